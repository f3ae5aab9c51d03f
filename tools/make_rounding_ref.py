#!/usr/bin/env python3
"""Record llama.cpp CPU's activation rounding and dot products, for tests/test_llamacpp_numerics.py.

    python tools/make_rounding_ref.py --llama-cpp /work/deps [--out tests/fixtures/llamacpp-rounding.npz]

llama.cpp's CPU matmul quantizes each activation row to the weight type's `vec_dot_type`
(Q8_0, Q8_1 or Q8_K; F16 and BF16 weights: that type) with the CPU backend's own `from_float` (on x86 the AVX code, not the
reference C) and dots it with the weight row by `vec_dot`. This calls those functions in the
built libggml-cpu.so through ctypes (ggml_get_type_traits_cpu) on a few activation rows
(random, plus rows made to hit rounding ties and a negative largest value), and stores: the
rows, their Q8_0, Q8_K, F16 and BF16 roundings dequantized (by ggml's to_float but Q8_K's), and for a set of
weight types a weight row quantized by ggml's reference quantizer (raw bytes) with
llama.cpp's dot of it against every activation row; and ggml_gelu (the CPU backend's f16
table, GGML_GELU_FP16) over a range of inputs.
"""

from __future__ import annotations

import argparse
import ctypes
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

# ggml type ids (ggml.h); the weight types whose reference quantizer needs no codebook setup
GGML = {"F16": 1, "BF16": 30, "Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q8_1": 9, "Q2_K": 10, "Q3_K": 11, "Q4_K": 12,
        "Q5_K": 13, "Q6_K": 14, "Q8_K": 15, "IQ4_NL": 20, "IQ4_XS": 23, "TQ1_0": 34, "TQ2_0": 35, "MXFP4": 39}
WEIGHTS = ["F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS",
           "TQ1_0", "TQ2_0", "MXFP4"]
N = 256  # one Q8_K block, eight Q8_0 blocks


class TraitsCpu(ctypes.Structure):
    _fields_ = [("from_float", ctypes.c_void_p), ("vec_dot", ctypes.c_void_p), ("vec_dot_type", ctypes.c_int),
                ("nrows", ctypes.c_int64)]


class Traits(ctypes.Structure):
    _fields_ = [("type_name", ctypes.c_char_p), ("blck_size", ctypes.c_int64), ("blck_size_interleave", ctypes.c_int64),
                ("type_size", ctypes.c_size_t), ("is_quantized", ctypes.c_bool), ("to_float", ctypes.c_void_p),
                ("from_float_ref", ctypes.c_void_p)]


CONVERT = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)  # (src, dst, k)
VEC_DOT = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.POINTER(ctypes.c_float), ctypes.c_size_t, ctypes.c_void_p,
                           ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)


def activation_rows(rng: np.random.Generator) -> np.ndarray:
    rows = [rng.standard_normal(N), rng.standard_normal(N) * 1e-3, rng.standard_normal(N) ** 3]
    r = rng.standard_normal(N)
    r[17] = -5.0  # largest |x| negative (Q8_K takes its sign)
    rows.append(r)
    r = rng.integers(-254, 255, N) / 2.0  # k + 1/2 steps of amax/127: ties under round-half-even vs away
    r[::32] = 127.0
    rows.append(r)
    r = rng.standard_normal(N)
    r[:32] = 0.0  # an all-zero Q8_0 block
    rows.append(r)
    rows += [rng.standard_normal(N) * s for s in (0.1, 3.0)]
    return np.array(rows, np.float32)


class InitParams(ctypes.Structure):
    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p), ("no_alloc", ctypes.c_bool)]


def ggml_gelu(base, cpu) -> tuple[np.ndarray, np.ndarray]:
    """ggml_gelu over inputs spanning its f16 table and both cut-offs (+-10), in a one-op graph
    computed by the CPU backend (ggml_graph_compute_with_ctx)."""
    x = np.concatenate([np.linspace(-12, 12, 4001), np.random.default_rng(3).standard_normal(2000) * 3,
                        [-10.0, 10.0, -9.999, 9.999, 0.0, 1e-6, -1e-6]]).astype(np.float32)
    base.ggml_init.restype = ctypes.c_void_p
    base.ggml_init.argtypes = [InitParams]
    base.ggml_new_tensor_1d.restype = ctypes.c_void_p
    base.ggml_new_tensor_1d.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int64]
    base.ggml_gelu.restype = ctypes.c_void_p
    base.ggml_gelu.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    base.ggml_get_data.restype = ctypes.c_void_p
    base.ggml_get_data.argtypes = [ctypes.c_void_p]
    base.ggml_new_graph.restype = ctypes.c_void_p
    base.ggml_new_graph.argtypes = [ctypes.c_void_p]
    base.ggml_build_forward_expand.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    base.ggml_free.argtypes = [ctypes.c_void_p]
    cpu.ggml_graph_compute_with_ctx.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    ctx = base.ggml_init(InitParams(64 << 20, None, False))
    a = base.ggml_new_tensor_1d(ctx, 0, len(x))  # GGML_TYPE_F32
    ctypes.memmove(base.ggml_get_data(a), x.ctypes.data, x.nbytes)
    b = base.ggml_gelu(ctx, a)
    gf = base.ggml_new_graph(ctx)
    base.ggml_build_forward_expand(gf, b)
    cpu.ggml_graph_compute_with_ctx(ctx, gf, 1)
    y = np.empty_like(x)
    ctypes.memmove(y.ctypes.data, base.ggml_get_data(b), y.nbytes)
    base.ggml_free(ctx)
    return x, y


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-cpp", type=Path, default=Path("/work/deps"))
    ap.add_argument("--out", type=Path, default=ROOT / "tests" / "fixtures" / "llamacpp-rounding.npz")
    args = ap.parse_args()
    import make_fixtures as mf

    lc = mf.find_llama_cpp(args.llama_cpp)
    base = ctypes.CDLL(str(lc.lib_dir / "libggml-base.so"))
    cpu = ctypes.CDLL(str(lc.lib_dir / "libggml-cpu.so"))
    cpu.ggml_cpu_init()
    cpu.ggml_get_type_traits_cpu.restype = ctypes.POINTER(TraitsCpu)
    base.ggml_get_type_traits.restype = ctypes.POINTER(Traits)

    def traits(t):
        return base.ggml_get_type_traits(GGML[t]).contents

    def cpu_traits(t):
        return cpu.ggml_get_type_traits_cpu(GGML[t]).contents

    x = activation_rows(np.random.default_rng(7))
    out = {"x": x}
    for act in ("Q8_0", "Q8_K", "F16", "BF16"):
        tr, ct = traits(act), cpu_traits(act)
        rounded = np.zeros_like(x)
        for i, row in enumerate(x):
            buf = ctypes.create_string_buffer(N // tr.blck_size * tr.type_size)
            CONVERT(ct.from_float)(row.ctypes.data, ctypes.addressof(buf), N)
            if tr.to_float:
                CONVERT(tr.to_float)(ctypes.addressof(buf), rounded[i].ctypes.data, N)
            else:  # ggml has no to_float for Q8_K: block_q8_K is {float d; int8 qs[256]; int16 bsums[16]}
                raw = np.frombuffer(buf.raw, np.uint8)
                rounded[i] = raw[:4].view(np.float32)[0] * raw[4 : 4 + N].view(np.int8)
        out[f"rounded_{act}"] = rounded
    rng = np.random.default_rng(11)
    for w in WEIGHTS:
        tr, ct = traits(w), cpu_traits(w)
        wrow = (rng.standard_normal(N) * 0.1).astype(np.float32)
        wq = ctypes.create_string_buffer(N // tr.blck_size * tr.type_size)
        CONVERT(tr.from_float_ref)(wrow.ctypes.data, ctypes.addressof(wq), N)
        act = ct.vec_dot_type
        at = base.ggml_get_type_traits(act).contents
        act_cpu = cpu.ggml_get_type_traits_cpu(act).contents
        dots = np.zeros(len(x), np.float32)
        for i, row in enumerate(x):
            xq = ctypes.create_string_buffer(N // at.blck_size * at.type_size)
            CONVERT(act_cpu.from_float)(row.ctypes.data, ctypes.addressof(xq), N)
            s = ctypes.c_float()
            VEC_DOT(ct.vec_dot)(N, ctypes.byref(s), 0, ctypes.addressof(wq), 0, ctypes.addressof(xq), 0, 1)
            dots[i] = s.value
        out[f"w_{w}"] = np.frombuffer(wq.raw, np.uint8).copy()
        out[f"dot_{w}"] = dots
        out[f"vec_dot_type_{w}"] = np.array(at.type_name.decode())
    out["gelu_x"], out["gelu"] = ggml_gelu(base, cpu)
    np.savez_compressed(args.out, **out)
    print(f"{args.out}: {len(x)} rows, {len(WEIGHTS)} weight types")
    return 0


if __name__ == "__main__":
    sys.exit(main())
