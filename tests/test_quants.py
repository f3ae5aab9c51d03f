"""Quant types: geometry agrees with gguf's table; dequantizers agree with the format spec."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gq

from onebit.quants import QTYPES, Q1_0

REQUIRED = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K", "MXFP4", "Q1_0", "TQ1_0", "TQ2_0"]


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


@pytest.mark.parametrize("name", ["Q4_K", "Q5_K", "Q6_K"])
def test_k_quants_decode_random_blocks_like_gguf(name):
    """K-quants have no gguf quantizer; random blocks (finite scales) must decode to the same
    values as gguf's reference dequantizer, with our row layout."""
    qt = GGMLQuantizationType[name]
    bs, ts = GGML_QUANT_SIZES[qt]
    rng = np.random.default_rng(2)
    raw = rng.integers(0, 256, (3, 2 * ts), dtype=np.uint8)
    # keep the f16 super-block scales finite and small
    for blk in range(2):
        off = blk * ts + (ts - 2 if name == "Q6_K" else 0)
        n = 1 if name == "Q6_K" else 2
        for j in range(n):
            raw[:, off + 2 * j : off + 2 * j + 2] = np.frombuffer(np.float16(0.01 * (j + 1)).tobytes(), np.uint8)
    out = QTYPES[int(qt)].dequantize(raw)
    assert out.shape == (3, 2 * bs) and np.all(np.isfinite(out))
    np.testing.assert_array_equal(out, gq.dequantize(raw, qt).reshape(3, 2 * bs))
