"""Hostile GGUF headers (issue 36): well-formed files whose counts ask for time or memory are
accepted or refused at a cost bounded by what the parser keeps, not by what the file claims.
Memory is measured with tracemalloc (numpy reports its buffers to it); the counts checked
against the bytes left make refusals deterministic. No wall-clock assertions."""

from __future__ import annotations

import struct
import sys
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
import fuzz_gguf  # noqa: E402

from onebit.formats import gguf_file  # noqa: E402
from onebit.errors import ModelFileError  # noqa: E402
from onebit.formats.gguf_file import GGUFFile, SkippedArray  # noqa: E402


def _parse(path):
    """(metadata or the error, peak traced bytes) of loading `path`'s header."""
    tracemalloc.start()
    try:
        result = GGUFFile(path).metadata
    except ModelFileError as e:
        result = e
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return result, peak


# Sizes just past each bound, small enough to build in a fraction of a second. Before the bounds
# the parser materialised every item: tens of MB here, gigabytes at the sizes.
@pytest.mark.parametrize("shape,n,limit", [
    ("nested_empty_arrays", 200_000, "string or nested-array items"),
    ("empty_strings", 600_000, "string or nested-array items"),
    ("one_element_tensors", 40_000, "40000 tensors; onebit reads at most 32768"),
    ("empty_array_keys", 20_000, "20000 metadata entries; onebit reads at most 16384"),
    ("vocab_count", 1 << 40, "at most 4194304"),
])
def test_hostile_shapes_are_refused_before_they_cost_memory(tmp_path, shape, n, limit):
    p = tmp_path / f"{shape}.gguf"
    p.write_bytes(fuzz_gguf.hostile_header(shape, n))
    result, peak = _parse(p)
    assert isinstance(result, ModelFileError) and limit in str(result) and str(p) in str(result)
    assert peak < 2 << 20, f"{shape}: peak {peak} bytes"


def test_nested_arrays_under_the_bound_are_stepped_over_not_kept(tmp_path):
    p = tmp_path / "nested.gguf"
    p.write_bytes(fuzz_gguf.hostile_header("nested_empty_arrays", 20_000))
    meta, peak = _parse(p)
    assert meta["hostile.nested"] == SkippedArray(etype=9, count=20_000)
    assert peak < 1 << 20, peak  # before: one numpy array kept per item


def _one_kv_file(key: bytes, value: bytes, n_tensors: int = 0) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", 3, n_tensors, 1) + fuzz_gguf._gguf_str(key) + value


def test_long_numeric_array_outside_the_vocabulary_is_skipped_without_a_copy(tmp_path):
    n = 1 << 20
    p = tmp_path / "arr.gguf"
    p.write_bytes(_one_kv_file(b"general.junk", struct.pack("<IIQ", 9, 4, n) + bytes(4 * n)))
    meta, peak = _parse(p)
    assert meta["general.junk"] == SkippedArray(etype=4, count=n)
    assert peak < 1 << 20, peak  # the 4 MB of items were copied before


def test_short_numeric_arrays_are_kept(tmp_path):
    p = tmp_path / "arr.gguf"
    p.write_bytes(_one_kv_file(b"qwen3moe.layer_flags", struct.pack("<IIQ", 9, 5, 3) + struct.pack("<3i", 1, -2, 3)))
    meta, _ = _parse(p)
    np.testing.assert_array_equal(meta["qwen3moe.layer_flags"], [1, -2, 3])


def test_metadata_strings_count_against_a_budget_checked_before_the_copy(tmp_path, monkeypatch):
    monkeypatch.setattr(gguf_file, "MAX_KEPT_BYTES", 1 << 20)
    p = tmp_path / "long.gguf"
    p.write_bytes(fuzz_gguf.hostile_header("long_string", 4 << 20))
    result, peak = _parse(p)
    assert isinstance(result, ModelFileError) and "exceeds 1 MiB" in str(result) and "general.description" in str(result)
    assert peak < 1 << 20, peak  # refused from the length field: the 4 MB string is never copied


def test_tensor_count_is_checked_against_the_bytes_left_after_the_metadata(tmp_path):
    # The count fits the whole file (32 bytes an entry) but not what the metadata leaves.
    body = struct.pack("<I", 8) + fuzz_gguf._gguf_str(b"x" * 4000)
    data = _one_kv_file(b"general.description", body, n_tensors=100)
    p = tmp_path / "count.gguf"
    p.write_bytes(data + bytes(32 * 100 - 3200 + 64))
    assert 100 * 32 <= p.stat().st_size
    with pytest.raises(ModelFileError, match=r"100 tensors cannot fit in the \d+ bytes left after the metadata"):
        GGUFFile(p)
