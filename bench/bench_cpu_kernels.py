#!/usr/bin/env python3
"""Mat-vec bandwidth of the cpu backend's kernels for every weight type.

    python bench/bench_cpu_kernels.py [--mib 16] [--rows 1] [--runs 9]

For each type: `products.matmul` (onebit/backends/cpu) (the parallel mat-vec / mat-mat) of random blocks, about
--mib MiB of weights in rows of 4096, with --rows activation rows; weight bytes / median time,
and that as a fraction of a plain numpy sum over a float32 array of the same bytes measured
alternately with it (a read-bandwidth yardstick under the same load). Never run by the tests.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from onebit.backends.cpu import base, kernel_sets, products  # noqa: E402
from onebit.backends.vulkan.reference import random_blocks  # noqa: E402
from onebit.formats.quants import QTYPES, QTYPES_BY_NAME  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=float, default=16.0)
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--runs", type=int, default=9)
    ap.add_argument("--types", default=",".join(sorted(QTYPES[t].name for t in base.SUPPORTED)))
    args = ap.parse_args()
    kernel_sets.warm_up()
    rng = np.random.default_rng(0)
    n_in = 4096
    print(f"threads: {__import__('numba').get_num_threads()}; "
          f"{args.rows} activation row(s); rows of {n_in} weights")
    print()
    print("| type | MiB | time ms | GB/s | numpy sum GB/s | ratio |")
    print("|---|---:|---:|---:|---:|---:|")
    for name in args.types.split(","):
        cls = QTYPES_BY_NAME[name]
        row_bytes = cls.row_bytes(n_in)
        n_out = max(16, int(args.mib * 2**20) // row_bytes)
        w = random_blocks(name, (n_out, n_in), rng)
        w.flags.writeable = False
        x = rng.standard_normal((args.rows, n_in)).astype(np.float32)
        out = np.empty((args.rows, n_out), np.float32)
        yard = np.ones(w.nbytes // 4, np.float32)
        products.matmul(out, x, w, cls.type_id)
        tk, ty = [], []
        for _ in range(args.runs):
            t0 = time.perf_counter()
            yard.sum()
            ty.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            products.matmul(out, x, w, cls.type_id)
            tk.append(time.perf_counter() - t0)
        t, t_y = statistics.median(tk), statistics.median(ty)
        print(f"| {name} | {w.nbytes / 2**20:.1f} | {t * 1e3:.2f} | {w.nbytes / t / 1e9:.2f} | "
              f"{w.nbytes / t_y / 1e9:.2f} | {t_y / t:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
