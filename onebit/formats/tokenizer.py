"""Tokenizers built from GGUF metadata that give llama.cpp's token ids.

The merge loops run in HF `tokenizers` (Rust). Around them this module keeps the rules in
which llama.cpp (src/llama-vocab.cpp) differs from HF's own tokenizer.json pipelines:

- special and user-defined tokens are cut out of the text longest token first over the whole
  text (not leftmost-longest), and user-defined ones even when `parse_special` is off;
- SentencePiece (`llama`) text gets a space before every fragment between special tokens, and
  merges any adjacent pair whose concatenation is a token, highest score first;
- byte-level BPE (`gpt2`) splits words with the regex list llama.cpp picks for
  `tokenizer.ggml.pre`, applied one after another, and some pre-tokenizers ignore merges when
  a whole word is a token;
- BOS/EOS, end-of-generation tokens and decoding (leading-space strip, `clean_spaces`) follow
  llama.cpp's defaults and its token-text heuristics.

Known gaps: characters first assigned in Unicode 16 (Oniguruma knows them, llama.cpp's 15.1
tables do not) can split differently; SentencePiece vocabularies whose tokens share scores
merge ties in a different order (a warning is logged); the Kimi-K2, AFMoE, tiny_aya,
superbpe and whitespace pre-tokenizers (custom code in llama.cpp) and the bert, t5, rwkv and
plamo2 models are refused.
"""

from __future__ import annotations

import codecs
import hashlib
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Regex, Tokenizer as HFTokenizer
from tokenizers import models as hf_models
from tokenizers import pre_tokenizers as hf_pre

from ..errors import ModelFileError, UnsupportedModelError, UsageError

log = logging.getLogger(__name__)

# GGUF token types (tokenizer.ggml.token_type).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# llama.cpp token attributes (llama.h), kept as bit flags because llama.cpp ORs them.
_A_UNKNOWN = 1 << 0
_A_UNUSED = 1 << 1
_A_NORMAL = 1 << 2
_A_CONTROL = 1 << 3
_A_USER_DEFINED = 1 << 4
_A_BYTE = 1 << 5
_A_LSTRIP = 1 << 7
_A_RSTRIP = 1 << 8
_TYPE_ATTR = {
    NORMAL: _A_NORMAL,
    UNKNOWN: _A_UNKNOWN,
    CONTROL: _A_CONTROL,
    USER_DEFINED: _A_USER_DEFINED,
    UNUSED: _A_UNUSED,
    BYTE: _A_BYTE,
}
_A_SPECIAL = _A_UNKNOWN | _A_CONTROL  # hidden from decoded text unless asked for
_A_PARSED = _A_CONTROL | _A_USER_DEFINED | _A_UNKNOWN  # cut out of the text before merges

# SentencePiece vocabularies this large keep their merge ranking in a cache file (set_cache_dir).
SPM_CACHE_MIN_TOKENS = 65536
_cache_dir: Path | None = None


def set_cache_dir(path: str | os.PathLike | None) -> None:
    """Keep derived data (the merge ranking of SentencePiece vocabularies of SPM_CACHE_MIN_TOKENS
    tokens or more) in folder `path` for every Tokenizer built after this call; None, the
    default, keeps none (the ranking is found again on each load). The `onebit` command sets
    $ONEBIT_CACHE_DIR, else $XDG_CACHE_HOME/onebit, else ~/.cache/onebit."""
    global _cache_dir
    _cache_dir = None if path is None else Path(path)


def cache_dir() -> Path | None:
    """The folder set by `set_cache_dir`, or None."""
    return _cache_dir


_SPACE = "\u2581"  # SentencePiece's escaped space
_UNK_SENTINEL = "\U0010ffff<onebit-unknown>"  # in no vocabulary
_C_SPACE = " \t\n\v\f\r"  # C isspace(), which llama.cpp's lstrip/rstrip use

# Token texts llama.cpp treats as end of generation (llama_vocab::impl::load).
_EOG_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
    "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
    "<\uff5cend\u2581of\u2581sentence\uff5c>", "[e~[",
})
_EOT_TEXTS = (
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>",
    "<EOT>", "_<EOT>", "[EOT]", "<\uff5cend\u2581of\u2581sentence\uff5c>", "<end_of_utterance>",
)
# FIM tokens llama.cpp looks up by text; the pad/repo/file-separator ones end generation.
_FIM_TEXTS = {
    "pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<\uff5cfim\u2581begin\uff5c>",
            "<PRE>", "\u2581<PRE>", "<|code_prefix|>", "<|prefix|>"),
    "suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<\uff5cfim\u2581hole\uff5c>",
            "<SUF>", "\u2581<SUF>", "<|code_suffix|>", "<|suffix|>"),
    "mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<\uff5cfim\u2581end\uff5c>",
            "<MID>", "\u2581<MID>", "<|code_middle|>", "<|middle|>"),
    "pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "sep": ("<|file_sep|>",),
}

# --- pre-tokenizer regexes (llama.cpp's, adapted there from each model's tokenizer.json) ---

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_LLAMA3 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN35 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_JAIS2 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s{512}(?!\S)|\s{256}(?!\S)|\s{128}(?!\S)|\s{64}(?!\S)|\s{32}(?!\S)"
          r"|\s{16}(?!\S)|\s{8}(?!\S)|\s{4}(?!\S)|\s{1,2}(?!\S)|\s{1}")
# Upper/lower case by lookahead: llama.cpp runs these on text where every non-ASCII letter
# is one placeholder, so a non-ASCII letter counts as both cases.
_GPT4O = (r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+" + _CONTRACTIONS + "?"
          r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*" + _CONTRACTIONS + "?"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN = (r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+"
           r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*"
           r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GRANITE_EMB = (r"[^\r\n\p{L}\p{N}]?((?=[\p{L}\p{M}])([^a-z]))*((?=[\p{L}\p{M}])([^A-Z]))+"
                + _CONTRACTIONS + "?"
                r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}\p{M}])([^a-z]))+((?=[\p{L}\p{M}])([^A-Z]))*"
                + _CONTRACTIONS + "?"
                r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_CJK_KANA = "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+"
_DEEPSEEK3 = (r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"""
              r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_SPARK = (r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"""
          r"| ?[\p{P}\p{S}]+|[\r\n]|\s+(?!\S)|\s+")
# llama.cpp matches these literal classes with every non-ASCII space turned into \v, so the
# spaces inside their ranges (U+1680, U+2000.., U+3000) never match: "&&\S" says the same.
_DEEPSEEK_CJK = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff&&\\S]+"
_DEEPSEEK_LLM_LETTERS = (
    "\\s?[A-Za-z\xb5\xc0-\xd6\xd8-\xf6\xf8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af"
    "\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1"
    "\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5"
    "\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a"
    "\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d"
    "\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3"
    "\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115"
    "\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f"
    "\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3"
    "\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf"
    "\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f"
    "\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2"
    "\U000118a0-\U000118df\U0001e900-\U0001e943]+"
)
_DEEPSEEK_LLM_PUNCT = "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002&&\\S]+"
_BLOOM = " ?[^(\\s|.,!?\u2026\u3002\uff0c\u3001\u0964\u06d4\u060c)]+"
_YOUTU_CJK = ("[\uac00-\ud7a3\u3131-\u318e]+|[\uff01\u2026\u201c\u201d\u2018\u2019\u2014\uff1a\uff1b"
              "\uff0c\u3001-\u303f\ufe30-\ufe4f]+|[\u3105-\u312f]+|[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+")
# llama.cpp folds \p{Lu}, \p{Ll}, ... into one letter class here, so every letter is both cases.
_YOUTU = (r"[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]*[\p{L}\p{M}]+" + _CONTRACTIONS + "?"
          r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+[\p{L}\p{M}]*" + _CONTRACTIONS + "?"
          r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")


@dataclass(frozen=True)
class _Pre:
    """One llama.cpp pre-tokenizer: its regex list and the flags `load()` sets with it."""

    regexes: tuple[str, ...]
    ignore_merges: bool = False
    clean_spaces: bool = True
    add_bos: bool = False
    bos_null: bool = False  # llama.cpp clears the default BOS id (GLM)
    spm_style: bool = False  # spaces as U+2581, raw UTF-8 with <0xXX> byte fallback (Gemma 4)


_DEFAULT = _Pre((r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", "[0-9][0-9][0-9]"))
_GPT2_PRE = _Pre((_GPT2,))
_STARCODER = _Pre((r"\p{N}", _GPT2))
_NO_CLEAN = dict(clean_spaces=False)

# tokenizer.ggml.pre -> pre-tokenizer, as in llama_vocab::impl::load.
_PRE: dict[str, _Pre] = {
    "default": _DEFAULT,
    "llama3": _Pre((_LLAMA3,), ignore_merges=True, add_bos=True),
    "minicpm5": _Pre((r"\p{N}{1,3}", _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}+"
                      r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"), ignore_merges=True),
    "deepseek-llm": _Pre(("[\r\n]", _DEEPSEEK_LLM_LETTERS, _DEEPSEEK_LLM_PUNCT, r"\s+\z",
                          _DEEPSEEK_CJK, r"\p{N}+"), **_NO_CLEAN),
    "deepseek-coder": _Pre(("[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _DEEPSEEK_CJK, r"\p{N}"),
                           **_NO_CLEAN),
    "deepseek-v3": _Pre((r"\p{N}{1,3}", _CJK_KANA, _DEEPSEEK3), **_NO_CLEAN),
    "spark2_5": _Pre((r"\p{N}{1,3}", _CJK_KANA, _SPARK, r"\p{N}"), **_NO_CLEAN),
    "falcon": _Pre((r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, "[0-9][0-9][0-9]")),
    "mpt": _GPT2_PRE,
    "starcoder": _STARCODER,
    "gpt-2": _GPT2_PRE,
    "jais-2": _Pre((_JAIS2,)),
    "gemma4": _Pre(("[^\n]+|[\n]+",), spm_style=True),
    "sarvam-moe": _Pre(("[^\n]+|[\n]+",), spm_style=True, **_NO_CLEAN),
    "refact": _STARCODER,
    "command-r": _Pre((r"\p{N}", _GPT2), **_NO_CLEAN),
    "qwen2": _Pre((_QWEN2,), **_NO_CLEAN),
    "qwen35": _Pre((_QWEN35,), **_NO_CLEAN),
    "stablelm2": _Pre((_QWEN2,)),
    "olmo": _GPT2_PRE,
    "dbrx": _Pre((_LLAMA3,)),
    "smaug-bpe": _Pre((_LLAMA3,)),
    "poro-chat": _Pre((_BLOOM,), **_NO_CLEAN),
    "chatglm-bpe": _Pre((_LLAMA3,), bos_null=True),
    "glm4": _Pre((_LLAMA3,), bos_null=True, ignore_merges=True),
    "viking": _Pre((_BLOOM, r"\p{N}"), **_NO_CLEAN),
    "jais": _GPT2_PRE,
    "tekken": _Pre((_TEKKEN,), ignore_merges=True, add_bos=True, **_NO_CLEAN),
    "smollm": _Pre((r"\p{N}", _GPT2), **_NO_CLEAN),
    "codeshell": _STARCODER,
    "bloom": _Pre((_BLOOM,)),
    "gpt3-finnish": _Pre((_BLOOM,)),
    "exaone": _STARCODER,
    "exaone4": _GPT2_PRE,
    "exaone-moe": _Pre((_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?(?:\p{L}\p{M}*(?: \p{L}\p{M}*)*)+"
                        r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]?|\s*[\r\n]|\s+(?!\S)|\s+",)),
    "minerva-7b": _STARCODER,
    "megrez": _Pre((_QWEN2,)),
    "gpt-4o": _Pre((_GPT4O,), **_NO_CLEAN),
    "granite-embed-multi-97m": _Pre((_GRANITE_EMB,), ignore_merges=True, **_NO_CLEAN),
    "trillion": _Pre((_GPT2,), **_NO_CLEAN),
    "granite-docling": _Pre((_GPT2,), **_NO_CLEAN),
    "bailingmoe": _Pre((r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+"
                        r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+",), **_NO_CLEAN),
    "seed-coder": _Pre((_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}"
                        r"| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+",), **_NO_CLEAN),
    "hunyuan": _Pre((_QWEN2,), **_NO_CLEAN),
    "hunyuan-dense": _Pre((r"\p{N}{1,3}", _CJK_KANA, _DEEPSEEK3), **_NO_CLEAN),
    "ufakzeka": _Pre((r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
                      r"|\s+(?!\S)|\s+",), **_NO_CLEAN),
    "grok-2": _Pre((_QWEN2,), **_NO_CLEAN),
    "laguna": _Pre(("[^\n]+|[\n]+", _QWEN2), **_NO_CLEAN),
    "minimax-m2": _Pre((_GPT4O,), **_NO_CLEAN),
    "solar-open": _Pre((_QWEN2,), **_NO_CLEAN),
    "mellum2": _STARCODER,
    "youtu": _Pre((_YOUTU_CJK, _YOUTU), ignore_merges=True, **_NO_CLEAN),
    "chameleon": _Pre(("<sentinel:[0-9]+>", "(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z", "([\t\n]|    |  )",
                       r"\p{N}", r"[\p{P}!-/:-@\[-`{-~]", _GPT2), add_bos=True, **_NO_CLEAN),
}
_ALIASES = {
    "llama-v3": "llama3", "llama-bpe": "llama3", "falcon3": "llama3", "falcon-h1": "llama3",
    "pixtral": "llama3", "midm-2.0": "llama3", "lfm2": "llama3", "jina-v5-nano": "llama3",
    "phi-2": "gpt-2", "jina-es": "gpt-2", "jina-de": "gpt-2", "gigachat": "gpt-2",
    "jina-v2-es": "gpt-2", "jina-v2-de": "gpt-2", "a.x-4.0": "gpt-2", "mellum": "gpt-2",
    "modern-bert": "gpt-2", "jina-v1-en": "gpt-2", "jina-v2-code": "gpt-2", "roberta-bpe": "gpt-2",
    "granite-embed-multi-311m": "gemma4", "deepseek-r1-qwen": "qwen2", "kormo": "qwen2",
    "f2llmv2": "qwen2", "glm5": "glm4", "llama4": "gpt-4o", "kanana2": "gpt-4o",
    "talkie": "gpt-4o", "bailingmoe2": "bailingmoe", "llada-moe": "bailingmoe",
    "hy_v4": "hunyuan-dense", "joyai-llm": "hunyuan-dense",
}
SUPPORTED_PRE = tuple(sorted(set(_PRE) | set(_ALIASES)))
SUPPORTED_MODELS = ("gpt2", "llama", "gemma4")


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (byte-level BPE token texts use it)."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {b: chr(b) for b in printable}
    n = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + n)
            n += 1
    return table


_BYTE_TO_CHAR = _bytes_to_unicode()
_CHAR_TO_BYTE = {c: b for b, c in _BYTE_TO_CHAR.items()}


def _clean_spaces(text: bytes) -> bytes:
    """llama.cpp's clean_up_tokenization_spaces, pass for pass on the raw bytes."""
    t = bytearray(text)
    # " ?", " !", " .", " ,": drop the space
    out = bytearray()
    for i, x in enumerate(t):
        if i > 0 and t[i - 1] == 0x20 and x in b"?!.," and out:
            out.pop()
        out.append(x)
    # " ' ": drop the spaces around a lone apostrophe (llama.cpp zeroes the next space)
    t = out
    out, i = bytearray(t[:1]), 1
    while i < len(t):
        x = t[i]
        if x == 0x27 and i + 1 < len(t) and t[i - 1] == 0x20 and t[i + 1] == 0x20:
            out.pop()
            i += 1
            t[i] = 0
        out.append(x)
        i += 1
    # " 's", " 'm", " 're", " 've": drop the space
    t, out = out, bytearray()
    n = len(t)
    for i, x in enumerate(t):
        if i > 0 and t[i - 1] == 0x20 and x == 0x27 and i + 1 < n:
            x1 = t[i + 1]
            if x1 in b"sm" or (i + 2 < n and t[i + 2] == 0x65 and x1 in b"rv"):
                out.pop()
        out.append(x)
    return bytes(out)


def _as_list(meta: Mapping[str, Any], key: str) -> list | None:
    value = meta.get(key)
    if value is None:
        return None
    return value.tolist() if hasattr(value, "tolist") else list(value)


MAX_DUPLICATE_TOKENS = 64  # repeated token strings tolerated (beyond 1% of the vocabulary: refused)


def _first_repeat(texts: list[str]) -> str:
    first: dict[str, int] = {}
    for i, t in enumerate(texts):
        if t in first:
            return f"{t!r:.40} at ids {first[t]} and {i}"
        first[t] = i
    return "none"


class Tokenizer:
    """Text <-> token ids for one GGUF model, matching llama.cpp id for id."""

    def __init__(self, meta: Mapping[str, Any], source: str = "<gguf>"):
        self.source = source
        model = meta.get("tokenizer.ggml.model")
        if model is None:
            raise ModelFileError(
                f"{source}: the file has no tokenizer (tokenizer.ggml.model is missing); use a GGUF "
                "converted with its tokenizer, e.g. by llama.cpp's convert_hf_to_gguf.py"
            )
        if model not in SUPPORTED_MODELS:
            raise UnsupportedModelError(
                f"{source}: tokenizer model '{model}' is not supported; onebit runs "
                f"{', '.join(SUPPORTED_MODELS)} tokenizers. Use a GGUF of a model with one of them"
            )
        texts = meta.get("tokenizer.ggml.tokens")
        if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
            raise ModelFileError(
                f"{source}: tokenizer.ggml.tokens is missing or not a list of strings; "
                "the file is damaged or was written by a broken converter, reconvert it"
            )
        n = len(texts)
        self.model = model
        self._spm = model == "llama"

        pre_name = "gemma4" if model == "gemma4" else meta.get("tokenizer.ggml.pre") or "default"
        if self._spm:
            self.pre_name = "default"
            self._pre = _DEFAULT
        else:
            key = _ALIASES.get(pre_name, pre_name)
            if key not in _PRE:
                raise UnsupportedModelError(
                    f"{source}: pre-tokenizer '{pre_name}' (tokenizer.ggml.pre) is not supported; "
                    f"supported: {', '.join(SUPPORTED_PRE)}. Use a model whose tokenizer is one "
                    "of these, or report the model so its pre-tokenizer can be added"
                )
            self.pre_name = pre_name
            self._pre = _PRE[key]

        # llama.cpp renames empty tokens; duplicates resolve to the last id, as in its map.
        texts = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(texts)]
        self._texts = texts
        self._ids = {t: i for i, t in enumerate(texts)}
        if n - len(self._ids) > max(MAX_DUPLICATE_TOKENS, n // 100):
            raise ModelFileError(
                f"{source}: tokenizer.ggml.tokens repeats token strings at {n - len(self._ids)} of its {n} ids "
                f"(e.g. {_first_repeat(texts)}); a tokenizer maps each text to one id, so text could not be "
                "encoded. The file is damaged, reconvert it"
            )

        scores = _as_list(meta, "tokenizer.ggml.scores")
        types = _as_list(meta, "tokenizer.ggml.token_type")
        for key, arr in (("scores", scores), ("token_type", types)):
            if arr is not None and len(arr) < n:
                raise ModelFileError(
                    f"{source}: tokenizer.ggml.{key} has {len(arr)} entries for {n} tokens; "
                    "the file is damaged, reconvert it"
                )
        self._scores = [float(s) for s in scores[:n]] if scores is not None else [0.0] * n
        attrs = [_TYPE_ATTR.get(int(t), 0) for t in types[:n]] if types else [_A_NORMAL] * n

        self._init_flags(meta, n)
        self._init_special(meta, attrs, n)
        self._attrs = attrs
        # Longest first, as llama.cpp cuts them (its sort is not stable; ties keep id order).
        self._special = sorted(
            ((texts[i], i) for i in range(n) if attrs[i] & _A_PARSED),
            key=lambda ti: -len(ti[0].encode("utf-8")),
        )
        self._hf = self._build_hf(meta)
        self._pieces: list[bytes | None] = [None] * n
        self.chat_template: str | None = meta.get("tokenizer.chat_template") or None

    @classmethod
    def from_metadata(cls, meta: Mapping[str, Any], source: str = "<gguf>") -> Tokenizer:
        return cls(meta, source)

    # --- metadata ---------------------------------------------------------------------------

    def _init_flags(self, meta: Mapping[str, Any], n: int) -> None:
        pre = self._pre
        if self._spm:
            bos, eos, unk = 1, 2, 0
            add_space_prefix, add_bos, clean = True, True, False
        elif self.model == "gemma4":
            bos = eos = unk = None
            add_space_prefix, add_bos, clean = False, pre.add_bos, pre.clean_spaces
        else:
            bos, eos, unk = 11, 11, None
            add_space_prefix, add_bos, clean = False, pre.add_bos, pre.clean_spaces
        if pre.bos_null:
            bos = None
        self._escape_spaces = self._spm or pre.spm_style
        self.add_space_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", add_space_prefix))
        self.clean_spaces = clean

        def special_id(key: str, default: int | None) -> int | None:
            if default is not None and default >= n:
                default = None
            value = meta.get(f"tokenizer.ggml.{key}")
            if value is None:
                return default
            value = int(value)
            return value if 0 <= value < n else default

        self.bos_id = special_id("bos_token_id", bos)
        self.eos_id = special_id("eos_token_id", eos)
        self.unk_id = special_id("unknown_token_id", unk)
        self._eot_id = special_id("eot_token_id", None)
        self._eom_id = special_id("eom_token_id", None)
        # The deprecated prefix/suffix/middle keys come later in llama.cpp's list, so they win.
        old_keys = {"pre": "prefix", "suf": "suffix", "mid": "middle"}
        self._fim = {}
        for kind in ("pre", "suf", "mid", "pad", "rep", "sep"):
            tid = special_id(f"fim_{kind}_token_id", None)
            if kind in old_keys:
                tid = special_id(f"{old_keys[kind]}_token_id", tid)
            self._fim[kind] = tid
        self.add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", add_bos))
        self.add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
        if _ALIASES.get(self.pre_name, self.pre_name) == "gemma4":
            self.add_bos = True  # llama.cpp forces it for Gemma 4
        for flag, tid, what in ((self.add_bos, self.bos_id, "BOS"), (self.add_eos, self.eos_id, "EOS")):
            if flag and tid is None:
                raise ModelFileError(
                    f"{self.source}: the tokenizer asks for a {what} token but has no valid "
                    f"{what.lower()}_token_id; the file's tokenizer metadata is inconsistent, reconvert it"
                )

    def _init_special(self, meta: Mapping[str, Any], attrs: list[int], n: int) -> None:
        """End-of-generation set and attribute fix-ups, in llama.cpp's order."""
        ids = self._ids

        def mark_control(tid: int) -> None:
            attrs[tid] |= _A_CONTROL

        if self._eot_id is None:
            for text in _EOT_TEXTS:
                if text in ids:
                    self._eot_id = ids[text]
                    break
        if self._eom_id is None and "<|eom_id|>" in ids:
            self._eom_id = ids["<|eom_id|>"]
        for kind, candidates in _FIM_TEXTS.items():
            if self._fim[kind] is None:
                for text in candidates:
                    if text in ids:
                        self._fim[kind] = ids[text]
                        break
        for tid in (self._eot_id, self._eom_id, *self._fim.values()):
            if tid is not None:
                mark_control(tid)

        eog = {self._fim[k] for k in ("pad", "rep", "sep") if self._fim[k] is not None}
        for text in _EOG_TEXTS:
            tid = ids.get(text)
            if tid is not None:
                eog.add(tid)
                mark_control(tid)
        for text in ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"):  # gpt-oss
            if text in ids:
                attrs[ids[text]] = _A_USER_DEFINED
        eog.update(t for t in (self.eos_id, self._eot_id, self._eom_id) if t is not None)

        eog_texts = {self._texts[t] for t in eog}
        end_id = ids.get("<|end|>")
        has_call = bool(eog_texts & {"<|call|>", "<|calls|>"})
        if end_id in eog and has_call and eog_texts & {"<|return|>", "<|flush|>"}:
            eog.discard(end_id)  # o200k_harmony / solar-open: <|end|> ends a message, not the turn
            attrs[end_id] = _A_USER_DEFINED
        s_id = ids.get("</s>")
        if s_id in eog and eog_texts & {"<|tool_response>", "<|plamo:eos|>"}:
            eog.discard(s_id)  # Gemma 4 / PLaMo: </s> is a normal token
            attrs[s_id] = _A_NORMAL
        self._eog = frozenset(eog)

        name = str(meta.get("general.name", "")).lower()
        if "phi-3" in name or "phi3" in name:
            # llama.cpp strips spaces right of Phi-3's special tokens, except these.
            for tid in range(n):
                if attrs[tid] & _A_PARSED:
                    attrs[tid] |= _A_RSTRIP
            if "</s>" in ids:
                attrs[ids["</s>"]] |= _A_RSTRIP
            for text in ("<unk>", "<s>", "<|endoftext|>"):
                if text in ids:
                    attrs[ids[text]] &= ~_A_RSTRIP

    # --- the HF model -----------------------------------------------------------------------

    def _build_hf(self, meta: Mapping[str, Any]) -> HFTokenizer:
        vocab = self._ids
        if self._spm:
            merges = self._spm_merges()
            unk = self._texts[self.unk_id] if self.unk_id is not None else None
            bpe = hf_models.BPE(vocab, merges, unk_token=unk, byte_fallback=True)
            return HFTokenizer(bpe)

        raw = meta.get("tokenizer.ggml.merges")
        if not isinstance(raw, list):
            raise ModelFileError(
                f"{self.source}: tokenizer.ggml.merges is missing; a BPE tokenizer needs its merges, "
                "reconvert the model with its tokenizer"
            )
        merges, seen = [], set()
        for i, m in enumerate(raw):
            cut = m.find(" ", 1) if isinstance(m, str) else -1
            if cut < 0 or cut == len(m) - 1:
                raise ModelFileError(
                    f"{self.source}: tokenizer.ggml.merges entry {i} ({m!r:.60}) is not two tokens separated by a "
                    "space; the file is damaged or was written by a broken converter, reconvert it"
                )
            pair = m[:cut], m[cut + 1:]
            # llama.cpp would merge a pair whose result is no token and then spell it in
            # bytes; HF refuses such merges, and no real vocabulary has one. A repeated pair
            # keeps its first rank, as in llama.cpp's map.
            if pair[0] in vocab and pair[1] in vocab and pair[0] + pair[1] in vocab and pair not in seen:
                seen.add(pair)
                merges.append(pair)
        if self._pre.spm_style:
            bpe = hf_models.BPE(vocab, merges, byte_fallback=True)
            return HFTokenizer(bpe)
        # A character with no token stays in the word as a barrier in llama.cpp and is then
        # dropped; HF drops it before merging. An unknown token past the vocabulary keeps the
        # barrier, and _encode_text drops its id.
        vocab = {**vocab, _UNK_SENTINEL: len(self._texts)}
        bpe = hf_models.BPE(vocab, merges, unk_token=_UNK_SENTINEL,
                            ignore_merges=self._pre.ignore_merges)
        tok = HFTokenizer(bpe)
        splits = [hf_pre.Split(Regex(r), behavior="isolated") for r in self._pre.regexes]
        tok.pre_tokenizer = hf_pre.Sequence(
            [*splits, hf_pre.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
        return tok

    def _spm_merges(self) -> list[tuple[str, str]]:
        """Every split of every token into two tokens, best merged score first.

        llama.cpp's SPM loop merges the adjacent pair whose concatenation is the
        highest-scoring token; HF's BPE merges the lowest-ranked pair, so rank = score order.
        Where two different tokens tie on score llama.cpp takes the leftmost pair and HF the
        lower rank (here: the lower token id), so a vocabulary with many ties (converters that
        write one score for every token) may tokenize differently; real SentencePiece
        vocabularies have distinct scores.
        """
        ranked = self._spm_ranking()  # [n, 2]: (token id, split position), in merge order
        scores = np.asarray(self._scores, np.float64)
        merged = np.unique(ranked[:, 0])
        tied = len(merged) - len(np.unique(scores[merged]))
        if tied > len(merged) // 100:
            log.warning("%s: %d of %d SentencePiece tokens share a score with another; token ids "
                        "may differ from llama.cpp's where such merges compete", self.source, tied,
                        len(merged))
        texts = self._texts
        return [(texts[t][:k], texts[t][k:]) for t, k in ranked.tolist()]

    def _spm_ranking(self) -> np.ndarray:
        """The merge order as (token id, split) rows. Finding the splits of a 262k vocabulary
        takes seconds (a million substring checks), so large vocabularies keep the result in a
        cache file keyed by a hash of their tokens and scores."""
        path = None
        if len(self._texts) >= SPM_CACHE_MIN_TOKENS:
            directory = cache_dir()
            if directory is not None:
                h = hashlib.sha256(b"onebit-spm-merges-v1\0")
                h.update("\0".join(self._texts).encode("utf-8", "surrogatepass"))
                h.update(np.asarray(self._scores, np.float64).tobytes())
                path = directory / f"spm-merges-{h.hexdigest()[:32]}.npy"
                try:
                    ranked = np.load(path, allow_pickle=False)
                    if ranked.ndim == 2 and ranked.shape[1] == 2 and ranked.dtype == np.int32 and (
                            not ranked.size or (ranked.min() >= 0 and ranked[:, 0].max() < len(self._texts))):
                        return ranked
                except (OSError, ValueError):
                    pass
        ids, scores = self._ids, self._scores
        rows = []
        for text, tid in ids.items():
            score = scores[tid]
            for k in range(1, len(text)):
                if text[:k] in ids and text[k:] in ids:
                    rows.append((-score, tid, k))
        rows.sort()
        ranked = np.array([(tid, k) for _, tid, k in rows], np.int32).reshape(-1, 2)
        if path is not None:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = path.with_suffix(f".{os.getpid()}.tmp")
                with open(tmp, "wb") as f:
                    np.save(f, ranked)
                os.replace(tmp, path)
            except OSError as e:
                log.debug("tokenizer cache %s not written: %s", path, e)
        return ranked

    # --- encode -----------------------------------------------------------------------------

    def _partition(self, text: str, parse_special: bool) -> list[str | int]:
        """Cut special tokens out of `text` the way llama.cpp's tokenizer_st_partition does."""
        frags: list[str | int] = [text]
        attrs = self._attrs
        for tok, tid in self._special:
            attr = attrs[tid]
            if not parse_special and attr & _A_SPECIAL:
                continue
            if tok not in text:
                continue
            out: list[str | int] = []
            for frag in frags:
                if isinstance(frag, int) or tok not in frag:
                    out.append(frag)
                    continue
                start = 0
                while True:
                    hit = frag.find(tok, start)
                    if hit < 0:
                        break
                    left = frag[start:hit]
                    if attr & _A_LSTRIP:
                        left = left.rstrip(_C_SPACE)
                    if left:
                        out.append(left)
                    out.append(tid)
                    start = hit + len(tok)
                    if attr & _A_RSTRIP:
                        while start < len(frag) and frag[start] in _C_SPACE:
                            start += 1
                if start < len(frag):
                    out.append(frag[start:])
            frags = out
        return frags

    def _encode_text(self, text: str) -> list[int]:
        if self._spm:
            if self.add_space_prefix:
                text = " " + text
            return self._hf.encode(text.replace(" ", _SPACE), add_special_tokens=False).ids
        if self._pre.spm_style:
            return self._encode_spm_style(text.replace(" ", _SPACE))
        ids = self._hf.encode(text, add_special_tokens=False).ids
        unk = len(self._texts)
        return [i for i in ids if i != unk] if unk in ids else ids

    def _encode_spm_style(self, text: str) -> list[int]:
        # Gemma 4: runs of newlines and of other text are merged apart; a run of newlines
        # that is itself a token stays whole.
        out: list[int] = []
        start = 0
        while start < len(text):
            nl = text[start] == "\n"
            end = start
            while end < len(text) and (text[end] == "\n") == nl:
                end += 1
            word = text[start:end]
            if nl and word in self._ids:
                out.append(self._ids[word])
            else:
                out.extend(self._hf.encode(word, add_special_tokens=False).ids)
            start = end
        return out

    def encode(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        """Token ids of `text`, as llama.cpp's llama_tokenize(text, add_special, parse_special)."""
        if not isinstance(text, str):
            raise UsageError(f"encode() takes text as str, not {type(text).__name__}")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:  # lone surrogates have no UTF-8 form: they become "?"
            text = text.encode("utf-8", "replace").decode("utf-8")
        ids: list[int] = []
        if add_special and self.add_bos:
            ids.append(self.bos_id)
        if text:
            for frag in self._partition(text, parse_special):
                if isinstance(frag, int):
                    ids.append(frag)
                else:
                    ids.extend(self._encode_text(frag))
        if add_special and self.add_eos:
            ids.append(self.eos_id)
        return ids

    # --- decode -----------------------------------------------------------------------------

    def _check_id(self, tid: int) -> int:
        if not 0 <= tid < len(self._texts):
            raise UsageError(f"token id {tid} is out of range for a vocabulary of {len(self._texts)}")
        return tid

    def _piece(self, tid: int) -> bytes:
        """llama.cpp's token_to_piece(special=True): the bytes a token stands for."""
        piece = self._pieces[tid]
        if piece is not None:
            return piece
        text, attr = self._texts[tid], self._attrs[tid]
        if attr & (_A_SPECIAL | _A_USER_DEFINED):
            piece = text.encode("utf-8")
        elif attr & _A_NORMAL:
            if self._escape_spaces:
                piece = text.replace(_SPACE, " ").encode("utf-8")
            else:
                out = bytearray()
                for ch in text:
                    b = _CHAR_TO_BYTE.get(ch)
                    if b is None:  # not a byte-level character: llama.cpp spells it out
                        raw = ch.encode("utf-8")
                        out += b"[UNK_BYTE_0x" + raw.hex().encode() + text.encode("utf-8") + b"]"
                    else:
                        out.append(b)
                piece = bytes(out)
        elif attr & _A_BYTE:
            try:
                piece = bytes([int(text[3:5], 16)])
            except ValueError:
                piece = b"\x00"
        else:
            piece = b""
        self._pieces[tid] = piece
        return piece

    def token_bytes(self, token_id: int, special: bool = True) -> bytes:
        """Raw bytes of one token; control tokens give their text unless `special` is False."""
        tid = self._check_id(int(token_id))
        if not special and self._attrs[tid] & _A_SPECIAL:
            return b""
        return self._piece(tid)

    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        """Text of `ids`, as llama.cpp's llama_detokenize(remove_special=skip_special,
        unparse_special=not skip_special): control tokens are shown unless skipped; skipping
        also drops a leading BOS and a trailing EOS; the first token loses one leading space
        when the model adds a space prefix (not after a BOS); and tokenizers with clean_spaces
        drop spaces before punctuation."""
        ids = [self._check_id(int(t)) for t in ids]
        remove_space = self.add_space_prefix
        if skip_special and self.add_bos and ids and ids[0] == self.bos_id:
            remove_space = False
            ids = ids[1:]
        if skip_special and self.add_eos and ids and ids[-1] == self.eos_id:
            ids = ids[:-1]
        out = bytearray()
        for tid in ids:
            piece = self.token_bytes(tid, special=not skip_special)
            if remove_space and piece.startswith(b" "):
                piece = piece[1:]
            remove_space = False
            out += piece
        raw = _clean_spaces(bytes(out)) if self.clean_spaces else bytes(out)
        return raw.decode("utf-8", "replace")

    def stream(self, skip_special: bool = True) -> StreamDecoder:
        return StreamDecoder(self, skip_special=skip_special)

    # --- properties -------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return len(self._texts)

    @property
    def stop_ids(self) -> frozenset[int]:
        """Tokens that end generation (llama.cpp's EOG set)."""
        return self._eog

    @property
    def bos_token(self) -> str:
        return self._texts[self.bos_id] if self.bos_id is not None else ""

    @property
    def eos_token(self) -> str:
        return self._texts[self.eos_id] if self.eos_id is not None else ""

    def token_text(self, token_id: int) -> str:
        """The token's text as stored in the vocabulary (byte-level or U+2581 form)."""
        return self._texts[self._check_id(int(token_id))]

    def token_to_id(self, text: str) -> int | None:
        return self._ids.get(text)

    def is_special(self, token_id: int) -> bool:
        """Control or unknown token: hidden from decoded text when skipping specials."""
        return bool(self._attrs[self._check_id(int(token_id))] & _A_SPECIAL)


class StreamDecoder:
    """Turns token ids, one at a time, into text that never splits a UTF-8 character.

    Bytes that can never become valid UTF-8 come out as U+FFFD rather than being dropped; an
    unfinished character waits for the next token, and `flush()` returns whatever is left.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = True):
        self._tok = tokenizer
        self._skip = skip_special
        self._dec = codecs.getincrementaldecoder("utf-8")("replace")

    def push(self, token_id: int) -> str:
        return self._dec.decode(self._tok.token_bytes(token_id, special=not self._skip))

    __call__ = push

    def flush(self) -> str:
        text = self._dec.decode(b"", final=True)
        self._dec.reset()
        return text
