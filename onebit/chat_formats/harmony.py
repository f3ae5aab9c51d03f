"""OpenAI's harmony format (gpt-oss): a reply is a run of messages, each on a channel.

The chat template ends the prompt with `<|start|>assistant`; the model then writes
`<|channel|>analysis<|message|>...<|end|>` (its reasoning), `<|start|>assistant<|channel|>final
<|message|>...` (the reply) and stops with `<|return|>` (or `<|call|>` after a tool call on the
`commentary` channel; `<|end|>` only ends one message). The stop tokens themselves are the
vocabulary's end-of-generation tokens (see tokenizer.py: `<|end|>` is not one of them).

`HarmonyStream` splits the streamed text into the reasoning (`analysis`) and what the user
sees (`final`, and `commentary` without a recipient: a preamble). Text before any channel
header (a model that ignores the format) counts as the reply. The assistant turn goes back
into the history as the gpt-oss template expects it: `content` the final text, `thinking` the
analysis (the template drops the thinking of earlier turns itself).
"""

from __future__ import annotations

START, CHANNEL, MESSAGE, END = "<|start|>", "<|channel|>", "<|message|>", "<|end|>"
RETURN, CALL, CONSTRAIN = "<|return|>", "<|call|>", "<|constrain|>"
MARKERS = (START, CHANNEL, MESSAGE, END, RETURN, CALL, CONSTRAIN)


def is_harmony(model) -> bool:
    """Whether the model's chat template writes harmony messages (and its vocabulary has them)."""
    template = model.chat_template or ""
    tok = model.tokenizer
    return CHANNEL in template and MESSAGE in template and all(
        tok.token_to_id(m) is not None for m in (START, CHANNEL, MESSAGE, END))


class ReasoningStream:
    """What a reply splitter (harmony channels here, `<think>` blocks in think.py; which one a
    model gets: think.reply_splitter) holds: the text still held back, and the reasoning and
    reply so far. `feed(text, final)` returns the (reasoning, reply) text to show.
    `history_key`: the assistant turn's key for its reasoning, as the chat templates read it."""

    history_key = "reasoning_content"

    def __init__(self):
        self.buf = ""
        self.reasoning: list[str] = []
        self.reply: list[str] = []

    @property
    def thinking(self) -> str:
        return "".join(self.reasoning)

    @property
    def content(self) -> str:
        return "".join(self.reply)


class HarmonyStream(ReasoningStream):
    """Feed the reply's text as it streams; each `feed` returns (reasoning, reply) text to show."""

    history_key = "thinking"  # (the gpt-oss template's)

    def __init__(self):
        super().__init__()
        self.state = "start"  # start | header | content | between | done
        self.header = ""
        self.channel = ""
        self.recipient = False  # the message is addressed (a tool call): neither reasoning nor reply

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        """Add streamed text (final: no more comes, so nothing is held back)."""
        self.buf += text
        think, say = [], []
        while self.buf:
            i = self.buf.find("<|")
            if i < 0:
                if not final and self.buf.endswith("<"):  # maybe a marker's first character
                    if len(self.buf) == 1:
                        break
                    plain, self.buf = self.buf[:-1], "<"
                else:
                    plain, self.buf = self.buf, ""
            elif i > 0:
                plain, self.buf = self.buf[:i], self.buf[i:]
            else:
                marker = next((m for m in MARKERS if self.buf.startswith(m)), None)
                if marker is None:
                    if not final and any(m.startswith(self.buf) for m in MARKERS):
                        break  # the start of a marker: wait for the rest
                    plain, self.buf = "<|", self.buf[2:]
                else:
                    self.buf = self.buf[len(marker):]
                    self._marker(marker)
                    continue
            self._text(plain, think, say)
        t, s = "".join(think), "".join(say)
        self.reasoning.append(t)
        self.reply.append(s)
        return t, s

    def _marker(self, m: str) -> None:
        if m in (RETURN, CALL):
            self.state = "done"
        elif m == END:
            self.state = "between"
        elif m == START:
            self.state, self.header = "header", ""
        elif m == CHANNEL and self.state in ("start", "header", "between"):
            self.state, self.header = "header", CHANNEL
        elif m == MESSAGE and self.state == "header":
            words = self.header.split(CHANNEL, 1)[-1].replace(CONSTRAIN, " ").split()
            self.channel = words[0] if words else ""
            self.recipient = any(w.startswith("to=") for w in words) or "to=" in self.header
            self.state = "content"
        elif self.state == "header":
            self.header += m

    def _text(self, plain: str, think: list, say: list) -> None:
        if self.state == "start":  # no header at all: the model wrote its reply directly
            self.state, self.channel, self.recipient = "content", "final", False
        if self.state == "header":
            self.header += plain
        elif self.state == "content":
            if self.channel == "analysis":
                think.append(plain)
            elif not self.recipient:  # final, or a commentary preamble
                say.append(plain)
        # between messages or after the end: stray text is dropped


def split_reply(text: str) -> tuple[str, str]:
    """(reasoning, reply) of a whole harmony reply."""
    s = HarmonyStream()
    s.feed(text, final=True)
    return s.thinking, s.content
