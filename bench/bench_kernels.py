#!/usr/bin/env python3
"""Per-kernel bandwidth on the Vulkan device, against the device's own copy bandwidth.

    python bench/bench_kernels.py                    # every weight type, ~24 MiB of weights each
    python bench/bench_kernels.py --types Q4_K,Q8_0 --mib 64 --device 0
    python bench/bench_kernels.py --kernels mul_mv,mul_mv_id --mib 8   # the decode kernels only
    python bench/bench_kernels.py --kernels mul_mv_xr --types Q4_K,Q8_0 --mib 2.25 --n-in 1024 \
        --prefill-rows 1,2,4,8,16      # R rows: mat-vec per row against XROWS, alternating
    python bench/bench_kernels.py --kernels mul_mm_id --types Q4_K --n-in 2048 --moe-ff 768 \
        --experts 128 --prefill-rows 16,64,512   # prefill experts: per slot against tiled

For each kernel and weight type: bytes of weights (or KV cache) the kernel must read, divided
by its time on the device, and that rate as a fraction of the device's copy bandwidth (a copy
reads and writes, so its bandwidth counts both). The copy shader is measured in the same run as
each kernel, alternating submissions (copy, kernel, copy, kernel, ...) and taking the median of
each, so a machine whose load changes between types still gives comparable ratios;
vkCmdCopyBuffer (on lavapipe a plain memcpy) is measured once at the start. Times are medians
over several submissions of a recorded sequence of `--reps` dispatches, so host overhead is
amortised. A summary then lists each type's mat-vec ratio against half of Q4_K's. Shared
machines are noisy: read the ratios, not the absolute numbers. Never run by the tests.
"""


from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from onebit.backends.vulkan import reference as ref  # noqa: E402
from onebit.backends.vulkan.device import open_device  # noqa: E402
from onebit.backends.vulkan.kernels import MV_ID_XR_WIDE, SUPPORTED_TYPES, QTYPES_BY_NAME, Kernels, WeightStore  # noqa: E402,E501


def _sequence(dev, record, reps: int):
    seq = dev.sequence()
    for _ in range(reps):
        record(seq)
    seq.run()  # record, compile, warm up
    return seq


def _seconds(seq) -> float:
    t0 = time.perf_counter()
    seq.run()
    return time.perf_counter() - t0


def timed(dev, record, reps: int, runs: int) -> float:
    """Median seconds per dispatch-group `record` adds, over `runs` submissions of `reps` copies."""
    seq = _sequence(dev, record, reps)
    times = [_seconds(seq) for _ in range(runs)]
    seq.close()
    return statistics.median(times) / reps


def timed_with_copy(dev, record, copy_seq, reps: int, runs: int) -> tuple[float, float]:
    """(median seconds per `record`, median seconds per copy-shader dispatch), the two measured
    alternately in one loop: copy_seq holds `copy_reps` copy dispatches (see main)."""
    seq = _sequence(dev, record, reps)
    t_kernel, t_copy = [], []
    for _ in range(runs):
        t_copy.append(_seconds(copy_seq[0]))
        t_kernel.append(_seconds(seq))
    seq.close()
    return statistics.median(t_kernel) / reps, statistics.median(t_copy) / copy_seq[1]


def _xrows_medians(dev, k, record, xrows_list, slow, runs) -> list[float]:
    """Median seconds of `record` with per-row products (mv_xrows 0) and each XROWS width, one
    submission of each in turn per run (alternating)."""
    return _alternating(dev, record, [0, *xrows_list], lambda v: setattr(k, "mv_xrows", v), slow, runs)


def _alternating(dev, record, settings, apply, slow, runs) -> list[float]:
    """Median seconds of `record` recorded under each setting (`apply(setting)` before recording),
    one submission of each in turn per run."""
    seqs = []
    for v in settings:
        apply(v)
        seqs.append(_sequence(dev, record, slow))
    times = [[] for _ in seqs]
    for _ in range(runs):
        for i, sq in enumerate(seqs):
            times[i].append(_seconds(sq) / slow)
    for sq in seqs:
        sq.close()
    return [statistics.median(t) for t in times]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--types", default=",".join(SUPPORTED_TYPES))
    ap.add_argument("--mib", type=float, default=24.0, help="weight bytes per matrix (MiB)")
    ap.add_argument("--n-in", type=int, default=4096, help="row length of every matrix")
    ap.add_argument("--reps", type=int, default=8, help="dispatches per submission")
    ap.add_argument("--runs", type=int, default=5, help="submissions per measurement (median)")
    ap.add_argument("--prefill-rows", default="32",
                    help="rows of x for mul_mv_rows / mul_mm; for mul_mv_xr a list, e.g. 1,2,4,8,16")
    ap.add_argument("--kernels", default="mul_mv,mul_mv_id,mul_mv_rows,mul_mm,get_rows,attn",
                    help="which kernels (mul_mv_rows: mul_mv at --prefill-rows rows; mul_mv_xr: mat-vec per row "
                         "against many rows per weight decode, alternating, at each of --prefill-rows; attn_rows: prefill "
                         "attention, the one-row kernel against attn.comp ROWS, at each of --prefill-rows; mul_mv_id_xr / "
                         "mul_mm_id: routed experts at each of --prefill-rows tokens, per slot against grouped on a CPU "
                         "device / the tiled expert mat-mat)")
    ap.add_argument("--xrows", default=None, help="mul_mv_xr: Kernels.mv_xrows values to compare, e.g. 4,8 "
                    "(default: the Kernels default)")
    ap.add_argument("--xr-nr", type=int, default=None, help="mul_mv_xr: weight rows per thread (Kernels.mv_xr_nr)")
    ap.add_argument("--experts", type=int, default=64, help="mul_mv_id_xr: experts (the 0.9B file's 64, top 8, 256)")
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--moe-ff", type=int, default=256)
    ap.add_argument("--id-min-slots", type=float, default=None,
                    help="mul_mv_id_xr: group the experts from this many slots per expert (Kernels.mv_id_xr_min_slots)")
    ap.add_argument("--xr-storage", action="store_true", help="mul_mv_xr: x from a storage buffer")
    ap.add_argument("--id-nr", type=int, default=None, help="mul_mv_id_xr: weight rows per thread "
                    "(Kernels.mv_id_xr_nr; twice that for kernels.MV_ID_XR_WIDE)")
    ap.add_argument("--id-xrows", type=int, default=None, help="mul_mv_id_xr: rows of x per decode at most "
                    "(Kernels.mv_id_xrows)")
    ap.add_argument("--unrolled", type=int, default=None,
                    help="thread-per-row mat-vec: copies of the dequantizer per block (Kernels.mv_unrolled), "
                         "which sets rows per thread")
    ap.add_argument("--device", default=os.environ.get("ONEBIT_VULKAN_DEVICE"),
                    help="index or part of the name (default: $ONEBIT_VULKAN_DEVICE / auto)")
    args = ap.parse_args()

    dev = open_device(args.device)
    k = Kernels(dev)
    if args.unrolled:
        k.mv_unrolled = args.unrolled
    rng = np.random.default_rng(0)
    print(f"device: {dev.info.name} ({dev.info.type}); mat-vec: reduce {k.reduce}, workgroup {k.mv_wg}, up to "
          f"{k.mv_rows} rows per {'thread' if k.reduce == 'none' else 'workgroup'}")

    # -- the yardsticks: copy bandwidth (bytes read + bytes written per second) -------------
    size = int(args.mib * 2**20) // 16 * 16
    src, dst = dev.buffer(size), dev.buffer(size)
    src.write(rng.integers(0, 255, size, dtype=np.uint8))
    copy_shader = lambda s: k.copy(s, src.slice(0, size), dst.slice(0, size))  # noqa: E731
    shader_bw = 2 * size / timed(dev, copy_shader, args.reps, args.runs)
    cmd_bw = 2 * size / timed(dev, lambda s: s.copy(src.slice(0, size), dst.slice(0, size)), args.reps, args.runs)
    def cls_bytes_per_weight(type_name):
        c = QTYPES_BY_NAME[type_name]
        return c.type_size / c.block_size

    print(f"copy bandwidth over {size / 2**20:.0f} MiB, read + write: copy shader {shader_bw / 1e9:.2f} GB/s, "
          f"vkCmdCopyBuffer {cmd_bw / 1e9:.2f} GB/s (at the start; each kernel below has its own copy-shader "
          "figure, measured alternately with it)")
    copy_reps = max(1, args.reps // 2)
    copy_seq = (_sequence(dev, copy_shader, copy_reps), copy_reps)
    kernels = set(args.kernels.split(","))

    rows = []

    def add(kernel, type_name, nbytes, record, reps, note=""):
        t, t_copy = timed_with_copy(dev, record, copy_seq, reps, args.runs)
        rows.append((kernel, type_name, nbytes, t, nbytes / t, 2 * size / t_copy, note))

    n_in = args.n_in
    R_list = [int(r) for r in args.prefill_rows.split(",")]
    R = max(R_list)
    xr_rows, mm_rows = [], []
    if args.xr_nr:
        k.mv_xr_nr = args.xr_nr
    if args.xr_storage:
        k.mv_xr_uniform = False
    if args.id_nr:
        k.mv_id_xr_nr = args.id_nr
    if args.id_xrows:
        k.mv_id_xrows = args.id_xrows
    if args.id_min_slots is not None:
        k.mv_id_xr_min_slots = args.id_min_slots
    xrows_list = [int(v) for v in args.xrows.split(",")] if args.xrows else [k.mv_xrows]
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

        if "mul_mv" in kernels:
            add("mul_mv", type_name, w_bytes, lambda s: k.mul_mv(s, w, x1, y.slice(), 1, n_in, n_out), args.reps,
                f"[{n_out}x{n_in}] @ 1 row")
        if "mul_mv_id" in kernels:
            add("mul_mv_id", type_name, k_used * e_rows * row_bytes,
                lambda s: k.mul_mv_id(s, we, x1, y.slice(), ids.slice(), wts.slice(), 1, k_used, n_in, 0, e_rows,
                                      mode="slots"), args.reps, f"{k_used} of {n_exp} experts [{e_rows}x{n_in}]")
        for kernel, name in (("mul_mv", "mul_mv_rows"), ("mul_mm", "mul_mm")):
            if name in kernels:
                mul = getattr(k, kernel)
                add(kernel, type_name, w_bytes, lambda s: mul(s, w, x.slice(), y.slice(), R, n_in, n_out), slow,
                    f"@ {R} rows")
        if "mul_mv_xr" in kernels:  # per-row mat-vec (mv_xrows 0) and XROWS, alternating submissions
            for r in R_list:
                xr_rows.append((type_name, n_out, r, _xrows_medians(
                    dev, k, lambda s: k.mul_mv(s, w, x.slice(), y.slice(), r, n_in, n_out), xrows_list, slow, args.runs)))
            k.mv_xrows = xrows_list[0]
        if "mul_mv_id_xr" in kernels or "mul_mm_id" in kernels:
            # routed experts at R tokens: per slot (mv_xrows 0) against grouped on the thread-per-row
            # kernel (CPU devices), or per slot against the tiled expert mat-mat (GPUs)
            E, kk, F = args.experts, args.top_k, args.moe_ff
            ge = WeightStore(dev)
            ge.add("g", ref.random_blocks(type_name, (E, F, n_in), rng), type_name, (E, F, n_in))
            ge.add("d", ref.random_blocks(type_name, (E, n_in, F), rng), type_name, (E, n_in, F))
            wg_, wd_ = ge.commit()
            for r in R_list:
                rid = dev.upload(np.stack([rng.permutation(E)[:kk] for _ in range(r)]).astype(np.int32))
                rwt = dev.upload(rng.random((r, kk)).astype(np.float32))
                xe = dev.upload(rng.standard_normal((r, n_in)).astype(np.float32))
                he = dev.upload(rng.standard_normal((r, kk, F)).astype(np.float32))
                ge_out, yd = dev.buffer(r * kk * F * 4), dev.buffer(r * n_in * 4)

                def rec(s, r=r, rid=rid, rwt=rwt, xe=xe, he=he, ge_out=ge_out, yd=yd):
                    k.mul_mv_id(s, wg_, xe.slice(), ge_out.slice(), rid.slice(), rwt.slice(), r, kk, n_in, 0, F)
                    k.mul_mv_id(s, wd_, he.slice(), yd.slice(), rid.slice(), rwt.slice(), r, kk, kk * F, F, n_in,
                                mode="sum")
                if "mul_mv_id_xr" in kernels:
                    xr_rows.append((type_name, f"{E}x{F} top {kk}", r,
                                    _xrows_medians(dev, k, rec, xrows_list, slow, args.runs)))
                if "mul_mm_id" in kernels:
                    keep = k.mv_xrows, k.mm_id_min_slots

                    def tiled(on, k=k):  # per slot: neither grouping; tiled: always
                        k.mv_xrows, k.mm_id_min_slots = (0, 0) if on else (0, math.inf)
                    ts = _alternating(dev, rec, [False, True], tiled, slow, args.runs)
                    k.mv_xrows, k.mm_id_min_slots = keep
                    # weight bytes each way: per slot, the expert's gate and down once per slot;
                    # tiled, once per 32 slots of each expert
                    counts = np.bincount(rid.read(np.int32, (r, kk)).reshape(-1), minlength=E)
                    e_bytes = 2 * F * n_in * cls.type_size // cls.block_size
                    mm_rows.append((type_name, f"{E}x{F} top {kk}", r, ts, r * kk * e_bytes,
                                    int(np.ceil(counts / 32).sum()) * e_bytes))
                for b in (rid, rwt, xe, he, ge_out, yd):
                    b.destroy()
            k.mv_xrows = xrows_list[0]
            for b in ge.buffers:
                b.destroy()
        if "get_rows" in kernels:
            add("get_rows", type_name, 16 * row_bytes, lambda s: k.get_rows(s, w, gid.slice(), y.slice(), 16, n_in),
                args.reps, "16 rows")
        for b in (x, y, ids, wts, gid, *store.buffers):
            b.destroy()

    if "attn" in kernels:  # attention over the KV cache (decode): bytes of K and V read
        H, Hkv, D, S = 32, 8, 128, 4096
        kc = dev.upload(rng.standard_normal((S, Hkv, D)).astype(np.float32))
        vc = dev.upload(rng.standard_normal((S, Hkv, D)).astype(np.float32))
        q = dev.upload(rng.standard_normal((1, H, D)).astype(np.float32))
        pos = dev.upload(np.array([S - 1], np.int32))
        o = dev.buffer(H * D * 4)
        add("attn", "F32 KV", 2 * S * Hkv * D * 4,
            lambda s: k.attention(s, q.slice(), kc.slice(), vc.slice(), pos.slice(), o.slice(), 1, H, Hkv, D, D, S),
            max(1, args.reps // 4), f"decode, {S} positions, {H}/{Hkv} heads x {D}")

    if "attn_rows" in kernels:  # prefill attention, causal over R rows: one-row kernel against attn.comp ROWS
        H, Hkv, D = 16, 4, 64  # the 0.9B file's heads
        print()
        print(f"attention over R causal rows ({H}/{Hkv} heads x {D}): ms, one-row kernel (attn_rows 0) against "
              f"the many-row kernel, submissions alternating, medians of {args.runs}")
        print()
        print("| R | one-row ms | rows ms | speedup |")
        print("|---:|---:|---:|---:|")
        for r in R_list:
            q = dev.upload(rng.standard_normal((r, H, D)).astype(np.float32))
            kc = dev.upload(rng.standard_normal((r, Hkv, D)).astype(np.float32))
            vc = dev.upload(rng.standard_normal((r, Hkv, D)).astype(np.float32))
            pos, o = dev.upload(np.arange(r, dtype=np.int32)), dev.buffer(r * H * D * 4)
            rows_min, seqs = k.attn_rows, []
            for setting in (0, rows_min):
                k.attn_rows = setting
                seqs.append(_sequence(dev, lambda s: k.attention(s, q.slice(), kc.slice(), vc.slice(), pos.slice(),
                                                                 o.slice(), r, H, Hkv, D, D, r), 1))
            k.attn_rows = rows_min
            ts = [[], []]
            for _ in range(args.runs):
                for i, sq in enumerate(seqs):
                    ts[i].append(_seconds(sq))
            a, b = (statistics.median(t) for t in ts)
            print(f"| {r} | {a * 1e3:.2f} | {b * 1e3:.2f} | {a / b:.2f}x |")
            for sq in seqs:
                sq.close()
            for buf in (q, kc, vc, pos, o):
                buf.destroy()

    if xr_rows:
        print()
        print(f"mul_mv / mul_mv_id_xr (an expert gate [F x {n_in}] in slots mode + down [{n_in} x F] in sum "
              f"mode) at R rows of x [out x {n_in}]: ms per product, mat-vec per row (xr 0) against many rows "
              f"per weight decode (xr = mv_xrows), submissions alternating, medians of {args.runs}; "
              f"nr {k.mv_xr_nr} (experts: {k.mv_id_xr_nr}, 2x for {sorted(MV_ID_XR_WIDE)}, at most {k.mv_id_xrows} rows), x from a {'storage' if args.xr_storage else 'uniform'} buffer where it fits")
        print()
        print("| type | out | R | " + " | ".join(f"xr {v} ms" for v in [0, *xrows_list]) + " | " +
              " | ".join(f"xr {v} speedup" for v in xrows_list) + " |")
        print("|---|---:|---:|" + "---:|" * (2 * len(xrows_list) + 1))
        for type_name, n_out, r, ts in xr_rows:
            print(f"| {type_name} | {n_out} | {r} | " + " | ".join(f"{t * 1e3:.2f}" for t in ts) + " | " +
                  " | ".join(f"{ts[0] / t:.2f}x" for t in ts[1:]) + " |")
    if mm_rows:
        print()
        print(f"routed experts (a gate [F x {n_in}] in slots mode + down [{n_in} x F] in sum mode) at R tokens: ms, "
              f"the per-slot mat-vec against the tiled expert mat-mat (mul_mm_id), submissions alternating, medians "
              f"of {args.runs}; MiB: weight bytes each must read (tiled: each expert once per 32 of its slots); "
              "GB/s: those bytes / time")
        print()
        print("| type | experts | R | per-slot ms | tiled ms | speedup | per-slot MiB | tiled MiB | per-slot GB/s | "
              "tiled GB/s |")
        print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        for type_name, shape, r, (a, b), ba, bb in mm_rows:
            print(f"| {type_name} | {shape} | {r} | {a * 1e3:.2f} | {b * 1e3:.2f} | {a / b:.2f}x | {ba / 2**20:.1f} | "
                  f"{bb / 2**20:.1f} | {ba / a / 1e9:.1f} | {bb / b / 1e9:.1f} |")
    if not rows:
        copy_seq[0].close()
        dev.close()
        return 0
    print()
    print("GB/s: bytes of weights (or KV cache) the kernel reads / time; copy GB/s: the copy shader measured "
          "alternately with that kernel; /copy divides the two; /cmdcopy divides by vkCmdCopyBuffer's bandwidth "
          "at the start.")
    print()
    print(f"| {'kernel':<9} | {'type':<7} | {'MiB':>6} | {'time ms':>8} | {'GB/s':>6} | {'copy GB/s':>9} | "
          f"{'/copy':>6} | {'/cmdcopy':>8} | note")
    print(f"|{'-' * 11}|{'-' * 9}|{'-' * 8}|{'-' * 10}|{'-' * 8}|{'-' * 11}|{'-' * 8}|{'-' * 10}|------")
    for kernel, type_name, nbytes, t, bw, copy_bw, note in rows:
        if kernel == "mul_mm" or note.startswith("@"):
            note = f"{note}: {2 * R * nbytes / cls_bytes_per_weight(type_name) / t / 1e9:.1f} GFLOP/s"
        print(f"| {kernel:<9} | {type_name:<7} | {nbytes / 2**20:6.2f} | {t * 1e3:8.3f} | {bw / 1e9:6.2f} | "
              f"{copy_bw / 1e9:9.2f} | {bw / copy_bw:6.3f} | {bw / cmd_bw:8.3f} | {note}")
    decode = {t: bw / c for kern, t, _, _, bw, c, note in rows if kern == "mul_mv" and not note.startswith("@")}
    if "Q4_K" in decode:
        bar = decode["Q4_K"] / 2
        print()
        print(f"mat-vec (1 row) ratio to the copy shader; half of Q4_K's is {bar:.3f}:")
        print()
        print("| type    | /copy | vs half Q4_K |")
        print("|---------|-------|--------------|")
        for t, r in sorted(decode.items(), key=lambda kv: -kv[1]):
            print(f"| {t:<7} | {r:5.3f} | {'ok' if r >= bar else 'BELOW':<12} |")
    copy_seq[0].close()
    src.destroy()
    dst.destroy()
    dev.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
