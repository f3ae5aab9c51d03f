"""Greedy decoding with the device a step ahead (chain.GreedyChain): each step's tail writes the
next step's token and position on the device, so the host reads a token while the device runs
the next step. Against plain steps (`forward` per token, the host's argmax) on the same
backend: the same tokens, the same cache afterwards (the step queued past the last token kept
is undone), through a KV storage that grows, up to the context's end, and with a non-finite
step stopping generation as a plain step does."""

from __future__ import annotations

import numpy as np
import pytest

import onebit
from conftest import fixture_path
from onebit.backends import BACKENDS
from onebit.backends.vulkan.backend import VulkanBackend
from onebit.errors import NonFiniteError
from onebit.generate import generate_step
from onebit.sample import make_sampler

N_GEN = 24


@pytest.fixture(autouse=True)
def vulkan_registered(monkeypatch):
    monkeypatch.setitem(BACKENDS, "vulkan", VulkanBackend)  # no silent fall back to numpy


def _prompt(m, n=6, seed=0):
    return np.random.default_rng(seed).integers(1, m.cfg.vocab_size, n).tolist()


def _greedy(chained: bool):
    s = make_sampler(0.0, 1.0, 0.0, 0, None)
    return s if chained else (lambda logits: s(logits))  # (a plain callable: no chain)


def _run(m, prompt, n, chained, cache=None, **kw):
    """n greedy tokens, the cache after, and (the chains made, the tokens they gave)."""
    cache = m.new_cache() if cache is None else cache
    used, given = [], [0]
    make = m.net.greedy_steps

    def spy(*a, **k):
        chain = make(*a, **k)
        used.append(chain)
        if chain is not None:
            step = chain.step

            def counted(tok):
                nxt = step(tok)
                given[0] += nxt is not None
                return nxt

            chain.step = counted
        return chain

    m.net.greedy_steps = spy
    try:
        gen = generate_step(m.net, prompt, cache, _greedy(chained), **kw)
        toks = [next(gen) for _ in range(n)]
        gen.close()
    finally:
        del m.net.greedy_steps
    return toks, cache, (used, given[0])


def _after(m, cache, tok):
    """Logits of one more plain step: what the cache holds decides them."""
    return m.net.forward(np.array([tok], np.int64), cache)


FIXTURES = sorted(p.name[: -len(".gguf")] for p in fixture_path("").glob("*.gguf") if "imatrix" not in p.name)


@pytest.mark.parametrize("name", FIXTURES)
def test_chained_greedy_equals_plain_steps(name):
    """Every fixture: the chain's tokens and cache are plain steps'; a model with recurrent
    state (its queued step could not be undone by a trim) decodes with plain steps."""
    m = onebit.load(fixture_path(f"{name}.gguf"), backend="vulkan")
    prompt = _prompt(m)
    want, plain_cache, (used, _) = _run(m, prompt, N_GEN, chained=False)
    assert used == []
    got, cache, (used, replays) = _run(m, prompt, N_GEN, chained=True)
    if m.cfg.recurrent_layers:
        assert used == [None] and replays == 0
    else:
        assert used and used[0] is not None and replays == N_GEN - 1  # every token after the first
    assert got == want
    assert cache.offset == plain_cache.offset == len(prompt) + N_GEN - 1
    np.testing.assert_array_equal(_after(m, cache, got[-1]), _after(m, plain_cache, want[-1]))


def test_chain_grows_the_kv_storage_and_stops_at_the_context_end():
    """A storage of 8 positions grows twice under the chain (8 -> 16 -> 32); with a context end
    at position 20 the chain stops queueing there and the tokens after come from plain steps,
    as they would without the chain."""
    for kw in ({}, {"max_positions": 20}):
        m = onebit.load(fixture_path("qwen3moe-f32.gguf"), backend="vulkan")  # (no storage to reuse)
        prompt = _prompt(m)
        want, plain_cache, _ = _run(m, prompt, N_GEN, False, m.net.make_cache(capacity=8), **kw)
        cache = m.net.make_cache(capacity=8)
        assert cache.storage.capacity == 8
        got, cache, (used, replays) = _run(m, prompt, N_GEN, True, cache, **kw)
        assert got == want and cache.offset == plain_cache.offset
        assert cache.storage.capacity == 32
        assert replays == (N_GEN - 1 if not kw else 20 - len(prompt))
        np.testing.assert_array_equal(_after(m, cache, got[-1]), _after(m, plain_cache, want[-1]))


def test_stopping_early_leaves_the_cache_as_plain_decoding_does():
    m = onebit.load(fixture_path("gemma3-f32.gguf"), backend="vulkan")  # (sliding-window rings too)
    prompt = _prompt(m, seed=1)
    for n in (1, 2, 3, 7):
        want, plain_cache, _ = _run(m, prompt, n, False)
        got, cache, _ = _run(m, prompt, n, True)
        assert got == want and cache.offset == plain_cache.offset == len(prompt) + n - 1
        np.testing.assert_array_equal(_after(m, cache, got[-1]), _after(m, plain_cache, want[-1]))


def test_a_nonfinite_step_inside_the_chain_stops_as_a_plain_step_does(tmp_path):
    """The 4th generated token's embedding row is NaN: the chain has already queued the step
    after it; the error names the embedding (a numpy re-run of that step), the tokens before
    are the same, and the cache ends as plain decoding's."""
    from test_nonfinite import _poison

    m = onebit.load(fixture_path("qwen3moe-f32.gguf"), backend="vulkan")
    prompt = _prompt(m)
    toks, _, _ = _run(m, prompt, 8, False)
    bad = next(t for i, t in enumerate(toks) if i >= 3 and t not in prompt and t not in toks[:i])
    n_ok = toks.index(bad) + 1
    m = onebit.load(_poison(tmp_path, "token_embd.weight", np.nan, where=bad), backend="vulkan")
    results = []
    for chained in (False, True):
        cache, got = m.new_cache(), []
        gen = generate_step(m.net, prompt, cache, _greedy(chained))
        with pytest.raises(NonFiniteError) as e:
            for tok in gen:
                got.append(tok)
        results.append((got, str(e.value), cache.offset))
    assert results[0] == results[1]
    assert results[0][0] == toks[:n_ok] and "first in the token embedding" in results[0][1]


def test_closing_the_model_under_a_suspended_chain_waits_for_its_step():
    """A generator left suspended with a step queued, then the backend closed: the recording's
    close waits for the device before freeing what the step writes (no crash, nothing written
    into freed memory); a fresh model then decodes as before."""
    m = onebit.load(fixture_path("qwen3moe-f32.gguf"), backend="vulkan")
    prompt = _prompt(m)
    cache = m.new_cache()
    gen = generate_step(m.net, prompt, cache, _greedy(True))
    first = [next(gen) for _ in range(4)]
    m.be.close()  # (the generator still holds a queued step)
    m2 = onebit.load(fixture_path("qwen3moe-f32.gguf"), backend="vulkan")
    again, _, _ = _run(m2, prompt, 4, True)
    assert again == first
