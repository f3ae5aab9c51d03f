"""Behaviour several callers share runs through one function, tested through every caller, so
two copies cannot drift apart again: prefix reuse (cache.PrefixCache: chat and serve), chat
rendering (Model.chat_tokens, tools included: chat and serve), the choice of reasoning
splitter (think.reply_splitter: chat, generate streamed and batched, serve) and the expert
pool's stats line (runner.pool_line: generate's --stats, chat's /stats, the Ray worker)."""

from __future__ import annotations

import ast
import queue
from pathlib import Path

import pytest

import onebit
from conftest import fixture_path
from ggufedit import rewrite
from onebit.apps.chat import ChatSession
from onebit.chat_formats.harmony import HarmonyStream
from onebit.apps.serve import Engine, Sampling, Work
from onebit.chat_formats.think import ThinkStream, reply_splitter

ROOT = Path(__file__).resolve().parents[1]
QWEN3_TEMPLATE = (ROOT / "tests" / "templates" / "Qwen-Qwen3-0.6B.jinja").read_text()
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def serve(model, works: list[Work], lookup: int = 0) -> list[dict]:
    """Each request through serve's worker in turn: {"start", "content", "reasoning", "done"}."""
    engine = Engine(model, sampling=Sampling(), lookup=lookup)
    out = []
    try:
        for work in works:
            events: queue.Queue = queue.Queue()
            engine.submit(work, events.put)
            got = {"content": "", "reasoning": ""}
            while True:
                kind, value = events.get(timeout=300)
                if kind == "start":
                    got["start"] = value
                elif kind == "delta":
                    got["content"] += value.content
                    got["reasoning"] += value.reasoning
                elif kind == "error":
                    raise value
                else:
                    got["done"] = value
                    break
            out.append(got)
    finally:
        engine.stop()  # (not close(): the model stays open for the caller)
        engine.join(60)
    return out


def greedy_work(messages, max_tokens: int = 8, **kw) -> Work:
    return Work(None, messages=[dict(m) for m in messages], sampling=Sampling(temperature=0.0),
                max_tokens=max_tokens, **kw)


# -- prefix reuse: one PrefixCache, with checkpoints, for chat and serve -------------------------


@pytest.mark.parametrize("lookup", [0, 4])
def test_serve_reuses_a_hybrid_prefix_as_chat_does(lookup):
    """A hybrid model (recurrent state: no trim, checkpoints) served a conversation and then its
    continuation keeps the shared prefix, as many tokens of it as a chat keeps, and replies as
    the chat does."""
    m = onebit.load(fixture_path("qwen35moe-f32.gguf"), backend="numpy")
    chat = ChatSession(m, temperature=0.0, max_tokens=8, lookup=lookup)
    first = "".join(r.text for r in chat.send("hello there"))
    second = "".join(r.text for r in chat.send("and then"))
    kept = chat.last.prompt_tokens - chat.last.prompt_tokens_computed
    assert kept > 0
    got = serve(m, [greedy_work(chat.history[:1]), greedy_work(chat.history[:3])], lookup=lookup)
    assert [g["content"] for g in got] == [first, second]
    assert got[0]["start"]["cached_tokens"] == 0
    assert got[1]["start"]["cached_tokens"] == kept == got[1]["done"].cached_tokens


# -- chat rendering: Model.chat_tokens, tools and variables included ---------------------------


@pytest.fixture(scope="module")
def qwen3_model(tmp_path_factory):
    dst = tmp_path_factory.mktemp("render") / "qwen3tools.gguf"
    rewrite(fixture_path("qwen3moe-f32.gguf"), dst, meta={"tokenizer.chat_template": QWEN3_TEMPLATE})
    return onebit.load(dst, backend="numpy")


def test_serve_renders_with_chat_tokens(qwen3_model, monkeypatch):
    m = qwen3_model
    msgs = [{"role": "user", "content": "The weather in Oslo?"}]
    with_tools = m.chat_tokens(msgs, tools=[WEATHER])
    assert "get_weather" in m.detokenize(with_tools) and "get_weather" not in m.detokenize(m.chat_tokens(msgs))
    monkeypatch.setattr(m, "template_kwargs", {"enable_thinking": False})  # as `--chat-template-kwargs` sets it
    off, on = m.chat_tokens(msgs), m.chat_tokens(msgs, template_kwargs={"enable_thinking": True})
    assert off != on  # the request's variables over the model's
    engine = Engine(m, sampling=Sampling())
    try:
        assert engine._prompt_ids(Work(None, messages=msgs), 4096) == off
        assert engine._prompt_ids(Work(None, messages=msgs, template_kwargs={"enable_thinking": True}), 4096) == on
        assert engine._prompt_ids(Work(None, messages=msgs, tools=[WEATHER]), 4096) == m.chat_tokens(msgs, tools=[WEATHER])
    finally:
        engine.stop()
        engine.join(60)


# -- the reasoning splitter: think.reply_splitter for every caller -------------------------------


REASONING, ANSWER = "The user says hi.", "Hello! 2 < 3."
REPLIES = {  # a reply as the model writes it, and its end-of-generation token
    "think": (f"<think>\n{REASONING}\n</think>\n\n{ANSWER}", "<|im_end|>"),
    "harmony": (f"<|channel|>analysis<|message|>{REASONING}<|end|><|start|>assistant<|channel|>final"
                f"<|message|>{ANSWER}", "<|return|>"),
}


class Scripted:
    """A sampler that writes a given reply (token by token), whatever the logits."""

    def __init__(self, ids):
        self.ids = list(ids)

    def __call__(self, logits):
        return self.ids.pop(0)


@pytest.fixture(scope="module", params=sorted(REPLIES))
def reasoning_model(request, qwen3_model):
    if request.param == "think":
        return qwen3_model, request.param
    return onebit.load(fixture_path("gptoss-f32.gguf"), backend="numpy"), request.param


def _script(model, kind):
    text, end = REPLIES[kind]
    return Scripted(model.tokenize(text, add_special=False) + [model.tokenizer.token_to_id(end)])


def test_the_splitter_each_model_gets(reasoning_model, qwen3_model):
    model, kind = reasoning_model
    ids = model.chat_tokens([{"role": "user", "content": "Hi"}])
    want = {"think": ThinkStream, "harmony": HarmonyStream}[kind]
    assert type(reply_splitter(model, ids)) is want
    # a reply a grammar constrains from its first token opens no <think> block; harmony's channels stay
    assert type(reply_splitter(model, ids, constrained=True)) is (HarmonyStream if kind == "harmony" else type(None))
    plain = onebit.load(fixture_path("qwen3moe-f32.gguf"), backend="numpy")
    assert reply_splitter(plain, plain.chat_tokens([{"role": "user", "content": "<think>"}])) is None


def test_every_caller_splits_a_reply_alike(reasoning_model, monkeypatch, capsys):
    """chat, generate (batched and streamed) and serve give the same reasoning and reply."""
    from onebit.apps import batch
    from onebit import model as model_mod
    from onebit.apps import serve as serve_mod
    from onebit.cli import main

    model, kind = reasoning_model
    msgs = [{"role": "user", "content": "Hi!"}]
    got = {}
    s = ChatSession(model, temperature=0.0, max_tokens=200)
    s.sampler = _script(model, kind)
    replies = list(s.send("Hi!"))
    got["chat"] = ("".join(r.reasoning for r in replies), "".join(r.text for r in replies))

    monkeypatch.setattr(model_mod, "make_sampler", lambda *a, **kw: _script(model, kind))
    item = batch.PromptItem("1", 1, prompt="Hi!")
    rec = batch.generate_one(model, item, chat=True, system=None, seed=None, max_tokens=200, show_reasoning=True)
    got["batch"] = (rec["reasoning"], rec["text"])
    main._stream_one(model, item, True, None, None, dict(max_tokens=200, show_reasoning=True))
    out, err = capsys.readouterr()
    got["generate"] = (err, out.removesuffix("\n"))

    monkeypatch.setattr(serve_mod, "make_sampler", lambda *a, **kw: _script(model, kind))
    (one,) = serve(model, [greedy_work(msgs, max_tokens=200)])
    got["serve"] = (one["reasoning"], one["content"])
    assert got == dict.fromkeys(got, (REASONING, ANSWER))


def test_no_caller_picks_a_splitter_itself():
    """Only think.reply_splitter makes a splitter (HarmonyStream, think_stream) or asks which
    format a model writes (is_harmony, uses_think) on behalf of a caller."""
    callers = ["onebit/apps/chat.py", "onebit/apps/serve.py", "onebit/apps/serve_app.py", "onebit/apps/batch.py", "cli/main.py",
               "cli/chat_repl.py"]
    named = {}
    for path in callers:
        tree = ast.parse((ROOT / path).read_text(encoding="utf-8"))
        names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
        names |= {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
        named[path] = sorted(names & {"HarmonyStream", "ThinkStream", "think_stream", "is_harmony", "uses_think",
                                      "split_reply", "split_think"})
    assert named == dict.fromkeys(callers, [])


# -- the expert pool's stats line: runner.pool_line --------------------------------------------


@pytest.mark.parametrize("streamed", [False, True])
def test_every_stats_line_is_pool_line(streamed, capsys):
    from onebit.cli import chat_repl, main
    from onebit.apps.cluster import BatchWorker
    from onebit.runner import pool_line

    kw = dict(slots=6, budget="1GiB") if streamed else {}
    m = onebit.load(fixture_path("qwen3moe-f32.gguf"), backend="numpy", **kw)
    s = ChatSession(m, temperature=0.0, max_tokens=4, lookup=0)
    list(s.send("hello"))
    line = pool_line(m.pool, m.net.rows_run)
    assert ("experts streaming through 6 slots: hit rate" in line) == streamed
    assert (line == "all experts resident (no streaming pool)") == (not streamed)
    assert line in chat_repl.format_stats(s).splitlines()  # chat's /stats
    worker = BatchWorker.__new__(BatchWorker)  # (its constructor sets a Ray worker's threads)
    worker.model, worker.lookup_stats = m, None
    assert worker.stats() == [line]  # the Ray driver's --stats
    main._finish(m, stats=True)  # generate's --stats (it closes the model)
    assert f"stats: {line}\n" in capsys.readouterr().err
