"""Tokenizer: our ids equal llama.cpp's on every fixture tokenizer, and text survives the trip.

The oracle is `tests/fixtures/tokenizer_cases.json`, made by tools/make_fixtures.py with
llama.cpp itself; nothing here needs llama.cpp. The synthetic cases at the end were checked
against llama.cpp (llama-cpp-python 0.3.36) when they were written; the expected ids in
them are llama.cpp's.
"""

from __future__ import annotations

import json
import re
from functools import lru_cache

import pytest

from onebit.errors import ModelFileError, OnebitError, UnsupportedModelError, UsageError
from onebit.formats.gguf_file import read_metadata
from onebit.formats.tokenizer import SUPPORTED_PRE, StreamDecoder, Tokenizer, _BYTE_TO_CHAR

from conftest import fixture_path

CASES_FILE = "tokenizer_cases.json"


@lru_cache(maxsize=1)
def cases() -> dict:
    # A missing file is an error here, not a skip: the oracle must be present.
    return json.loads(fixture_path(CASES_FILE).read_text(encoding="utf-8"))


def _case_files() -> list[str]:
    try:
        data = cases()
    except FileNotFoundError:
        return ["<missing tokenizer_cases.json>"]  # collected, then fails in the test
    return sorted(data["cases"]) + sorted(data.get("same_tokenizer_as", {}))


@lru_cache(maxsize=None)
def tokenizer(name: str) -> Tokenizer:
    return Tokenizer.from_metadata(read_metadata(fixture_path(name)), name)


def _expected(name: str, mode: str) -> list[list[int]]:
    data = cases()
    owner = data.get("same_tokenizer_as", {}).get(name, name)
    return data["cases"][owner][mode]


FILES = _case_files()
MODES = {"special": dict(add_special=True, parse_special=True),
         "plain": dict(add_special=False, parse_special=False)}


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("name", FILES)
def test_ids_match_llama_cpp(name, mode):
    strings = cases()["strings"]
    expected = _expected(name, mode)
    assert len(expected) == len(strings)
    tok = tokenizer(name)
    wrong = [(s, want, got) for s, want in zip(strings, expected)
             if (got := tok.encode(s, **MODES[mode])) != want]
    assert not wrong, "\n".join(f"{s!r}: llama.cpp {w} ours {g}" for s, w, g in wrong[:10])


def test_fixtures_cover_both_tokenizer_families():
    models = {tokenizer(n).model for n in cases()["cases"]}
    assert {"gpt2", "llama"} <= models


# Spaces before , . ? ! and around a lone ' are tidied by llama.cpp's clean_spaces on decode.
_CLEANED = re.compile(r" [?!.,]| ' | '(?:s|m|re|ve)")


@pytest.mark.parametrize("name", FILES)
def test_decode_round_trips(name):
    tok = tokenizer(name)
    for s in cases()["strings"]:
        ids = tok.encode(s, add_special=False, parse_special=False)
        if tok.clean_spaces and _CLEANED.search(s):
            continue  # test_clean_spaces_follows_llama_cpp covers these
        assert tok.decode(ids) == s, (s, ids)


def test_clean_spaces_follows_llama_cpp():
    tok = tokenizer("mixtral-f32.gguf")  # llama-bpe: llama.cpp cleans spaces on decode
    assert tok.clean_spaces
    ids = tok.encode("a , b . c ' d 's e", add_special=False)
    assert tok.decode(ids) == "a, b. c'd's e"
    assert not tokenizer("qwen3moe-f32.gguf").clean_spaces  # qwen2 pre: off


def test_spm_decode_strips_the_prefix_space_once():
    tok = tokenizer("llama-f32.gguf")
    assert tok.add_space_prefix and tok.add_bos
    plain = tok.encode("Hello world", add_special=False)
    assert tok.token_bytes(plain[0]).startswith(b" ")
    assert tok.decode(plain) == "Hello world"
    with_bos = tok.encode("Hello world")
    assert with_bos[0] == tok.bos_id
    # llama.cpp: the BOS piece takes the strip, so the space stays; skipping BOS keeps it too.
    assert tok.decode(with_bos) == tok.bos_token + " Hello world"
    assert tok.decode(with_bos, skip_special=True) == " Hello world"


def test_parse_special_matches_control_tokens_only_when_asked():
    tok = tokenizer("qwen3moe-f32.gguf")
    im_start = tok.token_to_id("<|im_start|>")
    assert im_start is not None
    assert tok.encode("<|im_start|>user", add_special=False)[0] == im_start
    assert im_start not in tok.encode("<|im_start|>user", add_special=False, parse_special=False)


@pytest.mark.parametrize("name", ["qwen3moe-f32.gguf", "olmoe-f32.gguf", "llama-f32.gguf",
                                  "mixtral-f32.gguf", "qwen2-f32.gguf"])
def test_stop_ids(name):
    tok = tokenizer(name)
    assert tok.eos_id in tok.stop_ids
    for text in ("<|im_end|>", "<|endoftext|>", "</s>"):
        tid = tok.token_to_id(text)
        if tid is not None:
            assert tid in tok.stop_ids, text
    assert tok.token_to_id("<|im_start|>") not in tok.stop_ids


def test_bos_eos_properties():
    tok = tokenizer("mixtral-f32.gguf")
    assert tok.add_bos and tok.encode("hi")[0] == tok.bos_id
    assert tok.bos_token == "<|begin_of_text|>" and tok.eos_token == "<|im_end|>"
    tok = tokenizer("qwen3moe-f32.gguf")
    assert not tok.add_bos and tok.encode("hi") == tok.encode("hi", add_special=False)


# --- streaming ---------------------------------------------------------------------------

MULTIBYTE = "日本語 🚀😀 Ελληνικά, кириллица, 👨\u200d👩\u200d👧 and café"


@pytest.mark.parametrize("name", ["qwen3moe-f32.gguf", "llama-f32.gguf", "mixtral-f32.gguf"])
def test_stream_decoder_never_splits_a_character(name):
    tok = tokenizer(name)
    ids = tok.encode(MULTIBYTE, add_special=False)
    # The test means something only if some token ends inside a character.
    assert any(_invalid_utf8(tok.token_bytes(i)) for i in ids)
    dec = tok.stream()
    pieces = [dec.push(i) for i in ids] + [dec.flush()]
    assert all("\ufffd" not in p for p in pieces)
    text = "".join(pieces)
    assert text == b"".join(tok.token_bytes(i) for i in ids).decode("utf-8")
    assert text.lstrip(" ") == MULTIBYTE


def _invalid_utf8(b: bytes) -> bool:
    try:
        b.decode("utf-8")
    except UnicodeDecodeError:
        return True
    return False


def test_stream_decoder_keeps_bad_bytes_and_skips_control_tokens():
    tok = tokenizer("llama-f32.gguf")
    byte_ids = [tok.token_to_id(f"<0x{b:02X}>") for b in "é".encode()]
    assert None not in byte_ids
    dec = StreamDecoder(tok)
    assert dec.push(byte_ids[0]) == ""  # half a character waits
    assert dec.push(tok.eos_id) == ""  # a control token adds no text when skipping specials
    assert dec.push(byte_ids[1]) == "é"
    assert dec.push(byte_ids[1]) == "\ufffd"  # a stray continuation byte shows, not dropped
    assert dec.push(byte_ids[0]) == ""
    assert dec.flush() == "\ufffd"  # so does a character cut off at the end
    assert dec.flush() == ""
    dec = tok.stream(skip_special=False)
    assert dec.push(tok.eos_id) == tok.eos_token


def test_token_bytes_and_range_errors():
    tok = tokenizer("olmoe-f32.gguf")
    assert tok.token_bytes(tok.encode(" ", add_special=False)[0]) == b" "
    with pytest.raises(UsageError):
        tok.token_bytes(tok.vocab_size)
    with pytest.raises(UsageError):
        tok.decode([-1])


# --- llama.cpp rules on synthetic vocabularies (ids checked against llama.cpp) -----------

def _byte_vocab_meta(extra: list[str], extra_types: list[int], **meta) -> dict:
    tokens = [_BYTE_TO_CHAR[b] for b in range(256)] + extra
    out = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt-2",
           "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": [1] * 256 + extra_types,
           "tokenizer.ggml.merges": ["Ġ t", "h e"]}
    out.update(meta)
    return out


SYNTH = _byte_vocab_meta(
    ["<a|", "|bcd>", "<|channel|>", "<|return|>", "<|call|>", "<|end|>", "<|endoftext|>"],
    [4, 3, 3, 3, 3, 3, 1],
    **{"tokenizer.ggml.bos_token_id": 262, "tokenizer.ggml.eos_token_id": 262},
)


@pytest.mark.parametrize("text, special, plain", [
    # Specials are cut longest first over the whole text, not leftmost-longest: "|bcd>" wins.
    ("x<a|bcd>y", [120, 60, 97, 257, 121], [120, 256, 98, 99, 100, 62, 121]),
    # gpt-oss: <|channel|> becomes user-defined (parsed even in plain mode); with <|return|>
    # and <|call|> present, <|end|> is no longer end-of-generation and is user-defined too.
    ("<|channel|>analysis<|end|><|return|>", [258, 97, 110, 97, 108, 121, 115, 105, 115, 261, 259],
     [258, 97, 110, 97, 108, 121, 115, 105, 115, 261, 60, 124, 114, 101, 116, 117, 114, 110, 124, 62]),
    # A normal-typed <|endoftext|> is made a control token (llama.cpp's EOG text list).
    ("a<|endoftext|>b", [97, 262, 98], [97, 60, 124, 101, 110, 100, 111, 102, 116, 101, 120, 116, 124, 62, 98]),
])
def test_llama_cpp_special_token_rules(text, special, plain):
    tok = Tokenizer.from_metadata(SYNTH, "synth.gguf")
    assert tok.encode(text) == special
    assert tok.encode(text, add_special=False, parse_special=False) == plain


def test_a_character_with_no_token_still_separates_its_neighbours():
    # Byte 0x1c has no token here; llama.cpp drops it after merging, so the NULs on either
    # side of it do not merge into the "\x00\x00" token (id 255).
    tokens = [_BYTE_TO_CHAR[b] for b in range(256) if b != 0x1C] + ["\u0100\u0100"]
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt-2", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.merges": ["\u0100 \u0100"]}
    tok = Tokenizer.from_metadata(meta, "unknown.gguf")
    assert tok.encode("\x00\x1c\x00\x00") == [0, 255]
    assert tok.encode("\x00\x1c\x00") == [0, 0]
    assert tok.encode("a\x1cb") == [96, 97]


def test_llama_cpp_eog_rules():
    tok = Tokenizer.from_metadata(SYNTH, "synth.gguf")
    assert tok.stop_ids == {259, 260, 262}  # <|return|>, <|call|>, <|endoftext|>


# --- errors ------------------------------------------------------------------------------

def test_missing_tokenizer_is_a_model_file_error():
    with pytest.raises(ModelFileError, match=r"model\.gguf.*tokenizer\.ggml\.model"):
        Tokenizer.from_metadata({"general.architecture": "llama"}, "model.gguf")


def test_unknown_model_and_pre_are_unsupported():
    with pytest.raises(UnsupportedModelError, match=r"x\.gguf.*'rwkv'"):
        Tokenizer.from_metadata({"tokenizer.ggml.model": "rwkv", "tokenizer.ggml.tokens": ["a"]}, "x.gguf")
    with pytest.raises(UnsupportedModelError, match=r"x\.gguf.*'made-up'.*qwen2"):
        Tokenizer.from_metadata(_byte_vocab_meta([], [], **{"tokenizer.ggml.pre": "made-up"}), "x.gguf")


@pytest.mark.parametrize("broken", [
    {"tokenizer.ggml.tokens": None},
    {"tokenizer.ggml.tokens": [1, 2]},
    {"tokenizer.ggml.merges": None},
    {"tokenizer.ggml.token_type": [1]},
    {"tokenizer.ggml.model": "gemma4", "tokenizer.ggml.add_eos_token": True},
])
def test_broken_metadata_is_one_clear_error(broken):
    meta = _byte_vocab_meta([], [])
    meta.update(broken)
    meta = {k: v for k, v in meta.items() if v is not None}
    with pytest.raises(ModelFileError, match=r"^bad\.gguf: "):
        Tokenizer.from_metadata(meta, "bad.gguf")


SPM_STYLE_PRE = {"gemma4", "granite-embed-multi-311m", "sarvam-moe"}  # U+2581 and <0xXX> tokens


@pytest.mark.parametrize("pre", SUPPORTED_PRE)
def test_every_supported_pre_tokenizer_builds_and_round_trips(pre):
    if pre in SPM_STYLE_PRE:
        tokens = [f"<0x{b:02X}>" for b in range(256)] + [chr(c) for c in range(0x21, 0x7F)] + ["\u2581"]
        meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre, "tokenizer.ggml.tokens": tokens,
                "tokenizer.ggml.token_type": [6] * 256 + [1] * 95, "tokenizer.ggml.merges": ["\u2581 H"],
                "tokenizer.ggml.bos_token_id": 0}
    else:
        meta = _byte_vocab_meta([], [], **{"tokenizer.ggml.pre": pre})
    tok = Tokenizer.from_metadata(meta, "p.gguf")
    text = "Hello, wörld 123!\n\n  x"
    assert tok.decode(tok.encode(text, add_special=False)) == text


def test_encode_rejects_non_text():
    tok = tokenizer("olmoe-f32.gguf")
    with pytest.raises(OnebitError):
        tok.encode(b"bytes")  # type: ignore[arg-type]
    assert tok.encode("\ud800x", add_special=False) == tok.encode("?x", add_special=False)


@pytest.mark.parametrize("name", ["gemma3-f32.gguf", "llama-f32.gguf"])
def test_spm_merge_ranking_cache(name, tmp_path, monkeypatch):
    """Large SentencePiece vocabularies keep their merge ranking in a cache file: a tokenizer
    built from the cache (or past a damaged one) gives the same merges and ids."""
    from onebit.formats import tokenizer as tok_mod

    meta = read_metadata(fixture_path(name))
    monkeypatch.setattr(tok_mod, "SPM_CACHE_MIN_TOKENS", 1)
    monkeypatch.setattr(tok_mod, "_cache_dir", None)  # (restored after the test)
    cold = Tokenizer.from_metadata(meta, name)
    tok_mod.set_cache_dir(tmp_path)
    first = Tokenizer.from_metadata(meta, name)
    (path,) = tmp_path.glob("spm-merges-*.npy")
    warm = Tokenizer.from_metadata(meta, name)
    assert first._spm_merges() == warm._spm_merges() == cold._spm_merges()
    strings = cases()["strings"]
    want = [cold.encode(s) for s in strings]
    assert [warm.encode(s) for s in strings] == want
    path.write_bytes(b"not a numpy file")
    assert [Tokenizer.from_metadata(meta, name).encode(s) for s in strings] == want
    tok_mod.set_cache_dir(None)
    path.unlink()
    Tokenizer.from_metadata(meta, name)
    assert not list(tmp_path.glob("spm-merges-*"))
