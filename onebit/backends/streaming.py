"""Streamed experts on the numpy backend: each MoE layer's routed experts come from a slot pool.

Only where the expert bytes come from changes; the arithmetic is the resident path's, in
the same order, so the output is bit-identical to fully resident (invariant 3).
"""

from __future__ import annotations

import numpy as np

from ..gguf_file import EXPERT_PARTS as PARTS
from .numpy_backend import NumpyBackend


class StreamingNumpyBackend(NumpyBackend):
    name = "numpy"

    def __init__(self, gguf, pool):
        super().__init__(gguf)
        self.pool = pool

    def experts(self, x: np.ndarray, layer: int, ids: np.ndarray, weights: np.ndarray, glu=None) -> np.ndarray:
        parts = [self.gguf.tensor(f"blk.{layer}.{p}.weight") for p in PARTS]
        biases = self.expert_biases(layer)
        out = np.zeros_like(x)
        experts = [int(e) for e in np.unique(ids)]
        # (a read that fails because the file changed is named by the model's forward)
        for _, group, slots in self.pool.pinned_groups(layer, experts):
            for e, slot in zip(group, slots):
                raws = [self.pool.slot_view(layer, slot, p) for p in PARTS]
                self.expert_ffn(out, x, ids, weights, e, parts, raws, biases, glu)
        return out
