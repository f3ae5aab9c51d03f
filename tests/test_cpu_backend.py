"""The cpu backend (numba kernels) against the numpy reference.

Kernels: fresh random blocks of every type they claim (every quant bit pattern, sane
scales), outputs poisoned with NaN first, compared with the numpy twin (the type's
`dequantize`, then the float32 product). Backend: every fixture's logits within tolerance of
numpy and greedy tokens identical; streamed == resident bit for bit (tests/test_pool.py).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

import onebit
from conftest import fixture_path, greedy_tokens
from onebit.backends import resolve
from onebit.backends.cpu import (CpuBackend, base, int_dots, kernel_sets, kernels, products, repack, small_ops, threads,
                                 x16)
from onebit.backends.numpy_backend import NumpyBackend
from onebit.backends.vulkan.reference import random_blocks
from onebit.formats.quants import QTYPES, QTYPES_BY_NAME, X16_Q5_BLOCK, X16_Q6_BLOCK, x16_bytes
from onebit.backends.cpu.backend import X16_FROM

# The tests of single kernels call the all-types kernels, compiled first by the `cpu_kernels`
# fixture (all of them at once, the parts side by side); the tests that load a model take the
# kernels of its file (kernels_for), as a user's first run does.
ALL_TYPES = pytest.mark.usefixtures("cpu_kernels")

TYPES = sorted(QTYPES[t].name for t in base.SUPPORTED)
# Relative tolerance (of the largest |reference| value) per weight type. The weights decode to
# the reference's float32 values (up to one rounding of scale * quant, or a fused multiply-add).
# Float-path types keep float32 activations, so what differs is the order of float32 sums. The
# integer-path types (int_dots.INT_TYPES) dot against activations rounded to int16 per block of 32: to
# the same bound against that rounding (`rounded`, written again here), and to ACT_TOL against
# the float32 activations (measured: 2-5.5e-5 of the largest value, products and expert FFNs).
TOL = {t: 2e-5 for t in TYPES}
ACT_TOL = 1.5e-4
LOGIT_TOL = 1e-4  # whole forward passes, of the largest |logit| (as tests/test_vulkan_backend.py)


@pytest.fixture
def rng():
    return np.random.default_rng(int(os.environ.get("ONEBIT_TEST_SEED", "20261202")))


def n_in(name: str, blocks: int = 3) -> int:
    return max(QTYPES_BY_NAME[name].block_size, 32) * blocks


def close(got, want, tol, what=""):
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * float(np.abs(want).max()), err_msg=what)


def ro(a):
    a = np.ascontiguousarray(a).view()
    a.flags.writeable = False
    return a


@ALL_TYPES
@pytest.mark.parametrize("rows", [1, 3, 9, 14])  # mat-vec; mat-mat in groups of 8, 4, 2 rows and single rows
@pytest.mark.parametrize("name", TYPES)
def test_matmul(rng, name, rows):
    w = random_blocks(name, (37, n_in(name)), rng)  # 37 rows: not a multiple of the work chunk
    x = rng.standard_normal((rows, n_in(name))).astype(np.float32)
    out = np.full((rows, 37), np.nan, np.float32)
    products.matmul(out, x, ro(w), QTYPES_BY_NAME[name].type_id)
    wf = QTYPES_BY_NAME[name].dequantize(w).T
    if name in int_dots.INT_TYPES:
        close(out, rounded(x) @ wf, TOL[name], name)
        close(out, x @ wf, ACT_TOL, name)
    else:
        close(out, x @ wf, TOL[name], name)


def rounded(x: np.ndarray) -> np.ndarray:
    """x as the integer products see it (int_dots.quantize_acts' rule): per block of 32,
    d = max|x| / 32767 and x -> round(x / d) * d, in float64."""
    b = x.astype(np.float64).reshape(*x.shape[:-1], -1, 32)
    d = np.abs(b).max(axis=-1, keepdims=True) / 32767
    q = np.rint(np.divide(b, d, out=np.zeros_like(b), where=d > 0))
    return (q * d).reshape(x.shape)


@ALL_TYPES
def test_int16_rounding_is_what_the_integer_products_use(rng):
    """quantize_acts against `rounded`: the same int16 values (up to a tie at .5 in float32),
    the scales, and each block's scale x sum; a block of zeros and one holding inf or nan."""
    x = rng.standard_normal((3, 96)).astype(np.float32) * np.float32(7)
    x[1, 32:64] = 0
    x[2, 64] = np.inf
    q, d, m = int_dots.quantize_acts(x)
    assert q.shape == (3, 192 + int_dots.ROW_PAD)  # (the values, then byte planes with VNNI, else the EO copy)
    if int_dots.VNNI:  # the byte planes after the 96 values: low bytes, then high bytes
        planes = q.view(np.uint8)[:, 192:384].astype(np.int64)
        lo, hi = planes[:, :96], planes[:, 96:]
        assert np.array_equal(256 * np.where(hi > 127, hi - 256, hi) + lo, q[:, :96])  # v = 256 hi + lo, exactly
    if int_dots.VNNI:  # each block's d x the sum of its high bytes (IQ4_XS_X16's correction)
        highs = np.where(hi > 127, hi - 256, hi).reshape(3, 3, 32).sum(-1) * d.astype(np.float64)
        ok = np.isfinite(d)
        assert m.shape == (3, 12) and np.allclose(m[:, 9:][ok], highs[ok], rtol=1e-6) and np.isnan(m[2, 11])
    q, m16, m = q[:, :96], m[:, 3:9], m[:, :3]
    assert np.array_equal(m16, q.reshape(3, 6, 16).sum(-1).astype(np.float32))  # each 16 values' sum (Q6_K's offset)
    b = x.astype(np.float64).reshape(3, 3, 32)
    assert np.allclose(d[:, :2].astype(np.float64) * 32767, np.abs(b).max(-1)[:, :2], rtol=1e-6)
    assert d[1, 1] == 0 and np.all(q[1, 32:64] == 0) and m[1, 1] == 0
    assert np.isnan(d[2, 2]) and np.all(np.isfinite(d[:2]))
    amax = np.abs(np.where(np.isfinite(b), b, 0)).max(-1, keepdims=True)
    want = np.rint(np.divide(b * 32767, amax, out=np.zeros_like(b), where=amax > 0)).reshape(3, 96)
    diff = np.abs(q.astype(np.float64) - want)[np.isfinite(np.repeat(d, 32, axis=1))]
    assert diff.max() <= 1 and (diff > 0).mean() < 0.01  # a tie at .5 in float32 at most
    sums = q.reshape(3, 3, 32).sum(-1).astype(np.float64) * d
    assert np.allclose(m[np.isfinite(m)], sums[np.isfinite(sums)], rtol=1e-6)


@ALL_TYPES
@pytest.mark.skipif(not int_dots.VNNI, reason="the X16 layout is AVX-512 VNNI's (elsewhere Q4_K stays in rows)")
@pytest.mark.parametrize("rows", [1, 3, 9])
def test_q4_k_x16_products(rng, rows):
    """Q4_K repacked 16 rows to a group: against the reference as the row kernel is (the same
    rounded activations), and against the row kernel itself (the same sums in another order),
    alone, serial, and in matmul3 beside a matrix in rows; 48 rows: three work chunks."""
    qt = QTYPES_BY_NAME["Q4_K"]
    w = random_blocks("Q4_K", (48, 512), rng)
    x = rng.standard_normal((rows, 512)).astype(np.float32)
    packed = repack.repack_x16(w)
    assert packed.shape == (48, 2 * x16.X16_BLOCK // 16) and not packed.flags.writeable
    want = np.full((rows, 48), np.nan, np.float32)
    products.matmul(want, x, ro(w), qt.type_id)
    wf = qt.dequantize(w).T
    for kernel in (products.matmul, products.matmul_serial):
        got = np.full((rows, 48), np.nan, np.float32)
        kernel(got, x, packed, x16.Q4_K_X16)
        close(got, rounded(x) @ wf, TOL["Q4_K"], "Q4_K_X16")
        close(got, want, 1e-6, "Q4_K_X16 against the row kernel")
    other = random_blocks("Q6_K", (20, 512), rng)
    three = np.full((rows, 48 + 20 + 48), np.nan, np.float32)
    products.matmul3(three, x, packed, ro(other), packed, x16.Q4_K_X16, QTYPES_BY_NAME["Q6_K"].type_id, x16.Q4_K_X16)
    close(three[:, :48], want, 1e-6, "matmul3, first")
    close(three[:, 68:], want, 1e-6, "matmul3, third (from column 68)")
    close(three[:, 48:68], x @ QTYPES_BY_NAME["Q6_K"].dequantize(other).T, ACT_TOL, "matmul3, Q6_K rows")


def test_a_model_repacks_at_load_a_bare_backend_when_it_uses_a_matrix():
    """onebit.load's cpu backend has its X16 matrices made before the first forward (not inside
    the first prompt); a backend opened on its own (a device backend's predictor) repacks only
    what it uses, when it uses it."""
    path = fixture_path("q3moe256-Q4_K_M.gguf")
    m = onebit.load(path, backend="cpu", repack_from=0)  # (a small file: the layouts asked for)
    eligible = {n for n, t in m.gguf.tensors.items() if m.be.policy.packs(t)}
    x16 = lambda be: {n for n, (_, (_, qt, _)) in be._products.items() if qt >= 256}  # noqa: E731
    assert bool(eligible) == int_dots.VNNI and x16(m.be) == eligible
    bare = CpuBackend(m.gguf, policy=CpuBackend.memory_policy(m.gguf, repack_from=0))
    assert not x16(bare)
    if int_dots.VNNI:
        name = sorted(eligible)[0]
        bare.linear(np.ones((1, m.gguf.tensor(name).shape[1]), np.float32), name)
        assert x16(bare) == {name}


@pytest.mark.skipif(not int_dots.VNNI, reason="the X16 layouts are AVX-512 VNNI's")
def test_a_matrix_repacks_a_part_at_a_time(monkeypatch):
    """A matrix repacked 16 rows a part (REPACK_PART), each part's pages of the map given back as
    it is done, is the same bytes as repacked whole; the logits are the same bits."""
    from onebit.backends.cpu import backend as cpu_module

    path = fixture_path("q3moe256-Q4_K_M.gguf")
    whole = onebit.load(path, backend="cpu", repack_from=0)
    monkeypatch.setattr(cpu_module, "REPACK_PART", 1)
    parts = onebit.load(path, backend="cpu", repack_from=0)
    packed = {n: v[1] for n, v in parts.be._products.items() if v[1][1] >= 256}
    assert packed and any(t.shape[0] > 16 for t, _, _ in packed.values())
    for n, (t, qt, got) in packed.items():
        assert qt == repack.x16_type(t.qtype) and not got.flags.writeable
        assert np.array_equal(got, repack.repack_x16(np.asarray(t.raw), t.qtype)), n
    ids = [1, 2, 3, 4, 5]
    assert np.array_equal(whole.logits(ids), parts.logits(ids))


@pytest.mark.skipif(not int_dots.VNNI, reason="the X16 layouts are AVX-512 VNNI's")
def test_a_small_file_keeps_its_rows():
    """Under X16_FROM bytes of tensors (a load's default) a file keeps the rows as they are,
    matrices and experts, and its kernels compile no layout (no repack part); from the size
    `repack_from` gives it takes the layouts. The same logits either way, to the products'
    float order."""
    path = fixture_path("q3moe256-Q8_0.gguf")
    assert os.path.getsize(path) < X16_FROM
    small = onebit.load(path, backend="cpu")
    big = onebit.load(path, backend="cpu", repack_from=os.path.getsize(path) // 2)
    x16 = lambda be: {n for n, (_, (_, qt, _)) in be._products.items() if qt >= 256}  # noqa: E731
    assert not small.be.policy.repacks and "repack" not in small.be.K.parts and not x16(small.be)
    assert small.be.source.layout is None and small.be.policy.experts is None
    assert big.be.policy.repacks and x16(big.be) and big.be.source.layout is not None
    ids = [1, 2, 3, 4, 5]
    a, b = small.logits(ids), big.logits(ids)
    assert np.abs(a - b).max() <= 1e-4 * np.abs(a).max()


@pytest.mark.parametrize("repack_from", [None, 0])
def test_a_streamed_file_holds_what_its_plan_counts(repack_from):
    """One decision (X16Policy.packs) for the loader, the plan and the backend. A small file
    streamed through a pool (by default under X16_FROM: its matrices as rows; with repack_from=0
    in X16 layouts on AVX-512 VNNI) holds each non-expert tensor once, repacked by the backend
    or copied by the loader, none left to be read through the file's map, and the plan's
    resident weights are exactly those bytes."""
    path = fixture_path("q3moe256-Q4_K_M.gguf")
    m = onebit.load(path, backend="cpu", slots=4, budget="1GiB", predict="off", repack_from=repack_from)
    try:
        assert m.pool is not None
        packed = {n: raw for n, (_, (t, qt, raw)) in m.be._products.items() if qt >= 256}
        assert set(packed) == {n for n, t in m.gguf.tensors.items() if m.be.policy.packs(t)}
        assert bool(packed) == (int_dots.VNNI and repack_from == 0)
        held = 0
        for n, t in m.gguf.tensors.items():
            if n.endswith("_exps.weight"):
                continue  # (in the pool's slots)
            if n in packed:
                held += packed[n].nbytes
            else:
                assert not isinstance(t.raw, np.memmap) and not isinstance(t.raw.base, np.memmap), n
                held += t.raw.nbytes
        assert held == next(i.bytes for i in m.plan.items if i.component == "resident weights")
    finally:
        m.close()


@ALL_TYPES
def test_q4_k_x16_layout_by_hand(rng):
    """One block of 16 rows repacked, checked field by field against the Q4_K block format."""
    if not int_dots.VNNI:
        pytest.skip("the X16 layout is AVX-512 VNNI's")
    w = random_blocks("Q4_K", (16, 256), rng)
    p = repack.repack_x16(w).reshape(-1)
    assert p.shape == (x16.X16_BLOCK,)
    for r in range(16):
        blk = w[r]
        assert bytes(p[2 * r : 2 * r + 2]) == bytes(blk[0:2]) and bytes(p[32 + 2 * r : 34 + 2 * r]) == bytes(blk[2:4])
        q = blk[4:16].astype(int)
        for s in range(8):  # ggml's get_scale_min_k4
            sc, mn = (q[s] & 63, q[s + 4] & 63) if s < 4 else (
                (q[s + 4] & 15) | ((q[s - 4] >> 6) << 4), (q[s + 4] >> 4) | ((q[s] >> 6) << 4))
            assert (p[64 + 16 * s + r], p[192 + 16 * s + r]) == (sc, mn)
        for j in range(4):
            for k in range(8):
                at = 320 + 64 * (8 * j + k) + 4 * r
                assert bytes(p[at : at + 4]) == bytes(blk[16 + 32 * j + 4 * k : 20 + 32 * j + 4 * k])


@ALL_TYPES
def test_q5_k_x16_layout_by_hand(rng):
    """Two blocks of 16 Q5_K rows repacked: each weight rebuilt from the layout's fields (d, dmin,
    the decoded 6-bit scale and min of its 32, its nibble among the quants, its fifth bit among
    the fifth-bit words) equals the reference dequantization."""
    if not int_dots.VNNI:
        pytest.skip("the X16 layout is AVX-512 VNNI's")
    qt = QTYPES_BY_NAME["Q5_K"]
    w = random_blocks("Q5_K", (16, 512), rng)
    p = repack.repack_x16(w, qt.type_id).reshape(2, -1)
    assert p.shape[1] == X16_Q5_BLOCK
    want = qt.dequantize(w)
    for i in range(2):
        blk = p[i]
        d, dmin = (blk[a : a + 32].view(np.float16).astype(np.float32) for a in (0, 32))
        sc, mn = blk[64:192].reshape(8, 16).astype(np.float32), blk[192:320].reshape(8, 16).astype(np.float32)
        first = blk[320:1344].reshape(8, 2, 16, 4)  # [k, (pair 0's quants, fifth bits), row, byte]
        rest = blk[1344:].reshape(3, 8, 16, 4)  # [pair j - 1, k, row, byte]
        for wi in range(256):
            j, h, l = wi // 64, (wi % 64) // 32, wi % 32  # weight 64 j + 32 h + l
            byte = first[l // 4, 0, :, l % 4] if j == 0 else rest[j - 1, l // 4, :, l % 4]
            u = ((byte >> 4) if h else (byte & 15)).astype(np.int32)
            u |= ((first[l // 4, 1, :, l % 4] >> (2 * j + h)) & 1).astype(np.int32) << 4
            got = d * sc[2 * j + h] * u - dmin * mn[2 * j + h]
            assert np.allclose(got, want[:, 256 * i + wi], rtol=1e-5, atol=1e-6), (i, wi)


def test_transpose16_moves_16_rows_of_16_words_at_any_alignment(rng):
    """transpose16 (the Q4_K and Q6_K repacks' quants): dst[d0 + 64 j + 4 r ..] = src[s0 + r stride
    + 4 j ..], from odd offsets and an odd stride (Q6_K rows are 210 bytes a block), nothing else
    written."""
    from numba import njit

    @njit
    def run(src, s0, stride, dst, d0):
        x16.transpose16(src, s0, stride, dst, d0)

    for s0, stride, d0 in ((0, 64, 0), (3, 210, 5), (17, 630, 64)):
        src = rng.integers(0, 256, s0 + 15 * stride + 64 + 7, dtype=np.uint8)
        dst = rng.integers(0, 256, d0 + 1024 + 9, dtype=np.uint8)
        before = dst.copy()
        run(src, np.uint64(s0), np.uint64(stride), dst, np.uint64(d0))
        rows = np.stack([src[s0 + r * stride: s0 + r * stride + 64] for r in range(16)]).view(np.uint32)  # [r, j]
        assert np.array_equal(dst[d0: d0 + 1024].view(np.uint32).reshape(16, 16), rows.T)
        assert np.array_equal(dst[:d0], before[:d0]) and np.array_equal(dst[d0 + 1024:], before[d0 + 1024:])


@ALL_TYPES
def test_q6_k_x16_layout_by_hand(rng):
    """A group of 16 Q6_K rows repacked: each weight rebuilt from the layout's fields (d, the
    scale of its 16, its low 4 and high 2 bits) equals the reference dequantization."""
    if not int_dots.VNNI:
        pytest.skip("the X16 layouts are AVX-512 VNNI's")
    qt = QTYPES_BY_NAME["Q6_K"]
    w = random_blocks("Q6_K", (16, 512), rng)
    p = repack.repack_x16(w, qt.type_id).reshape(2, X16_Q6_BLOCK)  # two blocks of 256
    want = qt.dequantize(w)  # [16, 512]
    for i in range(2):
        blk = p[i]
        d = blk[:32].view(np.float16).astype(np.float32)  # [16 rows]
        sc = blk[32:288].view(np.int8).reshape(16, 16).astype(np.float32)  # [sub-block, row]
        quants = blk[288:].reshape(16, 3, 16, 4)  # [k, (low bits, low bits, high bits), row, 4 weights]
        for wi in range(256):
            c, t = wi // 4, wi % 4  # weights 4 c .. 4 c + 3 hold weight wi
            lo = quants[c % 16, (c // 16) % 2, :, t]  # c and c + 32 share a byte, as c + 16 and c + 48
            low = lo >> 4 if c >= 32 else lo & 15
            high = (quants[c % 16, 2, :, t] >> (2 * (c // 16))) & 3
            u = low.astype(np.int32) | (high.astype(np.int32) << 4)
            got = d * sc[wi // 16] * (u - 32)
            assert np.allclose(got, want[:, 256 * i + wi], rtol=1e-6, atol=0), (i, wi)


@ALL_TYPES
@pytest.mark.skipif(not int_dots.VNNI, reason="the X16 layouts are AVX-512 VNNI's")
@pytest.mark.parametrize("rows", [1, 3, 9])
@pytest.mark.parametrize("name", ["Q5_K", "Q6_K", "MXFP4", "Q4_0", "Q5_0", "IQ4_XS", "Q8_0", "Q4_1", "Q5_1", "IQ4_NL",
                                  "Q2_K", "Q3_K"])
def test_x16_layout_products(rng, name, rows):
    """The X16 layouts of Q5_K, Q6_K, MXFP4, Q4_0, Q5_0, IQ4_XS, Q8_0, Q4_1, Q5_1, IQ4_NL, Q2_K and
    Q3_K, an odd number of blocks a row (768 weights as the 30B-A3B shape's down experts; 288 for
    the 32-weight types, as gpt-oss's 2880 has 90): against the reference on the same rounded
    activations and against the row kernel (Q2_K's and Q3_K's take float32 activations: against
    those, to ACT_TOL); serial == parallel repack."""
    qt = QTYPES_BY_NAME[name]
    k = 288 if qt.block_size == 32 else 768
    w = random_blocks(name, (48, k), rng)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    packed = repack.repack_x16(w, qt.type_id)
    assert packed.shape == (48, x16_bytes(w.shape[1], qt.type_id)) and not packed.flags.writeable
    want = np.full((rows, 48), np.nan, np.float32)
    products.matmul(want, x, ro(w), qt.type_id)
    wf = qt.dequantize(w).T
    for kernel in (products.matmul, products.matmul_serial):
        got = np.full((rows, 48), np.nan, np.float32)
        kernel(got, x, packed, repack.x16_type(qt.type_id))
        close(got, rounded(x) @ wf, TOL[name], f"{name}_X16")
        if name in int_dots.INT_TYPES:
            close(got, want, 1e-6, f"{name}_X16 against the row kernel")
        else:
            close(got, want, ACT_TOL, f"{name}_X16 against the row kernel")
    serial = np.empty_like(packed)
    repack.repack_x16_serial(ro(w), serial, qt.type_id)
    assert np.array_equal(serial, packed)


@ALL_TYPES
@pytest.mark.skipif(not int_dots.VNNI, reason="the X16 layouts are AVX-512 VNNI's")
@pytest.mark.parametrize("n", [37, 21])
@pytest.mark.parametrize("name", x16.X16_TYPES)
def test_x16_layouts_hold_rows_past_the_last_group(rng, name, n):
    """A matrix of n rows, not a multiple of 16 (an output head of an odd vocabulary): its groups
    in the layout, its last n % 16 rows as they are right after them (then zeros to the array's
    end); its products equal the row kernel's (the last rows through the type's own row dot;
    Q2_K's and Q3_K's groups on rounded activations: against the reference on those), alone,
    serial and in matmul3; serial == parallel repack."""
    qt = QTYPES_BY_NAME[name]
    k = 288 if qt.block_size == 32 else 512
    w = random_blocks(name, (n, k), rng)
    packed = repack.repack_x16(w, qt.type_id)
    full, rb = n // 16 * 16, w.shape[1]
    assert packed.shape == (n, x16_bytes(rb, qt.type_id)) and not packed.flags.writeable
    tail = packed[full:].reshape(-1)
    assert np.array_equal(tail[: (n - full) * rb], w[full:].reshape(-1)) and not tail[(n - full) * rb :].any()
    serial = np.empty_like(packed)
    repack.repack_x16_serial(ro(w), serial, qt.type_id)
    assert np.array_equal(serial, packed)
    wf = qt.dequantize(w).T
    for rows in (1, 3):
        x = rng.standard_normal((rows, k)).astype(np.float32)
        want = np.full((rows, n), np.nan, np.float32)
        products.matmul(want, x, ro(w), qt.type_id)
        for kernel in (products.matmul, products.matmul_serial):
            got = np.full((rows, n), np.nan, np.float32)
            kernel(got, x, packed, repack.x16_type(qt.type_id))
            if name in int_dots.INT_TYPES:
                close(got, want, 1e-6, f"{name}_X16 against the row kernel")
            else:
                close(got[:, :full], rounded(x) @ wf[:, :full], TOL[name], f"{name}_X16")
                close(got[:, full:], want[:, full:], 1e-6, f"{name}_X16's last rows against the row kernel")
        three = np.full((rows, 2 * n + 5), np.nan, np.float32)
        five = random_blocks("Q8_0", (5, k), rng)
        products.matmul3(three, x, packed, ro(five), packed, repack.x16_type(qt.type_id),
                         QTYPES_BY_NAME["Q8_0"].type_id, repack.x16_type(qt.type_id))
        got = np.full((rows, n), np.nan, np.float32)
        products.matmul(got, x, packed, repack.x16_type(qt.type_id))
        assert np.array_equal(three[:, :n], got) and np.array_equal(three[:, n + 5 :], got)


@ALL_TYPES
@pytest.mark.parametrize("name", ["Q2_K", "Q3_K"])
def test_q2_k_q3_k_x16_layouts_by_hand(rng, name):
    """A group of 16 Q2_K or Q3_K rows repacked: each weight rebuilt from the layout's fields as
    the layout's comment (x16.py) places them equals the reference dequantization. Q2_K: d, dmin,
    the scale byte of its 16 (scale & 15, min >> 4), its 2 bits at bits 2 j of its quant byte;
    Q3_K: d, its 6-bit scale from the packed bytes, its 2 low bits and its hmask bit (u - 4)."""
    if not int_dots.VNNI:
        pytest.skip("the X16 layouts are AVX-512 VNNI's")
    qt = QTYPES_BY_NAME[name]
    w = random_blocks(name, (16, 512), rng)
    p = repack.repack_x16(w, qt.type_id).reshape(2, 16 * qt.type_size)
    want = qt.dequantize(w)
    for i in range(2):
        blk = p[i]
        d = blk[:32].view(np.float16).astype(np.float32)  # [row]
        for wi in range(256):
            n, j, l = wi // 128, (wi % 128) // 32, wi % 32  # weight 128 n + 32 j + l
            h, k, at, sub = l // 16, (l % 16) // 4, l % 4, wi // 16
            if name == "Q2_K":
                dmin = blk[32:64].view(np.float16).astype(np.float32)
                sc = blk[64 + 16 * sub : 80 + 16 * sub].astype(np.int32)  # [row]
                quant = blk[320 + 64 * (8 * h + 4 * n + k) :][:64].reshape(16, 4)[:, at].astype(np.int32)
                got = d * (sc & 15) * ((quant >> (2 * j)) & 3) - dmin * (sc >> 4)
            else:
                packed_sc = blk[32:224].reshape(12, 16).astype(np.int32)  # [byte, row]
                six = ((packed_sc[sub % 8] >> (4 * (sub // 8))) & 15) | (
                    ((packed_sc[8 + sub % 4] >> (2 * (sub // 4))) & 3) << 4)
                hm = blk[224 + 768 * h + 64 * k :][:64].reshape(16, 4)[:, at].astype(np.int32)
                quant = blk[224 + 768 * h + 256 + 256 * n + 64 * k :][:64].reshape(16, 4)[:, at].astype(np.int32)
                u = ((quant >> (2 * j)) & 3) | (((hm >> (4 * n + j)) & 1) << 2)
                got = d * (six - 32) * (u - 4)
            assert np.allclose(got, want[:, 256 * i + wi], rtol=1e-6, atol=1e-6 * np.abs(want).max()), (i, wi)


@ALL_TYPES
@pytest.mark.parametrize("name", ["MXFP4", "Q4_0", "Q5_0", "Q8_0", "Q4_1", "Q5_1", "IQ4_NL"])
def test_plain_x16_layout_by_hand(rng, name):
    """A group of 16 rows repacked: each row's scale field (Q4_1's and Q5_1's minimum, Q5_0's
    and Q5_1's word of fifth bits) where the layout puts it, and each weight's quant (a nibble;
    Q8_0's a byte) found again at its place in the quants; Q5_0's, Q4_1's, Q5_1's and IQ4_NL's
    weights rebuilt from the layout equal the reference's."""
    if not int_dots.VNNI:
        pytest.skip("the X16 layouts are AVX-512 VNNI's")
    qt = QTYPES_BY_NAME[name]
    qb = 32 if name == "Q8_0" else 16  # quant bytes a block
    ts, sb = qt.type_size, qt.type_size - qb
    fb = 1 if name == "MXFP4" else 2  # the scale's bytes; Q4_1's and Q5_1's minimum (2), the fifth bits (4) follow
    mb = 2 if name in ("Q4_1", "Q5_1") else 0
    w = random_blocks(name, (16, 64), rng)  # two blocks a row
    p = repack.repack_x16(w, qt.type_id).reshape(2, 16 * ts)
    want_f = qt.dequantize(w)
    for i in range(2):
        blk = p[i]
        quants = blk[16 * sb :].reshape(qb // 4, 16, 4)  # [k, row, byte]
        for r in range(16):
            src = w[r, i * ts : (i + 1) * ts]
            assert bytes(blk[fb * r : fb * (r + 1)]) == bytes(src[:fb])
            if mb:
                assert bytes(blk[16 * fb + 2 * r : 16 * fb + 2 * (r + 1)]) == bytes(src[fb : fb + mb])
            if sb > fb + mb:
                at = 16 * (fb + mb) + 4 * r
                assert bytes(blk[at : at + 4]) == bytes(src[fb + mb : sb])
            for wi in range(32):
                if qb == 32:  # weight wi: byte wi of the quants
                    assert quants[wi // 4, r, wi % 4] == src[sb + wi]
                    continue
                byte, want = quants[(wi % 16) // 4, r, wi % 4], src[sb + wi % 16]  # low nibble below 16
                nib = byte >> 4 if wi >= 16 else byte & 15
                assert nib == (want >> 4 if wi >= 16 else want & 15)
                d = blk[2 * r : 2 * r + 2].view(np.float16).astype(np.float32)[0]
                if name == "Q5_0":
                    fifth = (int(blk[32 + 4 * r : 36 + 4 * r].view(np.uint32)[0]) >> wi) & 1
                    assert d * ((int(nib) | (fifth << 4)) - 16) == want_f[r, 32 * i + wi], (i, r, wi)
                elif name in ("Q4_1", "Q5_1"):  # d q + m
                    m = blk[32 + 2 * r : 34 + 2 * r].view(np.float16).astype(np.float32)[0]
                    fifth = (int(blk[64 + 4 * r : 68 + 4 * r].view(np.uint32)[0]) >> wi) & 1 if name == "Q5_1" else 0
                    got = np.float32(d * np.float32(int(nib) | (fifth << 4))) + m
                    assert np.isclose(got, want_f[r, 32 * i + wi], rtol=1e-6, atol=1e-6 * abs(m)), (i, r, wi)
                elif name == "IQ4_NL":  # d level[q]
                    from onebit.formats.quants import iq4_values

                    assert d * np.float32(iq4_values()[nib]) == want_f[r, 32 * i + wi], (i, r, wi)


@ALL_TYPES
def test_iq4_xs_x16_layout_by_hand(rng):
    """A group of 16 IQ4_XS rows repacked: each weight rebuilt from the layout's fields (d, the
    6-bit scale of its 32 from the high-bit u16 and the low-nibble bytes, its quant's level)
    equals the reference dequantization."""
    if not int_dots.VNNI:
        pytest.skip("the X16 layouts are AVX-512 VNNI's")
    from onebit.formats.quants import iq4_values

    qt = QTYPES_BY_NAME["IQ4_XS"]
    w = random_blocks("IQ4_XS", (16, 512), rng)
    p = repack.repack_x16(w, qt.type_id).reshape(2, 16 * 136)
    want = qt.dequantize(w)
    levels = np.asarray(iq4_values(), np.float32)
    for i in range(2):
        blk = p[i]
        d = blk[:32].view(np.float16).astype(np.float32)
        high = blk[32:64].view(np.uint16).astype(np.int32)
        low = blk[64:128].reshape(4, 16).astype(np.int32)  # [byte, row]
        quants = blk[128:].reshape(8, 4, 16, 4)  # [sub-block, k, row, byte]
        for wi in range(256):
            j, t = wi // 32, wi % 32
            ls = ((low[j // 2] >> (4 * (j % 2))) & 15) | (((high >> (2 * j)) & 3) << 4)
            byte = quants[j, (t % 16) // 4, :, t % 4]
            got = d * (ls - 32) * levels[(byte >> 4) if t >= 16 else (byte & 15)]
            assert np.allclose(got, want[:, 256 * i + wi], rtol=1e-6, atol=0), (i, wi)


@ALL_TYPES
@pytest.mark.parametrize("name", ["Q8_0", "Q4_K", "IQ4_XS_X16", "MXFP4_X16"])
def test_integer_products_keep_nan_and_inf_visible(rng, name):
    """An activation block holding inf or nan gives nan outputs (float32 products would give inf
    or nan), never a finite number that hides it; the X16 layouts' too."""
    x16 = name.endswith("_X16")
    if x16 and not int_dots.VNNI:
        pytest.skip("the X16 layouts are AVX-512 VNNI's")
    qt = QTYPES_BY_NAME[name.removesuffix("_X16")]
    w = random_blocks(qt.name, (16 if x16 else 5, 256), rng)
    w, tid = (repack.repack_x16(w, qt.type_id), repack.x16_type(qt.type_id)) if x16 else (ro(w), qt.type_id)
    x = rng.standard_normal((2, 256)).astype(np.float32)
    x[0, 7], x[1, 200] = np.inf, np.nan
    out = np.zeros((2, w.shape[0]), np.float32)
    products.matmul(out, x, w, tid)
    assert not np.isfinite(out).any()


@ALL_TYPES
@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("name", ["F32", "F16", "BF16"])
def test_matmul_float_rows_with_a_tail(rng, name, rows):
    """Float rows decode 32 weights at a time, then the last len % 32 one by one."""
    w = random_blocks(name, (19, 101), rng)
    x = rng.standard_normal((rows, 101)).astype(np.float32)
    out = np.full((rows, 19), np.nan, np.float32)
    products.matmul(out, x, ro(w), QTYPES_BY_NAME[name].type_id)
    close(out, x @ QTYPES_BY_NAME[name].dequantize(w).T, TOL[name], name)


@ALL_TYPES
def test_rows_of_one_call_and_fused_projections_give_the_same_bits(rng):
    """A row's product is the same bits whether it is dotted alone or with 1, 3 or 7 others (mat-vec
    vs mat-mat), in the parallel or the serial kernel, and in matmul3 (q, k, v in one region)."""
    names = ["Q4_K", "Q6_K", "Q8_0"]
    ws = [ro(random_blocks(n, (40 + 9 * i, 512), rng)) for i, n in enumerate(names)]
    qts = [QTYPES_BY_NAME[n].type_id for n in names]
    R = 15  # one group of 8, one of 4, one of 2, one row
    x = rng.standard_normal((R, 512)).astype(np.float32)
    fused = np.full((R, sum(w.shape[0] for w in ws)), np.nan, np.float32)
    products.matmul3(fused, x, *ws, *qts)
    col = 0
    for w, qt in zip(ws, qts):
        whole = np.full((R, w.shape[0]), np.nan, np.float32)
        products.matmul(whole, x, w, qt)
        assert np.array_equal(fused[:, col : col + w.shape[0]], whole)
        col += w.shape[0]
        for r in range(R):
            one = np.full((1, w.shape[0]), np.nan, np.float32)
            products.matmul_serial(one, x[r : r + 1], w, qt)
            assert np.array_equal(one[0], whole[r])


@ALL_TYPES
def test_small_ops_match_numpy(rng):
    """The serial kernels CpuStep runs for few-row forwards against NumpyBackend's ops."""
    be = NumpyBackend
    x = rng.standard_normal((3, 64)).astype(np.float32)
    w = rng.standard_normal(64).astype(np.float32)
    out = np.full_like(x, np.nan)
    small_ops.rms_norm(out, x, w, 1e-6)
    close(out, be.rms_norm(x, w, 1e-6), 1e-6)

    pos = np.array([0, 5, 17], np.int64)
    q = rng.standard_normal((3, 4, 16)).astype(np.float32)
    for neox in (True, False):
        inv = 1e4 ** (-np.arange(0, 12, 2, dtype=np.float64) / 12)  # n_rot 12 of 16 dims
        got = np.full_like(q, np.nan)
        small_ops.rope(got, q, pos, inv, 1.0, neox)
        close(got, be.rope(q, pos, 12, 1e4, neox), 1e-6)

    S, Hkv = 18, 2
    k = rng.standard_normal((S, Hkv, 16)).astype(np.float32)
    v = rng.standard_normal((S, Hkv, 8)).astype(np.float32)
    for window in (0, 4):
        got = np.full((3, 4, 8), np.nan, np.float32)
        small_ops.attention(got, q, k, v, pos, window, 0.25)  # 1 / sqrt(16)
        close(got.reshape(3, -1), be.attention(be, q, k, v, pos, window), 1e-5)
        small_ops.attention(got, q, k, v, pos, window, 0.1)  # a model's own scale (Gemma's query_pre_attn_scalar)
        close(got.reshape(3, -1), be.attention(be, q, k, v, pos, window, 0.1), 1e-5)
    # a sliding-window ring: position p in row p % S, rows past S wrapped over the oldest
    kl = rng.standard_normal((31, Hkv, 16)).astype(np.float32)
    vl = rng.standard_normal((31, Hkv, 8)).astype(np.float32)
    ring = np.arange(31 - S, 31) % S  # positions 13..30 in their rows
    kr, vr = np.empty_like(k), np.empty_like(v)
    kr[ring], vr[ring] = kl[31 - S :], vl[31 - S :]
    late = np.array([20, 25, 30], np.int64)
    got = np.full((3, 4, 8), np.nan, np.float32)
    small_ops.attention(got, q, kr, vr, late, 4, 0.25)
    close(got.reshape(3, -1), be.attention(be, q, kl, vl, late, 4), 1e-5)

    logits = rng.standard_normal((5, 12)).astype(np.float32)
    logits[0, 3] = logits[0, 7]  # a tie: the lower id first, as numpy's stable argsort
    for norm in (True, False):
        ids, wts = small_ops.route(logits, 4, norm)
        want_ids, want_w = be.route(be, logits, 4, norm)
        assert np.array_equal(ids, want_ids)
        close(wts, want_w, 1e-6)

    experts, offs, rows, rw = small_ops.routed_rows(want_ids, want_w, 12)
    flat = want_ids.reshape(-1)
    order = np.argsort(flat, kind="stable")
    assert np.array_equal(experts, np.unique(flat))
    assert np.array_equal(offs, np.searchsorted(flat[order], np.append(experts, 12)))
    assert np.array_equal(rows, order // 4) and np.array_equal(rw, want_w.reshape(-1)[order])


@ALL_TYPES
def test_no_compile_in_a_forward_pass():
    """Every kernel signature a forward uses (prefill, decode, streamed experts) is made when the
    backend opens, so no compile lands in the per-token path. A fresh process: this one's earlier
    tests may have compiled extra signatures."""
    import subprocess
    import sys

    code = f"""
import numpy as np, onebit
for name in ("qwen3moe-f32", "q3moe256-Q4_K_M", "qwen2moe-f32"):
    m = onebit.load({str(fixture_path("qwen3moe-f32.gguf").parent)!r} + "/" + name + ".gguf", backend="cpu")
    kernels = m.be.K.kernels()  # (the all-types kernels here: cpu_kernels compiled them)
    before = [len(k.signatures) for k in kernels]
    cache = m.new_cache()
    m.net.forward(np.arange(1, 12), cache)
    for t in range(3):
        m.net.forward(np.array([t + 1]), cache)
    after = [len(k.signatures) for k in kernels]
    assert before == after, (name, [k.__name__ for k, a, b in zip(kernels, after, before) if a != b])
s = onebit.load({str(fixture_path("q3moe256-Q8_0.gguf"))!r}, backend="cpu", slots=4)
kernels = s.be.K.kernels()
before = [len(k.signatures) for k in kernels]
s.logits([1, 2, 3])
assert before == [len(k.signatures) for k in kernels], "streaming"
print("ok")
"""
    root = Path(__file__).resolve().parent.parent
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=root)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


@ALL_TYPES
def test_cache_is_cold_only_without_a_disk_cache(tmp_path):
    """The first-run compile (and its notice) happens exactly when numba's disk cache lacks a
    kernel: an empty cache dir is cold; this machine's cache, filled by the cpu_kernels fixture, is not."""
    import subprocess
    import sys

    code = "from onebit.backends.cpu import kernel_sets; print(kernel_sets.cache_is_cold())"
    root = Path(__file__).resolve().parent.parent
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path))
    cold = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=root, env=env)
    warm = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=root)
    assert (cold.stdout.strip(), warm.stdout.strip()) == ("True", "False"), (cold.stderr, warm.stderr)


@ALL_TYPES
@pytest.mark.parametrize("name", TYPES)
def test_get_rows(rng, name):
    w = random_blocks(name, (20, n_in(name)), rng)
    ids = np.array([3, 0, 19, 3], np.int64)
    out = np.full((4, n_in(name)), np.nan, np.float32)
    products.get_rows(out, ro(w), ids, QTYPES_BY_NAME[name].type_id, base.LUT, base.M)
    want = QTYPES_BY_NAME[name].dequantize(w[ids])
    close(out, want, 1e-6, name)  # one rounding of scale * quant at most


@ALL_TYPES
@pytest.mark.parametrize("name", TYPES)
def test_expert_ffn_matches_numpy(rng, name):
    """The fused routed-expert kernel == NumpyBackend.expert_ffn summed over the chosen experts."""
    # 17 rows of 3 experts each over 6 experts: some expert serves 8+ rows (the dot8 path)
    E, hidden, dim, R, k = 6, 2 * max(QTYPES_BY_NAME[name].block_size, 32), n_in(name), 17, 3
    gate, up = (random_blocks(name, (E, hidden, dim), rng) for _ in range(2))
    down = random_blocks(name, (E, dim, hidden), rng)
    x = rng.standard_normal((R, dim)).astype(np.float32)
    ids = np.stack([rng.choice(E, k, replace=False) for _ in range(R)])  # [R, k]
    wts = rng.random((R, k)).astype(np.float32)

    class Part:
        qtype = QTYPES_BY_NAME[name].type_id

    want = np.zeros_like(x)
    with np.errstate(over="ignore"):  # exp in silu of large random gate values
        for e in np.unique(ids):
            NumpyBackend.expert_ffn(NumpyBackend, want, x, ids, wts, int(e), [Part] * 3, [gate[e], up[e], down[e]])
    experts, offs, rows, rw = CpuBackend.routed_rows(ids, wts, E)
    got = np.zeros_like(x)
    qt = Part.qtype
    y = np.full((len(rows), dim), np.nan, np.float32)  # (poisoned: every routed row must be written)
    products.expert_ffn(got, y, x, ro(gate), ro(up), ro(down), experts, np.arange(len(experts)), offs, rows, rw,
                        True, qt, qt, qt)
    close(got, want, ACT_TOL if name in int_dots.INT_TYPES else TOL[name], name)

    # The experts in batches, in another order (a pool's resident experts, then its reads as
    # they complete), the last call adding: the same bits. A call that does not add leaves out be.
    split = np.zeros_like(x)
    y = np.full((len(rows), dim), np.nan, np.float32)
    for js in ([len(experts) - 1, 1], [0], list(range(2, len(experts) - 1))):
        js = np.array(js, np.int64)
        products.expert_ffn(split, y, x, ro(gate), ro(up), ro(down), experts[js], js, offs, rows, rw, False,
                            qt, qt, qt)
        assert not split.any()
    products.expert_ffn(split, y, x, ro(gate), ro(up), ro(down), experts[:0], np.zeros(0, np.int64), offs, rows,
                        rw, True, qt, qt, qt)
    assert np.array_equal(split, got)



@ALL_TYPES
@pytest.mark.parametrize("name", ["Q8_0", "Q4_K", "Q6_K", "MXFP4", "F16"])
def test_expert_ffn_oai_matches_numpy(rng, name):
    """gpt-oss's expert kernel (biases, clamped SwiGLU) == NumpyBackend.expert_ffn with them, on
    the integer products and a float one: the kernel frees its int16 activations only after
    its loop (a kernel that freed them early read garbage on every integer type)."""
    E, hidden, dim, R, k = 4, n_in(name), n_in(name), 9, 2
    gate, up = (random_blocks(name, (E, hidden, dim), rng) for _ in range(2))
    down = random_blocks(name, (E, dim, hidden), rng)
    biases = [(rng.standard_normal((E, n)) * 0.1).astype(np.float32) for n in (hidden, hidden, dim)]
    x = (rng.standard_normal((R, dim)) * 0.05).astype(np.float32)
    ids = np.stack([rng.choice(E, k, replace=False) for _ in range(R)])  # [R, k]
    wts = rng.random((R, k)).astype(np.float32)
    glu = (1.702, 7.0)

    class Part:
        qtype = QTYPES_BY_NAME[name].type_id

    want = np.zeros_like(x)
    with np.errstate(over="ignore"):
        for e in np.unique(ids):
            NumpyBackend.expert_ffn(NumpyBackend, want, x, ids, wts, int(e), [Part] * 3, [gate[e], up[e], down[e]],
                                    biases, glu)
    experts, offs, rows, rw = CpuBackend.routed_rows(ids, wts, E)
    got = np.zeros_like(x)
    qt = Part.qtype
    y = np.full((len(rows), dim), np.nan, np.float32)
    products.expert_ffn_oai(got, y, x, ro(gate), ro(up), ro(down), experts, np.arange(len(experts)), experts.copy(),
                            offs, rows, rw, True, qt, qt, qt, *[ro(b) for b in biases], *glu)
    close(got, want, ACT_TOL if name in int_dots.INT_TYPES else TOL[name], name)


ARCH = ["qwen3moe-f32", "qwen2moe-f32", "olmoe-f32", "llama-f32", "mixtral-f32", "qwen2-f32", "qwen3-f32",
        "llama3rope-f32", "gemma3-f32", "glm4moe-f32"]
QUANT = ["q3moe256-" + t for t in ("F16", "BF16", "Q8_0", "Q4_0", "Q4_K_M", "Q5_K_M", "Q6_K", "MXFP4_MOE",
                                   "Q1_0", "TQ1_0", "TQ2_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "IQ1_S", "IQ1_M",
                                   "IQ2_XXS", "IQ2_XS", "IQ3_XXS", "IQ3_S", "IQ4_NL", "IQ4_XS")]
QUANT += ["glm4moe-Q8_0", "glm4moe-Q4_0", "glm256-Q4_K_M"]


@pytest.mark.parametrize("name", ARCH + QUANT)
def test_cpu_matches_numpy(name):
    path = fixture_path(f"{name}.gguf")
    ids = np.load(fixture_path(f"{name}.ref.npz"))["tokens"][:12].astype(np.int64)
    ref, cpu = onebit.load(path, backend="numpy"), onebit.load(path, backend="cpu")
    assert isinstance(cpu.be, CpuBackend)
    want, got = ref.logits(ids), cpu.logits(ids)
    np.testing.assert_allclose(got, want, rtol=0, atol=LOGIT_TOL * np.abs(want).max())
    assert greedy_tokens(cpu, ids[:6], 6) == greedy_tokens(ref, ids[:6], 6)


def test_every_quant_type_has_a_kernel(capsys):
    """No type of onebit.formats.quants takes the numpy path: a file mixing five types says nothing."""
    assert set(QTYPES) <= base.SUPPORTED
    m = onebit.load(fixture_path("q3moe256-IQ1_M.gguf"), backend="cpu")
    assert len({t.qtype for t in m.gguf.tensors.values()}) >= 5
    m.logits([1, 2, 3])
    assert "onebit: note:" not in capsys.readouterr().err


def test_a_type_without_a_kernel_falls_back_and_says_so_once(capsys, monkeypatch):
    """The numpy path for a type the kernels do not claim (a type added to onebit.formats.quants
    before its kernel): said once at load, and the logits still match numpy's."""
    fewer = base.SUPPORTED - {QTYPES_BY_NAME["Q1_0"].type_id}
    for where in (kernels, kernel_sets):  # (what the backend reads, and what the kernel sets read)
        monkeypatch.setattr(where, "SUPPORTED", fewer)
    path = fixture_path("q3moe256-Q1_0.gguf")
    m = onebit.load(path, backend="cpu")
    err = capsys.readouterr().err
    assert err.count("onebit: note:") == 1 and "Q1_0" in err and "numpy reference path" in err
    want = onebit.load(path, backend="numpy").logits([1, 2, 3])
    np.testing.assert_allclose(m.logits([1, 2, 3]), want, rtol=0, atol=LOGIT_TOL * np.abs(want).max())
    assert capsys.readouterr().err == ""


def test_auto_takes_vulkan_only_on_a_gpu(monkeypatch):
    """auto: Vulkan on an integrated or discrete GPU, else cpu; a CPU-type Vulkan device
    (lavapipe) only when a device is asked for by name."""
    import dataclasses

    import onebit.backends as backends
    from onebit.backends.vulkan import device as vkdev

    try:
        real = vkdev.list_devices()
    except vkdev.VulkanUnavailableError:
        real = []
    fake = real[0] if real else None
    if fake is None:
        pytest.skip("no Vulkan device to describe")
    lavapipe = dataclasses.replace(fake, type="cpu", missing=())
    monkeypatch.setattr(vkdev, "list_devices", lambda: [lavapipe])
    assert backends.gpu_device() is None and resolve("auto") == "cpu"
    assert onebit.load(fixture_path("qwen3moe-f32.gguf"), backend="cpu").be.name == "cpu"
    assert resolve("auto", "0") == "vulkan"  # a device asked for by name or index
    monkeypatch.setenv("ONEBIT_VULKAN_DEVICE", "0")
    assert resolve("auto") == "cpu"  # the library reads no environment (the CLI passes it as `device`)
    monkeypatch.delenv("ONEBIT_VULKAN_DEVICE")
    for kind in ("integrated", "discrete"):
        monkeypatch.setattr(vkdev, "list_devices", lambda: [lavapipe, dataclasses.replace(lavapipe, type=kind)])
        assert backends.gpu_device().type == kind and resolve("auto") == "vulkan"


@pytest.mark.parametrize("others,want", [(0.2, "ACTIVE"), (1.0, "PASSIVE"), (None, "PASSIVE")])
def test_kernel_threads_spin_only_on_an_idle_machine(monkeypatch, others, want):
    """OpenMP workers spin briefly between regions when the machine is idle (other runnable
    tasks under half the cores), sleep at once when it is busy or that is unknown, and a user's
    own OMP_WAIT_POLICY is left alone."""
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 2)

    def running():
        if others is None:
            raise OSError("no load figures")
        return others

    monkeypatch.setattr(threads, "_others_running", running)
    threads.wait_policy()
    assert os.environ["OMP_WAIT_POLICY"] == want
    assert ("GOMP_SPINCOUNT" in os.environ) == (want == "ACTIVE")
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.setattr(threads, "_others_running", lambda: 0.0)
    threads.wait_policy()
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE" and "GOMP_SPINCOUNT" not in os.environ



def test_importing_onebit_sets_no_thread_environment():
    """Importing any onebit module (the cpu kernels among them) writes no OMP_*, GOMP_* or NUMBA_*
    variable: the wait policy is set when a cpu backend opens (`wait_policy`), not at import."""
    import subprocess
    import sys

    code = """
import importlib, os, pkgutil, onebit
before = dict(os.environ)
for m in pkgutil.walk_packages(onebit.__path__, "onebit."):
    importlib.import_module(m.name)
print(sorted(k for k in os.environ.keys() | before.keys() if os.environ.get(k) != before.get(k)))
"""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_", "NUMBA_NUM_THREADS"))}
    root = Path(__file__).resolve().parent.parent
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=root, env=env)
    assert r.returncode == 0 and r.stdout.strip() == "[]", (r.stdout, r.stderr[-3000:])


def test_the_backend_sets_the_wait_policy_before_numba_starts_its_threads(monkeypatch):
    """OpenMP reads OMP_WAIT_POLICY once, when numba starts its threads (numba.get_num_threads,
    a first parallel region): the backend sets the policy when it opens, before it asks for them."""
    from onebit.backends.cpu import backend
    from onebit.formats.gguf_file import GGUFFile

    calls, count = [], backend.default_threads
    monkeypatch.setattr(backend, "wait_policy", lambda: calls.append("wait_policy"))
    monkeypatch.setattr(backend, "default_threads", lambda: calls.append("threads") or count())
    CpuBackend(GGUFFile(fixture_path("qwen3-f32.gguf")))
    assert calls == ["wait_policy", "threads"]


def test_others_running_counts_a_busy_process():
    """The count the wait policy reads: a busy process beside this one shows (on Linux)."""
    import subprocess
    import sys
    import time

    if not os.path.exists("/proc/loadavg"):
        pytest.skip("no /proc/loadavg")
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)
        assert threads._others_running() >= 0.6
    finally:
        busy.kill()
        busy.wait()


def test_the_threads_asked_for_hold_in_every_thread_that_runs_the_kernels():
    """A LoadSpec's `threads` (-t/--threads) sets numba's thread count, which is the calling
    thread's own: the backend sets it in each thread that runs its kernels (serve's worker, not
    only the thread that loaded). More than numba's pool has is refused."""
    import threading

    import numba

    from onebit.cli.options import load_spec
    from onebit.errors import UsageError

    assert load_spec(None, "cpu", threads=1).threads == 1
    m = onebit.load(fixture_path("qwen3moe-f32.gguf"), backend="cpu", threads=1)
    seen = []
    for _ in range(2):  # (the second thread may get the first's id once it has ended)
        worker = threading.Thread(target=lambda: (m.logits([1, 2, 3]), seen.append(numba.get_num_threads())))
        worker.start()
        worker.join()
    assert m.be.threads == 1 and seen == [1, 1]
    with pytest.raises(UsageError, match="--threads"):
        onebit.load(fixture_path("qwen3moe-f32.gguf"), backend="cpu", threads=numba.config.NUMBA_NUM_THREADS + 1)
