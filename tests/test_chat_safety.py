"""Chat: a refused message leaves the conversation as it was; /commands; what reaches the terminal."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

import onebit
from conftest import fixture_path
from onebit.apps.chat import ChatSession
from onebit.errors import UsageError
from onebit.generate import GenerationResponse

MODEL = fixture_path("qwen3moe-f32.gguf")


def test_message_longer_than_context_leaves_history_and_cache_alone():
    s = ChatSession(onebit.load(MODEL, n_ctx=64, backend="cpu"), temperature=0.0, max_tokens=4)
    list(s.send("What does os do?"))
    history = [dict(m) for m in s.history]
    cached, offset = list(s.prefix.tokens), s.prefix.cache.offset
    with pytest.raises(UsageError, match="longer than"):
        list(s.send("word " * 100))
    assert s.history == history and s.prefix.tokens == cached and s.prefix.cache.offset == offset
    list(s.send("And json?"))  # the conversation goes on, the first exchange still there
    assert s.history[:2] == history and s.last.prompt_tokens_computed < s.last.prompt_tokens


class FakeSession:
    sent: list[str] = []

    def __init__(self, model, system=None, **settings):
        self.last = SimpleNamespace(dropped_turns=0, finish_reason=None)

    def send(self, text):
        FakeSession.sent.append(text)
        self.last.finish_reason = "stop"
        yield GenerationResponse("\x1b[2Jred\x07 ok\tfine\r\n", 1, "stop", 1, 1, 0.0, 0.0)

    def reset(self):
        pass


def chat(monkeypatch, capsys, lines):
    """run_chat over scripted input lines (EOFError = Ctrl-D): (messages sent, stdout)."""
    from onebit.cli.chat_repl import run_chat

    feed = iter(lines)

    def fake_input(prompt=""):
        x = next(feed, EOFError)
        if x is EOFError:
            raise EOFError
        return x

    FakeSession.sent = []
    monkeypatch.setattr("onebit.apps.chat.ChatSession", FakeSession)
    monkeypatch.setattr("builtins.input", fake_input)
    model = SimpleNamespace(gguf={"general.name": "fake"}, path="fake.gguf", cfg=SimpleNamespace(arch="x"),
                            be=SimpleNamespace(name="numpy"))
    run_chat(model)
    return FakeSession.sent, capsys.readouterr().out


def test_unknown_command_with_arguments_is_not_a_prompt(monkeypatch, capsys):
    sent, out = chat(monkeypatch, capsys, ["/foo bar", "/reset now", "//etc/hosts is?", "/quit", "after quit"])
    assert sent == ["/etc/hosts is?"]  # // sends a message that starts with /
    assert "unknown command /foo" in out and "/reset takes no arguments" in out


def test_control_characters_in_a_reply_are_escaped(monkeypatch, capsys):
    sent, out = chat(monkeypatch, capsys, ["hello"])
    assert sent == ["hello"]
    assert "\\x1b[2Jred\\x07 ok\tfine\\x0d\n" in out and "\x1b" not in out and "\x07" not in out


def test_ctrl_d_in_a_block_cancels_the_block_not_the_chat(monkeypatch, capsys):
    sent, out = chat(monkeypatch, capsys, ['"""', "half a message", EOFError, "next one", "line\\", EOFError,
                                           "last"])
    assert sent == ["next one", "last"] and out.count("message cancelled") == 2
