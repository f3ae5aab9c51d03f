#!/usr/bin/env python3
"""A chat's turns in one process with experts streaming: each turn's prompt appended to the
conversation, then greedy decode; per turn the prompt's tok/s, the decode tok/s, the demand
misses and the MiB read a decode token. What the pool holds when a prompt ends decides the
first tokens' misses.

    python bench/stream_turns.py MODEL.gguf [--budget 8GiB] [--predict auto] [--tokens 32]
        [--tree OTHER_CHECKOUT ...] [--rounds 3]

Each run is a fresh process (cpu backend, no warm start, so every run starts from empty
slots); the checkouts (`--tree`, this one first) take turns within a round, medians over
rounds. Turn 1 is bench_predict_default's paragraph, turn 2 a question on another subject.
Never run by the tests.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
TURN_2 = ("Now tell me about the steam engine instead. Who built the first practical one, what problem did it "
          "solve in the mines of England, and how did James Watt's separate condenser change its efficiency? "
          "Describe how railways and factories spread across Europe in the decades that followed, and what "
          "it meant for the people who moved from farms into the growing industrial cities.")


def child(model: str, budget: str, predict: str, tokens: int) -> dict:
    import numpy as np

    sys.path.insert(0, str(HERE))
    from bench_predict_default import PROMPT

    import onebit

    m = onebit.load(model, backend="cpu", budget=budget, predict=predict, warm_start=False)
    if m.pool is None:
        raise SystemExit("stream_turns: the experts do not stream at this budget")
    pool, cache, out = m.pool, m.new_cache(), []
    for text in (PROMPT, TURN_2):
        ids = m.tokenizer.encode(text)
        t0 = time.perf_counter()
        logits = m.net.forward(np.array(ids), cache, last_only=True)
        prompt_s = time.perf_counter() - t0
        tok = int(logits[-1].argmax())
        misses, read, t0 = pool.stats.demand_misses, pool.stats.bytes_read, time.perf_counter()
        for _ in range(tokens):
            tok = int(m.net.forward(np.array([tok]), cache, last_only=True)[-1].argmax())
        dt = time.perf_counter() - t0
        out.append({"prompt_tok_s": len(ids) / prompt_s, "tok_s": tokens / dt,
                    "misses": (pool.stats.demand_misses - misses) / tokens,
                    "mib": (pool.stats.bytes_read - read) / tokens / 2**20})
    m.close()
    return {"turns": out, "onebit": onebit.__file__}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--budget", default="8GiB")
    ap.add_argument("--predict", default="auto")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--tree", action="append", default=[], help="another checkout to alternate with")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.model, a.budget, a.predict, a.tokens)))
        return 0
    trees = [None, *a.tree]
    got: dict[int, list] = {i: [] for i in range(len(trees))}
    for r in range(a.rounds):
        for i in (range(len(trees)) if r % 2 == 0 else reversed(range(len(trees)))):
            env = dict(os.environ)
            if trees[i]:
                env["PYTHONPATH"] = trees[i]
            cmd = [sys.executable, __file__, a.model, "--budget", a.budget, "--predict", a.predict,
                   "--tokens", str(a.tokens), "--child"]
            p = subprocess.run(cmd, capture_output=True, text=True, errors="replace", env=env)
            if p.returncode:
                raise SystemExit(f"{' '.join(cmd)} failed:\n{p.stderr[-2000:]}")
            res = json.loads(p.stdout.strip().splitlines()[-1])
            got[i].append(res["turns"])
            print(f"  round {r + 1} {trees[i] or 'this checkout'} ({res['onebit']}): " + "; ".join(
                f"turn {t + 1} prompt {x['prompt_tok_s']:.2f} tok/s, decode {x['tok_s']:.2f} tok/s, "
                f"{x['misses']:.1f} misses, {x['mib']:.0f} MiB a token"
                for t, x in enumerate(res["turns"])), file=sys.stderr, flush=True)
    print(f"{Path(a.model).name} --budget {a.budget} --predict {a.predict}; {a.tokens} tokens a turn; "
          f"medians of {a.rounds} rounds")
    print(f"{'checkout':<28} {'turn':>4} {'prompt':>7} {'tok/s':>7} {'misses/tok':>11} {'MiB/tok':>8}")
    for i, tree in enumerate(trees):
        for t in range(2):
            med = {k: statistics.median(run[t][k] for run in got[i]) for k in ("prompt_tok_s", "tok_s", "misses", "mib")}
            print(f"{tree or 'this checkout':<28} {t + 1:>4} {med['prompt_tok_s']:7.2f} {med['tok_s']:7.2f} "
                  f"{med['misses']:11.1f} {med['mib']:8.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
