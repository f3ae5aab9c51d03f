"""`onebit` entry point (typer). Parses, calls the library, prints."""

from __future__ import annotations

import json
import os
import sys
from typing import Optional

import typer

from onebit import __version__
from onebit.errors import OnebitError, UsageError, json_object

from .options import (BACKEND, BUDGET, CTX, DEVICE, LOOKUP, MODEL_ARG, MODEL_OPT, POLICY, SHOW_REASONING, SLOTS,
                      STATS, TEMPLATE_KWARGS, THREADS, TRACE, WARM_START, Command, _check_sampling, _device, _load, _lookup,
                      CPU_TARGET, _model, _template_kwargs, cache_dir, cpu_target, default_model_path, load_spec,
                      predict_options, cache_type_options)

app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode=None,
                  help="Run GGUF mixture-of-experts language models.")


def _finish(m, stats: bool, lookup=None) -> None:
    """At exit: close the trace and print expert-pool (and lookup decoding, and routing
    prediction) stats when asked."""
    if m.hook is not None and hasattr(m.hook, "close"):
        m.hook.close()
    if m.predictor is not None and (stats or m.predictor.s.stats):
        typer.echo(m.predictor.table(), err=True)
    if stats and lookup is not None:
        typer.echo(lookup.line(), err=True)
    if stats:
        from onebit.runner import pool_line

        typer.echo("stats: " + pool_line(m.pool, m.net.rows_run), err=True)
    m.close()


def _version(value: bool) -> None:
    if value:
        typer.echo(f"onebit {__version__}")
        raise typer.Exit(0)


@app.callback()
def root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version."),
    target: Optional[str] = CPU_TARGET,
) -> None:
    cpu_target(target)


# -- shared options ---------------------------------------------------------------------

# Names the renderer sets itself (onebit.chat_formats.chat_template.render_chat).


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:  # (one of them does not exist yet)
        return False


@app.command(cls=Command)
@predict_options()
@cache_type_options
def generate(
    model: Optional[str] = MODEL_ARG,
    model_opt: Optional[str] = MODEL_OPT,
    prompt: Optional[str] = typer.Option(None, "--prompt", "-p", help="One prompt."),
    input: Optional[str] = typer.Option(None, "--input", "-i",
                                        help="Prompts file: JSONL ({id, prompt} or {id, messages}) or text, "
                                             "one per line; '-' for stdin."),
    output: Optional[str] = typer.Option(None, "--output", "-o", help="Results JSONL (appended; reruns resume)."),
    input_format: str = typer.Option("auto", "--format", help="Input format: auto, jsonl or text."),
    on_error: str = typer.Option("skip", "--on-error", help="A bad input line: skip it or stop."),
    raw: bool = typer.Option(False, "--raw", help="Do not apply the chat template to prompts."),
    system: Optional[str] = typer.Option(None, "--system", help="System message for chat-formatted prompts."),
    max_tokens: int = typer.Option(256, "--max-tokens", "-n", help="Tokens to generate at most."),
    temperature: float = typer.Option(0.0, "--temperature", "--temp", help="0 = greedy."),
    top_k: int = typer.Option(0, "--top-k", help="Keep the k most likely tokens (0 = off)."),
    top_p: float = typer.Option(1.0, "--top-p", help="Nucleus sampling mass (1 = off)."),
    min_p: float = typer.Option(0.0, "--min-p", help="Drop tokens below min-p x the best one."),
    repeat_penalty: float = typer.Option(1.0, "--repeat-penalty", help="Repetition penalty (1 = off)."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Random seed (per prompt: seed and id)."),
    stop: list[str] = typer.Option([], "--stop", help="Stop string (repeatable)."),
    backend: str = BACKEND,
    ctx: Optional[int] = CTX,
    slots: Optional[str] = SLOTS,
    budget: Optional[str] = BUDGET,
    pool_policy: str = POLICY,
    stats: bool = STATS,
    trace: Optional[str] = TRACE,
    device: Optional[str] = DEVICE,
    threads: Optional[int] = THREADS,
    lookup: Optional[int] = LOOKUP,
    warm_start: bool = WARM_START,
    predict=None,  # a PredictSettings from the --moe-predict options (predict_options)
    cache_types=None,  # a KVTypes from the --cache-type options (cache_type_options)
    as_json: bool = typer.Option(False, "--json", help="Single prompt: print one JSON object."),
    template_kwargs: Optional[str] = TEMPLATE_KWARGS,
    ray_address: Optional[str] = typer.Option(
        None, "--ray", help="Spread --input over a Ray cluster: auto, ray://HOST:10001, a cluster address, or local "
                            "(start Ray on this machine). Needs the cluster extra: pip install 'onebit[cluster]'."),
    workers: Optional[int] = typer.Option(None, "--workers", help="With --ray: worker actors, each loading the model "
                                                                 "once (default: one per node)."),
    worker_cpus: float = typer.Option(1.0, "--worker-cpus", help="With --ray: CPUs each worker claims in Ray, and its "
                                                                 "cpu backend's threads."),
    show_reasoning: bool = typer.Option(
        False, "--show-reasoning",
        help="Models that reason apart from the reply (gpt-oss channels, <think> blocks of Qwen3 / GLM / "
             "DeepSeek-R1): keep the reasoning, as a `reasoning` "
             "field of each result (or on stderr for a streamed prompt). Default: dropped; `text` is the reply."),
    json_schema: Optional[str] = typer.Option(
        None, "--json-schema", "-j", help="Constrain every reply to JSON matching this JSON schema, given inline "
                                          "('{}' for any object); needs the serve extra (llguidance)."),
    json_schema_file: Optional[str] = typer.Option(
        None, "--json-schema-file", help="As --json-schema, the schema read from this file."),
) -> None:
    """Generate from one prompt, or from a file of prompts into a JSONL file."""
    from onebit.apps import batch
    from onebit.lookup import DEFAULT_DRAFTS, LookupStats

    model, device = _model(model, model_opt), _device(device)
    if (prompt is None) == (input is None):
        raise UsageError("give exactly one of --prompt or --input")
    if on_error not in ("skip", "stop"):
        raise UsageError(f"--on-error must be skip or stop, got {on_error!r}")
    if prompt is not None and not prompt.strip():
        raise UsageError("the prompt is empty")
    for name, text in (("--prompt", prompt), ("--system", system)):
        if text is not None:
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:
                raise UsageError(f"{name} is not valid UTF-8 text") from None
    _check_sampling(max_tokens, temperature, top_k, top_p, min_p, repeat_penalty)
    template_kw = _template_kwargs(template_kwargs)
    lookup = _lookup(lookup, default=0 if trace else DEFAULT_DRAFTS)
    lookup_stats = LookupStats() if lookup else None
    if any(s == "" for s in stop):
        raise UsageError("--stop '' would stop before the first token: give a non-empty stop string")
    if input is not None and output is None:
        raise UsageError("--input needs --output FILE.jsonl (or - for stdout) for the results")
    if input not in (None, "-") and output not in (None, "-") and _same_file(input, output):
        raise UsageError(f"--output {output} is the --input file (its results would be read as prompts, or its "
                         "prompts as results): give another --output")
    schema = _json_schema(json_schema, json_schema_file)
    if ray_address is not None:
        from .ray_batch import check_ray_args

        if schema is not None:
            raise UsageError("--json-schema does not go with --ray yet: run the batch on one machine")
        check_ray_args(input, model, ctx, trace, predict)
    elif workers is not None or worker_cpus != 1.0:
        raise UsageError("--workers and --worker-cpus go with --ray ADDRESS")
    results = batch.ResultsFile.open(output) if output is not None else None
    try:
        done = set()
        if results is not None and input is not None:
            done = results.resume()
            _warn_unreadable(results)
        if ray_address is not None:
            from .ray_batch import generate_on_ray

            gen = dict(max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                       repetition_penalty=repeat_penalty, stop=stop, lookup=lookup, show_reasoning=show_reasoning)
            generate_on_ray(ray_address, workers, worker_cpus, stats, input, input_format, results, on_error, done,
                            load_spec(model, backend, ctx, slots, budget, pool_policy, device, predict, threads,
                                      template_kw, cache_types, warm_start),
                            dict(raw=raw, system=system, seed=seed, gen=gen))
            return
        m = _load(model, backend, ctx, slots, budget, pool_policy, trace, device, predict, threads, template_kw,
                  cache_types=cache_types, warm_start=warm_start)
        try:
            _generate(m, prompt, input, input_format, results, on_error, raw, system, seed, as_json, done,
                      dict(max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                           repetition_penalty=repeat_penalty, stop=stop, lookup=lookup,
                           lookup_stats=lookup_stats, show_reasoning=show_reasoning,
                           constrain=_json_constraint(m, schema)))
        finally:
            _finish(m, stats, lookup_stats)
    finally:
        if results is not None:
            results.close()


def _json_schema(inline: Optional[str], file: Optional[str]) -> Optional[dict]:
    """The schema of --json-schema JSON or --json-schema-file FILE (not both), checked before
    any model is loaded; None without either."""
    from onebit.chat_formats.structured import check_schema, load_schema

    if inline is not None and file is not None:
        raise UsageError("give the JSON schema once: --json-schema JSON or --json-schema-file FILE")
    if file is not None:
        return load_schema(file)
    if inline is None:
        return None
    schema = json_object(inline, "--json-schema", ", such as '{\"type\": \"object\"}' ('{}': any object)",
                         "; give the schema itself, such as '{\"type\": \"object\"}', or a file with --json-schema-file")
    check_schema(schema, "--json-schema")
    return schema


def _json_constraint(m, schema):
    """A maker of a fresh JSON constraint per prompt (it holds the parse state), or None."""
    if schema is None:
        return None
    from onebit.chat_formats.structured import Constraint, json_grammar

    grammar = json_grammar(schema or None)
    Constraint(m, grammar)  # refuse a grammar the model's vocabulary cannot write, before any prompt
    return lambda: Constraint(m, grammar)


def _warn_unreadable(results) -> None:
    bad = results.unreadable_lines
    if bad:
        where = ", ".join(map(str, bad[:5])) + (", ..." if len(bad) > 5 else "")
        typer.echo(f"onebit: warning: {results.path}: {len(bad)} line(s) that are not results (line {where}) "
                   f"are kept as they are", err=True)


def _generate(m, prompt, input, input_format, results, on_error, raw, system, seed, as_json, done, gen) -> None:
    from onebit.apps import batch

    chat = not raw and m.chat_template is not None
    if input is None:
        item = batch.PromptItem("1", 1, prompt=prompt)
        why = batch.too_long(m, len(batch.prompt_ids(m, item, chat=chat, system=system)))
        if why is not None:
            raise UsageError(why)
        if results is not None or as_json:
            rec = batch.generate_one(m, item, chat=chat, system=system, seed=seed, **gen)
            if results is not None:
                results.write(rec)
            if results is None or (as_json and results.path != "-"):
                typer.echo(json.dumps(rec, ensure_ascii=False))
            return
        _stream_one(m, item, chat, system, seed, gen)
        return
    _run_batch(m, input, input_format, results, on_error, chat, system, seed, done, gen)


def _stream_one(m, item, chat, system, seed, gen) -> None:
    from onebit.apps import batch

    from onebit.chat_formats.think import reply_splitter

    from .chat_repl import visible

    gen = dict(gen)
    show_reasoning = gen.pop("show_reasoning", False)
    constrain = gen.pop("constrain", None)
    if constrain is not None:
        gen["processors"] = [constrain()]
    # gpt-oss: print the final channel; <think> blocks: print the reply after the block (think.py)
    channels = reply_splitter(m, batch.prompt_ids(m, item, chat=chat, system=system)) if chat else None
    msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": item.prompt}]
    tty = sys.stdout.isatty()  # on a terminal, control characters in the output are shown escaped
    for r in m.generate(msgs if chat else item.prompt, seed=batch.prompt_seed(seed, item.id), **gen):
        text = r.text
        if channels is not None:
            thinking, text = channels.feed(text, final=r.finish_reason is not None)
            if thinking and show_reasoning:
                sys.stderr.write(visible(thinking))
                sys.stderr.flush()
        sys.stdout.write(visible(text) if tty else text)
        sys.stdout.flush()
    sys.stdout.write("\n")


def _run_batch(m, input, input_format, results, on_error, chat, system, seed, done, gen) -> None:
    from tqdm import tqdm

    from onebit.apps import batch

    stream, total = batch.open_prompts(input)
    with tqdm(total=total, unit="prompt", file=sys.stderr, disable=None, dynamic_ncols=True) as bar:
        run = batch.BatchRun(results, input, on_error, done, tick=bar.update,
                             warn=lambda msg: tqdm.write(f"onebit: warning: {msg}", file=sys.stderr))
        for item in run.pending(stream, input_format):
            run.record(item, batch.generate_one(m, item, chat=chat, system=system, seed=seed, **gen))
    for line in run.summary():
        typer.echo(line, err=True)


@app.command(cls=Command)
def info(
    model: Optional[str] = MODEL_ARG,
    model_opt: Optional[str] = MODEL_OPT,
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Describe a model: architecture, parameters, experts, types, tokenizer."""
    from onebit.formats.gguf_file import GGUFFile
    from onebit.apps.info import format_info, model_info
    from onebit.models import network_class

    model = _model(model, model_opt)
    path = default_model_path() if model is None else model
    g = GGUFFile(path)
    cfg = network_class(g.architecture, path).config(g)
    data = model_info(g, cfg, _cpu_target())
    typer.echo(json.dumps(data, indent=2) if as_json else format_info(data))


def _cpu_target() -> Optional[dict]:
    """What the cpu backend's kernels are compiled for here, or None where numba cannot load."""
    try:
        from onebit.backends.cpu.target import describe

        return describe()
    except ImportError:  # (no numba here: the cpu backend cannot run)
        return None


@app.command(cls=Command)
def devices() -> None:
    """List the Vulkan devices (name, type, heaps, limits), the CPU, and which backend auto picks
    here; --device (or $ONEBIT_VULKAN_DEVICE) takes a device's index or part of its name."""
    from onebit.backends.info import device_report

    typer.echo(device_report(_device(None)))


@app.command(cls=Command)
@cache_type_options
def plan(
    model: Optional[str] = MODEL_ARG,
    model_opt: Optional[str] = MODEL_OPT,
    ctx: Optional[int] = typer.Option(None, "--ctx", help="Context length to plan the KV cache for (default: as a "
                                                          "load picks it: min(model's, 4096), less when streaming)."),
    layers: str = typer.Option("", "--moe-predict-layers", "--layers",
                               help="Layers whose next-layer routing is predicted in block mode (their "
                                    "scratch is counted), e.g. 1,2,5-9 (default: as a load does: every MoE "
                                    "layer when streaming on a GPU; none on the cpu, whose default router "
                                    "prediction needs no scratch)."),
    slots: str = typer.Option("auto", "--slots", help="Expert slots: a number, or auto (what fits)."),
    budget: Optional[str] = typer.Option(None, "--budget", help="Memory budget, e.g. 12GiB (default: detected)."),
    reserve: Optional[str] = typer.Option(None, "--reserve", help="Left for the OS when detecting (default 1GiB)."),
    verify_rows: int = typer.Option(8, "--verify-rows", help="Rows verified at once by speculative decoding."),
    backend: str = typer.Option("auto", "--backend", help="auto, cpu, numpy or vulkan; on vulkan (auto: on a GPU) "
                                                          "the device's heap and limits are in the budget."),
    device: Optional[str] = DEVICE,
    parallel: int = typer.Option(1, "--parallel", "-np", help="Sequences decoded together (serve --parallel): "
                                                              "a KV cache of the whole context for each."),
    cache_ram: str = typer.Option("0", "--cache-ram", "-cram", help="MiB for serve's saved prompt prefixes, or "
                                                                    "auto (what the plan leaves, at most 8192: "
                                                                    "serve's default)."),
    cache_types=None,  # a KVTypes from the --cache-type options (cache_type_options)
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Dry run of the memory plan: what is resident, how many expert slots fit, and whether it fits.
    Exit 0 if it fits, 1 if not, 2 on bad input. Allocates nothing."""
    from onebit.formats.gguf_file import GGUFFile
    from onebit.memory.budget import detect_budget
    from onebit.memory.plan import plan_load
    from onebit.models import network_class

    model, device = _model(model, model_opt), _device(device)
    path = default_model_path() if model is None else model
    from onebit.backends import backend_class, resolve

    cls = backend_class(resolve(backend, device))
    b = detect_budget(budget, reserve, **cls.device_limits(device))
    g = GGUFFile(path)
    cfg = network_class(g.architecture, path).config(g)
    cache_types.check(cfg)
    p = plan_load(g, cfg, b, ctx=ctx, layers=layers, slots=None if slots == "auto" else slots,
                  verify_rows=verify_rows, policy=cls.memory_policy(g),
                  predict_when_streaming=not layers and not cls.runs_on_host, sequences=parallel, kv=cache_types,
                  prompt_cache=_cache_ram(cache_ram))
    typer.echo(json.dumps(p.to_dict(), indent=2) if as_json else p.table())
    raise typer.Exit(0 if p.fits else 1)


def _cache_ram(value: str) -> Optional[int]:
    """plan's --cache-ram: MiB as bytes, None for auto (serve's default)."""
    if value == "auto":
        return None
    try:
        mib = int(value)
    except ValueError:
        raise UsageError(f"--cache-ram must be a number of MiB or auto, got {value!r}") from None
    if mib < 0:
        raise UsageError(f"--cache-ram must be at least 0 MiB, got {mib}")
    return mib << 20


@app.command(cls=Command)
@predict_options()
@cache_type_options
def chat(
    model: Optional[str] = MODEL_ARG,
    model_opt: Optional[str] = MODEL_OPT,
    system: Optional[str] = typer.Option(None, "--system", help="System message."),
    max_tokens: int = typer.Option(512, "--max-tokens", "-n", help="Longest reply in tokens."),
    temperature: float = typer.Option(0.7, "--temperature", "--temp"),
    top_k: int = typer.Option(0, "--top-k"),
    top_p: float = typer.Option(0.95, "--top-p"),
    min_p: float = typer.Option(0.05, "--min-p"),
    repeat_penalty: float = typer.Option(1.0, "--repeat-penalty"),
    seed: Optional[int] = typer.Option(None, "--seed"),
    backend: str = BACKEND,
    ctx: Optional[int] = CTX,
    slots: Optional[str] = SLOTS,
    budget: Optional[str] = BUDGET,
    pool_policy: str = POLICY,
    stats: bool = STATS,
    trace: Optional[str] = TRACE,
    device: Optional[str] = DEVICE,
    threads: Optional[int] = THREADS,
    lookup: Optional[int] = LOOKUP,
    warm_start: bool = WARM_START,
    predict=None,  # a PredictSettings from the --moe-predict options (predict_options)
    cache_types=None,  # a KVTypes from the --cache-type options (cache_type_options)
    template_kwargs: Optional[str] = TEMPLATE_KWARGS,
    show_reasoning: bool = SHOW_REASONING,
) -> None:
    """Chat in the terminal. /help lists the commands."""
    from onebit.lookup import DEFAULT_DRAFTS

    from .chat_repl import run_chat

    model, device = _model(model, model_opt), _device(device)
    _check_sampling(max_tokens, temperature, top_k, top_p, min_p, repeat_penalty)
    template_kw = _template_kwargs(template_kwargs)
    lookup = _lookup(lookup, default=0 if trace else DEFAULT_DRAFTS)
    m = _load(model, backend, ctx, slots, budget, pool_policy, trace, device, predict, threads, template_kw,
              cache_types=cache_types, warm_start=warm_start)
    try:
        first = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": "hi"}]
        n = len(m.chat_tokens(first))
        if n >= m.context_length:
            raise UsageError(f"--ctx {m.context_length} leaves no room to chat: the chat template alone takes "
                             f"{n} tokens")
        run_chat(m, system=system, max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                 min_p=min_p, repetition_penalty=repeat_penalty, seed=seed, lookup=lookup,
                 show_reasoning=show_reasoning)
    finally:
        _finish(m, stats)


@app.command(cls=Command)
@predict_options()
@cache_type_options
def bench(
    model: Optional[str] = MODEL_ARG,
    model_opt: Optional[str] = MODEL_OPT,
    prompt_tokens: int = typer.Option(64, "--prompt-tokens", help="Prompt length to time."),
    gen_tokens: int = typer.Option(32, "--gen-tokens", help="Decode steps to time."),
    runs: int = typer.Option(3, "--runs", help="Runs; the median is reported."),
    no_warmup: bool = typer.Option(False, "--no-warmup", help="Count the first run too (by default one run "
                                   "first is not counted, as llama-bench's warm-up)."),
    backend: str = BACKEND,
    device: Optional[str] = DEVICE,
    threads: Optional[int] = THREADS,
    ctx: Optional[int] = CTX,
    slots: Optional[str] = SLOTS,
    budget: Optional[str] = BUDGET,
    pool_policy: str = POLICY,
    stats: bool = STATS,
    lookup: Optional[int] = LOOKUP,
    warm_start: bool = WARM_START,
    predict=None,  # a PredictSettings from the --moe-predict options (predict_options)
    cache_types=None,  # a KVTypes from the --cache-type options (cache_type_options)
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Prompt and decode tok/s on this machine (median of runs)."""
    model, device = _model(model, model_opt), _device(device)
    if prompt_tokens < 1 or gen_tokens < 1 or runs < 1:
        raise UsageError("--prompt-tokens, --gen-tokens and --runs must be >= 1")
    lookup = _lookup(lookup, default=0)  # a benchmark of plain decoding unless asked
    m = _load(model, backend, ctx, slots, budget, pool_policy, device=device, predict=predict, threads=threads,
              cache_types=cache_types, warm_start=warm_start)
    try:
        _bench(m, prompt_tokens, gen_tokens, runs, lookup, as_json, not no_warmup)
    finally:
        _finish(m, stats)


def _bench(m, prompt_tokens, gen_tokens, runs, lookup, as_json, warmup: bool = True) -> None:
    from onebit.apps.bench import run_bench

    res = run_bench(m, prompt_tokens, gen_tokens, runs, lookup=lookup, warmup=warmup)
    if as_json:
        typer.echo(json.dumps(res, indent=2))
    else:
        typer.echo(f"model    {res['model']}\nbackend  {res['backend']} ({res['backend_detail']})")
        typer.echo(f"prompt   {res['prompt_tokens']} tokens: {res['prompt_tps']:.1f} tok/s (median of {runs})")
        typer.echo(f"decode   {res['gen_tokens']} tokens: {res['decode_tps']:.1f} tok/s (median of {runs})")
        if lookup:
            lk = res["lookup"]
            typer.echo(f"lookup   up to {lookup} drafts: {lk['drafts_accepted']} of {lk['drafts_proposed']} accepted, "
                       f"{lk['tokens_per_forward']:.2f} tokens per forward")


@app.command("cache-sim", cls=Command)
def cache_sim(
    trace: str = typer.Argument(..., help="Routing trace from --trace."),
    slots: list[int] = typer.Option(..., "--slots", help="Pool size in experts (repeatable)."),
    policy: list[str] = typer.Option([], "--policy", help="Policies to replay (default: all)."),
    decay: float = typer.Option(0.95, "--decay", help="Per-token decay of global-lfu counts."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Replay a routing trace through expert-cache policies and print hit rates (decode tokens)."""
    from onebit.moe.cachesim import POLICIES, format_table, load_trace, simulate

    bad = [n for n in slots if n < 1]
    if bad:
        raise UsageError(f"--slots {bad[0]}: the pool needs at least 1 slot")
    if not 0.0 <= decay <= 1.0:
        raise UsageError(f"--decay {decay}: give a number from 0 to 1")
    t = load_trace(trace)
    results = []
    for n in slots:
        for p in policy or POLICIES:
            try:
                results.append(simulate(t, p, n, decay))
            except UsageError:
                if policy:  # asked for by name: say why it cannot run
                    raise
    decode_tokens = len({a.token for a in t.accesses if a.decode})
    if as_json:
        typer.echo(json.dumps([{"policy": r.policy, "slots": r.slots, "hit_rate": r.hit_rate, "hits": r.hits,
                                "accesses": r.accesses} for r in results], indent=2))
    else:
        typer.echo(format_table(results, decode_tokens))


def _click_errors() -> tuple[type, type]:
    """(ClickException, UsageError) of the click that typer runs on: typer ships its own copy
    of click, whose exceptions are not the `click` package's, so take them from typer's own."""
    mro = typer.BadParameter.__mro__
    return (next(c for c in mro if c.__name__ == "ClickException"), next(c for c in mro if c.__name__ == "UsageError"))


def main() -> None:
    import logging
    import warnings

    handler = logging.StreamHandler(sys.stderr)  # library warnings as the CLI's own one-line warnings
    handler.setFormatter(logging.Formatter("onebit: warning: %(message)s"))
    handler.setLevel(logging.WARNING)
    logging.getLogger("onebit").addHandler(handler)

    warnings.simplefilter("ignore", RuntimeWarning)  # numeric trouble is one error from the engine instead
    from onebit.formats.tokenizer import set_cache_dir

    set_cache_dir(cache_dir())
    from .serve import register  # `serve` and `list` (that module imports this one's options)

    register(app)
    click_exception, click_usage = _click_errors()
    try:
        rc = app(prog_name="onebit", standalone_mode=False)  # click returns an Exit's code in this mode
        sys.exit(rc if isinstance(rc, int) else 0)
    except OnebitError as e:
        _print_error(str(e), e.exit_code)
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except (typer.Abort, KeyboardInterrupt):
        sys.stderr.write("onebit: interrupted\n")
        sys.exit(130)
    except BrokenPipeError:
        sys.exit(0)
    except click_usage as e:  # bad arguments: click's usage line, then one error line; exit 2
        if type(e).__name__ == "NoArgsIsHelpError":  # plain `onebit`: the help
            sys.stderr.write(e.format_message() + "\n")
            sys.exit(2)
        if e.ctx is not None:
            sys.stderr.write(e.ctx.get_usage() + "\n")
            sys.stderr.write(f"Try '{e.ctx.command_path} {e.ctx.help_option_names[0]}' for help.\n")
        _print_error(e.format_message(), 2)
    except click_exception as e:
        _print_error(e.format_message(), e.exit_code)
    except Exception as e:  # anything unexpected: one line, no traceback
        if os.environ.get("ONEBIT_DEBUG"):
            raise
        _print_error(f"internal error: {type(e).__name__}: {e} (set ONEBIT_DEBUG=1 for a traceback)", 1)


def _print_error(msg: str, code: int) -> None:
    msg = " ".join(msg.split())
    sys.stderr.write(f"onebit: error: {msg}\n")
    sys.exit(code)


if __name__ == "__main__":
    main()
