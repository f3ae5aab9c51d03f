"""Chat templates: the Jinja template in a GGUF file turned into a prompt string.

Templates come from files anyone can publish, so they run in jinja2's immutable sandbox with
the same environment HF transformers gives them (trim_blocks, lstrip_blocks, loop controls,
`raise_exception`, `strftime_now`, a `tojson` that keeps non-ASCII text), plus bounds the
sandbox lacks: touching an unsafe attribute is an error rather than an empty string, string
and list growth (`*`, `+`, `%`, padding methods and filters) and the output are capped.

A render runs in a worker process (one per onebit process, started at the first render and
kept), because one C-level call (`sum` of lists, `join`, `format`) can run for minutes or take
gigabytes where no Python-level check can step in. The worker has an address-space limit of
`RENDER_MEMORY` beyond what it holds between renders and a CPU-time limit; the caller kills it
past `timeout_s` of wall-clock time and starts a fresh one at the next render. A turn costs one
round trip over a pipe (requests pickled in, replies as JSON out: the worker is never trusted
with code in the caller). Every failure is one `TemplateError` that names the file and the
problem (and the limit, when one was hit).
"""

from __future__ import annotations

import atexit
import datetime as _dt
import json
import math
import os
import pickle
import re
import select
import signal
import string
import struct
import subprocess
import sys
import threading
import time
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

from ..errors import TemplateError

# HF transformers' default template, which llama.cpp also falls back to.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Gemma's turns, for Gemma files converted without their template: a system message opens the
# first user turn, the assistant's role is "model".
GEMMA_TEMPLATE = (
    "{{ bos_token }}"
    "{% set ns = namespace(system='') %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{% set ns.system = message['content'] + '\n\n' %}"
    "{% else %}"
    "{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role']) + '\n' }}"
    "{% if message['role'] == 'user' %}{{ ns.system }}{% set ns.system = '' %}{% endif %}"
    "{{ message['content'] | trim + '<end_of_turn>\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)


def fallback_template(tokens) -> tuple[str, str]:
    """(name, template) for a file without a chat template: Gemma's turns where the vocabulary
    has their markers, else ChatML."""
    if tokens is not None and "<start_of_turn>" in tokens and "<end_of_turn>" in tokens:
        return "Gemma turns", GEMMA_TEMPLATE
    return "ChatML", CHATML_TEMPLATE


MIN_OUTPUT_CHARS = 1 << 20  # a render may always produce this much
TIMEOUT_S = 10.0  # wall-clock seconds a render may take
RENDER_MEMORY = 256 << 20  # bytes of address space a render may add to the worker
WORKER_START_S = 60.0  # the worker's start (an interpreter and jinja2) on a loaded machine

_PERCENT_SPEC = re.compile(r"%(?:\([^)]*\))?[#0\- +]*(\*|\d+)?(?:\.(\*|\d+))?")


class _Raised(Exception):
    """raise_exception() called by the template."""


def _raise_exception(message: Any = "") -> None:
    raise _Raised(str(message))


def _strftime_now(fmt: str) -> str:
    # the caller's clock when it asked for the render (the worker renders it)
    return (getattr(_state, "now", None) or datetime.now()).strftime(str(fmt))


def _tojson(value: Any, ensure_ascii: bool = False, indent: Any = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    # HF's override: Jinja's own tojson HTML-escapes and always sorts keys.
    width = indent if isinstance(indent, int) else len(indent) if isinstance(indent, str) else 0
    if width > 64:  # each nesting level repeats it on every line
        raise _TooBig(f"tojson indent {width} is too large")
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                      separators=separators, sort_keys=sort_keys)


class _GenerationTag(Extension):
    """HF's {% generation %}...{% endgeneration %} marks assistant text; here it just renders it."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


class _Env(ImmutableSandboxedEnvironment):
    """The sandbox, with growth caps. `limit` is set per render (see `_limit`)."""

    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def unsafe_undefined(self, obj: Any, attribute: str):
        raise SecurityError(
            f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe"
        )

    def call_binop(self, context, operator: str, left: Any, right: Any) -> Any:
        limit = _limit()
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(n, int):
                    _check(len(seq) * max(n, 0), limit)
        elif operator == "**":
            if isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and right > 0:
                _check(right * abs(left).bit_length() // 8, limit)
        elif operator == "%" and isinstance(left, str):
            _check_percent(left, right, limit)
        result = super().call_binop(context, operator, left, right)
        if isinstance(result, (str, list, tuple)):
            _check(len(result), limit)
        return result

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja's signature)
        owner = getattr(__obj, "__self__", None)
        if isinstance(owner, str):
            _check_str_method(owner, getattr(__obj, "__name__", ""), args, kwargs, _limit())
        result = super().call(__context, __obj, *args, **kwargs)
        if isinstance(result, (str, list, tuple)):
            _check(len(result), _limit())
        return result

    def wrap_str_format(self, value: Any):
        wrapper = super().wrap_str_format(value)
        if wrapper is None:
            return None
        fmt = value.__self__

        def guarded(*args: Any, **kwargs: Any) -> str:
            _check_format_string(fmt, _limit())
            return wrapper(*args, **kwargs)

        return guarded


_state = threading.local()


def _limit() -> int:
    return getattr(_state, "limit", MIN_OUTPUT_CHARS)


class _TooBig(Exception):
    pass


def _check(size: int, limit: int) -> None:
    if size > limit:
        raise _TooBig(f"the template tried to build a value of {size} characters (limit {limit})")


def _check_str_method(s: str, name: str, args: tuple, kwargs: dict, limit: int) -> None:
    if name in ("center", "ljust", "rjust", "zfill") and args and isinstance(args[0], int):
        _check(args[0], limit)
    elif name == "expandtabs":
        size = args[0] if args else kwargs.get("tabsize", 8)
        if isinstance(size, int):
            _check(len(s) + s.count("\t") * size, limit)
    elif name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
        hits = s.count(args[0]) if args[0] else len(s) + 1
        _check(len(s) + hits * max(len(args[1]) - len(args[0]), 0), limit)


def _check_format_string(fmt: str, limit: int) -> None:
    try:
        fields = list(string.Formatter().parse(fmt))
    except ValueError:
        return  # str.format raises the same error itself
    for _, _, spec, _ in fields:
        if spec and "{" in spec:
            raise _TooBig("the template uses a computed width in str.format")
        for width in re.findall(r"\d+", spec or ""):
            _check(int(width), limit)


def _check_percent(fmt: str, args: Any, limit: int) -> None:
    for star_or_width, precision in _PERCENT_SPEC.findall(fmt):
        if star_or_width == "*" or precision == "*":
            raise _TooBig("the template uses a computed width in % formatting")
        for n in (star_or_width, precision):
            if n:
                _check(int(n), limit)


def _guard_filters(env: _Env) -> None:
    """Wrap the built-in filters that can blow a short input up into a huge output."""
    center, indent, fmt, wordwrap, replace, batch, slice_ = (
        env.filters[k] for k in ("center", "indent", "format", "wordwrap", "replace", "batch", "slice"))

    def g_center(value, width=80):
        _check(int(width), _limit())
        return center(value, width)

    def g_indent(s, width=4, *args, **kwargs):
        if isinstance(width, int):
            _check(len(str(s)) + (str(s).count("\n") + 1) * width, _limit())
        elif isinstance(width, str):
            _check(len(str(s)) + (str(s).count("\n") + 1) * len(width), _limit())
        return indent(s, width, *args, **kwargs)

    def g_format(value, *args, **kwargs):
        _check_percent(str(value), args, _limit())
        return fmt(value, *args, **kwargs)

    def g_wordwrap(environment, s, width=79, break_long_words=True, wrapstring=None, **kwargs):
        if wrapstring is not None:
            _check(len(str(s)) * (len(str(wrapstring)) + 1), _limit())
        return wordwrap(environment, s, width, break_long_words, wrapstring, **kwargs)

    def g_replace(eval_ctx, s, old, new, count=None):
        _check_str_method(str(s), "replace", (str(old), str(new)), {}, _limit())
        return replace(eval_ctx, s, old, new, count)

    def g_batch(value, linecount, fill_with=None):
        if fill_with is not None:  # pads the last batch up to linecount items
            _check(int(linecount), _limit())
        return batch(value, linecount, fill_with)

    def g_slice(value, slices, fill_with=None):  # makes `slices` lists, however short value is
        _check(int(slices), _limit())
        return slice_(value, slices, fill_with)

    g_wordwrap.jinja_pass_arg = wordwrap.jinja_pass_arg  # type: ignore[attr-defined]
    g_replace.jinja_pass_arg = replace.jinja_pass_arg  # type: ignore[attr-defined]
    env.filters.update(center=g_center, indent=g_indent, format=g_format, wordwrap=g_wordwrap,
                       replace=g_replace, batch=g_batch, slice=g_slice)


@lru_cache(maxsize=1)
def _environment() -> _Env:
    env = _Env(trim_blocks=True, lstrip_blocks=True,
               extensions=[_GenerationTag, "jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)
    env.globals.pop("lipsum", None)  # lipsum(n=10**9) is a one-call memory bomb
    _guard_filters(env)
    return env


@lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    return _environment().from_string(template)


def _size_of(value: Any) -> int:
    try:
        return len(json.dumps(value, ensure_ascii=False, default=str))
    except (TypeError, ValueError, RecursionError):
        return 0


def render_chat(
    template: str | None,
    messages: list[dict],
    add_generation_prompt: bool = True,
    bos_token: str = "",
    eos_token: str = "",
    source: str = "<gguf>",
    *,
    tools: list | None = None,
    max_output_chars: int | None = None,
    timeout_s: float = TIMEOUT_S,
    **extra: Any,
) -> str:
    """Render `messages` with the model's chat template (ChatML when the file has none).

    `extra` is passed to the template as variables (e.g. `enable_thinking=False`). The output
    may be at most `max_output_chars` long (default: 1 MiB plus 8x the size of the input); the
    render may take `timeout_s` seconds and `RENDER_MEMORY` bytes (in the worker process).
    """
    if template is None or not str(template).strip():
        template = CHATML_TEMPLATE
    context = dict(extra)
    context.update(messages=messages, add_generation_prompt=add_generation_prompt,
                   bos_token=bos_token, eos_token=eos_token, tools=tools)
    limit = max_output_chars or MIN_OUTPUT_CHARS + 8 * (_size_of(messages) + _size_of(tools)
                                                        + _size_of(extra))
    try:
        now = datetime.now()  # as a plain datetime (tests put a subclass in `datetime`):
        now = _dt.datetime(now.year, now.month, now.day, now.hour, now.minute, now.second, now.microsecond)
        request = pickle.dumps((str(template), context, limit, source, timeout_s, now), pickle.HIGHEST_PROTOCOL)
    except (pickle.PicklingError, TypeError, AttributeError, RecursionError) as e:
        raise TemplateError(f"{source}: the messages cannot be passed to the chat template ({e})") from None
    return _WORKER.render(request, timeout_s, source)


def render_here(template: str, context: dict, limit: int, source: str, now: datetime | None = None) -> str:
    """The render itself, in this process and without the time and memory limits (the worker
    calls it; `bench/bench_template.py` compares it with a round trip)."""

    def render() -> str:
        _state.limit, _state.now = limit, now
        tpl = _compile(template)
        chunks, size = [], 0
        for chunk in tpl.generate(**context):
            size += len(chunk)
            _check(size, limit)
            chunks.append(chunk)
        return "".join(chunks)

    try:
        return render()
    except jinja2.TemplateSyntaxError as e:
        raise TemplateError(
            f"{source}: the chat template has a syntax error at line {e.lineno}: {e.message}; "
            "fix the template or pass one of your own"
        ) from None
    except _Raised as e:
        raise TemplateError(f"{source}: the chat template refused these messages: {e}") from None
    except SecurityError as e:
        raise TemplateError(
            f"{source}: the chat template tried to leave its sandbox ({e}); refusing to use it"
        ) from None
    except _TooBig as e:
        raise TemplateError(f"{source}: the chat template output is too large: {e}") from None
    except OverflowError as e:  # the sandbox's range() limit, among others
        raise TemplateError(f"{source}: the chat template failed: {e}") from None
    except RecursionError:
        raise TemplateError(f"{source}: the chat template recursed too deeply") from None
    except MemoryError:
        raise
    except Exception as e:  # noqa: BLE001 - undefined names, type errors, ... in template code
        raise TemplateError(
            f"{source}: the chat template failed: {type(e).__name__}: {e}"
        ) from None


# -- the worker process ---------------------------------------------------------------------
# Frames on its pipes: an 8-byte little-endian length, then the body.


def _memory_message(source: str) -> str:
    return (f"{source}: the chat template needed more than {RENDER_MEMORY >> 20} MB of memory (the limit for "
            "one render); fix the template or pass one of your own")


def _timeout_message(source: str, timeout_s: float) -> str:
    return (f"{source}: the chat template did not finish within {timeout_s:g} s (the limit for one render; a "
            "runaway loop?); fix the template or pass one of your own")


def _serve() -> None:
    """The worker's loop: read a request, render it under the limits, write the reply as JSON.
    Exits at the end of its input, and after a render that ran out of memory."""
    import resource

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the caller decides when a render stops
    inp, out = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing but replies on the pipe
    out.write(b"ready\n")
    out.flush()
    page = os.sysconf("SC_PAGE_SIZE")
    while True:
        head = inp.read(8)
        if len(head) < 8:
            return
        try:
            template, context, limit, source, timeout_s, now = pickle.loads(inp.read(struct.unpack("<Q", head)[0]))
        except Exception as e:  # noqa: BLE001 - e.g. a class only the caller can import
            body = json.dumps({"error": f"the chat template worker cannot read the messages ({e})"}).encode()
            out.write(struct.pack("<Q", len(body)) + body)
            out.flush()
            continue
        with open("/proc/self/statm", "rb") as f:
            vm = int(f.read().split()[0]) * page
        resource.setrlimit(resource.RLIMIT_AS, (vm + RENDER_MEMORY, resource.RLIM_INFINITY))
        # CPU time as a backstop to the caller's clock (SIGXCPU ends the worker if the caller is gone)
        used = resource.getrusage(resource.RUSAGE_SELF)
        cpu = math.ceil(used.ru_utime + used.ru_stime + timeout_s) + 2
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, resource.RLIM_INFINITY))
        exhausted = False
        try:
            reply = {"text": render_here(template, context, limit, source, now)}
        except TemplateError as e:
            reply = {"error": str(e)}
        except MemoryError:
            exhausted = True
        del template, context
        if exhausted:
            reply = {"error": _memory_message(source)}
        resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        body = json.dumps(reply, ensure_ascii=False).encode("utf-8", "surrogatepass")
        out.write(struct.pack("<Q", len(body)) + body)
        out.flush()
        if exhausted:
            return  # a fresh worker for the next render: memory may be fragmented


class _Worker:
    """The caller's side: one worker process, started at the first render, restarted after a
    render that it had to stop; renders from several threads take turns."""

    def __init__(self):
        self.proc: subprocess.Popen | None = None
        self.lock = threading.Lock()
        self.started = 0  # processes started (tests and the soak check read it)
        self.owner = os.getpid()

    def render(self, request: bytes, timeout_s: float, source: str) -> str:
        with self.lock:
            if self.owner != os.getpid():  # a forked child: the worker's pipes belong to the parent
                self.proc, self.owner = None, os.getpid()
            try:
                if self.proc is None or self.proc.poll() is not None:
                    self._start(source)
                self.proc.stdin.write(struct.pack("<Q", len(request)) + request)
                self.proc.stdin.flush()
                body = self._read_frame(timeout_s)
            except BaseException:  # a stopped render, an interrupt, a broken pipe: the worker goes
                self.stop()
                raise
            if body is None:
                self.stop()
                raise TemplateError(_timeout_message(source, timeout_s))
            if body == b"":
                rc = self.stop()
                if rc == -signal.SIGXCPU:
                    raise TemplateError(_timeout_message(source, timeout_s))
                raise TemplateError(f"{source}: the chat template worker stopped ({_how(rc)}); fix the template "
                                    "or pass one of your own")
            reply = json.loads(body)
            if "error" in reply:
                if reply["error"] == _memory_message(source):
                    self.stop()
                raise TemplateError(reply["error"])
            return reply["text"]

    def _start(self, source: str) -> None:
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # (above onebit/)
        code = "import sys; sys.path.insert(0, sys.argv[1]); from onebit.chat_formats.chat_template import _serve; _serve()"
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", code, root], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL, start_new_session=True)
        except OSError as e:
            raise TemplateError(f"{source}: cannot start the chat template worker ({e.strerror or e})") from None
        self.started += 1
        ready = _read_exact(self.proc.stdout, len(b"ready\n"), time.monotonic() + WORKER_START_S)
        if ready != b"ready\n":
            rc = self.stop()
            raise TemplateError(f"{source}: the chat template worker did not start ({_how(rc)})")

    def _read_frame(self, timeout_s: float) -> bytes | None:
        """The next reply; None past the deadline, b"" if the worker died."""
        deadline = time.monotonic() + timeout_s
        head = _read_exact(self.proc.stdout, 8, deadline)
        if not head:
            return head
        return _read_exact(self.proc.stdout, struct.unpack("<Q", head)[0], deadline)

    def stop(self) -> int | None:
        """End the worker (if any); its exit status."""
        proc, self.proc = self.proc, None
        if proc is None or self.owner != os.getpid():
            return None
        if proc.poll() is None:
            proc.kill()
        rc = proc.wait()
        proc.stdin.close()
        proc.stdout.close()
        return rc


def _how(rc: int | None) -> str:
    if rc is None:
        return "no reply"
    return f"signal {signal.Signals(-rc).name}" if rc < 0 else f"exit status {rc}"


def _read_exact(stream, n: int, deadline: float) -> bytes | None:
    """n bytes from a pipe by `deadline`; None if time ran out, b"" at end of file."""
    fd, chunks, got = stream.fileno(), [], 0
    while got < n:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            return None
        chunk = os.read(fd, min(n - got, 1 << 20))
        if not chunk:
            return b""
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


_WORKER = _Worker()
atexit.register(_WORKER.stop)
