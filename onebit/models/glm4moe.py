"""GLM-4.5 / 4.5-Air / 4.6 (glm4moe): the first `leading_dense_block_count` layers have a dense
SwiGLU FFN, the rest routed experts plus an ungated shared expert. The router scores experts by
sigmoid (not softmax); the expert-score correction bias `exp_probs_b` is added for choosing the
top k only (the weights are the unbiased scores), optionally within the best expert groups;
the kept weights are renormalised (`expert_weights_norm`) and multiplied by the routed scaling
factor (`expert_weights_scale`). Attention has q/k/v biases, optional per-head q/k norms, and
NeoX RoPE over the first `rope.dimension_count` dims of each head (half of them in GLM-4.5).
The FFN's norm is `post_attention_norm`.

NextN / MTP layers (`nextn_predict_layers`, counted in block_count, after the others) are in
real files; like llama.cpp, onebit does not run them (config.py sets their tensors aside).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ..config import _float, _int, config_from_gguf
from ..errors import ModelFileError, UnsupportedModelError
from . import blocks
from .base import TransformerLM

GATING_SIGMOID = 2  # llama.cpp's expert_gating_func values: 1 softmax, 2 sigmoid (0: unset -> sigmoid)


class Network(TransformerLM):
    @staticmethod
    def config(gguf):
        qk_norm = "head" if "blk.0.attn_q_norm.weight" in gguf.tensors else "none"
        cfg = config_from_gguf(gguf, rope_neox=True, qk_norm=qk_norm)
        a, E = gguf.architecture, cfg.n_experts
        if not E:
            raise ModelFileError(f"{gguf.path}: {a}.expert_count is missing: glm4moe needs routed experts")
        gating = _int(gguf, f"{a}.expert_gating_func", GATING_SIGMOID, lo=0, hi=16)
        if gating not in (0, GATING_SIGMOID):
            raise UnsupportedModelError(f"{gguf.path}: {a}.expert_gating_func {gating} is not supported for "
                                        "glm4moe (only sigmoid, 2)")
        groups = _int(gguf, f"{a}.expert_group_count", 1, lo=0, hi=E) or 1
        used = _int(gguf, f"{a}.expert_group_used_count", groups, lo=0, hi=groups) or groups
        if groups > 1 and (E % groups or E // groups < 2 or cfg.n_experts_used > used * (E // groups)):
            raise ModelFileError(f"{gguf.path}: {E} experts in {groups} groups of which {used} are used cannot "
                                 f"give the top {cfg.n_experts_used}")
        sections = np.asarray(gguf.get(f"{a}.rope.dimension_sections", [0, 0])).reshape(-1)
        if len(sections) >= 2 and sections[0] > 0 and sections[1] > 0:  # llama.cpp then uses M-RoPE
            raise UnsupportedModelError(f"{gguf.path}: {a}.rope.dimension_sections asks for multimodal RoPE "
                                        "(GLM-4.5V), which onebit does not support")
        shared = _int(gguf, f"{a}.expert_shared_count", 0, lo=0, hi=64)
        return dataclasses.replace(
            cfg,
            ffn_norm="post_attention_norm",
            expert_gating="sigmoid",
            expert_weights_scale=_float(gguf, f"{a}.expert_weights_scale", 1.0, zero_is_off=True) or 1.0,
            expert_groups=groups if groups > 1 else 1,
            expert_groups_used=used if groups > 1 else 1,
            n_dense_lead=_int(gguf, f"{a}.leading_dense_block_count", 0, lo=0, hi=cfg.n_layers),
            shared_expert_hidden_dim=cfg.expert_hidden_dim * shared,
        )

    def layer(self, g, i: int, x):
        cfg, p = self.cfg, f"blk.{i}"
        h = g.residual(x, blocks.attention(g, cfg, i, g.norm(x, f"{p}.attn_norm.weight", cfg.norm_eps)))
        hn = g.norm(h, f"{p}.{cfg.ffn_norm}.weight", cfg.norm_eps)
        if not cfg.layer_is_moe(i):
            return g.residual(h, blocks.dense_ffn(g, i, hn))
        out = g.residual(h, blocks.sigmoid_moe_ffn(g, cfg, i, hn, h))
        if cfg.shared_expert_hidden_dim:
            out = g.residual(out, blocks.plain_shared_expert(g, i, hn))
        return out

    def expected_tensors(self, gguf):
        cfg = self.cfg
        exp = blocks.expected_tensors(cfg, gguf)
        for i in range(cfg.n_layers):
            p = f"blk.{i}"
            exp[f"{p}.{cfg.ffn_norm}.weight"] = exp.pop(f"{p}.ffn_norm.weight")
            exp.pop(f"{p}.ffn_gate_inp_shexp.weight", None)  # GLM's shared expert has no gate
            if cfg.layer_is_moe(i):
                exp[f"{p}.exp_probs_b.bias"] = (cfg.n_experts,)
        return exp
