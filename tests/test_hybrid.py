"""Hybrid Gated-DeltaNet MoE models (qwen3next, qwen35moe): the delta rule's two forms, the
recurrent layer cache (no trim: checkpoints and rollback), lookup decoding and chat prefix
reuse over it, the memory plan, block prediction with scratch state, and the quantized file
against llama.cpp. The f32 oracles (HF transformers and llama.cpp) are in test_oracle.py."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import onebit
import onebit.generate as generate_mod
from conftest import cosine_rows, fixture_path, greedy_tokens
from onebit.backends.numpy_backend import NumpyBackend
from onebit.cache import RecurrentCache, recurrent_state_bytes
from onebit.apps.chat import ChatSession
from onebit.lookup import DraftPolicy, LookupStats
from onebit.generate import generate_step
from onebit.moe.predict import settings_from
from onebit.sample import make_sampler

HYBRID = ["qwen3next-f32", "qwen35moe-f32"]
N_GEN = 16
_loaded: dict = {}


def load(name: str, backend: str = "numpy", **kw) -> onebit.Model:
    key = (name, backend, tuple(sorted(kw.items())))
    if key not in _loaded:
        _loaded[key] = onebit.load(fixture_path(f"{name}.gguf"), backend=backend, **kw)
    return _loaded[key]


def ref_tokens(name: str, n: int = 48) -> np.ndarray:
    return np.load(fixture_path(f"{name}.ref.npz"))["tokens"][:n].astype(np.int64)


# -- the ops ------------------------------------------------------------------------------


def _random_delta_inputs(rng, R, Hk=2, Hv=4, D=16):
    q = rng.normal(size=(R, Hk, D)).astype(np.float32)
    k = rng.normal(size=(R, Hk, D)).astype(np.float32)
    v = rng.normal(size=(R, Hv, D)).astype(np.float32)
    g = -rng.uniform(0.0, 3.0, size=(R, Hv)).astype(np.float32)  # log decay < 0
    beta = rng.uniform(0.0, 1.0, size=(R, Hv)).astype(np.float32)
    state = rng.normal(size=(Hv, D, D)).astype(np.float32)
    return q, k, v, g, beta, state


@pytest.mark.parametrize("tiled", [False, True])
@pytest.mark.parametrize("R,chunk", [(1, 64), (5, 64), (40, 16), (130, 64)])
def test_chunked_delta_rule_equals_the_step_form(R, chunk, tiled):
    be = NumpyBackend.__new__(NumpyBackend)
    args = _random_delta_inputs(np.random.default_rng(R), R)
    o_step, s_step = be.delta_rule(*args, 1e-6, tiled, 0)
    o_chunk, s_chunk = be.delta_rule(*args, 1e-6, tiled, chunk)
    np.testing.assert_allclose(o_chunk, o_step, rtol=0, atol=2e-5 * np.abs(o_step).max())
    np.testing.assert_allclose(s_chunk, s_step, rtol=0, atol=2e-5 * np.abs(s_step).max())
    assert not np.array_equal(s_step, args[5])  # the state moved


def test_delta_rule_step_form_is_the_recurrence():
    """One row through the op == the delta rule written out for one head."""
    be = NumpyBackend.__new__(NumpyBackend)
    q, k, v, g, beta, state = _random_delta_inputs(np.random.default_rng(7), 1)
    o, s = be.delta_rule(q, k, v, g, beta, state, 1e-6, False, 0)
    h, kh = 3, 3 // 2  # value head 3 reads key head 1 (grouped)
    qn = q[0, kh] / np.linalg.norm(q[0, kh]) / 4.0
    kn = k[0, kh] / np.linalg.norm(k[0, kh])
    S = np.exp(g[0, h]) * state[h]
    u = beta[0, h] * (v[0, h] - kn @ S)
    S = S + np.outer(kn, u)
    np.testing.assert_allclose(s[h], S, atol=1e-5)
    np.testing.assert_allclose(o[0, h], qn @ S, atol=1e-5)


def test_conv_over_rows_equals_one_row_at_a_time():
    be = NumpyBackend.__new__(NumpyBackend)
    rng = np.random.default_rng(1)
    x = rng.normal(size=(7, 12)).astype(np.float32)
    w = rng.normal(size=(12, 4)).astype(np.float32)
    hist0 = rng.normal(size=(3, 12)).astype(np.float32)
    y_all, h_all = be.ssm_conv(x, hist0, w)
    hist, ys = hist0, []
    for t in range(7):
        y, hist = be.ssm_conv(x[t : t + 1], hist, w)
        ys.append(y)
    np.testing.assert_allclose(np.concatenate(ys), y_all, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(hist, h_all)
    np.testing.assert_array_equal(h_all, x[-3:])
    # the first output sees the history's three rows and the first input
    want = be.silu((np.concatenate([hist0, x[:1]]) * w.T).sum(0))
    np.testing.assert_allclose(y_all[0], want, rtol=1e-5, atol=1e-6)


# -- the model -----------------------------------------------------------------------------


@pytest.mark.parametrize("name", HYBRID)
def test_layer_kinds_and_cache_types(name):
    m = load(name)
    cfg = m.cfg
    assert cfg.recurrent_layers == (0, 2) and cfg.attention_layers == (1, 3)
    cache = m.new_cache()
    assert [type(c).__name__ for c in cache] == ["RecurrentCache", "KVCache", "RecurrentCache", "KVCache"]
    assert not cache.can_trim
    assert cfg.ssm_v_tiled == (name == "qwen35moe-f32")
    assert cfg.rope_dim == {"qwen3next-f32": 4, "qwen35moe-f32": 8}[name] < cfg.head_dim  # partial rotary


@pytest.mark.parametrize("backend", ["numpy", "cpu"])
@pytest.mark.parametrize("name", HYBRID)
def test_prompt_in_one_forward_equals_one_token_at_a_time(name, backend):
    """The prompt's chunked delta rule (blocks of 64) and conv over 130 rows == 130 decode steps."""
    m = load(name, backend)
    ids = np.concatenate([ref_tokens(name, 48), ref_tokens(name, 48)[::-1], ref_tokens(name, 34)])  # 130: 3 blocks
    whole = m.net.forward(ids, m.new_cache())
    cache = m.new_cache()
    steps = np.concatenate([m.net.forward(ids[i : i + 1], cache) for i in range(len(ids))])
    np.testing.assert_allclose(whole, steps, rtol=0, atol=1e-4 * np.abs(steps).max())
    assert cosine_rows(whole, steps).min() > 0.999999


@pytest.mark.parametrize("name", HYBRID + ["qwen3next-Q8_0"])
def test_cpu_equals_numpy_greedy(name):
    ids = ref_tokens(name, 8)
    tokens = ref_tokens(name)
    m, ref = load(name, "cpu"), load(name)
    a, b = m.net.forward(tokens, m.new_cache()), ref.net.forward(tokens, ref.new_cache())
    # Q8_0's products take int16-rounded activations on the cpu backend (cpu/int_dots.py's INT_TYPES):
    # this random hybrid model amplifies that rounding to 5.0e-4 of the largest logit (cosine
    # 0.9999997); the float32 files keep the float32 bar.
    tol = 1e-3 if name.endswith("Q8_0") else 2e-5
    np.testing.assert_allclose(a, b, rtol=0, atol=tol * np.abs(b).max())
    assert cosine_rows(a, b).min() > 0.99999
    assert greedy_tokens(m, ids, N_GEN) == greedy_tokens(ref, ids, N_GEN)


def test_recurrent_cache_cannot_trim_but_rolls_back_to_a_checkpoint():
    m = load("qwen3next-f32")
    ids = ref_tokens("qwen3next-f32", 20)
    cache = m.new_cache()
    m.net.forward(ids[:12], cache)
    with pytest.raises(ValueError):
        cache.trim(2)
    point = cache.checkpoint()
    want = m.net.forward(ids[12:], cache)
    m.net.forward(ids[:5], cache)  # moves every layer's state on
    cache.rollback(point)
    assert cache.offset == 12
    got = m.net.forward(ids[12:], cache)
    assert np.array_equal(got, want)  # bit for bit: the same rows from the same state
    cache.clear()
    assert cache.offset == 0 and all(not c.state.any() for c in cache if isinstance(c, RecurrentCache))
    fresh = m.net.forward(ids, m.new_cache())
    assert np.array_equal(m.net.forward(ids, cache), fresh)


@pytest.mark.parametrize("name", HYBRID)
def test_gdn_features_are_load_bearing(name):
    """The value-head order and the partial rotary are checked by the oracle (a wrong choice fails it)."""
    m = onebit.load(fixture_path(f"{name}.gguf"), backend="cpu")
    ref = np.load(fixture_path(f"{name}.ref.npz"))
    for change in (dict(ssm_v_tiled=not m.cfg.ssm_v_tiled), dict(rope_dim=m.cfg.head_dim)):
        cfg = onebit.load(fixture_path(f"{name}.gguf"), backend="cpu").cfg
        m.net.arch.cfg = m.cfg = dataclasses.replace(cfg, **change)
        cos = cosine_rows(m.logits(ref["tokens"].astype(np.int64)), ref["logits_hf"])
        assert (cos >= 0.99999).mean() < 0.5, (name, change, np.median(cos))


# -- lookup decoding over recurrent state ---------------------------------------------------


class VerifyAll(DraftPolicy):
    def choose(self, tokens, drafts, lengths):
        super().choose(tokens, drafts, lengths)
        return len(drafts)


def step_tokens(m, ids, lookup, n=N_GEN):
    cache, stats = m.new_cache(), LookupStats()
    steps = generate_step(m.net, ids, cache, make_sampler(0.0), lookup=lookup, max_tokens=n,
                          max_positions=m.context_length, stats=stats)
    toks = [next(steps) for _ in range(n)]
    steps.close()
    return toks, cache, stats


class OracleDrafter:
    """Drafts from the known plain-greedy continuation: 1-4 right tokens, then a wrong one, so
    that every verify forward accepts some rows and rolls back the rest. (The random hybrid
    models' greedy text never repeats an n-gram, so the n-gram drafter would propose nothing
    that verifies.)"""

    def __init__(self, prompt_len, future):
        self.n0, self.future = prompt_len, future

    def __call__(self, tokens):
        self.tokens = list(tokens)
        return self

    def push(self, tok):
        self.tokens.append(tok)

    def propose_matched(self, n):
        done = len(self.tokens) - self.n0
        right = self.future[done : done + 1 + done % 4]
        wrong = [(self.future[done + len(right)] + 1) % 512] if done + len(right) < len(self.future) else []
        drafts = (right + wrong)[:n]
        return drafts, [3] * len(drafts)


@pytest.mark.parametrize("backend", ["numpy", "cpu"])
@pytest.mark.parametrize("name", HYBRID)
def test_lookup_over_recurrent_state_equals_plain_greedy(name, backend, monkeypatch):
    monkeypatch.setattr(generate_mod, "DraftPolicy", VerifyAll)
    m = load(name, backend)
    ids = ref_tokens(name, 10)
    want = greedy_tokens(m, ids, N_GEN)
    monkeypatch.setattr(generate_mod, "NgramDrafter", OracleDrafter(len(ids), want + greedy_tokens(m, ids, 2 * N_GEN)[N_GEN:]))
    got, cache, st = step_tokens(m, ids, 8)
    assert got == want
    assert st.proposed > st.accepted > 0  # drafts were accepted and rejected (rolled back)
    assert cache.offset == len(ids) + N_GEN - 1  # every yielded token but the last
    # the state left behind is plain decoding's: the next step gives the same logits
    plain = m.new_cache()
    m.net.forward(np.concatenate([ids, want[:-1]]), plain)
    a = m.net.forward(np.array([want[-1]]), cache)
    b = m.net.forward(np.array([want[-1]]), plain)
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-4 * np.abs(b).max())


def test_lookup_stopped_inside_accepted_drafts_rolls_back(monkeypatch):
    """max_tokens landing inside a verify forward's accepted drafts: the rows past the last
    yielded token are rolled back (checkpoint + the kept rows again), as for plain decoding."""
    monkeypatch.setattr(generate_mod, "DraftPolicy", VerifyAll)
    m = load("qwen3next-f32")
    ids = ref_tokens("qwen3next-f32", 10)
    plain = greedy_tokens(m, ids, 2 * N_GEN)
    monkeypatch.setattr(generate_mod, "NgramDrafter", OracleDrafter(len(ids), plain))
    for n in range(2, N_GEN):
        got, cache, st = step_tokens(m, ids, 8, n)
        assert got == plain[:n] and cache.offset == len(ids) + n - 1, n
        want = m.new_cache()
        m.net.forward(np.concatenate([ids, plain[: n - 1]]), want)
        a, b = (m.net.forward(np.array([plain[n - 1]]), c) for c in (cache, want))
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-4 * np.abs(b).max())


# -- chat prefix reuse over recurrent state --------------------------------------------------


@pytest.mark.parametrize("lookup", [0, 4])
def test_chat_prefix_reuse_equals_a_fresh_run(lookup):
    m = load("qwen35moe-f32")
    s = ChatSession(m, temperature=0.0, max_tokens=8, lookup=lookup)
    first = [r.token for r in s.send("hello there") if r.token is not None]
    second = [r.token for r in s.send("and then") if r.token is not None]
    assert s.last.prompt_tokens_computed < s.last.prompt_tokens  # the cache was reused
    from onebit.cache import MAX_CHECKPOINTS

    assert 1 <= len(s.prefix.checkpoints) <= MAX_CHECKPOINTS
    fresh = ChatSession(m, temperature=0.0, max_tokens=8, lookup=lookup)
    fresh.history = [dict(h) for h in s.history[:2]]
    again = [r.token for r in fresh.send("and then") if r.token is not None]
    assert fresh.last.prompt_tokens_computed == fresh.last.prompt_tokens  # nothing reused
    assert again == second and first
    # a prompt that diverges before the last checkpoint falls back to an earlier one (or none)
    s.history = s.history[:2]
    third = [r.token for r in s.send("and then") if r.token is not None]
    assert third == second
    s.reset()
    assert s.prefix.cache.offset == 0 and s.prefix.checkpoints == []


# -- the memory plan ------------------------------------------------------------------------


def test_plan_counts_recurrent_state_per_sequence_and_kv_for_attention_layers():
    from onebit.memory.budget import Budget
    from onebit.memory.plan import make_plan

    m = load("qwen3next-f32")
    cfg = m.cfg
    plans = [make_plan(m.gguf, cfg, Budget(1 << 34, "test", available=1 << 34), ctx=c) for c in (64, 256)]
    for p, c in zip(plans, (64, 256)):
        items = {i.component: i.bytes for i in p.items}
        assert items["KV cache"] == 2 * c * cfg.n_kv_heads * 2 * cfg.head_dim * 4  # layers 1 and 3 only
        per_layer = (3 * cfg.ssm_conv_channels + cfg.ssm_time_step_rank * cfg.ssm_state_size ** 2) * 4
        assert items["recurrent state"] == 2 * per_layer == recurrent_state_bytes(cfg)
        assert items["recurrent checkpoints"] == 5 * recurrent_state_bytes(cfg)  # 4 chat + 1 lookup
    # what the plan counts is what a cache holds
    cache = m.new_cache()
    assert sum(c.nbytes for c in cache if isinstance(c, RecurrentCache)) == recurrent_state_bytes(cfg)
    assert [i.bytes for i in plans[0].items if i.component == "recurrent state"] == \
        [i.bytes for i in plans[1].items if i.component == "recurrent state"]  # not per token


# -- block prediction over DeltaNet layers ------------------------------------------------------


def decode(m, ids, n=12):
    cache = m.new_cache()
    out = [m.net.forward(ids, cache, last_only=True)]
    toks = []
    for _ in range(n):
        toks.append(int(np.argmax(out[-1][-1])))
        out.append(m.net.forward(np.array([toks[-1]]), cache))
    return np.concatenate(out), toks


@pytest.mark.parametrize("backend", ["numpy", "cpu"])
@pytest.mark.parametrize("name", HYBRID)
def test_block_prediction_is_bit_identical_to_off(name, backend):
    ids = ref_tokens(name, 8)
    want = decode(load(name, backend), ids)
    for kw in (dict(mode="block"), dict(mode="block", ahead=2, chain=True), dict(mode="router", ahead=2)):
        m = onebit.load(fixture_path(f"{name}.gguf"), backend=backend, predict=settings_from(**kw))
        got = decode(m, ids)
        st = m.predictor.stats
        assert np.array_equal(got[0], want[0]) and got[1] == want[1], kw
        assert sum(s.predictions for s in st.values()) > 0, kw
        if kw["mode"] == "block":  # the speculative DeltaNet step predicts better than chance
            assert sum(s.hits for s in st.values()) > 0.5 * sum(s.routed for s in st.values())
        m.close()


def test_poisoned_recurrent_scratch_changes_nothing():
    name = "qwen3next-f32"
    ids = ref_tokens(name, 8)
    m = onebit.load(fixture_path(f"{name}.gguf"), predict=settings_from(mode="block", ahead=2), backend="cpu")
    want = decode(m, ids)
    want_hits = [s.hits for s in m.predictor.stats.values()]
    m.set_predict(settings_from(mode="block", ahead=2))
    pred = m.predictor
    assert any(isinstance(s, RecurrentCache) for s in pred.scratch.values())
    orig = pred.at_pause
    written = []

    def poisoned(ctx, layer, ids_, logits, h):
        for s in pred.scratch.values():
            for a in ((s.conv, s.state) if isinstance(s, RecurrentCache) else s):
                a.fill(np.nan)
        orig(ctx, layer, ids_, logits, h)
        written.extend(l for l, s in pred.scratch.items() if isinstance(s, RecurrentCache) and np.isfinite(s.state).all())

    pred.at_pause = poisoned
    got = decode(m, ids)
    assert np.array_equal(got[0], want[0]) and got[1] == want[1]
    assert [s.hits for s in pred.stats.values()] == want_hits
    # the speculative DeltaNet steps wrote their scratch (no NaN left in the layer predicted)
    assert 2 in written


def test_speculative_deltanet_step_equals_the_real_step_and_leaves_the_cache_alone():
    import copy

    from onebit.backends.numpy_backend import EagerStep
    from onebit.models import blocks
    from onebit.moe.predict import Predictor
    from onebit.pause import PauseContext

    m = load("qwen3next-f32")
    cfg = m.cfg
    pred = Predictor(m.gguf, cfg, settings_from(mode="block"))
    cache = m.new_cache()
    m.net.forward(ref_tokens("qwen3next-f32", 8), cache)
    before = copy.deepcopy(cache)
    h = np.random.default_rng(0).normal(size=(1, cfg.dim)).astype(np.float32)
    layer = 2  # a DeltaNet layer
    ctx = PauseContext(cache.offset, 1, lambda l: cache[l].keys, lambda l: cache[l].values, lambda l: cache[l])
    got = pred._block(ctx, layer, h)
    real = copy.deepcopy(cache)
    x = m.be.rms_norm(h, m.be.weight(f"blk.{layer}.attn_norm.weight"), cfg.norm_eps)
    step = EagerStep(m.be, np.array([0]), real)
    want = h + blocks.gated_deltanet(step, cfg, layer, x)
    step.commit()
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    assert np.array_equal(cache[layer].state, before[layer].state)  # the real state was not written
    assert np.array_equal(cache[layer].conv, before[layer].conv)
    assert np.array_equal(pred.scratch[layer].state, real[layer].state)  # the scratch holds the step's


# -- the quantized file: llama.cpp on the same file ---------------------------------------------


def test_quantized_hybrid_matches_llama_cpp_with_its_activation_rounding():
    """Random hybrid models are chaotic under rounding (Q8 rounding of the activations alone
    moves our f32 run by up to 1e-3 in cosine; qwen3moe's by 3e-5), so the Q8_0 file is held
    to llama.cpp on the same file with llama.cpp's Q8_0 activation rounding modelled, and the
    bar must separate it from the f32 weights."""
    from llamacpp_numerics import LlamaCppRoundingBackend

    ref = np.load(fixture_path("qwen3next-Q8_0.ref.npz"))
    tokens = ref["tokens"].astype(np.int64)
    meds = {}
    for name in ("qwen3next-Q8_0", "qwen3next-f32"):
        m = onebit.load(fixture_path(f"{name}.gguf"), backend="numpy")
        m.net.be = LlamaCppRoundingBackend(m.gguf)
        cos = cosine_rows(m.logits(tokens), ref["logits_llama"])
        meds[name] = (float(np.median(cos)), float((cos >= 0.995).mean()))
    assert meds["qwen3next-Q8_0"][0] >= 0.999 and meds["qwen3next-Q8_0"][1] >= 0.9, meds
    assert meds["qwen3next-f32"][0] < 0.999, meds  # the bar tells Q8_0 weights from f32 ones


def test_a_forward_stopped_half_way_leaves_the_recurrent_state_as_it_was():
    """Recurrent state is written when a step completes: an interrupt after layer 0's DeltaNet
    ran (at layer 2's pause point) leaves every layer, and the position, untouched."""
    import copy

    m = load("qwen3next-f32")
    ids = ref_tokens("qwen3next-f32", 12)
    cache = m.new_cache()
    m.net.forward(ids[:6], cache)
    before = copy.deepcopy(cache)

    def stop(layer, ids_, logits):
        if layer == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        m.net.forward(ids[6:], cache, hook=stop)
    assert cache.offset == before.offset
    for a, b in zip(cache, before):
        if isinstance(a, RecurrentCache):
            assert np.array_equal(a.conv, b.conv) and np.array_equal(a.state, b.state)
    assert np.array_equal(m.net.forward(ids[6:], cache), m.net.forward(ids[6:], before))


# -- Vulkan and streaming ---------------------------------------------------------------------


@pytest.mark.parametrize("name", HYBRID + ["qwen3next-Q8_0"])
def test_vulkan_equals_numpy_greedy(name):
    ids = ref_tokens(name, 8)
    m, ref = load(name, "vulkan"), load(name)
    assert m.net.be.name == "vulkan"  # no fall back
    tokens = ref_tokens(name)
    a, b = m.net.forward(tokens, m.new_cache()), ref.net.forward(tokens, ref.new_cache())
    np.testing.assert_allclose(a, b, rtol=0, atol=2e-4 * np.abs(b).max())
    assert greedy_tokens(m, ids, N_GEN) == greedy_tokens(ref, ids, N_GEN)


def test_vulkan_calm_q8_0_meets_llama_cpp_bar():
    """qwen3nextq-Q8_0 (weights N(0, 0.03), see tools/make_fixtures.py) is calm enough for
    llama.cpp's plain bar, which tests/test_oracle.py holds numpy and cpu to; here Vulkan."""
    ref = np.load(fixture_path("qwen3nextq-Q8_0.ref.npz"))
    m = load("qwen3nextq-Q8_0", "vulkan")
    assert m.net.be.name == "vulkan"  # no fall back
    cos = cosine_rows(m.net.forward(ref["tokens"].astype(np.int64), m.new_cache()), ref["logits_llama"])
    assert (cos >= 0.999).mean() >= 0.95, cos


def test_vulkan_device_cache_rolls_back_over_recurrent_state():
    m = load("qwen35moe-f32", "vulkan")
    ids = ref_tokens("qwen35moe-f32", 20)
    cache = m.new_cache()
    assert not cache.can_trim
    m.net.forward(ids[:12], cache)
    point = cache.checkpoint()
    want = m.net.forward(ids[12:], cache)
    m.net.forward(ids[:3], cache)
    cache.rollback(point)
    assert np.array_equal(m.net.forward(ids[12:], cache), want)
    fresh = m.new_cache()  # a new sequence on the reused storage starts from zero state
    assert np.array_equal(m.net.forward(ids, fresh), m.net.forward(ids, load("qwen35moe-f32", "vulkan").new_cache()))


def test_lookup_and_chat_on_vulkan(monkeypatch):
    monkeypatch.setattr(generate_mod, "DraftPolicy", VerifyAll)
    m = load("qwen3next-f32", "vulkan")
    ids = ref_tokens("qwen3next-f32", 10)
    want = greedy_tokens(m, ids, N_GEN)
    assert want == greedy_tokens(load("qwen3next-f32"), ids, N_GEN)
    monkeypatch.setattr(generate_mod, "NgramDrafter", OracleDrafter(len(ids), want + greedy_tokens(m, ids, 2 * N_GEN)[N_GEN:]))
    got, cache, st = step_tokens(m, ids, 8)
    assert got == want and st.proposed > st.accepted > 0 and cache.offset == len(ids) + N_GEN - 1
    monkeypatch.undo()
    replies = []
    for backend in ("vulkan", "numpy"):
        s = ChatSession(load("qwen3next-f32", backend), temperature=0.0, max_tokens=6)
        replies.append([[r.token for r in s.send(msg) if r.token is not None] for msg in ("hi", "go on")])
        assert s.last.prompt_tokens_computed < s.last.prompt_tokens
    assert replies[0] == replies[1]


@pytest.mark.parametrize("backend", ["numpy", "cpu", "vulkan"])
def test_streamed_equals_resident_bit_for_bit(backend):
    name = "qwen3next-f32"
    ids = ref_tokens(name, 12)
    want = decode(load(name, backend), ids)
    m = onebit.load(fixture_path(f"{name}.gguf"), backend=backend, slots=4, budget="1GiB")
    try:
        got = decode(m, ids)
        assert np.array_equal(got[0], want[0]) and got[1] == want[1]
        assert m.pool.stats.demand_misses > 0  # it did stream
    finally:
        m.close()


@pytest.mark.parametrize("mode", ["router", "block"])
def test_vulkan_prediction_is_bit_identical_to_off_and_streams(mode):
    name = "qwen35moe-f32"
    ids = ref_tokens(name, 8)
    want = decode(load(name, "vulkan"), ids)
    m = onebit.load(fixture_path(f"{name}.gguf"), backend="vulkan", slots=6, budget="1GiB",
                    predict=settings_from(mode=mode, ahead=2, chain=True))
    try:
        got = decode(m, ids)
        assert np.array_equal(got[0], want[0]) and got[1] == want[1]
        st = m.predictor.stats
        assert sum(s.predictions for s in st.values()) > 0 and m.pool.stats.prefetches > 0
    finally:
        m.close()
    # what Vulkan's block mode predicts is what numpy's does (the state it reads is the real one;
    # own=0: adding the current layer's top expert first is a host-backend option)
    hits = []
    for backend in ("vulkan", "numpy"):
        p = onebit.load(fixture_path(f"{name}.gguf"), backend=backend,
                        predict=settings_from(mode=mode, ahead=2, own=0))
        decode(p, ids)
        hits.append([(s.hits, s.predicted) for s in p.predictor.stats.values()])
        p.close()
    assert hits[0] == hits[1]


def test_vulkan_interrupt_during_a_forward_lands_after_it():
    """On Vulkan the recurrent state moves in place on the device, so Ctrl-C is held until the
    chunk's forward completes: the interrupt arrives after it, with state and position agreeing."""
    import signal

    m = load("qwen3next-f32", "vulkan")
    ids = ref_tokens("qwen3next-f32", 12)
    cache, plain = m.new_cache(), m.new_cache()
    m.net.forward(ids[:6], cache)
    m.net.forward(ids[:6], plain)
    want = m.net.forward(ids[6:], plain)

    def interrupt(layer, ids_, logits):
        if layer == 1:
            signal.raise_signal(signal.SIGINT)  # (to this thread, at once: os.kill may pick another)

    # Ctrl-C as a terminal gives it: Python's default handler, the signal not blocked here (an
    # earlier test in the same worker may have left either otherwise)
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    blocked = signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])
    try:
        with pytest.raises(KeyboardInterrupt):
            m.net.forward(ids[6:], cache, hook=interrupt)
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the handler is back
    finally:
        signal.signal(signal.SIGINT, before)
        if signal.SIGINT in blocked:
            signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGINT])
    assert cache.offset == plain.offset  # the step completed before the interrupt
    nxt = np.array([int(np.argmax(want[-1]))])
    np.testing.assert_array_equal(m.net.forward(nxt, cache), m.net.forward(nxt, plain))


# -- bad files ---------------------------------------------------------------------------------


@pytest.mark.parametrize("edit,what", [
    (dict(meta={"qwen3next.ssm.inner_size": 65}), "DeltaNet heads do not fit"),
    (dict(meta={"qwen3next.ssm.group_count": 3}), "DeltaNet heads do not fit"),
    (dict(meta={"qwen3next.ssm.conv_kernel": 1}), "ssm.conv_kernel"),
    (dict(drop_meta=("qwen3next.ssm.state_size",)), "ssm.state_size"),
    (dict(drop_tensors=("blk.2.ssm_a",)), "blk.2.ssm_a"),
    (dict(drop_tensors=("blk.0.ssm_conv1d.weight",)), "blk.0.ssm_conv1d.weight"),
])
def test_bad_hybrid_files_are_refused_in_one_line(tmp_path, monkeypatch, capsys, edit, what):
    from conftest import run_cli
    from ggufedit import rewrite

    bad = rewrite(fixture_path("qwen3next-f32.gguf"), tmp_path / "bad.gguf", **edit)
    code, out, err = run_cli(monkeypatch, capsys, "generate", "--model", str(bad), "--prompt", "hi",
                             "--max-tokens", "2", "--backend", "numpy")
    assert code == 2 and what in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1 and err.startswith("onebit: "), err


def test_vulkan_kv_growth_past_the_first_capacity_keeps_recurrent_state():
    """300 positions (the device KV grows from 256): the attention layers' K/V are copied into
    the new buffers, the DeltaNet layers' state (never reallocated) carries on."""
    name = "qwen35moe-f32"
    v, n = load(name, "vulkan"), load(name)
    ids = np.random.default_rng(0).integers(0, 500, size=300)
    cv = v.new_cache()
    got = np.concatenate([v.net.forward(ids[s : s + 100], cv) for s in range(0, 300, 100)])
    want = n.net.forward(ids, n.new_cache())
    assert cv.storage.capacity >= 300
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-4 * np.abs(want).max())


def test_mtp_blocks_counted_in_block_count_are_not_run(tmp_path):
    """llama.cpp's converter appends the MTP blocks to block_count and says how many in
    nextn_predict_layers; the model runs the trunk only (a file claiming one MTP block more
    than it has gives the same logits; without the key the missing block is an error)."""
    from ggufedit import rewrite

    from onebit.errors import ModelFileError

    src = fixture_path("qwen3next-f32.gguf")
    mtp = rewrite(src, tmp_path / "mtp.gguf", meta={"qwen3next.block_count": 5, "qwen3next.nextn_predict_layers": 1})
    ids = ref_tokens("qwen3next-f32", 12)
    m = onebit.load(mtp, backend="numpy")
    assert m.cfg.n_layers == 4 and m.cfg.recurrent_layers == (0, 2)
    assert np.array_equal(m.logits(ids), load("qwen3next-f32").logits(ids))
    with pytest.raises(ModelFileError, match="5 layers|blk.4"):
        onebit.load(rewrite(src, tmp_path / "no_key.gguf", meta={"qwen3next.block_count": 5}), backend="numpy")


def test_chat_interrupted_in_the_prompt_leaves_a_consistent_session():
    """Ctrl-C while a hybrid chat runs its prompt (the part run ahead of the last token): the
    cache, the cached tokens and the history agree, and the next turn equals a fresh session's
    over the same history."""
    m = onebit.load(fixture_path("qwen3next-f32.gguf"), backend="numpy")
    calls = {"n": 0}

    def stop_once(layer, ids, logits):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt

    s = ChatSession(m, temperature=0.0, max_tokens=6)
    m.hook = stop_once
    with pytest.raises(KeyboardInterrupt):
        list(s.send("hello there"))
    m.hook = None
    assert s.prefix.cache.offset == len(s.prefix.tokens) == 0  # the first forward was stopped: nothing went in
    assert s.history[-1] == {"role": "assistant", "content": ""}
    again = [r.token for r in s.send("and then") if r.token is not None]
    fresh = ChatSession(load("qwen3next-f32"), temperature=0.0, max_tokens=6)
    fresh.history = [dict(h) for h in s.history[:2]]
    assert [r.token for r in fresh.send("and then") if r.token is not None] == again


# qwen35moe-f32 has 4 rotary pairs and sections [2, 1, 1, 0]. llama.cpp's interleaved MRoPE turns
# a pair by the position of the section it falls in (text: the token's position in the first
# three, 0 in the fourth); transformers turns every pair by the token's position.
@pytest.mark.parametrize("sections,runs", [
    ([1, 1, 1, 0], True),   # 3 sectors for 4 pairs: pair 3 wraps to sector 0 (t): NeoX, as llama.cpp
    ([3, 3, 2, 0], True),   # more sectors than pairs (a file made for wider heads)
    ([4, 0, 0, 0], False),  # pairs 1 and 2 in no text section: llama.cpp leaves them unrotated
])
def test_mrope_sections_that_leave_a_pair_unrotated_are_refused(tmp_path, sections, runs):
    from ggufedit import rewrite
    from onebit.errors import ModelFileError
    from onebit.models.qwen35moe import imrope_e_pairs

    assert imrope_e_pairs([2, 1, 1, 0], 4) == []  # the fixture's own
    path = rewrite(fixture_path("qwen35moe-f32.gguf"), tmp_path / "s.gguf",
                   meta={"qwen35moe.rope.dimension_sections": sections}) or tmp_path / "s.gguf"
    if not runs:
        with pytest.raises(ModelFileError, match=r"rope.dimension_sections \[4, 0, 0, 0\] give rotary pairs \[1, 2\]"):
            onebit.load(path, backend="numpy")
        return
    ids = ref_tokens("qwen35moe-f32", 12)
    np.testing.assert_array_equal(onebit.load(path, backend="numpy").logits(ids), load("qwen35moe-f32").logits(ids))
