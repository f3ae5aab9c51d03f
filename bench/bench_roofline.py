#!/usr/bin/env python3
"""Roofline of the cpu backend's products at real shapes: decode GB/s against the machine's
memory bandwidth, prompt GFLOP/s against its float32 matrix-product peak.

    python bench/bench_roofline.py [--runs 9] [--prompt 64] [--types Q4_K,Q6_K,...] [--shapes 30B,...] [--root DIR]

Shapes (weight rows N x row length K): the 30B-A3B shape's attention (q 4096 x 2048, k/v 512 x
2048, o 2048 x 4096) and its routed experts (8 of 128, gate/up 768 x 2048, down 2048 x 768, one
`expert_ffn` call as a decode token makes), its output matrix (151936 x 2048, and with one row
more: 16 rows to a group and one left, as an odd vocabulary's output head); the 0.86B file's
experts (8 of 64, 256 x 1024) and q (1024 x 1024); gpt-oss-20b's experts (4 of 32, 2880 x 2880);
Gemma 3 270M's output (262144 x 640, Q8_0 and Q6_K-less: 640 is not a multiple of 256). Each in
each --types type that fits the row length.

Decode: one activation row; GB/s = weight bytes the call reads / median time (experts: the k
chosen experts' bytes; each call routes anew, one of 16 routings in turn, so the experts of one
call are not the last call's, as a decode token's are not: on the 30B shape the same 8 experts
each call ran from the cache). Prompt: --prompt activation rows (experts: each row routed to 8 of the
experts at random, as a prompt chunk is); GFLOP/s = 2 x MACs / median time. Yardsticks measured
in the same run: memory bandwidth (numpy sums over two halves of a 1 GiB array on two threads,
best of 5) and the float32 peak (numpy's BLAS sgemm of 2048 x 2048 matrices, two threads, best
of 5). --root runs another checkout's kernels (the same call signatures) for a before/after
table. Never run by the tests.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np


def yardsticks() -> tuple[float, float]:
    from machine import memory_read_gbs

    bw = memory_read_gbs()
    m = np.random.default_rng(0).standard_normal((2048, 2048)).astype(np.float32)
    flops = 0.0
    for _ in range(5):
        t0 = time.perf_counter()
        m @ m
        flops = max(flops, 2 * 2048**3 / (time.perf_counter() - t0))
    return bw, flops / 1e9


SHAPES = [  # label, kind, N, K (experts: hidden, dim, n_experts)
    ("30B attn q", "dense", 4096, 2048),
    ("30B attn k/v", "dense", 512, 2048),
    ("30B attn o", "dense", 2048, 4096),
    ("30B experts 8/128", "experts", 768, 2048, 128),
    ("30B output", "dense", 151936, 2048),
    ("30B output + 1 row", "dense", 151937, 2048),  # (not a multiple of 16: the X16 layouts' last row as a row)
    ("0.86B attn q", "dense", 1024, 1024),
    ("0.86B experts 8/64", "experts", 256, 1024, 64),
    ("gpt-oss-20b experts 4/32", "experts", 2880, 2880, 32, 4),
    ("gpt-oss attn q", "dense", 4096, 2880),
    ("gpt-oss output", "dense", 201088, 2880),
    ("Gemma 270M output", "dense", 262144, 640),
    ("Gemma 270M gate/up", "dense", 2048, 640),
    ("Gemma 270M down", "dense", 640, 2048),
]


def median_time(fn, runs: int) -> float:
    fn()
    ts = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=9)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--types", default="Q4_K,Q4_K_X16,Q5_K,Q6_K,Q6_K_X16,Q8_0,Q8_0_X16,Q4_0,Q4_0_X16,Q5_0,"
                    "Q5_0_X16,MXFP4,MXFP4_X16,IQ4_XS,IQ4_XS_X16,Q2_K,Q2_K_X16,Q3_K,Q3_K_X16,F16,BF16", help="Q4_K_X16: Q4_K in the cpu backend's repacked layout "
                    "(AVX-512 VNNI; backends/cpu.py X16_TYPES)")
    ap.add_argument("--shapes", default="", help="comma-separated label prefixes (default: all)")
    ap.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[1])
    args = ap.parse_args()
    sys.path.insert(0, str(args.root))
    from onebit.backends.cpu import CpuBackend, int_dots, products, repack
    from onebit.backends.cpu import x16 as layouts
    from onebit.backends.vulkan.reference import random_blocks
    from onebit.formats import quants
    from onebit.formats.quants import QTYPES_BY_NAME

    bw, peak = yardsticks()
    import numba

    print(f"kernels: {args.root}; threads {numba.get_num_threads()}; memory {bw:.1f} GB/s (2 threads); "
          f"float32 peak (BLAS sgemm) {peak:.0f} GFLOP/s; prompt rows {args.prompt}")
    print()
    print("| shape | type | N x K | MiB | decode ms | GB/s | x memory | prompt ms | GFLOP/s | x peak |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|")
    rng = np.random.default_rng(0)
    wanted = [s for s in SHAPES if not args.shapes or any(s[0].startswith(p) for p in args.shapes.split(","))]
    for label, kind, N, Kin, *rest in wanted:
        for name in args.types.split(","):
            x16 = name.endswith("_X16")  # the cpu backend's repacked layouts
            if x16 and (not int_dots.VNNI or not hasattr(layouts, name)):
                continue
            qt = QTYPES_BY_NAME[name.removesuffix("_X16")]
            tid = getattr(layouts, name) if x16 else qt.type_id
            if Kin % qt.block_size or (kind == "experts" and N % qt.block_size):
                continue
            if kind == "dense":
                w = random_blocks(qt.name, (N, Kin), rng)
                w = repack.repack_x16(w, qt.type_id) if x16 else w
                w.flags.writeable = False
                nbytes, macs = w.nbytes, N * Kin

                def run(R, w=w, N=N, Kin=Kin, t=tid):
                    x = rng.standard_normal((R, Kin)).astype(np.float32)
                    out = np.empty((R, N), np.float32)
                    return lambda: products.matmul(out, x, w, t)
            else:
                E, k = rest[0], (rest[1:] or [8])[0]
                gate, up = (random_blocks(qt.name, (E, N, Kin), rng) for _ in range(2))
                down = random_blocks(qt.name, (E, Kin, N), rng)
                if x16:
                    gate, up, down = (repack.repack_x16(a, qt.type_id) for a in (gate, up, down))
                for a in (gate, up, down):
                    a.flags.writeable = False
                nbytes = k * (gate[0].nbytes + up[0].nbytes + down[0].nbytes)
                macs = k * 3 * N * Kin

                def run(R, gate=gate, up=up, down=down, E=E, Kin=Kin, t=tid, k=k):
                    x = (rng.standard_normal((R, Kin)) * 0.1).astype(np.float32)
                    routings = []
                    for _ in range(16):
                        ids = np.stack([rng.choice(E, k, replace=False) for _ in range(R)])
                        sel, offs, rows, rw = CpuBackend.routed_rows(ids, np.full((R, k), 1 / k, np.float32), E)
                        y = np.empty((rows.shape[0], Kin), np.float32)  # (each routed row's expert output)
                        js = np.arange(len(sel), dtype=np.int64)  # (every chosen expert in the one call)
                        routings.append((np.asarray(sel, np.int64), js, offs, rows, rw, y))
                    out, turn = np.zeros_like(x), iter(range(1 << 62))

                    def call():
                        sel, js, offs, rows, rw, y = routings[next(turn) % 16]
                        products.expert_ffn(out, y, x, gate, up, down, sel, js, offs, rows, rw, True, t, t, t)
                    return call
            td = median_time(run(1), args.runs)
            tp = median_time(run(args.prompt), max(3, args.runs // 3))
            gbs = nbytes / td / 1e9
            gf = 2 * macs * args.prompt / tp / 1e9
            print(f"| {label} | {name} | {N} x {Kin} | {nbytes / 2**20:.1f} | {td * 1e3:.2f} | {gbs:.1f} | "
                  f"{gbs / bw:.2f} | {tp * 1e3:.1f} | {gf:.1f} | {gf / peak:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
