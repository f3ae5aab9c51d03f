#!/usr/bin/env python3
"""Per-kernel bandwidth on the Vulkan device, against the device's own copy bandwidth.

    python bench/bench_kernels.py                    # every weight type, ~24 MiB of weights each
    python bench/bench_kernels.py --types Q4_K,Q8_0 --mib 64 --device 0

For each kernel and weight type: bytes of weights (or KV cache) the kernel must read, divided
by its time on the device, and that rate as a fraction of the device's measured copy
bandwidth, both as a copy shader and as vkCmdCopyBuffer over the same bytes (a copy reads and
writes, so its bandwidth counts both; on lavapipe vkCmdCopyBuffer is a plain memcpy). Times are
medians over several submissions of a recorded sequence of `--reps` dispatches, so host
overhead is amortised. Shared machines are noisy: read the ratios, not the absolute numbers.
Never run by the tests.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from onebit.backends.vulkan import reference as ref  # noqa: E402
from onebit.backends.vulkan.device import open_device  # noqa: E402
from onebit.backends.vulkan.kernels import SUPPORTED_TYPES, QTYPES_BY_NAME, Kernels, WeightStore  # noqa: E402


def timed(dev, record, reps: int, runs: int) -> float:
    """Median seconds per dispatch-group `record` adds, over `runs` submissions of `reps` copies."""
    seq = dev.sequence()
    for _ in range(reps):
        record(seq)
    seq.run()  # record, compile, warm up
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        seq.run()
        times.append(time.perf_counter() - t0)
    seq.close()
    return statistics.median(times) / reps


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--types", default=",".join(SUPPORTED_TYPES))
    ap.add_argument("--mib", type=float, default=24.0, help="weight bytes per matrix (MiB)")
    ap.add_argument("--n-in", type=int, default=4096, help="row length of every matrix")
    ap.add_argument("--reps", type=int, default=8, help="dispatches per submission")
    ap.add_argument("--runs", type=int, default=5, help="submissions per measurement (median)")
    ap.add_argument("--prefill-rows", type=int, default=32)
    ap.add_argument("--device", default=None, help="index or part of the name (default: $ONEBIT_VULKAN_DEVICE / auto)")
    args = ap.parse_args()

    dev = open_device(args.device)
    k = Kernels(dev)
    rng = np.random.default_rng(0)
    print(f"device: {dev.info.name} ({dev.info.type}); mat-vec: reduce {k.reduce}, workgroup {k.mv_wg}, up to "
          f"{k.mv_rows} rows per {'thread' if k.reduce == 'none' else 'workgroup'}")

    # -- the yardsticks: copy bandwidth (bytes read + bytes written per second) -------------
    size = int(args.mib * 2**20) // 16 * 16
    src, dst = dev.buffer(size), dev.buffer(size)
    src.write(rng.integers(0, 255, size, dtype=np.uint8))
    shader_bw = 2 * size / timed(dev, lambda s: k.copy(s, src.slice(0, size), dst.slice(0, size)), args.reps, args.runs)
    cmd_bw = 2 * size / timed(dev, lambda s: s.copy(src.slice(0, size), dst.slice(0, size)), args.reps, args.runs)
    print(f"copy bandwidth over {size / 2**20:.0f} MiB, read + write: copy shader {shader_bw / 1e9:.2f} GB/s, "
          f"vkCmdCopyBuffer {cmd_bw / 1e9:.2f} GB/s")
    src.destroy()
    dst.destroy()

    rows = []

    def add(kernel, type_name, nbytes, t, note=""):
        rows.append((kernel, type_name, nbytes, t, nbytes / t, note))

    n_in = args.n_in
    R = args.prefill_rows
    for type_name in args.types.split(","):
        cls = QTYPES_BY_NAME[type_name]
        row_bytes = n_in // cls.block_size * cls.type_size
        n_out = max(64, int(args.mib * 2**20) // row_bytes // 64 * 64)
        n_exp, k_used = 16, 4
        e_rows = max(64, n_out // n_exp // 64 * 64)
        store = WeightStore(dev)
        store.add("w", ref.random_blocks(type_name, (n_out, n_in), rng), type_name, (n_out, n_in))
        store.add("e", ref.random_blocks(type_name, (n_exp, e_rows, n_in), rng), type_name, (n_exp, e_rows, n_in))
        w, we = store.commit()
        x = dev.upload(rng.standard_normal((R, n_in)).astype(np.float32))
        x1 = x.slice(0, n_in * 4)
        y = dev.buffer(R * max(n_out, n_in) * 4 * k_used)
        ids = dev.upload(rng.permutation(n_exp)[:k_used].astype(np.int32).reshape(1, k_used))
        wts = dev.upload(np.full((1, k_used), 1.0 / k_used, np.float32))
        gid = dev.upload(rng.integers(0, n_out, 16).astype(np.int32))
        w_bytes = n_out * row_bytes
        slow = max(1, args.reps // 4)

        t = timed(dev, lambda s: k.mul_mv(s, w, x1, y.slice(), 1, n_in, n_out), args.reps, args.runs)
        add("mul_mv", type_name, w_bytes, t, f"[{n_out}x{n_in}] @ 1 row")
        t = timed(dev, lambda s: k.mul_mv_id(s, we, x1, y.slice(), ids.slice(), wts.slice(), 1, k_used, n_in, 0,
                                             e_rows, mode="slots"), args.reps, args.runs)
        add("mul_mv_id", type_name, k_used * e_rows * row_bytes, t, f"{k_used} of {n_exp} experts [{e_rows}x{n_in}]")
        for kernel in ("mul_mv", "mul_mm"):
            mul = getattr(k, kernel)
            t = timed(dev, lambda s: mul(s, w, x.slice(), y.slice(), R, n_in, n_out), slow, args.runs)
            add(kernel, type_name, w_bytes, t, f"@ {R} rows: {2 * R * n_out * n_in / t / 1e9:.1f} GFLOP/s")
        t = timed(dev, lambda s: k.get_rows(s, w, gid.slice(), y.slice(), 16, n_in), args.reps, args.runs)
        add("get_rows", type_name, 16 * row_bytes, t, "16 rows")
        for b in (x, y, ids, wts, gid, *store.buffers):
            b.destroy()

    # attention over the KV cache (decode): bytes of K and V read
    H, Hkv, D, S = 32, 8, 128, 4096
    kc = dev.upload(rng.standard_normal((S, Hkv, D)).astype(np.float32))
    vc = dev.upload(rng.standard_normal((S, Hkv, D)).astype(np.float32))
    q = dev.upload(rng.standard_normal((1, H, D)).astype(np.float32))
    pos = dev.upload(np.array([S - 1], np.int32))
    o = dev.buffer(H * D * 4)
    t = timed(dev, lambda s: k.attention(s, q.slice(), kc.slice(), vc.slice(), pos.slice(), o.slice(), 1, H, Hkv, D,
                                         D, S), max(1, args.reps // 4), args.runs)
    add("attn", "F32 KV", 2 * S * Hkv * D * 4, t, f"decode, {S} positions, {H}/{Hkv} heads x {D}")

    print()
    print("GB/s: bytes of weights (or KV cache) the kernel reads / time; the ratios divide that by the copy "
          "shader's and by vkCmdCopyBuffer's bandwidth.")
    print()
    print(f"| {'kernel':<9} | {'type':<6} | {'MiB':>6} | {'time ms':>8} | {'GB/s':>6} | {'/shader':>7} | "
          f"{'/cmdcopy':>8} | note")
    print(f"|{'-' * 11}|{'-' * 8}|{'-' * 8}|{'-' * 10}|{'-' * 8}|{'-' * 9}|{'-' * 10}|------")
    for kernel, type_name, nbytes, t, bw, note in rows:
        print(f"| {kernel:<9} | {type_name:<6} | {nbytes / 2**20:6.2f} | {t * 1e3:8.3f} | {bw / 1e9:6.2f} | "
              f"{bw / shader_bw:7.3f} | {bw / cmd_bw:8.3f} | {note}")
    dev.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
