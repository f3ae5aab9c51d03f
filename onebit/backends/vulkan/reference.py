"""The numpy twins of the Vulkan kernels: same signatures as `ops.VulkanOps`, float32 maths.

Where the numpy backend already has the op, the twin is that op, so the kernels are held to
the same reference the model graph uses.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from ...formats.quants import QTYPES
from ..numpy_backend import NumpyBackend

_NP = NumpyBackend(None)
_BY_NAME = {cls.name: cls for cls in QTYPES.values()}


def dequantize(w_raw: np.ndarray, type_name: str) -> np.ndarray:
    return _BY_NAME[type_name].dequantize(w_raw)


def mul_mv(w_raw: np.ndarray, type_name: str, x: np.ndarray) -> np.ndarray:
    """x: [R, in] @ W[out, in].T -> [R, out]; W in its quantized layout [out, row_bytes]."""
    return x @ dequantize(w_raw, type_name).T


def mul_mm(w_raw: np.ndarray, type_name: str, x: np.ndarray) -> np.ndarray:
    return mul_mv(w_raw, type_name, x)


def mul_mv_id(w_raw: np.ndarray, type_name: str, x: np.ndarray, ids: np.ndarray,
              wts: Optional[np.ndarray] = None, mode: str = "slots") -> np.ndarray:
    """W: [E, out, row_bytes]; x: [R, in] (every slot) or [R, k, in]; ids, wts: [R, k].
    "slots" -> [R, k, out]; "weighted" -> [R, k, out] times wts; "sum" -> [R, out]."""
    R, k = ids.shape
    xs = np.broadcast_to(x[:, None, :], (R, k, x.shape[-1])) if x.ndim == 2 else x
    out = np.stack([
        np.stack([dequantize(w_raw[ids[r, s]], type_name) @ xs[r, s] for s in range(k)]) for r in range(R)
    ]).astype(np.float32)  # [R, k, out]
    if mode == "slots":
        return out
    out = out * wts[:, :, None]
    return out if mode == "weighted" else out.sum(axis=1)


def get_rows(w_raw: np.ndarray, type_name: str, ids: np.ndarray) -> np.ndarray:
    return dequantize(w_raw[np.asarray(ids, dtype=np.int64)], type_name)


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return _NP.rms_norm(x, w, eps)


def rope(x: np.ndarray, pos: np.ndarray, n_rot: int, theta: float, neox: bool, scale: float = 1.0,
         factors: Optional[np.ndarray] = None) -> np.ndarray:
    return _NP.rope(x, pos, n_rot, theta, neox, scale, factors)


def router(logits: np.ndarray, k: int, norm: bool) -> tuple[np.ndarray, np.ndarray]:
    return _NP.route(logits, k, norm)


def sigmoid_router(logits: np.ndarray, bias: Optional[np.ndarray], k: int, norm: bool, scale: float = 1.0,
                   groups: int = 1, groups_used: int = 1) -> tuple[np.ndarray, np.ndarray]:
    return _NP.route_sigmoid(logits, k, bias, norm, scale, groups, groups_used)


def add(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return a + b


def mul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return a * b


def silu(a: np.ndarray) -> np.ndarray:
    return _NP.silu(a)


def swiglu(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return _NP.silu(a) * b


def geglu(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return _NP.gelu_tanh(a) * b


def softcap(a: np.ndarray, cap: float) -> np.ndarray:
    return _NP.softcap(a, cap)


def argmax(x: np.ndarray) -> np.ndarray:
    return np.argmax(x, axis=-1)


def greedy_next(logits: np.ndarray, pos: int) -> tuple[int, int, int, bool]:
    """(next token, next position, the token the host reads, whether any logit is NaN / inf);
    the token is the argmax of the finite logits (0 if there are none)."""
    bad = ~np.isfinite(logits)
    tok = int(np.argmax(np.where(bad, -np.inf, logits))) if not bad.all() else 0
    return tok, pos + 1, tok, bool(bad.any())


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, q_pos: np.ndarray, window: int = 0,
              scale: Optional[float] = None, sinks: Optional[np.ndarray] = None) -> np.ndarray:
    return _NP.attention(q, k, v, q_pos, window, scale, sinks)


def expert_glu_oai(g: np.ndarray, u: np.ndarray, ids: np.ndarray, bg: np.ndarray, bu: np.ndarray,
                   alpha: float, limit: float) -> np.ndarray:
    """g, u: [R, k, F] gate and up products of experts ids [R, k]; bg, bu: [E, F]."""
    return _NP.glu_oai(g + bg[ids], u + bu[ids], alpha, limit)


def expert_down_bias(y: np.ndarray, ids: np.ndarray, wts: np.ndarray, bd: np.ndarray) -> np.ndarray:
    """y: [R, dim] plus each row's experts' down biases bd: [E, dim], weighted."""
    return y + np.einsum("rk,rkd->rd", wts, bd[ids])


def set_rows(dst: np.ndarray, src: np.ndarray, pos: np.ndarray, wrap: bool = False) -> np.ndarray:
    """dst with row pos[r] (wrap: pos[r] % len(dst), a sliding-window ring) set to src[r]."""
    out = dst.copy()
    out[pos % len(dst) if wrap else pos] = src
    return out


def hadamard(x: np.ndarray, n: int) -> np.ndarray:
    """x with every chunk of n values rotated by the n x n Walsh-Hadamard matrix over sqrt(n)."""
    from ...cache import hadamard as rotate

    return rotate(x, n)


def set_rows_q(dst: np.ndarray, src: np.ndarray, pos: np.ndarray, type_name: str, wrap: bool = False) -> np.ndarray:
    """dst (raw ggml blocks, uint8 [rows, row bytes]) with row pos[r] (wrap: % rows) set to src[r]
    (float32 [R, n]) quantized as ggml's reference quantizer does (`quants.<T>.quantize`)."""
    from ...formats.quants import QTYPES_BY_NAME

    out = dst.copy()
    out[pos % len(dst) if wrap else pos] = QTYPES_BY_NAME[type_name].quantize(src)
    return out


# Byte offsets of the f16 scales in each block type; random bytes elsewhere are all valid.
_F16_SCALES = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q1_0": (0,),
               "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
               "TQ1_0": (52,), "TQ2_0": (64,), "IQ2_XXS": (0,), "IQ2_XS": (0,), "IQ2_S": (0,), "IQ3_XXS": (0,),
               "IQ3_S": (0,), "IQ1_S": (0,), "IQ4_NL": (0,), "IQ4_XS": (0,)}


def _iq1_m_set_d(raw: np.ndarray, d: np.ndarray) -> None:
    """IQ1_M keeps its f16 d in the top nibbles of the four u16 scale words (bytes 48..55)."""
    bits = d.astype(np.float16).view(np.uint16).astype(np.uint16)
    sc = raw[:, 48:56].copy().view("<u2") & np.uint16(0x0FFF)
    for k in range(4):
        sc[:, k] |= ((bits >> np.uint16(4 * k)) & np.uint16(15)) << np.uint16(12)
    raw[:, 48:56] = sc.view(np.uint8)


def random_blocks(type_name: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Random weights in `type_name`'s layout: uint8 [*shape[:-1], row_bytes].

    Float types come from normal values; block types are random bytes (every quant bit
    pattern, every packed scale) with sane f16 scales (and E8M0 exponents for MXFP4), so the
    dequantized values stay finite and O(1)."""
    cls = _BY_NAME[type_name]
    lead, n = tuple(shape[:-1]), shape[-1]
    if type_name in ("F32", "F16", "BF16"):
        f = rng.standard_normal(shape).astype(np.float32)
        if type_name == "F16":
            f = f.astype(np.float16)
        elif type_name == "BF16":
            f = (f.view(np.uint32) >> 16).astype(np.uint16)
        return f.view(np.uint8).reshape(*lead, -1)
    nb = int(np.prod(shape)) // cls.block_size
    raw = rng.integers(0, 256, (nb, cls.type_size), dtype=np.uint8)
    if type_name == "MXFP4":
        raw[:, 0] = rng.integers(120, 128, nb)  # 2^-8 .. 2^-1
    for off in _F16_SCALES.get(type_name, ()):
        d = rng.uniform(0.002, 0.05, nb) * rng.choice([-1.0, 1.0], nb)
        raw[:, off : off + 2] = d.astype(np.float16).view(np.uint8).reshape(nb, 2)
    if type_name == "IQ1_M":
        _iq1_m_set_d(raw, rng.uniform(0.002, 0.05, nb) * rng.choice([-1.0, 1.0], nb))
    return raw.reshape(*lead, n // cls.block_size * cls.type_size)


# -- Gated DeltaNet ---------------------------------------------------------------------------


def cols(a: np.ndarray, c0: int, w: int) -> np.ndarray:
    """a[..., c0:c0 + w], contiguous."""
    return np.ascontiguousarray(a[..., c0 : c0 + w])


def sigmoid_mul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return a * _NP.sigmoid(b)


def gdn_gates(b: np.ndarray, a: np.ndarray, dt: np.ndarray, A: np.ndarray):
    return _NP.gdn_gates(b, a, dt, A)


def ssm_conv(x: np.ndarray, hist: np.ndarray, w: np.ndarray):
    """(silu(conv) [R, C], the new history [K-1, C])."""
    return _NP.ssm_conv(x, hist, w)


def delta_rule(q, k, v, g, beta, state, eps: float, tiled: bool = False):
    """(o [R, Hv, D], the new state [Hv, D, D]), one step per row."""
    return _NP.delta_rule(q, k, v, g, beta, state, eps, tiled, 0)


def delta_chunk(q, k, v, g, beta, state, eps: float, tiled: bool = False, chunk: int = 32):
    """(o [R, Hv, D], the new state [Hv, D, D]) in the chunked form, blocks of `chunk` rows
    (delta_chunk.comp: the same block sums, u by forward substitution where this solves)."""
    return _NP.delta_rule(q, k, v, g, beta, state, eps, tiled, chunk)
