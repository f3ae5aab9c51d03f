"""OLMoE: q/k norms over the whole projection, NeoX RoPE, un-normalised softmax top-k routing."""

from __future__ import annotations

import numpy as np

from ..config import config_from_gguf
from .base import TransformerLM
from .blocks import attention, moe_ffn, norm, output_head


class Model(TransformerLM):
    @staticmethod
    def config(gguf):
        return config_from_gguf(gguf, rope_neox=True, qk_norm="full", default_weights_norm=False)

    def forward(self, ids, cache, hook=None, last_only=False) -> np.ndarray:
        be, cfg = self.be, self.cfg
        pos = self.positions(cache, len(ids))  # [R]
        x = be.embed("token_embd.weight", ids)  # [R, dim]
        for i in range(cfg.n_layers):
            h = x + attention(be, cfg, i, norm(be, x, f"blk.{i}.attn_norm.weight", cfg.norm_eps), cache[i], pos)
            x = h + moe_ffn(be, cfg, i, norm(be, h, f"blk.{i}.ffn_norm.weight", cfg.norm_eps), hook)
        return output_head(be, cfg, x[-1:] if last_only else x)  # [R, vocab]
