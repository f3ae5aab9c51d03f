"""The public model object: tokenizer, chat template, network and backend in one place."""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
from typing import Iterator, Optional, Sequence

import numpy as np

from .backends import fallback_order, open_backend, resolve
from .errors import BackendUnavailableError, UsageError
from .generate import GenerationResponse, stream_generate
from .gguf_file import GGUFFile
from .lookup import DEFAULT_DRAFTS, lookup_budget
from .models import network_class
from .models.base import check_ids
from .runner import Runner
from .sample import make_logits_processors, make_sampler
from .tokenizer import Tokenizer

log = logging.getLogger("onebit")


class Model:
    """The facade a user loads: tokenizer, chat template, memory plan, backend and network
    (`self.net`, the architecture's schedule over the backend) in one place."""

    def __init__(self, path: str | os.PathLike, backend: str = "auto", n_ctx: Optional[int] = None,
                 slots: Optional[int | str] = None, budget: Optional[str | int] = None, pool_policy: str = "global",
                 predict=None, device: Optional[str | int] = None):
        self.path = str(path)
        self.gguf = GGUFFile(path)
        cls = network_class(self.gguf.architecture, self.path)
        cfg = cls.config(self.gguf)
        if n_ctx is not None and n_ctx < 1:
            raise UsageError(f"context length must be >= 1, got {n_ctx}")
        self.hook = None  # called between every MoE router and its experts (e.g. a TraceWriter)
        self.template_kwargs: dict = {}  # extra chat-template variables, e.g. {"enable_thinking": False}
        from .memory.guard import MemoryGuard

        self.guard = MemoryGuard()  # checked every generated token
        self.backend_asked = backend
        # The load path: file -> config -> plan -> expert source -> backend -> network. One
        # fallback rule: a backend that cannot run here (or cannot run this model) gives way to
        # the next fastest that can, said in one line.
        order = fallback_order(resolve(backend, device))
        for i, name in enumerate(order):
            try:
                with np.errstate(all="ignore"):  # weights dequantized at load: NaN / inf show up as an error later
                    self.plan, self.pool, self.be, predict = self._open(name, cfg, n_ctx, slots, budget,
                                                                        pool_policy, predict, device)
                    self.context_length = self.plan.ctx
                    # a streamed plan allocates its KV cache up front, as planned (a resident
                    # load grows it as the context fills, so a short chat holds little)
                    held = self.pool is not None or slots is not None or budget is not None
                    try:
                        self.net = Runner(cls(cfg), self.gguf, self.be, self.context_length if held else 0)
                    except BaseException:
                        self.be.close()
                        if self.pool is not None:
                            self.pool.close()
                        raise
                break
            except BackendUnavailableError as e:
                if i + 1 == len(order):
                    raise
                sys.stderr.write(f"onebit: warning: {e}; using the {order[i + 1]} backend\n")
                log.info("backend %s unavailable, using %s: %s", name, order[i + 1], e)  # (stderr has it already)
        self.decision = self.plan.decision  # one line: resident or streamed, the context, the budget
        self.cfg = self.net.cfg
        self.predictor = None
        if predict.on:
            self.set_predict(predict)
        self.tokenizer = Tokenizer.from_metadata(self.gguf.metadata, self.path)
        self.chat_template: Optional[str] = self.gguf.get("tokenizer.chat_template")
        from .chat_template import fallback_template

        # what `chat` renders with when the file has no template
        self.fallback_template = fallback_template(self.gguf.get("tokenizer.ggml.tokens"))[1]

    def _open(self, name: str, cfg, n_ctx, slots, budget, policy, predict, device):
        """(plan, pool, backend, prediction settings) for backend `name`; prediction "auto"
        resolves to block where experts stream (its gate turns it off where it does not pay)
        and off where every expert is resident. Memory is planned on every load, against
        the detected budget or the one given (memory.plan.plan_load: the same plan `onebit
        plan` prints): routed experts stream through a pool when they do not all fit with
        margin, the pool's slots in device memory on Vulkan. A plan that does not fit is
        refused when a budget, slots or a context were asked for; with none of them the load
        goes ahead with what the plan chose (the most it can) and says so in one line."""
        from .memory.budget import detect_budget
        from .memory.plan import PlanError, plan_load
        from .memory.pool import ExpertPool

        dev = limits = None
        if name == "vulkan":
            from .backends.vulkan.device import default_device
            from .memory.budget import vulkan_limits

            dev = default_device(device)  # (a device that cannot open: VulkanUnavailableError)
            limits = vulkan_limits(device)
        from .moe.predict import as_settings

        predict = as_settings(predict)
        auto = predict.mode == "auto"
        b = detect_budget(budget, **(limits or {}))
        plan = plan_load(self.gguf, cfg, b, ctx=n_ctx, layers="" if auto else _predicted_layers(cfg, predict),
                         slots=slots, backend=name, predict_when_streaming=auto)
        if auto:
            predict = dataclasses.replace(predict, mode="block" if plan.streaming else "off")
        if not plan.fits:
            if slots is not None or budget is not None or n_ctx is not None:
                raise PlanError(plan)
            sys.stderr.write(f"onebit: warning: {self.path} does not fit the memory budget (needs at least "
                             f"{_gib(plan.total)} GiB, {_gib(plan.budget.bytes)} GiB left): loading anyway, "
                             "expect paging; see `onebit plan`\n")
        pool = arrays = None
        try:
            if plan.streaming:
                if name == "vulkan":  # slots in mapped device buffers the expert kernels read
                    from .backends.vulkan.slots import SlotArrays

                    arrays = SlotArrays(dev)
                pool = ExpertPool(self.gguf, plan.classes, plan.slots, policy=policy, allocate=arrays,
                                  layout=_expert_layout(name, self.gguf))
                if name != "vulkan":
                    self._copy_resident(repacked=_repacked_by(name))
            elif name != "vulkan" and plan.fits:
                dense, layout = _repacked_by(name), _expert_layout(name, self.gguf)
                self._map_weights(skip=lambda t: dense(t) or (layout is not None and layout.packs(t)))
            be = open_backend(name, self.gguf, experts=pool, device=dev, slot_arrays=arrays)
            if name == "cpu":
                be.repack(experts=plan.fits)
            return plan, pool, be, predict
        except BaseException:
            if pool is not None:
                pool.close()
            if arrays is not None:
                arrays.destroy()
            raise

    def _copy_resident(self, repacked=lambda t: False) -> None:
        """When streaming, hold the non-expert tensors in memory (the plan counts them) so a file
        that shrinks or fails under us gives a read error from the pool, not a SIGBUS from the map.
        Read with pread, not copied from the map: pages touched through the map would count
        in this process's resident memory beside the copy (a 30B-A3B: 0.96 GiB twice). Not the
        tensors the backend holds in a layout of its own (`repacked`): it copies those from the
        map itself, and a copy here would be a second one."""
        from tqdm import tqdm

        from .errors import ModelFileError
        from .gguf_file import is_expert_tensor

        # (an expert part's bias, gpt-oss, is small and resident too)
        resident = [t for name, t in self.gguf.tensors.items()
                    if (not is_expert_tensor(name) or name.endswith(".bias")) and not repacked(t)]
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

        from .gguf_file import is_expert_tensor

        # experts first: where the system cannot, it says so at the first tensor
        order = sorted((t for t in self.gguf.tensors.values() if not skip(t)), key=lambda t: not is_expert_tensor(t.name))
        total = sum(t.n_bytes for t in order)
        with tqdm(total=total, unit="B", unit_scale=True, desc="mapping", file=sys.stderr, leave=False,
                  disable=True if total < (256 << 20) else None) as bar:
            for t in order:
                if not self.gguf.populate(t):
                    return  # (this system cannot: first touch it is)
                bar.update(t.n_bytes)

    def set_predict(self, settings) -> None:
        """Routing prediction at every MoE pause point (a moe.predict.PredictSettings, or a mode
        name: off, router, block), feeding the expert pool's prefetch queue when streaming."""
        from .moe.predict import Predictor, as_settings

        settings = as_settings(settings)
        if self.predictor is not None:
            self.predictor.close()
        self.predictor = None
        if settings.on:
            if not any(self.cfg.layer_is_moe(i) for i in range(self.cfg.n_layers)):
                raise UsageError(f"{self.path}: routing prediction needs a mixture-of-experts model")
            from .backends import device_info

            on_host = self.be.runs_on_host
            host = self.be if on_host else _host_backend(self.gguf, self.pool)
            # a device backend's pool slots are device memory the host maps: read by the host's
            # expert ops only where that memory is the host's own (unified: an APU, a CPU device;
            # on a discrete GPU such reads are uncached, far slower than the prediction is worth)
            info = device_info(self.be)
            own_ok = on_host or self.pool is None or bool(info and info.unified)
            # the host's ranking overlaps the device's compute, except on a CPU device (lavapipe),
            # whose compute runs on the same cores: there the ledger charges it, as on a host backend
            overlapped = not on_host and not (info is not None and info.type == "cpu")
            self.predictor = Predictor(self.gguf, self.cfg, settings, self.pool, host, overlapped=overlapped,
                                       own_ok=own_ok)
        self.net.predictor = self.predictor

    def close(self) -> None:
        if self.predictor is not None:
            self.predictor.close()
        if self.pool is not None:
            self.pool.close()

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
        from .chat_template import render_chat

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
        distribution (sampling); None: $ONEBIT_LOOKUP, else 8 (0 where a hook is set).
        `lookup_stats`: a `LookupStats` to count them in. `processors`: logits processors
        applied after the repetition penalty (e.g. a grammar constraint, structured.py)."""
        if isinstance(prompt, str):
            ids = self.tokenize(prompt)
        elif prompt and isinstance(prompt[0], dict):
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


def _repacked_by(backend: str):
    """Which tensors backend `backend` repacks into a layout of its own (cpu: Q4_K matrices on
    AVX-512 VNNI, cpu_kernels.repacks), or a test that is never true."""
    if backend != "cpu":
        return lambda t: False
    from .backends.cpu_kernels import repacks

    return repacks


def _expert_layout(backend: str, gguf):
    """The ExpertLayout backend `backend` holds this file's routed experts in (the cpu backend's
    X16 layout on AVX-512 VNNI), or None: as the file has them."""
    if backend != "cpu":
        return None
    from .backends import cpu_kernels
    from .backends.cpu import X16Experts

    return X16Experts(gguf) if cpu_kernels.VNNI else None


def _host_backend(gguf, pool=None):
    """Host ops for a device backend's predictor: the cpu backend's kernels (no float32 copy of
    a weight, unlike numpy's reference ops), or numpy's where the cpu backend cannot run; with
    a pool, routed experts from its slots (acquired, as the layer itself acquires them)."""
    try:
        return open_backend("cpu", gguf, experts=pool)
    except BackendUnavailableError:
        return open_backend("numpy", gguf, experts=pool)


def _predicted_layers(cfg, predict) -> str:
    """The --layers spec a plan reserves prediction scratch for: the layers `predict` predicts."""
    from .moe.predict import as_settings

    predict = as_settings(predict)
    if not predict.on:
        return ""
    if predict.layers:
        return predict.layers
    return ",".join(str(i) for i in range(cfg.n_layers) if cfg.layer_is_moe(i))


def load(path: str | os.PathLike, backend: str = "auto", n_ctx: Optional[int] = None,
         slots: Optional[int | str] = None, budget: Optional[str | int] = None, pool_policy: str = "global",
         predict=None, device: Optional[str | int] = None) -> Model:
    """Open a GGUF model (memory-mapped) on the given backend (auto: Vulkan on a GPU, else cpu;
    numpy is the reference). With `slots` (a number or "auto")
    or `budget`, memory is planned first and routed experts stream through a slot pool when
    fewer slots than experts fit. `predict` (a mode name or moe.predict.PredictSettings):
    routing prediction feeding the pool's prefetch queue. `device`: the Vulkan device (a name
    or index, as `onebit info --device` lists; None: $ONEBIT_VULKAN_DEVICE, else the first)."""
    return Model(path, backend=backend, n_ctx=n_ctx, slots=slots, budget=budget, pool_policy=pool_policy,
                 predict=predict, device=device)
