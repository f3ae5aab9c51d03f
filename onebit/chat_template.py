"""Chat templates: the Jinja template in a GGUF file turned into a prompt string.

Templates come from files anyone can publish, so they run in jinja2's immutable sandbox with
the same environment HF transformers gives them (trim_blocks, lstrip_blocks, loop controls,
`raise_exception`, `strftime_now`, a `tojson` that keeps non-ASCII text), plus bounds the
sandbox lacks: touching an unsafe attribute is an error rather than an empty string, string
and list growth (`*`, `+`, `%`, padding methods and filters) and the output are capped, and a
render that runs past its deadline is stopped. Every failure is one `TemplateError` that names
the file and the problem.
"""

from __future__ import annotations

import ctypes
import json
import re
import string
import threading
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

from .errors import TemplateError

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
TIMEOUT_S = 10.0

_PERCENT_SPEC = re.compile(r"%(?:\([^)]*\))?[#0\- +]*(\*|\d+)?(?:\.(\*|\d+))?")


class _Raised(Exception):
    """raise_exception() called by the template."""


class _Deadline(BaseException):
    """Injected into a render that ran out of time; BaseException so templates can't catch it."""


def _raise_exception(message: Any = "") -> None:
    raise _Raised(str(message))


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(str(fmt))


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


def _run(render, timeout_s: float, source: str) -> str:
    """Run `render` in a worker thread; past the deadline, stop it with an async exception."""
    box: dict[str, Any] = {}

    def work() -> None:
        try:
            box["out"] = render()
        except BaseException as e:  # noqa: BLE001 - handed to the caller below
            box["err"] = e

    worker = threading.Thread(target=work, name="chat-template", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        ctypes.pythonapi.PyThreadState_SetAsyncExc(
            ctypes.c_ulong(worker.ident), ctypes.py_object(_Deadline))
        worker.join(1.0)
        raise TemplateError(
            f"{source}: the chat template did not finish within {timeout_s:g} s (a runaway "
            "loop?); fix the template or pass one of your own"
        )
    if "err" in box:
        raise box["err"]
    return box["out"]


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
    may be at most `max_output_chars` long (default: 1 MiB plus 8x the size of the input).
    """
    if template is None or not str(template).strip():
        template = CHATML_TEMPLATE
    context = dict(extra)
    context.update(messages=messages, add_generation_prompt=add_generation_prompt,
                   bos_token=bos_token, eos_token=eos_token, tools=tools)
    limit = max_output_chars or MIN_OUTPUT_CHARS + 8 * (_size_of(messages) + _size_of(tools)
                                                        + _size_of(extra))

    def render() -> str:
        _state.limit = limit
        tpl = _compile(template)
        chunks, size = [], 0
        for chunk in tpl.generate(**context):
            size += len(chunk)
            _check(size, limit)
            chunks.append(chunk)
        return "".join(chunks)

    try:
        return _run(render, timeout_s, source)
    except TemplateError:
        raise
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
    except (_Deadline, MemoryError) as e:
        raise TemplateError(f"{source}: the chat template was stopped ({type(e).__name__})") from None
    except Exception as e:  # noqa: BLE001 - undefined names, type errors, ... in template code
        raise TemplateError(
            f"{source}: the chat template failed: {type(e).__name__}: {e}"
        ) from None
