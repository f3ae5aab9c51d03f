"""The routes of `onebit serve` beyond chat and completions: embeddings, tokenize and
detokenize, llama-server's /props and /slots, Prometheus /metrics, the chat page at `/`."""

from __future__ import annotations

import base64
from importlib import resources
from typing import Any, Callable, Optional, Union

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, PlainTextResponse
from pydantic import Field

from .. import __version__
from .embed import embed, input_ids
from .serve import ApiError, Engine, Work
from .serve_app import Run, _Strict, parsed, served_model

MAX_INPUTS = 2048  # texts of one embeddings request


async def run_task(engine: Engine, model: Optional[str], task: Callable[[Any], Any], request: Request) -> tuple:
    """(model id, result) of `task(model)` run on the worker in its turn."""
    run = Run(engine, Work(model=model, task=task), request)
    info = None
    while True:
        ev = await run.next()
        if ev is None:
            raise ApiError("the request was cancelled", 499, code="cancelled")
        kind, value = ev
        if kind == "error":
            raise value
        if kind == "start":
            info = value
        elif kind == "done":
            return info["model"], value


def embedding_task(inputs: list, pooling: str) -> Callable[[Any], tuple[list[np.ndarray], int]]:
    """A task: (one vector per input, the tokens read) for texts or token id lists; a text is
    tokenized only as far as shows it is longer than the context (`input_ids`)."""
    def task(model):
        ids = [input_ids(model, x) if isinstance(x, str) else list(x) for x in inputs]
        if any(not i for i in ids):
            raise ApiError("an input is empty", param="input")
        return embed(model, ids, pooling), sum(len(i) for i in ids)
    return task


def embedding_inputs(value) -> list:
    """The `input` of an embeddings request as a list of texts or token id lists."""
    if isinstance(value, str):
        return [value]
    if value and all(isinstance(t, int) for t in value):
        return [value]
    if not value:
        raise ApiError("input is empty", param="input")
    if len(value) > MAX_INPUTS:
        raise ApiError(f"at most {MAX_INPUTS} inputs per request", param="input")
    return list(value)


class EmbeddingRequest(_Strict):
    input: Union[str, list[str], list[int], list[list[int]]]
    model: Optional[str] = None
    encoding_format: str = "float"
    dimensions: Optional[int] = Field(None, gt=0)
    user: Optional[str] = None


class TokenizeRequest(_Strict):
    content: str
    add_special: bool = False
    with_pieces: bool = False


class DetokenizeRequest(_Strict):
    tokens: list[int]


def _vector(v: np.ndarray, fmt: str, dimensions: Optional[int]):
    if dimensions is not None:
        if dimensions > len(v):
            raise ApiError(f"dimensions: this model's embeddings have {len(v)}", param="dimensions")
        v = v[:dimensions]
        v = v / max(float(np.linalg.norm(v)), 1e-12)  # (unit length again, as OpenAI's shortened ones)
    if fmt == "base64":
        return base64.b64encode(np.asarray(v, dtype="<f4").tobytes()).decode()
    if fmt != "float":
        raise ApiError("encoding_format must be float or base64", param="encoding_format")
    return [float(x) for x in v]


def add_openai_extra(engine: Engine, pooling: str = "mean") -> Callable[[FastAPI], None]:
    def add(app: FastAPI) -> None:
        def inputs_of(req: EmbeddingRequest):
            """(the model's name, the inputs) of an embeddings request (in `parsed`'s thread)."""
            inputs = embedding_inputs(req.input)
            if req.encoding_format not in ("float", "base64"):
                raise ApiError("encoding_format must be float or base64", param="encoding_format")
            name = served_model(engine, req.model)
            engine.check_model(name)
            return name, inputs

        @app.post("/v1/embeddings")
        @app.post("/embeddings")
        async def embeddings(request: Request):
            req, (name, inputs) = await parsed(request, EmbeddingRequest, inputs_of, MAX_INPUTS, ())
            model, (vectors, n) = await run_task(engine, name, embedding_task(inputs, pooling), request)
            data = [{"object": "embedding", "index": i, "embedding": _vector(v, req.encoding_format, req.dimensions)}
                    for i, v in enumerate(vectors)]
            return {"object": "list", "data": data, "model": model, "usage": {"prompt_tokens": n, "total_tokens": n}}

        def loaded():
            m = engine.model
            if m is None:
                raise ApiError("no model is loaded now (one is being switched in)", 503, "server_error")
            return m

        def tokens_of(req: TokenizeRequest) -> dict:
            m = loaded()
            ids = m.tokenize(req.content, add_special=req.add_special)
            if not req.with_pieces:
                return {"tokens": ids}
            return {"tokens": [{"id": t, "piece": m.tokenizer.token_bytes(t).decode("utf-8", "replace")}
                               for t in ids]}

        def text_of(req: DetokenizeRequest) -> dict:
            m = loaded()
            bad = [t for t in req.tokens if not 0 <= t < m.cfg.vocab_size]
            if bad:
                raise ApiError(f"token id {bad[0]} is out of range for a vocabulary of {m.cfg.vocab_size}",
                               param="tokens")
            return {"content": m.detokenize(req.tokens)}

        @app.post("/tokenize")
        async def tokenize(request: Request):  # (parsed and tokenized in a thread, as every body)
            return (await parsed(request, TokenizeRequest, tokens_of, 0, ()))[1]

        @app.post("/detokenize")
        async def detokenize(request: Request):
            return (await parsed(request, DetokenizeRequest, text_of, 0, ()))[1]

        @app.get("/props")
        async def props():
            m = loaded()
            s = engine.sampling
            return {"model_path": m.path, "model_alias": engine.model_id, "total_slots": engine.parallel,
                    "n_ctx": m.context_length, "build_info": f"onebit {__version__}",
                    "chat_template": m.chat_template or "", "pooling": pooling,
                    "default_generation_settings": {
                        "n_ctx": m.context_length, "params": {
                            "temperature": s.temperature, "top_k": s.top_k, "top_p": s.top_p, "min_p": s.min_p,
                            "repeat_penalty": s.repeat_penalty}}}

        @app.get("/slots")
        async def slots():
            m = engine.model
            return [{"id": s.id, "n_ctx": m.context_length if m is not None else 0, "is_processing": s.job is not None,
                     "model": engine.model_id, "cached_tokens": len(s.prefix.tokens)} for s in engine.slots]

        @app.get("/metrics")
        async def metrics():
            lines = []
            for name, kind, value, text in (
                    ("onebit_requests_total", "counter", engine.served, "Requests the workers finished."),
                    ("onebit_tokens_generated_total", "counter", engine.generated, "Tokens generated."),
                    ("onebit_requests_processing", "gauge", engine.processing(), "Requests running."),
                    ("onebit_slots", "gauge", engine.parallel, "Requests that may run at once (--parallel)."),
                    ("onebit_batched_steps_total", "counter", engine.batcher.shared if engine.batcher else 0,
                     "Forwards that ran the rows of several requests together."),
                    ("onebit_requests_waiting", "gauge", engine.waiting(), "Requests queued."),
                    ("onebit_prompt_tokens_total", "counter", engine.prompt_tokens, "Prompt tokens of the requests."),
                    ("onebit_prompt_tokens_cached_total", "counter", engine.cached_tokens,
                     "Of them, tokens a cache held already (a slot's or a saved prefix): not run again."),
                    ("onebit_prompt_cache_loads_total", "counter", engine.prompts.loads,
                     "Saved prefixes moved back into a slot (--cache-ram)."),
                    ("onebit_prompt_cache_tokens_loaded_total", "counter", engine.prompts.tokens_loaded,
                     "Prompt tokens those saved prefixes held."),
                    ("onebit_prompt_cache_saves_total", "counter", engine.prompts.saves,
                     "Prefixes saved from a slot's cache."),
                    ("onebit_prompt_cache_dropped_total", "counter", engine.prompts.drops,
                     "Saved prefixes dropped for room, least recently used first."),
                    ("onebit_prompt_cache_prefixes", "gauge", len(engine.prompts.entries), "Saved prefixes held."),
                    ("onebit_prompt_cache_bytes", "gauge", engine.prompts.nbytes, "Bytes they take."),
                    ("onebit_prompt_cache_budget_bytes", "gauge", engine.prompts.budget,
                     "Bytes the memory plan holds for them (--cache-ram).")):
                lines += [f"# HELP {name} {text}", f"# TYPE {name} {kind}", f"{name} {value}"]
            return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

        @app.get("/", response_class=HTMLResponse)
        async def page():
            return HTMLResponse(resources.files("onebit.apps").joinpath("page/index.html").read_text("utf-8"))

    return add


__all__ = ["add_openai_extra", "embedding_inputs", "embedding_task", "run_task"]
