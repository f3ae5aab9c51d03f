"""ChatSession: prefix reuse is exact, context overflow drops old turns, interrupts keep state."""

from __future__ import annotations

import pytest

import onebit
from conftest import fixture_path
from onebit.apps.chat import ChatSession
from onebit.errors import UsageError

MODEL = fixture_path("qwen3moe-f32.gguf")


def test_second_turn_reuses_the_cache_and_matches_a_fresh_run():
    m = onebit.load(MODEL, backend="cpu")
    s = ChatSession(m, temperature=0.0, max_tokens=6)
    first = "".join(r.text for r in s.send("What does json.dumps do?"))
    second = "".join(r.text for r in s.send("And json.loads?"))
    assert s.last.prompt_tokens_computed < s.last.prompt_tokens  # the first turn came from the cache
    fresh = ChatSession(onebit.load(MODEL, backend="cpu"), temperature=0.0, max_tokens=6)
    fresh.history = [{"role": "user", "content": "What does json.dumps do?"}, {"role": "assistant", "content": first}]
    again = "".join(r.text for r in fresh.send("And json.loads?"))
    assert again == second
    assert fresh.last.prompt_tokens_computed == fresh.last.prompt_tokens  # nothing cached


def test_context_overflow_drops_oldest_turns():
    m = onebit.load(MODEL, n_ctx=96, backend="cpu")
    s = ChatSession(m, temperature=0.0, max_tokens=8, system="Be brief.")
    dropped = 0
    for i in range(8):
        list(s.send(f"Question number {i} about the os module and its functions?"))
        dropped += s.last.dropped_turns
        assert len(s.prefix.tokens) <= 96
    assert dropped > 0
    assert s.messages()[0]["role"] == "system"


def test_a_full_context_drops_old_turns_once_not_every_turn():
    """Once the context is full, dropping old turns makes the next prompt differ from the cache at
    its start, so that turn runs the whole conversation again. It must drop enough that the turns
    after it again run only what they add, not drop one turn and re-run everything each turn."""
    m = onebit.load(MODEL, n_ctx=256, backend="cpu")
    s = ChatSession(m, temperature=0.0, max_tokens=4, system="Be brief.")
    turns = []
    for i in range(24):
        list(s.send(f"Question {i} about os?"))
        turns.append((s.last.dropped_turns, s.last.prompt_tokens, s.last.prompt_tokens_computed))
        assert len(s.prefix.tokens) <= 256
    drops = [i for i, t in enumerate(turns) if t[0]]
    assert drops, turns  # the context filled
    first = drops[0]
    assert len(drops) <= 5, turns  # about one drop per half a context of turns (7 turns here)
    for prev, (dropped, total, computed) in zip(turns[first:], turns[first + 1:]):
        if not dropped:  # the turn ran what the conversation grew by (its message, the last reply)
            assert computed <= total - prev[1], turns
    after = turns[first + 1:]
    assert sum(c for _, _, c in after) < sum(t for _, t, _ in after) // 3, turns
    assert turns[first][1] + 4 <= 256 // 2  # the drop left half the context free


def test_message_longer_than_context_is_refused():
    s = ChatSession(onebit.load(MODEL, n_ctx=32, backend="cpu"), temperature=0.0)
    with pytest.raises(UsageError, match="longer than"):
        list(s.send("word " * 200))


def test_interrupted_reply_keeps_a_consistent_cache():
    m = onebit.load(MODEL, backend="cpu")
    s = ChatSession(m, temperature=0.0, max_tokens=50)
    gen = s.send("Tell me about os.path")
    for i, _ in enumerate(gen):
        if i == 3:
            break
    gen.close()  # what Ctrl-C does in the terminal
    assert s.last.finish_reason == "interrupted"
    assert s.prefix.cache.offset == len(s.prefix.tokens)
    reply = "".join(r.text for r in s.send("Go on"))  # the session keeps working
    assert isinstance(reply, str) and s.last.finish_reason in ("stop", "length")
