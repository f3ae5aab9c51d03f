"""The mutation fuzzer's short run (tools/fuzz_gguf.py): mutated copies of real fixture files
(byte flips in header and data, truncations, tensor offset / type / dimension edits, metadata
values and array lengths) load and run one short generation, or fail with our own one-line
error: no other exception, warning, crash, hang or outsized allocation. The long run
(`--long`, 10,000 cases) and its result: docs/fuzzing.md."""

from __future__ import annotations

import struct
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
import fuzz_gguf  # noqa: E402

from conftest import fixture_path  # noqa: E402


def test_short_mutation_fuzz_run():
    res = fuzz_gguf.run(range(300), seed=2026, fixtures=fuzz_gguf.DEFAULT_FIXTURES, log=lambda s: None)
    assert res["counts"]["fail"] == 0, res["failures"][:5]
    # The mutations reach past the header checks: some files load and run, some stop later on.
    assert res["counts"]["ok"] > 10 and res["counts"]["error"] > 100, res["counts"]


def test_worker_round_trip(tmp_path):
    w = fuzz_gguf.Worker()
    try:
        assert w.run(0, str(fixture_path("qwen3moe-f32.gguf"))) == ("ok", "")
        bad = tmp_path / "bad.gguf"
        bad.write_bytes(b"GGUF" + struct.pack("<I", 3) + bytes(40))
        status, detail = w.run(1, str(bad))
        assert status == "error" and str(bad) in detail
    finally:
        w.stop()


def test_check_file_counts_what_the_cli_would_not_print_cleanly(monkeypatch):
    """The check is real: any other exception, an escaped warning, or non-finite logits fail."""
    import warnings

    import numpy as np

    import onebit
    from onebit.errors import ModelFileError

    path = str(fixture_path("qwen3moe-f32.gguf"))
    real_load = onebit.load

    def raising(exc):
        def load(p):
            raise exc
        return load

    monkeypatch.setattr(onebit, "load", raising(ValueError("operands could not be broadcast")))
    status, detail = fuzz_gguf.check_file(path)
    assert status == "fail" and "ValueError" in detail
    monkeypatch.setattr(onebit, "load", raising(ModelFileError("x.gguf: corrupt")))
    assert fuzz_gguf.check_file(path) == ("error", "x.gguf: corrupt")

    def warning_load(p):
        warnings.warn("overflow encountered in matmul", RuntimeWarning)
        return real_load(p)

    monkeypatch.setattr(onebit, "load", warning_load)
    assert fuzz_gguf.check_file(path)[0] == "fail"

    def nan_load(p):
        m = real_load(p)
        m.logits = lambda ids: np.full((len(ids), m.cfg.vocab_size), np.nan, np.float32)
        return m

    monkeypatch.setattr(onebit, "load", nan_load)
    status, detail = fuzz_gguf.check_file(path)
    assert status == "fail" and "finite" in detail


def test_layout_finds_every_field():
    data = fixture_path("qwen3moe-f32.gguf").read_bytes()
    lay = fuzz_gguf.layout(data)
    import gguf

    ref = gguf.GGUFReader(str(fixture_path("qwen3moe-f32.gguf")))
    assert [t.name for t in lay.tensors] == [t.name for t in ref.tensors]
    assert lay.data_start == ref.data_offset
    for t, rt in zip(lay.tensors, ref.tensors):
        assert struct.unpack_from("<I", data, t.type_pos)[0] == int(rt.tensor_type)
        assert lay.data_start + t.offset == int(rt.data_offset)
