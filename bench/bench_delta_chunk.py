"""Prompt speed of the Vulkan backend with the chunked delta rule (delta_chunk.comp) against the
one-step-per-row kernel (delta_rule.comp) on hybrid Gated-DeltaNet files, alternating in one run.

    python bench/bench_delta_chunk.py MODEL.gguf [MODEL2.gguf ...] [--prompt 256] [--runs 3]
    python bench/bench_delta_chunk.py --kernels [--runs 3]

Per file: a fresh cache, one prompt of --prompt random token ids in one forward, with
`Kernels.delta_chunk_min_rows` set to 0 (step kernel) and to 16 (chunked) in turn (ABAB...),
after one warm-up each (pipeline compilation); medians of prompt tok/s, and the largest
difference of the logits between the two. --kernels: the two kernels alone (VulkanOps, uploads
included) over random inputs at several head widths and row counts, and blocks of 8, 16, 32 rows.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np


def bench_model(path: str, n_prompt: int, runs: int) -> None:
    import onebit

    m = onebit.load(path, backend="vulkan")
    k = m.net.be.k
    ids = np.random.default_rng(0).integers(0, m.cfg.vocab_size, n_prompt).astype(np.int64)
    rates: dict[int, list[float]] = {0: [], 16: []}
    logits = {}
    for it in range(runs + 1):
        for min_rows in rates:
            k.delta_chunk_min_rows = min_rows
            t = time.perf_counter()
            logits[min_rows] = m.net.forward(ids, m.new_cache())
            dt = time.perf_counter() - t
            if it:
                rates[min_rows].append(n_prompt / dt)
    step, chunk = (statistics.median(rates[r]) for r in (0, 16))
    diff = float(np.abs(logits[0] - logits[16]).max())
    print(f"| {path.rsplit('/', 1)[-1]} | {n_prompt} | {step:.1f} | {chunk:.1f} | {chunk / step:.2f} | {diff:.2e} |",
          flush=True)


def bench_kernels(runs: int) -> None:
    from onebit.backends.vulkan.ops import VulkanOps

    ops = VulkanOps()
    rng = np.random.default_rng(0)
    print("| head width | Hk/Hv | rows | step ms | chunk 8 | chunk 16 | chunk 32 |\n|---:|---:|---:|---:|---:|---:|---:|")
    for D, Hk, Hv in [(16, 2, 4), (64, 4, 8), (128, 16, 32)]:
        for R in [16, 64, 256]:
            q, k = (rng.normal(size=(R, Hk, D)).astype(np.float32) for _ in range(2))
            v = rng.normal(size=(R, Hv, D)).astype(np.float32)
            g = -rng.uniform(0, 0.5, size=(R, Hv)).astype(np.float32)
            b = rng.uniform(0, 1, size=(R, Hv)).astype(np.float32)
            st = rng.normal(size=(Hv, D, D)).astype(np.float32)
            fs = [lambda: ops.delta_rule(q, k, v, g, b, st, 1e-6)]
            fs += [(lambda c=c: ops.delta_chunk(q, k, v, g, b, st, 1e-6, False, c)) for c in (8, 16, 32)]
            times: list[list[float]] = [[] for _ in fs]
            for f in fs:
                f()
            for _ in range(runs):  # alternating
                for i, f in enumerate(fs):
                    t = time.perf_counter()
                    f()
                    times[i].append(time.perf_counter() - t)
            ms = " | ".join(f"{statistics.median(t) * 1e3:.1f}" for t in times)
            print(f"| {D} | {Hk}/{Hv} | {R} | {ms} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="*")
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--kernels", action="store_true")
    a = ap.parse_args()
    if a.kernels:
        bench_kernels(a.runs)
    if a.models:
        print("| file | prompt | step tok/s | chunked tok/s | ratio | max logit diff |\n|---|---:|---:|---:|---:|---:|")
    for p in a.models:
        bench_model(p, a.prompt, a.runs)


if __name__ == "__main__":
    main()
