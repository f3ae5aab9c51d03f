"""Qwen3-Next (hybrid MoE): Gated DeltaNet layers with a full attention layer between them
(`attention.recurrent_layers`, or every `full_attention_interval`-th layer), 512 routed
experts and a sigmoid-gated shared expert in every layer.

- DeltaNet layer: `attn_qkv` -> short causal conv (`ssm_conv1d`, silu) -> l2-normalised q, k;
  beta = sigmoid(b), decay = exp(softplus(a + ssm_dt) * ssm_a) per value head (`ssm_ba` holds
  b and a per key head); the gated delta rule over the layer's state; an RMS norm per value
  head times silu(`attn_gate` x); `ssm_out`.
- Attention layer: q_proj gives query and output gate per head, per-head q/k norms, NeoX rope
  on the first rope_dim (a quarter of head_dim in the real model), o * sigmoid(gate).
- The FFN's norm is `post_attention_norm`; routing is softmax top-k, renormalised.
- The MTP (next-token prediction) blocks a converted file may end with are not run.

llama.cpp's converter stores the (1 + w) norm weights as plain RMS norm weights (the gated
DeltaNet norm is plain already) and A_log as ssm_a = -exp(A_log). Value head j reads key head
j // (value heads / key heads), as transformers' repeat_interleave.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ..config import ModelConfig, _int, config_from_gguf
from ..errors import ModelFileError, UnsupportedModelError
from . import blocks
from .base import TransformerLM

FULL_ATTENTION_INTERVAL = 4  # llama.cpp's default when the file has neither key


def hybrid_config(gguf, v_tiled: bool, default_weights_norm: bool = True) -> ModelConfig:
    """The shared keys, plus the DeltaNet's (`ssm.*`) and which layers are recurrent."""
    cfg = config_from_gguf(gguf, rope_neox=True, qk_norm="head", default_weights_norm=default_weights_norm)
    a = gguf.architecture
    # config_from_gguf leaves out the multi-token-prediction blocks llama.cpp's converter
    # appends (`nextn_predict_layers`): like llama.cpp's main pass, the model runs the others only.
    n = cfg.n_layers
    flags = gguf.get(f"{a}.attention.recurrent_layers")
    if flags is not None and np.ndim(flags) > 0:
        flags = np.asarray(flags).reshape(-1)
        if len(flags) < n:
            raise ModelFileError(f"{gguf.path}: '{a}.attention.recurrent_layers' has {len(flags)} entries for {n} layers")
        recurrent = tuple(i for i in range(n) if flags[i])
    else:
        every = _int(gguf, f"{a}.full_attention_interval", FULL_ATTENTION_INTERVAL, hi=n + 1)
        recurrent = tuple(i for i in range(n) if (i + 1) % every)
    kernel = _int(gguf, f"{a}.ssm.conv_kernel", lo=2, hi=64)
    state = _int(gguf, f"{a}.ssm.state_size", hi=4096)
    k_heads = _int(gguf, f"{a}.ssm.group_count", hi=4096)
    v_heads = _int(gguf, f"{a}.ssm.time_step_rank", hi=4096)
    inner = _int(gguf, f"{a}.ssm.inner_size")
    if v_heads % k_heads or inner != v_heads * state:
        raise ModelFileError(f"{gguf.path}: DeltaNet heads do not fit: {v_heads} value heads over {k_heads} key "
                             f"heads, inner size {inner} (must be value heads x state size {state})")
    if not cfg.n_experts or not cfg.shared_expert_hidden_dim:
        raise UnsupportedModelError(f"{gguf.path}: {a} without routed and shared experts is not supported")
    if cfg.head_dim != cfg.head_dim_v:
        raise UnsupportedModelError(f"{gguf.path}: {a} with key width {cfg.head_dim} != value width {cfg.head_dim_v}")
    legacy = [t for t in gguf.tensors if t.endswith(".ssm_in.weight")]
    if legacy:
        raise UnsupportedModelError(f"{gguf.path}: tensor {legacy[0]!r} is the old fused qkvz layout; convert the model "
                                    "again with a current llama.cpp (attn_qkv + attn_gate)")
    return dataclasses.replace(
        cfg, recurrent_layers=recurrent, ssm_conv_kernel=kernel, ssm_state_size=state, ssm_group_count=k_heads,
        ssm_time_step_rank=v_heads, ssm_v_tiled=v_tiled, ffn_norm="post_attention_norm")


class Network(TransformerLM):
    def expected_tensors(self, gguf):
        return blocks.hybrid_tensors(self.cfg, gguf)

    @staticmethod
    def config(gguf):
        return hybrid_config(gguf, v_tiled=False)

    def layer(self, g, i: int, x):
        return blocks.hybrid_layer(g, self.cfg, i, x)
