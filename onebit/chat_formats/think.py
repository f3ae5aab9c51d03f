"""`<think> ... </think>` reasoning (Qwen3, GLM-4.5/4.6, Qwen3.5, DeepSeek-R1 distills).

These models write their reasoning in a `<think>` block before the reply. Some chat templates
end the generation prompt with `<think>\\n` already (Qwen3.5, thinking on), so the reply starts
inside the block and only `</think>` is to come. `ThinkStream` splits the streamed text into
the reasoning and the reply, with HarmonyStream's interface (harmony.py), the way llama.cpp's
`--reasoning-format deepseek` does: a block counts only at the start of the reply, the blank
lines around the reasoning and before the reply are dropped, and a block that never closes is
all reasoning. Text that does not open with a block (and a prompt that did not open one) passes
through byte for byte.

Whether a model is one of these is read from its chat template: it mentions both tags. The
assistant turn goes back into the history as those templates expect it: `content` the reply,
`reasoning_content` the reasoning (each template decides whether to render it again).
"""

from __future__ import annotations

from typing import Optional

from .harmony import HarmonyStream, ReasoningStream, is_harmony

OPEN, CLOSE = "<think>", "</think>"


def uses_think(model) -> bool:
    """Whether the model's chat template writes `<think>` blocks."""
    template = model.chat_template or ""
    return OPEN in template and CLOSE in template


def prompt_opens_think(prompt_text: str) -> bool:
    """Whether a rendered generation prompt ends inside an open `<think>` block."""
    return prompt_text.rstrip().endswith(OPEN)


def think_stream(model, prompt_ids) -> Optional["ThinkStream"]:
    """A splitter for the reply to `prompt_ids` (a rendered chat prompt), or None when the
    model's template has no think tags."""
    if not uses_think(model):
        return None
    tail = model.detokenize(list(prompt_ids)[-8:]) if len(prompt_ids) else ""
    return ThinkStream(inside=prompt_opens_think(tail))


def reply_splitter(model, prompt_ids, constrained: bool = False) -> Optional[ReasoningStream]:
    """What splits a chat reply to `prompt_ids` (a rendered chat prompt) into reasoning and
    reply, for every caller (chat, generate, serve, batch): harmony channels where the model
    writes them (gpt-oss), else a `<think>` block where its template has the tags, unless a
    grammar constrains the reply from its first token (`constrained`: no block can open);
    None: the text is all reply."""
    if is_harmony(model):
        return HarmonyStream()
    if constrained:
        return None
    return think_stream(model, prompt_ids)


def _held(buf: str, tag: str) -> int:
    """How many characters at the end of buf could be the start of tag."""
    for k in range(min(len(tag) - 1, len(buf)), 0, -1):
        if tag.startswith(buf[-k:]):
            return k
    return 0


class ThinkStream(ReasoningStream):
    """Feed the reply's text as it streams; each `feed` returns (reasoning, reply) text to show."""

    def __init__(self, inside: bool = False):
        super().__init__()
        self.inside = inside  # the prompt opened the block
        self.state = "start"  # start | think | after | reply
        self.lead = True  # no reasoning text shown yet (its leading blank lines are dropped)

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        """Add streamed text (final: no more comes, so nothing is held back)."""
        self.buf += text
        think, say = [], []
        while True:
            if self.state == "start":
                head = self.buf.lstrip()
                if head.startswith(OPEN):  # the block opens (again, where the prompt opened it)
                    self.buf, self.state = head[len(OPEN):], "think"
                    continue
                if not final and OPEN.startswith(head):  # nothing yet, or the tag's first characters
                    break
                if self.inside:
                    self.state = "think"
                    continue
                self.state = "reply"  # no block: the text as it is
                continue
            if self.state == "think":
                if self.lead:
                    self.buf = self.buf.lstrip()
                i = self.buf.find(CLOSE)
                if i >= 0:
                    think.append(self.buf[:i].rstrip())
                    self.buf, self.state = self.buf[i + len(CLOSE):], "after"
                    continue
                if final:
                    part, self.buf = self.buf.rstrip(), ""
                else:
                    keep = self.buf[: len(self.buf) - _held(self.buf, CLOSE)]
                    part = keep.rstrip()  # trailing blanks wait: they go if the block ends next
                    self.buf = self.buf[len(part):]
                if part:
                    self.lead = False
                    think.append(part)
                break
            if self.state == "after":
                self.buf = self.buf.lstrip()
                if self.buf:
                    self.state = "reply"
                    continue
                break
            say.append(self.buf)  # reply
            self.buf = ""
            break
        t, s = "".join(think), "".join(say)
        self.reasoning.append(t)
        self.reply.append(s)
        return t, s


def split_think(text: str, inside: bool = False) -> tuple[str, str]:
    """(reasoning, reply) of a whole reply."""
    s = ThinkStream(inside)
    s.feed(text, final=True)
    return s.thinking, s.content
