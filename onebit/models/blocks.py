"""Blocks shared by the architectures, written once over the ops every backend gives.

A block takes `g`, the running step (`NumpyBackend` runs each op at once on arrays; the
Vulkan backend records each op into command buffers and runs them later), the config, the
layer index and x: [R, dim], R rows of one sequence at consecutive positions. The ops:

    embed(name)               get_rows of the step's token ids from a table -> [R, dim]
    norm(x, name, eps)        RMS norm over the last axis, times weight `name`
    linear(x, name, bias)     x @ W.T (+ bias): [R, in] -> [R, out]
    linears(x, names, biases) linear of one input by several matrices (a backend may fuse them)
    view(x, shape)            the same values in another shape
    rope(x, n_rot, theta, neox, scale, factors)  x: [R, H, D] rotated at the rows' positions
                              (factors: a tensor of per-frequency divisors, or None)
    attention(layer, q, k, v, window, scale)  store k, v in the layer's cache; causal GQA over
                              it (over the last `window` positions only, if > 0; q.k times
                              `scale`, default 1/sqrt(D)) -> [R, H * Dv]
    add(a, b), swiglu(a, b)   a + b, silu(a) * b
    geglu(a, b)               gelu(a) * b, gelu by its tanh approximation
    scale(x, s)               x * s for a constant s
    softcap(x, cap)           cap * tanh(x / cap)
    residual(x, y)            x + y, neither used again (a backend may add y into x in place)
    route(logits, k, norm)    softmax top-k -> ids [R, k], weights [R, k]
    route_sigmoid(logits, k, bias, norm, scale, groups, groups_used)  sigmoid scores, top-k
                              chosen by score + bias (tensor `bias`, or None) within the best
                              groups, weighted by the scores (renormalised if norm) x scale
    pause(layer, ids, logits, h)  the pause point: the host may act before the layer's experts
                              run (h: the residual stream there, which a predictor ranks from)
    experts(layer, x, ids, w) the routed experts' SwiGLU FFN, weighted and summed -> [R, dim]
    shared_expert(layer, x)   the sigmoid-gated shared expert -> [R, dim]
    last_row(x)               x[-1:]

Hybrid (Gated DeltaNet) models add:

    split(x, sizes)           x: [..., sum(sizes)] -> one array per size along the last axis
    sigmoid_gate(x, gate)     x * sigmoid(gate)
    ssm_conv(layer, x, name)  silu(depthwise causal conv) of x: [R, C] after the layer's conv
                              history (taps `name`: [C, K]); the history moves on -> [R, C]
    gdn_gates(b, a, dt, A)    beta = sigmoid(b), log decay g = softplus(a + dt) * A -> [R, Hv] x 2
    delta_rule(layer, q, k, v, g, beta, eps, tiled)  the gated delta rule over the layer's
                              recurrent state (q, k l2-normalised inside) -> [R, Hv, D]

Tensor names are the GGUF names.
"""

from __future__ import annotations

from typing import Mapping, Protocol

from ..config import ModelConfig
from ..errors import ModelFileError


class StepOps(Protocol):
    """The ops a schedule calls on its step `g` (described above): the numpy backend's
    `EagerStep` (numpy and cpu) and the Vulkan backend's `Recorder` give every one
    (tests/test_step_ops.py). An op a backend's kernels lack is not a gap here: the cpu
    backend inherits numpy's reference op (said once per file, at load), and a Vulkan
    recording that cannot record an op refuses the model, which then loads on the next
    backend (`onebit.load`'s one fallback rule)."""

    tensor_names: Mapping[str, object]  # the file's tensors, by GGUF name

    def embed(self, name: str): ...
    def norm(self, x, name: str, eps: float): ...
    def linear(self, x, name: str, bias: str | None = None): ...
    def linears(self, x, names, biases): ...
    def view(self, x, shape): ...
    def rope(self, x, n_rot: int, theta: float, neox: bool, scale: float, factors=None): ...
    def attention(self, layer: int, q, k, v, window: int = 0, scale: float | None = None, sinks: str | None = None): ...
    def add(self, a, b): ...
    def residual(self, x, y): ...
    def swiglu(self, a, b): ...
    def geglu(self, a, b): ...
    def scale(self, x, s: float): ...
    def softcap(self, x, cap: float): ...
    def route(self, logits, k: int, norm: bool): ...
    def route_sigmoid(self, logits, k: int, bias: str | None, norm: bool, scale: float, groups: int = 1,
                      groups_used: int = 1): ...
    def pause(self, layer: int, ids, logits, h) -> None: ...
    def experts(self, layer: int, x, ids, weights, glu=None): ...
    def shared_expert(self, layer: int, x): ...
    def last_row(self, x): ...
    def split(self, x, sizes): ...
    def sigmoid_gate(self, x, gate): ...
    def ssm_conv(self, layer: int, x, name: str): ...
    def gdn_gates(self, b, a, dt_bias: str, ssm_a: str): ...
    def delta_rule(self, layer: int, q, k, v, g, beta, eps: float, tiled: bool = False): ...


def attention(g, cfg: ModelConfig, layer: int, x):
    p = f"blk.{layer}"

    def bias(n: str):
        name = f"{p}.attn_{n}.bias"
        return name if cfg.attn_bias and name in g.tensor_names else None

    q, k, v = g.linears(x, [f"{p}.attn_{n}.weight" for n in "qkv"], [bias(n) for n in "qkv"])
    # q: [R, H*D], k: [R, Hkv*D], v: [R, Hkv*Dv]
    if cfg.qk_norm == "full":  # olmoe: one norm over the whole projection
        q = g.norm(q, f"{p}.attn_q_norm.weight", cfg.norm_eps)
        k = g.norm(k, f"{p}.attn_k_norm.weight", cfg.norm_eps)
    q = g.view(q, (cfg.n_heads, cfg.head_dim))  # [R, H, D]
    k = g.view(k, (cfg.n_kv_heads, cfg.head_dim))  # [R, Hkv, D]
    v = g.view(v, (cfg.n_kv_heads, cfg.head_dim_v))  # [R, Hkv, Dv]
    if cfg.qk_norm == "head":  # qwen3: a norm per head
        q = g.norm(q, f"{p}.attn_q_norm.weight", cfg.norm_eps)
        k = g.norm(k, f"{p}.attn_k_norm.weight", cfg.norm_eps)
    theta, scale = cfg.layer_rope(layer)
    factors = "rope_freqs.weight" if cfg.rope_factors else None
    q = g.rope(q, cfg.rope_dim, theta, cfg.rope_neox, scale, factors)
    k = g.rope(k, cfg.rope_dim, theta, cfg.rope_neox, scale, factors)
    o = g.attention(layer, q, k, v, cfg.layer_window(layer), cfg.attn_scale or None)  # [R, H*Dv]
    return g.linear(o, f"{p}.attn_output.weight")  # [R, dim]


def dense_ffn(g, layer: int, x):
    p = f"blk.{layer}"
    gate, up = g.linears(x, [f"{p}.ffn_gate.weight", f"{p}.ffn_up.weight"], [None, None])
    h = g.swiglu(gate, up)  # [R, hidden]
    return g.linear(h, f"{p}.ffn_down.weight")


def geglu_ffn(g, layer: int, x):
    """Gemma's FFN: down(gelu_tanh(gate(x)) * up(x))."""
    p = f"blk.{layer}"
    gate, up = g.linears(x, [f"{p}.ffn_gate.weight", f"{p}.ffn_up.weight"], [None, None])
    h = g.geglu(gate, up)  # [R, hidden]
    return g.linear(h, f"{p}.ffn_down.weight")


def sandwich_layer(g, cfg: ModelConfig, layer: int, x):
    """Gemma 2/3: a norm before and after both the attention and the FFN, each added to x."""
    p = f"blk.{layer}"
    a = attention(g, cfg, layer, g.norm(x, f"{p}.attn_norm.weight", cfg.norm_eps))
    h = g.residual(x, g.norm(a, f"{p}.post_attention_norm.weight", cfg.norm_eps))
    f = geglu_ffn(g, layer, g.norm(h, f"{p}.ffn_norm.weight", cfg.norm_eps))
    return g.residual(h, g.norm(f, f"{p}.post_ffw_norm.weight", cfg.norm_eps))


def moe_ffn(g, cfg: ModelConfig, layer: int, x, h):
    """Routed experts over x = norm(h); h is the residual stream the FFN block adds to."""
    logits = g.linear(x, f"blk.{layer}.ffn_gate_inp.weight")  # [R, E]
    ids, weights = g.route(logits, cfg.n_experts_used, cfg.expert_weights_norm)  # [R, k]
    g.pause(layer, ids, logits, h)
    return g.experts(layer, x, ids, weights)  # [R, dim]


def sigmoid_moe_ffn(g, cfg: ModelConfig, layer: int, x, h):
    """Routed experts with sigmoid router scores (GLM-4.5): the expert-score correction bias
    `exp_probs_b` steers the choice only; x = norm(h)."""
    p = f"blk.{layer}"
    logits = g.linear(x, f"{p}.ffn_gate_inp.weight")  # [R, E]
    bias = f"{p}.exp_probs_b.bias"
    ids, weights = g.route_sigmoid(logits, cfg.n_experts_used, bias if bias in g.tensor_names else None,
                                   cfg.expert_weights_norm, cfg.expert_weights_scale, cfg.expert_groups,
                                   cfg.expert_groups_used)  # [R, k]
    g.pause(layer, ids, logits, h)
    return g.experts(layer, x, ids, weights)  # [R, dim]


def plain_shared_expert(g, layer: int, x):
    """An always-on shared expert without a gate (GLM): down(silu(gate(x)) * up(x))."""
    p = f"blk.{layer}"
    gate, up = g.linears(x, [f"{p}.ffn_gate_shexp.weight", f"{p}.ffn_up_shexp.weight"], [None, None])
    h = g.swiglu(gate, up)  # [R, S]
    return g.linear(h, f"{p}.ffn_down_shexp.weight")  # [R, dim]


def decoder_layer(g, cfg: ModelConfig, layer: int, x):
    """Pre-norm block: x + mixer(norm(x)), then + FFN(norm): routed experts (+ a shared expert)
    on MoE layers, a dense SwiGLU elsewhere."""
    p = f"blk.{layer}"
    h = g.residual(x, attention(g, cfg, layer, g.norm(x, f"{p}.attn_norm.weight", cfg.norm_eps)))
    hn = g.norm(h, f"{p}.ffn_norm.weight", cfg.norm_eps)
    if not cfg.layer_is_moe(layer):
        return g.residual(h, dense_ffn(g, layer, hn))
    out = g.residual(h, moe_ffn(g, cfg, layer, hn, h))
    if cfg.shared_expert_hidden_dim:
        out = g.residual(out, g.shared_expert(layer, hn))
    return out


def gated_attention(g, cfg: ModelConfig, layer: int, x):
    """qwen3next / qwen35moe full attention: q_proj gives each head's query and an output gate
    side by side; per-head q/k norms; partial NeoX rope; o * sigmoid(gate) before attn_output."""
    p = f"blk.{layer}"
    H, Hkv, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    qg, k, v = g.linears(x, [f"{p}.attn_{n}.weight" for n in "qkv"], [None, None, None])
    # qg: [R, H*2D], k: [R, Hkv*D], v: [R, Hkv*D]
    q, gate = g.split(g.view(qg, (H, 2 * D)), (D, D))  # [R, H, D] each
    q = g.norm(q, f"{p}.attn_q_norm.weight", cfg.norm_eps)
    k = g.norm(g.view(k, (Hkv, D)), f"{p}.attn_k_norm.weight", cfg.norm_eps)  # [R, Hkv, D]
    v = g.view(v, (Hkv, cfg.head_dim_v))
    q = g.rope(q, cfg.rope_dim, cfg.rope_theta, True, cfg.rope_scale)
    k = g.rope(k, cfg.rope_dim, cfg.rope_theta, True, cfg.rope_scale)
    o = g.attention(layer, q, k, v, 0, cfg.attn_scale or None)  # [R, H*Dv]
    o = g.sigmoid_gate(o, g.view(gate, (H * D,)))
    return g.linear(o, f"{p}.attn_output.weight")  # [R, dim]


def gated_deltanet(g, cfg: ModelConfig, layer: int, x):
    """Gated DeltaNet (linear attention): q, k, v through a short causal conv (silu), the gated
    delta rule over the layer's recurrent state, an RMS norm per value head gated by silu(z).
    qwen3next stores beta and alpha in one matrix (`ssm_ba`, per key head: its value heads'
    b then a); qwen35moe in two (`ssm_beta`, `ssm_alpha`)."""
    p = f"blk.{layer}"
    Hk, Hv, D = cfg.ssm_group_count, cfg.ssm_time_step_rank, cfg.ssm_state_size
    qkv = g.linear(x, f"{p}.attn_qkv.weight")  # [R, (2 Hk + Hv) D]
    z = g.linear(x, f"{p}.attn_gate.weight")  # [R, Hv*D]
    if f"{p}.ssm_ba.weight" in g.tensor_names:
        r = Hv // Hk
        b, a = g.split(g.view(g.linear(x, f"{p}.ssm_ba.weight"), (Hk, 2 * r)), (r, r))  # [R, Hk, r] each
        b, a = g.view(b, (Hv,)), g.view(a, (Hv,))  # [R, Hv]
    else:
        b, a = g.linear(x, f"{p}.ssm_beta.weight"), g.linear(x, f"{p}.ssm_alpha.weight")  # [R, Hv]
    qkv = g.ssm_conv(layer, qkv, f"{p}.ssm_conv1d.weight")  # [R, C]
    q, k, v = g.split(qkv, (Hk * D, Hk * D, Hv * D))
    beta, decay = g.gdn_gates(b, a, f"{p}.ssm_dt.bias", f"{p}.ssm_a")  # [R, Hv]
    o = g.delta_rule(layer, g.view(q, (Hk, D)), g.view(k, (Hk, D)), g.view(v, (Hv, D)), decay, beta,
                     cfg.norm_eps, cfg.ssm_v_tiled)  # [R, Hv, D]
    o = g.swiglu(g.view(z, (Hv, D)), g.norm(o, f"{p}.ssm_norm.weight", cfg.norm_eps))  # silu(z) * norm(o)
    return g.linear(g.view(o, (Hv * D,)), f"{p}.ssm_out.weight")  # [R, dim]


def mixer(g, cfg: ModelConfig, layer: int, x):
    """Layer's token mixer over x = norm(h): attention, or in a hybrid model gated attention
    or a Gated DeltaNet."""
    if not cfg.recurrent_layers:
        return attention(g, cfg, layer, x)
    return (gated_deltanet if cfg.layer_is_recurrent(layer) else gated_attention)(g, cfg, layer, x)


def hybrid_layer(g, cfg: ModelConfig, layer: int, x):
    """qwen3next / qwen35moe: x + mixer(norm(x)), then + routed experts and the sigmoid-gated
    shared expert, both over the post-attention norm."""
    p = f"blk.{layer}"
    h = g.residual(x, mixer(g, cfg, layer, g.norm(x, f"{p}.attn_norm.weight", cfg.norm_eps)))
    hn = g.norm(h, f"{p}.{cfg.ffn_norm}.weight", cfg.norm_eps)
    out = g.residual(h, moe_ffn(g, cfg, layer, hn, h))
    return g.residual(out, g.shared_expert(layer, hn))


def hybrid_tensors(cfg: ModelConfig, gguf) -> dict[str, tuple[int, ...]]:
    """Shapes (numpy order) of the tensors a hybrid model's blocks read."""
    d, H, Hkv, D = cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    Hk, Hv, Ds, K = cfg.ssm_group_count, cfg.ssm_time_step_rank, cfg.ssm_state_size, cfg.ssm_conv_kernel
    E, F, S = cfg.n_experts, cfg.expert_hidden_dim, cfg.shared_expert_hidden_dim
    exp = {"token_embd.weight": (cfg.vocab_size, d), "output_norm.weight": (d,)}
    if "output.weight" in gguf.tensors:
        exp["output.weight"] = (cfg.vocab_size, d)
    for layer in range(cfg.n_layers):
        p = f"blk.{layer}"
        exp.update({
            f"{p}.attn_norm.weight": (d,),
            f"{p}.{cfg.ffn_norm}.weight": (d,),
            f"{p}.ffn_gate_inp.weight": (E, d),
            f"{p}.ffn_gate_exps.weight": (E, F, d),
            f"{p}.ffn_up_exps.weight": (E, F, d),
            f"{p}.ffn_down_exps.weight": (E, d, F),
            f"{p}.ffn_gate_inp_shexp.weight": (d,),
            f"{p}.ffn_gate_shexp.weight": (S, d),
            f"{p}.ffn_up_shexp.weight": (S, d),
            f"{p}.ffn_down_shexp.weight": (d, S),
        })
        if not cfg.layer_is_recurrent(layer):
            exp.update({
                f"{p}.attn_q.weight": (H * 2 * D, d),
                f"{p}.attn_k.weight": (Hkv * D, d),
                f"{p}.attn_v.weight": (Hkv * cfg.head_dim_v, d),
                f"{p}.attn_output.weight": (d, H * cfg.head_dim_v),
                f"{p}.attn_q_norm.weight": (D,),
                f"{p}.attn_k_norm.weight": (D,),
            })
            continue
        exp.update({
            f"{p}.attn_qkv.weight": (cfg.ssm_conv_channels, d),
            f"{p}.attn_gate.weight": (Hv * Ds, d),
            f"{p}.ssm_conv1d.weight": (cfg.ssm_conv_channels, K),
            f"{p}.ssm_dt.bias": (Hv,),
            f"{p}.ssm_a": (Hv,),
            f"{p}.ssm_norm.weight": (Ds,),
            f"{p}.ssm_out.weight": (d, Hv * Ds),
        })
        if f"{p}.ssm_ba.weight" in gguf.tensors:
            exp[f"{p}.ssm_ba.weight"] = (2 * Hv, d)
        else:
            exp[f"{p}.ssm_beta.weight"] = (Hv, d)
            exp[f"{p}.ssm_alpha.weight"] = (Hv, d)
    return exp


def output_head(g, cfg: ModelConfig, x):
    x = g.norm(x, "output_norm.weight", cfg.norm_eps)
    name = "output.weight" if "output.weight" in g.tensor_names else "token_embd.weight"  # tied embeddings
    logits = g.linear(x, name)  # [R, vocab]
    return g.softcap(logits, cfg.final_logit_softcap) if cfg.final_logit_softcap > 0 else logits


def check_tensors(gguf, expected: dict[str, tuple[int, ...]]) -> None:
    """Every tensor the graph reads must exist with the shape the config implies."""
    for name, shape in expected.items():
        t = gguf.tensors.get(name)
        if t is None:
            raise ModelFileError(f"{gguf.path}: tensor {name!r} is missing")
        if tuple(t.shape) != tuple(shape) and tuple(d for d in t.shape if d != 1) != tuple(shape):
            raise ModelFileError(f"{gguf.path}: tensor {name!r} has shape {list(t.shape)}, expected {list(shape)}")


def expected_tensors(cfg: ModelConfig, gguf) -> dict[str, tuple[int, ...]]:
    """Shapes (numpy order) of the tensors the shared blocks read."""
    d, H, Hkv, D, Dv = cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.head_dim_v
    exp = {"token_embd.weight": (cfg.vocab_size, d), "output_norm.weight": (d,)}
    if "output.weight" in gguf.tensors:
        exp["output.weight"] = (cfg.vocab_size, d)
    if cfg.rope_factors:
        exp["rope_freqs.weight"] = (cfg.rope_dim // 2,)
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
        if cfg.post_norms:
            exp[f"{p}.post_attention_norm.weight"] = (d,)
            exp[f"{p}.post_ffw_norm.weight"] = (d,)
        if cfg.qk_norm == "head":
            exp[f"{p}.attn_q_norm.weight"] = (D,)
            exp[f"{p}.attn_k_norm.weight"] = (D,)
        elif cfg.qk_norm == "full":
            exp[f"{p}.attn_q_norm.weight"] = (H * D,)
            exp[f"{p}.attn_k_norm.weight"] = (Hkv * D,)
        if cfg.layer_is_moe(layer):
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
