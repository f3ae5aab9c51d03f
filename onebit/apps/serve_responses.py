"""OpenAI's Responses API (`POST /v1/responses`, the openai SDK's `client.responses.create`):
text and function-call output items, structured output (`text.format`), and the streamed
events (`response.created` ... `response.completed`). A request becomes the same chat work as
/v1/chat/completions; nothing is stored (`previous_response_id` is refused)."""

from __future__ import annotations

import json
from typing import Any, Optional, Union

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from .serve import ApiError, Done, Engine, new_id, now
from .serve_app import ChatRequest, Gone, _collect, _start, _Strict, chat_work, parsed, served_model


class ResponsesRequest(_Strict):
    model: Optional[str] = None
    input: Union[str, list[dict]]
    instructions: Optional[str] = None
    stream: bool = False
    tools: Optional[list[dict]] = None
    tool_choice: Union[str, dict, None] = None
    text: Optional[dict] = None
    max_output_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    previous_response_id: Optional[str] = None
    metadata: Optional[dict] = None


def _text(content) -> str:
    if isinstance(content, str):
        return content
    parts = []
    for p in content or []:
        if p.get("type") not in ("input_text", "output_text", "text"):
            raise ApiError(f"only text content is supported (got a {p.get('type')!r} part)", param="input")
        parts.append(p.get("text") or "")
    return "".join(parts)


def chat_body(req: ResponsesRequest) -> dict:
    """The /v1/chat/completions body a Responses request means."""
    if req.previous_response_id:
        raise ApiError("previous_response_id: responses are not stored; send the whole conversation as input",
                       param="previous_response_id")
    msgs: list[dict] = []
    if req.instructions:
        msgs.append({"role": "system", "content": req.instructions})
    items = [{"role": "user", "content": req.input}] if isinstance(req.input, str) else req.input
    for item in items:
        kind = item.get("type", "message")
        if kind == "message":
            msgs.append({"role": item.get("role", "user"), "content": _text(item.get("content"))})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item["name"], "arguments": item.get("arguments", "{}")}}
            if msgs and msgs[-1]["role"] == "assistant" and "tool_calls" in msgs[-1]:
                msgs[-1]["tool_calls"].append(call)
            else:
                msgs.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            out = item.get("output")
            msgs.append({"role": "tool", "tool_call_id": item.get("call_id"),
                         "content": out if isinstance(out, str) else json.dumps(out)})
        elif kind == "reasoning":
            continue
        else:
            raise ApiError(f"input items of type {kind!r} are not supported", param="input")
    body: dict[str, Any] = {"model": req.model, "messages": msgs}
    if req.tools:
        tools = []
        for t in req.tools:
            if t.get("type") != "function":
                raise ApiError(f"only function tools are supported (got {t.get('type')!r})", param="tools")
            tools.append({"type": "function", "function": {
                "name": t.get("name"), "description": t.get("description", ""),
                "parameters": t.get("parameters") or {"type": "object", "properties": {}}}})
        body["tools"] = tools
    choice = req.tool_choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    if choice is not None:
        body["tool_choice"] = choice
    fmt = (req.text or {}).get("format")
    if fmt and fmt.get("type") == "json_schema":
        body["response_format"] = {"type": "json_schema", "json_schema": {
            "name": fmt.get("name", "response"), "schema": fmt.get("schema"), "strict": fmt.get("strict")}}
    elif fmt and fmt.get("type") == "json_object":
        body["response_format"] = {"type": "json_object"}
    for k, v in (("max_tokens", req.max_output_tokens), ("temperature", req.temperature), ("top_p", req.top_p)):
        if v is not None:
            body[k] = v
    return body


def _usage(done: Done) -> dict:
    return {"input_tokens": done.prompt_tokens, "output_tokens": done.completion_tokens,
            "total_tokens": done.prompt_tokens + done.completion_tokens,
            "input_tokens_details": {"cached_tokens": done.cached_tokens},
            "output_tokens_details": {"reasoning_tokens": 0}}


def _message(mid: str, text: str, status: str = "completed") -> dict:
    return {"type": "message", "id": mid, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def _call_item(c) -> dict:
    return {"type": "function_call", "id": new_id("fc"), "call_id": c.id, "name": c.name,
            "arguments": c.arguments, "status": "completed"}


def add_responses(engine: Engine):
    def to_work(req: ResponsesRequest):
        """The chat work a Responses request means (in `parsed`'s thread)."""
        body = chat_body(req)
        body["model"] = served_model(engine, body["model"])
        try:
            creq = ChatRequest(**body)
        except ValueError as e:
            raise ApiError(f"the request is not valid: {e}") from None
        engine.check_model(creq.model)
        return chat_work(creq, engine.sampling, engine.vocab_size)

    def add(app: FastAPI) -> None:
        @app.post("/v1/responses")
        @app.post("/responses")
        async def responses(request: Request):
            req, work = await parsed(request, ResponsesRequest, to_work, engine.context_length(), ("input",))
            rid, mid, created = new_id("resp"), new_id("msg"), now()

            def response(info: dict, status: str, output: list, done: Optional[Done] = None) -> dict:
                incomplete = {"reason": "max_output_tokens"} if done is not None and \
                    done.finish_reason == "length" else None
                return {"id": rid, "object": "response", "created_at": created, "status": status,
                        "model": info["model"], "output": output, "parallel_tool_calls": True,
                        "tool_choice": req.tool_choice or "auto", "tools": req.tools or [],
                        "instructions": req.instructions, "temperature": req.temperature, "top_p": req.top_p,
                        "max_output_tokens": req.max_output_tokens, "text": req.text or {"format": {"type": "text"}},
                        "metadata": req.metadata or {}, "error": None, "incomplete_details": incomplete,
                        "usage": _usage(done) if done is not None else None}

            def final_status(done: Done) -> str:
                return "incomplete" if done.finish_reason == "length" else "completed"

            try:
                run, info = await _start(engine, work, request)
                if not req.stream:
                    text, _, done, _ = await _collect(run, request)
                    output = ([_message(mid, text)] if text or not done.tool_calls else []) + \
                        [_call_item(c) for c in done.tool_calls]
                    return response(info, final_status(done), output, done)
            except Gone:
                return JSONResponse({}, status_code=499)

            async def events():
                seq = [0]

                def ev(kind: str, **fields) -> str:
                    body = {"type": kind, "sequence_number": seq[0], **fields}
                    seq[0] += 1
                    return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"

                text: list[str] = []
                opened = False
                try:
                    yield ev("response.created", response=response(info, "in_progress", []))
                    yield ev("response.in_progress", response=response(info, "in_progress", []))
                    while True:
                        kind, value = await run.events.get()
                        if kind == "error":
                            yield ev("error", code=value.code, message=str(value), param=value.param)
                            return
                        content = value.content
                        if content and not opened:
                            opened = True
                            yield ev("response.output_item.added", output_index=0,
                                     item=_message(mid, "", "in_progress") | {"content": []})
                            yield ev("response.content_part.added", item_id=mid, output_index=0, content_index=0,
                                     part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})
                        if content:
                            text.append(content)
                            yield ev("response.output_text.delta", item_id=mid, output_index=0, content_index=0,
                                     delta=content, logprobs=[])
                        if kind == "done":
                            break
                    done: Done = value
                    output = []
                    if opened:
                        full = "".join(text)
                        yield ev("response.output_text.done", item_id=mid, output_index=0, content_index=0,
                                 text=full, logprobs=[])
                        yield ev("response.content_part.done", item_id=mid, output_index=0, content_index=0,
                                 part={"type": "output_text", "text": full, "annotations": [], "logprobs": []})
                        output.append(_message(mid, full))
                        yield ev("response.output_item.done", output_index=0, item=output[-1])
                    for c in done.tool_calls:
                        item = _call_item(c)
                        i = len(output)
                        yield ev("response.output_item.added", output_index=i,
                                 item={**item, "arguments": "", "status": "in_progress"})
                        yield ev("response.function_call_arguments.delta", item_id=item["id"], output_index=i,
                                 delta=item["arguments"])
                        yield ev("response.function_call_arguments.done", item_id=item["id"], output_index=i,
                                 arguments=item["arguments"], name=item["name"])
                        output.append(item)
                        yield ev("response.output_item.done", output_index=i, item=item)
                    status = final_status(done)
                    yield ev("response.completed" if status == "completed" else "response.incomplete",
                             response=response(info, status, output, done))
                finally:
                    run.cancel()

            return StreamingResponse(events(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    return add


__all__ = ["add_responses", "chat_body"]
