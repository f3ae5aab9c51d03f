"""The recorded decode step (onebit/backends/vulkan/graph.py) == the numpy reference.

Every supported architecture (f32 fixtures) and a few quant types: a prompt through the
per-op path (prefill writes K/V into the device cache the graph reads), then one-token steps
through the replayed command buffer. Logits within LOGIT_TOL of the largest reference logit
(measured: worst relative error ~1.2e-6 on these fixtures), greedy tokens identical. The
step is recorded once per KV storage and replayed; trim / snapshot / restore still work.
"""

from __future__ import annotations

import numpy as np
import pytest

import onebit
from conftest import fixture_path
from onebit.backends import BACKENDS
from onebit.backends.vulkan import graph as graph_mod
from onebit.backends.vulkan.backend import VulkanBackend
from onebit.backends.vulkan.graph import DecodeGraph, DeviceKVCache

ARCH = ["qwen3moe-f32", "qwen2moe-f32", "olmoe-f32", "llama-f32", "mixtral-f32", "qwen2-f32", "qwen3-f32"]
QUANT = ["q3moe256-" + t for t in ("f32", "Q4_K_M", "Q8_0", "MXFP4_MOE")]
LOGIT_TOL = 1e-4
N_PROMPT, N_DECODE = 5, 8

_loaded: dict[tuple[str, str], onebit.Model] = {}


@pytest.fixture(autouse=True)
def vulkan_registered(monkeypatch):
    monkeypatch.setitem(BACKENDS, "vulkan", VulkanBackend)


def load(name: str, backend: str) -> onebit.Model:
    key = (name, backend)
    if key not in _loaded:
        _loaded[key] = onebit.load(fixture_path(f"{name}.gguf"), backend=backend)
    return _loaded[key]


def prompt(name: str) -> np.ndarray:
    return np.load(fixture_path(f"{name}.ref.npz"))["tokens"][:N_PROMPT].astype(np.int64)


def greedy(m, ids: np.ndarray, n: int, forward=None) -> tuple[list[int], np.ndarray]:
    forward = forward or m.net.forward
    cache = m.new_cache()
    logits = forward(ids, cache, last_only=True)
    toks, steps = [], []
    for _ in range(n):
        tok = int(np.argmax(logits[-1]))
        toks.append(tok)
        logits = forward(np.array([tok], np.int64), cache)
        steps.append(logits[-1])
    return toks, np.stack(steps)


@pytest.mark.parametrize("name", ARCH + QUANT)
def test_graph_decode_matches_numpy(name):
    ref, vk = load(name, "numpy"), load(name, "vulkan")
    assert vk.be.make_cache(vk.net) is not None, "the recorded step should support this model"
    before = vk.be.graph_recordings
    want_toks, want = greedy(ref, prompt(name), N_DECODE)
    got_toks, got = greedy(vk, prompt(name), N_DECODE)
    assert got_toks == want_toks
    np.testing.assert_allclose(got, want, rtol=0, atol=LOGIT_TOL * np.abs(want).max())
    assert vk.be.graph_recordings - before <= 1  # recorded at most once (storages are reused)
    assert vk.be._graphs.storages and all(s.graph is not None for s in vk.be._graphs.storages)


def test_graph_equals_per_op_path_on_the_same_backend():
    vk = load("qwen3moe-f32", "vulkan")
    toks_g, got = greedy(vk, prompt("qwen3moe-f32"), N_DECODE)
    toks_p, want = greedy(vk, prompt("qwen3moe-f32"), N_DECODE, forward=vk.net.forward.per_op)
    assert toks_g == toks_p
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6 * np.abs(want).max())


def test_replay_does_not_rerecord(monkeypatch):
    vk = onebit.load(fixture_path("qwen3moe-f32.gguf"), backend="vulkan")
    try:
        be = vk.be
        start_total = DecodeGraph.recordings
        cache = vk.new_cache()
        assert isinstance(cache[0], DeviceKVCache)
        vk.net.forward(prompt("qwen3moe-f32"), cache)
        assert be.graph_recordings == 0  # prefill runs op by op
        tok = 1
        for _ in range(10):
            tok = int(vk.net.forward(np.array([tok]), cache)[-1].argmax())
        assert be.graph_recordings == 1 and DecodeGraph.recordings == start_total + 1
        g = cache[0].storage.graph
        assert g.n_replays == 10
        assert cache[0].offset == N_PROMPT + 10
        # a new cache for the next conversation reuses the idle storage and its recorded step
        del cache
        cache = vk.new_cache()
        for _ in range(3):
            tok = int(vk.net.forward(np.array([tok]), cache)[-1].argmax())
        assert be.graph_recordings == 1 and cache[0].storage.graph is g and g.n_replays == 13
        # the step with a hook runs op by op (the hook needs the ids on the host)
        seen = []
        vk.net.forward(np.array([tok]), cache, hook=lambda layer, ids, logits: seen.append(layer))
        assert seen and be.graph_recordings == 1 and g.n_replays == 13
    finally:
        vk.be.close()


def test_kv_growth_rerecords_once_and_keeps_the_cache(monkeypatch):
    monkeypatch.setattr(graph_mod, "MIN_CAPACITY", 8)
    name = "qwen3moe-f32"
    vk, ref = onebit.load(fixture_path(f"{name}.gguf"), backend="vulkan"), load(name, "numpy")
    try:
        toks_g, got = greedy(vk, prompt(name), 12)  # 5 + 12 positions: capacity 8 -> 16 -> 32
        toks_r, want = greedy(ref, prompt(name), 12)
        assert toks_g == toks_r
        np.testing.assert_allclose(got, want, rtol=0, atol=LOGIT_TOL * np.abs(want).max())
        # recorded at capacity 8 (pos 5), again at 16 (pos 8) and 32 (pos 16): once per capacity
        assert vk.be.graph_recordings == 3 and cache_capacity(vk) == 32
    finally:
        vk.be.close()


def cache_capacity(m) -> int:
    (kv,) = m.be._graphs.storages
    return kv.capacity


def test_trim_snapshot_restore_with_the_graph():
    vk = load("qwen3moe-f32", "vulkan")
    cache = vk.new_cache()
    vk.net.forward(prompt("qwen3moe-f32"), cache)
    seq = [7, 11, 13, 17]

    def run(toks):
        return np.concatenate([vk.net.forward(np.array([t]), cache) for t in toks])

    a = run(seq)
    for c in cache:
        c.trim(3)
    b = run(seq[1:])
    assert np.array_equal(a[1:], b)
    snap = [c.snapshot() for c in cache]
    c1 = run([19, 23])
    for c, s in zip(cache, snap):
        c.restore(s)
    assert cache[0].offset == N_PROMPT + 4
    c2 = run([19, 23])
    assert np.array_equal(c1, c2)
    # the graph wrote the K/V the per-op path now reads: a per-op step agrees with a graph step
    for c in cache:
        c.trim(1)
    per_op = vk.net.forward.per_op(np.array([23]), cache)
    np.testing.assert_allclose(per_op, c2[-1:], rtol=0, atol=1e-6 * np.abs(c2).max())


def test_argmax_on_the_device_and_host_timing():
    vk = load("q3moe256-Q4_K_M", "vulkan")
    cache = vk.new_cache()
    vk.net.forward(prompt("q3moe256-Q4_K_M"), cache)
    logits = vk.net.forward(np.array([3]), cache)
    g = cache[0].storage.graph
    assert g.last_argmax == int(logits[-1].argmax())
    assert g.host_s > 0 and g.wait_s > 0


def test_fallback_when_disabled():
    name = "qwen2moe-f32"
    vk, ref = onebit.load(fixture_path(f"{name}.gguf"), backend="vulkan"), load(name, "numpy")
    try:
        vk.be.use_graph = False
        toks, got = greedy(vk, prompt(name), 4)
        assert vk.be.graph_recordings == 0
        want_toks, want = greedy(ref, prompt(name), 4)
        assert toks == want_toks
        np.testing.assert_allclose(got, want, rtol=0, atol=LOGIT_TOL * np.abs(want).max())
    finally:
        vk.be.close()


def test_unsupported_model_falls_back_with_a_log(monkeypatch, caplog):
    monkeypatch.setattr(graph_mod, "GRAPH_ARCHS", ("qwen3moe",))
    name = "qwen3-f32"
    vk, ref = onebit.load(fixture_path(f"{name}.gguf"), backend="vulkan"), load(name, "numpy")
    try:
        with caplog.at_level("WARNING", logger="onebit.backends.vulkan.graph"):
            cache = vk.new_cache()
        assert not isinstance(cache[0], DeviceKVCache)
        assert any("op by op" in r.getMessage() and "qwen3" in r.getMessage() for r in caplog.records)
        toks, got = greedy(vk, prompt(name), 3)
        want_toks, want = greedy(ref, prompt(name), 3)
        assert toks == want_toks and vk.be.graph_recordings == 0
        np.testing.assert_allclose(got, want, rtol=0, atol=LOGIT_TOL * np.abs(want).max())
    finally:
        vk.be.close()
