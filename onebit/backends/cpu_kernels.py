"""numba kernels of the cpu backend: they read quantized blocks straight from the file map.

Products (`matmul`, `matmul3`, `expert_ffn`) run each weight type's own row loop (`ROWS`), which
dots each weight row with up to eight activation rows at once (a prompt's rows meet a tile of
weight rows at a time) through DOT1 / .. / DOT8 or IDOT1 / .. / IDOT8: LLVM vector IR (numba intrinsics, below)
that decodes a block 32 weights at a time in registers and multiplies them into one 32-wide
accumulator per activation row. No float32 copy of a weight matrix is ever made and a row's
bytes are read once per eight activation rows. Activations are float32, or int16 per block of
32 for INT_TYPES (below), never 8-bit: results differ from the numpy twins
(`quants.QTYPES[..].dequantize` then matmul) by float32 rounding of the decode, the summation
order and, for INT_TYPES, the activations' 1/32767 rounding. Every type of onebit.quants
has its decoder here; the codebook (IQ) types read their grids from int8 tables in the
kernel's module. `decode_row` (plain numba, and the IR decoders for MORE_TYPES) serves get_rows.

Threads split output rows, or whole experts (`prange`); each output element is written by one
thread in a fixed order, so results do not depend on the thread count or on where the bytes
live (file map or a streaming pool's slot). A decode token runs about 3 parallel regions per
layer (q/k/v, attention output, experts); smaller products and the small ops run serially.
Compiled once per machine and cached on disk (cache=True). A backend takes `kernels_for(file)`:
the products compiled for the file's quant types only (`Kernels`; the all-types kernels below
when only they are cached), whose `warm_up` loads every signature a forward uses when the
backend opens. Every kernel releases the interpreter lock while it runs (nogil): an expert
pool's reader threads issue their next reads while a kernel computes (held, the drive sat idle
for the length of each kernel call).
"""

from __future__ import annotations

import os
import types as pytypes

import numpy as np


def _others_running() -> float:
    """Tasks other than this process that want a core now: Linux's count of runnable tasks
    (/proc/loadavg) less this one, the mean of 5 looks 2 ms apart; elsewhere the 1-minute load
    average (which also counts what this program ran a minute ago)."""
    import time

    try:
        seen = []
        for i in range(5):
            with open("/proc/loadavg") as f:
                seen.append(int(f.read().split()[3].split("/")[0]) - 1)
            if i < 4:
                time.sleep(0.002)
        return sum(seen) / len(seen)
    except (OSError, ValueError, IndexError):
        return os.getloadavg()[0]


def _wait_policy() -> None:
    """How numba's OpenMP workers wait between parallel regions (a decode token runs about three
    a layer), unless the user set OMP_WAIT_POLICY. On an idle machine they spin a little
    (GOMP_SPINCOUNT 10000, well under a millisecond) before sleeping: waking a sleeping worker
    costs each region tens of microseconds (Gemma 3 270M decode on the 2-core VM: 17.7 ms a token
    spinning, 23.9 sleeping at once). When other work wants at least half the cores they sleep
    at once: spinning workers starve the thread that has the work (same file with one busy
    process beside it: 32.4 ms sleeping, 65.2 spinning; earlier, 1.0 vs 8.4 tok/s decode on 2
    cores under load 6)."""
    if "OMP_WAIT_POLICY" in os.environ:
        return
    try:
        busy = _others_running() >= 0.5 * (os.cpu_count() or 1)
    except OSError:  # no way to tell: the safe choice
        busy = True
    if busy:
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    else:
        os.environ["OMP_WAIT_POLICY"] = "ACTIVE"
        os.environ.setdefault("GOMP_SPINCOUNT", "10000")


_wait_policy()

from llvmlite import ir  # noqa: E402
from numba import njit, prange, types  # noqa: E402
from numba.core import cgutils  # noqa: E402
from numba.extending import intrinsic  # noqa: E402
from numba.np.arrayobj import populate_array  # noqa: E402

from functools import cache  # noqa: E402

from ..quants import IQ1_DELTA, QTYPES_BY_NAME, iq4_values, iq_grid, type_name, x16_bytes  # noqa: E402
from ..quants import X16_BLOCK as X16_BLOCK_BYTES, X16_Q5_BLOCK, X16_Q6_BLOCK, X16_ROWS  # noqa: E402

# reassoc lets LLVM vectorise the dot products; no nnan/ninf (inputs may hold inf or nan).
FM = {"reassoc", "contract", "nsz", "arcp"}

F32, F16, BF16, Q8_0, Q4_0, Q4_K, Q5_K, Q6_K, MXFP4 = (QTYPES_BY_NAME[n].type_id for n in (
    "F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K", "MXFP4"))
# The types decode_row decodes in plain numba; the others (MORE_TYPES) it decodes with the
# LLVM IR of the dot products (`DECODE`).
PLAIN = {F32, F16, BF16, Q8_0, Q4_0, Q4_K, Q5_K, Q6_K, MXFP4}
MORE_TYPES = ("Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "TQ1_0", "TQ2_0", "Q1_0", "IQ1_S", "IQ1_M", "IQ2_XXS",
              "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_NL", "IQ4_XS")
# Types these kernels decode (every type of onebit.quants); a tensor of another type would take
# the numpy reference path.
SUPPORTED = PLAIN | {QTYPES_BY_NAME[n].type_id for n in MORE_TYPES}

E8M0 = 65536  # lut[E8M0 + e]: MXFP4's shared exponent, ggml's e8m0_to_fp32_half


def make_lut() -> np.ndarray:
    """float32 values of every f16 bit pattern, then of every e8m0 byte (halved, as ggml)."""
    f16 = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)
    e = np.arange(256, dtype=np.uint32)
    e8m0 = np.where(e < 2, np.uint32(0x00200000) << e, (e - 1) << np.uint32(23)).astype(np.uint32).view(np.float32)
    return np.concatenate([f16, e8m0])


LUT = make_lut()
MXFP4_VALUES = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.float32)


@njit(inline="always")
def _u16(b, o):
    return np.int64(b[o]) | (np.int64(b[o + 1]) << 8)


@njit(inline="always")
def _i8(v):
    v = np.int32(v)
    return v - ((v & 0x80) << 1)


@njit(inline="always")
def _scale_min_k4(b, o, j):
    """Q4_K/Q5_K: 6-bit scale and min of sub-block j from the 12 packed bytes at b[o:]."""
    if j < 4:
        return np.float32(b[o + j] & 63), np.float32(b[o + j + 4] & 63)
    sc = (b[o + j + 4] & 0xF) | ((b[o + j - 4] >> 6) << 4)
    m = (b[o + j + 4] >> 4) | ((b[o + j] >> 6) << 4)
    return np.float32(sc), np.float32(m)


def _view(context, builder, aty, arr, rty, at, ndrop):
    """A view of array `arr` (type aty) as type rty starting `at` bytes in, without its first
    `ndrop` dimensions, that holds no reference (meminfo null)."""
    src = context.make_array(aty)(context, builder, arr)
    out = context.make_array(rty)(context, builder)
    shape, strides = cgutils.unpack_tuple(builder, src.shape), cgutils.unpack_tuple(builder, src.strides)
    data = builder.gep(builder.bitcast(src.data, cgutils.voidptr_t), [at])
    populate_array(out, data=builder.bitcast(data, src.data.type), shape=shape[ndrop:], strides=strides[ndrop:],
                   itemsize=src.itemsize, meminfo=None)
    return out._getvalue()


# Views that hold no reference. numba counts references to an array with atomic increments
# wherever a kernel slices it or hands it to an inlined helper; in a parallel region both
# threads doing so on one array fight over its count's cache line (a decode token's expert FFN
# on the 0.86B file: 430 us a call with counted views, 260 us without). Only for views that
# live inside a kernel while its caller holds the array.

@intrinsic
def row_of(typingctx, a, i):
    """a[i] for a C-ordered array of 2 or more dimensions, as a view that holds no reference."""
    if not (isinstance(a, types.Array) and a.ndim >= 2 and a.layout == "C" and isinstance(i, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        src = context.make_array(sig.args[0])(context, builder, args[0])
        at = builder.mul(context.cast(builder, args[1], sig.args[1], types.intp),
                         builder.extract_value(src.strides, 0))
        return _view(context, builder, sig.args[0], args[0], sig.return_type, at, 1)

    return types.Array(a.dtype, a.ndim - 1, "C", readonly=not a.mutable)(a, i), codegen


@intrinsic
def borrowed(typingctx, a):
    """The C-ordered array a as a view that holds no reference."""
    if not (isinstance(a, types.Array) and a.layout == "C"):
        return None

    def codegen(context, builder, sig, args):
        return _view(context, builder, sig.args[0], args[0], sig.return_type, ir.Constant(ir.IntType(64), 0), 0)

    return a(a), codegen


@intrinsic
def keep_alive(typingctx, a):
    """Nothing, at run time: a use of `a` after a kernel's loop, so that numba frees `a` (an
    array the kernel made) only after the loop's reference-free views of it are done with."""
    return types.none(a), lambda context, builder, sig, args: context.get_dummy_value()


@njit(inline="always")
def lent(a):
    """The three arrays of acts(..) as views that hold no reference (see `keep_alive`)."""
    return borrowed(a[0]), borrowed(a[1]), borrowed(a[2])


# Every kernel takes the block loops' length `m` (always M = 32) from its caller at run time:
# LLVM fully unrolls a loop of a constant 32 trips and then leaves it scalar; with a run-time
# count it vectorises it (measured: Q8_0 mat-vec 2x faster).
M = 32


# decode_row's plain types, one function each (m = M); `decode_row` (below) dispatches on qt.
@njit(fastmath=FM)
def _decode_f32(b, out, lut, m):
    n = out.shape[0]
    f = b.view(np.float32)
    for i in range(n):
        out[i] = f[i]


@njit(fastmath=FM)
def _decode_f16(b, out, lut, m):
    n = out.shape[0]
    for i in range(n):
        out[i] = lut[_u16(b, 2 * i)]


@njit(fastmath=FM)
def _decode_bf16(b, out, lut, m):
    n = out.shape[0]
    u = out.view(np.uint32)
    for i in range(n):
        u[i] = np.uint32(_u16(b, 2 * i)) << np.uint32(16)


@njit(fastmath=FM)
def _decode_q8_0(b, out, lut, m):
    n = out.shape[0]
    s = b.view(np.int8)
    for blk in range(n // m):
        o = blk * 34
        d = lut[_u16(b, o)]
        q = s[o + 2 : o + 2 + m]
        y = out[blk * m : blk * m + m]
        for i in range(m):
            y[i] = np.float32(q[i]) * d


@njit(fastmath=FM)
def _decode_q4_0(b, out, lut, m):
    n = out.shape[0]
    h = m // 2
    for blk in range(n // m):
        o = blk * 18
        d = lut[_u16(b, o)]
        q = b[o + 2 : o + 2 + h]
        y = out[blk * m : blk * m + m]
        y2 = y[h:]
        for i in range(h):
            y[i] = np.float32(np.int32(q[i] & 0xF) - 8) * d
        for i in range(h):
            y2[i] = np.float32(np.int32(q[i] >> 4) - 8) * d


@njit(fastmath=FM)
def _decode_mxfp4(b, out, lut, m):
    n = out.shape[0]
    h = m // 2
    for blk in range(n // m):
        o = blk * 17
        d = lut[E8M0 + b[o]]
        q = b[o + 1 : o + 1 + h]
        y = out[blk * m : blk * m + m]
        y2 = y[h:]
        for i in range(h):
            y[i] = d * MXFP4_VALUES[q[i] & 0xF]
        for i in range(h):
            y2[i] = d * MXFP4_VALUES[q[i] >> 4]


@njit(fastmath=FM)
def _decode_q4_k(b, out, lut, m):
    n = out.shape[0]
    for blk in range(n // 256):
        o = blk * 144
        d = lut[_u16(b, o)]
        dmin = lut[_u16(b, o + 2)]
        for j in range(4):
            sc1, m1 = _scale_min_k4(b, o + 4, 2 * j)
            sc2, m2 = _scale_min_k4(b, o + 4, 2 * j + 1)
            d1, dm1, d2, dm2 = d * sc1, dmin * m1, d * sc2, dmin * m2
            q = b[o + 16 + m * j : o + 16 + m * j + m]
            y = out[blk * 256 + 2 * m * j : blk * 256 + 2 * m * j + 2 * m]
            y2 = y[m:]
            for l in range(m):
                y[l] = d1 * np.float32(q[l] & 0xF) - dm1
            for l in range(m):
                y2[l] = d2 * np.float32(q[l] >> 4) - dm2


@njit(fastmath=FM)
def _decode_q5_k(b, out, lut, m):
    n = out.shape[0]
    for blk in range(n // 256):
        o = blk * 176
        d = lut[_u16(b, o)]
        dmin = lut[_u16(b, o + 2)]
        qh = b[o + 16 : o + 16 + m]
        for j in range(4):
            sc1, m1 = _scale_min_k4(b, o + 4, 2 * j)
            sc2, m2 = _scale_min_k4(b, o + 4, 2 * j + 1)
            d1, dm1, d2, dm2 = d * sc1, dmin * m1, d * sc2, dmin * m2
            q = b[o + 48 + m * j : o + 48 + m * j + m]
            y = out[blk * 256 + 2 * m * j : blk * 256 + 2 * m * j + 2 * m]
            sh = 2 * j
            y2 = y[m:]
            for l in range(m):
                y[l] = d1 * np.float32((q[l] & 0xF) | (((qh[l] >> sh) & 1) << 4)) - dm1
            for l in range(m):
                y2[l] = d2 * np.float32((q[l] >> 4) | (((qh[l] >> sh) & 2) << 3)) - dm2


@njit(fastmath=FM)
def _decode_q6_k(b, out, lut, m):
    n = out.shape[0]
    h = m // 2
    for blk in range(n // 256):
        o = blk * 210
        d = lut[_u16(b, o + 208)]
        for half in range(2):
            sc = o + 192 + 8 * half
            for g in range(2):  # 16 weights per scale: l in [16g, 16g + 16)
                a = b[o + 64 * half + h * g : o + 64 * half + h * g + h]
                c = b[o + 64 * half + m + h * g : o + 64 * half + m + h * g + h]
                qh = b[o + 128 + m * half + h * g : o + 128 + m * half + h * g + h]
                s1 = d * np.float32(_i8(b[sc + g]))
                s2 = d * np.float32(_i8(b[sc + g + 2]))
                s3 = d * np.float32(_i8(b[sc + g + 4]))
                s4 = d * np.float32(_i8(b[sc + g + 6]))
                y = out[blk * 256 + 128 * half + h * g : blk * 256 + 128 * half + 128]
                y1, y2, y3 = y[m:], y[2 * m :], y[3 * m :]
                for l in range(h):
                    y[l] = s1 * np.float32(np.int32((a[l] & 0xF) | ((qh[l] & 3) << 4)) - 32)
                for l in range(h):
                    y1[l] = s2 * np.float32(np.int32((c[l] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32)
                for l in range(h):
                    y2[l] = s3 * np.float32(np.int32((a[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32)
                for l in range(h):
                    y3[l] = s4 * np.float32(np.int32((c[l] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32)


# -- fused dot products as LLVM vector IR ---------------------------------------------------

I8, I16, I32, I64 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
FLT, HALF = ir.FloatType(), ir.HalfType()
FAST = ("contract",)  # fuse multiply-adds; no reassociation, no nnan/ninf (inputs may hold inf or nan)
W = 32  # weights per decoded group: one accumulator vector


def _vec(t, n=W):
    return ir.VectorType(t, n)


def _const(t, v):
    return ir.Constant(t, v)


def _splat(b, s, n=W):
    v = b.insert_element(ir.Constant(_vec(s.type, n), ir.Undefined), s, _const(I32, 0))
    return b.shuffle_vector(v, v, ir.Constant(_vec(I32, n), [0] * n))


def _two(b, s0, s1, n=W):
    """<s0 x n/2, s1 x n/2>: a scale per 16 weights (Q6_K; n = 16: per pair of weights)."""
    v = b.insert_element(ir.Constant(_vec(FLT, 2), ir.Undefined), s0, _const(I32, 0))
    v = b.insert_element(v, s1, _const(I32, 1))
    return b.shuffle_vector(v, v, ir.Constant(_vec(I32, n), [0] * (n // 2) + [1] * (n // 2)))


def _load(b, base, off, ty, align=1):
    p = b.gep(base, [_const(I64, off)]) if isinstance(off, int) else b.gep(base, [off])
    return b.load(b.bitcast(p, ir.PointerType(ty)), align=align)


def _byte(b, base, off):
    return b.zext(_load(b, base, off, I8), I32)


def _f16(b, base, off):
    return b.fpext(_load(b, base, off, HALF), FLT)


def _hsum(b, v, n=W):
    while n > 1:
        h = n // 2
        lo = b.shuffle_vector(v, v, ir.Constant(_vec(I32, h), list(range(h))))
        hi = b.shuffle_vector(v, v, ir.Constant(_vec(I32, h), list(range(h, n))))
        v = b.fadd(lo, hi, flags=FAST)
        n = h
    return b.extract_element(v, _const(I32, 0))


def _nibbles(b, q16):
    """16 bytes -> 32: the low nibbles, then the high ones (Q4_0, MXFP4)."""
    lo = b.and_(q16, ir.Constant(_vec(I8, 16), [15] * 16))
    hi = b.lshr(q16, ir.Constant(_vec(I8, 16), [4] * 16))
    return b.shuffle_vector(lo, hi, ir.Constant(_vec(I32), list(range(32))))


def _v8(v):
    return ir.Constant(_vec(I8), [v] * W)


def _ir_scale_min_k4(b, blk, j):
    """Q4_K/Q5_K: 6-bit scale and min of sub-block j from the 12 bytes at blk + 4, as float."""
    s = lambda i: _byte(b, blk, 4 + i)  # noqa: E731
    c63, c15 = _const(I32, 63), _const(I32, 15)
    if j < 4:
        sc, m = b.and_(s(j), c63), b.and_(s(j + 4), c63)
    else:
        sc = b.or_(b.and_(s(j + 4), c15), b.shl(b.lshr(s(j - 4), _const(I32, 6)), _const(I32, 4)))
        m = b.or_(b.lshr(s(j + 4), _const(I32, 4)), b.shl(b.lshr(s(j), _const(I32, 6)), _const(I32, 4)))
    return b.uitofp(sc, FLT), b.uitofp(m, FLT)


def _k_quants(b, name, blk):
    """Q4_K / Q5_K: (sub-block, <32 x i8> quants 0..15 / 0..31) of one block, in order."""
    qs = 16 if name == "Q4_K" else 48
    qh = _load(b, blk, 16, _vec(I8)) if name == "Q5_K" else None
    for j in range(4):
        q = _load(b, blk, qs + 32 * j, _vec(I8))
        for half, nib in enumerate((b.and_(q, _v8(15)), b.lshr(q, _v8(4)))):
            sub = 2 * j + half
            if qh is not None:
                nib = b.or_(nib, b.shl(b.and_(b.lshr(qh, _v8(sub)), _v8(1)), _v8(4)))
            yield sub, nib


def _q6_quants(b, blk, signed=True):
    """Q6_K: (first weight, <32 x i8> quants -32..31 (0..63, the stored values, if not `signed`),
    the two int8 scales of its halves as float) of one block, in order; the block's f16 scale is
    at blk + 208."""
    for half in range(2):
        a, c = _load(b, blk, 64 * half, _vec(I8)), _load(b, blk, 64 * half + 32, _vec(I8))
        qh = _load(b, blk, 128 + 32 * half, _vec(I8))
        for g, low in enumerate((b.and_(a, _v8(15)), b.and_(c, _v8(15)), b.lshr(a, _v8(4)), b.lshr(c, _v8(4)))):
            hi = b.shl(b.and_(b.lshr(qh, _v8(2 * g)), _v8(3)), _v8(4))
            q = b.sub(b.or_(low, hi), _v8(32)) if signed else b.or_(low, hi)
            s0, s1 = (b.sitofp(_load(b, blk, 192 + 8 * half + 2 * g + k, I8), FLT) for k in range(2))
            yield 128 * half + 32 * g, q, s0, s1


def _q5_quants(b, name, blk):
    """Q4_1 / Q5_0 / Q5_1: the block's <32 x i32> quants (0..15 / 0..31, no offset applied)."""
    return b.zext(_q5_bytes(b, name, blk), _vec(I32))


def _q5_bytes(b, name, blk):
    """Q4_1 / Q5_0 / Q5_1: the block's quants as <32 x i8> (0..15 / 0..31, no offset applied),
    the fifth bits from the 32-bit word as a <32 x i1> (one mask register on AVX-512)."""
    qs = {"Q4_1": 4, "Q5_0": 6, "Q5_1": 8}[name]
    q = _nibbles(b, _load(b, blk, qs, _vec(I8, 16)))
    if name != "Q4_1":
        fifth = b.zext(b.bitcast(_u32i(b, blk, qs - 4), _vec(ir.IntType(1), W)), _vec(I8))
        q = b.or_(q, b.shl(fifth, _v8(4)))
    return q


def _groups(b, name, blk):
    """The weight groups of one block at byte pointer blk: [(first weight, <32 x float>)]."""
    V = _vec(FLT)
    if name == "F32":
        return [(0, _load(b, blk, 0, V))]
    if name == "F16":
        return [(0, b.fpext(_load(b, blk, 0, _vec(HALF)), V))]
    if name == "BF16":
        u = b.shl(b.zext(_load(b, blk, 0, _vec(I16)), _vec(I32)), ir.Constant(_vec(I32), [16] * W))
        return [(0, b.bitcast(u, V))]
    if name == "Q8_0":
        q = b.sitofp(_load(b, blk, 2, _vec(I8)), V)
        return [(0, b.fmul(_splat(b, _f16(b, blk, 0)), q))]
    if name == "Q4_0":
        q = b.sub(_nibbles(b, _load(b, blk, 2, _vec(I8, 16))), _v8(8))
        return [(0, b.fmul(_splat(b, _f16(b, blk, 0)), b.sitofp(q, V)))]
    if name == "MXFP4":  # e2m1 magnitudes 0 1 2 3 4 6 8 12 (doubled, as ggml), sign in bit 3
        d = _e8m0_half(b, blk)
        n = b.zext(_nibbles(b, _load(b, blk, 1, _vec(I8, 16))), _vec(I32))
        c = lambda v: ir.Constant(_vec(I32), [v] * W)  # noqa: E731
        mag = b.and_(n, c(7))
        wide = b.shl(b.or_(c(2), b.and_(mag, c(1))), b.sub(b.lshr(mag, c(1)), c(1)))
        val = b.select(b.icmp_unsigned("<", mag, c(4)), mag, wide)
        val = b.select(b.icmp_unsigned("!=", b.and_(n, c(8)), c(0)), b.sub(c(0), val), val)
        return [(0, b.fmul(_splat(b, d), b.sitofp(val, V)))]
    if name in ("Q4_K", "Q5_K"):
        d, dmin = _f16(b, blk, 0), _f16(b, blk, 2)
        out = []
        for sub, nib in _k_quants(b, name, blk):
            sc, m = _ir_scale_min_k4(b, blk, sub)
            ds, dm = b.fmul(d, sc), b.fmul(dmin, m)
            out.append((32 * sub, b.fsub(b.fmul(_splat(b, ds), b.uitofp(nib, V)), _splat(b, dm))))
        return out
    if name == "Q6_K":
        d = _f16(b, blk, 208)
        return [(off, b.fmul(_two(b, b.fmul(d, s0), b.fmul(d, s1)), b.sitofp(q, V)))
                for off, q, s0, s1 in _q6_quants(b, blk)]
    return _more_groups(b, name, blk)


# -- the other types: legacy, K, ternary, 1-bit and codebook (IQ) blocks ---------------------
# Codebooks (IQ grids, the even-parity sign bytes) are int8 tables placed in the kernel's module
# as constants, read 4 or 8 bytes per grid index; IQ4's 16 levels are selected in registers.


def _ivec(vals):
    return ir.Constant(_vec(I32, len(vals)), list(vals))


def _cat(b, parts):
    """Equal-length vectors (a power-of-two count of them) -> one vector, in order."""
    while len(parts) > 1:
        n = parts[0].type.count
        mask = ir.Constant(_vec(I32, 2 * n), list(range(2 * n)))
        parts = [b.shuffle_vector(parts[i], parts[i + 1], mask) for i in range(0, len(parts), 2)]
    return parts[0]


def _spread(b, scalars):
    """Floats s0..s(k-1) -> <32 x float>, each repeated 32 / k times."""
    k = len(scalars)
    v = ir.Constant(_vec(FLT, k), ir.Undefined)
    for i, s in enumerate(scalars):
        v = b.insert_element(v, s, _const(I32, i))
    return b.shuffle_vector(v, v, _ivec([i * k // W for i in range(W)]))


def _u16i(b, base, off):
    return b.zext(_load(b, base, off, I16), I32)


def _u32i(b, base, off):
    return _load(b, base, off, I32)


def _bits32(b, word):
    """Bit l of the i32 `word` as lane l of <32 x i1>."""
    v = b.and_(b.lshr(_splat(b, word), _ivec(range(W))), _ivec([1] * W))
    return b.icmp_unsigned("!=", v, _ivec([0] * W))


def _negate_where(b, v, word):
    """v with lane l negated where bit l of `word` is set (sign bits)."""
    return b.select(_bits32(b, word), b.fneg(v), v)


@cache
def _table_bytes(name: str) -> bytes:
    if name == "SIGNS":  # 7 sign bits -> the byte with the even-parity 8th bit (EVEN_SIGNS)
        return bytes(i | ((bin(i).count("1") & 1) << 7) for i in range(128))
    return iq_grid(name).astype(np.int8).tobytes()


def _table(b, name):
    """Pointer (i8*) to table `name` in the function's module."""
    mod = b.module
    g = mod.globals.get(f"onebit_{name}")
    if g is None:
        data = _table_bytes(name)
        ty = ir.ArrayType(I8, len(data))
        g = ir.GlobalVariable(mod, ty, f"onebit_{name}")
        g.initializer = ir.Constant(ty, bytearray(data))
        g.global_constant = True
        g.linkage = "internal"
    return b.bitcast(g, ir.PointerType(I8))


def _grid_rows(b, tab, idxs, k):
    """Rows idxs (i32 values) of a table of k-byte rows -> one <len * k x i8> vector."""
    return _cat(b, [_load(b, tab, b.mul(b.zext(i, I64), _const(I64, k)), _vec(I8, k)) for i in idxs])


def _levels(b, q):
    """<32 x i8> of IQ4's level[q[l]] for the nibbles q: a tree of selects on the index bits over
    constant vectors (four compares and 15 selects per 32 weights, no per-lane loads)."""
    level = [ir.Constant(_vec(I8), [int(v)] * W) for v in iq4_values()]
    for bit in range(4):
        m = b.icmp_unsigned("!=", b.and_(q, _v8(1 << bit)), _v8(0))
        level = [b.select(m, level[2 * i + 1], level[2 * i]) for i in range(len(level) // 2)]
    return level[0]


def _even_signs(b, aux):
    """IQ2_XXS / IQ3_XXS: four 7-bit sign fields of aux (at bits 0, 7, 14, 21) -> the i32 of
    their four sign bytes (8th bit: even count of negatives)."""
    tab = _table(b, "SIGNS")
    word = _const(I32, 0)
    for k in range(4):
        s = b.and_(b.lshr(aux, _const(I32, 7 * k)), _const(I32, 127))
        byte = b.zext(_load(b, tab, b.zext(s, I64), I8), I32)
        word = b.or_(word, b.shl(byte, _const(I32, 8 * k)))
    return word


def _iq2_scale(b, d, s, div):
    """d (0.5 + s) / div for the 4-bit scale s (i32), as numpy's order: d * (0.5 + s) * (1/div)."""
    return b.fmul(b.fmul(d, b.fadd(_const(FLT, 0.5), b.uitofp(s, FLT))), _const(FLT, 1.0 / div))


def _more_groups(b, name, blk):
    V = _vec(FLT)
    c = lambda v, t=I32: ir.Constant(_vec(t), [v] * W)  # noqa: E731
    if name in ("Q4_1", "Q5_0", "Q5_1"):
        d = _f16(b, blk, 0)
        m = _f16(b, blk, 2) if name != "Q5_0" else None
        q = _q5_quants(b, name, blk)
        if name == "Q5_0":
            return [(0, b.fmul(_splat(b, d), b.sitofp(b.sub(q, c(16)), V)))]
        return [(0, b.fadd(b.fmul(_splat(b, d), b.uitofp(q, V)), _splat(b, m)))]
    if name == "Q2_K":  # 16 bytes of 4-bit scale | 4-bit min per 16 weights, 64 of 2-bit quants
        d, dmin = _f16(b, blk, 80), _f16(b, blk, 82)
        out = []
        for half in range(2):
            q = _load(b, blk, 16 + 32 * half, _vec(I8))
            for j in range(4):
                v = b.uitofp(b.and_(b.lshr(q, _v8(2 * j)), _v8(3)), V)
                s = [_byte(b, blk, 8 * half + 2 * j + k) for k in range(2)]
                sc = _two(b, *(b.fmul(d, b.uitofp(b.and_(x, _const(I32, 15)), FLT)) for x in s))
                mn = _two(b, *(b.fmul(dmin, b.uitofp(b.lshr(x, _const(I32, 4)), FLT)) for x in s))
                out.append((128 * half + 32 * j, b.fsub(b.fmul(sc, v), mn)))
        return out
    if name == "Q3_K":  # 32 bytes of high bits, 64 of 2-bit quants, 12 of 6-bit scales, f16 d
        d = _f16(b, blk, 108)
        hm = _load(b, blk, 0, _vec(I8))
        out = []
        for g in range(8):
            half, j = divmod(g, 4)
            q = b.and_(b.lshr(_load(b, blk, 32 + 32 * half, _vec(I8)), _v8(2 * j)), _v8(3))
            hb = b.and_(b.lshr(hm, _v8(g)), _v8(1))
            v = b.sitofp(b.add(b.sub(q, _v8(4)), b.shl(hb, _v8(2))), V)  # q - 4 where the high bit is 0
            s = []
            for i in (2 * g, 2 * g + 1):
                lo = b.and_(b.lshr(_byte(b, blk, 96 + i % 8), _const(I32, 4 * (i // 8))), _const(I32, 15))
                hi = b.and_(b.lshr(_byte(b, blk, 104 + i % 4), _const(I32, 2 * (i // 4))), _const(I32, 3))
                s.append(b.fmul(d, b.sitofp(b.sub(b.or_(lo, b.shl(hi, _const(I32, 4))), _const(I32, 32)), FLT)))
            out.append((32 * g, b.fmul(_two(b, *s), v)))
        return out
    if name == "TQ2_0":  # 2-bit values - 1, four per byte at shifts 0, 2, 4, 6 of 32-byte rows
        d = _splat(b, _f16(b, blk, 64))
        out = []
        for half in range(2):
            q = _load(b, blk, 32 * half, _vec(I8))
            for s in range(4):
                v = b.sitofp(b.sub(b.and_(b.lshr(q, _v8(2 * s)), _v8(3)), _v8(1)), V)
                out.append((128 * half + 32 * s, b.fmul(d, v)))
        return out
    if name == "TQ1_0":  # base-3 digits: 5 per byte of qs, 4 per byte of qh; digit = (byte * 3^p * 3) >> 8
        d = _splat(b, _f16(b, blk, 52))

        def tern(v):  # <32 x i8> of byte * 3^p (mod 256) -> weights
            t = b.lshr(b.mul(b.zext(v, _vec(I32)), c(3)), c(8))
            return b.fmul(d, b.sitofp(b.sub(t, c(1)), V))

        def times(v, p):
            n = v.type.count
            return b.mul(v, ir.Constant(_vec(I8, n), p if isinstance(p, list) else [p] * n))

        q0 = _load(b, blk, 0, _vec(I8))
        q1 = _load(b, blk, 32, _vec(I8, 16))
        qh = _load(b, blk, 48, _vec(I8, 4))
        qh = times(b.shuffle_vector(qh, qh, _ivec([0, 1, 2, 3] * 4)), [1] * 4 + [3] * 4 + [9] * 4 + [27] * 4)
        out = [(32 * p, tern(times(q0, 3**p))) for p in range(5)]
        p1 = [times(q1, 3**p) for p in range(5)]
        out += [(160, tern(_cat(b, p1[0:2]))), (192, tern(_cat(b, p1[2:4]))), (224, tern(_cat(b, [p1[4], qh])))]
        return out
    if name == "Q1_0":  # sign bits: w = bit ? +d : -d
        d = _splat(b, _f16(b, blk, 0))
        return [(32 * g, b.select(_bits32(b, _u32i(b, blk, 2 + 4 * g)), d, b.fneg(d))) for g in range(4)]
    if name in ("IQ4_NL", "IQ4_XS"):
        d = _f16(b, blk, 0)

        def levels(off):
            return b.sitofp(_levels(b, _nibbles(b, _load(b, blk, off, _vec(I8, 16)))), V)

        if name == "IQ4_NL":
            return [(0, b.fmul(_splat(b, d), levels(2)))]
        sh = _u16i(b, blk, 2)
        out = []
        for g in range(8):
            lo = b.and_(b.lshr(_byte(b, blk, 4 + g // 2), _const(I32, 4 * (g % 2))), _const(I32, 15))
            hi = b.and_(b.lshr(sh, _const(I32, 2 * g)), _const(I32, 3))
            s = b.sub(b.or_(lo, b.shl(hi, _const(I32, 4))), _const(I32, 32))
            out.append((32 * g, b.fmul(_splat(b, b.fmul(d, b.sitofp(s, FLT))), levels(8 + 16 * g))))
        return out
    if name in ("IQ2_XXS", "IQ3_XXS"):  # grid indices per 32 weights, a u32 of 4 sign fields + scale
        d, tab = _f16(b, blk, 0), _table(b, name)
        out = []
        for g in range(8):
            if name == "IQ2_XXS":
                aux = _u32i(b, blk, 2 + 8 * g + 4)
                vals = _grid_rows(b, tab, [_byte(b, blk, 2 + 8 * g + k) for k in range(4)], 8)
            else:
                aux = _u32i(b, blk, 66 + 4 * g)
                vals = _grid_rows(b, tab, [_byte(b, blk, 2 + 8 * g + k) for k in range(8)], 4)
            sc = _iq2_scale(b, d, b.lshr(aux, _const(I32, 28)), 4 if name == "IQ2_XXS" else 2)
            w = b.fmul(_splat(b, sc), b.sitofp(vals, V))
            out.append((32 * g, _negate_where(b, w, _even_signs(b, aux))))
        return out
    if name in ("IQ2_XS", "IQ2_S"):  # 8-weight grid rows, a 4-bit scale per 16 weights
        d, tab = _f16(b, blk, 0), _table(b, name)
        out = []
        for g in range(8):
            sb = _byte(b, blk, (66 if name == "IQ2_XS" else 74) + g)
            sc = _two(b, _iq2_scale(b, d, b.and_(sb, _const(I32, 15)), 4), _iq2_scale(b, d, b.lshr(sb, _const(I32, 4)), 4))
            if name == "IQ2_XS":
                qs = [_u16i(b, blk, 2 + 2 * (4 * g + k)) for k in range(4)]
                idx = [b.and_(q, _const(I32, 511)) for q in qs]
                tabs = _table(b, "SIGNS")
                signs = _const(I32, 0)
                for k, q in enumerate(qs):
                    byte = b.zext(_load(b, tabs, b.zext(b.lshr(q, _const(I32, 9)), I64), I8), I32)
                    signs = b.or_(signs, b.shl(byte, _const(I32, 8 * k)))
            else:
                qh = _byte(b, blk, 66 + g)
                idx = [b.or_(_byte(b, blk, 2 + 4 * g + k),
                             b.shl(b.and_(b.lshr(qh, _const(I32, 2 * k)), _const(I32, 3)), _const(I32, 8)))
                       for k in range(4)]
                signs = _u32i(b, blk, 34 + 4 * g)
            w = b.fmul(sc, b.sitofp(_grid_rows(b, tab, idx, 8), V))
            out.append((32 * g, _negate_where(b, w, signs)))
        return out
    if name == "IQ3_S":  # 9-bit indices of 4-weight rows, a sign bit per weight, d (1 + 2 s) per 32
        d, tab = _f16(b, blk, 0), _table(b, name)
        out = []
        for g in range(8):
            qh = _byte(b, blk, 66 + g)
            idx = [b.or_(_byte(b, blk, 2 + 8 * g + k),
                         b.shl(b.and_(b.lshr(qh, _const(I32, k)), _const(I32, 1)), _const(I32, 8))) for k in range(8)]
            s = b.and_(b.lshr(_byte(b, blk, 106 + g // 2), _const(I32, 4 * (g % 2))), _const(I32, 15))
            sc = b.fmul(d, b.fadd(_const(FLT, 1.0), b.fmul(_const(FLT, 2.0), b.uitofp(s, FLT))))
            w = b.fmul(_splat(b, sc), b.sitofp(_grid_rows(b, tab, idx, 4), V))
            out.append((32 * g, _negate_where(b, w, _u32i(b, blk, 74 + 4 * g))))
        return out
    if name in ("IQ1_S", "IQ1_M"):  # 11-bit indices of 8-weight rows of -1/0/1, +- 1/8, d (2 s + 1)
        tab = _table(b, "IQ1_S")
        eighth = _const(FLT, float(IQ1_DELTA))
        if name == "IQ1_M":
            sc = [_u16i(b, blk, 48 + 2 * i) for i in range(4)]
            d16 = b.or_(b.or_(b.lshr(sc[0], _const(I32, 12)), b.and_(b.lshr(sc[1], _const(I32, 8)), _const(I32, 0xF0))),
                        b.or_(b.and_(b.lshr(sc[2], _const(I32, 4)), _const(I32, 0xF00)), b.and_(sc[3], _const(I32, 0xF000))))
            d = b.fpext(b.bitcast(b.trunc(d16, I16), HALF), FLT)
        else:
            d = _f16(b, blk, 0)
        out = []
        for g in range(8):
            if name == "IQ1_S":
                qh = _u16i(b, blk, 34 + 2 * g)
                idx = [b.or_(_byte(b, blk, 2 + 4 * g + k),
                             b.shl(b.and_(b.lshr(qh, _const(I32, 3 * k)), _const(I32, 7)), _const(I32, 8)))
                       for k in range(4)]
                neg = b.icmp_unsigned("!=", b.and_(qh, _const(I32, 0x8000)), _const(I32, 0))
                delta = _splat(b, b.select(neg, b.fneg(eighth), eighth))
                s = b.and_(b.lshr(qh, _const(I32, 12)), _const(I32, 7))
                dl = _splat(b, b.fmul(d, b.uitofp(b.add(b.shl(s, _const(I32, 1)), _const(I32, 1)), FLT)))
            else:
                nib = [b.and_(b.lshr(_byte(b, blk, 32 + (4 * g + k) // 2), _const(I32, 4 * (k % 2))), _const(I32, 15))
                       for k in range(4)]
                idx = [b.or_(_byte(b, blk, 4 * g + k), b.shl(b.and_(n, _const(I32, 7)), _const(I32, 8)))
                       for k, n in enumerate(nib)]
                delta = _spread(b, [b.select(b.icmp_unsigned("!=", b.and_(n, _const(I32, 8)), _const(I32, 0)),
                                             b.fneg(eighth), eighth) for n in nib])
                dls = []
                for i in (2 * g, 2 * g + 1):
                    s = b.and_(b.lshr(sc[i // 4], _const(I32, 3 * (i % 4))), _const(I32, 7))
                    dls.append(b.fmul(d, b.uitofp(b.add(b.shl(s, _const(I32, 1)), _const(I32, 1)), FLT)))
                dl = _two(b, *dls)
            vals = b.fadd(b.sitofp(_grid_rows(b, tab, idx, 8), V), delta)
            out.append((32 * g, b.fmul(dl, vals)))
        return out
    raise KeyError(name)


def _groups1(b, name, p):
    """One weight of a float type at byte pointer p, as float."""
    if name == "F32":
        return _load(b, p, 0, FLT)
    if name == "F16":
        return b.fpext(_load(b, p, 0, HALF), FLT)
    return b.bitcast(b.shl(b.zext(_load(b, p, 0, I16), I32), _const(I32, 16)), FLT)


IR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "MXFP4", "Q4_K", "Q5_K", "Q6_K") + MORE_TYPES


def _intrinsic_of(typer, lead: str, rows: list[str], name: str):
    """intrinsic `name`(typingctx, <lead>, <rows>) -> typer(typingctx, ...): numba's intrinsics
    take a fixed list of arguments, so each row count gets a function of its own arity."""
    args = ", ".join([lead, *rows])
    ns = {"typer": typer}
    exec(f"def {name}(typingctx, {args}):\n    return typer(typingctx, {args})", ns)
    return intrinsic(ns[name])


def _make_dot(name: str, rows: int):
    qt = QTYPES_BY_NAME[name]
    elem = qt.type_size if qt.block_size == 1 else 0  # float types: bytes per weight; 32 per group
    bs, ts = (W, W * elem) if elem else (qt.block_size, qt.type_size)

    def codegen(context, builder, sig, args):
        b = builder
        w = context.make_array(sig.args[0])(context, b, args[0])
        xs = [context.make_array(t)(context, b, a).data for t, a in zip(sig.args[1:], args[1:])]
        nbytes = b.extract_value(w.shape, 0)
        nb = b.udiv(nbytes, _const(I64, ts))
        accs = [cgutils.alloca_once_value(b, ir.Constant(_vec(FLT), [0.0] * W)) for _ in xs]
        with cgutils.for_range(b, nb) as loop:
            i = loop.index
            blk = b.gep(w.data, [b.mul(i, _const(I64, ts))])
            first = b.mul(i, _const(I64, bs))
            for off, wv in _groups(b, name, blk):
                k = b.add(first, _const(I64, off))
                for x, acc in zip(xs, accs):
                    xv = _load(b, x, k, _vec(FLT), align=4)
                    b.store(b.fadd(b.load(acc), b.fmul(wv, xv, flags=FAST), flags=FAST), acc)
        sums = [_hsum(b, b.load(acc)) for acc in accs]
        if elem:  # a float row's last len % 32 weights, one at a time
            tails = [cgutils.alloca_once_value(b, ir.Constant(FLT, 0.0)) for _ in xs]
            first = b.mul(nb, _const(I64, W))
            with cgutils.for_range(b, b.sub(b.udiv(nbytes, _const(I64, elem)), first)) as loop:
                k = b.add(first, loop.index)
                wv = _groups1(b, name, b.gep(w.data, [b.mul(k, _const(I64, elem))]))
                for x, t in zip(xs, tails):
                    xv = b.load(b.gep(x, [k]), align=4)
                    b.store(b.fadd(b.load(t), b.fmul(wv, xv, flags=FAST), flags=FAST), t)
            sums = [b.fadd(s, b.load(t)) for s, t in zip(sums, tails)]
        if rows == 1:
            return sums[0]
        return context.make_tuple(b, sig.return_type, sums)

    def typer(typingctx, w, *xs):
        ok = (isinstance(w, types.Array) and w.ndim == 1 and w.dtype == types.uint8 and w.layout == "C"
              and all(isinstance(x, types.Array) and x.ndim == 1 and x.dtype == types.float32 and x.layout == "C"
                      for x in xs))
        if not ok:
            return None
        ret = types.float32 if rows == 1 else types.UniTuple(types.float32, rows)
        return ret(w, *xs), codegen

    return _intrinsic_of(typer, "w", [f"x{i}" for i in range(rows)], f"dot{rows}_{name.lower()}")


DOT1 = {n: _make_dot(n, 1) for n in IR_TYPES}
DOT2 = {n: _make_dot(n, 2) for n in IR_TYPES}
DOT4 = {n: _make_dot(n, 4) for n in IR_TYPES}
DOT8 = {n: _make_dot(n, 8) for n in IR_TYPES}


# -- integer dot products on 16-bit activations ----------------------------------------------
# For the common quantized types (INT_TYPES: the legacy 32-weight blocks and the K types people
# run) a weight row is dotted with activations rounded to int16 per block of 32 (a
# float32 scale d = max|x| / 32767 per block, and m = d * sum of the block's int16 values for
# the types whose weights carry an offset): the integer products of 32 weights
# sum exactly in int32 (pairs of 16-bit products: x86's pmaddwd, which LLVM selects from the IR
# below), then one float multiply-add per 32 weights applies the weight's and the activation's
# scales. Per 32 weights that is 5-6 vector operations where the float32 path (`_groups`) takes
# 10-12 (convert every weight to float, scale it, subtract the minimum, fused multiply-add).
# Why 16-bit and not 8-bit activations (what llama.cpp does): an activation rounded to 1/32767
# of its block's largest value moves a dot product by about 1e-5 of its size, as close to the
# float32 results as float32 summation order is, so every oracle bar held to float32 still
# holds; 8-bit rounding moves llama.cpp's logits to cosine 0.988-0.999 against float32
# (tests/test_oracle.py, BELOW_BAR). Measured on the 2-core VM (one thread, 1 MiB of Q4_K
# rows, so compute-bound): float32 6.6 GB/s, int16 11.3, int8 (AVX-512 VNNI) 15.3. The codebook
# types stay on the float32 path, and MXFP4 does without VNNI: its int16 form (selects over 32
# lanes) measured 0.82-0.94x its float32 decode (bench/bench_roofline.py); on VNNI see below.

A = 32  # activations per int16 block (one float32 scale each)
# int16 slots after each row of quantize_acts' q, never read: rows a power of two of bytes apart
# put the same column of 8 rows (a prompt's group) in one set of the 8-way L1 cache, and with
# the byte planes 16 lines took turns in one set (K = 4096: the prompt's products ran at 45-75
# GFLOP/s against 110-130 at K = 2048)
ROW_PAD = 32
ACT_MAX = 32767.0


def _has_vnni() -> bool:
    """Whether the code numba makes here may use AVX-512 VNNI (vpdpbusd): the features numba
    compiles for (NUMBA_CPU_FEATURES, else the host's; numba's disk cache is keyed by them too)."""
    from numba.core import config

    feats = config.CPU_FEATURES
    if feats is None:
        import llvmlite.binding as llvm

        feats = llvm.get_host_cpu_features().flatten()
    on = {f[1:] for f in feats.split(",") if f.startswith("+")}
    return {"avx512vnni", "avx512bw"} <= on


# Q4_K and Q5_K on AVX-512 VNNI: the int16 activation v is split exactly as v = 256 hi + lo
# (hi: its signed high byte, lo: its unsigned low byte; `quantize_acts` stores both planes
# after the int16 values), and a weight vector of 64 unsigned quants meets each plane in one
# vpdpbusd (64 byte products summed four to an int32 lane): sum q v = 256 sum q hi + sum q lo,
# the same integer as the int16 path's, in half the vector operations, and the float
# conversion once per 64 weights (two sub-blocks, a scale per half of the lanes) instead of
# per 32. Q6_K's quants are stored unsigned (q = u - 32): the products take u, and the 32 x
# sum of each 16 activations it owes (`quantize_acts` keeps those sums) comes off with the
# scales. Q8_0's weights are signed (vpdpbusd wants one unsigned side): int16 path.
VNNI = _has_vnni()
VNNI_TYPES = ("Q4_K", "Q5_K", "Q6_K", "MXFP4", "Q4_0", "Q5_0", "IQ4_NL", "IQ4_XS") if VNNI else ()


# The 32-weight nibble types on VNNI (PAIRS), two blocks (64 weights) to a step: each quant
# becomes an unsigned byte, the level it stands for plus a constant c (MXFP4: its doubled
# e2m1 value + 12 through a vpshufb table; IQ4_NL: its level + 128 through a table; Q4_0 and
# Q5_0: the stored 0..15 / 0..31 as they are, c = 8 / 16), and c x each block's activation sum
# comes off with the scales. IQ4_XS is IQ4_NL's levels in 256-weight blocks with a 6-bit scale
# per 32. Without VNNI these types keep the paths above.
PAIRS = {"MXFP4": 12, "Q4_0": 8, "Q5_0": 16, "IQ4_NL": 128}  # type -> c
INT_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K") + (
    ("MXFP4", "IQ4_NL", "IQ4_XS") if VNNI else ())
MXFP4_PLUS12 = [int(v) + 12 for v in (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)]
IQ4_PLUS128 = [int(v) + 128 - (256 if int(v) + 128 > 127 else 0) for v in iq4_values()]  # (as signed bytes)


def _pshufb(b, table16, idx):
    """<64 x i8>: table16[idx[i]] for indices 0..15 (vpshufb, the 16-byte table in every lane)."""
    ty = _vec(I8, 64)
    fn = cgutils.get_or_insert_function(b.module, ir.FunctionType(ty, [ty, ty]), "llvm.x86.avx512.pshuf.b.512")
    return b.call(fn, [ir.Constant(ty, table16 * 4), idx])


def _dpbusd(b, acc, u8, s8):
    """<16 x i32> acc + (sums of 4 products of unsigned bytes u8 and signed bytes s8)."""
    fnty = ir.FunctionType(_vec(I32, 16), [_vec(I32, 16), _vec(I8, 64), _vec(I8, 64)])
    fn = cgutils.get_or_insert_function(b.module, fnty, "llvm.x86.avx512.vpdpbusd.512")
    return b.call(fn, [acc, u8, s8])


def _plane_dot(b, w64, lo_p, hi_p, k):
    """<16 x i32>: 64 unsigned weight quants w64 . the int16 activations k.. k + 63, through their
    byte planes at lo_p, hi_p: 256 (w . hi) + (w . lo), four products to a lane (see VNNI)."""
    lo, hi = _load(b, lo_p, k, _vec(I8, 64)), _load(b, hi_p, k, _vec(I8, 64))
    high = _dpbusd(b, ir.Constant(_vec(I32, 16), [0] * 16), w64, hi)
    return _dpbusd(b, b.shl(high, ir.Constant(_vec(I32, 16), [8] * 16)), lo, w64)


def _pairs(b, w16, x16):
    """<32 x i16> . <32 x i16> -> <16 x i32>, lane k = w[2k] x[2k] + w[2k+1] x[2k+1] (pmaddwd)."""
    p = b.mul(b.sext(w16, _vec(I32)), b.sext(x16, _vec(I32)))
    even = b.shuffle_vector(p, p, _ivec(range(0, W, 2)))
    odd = b.shuffle_vector(p, p, _ivec(range(1, W, 2)))
    return b.add(even, odd)


def _k_scales(b, blk):
    """Q4_K / Q5_K: the 6-bit scales and mins of the 8 sub-blocks (12 bytes at blk + 4), as
    <8 x float> each (`_ir_scale_min_k4`, all 8 at once)."""
    s = b.zext(_load(b, blk, 4, _vec(I8, 12)), _vec(I32, 12))
    pick = lambda idx: b.shuffle_vector(s, s, _ivec(idx))  # noqa: E731
    c = lambda v: _ivec([v] * 8)  # noqa: E731
    first = ir.Constant(_vec(ir.IntType(1), 8), [1] * 4 + [0] * 4)  # sub-blocks 0-3
    a, a_hi = pick([0, 1, 2, 3, 8, 9, 10, 11]), pick([0, 0, 0, 0, 0, 1, 2, 3])
    m, m_hi = pick([4, 5, 6, 7, 8, 9, 10, 11]), pick([0, 0, 0, 0, 4, 5, 6, 7])
    sc = b.select(first, b.and_(a, c(63)), b.or_(b.and_(a, c(15)), b.shl(b.lshr(a_hi, c(6)), c(4))))
    mn = b.select(first, b.and_(m, c(63)), b.or_(b.lshr(m, c(4)), b.shl(b.lshr(m_hi, c(6)), c(4))))
    return b.uitofp(sc, _vec(FLT, 8)), b.uitofp(mn, _vec(FLT, 8))


def _igroups(b, name, blk):
    """One block of an INT_TYPES type at byte pointer blk, as integers: ([(first weight, <32 x
    i16> weights, scale)], scales, offsets). scale: a float (the group's), <16 x float> (a scale
    per pair lane, Q6_K's two per group), or, where `scales` (<8 x float>, Q4_K and Q5_K: the 8
    sub-blocks' scales) is given, the group's lane in it; offsets: what each block of 32 adds to
    every weight (weight = scale * q + offset), a float (one block) or <8 x float> (Q4_K, Q5_K:
    minus the 8 sub-blocks' minimums), or None."""
    V16 = _vec(I16)
    if name in ("Q4_1", "Q5_0", "Q5_1"):
        q = b.zext(_q5_bytes(b, name, blk), V16)
        if name == "Q5_0":
            return [(0, b.sub(q, ir.Constant(V16, [16] * W)), _f16(b, blk, 0))], None, None
        return [(0, q, _f16(b, blk, 0))], None, _f16(b, blk, 2)
    if name == "Q8_0":
        return [(0, b.sext(_load(b, blk, 2, _vec(I8)), V16), _f16(b, blk, 0))], None, None
    if name == "Q4_0":
        q = b.sub(_nibbles(b, _load(b, blk, 2, _vec(I8, 16))), _v8(8))
        return [(0, b.sext(q, V16), _f16(b, blk, 0))], None, None
    if name in ("Q4_K", "Q5_K"):
        d, dmin = _f16(b, blk, 0), _f16(b, blk, 2)
        sc, mn = _k_scales(b, blk)
        scales = b.fmul(_splat(b, d, 8), sc)
        out = [(32 * sub, b.zext(nib, V16), sub) for sub, nib in _k_quants(b, name, blk)]
        return out, scales, b.fneg(b.fmul(_splat(b, dmin, 8), mn))
    if name == "Q6_K":
        d = _f16(b, blk, 208)
        return [(off, b.sext(q, V16), _two(b, b.fmul(d, s0), b.fmul(d, s1), 16))
                for off, q, s0, s1 in _q6_quants(b, blk)], None, None
    raise ValueError(name)


def _vnni_k_block(b, name, blk, i, planes, xd, xm, accs, oaccs):
    """One Q4_K / Q5_K block (blk, the i-th of the row) into the rows' accumulators, through the
    activations' byte planes: 4 x 64 weights, two sub-blocks each (see VNNI)."""
    V16F, V8F = _vec(FLT, 16), _vec(FLT, 8)
    d, dmin = _f16(b, blk, 0), _f16(b, blk, 2)
    sc, mn = _k_scales(b, blk)
    scales, offsets = b.fmul(_splat(b, d, 8), sc), b.fneg(b.fmul(_splat(b, dmin, 8), mn))
    quants = dict(_k_quants(b, name, blk))  # sub-block -> <32 x i8>, 0..15 / 0..31
    first, sub0 = b.mul(i, _const(I64, 256)), b.mul(i, _const(I64, 8))
    sdx = [b.fmul(scales, _load(b, dx, sub0, V8F, align=4)) for dx in xd]
    for j in range(4):
        wv = b.shuffle_vector(quants[2 * j], quants[2 * j + 1], _ivec(range(64)))  # <64 x i8>
        k = b.add(first, _const(I64, 64 * j))
        for r, ((lo_p, hi_p), acc) in enumerate(zip(planes, accs)):
            isum = _plane_dot(b, wv, lo_p, hi_p, k)
            sv = b.shuffle_vector(sdx[r], sdx[r], _ivec([2 * j] * 8 + [2 * j + 1] * 8))
            b.store(b.fadd(b.load(acc), b.fmul(b.sitofp(isum, V16F), sv, flags=FAST), flags=FAST), acc)
    for mx, oacc in zip(xm, oaccs):
        b.store(b.fadd(b.load(oacc), b.fmul(offsets, _load(b, mx, sub0, V8F, align=4))), oacc)


def _e8m0_half(b, blk):
    """MXFP4's block scale (the e8m0 byte at blk), halved as ggml's e8m0_to_fp32_half."""
    e = _byte(b, blk, 0)
    small = b.shl(_const(I32, 0x00200000), e)
    big = b.shl(b.sub(e, _const(I32, 1)), _const(I32, 23))
    return b.bitcast(b.select(b.icmp_unsigned("<", e, _const(I32, 2)), small, big), FLT)


def _nibble_weights(b, name, q32, fifth=None):
    """32 quant bytes of two blocks (low nibbles: weights 0-15, high: 16-31 of each) -> <64 x i8>
    unsigned weights in order (see PAIRS); fifth: Q5_0's <64 x i1> fifth bits."""
    lo, hi = b.and_(q32, _v8(15)), b.lshr(q32, _v8(4))
    v = b.shuffle_vector(lo, hi, _ivec(list(range(16)) + list(range(32, 48)) + list(range(16, 32)) + list(range(48, 64))))
    if name == "MXFP4":
        return _pshufb(b, MXFP4_PLUS12, v)
    if name in ("IQ4_NL", "IQ4_XS"):
        return _pshufb(b, IQ4_PLUS128, v)
    if fifth is not None:
        v = b.or_(v, b.shl(b.zext(fifth, _vec(I8, 64)), ir.Constant(_vec(I8, 64), [4] * 64)))
    return v


def _pair_step(b, k, s, wv, ds, loads, planes, xd, xm, accs, oaccs, wide=False):
    """64 weights wv (two blocks of 32 with scales ds; one block, ds of one, and zero padding)
    against the activations from index k (block s) of each row: the integer products through
    the byte planes into accs, each block's weight scale x activation sum into oaccs. `wide`:
    weights over 127 (IQ4's level + 128), which the low plane's unsigned bytes cannot meet as
    the signed side: it meets them as lo - 128 (signed), and 128 x each lane's weights come back."""
    V16I = _vec(I32, 16)
    zero, eight = ir.Constant(V16I, [0] * 16), ir.Constant(V16I, [8] * 16)
    V2F, two = _vec(FLT, 2), len(ds) == 2
    wsc = _two(b, ds[0], ds[-1], 16)  # the weight scale of each lane
    dsv = b.insert_element(b.insert_element(ir.Constant(V2F, [0.0, 0.0]), ds[0], _const(I32, 0)),
                           ds[-1] if two else ir.Constant(FLT, 0.0), _const(I32, 1))
    if wide:
        back = b.shl(_dpbusd(b, zero, wv, ir.Constant(_vec(I8, 64), [1] * 64)), ir.Constant(V16I, [7] * 16))
    for r, ((lo_p, hi_p), dx, mx, acc, oacc) in enumerate(zip(planes, xd, xm, accs, oaccs)):
        lo, hi = loads(lo_p, k), loads(hi_p, k)
        high = b.shl(_dpbusd(b, zero, wv, hi), eight)
        if wide:
            isum = b.add(_dpbusd(b, high, wv, b.xor(lo, ir.Constant(_vec(I8, 64), [-128] * 64))), back)
        else:
            isum = _dpbusd(b, high, lo, wv)
        if two:  # both blocks' activation scales and sums in one load each
            dxv, mv = _load(b, dx, s, V2F, align=4), _load(b, mx, s, V2F, align=4)
        else:
            dxv = b.insert_element(ir.Constant(V2F, [0.0, 0.0]), _load(b, dx, s, FLT, align=4), _const(I32, 0))
            mv = b.insert_element(ir.Constant(V2F, [0.0, 0.0]), _load(b, mx, s, FLT, align=4), _const(I32, 0))
        sv = b.fmul(wsc, b.shuffle_vector(dxv, dxv, _ivec([0] * 8 + [1] * 8)))
        b.store(b.fadd(b.load(acc), b.fmul(b.sitofp(isum, _vec(FLT, 16)), sv, flags=FAST), flags=FAST), acc)
        b.store(b.fadd(b.load(oacc), b.fmul(dsv, mv)), oacc)  # <2 x float>: each block's scale x sum


def _vnni_pairs(b, name, wdata, nb, planes, xd, xm, accs, oaccs):
    """A row of nb blocks of a PAIRS type at wdata into the rows' accumulators, two blocks a
    step, an odd last block alone; oaccs gather each block's weight scale x its activations'
    scale x sum, which the caller multiplies by -PAIRS[name]."""
    ts = QTYPES_BY_NAME[name].type_size
    qs = {"MXFP4": 1, "Q4_0": 2, "Q5_0": 6, "IQ4_NL": 2}[name]
    scale = (lambda blk: _e8m0_half(b, blk)) if name == "MXFP4" else (lambda blk: _f16(b, blk, 0))  # noqa: E731
    bits = lambda blk: b.bitcast(_u32i(b, blk, 2), _vec(ir.IntType(1), 32))  # noqa: E731  (Q5_0's fifth bits)
    wide = name == "IQ4_NL"
    with cgutils.for_range(b, b.udiv(nb, _const(I64, 2))) as loop:
        blk = b.gep(wdata, [b.mul(loop.index, _const(I64, 2 * ts))])
        blk2 = b.gep(blk, [_const(I64, ts)])
        q = b.shuffle_vector(_load(b, blk, qs, _vec(I8, 16)), _load(b, blk2, qs, _vec(I8, 16)), _ivec(range(32)))
        fifth = b.shuffle_vector(bits(blk), bits(blk2), _ivec(range(64))) if name == "Q5_0" else None
        _pair_step(b, b.mul(loop.index, _const(I64, 64)), b.mul(loop.index, _const(I64, 2)),
                   _nibble_weights(b, name, q, fifth), [scale(blk), scale(blk2)],
                   lambda p, k: _load(b, p, k, _vec(I8, 64)), planes, xd, xm, accs, oaccs, wide)
    last = b.sub(nb, _const(I64, 1))
    with b.if_then(b.icmp_unsigned("!=", b.and_(nb, _const(I64, 1)), _const(I64, 0))):
        blk = b.gep(wdata, [b.mul(last, _const(I64, ts))])
        q = b.shuffle_vector(_load(b, blk, qs, _vec(I8, 16)), ir.Constant(_vec(I8, 16), [0] * 16), _ivec(range(32)))
        none = ir.Constant(_vec(ir.IntType(1), 32), [0] * 32)
        fifth = b.shuffle_vector(bits(blk), none, _ivec(range(64))) if name == "Q5_0" else None
        pad = ir.Constant(_vec(I8, 32), [0] * 32)  # (the padding's activations are zero)
        _pair_step(b, b.mul(last, _const(I64, 32)), last, _nibble_weights(b, name, q, fifth), [scale(blk)],
                   lambda p, k: b.shuffle_vector(_load(b, p, k, _vec(I8, 32)), pad, _ivec(range(64))),
                   planes, xd, xm, accs, oaccs, wide)


def _vnni_iq4xs_block(b, blk, i, planes, xd, xm, accs, oaccs):
    """One IQ4_XS block (256 weights: f16 d, the 6-bit scales' high bits in a u16 and low
    nibbles in 4 bytes, then 8 x 16 quant bytes) as four pair steps, sub-block j's scale
    d x (its 6-bit scale - 32) (see PAIRS)."""
    d = _f16(b, blk, 0)
    high = b.zext(_load(b, blk, 2, I16), I32)
    scales = []
    for j in range(8):
        low = b.and_(b.lshr(b.zext(_load(b, blk, 4 + j // 2, I8), I32), _const(I32, 4 * (j % 2))), _const(I32, 15))
        ls = b.or_(low, b.shl(b.and_(b.lshr(high, _const(I32, 2 * j)), _const(I32, 3)), _const(I32, 4)))
        scales.append(b.fmul(d, b.sitofp(b.sub(ls, _const(I32, 32)), FLT)))
    for t in range(4):
        q = _load(b, blk, 8 + 32 * t, _vec(I8))
        k = b.add(b.mul(i, _const(I64, 256)), _const(I64, 64 * t))
        s = b.add(b.mul(i, _const(I64, 8)), _const(I64, 2 * t))
        _pair_step(b, k, s, _nibble_weights(b, "IQ4_XS", q), scales[2 * t : 2 * t + 2],
                   lambda p, k: _load(b, p, k, _vec(I8, 64)), planes, xd, xm, accs, oaccs, True)


def _vnni_q6_block(b, blk, i, planes, xd, xs, accs, oaccs):
    """One Q6_K block into the rows' accumulators through the byte planes (see VNNI): the
    stored quants u = q + 32, 64 to an instruction; oaccs gather d x scale x dx x (sum of the
    16 activations) per group of 16, which the caller multiplies by -32."""
    V16F = _vec(FLT, 16)
    d = _f16(b, blk, 208)
    sc = b.fmul(_splat(b, d, 16), b.sitofp(_load(b, blk, 192, _vec(I8, 16)), V16F))  # d x the 16 scales
    first, sub0 = b.mul(i, _const(I64, 256)), b.mul(i, _const(I64, 8))
    groups = list(_q6_quants(b, blk, signed=False))  # (first weight, u, ..) of the 8 groups of 32, in order
    dx8 = [_load(b, dx, sub0, _vec(FLT, 8), align=4) for dx in xd]
    for j in range(4):  # weights 64 j .. 64 j + 63: groups of 16 number 4 j .. 4 j + 3
        (o0, u0, _, _), (o1, u1, _, _) = groups[2 * j], groups[2 * j + 1]
        assert (o0, o1) == (64 * j, 64 * j + 32)
        uv = b.shuffle_vector(u0, u1, _ivec(range(64)))
        k = b.add(first, _const(I64, 64 * j))
        lane_sc = b.shuffle_vector(sc, sc, _ivec([4 * j + t // 4 for t in range(16)]))  # a scale per 16 weights = 4 lanes
        for r, ((lo_p, hi_p), acc) in enumerate(zip(planes, accs)):
            isum = _plane_dot(b, uv, lo_p, hi_p, k)
            dxv = b.shuffle_vector(dx8[r], dx8[r], _ivec([2 * j] * 8 + [2 * j + 1] * 8))
            b.store(b.fadd(b.load(acc), b.fmul(b.sitofp(isum, V16F), b.fmul(lane_sc, dxv), flags=FAST), flags=FAST),
                    acc)
    for r, (x16, oacc) in enumerate(zip(xs, oaccs)):
        dxg = b.shuffle_vector(dx8[r], dx8[r], _ivec([g // 2 for g in range(16)]))  # dx of each group's block of 32
        sums = _load(b, x16, b.mul(i, _const(I64, 16)), V16F, align=4)
        b.store(b.fadd(b.load(oacc), b.fmul(b.fmul(sc, dxg), sums)), oacc)


def _make_idot(name: str, rows: int):
    """Intrinsic idot(w, q, d, m, r0, ..): weight row w (raw bytes of type `name`) . activation
    rows r0.. of (q, d, m) = quantize_acts(x), each as float32. A row's sum is the same whatever
    rows share the call."""
    qt = QTYPES_BY_NAME[name]
    bs, ts = qt.block_size, qt.type_size
    subs = bs // A

    def codegen(context, builder, sig, args):
        b = builder
        w = context.make_array(sig.args[0])(context, b, args[0])
        qa, da, ma = (context.make_array(t)(context, b, a) for t, a in zip(sig.args[1:4], args[1:4]))
        k_len = b.extract_value(qa.shape, 1)
        nblk = b.extract_value(da.shape, 1)
        xq = [b.gep(qa.data, [b.mul(r, k_len)]) for r in args[4:]]
        xd = [b.gep(da.data, [b.mul(r, nblk)]) for r in args[4:]]
        mrow = b.extract_value(ma.shape, 1)  # 3 nblk: the blocks' scale x sum, then each 16's sum
        xm = [b.gep(ma.data, [b.mul(r, mrow)]) for r in args[4:]]
        xs = [b.gep(m, [nblk]) for m in xm]
        nb = b.udiv(b.extract_value(w.shape, 0), _const(I64, ts))
        V16F, V8F = _vec(FLT, 16), _vec(FLT, 8)
        per_block = name in ("Q4_1", "Q5_1")  # one offset per block of 32; Q4_K, Q5_K: 8 per block
        accs = [cgutils.alloca_once_value(b, ir.Constant(V16F, [0.0] * 16)) for _ in xq]
        vq6 = name == "Q6_K" and name in VNNI_TYPES  # (its offsets: a <16 x float> per row)
        vpair = name in VNNI_TYPES and (name in PAIRS or name == "IQ4_XS")  # (a float offset per row)
        if per_block:
            zero = ir.Constant(FLT, 0.0)
        elif vpair:  # (a pair of blocks' offsets)
            zero = ir.Constant(_vec(FLT, 2), [0.0, 0.0])
        else:
            zero = ir.Constant(_vec(FLT, 16 if vq6 else 8), [0.0] * (16 if vq6 else 8))
        oaccs = [cgutils.alloca_once_value(b, zero) for _ in xq]
        if name in VNNI_TYPES:  # the byte planes (quantize_acts): lo at 2K bytes into the row, hi at 3K
            kk = b.mul(nblk, _const(I64, A))
            xb = [b.bitcast(x, ir.PointerType(I8)) for x in xq]
            planes = [(b.gep(x, [b.mul(kk, _const(I64, 2))]), b.gep(x, [b.mul(kk, _const(I64, 3))])) for x in xb]
        if vpair and name != "IQ4_XS":
            _vnni_pairs(b, name, w.data, nb, planes, xd, xm, accs, oaccs)
        else:
            with cgutils.for_range(b, nb) as loop:
                i = loop.index
                blk = b.gep(w.data, [b.mul(i, _const(I64, ts))])
                if vq6:
                    _vnni_q6_block(b, blk, i, planes, xd, xs, accs, oaccs)
                elif vpair:
                    _vnni_iq4xs_block(b, blk, i, planes, xd, xm, accs, oaccs)
                elif name in VNNI_TYPES:
                    _vnni_k_block(b, name, blk, i, planes, xd, xm, accs, oaccs)
                else:
                    groups, scales, offsets = _igroups(b, name, blk)
                    first = b.mul(i, _const(I64, bs))
                    sub0 = b.mul(i, _const(I64, subs))
                    if scales is not None:  # each sub-block's weight scale x activation scale, 8 at once
                        sdx = [b.fmul(scales, _load(b, dx, sub0, V8F, align=4)) for dx in xd]
                    for off, wq, scale in groups:
                        k = b.add(first, _const(I64, off))
                        s = b.add(sub0, _const(I64, off // A))
                        for r, (x, dx, acc) in enumerate(zip(xq, xd, accs)):
                            isum = b.sitofp(_pairs(b, wq, _load(b, x, k, _vec(I16), align=2)), V16F)
                            if scales is not None:
                                sv = b.shuffle_vector(sdx[r], sdx[r], _ivec([scale] * 16))
                            elif isinstance(scale.type, ir.VectorType):
                                sv = b.fmul(scale, _splat(b, _load(b, dx, s, FLT, align=4), 16))
                            else:
                                sv = _splat(b, b.fmul(scale, _load(b, dx, s, FLT, align=4)), 16)
                            b.store(b.fadd(b.load(acc), b.fmul(isum, sv, flags=FAST), flags=FAST), acc)
                    if offsets is not None:
                        for mx, oacc in zip(xm, oaccs):
                            mv = _load(b, mx, sub0, FLT if per_block else V8F, align=4)
                            b.store(b.fadd(b.load(oacc), b.fmul(offsets, mv)), oacc)
        sums = [_hsum(b, b.load(acc), 16) for acc in accs]
        if name in ("Q4_1", "Q5_1"):
            sums = [b.fadd(s, b.load(oacc)) for s, oacc in zip(sums, oaccs)]
        elif name in ("Q4_K", "Q5_K"):
            sums = [b.fadd(s, _hsum(b, b.load(oacc), 8)) for s, oacc in zip(sums, oaccs)]
        elif vpair:  # weights + c: minus c x each block's scaled activation sum
            c = _const(FLT, float(PAIRS.get(name, 128)))
            sums = [b.fsub(s, b.fmul(c, _hsum(b, b.load(oacc), 2))) for s, oacc in zip(sums, oaccs)]
        elif vq6:  # q = u - 32: minus 32 x each group's scaled activation sum
            sums = [b.fsub(s, b.fmul(_const(FLT, 32.0), _hsum(b, b.load(oacc), 16))) for s, oacc in zip(sums, oaccs)]
        return sums[0] if rows == 1 else context.make_tuple(b, sig.return_type, sums)

    def typer(typingctx, w, q, d, m, *rs):
        ok = (isinstance(w, types.Array) and w.ndim == 1 and w.dtype == types.uint8 and w.layout == "C"
              and isinstance(q, types.Array) and q.ndim == 2 and q.dtype == types.int16 and q.layout == "C"
              and all(isinstance(a, types.Array) and a.ndim == 2 and a.dtype == types.float32 and a.layout == "C"
                      for a in (d, m))
              and all(isinstance(r, types.Integer) for r in rs))
        if not ok:
            return None
        ret = types.float32 if rows == 1 else types.UniTuple(types.float32, rows)
        return ret(w, q, d, m, *([types.int64] * rows)), codegen

    return _intrinsic_of(typer, "w, q, d, m", [f"r{i}" for i in range(rows)], f"idot{rows}_{name.lower()}")


IDOT1 = {n: _make_idot(n, 1) for n in INT_TYPES}
IDOT2 = {n: _make_idot(n, 2) for n in INT_TYPES}
IDOT4 = {n: _make_idot(n, 4) for n in INT_TYPES}
IDOT8 = {n: _make_idot(n, 8) for n in INT_TYPES}


# -- Q4_K rows repacked sixteen to a group (AVX-512 VNNI) ------------------------------------
# The row kernels above spend most of their work on each 64 weights of one row: two vpdpbusd,
# then a shift, a conversion, the scales' multiply and the float sum, per row. With 16 rows'
# weights side by side (X16: the same 4 weights of 16 rows in one 64-byte vector), each vpdpbusd
# meets 4 activation bytes broadcast to every lane, and a sub-block's integer sums stay in
# int32 until its end: per 64 products one vpdpbusd per activation plane and half a nibble
# unpack, and the conversion and scales once per 32 weights of 16 rows. Measured on the
# 2-core VM (one thread, Q4_K rows of 2048 in cache): 15.3 GB/s as rows, 39.1 repacked.
# Layout of a group (16 rows) and block (256 weights), X16_BLOCK bytes: d of the 16 rows (f16),
# then their dmin (f16), the 6-bit scales as bytes [sub-block][row], the mins likewise, then the
# quants: for each pair of sub-blocks j (weights 64 j ..), each 4 weights k (k = 0..7: 4 k ..
# 4 k + 3 of sub-block 2 j in the low nibbles, of sub-block 2 j + 1 in the high), 16 rows x 4
# bytes. A [N, K] tensor repacks into [N, K / 256 x X16_BLOCK / 16] bytes: the same rows, 2.8%
# more bytes (the scales decoded), so the row loops' chunks of 16 rows and every shape stay.
# Q5_K (the same block with 32 bytes of fifth bits: bit 2 j of byte l is weight 64 j + l's, bit 2 j
# + 1 weight 64 j + 32 + l's) in the same arrangement ("Q5_K_X16"; Q5_K_M files' matrices and
# experts): Q4_K_X16's scales, then the quants of pair j = 0 each followed by the 16 rows'
# fifth-bit bytes 4 k .. 4 k + 3 (k = 0..7), then the quants of pairs 1..3 (X16_Q5_BLOCK bytes:
# 2.3% more than the rows, the scales decoded). In the order the kernel first reads them: with
# the fifth bits after all the quants it moved 15 GB/s from memory against the rows' 27-29.
X16, X16_BLOCK = X16_ROWS, X16_BLOCK_BYTES
Q4_K_X16 = 256 + QTYPES_BY_NAME["Q4_K"].type_id  # (a type id of onebit's own, beside GGUF's)
Q5_K_X16 = 256 + QTYPES_BY_NAME["Q5_K"].type_id


def _x16_frame(context, b, sig, args, block: int):
    """What an X16 dot's code starts from (its args as `dot16_q4_k_x16` takes them): the groups'
    block count nb and first block w0 for weight row n, activation row r's byte planes lo_p,
    hi_p, its block scales xd and its sums row xm, a store of the 16 results, and spread(p, k):
    the 4 activation bytes at p + k in every lane."""
    wa = context.make_array(sig.args[0])(context, b, args[0])
    n = args[1]
    qa, da, ma = (context.make_array(t)(context, b, a) for t, a in zip(sig.args[2:5], args[2:5]))
    r = args[5]
    oa = context.make_array(sig.args[6])(context, b, args[6])
    col = args[7]
    rb = b.extract_value(wa.strides, 0)  # bytes a row
    nb = b.udiv(b.mul(rb, _const(I64, X16)), _const(I64, block))
    w0 = b.gep(wa.data, [b.mul(n, rb)])
    k_len, nblk = b.extract_value(qa.shape, 1), b.extract_value(da.shape, 1)
    xb = b.bitcast(b.gep(qa.data, [b.mul(r, k_len)]), ir.PointerType(I8))
    kk = b.mul(nblk, _const(I64, A))
    lo_p, hi_p = b.gep(xb, [b.mul(kk, _const(I64, 2))]), b.gep(xb, [b.mul(kk, _const(I64, 3))])
    xd = b.gep(da.data, [b.mul(r, nblk)])
    xm = b.gep(ma.data, [b.mul(r, b.extract_value(ma.shape, 1))])
    V16F = _vec(FLT, 16)

    def store(res):
        ob = b.gep(oa.data, [b.add(b.mul(r, b.extract_value(oa.shape, 1)), col)])
        b.store(res, b.bitcast(ob, ir.PointerType(V16F)), align=4)

    def spread(p, k):
        return b.bitcast(_splat(b, _load(b, p, k, I32), 16), _vec(I8, 64))

    return nb, w0, lo_p, hi_p, xd, xm, nblk, store, spread


def _x16_typer(codegen):
    """The typing of an X16 dot intrinsic (see `dot16_q4_k_x16`) with its code `codegen`."""
    def typer(typingctx, w, n, q, d, m, r, out, col):
        ok = (isinstance(w, types.Array) and w.ndim == 2 and w.dtype == types.uint8 and w.layout == "C"
              and isinstance(q, types.Array) and q.ndim == 2 and q.dtype == types.int16 and q.layout == "C"
              and all(isinstance(a, types.Array) and a.ndim == 2 and a.dtype == types.float32 and a.layout == "C"
                      for a in (d, m, out)))
        if not ok:
            return None
        return types.none(w, types.int64, q, d, m, types.int64, out, types.int64), codegen
    return typer


def _bit4(b, v, i: int):
    """<64 x i8>: bit i of each byte of v, moved to bit 4 (0x10 or 0)."""
    V64 = _vec(I8, 64)
    if i < 4:
        v = b.shl(v, ir.Constant(V64, [4 - i] * 64))
    elif i > 4:
        v = b.lshr(v, ir.Constant(V64, [i - 4] * 64))
    return b.and_(v, ir.Constant(V64, [16] * 64))


def _q5_at(j, k):
    """Where Q5_K_X16's quant vector (pair j, 4 weights k) starts in its block (its fifth bits:
    _q5_at(0, k) + 64). Its code's and (as _q5_at_jit) its repack's."""
    return 320 + 128 * k if j == 0 else 1344 + 512 * (j - 1) + 64 * k


_q5_at_jit = njit(inline="always")(_q5_at)


def _k_x16_codegen(five: bool):
    """The dot of Q4_K_X16 weights, or (five) of Q5_K_X16: the same with each quant's fifth bit."""
    block = X16_Q5_BLOCK if five else X16_BLOCK
    return lambda context, builder, sig, args: _k_x16_code(context, builder, sig, args, block, five)


def _k_x16_code(context, builder, sig, args, block: int, five: bool):
    b = builder
    nb, w0, lo_p, hi_p, xd, xm, _, store, spread = _x16_frame(context, b, sig, args, block)
    V16F, V16I, V64 = _vec(FLT, 16), _vec(I32, 16), _vec(I8, 64)
    acc = cgutils.alloca_once_value(b, ir.Constant(V16F, [0.0] * 16))
    off = cgutils.alloca_once_value(b, ir.Constant(V16F, [0.0] * 16))
    zero = ir.Constant(V16I, [0] * 16)

    with cgutils.for_range(b, nb) as loop:
        i = loop.index
        blk = b.gep(w0, [b.mul(i, _const(I64, block))])
        d = b.fpext(_load(b, blk, 0, _vec(HALF, 16)), V16F)
        dmin = b.fpext(_load(b, blk, 32, _vec(HALF, 16)), V16F)
        first = b.mul(i, _const(I64, 256))
        for j in range(4):
            sums = [zero] * 4  # sub-block 2 j: high plane, low plane; 2 j + 1: the same
            for k in range(8):
                wv = _load(b, blk, _q5_at(j, k) if five else 320 + 64 * (8 * j + k), V64)
                lo4, hi4 = b.and_(wv, ir.Constant(V64, [15] * 64)), b.lshr(wv, ir.Constant(V64, [4] * 64))
                if five:
                    qh = _load(b, blk, _q5_at(0, k) + 64, V64)
                    lo4, hi4 = b.or_(lo4, _bit4(b, qh, 2 * j)), b.or_(hi4, _bit4(b, qh, 2 * j + 1))
                for h, q in enumerate((lo4, hi4)):
                    at = b.add(first, _const(I64, 64 * j + 32 * h + 4 * k))
                    sums[2 * h] = _dpbusd(b, sums[2 * h], q, spread(hi_p, at))
                    sums[2 * h + 1] = _dpbusd(b, sums[2 * h + 1], spread(lo_p, at), q)
            for h in range(2):
                sub = 2 * j + h
                isum = b.add(b.shl(sums[2 * h], ir.Constant(V16I, [8] * 16)), sums[2 * h + 1])
                sc = b.uitofp(_load(b, blk, 64 + 16 * sub, _vec(I8, 16)), V16F)
                mn = b.uitofp(_load(b, blk, 192 + 16 * sub, _vec(I8, 16)), V16F)
                s = b.add(b.mul(i, _const(I64, 8)), _const(I64, sub))
                dx, mx = _splat(b, _load(b, xd, s, FLT, align=4), 16), _splat(b, _load(b, xm, s, FLT, align=4), 16)
                scale = b.fmul(b.fmul(d, sc), dx)
                b.store(b.fadd(b.load(acc), b.fmul(b.sitofp(isum, V16F), scale, flags=FAST), flags=FAST), acc)
                b.store(b.fadd(b.load(off), b.fmul(b.fmul(dmin, mn), mx)), off)
    store(b.fsub(b.load(acc), b.load(off)))
    return context.get_dummy_value()


dot16_q4_k_x16 = intrinsic(_x16_typer(_k_x16_codegen(False)))
dot16_q4_k_x16.__doc__ = """out[r, col : col + 16] = rows n .. n + 15 of X16-packed Q4_K weights w (uint8
[N, row bytes], n a multiple of 16) . activation row r of (q, d, m) = quantize_acts(x)."""
dot16_q5_k_x16 = intrinsic(_x16_typer(_k_x16_codegen(True)))
dot16_q5_k_x16.__doc__ = """`dot16_q4_k_x16` for Q5_K_X16 weights."""


# Q6_K in the same arrangement ("Q6_K_X16"; first for the experts' short rows: 3 blocks a row on the
# 30B-A3B shape's down matrices, where the row kernel moved 8.5 GB/s from memory on one thread;
# then matrices too, as Q4_K_M files' output heads, attn_v and half their ffn_down).
# A group and block, X16_Q6_BLOCK = 16 x 210 bytes: d of the 16 rows (f16), the int8 scales
# [sub-block of 16][row], then for k = 0..15, 192 bytes in the order the kernel reads them (three
# vectors of 16 rows x 4 bytes; with the low and high bits apart, the kernel's three streams cost
# it half its speed from memory): the low 4 bits of the stored values u = q + 32 (0..63) of
# weights 4 k .. 4 k + 3 (low nibbles) and 4 (k + 32) .. (high); those of 4 (k + 16) .. and
# 4 (k + 48) ..; then the high 2 bits of 4 k .., 4 (k + 16) .., 4 (k + 32) .., 4 (k + 48) .. in
# bits 0-1, 2-3, 4-5, 6-7. The same bytes as the rows, so every shape stays.
Q6_K_X16 = 256 + QTYPES_BY_NAME["Q6_K"].type_id
Q6_Q = 32 + 256  # where the quants start


def _x16_q6_codegen(context, builder, sig, args):
    b = builder
    nb, w0, lo_p, hi_p, xd, xm, nblk, store, spread = _x16_frame(context, b, sig, args, X16_Q6_BLOCK)
    xs = b.gep(xm, [nblk])  # each 16 values' sum
    V16F, V16I, V64 = _vec(FLT, 16), _vec(I32, 16), _vec(I8, 64)
    acc = cgutils.alloca_once_value(b, ir.Constant(V16F, [0.0] * 16))
    off = cgutils.alloca_once_value(b, ir.Constant(V16F, [0.0] * 16))
    zero = ir.Constant(V16I, [0] * 16)
    nib, two = ir.Constant(V64, [15] * 64), ir.Constant(V64, [3] * 64)

    def shr(v, k):
        return b.lshr(v, ir.Constant(V64, [k] * 64)) if k else v

    with cgutils.for_range(b, nb) as loop:
        i = loop.index
        blk = b.gep(w0, [b.mul(i, _const(I64, X16_Q6_BLOCK))])
        d = b.fpext(_load(b, blk, 0, _vec(HALF, 16)), V16F)
        first = b.mul(i, _const(I64, 256))
        for s in range(4):  # sub-blocks s, s + 4, s + 8, s + 12 (16 weights each) at once
            sums = [zero] * 8  # per sub-block: high plane, low plane
            for k4 in range(4):
                k = 4 * s + k4
                l0, l1, hv = (_load(b, blk, Q6_Q + 192 * k + 64 * v, V64) for v in range(3))
                for idx, (lv, lsh, hsh) in enumerate(((l0, 0, 0), (l1, 0, 2), (l0, 4, 4), (l1, 4, 6))):
                    q = b.or_(b.and_(shr(lv, lsh), nib), b.shl(b.and_(shr(hv, hsh), two), ir.Constant(V64, [4] * 64)))
                    at = b.add(first, _const(I64, 4 * (k + 16 * idx)))
                    sums[2 * idx] = _dpbusd(b, sums[2 * idx], q, spread(hi_p, at))
                    sums[2 * idx + 1] = _dpbusd(b, sums[2 * idx + 1], spread(lo_p, at), q)
            for idx in range(4):
                sub = s + 4 * idx
                isum = b.add(b.shl(sums[2 * idx], ir.Constant(V16I, [8] * 16)), sums[2 * idx + 1])
                sc = b.sitofp(_load(b, blk, 32 + 16 * sub, _vec(I8, 16)), V16F)
                at = b.add(b.mul(i, _const(I64, 8)), _const(I64, sub // 2))
                dx = _splat(b, _load(b, xd, at, FLT, align=4), 16)
                sx = _splat(b, _load(b, xs, b.add(b.mul(i, _const(I64, 16)), _const(I64, sub)), FLT, align=4), 16)
                scale = b.fmul(b.fmul(d, sc), dx)
                b.store(b.fadd(b.load(acc), b.fmul(b.sitofp(isum, V16F), scale, flags=FAST), flags=FAST), acc)
                b.store(b.fadd(b.load(off), b.fmul(scale, sx)), off)
    store(b.fsub(b.load(acc), b.fmul(b.load(off), ir.Constant(V16F, [32.0] * 16))))
    return context.get_dummy_value()


dot16_q6_k_x16 = intrinsic(_x16_typer(_x16_q6_codegen))
dot16_q6_k_x16.__doc__ = """`dot16_q4_k_x16` for Q6_K_X16 weights."""


# MXFP4, Q4_0 and Q5_0 (32 weights a block: a scale, Q5_0's 32 fifth bits, then 16 bytes whose low
# nibbles are weights 0-15 and high nibbles 16-31) in the same arrangement ("MXFP4_X16",
# "Q4_0_X16", "Q5_0_X16"; gpt-oss's experts, Q4_0 files' experts and matrices, the Q5_0 matrices
# that Q4_K_M files hold where a row is not a multiple of 256, as Gemma 3's). Measured (2-core
# VM, both threads, bench_roofline): gpt-oss-20b's experts (4 of 32, 2880 x 2880) MXFP4 18-24 GB/s
# as rows, 29-48 repacked; prompt 114-121 -> 211-217 GFLOP/s. A group and block, 16 x the type's
# block bytes: the 16 rows' scales (MXFP4's e8m0 bytes, Q4_0's and Q5_0's f16), Q5_0's 16 words
# of fifth bits, then for k = 0..3 the 16 rows' quant bytes 4 k .. 4 k + 3 (weights 4 k .. 4 k +
# 3 in the low nibbles, 16 + 4 k .. in the high). The weights meet the activation planes as
# unsigned bytes, as PAIRS (MXFP4 through its table: the doubled e2m1 value + 12; Q4_0 as stored,
# 0..15 = q + 8; Q5_0 with its fifth bit, 0..31 = q + 16), and c x each block's activation sum
# comes off with the scales. The same bytes as the rows, so every shape stays.
NIBBLE_X16 = ("MXFP4", "Q4_0", "Q5_0")
X16_TYPES = ("Q4_K", "Q5_K", "Q6_K", "IQ4_XS", "Q8_0") + NIBBLE_X16  # the types with an X16 layout
MXFP4_X16, Q4_0_X16, Q5_0_X16 = (256 + QTYPES_BY_NAME[n].type_id for n in NIBBLE_X16)
# FIFTH[x]: the 4 bits of x (0..15) as 0x10 in bytes 0..3 of a word (bit b -> byte b).
FIFTH = [sum(((x >> i) & 1) << (8 * i + 4) for i in range(4)) for x in range(16)]


def _fifths(b, qh, shift: int):
    """<64 x i8>: in each 32-bit lane (a row), bits shift .. shift + 3 of its Q5_0 fifth bits qh
    (<16 x i32>) as 0x10 in bytes 0..3 (vpermd on FIFTH, which reads an index's low 4 bits)."""
    V16I = _vec(I32, 16)
    fn = cgutils.get_or_insert_function(b.module, ir.FunctionType(V16I, [V16I, V16I]), "llvm.x86.avx512.permvar.si.512")
    idx = b.lshr(qh, ir.Constant(V16I, [shift] * 16)) if shift else qh
    return b.bitcast(b.call(fn, [ir.Constant(V16I, FIFTH), idx]), _vec(I8, 64))


def _nibble_x16_codegen(name: str):
    ts = QTYPES_BY_NAME[name].type_size
    sb = ts - 16  # scale (and fifth-bit) bytes a row's block
    c = float(PAIRS[name])

    def codegen(context, builder, sig, args):
        b = builder
        nb, w0, lo_p, hi_p, xd, xm, _, store, spread = _x16_frame(context, b, sig, args, X16 * ts)
        V16F, V16I, V64 = _vec(FLT, 16), _vec(I32, 16), _vec(I8, 64)
        acc = cgutils.alloca_once_value(b, ir.Constant(V16F, [0.0] * 16))
        off = cgutils.alloca_once_value(b, ir.Constant(V16F, [0.0] * 16))
        zero = ir.Constant(V16I, [0] * 16)
        with cgutils.for_range(b, nb) as loop:
            i = loop.index
            blk = b.gep(w0, [b.mul(i, _const(I64, X16 * ts))])
            if name == "MXFP4":  # the 16 e8m0 bytes as ggml's e8m0_to_fp32_half (`_e8m0_half`), at once
                e = b.zext(_load(b, blk, 0, _vec(I8, 16)), V16I)
                small = b.shl(ir.Constant(V16I, [0x00200000] * 16), e)
                big = b.shl(b.sub(e, ir.Constant(V16I, [1] * 16)), ir.Constant(V16I, [23] * 16))
                dw = b.bitcast(b.select(b.icmp_unsigned("<", e, ir.Constant(V16I, [2] * 16)), small, big), V16F)
            else:
                dw = b.fpext(_load(b, blk, 0, _vec(HALF, 16)), V16F)
            if name == "Q5_0":
                qh = _load(b, blk, 32, V16I)
            first = b.mul(i, _const(I64, 32))
            hi_sum, lo_sum = zero, zero
            for k in range(4):
                wv = _load(b, blk, X16 * sb + 64 * k, V64)
                lo4, hi4 = b.and_(wv, ir.Constant(V64, [15] * 64)), b.lshr(wv, ir.Constant(V64, [4] * 64))
                if name == "MXFP4":
                    lo4, hi4 = _pshufb(b, MXFP4_PLUS12, lo4), _pshufb(b, MXFP4_PLUS12, hi4)
                elif name == "Q5_0":
                    lo4, hi4 = b.or_(lo4, _fifths(b, qh, 4 * k)), b.or_(hi4, _fifths(b, qh, 16 + 4 * k))
                for h, q in enumerate((lo4, hi4)):
                    at = b.add(first, _const(I64, 16 * h + 4 * k))
                    hi_sum = _dpbusd(b, hi_sum, q, spread(hi_p, at))
                    lo_sum = _dpbusd(b, lo_sum, spread(lo_p, at), q)
            isum = b.add(b.shl(hi_sum, ir.Constant(V16I, [8] * 16)), lo_sum)
            dx, mx = _splat(b, _load(b, xd, i, FLT, align=4), 16), _splat(b, _load(b, xm, i, FLT, align=4), 16)
            b.store(b.fadd(b.load(acc), b.fmul(b.sitofp(isum, V16F), b.fmul(dw, dx), flags=FAST), flags=FAST), acc)
            b.store(b.fadd(b.load(off), b.fmul(dw, mx)), off)
        store(b.fsub(b.load(acc), b.fmul(b.load(off), ir.Constant(V16F, [c] * 16))))
        return context.get_dummy_value()

    return codegen


dot16_mxfp4_x16 = intrinsic(_x16_typer(_nibble_x16_codegen("MXFP4")))
dot16_mxfp4_x16.__doc__ = """`dot16_q4_k_x16` for MXFP4_X16 weights."""
dot16_q4_0_x16 = intrinsic(_x16_typer(_nibble_x16_codegen("Q4_0")))
dot16_q4_0_x16.__doc__ = """`dot16_q4_k_x16` for Q4_0_X16 weights."""
dot16_q5_0_x16 = intrinsic(_x16_typer(_nibble_x16_codegen("Q5_0")))
dot16_q5_0_x16.__doc__ = """`dot16_q4_k_x16` for Q5_0_X16 weights."""


# IQ4_XS (256 weights a block: f16 d, the 8 sub-blocks' 6-bit scales as 2 high bits in a u16 and
# a low nibble in 4 bytes, then 8 x 16 quant bytes, low nibbles weights 0-15 of each 32, high
# 16-31) in the same arrangement ("IQ4_XS_X16"): a group and block, 16 x 136 bytes (the same
# bytes): d of the 16 rows (f16), their u16 of high scale bits, the 4 bytes of low scale nibbles
# as [byte][row], then for each sub-block j and k = 0..3 the 16 rows' quant bytes 16 j + 4 k ..
# 16 j + 4 k + 3. A quant's level (-127..113, IQ4_NL's table) needs both byte signs: it meets the
# signed high plane as u = level + 128 (unsigned, through vpshufb) and the unsigned low plane as
# the signed level (u ^ 0x80), so sum level x v = 256 sum u hi + sum level lo - 32768 sum hi, the
# last per block of 32 from `quantize_acts` (d x the sum of its high bytes).
IQ4_XS_X16_BLOCK = 16 * 136
IQ4_XS_X16 = 256 + QTYPES_BY_NAME["IQ4_XS"].type_id


def _signed_frame(context, b, sig, args, block: int):
    """`_x16_frame` for the layouts whose weights meet both activation planes signed (IQ4_XS_X16,
    Q8_0_X16), with the blocks' d x sum of high bytes xh and the accumulators acc, off."""
    nb, w0, lo_p, hi_p, xd, xm, nblk, store, spread = _x16_frame(context, b, sig, args, block)
    xh = b.gep(xm, [b.mul(nblk, _const(I64, 3))])  # each block's d x sum of high bytes
    V16F = _vec(FLT, 16)
    acc = cgutils.alloca_once_value(b, ir.Constant(V16F, [0.0] * 16))
    off = cgutils.alloca_once_value(b, ir.Constant(V16F, [0.0] * 16))
    return nb, w0, lo_p, hi_p, xd, xh, acc, off, store, spread


def _signed_pair(b, sums, u, at, lo_p, hi_p, spread):
    """(hi, lo) sums plus 64 weights given as u = level + 128 (unsigned) against the 4 activation
    bytes at `at`: u against the signed high plane, the signed level (u ^ 0x80) against the low."""
    V64 = _vec(I8, 64)
    hi_sum = _dpbusd(b, sums[0], u, spread(hi_p, at))
    return hi_sum, _dpbusd(b, sums[1], spread(lo_p, at), b.xor(u, ir.Constant(V64, [-128] * 64)))


def _signed_block(b, sums, dw, acc, off, xd, xh, s):
    """Add a block of 32 (index s)'s (hi, lo) sums, scaled by dw (its 16 rows' scales) and the
    activations' d, to acc; its d x sum of high bytes x dw to off (`_signed_result` takes it off)."""
    V16F, V16I = _vec(FLT, 16), _vec(I32, 16)
    isum = b.add(b.shl(sums[0], ir.Constant(V16I, [8] * 16)), sums[1])
    dx, mh = _splat(b, _load(b, xd, s, FLT, align=4), 16), _splat(b, _load(b, xh, s, FLT, align=4), 16)
    b.store(b.fadd(b.load(acc), b.fmul(b.sitofp(isum, V16F), b.fmul(dw, dx), flags=FAST), flags=FAST), acc)
    b.store(b.fadd(b.load(off), b.fmul(dw, mh)), off)


def _signed_result(b, store, acc, off):
    store(b.fsub(b.load(acc), b.fmul(b.load(off), ir.Constant(_vec(FLT, 16), [32768.0] * 16))))


def _x16_iq4xs_codegen(context, builder, sig, args):
    b = builder
    nb, w0, lo_p, hi_p, xd, xh, acc, off, store, spread = _signed_frame(context, b, sig, args, IQ4_XS_X16_BLOCK)
    V16F, V16I, V64 = _vec(FLT, 16), _vec(I32, 16), _vec(I8, 64)
    zero = ir.Constant(V16I, [0] * 16)
    splat = lambda v: ir.Constant(V16I, [v] * 16)  # noqa: E731
    with cgutils.for_range(b, nb) as loop:
        i = loop.index
        blk = b.gep(w0, [b.mul(i, _const(I64, IQ4_XS_X16_BLOCK))])
        d = b.fpext(_load(b, blk, 0, _vec(HALF, 16)), V16F)
        high = b.zext(_load(b, blk, 32, _vec(I16, 16)), V16I)
        # (the sub-blocks as a loop: unrolled, their code spilled registers; 28 -> 35-39 GB/s on the 30B experts)
        with cgutils.for_range(b, _const(I64, 8)) as sub:
            j = sub.index
            j32 = b.trunc(j, I32)
            scale_bytes = b.gep(blk, [b.mul(b.lshr(j, _const(I64, 1)), _const(I64, 16))])  # (byte j // 2 of 4)
            low = b.zext(_load(b, scale_bytes, 64, _vec(I8, 16)), V16I)
            low = b.and_(b.lshr(low, _splat(b, b.shl(b.and_(j32, _const(I32, 1)), _const(I32, 2)), 16)), splat(15))
            ls = b.or_(low, b.shl(b.and_(b.lshr(high, _splat(b, b.shl(j32, _const(I32, 1)), 16)), splat(3)), splat(4)))
            dsc = b.fmul(d, b.sitofp(b.sub(ls, splat(32)), V16F))
            qj = b.gep(blk, [b.add(_const(I64, 128), b.mul(j, _const(I64, 256)))])
            first = b.add(b.mul(i, _const(I64, 256)), b.mul(j, _const(I64, 32)))
            sums = zero, zero
            for k in range(4):
                wv = _load(b, qj, 64 * k, V64)
                lo4, hi4 = b.and_(wv, ir.Constant(V64, [15] * 64)), b.lshr(wv, ir.Constant(V64, [4] * 64))
                for h, q in enumerate((lo4, hi4)):
                    at = b.add(first, _const(I64, 16 * h + 4 * k))
                    sums = _signed_pair(b, sums, _pshufb(b, IQ4_PLUS128, q), at, lo_p, hi_p, spread)
            _signed_block(b, sums, dsc, acc, off, xd, xh, b.add(b.mul(i, _const(I64, 8)), j))
    _signed_result(b, store, acc, off)
    return context.get_dummy_value()


dot16_iq4_xs_x16 = intrinsic(_x16_typer(_x16_iq4xs_codegen))
dot16_iq4_xs_x16.__doc__ = """`dot16_q4_k_x16` for IQ4_XS_X16 weights."""


# Q8_0 (32 weights a block: f16 d, 32 signed bytes) in the same arrangement ("Q8_0_X16"; gpt-oss's
# attention and output head, Q8_0 files' matrices and experts): a group and block, 16 x 34 bytes
# (the same bytes): the 16 rows' d, then for k = 0..7 the 16 rows' quant bytes 4 k .. 4 k + 3. A
# signed quant q meets the signed high activation plane as the unsigned q + 128 (q ^ 0x80) and the
# unsigned low plane as itself, so sum q x v = 256 sum (q + 128) hi + sum q lo - 32768 sum hi, the
# last as IQ4_XS_X16's.
Q8_0_X16 = 256 + QTYPES_BY_NAME["Q8_0"].type_id


def _x16_q8_0_codegen(context, builder, sig, args):
    b = builder
    nb, w0, lo_p, hi_p, xd, xh, acc, off, store, spread = _signed_frame(context, b, sig, args, X16 * 34)
    V16F, V16I, V64 = _vec(FLT, 16), _vec(I32, 16), _vec(I8, 64)
    zero = ir.Constant(V16I, [0] * 16)
    with cgutils.for_range(b, nb) as loop:
        i = loop.index
        blk = b.gep(w0, [b.mul(i, _const(I64, X16 * 34))])
        d = b.fpext(_load(b, blk, 0, _vec(HALF, 16)), V16F)
        first = b.mul(i, _const(I64, 32))
        sums = zero, zero
        for k in range(8):
            u = b.xor(_load(b, blk, 32 + 64 * k, V64), ir.Constant(V64, [-128] * 64))  # q + 128
            sums = _signed_pair(b, sums, u, b.add(first, _const(I64, 4 * k)), lo_p, hi_p, spread)
        _signed_block(b, sums, d, acc, off, xd, xh, i)
    _signed_result(b, store, acc, off)
    return context.get_dummy_value()


dot16_q8_0_x16 = intrinsic(_x16_typer(_x16_q8_0_codegen))
dot16_q8_0_x16.__doc__ = """`dot16_q4_k_x16` for Q8_0_X16 weights."""


# The repacks index with unsigned 64-bit integers: a signed index makes numba test it for a
# negative value (numpy's wraparound) at every byte, which kept LLVM from joining four byte
# loads into one and held the MXFP4 and Q4_0 repacks to 1.7 GB/s on one thread (6.9 unsigned;
# Q4_K 6.1 -> 9.6): a pool's reader packs each expert it reads, and a resident load packs them all.
U = np.uint64


@njit(inline="always")
def _word(r8, q):
    """The little-endian 32-bit word of bytes r8[q .. q + 3] (q unsigned, any alignment)."""
    return (np.uint32(r8[q]) | (np.uint32(r8[q + U(1)]) << 8) | (np.uint32(r8[q + U(2)]) << 16)
            | (np.uint32(r8[q + U(3)]) << 24))


@njit(inline="always")
def _repack_iq4xs_group(r8, rb, o, o32, g, nb):
    """Group g (unsigned; rows 16 g .. 16 g + 15) of IQ4_XS rows r8 (uint8, flat, rb bytes a row
    of nb blocks) into o (uint8, flat; o32: the same as words) as IQ4_XS_X16."""
    for r in range(X16):
        row = (g * U(X16) + U(r)) * rb
        for i in range(nb):
            base, s = (g * nb + U(i)) * U(IQ4_XS_X16_BLOCK), row + U(i) * U(136)
            o[base + U(2 * r)], o[base + U(2 * r + 1)] = r8[s], r8[s + U(1)]
            o[base + U(32 + 2 * r)], o[base + U(33 + 2 * r)] = r8[s + U(2)], r8[s + U(3)]
            for t in range(4):
                o[base + U(64 + 16 * t + r)] = r8[s + U(4 + t)]
            w0 = (base + U(128)) // U(4) + U(r)
            for jk in range(32):  # (sub-block j = jk // 4, k = jk % 4: bytes 8 + 4 jk ..)
                o32[w0 + U(X16 * jk)] = _word(r8, s + U(8 + 4 * jk))


@njit(parallel=True, cache=True, nogil=True)
def repack_iq4_xs_x16(raw, out):
    """IQ4_XS rows raw (uint8 [N, K / 256 x 136], N a multiple of 16) -> out (the same shape) as
    IQ4_XS_X16, on every thread."""
    r8, rb, o = raw.reshape(-1), U(raw.shape[1]), out.reshape(-1)
    o32 = o.view(np.uint32)
    for g in prange(raw.shape[0] // X16):
        _repack_iq4xs_group(r8, rb, o, o32, U(g), rb // U(136))


@njit(cache=True, nogil=True)
def repack_iq4_xs_x16_serial(raw, out):
    """`repack_iq4_xs_x16` on the calling thread."""
    r8, rb, o = raw.reshape(-1), U(raw.shape[1]), out.reshape(-1)
    o32 = o.view(np.uint32)
    for g in range(raw.shape[0] // X16):
        _repack_iq4xs_group(r8, rb, o, o32, U(g), rb // U(136))


@njit(inline="always")
def _repack_plain_group(r8, rb, o, o32, g, ts, qb):
    """Group g of MXFP4, Q4_0, Q5_0 or Q8_0 rows (`_repack_iq4xs_group`'s arguments; blocks of ts
    bytes: a scale, Q5_0's 4 bytes of fifth bits, then qb quant bytes) in their X16 layout: the 16
    rows' scales, their fifth bits, then the quants, 4 bytes (a 32-bit word) at a time."""
    sb, nb = ts - qb, rb // ts
    fb = min(sb, U(2))  # the scale's bytes (MXFP4's 1, the others' f16); then Q5_0's fifth bits
    for r in range(X16):
        row = (g * U(X16) + U(r)) * rb
        for i in range(nb):
            base, s = (g * nb + U(i)) * U(X16) * ts, row + U(i) * ts
            for j in range(fb):
                o[base + fb * U(r) + U(j)] = r8[s + U(j)]
            if sb > fb:
                o32[(base + U(X16) * fb) // U(4) + U(r)] = _word(r8, s + fb)
            w0 = (base + U(X16) * sb) // U(4) + U(r)
            for k in range(qb // U(4)):
                o32[w0 + U(X16) * U(k)] = _word(r8, s + sb + U(4) * U(k))


@njit(parallel=True, cache=True, nogil=True)
def repack_plain_x16(raw, out, ts, qb):
    """MXFP4 (ts = 17, qb = 16), Q4_0 (18, 16), Q5_0 (22, 16) or Q8_0 (34, 32) rows raw (uint8 [N, K / 32 x ts],
    N a multiple of 16) -> out (the same shape) in their X16 layout, on every thread."""
    r8, rb, o = raw.reshape(-1), U(raw.shape[1]), out.reshape(-1)
    o32 = o.view(np.uint32)
    for g in prange(raw.shape[0] // X16):
        _repack_plain_group(r8, rb, o, o32, U(g), U(ts), U(qb))


@njit(cache=True, nogil=True)
def repack_plain_x16_serial(raw, out, ts, qb):
    """`repack_plain_x16` on the calling thread."""
    r8, rb, o = raw.reshape(-1), U(raw.shape[1]), out.reshape(-1)
    o32 = o.view(np.uint32)
    for g in range(raw.shape[0] // X16):
        _repack_plain_group(r8, rb, o, o32, U(g), U(ts), U(qb))


@njit(inline="always")
def _repack_group(r8, rb, o, o32, g, nb, ts, xb):
    """Group g of Q4_K rows (`_repack_iq4xs_group`'s arguments) in the X16 layout; of Q5_K rows
    (ts = 176 bytes a block, xb = X16_Q5_BLOCK) in Q5_K_X16."""
    w = r8.view(np.uint32)  # (a row is 144 or 176 bytes a block: its quants are word aligned)
    for r in range(X16):
        row = (g * U(X16) + U(r)) * rb
        for i in range(nb):
            base, s = (g * nb + U(i)) * xb, row + U(i) * ts
            o[base + U(2 * r)], o[base + U(2 * r + 1)] = r8[s], r8[s + U(1)]
            o[base + U(32 + 2 * r)], o[base + U(33 + 2 * r)] = r8[s + U(2)], r8[s + U(3)]
            for t in range(8):
                if t < 4:
                    sc, mn = r8[s + U(4 + t)] & 63, r8[s + U(8 + t)] & 63
                else:
                    sc = (r8[s + U(8 + t)] & 15) | ((r8[s + U(t)] >> 6) << 4)
                    mn = (r8[s + U(8 + t)] >> 4) | ((r8[s + U(4 + t)] >> 6) << 4)
                o[base + U(64 + 16 * t + r)] = sc
                o[base + U(192 + 16 * t + r)] = mn
            q0 = (s + ts - U(128)) // U(4)  # (4 weights a word)
            if ts == U(144):
                at = (base + U(320)) // U(4) + U(r)
                for jk in range(32):
                    o32[at + U(X16 * jk)] = w[q0 + U(jk)]
            else:  # Q5_K: the quants where _q5_at says, the fifth bits after pair 0's
                h0 = (s + U(16)) // U(4)
                for jk in range(32):
                    o32[(base + U(_q5_at_jit(jk // 8, jk % 8))) // U(4) + U(r)] = w[q0 + U(jk)]
                for k in range(8):
                    o32[(base + U(_q5_at_jit(0, k) + 64)) // U(4) + U(r)] = w[h0 + U(k)]


@njit(parallel=True, cache=True, nogil=True)
def repack_k_x16(raw, out, ts, xb):
    """Q4_K rows raw (uint8 [N, K / 256 x 144], N a multiple of 16; ts = 144, xb = X16_BLOCK) or
    Q5_K rows (ts = 176, xb = X16_Q5_BLOCK) -> out (uint8 [N, K / 256 x xb / 16]) in their X16
    layout, on every thread."""
    r8, rb, o = raw.reshape(-1), U(raw.shape[1]), out.reshape(-1)
    o32 = o.view(np.uint32)
    for g in prange(raw.shape[0] // X16):
        _repack_group(r8, rb, o, o32, U(g), rb // U(ts), U(ts), U(xb))


@njit(cache=True, nogil=True)
def repack_k_x16_serial(raw, out, ts, xb):
    """`repack_k_x16` on the calling thread (an expert pool's reader threads: one expert each)."""
    r8, rb, o = raw.reshape(-1), U(raw.shape[1]), out.reshape(-1)
    o32 = o.view(np.uint32)
    for g in range(raw.shape[0] // X16):
        _repack_group(r8, rb, o, o32, U(g), rb // U(ts), U(ts), U(xb))


@njit(inline="always")
def _repack_q6_group(r8, rb, o, o32, g, nb):
    """Group g of Q6_K rows (`_repack_iq4xs_group`'s arguments) as Q6_K_X16, 4 weights a 32-bit
    word (one block's bytes first copied to an aligned buffer: rows of 210 bytes are not)."""
    M4, M2 = np.uint32(0x0F0F0F0F), np.uint32(0x03030303)
    blk = np.empty(56, np.uint32)  # one row's block (210 bytes), word aligned
    b8 = blk.view(np.uint8)
    u = np.empty(64, np.uint32)  # its 256 stored values u = q + 32, 4 to a word, in weight order
    for r in range(X16):
        row = (g * U(X16) + U(r)) * rb
        for i in range(nb):
            base, s = (g * nb + U(i)) * U(X16_Q6_BLOCK), row + U(i) * U(210)
            for q in range(52):
                blk[q] = _word(r8, s + U(4 * q))
            b8[208], b8[209] = r8[s + U(208)], r8[s + U(209)]
            for h in range(2):  # ggml's dequantize_row_q6_K order, 4 values at once
                for l4 in range(8):
                    a, c, qh = blk[16 * h + l4], blk[16 * h + 8 + l4], blk[32 + 8 * h + l4]
                    u[32 * h + l4] = (a & M4) | ((qh & M2) << 4)
                    u[32 * h + 8 + l4] = (c & M4) | (((qh >> 2) & M2) << 4)
                    u[32 * h + 16 + l4] = ((a >> 4) & M4) | (((qh >> 4) & M2) << 4)
                    u[32 * h + 24 + l4] = ((c >> 4) & M4) | (((qh >> 6) & M2) << 4)
            o[base + U(2 * r)], o[base + U(2 * r + 1)] = b8[208], b8[209]
            for t in range(16):
                o[base + U(32 + 16 * t + r)] = b8[192 + t]
            w0 = (base + U(Q6_Q)) // U(4) + U(r)
            for k in range(16):
                at = w0 + U(48 * k)
                o32[at] = (u[k] & M4) | ((u[k + 32] & M4) << 4)
                o32[at + U(16)] = (u[k + 16] & M4) | ((u[k + 48] & M4) << 4)
                o32[at + U(32)] = (((u[k] >> 4) & M2) | (((u[k + 16] >> 4) & M2) << 2)
                                   | (((u[k + 32] >> 4) & M2) << 4) | (((u[k + 48] >> 4) & M2) << 6))


@njit(parallel=True, cache=True, nogil=True)
def repack_q6_k_x16(raw, out):
    """Q6_K rows raw (uint8 [N, K / 256 x 210], N a multiple of 16) -> out (the same shape) in the
    Q6_K_X16 layout, on every thread."""
    r8, rb, o = raw.reshape(-1), U(raw.shape[1]), out.reshape(-1)
    o32 = o.view(np.uint32)
    for g in prange(raw.shape[0] // X16):
        _repack_q6_group(r8, rb, o, o32, U(g), rb // U(210))


@njit(cache=True, nogil=True)
def repack_q6_k_x16_serial(raw, out):
    """`repack_q6_k_x16` on the calling thread."""
    r8, rb, o = raw.reshape(-1), U(raw.shape[1]), out.reshape(-1)
    o32 = o.view(np.uint32)
    for g in range(raw.shape[0] // X16):
        _repack_q6_group(r8, rb, o, o32, U(g), rb // U(210))


def x16_type(qtype: int) -> int:
    """The type id of qtype's X16 layout (Q4_K_X16, Q6_K_X16, ...: X16_TYPES)."""
    return qtype + 256


def repack_x16(raw: np.ndarray, qtype: int = QTYPES_BY_NAME["Q4_K"].type_id) -> np.ndarray:
    """A read-only X16 copy of rows raw [..., N, row bytes] of type qtype (one of X16_TYPES; each [N,
    row bytes] on its own: N a multiple of 16), on every thread."""
    out = np.empty((*raw.shape[:-1], x16_bytes(raw.shape[-1], qtype)), np.uint8)
    _repacker(qtype, False)(raw.reshape(-1, raw.shape[-1]), out.reshape(-1, out.shape[-1]))
    out.flags.writeable = False
    return out


def repack_x16_into(raw: np.ndarray, out: np.ndarray, qtype: int) -> None:
    """`repack_x16` of one [N, row bytes] into out, on every thread."""
    _repacker(qtype, False)(raw, out)


def repack_x16_serial(raw: np.ndarray, out: np.ndarray, qtype: int) -> None:
    """`repack_x16` of one [N, row bytes] into out, on the calling thread."""
    _repacker(qtype, True)(raw, out)


def _repacker(qtype: int, serial: bool):
    """f(raw, out): the repack kernel of qtype's X16 layout, serial or on every thread."""
    name = type_name(qtype)
    if name in NIBBLE_X16 or name == "Q8_0":
        kernel, ts = (repack_plain_x16_serial if serial else repack_plain_x16), QTYPES_BY_NAME[name].type_size
        qb = 32 if name == "Q8_0" else 16
        return lambda raw, out: kernel(raw, out, ts, qb)
    if name == "Q6_K":
        return repack_q6_k_x16_serial if serial else repack_q6_k_x16
    if name == "IQ4_XS":
        return repack_iq4_xs_x16_serial if serial else repack_iq4_xs_x16
    kernel = repack_k_x16_serial if serial else repack_k_x16  # Q4_K, Q5_K
    ts, xb = (176, X16_Q5_BLOCK) if name == "Q5_K" else (144, X16_BLOCK)
    return lambda raw, out: kernel(raw, out, ts, xb)


@njit(cache=True, nogil=True)
def quantize_acts(x):
    """float32 rows x [R, K] (K a multiple of 32) -> (q, d, m) of `_make_idot`: per block of 32,
    d = max|x| / 32767, q = round(x / d), m = d * sum(q). A block holding inf or nan gets d = nan
    (its products come out nan, as float32 ones would be inf or nan). With VNNI, q is [R, 2K +
    ROW_PAD]: the int16 values, then (as bytes) every value's low byte and high byte, two planes
    of K (without, [R, K + ROW_PAD]); m
    is [R, 4 K / 32]: the blocks' d x sum(q), then the sum of q over each 16 values, then (with
    VNNI) the blocks' d x the sum of their high bytes (IQ4_XS_X16's correction, see there)."""
    R, K = x.shape
    nb = K // A
    q = np.empty((R, (2 * K if VNNI else K) + ROW_PAD), np.int16)  # [R, K] values (then, with VNNI, their byte planes)
    planes = q.view(np.uint8)  # lo = v & 255 at byte 2K + k of a row, hi = v >> 8 at 3K + k
    d = np.empty((R, nb), np.float32)
    m = np.empty((R, 4 * nb), np.float32)  # [R, nb] scale x sum, [R, 2 nb] each 16 values' sum (exact), [R, nb]
    for r in range(R):
        for j in range(nb):
            xb = x[r, j * A : (j + 1) * A]
            amax = np.float32(0)
            finite = True
            for t in range(A):
                v = abs(xb[t])
                if not v <= np.float32(3.0e38):
                    finite = False
                elif v > amax:
                    amax = v
            s = 0
            sh = 0  # (the high bytes' sum)
            if finite and amax > 0:
                inv = np.float32(ACT_MAX) / amax
                for t in range(A):
                    v = np.int16(np.rint(xb[t] * inv))
                    q[r, j * A + t] = v
                    if VNNI:
                        planes[r, 2 * K + j * A + t] = np.uint8(v & 255)
                        planes[r, 3 * K + j * A + t] = np.uint8((v >> 8) & 255)
                        sh += v >> 8
                    s += v
                    if t == A // 2 - 1:
                        m[r, nb + 2 * j] = np.float32(s)
                m[r, nb + 2 * j + 1] = np.float32(s) - m[r, nb + 2 * j]
                d[r, j] = amax / np.float32(ACT_MAX)
            else:
                q[r, j * A : (j + 1) * A] = 0
                if VNNI:
                    planes[r, 2 * K + j * A : 2 * K + (j + 1) * A] = 0
                    planes[r, 3 * K + j * A : 3 * K + (j + 1) * A] = 0
                d[r, j] = np.float32(0) if finite else np.float32(np.nan)
                m[r, nb + 2 * j] = m[r, nb + 2 * j + 1] = np.float32(0)
            m[r, j] = d[r, j] * np.float32(s)
            m[r, 3 * nb + j] = d[r, j] * np.float32(sh)
    return q, d, m


# -- the kernels ---------------------------------------------------------------------------

def _make_decode(name: str):
    """Intrinsic decode(w, out): the raw row w (uint8) -> float32 out, through `_groups`."""
    qt = QTYPES_BY_NAME[name]

    def codegen(context, builder, sig, args):
        b = builder
        w = context.make_array(sig.args[0])(context, b, args[0])
        out = context.make_array(sig.args[1])(context, b, args[1]).data
        nb = b.udiv(b.extract_value(w.shape, 0), _const(I64, qt.type_size))
        with cgutils.for_range(b, nb) as loop:
            blk = b.gep(w.data, [b.mul(loop.index, _const(I64, qt.type_size))])
            first = b.mul(loop.index, _const(I64, qt.block_size))
            for off, wv in _groups(b, name, blk):
                p = b.gep(out, [b.add(first, _const(I64, off))])
                b.store(wv, b.bitcast(p, ir.PointerType(_vec(FLT))), align=4)
        return context.get_dummy_value()

    def decode(typingctx, w, out):
        ok = (isinstance(w, types.Array) and w.ndim == 1 and w.dtype == types.uint8 and w.layout == "C"
              and isinstance(out, types.Array) and out.ndim == 1 and out.dtype == types.float32
              and out.layout == "C")
        return (types.none(w, out), codegen) if ok else None

    decode.__name__ = f"decode_{name.lower()}"
    return intrinsic(decode)


DECODE = {n: _make_decode(n) for n in MORE_TYPES}


def _tid(name: str) -> int:
    """The type id of a quant type's name, or of onebit's own repacked layout (Q4_K_X16)."""
    if name.endswith("_X16"):
        return x16_type(QTYPES_BY_NAME[name[:-4]].type_id)
    return QTYPES_BY_NAME[name].type_id


def _dispatch(table, args: str, doc: str, names=IR_TYPES, last="F32", extra=""):
    """An inlined njit function `f(qt, w, <args>)` that calls table[name] for qt's type: one `if`
    per type (qt is a run-time value, so every type's branch is in each caller: the intrinsic's
    code itself, or a call of an outlined function, see `_outlined`)."""
    lines = [f"def f(qt, w, {args}):", f'    """{doc}"""']
    for n in names:
        if n != last:
            lines += [f"    if qt == {_tid(n)}:  # {n}", f"        return T_{n}(w, {args})"]
    lines.append(f"    return T_{last}(w, {args})")
    ns = {f"T_{n}": table[n] for n in names}
    exec("\n".join(lines), ns)
    return njit(inline="always")(ns["f"])


def _outlined(table, args: str):
    """MORE_TYPES' dots as functions of their own (not inlined): each is compiled once per
    argument type and linked into its callers, rather than copied into every call site. With
    26 types inlined at each of the kernels' dot calls, the first compile took 408 s (wall, on
    the shared 2 cores; 71 s before the new types); outlined, 124 s of CPU time against 70 s.
    A call per weight row costs nothing measurable."""
    out = dict(table)
    for n in MORE_TYPES:
        ns = {"dot": table[n]}
        exec(f"def {n.lower()}(w, {args}):\n    return dot(w, {args})", ns)
        out[n] = njit(ns[n.lower()])
    return out


# The order of the tests: the common types first.
_ORDER = ("Q8_0", "Q4_K", "Q6_K", "Q5_K", "Q4_0", "MXFP4", "F16", "BF16") + MORE_TYPES + ("F32",)
_A1, _A2, _A4, _A8 = "x", "x0, x1", "x0, x1, x2, x3", "x0, x1, x2, x3, x4, x5, x6, x7"
_DOTS = {1: _outlined(DOT1, _A1), 2: _outlined(DOT2, _A2), 4: _outlined(DOT4, _A4), 8: _outlined(DOT8, _A8)}
_IDOTS = {1: IDOT1, 2: IDOT2, 4: IDOT4, 8: IDOT8}
_INT_ORDER = tuple(n for n in _ORDER if n in INT_TYPES)


def _with_x16(names, x16: bool = True) -> tuple:
    """names, and (if x16) the X16 layouts first of those among them that have one, where the
    machine has VNNI."""
    names = tuple(names)
    return tuple(f"{n}_X16" for n in X16_TYPES if x16 and VNNI and n in names) + names


def _is_int(names, x16: bool = True) -> dict:
    """{"is_int": is_int(qt)}: whether qt is one of the INT_TYPES among `names` (and their X16
    layouts if x16), whose products take x's int16 blocks (`acts`)."""
    test = " or ".join(f"qt == {_tid(n)}" for n in _with_x16(_INT_ORDER) if n in _with_x16(names, x16)) or "False"
    ns: dict = {}
    exec(f"def is_int(qt):\n    return {test}", ns)
    return {"is_int": njit(inline="always")(ns["is_int"])}


TILE = 32  # weight rows a prompt's row groups meet before the next (about 20-70 KiB of weights)


def _row_loop(name: str):
    """rows(w, out, x, aq, ad, am, n0, n1, col) for weights of type `name`: out[:, col + n] = x @
    row n of w for n in [n0, n1), a weight row against up to 8 activation rows at once (the
    int16 products on (aq, ad, am) = acts(x) for INT_TYPES, else the float32 ones on x). One
    loop per type, the type's test outside it: with every type's code inside one loop, values
    LLVM hoists out of it for all the types at once spilled to the stack (the shipped types'
    decode products ran 10-40% slower, bench/results/issue34-kernels.md)."""
    def call(k, rs):  # weight row n . activation rows rs
        if name in INT_TYPES:
            return f"I{k}(row_of(w, n), aq, ad, am, {', '.join(rs)})"
        return f"F{k}(row_of(w, n), {', '.join(f'row_of(x, {r})' for r in rs)})"

    r8 = [f"r + {i}" if i else "r" for i in range(8)]
    src = f"""def rows(w, out, x, aq, ad, am, n0, n1, col):
    R = x.shape[0]
    if R == 1:  # decode
        for n in range(n0, n1):
            out[0, col + n] = {call(1, ["0"])}
        return
    for t0 in range(n0, n1, TILE):  # (a tile of weight rows stays in cache while each group of
        # x's rows meets it, rather than every row of x streaming through the cache for each weight row)
        t1 = min(n1, t0 + TILE)
        r = 0
        while r + 8 <= R:
            for n in range(t0, t1):
                t = {call(8, r8)}
                for i in range(8):
                    out[r + i, col + n] = t[i]
            r += 8
        while r + 4 <= R:
            for n in range(t0, t1):
                s0, s1, s2, s3 = {call(4, r8[:4])}
                out[r, col + n], out[r + 1, col + n], out[r + 2, col + n], out[r + 3, col + n] = s0, s1, s2, s3
            r += 4
        if r + 2 <= R:
            for n in range(t0, t1):
                s0, s1 = {call(2, r8[:2])}
                out[r, col + n], out[r + 1, col + n] = s0, s1
            r += 2
        while r < R:
            for n in range(t0, t1):
                out[r, col + n] = {call(1, ["r"])}
            r += 1
"""
    ns = {"row_of": row_of, "TILE": TILE}
    ns.update({f"F{k}": t[name] for k, t in _DOTS.items()})
    if name in INT_TYPES:
        ns.update({f"I{k}": t[name] for k, t in _IDOTS.items()})
    exec(src, ns)
    return njit(inline="always")(ns["rows"])


def _x16_rows(dot, name: str):
    """rows(w, out, x, aq, ad, am, n0, n1, col), the row loop of an X16 layout whose dot is `dot`
    (n0, n1 multiples of 16): 16 weight rows a call, each activation row in turn against them
    while they are in cache. Called, not inlined: inlined beside the other types' loops it
    slowed them (Gemma 3 270M's Q5_0 gate and up products 88 -> 93 us)."""
    ns = {"dot": dot, "X16": X16}
    exec("def rows(w, out, x, aq, ad, am, n0, n1, col):\n"
         "    for n in range(n0, n1, X16):\n"
         "        for r in range(x.shape[0]):\n"
         "            dot(w, n, aq, ad, am, r, out, col + n)\n", ns)
    ns["rows"].__qualname__ = ns["rows"].__name__ = f"rows_{name.lower()}"
    return njit(nogil=True)(ns["rows"])


ROWS = {n: _row_loop(n) for n in IR_TYPES}
ROWS.update({f"{n}_X16": _x16_rows(dot, f"{n}_X16") for n, dot in (
    ("Q4_K", dot16_q4_k_x16), ("Q5_K", dot16_q5_k_x16), ("Q6_K", dot16_q6_k_x16), ("MXFP4", dot16_mxfp4_x16), ("Q4_0", dot16_q4_0_x16),
    ("IQ4_XS", dot16_iq4_xs_x16), ("Q8_0", dot16_q8_0_x16), ("Q5_0", dot16_q5_0_x16))})
_RA = "out, x, aq, ad, am, n0, n1, col"


def _rows_of(names, x16: bool = True) -> dict:
    """{"rows_of": rows_of(qt, w, out, x, aq, ad, am, n0, n1, col)}: ROWS[qt's type] for the
    types `names` (and their X16 layouts if x16)."""
    return {"rows_of": _dispatch(ROWS, _RA, "The row loop of qt's type (ROWS).", _with_x16(names, x16), names[-1])}


globals().update(_is_int(IR_TYPES))
globals().update(_rows_of(_ORDER))


@njit(cache=True, nogil=True)
def acts(x, want):
    """x's int16 blocks (quantize_acts) if `want` (some product of x is of INT_TYPES), else empty."""
    if want:
        return quantize_acts(x)
    return np.empty((0, 0), np.int16), np.empty((0, 0), np.float32), np.empty((0, 0), np.float32)


def _row_decoders() -> dict:
    """decode(b, out, lut, m) of every type: the plain types' numba functions, MORE_TYPES' IR."""
    out = {n: globals()[f"_decode_{n.lower()}"] for n in IR_TYPES if n not in MORE_TYPES}
    for n in MORE_TYPES:
        ns = {"decode": DECODE[n]}
        exec(f"def {n.lower()}(w, out, lut, m):\n    decode(w, out)", ns)
        out[n] = njit(fastmath=FM)(ns[n.lower()])
    return out


decode_row = _dispatch(_row_decoders(), "out, lut, m", "Raw bytes w of one row -> float32 out (len(out) "
                       "weights); m = M.", _ORDER)


@njit(cache=True, nogil=True)
def matmul_rows(out, x, a, w, qt, n0, n1, col):
    """out[:, col + n] = x @ row n of w, for n in [n0, n1); a = acts(x, is_int(qt))."""
    aq, ad, am = lent(a)
    rows_of(qt, w, out, borrowed(x), aq, ad, am, n0, n1, col)


CHUNK = 16  # weight rows per parallel work item
# Below this many weights x rows a product runs on the calling thread: waking a worker costs more
# than the work (on a busy machine a woken worker may wait a scheduler tick for a core).
SERIAL_WORK = 1 << 19


@njit(parallel=True, cache=True, nogil=True)
def matmul(out, x, w, qt):
    """out[R, N] = x[R, K] @ W.T for raw weight rows w: uint8 [N, row_bytes] of type qt."""
    N = w.shape[0]
    a = acts(x, is_int(qt))
    ab, out, x, w = lent(a), borrowed(out), borrowed(x), borrowed(w)  # (no counted references in the loop)
    for c in prange((N + CHUNK - 1) // CHUNK):
        matmul_rows(out, x, ab, w, qt, c * CHUNK, min(N, (c + 1) * CHUNK), 0)
    keep_alive(a)


@njit(cache=True, nogil=True)
def matmul_serial(out, x, w, qt):
    matmul_rows(out, x, acts(x, is_int(qt)), w, qt, 0, w.shape[0], 0)


@njit(parallel=True, cache=True, nogil=True)
def matmul3(out, x, w0, w1, w2, qt0, qt1, qt2):
    """Three products of one x in one parallel region (q, k, v): out[R, N0 + N1 + N2] = x @
    [W0; W1; W2].T. Each output column is computed exactly as `matmul` computes it."""
    N0, N1, N2 = w0.shape[0], w1.shape[0], w2.shape[0]
    c0 = (N0 + CHUNK - 1) // CHUNK
    c1 = c0 + (N1 + CHUNK - 1) // CHUNK
    a = acts(x, is_int(qt0) or is_int(qt1) or is_int(qt2))
    ab, out, x = lent(a), borrowed(out), borrowed(x)
    w0, w1, w2 = borrowed(w0), borrowed(w1), borrowed(w2)
    for c in prange(c1 + (N2 + CHUNK - 1) // CHUNK):
        if c < c0:
            matmul_rows(out, x, ab, w0, qt0, c * CHUNK, min(N0, (c + 1) * CHUNK), 0)
        elif c < c1:
            matmul_rows(out, x, ab, w1, qt1, (c - c0) * CHUNK, min(N1, (c - c0 + 1) * CHUNK), N0)
        else:
            matmul_rows(out, x, ab, w2, qt2, (c - c1) * CHUNK, min(N2, (c - c1 + 1) * CHUNK), N0 + N1)
    keep_alive(a)


@njit(cache=True, nogil=True)
def get_rows(out, w, ids, qt, lut, m):
    """out[r] = row ids[r] of w (uint8 [N, row_bytes]) decoded to float32."""
    for r in range(ids.shape[0]):
        decode_row(qt, w[ids[r]], out[r], lut, m)


@njit(inline="always")
def _expert_rows(x, a, rows):
    """The rows `rows` of x and of its int16 blocks a = acts(x, ..) (x and a themselves when
    rows are 0, 1, .., len(x) - 1: a decode token's)."""
    n = rows.shape[0]
    same = n == x.shape[0]
    for p in range(n):
        if rows[p] != p:
            same = False
    if same:
        return x, a
    aq, ad, am = a
    if aq.shape[0] == 0:  # (no int16 blocks: float products)
        return x[rows], a
    return x[rows], (aq[rows], ad[rows], am[rows])


@njit(cache=True, nogil=True)
def gate_up(x, a, gate, up, e, rows, qg, qu):
    """Expert e's gate and up products of x's rows `rows` (a = acts(x, ..)): g, u [rows, hidden]."""
    n, hidden = rows.shape[0], gate.shape[1]
    xr, ar = _expert_rows(x, a, rows)  # [rows, dim]
    g = np.empty((n, hidden), np.float32)  # [rows, hidden]
    u = np.empty((n, hidden), np.float32)
    matmul_rows(g, xr, ar, row_of(gate, e), qg, 0, hidden, 0)
    matmul_rows(u, xr, ar, row_of(up, e), qu, 0, hidden, 0)
    return g, u


@njit(cache=True, nogil=True)
def one_expert(y, x, a, gate, up, down, e, rows, qg, qu, qd):
    """y[p] = down(silu(gate(x[rows[p]])) * up(x[rows[p]])) for expert e, p in [0, len(rows));
    a = acts(x, ..) (x's int16 blocks when gate or up is of INT_TYPES)."""
    n, hidden = rows.shape[0], gate.shape[1]
    g, u = gate_up(x, a, gate, up, e, rows, qg, qu)  # [rows, hidden] each
    for p in range(n):
        for i in range(hidden):
            g[p, i] = g[p, i] / (np.float32(1) + np.exp(-g[p, i])) * u[p, i]
    matmul_rows(y, g, acts(g, is_int(qd)), row_of(down, e), qd, 0, down.shape[1], 0)


@njit(parallel=True, cache=True, nogil=True)
def expert_ffn(out, x, gate, up, down, sel, offs, rows, rw, qg, qu, qd):
    """out[rows] += rw * down(silu(gate(x)) * up(x)) over the chosen experts, in order.

    gate, up: uint8 [E, hidden, row_bytes]; down: uint8 [E, dim, row_bytes] (a file's expert
    tensor or a pool's slots). Expert j of the call is gate[sel[j]]; the activation rows it
    serves are rows[offs[j]:offs[j+1]] with weights rw[...]. One parallel region: a thread
    runs whole experts into y; then each out element adds its experts' terms in order j = 0,
    1, ..., so a call split into groups of j gives the same bits.
    """
    dim = x.shape[1]
    y = np.empty((rows.shape[0], dim), np.float32)  # [routed rows, dim]
    a = acts(x, is_int(qg) or is_int(qu))
    ab, xb, gate, up, down = lent(a), borrowed(x), borrowed(gate), borrowed(up), borrowed(down)
    for j in prange(sel.shape[0]):
        one_expert(y[offs[j] : offs[j + 1]], xb, ab, gate, up, down, sel[j], rows[offs[j] : offs[j + 1]], qg, qu, qd)
    keep_alive(a)
    for p in range(rows.shape[0]):
        o, yp, w = out[rows[p]], y[p], rw[p]
        for d in range(dim):
            o[d] += yp[d] * w


@njit(cache=True, fastmath=FM, nogil=True)
def one_expert_oai(y, x, a, gate, up, down, e, rows, qg, qu, qd, bg, bu, bd, alpha, limit):
    """gpt-oss's expert FFN: y[p] = down(glu(gate(x) + bg, up(x) + bu)) + bd for expert e's
    weights (slot or file index e) and its biases bg, bu: [hidden], bd: [dim]; glu(g, u) =
    min(g, limit) * sigmoid(alpha * min(g, limit)) * (clip(u, -limit, limit) + 1)."""
    n, hidden = rows.shape[0], gate.shape[1]
    g, u = gate_up(x, a, gate, up, e, rows, qg, qu)  # [rows, hidden] each
    for p in range(n):
        for i in range(hidden):
            gi = min(g[p, i] + bg[i], np.float32(limit))
            ui = min(max(u[p, i] + bu[i], np.float32(-limit)), np.float32(limit))
            g[p, i] = gi / (np.float32(1) + np.exp(np.float32(-alpha) * gi)) * (ui + np.float32(1))
    matmul_rows(y, g, acts(g, is_int(qd)), row_of(down, e), qd, 0, down.shape[1], 0)
    for p in range(n):
        for d in range(y.shape[1]):
            y[p, d] += bd[d]


@njit(parallel=True, cache=True, nogil=True)
def expert_ffn_oai(out, x, gate, up, down, sel, eids, offs, rows, rw, qg, qu, qd, bg, bu, bd, alpha, limit):
    """`expert_ffn` for gpt-oss experts (`one_expert_oai`): expert j's weights are gate[sel[j]]
    and its biases bg[eids[j]], bu[eids[j]] ([E, hidden]), bd[eids[j]] ([E, dim]); the same
    order of sums, so a call split into groups of j gives the same bits."""
    dim = x.shape[1]
    y = np.empty((rows.shape[0], dim), np.float32)  # [routed rows, dim]
    a = acts(x, is_int(qg) or is_int(qu))
    ab, xb, gate, up, down = lent(a), borrowed(x), borrowed(gate), borrowed(up), borrowed(down)
    for j in prange(sel.shape[0]):
        e = eids[j]
        one_expert_oai(y[offs[j] : offs[j + 1]], xb, ab, gate, up, down, sel[j], rows[offs[j] : offs[j + 1]],
                       qg, qu, qd, bg[e], bu[e], bd[e], alpha, limit)
    keep_alive(a)
    for p in range(rows.shape[0]):
        o, yp, w = out[rows[p]], y[p], rw[p]
        for d in range(dim):
            o[d] += yp[d] * w


# -- the small ops of a decode step (serial but attention: each is microseconds of work) -------
# Their numpy twins (`NumpyBackend.rms_norm`, `rope`, `attention`, `route`) run the same float32
# arithmetic in another summation order.


@njit(cache=True, fastmath=FM, nogil=True)
def rms_norm(out, x, w, eps):
    """out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * w, for x, out: [n, D], w: [D]."""
    n, D = x.shape
    for r in range(n):
        xr = x[r]
        ss = np.float32(0)
        for i in range(D):
            ss += xr[i] * xr[i]
        s = np.sqrt(ss / np.float32(D) + np.float32(eps))
        o = out[r]
        for i in range(D):
            o[i] = xr[i] / s * w[i]


@njit(cache=True, nogil=True)
def rope(out, x, pos, inv_freq, scale, neox):
    """out = x rotated in its first 2 * len(inv_freq) dims: x, out: [R, H, D], pos: [R]."""
    R, H, D = x.shape
    half = inv_freq.shape[0]
    for r in range(R):  # out = x (in loops: numba's `out[:] = x` took 3 s of its first compile)
        for h in range(H):
            for i in range(D):
                out[r, h, i] = x[r, h, i]
    for r in range(R):
        for i in range(half):
            ang = np.float64(pos[r]) * scale * inv_freq[i]
            c, s = np.float32(np.cos(ang)), np.float32(np.sin(ang))
            ia, ib = (i, i + half) if neox else (2 * i, 2 * i + 1)
            for h in range(H):
                a, b = x[r, h, ia], x[r, h, ib]
                out[r, h, ia] = a * c - b * s
                out[r, h, ib] = a * s + b * c


@njit(cache=True, fastmath=FM, nogil=True)
def attention(out, q, k, v, q_pos, window, scale):
    """Causal GQA attention for few rows (decode): q: [R, H, D] at positions q_pos; k: [S, Hkv,
    D], v: [S, Hkv, Dv] holding position p in row p % S (a sliding-window ring: S is its
    capacity); out: [R, H, Dv]. Row r sees positions 0..q_pos[r] (the last `window` only, if > 0).
    scale: the q.k scale (1 / sqrt(D) unless the model sets its own, as Gemma does)."""
    _attend(out, q, k, v, q_pos, window, np.float32(scale), np.empty(0, np.float32), False)


@njit(cache=True, fastmath=FM, nogil=True)
def attention_sinks(out, q, k, v, q_pos, window, scale, sinks):
    """`attention` with a q.k scale of its own and attention sinks (gpt-oss): sinks[h] is a
    logit of head h that joins the softmax's denominator and weights no value. k, v hold
    position p in row p % S, as in `attention`."""
    _attend(out, q, k, v, q_pos, window, np.float32(scale), sinks, True)


@njit(parallel=True, cache=True, fastmath=FM, nogil=True)
def _attend(out, q, k, v, q_pos, window, scale, sinks, has_sinks):
    """The loops of `attention` and `attention_sinks` (scale: float32): a (row, head) a thread,
    each in the order a serial loop would run it (the same bits whatever the threads)."""
    R, H, D = q.shape
    S, Hkv, Dv = v.shape
    group = H // Hkv
    for rh in prange(R * H):
        r, h = rh // H, rh % H
        lo = max(0, q_pos[r] - window + 1) if window > 0 else 0
        n = q_pos[r] + 1 - lo
        kh = h // group
        qr = q[r, h]
        p = np.empty(n, np.float32)  # p[j]: position lo + j, in row (lo + j) % S
        m = sinks[h] if has_sinks else np.float32(-np.inf)
        row = lo % S
        for j in range(n):
            ks = k[row, kh]
            t = np.float32(0)
            for i in range(D):
                t += qr[i] * ks[i]
            t *= scale
            p[j] = t
            m = max(m, t)
            row = row + 1 if row + 1 < S else 0
        tot = np.float32(np.exp(sinks[h] - m)) if has_sinks else np.float32(0)
        for j in range(n):
            e = np.float32(np.exp(p[j] - m))
            p[j] = e
            tot += e
        o = out[r, h]
        o[:] = 0
        row = lo % S
        for j in range(n):
            ps = p[j] / tot
            vs = v[row, kh]
            for i in range(Dv):
                o[i] += ps * vs[i]
            row = row + 1 if row + 1 < S else 0


@njit(cache=True, nogil=True)
def route(logits, k, norm):
    """Softmax over experts, the top k (ties: the lower id first, as a stable argsort):
    logits [R, E] -> ids [R, k] int64, weights [R, k] float32."""
    R, E = logits.shape
    ids = np.empty((R, k), np.int64)
    wts = np.empty((R, k), np.float32)
    probs = np.empty(E, np.float32)
    taken = np.zeros(E, np.bool_)
    for r in range(R):
        m = logits[r, 0]
        for e in range(1, E):
            m = max(m, logits[r, e])
        tot = np.float32(0)
        for e in range(E):
            probs[e] = np.exp(logits[r, e] - m)
            tot += probs[e]
        taken[:] = False
        for j in range(k):
            best = -1
            for e in range(E):
                if not taken[e] and (best < 0 or probs[e] > probs[best]):
                    best = e
            taken[best] = True
            ids[r, j] = best
            wts[r, j] = probs[best] / tot
        if norm:
            s = np.float32(0)
            for j in range(k):
                s += wts[r, j]
            for j in range(k):
                wts[r, j] = wts[r, j] / s
    return ids, wts


@njit(cache=True, nogil=True)
def routed_rows(ids, weights, n_experts):
    """The experts chosen (ascending) and, per expert, the rows it serves and their weights:
    experts [n], offs [n+1], rows [R*k], rw [R*k] (expert j serves rows[offs[j]:offs[j+1]],
    in row order)."""
    R, k = ids.shape
    count = np.zeros(n_experts + 1, np.int64)
    for r in range(R):
        for j in range(k):
            count[ids[r, j] + 1] += 1
    n = 0
    for e in range(n_experts):
        n += count[e + 1] > 0
        count[e + 1] += count[e]
    experts = np.empty(n, np.int64)
    offs = np.empty(n + 1, np.int64)
    i = 0
    for e in range(n_experts):
        if count[e + 1] > count[e]:
            experts[i] = e
            offs[i] = count[e]
            i += 1
    offs[n] = R * k
    rows = np.empty(R * k, np.int64)
    rw = np.empty(R * k, np.float32)
    fill = count[:n_experts].copy()
    for r in range(R):
        for j in range(k):
            e = ids[r, j]
            rows[fill[e]] = r
            rw[fill[e]] = weights[r, j]
            fill[e] += 1
    return experts, offs, rows, rw


SMALL_OPS = (rms_norm, rope, attention, attention_sinks, route, routed_rows)
REPACKS = (repack_k_x16, repack_k_x16_serial, repack_q6_k_x16, repack_q6_k_x16_serial, repack_plain_x16,
           repack_plain_x16_serial, repack_iq4_xs_x16, repack_iq4_xs_x16_serial)


KERNELS = (matmul, matmul_serial, matmul3, get_rows, expert_ffn, matmul_rows, gate_up, one_expert, expert_ffn_oai,
           one_expert_oai)  # + SMALL_OPS, REPACKS


# -- the kernels of a file's types -----------------------------------------------------------
# A cold compile of the products for every type took 84-127 s on the 2-core VM (each product
# holds every type's dot code); for one file's two types (the shipped model: Q8_0, F32), with
# the small ops, about 13 s of CPU. So a backend takes the products compiled for its file's
# types: the same source, with the dot products' and decode_row's `if qt == ...` chains cut to
# those types, each type's code the all-types kernel's bit for bit (tests/test_first_token.py;
# every type: tools/check_kernel_bits.py).

PRODUCTS = ("matmul", "matmul_serial", "matmul3", "get_rows", "expert_ffn", "expert_ffn_oai")


def _clone(kernel, env: dict, tag: str):
    """`kernel`'s code compiled against the module's globals with `env` over them, cached on disk
    under its own name (`<name>__<tag>`: numba's index is by module, name and line)."""
    py = kernel.py_func
    f = pytypes.FunctionType(py.__code__, dict(py.__globals__, **env), py.__name__, py.__defaults__, py.__closure__)
    f.__qualname__ = f"{py.__qualname__}__{tag}"
    f.__doc__ = py.__doc__
    return njit(cache=True, **{k: v for k, v in kernel.targetoptions.items() if k != "nopython"})(f)


@cache
def _typed(names: tuple[str, ...], x16: bool) -> dict:
    """The products (and the helpers they call) of PRODUCTS with the dispatch cut to `names`, and
    their X16 layouts if x16 (one set of dispatchers per process: a second load of a file reuses
    the compiled code)."""
    tag = "_".join(n.lower() for n in names) + ("_x16" if x16 and VNNI else "")
    last = names[-1]
    env = {"decode_row": _dispatch(_row_decoders(), "out, lut, m", f"decode_row of {tag}.", names, last)}
    env.update(_is_int(names, x16))
    env.update(_rows_of(names, x16))
    for helper in (acts, matmul_rows, gate_up, one_expert, one_expert_oai):  # (each after what it calls)
        env[helper.py_func.__name__] = _clone(helper, env, tag)
    return {name: _clone(globals()[name], env, tag) for name in PRODUCTS}


# Groups of kernels, each compiled by one process when the disk cache is cold (`fill_cache`).
WARM_PARTS = {"dense": ("matmul", "matmul_serial"), "fused": ("matmul3", "get_rows"), "experts": ("expert_ffn",),
              "experts_oai": ("expert_ffn_oai",), "small": ("rms_norm", "rope", "attention", "attention_sinks",
                                                            "route", "routed_rows"),
              "repack": ("repack_k_x16", "repack_k_x16_serial", "repack_q6_k_x16", "repack_q6_k_x16_serial",
                         "repack_plain_x16", "repack_plain_x16_serial", "repack_iq4_xs_x16",
                         "repack_iq4_xs_x16_serial")}
# The repack kernels of each type's X16 layout (a file's "repack" part compiles its types' only).
REPACKS_OF = {"Q4_K": ("repack_k_x16", "repack_k_x16_serial"), "Q5_K": ("repack_k_x16", "repack_k_x16_serial"),
              "Q6_K": ("repack_q6_k_x16", "repack_q6_k_x16_serial"),
              "IQ4_XS": ("repack_iq4_xs_x16", "repack_iq4_xs_x16_serial")}
REPACKS_OF.update({n: ("repack_plain_x16", "repack_plain_x16_serial") for n in NIBBLE_X16 + ("Q8_0",)})
# What a part's cold compile costs, to balance the processes: CPU seconds on the 2-core VM
# were about 2 + 1.6 per type for each part of products (Q8_0 + F32: 2.9-6.3; all 26 types:
# 32-45), 3.5 for the small ops whatever the types.
SMALL_COST, PART_COST, TYPE_COST, REPACK_COST = 3.5, 2.0, 1.6, 2.0


class Kernels:
    """The kernels one backend calls: the products compiled for `names` (quant type names; None:
    every type, the module's own kernels) and the small ops, which every file shares. `parts`
    (of WARM_PARTS) are what `warm_up` loads and `fill_cache` compiles: a file without experts
    needs no expert kernel."""

    LUT, M, SERIAL_WORK = LUT, M, SERIAL_WORK

    def __init__(self, names=None, parts: tuple[str, ...] = tuple(WARM_PARTS), x16: bool | None = None):
        self.names = tuple(n for n in _ORDER if names is None or n in names) or ("F32",)
        self.everything = names is None
        self.parts = tuple(p for p in WARM_PARTS if p in parts)
        # the products take the X16 layouts' branches: by default where the file repacks (parts_for);
        # `fill_cache`'s workers, each given some of the parts, are told
        self.x16 = "repack" in self.parts if x16 is None else x16
        self.SUPPORTED = frozenset(SUPPORTED) if self.everything else frozenset(
            QTYPES_BY_NAME[n].type_id for n in self.names) & SUPPORTED
        own = globals() if self.everything else _typed(self.names, self.x16)
        for name in PRODUCTS + WARM_PARTS["small"] + WARM_PARTS["repack"]:
            setattr(self, name, own[name] if name in own else globals()[name])
        self._warm = False

    def kernels(self, parts=None) -> list:
        """The dispatchers of `parts` (default: this set's), each once: of the repacks, those of
        this set's types' layouts."""
        return [getattr(self, n) for p in (parts or self.parts) for n in WARM_PARTS[p]
                if p != "repack" or n in self._repacks()]

    def _repacks(self) -> tuple[str, ...]:
        """The repack kernels of this set's types' X16 layouts (REPACKS_OF)."""
        return tuple(dict.fromkeys(k for n, ks in REPACKS_OF.items() if self.everything or n in self.names
                                   for k in ks))

    def cold_parts(self) -> tuple[str, ...]:
        """The parts some kernel of which numba's disk cache lacks (none once this set is loaded)."""
        if self._warm:
            return ()
        return tuple(p for p in self.parts if not all(_cached(k) for k in self.kernels((p,))))

    def cache_is_cold(self) -> bool:
        return bool(self.cold_parts())

    def fill_cache(self) -> float:
        """Compile the cold parts into numba's disk cache, side by side: groups of parts balanced
        by their cost (`_cost`), one per core; this process compiles the first group, worker
        processes the others. Returns the seconds spent."""
        import subprocess
        import sys
        import time

        cold = self.cold_parts()
        if not cold:
            return 0.0
        t0 = time.perf_counter()
        groups = [[] for _ in range(min(os.cpu_count() or 1, len(cold)))]
        load = [0.0] * len(groups)
        for p in sorted(cold, key=self._cost, reverse=True):  # longest first, onto the least loaded
            g = load.index(min(load))
            groups[g].append(p)
            load[g] += self._cost(p)
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
        code = ("import sys; from onebit.backends import cpu_kernels as K; names = sys.argv[1]; "
                "K.Kernels(None if names == '*' else names.split(','), tuple(sys.argv[3:]), sys.argv[2] == 'x16')"
                ".warm_up()")
        names = "*" if self.everything else ",".join(self.names)
        procs = []
        try:
            for g in groups[1:]:
                try:
                    procs.append(subprocess.Popen([sys.executable, "-c", code, names, "x16" if self.x16 else "rows", *g],
                                                  env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                                  stderr=subprocess.DEVNULL))
                except OSError:  # no interpreter to start: warm_up compiles in this process instead
                    break
            self._warm_parts(groups[0])
            for p in procs:
                p.wait()  # a part that failed is compiled again by warm_up, which reports it
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        return time.perf_counter() - t0

    def _cost(self, part: str) -> float:
        return {"small": SMALL_COST, "repack": REPACK_COST}.get(part, PART_COST + TYPE_COST * len(self.names))

    def warm_up(self) -> tuple[float, int]:
        """Load every kernel of this set now (compiling it the first time on this machine), so
        that no compile lands in a forward pass. Returns (seconds, kernels compiled rather than
        loaded)."""
        import time

        if self._warm:
            return 0.0, 0
        t0 = time.perf_counter()
        kernels = self.kernels()
        before = sum(len(k.stats.cache_misses) for k in kernels)
        self._warm_parts(self.parts)
        self._warm = True
        return time.perf_counter() - t0, sum(len(k.stats.cache_misses) for k in kernels) - before

    def _warm_parts(self, parts) -> None:
        """Call the kernels of `parts` once, on tiny arguments of a forward's signatures."""
        qt = QTYPES_BY_NAME[self.names[0]]
        n = max(W, qt.block_size)  # one block (32 weights of a float type)
        x = np.zeros((1, n), np.float32)
        w = _ro(np.zeros((2, n // qt.block_size * qt.type_size), np.uint8))  # [2 rows, row bytes]
        h = _ro(np.zeros((1, n, w.shape[1]), np.uint8))  # one expert, hidden = dim = n
        ids, offs, one = np.zeros(1, np.int64), np.array([0, 1], np.int64), np.ones(1, np.float32)
        t = qt.type_id
        for part in parts:
            if part == "dense":
                self.matmul(np.empty((1, 2), np.float32), x, w, t)
                self.matmul_serial(np.empty((1, 2), np.float32), x, w, t)
            elif part == "fused":
                self.matmul3(np.empty((1, 6), np.float32), x, w, w, w, t, t, t)
                self.get_rows(np.empty((1, n), np.float32), w, ids, t, LUT, M)
            elif part == "experts":
                self.expert_ffn(np.zeros((1, n), np.float32), x, h, h, h, ids, offs, ids, one, t, t, t)
            elif part == "experts_oai":
                b = _ro(np.zeros((1, n), np.float32))
                self.expert_ffn_oai(np.zeros((1, n), np.float32), x, h, h, h, ids, ids, offs, ids, one, t, t, t,
                                    b, b, b, 1.702, 7.0)
            elif part == "repack":
                _warm_repack(self._repacks())
            else:
                _warm_small()


def parts_for(gguf, repack: bool) -> tuple[str, ...]:
    """The WARM_PARTS a forward of this file calls (gpt-oss's experts, with their biases, only
    the clamped-SwiGLU kernel); `repack`: whether the backend holds some of its tensors in X16
    layouts (its memory policy says, cpu.X16Policy)."""
    names = gguf.tensors.keys()
    experts = any("_exps.weight" in n for n in names)
    oai = any(n.endswith("ffn_gate_exps.bias") for n in names)
    return (("dense", "fused", "small") + (("experts_oai",) if oai else ("experts",) if experts else ())
            + (("repack",) if repack else ()))


def kernels_for(gguf, repack: bool) -> Kernels:
    """The kernels for this file: those of its own quant types when numba's disk cache holds
    them or when it holds no all-types set either (a fresh machine compiles only what the file
    needs); else the all-types kernels (a machine that compiled them, such as the test suite's)."""
    names = {t.type_name for t in gguf.tensors.values() if len(t.shape) > 1 and t.qtype in SUPPORTED}
    parts = parts_for(gguf, repack)
    own = Kernels(names, parts)
    if own.cache_is_cold():
        every = Kernels(None, parts)
        if not every.cache_is_cold():
            return every
    return own


def _ro(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


def _warm_small():
    xr = _ro(np.zeros((1, 32), np.float32))  # the small ops take read-only inputs (cpu._ro32)
    rms_norm(np.empty_like(xr), xr, xr[0], 1e-6)
    q = _ro(np.zeros((1, 2, 4), np.float32))
    pos, inv = _ro(np.zeros(1, np.int64)), _ro(np.ones(2))
    rope(np.empty_like(q), q, pos, inv, 1.0, True)
    attention(np.empty_like(q), q, q, q, pos, 0, 0.5)
    attention_sinks(np.empty_like(q), q, q, q, pos, 0, 0.5, xr[0, :2])
    ids2, w2 = route(xr, 2, True)
    routed_rows(ids2, w2, 32)


def _warm_repack(kernels):
    """Call each repack kernel named in `kernels` on one group of 16 rows."""
    args = {"repack_k_x16": (144, X16_BLOCK // X16, 144, X16_BLOCK), "repack_q6_k_x16": (210, 210),
            "repack_plain_x16": (17, 17, 17, 16),
            "repack_iq4_xs_x16": (136, 136)}
    for name in kernels:
        row, out, *more = args[name.removesuffix("_serial")]
        globals()[name](_ro(np.zeros((X16, row), np.uint8)), np.empty((X16, out), np.uint8), *more)


def _cached(kernel) -> bool:
    """Whether numba's disk cache holds compiled code of `kernel` for this source (an index made
    before this file last changed, e.g. by an upgrade, counts as empty: numba compiles again)."""
    try:
        return bool(kernel._cache._cache_file._load_index())
    except Exception:  # a numba without this layout: say yes, and compile in process if need be
        return True


EVERY = Kernels()  # the all-types kernels (tests, benches and the test suite's cache fill)


def cache_is_cold() -> bool:
    """Whether some all-types kernel has never been compiled on this machine."""
    return EVERY.cache_is_cold()


def fill_cache() -> float:
    """Compile every all-types kernel into numba's disk cache (Kernels.fill_cache)."""
    return EVERY.fill_cache()


def warm_up() -> tuple[float, int]:
    """Load every all-types kernel now (Kernels.warm_up)."""
    return EVERY.warm_up()
