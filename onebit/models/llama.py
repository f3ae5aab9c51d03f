"""Llama: interleaved RoPE (the converter permutes q/k), SwiGLU FFN, or Mixtral-style experts.

GGUF stores Mixtral as `llama` with expert tensors: softmax top-k routing, renormalised.
"""

from __future__ import annotations

from ..config import config_from_gguf
from .base import TransformerLM


class Network(TransformerLM):  # the shared pre-norm decoder layer (blocks.decoder_layer)
    @staticmethod
    def config(gguf):
        return config_from_gguf(gguf, rope_neox=False, default_weights_norm=True)
