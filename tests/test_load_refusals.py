"""Load refuses what cannot work, with one line (issue 36): a vocabulary that does not match
token_embd, one that repeats its token strings, merges that do not parse; path errors say
what they are (a symbolic-link loop, a broken link, an empty path); the prompt file's JSON
warning reads once "at column"."""

from __future__ import annotations

import os

import gguf
import pytest

import onebit
from conftest import fixture_path, run_cli
from ggufedit import rewrite
from onebit.errors import ModelFileError

QWEN = fixture_path("qwen3moe-f32.gguf")  # BPE (gpt2) tokenizer with merges, 512 tokens


def _field(path, key):
    return gguf.GGUFReader(str(path)).fields[key].contents()


def test_vocabulary_shorter_than_token_embd_is_refused(tmp_path):
    tokens = _field(QWEN, "tokenizer.ggml.tokens")
    p = rewrite(QWEN, tmp_path / "short.gguf", meta={"tokenizer.ggml.tokens": tokens[:-10]})
    with pytest.raises(ModelFileError, match=r"the vocabulary has 502 tokens but token_embd has 512 rows"):
        onebit.load(p, backend="numpy")


def test_vocabulary_of_one_repeated_token_is_refused(tmp_path):
    p = rewrite(QWEN, tmp_path / "same.gguf", meta={"tokenizer.ggml.tokens": ["a"] * 512})
    with pytest.raises(ModelFileError, match=r"repeats token strings at 511 of its 512 ids \(e\.g\. 'a' at ids 0 and 1\)"):
        onebit.load(p, backend="numpy")


def test_a_few_repeated_tokens_still_load(tmp_path):
    tokens = _field(QWEN, "tokenizer.ggml.tokens")
    tokens[-3:] = [tokens[-4]] * 3  # three repeats at the end (as some converters leave padding)
    p = rewrite(QWEN, tmp_path / "few.gguf", meta={"tokenizer.ggml.tokens": tokens})
    assert onebit.load(p, backend="numpy").tokenize("Hello world")


@pytest.mark.parametrize("bad", ["nospace", "trailing "])
def test_merges_that_do_not_parse_are_refused(tmp_path, bad):
    merges = _field(QWEN, "tokenizer.ggml.merges")
    merges[5] = bad
    p = rewrite(QWEN, tmp_path / "m.gguf", meta={"tokenizer.ggml.merges": merges})
    with pytest.raises(ModelFileError, match=r"tokenizer.ggml.merges entry 5 .* is not two tokens separated by a space"):
        onebit.load(p, backend="numpy")


def _one_line(code, out, err):
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("onebit: error: "), (code, err)
    return lines[0]


def test_symlink_loop_says_so(monkeypatch, capsys, tmp_path):
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    os.symlink(b, a)
    os.symlink(a, b)
    line = _one_line(*run_cli(monkeypatch, capsys, "info", str(a)))
    assert line == f"onebit: error: {a}: a loop of symbolic links"


def test_broken_symlink_says_so(monkeypatch, capsys, tmp_path):
    a = tmp_path / "a.gguf"
    os.symlink(tmp_path / "gone.gguf", a)
    line = _one_line(*run_cli(monkeypatch, capsys, "info", str(a)))
    assert f"{a}: a broken symbolic link (to {tmp_path / 'gone.gguf'})" in line


@pytest.mark.parametrize("args", [["info", ""], ["generate", "-m", "", "-p", "hi", "-n", "1"], ["plan", ""]])
def test_empty_model_path_is_an_error_not_the_shipped_model(monkeypatch, capsys, args):
    line = _one_line(*run_cli(monkeypatch, capsys, *args))
    assert "the model path is empty" in line


def test_json_warning_says_at_once(monkeypatch, capsys, tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text('{"prompt": "unterminated\n{"prompt": "ok"}\n')
    code, out, err = run_cli(monkeypatch, capsys, "generate", "-m", str(QWEN), "-i", str(src), "-n", "1",
                             "-o", str(tmp_path / "out.jsonl"), "--backend", "numpy")
    assert "not valid JSON (Unterminated string starting at column 12)" in err and "at at" not in err, err
