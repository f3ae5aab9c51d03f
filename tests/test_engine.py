"""Engine invariants on the fixtures: incremental decode == batched forward, cache rollback,
and bad model files refused with one clear error."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import onebit
from conftest import fixture_path
from ggufedit import rewrite
from onebit.errors import ModelFileError, UnsupportedModelError

ARCH_FIXTURES = ["qwen3moe-f32", "qwen2moe-f32", "olmoe-f32", "llama-f32", "mixtral-f32", "qwen2-f32", "qwen3-f32",
        "llama3rope-f32", "gemma3-f32"]


@pytest.mark.parametrize("name", ARCH_FIXTURES)
def test_decode_one_by_one_equals_batched_forward(name):
    m = onebit.load(fixture_path(f"{name}.gguf"), backend="cpu")
    ids = np.load(fixture_path(f"{name}.ref.npz"))["tokens"][:20].astype(np.int64)
    full = m.logits(ids)
    cache = m.new_cache()
    steps = np.concatenate([m.net.forward(ids[i : i + 1], cache) for i in range(len(ids))])
    np.testing.assert_allclose(steps, full, atol=2e-4, rtol=0)
    chunked = m.logits(ids, chunk=7)
    np.testing.assert_allclose(chunked, full, atol=2e-4, rtol=0)


def test_cache_trim_snapshot_restore():
    m = onebit.load(fixture_path("qwen3moe-f32.gguf"), backend="cpu")
    ids = np.load(fixture_path("qwen3moe-f32.ref.npz"))["tokens"][:12].astype(np.int64)
    cache = m.new_cache()
    m.net.forward(ids[:8], cache)
    snap = cache.snapshot()
    a = m.net.forward(ids[8:12], cache)
    assert cache.can_trim and cache.trim(4) == 4 and cache.offset == 8
    b = m.net.forward(ids[8:12], cache)  # rolled back: same logits again
    np.testing.assert_array_equal(a, b)
    m.net.forward(np.array([1, 2, 3], np.int64), cache)  # diverge, then restore the snapshot
    cache.restore(snap)
    assert cache.offset == 8
    np.testing.assert_array_equal(m.net.forward(ids[8:12], cache), a)


def _anon_rss() -> int:
    """This process's anonymous resident memory (what a copy of the weights would grow; the
    file's pages a load maps count in RSS but are the page cache's)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon in /proc/self/status")


def test_load_does_not_copy_weights():
    path = fixture_path("q3moe256-f32.gguf")
    onebit.load(path, backend="cpu")  # (the first load in a process imports and sets up the kernels)
    before = _anon_rss()
    m = onebit.load(path, backend="cpu")
    grown = _anon_rss() - before
    size = path.stat().st_size
    assert all(isinstance(t.raw.base, np.memmap) or isinstance(t.raw, np.memmap) for t in m.gguf.tensors.values())
    assert grown < size / 2, f"anonymous memory grew by {grown} bytes loading a {size}-byte file"


def test_a_resident_load_maps_every_weight_page(monkeypatch):
    """Every weight resident: their pages are mapped at load (no fault inside a decode step),
    the experts first."""
    from onebit.formats.gguf_file import GGUFFile

    done = []
    orig = GGUFFile.populate
    monkeypatch.setattr(GGUFFile, "populate", lambda self, t: done.append(t.name) or orig(self, t))
    m = onebit.load(fixture_path("q3moe256-f32.gguf"), backend="cpu")
    experts = {n for n in m.gguf.tensors if "_exps." in n}
    assert experts and set(done[: len(experts)]) == experts
    assert sorted(done) == sorted(m.gguf.tensors)  # (the token embedding among them)
    assert all(orig(m.gguf, m.gguf.tensor(n)) for n in sorted(experts)[:3])  # (this system can)


def test_missing_tensor(tmp_path):
    bad = rewrite(fixture_path("qwen3moe-f32.gguf"), tmp_path / "m.gguf", drop_tensors={"blk.1.ffn_up_exps.weight"})
    with pytest.raises(ModelFileError, match=r"blk\.1\.ffn_up_exps\.weight.*missing"):
        onebit.load(bad, backend="cpu")


def test_wrong_shape(tmp_path):
    def shrink(name, data, qtype):
        if name == "blk.0.attn_q.weight":
            return data[:-16], qtype

    bad = rewrite(fixture_path("qwen3moe-f32.gguf"), tmp_path / "m.gguf", tensor_fn=shrink)
    with pytest.raises(ModelFileError, match=r"blk\.0\.attn_q\.weight.*shape"):
        onebit.load(bad, backend="cpu")


def test_unknown_architecture(tmp_path):
    bad = rewrite(fixture_path("qwen3-f32.gguf"), tmp_path / "m.gguf", arch="mamba9")
    with pytest.raises(UnsupportedModelError, match="architecture 'mamba9' is not supported"):
        onebit.load(bad, backend="cpu")


@pytest.mark.parametrize("key,value", [("qwen3moe.embedding_length", 1 << 30), ("qwen3moe.block_count", 0),
                                       ("qwen3moe.expert_used_count", 99)])
def test_absurd_dimensions(tmp_path, key, value):
    bad = rewrite(fixture_path("qwen3moe-f32.gguf"), tmp_path / "m.gguf", meta={key: value})
    with pytest.raises(ModelFileError, match=key.split(".")[1]):
        onebit.load(bad, backend="cpu")


def test_generate_greedy_matches_teacher_forced_argmax():
    m = onebit.load(fixture_path("qwen3moe-f32.gguf"), backend="cpu")
    prompt = np.load(fixture_path("qwen3moe-f32.ref.npz"))["tokens"][:10].tolist()
    toks = [r.token for r in m.generate(prompt, max_tokens=8) if r.token is not None]
    assert len(toks) >= 1
    logits = m.logits(prompt + toks)
    expect = logits[len(prompt) - 1 : len(prompt) - 1 + len(toks)].argmax(axis=1).tolist()
    assert toks == expect
