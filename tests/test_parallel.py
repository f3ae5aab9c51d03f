"""Several sequences in one forward (Runner.forward_batch, serve's --parallel): each sequence's
greedy tokens are those it gets alone, token for token, whatever runs beside it, joining and
leaving at any step, on the numpy reference, the cpu backend and Vulkan (Mesa's lavapipe here);
MoE, hybrid (Gated DeltaNet: recurrent state per sequence), sliding-window rings and attention
sinks."""

from __future__ import annotations

import numpy as np
import pytest

import onebit
from conftest import fixture_path
from onebit.cache import MIN_SWA_ROWS
from onebit.errors import UsageError

# qwen3moe: MoE; qwen3next: hybrid; gemma3: sliding-window rings (sized to wrap here);
# gptoss: sliding window, sinks and biased experts
FIXTURES = ["qwen3moe-f32", "qwen3next-f32", "gemma3-f32", "gptoss-f32"]
BACKENDS = ["numpy", "cpu", "vulkan"]
STEPS = 12  # greedy tokens per sequence

_models: dict = {}


def load(name: str, backend: str):
    key = (name, backend)
    if key not in _models:
        _models[key] = onebit.load(fixture_path(f"{name}.gguf"), backend=backend)
    assert _models[key].be.name == backend  # (not a fallback)
    return _models[key]


def prompts(m, n: int) -> list[np.ndarray]:
    """n prompts of different lengths (3 to 20 tokens), seeded random ids."""
    rng = np.random.default_rng(7)
    return [rng.integers(3, m.cfg.vocab_size, 3 + (i * 7) % 18).astype(np.int64) for i in range(n)]


def alone(m, ids: np.ndarray) -> tuple[list[int], list[np.ndarray]]:
    """STEPS greedy tokens of one sequence run by itself, and the logits each came from."""
    cache = m.net.make_cache(swa_rows=MIN_SWA_ROWS)
    logits = m.net.forward(ids, cache, last_only=True)
    toks, rows = [], []
    for _ in range(STEPS):
        rows.append(logits[-1])
        toks.append(int(np.argmax(logits[-1])))
        logits = m.net.forward(np.array([toks[-1]], np.int64), cache)
    return toks, rows


def together(m, ids: list[np.ndarray], joins: list[int]) -> tuple[list[list[int]], list[list[np.ndarray]]]:
    """The same sequences in shared forwards: sequence i joins at step joins[i] (its whole
    prompt rides beside the others' decode rows) and leaves after STEPS tokens."""
    caches = [m.net.make_cache(swa_rows=MIN_SWA_ROWS) for _ in ids]
    toks: list[list[int]] = [[] for _ in ids]
    rows: list[list[np.ndarray]] = [[] for _ in ids]
    step = 0
    while any(len(t) < STEPS for t in toks):
        batch = [i for i in range(len(ids)) if joins[i] <= step and len(toks[i]) < STEPS]
        if batch:
            feed = [(ids[i] if caches[i].offset == 0 else np.array([toks[i][-1]], np.int64), caches[i]) for i in batch]
            out = m.net.forward_batch(feed, last_only=[True] * len(batch))
            for i, lg in zip(batch, out):
                assert lg.shape == (1, m.cfg.vocab_size)
                rows[i].append(lg[-1])
                toks[i].append(int(np.argmax(lg[-1])))
        step += 1
    return toks, rows


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", FIXTURES)
def test_sequences_together_give_their_tokens_alone(name, backend):
    m = load(name, backend)
    ids = prompts(m, 4)
    want = [alone(m, p) for p in ids]
    got_toks, got_rows = together(m, ids, joins=[0, 0, 3, 7])
    for i, (toks, rows) in enumerate(want):
        assert got_toks[i] == toks, f"sequence {i}"
        # the same logits within float32 rounding (a product over more rows may sum in another order)
        np.testing.assert_allclose(np.array(got_rows[i]), np.array(rows), rtol=0,
                                   atol=1e-4 * np.abs(np.array(rows)).max())
        if backend == "cpu" and not m.cfg.shared_expert_hidden_dim:
            # the cpu kernels sum each row in one order whatever the rows beside it: bit for bit
            # (a shared expert's gate is numpy's x @ w: a dot for one row, a gemv for several)
            assert np.array_equal(np.array(got_rows[i]), np.array(rows)), f"sequence {i}"


def test_all_rows_of_each_sequence():
    """Without last_only a sequence gets every row's logits, as its own forward gives them."""
    m = load("qwen3moe-f32", "numpy")
    a, b = prompts(m, 2)
    ca, cb = m.new_cache(), m.new_cache()
    ga, gb = m.net.forward_batch([(a, ca), (b, cb)], last_only=[False, True])
    assert ga.shape == (len(a), m.cfg.vocab_size) and gb.shape == (1, m.cfg.vocab_size)
    assert (ca.offset, cb.offset) == (len(a), len(b))
    wa, wb = m.net.forward(a, m.new_cache()), m.net.forward(b, m.new_cache(), last_only=True)
    np.testing.assert_allclose(ga, wa, rtol=0, atol=1e-4 * np.abs(wa).max())
    np.testing.assert_allclose(gb, wb, rtol=0, atol=1e-4 * np.abs(wb).max())


def test_one_sequence_is_the_plain_forward():
    """One sequence takes Runner.forward itself: bit for bit its logits."""
    m = load("qwen3moe-f32", "numpy")
    (a,) = prompts(m, 1)
    got = m.net.forward_batch([(a, m.new_cache())])[0]
    np.testing.assert_array_equal(got, m.net.forward(a, m.new_cache()))


def test_a_backend_without_batches_is_refused():
    m = load("qwen3moe-f32", "numpy")
    a, b = prompts(m, 2)
    m.be.batches_sequences = False  # (an instance attribute: as a backend that declares none)
    try:
        with pytest.raises(UsageError, match="one sequence per forward"):
            m.net.forward_batch([(a, m.new_cache()), (b, m.new_cache())])
    finally:
        del m.be.batches_sequences


@pytest.mark.parametrize("backend", BACKENDS)
def test_streamed_experts_read_once_per_step_for_every_sequence(backend):
    """Experts streamed through a pool of 3 slots: the batched sequences' tokens equal the
    resident model's alone; a step's experts are acquired once for all its rows, so the batched
    run reads fewer expert bytes than the same sequences one after another."""
    path = fixture_path("qwen3moe-f32.gguf")
    resident = load("qwen3moe-f32", backend)
    ids = prompts(resident, 4)
    want = [alone(resident, p)[0] for p in ids]
    apart = onebit.load(path, backend=backend, slots=3, budget="1GiB")
    assert apart.be.name == backend and apart.pool is not None
    assert [alone(apart, p)[0] for p in ids] == want
    together_ = onebit.load(path, backend=backend, slots=3, budget="1GiB")
    assert together(together_, ids, joins=[0, 0, 0, 0])[0] == want
    assert together_.pool.stats.bytes_read < apart.pool.stats.bytes_read
    apart.close()
    together_.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_router_prediction_reads_ahead_for_batched_sequences(backend):
    """Router prediction ranks a forward over several sequences' rows (it reads their residual,
    no cache): the next layer's experts for all of them are read ahead, and the tokens stay
    those alone. Block prediction (one sequence's cache) is left out of such forwards."""
    path = fixture_path("qwen3moe-f32.gguf")
    resident = load("qwen3moe-f32", backend)
    ids = prompts(resident, 3)
    want = [alone(resident, p)[0] for p in ids]
    for mode, predicts in (("router", True), ("block", False)):
        m = onebit.load(path, backend=backend, slots=6, budget="1GiB", predict=mode)
        try:
            assert m.predictor.per_sequence is not predicts
            # every step past the first is a batch of one decode row per sequence
            assert together(m, ids, joins=[0, 0, 0])[0] == want
            issued = sum(st.issued for st in m.predictor.stats.values())
            assert (issued > 0) is predicts and (m.pool.stats.prefetches > 0 or not predicts), mode
        finally:
            m.close()


def test_plan_counts_a_cache_per_sequence():
    """`sequences`: the KV cache, the recurrent state and its checkpoints once per sequence; the
    load's line says so."""
    from onebit.backends.base import activation_bytes
    from onebit.formats.gguf_file import GGUFFile
    from onebit.memory.budget import detect_budget
    from onebit.memory.plan import plan_load
    from onebit.models import network_class

    for name in ("qwen3moe-f32", "qwen3next-f32"):
        g = GGUFFile(fixture_path(f"{name}.gguf"))
        cfg = network_class(g.architecture, g.path).config(g)
        b = detect_budget("4GiB")
        one, three = (plan_load(g, cfg, b, ctx=256, sequences=n) for n in (1, 3))
        items = lambda p: {i.component: i.bytes for i in p.items}  # noqa: E731
        for part in ("KV cache", "recurrent state", "recurrent checkpoints"):
            if part in items(one):
                assert items(three)[part] == 3 * items(one)[part] > 0
        # a step holds one 256-row prompt chunk and the 2 others' verify rows (1 + 8 each)
        assert items(three)["compute scratch"] == activation_bytes(cfg, 256 + 2 * 9, 256)
        assert items(one)["compute scratch"] == activation_bytes(cfg, 256, 256)
        per_sequence = ("KV cache", "recurrent state", "recurrent checkpoints", "compute scratch")
        rest = {k: v for k, v in items(one).items() if k not in per_sequence}
        assert rest == {k: v for k, v in items(three).items() if k in rest}
        assert "context 256 for each of 3 sequences" in three.decision and "sequences" not in one.decision
    m = onebit.load(fixture_path("qwen3moe-f32.gguf"), backend="numpy", sequences=2)
    assert "for each of 2 sequences" in m.decision
    m.close()


def _turn(m, prefix, ids: list[int], n: int) -> list[int]:
    """One request as serve runs it on a slot's PrefixCache: the prefix kept, the rest of the
    prompt run, n greedy tokens, the cache settled."""
    common = prefix.reuse(ids)
    held = prefix.prefill(m.net, ids, common)
    logits = m.net.forward(np.asarray(ids[held:], np.int64), prefix.cache, last_only=True)
    out = []
    for _ in range(n):
        out.append(int(np.argmax(logits[-1])))
        logits = m.net.forward(np.array([out[-1]], np.int64), prefix.cache)
    prefix.settle(ids + out)
    return out


@pytest.mark.parametrize("backend", ["numpy", "vulkan"])
@pytest.mark.parametrize("name", ["qwen3moe-f32", "qwen3next-f32", "gemma3-f32"])
def test_prompt_cache_brings_a_conversation_back(name, backend, monkeypatch):
    """Two conversations taking turns on one slot (serve --parallel 1): the second saves the
    first's cache to the PromptCache, the first's next turn gets it back and runs only its new
    tokens; its greedy reply is the one a fresh cache gives. The hybrid model (qwen3next) goes
    back through the checkpoints saved with it; gemma3 through its sliding-window rings; Vulkan
    (Mesa's lavapipe here) copies its caches out of device memory and back."""
    from onebit.cache import PrefixCache, PromptCache

    if backend == "vulkan":
        from onebit.backends import BACKENDS
        from onebit.backends.vulkan.backend import VulkanBackend

        monkeypatch.setitem(BACKENDS, "vulkan", VulkanBackend)  # (lavapipe: asked for by name)
    m = load(name, backend)
    assert m.be.name == backend
    a, b = (p.tolist() for p in prompts(m, 4)[2:4])
    slot, saved = PrefixCache(m.new_cache()), PromptCache(1 << 30)
    saved.recall(slot, a, 0.5)
    reply = _turn(m, slot, a, 5)
    saved.recall(slot, b, 0.5)  # B keeps nothing of A: A is saved
    assert saved.saves == 1 and saved.loads == 0
    _turn(m, slot, b, 5)
    a2 = a + reply[:-1] + [5, 6, 7]  # (a reply edited at its end)
    saved.recall(slot, a2, 0.5)  # A's prefix back in the slot, B's saved
    assert saved.loads == 1 and saved.saves == 2
    held = slot.reuse(a2)
    # the recurrent state cannot trim: back to the checkpoint at A's prompt but its last token
    assert held == (len(a) - 1 if name == "qwen3next-f32" else len(a) + len(reply) - 1)
    assert _turn(m, slot, a2, 6) == _turn(m, PrefixCache(m.new_cache()), a2, 6)


def test_prompt_cache_drops_the_least_recently_used():
    """A budget for two saved prefixes: a third drops the oldest; taking one out frees its room;
    a prefix over the whole budget is not saved."""
    from onebit.cache import PrefixCache, PromptCache

    m = load("qwen3moe-f32", "numpy")
    convs = [[10 * i + j + 3 for j in range(10)] for i in range(3)]  # three conversations of 10 tokens
    slots = []
    for ids in convs:
        slot = PrefixCache(m.new_cache())
        m.net.forward(np.asarray(ids, np.int64), slot.cache)
        slot.settle(ids)
        slots.append(slot)
    one = PromptCache(1 << 30)
    one.save(slots[0])
    size = one.nbytes
    assert size == m.cfg.n_layers * 10 * m.cfg.n_kv_heads * (m.cfg.head_dim + m.cfg.head_dim_v) * 4  # f32 K/V
    cache = PromptCache(2 * size)
    for s in slots:
        assert cache.save(s)
    assert cache.drops == 1 and cache.nbytes == 2 * size
    assert cache.take(convs[0] + [1], 0) is None  # the oldest went
    got = cache.take(convs[1] + [1], 0)
    assert got is not None and got.tokens.tolist() == convs[1] and cache.nbytes == size
    assert not PromptCache(size - 1).save(slots[2])
