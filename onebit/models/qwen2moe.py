"""Qwen2-MoE: q/k/v biases, NeoX RoPE, un-normalised top-k routing plus a sigmoid-gated shared expert."""

from __future__ import annotations

from ..config import config_from_gguf
from .base import TransformerLM


class Network(TransformerLM):  # the shared pre-norm decoder layer (blocks.decoder_layer)
    @staticmethod
    def config(gguf):
        return config_from_gguf(gguf, rope_neox=True, default_weights_norm=False)
