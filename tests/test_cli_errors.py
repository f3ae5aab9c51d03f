"""Argument errors exit 2 with click's usage line; --ctx, --stop and --device are checked up front."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import fixture_path, run_cli

MODEL = str(fixture_path("qwen3moe-f32.gguf"))
pytestmark = pytest.mark.kernels_of(MODEL)  # (for its `onebit` processes)



@pytest.mark.parametrize("args, what", [
    (["generate", "--temperature", "abc"], "Invalid value for '--temperature'"),
    (["generate", "--bogus"], "No such option: --bogus"),
    (["bogus"], "No such command 'bogus'"),
])
def test_usage_errors_exit_2_with_usage(monkeypatch, capsys, args, what):
    code, _, err = run_cli(monkeypatch, capsys, *args)
    lines = err.splitlines()
    assert code == 2, err
    assert lines[0].startswith("Usage: onebit") and "--help" in lines[1]
    assert lines[-1].startswith("onebit: error: ") and what in lines[-1] and "internal error" not in err


def test_missing_option_value_exits_2(monkeypatch, capsys):
    code, _, err = run_cli(monkeypatch, capsys, "generate", "--prompt")
    assert code == 2 and "requires an argument" in err and "internal error" not in err


def test_usage_error_as_a_process():
    r = subprocess.run([sys.executable, "-m", "onebit.cli.main", "generate", "--max-tokens", "many"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Usage:" in r.stderr and "Traceback" not in r.stderr


def test_no_arguments_prints_help_exit_2(monkeypatch, capsys):
    code, _, err = run_cli(monkeypatch, capsys)
    assert code == 2 and "Commands" in err and "internal error" not in err


@pytest.mark.parametrize("ctx, what", [("513", "out of range"), ("100000", "out of range"), ("1", "no room"),
                                       ("0", "at least 2"), ("2", "no room to generate")])
def test_ctx_checked(monkeypatch, capsys, ctx, what):
    code, out, err = run_cli(monkeypatch, capsys, "generate", "-m", MODEL, "-p", "hello there", "--ctx", ctx,
                             "-n", "3", "--json")
    assert code == 2 and what in err and out == "", (code, out, err)


def test_ctx_at_the_model_limit_works(monkeypatch, capsys):
    code, out, err = run_cli(monkeypatch, capsys, "generate", "-m", MODEL, "-p", "hi", "--ctx", "512", "-n", "2",
                             "--json")
    assert code == 0, err


def test_chat_ctx_too_small_for_the_template(monkeypatch, capsys):
    code, _, err = run_cli(monkeypatch, capsys, "chat", MODEL, "--ctx", "4")
    assert code == 2 and "no room to chat" in err


def test_empty_stop_string_refused(monkeypatch, capsys):
    code, _, err = run_cli(monkeypatch, capsys, "generate", "-m", MODEL, "-p", "hi", "--stop", "")
    assert code == 2 and "--stop" in err


@pytest.mark.parametrize("device", ["99", "foo"])
def test_vulkan_device_that_does_not_exist_exits_2(monkeypatch, capsys, device):
    monkeypatch.delenv("ONEBIT_VULKAN_DEVICE", raising=False)
    code, out, err = run_cli(monkeypatch, capsys, "generate", "-m", MODEL, "-p", "hi", "-n", "2",
                             "--backend", "vulkan", "--device", device)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2 and out == "", (code, out, err)
    assert len(lines) == 1 and lines[0].startswith("onebit: error: ") and "warning" not in err
