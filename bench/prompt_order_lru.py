#!/usr/bin/env python3
"""Where the pool's decode hit rate stands against LRU replays of the same routing, the prompt
replayed in the order cache-sim uses and in the order the engine runs it.

    python bench/prompt_order_lru.py MODEL.gguf [--budget 8GiB] [--prompt 175] [--tokens 32] [--keep 8,16] [--no-scan]

One fresh process (cpu backend, prediction off, no warm start: an empty record folder) runs a
prompt of --prompt tokens of English prose, then --tokens greedy decode steps, with a routing
trace; the pool's decode hit rate is printed beside replays of that trace through one LRU order
over every layer with the pool's slot count, decode tokens counted:

- cache-sim's global LRU (`onebit cache-sim`, tools/routing_stats.py): every token through all
  layers in turn, the prompt's too ("token-major");
- the same LRU over the prompt as a batched forward meets it: layer by layer, each layer's rows
  in order ("layer-major", the trace's own order);
- layer-major, and at each prompt layer the experts of its last K rows kept (touched last), the
  others made the least recently used: what the pool does for a prompt chunk (KEEP_ROWS);
- Belady's optimum (global, token-major).

Never run by the tests.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))


def records(path: str) -> list[tuple[str, int, list]]:
    """(phase, layer, rows) of each trace record, in the trace's order."""
    out = []
    with open(path) as f:
        f.readline()
        for line in f:
            if line.strip():
                r = json.loads(line)
                out.append((r["phase"], r["layer"], r["experts"]))
    return out


def layer_major_lru(recs, slots: int, keep: int = 0) -> float:
    """Decode hit rate of one LRU order over (layer, expert) keys (cache-sim's LRU), records
    replayed in order; a prompt layer's rows row by row (keep 0), or its experts touched
    together with those of its last `keep` rows left most recently used and the others moved
    to the front."""
    from onebit.moe.cachesim import LRU

    lru = LRU(slots)
    hits = looks = 0
    for phase, layer, rows in recs:
        if phase == "prompt" and keep:
            keys = list(dict.fromkeys((layer, e) for row in rows for e in row))
            pinned = set()
            for key in keys:
                lru.access(key, pinned, 0)
                pinned.add(key)
            last = {(layer, e) for row in rows[-keep:] for e in row}
            for key in keys:
                if key not in last and key in lru.d:
                    lru.d.move_to_end(key, last=False)
            continue
        for row in rows:
            pinned = {(layer, e) for e in row}
            for e in row:
                hit = lru.access((layer, e), pinned, 0)
                if phase == "decode":
                    looks += 1
                    hits += hit
    return hits / looks if looks else 0.0


def child(model: str, budget: str, prompt: int, tokens: int, trace: str, no_scan: bool) -> dict:
    from bench_predict_default import PROMPT

    import onebit
    from onebit.memory import pool as pool_mod
    from onebit.moe.trace import TraceWriter

    if no_scan:  # (no acquire is a scan: every prompt chunk through the one LRU order)
        pool_mod.PROMPT_SHARE = 2.0

    m = onebit.load(model, backend="cpu", budget=budget, predict="off")
    try:
        m.hook = TraceWriter(trace, m.path, m.cfg.n_layers, m.cfg.n_experts, m.cfg.n_experts_used)
        ids = m.tokenize(PROMPT * (1 + prompt // 40))[:prompt]
        cache = m.new_cache()
        logits = m.net.forward(np.array(ids), cache, hook=m.hook, last_only=True)
        tok = int(logits[-1].argmax())
        m.hook.phase = "decode"
        s = m.pool.stats
        before = (s.hits, s.prefetch_hits, s.demand_misses)
        for _ in range(tokens):
            logits = m.net.forward(np.array([tok]), cache, hook=m.hook, last_only=True)
            tok = int(logits[-1].argmax())
        m.hook.close()
        m.hook = None
        d = [a - b for a, b in zip((s.hits, s.prefetch_hits, s.demand_misses), before)]
        return {"pool": (d[0] + d[1]) / sum(d), "slots": m.pool.n_slots, "prompt_tokens": len(ids)}
    finally:
        m.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--budget", default="8GiB")
    ap.add_argument("--prompt", type=int, default=175)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--keep", default="8,16", help="rows kept in the layer-major replays (comma list)")
    ap.add_argument("--no-scan", action="store_true", help="the pool with no scans (prompt chunks under plain LRU)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        sys.path.insert(0, str(HERE))
        print(json.dumps(child(args.model, args.budget, args.prompt, args.tokens, args.child, args.no_scan)))
        return
    import subprocess

    from onebit.moe.cachesim import load_trace, simulate

    with tempfile.TemporaryDirectory() as tmp:
        trace = os.path.join(tmp, "trace.jsonl")
        env = {**os.environ, "ONEBIT_CACHE_DIR": os.path.join(tmp, "records")}  # (no warm start)
        r = subprocess.run([sys.executable, __file__, args.model, "--budget", args.budget, "--prompt", str(args.prompt),
                            "--tokens", str(args.tokens), "--child", trace] + ["--no-scan"] * args.no_scan,
                           capture_output=True, text=True, env=env)
        if r.returncode:
            raise SystemExit(r.stderr[-2000:])
        got = json.loads(r.stdout.strip().splitlines()[-1])
        n = got["slots"]
        t = load_trace(trace)
        recs = records(trace)
        rows = [("the pool (onebit, prediction off" + (", no scans)" if args.no_scan else ")"), got["pool"]),
                ("LRU, token-major prompt (cache-sim global-lru)", simulate(t, "global-lru", n).hit_rate),
                ("LRU, layer-major prompt", layer_major_lru(recs, n))]
        rows += [(f"LRU, layer-major prompt, last {k} rows kept", layer_major_lru(recs, n, int(k)))
                 for k in args.keep.split(",") if k]
        rows.append(("Belady (global, token-major)", simulate(t, "belady", n).hit_rate))
    print(f"{Path(args.model).name}: {got['prompt_tokens']}-token prompt, {args.tokens} decode tokens, "
          f"{n} slots (--budget {args.budget}); decode hit rates")
    for name, v in rows:
        print(f"  {name:<50} {100 * v:5.1f}%")


if __name__ == "__main__":
    main()
