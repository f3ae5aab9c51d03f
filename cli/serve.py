"""`onebit serve` (the OpenAI API on a local port) and `onebit list` (GGUF files found here)."""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
import sys
from typing import Optional

import typer

from onebit.errors import UsageError

from .options import (BACKEND, BUDGET, CTX, DEVICE, LOOKUP, MODEL_ARG, MODEL_OPT, POLICY, SLOTS, TEMPLATE_KWARGS,
                      THREADS, Command, _check_sampling, _device, _load, _lookup, _model, _template_kwargs,
                      model_name, model_stores, predict_options, cache_type_options, WARM_START)

MODELS_DIR = typer.Option([], "--models-dir", help="A folder of GGUF files a request's `model` may pick "
                                                   "(loaded in its turn, one model at a time). Repeatable.")


def _listen(host: str, port: int) -> socket.socket:
    """A listening socket, or one clear error (a port in use, a host that is not ours)."""
    if not 0 <= port <= 65535:
        raise UsageError(f"--port must be 0-65535, got {port}")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise UsageError(f"--host {host!r}: cannot resolve it ({e.strerror})") from None
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
        sock.listen(128)
    except OSError as e:
        sock.close()
        raise UsageError(f"cannot listen on {host}:{port} ({e.strerror}); choose another --port or --host") from None
    sock.set_inheritable(True)
    return sock


def _chat_template(given: Optional[str], file: Optional[str]) -> Optional[str]:
    """The template text of --chat-template (a file, or Jinja text itself) or --chat-template-file."""
    if given is not None and file is not None:
        raise UsageError("give the chat template once: --chat-template or --chat-template-file")
    if given is not None and not os.path.isfile(given):
        if "{{" in given or "{%" in given:
            return given
        raise UsageError(f"--chat-template {given}: no such file (give a Jinja template file, or its text)")
    path, flag = (given, "--chat-template") if given is not None else (file, "--chat-template-file")
    if path is None:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"{flag} {path}: cannot read it ({e})") from None
    if not text.strip():
        raise UsageError(f"{flag} {path}: the file is empty")
    return text


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


@predict_options("out", "stats")
@cache_type_options
def serve(
    model: Optional[str] = MODEL_ARG,
    model_opt: Optional[str] = MODEL_OPT,
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on (loopback by default)."),
    port: int = typer.Option(8080, "--port", help="Port to listen on (0: any free port, printed at start)."),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="ONEBIT_API_KEY",
                                          help="Require 'Authorization: Bearer KEY' on every request (GET /health "
                                               "without it: the status only; default $ONEBIT_API_KEY; "
                                               "none: no key)."),
    models_dir: list[str] = MODELS_DIR,
    temperature: float = typer.Option(0.7, "--temperature", "--temp", help="Default when a request gives none."),
    top_k: int = typer.Option(0, "--top-k", help="Default when a request gives none (0 = off)."),
    top_p: float = typer.Option(0.95, "--top-p", help="Default when a request gives none."),
    min_p: float = typer.Option(0.05, "--min-p", help="Default when a request gives none."),
    repeat_penalty: float = typer.Option(1.0, "--repeat-penalty", help="Default when a request gives none."),
    backend: str = BACKEND,
    ctx: Optional[int] = CTX,
    slots: Optional[str] = SLOTS,
    budget: Optional[str] = BUDGET,
    pool_policy: str = POLICY,
    device: Optional[str] = DEVICE,
    threads: Optional[int] = THREADS,
    lookup: Optional[int] = LOOKUP,
    predict=None,  # a PredictSettings from the --moe-predict options (predict_options)
    cache_types=None,  # a KVTypes from the --cache-type options (cache_type_options)
    warm_start: bool = WARM_START,
    template_kwargs: Optional[str] = TEMPLATE_KWARGS,
    parallel: int = typer.Option(1, "--parallel", "-np", help="Requests decoded together, their forwards batched "
                                 "(as llama-server's -np): a KV cache of the whole context each, counted by the "
                                 "memory plan (vulkan, cpu and numpy backends)."),
    cache_ram: Optional[int] = typer.Option(None, "--cache-ram", "-cram", help="MiB of host memory for prompt "
                                            "prefixes saved beside the slots' caches (as llama-server's), "
                                            "counted by the memory plan; the least recently used is dropped "
                                            "first (default: what the plan leaves, at most 8192; 0: none)."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No log line per request."),
    cors: list[str] = typer.Option([], "--cors", help="Allow browser pages from this origin (e.g. "
                                   "https://app.example; '*': any). Repeatable. Pages on this machine "
                                   "(localhost, 127.0.0.1, [::1]) are always allowed, as ollama does."),
    pooling: str = typer.Option("mean", "--pooling", help="How /v1/embeddings pools a text's hidden states: "
                                "mean, last or cls (as llama-server)."),
    chat_template: Optional[str] = typer.Option(None, "--chat-template",
                                                help="A Jinja chat template used in place of the model's: a file, "
                                                     "or the template's text."),
    chat_template_file: Optional[str] = typer.Option(None, "--chat-template-file",
                                                     help="A Jinja chat template file used in place of the model's "
                                                          "(as llama.cpp's)."),
    jinja: bool = typer.Option(False, "--jinja", help="Accepted as llama.cpp takes it: templates are always "
                                                      "rendered with Jinja here."),
) -> None:
    """Serve the OpenAI API (chat, completions, embeddings, responses), ollama's API and a chat page."""
    try:
        import uvicorn

        from onebit.apps.serve_app import uvicorn_options
        from onebit.apps.serve_routes import build_app
    except ImportError as e:
        raise UsageError(f"onebit serve needs the serve extra ({e.name} is missing): pip install 'onebit[serve]'") \
            from None
    from onebit.formats import catalog
    from onebit.lookup import DEFAULT_DRAFTS
    from onebit.apps.embed import POOLINGS
    from onebit.apps.serve import Engine, Sampling
    from onebit.apps.serve_loading import LoadingAnswer

    given = model if model is not None else model_opt
    model, device = _model(model, model_opt), _device(device)
    _check_sampling(0, temperature, top_k, top_p, min_p, repeat_penalty)
    for d in models_dir:
        if not os.path.isdir(d):
            raise UsageError(f"--models-dir {d}: not a folder")
    if api_key is not None and not api_key.strip():
        raise UsageError("--api-key is empty")
    if pooling not in POOLINGS:
        raise UsageError(f"--pooling must be one of {', '.join(POOLINGS)}, got {pooling!r}")
    from onebit.apps.serve_app import MAX_CONNECTIONS

    if not 1 <= parallel <= MAX_CONNECTIONS:  # (more slots than open connections would never fill)
        raise UsageError(f"--parallel must be 1-{MAX_CONNECTIONS} (the open connections served), got {parallel}")
    if cache_ram is not None and cache_ram < 0:
        raise UsageError(f"--cache-ram must be at least 0 MiB (0: no saved prefixes), got {cache_ram}")
    template = _chat_template(chat_template, chat_template_file)
    template_kw = _template_kwargs(template_kwargs)
    lookup = _lookup(lookup, default=DEFAULT_DRAFTS)  # as chat and generate: the same tokens, sooner
    sock = _listen(host, port)
    bound = sock.getsockname()
    shown = f"[{bound[0]}]" if ":" in bound[0] else bound[0]
    typer.echo(f"onebit serve: loading {model or 'the shipped model'}; http://{shown}:{bound[1]}/health "
               "answers 503 until it is in", err=True)
    loading = LoadingAnswer(sock)
    try:
        m = _load(model, backend, ctx, slots, budget, pool_policy, None, device, predict, threads, template_kw,
                  sequences=parallel, cache_types=cache_types,
                  prompt_cache=None if cache_ram is None else cache_ram << 20, warm_start=warm_start)
    finally:
        loading.stop()
    if template is not None:
        m.chat_template = template
    sampling = Sampling(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                        repeat_penalty=repeat_penalty)
    found = lambda: {e.id: e.path for e in catalog.find(models_dir)}  # noqa: E731
    try:
        engine = Engine(m, sampling, lookup=lookup, catalog=found if models_dir else dict,  # (switches load as m.spec)
                        name=model_name(given, model), parallel=parallel)
    except UsageError:
        m.close()
        raise

    log = logging.getLogger("onebit.apps.serve")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("onebit serve: %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.WARNING if quiet else logging.INFO)
    log.propagate = False

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):  # SIGTERM / Ctrl-C: cancel what runs, then uvicorn's shutdown
            engine.stop()
            super().handle_exit(sig, frame)
            # uvicorn raises a caught signal again once it has stopped (the process would then die
            # of it before the model is closed): the shutdown is ours, and ends with exit code 0
            self._captured_signals.clear()

    config = uvicorn.Config(build_app(engine, api_key, cors, pooling), log_level="warning", access_log=False, lifespan="off",
                            timeout_graceful_shutdown=3, **uvicorn_options())
    typer.echo(f"onebit serve: {engine.model_id} on http://{shown}:{bound[1]}/v1 "
               f"({'API key required' if api_key else 'no API key'}; Ctrl-C stops)", err=True)
    if not _loopback(host) and api_key is None:
        typer.echo(f"onebit: warning: listening on {host} without --api-key: anyone who can reach this "
                   "machine can use the model", err=True)
    try:
        Server(config).run(sockets=[sock])
    finally:
        engine.close()
        sock.close()
        typer.echo("onebit serve: stopped", err=True)


def list_models(
    models_dir: list[str] = typer.Option([], "--models-dir", help="A folder of GGUF files to list too. Repeatable."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """List GGUF files: --models-dir folders, the Hugging Face cache, ollama's and LM Studio's stores."""
    import json

    from onebit.formats import catalog

    for d in models_dir:
        if not os.path.isdir(d):
            raise UsageError(f"--models-dir {d}: not a folder")
    stores = model_stores()
    entries = catalog.find(models_dir, stores)
    if as_json:
        typer.echo(json.dumps([e.__dict__ for e in entries], indent=2))
        return
    if not entries:
        places = ", ".join([*models_dir, *stores.places()])
        typer.echo(f"no GGUF files found (looked in {places})")
        return
    width = max(len(e.id) for e in entries)
    for e in entries:
        typer.echo(f"{e.id:<{width}}  {e.size / 2**30:7.2f} GiB  {e.source:<11}  {e.path}")


def register(app: typer.Typer) -> None:
    """Add `serve` and `list` to the onebit app (main.py calls this: under `python -m`, main.py
    runs as __main__, so this module must not import its app)."""
    app.command(cls=Command)(serve)
    app.command("list", cls=Command)(list_models)
