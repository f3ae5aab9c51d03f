"""The recorded forward (onebit/backends/vulkan/recording.py) == the numpy reference.

One schedule per architecture, run eagerly by numpy and recorded by Vulkan. Every supported
architecture (f32 fixtures) and a few quant types: prefill and one-token steps through
replayed recordings; logits within LOGIT_TOL of the largest reference logit, greedy tokens
identical. R rows in one forward == R single-row steps (invariant 7) on both backends. A
decode step is one submission; a hook adds one per MoE layer (pause points), never an
op-by-op path; recordings are made once per shape and reused.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest

import onebit
from conftest import fixture_path
from onebit.backends import BACKENDS
from onebit.backends.vulkan import VulkanKernelError
from onebit.backends.vulkan import backend as backend_mod
from onebit.backends.vulkan import recorder as recorder_mod
from onebit.backends.vulkan import runner as runner_mod
from onebit.backends.vulkan.backend import VulkanBackend
from onebit.backends.vulkan.kv import DeviceCache
from onebit.backends.vulkan.runner import row_chunks

ARCH = ["qwen3moe-f32", "qwen2moe-f32", "olmoe-f32", "llama-f32", "mixtral-f32", "qwen2-f32", "qwen3-f32",
        "llama3rope-f32", "gemma3-f32", "glm4moe-f32"]
QUANT = ["q3moe256-" + t for t in ("f32", "Q4_K_M", "Q8_0", "MXFP4_MOE")]
QUANT += ["glm4moe-Q8_0", "glm256-Q4_K_M"]
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


def tokens(name: str, n: int = N_PROMPT) -> np.ndarray:
    return np.load(fixture_path(f"{name}.ref.npz"))["tokens"][:n].astype(np.int64)


def greedy(m, ids: np.ndarray, n: int, hook=None) -> tuple[list[int], np.ndarray]:
    cache = m.new_cache()
    logits = m.net.forward(ids, cache, hook=hook, last_only=True)
    toks, steps = [], []
    for _ in range(n):
        tok = int(np.argmax(logits[-1]))
        toks.append(tok)
        logits = m.net.forward(np.array([tok], np.int64), cache, hook=hook)
        steps.append(logits[-1])
    return toks, np.stack(steps)


@pytest.mark.parametrize("name", ARCH + QUANT)
def test_recorded_decode_matches_numpy(name):
    ref, vk = load(name, "numpy"), load(name, "vulkan")
    assert isinstance(vk.be, VulkanBackend)
    want_toks, want = greedy(ref, tokens(name), N_DECODE)
    got_toks, got = greedy(vk, tokens(name), N_DECODE)
    assert got_toks == want_toks
    np.testing.assert_allclose(got, want, rtol=0, atol=LOGIT_TOL * np.abs(want).max())


@pytest.mark.parametrize("backend", ["numpy", "vulkan"])
@pytest.mark.parametrize("name", ["qwen3moe-f32", "qwen2moe-f32", "llama-f32", "gemma3-f32", "glm4moe-f32"])
def test_rows_in_one_forward_equal_single_steps(name, backend):
    """R rows in one forward == R one-row forwards, R = 1..9, after a 4-token prefix: numpy within
    float32 rounding (another matmul shape may sum in another order), Vulkan within kernel
    tolerance; the greedy token of every row identical."""
    m = load(name, backend)
    ids = tokens(name, 13)
    for R in range(1, 10):
        batch = m.new_cache()
        m.net.forward(ids[:4], batch)
        got = m.net.forward(ids[4 : 4 + R], batch)  # [R, vocab]
        assert batch.offset == 4 + R
        single = m.new_cache()
        m.net.forward(ids[:4], single)
        want = np.concatenate([m.net.forward(ids[4 + r : 5 + r], single) for r in range(R)])
        tol = (1e-5 if backend == "numpy" else LOGIT_TOL) * np.abs(want).max()
        np.testing.assert_allclose(got, want, rtol=0, atol=tol)
        assert (got.argmax(-1) == want.argmax(-1)).all()


def test_one_submission_per_decode_step_and_no_rerecording():
    vk = onebit.load(fixture_path("qwen3moe-f32.gguf"), backend="vulkan")
    try:
        be, dev = vk.be, vk.be.dev
        cache = vk.new_cache()
        assert isinstance(cache, DeviceCache)
        vk.net.forward(tokens("qwen3moe-f32"), cache)
        tok, made = 1, be.recordings
        for i in range(10):
            s0 = dev.n_submits
            tok = int(vk.net.forward(np.array([tok]), cache)[-1].argmax())
            assert dev.n_submits - s0 == 1
        assert be.recordings - made <= 1 and cache.offset == N_PROMPT + 10
        recs = dict(cache.storage.recordings)
        # a new cache for the next conversation reuses the idle storage and its recordings
        storage = cache.storage
        del cache
        cache = vk.new_cache()
        assert cache.storage is storage
        made = be.recordings
        for _ in range(3):
            tok = int(vk.net.forward(np.array([tok]), cache)[-1].argmax())
        assert be.recordings == made and all(r.n_replays > 0 for k, r in recs.items() if k[1] == 1)
    finally:
        vk.be.close()


@pytest.mark.parametrize("name", ["qwen3moe-f32", "qwen2moe-f32"])
def test_hook_pauses_the_recording_and_changes_nothing(name):
    """With a hook every MoE layer is a pause point: one submission per MoE layer plus one, the
    hook sees numpy's expert ids, and the logits are bit-identical to the hook-free replay."""
    ref, vk = load(name, "numpy"), load(name, "vulkan")
    n_moe = sum(vk.cfg.layer_is_moe(i) for i in range(vk.cfg.n_layers))
    seen = {"numpy": [], "vulkan": []}

    def hook_for(key):
        return lambda layer, ids, logits: seen[key].append((layer, ids.tolist(), logits.shape))

    want_toks, want = greedy(vk, tokens(name), 4)
    ref_toks, _ = greedy(ref, tokens(name), 4, hook=hook_for("numpy"))
    s0 = vk.be.dev.n_submits
    got_toks, got = greedy(vk, tokens(name), 4, hook=hook_for("vulkan"))
    assert vk.be.dev.n_submits - s0 == 5 * (n_moe + 1)  # prefill + 4 steps, each paused at every MoE layer
    assert got_toks == want_toks == ref_toks
    np.testing.assert_array_equal(got, want)
    assert seen["vulkan"] == seen["numpy"] and len(seen["vulkan"]) == 5 * n_moe


def test_kv_growth_rerecords_and_keeps_the_cache(monkeypatch):
    monkeypatch.setattr(runner_mod, "MIN_CAPACITY", 8)
    name = "qwen3moe-f32"
    vk, ref = onebit.load(fixture_path(f"{name}.gguf"), backend="vulkan"), load(name, "numpy")
    try:
        toks_g, got = greedy(vk, tokens(name), 12)  # 5 + 12 positions: capacity 8 -> 16 -> 32
        toks_r, want = greedy(ref, tokens(name), 12)
        assert toks_g == toks_r
        np.testing.assert_allclose(got, want, rtol=0, atol=LOGIT_TOL * np.abs(want).max())
        assert max(s.capacity for s in vk.be.runner.storages) == 32
    finally:
        vk.be.close()


def test_trim_snapshot_restore_on_the_device_cache():
    vk = load("qwen3moe-f32", "vulkan")
    ids = tokens("qwen3moe-f32", 12)
    cache = vk.new_cache()
    vk.net.forward(ids[:8], cache)
    snap = cache.snapshot()
    a = vk.net.forward(ids[8:12], cache)
    assert cache.trim(4) == 4 and cache.offset == 8
    np.testing.assert_array_equal(vk.net.forward(ids[8:12], cache), a)
    vk.net.forward(np.array([1, 2, 3]), cache)
    cache.restore(snap)
    np.testing.assert_array_equal(vk.net.forward(ids[8:12], cache), a)


def test_a_type_without_a_shader_runs_as_f32_and_says_so(monkeypatch, caplog):
    monkeypatch.setattr(backend_mod, "SUPPORTED_TYPES", tuple(t for t in backend_mod.SUPPORTED_TYPES if t != "Q4_K"))
    name = "q3moe256-Q4_K_M"
    with caplog.at_level(logging.WARNING, logger="onebit.backends.vulkan.backend"):
        vk = onebit.load(fixture_path(f"{name}.gguf"), backend="vulkan")
    try:
        assert any("Q4_K" in r.getMessage() and "F32" in r.getMessage() for r in caplog.records)
        assert isinstance(vk.be, VulkanBackend) and any(t.type_name == "F32" for t in vk.be.tensors.values())
        toks, got = greedy(vk, tokens(name), 4)
        want_toks, want = greedy(load(name, "numpy"), tokens(name), 4)
        assert toks == want_toks
        np.testing.assert_allclose(got, want, rtol=0, atol=LOGIT_TOL * np.abs(want).max())
    finally:
        vk.be.close()


def test_a_model_the_kernels_cannot_run_falls_back_to_the_next_backend_with_a_warning(monkeypatch, capsys):
    """One fallback rule: Vulkan asked for by name but unable to record the model gives way to
    the next fastest backend (cpu), said in one line."""
    def refuse(*a, **k):
        raise VulkanKernelError("kernel attn: head dims outside its limits")

    monkeypatch.setattr(recorder_mod.Recorder, "attention", refuse)
    m = onebit.load(fixture_path("qwen3-f32.gguf"), backend="vulkan")
    assert m.be.name == "cpu"
    err = capsys.readouterr().err
    assert "the Vulkan kernels cannot run this model" in err and "using the cpu backend" in err
    assert err.count("onebit: warning:") == 1
    want_toks, _ = greedy(load("qwen3-f32", "numpy"), tokens("qwen3-f32"), 3)
    assert greedy(m, tokens("qwen3-f32"), 3)[0] == want_toks


def test_row_chunks():
    assert row_chunks(1) == [1] and row_chunks(9) == [9] and row_chunks(16) == [16]
    assert row_chunks(300) == [256, 32, 12]
    assert row_chunks(600) == [256, 256, 64, 16, 8]
    assert row_chunks(40, limit=8) == [8, 8, 8, 8, 8]
    # no one-row chunk in a forward of more rows (one row runs other kernels: another sum order)
    assert row_chunks(33) == [31, 2] and row_chunks(257) == [255, 2] and row_chunks(10, limit=9) == [8, 2]
    for n in range(1, 700):
        chunks = row_chunks(n)
        assert sum(chunks) == n and all(c <= 16 or c & (c - 1) == 0 or c & (c + 1) == 0 for c in chunks)
        for limit in (3, 9, 256):
            chunks = row_chunks(n, limit)
            assert sum(chunks) == n and max(chunks) <= limit and (n == 1 or 1 not in chunks)


def test_an_observing_hook_keeps_one_submission_per_step():
    """A hook with needs_pause = False (a routing trace) is called after the step with the same
    ids, in layer order, as a pausing hook sees; the step stays one submission."""
    vk = load("qwen3moe-f32", "vulkan")
    n_moe = sum(vk.cfg.layer_is_moe(i) for i in range(vk.cfg.n_layers))
    paused, observed = [], []

    class Observer:
        needs_pause = False

        def __call__(self, layer, ids, logits):
            observed.append((layer, ids.tolist(), logits.tolist()))

    greedy(vk, tokens("qwen3moe-f32"), 3, hook=lambda layer, ids, logits: paused.append(
        (layer, ids.tolist(), logits.tolist())))
    s0 = vk.be.dev.n_submits
    greedy(vk, tokens("qwen3moe-f32"), 3, hook=Observer())
    assert vk.be.dev.n_submits - s0 == 4
    assert observed == paused and len(observed) == 4 * n_moe


@pytest.mark.parametrize("name", ["qwen3moe-f32", "qwen2moe-f32", "llama-f32", "q3moe256-Q4_K_M", "q3moe256-MXFP4_MOE"])
def test_prompt_chunks_match_numpy(name):
    """A 40-row forward runs as recorded chunks of 32 and 8 rows, each recorded once."""
    ref, vk = load(name, "numpy"), load(name, "vulkan")
    ids = tokens(name, 40)
    assert len(ids) == 40
    want = ref.logits(ids)
    cache = vk.new_cache()
    got = vk.net.forward(ids, cache)
    assert cache.offset == 40
    np.testing.assert_allclose(got, want, rtol=0, atol=LOGIT_TOL * np.abs(want).max())
    assert (got.argmax(-1) == want.argmax(-1)).all()
    assert {k[1] for k in cache.storage.recordings} >= {32, 8}


def test_scratch_is_reused_across_recordings():
    """Recordings share the backend's scratch arena: recording many row counts does not keep
    allocating (only one recording runs at a time)."""
    vk = onebit.load(fixture_path("qwen3moe-f32.gguf"), backend="vulkan")
    try:
        ids = tokens("qwen3moe-f32", 12)
        cache = vk.new_cache()
        vk.net.forward(ids[:9], cache)
        after_first = vk.be.arena.nbytes
        for R in (9, 9, 8, 7, 9, 6):
            cache.trim(cache.offset)
            vk.net.forward(ids[:R], cache)
        assert vk.be.arena.nbytes <= 2 * after_first
    finally:
        vk.be.close()


def test_sliding_window_layers_match_numpy(monkeypatch):
    """A config with a sliding window on some layers (as Gemma 3 and gpt-oss files have): both
    backends mask the same positions, greedy tokens agree, and the window really changes the
    logits once the prompt is longer than it."""
    import dataclasses

    from onebit.models import qwen3moe

    plain = qwen3moe.Network.config
    full_model = load("qwen3moe-f32", "numpy")  # (cached by the module: loaded before the window is patched in)
    monkeypatch.setattr(qwen3moe.Network, "config", staticmethod(
        lambda g: dataclasses.replace(plain(g), sliding_window=3, swa_layers=(1,))))
    path = fixture_path("qwen3moe-f32.gguf")
    ref, vk = onebit.load(path, backend="numpy"), onebit.load(path, backend="vulkan")
    try:
        assert vk.cfg.layer_window(1) == 3 and vk.cfg.layer_window(0) == 0
        ids = tokens("qwen3moe-f32", 20)
        want, got = ref.logits(ids), vk.logits(ids)
        np.testing.assert_allclose(got, want, rtol=0, atol=LOGIT_TOL * np.abs(want).max())
        full = full_model.logits(ids)
        np.testing.assert_allclose(want[:3], full[:3], rtol=0, atol=1e-5 * np.abs(full).max())  # within the window: the same (to rounding)
        assert np.abs(want[3:] - full[3:]).max() > 1e-3
        assert greedy(vk, ids[:6], 6)[0] == greedy(ref, ids[:6], 6)[0]
    finally:
        vk.be.close()


MIXED = ["q3moe256-" + t for t in ("IQ1_M", "IQ3_XXS", "Q2_K", "TQ1_0", "MXFP4_MOE")]


@pytest.mark.parametrize("name", MIXED)
def test_a_mixed_type_file_keeps_the_recorded_step(name, caplog):
    """A file that mixes quant types (as llama-quantize writes them: IQ1_M holds IQ1_M, IQ2_XXS,
    Q2_K, Q4_K and Q5_K matrices) uploads every matrix in its own type (no F32 upload logged) and
    decodes by replaying one recording: one submission per token, no re-recording, greedy
    tokens as numpy's."""
    with caplog.at_level(logging.INFO, logger="onebit"):
        vk = onebit.load(fixture_path(f"{name}.gguf"), backend="vulkan")
    try:
        be, dev = vk.be, vk.be.dev
        assert isinstance(be, VulkanBackend)
        assert not [r.getMessage() for r in caplog.records if "F32" in r.getMessage() or "fall" in r.getMessage()]
        kinds = {t.type_name for n, t in vk.gguf.tensors.items() if len(t.shape) > 1}
        assert len(kinds) >= 3, kinds
        assert all(be.tensors[n].type_name == t.type_name for n, t in vk.gguf.tensors.items() if n in be.tensors)
        cache = vk.new_cache()
        logits = vk.net.forward(tokens(name), cache, last_only=True)
        made, got = be.recordings, []
        for _ in range(N_DECODE):
            tok = int(np.argmax(logits[-1]))
            got.append(tok)
            s0 = dev.n_submits
            logits = vk.net.forward(np.array([tok], np.int64), cache)
            assert dev.n_submits - s0 == 1
        assert be.recordings - made <= 1
        assert [r.n_replays for k, r in cache.storage.recordings.items() if k[1] == 1] == [N_DECODE]
        assert got == greedy(load(name, "numpy"), tokens(name), N_DECODE)[0]
    finally:
        vk.be.close()
