"""The `onebit` command as a user runs it: output, exit codes, one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import fixture_path
from ggufedit import rewrite

MODEL = str(fixture_path("qwen3moe-f32.gguf"))
pytestmark = pytest.mark.kernels_of(MODEL)  # (for its `onebit` processes)


def onebit(*args, input=None):
    return subprocess.run([sys.executable, "-m", "onebit.cli.main", *args], capture_output=True, text=True,
                          input=input, timeout=300)


def assert_one_line_error(r, code=2):
    assert r.returncode == code, (r.returncode, r.stdout, r.stderr)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    return lines[0]


def test_version():
    r = onebit("--version")
    assert r.returncode == 0 and r.stdout.startswith("onebit ")


def test_generate_json():
    r = onebit("generate", "--model", MODEL, "--prompt", "The json module", "--max-tokens", "5", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert set(out) >= {"text", "tokens"} and isinstance(out["text"], str)
    assert 1 <= len(out["tokens"]) <= 5 and out["generation_tokens"] >= len(out["tokens"])


def test_generate_is_deterministic_with_seed():
    args = ["generate", "--model", MODEL, "--prompt", "Hello", "--max-tokens", "6", "--temperature", "0.9",
            "--seed", "3", "--json"]
    a, b = onebit(*args), onebit(*args)
    assert a.returncode == 0 and json.loads(a.stdout)["tokens"] == json.loads(b.stdout)["tokens"]


def test_missing_model():
    line = assert_one_line_error(onebit("generate", "--model", "/nonexistent.gguf", "--prompt", "x"))
    assert "/nonexistent.gguf" in line and "no such file" in line


def test_corrupt_model(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(fixture_path("qwen3moe-f32.gguf").read_bytes()[:5000])
    line = assert_one_line_error(onebit("generate", "--model", str(bad), "--prompt", "x"))
    assert str(bad) in line


def test_not_a_gguf(tmp_path):
    bad = tmp_path / "notes.txt"
    bad.write_text("hello")
    line = assert_one_line_error(onebit("generate", "--model", str(bad), "--prompt", "x"))
    assert "not a GGUF file" in line


def test_unknown_arch(tmp_path):
    bad = rewrite(fixture_path("qwen3-f32.gguf"), tmp_path / "m.gguf", arch="mamba9")
    line = assert_one_line_error(onebit("generate", "--model", str(bad), "--prompt", "x"))
    assert "mamba9" in line


@pytest.mark.parametrize("opt", [["--temperature", "-1"], ["--top-p", "0"], ["--max-tokens", "-3"]])
def test_bad_options(opt):
    assert_one_line_error(onebit("generate", "--model", MODEL, "--prompt", "x", *opt))


def test_empty_prompt():
    line = assert_one_line_error(onebit("generate", "--model", MODEL, "--prompt", ""))
    assert "empty" in line


def test_non_utf8_prompt():
    r = subprocess.run([sys.executable, "-m", "onebit.cli.main", "generate", "--model", MODEL, "--prompt", b"abc\xff"],
                       capture_output=True, timeout=120)
    assert r.returncode == 2 and b"not valid UTF-8" in r.stderr and b"Traceback" not in r.stderr


# --chat-template-kwargs: extra template variables (as llama.cpp's flag), e.g. Qwen3's
# enable_thinking. A template whose length depends on the variable shows it arrived.
KW_TEMPLATE = ("{% for m in messages %}{{ m['content'] }}{% endfor %}"
               "{% if enable_thinking is defined and not enable_thinking %} no think{% else %} think think think"
               " think think think{% endif %}")


def test_chat_template_kwargs_reach_the_template(tmp_path):
    path = str(rewrite(fixture_path("qwen3moe-f32.gguf"), tmp_path / "m.gguf",
                       meta={"tokenizer.chat_template": KW_TEMPLATE}))
    counts = {}
    for kw in (None, '{"enable_thinking": true}', '{"enable_thinking": false}'):
        args = ["generate", "--model", path, "--prompt", "hi", "--max-tokens", "1", "--json"]
        r = onebit(*args, *(["--chat-template-kwargs", kw] if kw else []))
        assert r.returncode == 0, r.stderr
        counts[kw] = json.loads(r.stdout)["prompt_tokens"]
    assert counts[None] == counts['{"enable_thinking": true}'] > counts['{"enable_thinking": false}'], counts


@pytest.mark.parametrize("kw, why", [("{enable_thinking: false}", "not valid JSON"), ("[1, 2]", "JSON object"),
                                     ('{"messages": []}', "messages")])
def test_bad_chat_template_kwargs(kw, why):
    for cmd in (["generate", "--model", MODEL, "--prompt", "x"], ["chat", MODEL]):
        line = assert_one_line_error(onebit(*cmd, "--chat-template-kwargs", kw))
        assert why in line, line


def test_generate_drafts_by_default_but_not_while_tracing(tmp_path):
    from onebit.moe.trace import read_trace

    base = ["generate", "--model", MODEL, "--prompt", "one two one two one two one two", "--max-tokens", "24",
            "--temperature", "0", "--stats"]
    plain = onebit(*base, "--lookup", "0")
    default = onebit(*base)
    trace = tmp_path / "t.jsonl"
    traced = onebit(*base, "--trace", str(trace))
    for r in (plain, default, traced):
        assert r.returncode == 0, r.stderr
    assert default.stdout == plain.stdout == traced.stdout
    line = [ln for ln in default.stderr.splitlines() if ln.startswith("lookup: drafts proposed")]
    assert line and int(line[0].split()[3].rstrip(",")) > 0, default.stderr
    assert "lookup:" not in plain.stderr and "lookup:" not in traced.stderr
    decode = [a for a in read_trace(str(trace)).accesses if a.decode]
    assert len(decode) == 23 * len({a.layer for a in decode})  # one row per decode token: no verify rows
