"""Every route of `onebit serve` put together: OpenAI's chat, completions, embeddings and
Responses APIs, ollama's API, llama-server's extras and the chat page, with CORS around them."""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

from .embed import POOLINGS
from ..errors import UsageError
from .serve import Engine
from .serve_app import create_app
from .serve_extra import add_openai_extra
from .serve_ollama import add_ollama
from .serve_responses import add_responses

LOCAL_ORIGINS = r"(https?://(localhost|127\.0\.0\.1|\[::1\]|0\.0\.0\.0)(:\d+)?|(app|file|tauri)://.*)"


def cors(origins: Sequence[str]) -> Callable[[Any], Any]:
    """Cross-origin requests: from `origins` (`*`: any) and, as ollama allows them, from pages
    on this machine (localhost, 127.0.0.1, [::1]) and app:// file:// tauri:// ones."""
    from starlette.middleware.cors import CORSMiddleware

    def wrap(app):
        return CORSMiddleware(app, allow_origins=list(origins), allow_origin_regex=LOCAL_ORIGINS,
                              allow_methods=["*"], allow_headers=["*"], expose_headers=["*"], max_age=600)
    return wrap


def build_app(engine: Engine, api_key: Optional[str] = None, origins: Sequence[str] = (),
              pooling: str = "mean") -> Any:
    """Every route of `onebit serve`: OpenAI's chat, completions, embeddings and Responses APIs,
    ollama's, llama-server's extras, the page; CORS around them all."""
    if pooling not in POOLINGS:
        raise UsageError(f"pooling must be one of {', '.join(POOLINGS)}")
    return create_app(engine, api_key, routes=[add_openai_extra(engine, pooling), add_ollama(engine, pooling),
                                               add_responses(engine)], wrap=cors(origins))


__all__ = ["LOCAL_ORIGINS", "build_app", "cors"]
