"""A second process that keeps what the first learned: start to first token and the first decode
tokens of a streamed model, with and without the expert use counts an earlier process kept
(memory/warm.py), each process fresh with the page cache dropped before it (root).

    python bench/bench_warm.py /work/big/q3-30b-trained.gguf --budget 8GiB [--rounds 3] [--tokens 32]

A round: one process teaches (an empty folder for the counts; it runs bench_scale's WARM text,
then decodes, and keeps what it used when it closes), then two measured processes alternate,
`kept` (reading the taught folder) and `none` (no folder), each on a different text from the
teacher's: the 12-token SHORT prompt timed from the process's start to its first token (import,
load, prompt), then PROSE as a prompt and N greedy decode tokens, their tok/s and the pool's
hit rate and reads. The measured processes never write the folder (their counts would teach
the next). Medians over rounds; `kept / none` beside each.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_scale import PROSE, SHORT, WARM, drop_page_cache  # noqa: E402


def run(cfg: dict) -> dict:
    """One process's measurement (in a child): JSON-able figures."""
    import onebit

    m = onebit.load(cfg["model"], backend="cpu", budget=cfg["budget"], slots=cfg.get("slots"), warm_dir=cfg["warm_dir"])
    pool = m.pool
    if pool is None:
        raise SystemExit("the model does not stream at this budget: nothing to keep")
    out = {"load_s": time.time() - cfg["started"], "warm_reads": pool.stats.warm_reads}
    ids = m.tokenize(SHORT)[:12]
    m.net.forward(np.array(ids), m.new_cache(), last_only=True)
    out["start_to_token_s"] = time.time() - cfg["started"]
    out["read_mib_to_token"] = pool.stats.bytes_read / 2**20
    text = WARM if cfg["teach"] else PROSE
    cache = m.new_cache()
    logits = m.net.forward(np.array(m.tokenize(text)[:128]), cache, last_only=True)
    tok = int(logits[-1].argmax())
    s = pool.stats
    before = (s.hits, s.prefetch_hits, s.demand_misses, s.bytes_read)
    t0 = time.perf_counter()
    for _ in range(cfg["tokens"]):
        tok = int(m.net.forward(np.array([tok]), cache, last_only=True)[-1].argmax())
    dt = time.perf_counter() - t0
    d = [b - a for a, b in zip(before, (s.hits, s.prefetch_hits, s.demand_misses, s.bytes_read))]
    out.update(decode_tps=cfg["tokens"] / dt, hit_rate=(d[0] + d[1]) / max(sum(d[:3]), 1),
               read_mib_per_token=d[3] / cfg["tokens"] / 2**20)
    if not cfg["teach"]:
        m.warm = None  # (a measured process keeps nothing: the next one must see the teacher's counts only)
    m.close()
    return out


def child(cfg: dict) -> dict:
    drop_page_cache()
    cfg = {**cfg, "started": time.time()}
    r = subprocess.run([sys.executable, __file__, "--child", json.dumps(cfg)], capture_output=True, text=True,
                       errors="replace", timeout=3600)
    if r.returncode:
        return {"error": (r.stderr.strip().splitlines() or ["?"])[-1]}
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?")
    ap.add_argument("--budget", default="8GiB")
    ap.add_argument("--slots", type=int, help="expert slots (instead of what the budget plans)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--child")
    a = ap.parse_args()
    if a.child:
        print(json.dumps(run(json.loads(a.child))))
        return
    if a.model is None:
        ap.error("the model file is needed")
    if os.geteuid() != 0:
        raise SystemExit("every process starts on a dropped page cache: run as root")
    base = {"model": a.model, "budget": a.budget, "slots": a.slots, "tokens": a.tokens}
    got: dict[str, list] = {"teach": [], "kept": [], "none": []}
    for r in range(a.rounds):
        with tempfile.TemporaryDirectory() as d:
            got["teach"].append(child({**base, "warm_dir": d, "teach": True}))
            order = ("kept", "none") if r % 2 == 0 else ("none", "kept")
            for name in order:
                got[name].append(child({**base, "warm_dir": d if name == "kept" else None, "teach": False}))
        for name in ("teach", *order):
            print(f"  round {r + 1} {name}: {got[name][-1]}", file=sys.stderr)
    keys = ("start_to_token_s", "read_mib_to_token", "warm_reads", "decode_tps", "hit_rate", "read_mib_per_token")
    med = {n: {k: statistics.median([x[k] for x in v if k in x]) if any(k in x for x in v) else float("nan")
               for k in keys} for n, v in got.items()}
    print(f"\n{a.model} at {a.budget}{f', {a.slots} slots' if a.slots else ''}, cpu, {a.rounds} rounds, {a.tokens} decode tokens (medians)")
    print(f"{'process':<8} " + " ".join(f"{k:>18}" for k in keys))
    for n in ("teach", "none", "kept"):
        print(f"{n:<8} " + " ".join(f"{med[n][k]:18.3f}" for k in keys))
    print(f"{'kept/none':<8} " + " ".join(f"{med['kept'][k] / med['none'][k] if med['none'][k] else float('nan'):18.3f}"
                                          for k in keys))


if __name__ == "__main__":
    main()
