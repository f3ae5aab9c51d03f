"""The expert pool and streamed inference: bit-identical to resident at every slot count."""

from __future__ import annotations

import numpy as np
import pytest

import onebit
from conftest import fixture_path
from onebit.errors import ModelFileChangedError, UsageError
from onebit.formats.gguf_file import GGUFFile
from onebit.memory.plan import size_classes
from onebit.memory.pool import ExpertPool, StreamReadError

Q4K = "q3moe256-Q4_K_M.gguf"


def decode_logits(model, prompt, n):
    """Greedy decode n tokens one at a time; return every step's logits."""
    cache = model.new_cache()
    out = [model.net.forward(prompt, cache)]
    tok = int(out[-1][-1].argmax())
    for _ in range(n):
        out.append(model.net.forward(np.array([tok]), cache))
        tok = int(out[-1][-1].argmax())
    return np.concatenate(out)


@pytest.mark.parametrize("name,slot_counts", [(Q4K, [4, 5, 7]), ("qwen3moe-f32.gguf", [2, 3, 8, 15]),
                                              ("qwen2moe-f32.gguf", [2, 9]), ("mixtral-f32.gguf", [2, 5]),
                                              ("glm4moe-f32.gguf", [2, 5])])
@pytest.mark.parametrize("policy", ["global", "layer"])
@pytest.mark.parametrize("backend", ["numpy", "cpu"])
def test_streamed_equals_resident_bit_for_bit(name, slot_counts, policy, backend):
    path = fixture_path(name)
    prompt = np.load(str(path).replace(".gguf", ".ref.npz"))["tokens"][:12].astype(np.int64)
    resident = onebit.load(path, backend=backend, repack_from=0)  # (cpu: the X16 layouts on these small files too)
    ref = decode_logits(resident, prompt, 10)
    if backend == "cpu" and name == Q4K:
        from onebit.backends.cpu.int_dots import VNNI
        from onebit.backends.cpu.x16 import Q4_K_X16
        assert (Q4_K_X16 in resident.be._experts_of(0)[2]) == VNNI  # (the file's experts packed at load)
    for slots in slot_counts:
        m = onebit.load(path, slots=slots, budget="1GiB", pool_policy=policy, backend=backend, repack_from=0)
        assert m.be.name == backend
        assert m.pool is not None and m.pool.n_slots == slots
        got = decode_logits(m, prompt, 10)
        st = m.pool.stats
        if backend == "cpu" and name == Q4K:  # its Q4_K attention and experts in the repacked layout, streamed too
            from onebit.backends.cpu.int_dots import VNNI
            from onebit.backends.cpu.x16 import Q4_K_X16
            assert any(q == Q4_K_X16 for _, (_, q, _) in m.be._products.values()) == VNNI
            assert any(m.pool.packed.values()) == VNNI
            from onebit.backends.cpu.x16 import Q6_K_X16
            assert (Q4_K_X16 in m.be._experts_of(0)[2]) == VNNI and (Q6_K_X16 in m.be._experts_of(1)[2]) == VNNI
        m.close()
        assert np.array_equal(got, ref), f"{name} slots={slots} policy={policy}"
        assert st.demand_misses > 0 and st.bytes_read > 0


def make_pool(slots, path=None, **kw):
    g = GGUFFile(path or fixture_path("qwen3moe-f32.gguf"))
    classes = size_classes(g)
    return g, ExpertPool(g, classes, [slots], **kw)


def copy_of_fixture(tmp_path):
    """A copy of qwen3moe-f32.gguf that a test may cut short."""
    path = tmp_path / "m.gguf"
    path.write_bytes(fixture_path("qwen3moe-f32.gguf").read_bytes())
    return path


def test_lru_hits_misses_and_bytes():
    g, pool = make_pool(3)
    try:
        raw = g.tensor("blk.0.ffn_gate_exps.weight").raw
        slots = pool.acquire(0, [1, 2])
        assert np.array_equal(pool.slot_view(0, slots[0], "ffn_gate_exps"), raw[1])
        pool.release(0, [1, 2])
        pool.acquire(1, [5])
        pool.release(1, [5])
        pool.acquire(0, [1])  # hit
        pool.release(0, [1])
        pool.acquire(1, [6])  # evicts the least recently used: (0, 2)
        pool.release(1, [6])
        assert set(pool.where) == {(0, 1), (1, 5), (1, 6)}
        s = pool.stats
        assert (s.hits, s.demand_misses) == (1, 4)
        per_expert = sum(g.tensor(f"blk.0.ffn_{p}_exps.weight").n_bytes // 8 for p in ("gate", "up", "down"))
        assert s.bytes_read >= 4 * per_expert
    finally:
        pool.close()


def test_tracked_table_follows_acquires_and_evictions():
    """track(): table[layer, e] is e's slot once an acquire had it resident, -1 once its slot
    goes to another expert; a prefetch alone does not enter it (not known complete). touch()
    counts hits and orders the LRU as acquire + release would: the same evictions follow."""
    _, pool = make_pool(3)
    _, twin = make_pool(3)
    try:
        table = np.zeros((2, 8), np.int32)
        pool.track(table)
        assert (table == -1).all()
        slots = pool.acquire(0, [1, 2])
        pool.release(0, [1, 2])
        assert table[0, 1] == slots[0] and table[0, 2] == slots[1]
        assert (table == -1).sum() == 14
        pool.prefetch(1, [4])
        pool.drain()
        assert table[1, 4] == -1
        pool.acquire(1, [4])
        pool.release(1, [4])
        assert table[1, 4] >= 0
        # the twin does by acquire + release what `pool` does by touch
        for layer, e in ((0, [1, 2]), (1, [4])):
            twin.acquire(layer, e)
            twin.release(layer, e)
        before = pool.stats.hits
        pool.touch([(0, [1])])
        twin.acquire(0, [1])
        twin.release(0, [1])
        assert pool.stats.hits == before + 1 == twin.stats.hits
        for q in (pool, twin):  # evicts the least recently used: (0, 2), not (0, 1)
            q.acquire(1, [6])
            q.release(1, [6])
        assert set(pool.where) == set(twin.where) == {(0, 1), (1, 4), (1, 6)}
        assert table[0, 2] == -1 and table[1, 6] == pool.where[(1, 6)].index
        assert table[0, 1] == pool.where[(0, 1)].index
        with pytest.raises(RuntimeError, match="not resident"):
            pool.touch([(0, [2])])
    finally:
        pool.close()
        twin.close()


def test_prefetch_hit_and_waste():
    _, pool = make_pool(2)
    try:
        pool.prefetch(0, [3])
        pool.drain()
        pool.acquire(0, [3])  # resident or in flight: a prefetch hit
        pool.release(0, [3])
        pool.prefetch(1, [4])
        pool.drain()
        pool.acquire(0, [5])  # evicts... the LRU of {(0,3), (1,4)}: (0,3)
        pool.release(0, [5])
        pool.acquire(0, [6])  # evicts the never-used prefetch (1,4): wasted
        pool.release(0, [6])
        s = pool.stats
        assert s.prefetch_hits == 1 and s.prefetches == 2 and s.wasted_prefetches == 1
    finally:
        pool.close()


def test_more_experts_than_slots_is_refused():
    _, pool = make_pool(2)
    try:
        with pytest.raises(UsageError, match="only 2 slots"):
            pool.acquire(0, [1, 2, 3])
    finally:
        pool.close()


def test_file_truncated_while_streaming(tmp_path):
    path = copy_of_fixture(tmp_path)
    m = onebit.load(path, slots=2, budget="1GiB", backend="cpu")
    try:
        g = m.gguf
        cut = g.tensor("blk.1.ffn_down_exps.weight").offset
        with open(path, "r+b") as f:
            f.truncate(cut)
        # The model checks the file before every forward; the pool's own read says so too.
        with pytest.raises(ModelFileChangedError, match=r"file changed while running: size 773152 -> \d+ bytes"):
            m.logits(np.arange(8))
        with pytest.raises(StreamReadError, match="ended early"):
            m.pool.acquire(1, list(range(m.cfg.n_experts_used)))
    finally:
        m.close()


def test_acquire_pins_hits_before_claiming_misses():
    """A miss must not evict an expert the same acquire is about to use."""
    _, pool = make_pool(4)
    try:
        for e in (1, 2, 3, 4):  # 1 is the least recently used
            pool.acquire(0, [e])
            pool.release(0, [e])
        pool.acquire(0, [0, 1])
        pool.release(0, [0, 1])
        assert (pool.stats.hits, pool.stats.demand_misses) == (1, 5)
        assert set(pool.where) == {(0, 0), (0, 1), (0, 3), (0, 4)}  # LRU evicted 2, not 1
    finally:
        pool.close()


def test_arriving_gives_the_resident_experts_first_then_the_reads_and_releases_all():
    """arriving: the hits at once, before any read completes (the readers held back here), then
    the misses as they land; every position once, each slot holding its expert's bytes; all
    pinned until the end, then released; the stall and misses counted as acquire counts them."""
    g, pool = make_pool(6)
    try:
        raw = g.tensor("blk.0.ffn_gate_exps.weight").raw
        pool.acquire(0, [2, 5])
        pool.release(0, [2, 5])
        with pool.lock:  # no reader takes a read until the hits came
            gen = pool.arriving(0, [1, 2, 4, 5])
            first = next(gen)
        assert first[0] == [1, 3] and [pool.slots[0][i].key for i in first[1]] == [(0, 2), (0, 5)]
        seen = {1: first[1][0], 3: first[1][1]}
        for positions, slots in gen:
            assert all(pool.slots[0][i].pins == 1 for i in slots)
            seen.update(zip(positions, slots))
        assert sorted(seen) == [0, 1, 2, 3]
        for j, e in enumerate([1, 2, 4, 5]):
            assert np.array_equal(pool.slot_view(0, seen[j], "ffn_gate_exps"), raw[e])
        assert all(s.pins == 0 for s in pool.slots[0])
        assert (pool.stats.hits, pool.stats.demand_misses) == (2, 4)
        assert pool.by_layer[0][1] == 4 and pool.stats.stall_seconds > 0
    finally:
        pool.close()


def test_arriving_a_failed_read_raises_with_nothing_pinned(tmp_path):
    path = copy_of_fixture(tmp_path)
    g, pool = make_pool(4, path)
    try:
        pool.acquire(1, [0])
        pool.release(1, [0])
        with open(path, "r+b") as f:
            f.truncate(g.tensor("blk.1.ffn_down_exps.weight").offset)
        with pytest.raises(StreamReadError, match="ended early"):
            for _ in pool.arriving(1, [0, 1, 2]):
                pass
        pool.drain()  # (a read still in flight pins its slot until it ends)
        assert all(s.pins == 0 for s in pool.slots[0])
    finally:
        pool.close()


def test_arriving_more_experts_than_slots_comes_in_groups():
    _, pool = make_pool(2)
    try:
        got = [(list(p), len(s)) for p, s in pool.arriving(0, [1, 2, 3])]
        assert got == [([0, 1], 2), ([2], 1)] and all(s.pins == 0 for s in pool.slots[0])
    finally:
        pool.close()


def test_acquire_waits_for_a_release_from_another_thread():
    """With every slot pinned, an acquire waits (in _victim) until another thread releases one;
    a release wakes the lock's waiters only while such an acquire waits (the reader threads wait
    on the same lock), so the waiter must be counted and woken."""
    import threading

    _, pool = make_pool(2)
    try:
        pool.acquire(0, [0, 1])  # both slots pinned
        got, err = [], []

        def other():
            try:
                got.append(pool.acquire(0, [2]))
                pool.release(0, [2])
            except Exception as e:  # noqa: BLE001 (reported below)
                err.append(e)

        t = threading.Thread(target=other)
        t.start()
        for _ in range(1000):  # until the other acquire waits for a slot
            with pool.lock:
                if pool._slot_waiters:
                    break
            t.join(0.01)
        with pool.lock:
            assert pool._slot_waiters == 1 and not got, "the second acquire did not wait for a slot"
        pool.release(0, [0, 1])
        t.join(30)
        assert not t.is_alive() and not err, err
        assert len(got) == 1 and (0, 2) in pool.where and pool._slot_waiters == 0
    finally:
        pool.close()


def _scan_file(path, layers=6, experts=16):
    """Expert tensors only: `layers` layers of `experts` F32 experts, each row its own numbers."""
    from test_gguf_file import write_gguf

    rng = np.random.default_rng(3)
    return write_gguf(path, {f"blk.{l}.ffn_{p}_exps.weight": rng.standard_normal((experts, 4, 8)).astype(np.float32)
                             for l in range(layers) for p in ("gate", "up", "down")})


def _scan(pool, g, layers, experts=tuple(range(16))):
    """A prompt chunk's pass: `experts` of every layer, in layer order; each slot checked
    against the file."""
    for layer in range(layers):
        experts = list(experts)
        slots = pool.acquire(layer, experts)
        raw = g.tensor(f"blk.{layer}.ffn_down_exps.weight").raw
        for e, s in zip(experts, slots):
            assert np.array_equal(pool.slot_view(layer, s, "ffn_down_exps"), raw[e])
        pool.release(layer, experts)


def test_a_prompt_pass_hits_what_the_last_pass_left():
    """Passes over more experts than there are slots: under plain LRU each pass evicts what
    the next needs first (no hits after the first pass); a scan's misses go to the stream
    region only, so the other slots keep their experts for every later pass to hit, and the
    read-ahead never takes them either."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        g = GGUFFile(_scan_file(f"{d}/scan.gguf"))
        pool = ExpertPool(g, size_classes(g), [40])
        try:
            assert pool.stream_from == [20]  # 40 slots, 16 experts a layer: 20 stream (half the slots)
            _scan(pool, g, 6)
            pool.drain()
            kept = {s.index: s.key for s in pool.slots[0][:20]}
            assert all(k is not None for k in kept.values())
            for _ in range(2):
                reads, before = pool.reads, pool.stats.hits
                _scan(pool, g, 6)
                pool.drain()
                assert pool.stats.hits - before >= 20  # the kept experts, not read again
                assert pool.reads - reads <= 6 * 16 - 20
                assert {s.index: s.key for s in pool.slots[0][:20]} == kept
            # a decode step's few experts use every slot in one LRU order again
            pool.acquire(0, [0])
            pool.release(0, [0])
        finally:
            pool.close()


def test_a_prompt_pass_keeps_its_last_rows_experts_for_the_decode():
    """Given the chunk's routing, a pass ends holding the experts of its last rows (KEEP_ROWS),
    every layer's, outside the stream region, though the read-ahead brought most of them into
    it; in their place go experts the pass's earlier rows used at earlier layers. The next pass
    reads no more than without it, and the decode's acquires of those experts read nothing.
    Without the routing, the late layers' last experts are gone."""
    import tempfile

    from onebit.memory.pool import KEEP_ROWS

    tail = {layer: [(2 * layer + j) % 16 for j in range(3)] for layer in range(6)}  # 18 experts: main has 20

    def routed(layer):  # one sequence: every expert once, then KEEP_ROWS rows among the layer's last three
        return [np.array([[e] for e in range(16)] + [[tail[layer][r % 3]] for r in range(KEEP_ROWS)])]

    with tempfile.TemporaryDirectory() as d:
        g = GGUFFile(_scan_file(f"{d}/scan.gguf"))
        held, reads = {}, {}
        for given in (True, False):
            pool = ExpertPool(g, size_classes(g), [40])
            try:
                for _ in range(2):
                    before = pool.reads
                    for layer in range(6):
                        experts = list(range(16))
                        slots = pool.acquire(layer, experts, routed(layer) if given else None)
                        raw = g.tensor(f"blk.{layer}.ffn_down_exps.weight").raw
                        for e, s in zip(experts, slots):
                            assert np.array_equal(pool.slot_view(layer, s, "ffn_down_exps"), raw[e])
                        pool.release(layer, experts)
                    pool.drain()
                    reads[given] = pool.reads - before
                assert sum(s.stream for s in pool.slots[0]) == 20  # (the regions traded slots, kept their sizes)
                held[given] = {key for key, s in pool.where.items() if not s.stream}
                before = pool.reads
                for layer in range(6):  # the decode after the prompt
                    pool.acquire(layer, tail[layer])
                    pool.release(layer, tail[layer])
                if given:
                    assert pool.reads == before
            finally:
                pool.close()
        assert all((layer, e) in held[True] for layer, es in tail.items() for e in es)
        assert not all((layer, e) in held[False] for layer, es in tail.items() for e in es)
        assert reads[True] <= reads[False], reads


def test_a_prompt_chunk_under_plain_lru_keeps_its_last_rows_experts():
    """A chunk that routes to fewer experts than a scan (plain LRU): its other experts go first
    when slots are needed, so after a pass over more experts than there are slots, every
    layer's last-rows experts are still resident; without the routing the first layers' are
    evicted by the later layers'."""
    import tempfile

    from onebit.memory.pool import KEEP_ROWS, PROMPT_SHARE

    routes = {layer: [(3 * layer + j) % 16 for j in range(10)] for layer in range(6)}  # 10 < 0.75 x 16
    assert len(routes[0]) < PROMPT_SHARE * 16
    tail = {layer: r[-3:] for layer, r in routes.items()}

    def routed(layer):  # (one sequence)
        return [np.array([[e] for e in routes[layer]] + [[tail[layer][r % 3]] for r in range(KEEP_ROWS)])]

    with tempfile.TemporaryDirectory() as d:
        g = GGUFFile(_scan_file(f"{d}/scan.gguf"))
        held = {}
        for given in (True, False):
            pool = ExpertPool(g, size_classes(g), [28])  # (a layer pinned: 10, and 5 layers x 3 kept)
            try:
                for layer in range(6):
                    slots = pool.acquire(layer, routes[layer], routed(layer) if given else None)
                    raw = g.tensor(f"blk.{layer}.ffn_down_exps.weight").raw
                    for e, s in zip(routes[layer], slots):
                        assert np.array_equal(pool.slot_view(layer, s, "ffn_down_exps"), raw[e])
                    pool.release(layer, routes[layer])
                pool.drain()
                held[given] = set(pool.where)
            finally:
                pool.close()
        assert all((layer, e) in held[True] for layer, es in tail.items() for e in es)
        assert not all((layer, e) in held[False] for layer, es in tail.items() for e in es)


def test_a_chunk_over_several_sequences_keeps_each_ones_last_rows_in_any_order():
    """Two sequences' prompts in one forward (serve --parallel; the Vulkan backend puts them in
    an order of its own): the experts of each one's last KEEP_ROWS rows are kept, and the pool
    ends the same whichever sequence's rows come first."""
    import tempfile

    from onebit.memory.pool import KEEP_ROWS

    routes = {layer: [(3 * layer + j) % 16 for j in range(10)] for layer in range(6)}
    tails = {layer: (r[2], r[5]) for layer, r in routes.items()}

    def sequences(layer):  # every routed expert once, then KEEP_ROWS rows of one expert each
        r = routes[layer]
        return [np.array([[e] for e in r] + [[t]] * KEEP_ROWS) for t in tails[layer]]

    with tempfile.TemporaryDirectory() as d:
        g = GGUFFile(_scan_file(f"{d}/scan.gguf"))
        ends = {}
        for order in (1, -1):
            pool = ExpertPool(g, size_classes(g), [28])
            try:
                for layer in range(6):
                    pool.acquire(layer, routes[layer], sequences(layer)[::order])
                    pool.release(layer, routes[layer])
                pool.drain()
                ends[order] = [s.key for s in pool.lru[0].values()]
            finally:
                pool.close()
            assert all((layer, e) in ends[order] for layer, es in tails.items() for e in es)
        assert ends[1] == ends[-1]


def test_a_prompt_pass_reads_ahead_into_the_stream_region():
    """While a scan's layer computes, the next layers' experts are already queued (prefetches
    the next acquires count as prefetch hits), as far as the stream region has room."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        g = GGUFFile(_scan_file(f"{d}/scan.gguf"))
        pool = ExpertPool(g, size_classes(g), [40])
        try:
            _scan(pool, g, 6)
            pool.drain()
            s = pool.stats
            assert s.prefetches > 0 and s.prefetch_hits > 0 and s.wasted_prefetches == 0
            assert s.prefetch_hits + s.demand_misses == 6 * 16  # every expert read once, none twice
        finally:
            pool.close()


def test_prefetches_a_prompt_pass_did_not_use_leave_the_stream_region():
    """The read-ahead reads every expert of the next layers, but a prompt need not route to all
    of them: the prefetches a pass leaves unused must become victims, or they would fill the
    stream region pass after pass and the read-ahead would stop."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        g = GGUFFile(_scan_file(f"{d}/scan.gguf"))
        pool = ExpertPool(g, size_classes(g), [40])
        try:
            for _ in range(6):
                _scan(pool, g, 6, experts=range(3, 16))  # experts 0-2 (read ahead first) never routed
                pool.drain()
            # a pass went by every layer: none of its read-ahead waits for a use any more
            assert not any(s.prefetched for s in pool.slots[0][pool.stream_from[0]:])
            assert len(pool.lru_stream[0]) == 20 and pool.stats.wasted_prefetches > 0
        finally:
            pool.close()


@pytest.mark.parametrize("direct", [True, False])
def test_a_pool_packs_its_slots_as_the_file_is_packed(direct):
    """The cpu backend's X16 expert layout: a slot filled by a reader thread (one expert, packed
    on that thread) holds the bytes the file's experts take packed at load (every thread), and
    the slots take the bytes the cpu plan counts for them."""
    from onebit.backends.cpu import CpuBackend, int_dots

    if not int_dots.VNNI:
        pytest.skip("the X16 layout is AVX-512 VNNI's (elsewhere experts stay as in the file)")
    g = GGUFFile(fixture_path(Q4K))
    policy = CpuBackend.memory_policy(g, repack_from=0)
    layout = policy.experts
    classes = size_classes(g, policy)
    pool = ExpertPool(g, classes, [5, 4], layout=layout, direct=direct)
    try:
        assert pool.nbytes == sum(n * c.expert_bytes for n, c in zip([5, 4], classes))
        for layer in (0, 1):
            slots = pool.acquire(layer, [1, 3])
            for part in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"):
                t = g.tensor(f"blk.{layer}.{part}.weight")
                held = layout.pack_all(t, t.raw) if layout.packs(t) else t.raw
                assert layout.packs(t)  # (Q4_K and Q6_K: both)
                for e, s in zip([1, 3], slots):
                    assert np.array_equal(pool.slot_view(layer, s, part), held[e])
            pool.release(layer, [1, 3])
    finally:
        pool.close()
