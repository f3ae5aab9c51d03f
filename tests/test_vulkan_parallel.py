"""Vulkan's forward over several sequences' rows (VulkanBackend.forward_batch, serve's --parallel)
== the numpy reference's forward_batch on the same rows: prompt chunks and decode rows of
sequences at different positions in one forward, each over its own device cache (f32, a rotated
q8_0 / q4_0 cache, sliding-window rings that wrap, a hybrid model's recurrent state), streamed
experts (with pauses, and steps by the pool's slot table), views that cannot be bound (copied
rows), more rows than one recorded forward holds, a cache that grows under a recording, and
logits that are not finite in one sequence. Logits within LOGIT_TOL of the largest reference
logit, as tests/test_vulkan_graph.py holds one sequence's forward (Mesa's lavapipe here)."""

from __future__ import annotations

import numpy as np
import pytest

import onebit
from conftest import fixture_path
from onebit.backends import BACKENDS
from onebit.backends.vulkan import recorder as recorder_mod
from onebit.backends.vulkan.backend import VulkanBackend
from onebit.backends.vulkan.runner import MAX_ROWS, rounds
from onebit.cache import MIN_SWA_ROWS

LOGIT_TOL = 1e-4

# (fixture, load options): MoE, dense, hybrid (Gated DeltaNet), sliding-window rings and sinks,
# a quantized cache whose heads are rotated (64 wide), experts streamed through 3 slots
CASES = [("qwen3moe-f32", {}), ("llama-f32", {}), ("qwen3next-f32", {}), ("gemma3-f32", {}), ("gptoss-f32", {}),
         ("q3moe256-Q8_0", {"cache_type_k": "q8_0", "cache_type_v": "q4_0"}),
         ("qwen3moe-f32", {"slots": 3, "budget": "1GiB"})]


@pytest.fixture(autouse=True)
def vulkan_registered(monkeypatch):
    monkeypatch.setitem(BACKENDS, "vulkan", VulkanBackend)


def load(name: str, backend: str, **options) -> onebit.Model:
    m = onebit.load(fixture_path(f"{name}.gguf"), backend=backend, **options)
    assert m.be.name == backend  # (not a fallback)
    return m


def steps(vocab: int) -> list[list]:
    """Three sequences' rows, step by step (None: not in that step): prompts of 7, 3 and 20
    tokens, joining at different steps beside the others' decode and verify rows."""
    rng = np.random.default_rng(3)
    a, b, c = (rng.integers(3, vocab, n).astype(np.int64) for n in (7, 3, 20))
    return [[a, b, None], [a[:1], b[:1], c], [a[:1], b[:2], c[:1]], [a[:3], None, c[:1]]]


def run(m, rows: list[list], last_only=None, swa_rows=None) -> list[np.ndarray]:
    """Every step's logits per sequence in it, through forward_batch."""
    caches = [m.net.make_cache() if swa_rows is None else m.net.make_cache(swa_rows=swa_rows) for _ in rows[0]]
    out = []
    for step in rows:
        seqs = [(ids, caches[i]) for i, ids in enumerate(step) if ids is not None]
        lo = [i % 2 == 1 for i in range(len(seqs))] if last_only is None else last_only
        out += m.net.forward_batch(seqs, last_only=lo)
    return out


def assert_close(got: list[np.ndarray], want: list[np.ndarray]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.shape == w.shape
        np.testing.assert_allclose(g, w, rtol=0, atol=LOGIT_TOL * np.abs(w).max())
        assert (g.argmax(-1) == w.argmax(-1)).all()


@pytest.mark.parametrize("name,options", CASES, ids=[f"{n}-{'-'.join(o) or 'resident'}" for n, o in CASES])
def test_sequences_together_match_numpy(name, options):
    host = {k: v for k, v in options.items() if k.startswith("cache_type")}
    want = run(load(name, "numpy", **host), steps(load(name, "numpy").cfg.vocab_size))
    with load(name, "vulkan", **options) as m:
        assert (m.pool is not None) == ("slots" in options)
        assert_close(run(m, steps(m.cfg.vocab_size)), want)


def test_decode_steps_replay_one_recording():
    """Three sequences decoding one row each, step after step, on their caches: the first such
    step is recorded, the others replay it, whatever order the sequences are handed in."""
    ref, m = load("qwen3moe-f32", "numpy"), load("qwen3moe-f32", "vulkan")
    rng = np.random.default_rng(4)
    prompts = [rng.integers(3, m.cfg.vocab_size, n).astype(np.int64) for n in (4, 9, 2)]
    got, want = [], []
    for model, out in ((m, got), (ref, want)):
        caches = [model.new_cache() for _ in prompts]
        out += model.net.forward_batch(list(zip(prompts, caches)), last_only=[True] * 3)
        for i in range(5):
            if i == 1 and model is m:
                made = m.be.recordings
            seqs = [(np.array([7 + i + j]), c) for j, c in enumerate(caches)]
            out += model.net.forward_batch(seqs[::-1] if i % 2 else seqs)
    assert m.be.recordings == made
    assert_close(got, want)
    m.close()


def test_rings_that_wrap_within_a_step():
    """gemma3's sliding-window rings sized for the fewest rows: a 20-token prompt beside decode
    rows runs as several forwards (each sequence's rows within what its rings hold)."""
    ref, m = load("gemma3-f32", "numpy"), load("gemma3-f32", "vulkan")
    rows = steps(m.cfg.vocab_size)
    want = run(ref, rows, swa_rows=MIN_SWA_ROWS)
    made = m.be.recordings
    assert_close(run(m, rows, swa_rows=MIN_SWA_ROWS), want)
    assert m.be.recordings > made
    m.close()


def test_batched_steps_by_the_slot_table(monkeypatch):
    """Two sequences decoding together with experts streamed through 14 slots: once a step's
    experts were all hits, the next runs as one submission whose routers write the slot table
    (Recording.by_table), refused and run again with pauses where an expert is not pooled.
    Against every streamed layer pausing: the same logits bit for bit and the same pool counts."""
    from onebit.memory import pool as P

    monkeypatch.setattr(P, "PROMPT_SHARE", 2.0)  # (as test_vulkan_streaming: no acquire is a scan)
    runs = {}
    for table in (True, False):
        with load("qwen3moe-f32", "vulkan", slots=14, budget="1GiB", predict="off") as m:
            m.be.runner.pool_table_steps = table
            ca, cb = m.new_cache(), m.new_cache()
            out = m.net.forward_batch([(np.arange(3, 11), ca), (np.arange(20, 25), cb)], last_only=[True, True])
            got = list(out)
            for _ in range(16):
                out = m.net.forward_batch([(np.array([int(lg[-1].argmax())]), c) for lg, c in zip(out, (ca, cb))])
                got += out
            st, r = m.pool.stats, m.be.runner
            runs[table] = (np.concatenate(got), (st.hits, st.demand_misses, st.bytes_read),
                           (r.table_steps, r.table_steps_refused))
    (got, counts, (tried, refused)), (want, want_counts, none) = runs[True], runs[False]
    assert np.array_equal(got, want) and counts == want_counts and none == (0, 0)
    assert tried > refused > 0 and counts[1] > 0  # steps by the table ran, some refused; the pool missed


def test_rows_copied_where_a_view_cannot_be_bound(monkeypatch):
    """A device whose binding offsets a sequence's rows do not meet (lavapipe aligns them all
    at 16 bytes): the rows are copied out and the results copied back, the same logits."""
    whole = recorder_mod.Recorder._rows_of
    monkeypatch.setattr(recorder_mod.Recorder, "_rows_of",
                        lambda self, x, sq: whole(self, x, sq) if sq.r0 == 0 and sq.n == x.rows else None)
    for name in ("qwen3moe-f32", "qwen3next-f32"):
        want = run(load(name, "numpy"), steps(load(name, "numpy").cfg.vocab_size))
        with load(name, "vulkan") as m:
            assert_close(run(m, steps(m.cfg.vocab_size)), want)


def test_more_rows_than_one_forward():
    """Two prompts of 200 rows and a decode row: more than MAX_ROWS, so several forwards, each
    sequence's rows in the chunks its own forward takes; every row's logits as numpy's."""
    rng = np.random.default_rng(5)
    ref, m = load("qwen3moe-f32", "numpy"), load("qwen3moe-f32", "vulkan")
    a, b, c = (rng.integers(3, m.cfg.vocab_size, n).astype(np.int64) for n in (200, 200, 5))
    rows = [[None, None, c], [a, b, c[:1]], [a[:2], b[:1], c[:1]]]
    want = run(ref, rows, last_only=[False] * 3)
    assert_close(run(m, rows, last_only=[False] * 3), want)
    m.close()


def test_a_cache_that_grows_drops_the_recordings_over_it():
    """A sequence's cache (256 positions) grows under the batch: the recordings bound to its old
    buffers go (closed, out of every storage's list) and the next steps record anew, as numpy's."""
    rng = np.random.default_rng(9)
    ref, m = load("qwen3moe-f32", "numpy"), load("qwen3moe-f32", "vulkan")
    a, b = rng.integers(3, m.cfg.vocab_size, 262).astype(np.int64), rng.integers(3, m.cfg.vocab_size, 9)
    want, got = [], []
    for model, out in ((ref, want), (m, got)):
        ca, cb = model.new_cache(), model.new_cache()
        model.net.forward(a[:250], ca)
        for s in range(250, 262, 4):  # 254, 258 (the storage doubles), 262 positions
            if model is m and s == 254:
                assert ca.storage.capacity == 256
                old = [r for r in ca.storage.recordings.values() if r.kv is None]
                assert len(old) == 1 and old[0] in cb.storage.recordings.values()
            out += model.net.forward_batch([(a[s : s + 4], ca), (b[s - 250 : s - 249], cb)])
    assert ca.storage.capacity == 512 and old[0].closed and old[0] not in cb.storage.recordings.values()
    assert not any(r.closed for r in ca.storage.recordings.values())
    assert_close(got, want)
    m.close()


def test_two_sequences_cannot_share_a_cache():
    m = load("qwen3moe-f32", "vulkan")
    c = m.new_cache()
    with pytest.raises(ValueError, match="share a KV cache"):
        m.net.forward_batch([(np.array([5]), c), (np.array([6]), c)])
    m.close()


def test_rounds():
    """Worked by hand. Each sequence's rows in row_chunks' sizes (300 -> 256, 32, 12; 20 -> 16,
    4; 60 -> 32, 16, 12); a forward takes every sequence's next chunk that fits in MAX_ROWS."""
    assert MAX_ROWS == 256
    assert rounds([300, 1, 20], [256] * 3, [1, 1, 1], 256) == [
        [(0, 0, 256)], [(0, 256, 32), (1, 0, 1), (2, 0, 16)], [(0, 288, 12), (2, 16, 4)]]
    assert rounds([200, 1, 60], [256] * 3, [1, 1, 1], 256) == [
        [(0, 0, 128), (1, 0, 1), (2, 0, 32)], [(0, 128, 64), (2, 32, 16)], [(0, 192, 8), (2, 48, 12)]]
    # a ring's limit (16 rows) splits a sequence's own rows; all-row logits count against logit_rows
    assert rounds([40, 3], [16, 256], [40, 3], 20) == [[(0, 0, 16), (1, 0, 3)], [(0, 16, 16)], [(0, 32, 8)]]
    assert rounds([40, 3], [16, 256], [40, 3], 18) == [[(0, 0, 16)], [(0, 16, 16)], [(0, 32, 8), (1, 0, 3)]]


def test_nonfinite_logits_of_one_sequence_stop_the_batch(tmp_path):
    """A sequence whose first row's logits are NaN and last rows' are not (an expert of the last
    layer only that row routes to, poisoned: as tests/test_nonfinite.py): beside another
    sequence, a forward returning its every row stops with the error naming the experts (also
    where that row is in an earlier chunk: 20 rows, 16 + 4); returning last rows only does not."""
    from onebit.errors import NonFiniteError
    from test_nonfinite import _poison, _routed_first_not_last

    ref = onebit.load(fixture_path("qwen3moe-f32.gguf"), backend="cpu")
    ids, e = _routed_first_not_last(ref, 20)
    with onebit.load(_poison(tmp_path, f"blk.{ref.cfg.n_layers - 1}.ffn_down_exps.weight", np.nan, where=e),
                     backend="vulkan") as m:
        assert m.be.name == "vulkan"
        for rows in (3, 20):
            both = [(ids[:rows], m.new_cache()), (ids[:rows], m.new_cache())]
            assert all(np.isfinite(lg).all() for lg in m.net.forward_batch(both, last_only=[True, True]))
            with pytest.raises(NonFiniteError, match="experts"):
                m.net.forward_batch([(ids[:rows], m.new_cache()), (ids[:rows], m.new_cache())],
                                    last_only=[True, False])


def test_nonfinite_logits_of_an_earlier_chunk_are_reported(tmp_path):
    """A 20-row prompt keeping its last row's logits runs as 16 + 4 rows, each chunk's head on
    its last row: where row 15's logits are NaN (an expert of the last layer that it routes to
    and rows 16-19 do not, poisoned), its forward stops, beside another sequence as alone."""
    from onebit.errors import NonFiniteError
    from test_nonfinite import _poison

    ref = onebit.load(fixture_path("qwen3moe-f32.gguf"), backend="cpu")
    last, rng = ref.cfg.n_layers - 1, np.random.default_rng(6)
    for _ in range(200):
        ids = rng.integers(1, ref.cfg.vocab_size, 20)
        seen = {}
        ref.net.forward(ids, ref.new_cache(), hook=lambda layer, e, _: seen.setdefault(layer, e))
        alone = [int(e) for e in seen[last][15] if not any(e in seen[last][r] for r in range(16, 20))]
        if alone:
            break
    else:
        raise AssertionError("no such prompt in 200 tries")
    p = _poison(tmp_path, f"blk.{last}.ffn_down_exps.weight", np.nan, where=alone[0])
    with onebit.load(p, backend="vulkan") as m:
        assert m.be.name == "vulkan"
        with pytest.raises(NonFiniteError, match="experts"):
            m.net.forward(ids, m.new_cache(), last_only=True)
        other = ids[:5]  # (its last row's logits are finite)
        assert np.isfinite(m.net.forward(other, m.new_cache(), last_only=True)).all()
        with pytest.raises(NonFiniteError, match="experts"):
            m.net.forward_batch([(other, m.new_cache()), (ids, m.new_cache())], last_only=[True, True])
