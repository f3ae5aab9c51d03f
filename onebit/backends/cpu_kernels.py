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

import os

import numpy as np

# numba's OpenMP workers sleep at once when idle instead of spinning: on a machine whose cores
# are shared, spinning workers starve the thread that has the work, and each parallel region
# waits out a scheduler tick (measured: 1.0 vs 8.4 tok/s decode on 2 cores under load 6).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from numba import njit, prange  # noqa: E402

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


# Every kernel takes the block loops' length `m` (always M = 32) from its caller at run time:
# LLVM fully unrolls a loop of a constant 32 trips and then leaves it scalar; with a run-time
# count it vectorises it (measured: Q8_0 mat-vec 2x faster).
M = 32


@njit(fastmath=FM, cache=True)
def decode_row(qt, b, out, lut, m):
    """Raw bytes `b` of one row -> float32 `out` (len(out) weights); m = M."""
    n = out.shape[0]
    h = m // 2
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
        s = b.view(np.int8)
        for blk in range(n // m):
            o = blk * 34
            d = lut[_u16(b, o)]
            q = s[o + 2 : o + 2 + m]
            y = out[blk * m : blk * m + m]
            for i in range(m):
                y[i] = np.float32(q[i]) * d
    elif qt == Q4_0:
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
    elif qt == MXFP4:
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
    elif qt == Q4_K:
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
    elif qt == Q5_K:
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
    elif qt == Q6_K:
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
def matmul(out, x, w, qt, lut, m):
    """out[R, N] = x[R, K] @ W.T for raw weight rows w: uint8 [N, row_bytes] of type qt."""
    N = w.shape[0]
    R, K = x.shape
    for c in prange((N + CHUNK - 1) // CHUNK):
        buf = np.empty(K, np.float32)
        for n in range(c * CHUNK, min(N, (c + 1) * CHUNK)):
            decode_row(qt, w[n], buf, lut, m)
            r = 0
            while r + 4 <= R:
                s0, s1, s2, s3 = _dot4(buf, x[r], x[r + 1], x[r + 2], x[r + 3], K)
                out[r, n], out[r + 1, n], out[r + 2, n], out[r + 3, n] = s0, s1, s2, s3
                r += 4
            while r < R:
                out[r, n] = _dot(buf, x[r], K)
                r += 1


@njit(parallel=True, fastmath=FM, cache=True)
def get_rows(out, w, ids, qt, lut, m):
    """out[r] = row ids[r] of w (uint8 [N, row_bytes]) decoded to float32."""
    for r in prange(ids.shape[0]):
        decode_row(qt, w[ids[r]], out[r], lut, m)


@njit(parallel=True, fastmath=FM, cache=True)
def expert_ffn(out, x, gate, up, down, sel, offs, rows, rw, qg, qu, qd, lut, m):
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
            decode_row(qg, gate[sel[j], i], gb, lut, m)
            decode_row(qu, up[sel[j], i], ub, lut, m)
            for p in range(offs[j], offs[j + 1]):
                xr = x[rows[p]]
                g = _dot(gb, xr, dim)
                u = _dot(ub, xr, dim)
                h[p, i] = g / (np.float32(1) + np.exp(-g)) * u
    for c in prange((dim + CHUNK - 1) // CHUNK):
        db = np.empty(hidden, np.float32)
        for d in range(c * CHUNK, min(dim, (c + 1) * CHUNK)):
            for j in range(n_sel):
                decode_row(qd, down[sel[j], d], db, lut, m)
                for p in range(offs[j], offs[j + 1]):
                    out[rows[p], d] += _dot(db, h[p], hidden) * rw[p]


KERNELS = (matmul, get_rows, expert_ffn)
_warm = False


def warm_up() -> tuple[float, int]:
    """Load every kernel now (compiling it the first time on this machine), so that no
    compile lands in a forward pass. Returns (seconds, kernels compiled rather than loaded)."""
    global _warm
    import time

    if _warm:
        return 0.0, 0
    t0 = time.perf_counter()
    before = sum(len(k.stats.cache_misses) for k in KERNELS)
    w = np.zeros((2, 2, 34), np.uint8)
    w.flags.writeable = False
    x = np.zeros((1, 32), np.float32)
    ids = np.zeros(1, np.int64)
    matmul(np.empty((1, 2), np.float32), x, w[0], Q8_0, LUT, M)
    get_rows(np.empty((1, 32), np.float32), w[0], ids, Q8_0, LUT, M)
    h = np.zeros((1, 32, 34), np.uint8)  # one expert: hidden 32, dim 32
    h.flags.writeable = False
    offs = np.array([0, 1], np.int64)
    expert_ffn(np.zeros((1, 32), np.float32), x, h, h, h, ids, offs, ids, np.ones(1, np.float32),
               Q8_0, Q8_0, Q8_0, LUT, M)
    _warm = True
    return time.perf_counter() - t0, sum(len(k.stats.cache_misses) for k in KERNELS) - before
