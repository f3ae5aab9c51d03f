"""Qwen3-MoE: per-head q/k norms, NeoX RoPE, softmax top-k routing renormalised to 1."""

from __future__ import annotations

from ..config import config_from_gguf
from .base import TransformerLM


class Network(TransformerLM):  # the shared pre-norm decoder layer (blocks.decoder_layer)
    @staticmethod
    def config(gguf):
        return config_from_gguf(gguf, rope_neox=True, qk_norm="head", default_weights_norm=True)
