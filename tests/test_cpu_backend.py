"""The cpu backend (numba kernels) against the numpy reference.

Kernels: fresh random blocks of every type they claim (every quant bit pattern, sane
scales), outputs poisoned with NaN first, compared with the numpy twin (the type's
`dequantize`, then the float32 product). Backend: every fixture's logits within tolerance of
numpy and greedy tokens identical; streamed == resident bit for bit (tests/test_pool.py).
"""

from __future__ import annotations

import os

import numpy as np
import pytest

import onebit
from conftest import fixture_path
from onebit.backends import cpu_kernels as K
from onebit.backends import resolve
from onebit.backends.cpu import CpuBackend
from onebit.backends.numpy_backend import NumpyBackend
from onebit.backends.vulkan.reference import random_blocks
from onebit.quants import QTYPES, QTYPES_BY_NAME

TYPES = sorted(QTYPES[t].name for t in K.SUPPORTED)
# Relative tolerance (of the largest |reference| value) per weight type. Activations stay
# float32 and the weights decode to the reference's float32 values (up to one rounding of
# scale * quant), so what differs is the order of float32 sums: the same bound for every type.
TOL = {t: 2e-5 for t in TYPES}
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


@pytest.mark.parametrize("rows", [1, 3, 9])  # mat-vec; mat-mat with a partial group of 4 rows
@pytest.mark.parametrize("name", TYPES)
def test_matmul(rng, name, rows):
    w = random_blocks(name, (37, n_in(name)), rng)  # 37 rows: not a multiple of the work chunk
    x = rng.standard_normal((rows, n_in(name))).astype(np.float32)
    out = np.full((rows, 37), np.nan, np.float32)
    K.matmul(out, x, ro(w), QTYPES_BY_NAME[name].type_id)
    close(out, x @ QTYPES_BY_NAME[name].dequantize(w).T, TOL[name], name)


@pytest.mark.parametrize("name", TYPES)
def test_get_rows(rng, name):
    w = random_blocks(name, (20, n_in(name)), rng)
    ids = np.array([3, 0, 19, 3], np.int64)
    out = np.full((4, n_in(name)), np.nan, np.float32)
    K.get_rows(out, ro(w), ids, QTYPES_BY_NAME[name].type_id, K.LUT, K.M)
    want = QTYPES_BY_NAME[name].dequantize(w[ids])
    close(out, want, 1e-6, name)  # one rounding of scale * quant at most


@pytest.mark.parametrize("name", TYPES)
def test_expert_ffn_matches_numpy(rng, name):
    """The fused routed-expert kernel == NumpyBackend.expert_ffn summed over the chosen experts."""
    E, hidden, dim, R, k = 6, 2 * max(QTYPES_BY_NAME[name].block_size, 32), n_in(name), 5, 3
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
    experts, offs, rows, rw = CpuBackend.routed_rows(ids, wts)
    got = np.zeros_like(x)
    qt = Part.qtype
    K.expert_ffn(got, x, ro(gate), ro(up), ro(down), experts, offs, rows, rw, qt, qt, qt)
    close(got, want, TOL[name], name)

    # Split into groups of experts (a streaming pool with few slots): the same bits.
    split = np.zeros_like(x)
    for a, b in ((0, 2), (2, len(experts))):
        o = offs[a : b + 1]
        K.expert_ffn(split, x, ro(gate), ro(up), ro(down), experts[a:b], o - o[0], rows[o[0] : o[-1]],
                     rw[o[0] : o[-1]], qt, qt, qt)
    assert np.array_equal(split, got)


def _greedy(m, ids: np.ndarray, n: int) -> list[int]:
    cache = m.new_cache()
    logits = m.net.forward(ids, cache, last_only=True)
    out = []
    for _ in range(n):
        tok = int(np.argmax(logits[-1]))
        out.append(tok)
        logits = m.net.forward(np.array([tok], np.int64), cache)
    return out


ARCH = ["qwen3moe-f32", "qwen2moe-f32", "olmoe-f32", "llama-f32", "mixtral-f32", "qwen2-f32", "qwen3-f32"]
QUANT = ["q3moe256-" + t for t in ("F16", "BF16", "Q8_0", "Q4_0", "Q4_K_M", "Q5_K_M", "Q6_K", "MXFP4_MOE",
                                   "Q1_0", "TQ1_0", "TQ2_0")]


@pytest.mark.parametrize("name", ARCH + QUANT)
def test_cpu_matches_numpy(name):
    path = fixture_path(f"{name}.gguf")
    ids = np.load(fixture_path(f"{name}.ref.npz"))["tokens"][:12].astype(np.int64)
    ref, cpu = onebit.load(path, backend="numpy"), onebit.load(path, backend="cpu")
    assert isinstance(cpu.be, CpuBackend)
    want, got = ref.logits(ids), cpu.logits(ids)
    np.testing.assert_allclose(got, want, rtol=0, atol=LOGIT_TOL * np.abs(want).max())
    assert _greedy(cpu, ids[:6], 6) == _greedy(ref, ids[:6], 6)


def test_types_without_a_kernel_fall_back_and_say_so_once(capsys):
    m = onebit.load(fixture_path("q3moe256-Q1_0.gguf"), backend="cpu")
    err = capsys.readouterr().err
    assert err.count("onebit: note:") == 1 and "Q1_0" in err and "numpy reference path" in err
    m.logits([1, 2, 3])
    assert capsys.readouterr().err == ""


def test_auto_takes_vulkan_only_on_a_gpu(monkeypatch):
    """auto: Vulkan on an integrated or discrete GPU, else cpu; a CPU-type Vulkan device
    (lavapipe) only when a device is asked for by name."""
    import dataclasses

    import onebit.backends as backends
    from onebit.backends.vulkan import device as vkdev

    monkeypatch.delenv(vkdev.DEVICE_ENV, raising=False)
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
    assert onebit.load(fixture_path("qwen3moe-f32.gguf")).be.name == "cpu"
    monkeypatch.setenv(vkdev.DEVICE_ENV, "0")  # a device asked for by name or index
    assert resolve("auto") == "vulkan"
    monkeypatch.delenv(vkdev.DEVICE_ENV)
    for kind in ("integrated", "discrete"):
        monkeypatch.setattr(vkdev, "list_devices", lambda: [lavapipe, dataclasses.replace(lavapipe, type=kind)])
        assert backends.gpu_device().type == kind and resolve("auto") == "vulkan"
