"""The tiled expert mat-mat (shaders/mul_mm.comp MUL_ID + moe_group.comp), against numpy.

GPUs take it for routed experts where each expert gets at least `mm_id_min_slots` slots on
average (prefill chunks): each expert's weight tiles are read once for up to 32 of the slots
routed to it. lavapipe is a CPU device and groups experts on the thread-per-row kernel instead,
so these tests force the tiled path there (`mv_xrows = 0`: not the CPU grouping;
`mm_id_min_slots`: the GPU threshold). Twin:
reference.mul_mv_id (the same maths). Outputs and the scratch are poisoned with NaN.
"""

from __future__ import annotations

import numpy as np
import pytest

import onebit
from conftest import fixture_path, greedy_tokens
from onebit.backends.vulkan import reference as ref
from onebit.backends.vulkan.kernels import SUPPORTED_TYPES, _push
from onebit.backends.vulkan.ops import VulkanOps
from test_pool import decode_logits
from test_vulkan_backend import LOGIT_TOL

from test_vulkan_kernels import PART_BYTES, TOL, close, experts_in_parts, n_in, rng  # noqa: F401  (rng: the seeded fixture)
from test_vulkan_xrows import Spy, check_shared_expert_sum, poison_scratch


def tiled(o: VulkanOps, min_slots: float = 8) -> VulkanOps:
    o.k.mv_xrows = 0  # not the CPU devices' grouping
    o.k.mm_id_min_slots = min_slots  # (8: a GPU's threshold)
    return o


@pytest.fixture(scope="module")
def gpu_ops():
    return tiled(VulkanOps(reduce="subgroup"))


def routing(rng, R: int, E: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    ids = np.stack([rng.choice(E, k, replace=False) for _ in range(R)]).astype(np.int32)
    return ids, rng.random((R, k)).astype(np.float32)


@pytest.mark.parametrize("type_name", SUPPORTED_TYPES)
def test_mul_mm_id_every_type(gpu_ops, rng, type_name):
    """45 tokens x 2 of 4 experts: experts with more than 32 slots take two slot tiles, 37 rows
    a partial weight tile; every mode."""
    n = n_in(type_name)
    E, k, R, rows = 4, 2, 45, 37
    we = ref.random_blocks(type_name, (E, rows, n), rng)
    ids, wts = routing(rng, R, E, k)
    ids[:40, 0] = 3  # expert 3: at least 40 slots (two tiles of the slot list)
    ids[:40, 1] = np.where(ids[:40, 1] == 3, 0, ids[:40, 1])
    for mode, shape in (("slots", (R, n)), ("weighted", (R, k, n)), ("sum", (R, k, n))):
        x = rng.standard_normal(shape).astype(np.float32)
        poison_scratch(gpu_ops, 64 * 1024)
        with Spy(gpu_ops.k, "mul_mm_id") as spy:
            got = gpu_ops.mul_mv_id(we, type_name, x, ids, wts, mode)
        assert spy.calls == 1
        close(got, ref.mul_mv_id(we, type_name, x, ids, wts, mode), rng, TOL[type_name],
              f"mul_mm_id {mode} {type_name}")


@pytest.mark.parametrize("R", [3, 63, 64, 200])
def test_mul_mm_id_from_the_threshold_up(gpu_ops, rng, R):
    """The 0.9B file's routing (64 experts, top 8; smaller rows): per-slot mat-vec below 8 slots
    per expert on average (64 tokens), tiled from there; experts with no slot, one, many."""
    E, k, n = 64, 8, 256
    we = ref.random_blocks("Q4_K", (E, 40, n), rng)
    ids, wts = routing(rng, R, E, k)
    x = rng.standard_normal((R, k, n)).astype(np.float32)
    poison_scratch(gpu_ops, R * k * 40 * 4 + 64 * 1024)
    with Spy(gpu_ops.k, "mul_mm_id") as spy:
        got = gpu_ops.mul_mv_id(we, "Q4_K", x, ids, wts, "sum")
    assert spy.calls == (R * k >= gpu_ops.k.mm_id_min_slots * E) == (R >= 64)
    close(got, ref.mul_mv_id(we, "Q4_K", x, ids, wts, "sum"), rng, TOL["Q4_K"], f"mul_mm_id sum R={R}")


def test_mul_mm_id_in_parts(rng):
    """Experts bound in parts (two per binding): each part's dispatch takes its own experts'
    slot lists; moe_sum adds the slots of every part."""
    o = tiled(VulkanOps(reduce="subgroup", max_part_bytes=PART_BYTES), min_slots=1)
    k, R = 2, 12
    we, ids, wts, xe = experts_in_parts(rng, R, k=k)
    for mode in ("slots", "weighted", "sum"):
        x = xe[:, 0] if mode == "slots" else xe
        poison_scratch(o, 64 * 1024)
        with Spy(o.k, "mul_mm_id") as spy:
            got = o.mul_mv_id(we, "Q4_K", x, ids, wts, mode)
        assert spy.calls == 1
        close(got, ref.mul_mv_id(we, "Q4_K", x, ids, wts, mode), rng, TOL["Q4_K"], f"mul_mm_id parts {mode}")


def test_mul_mm_id_sum_skips_experts_in_no_part(gpu_ops, rng):
    check_shared_expert_sum(gpu_ops, rng, 40, "mul_mm_id")


def test_moe_group_lists_each_experts_slots_in_order(gpu_ops, rng):
    """The slot lists themselves: for each expert, the slots routed to it, ascending, and their
    count; an expert nobody chose has none. 300 tokens x 4 of 9 (the ids spread over 64
    threads' runs unevenly)."""
    o = gpu_ops
    E, k, R = 9, 4, 300
    ids, _ = routing(rng, R, E, k)
    ids[ids == 7] = 8  # expert 7: no slots (8 may now repeat in a token: the lists still hold every slot)
    ids_s = o._in(ids, np.int32)
    cap = R * k  # room for repeats
    counts, lists = o._out((E,)), o._out((E, cap))
    seq = o.dev.sequence()
    seq.dispatch(o.k.pipeline("moe_group", 3), (ids_s, counts[0], lists[0]), _push("3I", R * k, cap, E), (E, 1, 1),
                 writes=(1, 2))
    seq.run()
    seq.close()
    got_n = counts[0].buffer.read(np.uint32, (E,), counts[0].offset)
    got_l = lists[0].buffer.read(np.uint32, (E, cap), lists[0].offset)
    flat = ids.reshape(-1)
    for e in range(E):
        want = np.flatnonzero(flat == e)
        assert got_n[e] == len(want), f"expert {e}"
        np.testing.assert_array_equal(got_l[e, : len(want)], want, err_msg=f"expert {e}")
    assert got_n[7] == 0


@pytest.mark.parametrize("name", ["q3moe256-Q4_K_M", "qwen3moe-f32", "gptoss-f32"])
def test_a_prefill_through_the_tiled_kernels_matches_numpy(name):
    """A whole prefill with the GPU's choices (tiled experts and tiled dense products over more
    than 4 rows; here the experts are tiled from 1 slot each on average) against the numpy backend: logits within tests/test_vulkan_backend.py's
    tolerance, then greedy tokens (prompt of 20: a tiled prefill, then one-row steps)."""
    path = fixture_path(f"{name}.gguf")
    ids = np.load(fixture_path(f"{name}.ref.npz"))["tokens"][:20].astype(np.int64)
    ref_m, vk = onebit.load(path, backend="numpy"), onebit.load(path, backend="vulkan")
    k = vk.be.k
    k.mv_xrows, k.mm_id_min_slots, k.mv_max_rows = 0, 1, 4
    with Spy(k, "mul_mm_id") as spy, Spy(k, "mul_mm") as spy_mm:
        got = vk.logits(ids)
        assert greedy_tokens(vk, ids, 6) == greedy_tokens(ref_m, ids, 6)
    assert spy.calls > 0 and spy_mm.calls > 0
    want = ref_m.logits(ids)
    np.testing.assert_allclose(got, want, rtol=0, atol=LOGIT_TOL * np.abs(want).max())


@pytest.mark.parametrize("name,slots", [("q3moe256-Q4_K_M", 4), ("q3moe256-Q4_K_M", 7), ("qwen3moe-f32", 2)])
def test_streamed_experts_through_the_tiled_kernel_match_numpy(name, slots):
    """Streamed on the GPU's path: the expert kernels index the pool's slots through the slot
    table, with passes over row groups where the routed experts outnumber the slots (the
    smallest pools). A 36-token prefill and greedy decode against the numpy backend."""
    path = fixture_path(f"{name}.gguf")
    prompt = np.load(fixture_path(f"{name}.ref.npz"))["tokens"][:36].astype(np.int64)
    want = decode_logits(onebit.load(path, backend="numpy"), prompt, 6)
    m = onebit.load(path, backend="vulkan", slots=slots, budget="1GiB")
    try:
        assert m.be.name == "vulkan" and m.be.pool is m.pool
        m.be.k.mv_xrows, m.be.k.mm_id_min_slots, m.be.k.mv_max_rows = 0, 1, 4
        with Spy(m.be.k, "mul_mm_id") as spy:
            got = decode_logits(m, prompt, 6)
        assert spy.calls > 0 and m.pool.stats.demand_misses > 0
    finally:
        m.close()
    np.testing.assert_allclose(got, want, rtol=0, atol=LOGIT_TOL * np.abs(want).max())
    assert (got.argmax(-1) == want.argmax(-1)).all()
