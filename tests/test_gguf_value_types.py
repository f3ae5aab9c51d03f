"""Metadata stored with the wrong GGUF value type (tokens as u32, a token id as a string, ...):
one clear error naming the key, exit 2, in `info` and `generate`; never an internal error."""

from __future__ import annotations

import pytest

from conftest import fixture_path, run_cli
from ggufedit import rewrite
from onebit.errors import ModelFileError
from onebit.formats.gguf_file import GGUFFile

SRC = fixture_path("qwen3moe-f32.gguf")
WRONG = [
    ("tokenizer.ggml.tokens", 5),  # u32
    ("tokenizer.ggml.bos_token_id", "1"),
    ("tokenizer.ggml.eos_token_id", [1, 2]),
    ("tokenizer.ggml.pre", ["qwen2"]),
    ("tokenizer.ggml.token_type", "normal"),
    ("tokenizer.ggml.scores", ["a"]),
    ("tokenizer.chat_template", 7),
    ("tokenizer.ggml.add_bos_token", 1),
    ("general.architecture", 3),
]


@pytest.mark.parametrize("key, value", WRONG, ids=[k for k, _ in WRONG])
def test_a_wrong_value_type_is_one_error_naming_the_key(tmp_path, monkeypatch, capsys, key, value):
    bad = rewrite(SRC, tmp_path / "bad.gguf", meta={key: value})
    with pytest.raises(ModelFileError, match=key.replace(".", r"\.")):
        GGUFFile(str(bad))
    for args in (["info", str(bad)], ["generate", "--model", str(bad), "-p", "hi", "-n", "1", "--backend", "numpy"]):
        code, _, err = run_cli(monkeypatch, capsys, *args)
        assert code == 2 and key in err and "internal error" not in err, err


def test_token_types_as_bools_are_refused(tmp_path):
    n = len(GGUFFile(str(SRC)).metadata["tokenizer.ggml.tokens"])
    bad = rewrite(SRC, tmp_path / "bools.gguf", meta={"tokenizer.ggml.token_type": [True] * n})
    with pytest.raises(ModelFileError, match="token_type"):
        GGUFFile(str(bad))
