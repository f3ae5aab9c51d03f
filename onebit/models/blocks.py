"""Blocks shared by the architectures: attention, dense FFN, MoE FFN, output head.

Each block takes the backend `be`, the config, the layer index and rows x: [R, dim] of one
sequence at positions `pos`: [R]. Tensor names are the GGUF names.
"""

from __future__ import annotations

from typing import Callable, Optional

import numpy as np

from ..cache import KVCache
from ..config import ModelConfig
from ..errors import ModelFileError

# Called between the router and the experts of MoE layer `layer`: hook(layer, ids [R, k], logits [R, E]).
ExpertHook = Callable[[int, np.ndarray, np.ndarray], None]


def norm(be, x: np.ndarray, name: str, eps: float) -> np.ndarray:
    return be.rms_norm(x, be.weight(name), eps)


def linear(be, x: np.ndarray, name: str, bias: bool = False) -> np.ndarray:
    y = be.linear(x, f"{name}.weight")
    if bias and be.has(f"{name}.bias"):
        y = y + be.weight(f"{name}.bias")
    return y


def attention(be, cfg: ModelConfig, layer: int, x: np.ndarray, cache: KVCache, pos: np.ndarray) -> np.ndarray:
    p = f"blk.{layer}"
    R = x.shape[0]
    q = linear(be, x, f"{p}.attn_q", cfg.attn_bias)  # [R, H*D]
    k = linear(be, x, f"{p}.attn_k", cfg.attn_bias)  # [R, Hkv*D]
    v = linear(be, x, f"{p}.attn_v", cfg.attn_bias)  # [R, Hkv*Dv]
    if cfg.qk_norm == "full":  # olmoe: one norm over the whole projection
        q = norm(be, q, f"{p}.attn_q_norm.weight", cfg.norm_eps)
        k = norm(be, k, f"{p}.attn_k_norm.weight", cfg.norm_eps)
    q = q.reshape(R, cfg.n_heads, cfg.head_dim)  # [R, H, D]
    k = k.reshape(R, cfg.n_kv_heads, cfg.head_dim)  # [R, Hkv, D]
    v = v.reshape(R, cfg.n_kv_heads, cfg.head_dim_v)  # [R, Hkv, Dv]
    if cfg.qk_norm == "head":  # qwen3: a norm per head
        q = norm(be, q, f"{p}.attn_q_norm.weight", cfg.norm_eps)
        k = norm(be, k, f"{p}.attn_k_norm.weight", cfg.norm_eps)
    q = be.rope(q, pos, cfg.rope_dim, cfg.rope_theta, cfg.rope_neox, cfg.rope_scale)
    k = be.rope(k, pos, cfg.rope_dim, cfg.rope_theta, cfg.rope_neox, cfg.rope_scale)
    keys, values = cache.update_and_fetch(k, v)  # [S, Hkv, D], [S, Hkv, Dv]
    o = be.attention(q, keys, values, pos)  # [R, H*Dv]
    return linear(be, o, f"{p}.attn_output")


def dense_ffn(be, layer: int, x: np.ndarray) -> np.ndarray:
    p = f"blk.{layer}"
    h = be.silu(linear(be, x, f"{p}.ffn_gate")) * linear(be, x, f"{p}.ffn_up")  # [R, hidden]
    return linear(be, h, f"{p}.ffn_down")


def moe_ffn(be, cfg: ModelConfig, layer: int, x: np.ndarray, hook: Optional[ExpertHook]) -> np.ndarray:
    p = f"blk.{layer}"
    logits = linear(be, x, f"{p}.ffn_gate_inp")  # [R, E]
    ids, weights = be.route(logits, cfg.n_experts_used, cfg.expert_weights_norm)  # [R, k]
    if hook is not None:
        hook(layer, ids, logits)
    return be.experts(x, p, ids, weights)


def shared_expert(be, layer: int, x: np.ndarray) -> np.ndarray:
    """qwen2moe's always-on expert, scaled per row by a sigmoid gate."""
    p = f"blk.{layer}"
    h = be.silu(linear(be, x, f"{p}.ffn_gate_shexp")) * linear(be, x, f"{p}.ffn_up_shexp")
    y = linear(be, h, f"{p}.ffn_down_shexp")  # [R, dim]
    w = be.weight(f"{p}.ffn_gate_inp_shexp.weight").reshape(-1, 1)  # [dim, 1]
    g = x @ w  # [R, 1]
    return y / (np.float32(1.0) + np.exp(-g))


def output_head(be, cfg: ModelConfig, x: np.ndarray) -> np.ndarray:
    x = norm(be, x, "output_norm.weight", cfg.norm_eps)
    name = "output.weight" if be.has("output.weight") else "token_embd.weight"  # tied embeddings
    return be.linear(x, name)  # [R, vocab]


def check_tensors(gguf, expected: dict[str, tuple[int, ...]]) -> None:
    """Every tensor the graph reads must exist with the shape the config implies."""
    for name, shape in expected.items():
        t = gguf.tensors.get(name)
        if t is None:
            raise ModelFileError(f"{gguf.path}: tensor {name!r} is missing")
        if tuple(t.shape) != tuple(shape) and tuple(d for d in t.shape if d != 1) != tuple(shape):
            raise ModelFileError(f"{gguf.path}: tensor {name!r} has shape {list(t.shape)}, expected {list(shape)}")


def expected_tensors(cfg: ModelConfig, gguf, layer_has_moe: Callable[[int], bool]) -> dict[str, tuple[int, ...]]:
    """Shapes (numpy order) of the tensors the shared blocks read."""
    d, H, Hkv, D, Dv = cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.head_dim_v
    exp = {"token_embd.weight": (cfg.vocab_size, d), "output_norm.weight": (d,)}
    if "output.weight" in gguf.tensors:
        exp["output.weight"] = (cfg.vocab_size, d)
    for layer in range(cfg.n_layers):
        p = f"blk.{layer}"
        exp.update({
            f"{p}.attn_norm.weight": (d,),
            f"{p}.attn_q.weight": (H * D, d),
            f"{p}.attn_k.weight": (Hkv * D, d),
            f"{p}.attn_v.weight": (Hkv * Dv, d),
            f"{p}.attn_output.weight": (d, H * Dv),
            f"{p}.ffn_norm.weight": (d,),
        })
        for n, width in (("q", H * D), ("k", Hkv * D), ("v", Hkv * Dv)):
            if f"{p}.attn_{n}.bias" in gguf.tensors:
                exp[f"{p}.attn_{n}.bias"] = (width,)
        if cfg.qk_norm == "head":
            exp[f"{p}.attn_q_norm.weight"] = (D,)
            exp[f"{p}.attn_k_norm.weight"] = (D,)
        elif cfg.qk_norm == "full":
            exp[f"{p}.attn_q_norm.weight"] = (H * D,)
            exp[f"{p}.attn_k_norm.weight"] = (Hkv * D,)
        if layer_has_moe(layer):
            E, F = cfg.n_experts, cfg.expert_hidden_dim
            exp.update({
                f"{p}.ffn_gate_inp.weight": (E, d),
                f"{p}.ffn_gate_exps.weight": (E, F, d),
                f"{p}.ffn_up_exps.weight": (E, F, d),
                f"{p}.ffn_down_exps.weight": (E, d, F),
            })
            if cfg.shared_expert_hidden_dim:
                S = cfg.shared_expert_hidden_dim
                exp.update({
                    f"{p}.ffn_gate_inp_shexp.weight": (d,),
                    f"{p}.ffn_gate_shexp.weight": (S, d),
                    f"{p}.ffn_up_shexp.weight": (S, d),
                    f"{p}.ffn_down_shexp.weight": (d, S),
                })
        else:
            F = cfg.hidden_dim
            exp.update({
                f"{p}.ffn_gate.weight": (F, d),
                f"{p}.ffn_up.weight": (F, d),
                f"{p}.ffn_down.weight": (d, F),
            })
    return exp
