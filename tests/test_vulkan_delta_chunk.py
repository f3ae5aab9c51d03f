"""The chunked delta rule on Vulkan (shaders/delta_chunk.comp) inside whole hybrid models: the
Recorder takes it for prompt chunks of >= Kernels.delta_chunk_min_rows rows. CPU devices
(lavapipe, where these tests run) leave it off by default (measured no faster there,
bench/results/hybrid-deltanet-2026-12-02.md), so each test turns it on and checks it really ran. The
kernel against its numpy twin and the step kernel: tests/test_vulkan_hybrid_kernels.py."""

from __future__ import annotations

import dataclasses
import types

import numpy as np
import pytest

import onebit
from conftest import cosine_rows, fixture_path, greedy_tokens
from onebit.backends.vulkan.kernels import DELTA_CHUNK_MIN_ROWS, Kernels

HYBRID = ["qwen3next-f32", "qwen35moe-f32"]
_loaded: dict = {}


def load(name: str, backend: str):
    if (name, backend) not in _loaded:
        _loaded[name, backend] = onebit.load(fixture_path(f"{name}.gguf"), backend=backend)
    return _loaded[name, backend]


def chunked(name: str):
    """The Vulkan model with the chunked delta rule on (>= 16 rows); k.chunk_rows: the row count of
    every chunked call recorded (recordings are kept and replayed, so across tests it only grows)."""
    m = load(name, "vulkan")
    assert m.net.be.name == "vulkan"  # no fall back
    k = m.net.be.k
    k.delta_chunk_min_rows = DELTA_CHUNK_MIN_ROWS
    if not hasattr(k, "chunk_rows"):
        k.chunk_rows = []
        real = Kernels.delta_chunk.__get__(k)

        def counted(seq, *args):
            k.chunk_rows.append(args[7])  # n_rows, after q, k, v, g, beta, state, out
            return real(seq, *args)

        k.delta_chunk = counted
    return m


def prompt(name: str, n: int) -> np.ndarray:
    vocab = load(name, "numpy").cfg.vocab_size
    return np.random.default_rng(130).integers(0, vocab, n).astype(np.int64)


@pytest.mark.parametrize("name", HYBRID)
def test_long_prompt_chunked_equals_numpy(name):
    """130 rows in one forward (recorded as 128 + 2: the chunked kernel, then the step kernel on
    the state it left) == numpy (whose own chunked form runs in blocks of 64)."""
    m, ref = chunked(name), load(name, "numpy")
    ids = prompt(name, 130)
    a, b = m.net.forward(ids, m.new_cache()), ref.net.forward(ids, ref.new_cache())
    rows = m.net.be.k.chunk_rows
    assert rows.count(128) == len(m.cfg.recurrent_layers) > 0 and 2 not in rows  # every DeltaNet layer
    np.testing.assert_allclose(a, b, rtol=0, atol=2e-4 * np.abs(b).max())
    off = load(name, "vulkan")  # the same model with the chunked form off again: the step kernel's logits
    off.net.be.k.delta_chunk_min_rows = 0
    c = off.net.forward(ids, off.new_cache())
    assert not np.array_equal(a, c)  # a different kernel really ran
    np.testing.assert_allclose(a, c, rtol=0, atol=2e-4 * np.abs(c).max())


@pytest.mark.parametrize("name", HYBRID)
def test_greedy_after_a_long_prompt_identical(name):
    m, ref = chunked(name), load(name, "numpy")
    ids = prompt(name, 100)
    assert greedy_tokens(m, ids, 12) == greedy_tokens(ref, ids, 12)
    assert {64, 32} <= set(m.net.be.k.chunk_rows)  # the prompt's 64 + 32 (+ 4) rows


@pytest.mark.parametrize("name", HYBRID)
def test_chunked_meets_the_transformers_bar(name):
    """tests/test_oracle.py's HF bar with the chunked form on (48 positions: 32 + 16 rows, both chunked)."""
    m = chunked(name)
    ref = np.load(fixture_path(f"{name}.ref.npz"))
    logits = m.net.forward(ref["tokens"].astype(np.int64), m.new_cache())
    assert {32, 16} <= set(m.net.be.k.chunk_rows)
    for key, bar in (("logits_hf", 0.97), ("logits_llama", 0.95)):
        cos = cosine_rows(logits, ref[key])
        ok = cos >= 0.999
        if key == "logits_hf":
            ok = (cos >= 0.99999) & (np.abs(logits - ref[key]).max(axis=1) <= 1e-2)
        assert ok.mean() >= bar, (key, np.nonzero(~ok)[0], cos.min())


def test_the_chunked_form_is_off_on_cpu_devices_and_on_on_gpus_it_fits():
    dev = load("qwen3next-f32", "vulkan").net.be.dev
    assert dev.info.type == "cpu" and Kernels(dev).delta_chunk_min_rows == 0
    gpu = types.SimpleNamespace(info=dataclasses.replace(dev.info, type="discrete"))
    assert Kernels(gpu).delta_chunk_min_rows == DELTA_CHUNK_MIN_ROWS
    small = types.SimpleNamespace(info=dataclasses.replace(gpu.info, max_compute_shared_memory_size=16384))
    assert Kernels(small).delta_chunk_min_rows == 0  # the kernel's shared arrays would not fit
