"""numba kernels of the cpu backend: they read quantized blocks straight from the file map.

A weight row is decoded block by block into a small float32 buffer on the worker's stack
(one row: at most a few KiB, in L1) and dotted with every activation row that needs it, so
no float32 copy of a weight matrix is ever made and each row's bytes are read once per call.
Activations stay float32: results differ from the numpy twins (`quants.QTYPES[..].dequantize`
then matmul) only by float32 rounding of the decode and the summation order.

Threads split output rows (`prange`); each output element is written by one thread in a
fixed order, so results do not depend on the thread count or on where the bytes live (file
map or a streaming pool's slot). Compiled once per machine and cached on disk (cache=True).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from ..quants import QTYPES_BY_NAME

# reassoc lets LLVM vectorise the dot products; no nnan/ninf (inputs may hold inf or nan).
FM = {"reassoc", "contract", "nsz", "arcp"}

F32, F16, BF16, Q8_0, Q4_0, Q4_K, Q5_K, Q6_K, MXFP4 = (QTYPES_BY_NAME[n].type_id for n in (
    "F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K", "MXFP4"))
# Types these kernels decode; tensors of other types take the numpy reference path.
SUPPORTED = {F32, F16, BF16, Q8_0, Q4_0, Q4_K, Q5_K, Q6_K, MXFP4}

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


@njit(fastmath=FM, cache=True)
def decode_row(qt, b, out, lut):
    """Raw bytes `b` of one row -> float32 `out` (len(out) weights)."""
    n = out.shape[0]
    if qt == F32:
        f = b.view(np.float32)
        for i in range(n):
            out[i] = f[i]
    elif qt == F16:
        for i in range(n):
            out[i] = lut[_u16(b, 2 * i)]
    elif qt == BF16:
        u = out.view(np.uint32)
        for i in range(n):
            u[i] = np.uint32(_u16(b, 2 * i)) << np.uint32(16)
    elif qt == Q8_0:
        for blk in range(n // 32):
            o = blk * 34
            d = lut[_u16(b, o)]
            for i in range(32):
                out[blk * 32 + i] = np.float32(_i8(b[o + 2 + i])) * d
    elif qt == Q4_0:
        for blk in range(n // 32):
            o = blk * 18
            d = lut[_u16(b, o)]
            for i in range(16):
                q = b[o + 2 + i]
                out[blk * 32 + i] = np.float32(np.int32(q & 0xF) - 8) * d
                out[blk * 32 + 16 + i] = np.float32(np.int32(q >> 4) - 8) * d
    elif qt == MXFP4:
        for blk in range(n // 32):
            o = blk * 17
            d = lut[E8M0 + b[o]]
            for i in range(16):
                q = b[o + 1 + i]
                out[blk * 32 + i] = d * MXFP4_VALUES[q & 0xF]
                out[blk * 32 + 16 + i] = d * MXFP4_VALUES[q >> 4]
    elif qt == Q4_K:
        for blk in range(n // 256):
            o = blk * 144
            d = lut[_u16(b, o)]
            dmin = lut[_u16(b, o + 2)]
            for j in range(4):
                sc1, m1 = _scale_min_k4(b, o + 4, 2 * j)
                sc2, m2 = _scale_min_k4(b, o + 4, 2 * j + 1)
                d1, dm1, d2, dm2 = d * sc1, dmin * m1, d * sc2, dmin * m2
                base = blk * 256 + 64 * j
                q0 = o + 16 + 32 * j
                for l in range(32):
                    q = b[q0 + l]
                    out[base + l] = d1 * np.float32(q & 0xF) - dm1
                    out[base + 32 + l] = d2 * np.float32(q >> 4) - dm2
    elif qt == Q5_K:
        for blk in range(n // 256):
            o = blk * 176
            d = lut[_u16(b, o)]
            dmin = lut[_u16(b, o + 2)]
            for j in range(4):
                sc1, m1 = _scale_min_k4(b, o + 4, 2 * j)
                sc2, m2 = _scale_min_k4(b, o + 4, 2 * j + 1)
                d1, dm1, d2, dm2 = d * sc1, dmin * m1, d * sc2, dmin * m2
                base = blk * 256 + 64 * j
                q0 = o + 48 + 32 * j
                for l in range(32):
                    q = b[q0 + l]
                    h = b[o + 16 + l] >> (2 * j)
                    out[base + l] = d1 * np.float32((q & 0xF) | ((h & 1) << 4)) - dm1
                    out[base + 32 + l] = d2 * np.float32((q >> 4) | ((h & 2) << 3)) - dm2
    elif qt == Q6_K:
        for blk in range(n // 256):
            o = blk * 210
            d = lut[_u16(b, o + 208)]
            for half in range(2):
                ql = o + 64 * half
                qh = o + 128 + 32 * half
                sc = o + 192 + 8 * half
                base = blk * 256 + 128 * half
                for l in range(32):
                    is_ = l // 16
                    a = b[ql + l]
                    c = b[ql + 32 + l]
                    h = b[qh + l]
                    q1 = np.int32((a & 0xF) | ((h & 3) << 4)) - 32
                    q2 = np.int32((c & 0xF) | (((h >> 2) & 3) << 4)) - 32
                    q3 = np.int32((a >> 4) | (((h >> 4) & 3) << 4)) - 32
                    q4 = np.int32((c >> 4) | (((h >> 6) & 3) << 4)) - 32
                    out[base + l] = (d * np.float32(_i8(b[sc + is_]))) * np.float32(q1)
                    out[base + 32 + l] = (d * np.float32(_i8(b[sc + is_ + 2]))) * np.float32(q2)
                    out[base + 64 + l] = (d * np.float32(_i8(b[sc + is_ + 4]))) * np.float32(q3)
                    out[base + 96 + l] = (d * np.float32(_i8(b[sc + is_ + 6]))) * np.float32(q4)


@njit(inline="always", fastmath=FM)
def _dot(a, b, n):
    s = np.float32(0)
    for k in range(n):
        s += a[k] * b[k]
    return s


@njit(inline="always", fastmath=FM)
def _dot4(w, x0, x1, x2, x3, n):
    s0 = s1 = s2 = s3 = np.float32(0)
    for k in range(n):
        v = w[k]
        s0 += v * x0[k]
        s1 += v * x1[k]
        s2 += v * x2[k]
        s3 += v * x3[k]
    return s0, s1, s2, s3


CHUNK = 8  # weight rows per parallel work item (one decode buffer each)


@njit(parallel=True, fastmath=FM, cache=True)
def matmul(out, x, w, qt, lut):
    """out[R, N] = x[R, K] @ W.T for raw weight rows w: uint8 [N, row_bytes] of type qt."""
    N = w.shape[0]
    R, K = x.shape
    for c in prange((N + CHUNK - 1) // CHUNK):
        buf = np.empty(K, np.float32)
        for n in range(c * CHUNK, min(N, (c + 1) * CHUNK)):
            decode_row(qt, w[n], buf, lut)
            r = 0
            while r + 4 <= R:
                s0, s1, s2, s3 = _dot4(buf, x[r], x[r + 1], x[r + 2], x[r + 3], K)
                out[r, n], out[r + 1, n], out[r + 2, n], out[r + 3, n] = s0, s1, s2, s3
                r += 4
            while r < R:
                out[r, n] = _dot(buf, x[r], K)
                r += 1


@njit(parallel=True, fastmath=FM, cache=True)
def get_rows(out, w, ids, qt, lut):
    """out[r] = row ids[r] of w (uint8 [N, row_bytes]) decoded to float32."""
    for r in prange(ids.shape[0]):
        decode_row(qt, w[ids[r]], out[r], lut)


@njit(parallel=True, fastmath=FM, cache=True)
def expert_ffn(out, x, gate, up, down, sel, offs, rows, rw, qg, qu, qd, lut):
    """out[rows] += rw * down(silu(gate(x)) * up(x)) over the chosen experts, in order.

    gate, up: uint8 [E, hidden, row_bytes]; down: uint8 [E, dim, row_bytes] (a file's expert
    tensor or a pool's slots). Expert j of the call is gate[sel[j]]; the activation rows it
    serves are rows[offs[j]:offs[j+1]] with weights rw[...]. Each out element adds its experts'
    terms in order j = 0, 1, ..., so a call split into groups of j gives the same bits.
    """
    n_sel = sel.shape[0]
    hidden = gate.shape[1]
    dim = x.shape[1]
    h = np.empty((rows.shape[0], hidden), np.float32)  # [routed rows, hidden]
    items = n_sel * hidden
    for c in prange((items + CHUNK - 1) // CHUNK):
        gb = np.empty(dim, np.float32)
        ub = np.empty(dim, np.float32)
        for it in range(c * CHUNK, min(items, (c + 1) * CHUNK)):
            j = it // hidden
            i = it - j * hidden
            decode_row(qg, gate[sel[j], i], gb, lut)
            decode_row(qu, up[sel[j], i], ub, lut)
            for p in range(offs[j], offs[j + 1]):
                xr = x[rows[p]]
                g = _dot(gb, xr, dim)
                u = _dot(ub, xr, dim)
                h[p, i] = g / (np.float32(1) + np.exp(-g)) * u
    for c in prange((dim + CHUNK - 1) // CHUNK):
        db = np.empty(hidden, np.float32)
        for d in range(c * CHUNK, min(dim, (c + 1) * CHUNK)):
            for j in range(n_sel):
                decode_row(qd, down[sel[j], d], db, lut)
                for p in range(offs[j], offs[j + 1]):
                    out[rows[p], d] += _dot(db, h[p], hidden) * rw[p]
