"""Qwen2-MoE: q/k/v biases, NeoX RoPE, un-normalised top-k routing plus a sigmoid-gated shared expert."""

from __future__ import annotations

import numpy as np

from ..config import config_from_gguf
from .base import TransformerLM
from .blocks import attention, moe_ffn, norm, output_head, shared_expert


class Model(TransformerLM):
    @staticmethod
    def config(gguf):
        return config_from_gguf(gguf, rope_neox=True, default_weights_norm=False)

    def forward(self, ids, cache, hook=None, last_only=False) -> np.ndarray:
        be, cfg = self.be, self.cfg
        pos = self.positions(cache, len(ids))  # [R]
        x = be.embed("token_embd.weight", ids)  # [R, dim]
        for i in range(cfg.n_layers):
            h = x + attention(be, cfg, i, norm(be, x, f"blk.{i}.attn_norm.weight", cfg.norm_eps), cache[i], pos)
            hn = norm(be, h, f"blk.{i}.ffn_norm.weight", cfg.norm_eps)
            x = h + moe_ffn(be, cfg, i, hn, hook) + shared_expert(be, i, hn)
        return output_head(be, cfg, x[-1:] if last_only else x)  # [R, vocab]
