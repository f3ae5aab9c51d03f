"""gpt-oss (`gpt-oss` in GGUF; gpt-oss-20b / 120b): pre-norm layers that alternate a
sliding-window attention layer (even layers, window from the file) and a full one; q/k/v/o
biases; attention sinks (one learned logit per head in the softmax's denominator); NeoX RoPE
with YaRN scaling; routed experts only: router with a bias, top-k of its logits then a softmax
over the k chosen; every expert part with a bias; the clamped SwiGLU (`GLU`).

llama.cpp reads no key for the SwiGLU's alpha and limit (its openai-moe graph has them as
constants, as transformers' GptOssConfig defaults do), nor for YaRN's ext factor (1) and the
attention factor (1 + 0.1 ln(factor) on cos and sin); they are the same here. The FFN norm is
`post_attention_norm` in GGUF. Softmax over the k chosen logits is the softmax over all
experts renormalised over the top k, which is the shared `route` op.
"""

from __future__ import annotations

import dataclasses
import math

from ..config import _float, _int, config_from_gguf, swa_layers_from_gguf
from . import blocks
from .base import TransformerLM

SWA_PERIOD = 2  # llama.cpp's default for gpt-oss: layers 0, 2, 4, ... slide, 1, 3, ... are full
GLU = (1.702, 7.0)  # (alpha, limit) of the clamped SwiGLU


class Network(TransformerLM):
    @staticmethod
    def config(gguf):
        cfg = config_from_gguf(gguf, rope_neox=True, default_weights_norm=True, yarn=True)
        a = gguf.architecture
        window = _int(gguf, f"{a}.attention.sliding_window", 0, lo=0, hi=1 << 24)
        return dataclasses.replace(
            cfg,
            sliding_window=window,
            swa_layers=swa_layers_from_gguf(gguf, cfg.n_layers, SWA_PERIOD) if window > 0 else (),
            rope_theta_swa=_float(gguf, f"{a}.rope.freq_base_swa", cfg.rope_theta),
            expert_weights_norm=True,
            attn_bias=True,
        )

    @staticmethod
    def mixer(g, cfg, layer: int, x):
        return attention(g, cfg, layer, x)

    @staticmethod
    def router_names(cfg, layer: int) -> tuple[str, str, str | None]:
        p = f"blk.{layer}"
        return f"{p}.post_attention_norm.weight", f"{p}.ffn_gate_inp.weight", f"{p}.ffn_gate_inp.bias"

    def layer(self, g, i: int, x):
        cfg, p = self.cfg, f"blk.{i}"
        h = g.residual(x, attention(g, cfg, i, g.norm(x, f"{p}.attn_norm.weight", cfg.norm_eps)))
        norm, router, bias = self.router_names(cfg, i)
        hn = g.norm(h, norm, cfg.norm_eps)
        logits = g.linear(hn, router, bias)  # [R, E]
        ids, weights = g.route(logits, cfg.n_experts_used, True)  # softmax over the top k
        g.pause(i, ids, logits, h)
        return g.residual(h, g.experts(i, hn, ids, weights, GLU))

    def expected_tensors(self, gguf) -> dict[str, tuple[int, ...]]:
        cfg = self.cfg
        d, H, E, F = cfg.dim, cfg.n_heads, cfg.n_experts, cfg.expert_hidden_dim
        exp = {}
        for name, shape in blocks.expected_tensors(cfg, gguf).items():
            if name.endswith(".ffn_norm.weight"):  # gpt-oss's FFN norm has another name
                name = name.replace(".ffn_norm.", ".post_attention_norm.")
            exp[name] = shape
        for i in range(cfg.n_layers):
            p = f"blk.{i}"
            exp.update({
                f"{p}.attn_q.bias": (H * cfg.head_dim,),
                f"{p}.attn_k.bias": (cfg.n_kv_heads * cfg.head_dim,),
                f"{p}.attn_v.bias": (cfg.n_kv_heads * cfg.head_dim_v,),
                f"{p}.attn_output.bias": (d,),
                f"{p}.attn_sinks.weight": (H,),
                f"{p}.ffn_gate_inp.bias": (E,),
                f"{p}.ffn_gate_exps.bias": (E, F),
                f"{p}.ffn_up_exps.bias": (E, F),
                f"{p}.ffn_down_exps.bias": (E, d),
            })
        return exp


def attention(g, cfg, layer: int, x):
    """Biased q/k/v, NeoX RoPE with YaRN, GQA with sinks (over the window on sliding layers),
    biased output projection. YaRN's magnitude scale on q and k is folded into the q.k scale."""
    p = f"blk.{layer}"
    q, k, v = g.linears(x, [f"{p}.attn_{n}.weight" for n in "qkv"], [f"{p}.attn_{n}.bias" for n in "qkv"])
    q = g.view(q, (cfg.n_heads, cfg.head_dim))  # [R, H, D]
    k = g.view(k, (cfg.n_kv_heads, cfg.head_dim))  # [R, Hkv, D]
    v = g.view(v, (cfg.n_kv_heads, cfg.head_dim_v))  # [R, Hkv, Dv]
    theta, scale = cfg.layer_rope(layer)
    yarn = cfg.yarn_rope(theta)
    factors, mscale = yarn if yarn is not None else (None, 1.0)
    q = g.rope(q, cfg.rope_dim, theta, True, scale, factors)
    k = g.rope(k, cfg.rope_dim, theta, True, scale, factors)
    qk_scale = mscale * mscale / math.sqrt(cfg.head_dim)
    o = g.attention(layer, q, k, v, cfg.layer_window(layer), qk_scale, f"{p}.attn_sinks.weight")  # [R, H*Dv]
    return g.linear(o, f"{p}.attn_output.weight", f"{p}.attn_output.bias")  # [R, dim]
