"""Many rows of x per weight decode on CPU devices (shaders/mul_mv.comp XROWS), against numpy.

Kernels.mul_mv over R > 1 rows takes mul_mv_xr (each weight unit decoded once for up to 16
rows), and mul_mv_id over enough tokens groups the slots per expert on the device
(mul_mv_id_xr, plus moe_sum for "sum"). Twins: reference.mul_mv / mul_mv_id (the same maths).
Outputs are poisoned with NaN (tests/test_vulkan_kernels.py's `close` and VulkanOps), and so
is the scratch buffer the grouped "sum" writes its slots to.
"""

from __future__ import annotations

import numpy as np
import pytest

from onebit.backends.vulkan import reference as ref
from onebit.backends.vulkan.device import Sequence
from onebit.backends.vulkan.kernels import MV_WHOLE_UNIT, SUPPORTED_TYPES
from onebit.backends.vulkan.ops import VulkanOps

from test_vulkan_kernels import PART_BYTES, TOL, close, experts_in_parts, n_in, rng  # noqa: F401  (rng: the seeded fixture)


@pytest.fixture(scope="module")
def cpu_ops():
    o = VulkanOps(reduce="none")  # the thread-per-row kernels, whatever the device
    assert o.k.mv_xrows > 1
    return o


class Spy:
    """Counts calls of one Kernels method (which path a product took)."""

    def __init__(self, k, name: str):
        self.k, self.name, self.calls = k, name, 0
        self.orig = getattr(k, name)

    def __enter__(self):
        def wrapped(*a, **kw):
            self.calls += 1
            return self.orig(*a, **kw)
        setattr(self.k, self.name, wrapped)
        return self

    def __exit__(self, *exc):
        delattr(self.k, self.name)  # back to the class's method


def poison_scratch(o: VulkanOps, nbytes: int) -> None:
    s = o.k._scratch_slice(nbytes)
    s.buffer.write(np.full(nbytes // 4, np.nan, np.float32), s.offset)


@pytest.mark.parametrize("type_name", SUPPORTED_TYPES)
def test_mul_mv_rows_every_type(cpu_ops, rng, type_name):
    """11 rows (the width-16 pipeline, its last 5 rows computed and dropped) and 37 (a prefill
    chunk: three dispatches of 13, 12, 12 rows through the same pipeline)."""
    n = n_in(type_name)
    w = ref.random_blocks(type_name, (37, n), rng)  # 37 weight rows: not a multiple of 8 x 8 per group
    for R in (11, 37):
        x = rng.standard_normal((R, n)).astype(np.float32)
        with Spy(cpu_ops.k, "mul_mv_xr") as spy:
            got = cpu_ops.mul_mv(w, type_name, x)
        assert spy.calls == (type_name not in MV_WHOLE_UNIT)  # those keep the one-row kernel
        close(got, ref.mul_mv(w, type_name, x), rng, TOL[type_name], f"mul_mv_xr {type_name} R={R}")


@pytest.mark.parametrize("type_name", ["Q4_K", "Q8_0", "Q6_K", "F32"])
@pytest.mark.parametrize("R", list(range(1, 10)))
def test_mul_mv_verify_rows(cpu_ops, rng, type_name, R):
    """R = 1..9 (lookup decoding's verify rows); R = 1 stays on the one-row mat-vec."""
    n = n_in(type_name, 4)
    w = ref.random_blocks(type_name, (70, n), rng)
    x = rng.standard_normal((R, n)).astype(np.float32)
    with Spy(cpu_ops.k, "mul_mv_xr") as spy:
        got = cpu_ops.mul_mv(w, type_name, x)
    assert spy.calls == (R > 1)
    close(got, ref.mul_mv(w, type_name, x), rng, TOL[type_name], f"mul_mv {type_name} R={R}")


@pytest.mark.parametrize("type_name", ["Q4_K", "Q5_0", "IQ2_XXS"])
def test_mul_mv_rows_x_storage_and_chunks(rng, type_name):
    """x too large for one uniform buffer per chunk of rows (storage-buffer variant), x forced to
    storage, and rows split into uniform-buffer chunks (6144 floats: 2 rows per 64 KiB)."""
    o = VulkanOps(reduce="none")
    for n, uniform in ((16640, True), (6144, True), (512, False)):
        o.k.mv_xr_uniform = uniform
        w = ref.random_blocks(type_name, (21, n), rng)
        x = rng.standard_normal((5, n)).astype(np.float32)
        close(o.mul_mv(w, type_name, x), ref.mul_mv(w, type_name, x), rng, TOL[type_name],
              f"mul_mv_xr {type_name} n={n} uniform={uniform}")


@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K", "F32"])
def test_mul_mv_rows_in_workgroup_layers(rng, monkeypatch, type_name):
    """Many rows: even chunks of at most 16, one per workgroup layer (grid z), as many layers per
    dispatch as the x binding holds; an uneven last chunk, a uniform window holding a whole
    number of chunks or not, x from a storage buffer. Every row has the one-row kernel's bits."""
    o = VulkanOps(reduce="none")
    layers = []
    dispatch = Sequence.dispatch

    def spy(seq, pipeline, bindings, push=b"", groups=(1, 1, 1), **kw):
        if pipeline.name.startswith("mul_mv_"):
            layers.append(groups[2])
        return dispatch(seq, pipeline, bindings, push, groups, **kw)

    monkeypatch.setattr(Sequence, "dispatch", spy)
    big_window = o.k.dev.info.max_uniform_buffer_range >= 65536
    # (n_in, rows, x uniform, chunks, dispatches where the window holds 64 KiB)
    for n, R, uniform, chunks, dispatches in ((256, 37, True, 3, 1), (512, 70, True, 5, 3), (2048, 37, True, 5, 5),
                                              (256, 37, False, 3, 1)):
        o.k.mv_xr_uniform = uniform
        w = ref.random_blocks(type_name, (21, n), rng)
        x = rng.standard_normal((R, n)).astype(np.float32)
        layers.clear()
        many = o.mul_mv(w, type_name, x)
        what = f"mul_mv_xr {type_name} n={n} R={R} uniform={uniform}"
        assert sum(layers) == chunks and (not big_window or len(layers) == dispatches), (what, layers)
        layers.clear()
        one = np.concatenate([o.mul_mv(w, type_name, x[r : r + 1]) for r in range(R)])
        assert layers == [1] * R
        np.testing.assert_array_equal(many, one, err_msg=what)
        close(many, ref.mul_mv(w, type_name, x), rng, TOL[type_name], what)


@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K", "Q5_0", "IQ4_XS", "IQ3_S"])
def test_x_shuffle_keeps_the_bits(rng, type_name):
    """x from a storage buffer read once per subgroup and shuffled to the lanes (mul_mv.comp
    X_SHUFFLE, where the device allows it): the same bits as each lane reading it, for the grouped
    experts (units of 32 and of 16 weights) and the dense kernel with x in a storage buffer."""
    o = VulkanOps(reduce="none")
    if not o.k.x_shuffle:
        pytest.skip("device without a one-subgroup workgroup of >= 8 lanes with shuffle")
    n = n_in(type_name, 2)
    E, k, R = 4, 2, 21
    we = ref.random_blocks(type_name, (E, 75, n), rng)
    w = ref.random_blocks(type_name, (75, n), rng)
    ids = np.stack([rng.choice(E, k, replace=False) for _ in range(R)]).astype(np.int32)
    wts = rng.random((R, k)).astype(np.float32)
    x, xe = rng.standard_normal((R, n)).astype(np.float32), rng.standard_normal((R, k, n)).astype(np.float32)
    o.k.mv_xr_uniform = False
    got = {}
    for on in (True, False):
        o.k.x_shuffle = on
        with Spy(o.k, "mul_mv_id_xr") as spy:
            got[on] = [o.mul_mv_id(we, type_name, xe, ids, wts, "sum"), o.mul_mv_id(we, type_name, x, ids, wts, "slots"),
                       o.mul_mv(w, type_name, x)]
        assert spy.calls == 2
    for a, b, what in zip(got[True], got[False], ("grouped sum", "grouped slots", "dense, x storage")):
        np.testing.assert_array_equal(a, b, err_msg=f"{type_name} {what}: shuffled x against read x")
    close(got[True][2], ref.mul_mv(w, type_name, x), rng, TOL[type_name], f"mul_mv_xr {type_name} x shuffled")


def test_mul_mv_rows_accumulate_into_a_strided_y(cpu_ops, rng):
    """y (+)= W @ x with y rows wider than W's output (the graph's fused linears)."""
    k, dev = cpu_ops.k, cpu_ops.dev
    w_raw = ref.random_blocks("Q4_K", (40, 256), rng)
    w = cpu_ops._weights(w_raw, "Q4_K", (40, 256))
    x = rng.standard_normal((11, 256)).astype(np.float32)
    y0 = rng.standard_normal((11, 64)).astype(np.float32)
    xs, ys = cpu_ops._in(x), cpu_ops._in(y0)
    seq = dev.sequence()
    k.mul_mv(seq, w, xs, ys, 11, 256, 64, accumulate=True)
    seq.run()
    seq.close()
    got = ys.buffer.read(np.float32, (11, 64), ys.offset)
    want = y0.copy()
    want[:, :40] += ref.mul_mv(w_raw, "Q4_K", x)
    close(got, want, rng, TOL["Q4_K"], "mul_mv_xr accumulate")


@pytest.mark.parametrize("type_name", SUPPORTED_TYPES)
def test_mul_mv_id_grouped_every_type(cpu_ops, rng, type_name):
    """Routed experts grouped per expert: 13 tokens x 2 of 4 experts (6.5 slots per expert: the
    grouped path, width 8, experts with more slots than that take two passes)."""
    n = n_in(type_name)
    E, k, R = 4, 2, 13
    we = ref.random_blocks(type_name, (E, 19, n), rng)
    ids = np.stack([rng.choice(E, k, replace=False) for _ in range(R)]).astype(np.int32)
    ids[:9, 0] = 1  # expert 1 gets at least 9 slots
    ids[:9, 1] = np.where(ids[:9, 1] == 1, 2, ids[:9, 1])
    wts = rng.random((R, k)).astype(np.float32)
    for mode, shape in (("slots", (R, n)), ("weighted", (R, k, n)), ("sum", (R, k, n))):
        x = rng.standard_normal(shape).astype(np.float32)
        poison_scratch(cpu_ops, R * k * 19 * 4)
        with Spy(cpu_ops.k, "mul_mv_id_xr") as spy:
            got = cpu_ops.mul_mv_id(we, type_name, x, ids, wts, mode)
        assert spy.calls == (type_name not in MV_WHOLE_UNIT)
        close(got, ref.mul_mv_id(we, type_name, x, ids, wts, mode), rng, TOL[type_name],
              f"mul_mv_id_xr {mode} {type_name}")


@pytest.mark.parametrize("R", [2, 9, 64])
def test_mul_mv_id_grouped_or_per_slot(cpu_ops, rng, R):
    """The 0.9B file's shape, 64 experts top 8 (smaller rows): per slot below 4 slots per expert
    on average (verify rows), grouped above (a prefill chunk); both against numpy."""
    E, k, n = 64, 8, 256
    we = ref.random_blocks("Q4_K", (E, 16, n), rng)
    ids = np.stack([rng.choice(E, k, replace=False) for _ in range(R)]).astype(np.int32)
    wts = rng.random((R, k)).astype(np.float32)
    x = rng.standard_normal((R, k, n)).astype(np.float32)
    poison_scratch(cpu_ops, R * k * 16 * 4)
    with Spy(cpu_ops.k, "mul_mv_id_xr") as spy:
        got = cpu_ops.mul_mv_id(we, "Q4_K", x, ids, wts, "sum")
    assert spy.calls == (R * k >= cpu_ops.k.mv_id_xr_min_slots * E) == (R == 64)
    close(got, ref.mul_mv_id(we, "Q4_K", x, ids, wts, "sum"), rng, TOL["Q4_K"], f"mul_mv_id sum R={R}")


def test_mul_mv_id_grouped_in_parts(rng):
    """Experts bound in parts (two per binding): each part's dispatch takes its own experts'
    slots; moe_sum adds the slots of every part."""
    o = VulkanOps(reduce="none", max_part_bytes=PART_BYTES)
    k, R = 2, 12
    we, ids, wts, xe = experts_in_parts(rng, R, k=k)
    for mode in ("slots", "sum"):
        poison_scratch(o, R * k * 8 * 4)
        with Spy(o.k, "mul_mv_id_xr") as spy:
            got = o.mul_mv_id(we, "Q4_K", xe, ids, wts, mode)
        assert spy.calls == 1
        close(got, ref.mul_mv_id(we, "Q4_K", xe, ids, wts, mode), rng, TOL["Q4_K"], f"mul_mv_id_xr parts {mode}")


def check_shared_expert_sum(o: VulkanOps, rng, R: int, kernel: str) -> None:
    """The shared expert as the graph records it: a 2-expert tensor whose one part holds expert
    0; slot 1 (expert 1, weight 0) is never computed and must not be added (its scratch row
    stays NaN). `kernel`: the Kernels method that must take the product."""
    from onebit.backends.vulkan.kernels import DeviceTensor, Part
    n, m = 256, 24
    raw = ref.random_blocks("Q8_0", (m, n), rng)
    w = o._weights(raw, "Q8_0", (m, n))
    (part,) = w.parts
    as_expert = DeviceTensor(w.name, w.type_name, (2, m, n), (Part(part.slice, 0, 1),))
    x = rng.standard_normal((R, n)).astype(np.float32)
    ids = np.tile(np.array([[0, 1]], np.int32), (R, 1))
    wts = np.stack([rng.random(R), np.zeros(R)], 1).astype(np.float32)
    xs, ids_s, wts_s = o._in(x), o._in(ids, np.int32), o._in(wts)
    y = o._out((R, m))
    poison_scratch(o, 64 * 1024)
    seq = o.dev.sequence()
    with Spy(o.k, kernel) as spy:
        o.k.mul_mv_id(seq, as_expert, xs, y[0], ids_s, wts_s, R, 2, n, 0, m, mode="sum")
    assert spy.calls == 1
    seq.run()
    seq.close()
    got = y[0].buffer.read(np.float32, (R, m), y[0].offset)
    close(got, wts[:, :1] * ref.mul_mv(raw, "Q8_0", x), rng, TOL["Q8_0"], f"shared expert as {kernel} sum")


def test_mul_mv_id_grouped_sum_skips_experts_in_no_part(cpu_ops, rng):
    check_shared_expert_sum(cpu_ops, rng, 8, "mul_mv_id_xr")


def test_mul_mv_rows_off_is_the_per_row_mat_vec(rng):
    """mv_xrows 0 (or 1): products over several rows stay on the per-row mat-vec (grid z = rows),
    as on GPUs; still right against numpy."""
    o = VulkanOps(reduce="none")
    o.k.mv_xrows = 0
    w = ref.random_blocks("Q4_K", (37, 512), rng)
    x = rng.standard_normal((5, 512)).astype(np.float32)
    we = ref.random_blocks("Q4_K", (4, 19, 512), rng)
    ids = np.stack([rng.choice(4, 2, replace=False) for _ in range(13)]).astype(np.int32)
    wts = rng.random((13, 2)).astype(np.float32)
    xe = rng.standard_normal((13, 2, 512)).astype(np.float32)
    with Spy(o.k, "mul_mv_xr") as spy, Spy(o.k, "mul_mv_id_xr") as spy_id:
        close(o.mul_mv(w, "Q4_K", x), ref.mul_mv(w, "Q4_K", x), rng, TOL["Q4_K"], "per-row mul_mv")
        close(o.mul_mv_id(we, "Q4_K", xe, ids, wts, "sum"), ref.mul_mv_id(we, "Q4_K", xe, ids, wts, "sum"), rng,
              TOL["Q4_K"], "per-slot mul_mv_id")
    assert spy.calls == 0 and spy_id.calls == 0


@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K", "Q8_0", "Q5_0", "F32", "IQ4_XS"])
def test_rows_have_the_one_row_kernels_bits(rng, type_name):
    """A row's result does not depend on how many rows were computed with it: the many-row
    kernels sum term for term as the one-row mat-vec (chunked prefill, ring caches and streamed
    experts are compared bit for bit with unchunked runs). Dense and all three expert modes."""
    o = VulkanOps(reduce="none")
    n = n_in(type_name, 4)
    w = ref.random_blocks(type_name, (37, n), rng)
    x = rng.standard_normal((11, n)).astype(np.float32)
    many = o.mul_mv(w, type_name, x)
    one = np.concatenate([o.mul_mv(w, type_name, x[r : r + 1]) for r in range(11)])
    np.testing.assert_array_equal(many, one, err_msg=f"mul_mv {type_name}: 11 rows against one at a time")
    E, k, R = 4, 2, 12
    we = ref.random_blocks(type_name, (E, 19, n), rng)
    ids = np.stack([rng.choice(E, k, replace=False) for _ in range(R)]).astype(np.int32)
    wts = rng.random((R, k)).astype(np.float32)
    for mode, shape in (("slots", (R, n)), ("weighted", (R, k, n)), ("sum", (R, k, n))):
        xe = rng.standard_normal(shape).astype(np.float32)
        with Spy(o.k, "mul_mv_id_xr") as spy:
            grouped = o.mul_mv_id(we, type_name, xe, ids, wts, mode)
        assert spy.calls == 1
        per_token = np.concatenate([o.mul_mv_id(we, type_name, xe[t : t + 1], ids[t : t + 1], wts[t : t + 1], mode)
                                    for t in range(R)])
        np.testing.assert_array_equal(grouped, per_token, err_msg=f"mul_mv_id {mode} {type_name}: grouped "
                                      "against one token at a time")
