"""glm4moe (GLM-4.5): what the shared oracle and backend tests do not cover on their own.

The routing rule against HF's own router module on the same inputs; each GLM feature of the
fixture is load-bearing against HF; the NextN (MTP) layer in the file is loaded, set aside and
never run, nor uploaded, planned or counted; prediction (router and block modes) ranks by the
sigmoid + bias rule and leaves the output bit-identical on numpy, cpu and Vulkan, resident and
streamed; a routing trace records the MoE layers only; the quantized files also meet the
llama.cpp bar with llama.cpp's activation rounding modelled.

Elsewhere: f32 vs transformers and llama.cpp, quantized vs llama.cpp (test_oracle.py);
backends vs numpy (test_cpu_backend.py, test_vulkan_graph.py); streamed == resident
(test_pool.py, test_vulkan_streaming.py); tokenizer ids (test_tokenizer.py); the router kernel
vs its numpy twin (test_vulkan_kernels.py).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import onebit
from conftest import FIXTURES, cosine_rows
from onebit.backends import BACKENDS
from onebit.backends.vulkan.backend import VulkanBackend
from onebit.errors import ModelFileError
from onebit.formats.gguf_file import GGUFFile, is_expert_tensor
from onebit.moe.predict import Predictor, settings_from

F32 = FIXTURES / "glm4moe-f32.gguf"
REF = np.load(FIXTURES / "glm4moe-f32.ref.npz")
NEXTN = 3  # the fixture's NextN layer: blk.3 (block_count 4, nextn_predict_layers 1)


@pytest.fixture(autouse=True)
def vulkan_registered(monkeypatch):
    monkeypatch.setitem(BACKENDS, "vulkan", VulkanBackend)


def hf_bar(logits: np.ndarray) -> np.ndarray:
    """Per position: within the f32 bar of test_oracle against transformers."""
    hf = REF["logits_hf"]
    return (cosine_rows(logits, hf) >= 0.99999) & (np.abs(logits - hf).max(axis=1) <= 1e-2)


def test_config_reads_the_glm_keys():
    cfg = onebit.load(F32, backend="numpy").cfg
    assert (cfg.n_layers, cfg.n_nextn_layers, cfg.n_dense_lead) == (3, 1, 1)
    assert [cfg.layer_is_moe(i) for i in range(3)] == [False, True, True]
    assert (cfg.expert_gating, cfg.expert_weights_norm, cfg.expert_weights_scale) == ("sigmoid", True, 2.5)
    assert (cfg.expert_groups, cfg.expert_groups_used) == (2, 1)
    assert (cfg.rope_dim, cfg.head_dim, cfg.rope_neox, cfg.qk_norm, cfg.attn_bias) == (8, 16, True, "head", True)
    assert cfg.shared_expert_hidden_dim == cfg.expert_hidden_dim == 32 and cfg.ffn_norm == "post_attention_norm"


def test_routing_rule_matches_hf_router_module():
    """onebit's route (numpy twin; Vulkan's kernel is held to it in test_vulkan_kernels) on the
    inputs HF's Glm4MoeTopkRouter took: the same experts with the same weights."""
    m = onebit.load(F32, backend="numpy")
    cfg, be = m.cfg, m.be
    moe = [i for i in range(cfg.n_layers) if cfg.layer_is_moe(i)]
    assert len(moe) == len(REF["router_in"])
    for j, layer in enumerate(moe):
        logits = be.linear(REF["router_in"][j], f"blk.{layer}.ffn_gate_inp.weight")  # [T, E]
        ids, w = be.route_sigmoid(logits, cfg.n_experts_used, be.weight(f"blk.{layer}.exp_probs_b.bias"),
                                  cfg.expert_weights_norm, cfg.expert_weights_scale, cfg.expert_groups,
                                  cfg.expert_groups_used)
        for t in range(len(ids)):  # HF's top-k is unsorted: compare expert -> weight maps
            got = dict(zip(ids[t].tolist(), w[t].tolist()))
            want = dict(zip(REF["router_ids"][j, t].tolist(), REF["router_weights"][j, t].tolist()))
            assert got.keys() == want.keys(), (layer, t, got, want)
            np.testing.assert_allclose([got[e] for e in want], list(want.values()), rtol=1e-5)


def _without_bias(m):
    for name in [n for n in m.gguf.tensors if n.endswith("exp_probs_b.bias")]:
        del m.gguf.tensors[name]  # the block then routes without the correction bias


FEATURES = [
    ("correction bias ignored", _without_bias),
    ("no expert groups", dict(expert_groups=1, expert_groups_used=1)),
    ("no routed scaling", dict(expert_weights_scale=1.0)),
    ("weights not renormalised", dict(expert_weights_norm=False)),
    ("no shared expert", dict(shared_expert_hidden_dim=0)),
    ("full rotary", dict(rope_dim=16)),
    ("interleaved rope", dict(rope_neox=False)),
]


@pytest.mark.parametrize("what,change", FEATURES, ids=[f[0] for f in FEATURES])
def test_glm_features_are_load_bearing(what, change):
    """Each feature turned off: the oracle notices (fewer positions within the bar than it asks)."""
    m = onebit.load(F32, backend="numpy")
    assert hf_bar(m.logits(REF["tokens"].astype(np.int64))).mean() >= 0.97
    if callable(change):
        change(m)
    else:
        m.net.arch.cfg = m.cfg = dataclasses.replace(m.cfg, **change)
    ok = hf_bar(m.logits(REF["tokens"].astype(np.int64)))
    assert ok.mean() < 0.97, f"{what}: still matches HF at {ok.mean():.2f} of positions"


@pytest.mark.parametrize("meta,match", [
    ({"glm4moe.expert_group_count": 3}, "8 experts in 3 groups"),  # groups must split the experts evenly
    ({"glm4moe.expert_group_count": 4, "glm4moe.expert_group_used_count": 1, "glm4moe.expert_used_count": 3},
     "cannot give the top 3"),  # one group of two experts cannot hold a top 3
    ({"glm4moe.expert_gating_func": 1}, "expert_gating_func 1 is not supported"),
    ({"glm4moe.rope.dimension_sections": [4, 2, 2, 0]}, "multimodal RoPE"),
])
def test_bad_routing_metadata_is_refused(tmp_path, meta, match):
    from ggufedit import rewrite

    from onebit.errors import OnebitError

    dst = tmp_path / "bad.gguf"
    rewrite(F32, dst, meta=meta)
    with pytest.raises(OnebitError, match=match):
        onebit.load(dst, backend="numpy")


# -- NextN / MTP layers ---------------------------------------------------------------------


def test_nextn_layer_is_set_aside_not_run_uploaded_planned_or_counted():
    from onebit.apps.info import model_info
    from onebit.memory.budget import Budget
    from onebit.memory.plan import make_plan, size_classes

    raw = GGUFFile(F32)
    mtp = {n for n in raw.tensors if n.startswith(f"blk.{NEXTN}.")}
    assert f"blk.{NEXTN}.nextn.eh_proj.weight" in mtp and f"blk.{NEXTN}.ffn_gate_exps.weight" in mtp
    for backend in ("numpy", "cpu", "vulkan"):
        m = onebit.load(F32, backend=backend)
        assert set(m.gguf.set_aside) == mtp and not mtp & set(m.gguf.tensors)
        if backend == "vulkan":
            assert isinstance(m.be, VulkanBackend) and not any(n.startswith(f"blk.{NEXTN}.") for n in m.be.tensors)
    g = m.gguf
    kept = [t for t in raw.tensors.values() if t.name not in mtp]
    plan = make_plan(g, m.cfg, Budget(1 << 30, "test", 1 << 30), ctx=64)
    resident = next(i for i in plan.items if i.component == "resident weights")
    assert resident.bytes == sum(t.n_bytes for t in kept if not is_expert_tensor(t.name))
    assert [c.layers for c in size_classes(g)] == [(1, 2)]
    info = model_info(g, m.cfg)
    assert info["layers"] == 3 and info["parameters"] == sum(t.n_elements for t in kept)


def test_file_without_its_nextn_tensors_runs_the_same(tmp_path):
    """A trunk-only file (nextn_predict_layers kept, the MTP tensors left out) is the same model."""
    from ggufedit import rewrite

    dst = tmp_path / "trunk.gguf"
    rewrite(F32, dst, drop_tensors=[n for n in GGUFFile(F32).tensors if n.startswith(f"blk.{NEXTN}.")])
    ids = REF["tokens"][:12].astype(np.int64)
    a, b = onebit.load(F32, backend="numpy"), onebit.load(dst, backend="numpy")
    assert b.cfg.n_layers == 3 and not b.gguf.set_aside
    assert np.array_equal(a.logits(ids), b.logits(ids))


def test_nextn_count_that_would_drop_a_real_layer_is_refused(tmp_path):
    from ggufedit import rewrite

    dst = tmp_path / "bad.gguf"
    rewrite(F32, dst, meta={"glm4moe.nextn_predict_layers": 2})
    with pytest.raises(ModelFileError, match="layer 2 a NextN layer"):
        onebit.load(dst, backend="numpy")


# -- prediction ------------------------------------------------------------------------------


def decode(m, ids, n=8):
    cache = m.new_cache()
    logits = m.net.forward(ids, cache)
    toks, steps = [], [logits[-1]]
    for _ in range(n):
        toks.append(int(np.argmax(steps[-1])))
        steps.append(m.net.forward(np.array([toks[-1]], np.int64), cache)[-1])
    return toks, np.stack(steps)


class SameLayer(Predictor):
    """At each pause, the predictor's own ranking applied to that layer and its residual h:
    with the route's rule it is exactly the layer's routing."""

    checked = 0

    def at_pause(self, ctx, layer, ids, logits, h):
        for (_, _, top), row in zip(self.select(self._router(layer, h)), ids):
            assert top == {int(e) for e in row}, (layer, top, row)
            SameLayer.checked += 1
        super().at_pause(ctx, layer, ids, logits, h)


@pytest.mark.parametrize("backend", ["numpy", "cpu", "vulkan"])
def test_prediction_ranks_by_the_routing_rule_and_changes_nothing(backend, monkeypatch):
    ids = REF["tokens"][:6].astype(np.int64)
    want = decode(onebit.load(F32, backend=backend), ids)
    monkeypatch.setattr("onebit.moe.predict.Predictor", SameLayer)
    SameLayer.checked = 0
    for mode in ("router", "block"):
        m = onebit.load(F32, backend=backend, predict=settings_from(mode=mode))
        assert isinstance(m.predictor, SameLayer)
        got = decode(m, ids)
        predictions = sum(s.predictions for s in m.predictor.stats.values())
        m.close()
        assert got[0] == want[0] and np.array_equal(got[1], want[1]), mode
        assert predictions > 0, mode
    assert SameLayer.checked > 0


@pytest.mark.parametrize("backend", ["numpy", "cpu", "vulkan"])
def test_streamed_with_prediction_equals_resident(backend):
    ids = REF["tokens"][:12].astype(np.int64)
    want = decode(onebit.load(F32, backend=backend), ids)
    m = onebit.load(F32, backend=backend, slots=3, budget="1GiB", predict=settings_from(mode="block"))
    try:
        got = decode(m, ids)
        st = m.pool.stats
        assert got[0] == want[0] and np.array_equal(got[1], want[1])
        assert st.demand_misses > 0 and st.prefetches > 0
    finally:
        m.close()


def test_routing_trace_has_the_moe_layers_only(tmp_path):
    from onebit.moe.trace import TraceWriter, read_trace

    m = onebit.load(F32, backend="numpy")
    m.hook = TraceWriter(str(tmp_path / "t.jsonl"), m.path, m.cfg.n_layers, m.cfg.n_experts, m.cfg.n_experts_used)
    routed = []
    ids = REF["tokens"][:5].astype(np.int64)
    def hook(layer, e, lg):
        routed.append((layer, e.tolist()))
        m.hook(layer, e, lg)

    m.net.forward(ids, m.new_cache(), hook=hook)
    m.hook.close()
    tr = read_trace(str(tmp_path / "t.jsonl"))
    assert tr.n_layers == 3 and {a.layer for a in tr.accesses} == {1, 2}
    got = sorted((a.layer, sorted(a.experts)) for a in tr.accesses)
    assert got == sorted((layer, sorted(row)) for layer, rows in routed for row in rows)


# -- quantized files -------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["glm4moe-Q8_0", "glm4moe-Q4_0"])
def test_quantized_matches_llama_cpp_with_its_activation_rounding(name):
    """With llama.cpp's Q8_0 activation rounding modelled too, the quantized files meet the
    llama.cpp bar (cosine >= 0.999 on >= 95% of positions; test_oracle holds the plain run to it)."""
    from llamacpp_numerics import LlamaCppRoundingBackend

    m = onebit.load(FIXTURES / f"{name}.gguf", backend="numpy")
    m.net.be = LlamaCppRoundingBackend(m.gguf)
    ref = np.load(FIXTURES / f"{name}.ref.npz")
    cos = cosine_rows(m.logits(ref["tokens"].astype(np.int64)), ref["logits_llama"])
    assert (cos >= 0.999).mean() >= 0.95, np.sort(cos)[:4]
