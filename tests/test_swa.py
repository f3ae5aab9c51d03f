"""Sliding-window layers' KV caches bounded by the window (onebit/cache.py RingKVCache, on
Vulkan DeviceRingKVCache): the ring gives the outputs of a cache of every position, bit for
bit on each backend (the same positions are summed in the same order), under prefill chunks
longer than the ring, lookup decoding's rollback and chat prefix reuse; the memory plan
counts what the rings allocate.

The gemma3 fixture has window 4 on 5 of its 6 layers. Rings here are sized for forwards of
MIN_SWA_ROWS = 9 rows (12 positions), so sequences of 60-100 tokens wrap them many times; the
default (256 rows) would not wrap on a fixture this small.
"""

from __future__ import annotations

import inspect
import json

import numpy as np
import pytest

import onebit
from conftest import cosine_rows, fixture_path, run_cli
from onebit.cache import (MIN_SWA_ROWS, SWA_ROWS, KVCache, RingKVCache, kv_cache_bytes, make_cache,
                          ring_capacity)
from onebit.apps.chat import ChatSession
from onebit.generate import generate_step
from onebit.lookup import MAX_DRAFTS, LookupStats
from onebit.sample import make_sampler

GEMMA = "gemma3-f32"
ROWS = MIN_SWA_ROWS  # the smallest ring: window + 8 positions
BACKENDS = ["numpy", "cpu", "vulkan"]

_models: dict = {}


def load(backend: str):
    if backend not in _models:
        m = onebit.load(fixture_path(f"{GEMMA}.gguf"), backend=backend)
        if backend == "vulkan" and m.be.name != "vulkan":
            pytest.fail(f"the Vulkan backend did not open ({m.be.name} instead)")
        _models[backend] = m
    return _models[backend]


def tokens(n: int) -> np.ndarray:
    """n token ids: the fixture's reference prompt, then seeded random ids."""
    ref = np.load(fixture_path(f"{GEMMA}.ref.npz"))["tokens"].astype(np.int64)
    m = load("numpy")
    extra = np.random.default_rng(5).integers(3, m.cfg.vocab_size, max(n - len(ref), 0))
    return np.concatenate([ref, extra])[:n]


def chunked(m, ids, cache, chunk: int) -> np.ndarray:
    return np.concatenate([m.net.forward(ids[s : s + chunk], cache) for s in range(0, len(ids), chunk)])


# -- the slack, from facts -----------------------------------------------------------------


def test_ring_size_facts():
    from onebit.memory.plan import PREFILL_ROWS
    from onebit.backends.vulkan.kv import MAX_ROWS

    assert MIN_SWA_ROWS == 1 + MAX_DRAFTS  # a verify forward's rows: rejected drafts always trim
    prefill = inspect.signature(generate_step).parameters["prefill_chunk"].default
    assert SWA_ROWS == prefill == MAX_ROWS == PREFILL_ROWS
    assert ring_capacity(512) == 512 + 255 and ring_capacity(4, 1) == 4 + MIN_SWA_ROWS - 1


# -- the ring on its own -------------------------------------------------------------------


def _read(keys: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """Positions lo..hi-1 of keys that hold position p in row p % len (the attention op's contract)."""
    return keys[np.arange(lo, hi) % len(keys)]


@pytest.mark.parametrize("window", [1, 4, 7])
def test_ring_holds_what_rows_read(window):
    """Written in pieces of 1..30 rows (longer than the ring too), the ring returns every position
    each piece's rows read, as a cache of every position does; trimming within the last piece
    works; further back it says it cannot, and trimming to 0 always can."""
    rng = np.random.default_rng(window)
    ring, full = RingKVCache(2, 3, 5, window, rows=ROWS), KVCache(2, 3, 5)
    C = ring.capacity
    start = 0
    for R in [1, 5, 9, 30, 2, 13, 1, 1, 40, 3]:
        k = rng.standard_normal((R, 2, 3)).astype(np.float32)
        v = rng.standard_normal((R, 2, 5)).astype(np.float32)
        rk, rv = ring.write(start, k, v)
        fk, fv = full.write(start, k, v)
        lo = max(0, start - window + 1)
        np.testing.assert_array_equal(_read(rk, lo, start + R), fk[lo:])
        np.testing.assert_array_equal(_read(rv, lo, start + R), fv[lo:])
        assert ring.keys.shape[0] <= C
        start += R
        if R <= ring.rows:  # a rejected verify: back to any length within this forward
            assert all(ring.can_trim_to(L) for L in range(start - R, start + 1))
    assert ring.keys.shape[0] == C and ring.nbytes == C * 2 * (3 + 5) * 4
    assert ring.held_from == start - C
    far = ring.held_from + window - 2  # what the row at `far` reads begins below what is held
    assert window == 1 or not ring.can_trim_to(far)
    if window > 1:
        with pytest.raises(ValueError, match="no longer holds"):
            ring.trim(far)
    ring.trim(0)
    assert ring.held_from == 0 and ring.can_trim_to(0)


def test_ring_snapshot_restore():
    rng = np.random.default_rng(1)
    ring = RingKVCache(1, 2, 2, 4, rows=ROWS)
    for p in range(30):
        ring.write(p, *rng.standard_normal((2, 1, 1, 2)).astype(np.float32))
    state = ring.snapshot(30)
    want = _read(ring.keys, 27, 30).copy()
    for p in range(30, 50):
        ring.write(p, *rng.standard_normal((2, 1, 1, 2)).astype(np.float32))
    assert not ring.can_trim_to(30)
    ring.restore(state)
    assert ring.can_trim_to(30) and ring.held_from == 30 - ring.capacity
    np.testing.assert_array_equal(_read(ring.keys, 27, 30), want)
    assert state[0].shape[0] == ring.capacity  # a snapshot is at most the ring


# -- bounded == unbounded, on every backend ------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_ring_equals_full_cache_bit_for_bit(backend):
    """100 positions (25 windows, the 12-position ring wrapped 8 times), fed in chunks of 1, of 5,
    of 9 (the ring's rows), of 40 (longer than the ring) and in one forward: the logits of every
    position equal those of a cache of every position, bit for bit."""
    m = load(backend)
    ids = tokens(100)
    for chunk in (1, 5, 9, 40, 100):
        ring = m.net.make_cache(swa_rows=ROWS)
        full = m.net.make_cache(swa_rows=0)
        assert [i for i, c in enumerate(ring) if isinstance(c, RingKVCache)] == list(m.cfg.swa_layers)
        got, want = chunked(m, ids, ring, chunk), chunked(m, ids, full, chunk)
        np.testing.assert_array_equal(got, want, err_msg=f"{backend}, chunks of {chunk}")
        C = ring_capacity(m.cfg.sliding_window, ROWS)
        assert all(c.keys.shape[0] == C for i, c in enumerate(ring) if i in m.cfg.swa_layers)
        assert ring.nbytes < full.nbytes


@pytest.mark.parametrize("backend", BACKENDS)
def test_gptoss_ring_equals_full_cache(backend):
    """gpt-oss (sinks, window 4 on every other layer) through a 12-position ring: 60 positions in
    chunks of 1, 9 and 40 give the logits of a cache of every position, bit for bit."""
    m = onebit.load(fixture_path("gptoss-f32.gguf"), backend=backend)
    try:
        assert m.cfg.swa_layers and m.cfg.sliding_window == 4
        ids = np.random.default_rng(7).integers(3, m.cfg.vocab_size, 60)
        for chunk in (1, 9, 40):
            ring = m.net.make_cache(swa_rows=ROWS)
            assert [i for i, c in enumerate(ring) if isinstance(c, RingKVCache)] == list(m.cfg.swa_layers)
            got, want = chunked(m, ids, ring, chunk), chunked(m, ids, m.net.make_cache(swa_rows=0), chunk)
            np.testing.assert_array_equal(got, want, err_msg=f"{backend}, chunks of {chunk}")
    finally:
        m.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_larger_window_ring_equals_full_cache(backend, tmp_path):
    """The fixture with window 20 (tests/ggufedit.py): a 28-position ring (20 + 8), 120 positions
    in chunks of 1, of 7 and of 33 (longer than the window and than the ring)."""
    from ggufedit import rewrite

    path = rewrite(fixture_path(f"{GEMMA}.gguf"), tmp_path / "w20.gguf", meta={"gemma3.attention.sliding_window": 20})
    m = onebit.load(path, backend=backend)
    try:
        assert m.cfg.sliding_window == 20
        ids = tokens(120)
        for chunk in (1, 7, 33):
            ring = m.net.make_cache(swa_rows=ROWS)
            got, want = chunked(m, ids, ring, chunk), chunked(m, ids, m.net.make_cache(swa_rows=0), chunk)
            np.testing.assert_array_equal(got, want, err_msg=f"{backend}, chunks of {chunk}")
            assert ring[0].capacity == 28 and ring[0].keys.shape[0] == 28 and ring[0].held_from == 120 - 28
    finally:
        m.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_ring_oracle(backend):
    """The fixture's reference prompt (48 positions) through a wrapping ring, in chunks of 5,
    against HF transformers and llama.cpp at the bars of tests/test_oracle.py."""
    m = load(backend)
    ref = np.load(fixture_path(f"{GEMMA}.ref.npz"))
    logits = chunked(m, ref["tokens"].astype(np.int64), m.net.make_cache(swa_rows=ROWS), 5)
    hf, ll = ref["logits_hf"], ref["logits_llama"]
    ok = (cosine_rows(logits, hf) >= 0.99999) & (np.abs(logits - hf).max(axis=1) <= 1e-2)
    assert ok.mean() >= 0.97, np.nonzero(~ok)[0]
    assert (cosine_rows(logits, ll) >= 0.999).mean() >= 0.95


@pytest.mark.parametrize("backend", BACKENDS)
def test_cache_snapshot_restore_with_rings(backend):
    """A sequence's snapshot (rings and full layers), taken at 40 positions and restored after
    30 more wrapped the rings, continues exactly as the sequence that never went on; the ring
    could not have trimmed back that far."""
    m = load(backend)
    ids = tokens(80)
    cache = m.net.make_cache(swa_rows=ROWS)
    m.net.forward(ids[:40], cache)
    state = cache.snapshot()
    m.net.forward(ids[40:70], cache)
    assert not cache.can_trim_to(40)
    with pytest.raises(ValueError, match="cannot trim"):
        cache.trim(30)
    cache.restore(state)
    assert cache.offset == 40
    got = chunked(m, ids[40:], cache, 3)
    want = m.net.forward(ids, m.net.make_cache(swa_rows=0))[40:]
    np.testing.assert_array_equal(got, chunked(m, ids[40:], _at(m, ids[:40]), 3))
    np.testing.assert_allclose(got, want, atol=1e-4)  # (other row counts per forward: not bitwise)


def _at(m, ids):
    c = m.net.make_cache(swa_rows=ROWS)
    m.net.forward(ids, c)
    return c


def _greedy(m, ids, cache, n, lookup=0):
    stats = LookupStats()
    steps = generate_step(m.net, ids, cache, make_sampler(0.0), lookup=lookup, max_tokens=n,
                          max_positions=m.context_length, stats=stats)
    out = [next(steps) for _ in range(n)]
    steps.close()
    return out, stats


@pytest.mark.parametrize("backend", BACKENDS)
def test_greedy_and_lookup_with_a_ring(backend):
    """Greedy decoding through a ring == through a cache of every position; lookup decoding
    (drafts verified in rows, rejected rows trimmed off the ring) == plain greedy."""
    m = load(backend)
    ids = tokens(48)  # (drafts proposed here are rejected about half the time)
    want, _ = _greedy(m, ids, m.net.make_cache(swa_rows=0), 60)
    plain, _ = _greedy(m, ids, m.net.make_cache(swa_rows=ROWS), 60)
    assert plain == want
    ring = m.net.make_cache(swa_rows=ROWS)
    got, st = _greedy(m, ids, ring, 60, lookup=MAX_DRAFTS)
    assert got == want
    assert st.proposed > st.accepted  # rows were rolled back
    assert ring.offset == len(ids) + 59 and ring[0].held_from > 0  # the ring wrapped


def _conversation(m, lookup, edit):
    """Replies (token ids) and prompt tokens run per turn, over turns that reuse the cache's
    prefix and, after `edit`, one whose common prefix is shorter than what was run since."""
    s = ChatSession(m, max_tokens=16, temperature=0.0, lookup=lookup)
    out = []
    for i, msg in enumerate(("hi", "what next", "go on", "and then", "more")):
        if i == 3 and edit:  # regenerate: drop the last exchange, ask again
            del s.history[-2:]
        out.append(([r.token for r in s.send(msg) if r.token is not None], s.last.prompt_tokens_computed,
                     s.last.prompt_tokens))
    return out


@pytest.mark.parametrize("backend", BACKENDS)
def test_chat_prefix_reuse_with_a_ring(backend, monkeypatch):
    """A chat through rings gives the replies of one through caches of every position; a turn
    whose common prefix the ring still covers runs only the new tokens; one whose prefix's end
    the ring no longer holds runs the whole conversation again."""
    m = load(backend)
    results = {}
    for rows in (0, ROWS):
        monkeypatch.setattr(m, "new_cache", lambda rows=rows: m.net.make_cache(swa_rows=rows))
        results[rows] = [_conversation(m, lookup, edit=True) for lookup in (0, 4)]
    replies = lambda conv: [t[0] for t in conv]
    assert [replies(c) for c in results[ROWS]] == [replies(results[0][0])] * 2
    assert replies(results[0][1]) == replies(results[0][0])
    for conv in results[ROWS]:
        assert conv[1][1] < conv[1][2]  # turn 2 reused the prefix
        assert conv[3][1] == conv[3][2]  # turn 4 (after the edit) ran everything again
    for conv in results[0]:
        assert conv[3][1] < conv[3][2]  # a cache of every position reuses it


# -- the memory plan counts what the caches allocate -------------------------------------------


@pytest.mark.parametrize("ctx", [3, 12, 100, 512])
@pytest.mark.parametrize("rows", [0, ROWS, SWA_ROWS])
def test_kv_bytes_equal_the_host_caches(ctx, rows):
    cfg = load("numpy").cfg
    cache = make_cache(cfg, ctx, rows)
    assert cache.nbytes == kv_cache_bytes(cfg, ctx, swa_rows=rows)
    per_pos = cfg.n_kv_heads * (cfg.head_dim + cfg.head_dim_v) * 4
    n_swa = len(cfg.swa_layers)
    ring = min(ctx, ring_capacity(cfg.sliding_window, rows)) if rows else ctx
    assert kv_cache_bytes(cfg, ctx, swa_rows=rows) == ((cfg.n_layers - n_swa) * ctx + n_swa * ring) * per_pos


@pytest.mark.parametrize("ctx", [3, 100, 512])
def test_kv_bytes_equal_the_device_caches(ctx):
    """What a new device KV storage allocates (the runner makes one per cache unless an idle one
    of at least that capacity is there to reuse)."""
    from onebit.backends.vulkan.kv import DeviceKV

    m = load("vulkan")
    for rows in (0, ROWS, SWA_ROWS):
        kv = DeviceKV(m.be.dev, m.cfg, ctx, rows)
        try:
            assert kv.nbytes == kv_cache_bytes(m.cfg, ctx, swa_rows=rows)
            assert sum(kb.size + vb.size for kb, vb in kv.buffers) == kv.nbytes  # the buffers themselves
        finally:
            kv.destroy()


def test_plan_counts_the_rings(monkeypatch, capsys):
    """`onebit plan` counts the sliding-window layers as their rings and says so; a model loaded
    under a budget allocates what the plan counted, on the host and on the device."""
    path = fixture_path(f"{GEMMA}.gguf")
    cfg = load("numpy").cfg
    code, out, err = run_cli(monkeypatch, capsys, "plan", str(path), "--ctx", "512", "--budget", "1GiB")
    assert code == 0, err
    line = next(l for l in out.splitlines() if l.startswith("KV cache"))
    ring = ring_capacity(cfg.sliding_window)
    assert f"512 tokens x 1 layers, {ring} x 5 sliding-window layers (window 4 + 255)" in line
    code, out, err = run_cli(monkeypatch, capsys, "plan", str(path), "--ctx", "512", "--budget", "1GiB", "--json")
    assert code == 0, err
    items = {i["component"]: i["bytes"] for i in json.loads(out)["items"]}
    assert items["KV cache"] == kv_cache_bytes(cfg, 512)
    for backend in ("numpy", "vulkan"):
        m = onebit.load(path, backend=backend, budget="1GiB", n_ctx=512)
        try:
            items = {i.component: i.bytes for i in m.plan.items}
            assert items["KV cache"] == kv_cache_bytes(cfg, 512) < kv_cache_bytes(cfg, 512, swa_rows=0)
            c = m.new_cache()
            got = c.storage.nbytes if backend == "vulkan" else c.nbytes
            assert got == items["KV cache"], backend
            del c
        finally:
            m.close()


# -- the kernels read the ring --------------------------------------------------------------


def test_cpu_kernel_reads_the_ring():
    """The cpu backend's decode kernel over a ring (position p in row p % S) == over the same
    positions in order, bit for bit, and == numpy within the kernel tolerance."""
    from onebit.backends.numpy_backend import NumpyBackend

    be = load("cpu").be
    rng = np.random.default_rng(3)
    S, window, H, Hkv, D = 12, 4, 4, 2, 16
    for R, top in ((1, 57), (3, 40), (4, 12)):
        pos = np.arange(top - R, top)
        q = rng.standard_normal((R, H, D)).astype(np.float32)
        full_k = rng.standard_normal((top, Hkv, D)).astype(np.float32)
        full_v = rng.standard_normal((top, Hkv, D)).astype(np.float32)
        ring_k, ring_v = np.zeros((S, Hkv, D), np.float32), np.zeros((S, Hkv, D), np.float32)
        held = np.arange(max(0, top - S), top)
        ring_k[held % S], ring_v[held % S] = full_k[held], full_v[held]
        for scale, sinks in ((None, None), (0.3, rng.standard_normal(H).astype(np.float32))):  # gpt-oss: sinks
            got = be.attention(q, ring_k, ring_v, pos, window, scale, sinks)
            np.testing.assert_array_equal(got, be.attention(q, full_k, full_v, pos, window, scale, sinks))
            np.testing.assert_allclose(got, NumpyBackend.attention(be, q, full_k, full_v, pos, window, scale, sinks),
                                       atol=1e-5)
            np.testing.assert_array_equal(NumpyBackend.attention(be, q, ring_k, ring_v, pos, window, scale, sinks),
                                          NumpyBackend.attention(be, q, full_k, full_v, pos, window, scale, sinks))


def test_block_prediction_reads_the_ring():
    """The block predictor's speculative attention (moe/predict.py) over a layer's ring == over
    a cache of every position: it reads the ring's positions, not its first rows."""
    from onebit.backends.numpy_backend import NumpyBackend
    from onebit.moe.predict import _ScratchStep
    from onebit.pause import PauseContext

    m = load("numpy")
    be = NumpyBackend(m.gguf)
    rng = np.random.default_rng(4)
    cfg = m.cfg
    start, R, window = 50, 2, cfg.sliding_window
    ring, full = RingKVCache(cfg.n_kv_heads, cfg.head_dim, cfg.head_dim_v, window, rows=ROWS), \
        KVCache(cfg.n_kv_heads, cfg.head_dim, cfg.head_dim_v)
    for p in range(start):
        k = rng.standard_normal((1, cfg.n_kv_heads, cfg.head_dim)).astype(np.float32)
        v = rng.standard_normal((1, cfg.n_kv_heads, cfg.head_dim_v)).astype(np.float32)
        ring.write(p, k, v)
        full.write(p, k, v)
    q = rng.standard_normal((R, cfg.n_heads, cfg.head_dim)).astype(np.float32)
    k = rng.standard_normal((R, cfg.n_kv_heads, cfg.head_dim)).astype(np.float32)
    v = rng.standard_normal((R, cfg.n_kv_heads, cfg.head_dim_v)).astype(np.float32)
    outs = []
    for c in (ring, full):
        ctx = PauseContext(start, R, lambda l, c=c: c.keys, lambda l, c=c: c.values)
        step = _ScratchStep(be, ctx, 0, np.zeros_like(k), np.zeros_like(v))
        outs.append(step.attention(0, q, k, v, window))
    np.testing.assert_array_equal(outs[0], outs[1])
    want = be.attention(q, *full.write(start, k, v), np.arange(start, start + R), window)
    np.testing.assert_allclose(outs[0], want, atol=1e-6)
