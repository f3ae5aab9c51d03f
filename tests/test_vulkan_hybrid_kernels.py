"""The Gated DeltaNet kernels (cols, sigmoid_mul, gdn_gates, ssm_conv, delta_rule) against
their numpy twins (onebit/backends/vulkan/reference.py), on fresh random inputs with
poisoned outputs, as tests/test_vulkan_kernels.py does for the others."""

from __future__ import annotations

import numpy as np
import pytest

from onebit.backends.vulkan import reference as ref
from onebit.backends.vulkan.ops import VulkanOps


@pytest.fixture(scope="module")
def ops():
    return VulkanOps()


@pytest.fixture
def rng():
    return np.random.default_rng(20261202)


def close(got, want, tol=2e-5):
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * float(np.abs(want).max()))


@pytest.mark.parametrize("shape,c0,w", [((3, 4, 32), 0, 16), ((3, 4, 32), 16, 16), ((5, 128), 64, 64), ((2, 2, 8), 4, 4)])
def test_cols(ops, rng, shape, c0, w):
    a = rng.normal(size=shape).astype(np.float32)
    np.testing.assert_array_equal(ops.cols(a, c0, w), ref.cols(a, c0, w))


def test_sigmoid_mul(ops, rng):
    a, b = (rng.normal(size=(7, 64)).astype(np.float32) * 4 for _ in range(2))
    close(ops.sigmoid_mul(a, b), ref.sigmoid_mul(a, b))


def test_gdn_gates(ops, rng):
    b, a = (rng.normal(size=(9, 8)).astype(np.float32) * 6 for _ in range(2))
    a[0, 0], a[0, 1] = 60.0, -60.0  # softplus far out on both sides
    dt = rng.normal(size=8).astype(np.float32)
    A = -np.exp(rng.uniform(-3, 2.5, size=8)).astype(np.float32)
    got, want = ops.gdn_gates(b, a, dt, A), ref.gdn_gates(b, a, dt, A)
    close(got[0], want[0])
    close(got[1], want[1])


@pytest.mark.parametrize("R", [1, 2, 3, 9])
def test_ssm_conv(ops, rng, R):
    C, K = 96, 4
    x = rng.normal(size=(R, C)).astype(np.float32)
    hist = rng.normal(size=(K - 1, C)).astype(np.float32)
    w = rng.normal(size=(C, K)).astype(np.float32)
    (y, h), (y_ref, h_ref) = ops.ssm_conv(x, hist, w), ref.ssm_conv(x, hist, w)
    close(y, y_ref)
    np.testing.assert_array_equal(h, h_ref)


@pytest.mark.parametrize("tiled", [False, True])
# (256, 1, 1, 128): more loop iterations than lavapipe runs in one invocation (see
# kernels.LOOP_LIMIT): the chunk is split over dispatches
@pytest.mark.parametrize("R,Hk,Hv,D", [(1, 2, 4, 16), (5, 2, 4, 16), (3, 1, 1, 128), (2, 2, 6, 32), (256, 1, 1, 128)])
def test_delta_rule(ops, rng, R, Hk, Hv, D, tiled):
    q, k = (rng.normal(size=(R, Hk, D)).astype(np.float32) for _ in range(2))
    v = rng.normal(size=(R, Hv, D)).astype(np.float32)
    g = -rng.uniform(0, 3, size=(R, Hv)).astype(np.float32)
    beta = rng.uniform(0, 1, size=(R, Hv)).astype(np.float32)
    state = rng.normal(size=(Hv, D, D)).astype(np.float32)
    (o, s), (o_ref, s_ref) = ops.delta_rule(q, k, v, g, beta, state, 1e-6, tiled), \
        ref.delta_rule(q, k, v, g, beta, state, 1e-6, tiled)
    close(o, o_ref, 5e-5)
    close(s, s_ref, 5e-5)


def delta_inputs(rng, R, Hk, Hv, D):
    q, k = (rng.normal(size=(R, Hk, D)).astype(np.float32) for _ in range(2))
    v = rng.normal(size=(R, Hv, D)).astype(np.float32)
    g = -rng.uniform(0, 0.5, size=(R, Hv)).astype(np.float32)  # decays as the models' gates give
    beta = rng.uniform(0, 1, size=(R, Hv)).astype(np.float32)
    state = rng.normal(size=(Hv, D, D)).astype(np.float32)
    return q, k, v, g, beta, state


# rows not a multiple of the block, fewer rows than one block, one row, several head counts,
# and more rows than one dispatch takes (256 x 128: past lavapipe's loop limit, kernels.LOOP_LIMIT)
CHUNK_CASES = [(70, 2, 4, 16, 32), (33, 1, 1, 128, 32), (20, 2, 6, 32, 8), (1, 2, 4, 16, 32),
               (47, 4, 8, 64, 16), (64, 2, 2, 256, 16), (40, 1, 2, 128, 32), (256, 1, 1, 128, 32)]


@pytest.mark.parametrize("tiled", [False, True])
@pytest.mark.parametrize("R,Hk,Hv,D,C", CHUNK_CASES)
def test_delta_chunk_twin(ops, rng, R, Hk, Hv, D, C, tiled):
    """delta_chunk.comp == its numpy twin (the numpy backend's chunked form), output and state."""
    args = delta_inputs(rng, R, Hk, Hv, D)
    (o, s), (o_ref, s_ref) = ops.delta_chunk(*args, 1e-6, tiled, C), ref.delta_chunk(*args, 1e-6, tiled, C)
    close(o, o_ref, 1e-4)
    close(s, s_ref, 1e-4)


@pytest.mark.parametrize("R,Hk,Hv,D,C", CHUNK_CASES)
def test_delta_chunk_equals_step(ops, rng, R, Hk, Hv, D, C):
    """The chunked kernel == the step kernel over the same rows (float32), output and final state."""
    args = delta_inputs(rng, R, Hk, Hv, D)
    (o, s), (o_step, s_step) = ops.delta_chunk(*args, 1e-6, False, C), ops.delta_rule(*args, 1e-6, False)
    close(o, o_step, 1e-4)
    close(s, s_step, 1e-4)


def test_delta_chunk_limits(ops, rng):
    args = delta_inputs(rng, 4, 1, 1, 16)
    from onebit.backends.vulkan.kernels import VulkanKernelError
    with pytest.raises(VulkanKernelError):
        ops.delta_chunk(*args, 1e-6, False, 33)
