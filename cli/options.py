"""What the `onebit` commands share: their options, the environment (read here and nowhere else
in onebit), and loading a model from them (imported by main.py, serve.py and ray_batch.py; it
imports none of them)."""

from __future__ import annotations

import functools
import inspect
import os
from pathlib import Path
from typing import Optional

import typer
import typer.core

from onebit.errors import UsageError, json_object


def default_model_path() -> str:
    from onebit.model import shipped_model_path

    return shipped_model_path()


LOUD_BYTES = 1 << 30  # a resident load of a file this large says what the plan chose (smaller ones stay quiet)


def load_spec(model: Optional[str], backend: str, ctx: Optional[int] = None, slots: Optional[str] = None,
              budget: Optional[str] = None, policy: str = "global", device: Optional[str] = None, predict=None,
              threads: Optional[int] = None, template_kwargs: Optional[dict] = None, cache_types=None,
              warm_start: bool = True):
    """The LoadSpec of a command's load flags, checked before anything is loaded (`cache_types`:
    a cache.KVTypes from the --cache-type options, None: f32)."""
    from onebit.cache import F32_KV
    from onebit.model import LoadSpec

    kv = cache_types or F32_KV
    spec = LoadSpec(path=model, backend=backend, n_ctx=ctx, slots=_slots(slots), budget=budget, pool_policy=policy,
                    device=device, predict=predict, threads=threads, template_kwargs=dict(template_kwargs or {}),
                    cache_type_k=kv.k, cache_type_v=kv.v, warm_start=warm_start)
    if ctx is not None:
        _check_ctx(spec.model_path(), ctx)
    if threads is not None and threads < 1:
        raise UsageError(f"--threads must be at least 1, got {threads}")
    return spec


def _load(model: Optional[str], backend: str, ctx: Optional[int] = None, slots: Optional[str] = None,
          budget: Optional[str] = None, policy: str = "global", trace: Optional[str] = None,
          device: Optional[str] = None, predict=None, threads: Optional[int] = None,
          template_kwargs: Optional[dict] = None, sequences: int = 1, cache_types=None,
          prompt_cache: Optional[int] = 0, warm_start: bool = True):
    import dataclasses

    import onebit

    spec = load_spec(model, backend, ctx, slots, budget, policy, device, predict, threads, template_kwargs,
                     cache_types, warm_start)
    m = onebit.load(dataclasses.replace(spec, sequences=sequences, prompt_cache=prompt_cache))
    if m.pool is not None or "reduced" in m.decision or m.gguf.file_bytes >= LOUD_BYTES or sequences > 1:
        import sys

        warm = f"; warm start {m.warm_start}" if m.pool is not None else ""
        sys.stderr.write(f"onebit: memory: {m.decision}{warm}\n")  # what the memory plan chose, in one line
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
    from onebit.formats.gguf_file import GGUFFile
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


# -- the environment: read here and nowhere else; the library gets what is found as arguments --

LOOKUP_ENV = "ONEBIT_LOOKUP"
PREDICT_ENV = "ONEBIT_MOE_PREDICT"  # the mode; ONEBIT_MOE_PREDICT_DEPTH etc. for each setting
DEVICE_ENV = "ONEBIT_VULKAN_DEVICE"
CACHE_ENV = "ONEBIT_CACHE_DIR"
CPU_TARGET_ENV = "ONEBIT_CPU_TARGET"


def _env(name: str) -> Optional[str]:
    """$name, or None where it is unset or blank."""
    value = os.environ.get(name, "").strip()
    return value or None


def _lookup(flag: Optional[int], default: int) -> int:
    """Drafts per forward: --lookup, else $ONEBIT_LOOKUP, else `default`."""
    from onebit.lookup import lookup_budget

    if flag is None:
        text = _env(LOOKUP_ENV)
        if text is not None:
            try:
                flag = int(text)
            except ValueError:
                raise UsageError(f"${LOOKUP_ENV} must be a whole number of drafts (0 = off), got {text!r}") from None
    return lookup_budget(flag, default=default)


def _device(flag: Optional[str]) -> Optional[str]:
    """The Vulkan device asked for: --device, else $ONEBIT_VULKAN_DEVICE, else None (the best one)."""
    return flag if flag is not None else _env(DEVICE_ENV)


def _predict(**flags):
    """PredictSettings from the --moe-predict* flags (PredictSettings field names), each over its
    $ONEBIT_MOE_PREDICT* variable; checked before loading."""
    from dataclasses import fields

    from onebit.moe.predict import PredictSettings, settings_from

    raw = {f.name: _env(PREDICT_ENV if f.name == "mode" else f"{PREDICT_ENV}_{f.name.upper()}")
           for f in fields(PredictSettings)}
    raw.update({k: v for k, v in flags.items() if v is not None})
    return settings_from(**raw)


def cpu_target(flag: Optional[str]) -> None:
    """Compile the cpu kernels for --cpu-target, else $ONEBIT_CPU_TARGET (avx2: a CPU with AVX2
    and FMA, no AVX-512), else for this machine (or numba's own $NUMBA_CPU_NAME and
    $NUMBA_CPU_FEATURES, which numba reads)."""
    name = flag if flag is not None else _env(CPU_TARGET_ENV)
    if name is not None:
        from onebit.backends.cpu.target import use

        use(name)


def cache_dir() -> Optional[Path]:
    """Where onebit keeps derived data: $ONEBIT_CACHE_DIR (off, 0 or none: nowhere), else
    $XDG_CACHE_HOME/onebit, else ~/.cache/onebit."""
    d = _env(CACHE_ENV)
    if d is not None:
        return None if d.lower() in ("off", "0", "none") else Path(d)
    return Path(_env("XDG_CACHE_HOME") or Path.home() / ".cache") / "onebit"


OLLAMA_SYSTEM = Path("/usr/share/ollama/.ollama/models")  # where ollama's Linux installer keeps models


def model_stores():
    """Where other tools keep GGUF files here (onebit.formats.catalog.Stores): $HF_HUB_CACHE, else
    $HF_HOME/hub, else ~/.cache/huggingface/hub; $OLLAMA_MODELS, else ~/.ollama/models, and
    ollama's system install (/usr/share/ollama/.ollama/models); LM Studio's two folders in the
    home folder."""
    from onebit.formats.catalog import Stores

    home = Path.home()
    hub = _env("HF_HUB_CACHE") or _env("HUGGINGFACE_HUB_CACHE")
    hf = Path(hub) if hub else Path(_env("HF_HOME") or home / ".cache" / "huggingface") / "hub"
    ollama = (Path(_env("OLLAMA_MODELS") or home / ".ollama" / "models"), OLLAMA_SYSTEM)
    lmstudio = (home / ".lmstudio" / "models", home / ".cache" / "lm-studio" / "models")
    return Stores(hf=hf, ollama=ollama, lmstudio=lmstudio)


# -- the model: a positional argument or -m / --model on every command that takes one --


def _model(arg: Optional[str], opt: Optional[str]) -> Optional[str]:
    """The model file from the positional argument or --model (None: the shipped model): a path,
    or a name `onebit list` shows (`qwen3:4b`, `org/repo/file`) for a file in another tool's store."""
    if arg is not None and opt is not None:
        raise UsageError(f"the model is given twice ({arg} and --model {opt}): give it once, either way")
    name = arg if arg is not None else opt
    if name is None or os.path.exists(name):
        return name
    from onebit.formats import catalog

    entry = catalog.lookup(name, (), model_stores())
    return entry.path if entry is not None else name  # (not found: the load says there is no such file)


def model_name(given: Optional[str], path: Optional[str]) -> Optional[str]:
    """The name a model was given by (a store name), where it is not its file's path."""
    return given if given is not None and path != given else None


MODEL_ARG = typer.Argument(None, help="GGUF model file (default: the small model shipped with onebit).")


MODEL_OPT = typer.Option(None, "--model", "-m", help="GGUF model file (default: the shipped model).")


BACKEND = typer.Option("auto", "--backend", help="Compute backend: auto (Vulkan on a GPU, else cpu), cpu, vulkan "
                                                  "or numpy (the reference).")


SLOTS = typer.Option(None, "--slots", help="Expert slots: a number or auto; fewer than all experts streams them "
                                          "from the file.")


BUDGET = typer.Option(None, "--budget", help="Memory budget, e.g. 12GiB (plans memory; refuses what won't fit).")


DEVICE = typer.Option(None, "--device", help="Vulkan device: index or name substring (see onebit devices).")


THREADS = typer.Option(None, "--threads", "-t", help="Threads of the cpu backend's kernels (default: every core).")


CPU_TARGET = typer.Option(None, "--cpu-target", help="Instruction sets the cpu backend's kernels are compiled for: "
                          "native (this CPU, the default) or avx2 (AVX2 and FMA, no AVX-512).")


POLICY = typer.Option("global", "--pool-policy", help="Expert pool eviction: global (one LRU) or layer.")


STATS = typer.Option(False, "--stats", help="Print expert-pool stats at exit.")


WARM_START = typer.Option(True, "--warm-start/--no-warm-start",
                          help="Where experts stream: start with the experts the last run on this file used most, "
                               "read in the background, and keep what this run uses for the next (a small record per "
                               "file in $ONEBIT_CACHE_DIR, else ~/.cache/onebit). --no-warm-start reads and keeps none.")


TRACE = typer.Option(None, "--trace", help="Record every token's routed experts to this JSONL file.")


CTX = typer.Option(None, "--ctx", help="Context length in tokens (default: min(model's, 4096)).")


PREDICT_PANEL = "Routing prediction, research settings (each also $ONEBIT_MOE_PREDICT_<NAME>)"


def _research(flag: str, help: str):
    return typer.Option(None, flag, help=help, rich_help_panel=PREDICT_PANEL)


# The --moe-predict options by the PredictSettings field each sets: the mode, then the research settings.
PREDICT_OPTIONS = {
    "mode": typer.Option(None, "--moe-predict", help="Routing prediction feeding the expert pool's prefetch: "
                                                     "auto, off, router or block (default $ONEBIT_MOE_PREDICT, else "
                                                     "auto: when experts stream, router on the cpu backend and block "
                                                     "on a GPU, the gate turning it off where it does not pay; "
                                                     "off when every expert is resident)."),
    "depth": _research("--moe-predict-depth", "Rank this many candidates per layer (default top-k)."),
    "margin": _research("--moe-predict-margin", "Read a deeper candidate only while its router logit is within "
                                                "this of the best."),
    "min": _research("--moe-predict-min", "Always read at least this many (default top-k)."),
    "layers": _research("--moe-predict-layers", "Layers predicted, e.g. 1,2,5-9 (default all MoE layers)."),
    "ahead": _research("--moe-predict-ahead", "Predict this many MoE layers ahead (default 1)."),
    "no_attn": _research("--moe-predict-no-attn", "Block mode without the mixer (0 or 1)."),
    "chain": _research("--moe-predict-chain", "Block mode, more than one ahead: run each deeper layer's block too "
                                              "(0 or 1; default 0: router form)."),
    "own": _research("--moe-predict-own", "Block mode: add this many of the current layer's top experts' output "
                                          "before predicting the next (default 1; 0: none)."),
    "out": _research("--moe-predict-out", "Per-token predicted / actual trace (JSONL)."),
    "stats": _research("--moe-predict-stats", "Print the per-layer prediction table at exit (0 or 1)."),
}


def predict_options(*without: str):
    """Decorator: a command's `predict` parameter becomes the PREDICT_OPTIONS (less the fields
    named in `without`), one option each as typer sees the command, and the command is called
    with one PredictSettings built from them (`_predict`: over $ONEBIT_MOE_PREDICT*, checked
    before anything loads)."""
    names = [n for n in PREDICT_OPTIONS if n not in without]

    def wrap(command):
        sig = inspect.signature(command)
        params = [p for p in sig.parameters.values() if p.name != "predict"]
        params += [inspect.Parameter(f"moe_predict_{n}", inspect.Parameter.KEYWORD_ONLY, default=PREDICT_OPTIONS[n],
                                     annotation=Optional[str]) for n in names]

        @functools.wraps(command)
        def run(**kw):
            given = {n: kw.pop(f"moe_predict_{n}") for n in names}
            return command(**kw, predict=_predict(**given))

        run.__signature__ = sig.replace(parameters=params)
        run.__annotations__ = {**{p.name: p.annotation for p in params}, "return": sig.return_annotation}
        return run

    return wrap


CACHE_TYPE_OPTIONS = {
    "k": typer.Option("f32", "--cache-type-k", "-ctk", help="Type the KV cache stores keys in: f32 (the default), "
                                                          "f16, q8_0 or q4_0 (as llama.cpp's -ctk; a quantized "
                                                          "cache takes less memory, leaving experts more)."),
    "v": typer.Option("f32", "--cache-type-v", "-ctv", help="Type the KV cache stores values in: f32 (the "
                                                          "default), f16, q8_0 or q4_0 (as llama.cpp's -ctv)."),
}


def cache_type_options(command):
    """Decorator: a command's `cache_types` parameter becomes --cache-type-k / --cache-type-v
    (-ctk / -ctv), and the command is called with one cache.KVTypes of them (checked first)."""
    sig = inspect.signature(command)
    params = [p for p in sig.parameters.values() if p.name != "cache_types"]
    params += [inspect.Parameter(f"cache_type_{n}", inspect.Parameter.KEYWORD_ONLY, default=opt, annotation=str)
               for n, opt in CACHE_TYPE_OPTIONS.items()]

    @functools.wraps(command)
    def run(**kw):
        from onebit.cache import KVTypes

        kv = KVTypes(kw.pop("cache_type_k").lower(), kw.pop("cache_type_v").lower())
        return command(**kw, cache_types=kv)

    run.__signature__ = sig.replace(parameters=params)
    run.__annotations__ = {**{p.name: p.annotation for p in params}, "return": sig.return_annotation}
    return run


class Command(typer.core.TyperCommand):
    """A command whose plain help (onebit turns typer's rich help off) lists the options of each
    `rich_help_panel` in a section of its own, after the options a user needs first."""

    def format_options(self, ctx, formatter) -> None:
        sections: dict[str, list] = {"Arguments": [], "Options": []}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is not None:
                title = ("Arguments" if param.param_type_name == "argument"
                         else getattr(param, "rich_help_panel", None) or "Options")
                sections.setdefault(title, []).append(record)
        for title, records in sections.items():
            if records:
                with formatter.section(title):
                    formatter.write_dl(records)


TEMPLATE_KWARGS = typer.Option(
    None, "--chat-template-kwargs",
    help='Extra chat-template variables as a JSON object, as llama.cpp takes them, e.g. '
         '\'{"enable_thinking": false}\' (Qwen3: answer without reasoning) or \'{"reasoning_effort": "low"}\' (gpt-oss).')


_TEMPLATE_OWN = ("messages", "add_generation_prompt", "bos_token", "eos_token", "tools")


def _template_kwargs(text: Optional[str]) -> dict:
    if text is None:
        return {}
    kw = json_object(text, "--chat-template-kwargs", ", such as '{\"enable_thinking\": false}'",
                     "; give an object such as '{\"enable_thinking\": false}'")
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
