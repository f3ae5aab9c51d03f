"""Qwen3.5 / 3.6 MoE: Qwen3-Next's layers (models/qwen3next.py) with beta and alpha in two
matrices (`ssm_beta`, `ssm_alpha`), value heads stored tiled by llama.cpp's converter (value head
j reads key head j % key heads), and interleaved MRoPE (`rope.dimension_sections`), which for
text, one position per token in every section, is NeoX rope over rope_dim. Routing weights are
always renormalised (transformers' Qwen3_5MoeTopKRouter)."""

from __future__ import annotations

import numpy as np

from ..errors import ModelFileError
from . import blocks
from .base import TransformerLM
from .qwen3next import hybrid_config


class Network(TransformerLM):
    def expected_tensors(self, gguf):
        return blocks.hybrid_tensors(self.cfg, gguf)

    @staticmethod
    def config(gguf):
        cfg = hybrid_config(gguf, v_tiled=True, default_weights_norm=True)
        sections = gguf.get(f"{gguf.architecture}.rope.dimension_sections")
        if sections is not None:
            s = [int(v) for v in np.asarray(sections).reshape(-1)]
            e_pairs = imrope_e_pairs((s + [0, 0, 0, 0])[:4], cfg.rope_dim // 2)
            if e_pairs is None or e_pairs:
                raise ModelFileError(f"{gguf.path}: rope.dimension_sections {s} give rotary pairs "
                                     f"{e_pairs or 'all'} of rope.dimension_count {cfg.rope_dim} to no text section "
                                     "(llama.cpp leaves them unrotated, transformers does not): onebit runs text "
                                     "MRoPE as NeoX rope over all of it")
        return cfg

    def layer(self, g, i: int, x):
        return blocks.hybrid_layer(g, self.cfg, i, x)


def imrope_e_pairs(sections: list[int], n_pairs: int) -> list[int] | None:
    """The rotary pairs llama.cpp's interleaved MRoPE (ggml_mrope_cache_init, is_imrope) gives to
    the 4th section, whose position is 0 for text; every other pair turns by the token's position
    (text has one position in the first three sections), which is NeoX rope. None: no sections."""
    total = sum(sections)
    if total <= 0:
        return None
    t, h, w = sections[0], sections[1], sections[2]
    out = []
    for k in range(n_pairs):
        sector = k % total
        if not ((sector % 3 == 1 and sector < 3 * h) or (sector % 3 == 2 and sector < 3 * w)
                or (sector % 3 == 0 and sector < 3 * t)):
            out.append(k)
    return out
