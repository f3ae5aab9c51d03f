"""Streamed experts on Vulkan: logits bit-identical to the resident Vulkan backend at every slot count.

The pool's slots are mapped device buffers; the expert kernels index them through a slot table.
A 36-token prefill (recorded chunks of 32 and 4 rows, each routing to more experts than the
smallest pools hold: the experts run in passes over row groups) then greedy decode one token
at a time; slot counts at the minimum, a middle count and all-but-one; both
pool policies ("layer" at the minimum leaves a layer fewer slots than its top-k: the staged path).
"""

from __future__ import annotations

import numpy as np
import pytest

import onebit
from conftest import fixture_path
from onebit.backends.vulkan.recording import _row_groups, _slot_table
from onebit.backends.vulkan.slots import SlotArrays

N_DECODE = 8
CASES = [("q3moe256-Q4_K_M.gguf", [4, 6, 7]), ("qwen3moe-f32.gguf", [2, 8, 15]), ("glm4moe-f32.gguf", [2, 5])]
_resident: dict[str, np.ndarray] = {}


from test_pool import decode_logits  # noqa: E402  (greedy decode, every step's logits)


def _prompt(path):
    return np.load(str(path).replace(".gguf", ".ref.npz"))["tokens"][:36].astype(np.int64)


def resident_logits(name):
    if name not in _resident:
        path = fixture_path(name)
        m = onebit.load(path, backend="vulkan")
        assert type(m.be).__name__ == "VulkanBackend"
        _resident[name] = decode_logits(m, _prompt(path), N_DECODE)
        m.close()
    return _resident[name]


@pytest.mark.parametrize("name,slot_counts", CASES)
@pytest.mark.parametrize("policy", ["global", "layer"])
def test_streamed_vulkan_equals_resident_bit_for_bit(name, slot_counts, policy):
    path = fixture_path(name)
    ref = resident_logits(name)
    for slots in slot_counts:
        m = onebit.load(path, backend="vulkan", slots=slots, budget="1GiB", pool_policy=policy)
        try:
            assert m.be.name == "vulkan" and m.be.pool is m.pool and m.pool.n_slots == slots
            # routed experts are not uploaded; the pool's slots are the device's mapped buffers
            assert not any("_exps." in t for t in m.be.tensors)
            assert all(m.be.slot_arrays.buffer_of(a).host_visible for b in m.pool.buffers for a in b.values())
            got = decode_logits(m, _prompt(path), N_DECODE)
            st = m.pool.stats
        finally:
            m.close()
        assert np.array_equal(got, ref), f"{name} slots={slots} policy={policy}"
        assert st.demand_misses > 0 and st.bytes_read > 0


def test_pool_on_mapped_device_buffers():
    """ExpertPool(allocate=SlotArrays): the reader threads write straight into device buffers."""
    from onebit.backends.vulkan.device import default_device
    from onebit.formats.gguf_file import GGUFFile
    from onebit.memory.plan import size_classes
    from onebit.memory.pool import ExpertPool

    g = GGUFFile(fixture_path("qwen3moe-f32.gguf"))
    arrays = SlotArrays(default_device())
    pool = ExpertPool(g, size_classes(g), [3], allocate=arrays)
    try:
        (slot,) = pool.acquire(1, [5])
        buf = arrays.buffer_of(pool.buffers[0]["ffn_up_exps"])
        raw = g.tensor("blk.1.ffn_up_exps.weight").raw[5]
        got = buf.read(np.uint8, raw.shape, slot * raw.nbytes)
        assert np.array_equal(got, raw)
        pool.release(1, [5])
    finally:
        pool.close()
        arrays.destroy()


def test_row_groups_and_slot_table():
    ids = np.array([[0, 1], [1, 2], [3, 4], [4, 0]])
    assert _row_groups(ids, 3) == [(0, 2), (2, 4)]
    assert _row_groups(ids, 2) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert _row_groups(ids[:0], 2) == []
    t = _slot_table(ids[:2], [0, 1, 2], [7, 3, 5])
    assert t.dtype == np.int32 and t.tolist() == [[7, 3], [3, 5]]


@pytest.mark.parametrize("slots,deferred", [(8, True), (2, False)])
def test_a_layers_experts_are_released_after_the_next_submission(monkeypatch, slots, deferred):
    """A decode step's layer 0 experts stay pinned until the segment after layer 1's pause is
    submitted (the host's work between segments is then only what the next one needs), unless
    layer 1's experts might need their slots (2 slots, top 2: released before its acquire)."""
    from onebit.backends.vulkan.device import Sequence

    path = fixture_path("qwen3moe-f32.gguf")
    m = onebit.load(path, backend="vulkan", slots=slots, budget="1GiB", predict="off")  # (the pool alone)
    try:
        cache = m.new_cache()
        m.net.forward(_prompt(path)[:4], cache, last_only=True)
        events = []
        submit, release, acquire = Sequence.submit, m.pool.release, m.pool.acquire
        monkeypatch.setattr(Sequence, "submit", lambda seq: (events.append("submit"), submit(seq))[1])
        monkeypatch.setattr(m.pool, "release", lambda layer, e: (events.append(f"release {layer}"), release(layer, e))[1])
        monkeypatch.setattr(m.pool, "acquire", lambda layer, e, routed=None: (events.append(f"acquire {layer}"), acquire(layer, e, routed))[1])
        m.net.forward(np.array([3]), cache)
    finally:
        m.close()
    want = ["submit", "acquire 0", "submit", "acquire 1", "submit", "release 0", "release 1"] if deferred else \
        ["submit", "acquire 0", "submit", "release 0", "acquire 1", "submit", "release 1"]
    assert events == want


@pytest.mark.parametrize("name,slots", [("qwen3moe-f32.gguf", 14), ("glm4moe-f32.gguf", 8), ("q3moe256-Q4_K_M.gguf", 6)])
def test_steps_whose_experts_are_all_pooled_run_without_pausing(tmp_path, name, slots, monkeypatch):
    """Once a step's experts were all hits, the next runs as one submission, its routers writing
    the slot table from the pool's (recording.py Recording.by_table); one that routes to an expert
    not pooled is refused and run again with pauses. Against the same decode with every
    streamed layer pausing: the same logits bit for bit, the same pool counts (hits, misses,
    bytes) and the same routing trace. (No acquire counts as a scan here: a scan reads the next
    layer ahead, and which slot a later miss evicts then depends on whether those reads have
    finished, which the thread scheduler decides: under load the two runs' counts differed by
    one hit.)"""
    from onebit.memory import pool as P
    from onebit.moe.trace import TraceWriter

    monkeypatch.setattr(P, "PROMPT_SHARE", 2.0)  # (more than every expert: no acquire is a scan)

    path = fixture_path(name)
    prompt = _prompt(path)[:8]
    runs = {}
    for lookup in (True, False):
        m = onebit.load(path, backend="vulkan", slots=slots, budget="1GiB", predict="off")  # (no pause a predictor asks for)
        try:
            m.be.runner.pool_table_steps = lookup
            streamed = len(m.be.streamed_layers)
            trace = str(tmp_path / f"{lookup}.jsonl")
            hook = TraceWriter(trace, "t", m.cfg.n_layers, m.cfg.n_experts, m.cfg.n_experts_used)
            dev, submits = m.be.dev, []
            cache = m.new_cache()
            out = [m.net.forward(prompt, cache, hook=hook)]
            for _ in range(2 * N_DECODE):
                n0 = dev.n_submits
                out.append(m.net.forward(np.array([int(out[-1][-1].argmax())]), cache, hook=hook))
                submits.append(dev.n_submits - n0)
            hook.close()
            st = m.pool.stats
            r = m.be.runner
            runs[lookup] = (np.concatenate(out), (st.hits, st.demand_misses, st.bytes_read, st.acquires), submits,
                            open(trace).read(), (r.table_steps, r.table_steps_refused))
        finally:
            m.close()
    (got, counts, submits, text, (tried, refused)), (want, want_counts, paused, want_text, none) = runs[True], runs[False]
    assert np.array_equal(got, want)
    assert counts == want_counts and text == want_text and none == (0, 0)
    assert counts[1] > 0  # (the pool missed, so pauses ran too)
    assert all(n == streamed + 1 for n in paused)  # every streamed layer pauses
    accepted = tried - refused
    assert accepted > 0 and submits.count(1) == accepted
    if name.startswith("q3moe256"):  # its decode routes to all 8 experts of a layer: 6 slots miss
        assert refused > 0


def test_a_hook_that_acts_is_called_at_every_streamed_layer():
    """A hook that may act before the experts (no needs_pause = False) pauses every step, even
    where every expert is pooled and every MoE layer streamed (steps with no pause are not for it)."""
    path = fixture_path("qwen3moe-f32.gguf")
    m = onebit.load(path, backend="vulkan", slots=14, budget="1GiB")
    try:
        assert m.be.streamed_layers == {0, 1}
        calls = []
        cache = m.new_cache()
        logits = m.net.forward(_prompt(path)[:8], cache)
        for _ in range(2 * N_DECODE):  # (without the hook these steps would run with no pause)
            logits = m.net.forward(np.array([int(logits[-1].argmax())]), cache, hook=lambda l, i, g: calls.append(l))
        assert m.be.runner.table_steps == 0
    finally:
        m.close()
    assert calls == [0, 1] * 2 * N_DECODE


def test_a_streamed_prompt_holds_one_layers_expert_scratch_not_every_layers():
    """A streamed layer's expert ops are kept for re-recording at replay, so their scratch must
    not come from the arena per layer (it never went back: 555 MiB at 96 rows on a 48-layer
    30B-A3B shape, past the memory plan): the arena of a streamed prompt stays within one
    layer's expert scratch of the resident prompt's."""
    path = fixture_path("qwen3moe-f32.gguf")
    rows = np.arange(3, 43)  # one recorded chunk of 40 rows
    arena = []
    for kw in ({}, {"slots": 8, "budget": "1GiB"}):
        m = onebit.load(path, backend="vulkan", **kw)
        assert (m.pool is not None) == bool(kw)
        m.net.forward(rows, m.new_cache(), last_only=True)
        arena.append(m.be.arena.nbytes)
        cfg = m.cfg
        m.close()
    one = cfg.n_experts_used * len(rows) * cfg.expert_hidden_dim * 4  # [R, k, F] float32
    one_layer = 3 * (1 << (one - 1).bit_length())  # gate, up, silu*up: the arena's power-of-two sizes
    assert arena[1] - arena[0] < one_layer, arena
