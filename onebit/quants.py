"""Quantization types: one class per GGML type, registered by type id.

Each class knows its block geometry and turns raw blocks into float32. Most types
delegate to the `gguf` package's reference dequantizers; Q1_0 is missing there and
is implemented here. A tensor row of `n` weights takes `n // block_size * type_size` bytes.
"""

from __future__ import annotations

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


def type_name(type_id: int) -> str:
    cls = QTYPES.get(int(type_id))
    if cls is not None:
        return cls.name
    try:
        return GGMLQuantizationType(int(type_id)).name
    except ValueError:
        return f"type {int(type_id)}"



QTYPES_BY_NAME = {cls.name: cls for cls in QTYPES.values()}
