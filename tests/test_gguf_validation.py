"""Layouts and metadata llama.cpp rejects are rejected here too, with one clear error (exit 2)."""

from __future__ import annotations

import struct
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

from conftest import fixture_path
from ggufedit import rewrite
from onebit.errors import ModelFileError
from onebit.formats.gguf_file import GGUFFile
from test_cli import assert_one_line_error, onebit

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
from fuzz_gguf import layout  # noqa: E402  (where each header field is)

QWEN3MOE = fixture_path("qwen3moe-f32.gguf")


def _edit(src: Path, dst: Path, tensor: str, field: str, value: int) -> Path:
    """Copy src to dst with one tensor-info field ('offset' or 'type') set to value."""
    data = bytearray(src.read_bytes())
    t = next(t for t in layout(bytes(data)).tensors if t.name == tensor)
    if field == "offset":
        struct.pack_into("<Q", data, t.offset_pos, value)
    else:
        struct.pack_into("<I", data, t.type_pos, value)
    dst.write_bytes(bytes(data))
    return dst


def _offset(path: Path, tensor: str) -> int:
    return next(t.offset for t in layout(path.read_bytes()).tensors if t.name == tensor)


# -- tensor data layout ------------------------------------------------------------------------


def test_tensor_aliasing_another_is_rejected(tmp_path):
    p = _edit(QWEN3MOE, tmp_path / "alias.gguf", "blk.0.attn_k.weight", "offset", 0)
    with pytest.raises(ModelFileError, match=r"'blk\.0\.attn_k\.weight'.*overlaps tensor") as e:
        GGUFFile(p)
    assert str(p) in str(e.value)


def test_tensor_overlapping_the_middle_of_another_is_rejected(tmp_path):
    other = _offset(QWEN3MOE, "blk.0.ffn_up_exps.weight")
    p = _edit(QWEN3MOE, tmp_path / "mid.gguf", "blk.1.attn_v.weight", "offset", other + 64)
    with pytest.raises(ModelFileError, match=r"'blk\.1\.attn_v\.weight'.*overlaps tensor 'blk\.0\.ffn_up_exps"):
        GGUFFile(p)


def test_swapped_offsets_of_different_sizes_are_rejected(tmp_path):
    a, b = "blk.0.attn_norm.weight", "blk.0.attn_q.weight"  # 256 and 16384 bytes
    data = bytearray(QWEN3MOE.read_bytes())
    lay = {t.name: t for t in layout(bytes(data)).tensors}
    struct.pack_into("<Q", data, lay[a].offset_pos, lay[b].offset)
    struct.pack_into("<Q", data, lay[b].offset_pos, lay[a].offset)
    p = tmp_path / "swap.gguf"
    p.write_bytes(bytes(data))
    with pytest.raises(ModelFileError, match="overlaps|starts at data offset"):
        GGUFFile(p)


@pytest.mark.parametrize("new_type", [gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.Q8_0])
def test_type_change_that_shrinks_a_tensor_is_rejected(tmp_path, new_type):
    """F32 -> F16 / Q8_0 keeps the tensor in bounds but leaves a gap before its neighbour."""
    p = _edit(QWEN3MOE, tmp_path / "type.gguf", "blk.0.attn_k.weight", "type", int(new_type))
    with pytest.raises(ModelFileError, match=r"blk\.0\.attn_k\.weight"):
        GGUFFile(p)


def test_type_change_that_grows_a_tensor_is_rejected(tmp_path):
    src = fixture_path("q3moe256-F16.gguf")
    name = next(t.name for t in layout(src.read_bytes()).tensors if t.name.endswith("attn_q.weight"))
    assert GGUFFile(src).tensor(name).type_name == "F16"
    p = _edit(src, tmp_path / "grow.gguf", name, "type", int(gguf.GGMLQuantizationType.F32))
    with pytest.raises(ModelFileError, match=r"overlaps|needs bytes up to"):
        GGUFFile(p)


def test_data_section_with_a_gap_at_its_start_is_rejected(tmp_path):
    """Every offset moved up by one alignment unit, with the bytes to match: in bounds, nothing
    overlaps, but the data no longer starts where the header says (llama.cpp refuses it too)."""
    data = bytearray(QWEN3MOE.read_bytes())
    lay = layout(bytes(data))
    for t in lay.tensors:
        struct.pack_into("<Q", data, t.offset_pos, t.offset + lay.alignment)
    data[lay.data_start:lay.data_start] = bytes(lay.alignment)
    p = tmp_path / "gap.gguf"
    p.write_bytes(bytes(data))
    first = min(lay.tensors, key=lambda t: t.offset).name
    msg = f"tensor '{first}' starts at data offset 32 but the data section starts at 0"
    with pytest.raises(ModelFileError, match=msg):
        GGUFFile(p)


def test_custom_alignment_is_honoured(tmp_path):
    """general.alignment = 64: a valid file loads; an offset aligned to 32 but not 64 is refused."""
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(tmp_path / "a64.gguf"), "qwen3moe")
    w.data_alignment = 64
    w.add_custom_alignment(64)
    w.add_tensor("a", rng.standard_normal(8).astype(np.float32))  # 32 bytes: padded to 64
    w.add_tensor("b", rng.standard_normal(8).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    g = GGUFFile(tmp_path / "a64.gguf")
    assert g.metadata["general.alignment"] == 64
    ref = gguf.GGUFReader(str(tmp_path / "a64.gguf")).tensors[1].data
    np.testing.assert_array_equal(g.tensor("b").raw.view(np.float32), ref)
    assert _offset(tmp_path / "a64.gguf", "b") == 64
    p = _edit(tmp_path / "a64.gguf", tmp_path / "a32.gguf", "b", "offset", 32)
    with pytest.raises(ModelFileError, match="not 64-aligned"):
        GGUFFile(p)


def test_layout_error_on_the_command_line(tmp_path):
    p = _edit(QWEN3MOE, tmp_path / "alias.gguf", "blk.0.attn_k.weight", "offset", 0)
    line = assert_one_line_error(onebit("generate", "--model", str(p), "--prompt", "x", "--max-tokens", "1"))
    assert str(p) in line and "blk.0.attn_k.weight" in line


# -- metadata ranges ---------------------------------------------------------------------------

BAD_META = [
    ("qwen3moe.attention.layer_norm_rms_epsilon", 0.0, "layer_norm_rms_epsilon"),
    ("qwen3moe.attention.layer_norm_rms_epsilon", -1e-6, "layer_norm_rms_epsilon"),
    ("qwen3moe.attention.layer_norm_rms_epsilon", float("nan"), "layer_norm_rms_epsilon"),
    ("qwen3moe.attention.layer_norm_rms_epsilon", float("inf"), "layer_norm_rms_epsilon"),
    ("qwen3moe.attention.layer_norm_rms_epsilon", 2.0, "layer_norm_rms_epsilon"),
    ("qwen3moe.rope.dimension_count", 3, "dimension_count"),
    ("qwen3moe.rope.dimension_count", 7, "dimension_count"),
    ("qwen3moe.rope.dimension_count", 18, "dimension_count"),
    ("qwen3moe.rope.dimension_count", 100000, "dimension_count"),
    ("qwen3moe.rope.freq_base", 0.0, "freq_base"),
    ("qwen3moe.rope.freq_base", -10000.0, "freq_base"),
    ("qwen3moe.attention.head_count_kv", 3, "head_count_kv"),
    ("qwen3moe.context_length", 0, "context_length"),
    ("qwen3moe.expert_count", 7, "expert_count"),
    ("qwen3moe.expert_count", 16, "expert_count"),
    ("qwen3moe.expert_count", 0, "expert_count"),
    ("qwen3moe.expert_used_count", 0, "expert_used_count"),
    ("qwen3moe.expert_used_count", 9, "expert_used_count"),
    ("qwen3moe.block_count", 1, "block_count"),
]


@pytest.mark.parametrize("key,value,named", BAD_META, ids=[f"{k.split('.')[-1]}={v}" for k, v, _ in BAD_META])
def test_metadata_out_of_range_is_one_clear_error(tmp_path, key, value, named):
    import onebit

    p = rewrite(QWEN3MOE, tmp_path / "m.gguf", meta={key: value})
    with pytest.raises(ModelFileError, match=named) as e:
        onebit.load(p, backend="cpu")
    assert str(p) in str(e.value)


def test_rope_dimension_count_equal_to_head_dim_or_smaller_even_loads(tmp_path):
    import onebit

    for n in (16, 8):
        p = rewrite(QWEN3MOE, tmp_path / f"r{n}.gguf", meta={"qwen3moe.rope.dimension_count": n})
        m = onebit.load(p, backend="cpu")
        assert m.cfg.rope_dim == n and np.isfinite(m.logits([1, 2, 3])).all()


@pytest.mark.parametrize("n", [3, 7, 100000])
def test_bad_rope_dimension_on_the_command_line(tmp_path, n):
    """Was `internal error: ValueError: operands could not be broadcast`, exit 1."""
    p = rewrite(QWEN3MOE, tmp_path / "m.gguf", meta={"qwen3moe.rope.dimension_count": n})
    line = assert_one_line_error(onebit("generate", "--model", str(p), "--prompt", "x", "--max-tokens", "1"))
    assert str(p) in line and "rope.dimension_count" in line


def test_a_zero_logit_softcap_means_off(tmp_path):
    """Gemma files write final_logit_softcapping = 0 when there is none (Gemma 3): that is off,
    not an out-of-range value; the logits are then the uncapped ones."""
    import onebit

    src = fixture_path("gemma3-f32.gguf")
    p = rewrite(src, tmp_path / "g.gguf", meta={"gemma3.final_logit_softcapping": 0.0})
    m = onebit.load(p, backend="numpy")
    assert m.cfg.final_logit_softcap == 0.0
    ids = np.load(fixture_path("gemma3-f32.ref.npz"))["tokens"][:6].astype(np.int64)
    capped = onebit.load(src, backend="numpy").logits(ids)
    assert np.abs(m.logits(ids)).max() > np.abs(capped).max()  # no cap applied
