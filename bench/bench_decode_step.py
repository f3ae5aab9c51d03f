#!/usr/bin/env python3
"""Time a decode forward of the model alone (no sampling, no CLI): the engine's step.

    python bench/bench_decode_step.py MODEL.gguf [--backend cpu] [--steps 32] [--profile]

Loads MODEL, runs a 64-token prompt, then `--steps` one-token forwards (after 5 warm-up
steps) and prints the mean step time; --profile adds a cProfile of another `--steps` steps
(the top 18 functions by own time). Run it alternately with another checkout's onebit
(`PYTHONPATH=OTHER python bench/bench_decode_step.py ...`) for a before/after. Never run by
the tests.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import numpy as np

import onebit


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    m = onebit.load(args.model, backend=args.backend)
    cache = m.new_cache()
    m.net.forward(np.arange(5, 69, dtype=np.int64), cache)
    token = np.array([7], np.int64)

    def run(n: int) -> None:
        for _ in range(n):
            m.net.forward(token, cache)

    run(5)
    t0 = time.perf_counter()
    run(args.steps)
    step = (time.perf_counter() - t0) / args.steps
    print(f"{onebit.__file__}: decode step {step * 1e3:.2f} ms ({1 / step:.1f} tok/s)")
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        run(args.steps)
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(18)


if __name__ == "__main__":
    main()
