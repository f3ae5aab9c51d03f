"""The HTTP side of `onebit serve`: the OpenAI API routes (FastAPI on uvicorn), requests
checked into `serve.Work`, the engine's events turned into responses or SSE chunks.

Every error is an OpenAI-style object `{"error": {"message", "type", "param", "code"}}` with a
4xx status for anything the request got wrong, and one line in the log per request.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from typing import Any, Callable, Literal, Optional, Sequence, Union

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from .. import __version__
from ..errors import OnebitError
from .serve import ApiError, Delta, Done, Engine, Sampling, Work, new_id, now

log = logging.getLogger("onebit.apps.serve")

MAX_BODY = 32 << 20  # bytes of a request body, however it is sent (Content-Length or chunked)
HEAD_TIMEOUT_S = 10.0  # a request's line and headers arrive within this, or the connection closes
BODY_TIMEOUT_S = 30.0  # each part of a body arrives within this of the last, or 408
MAX_CONNECTIONS = 64  # open connections; a request beyond them gets 503
FINGERPRINT = f"onebit-{__version__}"


# -- request bodies ------------------------------------------------------------------------

class _Strict(BaseModel):
    model_config = ConfigDict(extra="allow")  # kept to be named in the log, then ignored (unknown_fields)


class _Loose(BaseModel):
    model_config = ConfigDict(extra="ignore")  # clients echo back fields of our own replies


class FunctionCall(_Loose):
    name: str
    arguments: Union[str, dict] = "{}"


class ToolCallIn(_Loose):
    id: Optional[str] = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ContentPart(_Loose):
    type: str
    text: Optional[str] = None


class Message(_Loose):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[ContentPart], None] = None
    name: Optional[str] = None
    tool_calls: Optional[list[ToolCallIn]] = None
    tool_call_id: Optional[str] = None
    reasoning_content: Optional[str] = None


class StreamOptions(_Strict):
    include_usage: bool = False


class JsonSchemaSpec(_Loose):
    name: str = "response"
    schema_: Optional[dict] = Field(None, alias="schema")
    strict: Optional[bool] = None
    description: Optional[str] = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaSpec] = None


class _Sampling(_Strict):
    model: Optional[str] = None
    temperature: Optional[float] = Field(None, ge=0, le=2)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    top_k: Optional[int] = Field(None, ge=0)
    min_p: Optional[float] = Field(None, ge=0, le=1)
    seed: Optional[int] = None
    stop: Union[str, list[str], None] = None
    presence_penalty: Optional[float] = Field(None, ge=-2, le=2)
    frequency_penalty: Optional[float] = Field(None, ge=-2, le=2)
    repeat_penalty: Optional[float] = Field(None, gt=0)  # llama-server's name
    logit_bias: Optional[dict[str, float]] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    n: Optional[int] = None
    logprobs: Optional[Union[bool, int]] = None
    top_logprobs: Optional[int] = None
    user: Optional[str] = None
    cache_prompt: Optional[bool] = None  # llama-server's; the prompt cache is always on


class ChatRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    max_tokens: Optional[int] = Field(None, ge=0)
    max_completion_tokens: Optional[int] = Field(None, ge=0)
    response_format: Optional[ResponseFormat] = None
    tools: Optional[list[dict]] = None
    tool_choice: Union[Literal["none", "auto", "required"], dict, None] = None
    parallel_tool_calls: Optional[bool] = None
    reasoning_effort: Optional[str] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    metadata: Optional[dict] = None
    store: Optional[bool] = None
    service_tier: Optional[str] = None


class CompletionRequest(_Sampling):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: Optional[int] = Field(16, ge=0)
    echo: Optional[bool] = None
    suffix: Optional[str] = None
    best_of: Optional[int] = None


def unknown_fields(req: BaseModel, where: str = "") -> list[str]:
    """The fields of a request (its nested objects too) that no model here declares: ignored,
    as llama-server and ollama ignore them, and named in one warning line."""
    found = [f"{where}{k}" for k in (req.model_extra or {}) if isinstance(req, _Strict)]
    for name in type(req).model_fields:
        value = getattr(req, name)
        for i, v in enumerate(value if isinstance(value, list) else [value]):
            if isinstance(v, BaseModel):
                index = f"[{i}]" if isinstance(value, list) else ""
                found += unknown_fields(v, f"{where}{name}{index}.")
    return found


def warn_unknown(req: BaseModel, path: str) -> None:
    names = unknown_fields(req)
    if names:
        log.warning("%s: ignored unknown request fields: %s", path, ", ".join(names))


def close_objects(schema: Any) -> Any:
    """`schema` with `"additionalProperties": false` on every object schema that lists
    `properties` and does not say (llama-server reads a missing one as false): a constrained
    reply then stops after the keys the client named instead of inventing more."""
    if isinstance(schema, list):
        return [close_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for k, v in schema.items():
        if k in ("properties", "patternProperties", "$defs", "definitions") and isinstance(v, dict):
            out[k] = {name: close_objects(sub) for name, sub in v.items()}
        elif k in ("items", "prefixItems", "anyOf", "oneOf", "additionalProperties", "not", "then", "else",
                   "if", "contains"):
            out[k] = close_objects(v)
        else:
            out[k] = v  # (allOf members are merged: each stays open)
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


# -- requests to work ----------------------------------------------------------------------

MAX_N = 16  # choices of one request
MAX_TOP_LOGPROBS = 20


def _sampling(req: _Sampling, defaults: Sampling, vocab: int) -> Sampling:
    if req.n is not None and not 1 <= req.n <= MAX_N:
        raise ApiError(f"n must be 1-{MAX_N}", param="n")
    if req.n not in (None, 1) and req.stream:
        raise ApiError("n > 1 is served without streaming: set stream to false", param="n")
    bias = {}
    for k, v in (req.logit_bias or {}).items():
        try:
            t = int(k)
        except ValueError:
            raise ApiError(f"logit_bias keys are token ids, got {k!r}", param="logit_bias") from None
        if not 0 <= t < vocab or not -100 <= v <= 100:
            raise ApiError(f"logit_bias {k}: token id within the vocabulary ({vocab}) and bias in [-100, 100]",
                           param="logit_bias")
        bias[t] = v
    pick = lambda value, default: default if value is None else value  # noqa: E731
    return Sampling(
        temperature=pick(req.temperature, defaults.temperature), top_p=pick(req.top_p, defaults.top_p),
        top_k=pick(req.top_k, defaults.top_k), min_p=pick(req.min_p, defaults.min_p),
        seed=None if req.seed is None else req.seed % (1 << 64),  # any integer, as OpenAI takes it
        repeat_penalty=pick(req.repeat_penalty, defaults.repeat_penalty),
        presence_penalty=pick(req.presence_penalty, defaults.presence_penalty),
        frequency_penalty=pick(req.frequency_penalty, defaults.frequency_penalty), logit_bias=bias)


def _stops(stop) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > 16 or any(not s for s in stops):
        raise ApiError("stop: at most 16 non-empty strings", param="stop")
    return stops


def _text(content, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for p in content:
        if p.type != "text" or p.text is None:
            raise ApiError(f"{where}: only text content is supported (got a {p.type!r} part)", param="messages")
        parts.append(p.text)
    return "".join(parts)


def _messages(req: ChatRequest) -> list[dict]:
    out = []
    names = {}  # tool_call_id -> function name (templates that show a result's tool by name)
    for i, m in enumerate(req.messages):
        d: dict[str, Any] = {"role": m.role, "content": _text(m.content, f"messages[{i}].content")}
        if m.role == "developer":
            d["role"] = "system"
        if m.name is not None:
            d["name"] = m.name
        if m.reasoning_content:
            d["reasoning_content"] = d["thinking"] = m.reasoning_content  # <think> and gpt-oss templates
        if m.tool_calls:
            if m.role != "assistant":
                raise ApiError(f"messages[{i}]: only assistant messages carry tool_calls", param="messages")
            calls = []
            for c in m.tool_calls:
                args = c.function.arguments
                if isinstance(args, str):
                    try:
                        args = json.loads(args) if args.strip() else {}
                    except ValueError:
                        pass  # a template writes the text as it is
                calls.append({"id": c.id, "type": "function", "function": {"name": c.function.name,
                                                                             "arguments": args}})
                if c.id:
                    names[c.id] = c.function.name
            d["tool_calls"] = calls
        if m.role == "tool":
            if m.tool_call_id is not None:
                d["tool_call_id"] = m.tool_call_id
                if "name" not in d and m.tool_call_id in names:
                    d["name"] = names[m.tool_call_id]
        out.append(d)
    return out


def chat_work(req: ChatRequest, defaults: Sampling, vocab: int) -> Work:
    from ..chat_formats.structured import check_schema
    from ..chat_formats.toolcall import check_tools

    sampling = _sampling(req, defaults, vocab)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    tools, forced, schema = None, None, None
    if req.tools:
        try:
            table = check_tools(req.tools)
        except ValueError as e:
            raise ApiError(str(e), param="tools") from None
        choice = req.tool_choice or "auto"
        if choice != "none":
            tools = req.tools
        if choice == "required":
            forced = table
        elif isinstance(choice, dict):
            function = choice.get("function")
            name = function.get("name") if isinstance(function, dict) else None
            if choice.get("type") != "function" or name not in table:
                raise ApiError("tool_choice must name one of the tools: {\"type\": \"function\", \"function\": "
                               "{\"name\": ...}}", param="tool_choice")
            forced = {name: table[name]}
    elif req.tool_choice not in (None, "none", "auto"):
        raise ApiError("tool_choice needs tools", param="tool_choice")
    fmt = req.response_format
    if fmt is not None and fmt.type != "text":
        if forced is not None:
            raise ApiError("response_format and a required tool call cannot be combined", param="response_format")
        if fmt.type == "json_schema":
            if fmt.json_schema is None or fmt.json_schema.schema_ is None:
                raise ApiError("response_format json_schema needs json_schema.schema", param="response_format")
            schema = fmt.json_schema.schema_
            check_schema(schema, "response_format.json_schema.schema")
        else:
            schema = {}
    kwargs = dict(req.chat_template_kwargs or {})
    if req.reasoning_effort is not None:
        kwargs.setdefault("reasoning_effort", req.reasoning_effort)
    for own in ("messages", "add_generation_prompt", "bos_token", "eos_token", "tools"):
        if own in kwargs:
            raise ApiError(f"chat_template_kwargs cannot set {own}", param="chat_template_kwargs")
    if req.top_logprobs is not None and not 0 <= req.top_logprobs <= MAX_TOP_LOGPROBS:
        raise ApiError(f"top_logprobs must be 0-{MAX_TOP_LOGPROBS}", param="top_logprobs")
    if req.top_logprobs and not req.logprobs:
        raise ApiError("top_logprobs needs logprobs: true", param="top_logprobs")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    if forced is not None:
        forced = {name: close_objects(params) for name, params in forced.items()}
    if schema:
        schema = close_objects(schema)
    return Work(model=req.model, messages=_messages(req), tools=tools, forced_tools=forced, schema=schema,
                template_kwargs=kwargs, sampling=sampling, max_tokens=max_tokens, stop=_stops(req.stop),
                logprobs=logprobs)


def completion_work(req: CompletionRequest, defaults: Sampling, vocab: int) -> Work:
    if req.suffix or req.best_of not in (None, 1, req.n):
        raise ApiError("suffix and best_of are not supported", param="prompt")
    if req.logprobs is not None and not 0 <= int(req.logprobs) <= 5:
        raise ApiError("logprobs must be 0-5 (the alternatives given per token)", param="logprobs")
    if req.echo and req.logprobs is not None:
        raise ApiError("echo with logprobs is not supported (the prompt's logprobs are not computed)",
                       param="echo")
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and not all(isinstance(t, int) for t in prompt):
        if len(prompt) != 1:
            raise ApiError("one prompt per request", param="prompt")
        prompt = prompt[0]
    if isinstance(prompt, str) and not prompt:
        raise ApiError("the prompt is empty", param="prompt")
    if isinstance(prompt, list) and not prompt:
        raise ApiError("the prompt is empty", param="prompt")
    return Work(model=req.model, prompt=prompt, sampling=_sampling(req, defaults, vocab),
                max_tokens=req.max_tokens, stop=_stops(req.stop),
                logprobs=None if req.logprobs is None else int(req.logprobs))


# -- responses -----------------------------------------------------------------------------

def error_body(e: ApiError) -> dict:
    return {"error": {"message": str(e), "type": e.type, "param": e.param, "code": e.code}}


def _usage(done: Done) -> dict:
    return {"prompt_tokens": done.prompt_tokens, "completion_tokens": done.completion_tokens,
            "total_tokens": done.prompt_tokens + done.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": done.cached_tokens}}


def _timings(done: Done) -> dict:
    """llama-server's `timings` (prompt: up to the first token; predicted: the tokens after it)."""
    n = max(done.completion_tokens - 1, 0)
    return {"prompt_n": done.prompt_tokens - done.cached_tokens, "prompt_ms": round(done.prompt_time * 1000, 3),
            "predicted_n": n, "predicted_ms": round(done.generation_time * 1000, 3),
            "predicted_per_second": round(n / done.generation_time, 2) if done.generation_time > 0 and n else 0.0}


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class Run:
    """A submitted job seen from the event loop: its events, and whether its client is gone."""

    def __init__(self, engine: Engine, work: Work, request: Request):
        loop = asyncio.get_running_loop()
        self.events: asyncio.Queue = asyncio.Queue()
        self.request = request
        self.job = engine.submit(work, lambda ev: loop.call_soon_threadsafe(self.events.put_nowait, ev))

    async def next(self) -> Optional[tuple]:
        """The next event; None when the client disconnected (the job is then cancelled)."""
        while True:
            try:
                return await asyncio.wait_for(self.events.get(), 0.5)
            except asyncio.TimeoutError:
                if await self.request.is_disconnected():
                    self.job.cancel()
                    return None

    def cancel(self) -> None:
        self.job.cancel()


class Gone(Exception):
    """The client went away while its request ran (the job is cancelled)."""


async def _start(engine: Engine, work: Work, request: Request) -> tuple[Run, dict]:
    run = Run(engine, work, request)
    first = await run.next()
    if first is None:
        raise Gone
    kind, value = first
    if kind == "error":
        raise value
    return run, value


async def _collect(run: Run, request: Request) -> tuple[str, str, Done, list]:
    """(content, reasoning, Done, token logprobs) of a run that does not stream."""
    content, reasoning, logprobs = [], [], []
    checked = time.monotonic()
    while True:
        ev = await run.next()
        if ev is None:
            raise Gone
        if time.monotonic() - checked > 0.25:  # events keep coming: look for a client gone now and then
            checked = time.monotonic()
            if await request.is_disconnected():
                run.cancel()
                raise Gone
        kind, value = ev
        if kind == "delta":
            content.append(value.content)
            reasoning.append(value.reasoning)
            logprobs += value.logprobs
        elif kind == "error":
            raise value
        else:
            done: Done = value
            break
    content.append(done.content)
    return "".join(content), "".join(reasoning), done, logprobs + done.logprobs


def chat_logprobs(entries: list) -> Optional[dict]:
    """OpenAI's chat `logprobs`: {"content": [{token, logprob, bytes, top_logprobs}], "refusal"}."""
    return {"content": [{"token": e.token, "logprob": e.logprob, "bytes": e.bytes,
                         "top_logprobs": [{"token": t, "logprob": lp, "bytes": b} for t, lp, b in e.top]}
                        for e in entries], "refusal": None}


def completion_logprobs(entries: list, offset: int = 0) -> dict:
    """The completions API's `logprobs`: tokens, token_logprobs, top_logprobs, text_offset."""
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(e.token)
    return {"tokens": [e.token for e in entries], "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{t: lp for t, lp, _ in e.top} for e in entries], "text_offset": offsets}


async def respond(engine: Engine, work: Work, request: Request, chat: bool, stream: bool, include_usage: bool,
                  n: int = 1, echo: str = ""):
    """The reply to a chat or completions request: n choices (one run each, seeds apart when
    seeded), or a stream of one; `echo`: text put in front of a completion's."""
    from dataclasses import replace

    try:
        run, info = await _start(engine, work, request)
        rid = new_id("chatcmpl" if chat else "cmpl")
        created = now()
        if stream:
            return StreamingResponse(_stream(run, info, rid, created, chat, include_usage, echo),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        choices, usage = [], None
        for i in range(n):
            if i:
                seed = work.sampling.seed
                work_i = replace(work, sampling=replace(work.sampling, seed=None if seed is None else seed + i))
                run, info = await _start(engine, work_i, request)
            text, reasoning, done, entries = await _collect(run, request)
            logprobs = None
            if chat:
                message: dict[str, Any] = {"role": "assistant",
                                           "content": text if text or not done.tool_calls else None}
                if reasoning:
                    message["reasoning_content"] = reasoning
                if done.tool_calls:
                    message["tool_calls"] = [c.to_openai() for c in done.tool_calls]
                if work.logprobs is not None:
                    logprobs = chat_logprobs(entries)
                choices.append({"index": i, "message": message, "logprobs": logprobs,
                                "finish_reason": done.finish_reason})
            else:
                if work.logprobs is not None:
                    logprobs = completion_logprobs(entries)
                choices.append({"index": i, "text": echo + text, "logprobs": logprobs,
                                "finish_reason": done.finish_reason})
            u = _usage(done)
            if usage is None:
                usage, first = u, done
            else:  # the prompt counted once, every choice's tokens
                usage["completion_tokens"] += u["completion_tokens"]
                usage["total_tokens"] += u["completion_tokens"]
    except Gone:
        return JSONResponse({}, status_code=499)
    return JSONResponse({"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
                         "model": info["model"], "system_fingerprint": FINGERPRINT, "choices": choices,
                         "usage": usage, "timings": _timings(first)})


async def _stream(run: Run, info: dict, rid: str, created: int, chat: bool, include_usage: bool, echo: str = ""):
    obj = "chat.completion.chunk" if chat else "text_completion"
    head = {"id": rid, "object": obj, "created": created, "model": info["model"], "system_fingerprint": FINGERPRINT}

    want_logprobs = run.job.work.logprobs is not None
    offset = [len(echo)]

    def chunk(delta: Optional[dict] = None, finish: Optional[str] = None, text: str = "",
              entries: Optional[list] = None) -> str:
        logprobs = None
        if want_logprobs and entries:
            if chat:
                logprobs = chat_logprobs(entries)
            else:
                logprobs = completion_logprobs(entries, offset[0])
                offset[0] += sum(len(e.token) for e in entries)
        if chat:
            choice = {"index": 0, "delta": delta or {}, "logprobs": logprobs, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}
        body = {**head, "choices": [choice]}
        if include_usage:
            body["usage"] = None
        return _sse(body)

    try:
        if chat:
            yield chunk({"role": "assistant", "content": ""})
        elif echo:
            yield chunk(text=echo)
        pending = None  # an event taken while merging deltas
        while True:
            kind, value = pending if pending is not None else await run.events.get()
            pending = None
            if kind == "delta":
                d: Delta = value
                # deltas that queued up while the client read are sent as one chunk
                while not run.events.empty():
                    nxt = run.events.get_nowait()
                    if nxt[0] != "delta":
                        pending = nxt
                        break
                    d = Delta(d.content + nxt[1].content, d.reasoning + nxt[1].reasoning, d.logprobs + nxt[1].logprobs)
                if chat:
                    delta = {}
                    if d.reasoning:
                        delta["reasoning_content"] = d.reasoning
                    if d.content:
                        delta["content"] = d.content
                    yield chunk(delta, entries=d.logprobs)
                else:
                    yield chunk(text=d.content, entries=d.logprobs)
            elif kind == "error":
                e: ApiError = value
                log.info("stream %s ended: %s", rid, e)
                yield _sse(error_body(e))
                yield "data: [DONE]\n\n"
                return
            else:
                done: Done = value
                if done.content or (want_logprobs and done.logprobs):
                    yield chunk({"content": done.content}, entries=done.logprobs) if chat else \
                        chunk(text=done.content, entries=done.logprobs)
                if done.tool_calls:
                    yield chunk({"tool_calls": [c.to_openai(index=i) for i, c in enumerate(done.tool_calls)]})
                yield chunk({}, done.finish_reason) if chat else chunk(finish=done.finish_reason)
                if include_usage:
                    yield _sse({**head, "choices": [], "usage": _usage(done)})
                yield "data: [DONE]\n\n"
                return
    finally:
        run.cancel()  # a client gone mid-stream: the worker stops at the next token


# -- the app -------------------------------------------------------------------------------

def _validation_message(exc: RequestValidationError) -> tuple[str, Optional[str]]:
    errs = exc.errors()
    if not errs:
        return "invalid request", None
    e = errs[0]
    loc = [str(x) for x in e.get("loc", ()) if x != "body"]
    param = ".".join(loc) or None
    if e.get("type") == "json_invalid":
        return f"the request body is not valid JSON ({e.get('ctx', {}).get('error', e.get('msg'))})", None
    if e.get("type") == "extra_forbidden":
        return f"Unrecognized request argument supplied: {param}", param
    if e.get("type") == "missing" and not loc:
        return "the request needs a JSON body", None
    return f"{param}: {e.get('msg')}" if param else str(e.get("msg")), param


async def _parsed(request: Request, cls, to_work, engine: Engine) -> tuple:
    """(the request, its Work) for chat and completions (`parsed`, then the model named and
    to_work in the same thread)."""
    def work(req):
        req.model = served_model(engine, req.model)
        engine.check_model(req.model)
        return to_work(req, engine.sampling, engine.vocab_size)

    return await parsed(request, cls, work, engine.context_length())


async def parsed(request: Request, cls, make: Callable, limit: int, lists=("messages", "prompt")) -> tuple:
    """(the request as `cls`, make(it)): the body read (bounded by Gate), then parsed, checked and
    given to `make` (the route's work) in a thread, so a large body does not hold up the event
    loop's other clients. A list among `lists` longer than `limit` (each item is a token at least)
    is refused before it is validated."""
    try:
        raw = await request.body()
    except ClientDisconnect:  # gone before its body was in: nobody to answer
        raise ApiError("the client went away while sending the body", 499, code="cancelled") from None

    def parse():
        if not raw.strip():
            raise ApiError("the request needs a JSON body")
        try:
            obj = json.loads(raw)
        except ValueError as e:
            raise ApiError(f"the request body is not valid JSON ({e})") from None
        if not isinstance(obj, dict):
            raise ApiError("the request body must be a JSON object")
        for key in lists:  # a list longer than the context cannot fit: refused unread
            if isinstance(obj.get(key), list) and len(obj[key]) > limit:
                raise ApiError(f"This model's maximum context length is {limit} tokens; {key} has "
                               f"{len(obj[key])} items", code="context_length_exceeded", param=key)
        try:
            req = cls.model_validate(obj)
        except ValidationError as e:
            raise RequestValidationError(e.errors()) from None
        warn_unknown(req, request.url.path)
        return req, make(req)

    return await asyncio.to_thread(parse)


def http_protocol(head_timeout: float = HEAD_TIMEOUT_S):
    """uvicorn's HTTP/1.1 protocol with a bound on the time a request's line and headers take
    (uvicorn bounds the idle time between requests, not a request that arrives a byte at a time)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class Protocol(H11Protocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._head_timer = self.loop.call_later(head_timeout, self._head_late, self.cycle)

        def _head_late(self, cycle) -> None:
            if self.cycle is cycle and not self.transport.is_closing():  # no request began meanwhile
                log.info("%s: no request within %g s: closed", (self.client or ("-",))[0], head_timeout)
                self.transport.close()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._head_timer.cancel()
            self._head_timer = self.loop.call_later(head_timeout, self._head_late, self.cycle)

        def connection_lost(self, exc) -> None:
            self._head_timer.cancel()
            super().connection_lost(exc)

    return Protocol


def uvicorn_options(head_timeout: float = HEAD_TIMEOUT_S, max_connections: int = MAX_CONNECTIONS) -> dict:
    """uvicorn.Config's settings for the bounds above: the header timeout and the connection cap."""
    return {"http": http_protocol(head_timeout), "limit_concurrency": max_connections}


class Gate:
    """ASGI middleware: the API key, the body size limit, and one log line per request."""

    def __init__(self, app, api_key: Optional[str]):
        self.app = app
        self.api_key = api_key

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0 = time.perf_counter()
        status = {"code": 0}
        scope.setdefault("state", {})
        body = {"bytes": 0, "done": False}

        async def receive_bounded():
            """The body's parts, each within BODY_TIMEOUT_S, at most MAX_BODY bytes in all."""
            if body["done"]:
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), BODY_TIMEOUT_S)
            except asyncio.TimeoutError:
                raise ApiError(f"the request body did not arrive within {BODY_TIMEOUT_S:g} s", 408,
                               code="request_timeout") from None
            if message["type"] == "http.request":
                body["bytes"] += len(message.get("body", b""))
                if body["bytes"] > MAX_BODY:
                    raise ApiError(f"the request body is over {MAX_BODY} bytes, the most accepted", 413,
                                   code="request_too_large")
                body["done"] = not message.get("more_body", False)
            return message

        async def send_logged(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            error = self._refuse(scope)
            if error is not None:
                scope["state"]["error"] = str(error)
                await JSONResponse(error_body(error), status_code=error.status)(scope, receive, send_logged)
            else:
                await self.app(scope, receive_bounded, send_logged)
        finally:
            client = scope.get("client") or ("-", 0)
            why = scope["state"].get("error")
            ms = (time.perf_counter() - t0) * 1000
            log.info("%s %s %s %d %.0f ms%s", client[0], scope["method"], scope["path"], status["code"] or 499, ms,
                     f": {why}" if why else "")

    def _refuse(self, scope) -> Optional[ApiError]:
        headers = dict(scope.get("headers") or [])
        auth = headers.get(b"authorization", b"")  # bytes as sent: a UTF-8 key compares as UTF-8
        given = auth[7:] if auth[:7].lower() == b"bearer " else b""
        scope["state"]["authorized"] = self.api_key is None or hmac.compare_digest(given, self.api_key.encode())
        # /health without the key: the status only; / (the page) asks for the key itself
        if not scope["state"]["authorized"] and scope["path"] not in ("/health", "/"):
            return ApiError("Incorrect API key provided: pass it as 'Authorization: Bearer KEY'", 401,
                            code="invalid_api_key")
        length = headers.get(b"content-length")
        if length is not None:
            try:
                n = int(length)
            except ValueError:
                return ApiError("Content-Length is not a number")
            if n > MAX_BODY:
                return ApiError(f"the request body is {n} bytes; at most {MAX_BODY} are accepted", 413,
                                code="request_too_large")
        return None


def served_model(engine: Engine, name: Optional[str]) -> Optional[str]:
    """The model a request names, or None (the loaded one) where the server holds only one
    model: a single-model server answers any name, as llama-server does."""
    if name in (None, "") or name in engine.models() or len(engine.models()) > 1:
        return name
    return None


def create_app(engine: Engine, api_key: Optional[str] = None, routes: Sequence[Callable[[FastAPI], None]] = (),
               wrap: Callable[[Any], Any] = lambda app: app) -> Any:
    """The ASGI app: the OpenAI routes here, then each of `routes` adds its own (before the
    catch-all 404); `wrap` goes around the whole (CORS: outside the API key)."""
    app = FastAPI(title="onebit", version=__version__, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.engine = engine

    def failed(request: Request, e: ApiError) -> JSONResponse:
        request.state.error = str(e)
        return JSONResponse(error_body(e), status_code=e.status)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError):
        return failed(request, e)

    @app.exception_handler(OnebitError)
    async def _onebit_error(request: Request, e: OnebitError):
        return failed(request, ApiError(str(e), 400 if e.exit_code == 2 else 500,
                                        "invalid_request_error" if e.exit_code == 2 else "server_error"))

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError):
        message, param = _validation_message(e)
        return failed(request, ApiError(message, 400, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        message = f"{request.method} {request.url.path}: {e.detail}"
        return failed(request, ApiError(message, e.status_code, code=code))

    @app.exception_handler(Exception)
    async def _bug(request: Request, e: Exception):
        log.error("internal error: %s: %s", type(e).__name__, e)
        return failed(request, ApiError(f"internal error: {type(e).__name__}", 500, "server_error"))

    @app.get("/health")
    async def health(request: Request):
        problem = engine.problem
        if not request.state.authorized:  # without the key: whether it serves, nothing more
            return JSONResponse({"status": "ok" if problem is None else "unavailable"},
                                status_code=200 if problem is None else 503)
        if problem is not None:
            return JSONResponse({"status": "unavailable", "reason": problem}, status_code=503)
        return {"status": "ok", "model": engine.model_id, "busy": engine.busy(), "waiting": engine.waiting(),
                "served": engine.served, "generated": engine.generated}

    @app.get("/v1/models")
    @app.get("/models")
    async def models():
        created = now()
        return {"object": "list", "data": [{"id": m, "object": "model", "created": created, "owned_by": "onebit"}
                                           for m in engine.models()]}

    @app.get("/v1/models/{name:path}")
    @app.get("/models/{name:path}")
    async def model(name: str):
        if name not in engine.models():
            raise ApiError(f"The model '{name}' does not exist", 404, code="model_not_found", param="model")
        return {"id": name, "object": "model", "created": now(), "owned_by": "onebit"}

    @app.post("/v1/chat/completions")
    @app.post("/chat/completions")
    async def chat_completions(request: Request):
        req, work = await _parsed(request, ChatRequest, chat_work, engine)
        return await respond(engine, work, request, chat=True, stream=req.stream,
                             include_usage=bool(req.stream_options and req.stream_options.include_usage),
                             n=req.n or 1)

    @app.post("/v1/completions")
    @app.post("/completions")
    async def completions(request: Request):
        req, work = await _parsed(request, CompletionRequest, completion_work, engine)
        echo = ""
        if req.echo:
            loaded = engine.model
            if not isinstance(work.prompt, str) and loaded is None:
                raise ApiError("a model is being switched in: echo a token prompt again shortly", 503, "server_error")
            echo = work.prompt if isinstance(work.prompt, str) else loaded.detokenize(work.prompt)
        return await respond(engine, work, request, chat=False, stream=req.stream,
                             include_usage=bool(req.stream_options and req.stream_options.include_usage),
                             n=req.n or 1, echo=echo)

    for add in routes:
        add(app)
    return wrap(Gate(app, api_key))
