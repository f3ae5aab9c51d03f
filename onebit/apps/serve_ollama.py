"""ollama's API over the served models, for the clients that speak it (Open WebUI's ollama
connection, litellm's `ollama/` models, the `ollama` Python client): /api/chat and
/api/generate (streamed as NDJSON by default, as ollama does), /api/embed, /api/tags, /api/show,
/api/ps, /api/version. Requests become the same work as the OpenAI routes'."""

from __future__ import annotations

import asyncio
import json
import os
import time
from datetime import datetime, timezone
from typing import Any, Optional, Union

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from starlette.requests import ClientDisconnect

from .. import __version__
from ..errors import OnebitError
from .serve import ApiError, Done, Engine, Work
from .serve_app import (ChatRequest, CompletionRequest, Gone, _Strict, _collect, _start, chat_work,
                        completion_work, parsed, served_model)
from .serve_extra import embedding_inputs, embedding_task, run_task

# ollama's option names -> the OpenAI request's
_OPTIONS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p", "seed": "seed",
            "stop": "stop", "repeat_penalty": "repeat_penalty", "presence_penalty": "presence_penalty",
            "frequency_penalty": "frequency_penalty", "num_predict": "max_tokens"}


class OllamaChat(_Strict):
    model: Optional[str] = None
    messages: list[dict] = []
    stream: bool = True
    format: Union[str, dict, None] = None
    options: Optional[dict] = None
    tools: Optional[list[dict]] = None
    think: Union[bool, str, None] = None
    keep_alive: Union[str, int, float, None] = None


class OllamaGenerate(_Strict):
    model: Optional[str] = None
    prompt: str = ""
    system: Optional[str] = None
    raw: bool = False
    stream: bool = True
    format: Union[str, dict, None] = None
    options: Optional[dict] = None
    images: Optional[list] = None
    keep_alive: Union[str, int, float, None] = None


class OllamaEmbed(_Strict):
    model: Optional[str] = None
    input: Union[str, list[str], None] = None
    prompt: Optional[str] = None  # /api/embeddings (the older route)


def _stamp() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def _name(engine: Engine, name: Optional[str]) -> Optional[str]:
    """A request's model: ollama's `name:latest` is the name; any name on a one-model server."""
    if name and name.endswith(":latest") and name not in engine.models():
        name = name[: -len(":latest")]
    name = served_model(engine, name)
    engine.check_model(name)
    return name


def _fields(body: Any, options: Optional[dict], fmt) -> dict:
    out = {}
    for k, v in (options or {}).items():
        if k in _OPTIONS and v is not None:
            out[_OPTIONS[k]] = v
    if isinstance(out.get("max_tokens"), int) and out["max_tokens"] < 0:
        del out["max_tokens"]  # ollama's -1: no limit
    if fmt == "json":
        out["response_format"] = {"type": "json_object"}
    elif isinstance(fmt, dict):
        out["response_format"] = {"type": "json_schema", "json_schema": {"name": "format", "schema": fmt}}
    elif fmt not in (None, ""):
        raise ApiError("format must be \"json\" or a JSON schema", param="format")
    return out


def _messages(messages: list[dict]) -> list[dict]:
    out = []
    for m in messages:
        d = {"role": m.get("role"), "content": m.get("content") or ""}
        if m.get("images"):
            raise ApiError("only text messages are supported (a message has images)", param="messages")
        if m.get("thinking"):
            d["reasoning_content"] = m["thinking"]
        if m.get("tool_calls"):
            d["tool_calls"] = [{"type": "function", "function": {
                "name": c["function"]["name"], "arguments": json.dumps(c["function"].get("arguments") or {})}}
                for c in m["tool_calls"]]
        if m.get("tool_name"):
            d["name"] = m["tool_name"]
        out.append(d)
    return out


def _final(done: Done, t0: float) -> dict:
    total = int((time.perf_counter() - t0) * 1e9)
    return {"done": True, "done_reason": done.finish_reason if done.finish_reason != "tool_calls" else "stop",
            "total_duration": total, "load_duration": 0, "prompt_eval_count": done.prompt_tokens,
            "prompt_eval_duration": int(done.prompt_time * 1e9), "eval_count": done.completion_tokens,
            "eval_duration": int(done.generation_time * 1e9)}


def _calls(done: Done) -> list[dict]:
    out = []
    for c in done.tool_calls:
        try:
            args = json.loads(c.arguments)
        except ValueError:
            args = c.arguments
        out.append({"function": {"name": c.name, "arguments": args}})
    return out


async def _reply(engine: Engine, work: Work, request: Request, stream: bool, chat: bool):
    """ollama's reply: one object, or NDJSON lines (text as it comes, then the totals)."""
    t0 = time.perf_counter()

    def piece(text: str, thinking: str = "", calls: Optional[list] = None) -> Any:
        if not chat:
            d = {"response": text}
            if thinking:
                d["thinking"] = thinking
            return d
        msg: dict[str, Any] = {"role": "assistant", "content": text}
        if thinking:
            msg["thinking"] = thinking
        if calls:
            msg["tool_calls"] = calls
        return {"message": msg}

    try:
        run, info = await _start(engine, work, request)
    except Gone:
        return StreamingResponse(iter(()), status_code=499)
    head = lambda: {"model": info["model"], "created_at": _stamp()}  # noqa: E731
    if not stream:
        try:
            text, reasoning, done, _ = await _collect(run, request)
        except Gone:
            return StreamingResponse(iter(()), status_code=499)
        body = {**head(), **piece(text, reasoning, _calls(done)), **_final(done, t0)}
        if not chat:
            body["context"] = []
        return body

    async def lines():
        try:
            while True:
                kind, value = await run.events.get()
                if kind == "delta":
                    yield json.dumps({**head(), **piece(value.content, value.reasoning), "done": False}) + "\n"
                elif kind == "error":
                    yield json.dumps({"error": str(value)}) + "\n"
                    return
                else:
                    done: Done = value
                    last = {**head(), **piece(done.content, "", _calls(done)), **_final(done, t0)}
                    if not chat:
                        last["context"] = []
                    yield json.dumps(last) + "\n"
                    return
        finally:
            run.cancel()

    return StreamingResponse(lines(), media_type="application/x-ndjson")


def _details(path: str) -> dict:
    from ..formats.gguf_file import GGUFFile

    try:
        g = GGUFFile(path)
        arch, meta = g.architecture, g.metadata
    except (OnebitError, OSError):  # a file listed but not readable: its details are left empty
        return {"format": "gguf", "family": "", "families": None, "parameter_size": "", "quantization_level": ""}
    return {"parent_model": "", "format": "gguf", "family": arch, "families": [arch],
            "parameter_size": str(meta.get("general.size_label", "")), "quantization_level": str(meta.get("general.file_type", ""))}


def _entry(name: str, path: str) -> dict:
    try:
        st = os.stat(path)
        size, mtime = st.st_size, datetime.fromtimestamp(st.st_mtime, timezone.utc)
    except OSError:
        size, mtime = 0, datetime.now(timezone.utc)
    return {"name": name, "model": name, "modified_at": mtime.isoformat().replace("+00:00", "Z"), "size": size,
            "digest": "", "details": _details(path)}


def add_ollama(engine: Engine, pooling: str = "mean"):
    def add(app: FastAPI) -> None:
        @app.get("/api/version")
        async def version():
            return {"version": __version__}

        @app.get("/api/tags")
        async def tags():
            return {"models": [_entry(n, p) for n, p in engine.catalog().items()]}

        @app.get("/api/ps")
        async def ps():
            m = engine.model
            if m is None:
                return {"models": []}
            e = _entry(engine.model_id, m.path)
            return {"models": [{**e, "expires_at": "9999-12-31T23:59:59Z", "size_vram": 0,
                                "context_length": m.context_length}]}

        @app.post("/api/show")
        async def show(request: Request):
            body = await _json(request)
            name = await asyncio.to_thread(_name, engine, body.get("model") or body.get("name"))
            path = engine.catalog().get(name or engine.model_id) or engine.model.path
            d = _details(path)
            m = engine.model
            template = (m.chat_template or "") if m is not None and (name in (None, engine.model_id)) else ""
            caps = ["completion", "embedding"]
            if "tool" in template:
                caps.append("tools")
            info = {"general.architecture": d["family"]}
            if m is not None and name in (None, engine.model_id):
                info[f"{d['family']}.context_length"] = m.context_length
            return {"modelfile": "", "parameters": "", "template": template, "details": d, "model_info": info,
                    "capabilities": caps, "modified_at": _entry(name or engine.model_id, path)["modified_at"]}

        def chat_of(req: OllamaChat):
            """(the model's name, the chat work, or None for an empty chat: ollama loads the model)."""
            name = _name(engine, req.model)
            if not req.messages:
                return name, None
            fields = _fields(req, req.options, req.format)
            if req.tools:
                fields["tools"] = req.tools
            try:
                creq = ChatRequest(model=name, messages=_messages(req.messages), **fields)
            except ValueError as e:
                raise ApiError(f"the request is not valid: {e}") from None
            return name, chat_work(creq, engine.sampling, engine.vocab_size)

        @app.post("/api/chat")
        async def chat(request: Request):
            req, (name, work) = await parsed(request, OllamaChat, chat_of, engine.context_length(), ("messages",))
            if work is None:  # ollama: an empty chat loads the model
                return {"model": name or engine.model_id, "created_at": _stamp(),
                        "message": {"role": "assistant", "content": ""}, "done": True, "done_reason": "load"}
            return await _reply(engine, work, request, req.stream, chat=True)

        def generate_of(req: OllamaGenerate):
            """(the model's name, the work, or None for an empty prompt: ollama loads the model)."""
            name = _name(engine, req.model)
            if req.images:
                raise ApiError("only text prompts are supported (the request has images)", param="images")
            if not req.prompt:
                return name, None
            fields = _fields(req, req.options, req.format)
            try:
                if req.raw:
                    fields.pop("response_format", None)
                    work = completion_work(CompletionRequest(model=name, prompt=req.prompt, **fields),
                                           engine.sampling, engine.vocab_size)
                    if "max_tokens" not in fields:
                        work.max_tokens = None
                else:
                    msgs = ([{"role": "system", "content": req.system}] if req.system else []) + \
                           [{"role": "user", "content": req.prompt}]
                    work = chat_work(ChatRequest(model=name, messages=msgs, **fields), engine.sampling,
                                     engine.vocab_size)
            except ValueError as e:
                raise ApiError(f"the request is not valid: {e}") from None
            return name, work

        @app.post("/api/generate")
        async def generate(request: Request):
            req, (name, work) = await parsed(request, OllamaGenerate, generate_of, engine.context_length(), ())
            if work is None:  # ollama: an empty prompt loads the model
                return {"model": name or engine.model_id, "created_at": _stamp(), "response": "", "done": True,
                        "done_reason": "load"}
            return await _reply(engine, work, request, req.stream, chat=False)

        @app.post("/api/embed")
        @app.post("/api/embeddings")
        async def embed(request: Request):
            legacy = request.url.path.endswith("/embeddings")
            req, (name, inputs) = await parsed(
                request, OllamaEmbed, lambda req: (_name(engine, req.model),
                                                   embedding_inputs(req.prompt if legacy else req.input)),
                engine.context_length(), ())
            t0 = time.perf_counter()
            model, (vectors, n) = await run_task(engine, name, embedding_task(inputs, pooling), request)
            if legacy:
                return {"embedding": [float(x) for x in vectors[0]]}
            return {"model": model, "embeddings": [[float(x) for x in v] for v in vectors],
                    "total_duration": int((time.perf_counter() - t0) * 1e9), "load_duration": 0,
                    "prompt_eval_count": n}

    return add


async def _json(request: Request) -> dict:
    """The request's body as a JSON object, parsed in a thread (not on the event loop)."""
    try:
        raw = await request.body()
    except ClientDisconnect:  # gone before its body was in: nobody to answer
        raise ApiError("the client went away while sending the body", 499, code="cancelled") from None

    def parse():
        try:
            body = json.loads(raw or b"{}")
        except ValueError:
            raise ApiError("the request body is not valid JSON") from None
        if not isinstance(body, dict):
            raise ApiError("the request body must be a JSON object")
        return body

    return await asyncio.to_thread(parse)


__all__ = ["add_ollama"]
