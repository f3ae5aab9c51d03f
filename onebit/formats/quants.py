"""Quantization types: one class per GGML type, registered by type id.

Each class knows its block geometry and turns raw blocks into float32. The float, legacy
and K types delegate to the `gguf` package's reference dequantizers; Q1_0 (missing there)
and the IQ types are implemented here, the IQ types from their block layouts with the
codebook grids read from `gguf` as data (tests check ours against gguf's decoders and
llama.cpp). A tensor row of `n` weights takes `n // block_size * type_size` bytes.
"""

from __future__ import annotations

from functools import cache

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gguf_quants

QTYPES: dict[int, type["QType"]] = {}


def register(cls):
    QTYPES[cls.type_id] = cls
    return cls


class QType:
    name: str
    type_id: int
    block_size: int
    type_size: int

    @classmethod
    def row_bytes(cls, n: int) -> int:
        return n // cls.block_size * cls.type_size

    @classmethod
    def dequantize(cls, raw: np.ndarray) -> np.ndarray:
        """raw: uint8 [..., row_bytes] -> float32 [..., n]."""
        return gguf_quants.dequantize(np.ascontiguousarray(raw), GGMLQuantizationType(cls.type_id)).astype(
            np.float32, copy=False
        )

    @classmethod
    def quantize(cls, x: np.ndarray) -> np.ndarray:
        """float32 [..., n] -> uint8 [..., row_bytes], as ggml's reference quantizer writes it
        (gguf's numpy twin of it; F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 and a few more)."""
        q = gguf_quants.quantize(np.ascontiguousarray(x, dtype=np.float32), GGMLQuantizationType(cls.type_id))
        return np.ascontiguousarray(q).view(np.uint8)


def _gguf_type(name: str) -> type[QType]:
    qt = GGMLQuantizationType[name]
    block_size, type_size = GGML_QUANT_SIZES[qt]
    cls = type(name, (QType,), {"name": name, "type_id": int(qt), "block_size": block_size, "type_size": type_size})
    return register(cls)


F32 = _gguf_type("F32")
F16 = _gguf_type("F16")
BF16 = _gguf_type("BF16")
# Float types are plain views; skip the generic path's copies.
F32.dequantize = classmethod(lambda cls, raw: np.ascontiguousarray(raw).view(np.float32))
F16.dequantize = classmethod(lambda cls, raw: np.ascontiguousarray(raw).view(np.float16).astype(np.float32))
BF16.dequantize = classmethod(
    lambda cls, raw: (np.ascontiguousarray(raw).view(np.uint16).astype(np.uint32) << 16).view(np.float32)
)
Q8_0 = _gguf_type("Q8_0")
Q4_0 = _gguf_type("Q4_0")


# Q8_0 and Q4_0 in a few whole-array steps (gguf's generic path costs more than the arithmetic
# on the short rows a quantized KV cache writes and reads every step); the same results as
# gguf's (its twin of ggml's reference quantizer), bit for bit.
def _q8_0(cls, raw: np.ndarray) -> np.ndarray:
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    b = raw.reshape(-1, 34)
    out = b[:, 2:].view(np.int8).astype(np.float32) * b[:, :2].view(np.float16).astype(np.float32)
    return out.reshape(*raw.shape[:-1], raw.shape[-1] // 34 * 32)


def _q4_0(cls, raw: np.ndarray) -> np.ndarray:
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    b = raw.reshape(-1, 18)
    q = np.concatenate([b[:, 2:] & 15, b[:, 2:] >> 4], axis=1).view(np.int8) - np.int8(8)  # value j: low nibble
    out = q.astype(np.float32) * b[:, :2].view(np.float16).astype(np.float32)  # of byte j, j + 16: high nibble
    return out.reshape(*raw.shape[:-1], raw.shape[-1] // 18 * 32)


def _quantize_q8_0(cls, x: np.ndarray) -> np.ndarray:
    x = np.ascontiguousarray(x, dtype=np.float32)
    b = x.reshape(-1, 32)
    d = np.abs(b).max(axis=1, keepdims=True) / np.float32(127)
    with np.errstate(divide="ignore"):
        inv = np.where(d == 0, np.float32(0), np.float32(1) / d)
    v = b * inv
    a = np.abs(v)
    f = np.floor(a)
    q = np.sign(v) * (f + np.floor(2 * (a - f)))  # roundf: halves away from zero, exactly
    out = np.concatenate([d.astype(np.float16).view(np.uint8), q.astype(np.int8).view(np.uint8)], axis=1)
    return out.reshape(*x.shape[:-1], x.shape[-1] // 32 * 34)


def _quantize_q4_0(cls, x: np.ndarray) -> np.ndarray:
    x = np.ascontiguousarray(x, dtype=np.float32)
    b = x.reshape(-1, 32)
    m = np.take_along_axis(b, np.abs(b).argmax(axis=1, keepdims=True), axis=1)  # first of the largest |x|
    d = m / np.float32(-8)
    with np.errstate(divide="ignore"):
        inv = np.where(d == 0, np.float32(0), np.float32(1) / d)
    q = np.minimum(np.trunc(b * inv + np.float32(8.5)), np.float32(15)).astype(np.uint8)
    out = np.concatenate([d.astype(np.float16).view(np.uint8), q[:, :16] | (q[:, 16:] << np.uint8(4))], axis=1)
    return out.reshape(*x.shape[:-1], x.shape[-1] // 32 * 18)


Q8_0.dequantize = classmethod(_q8_0)
Q4_0.dequantize = classmethod(_q4_0)
Q8_0.quantize = classmethod(_quantize_q8_0)
Q4_0.quantize = classmethod(_quantize_q4_0)
Q4_1 = _gguf_type("Q4_1")
Q5_0 = _gguf_type("Q5_0")
Q5_1 = _gguf_type("Q5_1")
Q2_K = _gguf_type("Q2_K")
Q3_K = _gguf_type("Q3_K")
Q4_K = _gguf_type("Q4_K")
Q5_K = _gguf_type("Q5_K")
Q6_K = _gguf_type("Q6_K")
MXFP4 = _gguf_type("MXFP4")
TQ1_0 = _gguf_type("TQ1_0")
TQ2_0 = _gguf_type("TQ2_0")


@register
class Q1_0(QType):
    """128 weights per block: an f16 scale d, then 128 sign bits, LSB first; w = bit ? +d : -d."""

    name = "Q1_0"
    type_id = 41
    block_size = 128
    type_size = 2 + 16

    @classmethod
    def dequantize(cls, raw: np.ndarray) -> np.ndarray:
        raw = np.ascontiguousarray(raw, dtype=np.uint8)
        lead = raw.shape[:-1]
        blocks = raw.reshape(-1, cls.type_size)  # [nb, 18]
        d = blocks[:, :2].copy().view(np.float16).astype(np.float32)  # [nb, 1]
        bits = np.unpackbits(blocks[:, 2:], axis=1, bitorder="little")  # [nb, 128]
        out = np.where(bits == 1, d, -d).astype(np.float32)
        n = raw.shape[-1] // cls.type_size * cls.block_size
        return out.reshape(*lead, n)


# -- IQ types ------------------------------------------------------------------------------
# Codebook types: each group of 4 or 8 weights is an index into a fixed grid of magnitudes,
# plus sign bits and a per-run scale. The grids are data, taken from gguf's tables.


@cache
def iq_grid(name: str) -> np.ndarray:
    """The codebook of IQ type `name` as float32 [entries, 4 or 8] (IQ1_*: values -1, 0, 1)."""
    src = getattr(gguf_quants, "IQ1_S" if name == "IQ1_M" else name)
    src.init_grid()
    return np.ascontiguousarray(src.grid.reshape(src.grid_shape), dtype=np.float32)


@cache
def iq4_values() -> np.ndarray:
    """IQ4_NL / IQ4_XS: the 16 non-linear levels a nibble selects."""
    return np.array(gguf_quants.IQ4_NL.kvalues, dtype=np.float32)


def _even_sign_table() -> np.ndarray:
    """IQ2_XXS / IQ2_XS / IQ3_XXS store 7 sign bits per 8 weights; the 8th makes the count of
    negatives even. float32 [128, 8] of +-1."""
    i = np.arange(128)
    parity = np.array([bin(v).count("1") & 1 for v in i])
    byte = (i | (parity << 7)).astype(np.uint8)
    bits = np.unpackbits(byte[:, None], axis=1, bitorder="little")
    return (1 - 2 * bits.astype(np.float32)).astype(np.float32)


EVEN_SIGNS = _even_sign_table()


def _sign_bits(b: np.ndarray) -> np.ndarray:
    """Plain sign bytes (bit j set: weight j negative) -> float32 [..., 8 per byte] of +-1."""
    bits = np.unpackbits(b[..., None], axis=-1, bitorder="little")
    return (1 - 2 * bits.astype(np.float32)).astype(np.float32)


def _f16(b: np.ndarray) -> np.ndarray:
    """[nb, 2] bytes -> float32 [nb]."""
    return np.ascontiguousarray(b).view(np.float16)[:, 0].astype(np.float32)


def _u16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view("<u2")


def _u32(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view("<u4")


class BlockType(QType):
    """A type decoded block by block: `decode(blocks [nb, type_size]) -> float32 [nb, block_size]`."""

    @classmethod
    def decode(cls, b: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    @classmethod
    def dequantize(cls, raw: np.ndarray) -> np.ndarray:
        raw = np.ascontiguousarray(raw, dtype=np.uint8)
        lead = raw.shape[:-1]
        n = raw.shape[-1] // cls.type_size * cls.block_size
        out = cls.decode(raw.reshape(-1, cls.type_size))
        return out.astype(np.float32, copy=False).reshape(*lead, n)


def _iq_type(name: str):
    def wrap(cls):
        qt = GGMLQuantizationType[name]
        cls.name, cls.type_id = name, int(qt)
        cls.block_size, cls.type_size = GGML_QUANT_SIZES[qt]
        return register(cls)
    return wrap


@_iq_type("IQ2_XXS")
class IQ2_XXS(BlockType):
    """66 bytes: f16 d; per 32 weights 8 bytes: 4 grid indices (8 weights each), then a u32 of
    four 7-bit sign fields and a 4-bit scale s in the top bits; w = d (0.5 + s) / 4 * grid * sign."""

    @classmethod
    def decode(cls, b):
        nb = len(b)
        d = _f16(b[:, 0:2])
        sub = b[:, 2:66].reshape(nb, 8, 8)
        aux = _u32(sub[:, :, 4:8])[..., 0]  # [nb, 8]
        scale = d[:, None] * (np.float32(0.5) + (aux >> 28).astype(np.float32)) * np.float32(0.25)
        signs = EVEN_SIGNS[(aux[..., None] >> np.array([0, 7, 14, 21], np.uint32)) & 127]  # [nb, 8, 4, 8]
        vals = iq_grid("IQ2_XXS")[sub[:, :, 0:4]]  # [nb, 8, 4, 8]
        return (scale[..., None, None] * vals * signs).reshape(nb, 256)


@_iq_type("IQ2_XS")
class IQ2_XS(BlockType):
    """74 bytes: f16 d; 32 u16 (9-bit grid index, 7-bit sign field) per 8 weights; 8 bytes of
    4-bit scales, one per 16 weights (low nibble first); w = d (0.5 + s) / 4 * grid * sign."""

    @classmethod
    def decode(cls, b):
        nb = len(b)
        d = _f16(b[:, 0:2])
        qs = _u16(b[:, 2:66])  # [nb, 32]
        sc = b[:, 66:74]
        s = np.stack([sc & 15, sc >> 4], axis=-1).reshape(nb, 16).astype(np.float32)
        scale = d[:, None] * (np.float32(0.5) + s) * np.float32(0.25)  # [nb, 16]
        vals = iq_grid("IQ2_XS")[qs & 511] * EVEN_SIGNS[qs >> 9]  # [nb, 32, 8]
        return (np.repeat(scale, 2, axis=1)[..., None] * vals).reshape(nb, 256)


@_iq_type("IQ2_S")
class IQ2_S(BlockType):
    """82 bytes: f16 d; 32 low bytes of 10-bit grid indices; 32 sign bytes; 8 bytes of the
    indices' high 2 bits (four per byte); 8 bytes of 4-bit scales, one per 16 weights."""

    @classmethod
    def decode(cls, b):
        nb = len(b)
        d = _f16(b[:, 0:2])
        lo, sg, qh, sc = b[:, 2:34], b[:, 34:66], b[:, 66:74], b[:, 74:82]
        hi = (qh[:, :, None] >> np.array([0, 2, 4, 6], np.uint8)) & 3  # [nb, 8, 4]
        idx = lo.astype(np.int64) | (hi.reshape(nb, 32).astype(np.int64) << 8)
        s = np.stack([sc & 15, sc >> 4], axis=-1).reshape(nb, 16).astype(np.float32)
        scale = d[:, None] * (np.float32(0.5) + s) * np.float32(0.25)
        vals = iq_grid("IQ2_S")[idx] * _sign_bits(sg)  # [nb, 32, 8]
        return (np.repeat(scale, 2, axis=1)[..., None] * vals).reshape(nb, 256)


@_iq_type("IQ3_XXS")
class IQ3_XXS(BlockType):
    """98 bytes: f16 d; 64 grid indices (4 weights each); per 32 weights a u32 of four 7-bit
    sign fields and a 4-bit scale s on top; w = d (0.5 + s) / 2 * grid * sign."""

    @classmethod
    def decode(cls, b):
        nb = len(b)
        d = _f16(b[:, 0:2])
        aux = _u32(b[:, 66:98])  # [nb, 8]
        scale = d[:, None] * (np.float32(0.5) + (aux >> 28).astype(np.float32)) * np.float32(0.5)
        signs = EVEN_SIGNS[(aux[..., None] >> np.array([0, 7, 14, 21], np.uint32)) & 127]  # [nb, 8, 4, 8]
        vals = iq_grid("IQ3_XXS")[b[:, 2:66]].reshape(nb, 8, 4, 8)
        return (scale[..., None, None] * vals * signs).reshape(nb, 256)


@_iq_type("IQ3_S")
class IQ3_S(BlockType):
    """110 bytes: f16 d; 64 low bytes of 9-bit grid indices (4 weights each); 8 bytes of their
    high bits; 32 sign bytes (bit per weight); 4 bytes of 4-bit scales, one per 32 weights;
    w = d (1 + 2 s) * grid * sign."""

    @classmethod
    def decode(cls, b):
        nb = len(b)
        d = _f16(b[:, 0:2])
        lo, qh, sg, sc = b[:, 2:66], b[:, 66:74], b[:, 74:106], b[:, 106:110]
        hi = np.unpackbits(qh, axis=1, bitorder="little")  # [nb, 64]
        idx = lo.astype(np.int64) | (hi.astype(np.int64) << 8)
        s = np.stack([sc & 15, sc >> 4], axis=-1).reshape(nb, 8).astype(np.float32)
        scale = d[:, None] * (np.float32(1) + np.float32(2) * s)  # [nb, 8]
        vals = iq_grid("IQ3_S")[idx].reshape(nb, 8, 32) * _sign_bits(sg).reshape(nb, 8, 32)
        return (scale[..., None] * vals).reshape(nb, 256)


IQ1_DELTA = np.float32(0.125)


@_iq_type("IQ1_S")
class IQ1_S(BlockType):
    """50 bytes: f16 d; 32 low bytes of 11-bit grid indices (8 weights each, values -1/0/1);
    per 32 weights a u16: four 3-bit index highs, a 3-bit scale s, the delta's sign on top;
    w = d (2 s + 1) (grid +- 1/8)."""

    @classmethod
    def decode(cls, b):
        nb = len(b)
        d = _f16(b[:, 0:2])
        qh = _u16(b[:, 34:50]).astype(np.int64)  # [nb, 8]
        dl = d[:, None] * (2 * ((qh >> 12) & 7) + 1).astype(np.float32)
        delta = np.where(qh & 0x8000, -IQ1_DELTA, IQ1_DELTA).astype(np.float32)
        idx = b[:, 2:34].reshape(nb, 8, 4).astype(np.int64) | (((qh[..., None] >> np.array([0, 3, 6, 9])) & 7) << 8)
        vals = iq_grid("IQ1_S")[idx] + delta[..., None, None]  # [nb, 8, 4, 8]
        return (dl[..., None, None] * vals).reshape(nb, 256)


@_iq_type("IQ1_M")
class IQ1_M(BlockType):
    """56 bytes: 32 low bytes of 11-bit grid indices (8 weights each); 16 bytes of nibbles, one
    per index (3 high index bits, the delta's sign); four u16 of 3-bit scales (one per 16
    weights) whose top nibbles together are the f16 d; w = d (2 s + 1) (grid +- 1/8)."""

    @classmethod
    def decode(cls, b):
        nb = len(b)
        sc = _u16(b[:, 48:56]).astype(np.uint16)  # [nb, 4]
        d16 = (sc[:, 0] >> 12) | ((sc[:, 1] >> 8) & 0xF0) | ((sc[:, 2] >> 4) & 0xF00) | (sc[:, 3] & 0xF000)
        d = d16.astype(np.uint16).view(np.float16).astype(np.float32)
        s = ((sc[:, :, None].astype(np.int64) >> np.array([0, 3, 6, 9])) & 7).reshape(nb, 16)
        dl = d[:, None] * (2 * s + 1).astype(np.float32)  # [nb, 16]
        qh = b[:, 32:48]
        nib = np.stack([qh & 15, qh >> 4], axis=-1).reshape(nb, 32).astype(np.int64)
        idx = b[:, 0:32].astype(np.int64) | ((nib & 7) << 8)
        delta = np.where(nib & 8, -IQ1_DELTA, IQ1_DELTA).astype(np.float32)
        vals = iq_grid("IQ1_M")[idx] + delta[..., None]  # [nb, 32, 8]
        return (np.repeat(dl, 2, axis=1)[..., None] * vals).reshape(nb, 256)


@_iq_type("IQ4_NL")
class IQ4_NL(BlockType):
    """18 bytes, 32 weights: f16 d, 16 bytes of nibbles (weight j < 16: low nibble of byte j,
    else the high nibble of byte j - 16); w = d * level[nibble]."""

    @classmethod
    def decode(cls, b):
        d = _f16(b[:, 0:2])
        qs = b[:, 2:18]
        q = np.concatenate([qs & 15, qs >> 4], axis=1)  # [nb, 32]
        return d[:, None] * iq4_values()[q]


@_iq_type("IQ4_XS")
class IQ4_XS(BlockType):
    """136 bytes: f16 d; u16 of the scales' high 2 bits and 4 bytes of their low nibbles (6-bit
    scales s, one per 32 weights); 128 bytes of nibbles laid out per 32 as IQ4_NL's;
    w = d (s - 32) * level[nibble]."""

    @classmethod
    def decode(cls, b):
        nb = len(b)
        d = _f16(b[:, 0:2])
        sh = _u16(b[:, 2:4])[:, 0].astype(np.int64)
        sl = b[:, 4:8]
        lo = np.stack([sl & 15, sl >> 4], axis=-1).reshape(nb, 8).astype(np.int64)
        s = lo | (((sh[:, None] >> (2 * np.arange(8))) & 3) << 4)
        dl = d[:, None] * (s - 32).astype(np.float32)  # [nb, 8]
        qs = b[:, 8:136].reshape(nb, 8, 16)
        q = np.concatenate([qs & 15, qs >> 4], axis=2)  # [nb, 8, 32]
        return (dl[..., None] * iq4_values()[q]).reshape(nb, 256)


# llama.cpp types newer than the installed gguf package knows (ggml.h's enum ggml_type), so a
# file of one is refused by name
LLAMA_CPP_ONLY_TYPES = {42: "Q2_0"}


def type_name(type_id: int) -> str:
    cls = QTYPES.get(int(type_id))
    if cls is not None:
        return cls.name
    try:
        return GGMLQuantizationType(int(type_id)).name
    except ValueError:
        return LLAMA_CPP_ONLY_TYPES.get(int(type_id), f"unknown (id {int(type_id)})")



QTYPES_BY_NAME = {cls.name: cls for cls in QTYPES.values()}


# The bytes of the cpu backend's X16 layouts (backends/cpu/x16.py; which tensors take them:
# backends/cpu/backend.py, X16Policy): the rows of a matrix, or of each routed expert, 16 side by side.
# Q4_K's decodes each 256 weights' scales to bytes: X16_BLOCK bytes hold 16 rows x 256 weights,
# their 16 x 144 bytes of blocks and 64 more (2.8%; Q5_K's likewise, 2.3%); the others keep their
# bytes (Q6_K's: 16 rows x 256 weights in 16 x 210 bytes).
X16_ROWS = 16
X16_BLOCK = 320 + 2048
X16_Q5_BLOCK = X16_BLOCK + 512  # Q5_K's: Q4_K's and the fifth bits (2.3% more than 16 x 176)
X16_Q6_BLOCK = 16 * 210


def x16_bytes(n_bytes: int, qtype: int) -> int:
    """The bytes n_bytes of rows of type qtype (one with an X16 layout) take in their X16
    layout (a row's, or a tensor's): Q4_K's and Q5_K's grow by their decoded scales, the others' stay."""
    if qtype == QTYPES_BY_NAME["Q4_K"].type_id:
        return n_bytes // 144 * (X16_BLOCK // X16_ROWS)
    if qtype == QTYPES_BY_NAME["Q5_K"].type_id:
        return n_bytes // 176 * (X16_Q5_BLOCK // X16_ROWS)
    return n_bytes
