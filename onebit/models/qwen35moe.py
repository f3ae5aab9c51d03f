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


class Model(TransformerLM):
    def expected_tensors(self, gguf):
        return blocks.hybrid_tensors(self.cfg, gguf)

    @staticmethod
    def config(gguf):
        cfg = hybrid_config(gguf, v_tiled=True, default_weights_norm=True)
        sections = gguf.get(f"{gguf.architecture}.rope.dimension_sections")
        if sections is not None and int(np.sum(np.asarray(sections).reshape(-1)[:3])) * 2 != cfg.rope_dim:
            raise ModelFileError(f"{gguf.path}: rope.dimension_sections {list(np.asarray(sections).reshape(-1))} "
                                 f"does not cover rope.dimension_count {cfg.rope_dim} (text MRoPE is NeoX rope over all of it)")
        return cfg

    def layer(self, g, i: int, x):
        return blocks.hybrid_layer(g, self.cfg, i, x)
