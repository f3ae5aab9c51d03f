#!/usr/bin/env python3
"""Make the tiny GGUF test fixtures and their independent reference outputs ("oracles").

What it writes into --out (default tests/fixtures/):
  <name>-f32.gguf          tiny random HF models (one per architecture we support),
                           converted by llama.cpp's own convert_hf_to_gguf.py at f32
                           (glm4moe's with one NextN layer; glm256's is made, quantized
                           and deleted: only glm256-Q4_K_M.gguf is kept);
  q3moe256-<TYPE>.gguf     one qwen3moe model whose every matmul row is a multiple of 256,
                           quantized by llama-quantize into each type we support;
  <file>.ref.npz           tokens + teacher-forced logits from llama.cpp (all files) and from
                           HF transformers (f32 files only) for one fixed text;
  tokenizer_cases.json     llama.cpp tokenizations of tricky strings, per distinct tokenizer;
  manifest.json, README.md what each file is, and the numbers the checks gave.

It needs the optional tooling only (torch, transformers, sentencepiece, tokenizers, and a
llama.cpp build from tools/build_llama_cpp.sh); tests never run it, they read its outputs.
Usage:
  tools/build_llama_cpp.sh .llama-cpp
  python tools/make_fixtures.py --llama-cpp .llama-cpp --out tests/fixtures
One fixture's files, added to the existing ones without touching the others:
  python tools/make_fixtures.py --llama-cpp .llama-cpp --out /tmp/fx --only glm4moe,glm256 \
      --merge-into tests/fixtures
"""
from __future__ import annotations

import argparse
import importlib
import inspect
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parent.parent
LLAMA_CPP_PYTHON_VERSION = "0.3.36"

# One fixed natural-language text for every logits oracle. Long enough that every fixture
# tokenizer yields more than N_TOKENS tokens; we keep the first N_TOKENS.
REF_TEXT = (
    "The old lighthouse keeper climbed the spiral stairs every evening at dusk. "
    "He trimmed the wick, polished the great lens, and wrote the weather in his log: "
    "wind from the north-west, rain later, three ships seen before nine o'clock. "
    "Nobody had asked him to keep the log for twenty years, but he kept it anyway."
)
N_TOKENS = 48

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Strings whose tokenization differs between careless and careful tokenizer ports.
TOKENIZER_STRINGS = [
    "",
    " ",
    "  ",
    "\n",
    "\t",
    "\n\n\n  \t",
    "   leading spaces",
    "trailing spaces   ",
    "Hello world",
    " Hello world",
    "Hello  world\n\nNew paragraph.\r\nWindows line.",
    "don't won't I'LL we'Ve you'RE she's it'd",
    "1234567",
    "3.14159",
    "Call 555-0123 or +44 20 7946 0958 before 2024-12-31.",
    "1,000,000 and 0.000001 and 1e-9",
    "café naïve résumé Ångström façade",
    "Straße Größe über",
    "e\u0301 a\u0300 n\u0303 combining marks",
    "日本語のテキスト、漢字とかな。",
    "中文分词测试：我想在apple工作",
    "한국어 텍스트입니다",
    "مرحبا بالعالم",
    "Привет, мир! нещо на Български",
    "Ελληνικά γράμματα",
    "कुछ हिंदी पाठ",
    "🚀 rocket 😀😃 emoji",
    "👨\u200d👩\u200d👧\u200d👦 family ZWJ",
    "🏳️\u200d🌈 flag and 👍🏽 skin tone",
    "mixed: English, русский, 中文, العربية, 🙂",
    "def f(x):\n    return x ** 2  # square\n",
    "if (a && b) { return a->b[0]; }",
    "<html><body class=\"x\">&amp;</body></html>",
    "''''''```````\"\"\"\"......!!!!!!??????",
    "------======= ~~~ ___ |||",
    "<|im_start|>user\nhi<|im_end|>",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>",
    "text <|endoftext|> more text",
    "<|im_start|> not closed",
    "tab\tseparated\tvalues\t",
    "A" * 40,
    "aaaa bbbb cccc dddd eeee ffff",
    "x" + " " * 17 + "y",
    "\r\n",
    "no\u00a0break\u3000ideographic space",
]

# Extra non-English lines for the tokenizer corpus, so merges span multi-byte UTF-8
# sequences (tokens that are partial characters are a classic detokenizer bug).
MULTILINGUAL_LINES = [
    "Der schnelle braune Fuchs springt über den faulen Hund. Größe, Straße, Mädchen.",
    "Le vif renard brun saute par-dessus le chien paresseux. Café, naïve, façade.",
    "Быстрая коричневая лиса прыгает через ленивую собаку. Привет, мир!",
    "敏捷的棕色狐狸跳过了懒狗。我想在北京工作，今天天气很好。",
    "素早い茶色の狐が怠惰な犬を飛び越える。日本語のテキストです。",
    "الثعلب البني السريع يقفز فوق الكلب الكسول. مرحبا بالعالم.",
    "Η γρήγορη καφέ αλεπού πηδά πάνω από το τεμπέλικο σκυλί.",
    "빠른 갈색 여우가 게으른 개를 뛰어넘습니다. 안녕하세요.",
    "Emoji: 🚀 😀 👍 🙂 ✅ 🦙 and numbers 3.14159 1234567 2024-12-31.",
]

CORPUS_MODULES = [
    "abc", "argparse", "ast", "base64", "bisect", "calendar", "collections", "contextlib",
    "csv", "dataclasses", "datetime", "decimal", "difflib", "doctest", "email.message",
    "enum", "fractions", "functools", "gzip", "hashlib", "heapq", "html", "http.client",
    "inspect", "io", "ipaddress", "itertools", "json", "logging", "math", "operator",
    "os", "pathlib", "pickle", "pprint", "queue", "random", "re", "shlex", "shutil",
    "socket", "statistics", "string", "struct", "subprocess", "tarfile", "tempfile",
    "textwrap", "threading", "tokenize", "typing", "unittest", "urllib.parse", "uuid",
    "zipfile",
]
CORPUS_MAX_CHARS = 400_000

# Router weights get a larger scale than the rest, so that expert choices are rarely
# near-ties (a near-tie lets rounding pick another expert, and logits then jump).
ROUTER_GAIN = 3.0
ROUTER_WEIGHT = re.compile(r"\.(mlp|block_sparse_moe)\.(gate|router)\.weight$")
# The Gated DeltaNet's output norm multiplies by w itself, where Qwen3-Next's other norms take 1 + w.
PLAIN_NORM = re.compile(r"\.linear_attn\.norm\.weight$")
# ...and MoE fixtures take the first seed (fx.seed + 1000 * i) whose reference text routes
# with at least this margin between the k-th and (k+1)-th router logit.
MIN_ROUTER_MARGIN = 0.05
# GLM's expert-score correction bias (zeros in HF's init): N(0, this), on sigmoid scores in (0, 1).
EXPERT_BIAS_STD = 0.1
MAX_SEED_TRIES = 60

CHATML_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# gpt-oss (o200k_harmony): the special tokens its harmony chat template writes, and that
# template itself, as llama.cpp ships it (data, read at fixture time).
HARMONY_SPECIALS = ("<|startoftext|>", "<|endoftext|>", "<|return|>", "<|constrain|>",
                    "<|channel|>", "<|start|>", "<|end|>", "<|message|>", "<|call|>",
                    "<|endofprompt|>")
HARMONY_TEMPLATE_FILE = "models/templates/openai-gpt-oss-120b.jinja"   # under llama.cpp's src
# GLM-4.5's special tokens (llama.cpp's converter looks up [gMASK], <|user|>, <|endoftext|> and
# <|observation|> by name) and a short form of its turn format.
GLM_SPECIALS = ["<|endoftext|>", "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>",
                "<|observation|>"]
GLM_TEMPLATE = (
    "[gMASK]<sop>"
    "{% for message in messages %}{{ '<|' + message['role'] + '|>\\n' + message['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)

# Gemma's turn format, as onebit renders a Gemma file without a template (the same text).
sys.path.insert(0, str(REPO_ROOT))
from onebit.chat_formats.chat_template import GEMMA_TEMPLATE  # noqa: E402


# ---------------------------------------------------------------------------------------
# Fixture specifications
# ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TokenizerSpec:
    kind: str                       # "bpe" (byte-level, tokenizers) or "spm" (sentencepiece)
    vocab_size: int                 # total, special tokens included
    pre: str = "default"            # llama.cpp tokenizer.ggml.pre written for BPE vocabs
    specials: tuple[str, ...] = tuple(CHATML_SPECIALS)
    bos: str | None = None
    eos: str | None = None
    pad: str | None = None
    add_bos: bool = False
    ignore_merges: bool = False     # llama-bpe (llama 3) sets this in HF and llama.cpp
    dummy_prefix: bool = True       # spm: a space before the text (Llama); Gemma has none
    spm_ids: tuple[int, int, int, int] = (0, 1, 2, -1)  # spm: unk, bos, eos, pad ids
    chat_template: str = CHATML_TEMPLATE
    chat_template_file: str = ""    # a template shipped with llama.cpp (path under its src)


# HF pre-tokenizer regexes that mirror llama.cpp's (src/llama-vocab.cpp) for each `pre`,
# so the merges we train are the ones llama.cpp's pre-tokenization can reach.
_QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# o200k (gpt-4o, gpt-oss): tokenizer.json's regex; llama.cpp's "gpt-4o" is its rewrite
_GPT4O_REGEX = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+"
                r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
# llama.cpp's "default" pre-tokenizer applies these one after the other.
_DEFAULT_REGEXES = (r"[\p{P}\$\+<=>\^~\|]+", _GPT2_REGEX, r"\p{N}+", r"[0-9][0-9][0-9]")
PRE_REGEXES = {
    "qwen2": (_QWEN2_REGEX,),
    "llama-bpe": (_LLAMA3_REGEX,),
    "gpt-2": (_GPT2_REGEX,),
    "gpt-4o": (_GPT4O_REGEX,),
    "default": _DEFAULT_REGEXES,
    "glm4": (_LLAMA3_REGEX,),  # llama.cpp: the chatglm4 regex (llama 3's), ignore_merges
}

TOKENIZERS = {
    # Qwen 2/2.5/3 style: no BOS added, <|im_end|> ends a turn.
    "bpe-qwen2": TokenizerSpec("bpe", 512, pre="qwen2", bos="<|endoftext|>", eos="<|im_end|>",
                               pad="<|endoftext|>"),
    # GPT-2 / OLMoE style: <|endoftext|> is both BOS and EOS, none added.
    "bpe-gpt2": TokenizerSpec("bpe", 512, pre="gpt-2", bos="<|endoftext|>", eos="<|endoftext|>",
                              pad="<|endoftext|>"),
    # Llama 3 style: a distinct BOS that is added, ignore_merges.
    "bpe-llama3": TokenizerSpec("bpe", 512, pre="llama-bpe",
                                specials=("<|begin_of_text|>", *CHATML_SPECIALS),
                                bos="<|begin_of_text|>", eos="<|im_end|>", pad="<|endoftext|>",
                                add_bos=True, ignore_merges=True),
    # llama.cpp's fallback pre-tokenizer (several regexes in a row).
    "bpe-default": TokenizerSpec("bpe", 512, pre="default", bos="<|endoftext|>",
                                 eos="<|im_end|>", pad="<|endoftext|>"),
    # gpt-oss (o200k_harmony): the harmony special tokens, <|return|> ends a reply, the
    # real gpt-oss chat template.
    "bpe-o200k": TokenizerSpec("bpe", 512, pre="gpt-4o", specials=HARMONY_SPECIALS,
                               bos="<|startoftext|>", eos="<|return|>", pad="<|endoftext|>",
                               chat_template_file=HARMONY_TEMPLATE_FILE),
    # GLM-4.5 style: pre glm4 (llama.cpp: no BOS token, ignore_merges), GLM's specials.
    "bpe-glm4": TokenizerSpec("bpe", 512, pre="glm4", specials=tuple(GLM_SPECIALS), bos="[gMASK]",
                              eos="<|endoftext|>", pad="<|endoftext|>", ignore_merges=True,
                              chat_template=GLM_TEMPLATE),
    # Llama 1/2 style SentencePiece with byte fallback; ChatML markers are control symbols.
    "spm": TokenizerSpec("spm", 640, specials=("<|im_start|>", "<|im_end|>"),
                         bos="<s>", eos="</s>", add_bos=True),
    # Gemma style SentencePiece: no dummy prefix, pad/eos/bos/unk = 0/1/2/3, turn markers.
    "spm-gemma": TokenizerSpec("spm", 640, specials=("<start_of_turn>", "<end_of_turn>"),
                               bos="<bos>", eos="<eos>", pad="<pad>", add_bos=True,
                               dummy_prefix=False, spm_ids=(3, 2, 1, 0),
                               chat_template=GEMMA_TEMPLATE),
}


@dataclass(frozen=True)
class Fixture:
    name: str            # GGUF stem: <name>-f32.gguf
    hf_class: str        # transformers model class
    config_class: str    # transformers config class
    config: dict         # config kwargs (the tiny shape)
    tokenizer: str       # key into TOKENIZERS
    seed: int
    vocab_pad: int = 0   # extra vocab rows beyond the tokenizer (written as [PAD] tokens)
    quant_types: tuple[str, ...] = ()   # llama-quantize targets made from the f32 file
    norm_center: float = 1.0   # random norm weights are this + N(0, 0.2) (Gemma stores w - 1)
    gains: tuple[tuple[str, float], ...] = ()   # (parameter name suffix, factor) after init
    nextn_layers: int = 0      # GLM MTP layers saved beside the HF weights (see add_nextn_layers)
    ship_f32: bool = True      # False: the f32 file only feeds llama-quantize (too big to keep)
    convert_args: tuple[str, ...] = ()   # extra convert_hf_to_gguf.py flags


SMALL = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, max_position_embeddings=512, initializer_range=0.1,
             tie_word_embeddings=False)

# Quant types the engine supports; made from q3moe256-f32.gguf with llama-quantize.
QUANT_TYPES = ("F16", "BF16", "Q8_0", "Q4_0", "Q4_K_M", "Q5_K_M", "Q6_K", "MXFP4_MOE",
               "Q1_0", "TQ1_0", "TQ2_0",
               # the legacy and K types with a default mix of their own (Q2_K's holds Q3_K)
               "Q4_1", "Q5_0", "Q5_1", "Q2_K",
               # the IQ types (IQ3_XXS's mix holds IQ2_S and IQ3_S; IQ2_S's would be IQ2_XS)
               "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ3_XXS", "IQ3_S", "IQ4_NL", "IQ4_XS")

# Qwen3-Next's test shape: DeltaNet and gated attention layers alternating, 2 key heads serving
# 4 value heads, partial rotary (1/4 of head_dim), a sigmoid-gated shared expert.
QWEN3NEXT = dict(SMALL, num_hidden_layers=4, intermediate_size=128, num_experts=8,
                 num_experts_per_tok=2, moe_intermediate_size=32,
                 shared_expert_intermediate_size=64, norm_topk_prob=True, rms_norm_eps=1e-6,
                 full_attention_interval=2, linear_conv_kernel_dim=4, linear_key_head_dim=16,
                 linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                 rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                      partial_rotary_factor=0.25))

FIXTURES = [
    Fixture("qwen3moe", "Qwen3MoeForCausalLM", "Qwen3MoeConfig",
            dict(SMALL, intermediate_size=128, num_experts=8, num_experts_per_tok=2,
                 moe_intermediate_size=32, norm_topk_prob=True, rms_norm_eps=1e-6),
            "bpe-qwen2", seed=1),
    Fixture("qwen2moe", "Qwen2MoeForCausalLM", "Qwen2MoeConfig",
            dict(SMALL, intermediate_size=128, num_experts=8, num_experts_per_tok=2,
                 moe_intermediate_size=32, shared_expert_intermediate_size=64,
                 norm_topk_prob=False, rms_norm_eps=1e-6),
            "bpe-qwen2", seed=2),
    # llama.cpp's converter hard-codes rms eps 1e-5 for OLMoE; match it. llama.cpp sizes
    # OLMoE's k_norm as n_embd (real OLMoE is MHA), so no GQA here.
    Fixture("olmoe", "OlmoeForCausalLM", "OlmoeConfig",
            dict(SMALL, num_key_value_heads=4, intermediate_size=32, num_experts=8,
                 num_experts_per_tok=2, norm_topk_prob=False, rms_norm_eps=1e-5),
            "bpe-gpt2", seed=3),
    Fixture("llama", "LlamaForCausalLM", "LlamaConfig",
            dict(SMALL, intermediate_size=128, rms_norm_eps=1e-5),
            "spm", seed=4),
    Fixture("mixtral", "MixtralForCausalLM", "MixtralConfig",
            dict(SMALL, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2,
                 rms_norm_eps=1e-5),
            "bpe-llama3", seed=5),
    # Qwen2 has q/k/v biases; the vocab is padded past the tokenizer like real Qwen files.
    Fixture("qwen2", "Qwen2ForCausalLM", "Qwen2Config",
            dict(SMALL, intermediate_size=128, rms_norm_eps=1e-6),
            "bpe-default", seed=6, vocab_pad=32),
    # Llama 3.1 rope scaling: the converter writes rope_freqs.weight. original_max_position
    # is small so that the reference text's positions see every regime (factor 1, smoothed,
    # factor 8) of the per-frequency factors.
    Fixture("llama3rope", "LlamaForCausalLM", "LlamaConfig",
            dict(SMALL, intermediate_size=128, rms_norm_eps=1e-5,
                 rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0,
                                      low_freq_factor=1.0, high_freq_factor=4.0,
                                      original_max_position_embeddings=64)),
            "bpe-llama3", seed=9),
    # Gemma 3: six layers so that llama.cpp's default pattern (every sixth layer global)
    # gives five sliding-window layers (window 4) and one global; the global layers' linear
    # rope scaling and the local rope base differ, as in Gemma 3 4B+; final logit softcapping
    # (not in Gemma 3's own configs, but read by both implementations); q.k scaled by
    # 1/sqrt(head_dim) (GGUF has no query_pre_attn_scalar).
    Fixture("gemma3", "Gemma3ForCausalLM", "Gemma3TextConfig",
            dict(SMALL, num_hidden_layers=6, intermediate_size=128, rms_norm_eps=1e-6,
                 tie_word_embeddings=True, query_pre_attn_scalar=16, sliding_window=4,
                 hidden_activation="gelu_pytorch_tanh", final_logit_softcapping=4.0,
                 rope_parameters=dict(
                     full_attention=dict(rope_type="linear", factor=8.0, rope_theta=1000000.0),
                     sliding_attention=dict(rope_type="default", rope_theta=10000.0))),
            "spm-gemma", seed=10, norm_center=0.0),
    # Tied embeddings (no output.weight), as in the small Qwen3 models.
    Fixture("qwen3", "Qwen3ForCausalLM", "Qwen3Config",
            dict(SMALL, intermediate_size=128, rms_norm_eps=1e-6, tie_word_embeddings=True),
            "bpe-qwen2", seed=7),
    # gpt-oss: layers alternate sliding-window (window 4) and full attention; attention sinks
    # (scaled up so they matter), biases everywhere, YaRN rope whose original context (64)
    # and base put the ramp across the head's frequencies (truncate, as llama.cpp always
    # does), router top-k then softmax, clamped SwiGLU (limit 7: the expert gate/up weights
    # are scaled so the reference text crosses it). Expert widths are multiples of 32 (MXFP4).
    Fixture("gptoss", "GptOssForCausalLM", "GptOssConfig",
            dict(SMALL, num_hidden_layers=4, intermediate_size=64, num_local_experts=4,
                 num_experts_per_tok=2, sliding_window=4, rms_norm_eps=1e-5,
                 rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                      beta_fast=32.0, beta_slow=1.0, truncate=True,
                                      original_max_position_embeddings=64)),
            "bpe-o200k", seed=11, gains=(("sinks", 10.0), ("experts.gate_up_proj", 3.0))),
    # gpt-oss quantized as the hub files are (llama-quantize MXFP4_MOE: MXFP4 experts, Q8_0
    # elsewhere), from a model without the scaled expert weights: those make the model so
    # sensitive that llama.cpp's Q8_0 rounding of activations moves a quarter of the
    # positions below cosine 0.999 against any f32-activation engine.
    Fixture("gptossmx", "GptOssForCausalLM", "GptOssConfig",
            dict(SMALL, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2,
                 sliding_window=4, rms_norm_eps=1e-5,
                 rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                      beta_fast=32.0, beta_slow=1.0, truncate=True,
                                      original_max_position_embeddings=64)),
            "bpe-o200k", seed=12, quant_types=("MXFP4_MOE",), gains=(("sinks", 10.0),)),
    # Every matmul row length (256 hidden, 4x64 heads, 256 expert ff) is a multiple of 256,
    # the block size of the K-quants and TQ types.
    Fixture("q3moe256", "Qwen3MoeForCausalLM", "Qwen3MoeConfig",
            dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=64, max_position_embeddings=512,
                 initializer_range=0.05, tie_word_embeddings=False, intermediate_size=512,
                 num_experts=4, num_experts_per_tok=2, moe_intermediate_size=256,
                 norm_topk_prob=True, rms_norm_eps=1e-6),
            "bpe-qwen2", seed=8, quant_types=QUANT_TYPES),
    # GLM-4.5: layer 0 dense, sigmoid router scores with a random expert-score correction bias
    # (selection only), two expert groups of which one is used, renormalised top-k times a
    # routed scaling factor, an ungated shared expert, partial NeoX rotary (8 of 16 dims),
    # q/k/v biases, per-head q/k norms; plus one NextN (MTP) layer, which llama.cpp loads
    # and does not run. Rows of 32: Q8_0 and Q4_0 quantize every matrix. Weights N(0, 0.05):
    # at 0.1, llama.cpp's Q8_0 activation rounding moved a quarter of the positions of the
    # quantized files below cosine 0.999 (with that rounding modelled they agreed).
    Fixture("glm4moe", "Glm4MoeForCausalLM", "Glm4MoeConfig",
            dict(SMALL, num_hidden_layers=3, intermediate_size=128, moe_intermediate_size=32,
                 n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
                 first_k_dense_replace=1, norm_topk_prob=True, routed_scaling_factor=2.5,
                 n_group=2, topk_group=1, attention_bias=True, use_qk_norm=True,
                 rms_norm_eps=1e-5, initializer_range=0.05,
                 rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                      partial_rotary_factor=0.5)),
            "bpe-glm4", seed=11, quant_types=("Q8_0", "Q4_0"), nextn_layers=1),
    # GLM-4.5-Air's shape of attention (no q/k norms) with every matmul row a multiple of 256,
    # for a K-quant; only the quantized file is kept (the f32 one is 7 MiB).
    Fixture("glm256", "Glm4MoeForCausalLM", "Glm4MoeConfig",
            dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=64, max_position_embeddings=512,
                 initializer_range=0.05, tie_word_embeddings=False, intermediate_size=256,
                 moe_intermediate_size=256, n_routed_experts=4, num_experts_per_tok=2,
                 n_shared_experts=1, first_k_dense_replace=1, norm_topk_prob=True,
                 routed_scaling_factor=2.5, n_group=1, topk_group=1, attention_bias=True,
                 use_qk_norm=False, rms_norm_eps=1e-5,
                 rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                      partial_rotary_factor=0.5)),
            "bpe-glm4", seed=12, quant_types=("Q4_K_M",), ship_f32=False),
    # Hybrid Gated-DeltaNet MoE: linear-attention layers with a full (gated) attention layer
    # every second one (layers 1 and 3), 2 key heads serving 4 value heads in the DeltaNet,
    # partial rotary (1/4 of head_dim, as the real models), a sigmoid-gated shared expert.
    # No MTP tensors in a random model: --no-mtp. A Q8_0 file, checked against llama.cpp.
    # The (1 + w) norms get w = N(0, 0.2) (norm_center 0): with w near 1 every norm doubles
    # its input and the random model turns chaotic (Q8 activation rounding alone moved
    # position 0 to cosine 0.997).
    Fixture("qwen3next", "Qwen3NextForCausalLM", "Qwen3NextConfig",
            QWEN3NEXT,
            "bpe-qwen2", seed=11, quant_types=("Q8_0",), convert_args=("--no-mtp",), norm_center=0.0),
    # qwen3next's shape and layer kinds, calmed so that its Q8_0 file meets llama.cpp's bar
    # (qwen3next-Q8_0, at N(0, 0.1), is chaotic under llama.cpp's Q8 activation rounding:
    # 16/48 positions): weights N(0, 0.03), the routers x4 to keep the expert choice clear
    # (router margin 0.038). Measured: 0.05 alone 39/48, 0.05 with routers x4 44/48, x8
    # 37/48; 0.03 with x4 48/48. Only the Q8_0 file is kept (the f32 one is 1.5 MiB).
    Fixture("qwen3nextq", "Qwen3NextForCausalLM", "Qwen3NextConfig",
            dict(QWEN3NEXT, initializer_range=0.03),
            "bpe-qwen2", seed=13, quant_types=("Q8_0",), convert_args=("--no-mtp",), norm_center=0.0,
            gains=(("mlp.gate.weight", 4.0),), ship_f32=False),
    # Qwen 3.5 MoE: the same layer kinds with separate beta / alpha projections and value
    # heads stored tiled by the converter; interleaved MRoPE, which for text (one position
    # per token) is NeoX rope over rope_dim = 8 (mrope sections 2+1+1 pairs).
    Fixture("qwen35moe", "Qwen3_5MoeForCausalLM", "Qwen3_5MoeTextConfig",
            dict(SMALL, num_hidden_layers=4, num_experts=8, num_experts_per_tok=2,
                 moe_intermediate_size=32, shared_expert_intermediate_size=64,
                 rms_norm_eps=1e-6, layer_types=["linear_attention", "full_attention",
                                                 "linear_attention", "full_attention"],
                 linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
                 linear_num_key_heads=2, linear_num_value_heads=4,
                 rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                      partial_rotary_factor=0.5, mrope_section=[2, 1, 1],
                                      mrope_interleaved=True)),
            "bpe-qwen2", seed=12, convert_args=("--no-mtp",), norm_center=0.0),
]


# ---------------------------------------------------------------------------------------
# llama.cpp tooling
# ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class LlamaCpp:
    sdist: Path          # llama-cpp-python source tree (holds the `llama_cpp` package)
    src: Path            # vendored llama.cpp
    lib_dir: Path        # directory with libllama.so
    quantize: Path       # llama-quantize binary


def find_llama_cpp(root: Path) -> LlamaCpp:
    """Locate the pieces tools/build_llama_cpp.sh made under `root` (its OUT_DIR, or the
    extracted sdist itself)."""
    candidates = [root] + sorted(root.glob("llama_cpp_python-*"))
    sdist = next((c for c in candidates if (c / "llama_cpp" / "llama_cpp.py").is_file()
                  and (c / "vendor" / "llama.cpp").is_dir()), None)
    if sdist is None:
        sys.exit(f"error: no llama-cpp-python source tree under {root}; "
                 f"run tools/build_llama_cpp.sh {root} first")
    src = sdist / "vendor" / "llama.cpp"
    libs = sorted((src / "build").rglob("libllama.so"))
    quant = [p for p in sorted((src / "build").rglob("llama-quantize")) if p.is_file()]
    if not libs or not quant:
        sys.exit(f"error: libllama.so or llama-quantize missing under {src / 'build'}; "
                 f"run tools/build_llama_cpp.sh {root}")
    return LlamaCpp(sdist=sdist, src=src, lib_dir=libs[0].parent, quantize=quant[0])


def import_llama_cpp(lc: LlamaCpp):
    """Import the pure-ctypes binding from the sdist against our own libllama.so."""
    os.environ["LLAMA_CPP_LIB_PATH"] = str(lc.lib_dir)
    sys.path.insert(0, str(lc.sdist))
    llama_cpp = importlib.import_module("llama_cpp")
    # Turn off the CPU backend's "extra buffer types" (weight repacking, AMX tiles). They
    # make the oracle depend on the CPU it ran on (AMX even segfaults where the kernel
    # does not grant AMX state), and the plain dot-product kernels are the reference we
    # want. `Llama` exposes no switch for it, so patch the defaults it starts from.
    low = llama_cpp.llama_cpp
    default_params = low.llama_model_default_params

    def model_params_without_extra_bufts():
        params = default_params()
        params.use_extra_bufts = False
        return params
    low.llama_model_default_params = model_params_without_extra_bufts
    return llama_cpp


# Run llama.cpp's converter in a child process so that its vendored gguf-py (which it
# needs) never mixes with the installed `gguf` this script uses for reading. Our tiny
# tokenizers are not in its table of known tokenizer hashes, so we patch the lookup to
# return the pre-tokenizer name we chose for the fixture.
_CONVERT_BOOTSTRAP = textwrap.dedent("""
    import os, runpy, sys
    src = os.environ["ONEBIT_LLAMA_CPP_SRC"]
    sys.path[:0] = [os.path.join(src, "gguf-py"), src]
    from conversion.base import TextModel
    pre = os.environ["ONEBIT_TOKENIZER_PRE"]
    TextModel.get_vocab_base_pre = lambda self, tokenizer: pre
    sys.argv = [os.path.join(src, "convert_hf_to_gguf.py")] + sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
""")


def convert_to_gguf(lc: LlamaCpp, hf_dir: Path, out: Path, pre: str, model_name: str,
                    extra: tuple[str, ...] = ()) -> None:
    env = dict(os.environ, ONEBIT_LLAMA_CPP_SRC=str(lc.src), ONEBIT_TOKENIZER_PRE=pre)
    env.pop("NO_LOCAL_GGUF", None)
    cmd = [sys.executable, "-c", _CONVERT_BOOTSTRAP, str(hf_dir), "--outfile", str(out),
           "--outtype", "f32", "--model-name", model_name, *extra]
    run_quiet(cmd, env=env, what=f"convert {hf_dir.name}")


def quantize_gguf(lc: LlamaCpp, src: Path, dst: Path, qtype: str) -> list[str]:
    """llama-quantize src -> dst. Returns the extra flags used (paths relative to dst's dir)."""
    flags = QUANTIZE_FLAGS.get(qtype, [])
    args = list(flags)
    if qtype in NEEDS_IMATRIX:
        imatrix = src.with_name(src.name.replace("-f32.gguf", ".imatrix.gguf"))
        if not imatrix.exists():
            # onebit's own dependencies are needed; $ONEBIT_PYTHON may name a venv that has them
            python = os.environ.get("ONEBIT_PYTHON", sys.executable)
            run_quiet([python, str(REPO_ROOT / "tools" / "make_imatrix.py"), str(src), str(imatrix)],
                      env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)), what=f"imatrix for {src.name}")
        args += ["--imatrix", str(imatrix)]
        flags = [*flags, "--imatrix", imatrix.name]
    run_quiet([str(lc.quantize), *args, str(src), str(dst), qtype, "2"],
              what=f"quantize {qtype}")
    return flags


# llama-quantize refuses these without an importance matrix; tools/make_imatrix.py makes one
# (<fixture>.imatrix.gguf, kept with the fixtures) by running onebit's numpy engine over the
# reference text, as llama.cpp's llama-imatrix would.
NEEDS_IMATRIX = {"IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS"}


# Extra llama-quantize flags per type. None are needed with llama.cpp as vendored in
# llama-cpp-python 0.3.36: every default mix keeps all big matrices in the named type
# except output.weight (Q6_K for the 4-bit-and-below types), token_embd (Q4_K for TQ*),
# and, for *_K_M, attn_v / ffn_down_exps of the last layer (Q6_K); MXFP4_MOE is MXFP4
# experts + Q8_0 elsewhere. Those mixes are what real files hold, so we keep them; add
# "--pure" here to get a single-type file.
QUANTIZE_FLAGS: dict[str, list[str]] = {}


def run_quiet(cmd: list[str], env: dict | None = None, what: str = "") -> None:
    """Run a tool; show its output only if it fails."""
    res = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if res.returncode != 0:
        sys.stderr.write(res.stdout[-6000:] + res.stderr[-6000:])
        sys.exit(f"error: {what} failed (exit {res.returncode}): {' '.join(cmd[:3])} ...")


# ---------------------------------------------------------------------------------------
# Tokenizers
# ---------------------------------------------------------------------------------------

def build_corpus() -> list[str]:
    """Offline training text: docstrings of standard-library modules plus a few
    multilingual lines. Deterministic for a given Python version."""
    chunks: list[str] = []
    seen: set[str] = set()

    def add(doc: str | None) -> None:
        if doc and doc not in seen:
            seen.add(doc)
            chunks.append(inspect.cleandoc(doc))

    for modname in CORPUS_MODULES:
        try:
            mod = importlib.import_module(modname)
        except ImportError:
            continue
        add(mod.__doc__)
        for name, obj in sorted(vars(mod).items()):
            if name.startswith("_") or getattr(obj, "__module__", modname) != modname:
                continue
            add(getattr(obj, "__doc__", None))
            if inspect.isclass(obj):
                for mname, meth in sorted(vars(obj).items()):
                    if not mname.startswith("_"):
                        add(getattr(meth, "__doc__", None))
    lines: list[str] = []
    total = 0
    for chunk in chunks:
        for line in chunk.splitlines():
            lines.append(line)
            total += len(line) + 1
        if total > CORPUS_MAX_CHARS:
            break
    # Repeat the multilingual lines so their byte pairs are frequent enough to merge.
    lines += MULTILINGUAL_LINES * 40
    return lines


def train_bpe(spec: TokenizerSpec, corpus: list[str], out_dir: Path) -> None:
    """Byte-level BPE with the pre-tokenizer llama.cpp uses for `spec.pre`; special tokens
    are appended after the learned vocab (as in Qwen), so their ids are the highest."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(ignore_merges=spec.ignore_merges))
    splits = [pre_tokenizers.Split(Regex(rx), behavior="isolated")
              for rx in PRE_REGEXES[spec.pre]]
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        splits + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size - len(spec.specials),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),   # all 256 byte symbols
        min_frequency=2, show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    tok.add_special_tokens(list(spec.specials))
    assert tok.get_vocab_size() == spec.vocab_size, tok.get_vocab_size()
    if spec.add_bos:
        bos_id = tok.token_to_id(spec.bos)
        tok.post_processor = processors.TemplateProcessing(
            single=f"{spec.bos} $A", pair=f"{spec.bos} $A {spec.bos} $B",
            special_tokens=[(spec.bos, bos_id)])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)

    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=spec.bos,
                                   eos_token=spec.eos, pad_token=spec.pad)
    fast.save_pretrained(out_dir)
    patch_tokenizer_config(out_dir, spec, tokenizer_class="PreTrainedTokenizerFast")


def train_spm(spec: TokenizerSpec, corpus: list[str], out_dir: Path) -> None:
    """SentencePiece BPE configured like Llama 1/2: identity normalization, a dummy prefix
    space, whitespace kept as is, digits split, byte fallback for anything unseen."""
    import sentencepiece as spm

    out_dir.mkdir(parents=True, exist_ok=True)
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter([line for line in corpus if line.strip()]),
        model_prefix=str(out_dir / "tokenizer"), vocab_size=spec.vocab_size,
        model_type="bpe", character_coverage=0.9995, byte_fallback=True,
        normalization_rule_name="identity", add_dummy_prefix=spec.dummy_prefix,
        remove_extra_whitespaces=False, split_digits=True,
        allow_whitespace_only_pieces=True,
        unk_id=spec.spm_ids[0], bos_id=spec.spm_ids[1], eos_id=spec.spm_ids[2],
        pad_id=spec.spm_ids[3], bos_piece=spec.bos, eos_piece=spec.eos,
        **({"pad_piece": spec.pad} if spec.pad else {}),
        control_symbols=list(spec.specials),
        shuffle_input_sentence=False, num_threads=1, minloglevel=2)
    (out_dir / "tokenizer.vocab").unlink()
    patch_tokenizer_config(out_dir, spec, tokenizer_class="LlamaTokenizer",
                           extra=dict(bos_token=spec.bos, eos_token=spec.eos,
                                      unk_token="<unk>", legacy=True,
                                      **({"pad_token": spec.pad} if spec.pad else {})))


def patch_tokenizer_config(out_dir: Path, spec: TokenizerSpec, tokenizer_class: str,
                           extra: dict | None = None) -> None:
    """Write the fields llama.cpp's converter reads: add_bos/add_eos, the chat template."""
    path = out_dir / "tokenizer_config.json"
    cfg = json.loads(path.read_text()) if path.exists() else {}
    cfg.update(extra or {})
    cfg.update(tokenizer_class=tokenizer_class, add_bos_token=spec.add_bos,
               add_eos_token=False, chat_template=spec.chat_template, model_max_length=512)
    path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
    (out_dir / "chat_template.jinja").unlink(missing_ok=True)   # one source of truth


def token_ids(spec: TokenizerSpec, tok_dir: Path) -> dict[str, int | None]:
    """bos/eos/pad ids for config.json (llama.cpp's converter falls back to these)."""
    if spec.kind == "spm":
        pad = spec.spm_ids[3]
        return dict(bos_token_id=spec.spm_ids[1], eos_token_id=spec.spm_ids[2],
                    pad_token_id=pad if pad >= 0 else None)
    vocab = json.loads((tok_dir / "tokenizer.json").read_text())
    ids = {t["content"]: t["id"] for t in vocab["added_tokens"]}
    return dict(bos_token_id=ids.get(spec.bos), eos_token_id=ids.get(spec.eos),
                pad_token_id=ids.get(spec.pad))


# ---------------------------------------------------------------------------------------
# HF models
# ---------------------------------------------------------------------------------------

def make_hf_model(fx: Fixture, tok_spec: TokenizerSpec, tok_dir: Path, out_dir: Path) -> dict:
    """Random-init the tiny model in float32 and save it next to a copy of its tokenizer.
    Returns facts for the manifest (the seed used, the HF config)."""
    import transformers

    cfg_cls = getattr(transformers, fx.config_class)
    config = cfg_cls(vocab_size=tok_spec.vocab_size + fx.vocab_pad,
                     **token_ids(tok_spec, tok_dir), **fx.config)
    # MoE: a near-tie between the k-th and (k+1)-th router logit lets any rounding
    # (f16, quantized activations) pick another expert, and the logits then jump. Try
    # seeds until the reference text routes with a clear margin everywhere.
    tries = MAX_SEED_TRIES if getattr(config, "num_experts_per_tok", None) else 1
    ref_tokens = hf_encode(tok_dir, REF_TEXT)[:N_TOKENS]
    best = None
    for attempt in range(tries):
        seed = fx.seed + 1000 * attempt
        model = init_hf_model(fx.hf_class, config, seed, fx.norm_center, fx.gains)
        margin = router_margin(model, ref_tokens)
        if best is None or margin > best[2]:
            best = (seed, model, margin)
        if margin >= MIN_ROUTER_MARGIN:
            break
    seed, model, margin = best
    if tries > 1 and margin < MIN_ROUTER_MARGIN:
        print(f"note: {fx.name}: no seed reached router margin {MIN_ROUTER_MARGIN}; "
              f"took the best of {tries} ({margin:.4f})")

    if out_dir.exists():
        shutil.rmtree(out_dir)
    shutil.copytree(tok_dir, out_dir)
    model.save_pretrained(out_dir, safe_serialization=True)
    if fx.nextn_layers:
        add_nextn_layers(out_dir, fx.nextn_layers, seed, fx.norm_center)
    # getattr, not to_dict(): configs alias some names (num_experts -> num_local_experts)
    return dict(seed=seed, config={k: getattr(config, k, None)
                                   for k in ["vocab_size", *fx.config.keys()]})


def add_nextn_layers(hf_dir: Path, n: int, seed: int, norm_center: float) -> None:
    """GLM-4.5's NextN (multi-token prediction) layers, which transformers' Glm4MoeForCausalLM
    neither builds nor reads: per layer, the tensors of the last (MoE) decoder layer as saved,
    with fresh random values, plus eh_proj, enorm, hnorm and shared_head.norm, under the names
    of the real checkpoints. They go into a second file, model-nextn.safetensors (llama.cpp's
    converter reads every model*.safetensors, transformers only model.safetensors), and
    config.json counts them (num_nextn_predict_layers), as the real config does."""
    import torch
    from safetensors.torch import load_file, save_file

    cfg_path = hf_dir / "config.json"
    cfg = json.loads(cfg_path.read_text())
    last, d = cfg["num_hidden_layers"] - 1, cfg["hidden_size"]
    std = cfg.get("initializer_range", 0.02)
    prefix = f"model.layers.{last}."
    saved = {k[len(prefix):]: v for k, v in load_file(hf_dir / "model.safetensors").items() if k.startswith(prefix)}
    torch.manual_seed(seed + 1)
    out = {}
    for j in range(n):
        p = f"model.layers.{cfg['num_hidden_layers'] + j}."
        for name, t in sorted(saved.items()):
            if name.endswith("bias"):
                out[p + name] = 0.1 * torch.randn_like(t)
            elif "norm" in name and t.ndim == 1:
                out[p + name] = norm_center + 0.2 * torch.randn_like(t)
            else:
                out[p + name] = std * torch.randn_like(t) * (ROUTER_GAIN if ROUTER_WEIGHT.search("." + name) else 1)
        out[p + "eh_proj.weight"] = std * torch.randn(d, 2 * d)
        for name in ("enorm", "hnorm", "shared_head.norm"):
            out[p + name + ".weight"] = norm_center + 0.2 * torch.randn(d)
    save_file(out, hf_dir / "model-nextn.safetensors", metadata={"format": "pt"})
    cfg["num_nextn_predict_layers"] = n
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")


def init_hf_model(hf_class: str, config, seed: int, norm_center: float = 1.0, gains=()):
    import torch
    import transformers

    torch.manual_seed(seed)
    model = getattr(transformers, hf_class)(config).to(torch.float32).eval()
    # HF initialises norm weights to 1 and biases to 0, which would hide an engine that
    # ignores them; give them random values so every parameter matters.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.1)
            elif PLAIN_NORM.search(name):  # used as w even where the other norms are 1 + w
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif "norm" in name and p.ndim == 1:
                p.copy_(norm_center + 0.2 * torch.randn_like(p))
            elif ROUTER_WEIGHT.search(name):
                p.mul_(ROUTER_GAIN)
            for suffix, gain in gains:
                if name.endswith(suffix):
                    p.mul_(gain)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # GLM / DeepSeek V3: zeros in HF's init
                b.normal_(0.0, EXPERT_BIAS_STD)
    return model


def hf_encode(tok_dir: Path, text: str) -> list[int]:
    """The fixture tokenizer's own encoding (special tokens added), before llama.cpp's."""
    if (tok_dir / "tokenizer.json").exists():
        from tokenizers import Tokenizer
        return Tokenizer.from_file(str(tok_dir / "tokenizer.json")).encode(text).ids
    import sentencepiece as spm
    sp = spm.SentencePieceProcessor(model_file=str(tok_dir / "tokenizer.model"))
    return [sp.bos_id()] + sp.encode(text)


def router_margin(model, tokens: list[int]) -> float:
    """Smallest router margin (see hf_reference) over layers and positions; inf if dense."""
    import torch

    top_k = getattr(model.config, "num_experts_per_tok", None)
    if not top_k:
        return float("inf")
    with torch.no_grad():
        out = model(torch.tensor([tokens]), output_router_logits=True)
        return float(routing_margins(model, out.router_logits).min())


def routing_margins(model, router_logits):
    """[MoE layers, T]: the gap behind each router choice, k-th minus (k+1)-th of what the
    router ranks: the logits, or for GLM sigmoid(logits) + the correction bias within the
    chosen groups (and the gap between the last chosen group and the next)."""
    import torch

    top_k = model.config.num_experts_per_tok
    logits = torch.stack(router_logits)  # [L, T, E]
    if getattr(model.config, "model_type", "") != "glm4_moe":
        ranked = logits.sort(-1, descending=True).values
        return ranked[..., top_k - 1] - ranked[..., top_k]
    routers = [m for m in model.modules() if type(m).__name__ == "Glm4MoeTopkRouter"]
    sel = logits.sigmoid() + torch.stack([r.e_score_correction_bias for r in routers])[:, None, :]
    E, G, used = sel.shape[-1], model.config.n_group, model.config.topk_group
    gscore = sel.unflatten(-1, (G, E // G)).topk(2, dim=-1).values.sum(-1)  # [L, T, G]
    granked = gscore.sort(-1, descending=True)
    margins = [granked.values[..., used - 1] - granked.values[..., used]] if used < G else []
    keep = torch.zeros_like(gscore, dtype=torch.bool).scatter_(-1, granked.indices[..., :used], True)
    ranked = sel.masked_fill(~keep.repeat_interleave(E // G, -1), float("-inf")).sort(-1, descending=True).values
    margins.append(ranked[..., top_k - 1] - ranked[..., top_k])
    return torch.stack(margins).min(0).values


def hf_reference(hf_dir: Path, tokens: np.ndarray) -> dict[str, np.ndarray]:
    """Teacher-forced float32 logits from transformers (eager attention), empty context.
    For MoE models also the router margin: router logit k minus logit k+1 (k = experts
    used) per layer and position; where it is tiny, any rounding may pick other experts."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        hf_dir, dtype=torch.float32, attn_implementation="eager").eval()
    return hf_reference_from_model(model, tokens)


def hf_reference_from_model(model, tokens: np.ndarray) -> dict[str, np.ndarray]:
    import torch

    top_k = getattr(model.config, "num_experts_per_tok", None)
    # GLM: what HF's own router module took and chose, per MoE layer (a test checks onebit's
    # routing rule against it on the same inputs)
    routers = [m for m in model.modules() if type(m).__name__ == "Glm4MoeTopkRouter"]
    seen: list[tuple] = []
    hooks = [r.register_forward_hook(lambda mod, args, out: seen.append((args[0], out))) for r in routers]
    with torch.no_grad():
        out = model(torch.tensor(tokens[None, :], dtype=torch.long),
                    **({"output_router_logits": True} if top_k else {}))
    for h in hooks:
        h.remove()
    ref = {"logits_hf": out.logits[0].float().numpy()}
    if routers:
        ref["router_in"] = np.stack([x.reshape(-1, x.shape[-1]).numpy() for x, _ in seen])  # [L, T, dim]
        ref["router_weights"] = np.stack([o[1].numpy() for _, o in seen]).astype(np.float32)  # [L, T, k]
        ref["router_ids"] = np.stack([o[2].numpy() for _, o in seen]).astype(np.int32)  # [L, T, k]
    if top_k:
        # router_logits: one [T, n_experts] per MoE layer
        ref["router_margin"] = routing_margins(model, out.router_logits).float().numpy()
    return ref


# Quantized files: transformers on the GGUF's weights dequantized by gguf-py. Same weights
# as llama.cpp, but float32 activations (llama.cpp quantizes activations to Q8 for its dot
# products), so an engine that dequantizes and computes in f32 should match this tightly.
# GGUF name -> HF name for the one architecture we quantize (qwen3moe; no q/k permute).
GGUF_TO_HF_QWEN3MOE = {
    "token_embd": "model.embed_tokens.weight", "output": "lm_head.weight",
    "output_norm": "model.norm.weight",
    "attn_norm": "input_layernorm.weight", "ffn_norm": "post_attention_layernorm.weight",
    "attn_q": "self_attn.q_proj.weight", "attn_k": "self_attn.k_proj.weight",
    "attn_v": "self_attn.v_proj.weight", "attn_output": "self_attn.o_proj.weight",
    "attn_q_norm": "self_attn.q_norm.weight", "attn_k_norm": "self_attn.k_norm.weight",
    "ffn_gate_inp": "mlp.gate.weight", "ffn_down_exps": "mlp.experts.down_proj",
    # transformers keeps gate and up fused: gate_up_proj [E, 2 * ff, hidden]
    "ffn_gate_exps": "mlp.experts.gate_up_proj", "ffn_up_exps": "mlp.experts.gate_up_proj",
}


def hf_dequant_reference(gguf_path: Path, hf_dir: Path, tokens: np.ndarray) -> dict | None:
    """HF logits (and router margins) with every weight taken from `gguf_path`, dequantized
    by gguf-py. None if gguf-py cannot dequantize one of its types."""
    import torch
    import transformers
    from gguf import GGUFReader
    from gguf.quants import dequantize

    if gguf_meta(gguf_path)["arch"] != "qwen3moe":  # the one name table above
        return None
    model = transformers.AutoModelForCausalLM.from_pretrained(
        hf_dir, dtype=torch.float32, attn_implementation="eager").eval()
    params = dict(model.named_parameters())
    assigned: set[str] = set()
    with torch.no_grad():
        for t in GGUFReader(gguf_path).tensors:
            try:
                w = torch.from_numpy(np.array(dequantize(t.data, t.tensor_type),
                                              dtype=np.float32, order="C"))
            except NotImplementedError:
                return None
            base, _, _ = t.name.rpartition(".")       # drop ".weight"
            layer, _, part = base.partition(".")[2].partition(".") if base.startswith("blk.") \
                else ("", "", base)
            hf_name = GGUF_TO_HF_QWEN3MOE[part]
            hf_name = f"model.layers.{layer}.{hf_name}" if layer else hf_name
            target = params[hf_name]
            if part in ("ffn_gate_exps", "ffn_up_exps"):     # w: [E, ff, hidden]
                ff = w.shape[1]
                target = target[:, :ff] if part == "ffn_gate_exps" else target[:, ff:]
            assert target.shape == w.shape, (t.name, tuple(target.shape), tuple(w.shape))
            target.copy_(w)
            assigned.add(hf_name)
    assert assigned == set(params), set(params) - assigned
    ref = hf_reference_from_model(model, tokens)
    return {"logits_hf_dequant": ref["logits_hf"],
            **({"router_margin": ref["router_margin"]} if "router_margin" in ref else {})}


# ---------------------------------------------------------------------------------------
# llama.cpp oracles
# ---------------------------------------------------------------------------------------

GGML_TYPE_F32 = 0


def open_llama(llama_cpp, path: Path):
    # f32 KV cache and no flash attention: the oracle should carry as little rounding of
    # its own as the CPU backend allows.
    return llama_cpp.Llama(model_path=str(path), n_ctx=256, n_batch=256, n_ubatch=256,
                           n_threads=2, n_gpu_layers=0, logits_all=True, flash_attn=False,
                           type_k=GGML_TYPE_F32, type_v=GGML_TYPE_F32, verbose=False)


def llama_tokenize(llm, text: str, special: bool) -> list[int]:
    # add_bos here is llama.cpp's add_special; special is parse_special.
    return list(llm.tokenize(text.encode("utf-8"), add_bos=special, special=special))


def llama_logits(llm, tokens: np.ndarray) -> np.ndarray:
    llm.reset()
    llm.eval([int(t) for t in tokens])
    return np.array(llm.scores[: len(tokens)], dtype=np.float32, copy=True)


def compare(a: np.ndarray, b: np.ndarray) -> dict:
    cos = (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))
    return dict(max_abs=float(np.abs(a - b).max()), min_cos=float(cos.min()),
                argmax_agree=float((a.argmax(-1) == b.argmax(-1)).mean()),
                worst_pos=int(np.abs(a - b).max(-1).argmax()))


def tensor_types(path: Path) -> dict[str, str]:
    from gguf import GGUFReader
    return {t.name: t.tensor_type.name for t in GGUFReader(path).tensors}


def gguf_meta(path: Path) -> dict:
    from gguf import GGUFReader
    fields = GGUFReader(path).fields

    def get(key):
        return fields[key].contents() if key in fields else None
    return dict(arch=get("general.architecture"), tokenizer_model=get("tokenizer.ggml.model"),
                tokenizer_pre=get("tokenizer.ggml.pre"),
                has_chat_template="tokenizer.chat_template" in fields)


# ---------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=REPO_ROOT / "tests" / "fixtures")
    ap.add_argument("--llama-cpp", type=Path, default=REPO_ROOT / ".llama-cpp",
                    help="tools/build_llama_cpp.sh output dir (or the extracted sdist)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/onebit-fixtures-work"),
                    help="scratch dir for HF model dirs and tokenizers (outside the repo)")
    ap.add_argument("--only", default="",
                    help="comma-separated fixture names: make just these (a trial run; write "
                         "them to a scratch --out, the manifest then lists only them)")
    ap.add_argument("--only-quants", default="",
                    help="comma-separated quant types: (re)make just these q3moe256 files from the "
                         "q3moe256-f32.gguf already in --out, keeping every other file and merging "
                         "the manifest and README")
    ap.add_argument("--merge-into", type=Path, default=None,
                    help="after the run, copy its files into this fixtures dir and add their manifest "
                         "entries and tokenizer cases to its own (the other files there stay as they are)")
    args = ap.parse_args()
    fixtures = [fx for fx in FIXTURES if not args.only or fx.name in args.only.split(",")]
    # torch and ggml each bring an OpenMP runtime; with the default active wait policy
    # their idle threads spin and starve each other (minutes instead of seconds on 2 cores).
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

    lc = find_llama_cpp(args.llama_cpp.resolve())
    out: Path = args.out.resolve()
    work: Path = args.work.resolve()
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    print(f"llama.cpp: {lc.src}\nlibllama: {lc.lib_dir}\nout: {out}\nwork: {work}")
    if args.only_quants:
        return remake_quants(lc, out, [t for t in args.only_quants.split(",") if t])

    # 1. Tokenizers, trained offline on stdlib docstrings.
    corpus = build_corpus()
    print(f"corpus: {len(corpus)} lines, {sum(len(x) + 1 for x in corpus)} chars")
    tok_dirs: dict[str, Path] = {}
    for key in sorted({fx.tokenizer for fx in fixtures}):
        spec = TOKENIZERS[key]
        if spec.chat_template_file:   # the template as llama.cpp ships it
            spec = replace(spec, chat_template=(lc.src / spec.chat_template_file).read_text())
        tok_dirs[key] = work / "tokenizers" / key
        shutil.rmtree(tok_dirs[key], ignore_errors=True)
        (train_spm if spec.kind == "spm" else train_bpe)(spec, corpus, tok_dirs[key])
        print(f"tokenizer {key}: {spec.kind} vocab {spec.vocab_size} pre {spec.pre}")

    # 2. HF models -> f32 GGUF -> quantized GGUFs.
    files: dict[str, dict] = {}     # gguf file name -> info for the manifest
    for fx in fixtures:
        spec = TOKENIZERS[fx.tokenizer]
        hf_dir = work / "hf" / fx.name
        made = make_hf_model(fx, spec, tok_dirs[fx.tokenizer], hf_dir)
        f32 = out / f"{fx.name}-f32.gguf"
        convert_to_gguf(lc, hf_dir, f32, spec.pre, model_name=f"onebit-fixture-{fx.name}",
                        extra=fx.convert_args)
        files[f32.name] = dict(fixture=fx.name, hf_dir=hf_dir, hf_class=fx.hf_class,
                               tokenizer=fx.tokenizer, quant="F32", quantize_flags=[],
                               seed=made["seed"], ship=fx.ship_f32,
                               config=made["config"])
        print(f"converted {f32.name} (seed {made['seed']})")
        for qtype in fx.quant_types:
            dst = out / f"{fx.name}-{qtype}.gguf"
            flags = quantize_gguf(lc, f32, dst, qtype)
            files[dst.name] = dict(files[f32.name], quant=qtype, quantize_flags=flags,
                                   hf_dir=None)
            print(f"quantized {dst.name} {' '.join(flags)}")

    # 3. Oracles, and what the files turned out to hold.
    llama_cpp = import_llama_cpp(lc)
    f32_logits: dict[str, np.ndarray] = {}     # fixture -> llama.cpp logits of its f32 file
    tok_cases: dict[str, dict] = {}
    tok_alias: dict[str, str] = {}
    for fname, info in files.items():
        path = out / fname
        llm = open_llama(llama_cpp, path)
        if info["hf_dir"] is not None:
            if TOKENIZERS[info["tokenizer"]].chat_template_file:   # transformers' renderings of it
                (out / fname.replace(".gguf", ".chat.json")).write_text(json.dumps(
                    dict(cases=chat_template_cases(info["hf_dir"])), ensure_ascii=False, indent=1) + "\n")
            ref = f32_oracles(llm, path, info)
            f32_logits[info["fixture"]] = ref["logits_llama"]
            # tokenizer cases, once per distinct tokenizer (from a file that is kept)
            first = next((f for f, i in files.items() if i["tokenizer"] == info["tokenizer"]
                          and i["hf_dir"] is not None and i["ship"]), None)
            if not info["ship"]:
                pass
            elif first == fname:
                tok_cases[fname] = tokenizer_cases(llm)
                info["hf_tokenizer_mismatches"] = hf_tokenizer_mismatches(
                    info["hf_dir"], TOKENIZERS[info["tokenizer"]], tok_cases[fname])
            else:
                tok_alias[fname] = first
        else:
            f32_info = files[f"{info['fixture']}-f32.gguf"]
            ref = quantized_oracles(llm, path, info, f32_info["hf_dir"],
                                    f32_logits[info["fixture"]])
        llm.close()
        np.savez(out / fname.replace(".gguf", ".ref.npz"), **ref)
        info.update(has_logits_hf="logits_hf" in ref, types=tensor_types(path),
                    meta=gguf_meta(path), bytes=path.stat().st_size)
        report_line(fname, info)

    for fname in [f for f, i in files.items() if i["hf_dir"] is not None and not i["ship"]]:
        (out / fname).unlink()  # it fed llama-quantize and the quantized files' vs-f32 figures
        (out / fname.replace(".gguf", ".ref.npz")).unlink()
        del files[fname]
    (out / "tokenizer_cases.json").write_text(json.dumps(
        dict(strings=TOKENIZER_STRINGS, cases=tok_cases, same_tokenizer_as=tok_alias),
        ensure_ascii=False, indent=1) + "\n")
    write_manifest(out, files)
    write_readme(out, files)
    total = sum(p.stat().st_size for p in out.iterdir() if p.is_file())
    print(f"total size of {out}: {total / 2**20:.2f} MiB")
    if args.merge_into is not None:
        merge_into(out, args.merge_into.resolve())


def merge_into(src: Path, dst: Path) -> None:
    """--merge-into: this run's files (src) join the fixtures in dst; dst's manifest and
    tokenizer cases gain their entries, its README is rewritten from the merged manifest."""
    new = json.loads((src / "manifest.json").read_text())
    manifest = json.loads((dst / "manifest.json").read_text())
    for fname, entry in new["files"].items():
        chat = fname.replace(".gguf", ".chat.json")  # transformers' renderings of its template
        for name in (fname, entry["ref"], *([chat] if (src / chat).exists() else [])):
            shutil.copyfile(src / name, dst / name)
        manifest["files"][fname] = entry
    (dst / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    cases = json.loads((dst / "tokenizer_cases.json").read_text())
    added = json.loads((src / "tokenizer_cases.json").read_text())
    assert cases["strings"] == added["strings"], "tokenizer strings differ: regenerate everything"
    cases["cases"].update(added["cases"])
    cases["same_tokenizer_as"].update(added["same_tokenizer_as"])
    (dst / "tokenizer_cases.json").write_text(json.dumps(cases, ensure_ascii=False, indent=1) + "\n")
    write_readme(dst, {name: info_from_manifest(e) for name, e in manifest["files"].items()})
    print(f"merged {', '.join(new['files'])} into {dst}")


def info_from_manifest(entry: dict) -> dict:
    """A manifest entry back into the per-file info write_manifest / write_readme take."""
    info = dict(entry, types=entry["tensors"], hf_dir=None,
                meta=dict(arch=entry["arch"], tokenizer_model=entry["tokenizer"]["model"],
                          tokenizer_pre=entry["tokenizer"]["pre"]))
    info["tokenizer"] = entry["tokenizer"]["source"]
    return info


def remake_quants(lc: LlamaCpp, out: Path, qtypes: list[str]) -> None:
    """--only-quants: quantize q3moe256-f32.gguf into `qtypes` and record their llama.cpp oracles;
    every other file and its entry stay as they are. These files carry `logits_llama` only
    (the HF model is not kept between runs; a full run adds `logits_hf_dequant`)."""
    manifest = json.loads((out / "manifest.json").read_text())
    files = {name: info_from_manifest(e) for name, e in manifest["files"].items()}
    f32 = out / "q3moe256-f32.gguf"
    f32_logits = np.load(out / "q3moe256-f32.ref.npz")["logits_llama"]
    llama_cpp = import_llama_cpp(lc)
    for qtype in qtypes:
        dst = out / f"q3moe256-{qtype}.gguf"
        flags = quantize_gguf(lc, f32, dst, qtype)
        info = dict(files[f32.name], quant=qtype, quantize_flags=flags, hf_dir=None)
        for k in ("hf_vs_llama", "min_router_margin", "hf_dequant_vs_llama", "has_logits_hf"):
            info.pop(k, None)
        llm = open_llama(llama_cpp, dst)
        ref = llama_oracle(llm, info)
        llm.close()
        info["vs_f32_llama"] = compare(ref["logits_llama"], f32_logits)
        np.savez(out / dst.name.replace(".gguf", ".ref.npz"), **ref)
        info.update(has_logits_hf=False, types=tensor_types(dst), meta=gguf_meta(dst), bytes=dst.stat().st_size)
        files[dst.name] = info
        report_line(dst.name, info)
    write_manifest(out, files)
    write_readme(out, files)
    total = sum(p.stat().st_size for p in out.iterdir() if p.is_file())
    print(f"total size of {out}: {total / 2**20:.2f} MiB")


def llama_oracle(llm, info: dict) -> dict[str, np.ndarray]:
    """llama.cpp's tokens for REF_TEXT and its logits for them."""
    tokens = np.array(llama_tokenize(llm, REF_TEXT, special=True), dtype=np.int32)
    assert len(tokens) >= N_TOKENS, len(tokens)
    tokens = tokens[:N_TOKENS]
    logits = llama_logits(llm, tokens)
    info.update(n_vocab=int(logits.shape[1]),
                logits_range=[float(logits.min()), float(logits.max())])
    return dict(tokens=tokens, logits_llama=logits)


def f32_oracles(llm, path: Path, info: dict) -> dict[str, np.ndarray]:
    """llama.cpp and HF on an f32 file; records how they agree in `info`."""
    ref = llama_oracle(llm, info)
    tokens = ref["tokens"]
    # The seed search (make_hf_model) judged routing on the fixture tokenizer's tokens;
    # they should be llama.cpp's too.
    if hf_encode(info["hf_dir"], REF_TEXT)[:N_TOKENS] != tokens.tolist():
        print(f"warning: {path.name}: llama.cpp and the fixture tokenizer split the "
              f"reference text differently")
    ref.update(hf_reference(info["hf_dir"], tokens))
    info["hf_vs_llama"] = compare(ref["logits_llama"], ref["logits_hf"])
    if "router_margin" in ref:
        info["min_router_margin"] = float(ref["router_margin"].min())
    if info["fixture"] == "q3moe256":
        # self-test of the dequantized-weights path (GGUF -> HF names) used for its quants
        same = hf_dequant_reference(path, info["hf_dir"], tokens)["logits_hf_dequant"]
        assert np.abs(same - ref["logits_hf"]).max() < 1e-5
    return ref


def quantized_oracles(llm, path: Path, info: dict, hf_dir: Path,
                      f32_logits: np.ndarray) -> dict[str, np.ndarray]:
    """llama.cpp on a quantized file, plus HF on its dequantized weights where gguf-py can
    dequantize them; records the comparisons in `info`."""
    ref = llama_oracle(llm, info)
    info["vs_f32_llama"] = compare(ref["logits_llama"], f32_logits)
    # (the GGUF -> HF name map is qwen3moe's: the q3moe256 files only)
    # the GGUF -> HF name table covers qwen3moe only: other quantized files get llama.cpp's oracle
    deq = hf_dequant_reference(path, hf_dir, ref["tokens"]) if info["fixture"] == "q3moe256" else None
    if deq is not None:
        ref.update(deq)
        info["hf_dequant_vs_llama"] = compare(ref["logits_llama"], ref["logits_hf_dequant"])
        if "router_margin" in ref:
            info["min_router_margin"] = float(ref["router_margin"].min())
    return ref


# Conversations rendered by transformers' apply_chat_template for files whose tokenizer carries
# a template of its own (gpt-oss's harmony): system / developer messages, earlier assistant turns
# with their reasoning (`thinking`), a closed last assistant turn, template variables.
CHAT_CASES = [
    dict(messages=[{"role": "user", "content": "Hello there"}]),
    dict(messages=[{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"}]),
    dict(messages=[{"role": "developer", "content": "Answer in French."}, {"role": "user", "content": "Bonjour"}]),
    dict(messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Capital of France?"},
                   {"role": "assistant", "content": "Paris.", "thinking": "Easy: Paris."},
                   {"role": "user", "content": "And of Italy?"},
                   {"role": "assistant", "content": "Rome.", "thinking": "Rome, obviously."},
                   {"role": "user", "content": "Thanks! <b>bye</b>\n  see you"}]),
    dict(messages=[{"role": "user", "content": "2+2?"},
                   {"role": "assistant", "content": "4", "thinking": "Two plus two is four."}],
         add_generation_prompt=False),
    dict(messages=[{"role": "user", "content": "Who are you?"}],
         kwargs=dict(reasoning_effort="high", model_identity="You are a test model.")),
]


def chat_template_cases(hf_dir: Path) -> list[dict]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(hf_dir)
    out = []
    for case in CHAT_CASES:
        gen = case.get("add_generation_prompt", True)
        kwargs = case.get("kwargs", {})
        text = tok.apply_chat_template(case["messages"], tokenize=False, add_generation_prompt=gen, **kwargs)
        out.append(dict(messages=case["messages"], add_generation_prompt=gen, kwargs=kwargs, text=text))
    return out


def tokenizer_cases(llm) -> dict[str, list[list[int]]]:
    return dict(special=[llama_tokenize(llm, s, special=True) for s in TOKENIZER_STRINGS],
                plain=[llama_tokenize(llm, s, special=False) for s in TOKENIZER_STRINGS])


def hf_tokenizer_mismatches(hf_dir: Path, spec: TokenizerSpec, llama_cases: dict) -> int:
    """How many strings the fixture's own tokenizer splits differently from llama.cpp
    (diagnostic only: the oracles are llama.cpp's tokens)."""
    if spec.kind == "spm":
        # Loading the HF Llama tokenizer from tokenizer.model needs protobuf; the
        # sentencepiece library itself is the reference here anyway.
        import sentencepiece as spm
        sp = spm.SentencePieceProcessor(model_file=str(hf_dir / "tokenizer.model"))
        encode, expected = sp.encode, llama_cases["plain"]     # no BOS, no control parsing
    else:
        # tokenizers itself, not AutoTokenizer: transformers rebuilds the pre-tokenizer
        # for some model types (e.g. qwen2 gets NFC and its own regex).
        from tokenizers import Tokenizer
        tok = Tokenizer.from_file(str(hf_dir / "tokenizer.json"))

        def encode(s):   # always matches added tokens; adds BOS where the file does
            return tok.encode(s).ids
        expected = llama_cases["special"]
    return sum(encode(s) != ids for s, ids in zip(TOKENIZER_STRINGS, expected))


def report_line(fname: str, info: dict) -> None:
    types = sorted(set(info["types"].values()))
    msg = f"{fname:28s} {info['bytes'] / 2**20:6.2f} MiB  types={','.join(types)}"
    msg += f"  logits[{info['logits_range'][0]:.2f},{info['logits_range'][1]:.2f}]"
    if "hf_vs_llama" in info:
        c = info["hf_vs_llama"]
        msg += (f"  hf-vs-llama max|d|={c['max_abs']:.2e} min_cos={c['min_cos']:.7f}"
                f" argmax_agree={c['argmax_agree']:.3f}")
    if "vs_f32_llama" in info:
        c = info["vs_f32_llama"]
        msg += f"  vs-f32 max|d|={c['max_abs']:.3f} min_cos={c['min_cos']:.5f}"
    if "hf_dequant_vs_llama" in info:
        c = info["hf_dequant_vs_llama"]
        msg += (f"  hf-dequant-vs-llama max|d|={c['max_abs']:.2e} min_cos={c['min_cos']:.6f}"
                f" argmax_agree={c['argmax_agree']:.3f}")
    if "min_router_margin" in info:
        msg += f"  min_router_margin={info['min_router_margin']:.4f}"
    if "hf_tokenizer_mismatches" in info:
        msg += f"  hf-tok-mismatch={info['hf_tokenizer_mismatches']}/{len(TOKENIZER_STRINGS)}"
    print(msg, flush=True)


def write_manifest(out: Path, files: dict[str, dict]) -> None:
    import sentencepiece
    import tokenizers
    import torch
    import transformers

    manifest = dict(
        generator="tools/make_fixtures.py",
        llama_cpp=f"llama-cpp-python {LLAMA_CPP_PYTHON_VERSION} (vendored llama.cpp), CPU",
        versions=dict(python=sys.version.split()[0], torch=torch.__version__,
                      transformers=transformers.__version__,
                      tokenizers=tokenizers.__version__,
                      sentencepiece=sentencepiece.__version__, numpy=np.__version__),
        ref_text=REF_TEXT, n_tokens=N_TOKENS,
        oracle_settings=dict(
            tokens="llama.cpp tokenize(add_special=True, parse_special=True), first n_tokens",
            logits_llama="llama.cpp CPU, f32 KV cache, no flash attention, extra buffer "
                         "types (repack/AMX) off, one batch",
            logits_hf="transformers float32, eager attention (f32 files only)",
            logits_hf_dequant="transformers float32 on the file's weights dequantized by "
                              "gguf-py (quantized files gguf-py can read)",
            router_margin="[n_layers, n_tokens] router logit k minus logit k+1 in the HF run"),
        files={})
    for fname, info in files.items():
        types = info["types"]
        manifest["files"][fname] = dict(
            arch=info["meta"]["arch"], fixture=info["fixture"], hf_class=info["hf_class"],
            quant=info["quant"], quantize_flags=info["quantize_flags"], seed=info["seed"],
            tokenizer=dict(model=info["meta"]["tokenizer_model"],
                           pre=info["meta"]["tokenizer_pre"], source=info["tokenizer"]),
            n_vocab=info["n_vocab"], bytes=info["bytes"],
            tensor_types=sorted(set(types.values())),
            tensors=types, ref=fname.replace(".gguf", ".ref.npz"),
            has_logits_hf=info["has_logits_hf"],
            logits_range=info["logits_range"],
            **({"hf_vs_llama": info["hf_vs_llama"]} if "hf_vs_llama" in info else {}),
            **({"min_router_margin": info["min_router_margin"]}
               if "min_router_margin" in info else {}),
            **({"vs_f32_llama": info["vs_f32_llama"]} if "vs_f32_llama" in info else {}),
            has_logits_hf_dequant="hf_dequant_vs_llama" in info,
            **({"hf_dequant_vs_llama": info["hf_dequant_vs_llama"]}
               if "hf_dequant_vs_llama" in info else {}),
            config=info["config"])
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")


def off_type_tensors(types: dict[str, str]) -> tuple[str, list[str]]:
    """The main quantized type of a file and the quantized tensors not in it."""
    quant = [t for t in types.values() if t != "F32"]
    if not quant:
        return "F32", []
    main = max(set(quant), key=quant.count)
    return main, [f"{n.removesuffix('.weight')}={t}" for n, t in types.items()
                  if t not in ("F32", main)]


def write_readme(out: Path, files: dict[str, dict]) -> None:
    rows = []
    for fname, info in files.items():
        types = sorted(set(info["types"].values()))
        if "hf_vs_llama" in info:
            agree = f"HF {info['hf_vs_llama']['max_abs']:.1e}"
        else:
            agree = f"f32 file {info['vs_f32_llama']['max_abs']:.2g}"
            if "hf_dequant_vs_llama" in info:
                agree += f"; HF-dequant {info['hf_dequant_vs_llama']['max_abs']:.2g}"
        margin = f"{info['min_router_margin']:.3f}" if "min_router_margin" in info else ""
        rows.append(f"| `{fname}` | {info['meta']['arch']} | {', '.join(types)} | "
                    f"{info['meta']['tokenizer_model']}/{info['meta']['tokenizer_pre']} | "
                    f"{info['bytes'] / 1024:.0f} KiB | {agree} | {margin} |")
    mix_lines = []
    for fname, info in files.items():
        if info["quant"] != "F32":
            main, others = off_type_tensors(info["types"])
            flags = " ".join(info["quantize_flags"]) or "no flags"
            mix_lines.append(f"- `{fname}` ({flags}): {main}"
                             f"{'; except ' + ', '.join(others) if others else ''}.")
    fx_lines = []
    for fx in FIXTURES:
        spec = TOKENIZERS[fx.tokenizer]
        info = files.get(f"{fx.name}-f32.gguf") or next(
            (i for i in files.values() if i["fixture"] == fx.name), None)   # its f32 not kept
        if info is None:   # not made in this run (--only, --only-quants)
            continue
        shape = ", ".join(f"{k}={v}" for k, v in fx.config.items())
        pad = f" ({fx.vocab_pad} [PAD] rows past the tokenizer)" if fx.vocab_pad else ""
        if fx.gains:
            shape += "; after init, scaled: " + ", ".join(f"`{n}` x{g:g}" for n, g in fx.gains)
        fx_lines.append(f"- **{fx.name}** — `{fx.hf_class}`, seed {info['seed']}, vocab "
                        f"{spec.vocab_size + fx.vocab_pad}{pad}; {shape}. "
                        f"Tokenizer `{fx.tokenizer}`.")
    tok_lines = []
    for key, spec in TOKENIZERS.items():
        kind = "byte-level BPE" if spec.kind == "bpe" else "SentencePiece BPE with byte fallback"
        pre = f"pre `{spec.pre}`" if spec.kind == "bpe" else "llama.cpp SPM tokenizer"
        tok_lines.append(
            f"- `{key}`: {kind}, vocab {spec.vocab_size}, {pre}, specials "
            f"{', '.join(f'`{s}`' for s in spec.specials)}, bos `{spec.bos}`, eos `{spec.eos}`, "
            f"add_bos {spec.add_bos}{', ignore_merges' if spec.ignore_merges else ''}"
            f"{'' if spec.dummy_prefix or spec.kind != 'spm' else ', no dummy prefix'}.")
    total = sum(p.stat().st_size for p in out.iterdir() if p.is_file() and p.name != "README.md")
    text = f"""# Test fixtures

Made by `tools/make_fixtures.py`; do not edit by hand. Tiny random-initialised models,
converted to GGUF by llama.cpp's own `convert_hf_to_gguf.py`, quantized by `llama-quantize`,
with reference outputs ("oracles") from two independent implementations. About
{total / 2**20:.0f} MiB in all.

## Regenerate

```sh
tools/build_llama_cpp.sh .llama-cpp          # llama-cpp-python {LLAMA_CPP_PYTHON_VERSION} sdist, CPU build
pip install -e '.[fixtures]'                 # torch, transformers, sentencepiece
python tools/make_fixtures.py --llama-cpp .llama-cpp --out tests/fixtures
```

The run takes a few minutes on 2 cores and is deterministic (same bytes on a rerun on the
same machine; another CPU or library version may move llama.cpp's logits in the last bits).

## Files

| file | arch | tensor types | tokenizer (model/pre) | size | max abs logit diff, llama.cpp vs | min router margin |
|---|---|---|---|---|---|---|
{chr(10).join(rows)}

"f32 file": llama.cpp on this file vs llama.cpp on the f32 file it was quantized from,
`<fixture>-f32.gguf` (what quantizing cost; the f32 files of glm256 (7 MiB) and qwen3nextq (1.5 MiB) are not kept).
"HF-dequant": vs `logits_hf_dequant` below (what llama.cpp's activation rounding and
any expert flips cost). Router margins are from the HF run (on the dequantized weights for
quantized files). `manifest.json` has the same facts per file, plus every tensor's type, the
HF config, and the comparison numbers (max abs diff, min per-position cosine, argmax
agreement).

## Models

All float32. Norm weights are 1 + N(0, 0.2) and biases N(0, 0.1) (HF would init them to 1
and 0, hiding an engine that ignores them); router weights are scaled by {ROUTER_GAIN}; other
weights are N(0, initializer_range). MoE fixtures take the first seed (`seed + 1000 i`) whose
reference tokens route with a margin of at least {MIN_ROUTER_MARGIN} between the k-th and
(k+1)-th router logit in every layer (or the best of {MAX_SEED_TRIES} seeds), so that rounding
rarely changes which experts run.

{chr(10).join(fx_lines)}

Shapes chosen to suit llama.cpp: OLMoE is MHA because llama.cpp sizes its k_norm as n_embd;
its rms eps is 1e-5 because the converter writes 1e-5 whatever the config says. Gemma 3 has
six layers because llama.cpp (and the converter's GGUF) knows only the default pattern of one
global layer in six; llama.cpp's gelu looks up fp16-rounded inputs in a table, which is its
2e-3 from HF there. The converter stores Gemma's norm weights as 1 + w.

`<fixture>-<TYPE>.gguf` = `llama-quantize <fixture>-f32.gguf <TYPE>`; in q3moe256 and glm256
every matmul row length is a multiple of 256. Types per file (the routers
`ffn_gate_inp` and all norms stay F32):

{chr(10).join(mix_lines)}

## Tokenizers

Trained offline by the script on Python standard-library docstrings plus a few
multilingual lines. BPE ones are byte-level (all 256 byte symbols in the base alphabet),
with HF pre-tokenizer regexes that mirror llama.cpp's for the chosen `pre`; special tokens
come last in the vocab. Every tokenizer carries a `chat_template`: ChatML, except `spm-gemma`
(Gemma's turns) and `bpe-o200k` (gpt-oss's harmony template, llama.cpp's
`models/templates/openai-gpt-oss-120b.jinja`).

{chr(10).join(tok_lines)}

## Oracles

`<file>.ref.npz`:
- `tokens` int32 [{N_TOKENS}]: llama.cpp's tokenization of the reference text below
  (add_special=True, parse_special=True), first {N_TOKENS}.
- `logits_llama` float32 [{N_TOKENS}, n_vocab]: llama.cpp CPU, teacher-forced, every position,
  empty context; f32 KV cache, no flash attention, extra buffer types (repack/AMX) off.
  For quantized weights llama.cpp rounds activations to Q8_0 / Q8_K for its dot products
  (and to F16 / BF16 for F16 / BF16 weights).
- `logits_hf` float32 (only `*-f32.gguf`): HF transformers, float32, eager attention,
  same tokens.
- `logits_hf_dequant` float32 (quantized `q3moe256-*` files that gguf-py can dequantize; not
  Q1_0): HF transformers with every weight replaced by the GGUF's weight dequantized by
  gguf-py, float32 activations. An engine that dequantizes and computes in f32 should
  match this far more tightly than `logits_llama`.
- `router_in`, `router_ids`, `router_weights` (glm4moe-f32 only): per MoE layer, the input
  [{N_TOKENS}, dim] of HF's own router module and the experts [{N_TOKENS}, k] it chose (in its
  order) with their weights.
- `router_margin` float32 [n_layers, {N_TOKENS}] (MoE files with an HF oracle): router logit
  k minus router logit k+1 (k = experts used) from that HF run. Where it is tiny, rounding
  may pick other experts and the logits at that position jump; mask such positions when
  comparing against `logits_llama`.

`<file>.chat.json` (f32 files whose tokenizer carries a template of its own: gpt-oss's
harmony template, as llama.cpp ships it): `cases`, each `messages`, `add_generation_prompt`,
template variables `kwargs` and `text`, transformers' `apply_chat_template` rendering (its
"Current date" line is the day the script ran).

`tokenizer_cases.json`: `strings`; `cases[<gguf>]` = `special` (llama.cpp tokenize with
add_special=True, parse_special=True) and `plain` (both False), one list of ids per string,
for one file per distinct tokenizer; `same_tokenizer_as` maps the other f32 files to it.

`llamacpp-rounding.npz` (made by `tools/make_rounding_ref.py`, not by this script): activation
rows and llama.cpp CPU's own roundings of them (Q8_0, Q8_K, F16, BF16), weight rows of 17 types
with libggml-cpu's `vec_dot` against them, and `ggml_gelu` over a range: what
`tests/test_llamacpp_numerics.py` holds `tests/llamacpp_numerics.py` to.

Reference text:

> {REF_TEXT}
"""
    (out / "README.md").write_text(text)


if __name__ == "__main__":
    main()
