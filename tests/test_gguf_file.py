"""GGUF loading: valid files map without copying; bad files give one clear error."""

from __future__ import annotations

import struct
import tracemalloc

import gguf
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from onebit.errors import ModelFileError, OnebitError, UnsupportedModelError
from onebit.formats.gguf_file import GGUFFile


def write_gguf(path, tensors: dict[str, np.ndarray], meta: dict | None = None, raw_types: dict | None = None):
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    for k, v in (meta or {}).items():
        w.add_uint32(k, v)
    w.add_token_list(["a", "b", "c", "<s>"])
    for name, arr in tensors.items():
        if raw_types and name in raw_types:
            w.add_tensor(name, arr, raw_dtype=raw_types[name])
        else:
            w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture
def small(tmp_path):
    rng = np.random.default_rng(0)
    return write_gguf(tmp_path / "small.gguf", {
        "token_embd.weight": rng.standard_normal((4, 32)).astype(np.float32),
        "output_norm.weight": np.ones(32, np.float32),
    }, {"qwen3moe.block_count": 1})


def test_loads_metadata_and_maps_tensors(small):
    g = GGUFFile(small)
    assert g.architecture == "qwen3moe"
    assert g.metadata["qwen3moe.block_count"] == 1
    assert g.metadata["tokenizer.ggml.tokens"] == ["a", "b", "c", "<s>"]
    t = g.tensor("token_embd.weight")
    assert t.shape == (4, 32) and t.type_name == "F32"
    assert isinstance(t.raw.base, np.memmap) or isinstance(t.raw, np.memmap)  # a view of the file, not a copy
    ref = gguf.GGUFReader(str(small)).tensors[0].data
    np.testing.assert_array_equal(t.raw.view(np.float32), ref)


def test_quantized_tensor_row_bytes(tmp_path):
    from gguf import quants

    x = np.random.default_rng(1).standard_normal((3, 64)).astype(np.float32)
    q = quants.quantize(x, gguf.GGMLQuantizationType.Q8_0)
    p = write_gguf(tmp_path / "q.gguf", {"w": q}, raw_types={"w": gguf.GGMLQuantizationType.Q8_0})
    t = GGUFFile(p).tensor("w")
    assert t.shape == (3, 64) and t.raw.shape == (3, 68)


@pytest.mark.parametrize("cut_frac", [0.0, 0.01, 0.1, 0.3, 0.5, 0.7, 0.9])
def test_truncated_file_is_a_clear_error(small, tmp_path, cut_frac):
    data = small.read_bytes()
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(data[: int(len(data) * cut_frac)])
    with pytest.raises(ModelFileError) as e:
        GGUFFile(bad)
    assert str(bad) in str(e.value)


def test_every_header_truncation_is_caught(small, tmp_path):
    data = small.read_bytes()
    bad = tmp_path / "cut.gguf"
    tensor_bytes = (4 * 32 + 32) * 4
    for n in range(0, len(data) - tensor_bytes, 7):  # every cut that loses tensor data or header
        bad.write_bytes(data[:n])
        with pytest.raises(ModelFileError):
            GGUFFile(bad)


def test_bad_magic_and_version(small, tmp_path):
    data = bytearray(small.read_bytes())
    p = tmp_path / "x.gguf"
    p.write_bytes(b"GGML" + data[4:])
    with pytest.raises(ModelFileError, match="not a GGUF file"):
        GGUFFile(p)
    data[4:8] = struct.pack("<I", 99)
    p.write_bytes(bytes(data))
    with pytest.raises(ModelFileError, match="version 99"):
        GGUFFile(p)


def test_absurd_array_length_does_not_hang_or_allocate(small, tmp_path):
    data = bytearray(small.read_bytes())
    # tokenizer.ggml.tokens is the last KV: its array length follows key, type, elem type.
    key = b"tokenizer.ggml.tokens"
    i = data.index(key) + len(key) + 4 + 4
    assert struct.unpack_from("<Q", data, i)[0] == 4
    data[i : i + 8] = struct.pack("<Q", 1 << 60)
    p = tmp_path / "huge.gguf"
    p.write_bytes(bytes(data))
    tracemalloc.start()
    with pytest.raises(ModelFileError, match="tokenizer.ggml.tokens"):
        GGUFFile(p)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 16 << 20


def test_absurd_tensor_dims(small, tmp_path):
    data = bytearray(small.read_bytes())
    name = b"token_embd.weight"
    i = data.index(name) + len(name)
    assert struct.unpack_from("<I", data, i)[0] == 2
    data[i + 4 + 8 : i + 4 + 16] = struct.pack("<Q", 1 << 50)  # rows
    p = tmp_path / "dims.gguf"
    p.write_bytes(bytes(data))
    with pytest.raises(ModelFileError, match="token_embd.weight"):
        GGUFFile(p)


def test_unknown_tensor_type(small, tmp_path):
    data = bytearray(small.read_bytes())
    name = b"token_embd.weight"
    i = data.index(name) + len(name) + 4 + 16  # after n_dims and two dims
    assert struct.unpack_from("<I", data, i)[0] == 0  # F32
    data[i : i + 4] = struct.pack("<I", 40)  # NVFP4: a real type we do not run
    p = tmp_path / "type.gguf"
    p.write_bytes(bytes(data))
    with pytest.raises(UnsupportedModelError, match="NVFP4"):
        GGUFFile(p)
    data[i : i + 4] = struct.pack("<I", 42)  # Q2_0: llama-quantize makes it, the gguf package has no name for it
    p.write_bytes(bytes(data))
    with pytest.raises(UnsupportedModelError, match=r"has type Q2_0, which onebit does not support"):
        GGUFFile(p)
    data[i : i + 4] = struct.pack("<I", 777)
    p.write_bytes(bytes(data))
    with pytest.raises(UnsupportedModelError, match=r"has type unknown \(id 777\)"):
        GGUFFile(p)


def test_tensor_offset_past_end(small, tmp_path):
    data = bytearray(small.read_bytes())
    name = b"output_norm.weight"
    i = data.index(name) + len(name) + 4 + 8 + 4  # n_dims, one dim, type
    data[i : i + 8] = struct.pack("<Q", 1 << 20)
    p = tmp_path / "off.gguf"
    p.write_bytes(bytes(data))
    with pytest.raises(ModelFileError, match="truncated or corrupt"):
        GGUFFile(p)


def test_missing_and_non_files(tmp_path):
    with pytest.raises(ModelFileError, match="no such file"):
        GGUFFile(tmp_path / "nope.gguf")
    with pytest.raises(ModelFileError, match="not a regular file"):
        GGUFFile(tmp_path)
    (tmp_path / "empty.gguf").write_bytes(b"")
    with pytest.raises(ModelFileError, match="empty"):
        GGUFFile(tmp_path / "empty.gguf")


def test_split_files(tmp_path):
    rng = np.random.default_rng(2)
    a = rng.standard_normal((4, 32)).astype(np.float32)
    b = np.ones(32, np.float32)
    for no, tensors in ((0, {"token_embd.weight": a}), (1, {"output_norm.weight": b})):
        w = gguf.GGUFWriter(str(tmp_path / f"m-{no + 1:05d}-of-00002.gguf"), "qwen3moe")
        w.add_uint16("split.no", no)
        w.add_uint16("split.count", 2)
        for k, v in tensors.items():
            w.add_tensor(k, v)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
    g = GGUFFile(tmp_path / "m-00001-of-00002.gguf")
    assert set(g.tensors) == {"token_embd.weight", "output_norm.weight"}
    np.testing.assert_array_equal(g.tensor("output_norm.weight").raw.view(np.float32), b)
    (tmp_path / "m-00002-of-00002.gguf").unlink()
    with pytest.raises(ModelFileError, match="missing part"):
        GGUFFile(tmp_path / "m-00001-of-00002.gguf")


@settings(max_examples=300, deadline=2000, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_fuzz_mutated_header(small, tmp_path, data):
    """Any mutation of header bytes either loads or raises our own error: no other exception,
    no hang, no allocation out of proportion to the file."""
    raw = bytearray(small.read_bytes())
    header_len = gguf.GGUFReader(str(small)).data_offset
    n_mut = data.draw(st.integers(1, 8))
    for _ in range(n_mut):
        i = data.draw(st.integers(0, header_len - 1))
        kind = data.draw(st.sampled_from(["byte", "u64", "u32"]))
        if kind == "byte":
            raw[i] = data.draw(st.integers(0, 255))
        elif kind == "u32" and i + 4 <= len(raw):
            raw[i : i + 4] = struct.pack("<I", data.draw(st.sampled_from([0, 1, 2**31, 2**32 - 1, 41, 99])))
        elif i + 8 <= len(raw):
            raw[i : i + 8] = struct.pack("<Q", data.draw(st.sampled_from([0, 1, 2**40, 2**63, 2**64 - 1])))
    p = tmp_path / "fuzz.gguf"
    p.write_bytes(bytes(raw))
    tracemalloc.start()
    try:
        GGUFFile(p)
    except OnebitError:
        pass
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    assert peak < 32 << 20


def _reader_value(field):
    """A metadata value as the gguf package's reader decodes it."""
    v = field.contents()
    if isinstance(v, list) and v and not isinstance(v[0], (str, list)):
        return np.asarray(v)
    return v


@pytest.mark.parametrize("path", sorted((__import__("conftest").FIXTURES).glob("*.gguf")), ids=lambda p: p.name)
def test_parser_agrees_with_gguf_reader(path):
    ours = GGUFFile(path)
    ref = gguf.GGUFReader(str(path))
    keys = [k for k in ref.fields if not k.startswith("GGUF.")]
    assert sorted(keys) == sorted(ours.metadata)
    for k in keys:
        a, b = ours.metadata[k], _reader_value(ref.fields[k])
        if isinstance(a, np.ndarray):
            np.testing.assert_array_equal(a, b)
        else:
            assert a == b, k
    assert [t.name for t in ref.tensors] == list(ours.tensors)
    for rt in ref.tensors:
        t = ours.tensors[rt.name]
        assert t.qtype == int(rt.tensor_type) and t.offset == int(rt.data_offset)
        assert t.n_bytes == int(rt.n_bytes) and t.n_elements == int(rt.n_elements)
        np.testing.assert_array_equal(t.raw.reshape(-1), np.asarray(rt.data).reshape(-1).view(np.uint8))
