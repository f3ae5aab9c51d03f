"""The small ops of a decode step, each microseconds of work, in serial kernels (attention
parallel over rows and heads): `rms_norm`, `rope`, `attention`, `attention_sinks` (gpt-oss),
`route` (softmax top-k) and `routed_rows` (which rows each chosen expert serves)."""

from __future__ import annotations

import numpy as np
from numba import prange

from .base import FM, cached


# -- the small ops of a decode step (serial but attention: each is microseconds of work) -------
# Their numpy twins (`NumpyBackend.rms_norm`, `rope`, `attention`, `route`) run the same float32
# arithmetic in another summation order.


@cached(fastmath=FM, nogil=True)
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


@cached(nogil=True)
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


@cached(fastmath=FM, nogil=True)
def attention(out, q, k, v, q_pos, window, scale):
    """Causal GQA attention for few rows (decode): q: [R, H, D] at positions q_pos; k: [S, Hkv,
    D], v: [S, Hkv, Dv] holding position p in row p % S (a sliding-window ring: S is its
    capacity); out: [R, H, Dv]. Row r sees positions 0..q_pos[r] (the last `window` only, if > 0).
    scale: the q.k scale (1 / sqrt(D) unless the model sets its own, as Gemma does)."""
    _attend(out, q, k, v, q_pos, window, np.float32(scale), np.empty(0, np.float32))


@cached(fastmath=FM, nogil=True)
def attention_sinks(out, q, k, v, q_pos, window, scale, sinks):
    """`attention` with a q.k scale of its own and attention sinks (gpt-oss): sinks[h] is a
    logit of head h that joins the softmax's denominator and weights no value. k, v hold
    position p in row p % S, as in `attention`."""
    _attend(out, q, k, v, q_pos, window, np.float32(scale), sinks.copy())  # (a copy: writable, as attention's)


@cached(parallel=True, fastmath=FM, nogil=True)
def _attend(out, q, k, v, q_pos, window, scale, sinks):
    """The loops of `attention` and `attention_sinks` (scale: float32): a (row, head) a thread,
    each in the order a serial loop would run it (the same bits whatever the threads). sinks:
    empty, or a logit per head (attention_sinks); one signature for both callers (it was compiled
    for each, 2-3 s of CPU apiece)."""
    has_sinks = sinks.shape[0] > 0
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


@cached(nogil=True)
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


@cached(nogil=True)
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
