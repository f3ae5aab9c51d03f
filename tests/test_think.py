"""`<think>` reasoning blocks: split from the reply in chat and generate (think.py).

The real templates (tests/templates/, copied from llama.cpp's models/templates) are the
reference for the history: each one parses an assistant turn's raw text itself (it splits the
content at `</think>`), so the turn stored as (content, reasoning_content) must render exactly
as the raw reply would, with onebit's renderer and with plain jinja2 as transformers sets it up.
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path

import jinja2
import jinja2.ext
import jinja2.sandbox
import pytest

import onebit
from onebit.apps.chat import ChatSession
from onebit.chat_formats.chat_template import render_chat
from onebit.chat_formats.think import ThinkStream, prompt_opens_think, split_think, think_stream, uses_think

from conftest import chat_repl_output, fixture_path
from ggufedit import rewrite

TEMPLATES = Path(__file__).parent / "templates"
QWEN3, GLM46, QWEN35, R1 = ("Qwen-Qwen3-0.6B", "GLM-4.6", "Qwen3.5-4B", "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B")
REASONING, ANSWER = "The user says hi.\n\nI greet back <b>.", "Hello! 2 < 3 and </th is text."
RAW = f"<think>\n{REASONING}\n</think>\n\n{ANSWER}"


def template(name: str) -> str:
    return (TEMPLATES / f"{name}.jinja").read_text()


def _pieces(text: str, cuts) -> list[str]:
    edges = [0, *cuts, len(text)]
    return [text[a:b] for a, b in zip(edges, edges[1:])]


def _run(pieces, inside=False, final_empty=True):
    s = ThinkStream(inside)
    shown_t, shown_r = [], []
    for i, p in enumerate(pieces):
        t, r = s.feed(p, final=not final_empty and i == len(pieces) - 1)
        shown_t.append(t)
        shown_r.append(r)
    if final_empty:
        t, r = s.feed("", final=True)
        shown_t.append(t)
        shown_r.append(r)
    assert "".join(shown_t) == s.thinking and "".join(shown_r) == s.content
    return s.thinking, s.content


# -- the splitter ---------------------------------------------------------------------------------


@pytest.mark.parametrize("inside", [False, True])
def test_every_split_into_two_and_three_pieces(inside):
    text = RAW if not inside else RAW[len("<think>\n"):]  # the prompt opened the block
    n = len(text)
    for cuts in itertools.chain(((i,) for i in range(n + 1)), itertools.combinations(range(0, n + 1, 3), 2)):
        for final_empty in (True, False):
            assert _run(_pieces(text, cuts), inside, final_empty) == (REASONING, ANSWER), cuts


def test_one_character_at_a_time_and_tags_as_single_tokens():
    assert _run(list(RAW)) == (REASONING, ANSWER)
    assert _run(["<think>", "\n", REASONING, "\n", "</think>", "\n\n", ANSWER]) == (REASONING, ANSWER)
    assert _run(["<think>", "\n", REASONING, "</think>", ANSWER], inside=True) == (REASONING, ANSWER)  # opened twice
    assert _run(["\n", REASONING, "\n</think>\n\n", ANSWER], inside=True) == (REASONING, ANSWER)


@pytest.mark.parametrize("text", ["Hello there.", "  \n<thinking> is not a tag", "<", "<thi", " ",
                                  "a <think>later</think> is text", "", "\n\nHi\n"])
def test_text_without_a_leading_block_passes_through_byte_for_byte(text):
    n = len(text)
    for cuts in itertools.chain([()], ((i,) for i in range(n + 1)), itertools.combinations(range(n + 1), 2)):
        assert _run(_pieces(text, cuts)) == ("", text)


def test_edge_cases():
    assert split_think("<think>\nnever closed\n") == ("never closed", "")  # all reasoning, as llama.cpp
    assert split_think("still thinking", inside=True) == ("still thinking", "")
    assert split_think("<think></think>\n\nHi") == ("", "Hi")  # an empty block (GLM's no-think form)
    assert split_think("\n\n<think>a</think>b") == ("a", "b")
    assert split_think("<think>a</think>b</think>c") == ("a", "b</think>c")
    s = ThinkStream()
    assert s.feed("<think>a  ") == ("a", "") and s.feed("\n") == ("", "")  # blanks wait for what follows
    assert s.feed("b") == ("  \nb", "")


def test_which_models_and_prompts():
    class M:
        def __init__(self, t):
            self.chat_template = t

    assert all(uses_think(M(template(n))) for n in (QWEN3, GLM46, QWEN35, R1))
    plain = onebit.load(fixture_path("qwen3moe-f32.gguf"), backend="numpy")
    assert not uses_think(plain) and not uses_think(M(None))
    assert think_stream(plain, plain.chat_tokens([{"role": "user", "content": "<think>"}])) is None
    hi = [{"role": "user", "content": "Hi"}]
    opens = {n: prompt_opens_think(render_chat(template(n), hi, bos_token="<bos>")) for n in (QWEN3, GLM46, QWEN35)}
    assert opens == {QWEN3: False, GLM46: False, QWEN35: True}
    assert not prompt_opens_think(render_chat(template(QWEN35), hi, enable_thinking=False))


# -- history: the stored turn renders as the raw reply would ------------------------------------


def _plain_jinja(source: str, messages, add_generation_prompt: bool) -> str:
    """The template rendered by jinja2 set up as transformers' apply_chat_template sets it."""
    def raise_exception(msg):
        raise jinja2.exceptions.TemplateError(msg)

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                       extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, separators=None, sort_keys=False: json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(source).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                          bos_token="<bos>", eos_token="<eos>")


@pytest.mark.parametrize("name", [QWEN3, GLM46, QWEN35, R1])
@pytest.mark.parametrize("last", [False, True])
def test_stored_turn_renders_as_the_template_parses_the_raw_reply(name, last):
    reasoning, answer = split_think(RAW)
    stored = {"role": "assistant", "content": answer, "reasoning_content": reasoning}
    raw = {"role": "assistant", "content": RAW}
    head = [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Hi"}]
    tail = [] if last else [{"role": "user", "content": "Bye"}]
    src = template(name)
    for gen in (False, True):
        want = _plain_jinja(src, head + [raw] + tail, gen)
        if name == R1:  # its split keeps the blank lines after </think>; the stored reply has none
            want = want.replace("<｜Assistant｜>\n\n", "<｜Assistant｜>")
        assert render_chat(src, head + [stored] + tail, gen, bos_token="<bos>", eos_token="<eos>") == want
        assert _plain_jinja(src, head + [stored] + tail, gen) == want
        assert ANSWER in want and "</th is text" in want
    # the reasoning of the turn being continued is rendered again where the template keeps it
    # (after the last user message); an earlier turn's is dropped by all but GLM's <think></think>
    assert (REASONING.strip() in _plain_jinja(src, head + [stored] + tail, False)) == (last and name != R1)


# -- the chat and generate plumbing on a fixture with a real template ---------------------------


class Scripted:
    """A sampler that writes a given reply (token by token), whatever the logits."""

    def __init__(self, ids):
        self.ids = list(ids)

    def __call__(self, logits):
        return self.ids.pop(0)


@pytest.fixture(scope="module", params=[QWEN3, QWEN35])
def think_model(request, tmp_path_factory):
    dst = tmp_path_factory.mktemp("think") / f"{request.param}.gguf"
    rewrite(fixture_path("qwen3moe-f32.gguf"), dst, meta={"tokenizer.chat_template": template(request.param)})
    return onebit.load(dst, backend="numpy"), request.param


def _reply(name):
    return RAW[len("<think>\n"):] if name == QWEN35 else RAW  # Qwen3.5's prompt opened the block


def _script(model, text):
    tok = model.tokenizer
    return Scripted(model.tokenize(text, add_special=False) + [tok.token_to_id("<|im_end|>")])


def test_chat_session_splits_and_stores_the_turn(think_model):
    model, name = think_model
    s = ChatSession(model, temperature=0.0, max_tokens=200)
    s.sampler = _script(model, _reply(name))
    got = list(s.send("Hi!"))
    assert len(got) > 20  # the tags arrived in several tokens each
    assert "".join(r.text for r in got) == ANSWER and "".join(r.reasoning for r in got) == REASONING
    assert s.history[-1] == {"role": "assistant", "content": ANSWER, "reasoning_content": REASONING}
    s.sampler = _script(model, "<think>\nok\n</think>\n\nBye." if name == QWEN3 else "ok\n</think>\n\nBye.")
    assert "".join(r.text for r in s.send("Bye")) == "Bye."
    assert 0 < s.last.prompt_tokens_computed < s.last.prompt_tokens  # the cached prompt was reused
    text = model.apply_chat_template(s.messages()[:-1])
    assert f"<|im_start|>assistant\n{ANSWER}<|im_end|>" in text and REASONING not in text


def test_a_model_without_think_tags_is_unchanged():
    model = onebit.load(fixture_path("qwen3moe-f32.gguf"), backend="numpy")
    s = ChatSession(model, temperature=0.0, max_tokens=200)
    s.sampler = _script(model, RAW)
    got = list(s.send("Hi!"))
    assert "".join(r.text for r in got) == RAW and not any(r.reasoning for r in got)
    assert s.history[-1] == {"role": "assistant", "content": RAW}


@pytest.mark.parametrize("show", [False, True])
def test_chat_repl_hides_or_dims_the_reasoning(think_model, monkeypatch, capsys, show):
    model, name = think_model
    out = chat_repl_output(model, _script(model, _reply(name)), monkeypatch, capsys, show)
    assert ANSWER in out and "<think>" not in out and "</think>" not in out
    assert (f"\033[2m{REASONING}\033[0m\n{ANSWER}" in out) == show and ("I greet back" in out) == show
    assert ("(reasoning; --show-reasoning shows it)" in out) == (not show)


@pytest.mark.parametrize("show", [False, True])
def test_generate_keeps_the_reply_and_the_reasoning_per_flag(think_model, monkeypatch, show):
    from onebit.apps import batch
    from onebit import model as model_mod

    model, name = think_model
    monkeypatch.setattr(model_mod, "make_sampler", lambda *a, **kw: _script(model, _reply(name)))
    item = batch.PromptItem("1", 1, prompt="Hi!")
    rec = batch.generate_one(model, item, chat=True, system=None, seed=None, max_tokens=200, show_reasoning=show)
    assert rec["text"] == ANSWER and rec["finish_reason"] == "stop"
    assert rec.get("reasoning") == (REASONING if show else None)
    raw = batch.generate_one(model, item, chat=False, system=None, seed=None, max_tokens=200)
    assert raw["text"] == _reply(name)  # without the chat template nothing is parsed


@pytest.mark.parametrize("show", [False, True])
def test_generate_streamed_prints_the_reply_and_the_reasoning_on_stderr(think_model, monkeypatch, capsys, show):
    from onebit.apps import batch
    from onebit import model as model_mod
    from onebit.cli import main

    model, name = think_model
    monkeypatch.setattr(model_mod, "make_sampler", lambda *a, **kw: _script(model, _reply(name)))
    main._stream_one(model, batch.PromptItem("1", 1, prompt="Hi!"), True, None, None,
                     dict(max_tokens=200, show_reasoning=show))
    out, err = capsys.readouterr()
    assert out == ANSWER + "\n" and (err == REASONING) == show and (err == "") == (not show)


def test_cli_generate_on_a_think_template_runs(tmp_path):
    """The flag reaches the CLI on a model whose template has think tags (its random weights
    write no block, so the text is the reply): one JSON object, `reasoning` present, no traceback."""
    dst = tmp_path / "q.gguf"
    rewrite(fixture_path("qwen3moe-f32.gguf"), dst, meta={"tokenizer.chat_template": template(QWEN3)})
    r = subprocess.run([sys.executable, "-m", "onebit.cli.main", "generate", "--model", str(dst), "--prompt", "Hello",
                        "--max-tokens", "5", "--backend", "numpy", "--json", "--show-reasoning"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert "reasoning" in out and len(out["tokens"]) == 5
