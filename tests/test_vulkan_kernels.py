"""Every Vulkan kernel against its numpy twin (onebit/backends/vulkan/reference.py).

Fresh random data each run (the seed is in every failure message); outputs are poisoned with
NaN (or -1 for ids) before the kernel runs, so an element it never writes fails. Runs on
whatever device open_device() picks: lavapipe here and in CI.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from onebit.backends.vulkan import reference as ref
from onebit.backends.vulkan.device import VulkanKernelError
from onebit.backends.vulkan.kernels import MV_WHOLE_UNIT, MV_WINDOW, SUPPORTED_TYPES, shader_qk
from onebit.backends.vulkan.ops import VulkanOps

REDUCE_MODES = ("none", "subgroup", "shmem")

# Relative tolerance (of the largest |reference| value) per weight type. Both sides dequantize
# to the same float32 weights; what differs is the order of float32 sums, so every type gets
# the same bound, a few hundred ulps of the output's scale.
TOL = {t: 2e-5 for t in SUPPORTED_TYPES}


@pytest.fixture(scope="module")
def ops():
    return VulkanOps()


# Mat-vec is built three ways (shaders/variants.py REDUCE_MODES): "none" (thread per row, the
# default on CPU devices such as lavapipe), "subgroup" (the default on GPUs) and "shmem" (GPUs
# without subgroup arithmetic). All run here, whatever the device would pick.
@pytest.fixture(scope="module")
def ops_by_reduce():
    return {mode: VulkanOps(reduce=mode) for mode in REDUCE_MODES}


class SeededRng:
    """A numpy Generator that remembers its seed, for the failure message."""

    def __init__(self, seed: int):
        self.seed = seed
        self._gen = np.random.default_rng(seed)

    def __getattr__(self, name):
        return getattr(self._gen, name)


@pytest.fixture
def rng():
    # reproducible; ONEBIT_TEST_SEED=N tries other inputs
    return SeededRng(int(os.environ.get("ONEBIT_TEST_SEED", "20261201")))


def close(got, want, rng, tol=2e-5, what=""):
    scale = float(np.abs(want).max()) if np.size(want) else 1.0
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * scale, err_msg=f"{what} (seed {rng.seed})")


# Two Q4_K experts of 8 rows per binding, for experts_in_parts' weights.
PART_BYTES = 2 * 8 * 144


def experts_in_parts(rng, rows: int, n_experts: int = 5, k: int = 2):
    """Q4_K experts [n_experts, 8, 256] (bound in parts under PART_BYTES), each of `rows` tokens
    routed to k of them: (weights, ids, routing weights, x per slot)."""
    we = ref.random_blocks("Q4_K", (n_experts, 8, 256), rng)
    ids = np.stack([rng.choice(n_experts, k, replace=False) for _ in range(rows)]).astype(np.int32)
    wts = rng.random((rows, k)).astype(np.float32)
    xe = rng.standard_normal((rows, k, 256)).astype(np.float32)
    return we, ids, wts, xe


def n_in(type_name: str, blocks: int = 2) -> int:
    return max(shader_qk(type_name), 32) * blocks


# -- matrix products, every weight type --------------------------------------------------------


@pytest.mark.parametrize("reduce", ["none", "subgroup"])
@pytest.mark.parametrize("type_name", SUPPORTED_TYPES)
def test_mul_mv_decode(ops_by_reduce, rng, type_name, reduce):
    w = ref.random_blocks(type_name, (37, n_in(type_name)), rng)  # 37 rows: not a multiple of the rows per workgroup
    x = rng.standard_normal((1, n_in(type_name))).astype(np.float32)
    close(ops_by_reduce[reduce].mul_mv(w, type_name, x), ref.mul_mv(w, type_name, x), rng, TOL[type_name],
          f"mul_mv {type_name} {reduce}")


# Blocks whose size is not a multiple of 4 bytes are read as aligned words (shaders/dequant.glsl
# field_word), so a tensor's last block may need bytes past its end: the binding is rounded up
# (kernels.bound_bytes). One block per row and an odd row count put the tensor's end mid-word.
@pytest.mark.parametrize("type_name", SUPPORTED_TYPES)
def test_weights_ending_mid_word(ops_by_reduce, rng, type_name):
    o = ops_by_reduce["none"]
    n = max(shader_qk(type_name), 32)
    x = rng.standard_normal((2, n)).astype(np.float32)
    w = ref.random_blocks(type_name, (5, n), rng)
    close(o.mul_mv(w, type_name, x), ref.mul_mv(w, type_name, x), rng, TOL[type_name], f"mul_mv {type_name} tail")
    ids = np.array([[0, 2], [2, 1]], np.int32)
    wts = rng.random((2, 2)).astype(np.float32)
    we = ref.random_blocks(type_name, (3, 5, n), rng)
    close(o.mul_mv_id(we, type_name, x, ids, wts, "sum"), ref.mul_mv_id(we, type_name, x, ids, wts, "sum"), rng,
          TOL[type_name], f"mul_mv_id {type_name} tail")
    rows = np.array([4, 0, 4], np.int32)
    close(o.get_rows(w, type_name, rows), ref.get_rows(w, type_name, rows), rng, TOL[type_name],
          f"get_rows {type_name} tail")


# The one-row mat-vec of these types reads each block as the 16-byte words around it
# (shaders/dequant.glsl block_window) and picks its words at the block's offset in them: 768
# columns (3 blocks a row) put a row's blocks at offsets that differ from row to row, 2048 (8)
# at the same offsets in every row (Kernels._w_aligned: the offset from the block's index).
# Dense (37 rows; thread per row, in parts, and split across a subgroup) and experts, against
# numpy; the last block ends mid-word. IQ1_M keeps the many-row kernel, whose sums must stay
# the one-row kernel's bit for bit.
BLOCK_WINDOW_TYPES = sorted(MV_WINDOW)


@pytest.mark.parametrize("cols", [768, 2048])
@pytest.mark.parametrize("type_name", BLOCK_WINDOW_TYPES)
def test_mul_mv_block_windows(ops_by_reduce, rng, type_name, cols):
    x = rng.standard_normal((2, cols)).astype(np.float32)
    w = ref.random_blocks(type_name, (37, cols), rng)
    in_parts = VulkanOps(reduce="none", max_part_bytes=8 * w[0].nbytes)
    for o in (ops_by_reduce["none"], in_parts, ops_by_reduce["subgroup"]):
        assert o.k._w_aligned(o._weights(w, type_name, (37, cols))) == (cols == 2048)
        close(o.mul_mv(w, type_name, x), ref.mul_mv(w, type_name, x), rng, TOL[type_name],
              f"mul_mv {type_name} cols={cols} {o.k.reduce} parts={o.max_part_bytes}")
    o = ops_by_reduce["none"]
    if type_name not in MV_WHOLE_UNIT:  # 2 rows: the many-row kernel
        one = np.concatenate([o.mul_mv(w, type_name, x[r : r + 1]) for r in range(2)])
        np.testing.assert_array_equal(o.mul_mv(w, type_name, x), one, err_msg=f"{type_name} many-row bits")
    ids = np.array([[0, 2], [2, 1]], np.int32)
    wts = rng.random((2, 2)).astype(np.float32)
    we = ref.random_blocks(type_name, (3, 13, cols), rng)
    close(o.mul_mv_id(we, type_name, x, ids, wts, "sum"), ref.mul_mv_id(we, type_name, x, ids, wts, "sum"), rng,
          TOL[type_name], f"mul_mv_id {type_name} cols={cols}")


# Every type's thread-per-row mat-vec reads x from a uniform buffer when x fits one
# (the `_ux` variants, kernels.Kernels._mv_variant) and from a storage buffer when it does not:
# both paths, against numpy, and the choice itself.
X_UNIFORM_TYPES = list(SUPPORTED_TYPES)


@pytest.mark.parametrize("big", [False, True])
@pytest.mark.parametrize("type_name", X_UNIFORM_TYPES)
def test_mul_mv_x_uniform_or_storage(ops_by_reduce, rng, type_name, big):
    o = ops_by_reduce["none"]
    n = 6144 if big else 512  # 3 rows of x: 72 KiB (over the 64 KiB uniform buffer) or 6 KiB
    x = rng.standard_normal((3, n)).astype(np.float32)
    xs = o._in(x)
    name, uniform = o.k._mv_variant(f"mul_mv_{type_name}_none", type_name, 4, xs)
    assert (name.endswith("_ux"), uniform[:1] == (1,)) == (not big, not big), (name, uniform)
    w = ref.random_blocks(type_name, (37, n), rng)
    close(o.mul_mv(w, type_name, x), ref.mul_mv(w, type_name, x), rng, TOL[type_name], f"mul_mv {type_name} n={n}")
    E, k = 4, 2
    we = ref.random_blocks(type_name, (E, 24, n), rng)
    ids = np.stack([rng.choice(E, k, replace=False) for _ in range(3)]).astype(np.int32)
    wts = rng.random((3, k)).astype(np.float32)
    close(o.mul_mv_id(we, type_name, x, ids, wts, "sum"), ref.mul_mv_id(we, type_name, x, ids, wts, "sum"), rng,
          TOL[type_name], f"mul_mv_id sum {type_name} n={n}")


@pytest.mark.parametrize("reduce", REDUCE_MODES)
def test_mul_mv_several_rows(ops_by_reduce, rng, reduce):
    w = ref.random_blocks("Q5_K", (70, 512), rng)
    x = rng.standard_normal((3, 512)).astype(np.float32)
    close(ops_by_reduce[reduce].mul_mv(w, "Q5_K", x), ref.mul_mv(w, "Q5_K", x), rng, TOL["Q5_K"], f"mul_mv {reduce}")


@pytest.mark.parametrize("type_name", SUPPORTED_TYPES)
def test_mul_mm_prefill(ops, rng, type_name):
    w = ref.random_blocks(type_name, (45, n_in(type_name)), rng)  # partial 32x32 tiles both ways
    x = rng.standard_normal((35, n_in(type_name))).astype(np.float32)
    close(ops.mul_mm(w, type_name, x), ref.mul_mm(w, type_name, x), rng, TOL[type_name], f"mul_mm {type_name}")


@pytest.mark.parametrize("type_name", SUPPORTED_TYPES)
def test_get_rows(ops, rng, type_name):
    w = ref.random_blocks(type_name, (20, n_in(type_name)), rng)
    ids = rng.integers(0, 20, 5)
    # one multiply-add per weight: equal up to the rounding of a fused multiply-add
    close(ops.get_rows(w, type_name, ids), ref.get_rows(w, type_name, ids), rng, 1e-6, f"get_rows {type_name}")


@pytest.mark.parametrize("reduce", ["none", "subgroup"])
@pytest.mark.parametrize("type_name", SUPPORTED_TYPES)
def test_mul_mv_id_fused_weighted_sum(ops_by_reduce, rng, type_name, reduce):
    """The down projection: per-slot inputs, routing weights fused, summed over the k experts."""
    E, out, k, R = 5, 24, 2, 3
    w = ref.random_blocks(type_name, (E, out, n_in(type_name)), rng)
    ids = np.stack([rng.choice(E, k, replace=False) for _ in range(R)]).astype(np.int32)
    wts = rng.random((R, k)).astype(np.float32)
    x = rng.standard_normal((R, k, n_in(type_name))).astype(np.float32)
    got = ops_by_reduce[reduce].mul_mv_id(w, type_name, x, ids, wts, "sum")
    want = ref.mul_mv_id(w, type_name, x, ids, wts, "sum")
    close(got, want, rng, TOL[type_name], f"mul_mv_id sum {type_name} {reduce}")


@pytest.mark.parametrize("reduce", REDUCE_MODES)
@pytest.mark.parametrize("mode", ["slots", "weighted"])
def test_mul_mv_id_per_slot(ops_by_reduce, rng, mode, reduce):
    """Gate/up: one x row shared by every slot, output [R, k, out]."""
    E, out, k, R = 6, 40, 3, 2
    w = ref.random_blocks("Q4_K", (E, out, 256), rng)
    ids = np.stack([rng.choice(E, k, replace=False) for _ in range(R)]).astype(np.int32)
    wts = rng.random((R, k)).astype(np.float32)
    x = rng.standard_normal((R, 256)).astype(np.float32)
    close(ops_by_reduce[reduce].mul_mv_id(w, "Q4_K", x, ids, wts, mode), ref.mul_mv_id(w, "Q4_K", x, ids, wts, mode),
          rng, TOL["Q4_K"], f"mul_mv_id {mode} {reduce}")


@pytest.mark.parametrize("reduce", ["none", "subgroup"])
def test_weights_bound_in_parts(rng, reduce):
    """Tensors larger than maxStorageBufferRange are bound in parts (here: tiny parts)."""
    ops = VulkanOps(reduce=reduce, max_part_bytes=4 * 210)  # 4 rows of one Q6_K block per binding
    w = ref.random_blocks("Q6_K", (21, 256), rng)
    x = rng.standard_normal((3, 256)).astype(np.float32)
    close(ops.mul_mv(w, "Q6_K", x), ref.mul_mv(w, "Q6_K", x), rng, TOL["Q6_K"], "mul_mv parts")
    close(ops.mul_mm(w, "Q6_K", x), ref.mul_mm(w, "Q6_K", x), rng, TOL["Q6_K"], "mul_mm parts")
    ids = np.array([20, 0, 7, 4, 13])
    close(ops.get_rows(w, "Q6_K", ids), ref.get_rows(w, "Q6_K", ids), rng, 1e-6, "get_rows parts")
    ops = VulkanOps(reduce=reduce, max_part_bytes=PART_BYTES)
    we, ids, wts, xe = experts_in_parts(rng, 4)
    for mode in ("slots", "sum"):
        close(ops.mul_mv_id(we, "Q4_K", xe, ids, wts, mode), ref.mul_mv_id(we, "Q4_K", xe, ids, wts, mode), rng,
              TOL["Q4_K"], f"mul_mv_id parts {mode}")


def test_row_length_must_be_whole_blocks(ops, rng):
    w = ref.random_blocks("F32", (4, 24), rng)  # 24 is not a multiple of 16
    with pytest.raises(VulkanKernelError, match="mul_mv_F32.*multiple of 16"):
        ops.mul_mv(w, "F32", np.zeros((1, 24), np.float32))


# -- the rest of the step --------------------------------------------------------------------


@pytest.mark.parametrize("n", [96, 90])  # rows read as vec4s (rms_norm4) / as floats
def test_rms_norm(ops, rng, n):
    x = rng.standard_normal((5, n)).astype(np.float32) * 3
    w = rng.standard_normal(n).astype(np.float32)
    close(ops.rms_norm(x, w, 1e-6), ref.rms_norm(x, w, 1e-6), rng, 1e-5, f"rms_norm {n}")


@pytest.mark.parametrize("neox", [False, True])
@pytest.mark.parametrize("n_rot", [64, 32])
def test_rope(ops, rng, neox, n_rot):
    x = rng.standard_normal((3, 4, 64)).astype(np.float32)
    pos = np.array([0, 9, 300])
    # float32 angles (pos * theta^(-2i/n)) against numpy's float64: error grows with position
    close(ops.rope(x, pos, n_rot, 10000.0, neox, 0.5), ref.rope(x, pos, n_rot, 10000.0, neox, 0.5), rng, 5e-5,
          f"rope neox={neox} n_rot={n_rot}")


@pytest.mark.parametrize("neox", [False, True])
def test_rope_frequency_factors(ops, rng, neox):
    """Llama 3 rope scaling: each frequency divided by its factor (`rope_freqs.weight`)."""
    x = rng.standard_normal((3, 4, 64)).astype(np.float32)
    pos = np.array([0, 9, 300])
    factors = rng.uniform(1.0, 8.0, 32).astype(np.float32)
    want = ref.rope(x, pos, 64, 500000.0, neox, 1.0, factors)
    close(ops.rope(x, pos, 64, 500000.0, neox, 1.0, factors), want, rng, 5e-5, f"rope factors neox={neox}")
    # the twin: dividing the frequencies is the same rotation as with a per-dim position scale
    inv = 500000.0 ** (-np.arange(0, 64, 2) / 64) / factors
    ang = pos[:, None] * inv[None, :]
    a, b = (x[..., :32], x[..., 32:]) if neox else (x[..., 0::2], x[..., 1::2])
    c, s = np.cos(ang)[:, None], np.sin(ang)[:, None]
    got = np.concatenate([a * c - b * s, a * s + b * c], -1) if neox else \
        np.stack([a * c - b * s, a * s + b * c], -1).reshape(x.shape)
    np.testing.assert_allclose(want, got, rtol=0, atol=1e-5)
    assert np.abs(want - ref.rope(x, pos, 64, 500000.0, neox)).max() > 0.1  # the factors matter here


@pytest.mark.parametrize("k", [4, 12])  # 12: more than a CPU device's one-subgroup workgroup
@pytest.mark.parametrize("norm", [False, True])
def test_router_softmax_topk(ops, rng, norm, k):
    logits = rng.standard_normal((6, 60)).astype(np.float32)
    ids, w = ops.router(logits, k, norm)
    want_ids, want_w = ref.router(logits, k, norm)
    np.testing.assert_array_equal(ids, want_ids, err_msg=f"seed {rng.seed}")
    close(w, want_w, rng, 1e-5, "router weights")


def test_router_ties_pick_the_lower_expert(ops, rng):
    logits = np.zeros((1, 8), np.float32)
    logits[0, [2, 5, 6]] = 1.0
    ids, _ = ops.router(logits, 2, True)
    np.testing.assert_array_equal(ids, ref.router(logits, 2, True)[0])


@pytest.mark.parametrize("groups,used,k", [(1, 1, 4), (4, 2, 4), (8, 3, 4), (1, 1, 12)])
@pytest.mark.parametrize("norm", [False, True])
def test_router_sigmoid_topk(ops, rng, norm, groups, used, k):
    """GLM-4.5's router (sigmoid scores, correction bias for the choice only, expert groups)
    against its numpy twin; the bias must change the choice, and the weights stay unbiased.
    k = 12: more than a CPU device's one-subgroup workgroup."""
    logits = rng.standard_normal((6, 64)).astype(np.float32) * 2
    bias = rng.standard_normal(64).astype(np.float32) * 0.3
    ids, w = ops.sigmoid_router(logits, bias, k, norm, 2.5, groups, used)
    want_ids, want_w = ref.sigmoid_router(logits, bias, k, norm, 2.5, groups, used)
    np.testing.assert_array_equal(ids, want_ids, err_msg=f"seed {rng.seed}")
    close(w, want_w, rng, 1e-5, "sigmoid router weights")
    s = 1 / (1 + np.exp(-logits.astype(np.float64)))
    direct = np.take_along_axis(s, want_ids, -1) * 2.5
    if norm:
        direct = 2.5 * direct / direct.sum(-1, keepdims=True)
    np.testing.assert_allclose(want_w, direct, rtol=1e-5)  # weights: the unbiased scores
    assert not np.array_equal(want_ids, ref.sigmoid_router(logits, None, k, norm, 2.5, groups, used)[0])
    if groups > 1:  # every chosen expert lies in one of the `used` groups picked
        assert all(len(set(row // (64 // groups))) <= used for row in want_ids)
        assert not np.array_equal(want_ids, ref.sigmoid_router(logits, bias, k, norm, 2.5)[0])


@pytest.mark.parametrize("sigmoid", [False, True])
def test_router_writes_pool_slots_and_flags_a_miss(ops, rng, sigmoid):
    """SLOT_LUT (shaders/slot_lut.glsl): with the pool's table [layers, E] of slots (-1: not
    pooled), the router also writes table[layer, id] per chosen expert and sets the miss flag
    exactly when one of them is -1; ids and weights are those of the plain router."""
    logits = rng.standard_normal((5, 64)).astype(np.float32)
    lut = rng.permutation(3 * 64).reshape(3, 64).astype(np.int32)
    plain = ops.sigmoid_router(logits, None, 4, True) if sigmoid else ops.router(logits, 4, True)

    def run(table):
        if sigmoid:
            return ops.sigmoid_router(logits, None, 4, True, lut=table, layer=2)
        return ops.router(logits, 4, True, lut=table, layer=2)

    ids, w, slots, miss = run(lut)
    np.testing.assert_array_equal(ids, plain[0])
    np.testing.assert_array_equal(w, plain[1])
    np.testing.assert_array_equal(slots, lut[2][ids], err_msg=f"seed {rng.seed}")
    assert miss[0] == 0
    holes = lut.copy()
    holes[2, ids[3, 1]] = -1  # one chosen expert not pooled; other layers' holes do not count
    holes[1, :] = -1
    ids, w, slots, miss = run(holes)
    assert miss[0] == 1
    want = lut[2][ids]
    want[ids == ids[3, 1]] = 0  # (a missing expert reads slot 0: in bounds)
    np.testing.assert_array_equal(slots, want)
    holes[2, ids[3, 1]] = lut[2, ids[3, 1]]
    assert run(holes)[3][0] == 0


@pytest.mark.parametrize("op", ["add", "mul", "swiglu"])
def test_binary(ops, rng, op):
    a = rng.standard_normal((3, 100)).astype(np.float32)
    b = rng.standard_normal((3, 100)).astype(np.float32)
    close(getattr(ops, op)(a, b), getattr(ref, op)(a, b), rng, 1e-6, op)


def test_geglu(ops, rng):
    a = rng.standard_normal((3, 100)).astype(np.float32) * 4
    a[0, :4] = [-100.0, -30.0, 30.0, 100.0]  # exp(-2u) overflows or vanishes: no NaN
    b = rng.standard_normal((3, 100)).astype(np.float32)
    want = ref.geglu(a, b)
    u = np.sqrt(2 / np.pi) * (a.astype(np.float64) + 0.044715 * a.astype(np.float64) ** 3)
    np.testing.assert_allclose(want, 0.5 * a * (1 + np.tanh(u)) * b, rtol=1e-6, atol=1e-6)  # the tanh form
    close(ops.geglu(a, b), want, rng, 1e-6, "geglu")


def test_softcap(ops, rng):
    a = rng.standard_normal((5, 70)).astype(np.float32) * 20
    a[0, :3] = [-1e4, 0.0, 1e4]
    want = ref.softcap(a, 30.0)
    np.testing.assert_allclose(want, 30.0 * np.tanh(a.astype(np.float64) / 30.0), rtol=1e-6, atol=1e-6)
    close(ops.softcap(a, 30.0), want, rng, 1e-6, "softcap")


def test_silu(ops, rng):
    a = rng.standard_normal((7, 33)).astype(np.float32) * 4
    close(ops.silu(a), ref.silu(a), rng, 1e-6, "silu")


def test_argmax(ops, rng):
    x = rng.standard_normal((4, 1000)).astype(np.float32)
    x[1, [17, 400]] = 10.0  # a tie: the lower index wins
    np.testing.assert_array_equal(ops.argmax(x), ref.argmax(x), err_msg=f"seed {rng.seed}")


@pytest.mark.parametrize("n", [1, 7, 512, 151_936])
def test_greedy_next(ops, rng, n):
    """A greedy step's device tail: argmax (ties: the lower index) as the next token, the
    position moved on, and NaN / inf anywhere in the row flagged."""
    x = rng.standard_normal(n).astype(np.float32)
    cases = [x]
    if n > 1:
        tie = x.copy()
        tie[[n // 3, n - 1]] = 50.0  # a tie: the lower index wins
        cases.append(tie)
        for bad in (np.nan, np.inf, -np.inf):
            y = x.copy()
            y[rng.integers(0, n)] = bad
            cases.append(y)
    cases.append(np.full(n, np.nan, np.float32))
    for c in cases:
        got, want = ops.greedy_next(c, 41), ref.greedy_next(c, 41)
        assert got == want, f"seed {rng.seed}"
        if not want[3]:
            assert got[0] == int(np.argmax(c))


@pytest.mark.parametrize("n", [1, 5, 1023, 1024, 1025, 151_936, 3 * 262_144 + 7])
def test_nonfinite(ops, rng, n):
    """The forward's check of its logits: NaN, +inf or -inf anywhere (first, last, inside, at a
    workgroup's edge) is flagged, as numpy's isfinite says; finite values, the largest and the
    subnormal ones, are not."""
    x = rng.standard_normal(n).astype(np.float32)
    cases = [x]
    big = x.copy()
    big[0], big[-1] = np.finfo(np.float32).max, -np.finfo(np.float32).tiny / 4
    cases.append(big)
    for bad in (np.nan, np.inf, -np.inf):
        for at in {0, n - 1, int(rng.integers(0, n)), min(1024, n - 1)}:
            y = x.copy()
            y[at] = bad
            cases.append(y)
    for c in cases:
        assert ops.nonfinite(c) == (not np.isfinite(c).all()), f"seed {rng.seed}"


@pytest.mark.parametrize("reduce", ["none", "subgroup"])  # thread per key (CPU) / threads per chunk (GPU)
@pytest.mark.parametrize("S,R,Dv", [(1, 1, 64), (37, 1, 64), (600, 1, 64), (40, 6, 64), (50, 3, 32)])
def test_attention_gqa(ops_by_reduce, rng, S, R, Dv, reduce):
    """Decode (R = 1) over caches shorter and longer than one chunk, causal prefill rows, and
    value heads narrower than key heads."""
    H, Hkv, D = 8, 2, 64
    q = rng.standard_normal((R, H, D)).astype(np.float32)
    k = rng.standard_normal((S, Hkv, D)).astype(np.float32)
    v = rng.standard_normal((S, Hkv, Dv)).astype(np.float32)
    pos = np.arange(S - R, S)
    close(ops_by_reduce[reduce].attention(q, k, v, pos), ref.attention(q, k, v, pos), rng, 1e-5,
          f"attention S={S} R={R} Dv={Dv} {reduce}")


def _attention_by_loops(q, k, v, pos, window):
    """Sliding-window causal GQA attention, one (row, head) at a time: an independent check."""
    R, H, D = q.shape
    S, Hkv, Dv = v.shape
    out = np.zeros((R, H, Dv), np.float64)
    for r in range(R):
        keys = [j for j in range(S) if j <= pos[r] and (window == 0 or j > pos[r] - window)]
        for h in range(H):
            kvh = h // (H // Hkv)
            s = np.array([q[r, h] @ k[j, kvh] for j in keys], np.float64) / np.sqrt(D)
            p = np.exp(s - s.max())
            out[r, h] = (p / p.sum()) @ v[keys, kvh]
    return out.reshape(R, H * Dv)


@pytest.mark.parametrize("reduce", ["none", "subgroup"])
@pytest.mark.parametrize("window", [1, 5, 40, 300])
def test_attention_sliding_window(ops_by_reduce, rng, window, reduce):
    """Rows see only the last `window` positions up to their own: numpy against plain loops,
    the kernel against numpy (decode over a long cache, and prefill rows)."""
    H, Hkv, D, Dv = 4, 2, 32, 32
    for S, R in ((300, 1), (60, 7)):
        q = rng.standard_normal((R, H, D)).astype(np.float32)
        k = rng.standard_normal((S, Hkv, D)).astype(np.float32)
        v = rng.standard_normal((S, Hkv, Dv)).astype(np.float32)
        pos = np.arange(S - R, S)
        want = ref.attention(q, k, v, pos, window)
        np.testing.assert_allclose(want, _attention_by_loops(q, k, v, pos, window), rtol=0, atol=1e-5)
        close(ops_by_reduce[reduce].attention(q, k, v, pos, window), want, rng, 1e-5,
              f"attention window={window} S={S} R={R} {reduce}")


@pytest.mark.parametrize("reduce", ["none", "subgroup"])
def test_attention_scale(ops_by_reduce, rng, reduce):
    """A score scale other than 1/sqrt(D) (Gemma's query_pre_attn_scalar), with a window."""
    H, Hkv, D, S, R = 4, 1, 32, 40, 3
    q = rng.standard_normal((R, H, D)).astype(np.float32)
    k = rng.standard_normal((S, Hkv, D)).astype(np.float32)
    v = rng.standard_normal((S, Hkv, D)).astype(np.float32)
    pos = np.arange(S - R, S)
    want = ref.attention(q, k, v, pos, 4, 0.5)
    np.testing.assert_allclose(want, ref.attention(q * np.float32(0.5 * np.sqrt(D)), k, v, pos, 4), rtol=1e-5,
                               atol=1e-6)
    close(ops_by_reduce[reduce].attention(q, k, v, pos, 4, 0.5), want, rng, 1e-5, f"attention scale {reduce}")


@pytest.mark.parametrize("reduce", ["none", "subgroup"])
@pytest.mark.parametrize("window", [1, 4, 9])
def test_attention_over_a_ring(ops_by_reduce, rng, window, reduce):
    """A sliding-window ring (k, v of S rows holding position p in row p % S, positions far past
    S): the kernel against its numpy twin, and the twin against the same positions in order."""
    H, Hkv, D, Dv, S = 4, 2, 32, 32, window + 8
    for top, R in ((300, 1), (61, 9), (S + 3, 4)):
        q = rng.standard_normal((R, H, D)).astype(np.float32)
        full_k = rng.standard_normal((top, Hkv, D)).astype(np.float32)
        full_v = rng.standard_normal((top, Hkv, Dv)).astype(np.float32)
        held = np.arange(top - S, top)
        k, v = np.zeros((S, Hkv, D), np.float32), np.zeros((S, Hkv, Dv), np.float32)
        k[held % S], v[held % S] = full_k[held], full_v[held]
        pos = np.arange(top - R, top)
        want = ref.attention(q, k, v, pos, window)
        np.testing.assert_array_equal(want, ref.attention(q, full_k, full_v, pos, window))
        close(ops_by_reduce[reduce].attention(q, k, v, pos, window), want, rng, 1e-5,
              f"attention ring window={window} top={top} R={R} {reduce}")


def test_set_rows_wraps_into_a_ring(ops, rng):
    dst = rng.standard_normal((12, 2, 8)).astype(np.float32)
    src = rng.standard_normal((5, 2, 8)).astype(np.float32)
    pos = np.arange(58, 63)  # rows 10, 11, 0, 1, 2
    want = ref.set_rows(dst, src, pos, wrap=True)
    np.testing.assert_array_equal(want[[10, 11, 0, 1, 2]], src)
    np.testing.assert_array_equal(ops.set_rows(dst, src, pos, wrap=True), want)


@pytest.mark.parametrize("n", [64, 256])
def test_hadamard(ops, rng, n):
    x = rng.standard_normal((3, 2, 512)).astype(np.float32)
    close(ops.hadamard(x, n), ref.hadamard(x, n), rng, tol=1e-5, what=f"hadamard {n}")


@pytest.mark.parametrize("type_name", ["F16", "Q8_0", "Q4_0"])
@pytest.mark.parametrize("wrap", [False, True])
def test_set_rows_into_blocks(ops, rng, type_name, wrap):
    """K/V rows quantized into a cache of ggml blocks (--cache-type-k / -v) == quants' quantizer,
    byte for byte; rows of blocks that straddle 32-bit words, written side by side in one
    dispatch, keep their neighbours' bytes. Then read back as the attention reads them."""
    from onebit.formats.quants import QTYPES_BY_NAME

    qt = QTYPES_BY_NAME[type_name]
    # 3 blocks a row: Q8_0 rows of 102 bytes, Q4_0 of 54 (neither a multiple of 4); F16 rows end mid-block
    n = 3 * 32 if type_name != "F16" else 2 * 32 + 16
    dst = qt.quantize(rng.standard_normal((9, n)).astype(np.float32))  # [9, row bytes]
    src = (rng.standard_normal((5, n)) * 3).astype(np.float32)
    src[0, :32] = 0  # an all-zero block: scale 0
    src[1, 5] = 50.0  # one value sets a block's scale
    pos = np.array([12, 4, 5, 6, 1]) if wrap else np.array([3, 4, 5, 6, 8])
    want = ref.set_rows_q(dst, src, pos, type_name, wrap=wrap)
    got = ops.set_rows_q(dst, src, pos, type_name, wrap=wrap)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(ops.kv_rows(want, type_name, n, 20), qt.dequantize(want))
    got = ops.kv_rows(want, type_name, n, 5)  # the rows up to position 5 only (the rest: poison)
    np.testing.assert_array_equal(got[:6], qt.dequantize(want)[:6])
    assert np.isnan(got[6:]).all()


def test_set_rows(ops, rng):
    dst = rng.standard_normal((10, 2, 8)).astype(np.float32)
    src = rng.standard_normal((2, 2, 8)).astype(np.float32)
    pos = np.array([3, 7])
    np.testing.assert_array_equal(ops.set_rows(dst, src, pos), ref.set_rows(dst, src, pos))
