"""Gemma 3 (dense): sliding-window layers with a global one every sixth (their own RoPE base),
per-head q/k norms, NeoX RoPE, norms before and after attention and FFN, GeGLU (tanh gelu),
embeddings scaled by sqrt(dim), tied output head, optional final logit softcapping.

llama.cpp's converter stores Gemma's norm weights as 1 + w, so they are plain RMS norms here.
GGUF has no key for `query_pre_attn_scalar`: like llama.cpp, q.k is scaled by 1/sqrt(head_dim)
(1/sqrt(dim / n_heads) for the 62-layer 27B model).
"""

from __future__ import annotations

import dataclasses
import math

from ..config import _float, _int, config_from_gguf, swa_layers_from_gguf
from . import blocks
from .base import TransformerLM

SWA_PERIOD = 6  # llama.cpp's default: layers 5, 11, 17, ... attend globally
LOCAL_ROPE_THETA = 10000.0  # rope.freq_base_swa when the file does not say (llama.cpp's default)


class Network(TransformerLM):
    @staticmethod
    def config(gguf):
        cfg = config_from_gguf(gguf, rope_neox=True, qk_norm="head")
        a = gguf.architecture
        window = _int(gguf, f"{a}.attention.sliding_window", 0, lo=0, hi=1 << 24)
        swa = swa_layers_from_gguf(gguf, cfg.n_layers, SWA_PERIOD) if window > 0 else ()
        head_scale = cfg.dim / cfg.n_heads if cfg.n_layers == 62 else cfg.head_dim
        return dataclasses.replace(
            cfg,
            sliding_window=window,
            swa_layers=swa,
            rope_theta_swa=_float(gguf, f"{a}.rope.freq_base_swa", LOCAL_ROPE_THETA),
            rope_scale_swa=1.0,
            attn_scale=1.0 / math.sqrt(head_scale),
            embed_scale=math.sqrt(cfg.dim),
            final_logit_softcap=_float(gguf, f"{a}.final_logit_softcapping", 0.0, zero_is_off=True),
            post_norms=True,
        )

    def layer(self, g, i: int, x):
        return blocks.sandwich_layer(g, self.cfg, i, x)
