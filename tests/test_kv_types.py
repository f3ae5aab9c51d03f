"""KV cache types (--cache-type-k / --cache-type-v): keys and values stored as ggml's f16, q8_0 and
q4_0 rows. The blocks against values worked out by hand from ggml's definitions; the caches'
rows, rings, trim, snapshot and prefix reuse against float32 caches given the same values; the
logits of fixture models against their f32 cache; the memory plan's bytes; the CLI flags.
llama.cpp with the same cache types: tools/check_kv_types.py (needs its build; figures in
bench/results/kv-cache-types-2026-12-07.md)."""

from __future__ import annotations

import numpy as np
import pytest

import onebit
from onebit.cache import F32_KV, KVCache, KVRows, KVTypes, RingKVCache, hadamard, hadamard_size, kv_cache_bytes
from onebit.errors import UsageError
from onebit.formats.quants import Q4_0, Q8_0
from onebit.model import shipped_model_path

from conftest import FIXTURES

MOE64 = FIXTURES / "q3moe256-Q8_0.gguf"  # head width 64 (q8_0 / q4_0 need a multiple of 32)
QTYPES = ("f16", "q8_0", "q4_0")


def test_q8_0_block_worked_by_hand():
    # amax 127: d = 127 / 127 = 1 (f16 exact), q = round(x / d), halves away from zero (ggml's roundf)
    x = np.zeros(32, np.float32)
    x[:9] = [127, -127, 0.5, -0.5, 1.5, 2.5, -2.5, 3.49, 100.2]
    raw = Q8_0.quantize(x[None])[0]
    assert raw.shape == (34,)
    assert raw[:2].view(np.float16)[0] == 1.0
    q = raw[2:].view(np.int8)
    assert list(q[:9]) == [127, -127, 1, -1, 2, 3, -3, 3, 100]
    assert not q[9:].any()
    assert list(Q8_0.dequantize(raw[None])[0, :9]) == [127, -127, 1, -1, 2, 3, -3, 3, 100]
    # a scale that f16 rounds: d = 1 / 127 is stored as f16, the codes come from the f32 scale
    y = np.linspace(-1, 1, 32, dtype=np.float32)
    raw = Q8_0.quantize(y[None])[0]
    d16 = np.float16(np.float32(1) / np.float32(127))
    assert raw[:2].view(np.float16)[0] == d16
    want = np.sign(y) * np.floor(np.abs(y * np.float32(127)) + np.float32(0.5))
    assert np.array_equal(raw[2:].view(np.int8), want.astype(np.int8))
    assert np.array_equal(Q8_0.dequantize(raw[None])[0], want.astype(np.float32) * np.float32(d16))


def test_q4_0_block_worked_by_hand():
    # the value of largest magnitude m sets d = m / -8; q = min(15, trunc(x / d + 8.5)); x' = (q - 8) d
    x = np.zeros(32, np.float32)
    x[:6] = [-8, 7, 0.5, -0.5, 3.2, -7.9]
    x[16:18] = [6.6, -2.4]
    raw = Q4_0.quantize(x[None])[0]
    assert raw.shape == (18,) and raw[:2].view(np.float16)[0] == 1.0
    q = np.concatenate([raw[2:] & 15, raw[2:] >> 4])  # byte j: value j (low nibble), value j + 16 (high)
    assert list(q[:6]) == [0, 15, 9, 8, 11, 0] and list(q[16:18]) == [15, 6]
    assert list(Q4_0.dequantize(raw[None])[0, :6]) == [-8, 7, 1, 0, 3, -8]
    # a positive extreme gives a negative scale: 16 -> d = -2, code 0 -> (0 - 8) * -2 = 16
    y = np.zeros(32, np.float32)
    y[:3] = [16, -14, 3]
    raw = Q4_0.quantize(y[None])[0]
    assert raw[:2].view(np.float16)[0] == -2.0
    # 16 -> trunc(0.5) = 0 -> 16; -14 -> trunc(15.5) = 15 -> -14; 3 -> trunc(7.0) = 7 -> (7 - 8) * -2 = 2
    assert list(Q4_0.dequantize(raw[None])[0, :3]) == [16, -14, 2]


@pytest.mark.parametrize("cls", (Q8_0, Q4_0), ids=("Q8_0", "Q4_0"))
def test_dequantize_equals_gguf_on_random_blocks(cls):
    """quants' own Q8_0 / Q4_0 decoders and quantizers (what a quantized cache uses) against gguf's."""
    import gguf
    from gguf import quants as gguf_quants

    rng = np.random.default_rng(3)
    raw = rng.integers(0, 256, (7, 3, cls.row_bytes(96)), dtype=np.uint8)
    blocks = raw.reshape(-1, cls.type_size)
    blocks[:, :2] = rng.standard_normal(len(blocks)).astype(np.float16).view(np.uint8).reshape(-1, 2)
    want = gguf_quants.dequantize(raw, gguf.GGMLQuantizationType(cls.type_id))
    got = cls.dequantize(raw)
    assert got.dtype == np.float32 and got.shape == (7, 3, 96) and np.array_equal(got, want)
    for scale in (1e-3, 1.0, 100.0):  # and their quantizers, halves and zero blocks among the values
        x = (rng.standard_normal((13, 2, 96)) * scale).astype(np.float32)
        x[0, 0, :32] = 0
        x[1, 0, :6] = [0.5, -0.5, 2.5, -2.5, 127, 0.49999997]
        x[2, 1, :32] = np.round(x[2, 1, :32] * 4) / 4
        assert np.array_equal(cls.quantize(x), gguf_quants.quantize(x, gguf.GGMLQuantizationType(cls.type_id)))


def _hadamard_matrix(n: int) -> np.ndarray:
    """ggml_gen_hadamard's matrix, written out: 1/sqrt(n) at [0, 0], then [[H, H], [H, -H]]."""
    h = np.full((1, 1), 1 / np.sqrt(n))
    while len(h) < n:
        h = np.block([[h, h], [h, -h]])
    return h


def test_hadamard_rotation():
    rng = np.random.default_rng(4)
    x = rng.standard_normal((3, 2, 256)).astype(np.float32)
    for n in (64, 128, 256):
        want = (x.reshape(-1, n).astype(np.float64) @ _hadamard_matrix(n)).reshape(x.shape)
        assert np.abs(hadamard(x, n) - want).max() < 1e-5
        assert np.abs(hadamard(hadamard(x, n), n) - x).max() < 1e-5  # its own inverse
    # llama.cpp's sizes (llama-kv-cache.cpp): heads a multiple of 64 wide; keys the largest power
    # of two dividing the width, values 64
    assert [hadamard_size("k", w) for w in (32, 64, 96, 128, 192, 256)] == [0, 64, 0, 128, 64, 256]
    assert [hadamard_size("v", w) for w in (32, 64, 128, 256)] == [0, 64, 64, 64]


def _round_trip(t: str, x: np.ndarray, which: str = "k") -> np.ndarray:
    """x as a cache of type t stores and reads it back, from the quants classes and the rotation
    (quantized types, heads a multiple of 64 wide)."""
    if t == "f32":
        return x
    if t == "f16":
        return x.astype(np.float16).astype(np.float32)
    cls = {"q8_0": Q8_0, "q4_0": Q4_0}[t]
    n = hadamard_size(which, x.shape[-1])
    if not n:
        return cls.dequantize(cls.quantize(x))
    h = _hadamard_matrix(n)
    turned = (x.reshape(-1, n).astype(np.float64) @ h).astype(np.float32).reshape(x.shape)
    back = cls.dequantize(cls.quantize(turned))
    return (back.reshape(-1, n).astype(np.float64) @ h).astype(np.float32).reshape(x.shape)


@pytest.mark.parametrize("t", QTYPES)
def test_cache_rows_read_back_as_stored(t):
    rng = np.random.default_rng(1)
    c = KVCache(2, 64, 32, 0, KVTypes(t, t))
    assert isinstance(c.keys, KVRows)
    k1, v1 = rng.standard_normal((5, 2, 64), np.float32), rng.standard_normal((5, 2, 32), np.float32)
    k2, v2 = rng.standard_normal((300, 2, 64), np.float32), rng.standard_normal((300, 2, 32), np.float32)
    c.write(0, k1, v1)
    keys, values = c.write(5, k2, v2)  # grows past one step of 256
    assert keys.dtype == np.float32 and keys.shape == (305, 2, 64) and values.shape == (305, 2, 32)
    rk = c.rotation[0]
    assert c.rotation == ((64 if t != "f16" else 0), 0)  # (values 32 wide: not rotated)
    # what the attention takes (still rotated) and what the cache holds (indexing: rotated back)
    assert np.abs((hadamard(keys, rk) if rk else keys) - c.keys[:305]).max() < 1e-5
    # (the rotation's float sums differ from the matrix product's in the last bits, so a value
    # on a rounding edge may take the next code: a step of the block's scale at most)
    tol = {"f16": 0, "q8_0": 0.05, "q4_0": 0.8}[t]
    assert np.abs(c.keys[:305] - _round_trip(t, np.concatenate([k1, k2]))).max() <= tol
    assert np.array_equal(values, _round_trip(t, np.concatenate([v1, v2]), "v"))
    per_pos = 2 * (KVTypes(t, t).qtype("k").row_bytes(64) + KVTypes(t, t).qtype("v").row_bytes(32))
    assert c.nbytes == 512 * per_pos  # (two steps of 256 positions)
    # snapshot, overwrite, restore: the blocks come back as they were
    state = c.snapshot(200)
    c.write(100, k2[:50], v2[:50])
    c.restore(state)
    before = keys[:200]
    keys, _ = c.write(200, k2[195:200], v2[195:200])
    assert np.array_equal(keys[:200], before)


@pytest.mark.parametrize("t", ("q8_0", "q4_0"))
@pytest.mark.parametrize("rows", (4, 40))  # within the ring's rows, and a forward longer than them
def test_ring_matches_a_float_ring_given_stored_values(t, rows):
    """A quantized ring returns what a float32 ring returns when given the values as stored."""
    rng = np.random.default_rng(2)
    q = RingKVCache(1, 32, 32, window=8, rows=16, types=KVTypes(t, t))
    f = RingKVCache(1, 32, 32, window=8, rows=16)
    start = 0
    for step in range(6):
        n = rows if step % 2 else 3
        k, v = rng.standard_normal((n, 1, 32), np.float32), rng.standard_normal((n, 1, 32), np.float32)
        qk, qv = q.write(start, k, v)
        fk, fv = f.write(start, _round_trip(t, k), _round_trip(t, v))
        assert np.array_equal(qk, fk) and np.array_equal(qv, fv)
        start += n
    state = q.snapshot(start)
    q.trim(start - 2)
    q.restore(state)
    assert np.array_equal(q.keys[:], f.keys) and q.held_from == f.held_from


def test_types_are_checked():
    with pytest.raises(UsageError, match="q5_0"):
        KVTypes("q5_0", "f32")
    cfg = onebit.load(FIXTURES / "llama-f32.gguf", backend="numpy").cfg  # heads 16 wide
    with pytest.raises(UsageError, match="multiple of the type's block of 32"):
        KVTypes("f32", "q8_0").check(cfg)
    KVTypes("f16", "f16").check(cfg)
    with pytest.raises(UsageError, match="--cache-type-v q4_0"):
        onebit.load(FIXTURES / "llama-f32.gguf", backend="numpy", cache_type_v="q4_0")


def _logits(path, backend, t, ids):
    with onebit.load(path, backend=backend, cache_type_k=t, cache_type_v=t) as m:
        cache = m.net.make_cache()
        assert cache.nbytes == 0 or cache.nbytes == kv_cache_bytes(m.cfg, cache[0].keys.shape[0], KVTypes(t, t))
        # a prompt, then single decode steps: both paths read the cache
        return np.concatenate([m.net.forward(ids[:24], cache)] + [m.net.forward(ids[i : i + 1], cache)
                                                                   for i in range(24, len(ids))])


def _cos(a, b):
    return (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


# The bars (cosine min and median over positions, greedy agreement), from the fixtures' measured
# figures (numpy, 48 positions; the random-weight MoE has a sensitive position or two): q8_0
# keeps logits close to the f32 cache's and greedy tokens almost all the same; q4_0 (4-bit keys
# and values) moves them further, in llama.cpp as here (tools/check_kv_types.py).
BARS = {"f16": (0.9999, 0.99999, 1.0), "q8_0": (0.97, 0.9995, 0.9), "q4_0": (0.7, 0.95, 0.5)}


@pytest.mark.parametrize("path", [MOE64, shipped_model_path()], ids=["q3moe256", "default"])
def test_logits_against_the_f32_cache(path):
    ids = (np.arange(1, 49) * 7) % 200
    base = _logits(path, "numpy", "f32", ids)
    for t in QTYPES:
        got = _logits(path, "numpy", t, ids)
        cos, agree = _cos(got, base), (got.argmax(-1) == base.argmax(-1)).mean()
        lo, mid, greedy = BARS[t]
        assert cos.min() >= lo and np.median(cos) >= mid and agree >= greedy, (t, cos.min(), np.median(cos), agree)
        assert not np.array_equal(got, base)  # the cache type is in effect


def _same_greedy(got, ref, tie: float = 0.02):
    """Greedy tokens equal, but where the reference's best two are within `tie` (a 4-bit code
    flips on the last bits of float K/V, which backends sum in their own orders)."""
    a, b = got.argmax(-1), ref.argmax(-1)
    rows = np.arange(len(ref))
    assert (a == b).mean() >= 0.9
    assert np.all((a == b) | (ref[rows, b] - ref[rows, a] <= tie)), (a, b)


def test_cpu_backend_equals_numpy_with_a_quantized_cache():
    ids = (np.arange(1, 41) * 5) % 200
    for t in ("q8_0", "q4_0"):
        ref, got = _logits(MOE64, "numpy", t, ids), _logits(MOE64, "cpu", t, ids)
        assert _cos(got, ref).min() >= 0.9999
        _same_greedy(got, ref)


@pytest.fixture
def vulkan(monkeypatch):
    from onebit.backends import BACKENDS
    from onebit.backends.vulkan.backend import VulkanBackend

    monkeypatch.setitem(BACKENDS, "vulkan", VulkanBackend)  # (lavapipe: asked for by name)


@pytest.mark.parametrize("path, k, v", [(MOE64, "q8_0", "q8_0"), (MOE64, "q4_0", "f32"),
                                        (FIXTURES / "gemma3-f32.gguf", "f16", "f16")],  # rings, 16-wide heads
                         ids=["q8_0", "q4_0-f32", "gemma3-f16"])
def test_vulkan_equals_numpy_with_a_cache_of_blocks(vulkan, path, k, v):
    """The device writes the blocks (set_rows_<T>) and decodes them for the attention; prompt
    rows and decode steps against the numpy cache of the same types."""
    ids = (np.arange(1, 41) * 5) % 200
    out = {}
    for be in ("numpy", "vulkan"):
        with onebit.load(path, backend=be, cache_type_k=k, cache_type_v=v) as m:
            assert m.be.name == be
            cache = m.net.make_cache()
            out[be] = np.concatenate([m.net.forward(ids[:24], cache)] + [m.net.forward(ids[i : i + 1], cache)
                                                                          for i in range(24, len(ids))])
            if be == "vulkan":  # the host's view of the device blocks reads back as numpy's cache holds them
                layer = cache[0]
                assert isinstance(layer.keys, KVRows) or k == "f32"
    assert _cos(out["vulkan"], out["numpy"]).min() >= 0.9999
    _same_greedy(out["vulkan"], out["numpy"])


def test_vulkan_cache_of_blocks_snapshot_restore_trim(vulkan):
    a, b = (np.arange(1, 21) * 3) % 200, (np.arange(1, 9) * 11) % 200
    with onebit.load(MOE64, backend="vulkan", cache_type_k="q4_0", cache_type_v="q8_0") as m:
        cache = m.net.make_cache()
        m.net.forward(a, cache)
        state = cache.snapshot()
        first = m.net.forward(b, cache)
        cache.trim(len(b))
        assert np.array_equal(m.net.forward(b, cache), first)  # rows rewritten at the same positions
        m.net.forward(b[::-1], cache)
        cache.restore(state)
        assert np.array_equal(m.net.forward(b, cache), first)


def test_prefix_reuse_and_trim_with_a_quantized_cache():
    """Trimming back and running other tokens gives what a fresh cache gives, bit for bit (a
    position's blocks depend on that position's K/V only)."""
    a, b = (np.arange(1, 31) * 3) % 200, (np.arange(1, 11) * 11) % 200
    with onebit.load(MOE64, backend="numpy", cache_type_k="q8_0", cache_type_v="q4_0") as m:
        cache = m.net.make_cache()
        m.net.forward(a, cache)
        cache.trim(10)
        reused = m.net.forward(b, cache)
        fresh = m.net.make_cache()
        m.net.forward(a[:20], fresh)  # (the same row counts as above: the products' sums in the same order)
        want = m.net.forward(b, fresh)
        assert np.array_equal(reused, want)


def test_plan_counts_the_cache_at_its_types_bytes():
    from onebit.formats.gguf_file import GGUFFile
    from onebit.memory.budget import detect_budget
    from onebit.memory.plan import make_plan
    from onebit.models import network_class

    g = GGUFFile(str(MOE64))
    cfg = network_class(g.architecture, str(MOE64)).config(g)
    b = detect_budget("8GiB")
    kv = {t: _item(make_plan(g, cfg, b, ctx=512, kv=KVTypes(t, t)), "KV cache") for t in ("f32", "f16", "q8_0", "q4_0")}
    # per position and layer Hkv * (D + Dv) values, at 4, 2, 34/32 and 18/32 bytes each
    per_value = cfg.n_kv_heads * (cfg.head_dim + cfg.head_dim_v) * 512 * cfg.n_layers
    assert kv == {"f32": 4 * per_value, "f16": 2 * per_value, "q8_0": per_value * 34 // 32,
                  "q4_0": per_value * 18 // 32}
    assert kv_cache_bytes(cfg, 512) == kv["f32"] and F32_KV.plain


def _item(plan, component: str) -> int:
    return next(i.bytes for i in plan.items if i.component == component)


def test_a_quantized_cache_leaves_the_slots_more_room():
    """A budget three expert slots short of every expert with the f32 cache: the q4_0 cache
    (0.86 MiB less here, less the 0.5 MiB of one layer's K/V decoded for the attention; a slot
    is 204 KiB) gives the slots what it saves."""
    import dataclasses

    from onebit.formats.gguf_file import GGUFFile
    from onebit.memory.budget import detect_budget
    from onebit.memory.plan import make_plan
    from onebit.models import network_class

    g = GGUFFile(str(MOE64))
    cfg = network_class(g.architecture, str(MOE64)).config(g)
    whole = make_plan(g, cfg, detect_budget("8GiB"), ctx=512)
    slot = _item(whole, "expert slots") // sum(whole.slots)
    budget = dataclasses.replace(whole.budget, bytes=whole.total - 3 * slot)
    f32 = make_plan(g, cfg, budget, ctx=512)
    q4 = make_plan(g, cfg, budget, ctx=512, kv=KVTypes("q4_0", "q4_0"))
    assert f32.fits and q4.fits and sum(f32.slots) == sum(whole.slots) - 3
    saved = sum(_item(f32, c) - _item(q4, c) for c in ("KV cache", "compute scratch"))
    assert saved > slot and sum(q4.slots) == sum(f32.slots) + saved // slot


def _onebit(*args):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "onebit.cli.main", *args], capture_output=True, text=True, timeout=300)


def test_cli_cache_type_flags():
    r = _onebit("plan", str(MOE64), "--backend", "numpy", "--ctx", "512", "-ctk", "q8_0", "--cache-type-v", "q4_0")
    assert r.returncode == 0, r.stderr
    assert "keys q8_0, values q4_0" in r.stdout
    r = _onebit("generate", "-m", str(MOE64), "--backend", "numpy", "-p", "hi", "-n", "3", "-ctk", "q4_0",
                "-ctv", "f16")
    assert r.returncode == 0, r.stderr
    for bad, msg in ((("-ctk", "q3_k"), "not a cache type"), (("-ctv", "q8_0", "-m", str(FIXTURES / "llama-f32.gguf")),
                                                              "multiple of the type's block")):
        r = _onebit("generate", "--backend", "numpy", "-p", "hi", "-n", "1", *bad)
        assert r.returncode == 2 and msg in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


@pytest.mark.parametrize("k, v", [("q8_0", "q8_0"), ("q4_0", "q4_0"), ("f16", "q8_0"), ("q4_0", "f16")])
def test_cpu_attention_reads_the_blocks(k, v):
    """The cpu backend's decode attention over a cache's blocks as stored (kv_attention.py)
    against the numpy reference's over the float32 rows they decode to: GQA, rows at several
    positions, a sliding window over a ring (position p in row p % S)."""
    from onebit.backends.cpu.backend import CpuBackend
    from onebit.backends.numpy_backend import NumpyBackend
    from onebit.formats.gguf_file import GGUFFile

    be = CpuBackend(GGUFFile(MOE64))
    rng = np.random.default_rng(3)
    H, Hkv, D, S = 4, 2, 64, 40
    keys = KVRows.zeros(KVTypes(k, v).qtype("k"), S, Hkv, D)
    values = KVRows.zeros(KVTypes(k, v).qtype("v"), S, Hkv, D)
    keys[:] = rng.standard_normal((S, Hkv, D)).astype(np.float32)
    values[:] = rng.standard_normal((S, Hkv, D)).astype(np.float32)
    q = rng.standard_normal((3, H, D)).astype(np.float32)
    for pos, window in (([5, 6, 7], 0), ([37, 38, 39], 0), ([50, 51, 52], 16)):  # (the last: a ring)
        pos = np.array(pos, np.int64)
        got = be.attention(q, keys, values, pos, window)
        want = NumpyBackend.attention(be, q, keys.read(slice(None)), values.read(slice(None)), pos, window)
        assert np.allclose(got, want, rtol=1e-5, atol=1e-6), np.abs(got - want).max()


@pytest.mark.parametrize("backend", ("numpy", "cpu"))
def test_sequences_together_with_a_rotated_cache(backend):
    """forward_batch (serve --parallel) over caches of q8_0 keys and q4_0 values whose heads are
    rotated (64 wide: cache.hadamard_size): each sequence's logits are its own forward's."""
    with onebit.load(MOE64, backend=backend, cache_type_k="q8_0", cache_type_v="q4_0") as m:
        assert m.net.make_cache()[0].rotation == (64, 64)
        a, b = (np.arange(1, 13) * 7) % 200, (np.arange(1, 8) * 11) % 200
        alone = []
        for ids in (a, b):  # a prompt, then a decode step (the cpu backend's: over the cache's blocks)
            c = m.net.make_cache()
            alone.append(np.concatenate([m.net.forward(ids[:-1], c), m.net.forward(ids[-1:], c)]))
        ca, cb = m.net.make_cache(), m.net.make_cache()
        together = m.net.forward_batch([(a[:-1], ca), (b[:-1], cb)])
        together = [np.concatenate([t, s]) for t, s in
                    zip(together, m.net.forward_batch([(a[-1:], ca), (b[-1:], cb)]))]
        for got, want in zip(together, alone):
            assert np.allclose(got, want, rtol=1e-4, atol=1e-4), np.abs(got - want).max()


def test_the_cpu_attention_keeps_no_decoded_rows():
    """A prompt's attention over a quantized cache decodes the layer's rows (`_decoded`): the
    decoded copy belongs to that call. The rows' views are new at every call, so a decode kept
    past its call would hold one float32 copy of the layer per prompt chunk, for good."""
    import gc
    import weakref

    from onebit.backends.cpu.backend import _decoded

    rows = KVRows.zeros(Q8_0, 4, 1, 32)
    ref = weakref.ref(view := rows.view(4))
    _decoded(view)
    del view
    gc.collect()
    assert ref() is None
