"""The frozen model configuration, filled once from GGUF metadata."""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
from gguf.constants import Keys

from .errors import ModelFileError, UnsupportedModelError
from .formats.gguf_file import GGUFFile, is_expert_tensor

L, A, R = Keys.LLM, Keys.Attention, Keys.Rope

# Sanity bounds: a header claiming more than this is corrupt, not a big model.
MAX_DIM = 1 << 17
MAX_LAYERS = 1024
MAX_EXPERTS = 1 << 12
_BLK_RE = re.compile(r"^blk\.(\d+)\.")


def layer_of(tensor_name: str) -> int:
    """The layer of a `blk.N.` tensor name; -1 for a tensor outside the layers."""
    m = _BLK_RE.match(tensor_name)
    return int(m.group(1)) if m else -1


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    dim: int
    hidden_dim: int  # dense FFN width (0 when every layer is MoE)
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int  # key/query width per head
    head_dim_v: int  # value width per head
    vocab_size: int
    context_length: int
    norm_eps: float
    rope_theta: float
    rope_dim: int
    rope_neox: bool  # NeoX pairs (i, i + d/2) vs interleaved pairs (2i, 2i + 1)
    rope_scale: float  # linear position scaling (1.0 = none)
    n_experts: int = 0
    n_experts_used: int = 0
    expert_hidden_dim: int = 0
    shared_expert_hidden_dim: int = 0
    expert_weights_norm: bool = False  # renormalise the top-k routing weights to sum to 1
    qk_norm: str = "none"  # "none" | "head" (per head, qwen3) | "full" (whole projection, olmoe)
    attn_bias: bool = False
    sliding_window: int = 0  # positions a sliding-window layer attends to (0: none)
    swa_layers: tuple[int, ...] = ()  # the layers that use it (set by an architecture's config)
    rope_theta_swa: float = 0.0  # RoPE base of sliding-window layers (0: rope_theta)
    rope_scale_swa: float = 0.0  # their linear position scaling (0: rope_scale)
    rope_factors: bool = False  # `rope_freqs.weight` divides each RoPE frequency (Llama 3 scaling)
    attn_scale: float = 0.0  # query scale before q.k (0: 1/sqrt(head_dim))
    embed_scale: float = 1.0  # the token embeddings are multiplied by this (Gemma: sqrt(dim))
    final_logit_softcap: float = 0.0  # > 0: logits = cap * tanh(logits / cap)
    post_norms: bool = False  # norms after the attention and the FFN too (Gemma's sandwich layer)
    rope_yarn_factor: float = 0.0  # > 0: YaRN context extension by this factor (see yarn_rope)
    rope_yarn_orig_ctx: int = 0  # the context the model was trained at before extension
    rope_yarn_beta_fast: float = 32.0  # rotations per context above which a frequency is kept
    rope_yarn_beta_slow: float = 1.0  # ...and below which it is interpolated by the factor
    ffn_norm: str = "ffn_norm"  # the norm before the FFN, blk.<i>.<ffn_norm>.weight (GLM: post_attention_norm)
    expert_gating: str = "softmax"  # router scores: "softmax" over all experts, or "sigmoid" per expert (GLM)
    expert_weights_scale: float = 1.0  # the kept routing weights are multiplied by this (routed scaling factor)
    expert_groups: int = 1  # sigmoid routing: experts in this many equal groups, of which ...
    expert_groups_used: int = 1  # ... only these many (by their two best scores) may be chosen
    n_dense_lead: int = 0  # the first layers have a dense FFN, the rest routed experts (GLM, DeepSeek)
    n_nextn_layers: int = 0  # NextN / MTP layers after the n_layers run: in the file, never run
    # Hybrid linear-attention models (qwen3next, qwen35moe): Gated DeltaNet layers
    recurrent_layers: tuple[int, ...] = ()  # the layers whose mixer is a Gated DeltaNet (the rest: attention)
    ssm_conv_kernel: int = 0  # taps of the short causal conv over q, k, v
    ssm_state_size: int = 0  # key (= value) width of a DeltaNet head
    ssm_group_count: int = 0  # DeltaNet key heads
    ssm_time_step_rank: int = 0  # DeltaNet value heads (a multiple of the key heads)
    ssm_v_tiled: bool = False  # value head j reads key head j % key heads (else j // (value / key heads))

    def layer_is_recurrent(self, layer: int) -> bool:
        """Whether `layer`'s mixer is a recurrent (Gated DeltaNet) block with state, not attention."""
        return layer in self.recurrent_layers

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """The layers that keep keys and values by position."""
        return tuple(i for i in range(self.n_layers) if i not in self.recurrent_layers)

    @property
    def ssm_conv_channels(self) -> int:
        """Channels of the conv (and its history): q and k of every key head, v of every value head."""
        return self.ssm_state_size * (2 * self.ssm_group_count + self.ssm_time_step_rank)

    @property
    def is_moe(self) -> bool:
        return self.n_experts > 0

    def layer_window(self, layer: int) -> int:
        """How many positions (up to its own) a row of `layer` attends to; 0: all of them."""
        return self.sliding_window if layer in self.swa_layers else 0

    def layer_rope(self, layer: int) -> tuple[float, float]:
        """(base, linear position scale) of `layer`'s RoPE: sliding-window layers may have their own."""
        if layer in self.swa_layers:
            return self.rope_theta_swa or self.rope_theta, self.rope_scale_swa or self.rope_scale
        return self.rope_theta, self.rope_scale

    def yarn_rope(self, theta: float) -> tuple[np.ndarray, float] | None:
        """YaRN as llama.cpp computes it (ext_factor 1): per-frequency divisors of the RoPE
        frequencies [rope_dim / 2] and the magnitude scale of cos/sin, or None without YaRN.
        Frequency i is interpolated (divided by the factor) below the correction range
        [floor(low), ceil(high)] of pair indices, kept above it, and ramped linearly between."""
        if self.rope_yarn_factor <= 0:
            return None
        n = self.rope_dim

        def corr_dim(rotations: float) -> float:
            return n * np.log(self.rope_yarn_orig_ctx / (rotations * 2 * np.pi)) / (2 * np.log(theta))

        low = max(0.0, np.floor(corr_dim(self.rope_yarn_beta_fast)))
        high = min(n - 1.0, np.ceil(corr_dim(self.rope_yarn_beta_slow)))
        i = np.arange(n // 2, dtype=np.float64)
        keep = 1.0 - np.clip((i - low) / max(0.001, high - low), 0.0, 1.0)  # 1: extrapolate (keep)
        freq_scale = 1.0 / self.rope_yarn_factor
        mult = freq_scale * (1.0 - keep) + keep
        mscale = 1.0 + 0.1 * np.log(self.rope_yarn_factor) if self.rope_yarn_factor > 1 else 1.0
        return (1.0 / mult).astype(np.float32), float(mscale)

    def layer_is_moe(self, layer: int) -> bool:
        """Whether `layer`'s FFN is routed experts (else a dense SwiGLU)."""
        return self.is_moe and layer >= self.n_dense_lead


def _int(g: GGUFFile, key: str, default: int | None = None, lo: int = 1, hi: int = MAX_DIM) -> int:
    v = g.get(key, default)
    if v is None:
        raise ModelFileError(f"{g.path}: metadata key {key!r} is missing")
    if isinstance(v, np.ndarray):
        if v.size == 0 or not np.all(v == v.flat[0]):
            raise UnsupportedModelError(f"{g.path}: {key!r} varies per layer, which onebit does not support yet")
        v = v.flat[0].item()
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise ModelFileError(f"{g.path}: metadata {key!r} = {v!r} is out of range ({lo}..{hi})")
    return v


def _float(g: GGUFFile, key: str, default: float, lo: float = 0.0, hi: float = float("inf"),
           zero_is_off: bool = False) -> float:
    """A finite number with lo < v <= hi (every float the configs read must be positive), or
    exactly 0 where 0 means the feature is off (`zero_is_off`, e.g. Gemma's logit softcap)."""
    v = g.get(key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not np.isfinite(v):
        raise ModelFileError(f"{g.path}: metadata {key!r} = {v!r} is not a finite number")
    if zero_is_off and v == 0:
        return 0.0
    if not lo < v <= hi:
        bound = f"> {lo:g}" if hi == float("inf") else f"in ({lo:g}, {hi:g}]"
        raise ModelFileError(f"{g.path}: metadata {key!r} = {v!r} is out of range (must be {bound})")
    return float(v)


def _check_layers_and_experts(g: GGUFFile, a: str, n_layers: int, n_experts: int) -> None:
    """The counts in the metadata must agree with the tensors they describe (a layer or expert
    count that is too small would otherwise run a different model without a word)."""
    layers = {int(m.group(1)) for m in (_BLK_RE.match(n) for n in g.tensors) if m}
    extra = sorted(i for i in layers if i >= n_layers)
    if extra:
        raise ModelFileError(f"{g.path}: {a}.block_count is {n_layers} but the file has tensors for layer {extra[0]}")
    for name, t in g.tensors.items():
        if is_expert_tensor(name) or name.endswith(".ffn_gate_inp.weight"):
            if not n_experts:
                raise ModelFileError(f"{g.path}: tensor {name!r} holds routed experts but {a}.expert_count is "
                                     "0 or missing")
            if t.shape[0] != n_experts:
                raise ModelFileError(f"{g.path}: {a}.expert_count is {n_experts} but tensor {name!r} has "
                                     f"{t.shape[0]} experts (shape {list(t.shape)})")


def config_from_gguf(g: GGUFFile, *, rope_neox: bool, qk_norm: str = "none", default_weights_norm=False,
                     yarn: bool = False) -> ModelConfig:
    """Read the llama-family keys every supported architecture shares (`yarn`: the architecture
    applies YaRN RoPE scaling; elsewhere a file that asks for it is refused)."""
    a = g.architecture

    def K(key: str) -> str:  # a gguf.constants key template for this architecture
        return key.format(arch=a)

    dim = _int(g, K(L.EMBEDDING_LENGTH))
    n_heads = _int(g, K(A.HEAD_COUNT), hi=4096)
    n_kv_heads = _int(g, K(A.HEAD_COUNT_KV), n_heads, hi=4096)
    if n_heads % n_kv_heads:
        raise ModelFileError(f"{g.path}: head_count {n_heads} is not a multiple of head_count_kv {n_kv_heads}")
    head_dim = _int(g, K(A.KEY_LENGTH), dim // n_heads if dim % n_heads == 0 else None)
    head_dim_v = _int(g, K(A.VALUE_LENGTH), head_dim)
    # RoPE rotates pairs of a head's first rope_dim dimensions.
    rope_dim = _int(g, K(R.DIMENSION_COUNT), head_dim)
    if rope_dim % 2 or rope_dim > head_dim:
        raise ModelFileError(f"{g.path}: metadata {K(R.DIMENSION_COUNT)!r} = {rope_dim} must be even and at most "
                             f"the head dimension {head_dim}")
    n_blocks = _int(g, K(L.BLOCK_COUNT), hi=MAX_LAYERS)
    # NextN / MTP layers (GLM-4.5) are counted in block_count, after the layers that run.
    n_nextn = _int(g, K(L.NEXTN_PREDICT_LAYERS), 0, lo=0, hi=n_blocks - 1)
    n_layers = n_blocks - n_nextn
    n_experts = _int(g, K(L.EXPERT_COUNT), 0, lo=0, hi=MAX_EXPERTS)
    n_used = _int(g, K(L.EXPERT_USED_COUNT), 0, lo=0, hi=MAX_EXPERTS)
    if n_experts and not 1 <= n_used <= n_experts:
        raise ModelFileError(f"{g.path}: expert_used_count {n_used} is not between 1 and expert_count {n_experts}")
    _check_layers_and_experts(g, a, n_blocks, n_experts)
    if n_nextn:
        _set_aside_layers(g, n_layers)
    tokens = g.get("tokenizer.ggml.tokens")
    embd = g.tensor("token_embd.weight")
    vocab = embd.shape[0]
    if tokens is not None and len(tokens) != vocab:  # llama.cpp requires the same (its n_vocab)
        raise ModelFileError(f"{g.path}: the vocabulary has {len(tokens)} tokens but token_embd has {vocab} rows; "
                             "the file is damaged or was written by a broken converter, reconvert it")
    scaling = g.get(K(R.SCALING_TYPE), "none")
    rope_scale = 1.0
    yarn_keys = {}
    if scaling == "linear":
        rope_scale = 1.0 / _float(g, K(R.SCALING_FACTOR), 1.0, lo=1e-6)
    elif scaling == "yarn" and yarn:
        yarn_keys = dict(
            rope_yarn_factor=_float(g, K(R.SCALING_FACTOR), 1.0, lo=1e-6, hi=1e6),
            rope_yarn_orig_ctx=_int(g, K(R.SCALING_ORIG_CTX_LEN), g.get(K(L.CONTEXT_LENGTH), 4096), hi=1 << 24),
            rope_yarn_beta_fast=_float(g, f"{a}.rope.scaling.yarn_beta_fast", 32.0, hi=1e6),
            rope_yarn_beta_slow=_float(g, f"{a}.rope.scaling.yarn_beta_slow", 1.0, hi=1e6),
        )
    elif scaling not in ("none", None):
        raise UnsupportedModelError(f"{g.path}: RoPE scaling {scaling!r} is not supported yet")
    wnorm = g.get(K(L.EXPERT_WEIGHTS_NORM), default_weights_norm)
    return ModelConfig(
        arch=a,
        dim=dim,
        hidden_dim=_int(g, K(L.FEED_FORWARD_LENGTH), 0, lo=0),
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        head_dim=head_dim,
        head_dim_v=head_dim_v,
        vocab_size=vocab,
        context_length=_int(g, K(L.CONTEXT_LENGTH), 4096, hi=1 << 24),
        norm_eps=_float(g, K(A.LAYERNORM_RMS_EPS), 1e-6, hi=1.0),  # added to a mean square: 0 < eps <= 1
        rope_theta=_float(g, K(R.FREQ_BASE), 10000.0),
        rope_dim=rope_dim,
        rope_neox=rope_neox,
        rope_scale=rope_scale,
        n_experts=n_experts,
        n_experts_used=n_used,
        # llama (Mixtral) and olmoe files give the expert width as feed_forward_length.
        expert_hidden_dim=_int(g, K(L.EXPERT_FEED_FORWARD_LENGTH), g.get(K(L.FEED_FORWARD_LENGTH), 0), lo=0),
        shared_expert_hidden_dim=_int(g, K(L.EXPERT_SHARED_FEED_FORWARD_LENGTH), 0, lo=0),
        expert_weights_norm=bool(wnorm),
        qk_norm=qk_norm,
        attn_bias="blk.0.attn_q.bias" in g.tensors,
        rope_factors="rope_freqs.weight" in g.tensors,
        **yarn_keys,
        n_nextn_layers=n_nextn,
    )


def _set_aside_layers(g: GGUFFile, n_layers: int) -> None:
    """The tensors of layers n_layers and up (NextN / MTP layers, which llama.cpp skips too)
    leave `g.tensors` for `g.set_aside`: no backend uploads them, no plan, pool or info counts them."""
    names = [n for n in g.tensors if (m := _BLK_RE.match(n)) and int(m.group(1)) >= n_layers]
    for i in sorted({int(_BLK_RE.match(n).group(1)) for n in names}):
        if f"blk.{i}.nextn.eh_proj.weight" not in g.tensors:  # a count too large would drop real layers
            raise ModelFileError(f"{g.path}: {g.architecture}.nextn_predict_layers makes layer {i} a NextN layer, "
                                 f"but it has no blk.{i}.nextn.eh_proj.weight")
    for name in names:
        g.set_aside[name] = g.tensors.pop(name)


def swa_layers_from_gguf(g: GGUFFile, n_layers: int, default_pattern: int) -> tuple[int, ...]:
    """The sliding-window layers, as llama.cpp reads them: `attention.sliding_window_pattern`
    is one flag per layer, or a period n (every n-th layer is global: i % n == n - 1), else
    the architecture's default period."""
    key = f"{g.architecture}.attention.sliding_window_pattern"
    v = g.get(key)
    if v is not None and np.ndim(v) > 0:
        flags = np.asarray(v).reshape(-1)
        if len(flags) < n_layers:
            raise ModelFileError(f"{g.path}: {key!r} has {len(flags)} entries for {n_layers} layers")
        return tuple(i for i in range(n_layers) if flags[i])
    n = _int(g, key, default_pattern, lo=0, hi=MAX_LAYERS)
    return tuple(i for i in range(n_layers) if n == 0 or i % n < n - 1)
