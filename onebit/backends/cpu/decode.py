"""Row decoders: raw quantized bytes of one row -> float32. The common types (PLAIN) in plain
numba, one function each; the others (MORE_TYPES) through the LLVM IR block decoders of
ir_blocks.py (`DECODE`). `_row_decoders` gathers them for get_rows' type dispatch
(products.decode_row)."""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from ...formats.quants import QTYPES_BY_NAME
from .base import E8M0, FM, MORE_TYPES, MXFP4_VALUES
from .ir_blocks import FLT, I64, _const, _groups, _vec
from .float_dots import IR_TYPES


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

# decode_row's plain types, one function each (m = M); `decode_row` (products.py) dispatches on qt.
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
def _row_decoders() -> dict:
    """decode(b, out, lut, m) of every type: the plain types' numba functions, MORE_TYPES' IR."""
    out = {n: globals()[f"_decode_{n.lower()}"] for n in IR_TYPES if n not in MORE_TYPES}
    for n in MORE_TYPES:
        ns = {"decode": DECODE[n]}
        exec(f"def {n.lower()}(w, out, lut, m):\n    decode(w, out)", ns)
        out[n] = njit(fastmath=FM)(ns[n.lower()])
    return out
