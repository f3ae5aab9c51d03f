"""The public model object: tokenizer, chat template, network and backend in one place."""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import threading
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional, Sequence

import numpy as np

from .backends import backend_class, fallback_order, host_backend, resolve
from .errors import BackendUnavailableError, UsageError
from .generate import GenerationResponse, stream_generate
from .formats.gguf_file import GGUFFile
from .lookup import DEFAULT_DRAFTS, lookup_budget
from .models import network_class
from .models.base import check_ids
from .runner import Runner
from .sample import make_logits_processors, make_sampler
from .formats.tokenizer import Tokenizer

log = logging.getLogger("onebit")


def shipped_model_path() -> str:
    """The small model shipped with onebit (what a load without a path opens)."""
    from importlib.resources import files

    return str(files("onebit") / "data" / "default.gguf")


@dataclass(frozen=True)
class LoadSpec:
    """How to load a model, defined once: `onebit.load` takes one (or a path and these fields as
    keywords), the CLI builds one from its flags, serve loads every model a request switches to
    with the one it started with, and each Ray worker loads with the driver's."""

    path: Optional[str] = None  # the GGUF file (None: the model shipped with onebit)
    backend: str = "auto"  # auto (Vulkan on a GPU, else cpu), vulkan, cpu, or numpy (the reference)
    n_ctx: Optional[int] = None  # None: as the memory plan picks it (min(model's, 4096), less when streaming)
    slots: Optional[int | str] = None  # expert slots, a number or "auto"; with `budget`: memory is planned first
    budget: Optional[str | int] = None  # e.g. "12GiB" (None: detected)
    pool_policy: str = "global"  # expert pool eviction: global (one LRU) or layer
    device: Optional[str | int] = None  # the Vulkan device, an index or part of its name (None: the default)
    predict: Any = None  # routing prediction: a mode name or moe.predict.PredictSettings (None: auto)
    threads: Optional[int] = None  # the cpu backend's kernel threads (None: every core)
    # caches the plan holds room for (serve's --parallel: sequences decoded together); more than
    # one asks for them, as a budget does: a plan that does not fit is refused
    sequences: int = 1
    # bytes for the prefixes serve saves beside those caches (--cache-ram; None: what the plan
    # leaves, as memory.plan.plan_load says); 0: none
    prompt_cache: Optional[int] = 0
    # files of at least this many bytes take the backend's own weight layouts (the cpu backend's
    # X16 on AVX-512 VNNI); None: the backend's default (cpu: 64 MiB), 0: every file
    repack_from: Optional[int] = None
    # the types the KV cache stores keys and values in: f32, f16, q8_0 or q4_0 (llama.cpp's
    # --cache-type-k / --cache-type-v; a quantized cache takes less memory, the plan counts it)
    cache_type_k: str = "f32"
    cache_type_v: str = "f32"
    template_kwargs: dict = field(default_factory=dict)  # extra chat-template variables, e.g. {"enable_thinking": False}
    # where experts stream: warm the pool from what the last process to close this file learned,
    # and keep what this one learns at close (memory/warm.py), in the folder that
    # formats.tokenizer.set_cache_dir names (none set: nothing is kept)
    warm_start: bool = True

    def model_path(self) -> str:
        return self.path if self.path is not None else shipped_model_path()


class Model:
    """The facade a user loads: tokenizer, chat template, memory plan, backend and network
    (`self.net`, the architecture's schedule over the backend) in one place. It owns the file,
    the expert pool and its slots, the backend and the predictor, and `close` frees them in the
    reverse order (also as a context manager: `with onebit.load(...) as m:`)."""

    def __init__(self, spec: LoadSpec):
        self.spec = spec
        self.path = spec.model_path()
        self.gguf = GGUFFile(self.path)
        cls = network_class(self.gguf.architecture, self.path)
        cfg = cls.config(self.gguf)
        if spec.n_ctx is not None and spec.n_ctx < 1:
            raise UsageError(f"context length must be >= 1, got {spec.n_ctx}")
        if spec.threads is not None and spec.threads < 1:
            raise UsageError(f"threads must be >= 1, got {spec.threads}")
        self.hook = None  # called between every MoE router and its experts (e.g. a TraceWriter)
        self.template_kwargs: dict = dict(spec.template_kwargs)  # extra chat-template variables
        from .memory.guard import MemoryGuard

        self.guard = MemoryGuard()  # checked every generated token
        self.closed = False
        # where experts stream: "off", "no record", "record ignored" or "from a record (N experts)"
        self.warm_start = "off"
        self._record: Optional[tuple] = None  # (folder, what the record held) when one is kept at close
        # The load path: file -> config -> plan -> expert source -> backend -> network. One
        # fallback rule: a backend that cannot run here (or cannot run this model) gives way to
        # the next fastest that can, said in one line; a device asked for by name must exist.
        order = fallback_order(resolve(spec.backend, spec.device))
        if spec.device is not None:
            backend_class(order[0]).find_device(spec.device)
        for i, name in enumerate(order):
            try:
                with np.errstate(all="ignore"):  # weights dequantized at load: NaN / inf show up as an error later
                    self.plan, self.pool, self.slot_memory, self.be, predict = self._open(backend_class(name), cfg)
                    self.context_length = self.plan.ctx
                    # a streamed plan allocates its KV cache up front, as planned (a resident
                    # load grows it as the context fills, so a short chat holds little)
                    held = self.pool is not None or spec.slots is not None or spec.budget is not None
                    try:
                        self.net = Runner(cls(cfg), self.gguf, self.be, self.context_length if held else 0)
                    except BaseException:
                        self._free_parts()
                        raise
                break
            except BackendUnavailableError as e:
                if i + 1 == len(order):
                    raise
                sys.stderr.write(f"onebit: warning: {e}; using the {order[i + 1]} backend\n")
                log.info("backend %s unavailable, using %s: %s", name, order[i + 1], e)  # (stderr has it already)
        self.decision = self.plan.decision  # one line: resident or streamed, the context, the budget
        self.cfg = self.net.cfg
        if predict.on:
            self.set_predict(predict)
        self.tokenizer = Tokenizer.from_metadata(self.gguf.metadata, self.path)
        self.chat_template: Optional[str] = self.gguf.get("tokenizer.chat_template")
        from .chat_formats.chat_template import fallback_template

        # what `chat` renders with when the file has no template
        self.fallback_template = fallback_template(self.gguf.get("tokenizer.ggml.tokens"))[1]

    def _open(self, backend, cfg):
        """(plan, pool, the pool's slot memory, backend, prediction settings) for backend class
        `backend`, which answers for itself (backends/base.py): its device, the budget's limits
        there, how it holds this file's tensors, where a pool's slots live. Prediction "auto"
        resolves to router (host backends) or block (a device) where experts stream (its gate
        turns it off where it does not pay) and off where every expert is resident. Memory is planned on every load, against the
        detected budget or the one given (memory.plan.plan_load: the same plan `onebit plan`
        prints): routed experts stream through a pool when they do not all fit with margin. A
        plan that does not fit is refused when a budget, slots or a context were asked for; with
        none of them the load goes ahead with what the plan chose (the most it can) and says so
        in one line."""
        from .cache import KVTypes
        from .memory.budget import detect_budget
        from .memory.plan import PlanError, plan_load
        from .memory.pool import ExpertPool
        from .moe.predict import as_settings

        spec = self.spec
        kv = KVTypes(spec.cache_type_k, spec.cache_type_v)
        kv.check(cfg)
        dev = backend.open_device(spec.device)
        policy = backend.memory_policy(self.gguf, spec.repack_from)
        predict = as_settings(spec.predict)
        auto = predict.mode == "auto"
        b = detect_budget(spec.budget, **backend.device_limits(spec.device))
        # scratch for block prediction only: router prediction (auto's on a host backend) needs
        # one row's router logits a layer, no mixer's activations or K/V (106 MiB, 36 slots, on
        # the 30B-A3B shape at 8 GiB)
        plan = plan_load(self.gguf, cfg, b, ctx=spec.n_ctx, layers="" if auto else _predicted_layers(cfg, predict),
                         slots=spec.slots, policy=policy, predict_when_streaming=auto and not backend.runs_on_host,
                         sequences=spec.sequences, kv=kv, prompt_cache=spec.prompt_cache)
        if auto:
            # (where experts stream: router prediction on a host backend, whose cores the
            # prediction takes from the forward, block on a device, beside which the host is
            # idle; bench/results/trained-routing-30b-streaming-2026-12-07.md)
            mode = ("router" if backend.runs_on_host else "block") if plan.streaming else "off"
            predict = dataclasses.replace(predict, mode=mode, look=True)
        if not plan.fits:
            if spec.slots is not None or spec.budget is not None or spec.n_ctx is not None or spec.sequences > 1 \
                    or spec.prompt_cache:
                raise PlanError(plan)
            sys.stderr.write(f"onebit: warning: {self.path} does not fit the memory budget (needs at least "
                             f"{_gib(plan.total)} GiB, {_gib(plan.budget.bytes)} GiB left): loading anyway, "
                             "expect paging; see `onebit plan`\n")
        pool = slots = be = None
        try:
            if plan.streaming:
                slots = backend.slot_allocator(dev)
                pool = ExpertPool(self.gguf, plan.classes, plan.slots, policy=spec.pool_policy, allocate=slots,
                                  layout=policy.experts)
                if backend.reads_map:
                    self._copy_resident(skip=policy.packs)
                self._warm(pool, cfg)
            elif backend.reads_map and plan.fits:
                experts = policy.experts
                self._map_weights(skip=lambda t: policy.packs(t) or (experts is not None and experts.packs(t)))
            be = backend.open(self.gguf, experts=pool, device=dev, slot_arrays=slots, policy=policy,
                              threads=spec.threads)
            be.kv_types = kv
            be.repack(experts=plan.fits)
            return plan, pool, slots, be, predict
        except BaseException:
            _free(be, pool, slots)
            raise

    def _warm(self, pool, cfg) -> None:
        """Start warming `pool` from the record an earlier process kept of this file (its reads
        run behind every other read, memory/pool.py ExpertPool.warm), and note where this one's
        goes at close."""
        from .formats.tokenizer import cache_dir
        from .memory.warm import read_record, record_path, warm_order

        folder = cache_dir()
        if not self.spec.warm_start or folder is None:
            return
        learned = read_record(folder, self.path, {layer: len(u) for layer, u in pool.uses.items()})
        self._record = (folder, learned)
        if learned is None:
            self.warm_start = "record ignored" if record_path(folder, self.path).exists() else "no record"
            return
        n = pool.warm(warm_order(learned, cfg.n_experts_used), source="from a record")
        self.warm_start = f"from a record ({n} experts)"

    def _keep_learned(self) -> None:
        """Write what the pool learned to this file's record (memory/warm.py), where one is kept
        and the pool was used."""
        from .memory.warm import merged, write_record

        if self._record is None or self.pool is None or self.pool.stats.acquires == 0:
            return
        folder, old = self._record
        write_record(folder, self.path, merged(old, self.pool.learned()))

    def _copy_resident(self, skip=lambda t: False) -> None:
        """When streaming, hold the non-expert tensors in memory (the plan counts them) so a file
        that shrinks or fails under us gives a read error from the pool, not a SIGBUS from the map.
        Read with pread, not copied from the map: pages touched through the map would count
        in this process's resident memory beside the copy (a 30B-A3B: 0.96 GiB twice). Not the
        tensors the backend holds in a layout of its own (`skip`: its memory policy's `packs`):
        it copies those from the map itself, and a copy here would be a second one."""
        from tqdm import tqdm

        from .errors import ModelFileError
        from .formats.gguf_file import is_expert_tensor

        # (an expert part's bias, gpt-oss, is small and resident too)
        resident = [t for name, t in self.gguf.tensors.items()
                    if (not is_expert_tensor(name) or name.endswith(".bias")) and not skip(t)]
        total = sum(t.n_bytes for t in resident)
        fds: dict[str, int] = {}
        try:
            with tqdm(total=total, unit="B", unit_scale=True, desc="loading", file=sys.stderr, leave=False,
                      disable=True if total < (256 << 20) else None) as bar:
                for t in resident:
                    if isinstance(t.raw, np.memmap) or t.raw.base is not None:
                        if t.file not in fds:
                            fds[t.file] = os.open(t.file, os.O_RDONLY)
                        buf = np.empty(t.n_bytes, np.uint8)
                        done = 0
                        while done < t.n_bytes:  # (one preadv moves at most about 2 GiB)
                            got = os.preadv(fds[t.file], [memoryview(buf[done:])], t.offset + done)
                            if got <= 0:
                                raise ModelFileError(f"{t.file}: file ended early while loading {t.name} "
                                                     "(truncated?)")
                            done += got
                        raw = buf.view(t.raw.dtype).reshape(t.raw.shape)
                        self.gguf.tensors[t.name] = dataclasses.replace(t, raw=raw)
                    bar.update(t.n_bytes)
        except OSError as e:
            raise ModelFileError(f"{self.path}: cannot read the model file ({e.strerror or e})") from None
        finally:
            for fd in fds.values():
                os.close(fd)

    def _map_weights(self, skip=lambda t: False) -> None:
        """Every weight resident on the host: map all their pages now (GGUFFile.populate), as
        llama.cpp maps a file at load. A decode step reads a few experts of each layer,
        different ones each token, scattered over the file: left to first touch, those pages
        fault inside the steps for as long as new ones come. Measured on the 30B-A3B-shape file
        (2-core VM, file in the page cache, `bench/bench_map.py`, medians of 2): load 1.1 -> 1.6
        s, a 128-token prompt 12.0 -> 15.5 tok/s, then 32 greedy tokens 8.0 -> 8.6 tok/s. The
        token embedding is the same case: a step reads one row of it, a new one for each new
        token (same file with the page cache emptied by another program: 2.7 ms of a 94 ms
        step waited on the drive for that row). Not the tensors `skip` names: the backend reads
        them once into a layout of its own (it maps each as it does) and never again."""
        from tqdm import tqdm

        from .formats.gguf_file import is_expert_tensor

        # experts first: where the system cannot, it says so at the first tensor
        order = sorted((t for t in self.gguf.tensors.values() if not skip(t)), key=lambda t: not is_expert_tensor(t.name))
        total = sum(t.n_bytes for t in order)
        with tqdm(total=total, unit="B", unit_scale=True, desc="mapping", file=sys.stderr, leave=False,
                  disable=True if total < (256 << 20) else None) as bar:
            for t in order:
                if not self.gguf.populate(t):
                    return  # (this system cannot: first touch it is)
                bar.update(t.n_bytes)

    @property
    def predictor(self):
        """The routing predictor (moe.predict.Predictor) the network runs at its pause points, or None."""
        return self.net.predictor

    def set_predict(self, settings) -> None:
        """Routing prediction at every MoE pause point (a moe.predict.PredictSettings, or a mode
        name: off, router, block), feeding the expert pool's prefetch queue when streaming."""
        from .moe.predict import Predictor, as_settings

        settings = as_settings(settings)
        if self.net.predictor is not None:
            self.net.predictor.close()
        self.net.predictor = None
        if settings.on:
            if not any(self.cfg.layer_is_moe(i) for i in range(self.cfg.n_layers)):
                raise UsageError(f"{self.path}: routing prediction needs a mixture-of-experts model")
            be = self.be
            host = be if be.runs_on_host else host_backend(self.gguf, self.pool, self.spec.threads,
                                                            self.spec.repack_from)
            # the host's expert ops read a pool's slots only where the backend says that is cheap
            # (a device backend's slots: only in memory the host owns too)
            own_ok = self.pool is None or be.host_reads_slots
            self.net.predictor = Predictor(self.gguf, self.cfg, settings, self.pool, host,
                                           overlapped=be.overlaps_host, own_ok=own_ok)

    def close(self) -> None:
        """Free what the model holds, the reverse of its making: the predictor, the backend (its
        device memory), the expert pool (its reader threads stop), the pool's slots. Once."""
        if self.closed:
            return
        self.closed = True
        if self.net.predictor is not None:
            self.net.predictor.close()  # (its stats and table stay readable)
        self._keep_learned()
        self._free_parts()

    def _free_parts(self) -> None:
        _free(self.be, self.pool, self.slot_memory)

    def __enter__(self) -> "Model":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- text -------------------------------------------------------------------------

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special=add_special, parse_special=parse_special)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids))

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: Optional[list[dict]] = None, template_kwargs: Optional[dict] = None) -> str:
        """The conversation rendered with the chat template; `tools`: the tool definitions the
        template shows the model; `template_kwargs`: variables for this render, over the model's
        own (`self.template_kwargs`)."""
        from .chat_formats.chat_template import render_chat

        tok = self.tokenizer
        bos = tok.decode([tok.bos_id]) if tok.bos_id is not None else ""
        eos = tok.decode([tok.eos_id]) if tok.eos_id is not None else ""
        return render_chat(self.chat_template or self.fallback_template, messages,
                           add_generation_prompt=add_generation_prompt, bos_token=bos, eos_token=eos,
                           source=self.path, tools=tools, **{**self.template_kwargs, **(template_kwargs or {})})

    def chat_tokens(self, messages: list[dict], add_generation_prompt: bool = True,
                    tools: Optional[list[dict]] = None, template_kwargs: Optional[dict] = None) -> list[int]:
        """Token ids of a rendered conversation (apply_chat_template's arguments); BOS is added
        only if the template did not write it."""
        text = self.apply_chat_template(messages, add_generation_prompt, tools, template_kwargs)
        ids = self.tokenize(text, add_special=False, parse_special=True)
        bos = self.tokenizer.bos_id
        if self.tokenizer.add_bos and bos is not None and (not ids or ids[0] != bos):
            ids = [bos] + ids
        return ids

    # -- compute ----------------------------------------------------------------------

    def new_cache(self):
        return self.net.make_cache()

    def logits(self, ids: Sequence[int], chunk: int = 256) -> np.ndarray:
        """Teacher-forced logits at every position from an empty context: [len(ids), vocab] float32."""
        ids = np.asarray(ids, dtype=np.int64)
        self._check_ids(ids)
        cache = self.new_cache()
        out = [self.net.forward(ids[s : s + chunk], cache, hook=self.hook) for s in range(0, len(ids), chunk)]
        if not out:
            return np.zeros((0, self.cfg.vocab_size), np.float32)
        return np.concatenate(out).astype(np.float32, copy=False)

    def _check_ids(self, ids: np.ndarray) -> None:
        check_ids(ids, self.cfg.vocab_size)  # before a generator starts, so the error comes at once

    def generate(
        self, prompt: str | Sequence[int] | list[dict], max_tokens: int = 256, temperature: float = 0.0,
        top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0, repetition_penalty: float = 1.0,
        seed: Optional[int] = None, stop: Sequence[str] = (), cache=None, hook=None,
        lookup: Optional[int] = None, lookup_stats=None, processors: Sequence = (),
    ) -> Iterator[GenerationResponse]:
        """Yield GenerationResponse pieces. `prompt` is text, token ids, or chat messages (rendered
        with the model's chat template). `lookup`: drafts (n-gram lookup in the context, 0..8)
        verified per decode forward; the output is the same as without (greedy) or has the same
        distribution (sampling); None: 8 (0 where a hook is set).
        `lookup_stats`: a `LookupStats` to count them in. `processors`: logits processors
        applied after the repetition penalty (e.g. a grammar constraint, structured.py)."""
        if isinstance(prompt, str):
            ids = self.tokenize(prompt)
        elif len(prompt) and isinstance(prompt[0], dict):
            ids = self.chat_tokens(list(prompt))
        else:
            ids = [int(t) for t in prompt]
            self._check_ids(np.asarray(ids, dtype=np.int64))
        if not ids:
            raise UsageError("the prompt is empty: give at least one token")
        if max_tokens < 0:
            raise UsageError(f"max tokens must be >= 0, got {max_tokens}")
        sampler = make_sampler(temperature, top_p, min_p, top_k, seed)
        procs = make_logits_processors(repetition_penalty) + list(processors)
        hook = hook if hook is not None else self.hook
        yield from stream_generate(self, ids, max_tokens=max_tokens, sampler=sampler, processors=procs,
                                   stop=stop, cache=cache, hook=hook,
                                   lookup=lookup_budget(lookup, default=0 if hook is not None else DEFAULT_DRAFTS),
                                   lookup_stats=lookup_stats)


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f}"


def _free(be, pool, slots) -> None:
    """Close a backend, then its expert pool (reader threads stop before the memory they write
    goes), then free the pool's slot memory; each of them may be None."""
    if be is not None:
        be.close()
    if pool is not None:
        pool.close()
    if slots is not None:
        slots.destroy()


def _predicted_layers(cfg, predict) -> str:
    """The --layers spec a plan reserves prediction scratch for: the layers `predict` predicts in
    block mode (a mixer run ahead into scratch K/V)."""
    from .moe.predict import as_settings

    predict = as_settings(predict)
    if not predict.on or predict.mode == "router":  # (router prediction runs in no scratch: block's only)
        return ""
    if predict.layers:
        return predict.layers
    return ",".join(str(i) for i in range(cfg.n_layers) if cfg.layer_is_moe(i))


def load(model: LoadSpec | str | os.PathLike | None = None, **overrides) -> Model:
    """Open a GGUF model: `model` is a LoadSpec, or a path (None: the model shipped with onebit),
    and `overrides` are LoadSpec fields, e.g. `load("m.gguf", backend="cpu", n_ctx=2048)`. The
    backend: auto is Vulkan on a GPU, else cpu; numpy is the reference. With `slots` (a number or
    "auto") or `budget`, memory is planned first and routed experts stream through a slot pool
    when fewer slots than experts fit. `predict` (a mode name or moe.predict.PredictSettings):
    routing prediction feeding the pool's prefetch queue. `device`: the Vulkan device (a name or
    index, as `onebit devices` lists; None: the best usable one)."""
    spec = model if isinstance(model, LoadSpec) else LoadSpec(path=None if model is None else os.fspath(model))
    spec = dataclasses.replace(spec, **overrides)
    return on_a_thread_that_ends(lambda: Model(spec))


def on_a_thread_that_ends(fn):
    """fn() run on a thread that ends when it returns (its result, or its exception raised here):
    how `load` builds a Model. The cpu backend's kernels run on GNU OpenMP, which gives every
    thread that starts a parallel region a team of workers of its own, kept until that thread
    ends, and lets the workers spin between regions only while it manages no more threads than
    there are cores. A load's kernels (repacks, the first calls) left a team on the loading
    thread; forwards on another thread (serve's) then ran with a second team: the 0.86B MoE
    decoded 60-75 tok/s there against 92-106 on the loading thread (2-core VM). Loaded on a
    thread that ends, whichever thread runs the forwards has the only team. The caller waits
    in steps, so Ctrl-C still reaches it (the load then finishes behind it)."""
    out: dict = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - raised again on the caller's thread
            out["error"] = e

    t = threading.Thread(target=run, name="onebit-load", daemon=True)
    t.start()
    while t.is_alive():
        t.join(0.2)
    if "error" in out:
        raise out["error"]
    return out["value"]
