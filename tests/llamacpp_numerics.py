"""Model llama.cpp CPU's activation rounding, to explain our differences from it.

llama.cpp's CPU matmul for a quantized weight first quantizes the activation row to the
weight type's `vec_dot_type` (Q8_0: 32-value blocks with an f16 scale; Q8_K: 256-value
blocks with an f32 scale) and then takes integer dot products. Our reference keeps f32
activations. Rounding activations the same way in a patched numpy backend shows whether
the remaining difference is that rounding (and not our dequantization).
"""

from __future__ import annotations

import numpy as np

from onebit.backends import numpy_backend as nb
from onebit.quants import QTYPES

Q8_K_TYPES = {"Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "TQ1_0", "TQ2_0", "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS",
              "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_XS"}
Q8_0_TYPES = {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "MXFP4", "Q1_0", "IQ4_NL"}


def round_activation(x: np.ndarray, qtype: int) -> np.ndarray:
    name = QTYPES[qtype].name
    if name in Q8_K_TYPES:
        block, f16 = 256, False
    elif name in Q8_0_TYPES:
        block, f16 = 32, True
    else:
        return x
    shape = x.shape
    b = x.reshape(-1, block)
    d = np.abs(b).max(axis=1, keepdims=True) / 127
    if f16:
        d = d.astype(np.float16).astype(np.float32)
    inv = np.where(d > 0, 1 / np.where(d > 0, d, 1), 0)
    q = np.clip(np.round(b * inv), -127, 127)
    return (q * d).reshape(shape).astype(np.float32)


class LlamaCppRoundingBackend(nb.NumpyBackend):
    def linear(self, x, name):
        return super().linear(round_activation(x, self.gguf.tensor(name).qtype), name)

    def experts(self, x, layer, ids, weights, glu=None):
        gate, up, down = (self.gguf.tensor(f"blk.{layer}.ffn_{p}_exps.weight") for p in ("gate", "up", "down"))
        biases = self.expert_biases(layer)  # gpt-oss: [E, width] per part, else None
        out = np.zeros_like(x)
        for e in np.unique(ids):
            rows, slot = np.nonzero(ids == e)
            xg = round_activation(x[rows], gate.qtype)
            xu = round_activation(x[rows], up.qtype)
            g, u = xg @ nb.dequantize(gate, int(e)).T, xu @ nb.dequantize(up, int(e)).T
            if biases is not None:
                g, u = g + biases[0][e], u + biases[1][e]
            h = self.silu(g) * u if glu is None else self.glu_oai(g, u, *glu)
            y = round_activation(h, down.qtype) @ nb.dequantize(down, int(e)).T
            if biases is not None:
                y = y + biases[2][e]
            out[rows] += y * weights[rows, slot][:, None]
        return out
