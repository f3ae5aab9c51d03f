"""Quant types: geometry agrees with gguf's table; dequantizers agree with the format spec."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gq

from onebit.backends.vulkan.reference import random_blocks
from onebit.formats.quants import EVEN_SIGNS, QTYPES, QTYPES_BY_NAME, Q1_0, iq_grid

IQ_TYPES = ["IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_NL", "IQ4_XS"]
REQUIRED = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
            "MXFP4", "Q1_0", "TQ1_0", "TQ2_0", *IQ_TYPES]


@pytest.mark.parametrize("name", REQUIRED)
def test_required_type_registered_with_gguf_geometry(name):
    qt = GGMLQuantizationType[name]
    cls = QTYPES[int(qt)]
    assert cls.name == name
    assert (cls.block_size, cls.type_size) == GGML_QUANT_SIZES[qt]


def _q1_0_block(d: float, bits: np.ndarray) -> bytes:
    return np.float16(d).tobytes() + np.packbits(bits.astype(np.uint8), bitorder="little").tobytes()


def test_q1_0_matches_spec():
    rng = np.random.default_rng(0)
    bits = rng.integers(0, 2, (3, 128))
    ds = [0.5, -1.25, 3.0e-3]
    raw = np.frombuffer(b"".join(_q1_0_block(d, b) for d, b in zip(ds, bits)), np.uint8).reshape(1, 3 * 18)
    out = Q1_0.dequantize(raw)
    assert out.shape == (1, 384) and out.dtype == np.float32
    for i, d in enumerate(ds):
        d16 = float(np.float16(d))
        expect = np.where(bits[i] == 1, d16, -d16)
        np.testing.assert_array_equal(out[0, i * 128 : (i + 1) * 128], expect)


def test_q1_0_bit_order_is_lsb_first():
    raw = np.frombuffer(np.float16(1.0).tobytes() + bytes([0b00000001]) + bytes(15), np.uint8)[None]
    out = Q1_0.dequantize(raw)[0]
    assert out[0] == 1.0 and np.all(out[1:] == -1.0)


@pytest.mark.parametrize("name", ["Q8_0", "Q4_0", "MXFP4", "TQ1_0", "TQ2_0", "BF16", "F16"])
def test_dequantize_reproduces_quantized_values(name):
    """Quantize with gguf's reference quantizer; our dequantized values must be close to the input
    within the type's precision and have the row layout [rows, n]."""
    qt = GGMLQuantizationType[name]
    x = np.random.default_rng(1).uniform(-1, 1, (4, 256)).astype(np.float32)
    raw = gq.quantize(x, qt)
    out = QTYPES[int(qt)].dequantize(raw)
    assert out.shape == x.shape and out.dtype == np.float32
    tol = {"Q8_0": 0.01, "Q4_0": 0.15, "MXFP4": 0.3, "TQ1_0": 1.0, "TQ2_0": 1.0, "BF16": 0.01, "F16": 0.001}[name]
    assert np.abs(out - x).max() <= tol


def _k_scale_min(scales: np.ndarray, j: int) -> tuple[int, int]:
    """Sub-block j's 6-bit scale and min from the 12 packed bytes of Q4_K / Q5_K."""
    if j < 4:
        return int(scales[j]) & 63, int(scales[j + 4]) & 63
    sc = (int(scales[j + 4]) & 0xF) | ((int(scales[j - 4]) >> 6) << 4)
    m = (int(scales[j + 4]) >> 4) | ((int(scales[j]) >> 6) << 4)
    return sc, m


def _decode_k_block(name: str, b: np.ndarray) -> list[float]:
    """One 256-weight super-block decoded weight by weight, as the format is laid out in ggml's
    block_q4_K / block_q5_K / block_q6_K (plain loops: an implementation independent of ours)."""
    f16 = lambda lo: float(np.frombuffer(bytes(b[lo : lo + 2]), np.float16)[0])  # noqa: E731
    y = [0.0] * 256
    if name in ("Q4_K", "Q5_K"):
        d, dmin, scales = f16(0), f16(2), b[4:16]
        qh, qs = (b[16:48], b[48:176]) if name == "Q5_K" else (None, b[16:144])
        for c in range(4):  # 64 weights: low nibbles are sub-block 2c, high nibbles 2c + 1
            for half in range(2):
                sc, m = _k_scale_min(scales, 2 * c + half)
                for l in range(32):
                    q = (int(qs[32 * c + l]) >> (4 * half)) & 0xF
                    if qh is not None and (int(qh[l]) >> (2 * c + half)) & 1:
                        q += 16
                    y[64 * c + 32 * half + l] = d * sc * q - dmin * m
        return y
    ql, qh, sc, d = b[0:128], b[128:192], b[192:208].view(np.int8), f16(208)
    for n in range(2):  # 128 weights: four runs of 32, each 4 low bits + 2 high bits, minus 32
        for l in range(32):
            h = int(qh[32 * n + l])
            lo = (int(ql[64 * n + l]), int(ql[64 * n + l + 32]))
            qv = ((lo[0] & 0xF) | ((h & 3) << 4), (lo[1] & 0xF) | (((h >> 2) & 3) << 4),
                  (lo[0] >> 4) | (((h >> 4) & 3) << 4), (lo[1] >> 4) | (((h >> 6) & 3) << 4))
            for r in range(4):
                y[128 * n + 32 * r + l] = d * int(sc[8 * n + l // 16 + 2 * r]) * (qv[r] - 32)
    return y


@pytest.mark.parametrize("name", ["Q4_K", "Q5_K", "Q6_K"])
def test_k_quants_decode_hand_built_blocks(name):
    """Random K-quant blocks (finite f16 scales) decode to the values the layout defines,
    checked weight by weight against plain loops over the bytes, in our row layout [rows, n]."""
    qt = GGMLQuantizationType[name]
    bs, ts = GGML_QUANT_SIZES[qt]
    rng = np.random.default_rng(2)
    raw = rng.integers(0, 256, (3, 2 * ts), dtype=np.uint8)
    for blk in range(2):  # keep the f16 super-block scales finite and small, of both signs
        offs = [blk * ts + ts - 2] if name == "Q6_K" else [blk * ts, blk * ts + 2]
        for j, off in enumerate(offs):
            raw[:, off : off + 2] = np.frombuffer(np.float16((-1) ** blk * 0.01 * (j + 1)).tobytes(), np.uint8)
    out = QTYPES[int(qt)].dequantize(raw)
    assert out.shape == (3, 2 * bs) and out.dtype == np.float32
    want = np.array([[v for blk in range(2) for v in _decode_k_block(name, row[blk * ts : (blk + 1) * ts])]
                     for row in raw], np.float64)
    np.testing.assert_allclose(out, want, rtol=1e-6, atol=1e-7)


# -- IQ types: our decoders (onebit/formats/quants.py) against gguf-py's, an independent implementation --


@pytest.mark.parametrize("name", IQ_TYPES)
def test_iq_types_match_gguf_on_random_blocks(name):
    """Random bytes (every index, sign and scale bit pattern; finite f16 scales of both signs),
    several rows of several blocks: ours equals gguf-py's decoder exactly, in the row layout."""
    rng = np.random.default_rng(3)
    cls = QTYPES_BY_NAME[name]
    raw = random_blocks(name, (5, 6 * cls.block_size), rng)
    out = cls.dequantize(raw)
    assert out.shape == (5, 6 * cls.block_size) and out.dtype == np.float32
    np.testing.assert_array_equal(out, gq.dequantize(raw, GGMLQuantizationType[name]))
    assert np.isfinite(out).all() and np.abs(out).max() > 0


@pytest.mark.parametrize("name", IQ_TYPES)
def test_iq_types_decode_leading_dims(name):
    """An expert tensor [E, rows, row_bytes] decodes like its rows one by one."""
    rng = np.random.default_rng(4)
    cls = QTYPES_BY_NAME[name]
    raw = random_blocks(name, (3, 2, 256), rng)
    out = cls.dequantize(raw)
    assert out.shape == (3, 2, 256)
    np.testing.assert_array_equal(out[2, 1], cls.dequantize(raw[2, 1][None])[0])


def test_iq_sign_table_has_even_parity():
    """The 7-bit sign fields of IQ2_XXS / IQ2_XS / IQ3_XXS: the implied 8th sign keeps the
    number of negative weights even, and the low 7 signs are the index bits."""
    neg = EVEN_SIGNS < 0
    assert (neg.sum(axis=1) % 2 == 0).all()
    for i in (0, 1, 77, 127):
        assert [bool(neg[i, j]) for j in range(7)] == [bool(i >> j & 1) for j in range(7)]


def test_iq_grids_shapes_and_values():
    """Grid magnitudes are the format's levels: IQ2 {8, 25, 43}, IQ3_XXS steps of 8 from 4,
    IQ3_S odd 1..15, IQ1 {-1, 0, 1}."""
    levels = {"IQ2_XXS": {8, 25, 43}, "IQ2_XS": {8, 25, 43}, "IQ2_S": {8, 25, 43},
              "IQ3_XXS": {4, 12, 20, 28, 36, 44, 52, 62}, "IQ3_S": set(range(1, 16, 2)), "IQ1_S": {-1, 0, 1}}
    shapes = {"IQ2_XXS": (256, 8), "IQ2_XS": (512, 8), "IQ2_S": (1024, 8), "IQ3_XXS": (256, 4), "IQ3_S": (512, 4),
              "IQ1_S": (2048, 8)}
    for name, want in levels.items():
        g = iq_grid(name)
        assert g.shape == shapes[name] and set(np.unique(g).astype(int)) <= want, name
        assert len(np.unique(g, axis=0)) == len(g), f"{name}: grid entries repeat"
