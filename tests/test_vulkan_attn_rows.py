"""Attention over many rows on CPU devices (shaders/attn.comp ROWS: a workgroup per head and one
subgroup of rows, the lanes walking the keys together), against plain loops and the numpy twin.

tests/test_vulkan_kernels.py's attention tests (GQA, windows, rings, scales) and test_gptoss's
sinks test run it too wherever R >= Kernels.attn_rows; here: the shapes that take its other
paths (head widths that are not a multiple of 4 x the subgroup, rows that do not fill the last
subgroup, 1 to 4 heads per workgroup, positions in any order) and that a row's result does not
depend on its block.
"""

from __future__ import annotations

import numpy as np
import pytest

from onebit.backends.vulkan import reference as ref
from onebit.backends.vulkan.ops import VulkanOps

from test_vulkan_kernels import _attention_by_loops, close, rng  # noqa: F401  (rng: the seeded fixture)


@pytest.fixture(scope="module")
def cpu_ops():
    o = VulkanOps(reduce="none")
    if not o.k.attn_rows_able:
        pytest.skip("device without subgroup arithmetic and shuffle (attn.comp ROWS)")
    assert o.k.attn_rows == 2  # the default where the device has what it needs
    return o


class PipelineSpy:
    """Names of the pipelines Kernels asked for (which attention kernel a call took)."""

    def __init__(self, k):
        self.k, self.names = k, []

    def __enter__(self):
        orig = type(self.k).pipeline

        def wrapped(variant, *a, **kw):
            self.names.append(variant)
            return orig(self.k, variant, *a, **kw)
        self.k.pipeline = wrapped
        return self

    def __exit__(self, *exc):
        del self.k.pipeline


def _qkv(rng, R, S, H, Hkv, D, Dv):
    return (rng.standard_normal((R, H, D)).astype(np.float32), rng.standard_normal((S, Hkv, D)).astype(np.float32),
            rng.standard_normal((S, Hkv, Dv)).astype(np.float32))


@pytest.mark.parametrize("H,Hkv,D,Dv,S,R,window", [
    (8, 2, 64, 64, 50, 37, 0),    # the last subgroup of rows part-full
    (6, 2, 80, 48, 45, 9, 0),     # 20 vec4s per key row: three shuffle rounds, the last part-used; 3 heads
    (2, 1, 256, 256, 30, 2, 0),   # the widest heads, two rows
    (4, 4, 16, 32, 70, 16, 5),    # a window: the rows' first keys differ within a subgroup
])
def test_rows_kernel_against_loops(cpu_ops, rng, H, Hkv, D, Dv, S, R, window):
    q, k, v = _qkv(rng, R, S, H, Hkv, D, Dv)
    pos = np.arange(S - R, S)
    want = _attention_by_loops(q, k, v, pos, window)
    np.testing.assert_allclose(ref.attention(q, k, v, pos, window), want, rtol=0, atol=1e-5)
    with PipelineSpy(cpu_ops.k) as spy:
        got = cpu_ops.attention(q, k, v, pos, window)
    assert "attn_rows" in spy.names
    close(got, want, rng, 1e-5, f"attn_rows H={H}/{Hkv} D={D}/{Dv} S={S} R={R} window={window}")


def test_a_rows_result_does_not_depend_on_its_block(rng):
    """Rows in any order and any company give the same bits (chunked prefill is compared bit for
    bit with unchunked): all rows at once, a part of them alone, the rows permuted, and the
    heads one per workgroup instead of four."""
    o = VulkanOps(reduce="none")
    if not o.k.attn_rows_able:
        pytest.skip("device without subgroup arithmetic and shuffle (attn.comp ROWS)")
    o.k.attn_rows = 2
    H, Hkv, D, S, R = 8, 2, 32, 64, 21
    q, k, v = _qkv(rng, R, S, H, Hkv, D, D)
    pos = np.arange(S - R, S)
    with PipelineSpy(o.k) as spy:
        full = o.attention(q, k, v, pos)
    assert "attn_rows" in spy.names
    part = o.attention(q[5:14], k, v, pos[5:14])
    np.testing.assert_array_equal(part, full[5:14])
    perm = rng.permutation(R)
    shuffled = o.attention(q[perm], k, v, pos[perm])
    np.testing.assert_array_equal(shuffled, full[perm])
    assert o.k.attn_rows_heads == 4
    o.k.attn_rows_heads = 1
    np.testing.assert_array_equal(o.attention(q, k, v, pos), full)
    close(full, _attention_by_loops(q, k, v, pos, 0), rng, 1e-5, "attn_rows")


def test_rows_kernel_off_is_the_one_row_kernel(rng):
    o = VulkanOps(reduce="none")
    o.k.attn_rows = 0
    q, k, v = _qkv(rng, 7, 30, 4, 2, 32, 32)
    pos = np.arange(23, 30)
    with PipelineSpy(o.k) as spy:
        got = o.attention(q, k, v, pos)
    assert "attn_rows" not in spy.names and "attn_none" in spy.names
    close(got, _attention_by_loops(q, k, v, pos, 0), rng, 1e-5, "attn_none over rows")
