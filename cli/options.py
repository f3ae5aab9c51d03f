"""What the `onebit` commands share: their options, and loading a model from them (imported by
main.py, serve.py and ray_batch.py; it imports none of them)."""

from __future__ import annotations

import json
from typing import Optional

import typer

from onebit.errors import UsageError


def default_model_path() -> str:
    from onebit.model import shipped_model_path

    return shipped_model_path()


LOUD_BYTES = 1 << 30  # a resident load of a file this large says what the plan chose (smaller ones stay quiet)


def load_spec(model: Optional[str], backend: str, ctx: Optional[int] = None, slots: Optional[str] = None,
              budget: Optional[str] = None, policy: str = "global", device: Optional[str] = None, predict=None,
              threads: Optional[int] = None, template_kwargs: Optional[dict] = None):
    """The LoadSpec of a command's load flags, checked before anything is loaded."""
    from onebit.model import LoadSpec

    spec = LoadSpec(path=model, backend=backend, n_ctx=ctx, slots=_slots(slots), budget=budget, pool_policy=policy,
                    device=device, predict=predict, threads=threads, template_kwargs=dict(template_kwargs or {}))
    if ctx is not None:
        _check_ctx(spec.model_path(), ctx)
    if threads is not None and threads < 1:
        raise UsageError(f"--threads must be at least 1, got {threads}")
    return spec


def _load(model: Optional[str], backend: str, ctx: Optional[int] = None, slots: Optional[str] = None,
          budget: Optional[str] = None, policy: str = "global", trace: Optional[str] = None,
          device: Optional[str] = None, predict=None, threads: Optional[int] = None,
          template_kwargs: Optional[dict] = None):
    import onebit

    m = onebit.load(load_spec(model, backend, ctx, slots, budget, policy, device, predict, threads, template_kwargs))
    if m.pool is not None or "reduced" in m.decision or m.gguf.file_bytes >= LOUD_BYTES:
        import sys

        sys.stderr.write(f"onebit: memory: {m.decision}\n")  # what the memory plan chose, in one line
    if trace is not None:
        from onebit.moe.trace import TraceWriter

        m.hook = TraceWriter(trace, m.path, m.cfg.n_layers, m.cfg.n_experts, m.cfg.n_experts_used)
    return m


def _slots(slots: Optional[str]):
    if slots is None or slots == "auto":
        return slots
    try:
        return int(slots)
    except ValueError:
        raise UsageError(f"--slots must be a number or auto, got {slots!r}") from None


def _check_ctx(path: str, ctx: int) -> None:
    """--ctx within the model's context length, with room for a prompt token and a reply token;
    read from the file header before anything is loaded."""
    from onebit.gguf_file import GGUFFile
    from onebit.models import network_class

    if ctx < 1:
        raise UsageError(f"--ctx must be at least 2, got {ctx}")
    if ctx < 2:
        raise UsageError(f"--ctx {ctx} leaves no room to generate: a prompt takes at least one token "
                         f"and the reply another (use --ctx 2 or more)")
    g = GGUFFile(path)
    n = network_class(g.architecture, path).config(g).context_length
    if ctx > n:
        raise UsageError(f"--ctx {ctx} is out of range: the model's context length is {n}")


def _predict(mode, depth, margin, min_, layers, ahead, no_attn, chain, out, stats, own=None):
    """Prediction settings from the flags over $ONEBIT_MOE_PREDICT*; checked before loading."""
    from onebit.moe.predict import settings_from

    return settings_from(None, mode=mode, depth=depth, margin=margin, min=min_, layers=layers, ahead=ahead,
                         no_attn=no_attn, chain=chain, out=out, stats=stats, own=own)


MODEL_ARG = typer.Argument(None, help="GGUF model file (default: the small model shipped with onebit).")


MODEL_OPT = typer.Option(None, "--model", "-m", help="GGUF model file (default: the shipped model).")


BACKEND = typer.Option("auto", "--backend", help="Compute backend: auto (Vulkan on a GPU, else cpu), cpu, vulkan "
                                                  "or numpy (the reference).")


SLOTS = typer.Option(None, "--slots", help="Expert slots: a number or auto; fewer than all experts streams them "
                                          "from the file.")


BUDGET = typer.Option(None, "--budget", help="Memory budget, e.g. 12GiB (plans memory; refuses what won't fit).")


DEVICE = typer.Option(None, "--device", help="Vulkan device: index or name substring (see onebit info --device).")


THREADS = typer.Option(None, "--threads", "-t", help="Threads of the cpu backend's kernels (default: every core).")


POLICY = typer.Option("global", "--pool-policy", help="Expert pool eviction: global (one LRU) or layer.")


STATS = typer.Option(False, "--stats", help="Print expert-pool stats at exit.")


TRACE = typer.Option(None, "--trace", help="Record every token's routed experts to this JSONL file.")


CTX = typer.Option(None, "--ctx", help="Context length in tokens (default: min(model's, 4096)).")


PREDICT = typer.Option(None, "--moe-predict", help="Routing prediction feeding the expert pool's prefetch: "
                                                    "auto, off, router or block (default $ONEBIT_MOE_PREDICT, else "
                                                    "auto: block when experts stream, the gate turning it off "
                                                    "where it does not pay; off when every expert is resident).")


P_DEPTH = typer.Option(None, "--moe-predict-depth", help="Rank this many candidates per layer (default top-k).")


P_MARGIN = typer.Option(None, "--moe-predict-margin", help="Read a deeper candidate only while its router logit "
                                                          "is within this of the best.")


P_MIN = typer.Option(None, "--moe-predict-min", help="Always read at least this many (default top-k).")


P_LAYERS = typer.Option(None, "--moe-predict-layers", help="Layers predicted, e.g. 1,2,5-9 (default all MoE layers).")


P_AHEAD = typer.Option(None, "--moe-predict-ahead", help="Predict this many MoE layers ahead (default 1).")


P_NO_ATTN = typer.Option(None, "--moe-predict-no-attn", help="Block mode without the mixer (0 or 1).")


P_CHAIN = typer.Option(None, "--moe-predict-chain", help="Block mode, more than one ahead: run each deeper "
                                                         "layer's block too (0 or 1; default 0: router form).")


P_OWN = typer.Option(None, "--moe-predict-own", help="Block mode: add this many of the current layer's top "
                                                     "experts' output before predicting the next (default 1; 0: none).")


P_OUT = typer.Option(None, "--moe-predict-out", help="Per-token predicted / actual trace (JSONL).")


P_STATS = typer.Option(None, "--moe-predict-stats", help="Print the per-layer prediction table at exit (0 or 1).")


TEMPLATE_KWARGS = typer.Option(
    None, "--chat-template-kwargs",
    help='Extra chat-template variables as a JSON object, as llama.cpp takes them, e.g. '
         '\'{"enable_thinking": false}\' (Qwen3: answer without reasoning) or \'{"reasoning_effort": "low"}\' (gpt-oss).')


_TEMPLATE_OWN = ("messages", "add_generation_prompt", "bos_token", "eos_token", "tools")


def _template_kwargs(text: Optional[str]) -> dict:
    if text is None:
        return {}
    try:
        kw = json.loads(text)
    except ValueError as e:
        raise UsageError(f"--chat-template-kwargs is not valid JSON ({e}); give an object such as "
                         "'{\"enable_thinking\": false}'") from None
    if not isinstance(kw, dict):
        raise UsageError("--chat-template-kwargs must be a JSON object, such as '{\"enable_thinking\": false}'")
    own = sorted(set(kw) & set(_TEMPLATE_OWN))
    if own:
        raise UsageError(f"--chat-template-kwargs cannot set {', '.join(own)}: onebit sets those itself")
    return kw


LOOKUP = typer.Option(None, "--lookup", help="Lookup decoding: draft up to N tokens (0-8) from n-grams of the "
                                              "context and verify them in one forward; same output. "
                                              "Default: $ONEBIT_LOOKUP, else 8 (0 with --trace; "
                                              "0 for bench: plain decoding).")


def _check_sampling(max_tokens, temperature, top_k, top_p, min_p, repeat_penalty) -> None:
    """Refuse bad settings before spending time on loading the model."""
    from onebit.sample import make_logits_processors, make_sampler

    if max_tokens < 0:
        raise UsageError(f"--max-tokens must be >= 0, got {max_tokens}")
    make_sampler(temperature, top_p, min_p, top_k)
    make_logits_processors(repeat_penalty)


SHOW_REASONING = typer.Option(
    False, "--show-reasoning",
    help="Models that reason apart from the reply (gpt-oss channels, <think> blocks of Qwen3 / GLM / "
         "DeepSeek-R1): show the reasoning "
         "(dimmed in chat; a `reasoning` field in generate's output). Default: hidden / dropped.")
