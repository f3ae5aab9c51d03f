"""The `onebit` command as a user runs it: output, exit codes, one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import fixture_path, run_cli
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


# -- one command line: the model, devices, prediction settings, JSON schemas --------------------

MODEL_COMMANDS = {  # each command that takes a model, with what makes it stop early or run briefly
    "generate": ["-p", "hi", "-n", "2", "--backend", "numpy", "--json"],
    "chat": ["--ctx", "4"],  # refused once the model is loaded: the template alone fills 4 tokens
    "info": ["--json"],
    "plan": ["--json", "--backend", "cpu", "--budget", "1GiB"],
    "bench": ["--prompt-tokens", "2", "--gen-tokens", "1", "--runs", "1", "--no-warmup", "--backend", "numpy"],
    "serve": ["--port", "-1"],  # refused before anything loads: the model is resolved first
}


@pytest.mark.parametrize("command", sorted(MODEL_COMMANDS))
def test_every_model_command_takes_the_model_either_way_but_not_twice(monkeypatch, capsys, command):
    extra = MODEL_COMMANDS[command]
    by_position = run_cli(monkeypatch, capsys, command, MODEL, *extra)
    by_option = run_cli(monkeypatch, capsys, command, "-m", MODEL, *extra)
    long_option = run_cli(monkeypatch, capsys, command, "--model", MODEL, *extra)
    if command in ("info", "plan"):
        assert by_position[:2] == by_option[:2] == long_option[:2] and MODEL in by_position[1]
    elif command == "chat":
        assert by_position[0] == by_option[0] == 2 and "no room to chat" in by_option[2]
    elif command == "serve":
        assert by_position[0] == by_option[0] == 2 and "--port" in by_option[2]
    else:
        assert by_position[0] == by_option[0] == long_option[0] == 0, by_option
    code, out, err = run_cli(monkeypatch, capsys, command, MODEL, "-m", MODEL, *extra)
    assert code == 2 and out == "" and "the model is given twice" in err, (code, out, err)


def test_generate_output_is_the_same_for_either_way_of_naming_the_model(monkeypatch, capsys):
    args = ["-p", "Hello", "-n", "4", "--backend", "numpy", "--json"]
    a = run_cli(monkeypatch, capsys, "generate", MODEL, *args)
    b = run_cli(monkeypatch, capsys, "generate", "-m", MODEL, *args)
    assert a[0] == b[0] == 0 and json.loads(a[1])["tokens"] == json.loads(b[1])["tokens"]


def test_devices_lists_them_and_info_describes_the_model_only(monkeypatch, capsys):
    monkeypatch.delenv("ONEBIT_VULKAN_DEVICE", raising=False)
    code, out, err = run_cli(monkeypatch, capsys, "devices")
    assert code == 0 and "cpu:" in out and "--backend auto: " in out, (out, err)
    monkeypatch.setenv("ONEBIT_VULKAN_DEVICE", "0")  # a device asked for: auto takes Vulkan
    code, out, _ = run_cli(monkeypatch, capsys, "devices")
    assert code == 0 and "--backend auto: vulkan (device '0' asked for)" in out
    code, _, err = run_cli(monkeypatch, capsys, "info", "--device")
    assert code == 2 and "No such option: --device" in err


def test_plan_takes_moe_predict_layers_as_everywhere_and_layers_too(monkeypatch, capsys):
    base = ["plan", MODEL, "--json", "--backend", "cpu", "--slots", "4", "--budget", "1GiB"]
    plain = run_cli(monkeypatch, capsys, *base)
    named = run_cli(monkeypatch, capsys, *base, "--moe-predict-layers", "1")
    alias = run_cli(monkeypatch, capsys, *base, "--layers", "1")
    assert named[0] == alias[0] == plain[0] == 0, named
    assert named[1] == alias[1] and json.loads(named[1])["predicted_layers"] == [1]
    # as a streamed load on the cpu: router prediction, no layer's block scratch reserved
    assert json.loads(plain[1])["predicted_layers"] == []


@pytest.mark.parametrize("command", ["generate", "chat", "bench", "serve"])
def test_help_shows_the_research_settings_apart_and_last(monkeypatch, capsys, command):
    code, out, _ = run_cli(monkeypatch, capsys, command, "--help")
    assert code == 0
    main, _, research = out.partition("\nRouting prediction, research settings")
    assert research, out
    assert "--moe-predict-depth" in research and "--moe-predict-depth" not in main
    assert "--moe-predict " in main and "--backend" in main and "--backend" not in research
    assert ("--moe-predict-out" in research) == (command != "serve")  # serve writes no per-token trace


def test_predict_options_give_the_command_one_settings_object():
    """predict_options turns the command's `predict` parameter into the --moe-predict options and
    calls it with one PredictSettings: flags over $ONEBIT_MOE_PREDICT*, refused before the body runs."""
    import typer
    from typer.testing import CliRunner

    from onebit.cli.options import Command, predict_options
    from onebit.moe.predict import PredictSettings

    got = []
    app = typer.Typer()

    @app.command(cls=Command)
    @predict_options("out")
    def run(n: int = typer.Option(1, "--n"), predict=None) -> None:
        got.append((n, predict))

    r = CliRunner().invoke(app, ["--n", "2", "--moe-predict", "router", "--moe-predict-ahead", "2",
                                 "--moe-predict-no-attn", "1"], env={"ONEBIT_MOE_PREDICT_DEPTH": "5"})
    assert r.exit_code == 0, r.output
    assert got == [(2, PredictSettings(mode="router", ahead=2, no_attn=True, depth=5))]
    r = CliRunner().invoke(app, ["--moe-predict-out", "x.jsonl"])
    assert r.exit_code == 2 and "No such option" in r.output and len(got) == 1


def test_lookup_comes_from_the_flag_over_the_environment(monkeypatch, capsys):
    base = ["generate", MODEL, "-p", "one two one two one two one two", "-n", "12", "--backend", "numpy", "--stats"]
    monkeypatch.setenv("ONEBIT_LOOKUP", "0")
    code, _, err = run_cli(monkeypatch, capsys, *base)
    assert code == 0 and "lookup:" not in err, err
    code, _, err = run_cli(monkeypatch, capsys, *base, "--lookup", "4")
    assert code == 0 and "lookup: drafts proposed" in err, err
    monkeypatch.setenv("ONEBIT_LOOKUP", "many")
    code, _, err = run_cli(monkeypatch, capsys, *base)
    assert code == 2 and "$ONEBIT_LOOKUP must be a whole number" in err


@pytest.mark.parametrize("args, why", [
    (["--json-schema", "{type: object}"], "--json-schema is not valid JSON"),
    (["--json-schema", "[1]"], "--json-schema must be a JSON object"),
    (["--json-schema", '{"type": "nonsense"}'], "not usable as a JSON schema"),
    (["--json-schema", "{}", "--json-schema-file", "s.json"], "give the JSON schema once"),
    (["--json-schema-file", "/no/such/schema.json"], "cannot read the JSON schema"),
])
def test_bad_json_schemas_are_refused_before_loading(monkeypatch, capsys, args, why):
    pytest.importorskip("llguidance")
    code, out, err = run_cli(monkeypatch, capsys, "generate", "/no/such/model.gguf", "-p", "x", *args)
    assert code == 2 and out == "" and why in err, (code, out, err)


def test_json_schema_inline_and_from_a_file_constrain_alike(monkeypatch, capsys, tmp_path):
    pytest.importorskip("llguidance")
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    path = tmp_path / "s.json"
    path.write_text(json.dumps(schema))
    base = ["generate", "-p", "Is the sky blue?", "-n", "40", "--backend", "numpy", "--json"]  # the shipped model
    inline = run_cli(monkeypatch, capsys, *base, "-j", json.dumps(schema))
    file = run_cli(monkeypatch, capsys, *base, "--json-schema-file", str(path))
    assert inline[0] == file[0] == 0, inline
    a, b = json.loads(inline[1]), json.loads(file[1])
    assert a["tokens"] == b["tokens"] and a["finish_reason"] == "stop"
    assert json.loads(a["text"]) in ({"ok": True}, {"ok": False})
