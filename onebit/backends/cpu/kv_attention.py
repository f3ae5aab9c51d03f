"""Decode attention over a quantized KV cache's blocks as stored (--cache-type-k / -v f16,
q8_0, q4_0): each position's key and value rows decoded as the loop reaches them, once for all
the query heads of their group, instead of the whole layer decoded to float32 every step. The
numpy twin is NumpyBackend.attention over the rows KVRows.read decodes (the same values)."""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from .base import FM, cached
from .decode import _decode_f16, _decode_q4_0, _decode_q8_0

KV_CODES = {"F16": 0, "Q8_0": 1, "Q4_0": 2}  # a stored type's code in `attention_blocks`


@njit(inline="always")
def _decode(b, code, out, lut, m):
    if code == 0:
        _decode_f16(b, out, lut, m)
    elif code == 1:
        _decode_q8_0(b, out, lut, m)
    else:
        _decode_q4_0(b, out, lut, m)


@cached(parallel=True, fastmath=FM, nogil=True)
def attention_blocks(out, q, k, kcode, v, vcode, q_pos, window, scale, lut, m):
    """`small_ops.attention` with keys k: [S, Hkv, bytes of a D-wide row] and values v: [S, Hkv,
    bytes of a Dv-wide row] stored as types kcode / vcode (KV_CODES; uint8 rows of ggml blocks,
    position p in row p % S); q: [R, H, D], out: [R, H, Dv]. A (row, KV head) a thread: each
    position's rows decoded once for the heads of the group. lut: base.LUT (f16 values), m: M."""
    R, H, D = q.shape
    S, Hkv = k.shape[0], k.shape[1]
    Dv = out.shape[2]
    group = H // Hkv
    for rk in prange(R * Hkv):
        r, kh = rk // Hkv, rk % Hkv
        lo = max(0, q_pos[r] - window + 1) if window > 0 else 0
        n = q_pos[r] + 1 - lo
        p = np.empty((group, n), np.float32)  # p[g, j]: head kh * group + g, position lo + j
        top = np.full(group, -np.inf, np.float32)
        kb = np.empty(D, np.float32)
        vb = np.empty(Dv, np.float32)
        row = lo % S
        for j in range(n):
            _decode(k[row, kh], kcode, kb, lut, m)
            for g in range(group):
                qr = q[r, kh * group + g]
                t = np.float32(0)
                for i in range(D):
                    t += qr[i] * kb[i]
                t *= scale
                p[g, j] = t
                top[g] = max(top[g], t)
            row = row + 1 if row + 1 < S else 0
        tot = np.zeros(group, np.float32)
        for g in range(group):
            for j in range(n):
                e = np.float32(np.exp(p[g, j] - top[g]))
                p[g, j] = e
                tot[g] += e
            out[r, kh * group + g, :] = 0
        row = lo % S
        for j in range(n):
            _decode(v[row, kh], vcode, vb, lut, m)
            for g in range(group):
                ps = p[g, j] / tot[g]
                o = out[r, kh * group + g]
                for i in range(Dv):
                    o[i] += ps * vb[i]
            row = row + 1 if row + 1 < S else 0
