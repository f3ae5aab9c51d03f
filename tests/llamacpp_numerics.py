"""Model llama.cpp CPU's activation rounding, to explain our differences from it.

llama.cpp's CPU matmul for a quantized weight first quantizes the activation row to the
weight type's `vec_dot_type` (Q8_0: 32-value blocks with an f16 scale; Q8_1: the same plus
the block's f16 sum, which Q4_1 / Q5_1 multiply by their minimum; Q8_K: 256-value blocks with
an f32 scale; F16 and BF16 weights: the activation in that type) and then takes integer dot
products. Our reference keeps f32 activations. tests/test_llamacpp_numerics.py holds this
model to llama.cpp's own functions. Rounding activations the same way in a patched numpy backend shows whether
the remaining difference is that rounding (and not our dequantization).
"""

from __future__ import annotations

import numpy as np

from onebit.backends import numpy_backend as nb
from onebit.formats.quants import QTYPES

Q8_K_TYPES = {"Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "TQ1_0", "TQ2_0", "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS",
              "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_XS"}
Q8_0_TYPES = {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "MXFP4", "Q1_0", "IQ4_NL"}
Q8_1_TYPES = {"Q4_1", "Q5_1"}  # Q8_0's values, and a block sum the weight's minimum multiplies


def round_activation(x: np.ndarray, qtype: int) -> np.ndarray:
    """x as llama.cpp's CPU matmul sees it: quantized to the weight type's vec_dot_type, in
    float32 as ggml does (quantize_row_q8_0: q = round-half-even(x * 127/amax), scale
    f16(amax/127); quantize_row_q8_K_ref: iscale = -127/max with max the signed value of
    largest |x|, q = min(127, nearest(iscale * x)), scale 1/iscale)."""
    name = QTYPES[qtype].name
    if name == "F16":
        return x.astype(np.float16).astype(np.float32)
    if name == "BF16":  # ggml_compute_fp32_to_bf16: round to nearest even (no NaN here)
        u = np.ascontiguousarray(x, np.float32).view(np.uint32)
        return ((u + (0x7FFF + ((u >> 16) & 1))) & 0xFFFF0000).astype(np.uint32).view(np.float32)
    if name in Q8_K_TYPES:
        block, q8_0 = 256, False
    elif name in Q8_0_TYPES:
        block, q8_0 = 32, True
    else:
        return x
    shape = x.shape
    b = x.reshape(-1, block).astype(np.float32)
    amax = np.abs(b).max(axis=1, keepdims=True)
    nz = amax > 0
    with np.errstate(divide="ignore", invalid="ignore"):
        if q8_0:
            inv = np.where(nz, np.float32(127) / amax, np.float32(0))
            d = (amax / np.float32(127)).astype(np.float16).astype(np.float32)
            q = np.round(b * inv)
        else:
            signed = np.take_along_axis(b, np.abs(b).argmax(axis=1)[:, None], axis=1)  # first of largest |x|
            inv = np.where(nz, np.float32(-127) / signed, np.float32(0))
            d = np.where(nz, np.float32(1) / inv, np.float32(0))
            q = np.minimum(np.round(b * inv), 127)
    return (q * d).reshape(shape).astype(np.float32)


def q8_1_correction(x: np.ndarray, raw: np.ndarray, qtype: int) -> np.ndarray | None:
    """What llama.cpp's Q4_1 / Q5_1 dot adds to round_activation(x) @ W.T: per 32-block, the
    weight's minimum m times (f16(d * sum q) - f16(d) * sum q), the Q8_1 block sum it uses
    against the one the rounded values add up to. x [R, n], raw [out, row_bytes] -> [R, out]."""
    if QTYPES[qtype].name not in Q8_1_TYPES:
        return None
    b = x.reshape(len(x), -1, 32).astype(np.float32)
    amax = np.abs(b).max(axis=2)
    with np.errstate(divide="ignore", invalid="ignore"):
        inv = np.where(amax > 0, np.float32(127) / amax, np.float32(0))
    d = amax / np.float32(127)
    sq = np.round(b * inv[..., None]).sum(axis=2, dtype=np.float32)  # [R, nb]
    c = (d * sq).astype(np.float16).astype(np.float32) - d.astype(np.float16).astype(np.float32) * sq
    q = QTYPES[qtype]
    m = raw.reshape(len(raw), -1, q.type_size)[:, :, 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    return c @ m.T  # [R, out]


def _rounded_matmul(x: np.ndarray, t, index=None) -> np.ndarray:
    y = round_activation(x, t.qtype) @ nb.dequantize(t, index).T
    raw = t.raw if index is None else t.raw[index]
    corr = q8_1_correction(x, raw.reshape(-1, raw.shape[-1]), t.qtype)
    return y if corr is None else y + corr


def gelu_f16_table(x: np.ndarray) -> np.ndarray:
    """llama.cpp CPU's GELU (GGML_GELU_FP16, ggml_vec_geglu_f32): the f16 table entry of f16(x),
    0 at x <= -10, x at x >= 10."""
    f = x.astype(np.float16).astype(np.float32)
    u = np.float32(0.79788456080286535587989211986876) * f * (np.float32(1) + np.float32(0.044715) * f * f)
    t = np.tanh(u.astype(np.float64)).astype(np.float32)  # tanhf, correctly rounded (numpy's float32 tanh is not)
    y = (np.float32(0.5) * f * (np.float32(1) + t)).astype(np.float16).astype(np.float32)  # ggml_gelu_f32
    return np.where(x <= -10, np.float32(0), np.where(x >= 10, x, y)).astype(np.float32)


class LlamaCppRoundingBackend(nb.NumpyBackend):
    gelu_tanh = staticmethod(gelu_f16_table)

    def linear(self, x, name):
        t = self.gguf.tensor(name)
        shape = x.shape
        y = _rounded_matmul(x.reshape(-1, shape[-1]), t)
        return y.reshape(*shape[:-1], y.shape[-1])

    def experts(self, layer, x, ids, weights, glu=None):
        gate, up, down = (self.gguf.tensor(f"blk.{layer}.ffn_{p}_exps.weight") for p in ("gate", "up", "down"))
        biases = self.expert_biases(layer)  # gpt-oss: [E, width] per part, else None
        out = np.zeros_like(x)
        for e in np.unique(ids):
            rows, slot = np.nonzero(ids == e)
            g, u = _rounded_matmul(x[rows], gate, int(e)), _rounded_matmul(x[rows], up, int(e))
            if biases is not None:
                g, u = g + biases[0][e], u + biases[1][e]
            h = self.silu(g) * u if glu is None else self.glu_oai(g, u, *glu)
            y = _rounded_matmul(h, down, int(e))
            if biases is not None:
                y = y + biases[2][e]
            out[rows] += y * weights[rows, slot][:, None]
        return out
