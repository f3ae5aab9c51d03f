"""Routing prediction (onebit/moe/predict.py) changes which experts are read ahead, never the output.

Output with prediction on is bit-identical to off for every mode, depth, margin, lookahead and
layer mask, greedy and seeded sampling, resident and streamed, numpy and Vulkan; a poisoned
scratch changes nothing; the speculative block equals the real block run on a copy of the
cache; Vulkan's predictions equal numpy's (the residual read at the pause is right); the trace
and the table agree; the plan reserves exactly the scratch the predictor holds.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import tracemalloc

import numpy as np
import pytest

import onebit
from conftest import fixture_path
from onebit.backends import BACKENDS
from onebit.backends.numpy_backend import EagerStep
from onebit.backends.vulkan.backend import VulkanBackend
from onebit import generate as generate_mod
from onebit.errors import UsageError
from onebit.generate import generate_step
from onebit.lookup import DraftPolicy, LookupStats
from onebit.memory.budget import Budget
from onebit.memory.plan import make_plan
from onebit.models import blocks
from onebit.cache import scratch_kv_bytes
from onebit.moe.predict import PredictSettings, Predictor, settings_from
from onebit.sample import make_sampler

N_DECODE = 10


def shipped() -> str:
    """The shipped model: 6 MoE layers (lookahead and layer masks have somewhere to go) with
    learned routing; the fixtures have 2 layers."""
    from onebit.cli.main import default_model_path

    return default_model_path()


@pytest.fixture(autouse=True)
def vulkan_registered(monkeypatch):
    monkeypatch.setitem(BACKENDS, "vulkan", VulkanBackend)


_PROMPT = "def loads(s): Deserialize s (a str instance containing a JSON document) to a Python object."


def prompt(n=8):
    m = onebit.load(shipped(), backend="cpu")
    return np.asarray(m.tokenize(_PROMPT * 6)[:n], np.int64)


def decode(m, ids, n=N_DECODE, temp=0.0, seed=0):
    """Every step's logits and the sampled tokens of a decode after a prompt."""
    sampler = make_sampler(temp, top_k=20, seed=seed)
    cache = m.new_cache()
    out = [m.net.forward(ids, cache, last_only=True)]
    toks = []
    for _ in range(n):
        toks.append(sampler(out[-1][-1]))
        out.append(m.net.forward(np.array([toks[-1]]), cache))
    return np.concatenate(out), toks


SETTINGS = [
    dict(mode="router"),
    dict(mode="block"),
    dict(mode="block", ahead=3, depth=6, margin=2.0),
    dict(mode="block", ahead=3, chain=True),
    dict(mode="router", ahead=2, min=3, depth=8),
    dict(mode="block", no_attn=True, ahead=2),
    dict(mode="block", layers="2,4-5", ahead=2),
]


@pytest.mark.parametrize("backend", ["numpy", "cpu", "vulkan"])
def test_prediction_is_bit_identical_to_off(backend):
    ids = prompt()
    ref = onebit.load(shipped(), backend=backend)
    want_g = decode(ref, ids)
    want_s = decode(ref, ids, temp=0.9, seed=3)
    ref.close()
    for kw in SETTINGS:
        m = onebit.load(shipped(), backend=backend, predict=settings_from(**kw))
        got_g = decode(m, ids)
        got_s = decode(m, ids, temp=0.9, seed=3)
        st = m.predictor.stats
        m.close()
        assert np.array_equal(got_g[0], want_g[0]) and got_g[1] == want_g[1], kw
        assert np.array_equal(got_s[0], want_s[0]) and got_s[1] == want_s[1], kw
        assert sum(s.predictions for s in st.values()) > 0, kw  # it did predict


@pytest.mark.parametrize("backend", ["numpy", "cpu", "vulkan"])
def test_prediction_switched_off_and_on_by_its_gate_is_bit_identical_to_off(backend, monkeypatch):
    """The whole-step gate (it runs where experts stream) turning prediction off and on again
    mid-generation, held to a fixed pattern here (on for three forwards, off for two), changes
    nothing; the forwards it has off rank nothing."""
    import onebit.moe.predict as P

    pattern = iter(([True] * 3 + [False] * 2) * 100)
    monkeypatch.setattr(P.Gate, "step", lambda self, rows, pays=None, stall=0.0: next(pattern))
    path = shipped()
    ids = prompt(12)
    want = decode(onebit.load(path, backend=backend), ids)
    m = onebit.load(path, backend=backend, slots=10, budget="1GiB", predict=settings_from(mode="block", ahead=2))
    try:
        ranked = []
        real = m.predictor._router
        m.predictor._router = lambda layer, r: ranked.append(m.predictor.forwards) or real(layer, r)
        got = decode(m, ids)
        assert np.array_equal(got[0], want[0]) and got[1] == want[1]
        on = {f for f in range(1, N_DECODE + 2) if (f - 1) % 5 < 3}  # the forwards (1: the prompt) it ran on
        assert set(ranked) <= on and len(set(ranked)) > len(on) // 2
    finally:
        m.close()


@pytest.mark.parametrize("backend", ["numpy", "cpu", "vulkan"])
@pytest.mark.parametrize("mode", ["router", "block"])
def test_streamed_with_prediction_equals_resident_bit_for_bit(backend, mode):
    path = shipped()
    ids = prompt(12)
    want = decode(onebit.load(path, backend=backend), ids)
    m = onebit.load(path, backend=backend, slots=10, budget="1GiB",
                    predict=settings_from(mode=mode, ahead=2, depth=6))
    try:
        got = decode(m, ids)
        st = m.pool.stats
        assert np.array_equal(got[0], want[0]) and got[1] == want[1]
        assert st.prefetches > 0 and st.demand_misses > 0  # prefetches were issued and it did stream
        assert st.prefetch_hits > 0  # and some were used
        if mode == "block":  # the current layer's top expert added first, read from the pool's slots
            assert m.predictor.own == 1 and m.predictor.be.source is m.pool
    finally:
        m.close()


class VerifyAll(DraftPolicy):
    """Verifies every proposed draft whatever the timings say: rows in every forward it can."""

    def choose(self, tokens, drafts, lengths):
        super().choose(tokens, drafts, lengths)
        return len(drafts)


def lookup_decode(m, ids, n=24, temp=0.0):
    st = LookupStats()
    steps = generate_step(m.net, ids, m.new_cache(), make_sampler(temp, top_k=20, seed=5), lookup=8,
                          max_tokens=n, stats=st)
    toks = [next(steps) for _ in range(n)]
    steps.close()
    return toks, st


@pytest.mark.parametrize("backend", ["numpy", "cpu", "vulkan"])
def test_prediction_with_lookup_rows_is_identical_to_off(backend, monkeypatch):
    """Lookup decoding (on by default) verifies drafts in forwards of several rows, each row
    paused at every MoE layer: prediction over them changes nothing, resident or streamed."""
    monkeypatch.setattr(generate_mod, "DraftPolicy", VerifyAll)
    path = shipped()
    ids = prompt(40)  # the docstring twice and more: drafts from the prompt's own repeats
    ref = onebit.load(path, backend=backend)
    want_g, st = lookup_decode(ref, ids)
    want_s, st_s = lookup_decode(ref, ids, temp=0.9)
    ref.close()
    st.add(st_s)
    assert st.proposed > st.accepted > 0  # rows were verified, some rejected
    for kw in (dict(), dict(slots=10, budget="1GiB")):
        m = onebit.load(path, backend=backend, predict=settings_from(mode="block", ahead=2, depth=6), **kw)
        try:
            assert lookup_decode(m, ids)[0] == want_g, kw
            assert lookup_decode(m, ids, temp=0.9)[0] == want_s, kw
            assert sum(s.predictions for s in m.predictor.stats.values()) > 0, kw
        finally:
            m.close()


class Capture(Predictor):
    """Records what each pause point saw (the residual h and the routing)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.seen = []

    def at_pause(self, ctx, layer, ids, logits, h):
        self.seen.append((layer, ctx.start, ids.copy(), h.copy()))
        super().at_pause(ctx, layer, ids, logits, h)


def test_poisoned_scratch_changes_nothing():
    """The predictor's scratch (a speculative block's K/V) is written before it is read: with it
    poisoned (NaN) before every pause the decode is the same, and at every pause the next
    layer's speculative block gives the same bits over a NaN-filled and a zeroed scratch.
    (Compared at each pause rather than as a second run's hit counts: a full-suite run under
    xdist once gave a second run other counts at one layer, with or without poison; see the
    message of commit d279c5f, 2026-12-04.)"""
    path = shipped()
    ids = prompt()
    m = onebit.load(path, predict=settings_from(mode="block", ahead=2), backend="cpu")
    want = decode(m, ids)
    m.set_predict(settings_from(mode="block", ahead=2))
    pred = m.predictor
    orig = pred.at_pause
    blocks = []

    def poisoned(ctx, layer, ids_, logits, h):
        nxt = pred.moe_layers[pred.moe_layers.index(layer) + 1 :][:1]
        for target in nxt:
            outs = []
            for fill in (np.nan, 0.0):
                for k, v in pred.scratch.values():
                    k.fill(fill)
                    v.fill(fill)
                outs.append(pred._block(ctx, target, h))
            blocks.append(np.array_equal(outs[0], outs[1]) and np.isfinite(outs[0]).all())
        for k, v in pred.scratch.values():
            k.fill(np.nan)
            v.fill(np.nan)
        orig(ctx, layer, ids_, logits, h)

    pred.at_pause = poisoned
    got = decode(m, ids)
    assert np.array_equal(got[0], want[0]) and got[1] == want[1]
    assert len(blocks) > N_DECODE and all(blocks)
    assert sum(s.hits for s in pred.stats.values()) > 0  # (predictions were made, over the poison)


def test_a_prompts_speculative_block_reads_no_einsum_over_an_empty_axis(monkeypatch):
    """A prompt's first chunk has no earlier positions: the speculative attention must not take
    an einsum over that empty axis, whose output was seen holding another array's old bytes (NaN
    among them) now and then inside long pytest processes: the three tests above failed one run
    in twenty to forty that way (blocks all NaN at the prompt's pauses, h finite). Such an
    einsum is made to return NaN here, so the old code fails every time."""
    real = np.einsum

    def stale(spec, *ops, **kw):
        out = real(spec, *ops, **kw)
        inputs = spec.split("->")[0].split(",")
        sizes = {c: n for term, op in zip(inputs, ops) for c, n in zip(term, op.shape)}
        if any(n == 0 for c, n in sizes.items() if c not in spec.split("->")[1]) and out.size:
            out = np.full_like(out, np.nan)  # what an unwritten buffer may hold
        return out

    monkeypatch.setattr(np, "einsum", stale)
    m = onebit.load(shipped(), backend="numpy")
    pred = Predictor(m.gguf, m.cfg, settings_from(mode="block"))
    from onebit.pause import PauseContext

    cache = m.new_cache()
    ctx = PauseContext(0, 5, lambda l: cache[l].keys, lambda l: cache[l].values)
    h = np.random.default_rng(1).normal(size=(5, m.cfg.dim)).astype(np.float32)
    assert np.isfinite(pred._block(ctx, 2, h)).all()


def test_speculative_block_equals_the_real_block_on_a_cache_copy():
    """The block mode's attention over scratch == blocks.attention run for real (writing the
    K/V into a copy of the cache): the scratch path computes the same thing."""
    m = onebit.load(shipped(), backend="numpy")
    cfg = m.cfg
    pred = Predictor(m.gguf, cfg, settings_from(mode="block"))
    cache = m.new_cache()
    m.net.forward(prompt(), cache)
    h = np.random.default_rng(0).normal(size=(1, cfg.dim)).astype(np.float32)
    from onebit.pause import PauseContext

    layer = 2
    ctx = PauseContext(cache.offset, 1, lambda l: cache[l].keys, lambda l: cache[l].values)
    got = pred._block(ctx, layer, h)
    real = copy.deepcopy(cache)
    step = EagerStep(m.be, np.array([0]), real)
    x = m.be.rms_norm(h, m.be.weight(f"blk.{layer}.attn_norm.weight"), cfg.norm_eps)
    want = h + blocks.attention(step, cfg, layer, x)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    # and the real cache was not written
    assert not np.array_equal(real[layer].keys[cache.offset], cache[layer].keys[cache.offset])


def test_vulkan_predicts_what_numpy_predicts():
    path = shipped()
    ids = prompt()
    traces = []
    for backend in ("numpy", "vulkan"):
        m = onebit.load(path, backend=backend)
        cap = Capture(m.gguf, m.cfg, settings_from(mode="block", ahead=2))
        m.net.predictor = cap
        toks = decode(m, ids)[1]
        traces.append((toks, cap))
    (t0, a), (t1, b) = traces
    assert t0 == t1
    assert [(l, s, i.tolist()) for l, s, i, _ in a.seen] == [(l, s, i.tolist()) for l, s, i, _ in b.seen]
    for (_, _, _, ha), (_, _, _, hb) in zip(a.seen, b.seen):
        np.testing.assert_allclose(hb, ha, rtol=0, atol=1e-4 * max(1.0, np.abs(ha).max()))
    assert [s.hits for s in a.stats.values()] == [s.hits for s in b.stats.values()]


def test_trace_and_table_agree(tmp_path):
    out = tmp_path / "pred.jsonl"
    m = onebit.load(shipped(), predict=settings_from(mode="router", ahead=2, out=str(out)), backend="cpu")
    decode(m, prompt())
    m.close()
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert lines[0]["onebit_predict_trace"] == 1
    by_layer = {}
    for r in lines[1:]:
        hit = len(set(r["predicted"]) & set(r["actual"]))
        a = by_layer.setdefault(r["layer"], [0, 0, 0])
        a[0] += hit
        a[1] += len(r["actual"])
        a[2] += 1
    assert by_layer
    for layer, (hit, routed, rows) in by_layer.items():
        st = m.predictor.stats[layer]
        assert (st.hits, st.routed, st.predictions) == (hit, routed, rows)
        assert f"{layer:5d}  {hit / routed:6.3f}" in m.predictor.table()


def test_plan_reserves_the_predictor_scratch():
    m = onebit.load(shipped(), backend="numpy")
    cfg = m.cfg
    layers = "1,3-4"
    pred = Predictor(m.gguf, cfg, settings_from(mode="block", layers=layers))
    p = make_plan(m.gguf, cfg, Budget(1 << 30, "test", available=1 << 30), ctx=64, layers=layers)
    item = next(i for i in p.items if i.component == "predicted-layer scratch")
    kv = scratch_kv_bytes(cfg) * 3
    assert pred.scratch_bytes == kv  # the state the predictor holds == the planned K/V part
    activations = item.bytes - kv
    # one predicted block's transient memory stays within the planned activation scratch
    cache = m.new_cache()
    m.net.forward(prompt(60), cache)
    from onebit.pause import PauseContext

    ctx = PauseContext(cache.offset, 1, lambda l: cache[l].keys, lambda l: cache[l].values)
    h = np.ones((1, cfg.dim), np.float32)
    pred._router(3, pred._block(ctx, 3, h))  # warm (lazy imports)
    tracemalloc.start()
    pred._router(3, pred._block(ctx, 3, h))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.reset_peak()
    biggest = max((t for t in m.gguf.tensors.values() if t.name.startswith("blk.3.") and "exps" not in t.name),
                  key=lambda t: t.n_elements)
    pred.be.linear(h, biggest.name)  # one matrix dequantized for a product: the compute scratch counts it
    dequant = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert 0 < peak - dequant <= activations // 3


def test_settings_from_flags():
    """Values as the CLI's flags and $ONEBIT_MOE_PREDICT* give them (strings), or typed."""
    flags = dict(mode="block", depth="6", margin="1.5", min="2", layers="1,2,5-9", ahead="2", no_attn="1", stats="1")
    s = settings_from(**flags)
    assert s == PredictSettings(mode="block", depth=6, margin=1.5, min=2, layers="1,2,5-9", ahead=2, no_attn=True,
                                stats=True)
    assert settings_from(chain="1").chain and settings_from(chain=True, depth=6).depth == 6
    assert settings_from(mode=None, depth="", ahead=None) == PredictSettings()  # None or "": the default
    assert settings_from().mode == "auto"  # (router or block where experts stream, off where all are resident)
    for bad in (dict(mode="sometimes"), dict(depth="0"), dict(margin="-1"), dict(ahead="x"), dict(no_attn="maybe"),
                dict(min="5", depth="3")):
        with pytest.raises(UsageError):
            settings_from(**bad)
    with pytest.raises(TypeError, match="deepth"):
        settings_from(deepth=6)  # a misspelt setting is not silently dropped
    m = onebit.load(shipped(), backend="cpu")
    with pytest.raises(UsageError):
        m.set_predict(settings_from(mode="router", layers="0-99"))


@pytest.mark.kernels_of(shipped())  # (for the `onebit generate` it starts)
def test_cli_bad_values_exit_2_and_stats_print(tmp_path):
    base = [sys.executable, "-m", "onebit.cli.main", "generate", "-m", str(shipped()),
            "-p", "hi", "-n", "4", "--raw"]
    r = subprocess.run(base + ["--moe-predict", "bogus"], capture_output=True, text=True)
    assert r.returncode == 2 and "moe-predict" in r.stderr
    r = subprocess.run(base, capture_output=True, text=True, env={"ONEBIT_MOE_PREDICT_AHEAD": "0", "PATH": ""})
    assert r.returncode == 2 and "ahead" in r.stderr
    r = subprocess.run(base + ["--moe-predict", "block", "--moe-predict-stats", "1", "--slots", "10", "--budget", "1GiB"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "recall" in r.stderr and "prediction: block" in r.stderr
    r = subprocess.run(base + ["--moe-predict", "router", "--stats", "--slots", "10", "--budget", "1GiB"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "prefetch hits" in r.stderr and "per token" in r.stderr and "GB/s" in r.stderr and "recall" in r.stderr


def test_prefetch_never_evicts_what_the_current_layer_needs():
    from test_pool import make_pool

    g, pool = make_pool(3)
    try:
        pool.acquire(0, [1, 2])
        pool.release(0, [1, 2])  # resident, unpinned: LRU victims
        n = pool.prefetch(1, [4, 5, 6], keep=[(0, 1), (0, 2)])
        assert n == 1  # one free slot; the two the current layer routes to are kept
        pool.drain()
        assert (0, 1) in pool.where and (0, 2) in pool.where and (1, 4) in pool.where
    finally:
        pool.close()


@pytest.mark.parametrize("faster", [True, False])
def test_gate_runs_whichever_state_makes_decode_faster(monkeypatch, faster):
    """With prediction on costing 1 s a step and off 2 s (or the reverse), the gate spends most
    windows in the faster state and still tries the other now and then (a mode asked for by
    name: it starts on and does not look at the stall)."""
    import time as time_mod

    from onebit.moe.predict import Gate

    g = Gate(look=False)
    clock = [0.0]
    monkeypatch.setattr(time_mod, "perf_counter", lambda: clock[0])
    states = []
    for _ in range(400):
        on = g.step(1)
        states.append(on)
        clock[0] += 1.0 if on == faster else 2.0
    share = sum(s == faster for s in states[40:]) / len(states[40:])
    assert 0.7 < share < 1.0  # mostly the faster state, exploring the other
    assert g.mean[faster] < g.mean[not faster]


@pytest.mark.parametrize("stall_share, on", [(0.6, True), (0.1, False)])
def test_gate_looks_at_the_stall_before_predicting(monkeypatch, stall_share, on):
    """The gate starts off; its first two decode steps measure the share of a step spent
    waiting on expert reads: at 60% of a step it turns prediction on, at a tenth it stays off
    (and only tries on after its first windows). A prompt's chunk predicts meanwhile."""
    import time as time_mod

    from onebit.moe.predict import Gate

    g = Gate()
    clock = [0.0]
    monkeypatch.setattr(time_mod, "perf_counter", lambda: clock[0])
    assert g.step(12) is True  # a prompt's chunk
    clock[0] += 3.0
    states, stall = [], 0.0
    for _ in range(3 + Gate.WINDOW):
        states.append(g.step(1, stall=stall))
        clock[0] += 1.0
        stall += stall_share
    assert states[:2] == [False, False]  # looking
    assert all(s is on for s in states[2:])
    assert g.looked == Gate.LOOK


@pytest.mark.parametrize("stall_share, tried", [(0.2, False), (0.7, True)])
def test_a_gate_that_looked_tries_prediction_only_where_steps_stall(monkeypatch, stall_share, tried):
    """After looking (a tenth of each step stalled: off), the default gate stays off while its
    windows stall under STALL_ON: no trial of prediction, however many windows pass; where the
    stall grows past it (a pool that got too small for the text), the trial comes as before."""
    import time as time_mod

    from onebit.moe.predict import Gate

    g = Gate()
    clock = [0.0]
    monkeypatch.setattr(time_mod, "perf_counter", lambda: clock[0])
    states, stall = [], 0.0
    for i in range(2 + 40 * Gate.WINDOW):
        states.append(g.step(1, stall=stall))
        clock[0] += 1.0
        stall += 0.1 if i < 2 else stall_share
    assert states[:3] == [False, False, False]
    assert any(states) is tried


def gate_states(gate, cost, windows):
    """Feed `windows` windows to a SpeedGate, each state's figure from cost(window, on); the
    state each window ran in."""
    states = []
    for w in range(windows):
        states.append(gate.on)
        gate.window(cost(w, gate.on))
    return states


def test_gate_backs_off_exploring_a_state_that_keeps_losing():
    """Prediction costing 2 s a window and off 1 s: off is tried after FIRST windows, and the
    trials of on come EXPLORE, 2 EXPLORE, 4 EXPLORE ... windows apart, never more than CAP."""
    from onebit.gate import SpeedGate

    g = SpeedGate(6, 0.7, first=2, cap=32)
    states = gate_states(g, lambda w, on: 2.0 if on else 1.0, 300)
    ons = [w for w, on in enumerate(states) if on]
    assert ons[:2] == [0, 1] and not states[2]  # two windows on, then the trial of off, which wins
    gaps = [b - a for a, b in zip(ons[2:], ons[3:])]
    assert gaps[:3] == [12, 24, 32] and set(gaps[3:]) == {32}
    assert ons[2] == 2 + 6  # the first trial of on: EXPLORE windows after the switch


def test_gate_backoff_starts_over_when_the_other_state_wins():
    """After a long run of losing trials the gap is CAP; once the off state gets slower than on
    (the means cross), the gate runs on, and the gap starts over: off is tried again EXPLORE
    windows later, then 2 EXPLORE windows after that."""
    from onebit.gate import SpeedGate

    g = SpeedGate(6, 0.7, first=2, cap=32)
    states = gate_states(g, lambda w, on: (2.0 if on else 1.0) if w < 150 else (2.0 if on else 3.0), 300)
    later = states[150:]
    first_on = later.index(True)
    assert first_on <= 32  # found within one capped gap
    offs = [w for w, on in enumerate(later) if not on and w > first_on]
    assert offs[:2] == [first_on + 6, first_on + 6 + 12]
    assert sum(later[first_on:]) / len(later[first_on:]) > 0.8


def test_gate_held_skips_its_trials_as_lost_ones():
    """A caller that measures the current state winning by far holds the gate: a trial due is
    skipped as if it had run and lost (the next comes after a doubled gap), and without the
    hold the gate explores as before."""
    from onebit.gate import SpeedGate

    held = SpeedGate(6, 0.7, first=2, cap=32)
    states = []
    for w in range(100):
        states.append(held.on)
        held.window(1.0, hold=True)
    assert all(states)
    assert held.state["gap"] == 32 and held.state["trial"] is None
    free = SpeedGate(6, 0.7, first=2, cap=32)
    assert gate_states(free, lambda w, on: 1.0, 3) == [True, True, False]  # the trial at window 2


def test_gate_step_holds_while_prediction_pays(monkeypatch):
    """Gate.step asks `pays` with the window's median step once a window is full, only while
    prediction is on; held, the first trial (after FIRST windows) does not happen. (The steps
    wait on reads 60% of their time, so the gate turns on once it has looked.)"""
    import time as time_mod

    from onebit.moe.predict import Gate

    clock = [0.0]
    monkeypatch.setattr(time_mod, "perf_counter", lambda: clock[0])
    asked = []
    for answer in (True, False):
        g = Gate()
        states, stall = [], 0.0
        for _ in range(Gate.LOOK + 1 + Gate.WINDOW * (Gate.FIRST + 2)):
            states.append(g.step(1, lambda m: asked.append(m) or answer, stall=stall))
            clock[0] += 2.0
            stall += 1.2
        states = states[Gate.LOOK:]
        assert all(states) == answer  # held: on throughout; not held: the trial of off came
    assert asked and set(asked) == {2.0}


def test_predictor_pays_when_the_ledger_prices_prediction_above_half_a_step(monkeypatch):
    import onebit.moe.predict as P

    m = onebit.load(shipped(), backend="numpy", slots=10, budget="1GiB", predict=settings_from(mode="block"))
    try:
        p = m.predictor
        layers = list(p.ledger.level)
        monkeypatch.setattr(p.ledger, "value", lambda layer, level: 0.1)  # seconds a step, each layer
        assert p._pays(0.19 * len(layers)) and not p._pays(0.21 * len(layers))
        p.ledger = None  # (no pool, no ledger: never held)
        assert not p._pays(1e-9)
    finally:
        m.close()


def test_gate_without_backoff_explores_every_explore_windows():
    """No `first` or `cap` (lookup's gate): the other state is tried once every EXPLORE windows."""
    from onebit.gate import SpeedGate

    g = SpeedGate(8, 0.7)
    states = gate_states(g, lambda w, on: 1.0 if on else 2.0, 200)
    offs = [w for w, on in enumerate(states) if not on]
    assert offs[0] == 8 and {b - a for a, b in zip(offs, offs[1:])} == {8}


def test_prompt_rows_do_not_feed_the_gate(monkeypatch):
    import time as time_mod

    from onebit.moe.predict import Gate

    g = Gate()
    clock = [0.0]
    monkeypatch.setattr(time_mod, "perf_counter", lambda: clock[0])
    for _ in range(50):
        assert g.step(32)  # (a prompt's chunk predicts)
        clock[0] += 5.0
    assert g.windows == 0 and g.looked == 0


# -- the ledger: which level of prediction each layer runs at, from injected timings ---------

def ledger_run(ledger, steps, cost, pool):
    """Feed `steps` decode steps: cost(level) -> host seconds, pool(level) -> the pool's
    per-layer delta [prefetch hits, misses, wasted, stall, stall of missing acquires]. Returns
    the levels the layer ran at, step by step."""
    levels = []
    for _ in range(steps):
        lv = ledger.level[1]
        levels.append(lv)
        ledger.step({1: lv} if lv else {}, {1: cost(lv)} if lv else {}, {1: pool(lv)})
    return levels


def priced(hits_by_level, demand=2, t_miss=1e-3):
    """Pool deltas where a level's prefetches turn `hits_by_level[level]` of `demand` demand
    reads into hits, the rest missing at t_miss seconds each."""
    def pool(lv):
        hits = hits_by_level[lv]
        miss = demand - hits
        return [hits, miss, 0, miss * t_miss, miss * t_miss]
    return pool


def test_ledger_turns_off_a_layer_whose_prediction_costs_more_than_it_saves():
    from onebit.moe.predict import BLOCK, NONE, ROUTER, Ledger

    led = Ledger([1], BLOCK)
    # each level saves one 1 ms read a step but costs 3 ms (block) or 2 ms (router)
    levels = ledger_run(led, 12, lambda lv: {BLOCK: 3e-3, ROUTER: 2e-3}[lv], priced({NONE: 0, ROUTER: 1, BLOCK: 1}))
    w = Ledger.WARM
    # block costs more than the most it could save (2 reads, 2 ms): judged after one step
    assert levels[:1] == [BLOCK] and levels[1 : 1 + w] == [ROUTER] * w  # block lost: router is tried
    assert levels[1 + w :] == [NONE] * (12 - 1 - w)  # router lost too: off, within 1 + WARM steps
    assert led.value(1, ROUTER) < 0 and led.value(1, BLOCK) < 0


def test_ledger_keeps_a_layer_whose_prediction_pays_and_picks_the_best_level():
    from onebit.moe.predict import BLOCK, NONE, ROUTER, Ledger

    led = Ledger([1], BLOCK)  # block pays: 0.2 ms for two 1 ms reads saved of three
    assert set(ledger_run(led, 40, lambda lv: 2e-4, priced({NONE: 0, ROUTER: 1, BLOCK: 2}, demand=3))) == {BLOCK}
    led = Ledger([1], BLOCK)  # block's mixer costs 3 ms, the router 0.1 ms: router, one read saved
    levels = ledger_run(led, 40, lambda lv: {BLOCK: 3e-3, ROUTER: 1e-4}[lv], priced({NONE: 0, ROUTER: 1, BLOCK: 2}))
    w = Ledger.WARM
    assert levels[w : w + Ledger.PROBE] == [ROUTER] * Ledger.PROBE
    # the start (WARM steps: no miss had been timed yet, so no bound), and one retry after
    # PROBE steps, judged in one step (3 ms is more than the 2 ms it could save)
    assert levels.count(BLOCK) == w + 1
    assert led.probe[1] == 2 * Ledger.PROBE  # so the next retry waits twice as long


def test_ledger_prices_a_stopped_level_at_the_current_demand():
    """A layer stopped while its misses were cheap (a read took 0.1 ms) starts again, without
    waiting for a retry, once its misses cost more (the drive got busy: 1 ms a read)."""
    from onebit.moe.predict import NONE, ROUTER, Ledger

    led = Ledger([1], ROUTER)
    fast, slow = 1e-4, 1e-3
    # the router costs 0.5 ms and prefetches the one read a step the layer needs
    levels = ledger_run(led, 6, lambda lv: 5e-4, lambda lv: [1, 0, 0, 0.0, 0.0] if lv else [0, 1, 0, fast, fast])
    assert levels[-1] == NONE  # 0.1 ms saved for 0.5 ms: stopped
    levels = ledger_run(led, 6, lambda lv: 5e-4, lambda lv: [2, 0, 0, 0.0, 0.0] if lv else [0, 2, 0, 2 * slow, 2 * slow])
    assert levels[-1] == ROUTER and led.since[1] < Ledger.PROBE  # back on before a retry was due
    assert led.value(1, ROUTER) > 0


def test_ledger_does_not_charge_host_time_when_a_device_computes_meanwhile():
    from onebit.moe.predict import BLOCK, Ledger

    led = Ledger([1], BLOCK, overlapped=True)
    levels = ledger_run(led, 10, lambda lv: 1.0, priced({0: 0, 1: 1, 2: 1}))
    assert set(levels) == {BLOCK}


def test_ledger_cost_is_robust_to_one_preempted_step():
    from onebit.moe.predict import NONE, ROUTER, Ledger

    led = Ledger([1], ROUTER)
    costs = iter([1e-4, 5e-2] + [1e-4] * 20)  # the second step lost the core for 50 ms
    levels = ledger_run(led, 20, lambda lv: next(costs), priced({NONE: 0, ROUTER: 1}))
    assert set(levels) == {ROUTER}


class _FakePool:
    """What the predictor reads of a pool: prefetch, and the per-layer counters the ledger uses."""

    def __init__(self, layers):
        from onebit.memory.pool import PoolStats

        self.by_layer = {l: [0, 0, 0, 0.0, 0.0] for l in layers}
        self.stats = PoolStats()
        self.reads, self.read_seconds, self.read_cpu_seconds = 0, 0.0, 0.0
        self.prefetched = []

    def prefetch(self, layer, experts, keep=()):
        self.prefetched.append((layer, list(experts)))
        return len(experts)


def fake_pool_predictor(monkeypatch):
    """A router-mode predictor on the shipped model over a fake pool, with a fake clock and
    the whole-step gate held on (it is tested on its own): (predictor, pool, clock)."""
    import onebit.moe.predict as P

    m = onebit.load(shipped(), backend="numpy")
    pool = _FakePool(range(m.cfg.n_layers))
    pred = Predictor(m.gguf, m.cfg, settings_from(mode="router"), pool, m.be)
    pred.gate.step = lambda rows, pays=None, stall=0.0: True
    clock = [0.0]
    monkeypatch.setattr(P.time, "perf_counter", lambda: clock[0])
    return pred, pool, clock


def pause_steps(pred, steps, seen, in_pool):
    """Run `steps` one-row decode steps through the predictor's pause points (every MoE layer,
    one residual and routing), `in_pool()` after each; what `seen` held at each step's end."""
    import onebit.moe.predict as P

    h = np.ones((1, pred.cfg.dim), np.float32)
    ids = np.array([[0, 1]])
    ctx = P.PauseContext(0, 1, None, None)
    per_step = []
    for _ in range(steps):
        pred.begin(1)
        seen.clear()
        for layer in pred.moe_layers:
            pred.at_pause(ctx, layer, ids, None, h)
        per_step.append(list(seen))
        in_pool()
    return per_step


def test_predictor_stops_predicting_a_layer_the_ledger_turned_off(monkeypatch):
    """End to end through the predictor, with a fake clock and pool: layer 2's ranking costs
    5 ms and saves nothing; layer 1's costs 0.1 ms and turns its misses into hits. Within a
    few steps layer 2 is no longer ranked at all (no router call, no prefetch), layer 1 is."""
    import onebit.moe.predict as P

    pred, pool, clock = fake_pool_predictor(monkeypatch)
    real_router = pred._router
    ranked = []

    def router(layer, r):
        ranked.append(layer)
        clock[0] += 5e-3 if layer == 2 else 1e-4
        return real_router(layer, r)

    def in_pool():  # this step in the pool: layer 1 prefetched both of its demand reads, layer 2 missed both
        pool.by_layer[1][0] += 2
        pool.by_layer[2][1] += 2
        pool.by_layer[2][3] += 2e-3
        pool.by_layer[2][4] += 2e-3

    pred._router = router
    per_step = [sorted(set(r)) for r in pause_steps(pred, 10, ranked, in_pool)]
    assert per_step[0] == [1, 2, 3, 4, 5]
    assert all(2 not in s and 1 in s for s in per_step[P.Ledger.WARM + 1 :])
    assert pred.ledger.level[2] == P.NONE and pred.ledger.level[1] == P.ROUTER
    assert pred.stats[2].paused and not pred.stats[1].paused


def test_predictor_does_nothing_at_pause_points_once_every_layer_is_at_none(monkeypatch):
    """Every layer's ranking costs 5 ms and saves nothing: once the ledger has stopped them
    all, a pause point neither ranks nor scores (the predictor costs what off costs)."""
    import onebit.moe.predict as P

    pred, pool, clock = fake_pool_predictor(monkeypatch)
    real_router, real_score = pred._router, pred._score
    calls = []

    def router(layer, r):
        calls.append(("rank", layer))
        clock[0] += 5e-3
        return real_router(layer, r)

    def score(layer, ids):
        calls.append(("score", layer))
        return real_score(layer, ids)

    def in_pool():  # each layer misses both of its reads
        for layer in pred.moe_layers:
            pool.by_layer[layer][1] += 2
            pool.by_layer[layer][3] += 1e-4
            pool.by_layer[layer][4] += 1e-4

    pred._router, pred._score = router, score
    per_step = pause_steps(pred, 8, calls, in_pool)
    assert per_step[0] and pred.ledger.level == {l: P.NONE for l in pred.ledger.level}
    assert pred._idle and per_step[-1] == []


def test_steps_the_gate_runs_off_reach_no_ledger(monkeypatch):
    """While the whole-step gate has prediction off, a decode step neither reads the pool's
    counters nor moves the ledger: a layer at none does not reach its retry of router
    during the off steps, only PROBE steps after prediction is back on; and the first step
    back on is not measured (its start was not marked)."""
    import onebit.moe.predict as P

    pred, pool, clock = fake_pool_predictor(monkeypatch)
    real_router = pred._router
    ranked = []

    def router(layer, r):
        ranked.append(layer)
        clock[0] += 5e-3
        return real_router(layer, r)

    def in_pool():  # every layer misses both of its reads, each step
        for layer in pred.moe_layers:
            pool.by_layer[layer][1] += 2
            pool.by_layer[layer][3] += 1e-4
            pool.by_layer[layer][4] += 1e-4

    pred._router = router
    pause_steps(pred, 8, ranked, in_pool)
    led = pred.ledger
    assert set(led.level.values()) == {P.NONE}
    calls = []
    real_step = led.step
    led.step = lambda *a, **k: calls.append(a) or real_step(*a, **k)
    read = []
    by_layer = pool.by_layer
    pool.by_layer = type("Watched", (dict,), {"items": lambda d: read.append(1) or dict.items(d)})(by_layer)
    pred.gate.step = lambda rows, pays=None, stall=0.0: False
    pause_steps(pred, 3 * P.Ledger.PROBE, ranked, in_pool)
    # one ledger step and one read of the counters: for the step that ended as the gate
    # switched (it ran with prediction on); none for the steps that ran off
    assert len(calls) == 1 and read == [1]
    since, demand = dict(led.since), dict(led.demand)
    calls.clear()
    pause_steps(pred, 2, ranked, in_pool)
    assert led.since == since and led.demand == demand and set(led.level.values()) == {P.NONE}
    pred.gate.step = lambda rows, pays=None, stall=0.0: True
    pause_steps(pred, 1, ranked, in_pool)
    assert calls == []  # the first step back on: marked, not measured
    layer = min(led.level)
    levels = []
    for _ in range(P.Ledger.PROBE - min(since.values())):
        pause_steps(pred, 1, ranked, in_pool)
        levels.append(led.level[layer])
    assert calls and levels[-1] == P.ROUTER and P.ROUTER not in levels[:-1]  # the retry, on time


def test_read_cost_is_the_slope_of_compute_on_prefetch_reads():
    """Steps whose compute is 2 ms + 0.15 ms per prefetch read in flight (and noise that does
    not depend on the reads): the estimate finds the 0.15 ms, not the readers' CPU floor
    (0.1 ms); a slope past CAP times the floor is capped."""
    from onebit.moe.predict import ReadCost

    rc = ReadCost()
    rc.floor = 1e-4
    rng = np.random.default_rng(0)
    for i in range(ReadCost.MIN - 1):
        rc.add(i % 5, 2e-3 + 1.5e-4 * (i % 5))
    assert rc.value == rc.floor  # too few steps yet
    for i in range(60):
        reads = int(rng.integers(0, 8))
        rc.add(reads, 2e-3 + 1.5e-4 * reads + rng.normal(0, 2e-4))
    assert 1.25e-4 < rc.value < 1.75e-4
    steep = ReadCost()
    steep.floor = 1e-4
    for i in range(40):
        steep.add(i % 6, 2e-3 + 1e-3 * (i % 6))  # 10 times the readers' CPU: capped
    assert steep.value == ReadCost.CAP * steep.floor
    flat = ReadCost()
    flat.floor = 5e-5
    for i in range(40):
        flat.add(3, 2e-3 + rng.normal(0, 2e-4))  # the read count never varied: no slope to fit
    assert flat.value == flat.floor
    free = ReadCost()
    free.floor = 5e-5
    for i in range(40):
        free.add(i % 6, 2e-3 - 1e-4 * (i % 6))  # (a negative slope: never below the floor)
    assert free.value == free.floor


def test_ledger_charges_the_compute_its_prefetch_reads_take():
    from onebit.moe.predict import NONE, ROUTER, Ledger

    def run(read_cost):
        led = Ledger([1], ROUTER)
        led.read_cost = read_cost
        for _ in range(6):
            lv = led.level[1]
            # 0.1 ms to rank; it queues 4 reads a step, one of which is the layer's 1 ms miss
            led.step({1: lv} if lv else {}, {1: 1e-4}, {1: [1, 0, 0, 0.0, 0.0] if lv else [0, 1, 0, 1e-3, 1e-3]},
                     {1: 4} if lv else {})
        return led.level[1]

    assert run(1e-4) == ROUTER  # 1 ms saved for 0.1 + 0.4 ms
    assert run(5e-4) == NONE  # 1 ms saved for 0.1 + 2 ms


def test_block_mode_with_all_of_the_layers_own_experts_predicts_the_next_layer_exactly():
    """Block mode's residual lacks only layer l's own expert output: with all k of them added
    back (own = k) the prediction is the next layer's real input, so its top-k is the routing
    the real forward then takes, for every layer and row; without them (own = 0) it is not.
    Checks the added output (the FFN norm, the routing weights, the order) against the forward."""
    m = onebit.load(shipped(), backend="numpy")
    ids = prompt()
    recall = {}
    for own in (0, m.cfg.n_experts_used):
        m.set_predict(settings_from(mode="block", own=own))
        decode(m, ids)
        st = m.predictor.stats
        recall[own] = [st[l].top_hits / st[l].routed for l in st if st[l].predictions]
    assert recall[m.cfg.n_experts_used] == [1.0] * 5
    assert min(recall[0]) < 0.9
    assert settings_from(own="0").own == 0 and settings_from().own == 1
    with pytest.raises(UsageError):
        settings_from(own="-1")


def test_the_steps_after_a_prompt_do_not_feed_the_ledger(monkeypatch):
    """The first SETTLE decode steps after a multi-row forward are not measured (they evict
    what the prompt's rows prefetched); the ones after are."""
    import onebit.moe.predict as P

    m = onebit.load(shipped(), backend="numpy")
    pool = _FakePool(range(m.cfg.n_layers))
    pred = Predictor(m.gguf, m.cfg, settings_from(mode="router"), pool, m.be)
    steps = []
    monkeypatch.setattr(pred.ledger, "step", lambda *a, **k: steps.append(pred.forwards))
    pred.gate.step = lambda rows, pays=None, stall=0.0: True  # (the gate held on: it is tested on its own)
    pred.begin(12)  # a prompt
    for _ in range(P.SETTLE + 3):
        pred.begin(1)
    assert steps == [P.SETTLE + 3, P.SETTLE + 4]  # (forward n's begin measures step n - 1)


def test_ledger_restarts_a_layer_stopped_while_it_had_nothing_to_save():
    """A layer whose prediction ran while every expert it routed to was resident (no demand,
    so no cover measured) is stopped; when its misses come, its recall stands in for cover and
    it starts again without waiting for a retry."""
    from onebit.moe.predict import NONE, ROUTER, Ledger

    led = Ledger([1], ROUTER)
    t = 1e-3
    led.step({}, {}, {1: [0, 1, 0, t, t]})  # (a miss timed elsewhere: t_miss known)
    led.recall[1] = 0.8
    levels = ledger_run(led, 10, lambda lv: 1e-4, lambda lv: [0, 0, 0, 0.0, 0.0])
    assert levels[-1] == NONE  # nothing to save: stopped
    levels = ledger_run(led, 4, lambda lv: 1e-4, lambda lv: [1, 0, 0, 0.0, 0.0] if lv else [0, 1, 0, t, t])
    assert ROUTER in levels and led.since[1] < Ledger.PROBE
