"""The terminal side of `onebit chat`: read lines, stream replies, handle Ctrl-C and /commands."""

from __future__ import annotations

import os
import sys

HELP = """commands:
  /help    this help
  /reset   forget the conversation
  /stats   speed and memory of the last reply
  /quit    leave (also Ctrl-D, or Ctrl-C twice)
multi-line input: end a line with \\ to continue it, or wrap a block in lines of \"\"\"
  (Ctrl-D inside it cancels the message); start a message with // to send one that begins with /
Ctrl-C while a reply streams stops the reply."""
COMMANDS = ("/help", "/reset", "/stats", "/quit", "/exit", "/q")


def _colour() -> bool:
    return sys.stdout.isatty() and not os.environ.get("NO_COLOR") and os.environ.get("TERM") != "dumb"


class Style:
    def __init__(self, on: bool):
        self.dim = "\033[2m" if on else ""
        self.bold = "\033[1m" if on else ""
        self.reset = "\033[0m" if on else ""


def visible(text: str) -> str:
    """Model output for a terminal: control characters other than newline and tab are shown
    escaped (\\x1b), so generated text cannot move the cursor, clear the screen or retitle the
    window."""
    return "".join(f"\\x{ord(ch):02x}" if _is_control(ch) else ch for ch in text)


def _is_control(ch: str) -> bool:
    o = ord(ch)
    return (o < 0x20 and ch not in "\n\t") or 0x7F <= o < 0xA0


class Cancelled(Exception):
    """Ctrl-D inside a multi-line message: the message is dropped, the chat goes on."""


def read_message(prompt: str) -> str:
    """One user message; raises EOFError / KeyboardInterrupt as input() does at the prompt, and
    Cancelled for Ctrl-D in the middle of a multi-line message."""
    line = input(prompt)
    lines = []
    try:
        if line.strip() == '"""':
            while True:
                nxt = input("... ")
                if nxt.strip() == '"""':
                    return "\n".join(lines)
                lines.append(nxt)
        while line.endswith("\\"):
            lines.append(line[:-1])
            line = input("... ")
    except EOFError:
        raise Cancelled from None
    lines.append(line)
    return "\n".join(lines)


def format_stats(session) -> str:
    import psutil

    from onebit.runner import pool_line

    s = session.last
    rss = psutil.Process().memory_info().rss
    lines = [
        f"last reply: {s.generation_tokens} tokens, finish: {s.finish_reason or '-'}",
        f"prompt: {s.prompt_tokens} tokens ({s.prompt_tokens_computed} computed, "
        f"{s.prompt_tokens - s.prompt_tokens_computed} from cache) in {s.prompt_time:.2f} s, {s.prompt_tps:.1f} tok/s",
        f"decode: {s.generation_time:.2f} s, {s.generation_tps:.1f} tok/s",
        f"conversation: {len(session.prefix.tokens)} tokens in context of {session.model.context_length}, "
        f"{session.total_generated} tokens generated in total",
        f"memory: {rss / 2**20:.1f} MiB resident; model file {session.model.gguf.file_bytes / 2**20:.1f} MiB (mapped)",
        pool_line(session.model.pool, session.model.net.rows_run),
    ]
    if session.lookup:
        lines.append(session.lookup_stats.line() + f" (up to {session.lookup} drafts per forward)")
    if session.model.predictor is not None:
        lines.append(session.model.predictor.table())
    return "\n".join(lines)


def run_chat(model, system=None, show_reasoning: bool = False, **settings) -> None:
    from onebit.apps.chat import ChatSession
    from onebit.errors import OnebitError

    try:
        import readline  # noqa: F401  (line editing and history for input())
    except ImportError:
        pass
    st = Style(_colour())
    session = ChatSession(model, system=system, **settings)
    name = model.gguf.get("general.name") or os.path.basename(model.path)
    print(f"{st.bold}onebit chat{st.reset} {st.dim}- {name} ({model.cfg.arch}, {model.be.name} backend). "
          f"/help for commands, /quit to leave.{st.reset}")
    interrupts = 0
    while True:
        try:
            text = read_message(f"{st.bold}> {st.reset}")
            interrupts = 0
        except Cancelled:
            print(f"\n{st.dim}(message cancelled){st.reset}")
            continue
        except EOFError:
            print()
            return
        except KeyboardInterrupt:
            interrupts += 1
            if interrupts >= 2:
                print()
                return
            print(f"\n{st.dim}(Ctrl-C again or /quit to leave){st.reset}")
            continue
        cmd = text.strip()
        if not cmd:
            continue
        if cmd.startswith("//"):  # a message that starts with /
            text = text.lstrip()[1:]
        elif cmd.startswith("/"):
            word, *rest = cmd.split(maxsplit=1)
            if word not in COMMANDS:
                print(f"{st.dim}unknown command {word}; /help lists them (start a message with // to send "
                      f"it as it is){st.reset}")
                continue
            if rest:
                print(f"{st.dim}{word} takes no arguments{st.reset}")
                continue
            if word in ("/quit", "/exit", "/q"):
                return
            if word == "/help":
                print(HELP)
            elif word == "/reset":
                session.reset()
                print(f"{st.dim}(conversation cleared){st.reset}")
            elif word == "/stats":
                print(format_stats(session))
            continue
        try:
            replies = session.send(text)
            first, thought = True, False
            for r in replies:
                if first and session.last.dropped_turns:
                    print(f"{st.dim}(context full: dropped the {session.last.dropped_turns} oldest "
                          f"exchange(s)){st.reset}")
                first = False
                if r.reasoning and not thought:  # harmony's analysis channel or a <think> block: dimmed or hidden
                    thought = True
                    if not show_reasoning:
                        sys.stdout.write(f"{st.dim}(reasoning; --show-reasoning shows it){st.reset}")
                if r.reasoning and show_reasoning:
                    sys.stdout.write(f"{st.dim}{visible(r.reasoning)}{st.reset}")
                if r.text:
                    if thought:
                        sys.stdout.write("\n")
                        thought = False
                    sys.stdout.write(visible(r.text))
                sys.stdout.flush()
            if session.last.finish_reason == "length":
                sys.stdout.write(f"\n{st.dim}(reply cut at --max-tokens or the context limit){st.reset}")
            sys.stdout.write("\n")
        except KeyboardInterrupt:
            replies.close()
            sys.stdout.write(f"\n{st.dim}(reply stopped){st.reset}\n")
        except OnebitError as e:
            if session.history and session.history[-1] == {"role": "assistant", "content": ""}:
                session.history.pop()  # the placeholder of a reply that never started
            print(f"onebit: error: {e}", file=sys.stderr)
