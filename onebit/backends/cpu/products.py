"""The products, the kernels that read weights: `matmul` (parallel over chunks of output rows),
`matmul_serial`, `matmul3` (q, k and v of one input in one parallel region), `get_rows`, and
the expert FFNs `expert_ffn` and gpt-oss's `expert_ffn_oai` (parallel over experts). Each
writes every output element from one thread in a fixed order: the results do not depend on the
thread count. These are the all-types kernels; kernel_sets.py clones them for a file's types."""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from .base import FM, cached
from .views import borrowed, keep_alive, lent, row_of
from .decode import _row_decoders
from .float_dots import IR_TYPES
from .int_dots import quantize_acts
from .rows import _ORDER, _dispatch, _is_int, _rows_of


globals().update(_is_int(IR_TYPES))
globals().update(_rows_of(_ORDER))


@cached(nogil=True)
def acts(x, want):
    """x's int16 blocks (quantize_acts) if `want` (some product of x is of INT_TYPES), else empty."""
    if want:
        return quantize_acts(x)
    return np.empty((0, 0), np.int16), np.empty((0, 0), np.float32), np.empty((0, 0), np.float32)


decode_row = _dispatch(_row_decoders(), "out, lut, m", "Raw bytes w of one row -> float32 out (len(out) "
                       "weights); m = M.", _ORDER)


@njit(inline="always")
def ZERO():
    """0 as an int64 value, not a constant: numba compiles a function called with the constant 0
    for that constant, and `matmul_rows` (every type's row loops) was compiled three times for
    each kernel set (n0 and col 0 or not: 1.3-1.5 s each for Q8_0 and F32, more per type)."""
    return np.int64(0)


@cached(nogil=True)
def matmul_rows(out, x, a, w, qt, n0, n1, col):
    """out[:, col + n] = x @ row n of w, for n in [n0, n1); a = acts(x, is_int(qt))."""
    aq, ad, am = lent(a)
    rows_of(qt, w, out, borrowed(x), aq, ad, am, n0, n1, col)


CHUNK = 16  # weight rows per parallel work item
# Below this many weights x rows a product runs on the calling thread: waking a worker costs more
# than the work (on a busy machine a woken worker may wait a scheduler tick for a core).
SERIAL_WORK = 1 << 19


@cached(parallel=True, nogil=True)
def matmul(out, x, w, qt):
    """out[R, N] = x[R, K] @ W.T for raw weight rows w: uint8 [N, row_bytes] of type qt."""
    N = w.shape[0]
    a = acts(x, is_int(qt))
    ab, out, x, w = lent(a), borrowed(out), borrowed(x), borrowed(w)  # (no counted references in the loop)
    for c in prange((N + CHUNK - 1) // CHUNK):
        matmul_rows(out, x, ab, w, qt, c * CHUNK, min(N, (c + 1) * CHUNK), ZERO())
    keep_alive(a)


@cached(nogil=True)
def matmul_serial(out, x, w, qt):
    matmul_rows(out, x, acts(x, is_int(qt)), w, qt, ZERO(), w.shape[0], ZERO())


@cached(parallel=True, nogil=True)
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
            matmul_rows(out, x, ab, w0, qt0, c * CHUNK, min(N0, (c + 1) * CHUNK), ZERO())
        elif c < c1:
            matmul_rows(out, x, ab, w1, qt1, (c - c0) * CHUNK, min(N1, (c - c0 + 1) * CHUNK), N0)
        else:
            matmul_rows(out, x, ab, w2, qt2, (c - c1) * CHUNK, min(N2, (c - c1 + 1) * CHUNK), N0 + N1)
    keep_alive(a)


@cached(nogil=True)
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


@cached(nogil=True)
def gate_up(x, a, gate, up, e, rows, qg, qu):
    """Expert e's gate and up products of x's rows `rows` (a = acts(x, ..)): g, u [rows, hidden]."""
    n, hidden = rows.shape[0], gate.shape[1]
    xr, ar = _expert_rows(x, a, rows)  # [rows, dim]
    g = np.empty((n, hidden), np.float32)  # [rows, hidden]
    u = np.empty((n, hidden), np.float32)
    matmul_rows(g, xr, ar, row_of(gate, e), qg, ZERO(), hidden, ZERO())
    matmul_rows(u, xr, ar, row_of(up, e), qu, ZERO(), hidden, ZERO())
    return g, u


@cached(nogil=True)
def one_expert(y, x, a, gate, up, down, e, rows, qg, qu, qd):
    """y[p] = down(silu(gate(x[rows[p]])) * up(x[rows[p]])) for expert e, p in [0, len(rows));
    a = acts(x, ..) (x's int16 blocks when gate or up is of INT_TYPES)."""
    n, hidden = rows.shape[0], gate.shape[1]
    g, u = gate_up(x, a, gate, up, e, rows, qg, qu)  # [rows, hidden] each
    for p in range(n):
        for i in range(hidden):
            g[p, i] = g[p, i] / (np.float32(1) + np.exp(-g[p, i])) * u[p, i]
    matmul_rows(y, g, acts(g, is_int(qd)), row_of(down, e), qd, ZERO(), down.shape[1], ZERO())


@cached(parallel=True, nogil=True)
def expert_ffn(out, y, x, gate, up, down, sel, js, offs, rows, rw, add, qg, qu, qd):
    """y[rows of j] = down(silu(gate(x)) * up(x)) for the chosen experts j in js; then, if add,
    out[rows] += rw * y over every routed row, in order.

    gate, up: uint8 [E, hidden, row_bytes]; down: uint8 [E, dim, row_bytes] (a file's expert
    tensor or a pool's slots). Expert j = js[i] of the routing is gate[sel[i]]; the activation
    rows it serves are rows[offs[j]:offs[j+1]] with weights rw[...], and its output goes to
    y[offs[j]:offs[j+1]] ([routed rows, dim]). One parallel region: a thread runs whole
    experts. The sum adds each out element's experts' terms in order j = 0, 1, ..., so the
    experts computed in any grouping, in any order, before the call that adds give the same bits.
    """
    a = acts(x, is_int(qg) or is_int(qu))
    ab, xb, gate, up, down = lent(a), borrowed(x), borrowed(gate), borrowed(up), borrowed(down)
    for i in prange(js.shape[0]):
        j = js[i]
        one_expert(y[offs[j] : offs[j + 1]], xb, ab, gate, up, down, sel[i], rows[offs[j] : offs[j + 1]], qg, qu, qd)
    keep_alive(a)
    if add:
        _add_rows(out, y, rows, rw)


@njit(inline="always")
def _add_rows(out, y, rows, rw):
    """out[rows[p]] += rw[p] * y[p], p = 0, 1, ... in order."""
    for p in range(rows.shape[0]):
        o, yp, w = out[rows[p]], y[p], rw[p]
        for d in range(y.shape[1]):
            o[d] += yp[d] * w


@cached(fastmath=FM, nogil=True)
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
    matmul_rows(y, g, acts(g, is_int(qd)), row_of(down, e), qd, ZERO(), down.shape[1], ZERO())
    for p in range(n):
        for d in range(y.shape[1]):
            y[p, d] += bd[d]


@cached(parallel=True, nogil=True)
def expert_ffn_oai(out, y, x, gate, up, down, sel, js, eids, offs, rows, rw, add, qg, qu, qd, bg, bu, bd, alpha, limit):
    """`expert_ffn` for gpt-oss experts (`one_expert_oai`): expert j = js[i]'s weights are
    gate[sel[i]] and its biases bg[eids[j]], bu[eids[j]] ([E, hidden]), bd[eids[j]] ([E, dim]);
    the same order of sums."""
    a = acts(x, is_int(qg) or is_int(qu))
    ab, xb, gate, up, down = lent(a), borrowed(x), borrowed(gate), borrowed(up), borrowed(down)
    for i in prange(js.shape[0]):
        j = js[i]
        e = eids[j]
        one_expert_oai(y[offs[j] : offs[j + 1]], xb, ab, gate, up, down, sel[i], rows[offs[j] : offs[j + 1]],
                       qg, qu, qd, bg[e], bu[e], bd[e], alpha, limit)
    keep_alive(a)
    if add:
        _add_rows(out, y, rows, rw)
