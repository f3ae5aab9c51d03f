"""The OpenAI API over one loaded model: the engine side (no HTTP here; see serve_app.py).

Requests run in arrival order (a FIFO queue) on `parallel` slots, each a worker thread and a
sequence's cache: one slot runs one request at a time, owning the model; several decode
together, their forwards batched into one step (serve_batch.py). A slot's cache outlives a
request: a request takes the free slot whose cache holds most of its prompt (a continuing
conversation re-runs only its new turn), else the one used least recently, as ChatSession
keeps a chat's (cache.PrefixCache: with checkpoints where the model has recurrent state).
Beside the slots, the prompt cache (cache.PromptCache, --cache-ram, counted by the memory
plan) keeps more conversations: a request that would drop most of what its slot holds saves
that first, and gets back the saved prefix that shares most with its prompt, so conversations
that take turns on fewer slots keep their prefixes. A request whose client went away is
cancelled: its slot stops it at the next token.

A request names its model; with a models folder, a model other than the loaded one is
loaded in its turn, once no request runs (the loaded one is closed first: one model at a time).
"""

from __future__ import annotations

import logging
import queue
import re
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import numpy as np

from ..cache import SWA_ROWS, PrefixCache, PromptCache, common_length
from ..errors import OnebitError, UsageError
from ..generate import stream_generate
from ..lookup import MAX_DRAFTS
from ..memory.plan import prompt_cache_bytes
from ..sample import make_logits_processors, make_sampler
from ..chat_formats.think import reply_splitter
from ..chat_formats.toolcall import CLOSE as CALL_CLOSE
from ..chat_formats.toolcall import OPEN as CALL_OPEN
from ..chat_formats.toolcall import ToolCall, parse_harmony, parse_tags, tool_format
from .logprobs import LogprobRecorder, TokenLogprob
from .serve_batch import BatchedDecoder, Batcher
from .tool_prompt import generic_tool_messages, template_shows_tools

log = logging.getLogger("onebit.apps.serve")


class _Printable(logging.Filter):
    """Control characters in a log line (a model name or path a client sent, holding a newline
    or a terminal escape) are written escaped: no forged lines, nothing reaches the terminal."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        clean = "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)
        if clean != text or record.args:
            record.msg, record.args = clean, ()
        return True


log.addFilter(_Printable())
_ABSOLUTE = re.compile(r"(?<![\w.])/(?:[^\s/:'\"]+/)+[^\s/:'\"]*")  # /a/b..., as errors quote a file


class ApiError(OnebitError):
    """An error a request gets as an OpenAI-style error object."""

    def __init__(self, message: str, status: int = 400, type: str = "invalid_request_error",
                 code: Optional[str] = None, param: Optional[str] = None):
        super().__init__(message)
        self.status, self.type, self.code, self.param = status, type, code, param


@dataclass
class Sampling:
    temperature: float = 0.7
    top_p: float = 0.95
    top_k: int = 0
    min_p: float = 0.05
    seed: Optional[int] = None
    repeat_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)


@dataclass
class Work:
    """One request, as the worker runs it: a chat (`messages`) or a raw `prompt`."""
    model: Optional[str]
    messages: Optional[list[dict]] = None
    prompt: Optional[str | list[int]] = None
    tools: Optional[list[dict]] = None  # rendered by the template; calls read back from the reply
    forced_tools: Optional[dict[str, dict]] = None  # name -> parameters: the reply must be a call
    schema: Optional[dict] = None  # JSON mode: a schema, or {} for any object
    template_kwargs: dict = field(default_factory=dict)
    sampling: Sampling = field(default_factory=Sampling)
    max_tokens: Optional[int] = None  # None: up to the context's end
    stop: Sequence[str] = ()
    logprobs: Optional[int] = None  # each token's log-probability, with this many alternatives
    task: Optional[Callable[[Any], Any]] = None  # run on the worker with the model instead (embeddings)


@dataclass
class Delta:
    content: str = ""
    reasoning: str = ""
    logprobs: list = field(default_factory=list)  # TokenLogprob of the tokens since the last delta


@dataclass
class Done:
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    tool_calls: list[ToolCall] = field(default_factory=list)
    content: str = ""  # text held back to the end (a tool call that did not parse)
    prompt_time: float = 0.0
    generation_time: float = 0.0
    logprobs: list = field(default_factory=list)  # TokenLogprob of tokens not in a delta


class Job:
    """A request's place in the queue and its events, handed from the worker thread to the
    event loop: ("start", info), ("delta", Delta), then ("done", Done) or ("error", ApiError)."""

    def __init__(self, work: Work, notify: Callable[[tuple], None]):
        self.work = work
        self.notify = notify
        self.cancelled = threading.Event()

    def put(self, kind: str, value: Any) -> None:
        self.notify((kind, value))

    def cancel(self) -> None:
        self.cancelled.set()


@dataclass
class Slot:
    """One of the sequences served at once: its cache, kept from request to request, the request
    it runs now (None: free) and when it was last used."""
    id: int
    prefix: PrefixCache
    job: Optional[Job] = None
    used: float = 0.0


# a slot's cache goes on with a request whose prompt shares at least this share of it (else
# what it holds is saved to the prompt cache first, as llama-server does)
SIMILAR = 0.5


def model_id(path: str) -> str:
    name = Path(path).name
    return name[: -len(".gguf")] if name.lower().endswith(".gguf") else name


def penalties(presence: float, frequency: float, bias: dict[int, float], window: int = 64):
    """OpenAI's presence / frequency penalties (over the last `window` tokens, as llama.cpp
    applies them) and logit_bias, as one logits processor; None when all are off."""
    if not presence and not frequency and not bias:
        return None
    ids = np.asarray(list(bias), dtype=np.int64)
    values = np.asarray(list(bias.values()), dtype=np.float32)
    values[values <= -100] = -np.inf  # -100 bans the token, as OpenAI documents

    def apply(tokens, logits):
        logits = logits.copy()
        if len(ids):
            ok = ids < len(logits)  # (a model picked after the request was checked)
            logits[ids[ok]] += values[ok]
        recent = np.asarray(tokens[-window:], dtype=np.int64)
        if recent.size and (presence or frequency):
            seen, counts = np.unique(recent, return_counts=True)
            logits[seen] -= presence + frequency * counts
        return logits

    return apply


class ReplySplitter:
    """Turns the generated text into what the API returns: reasoning apart (gpt-oss analysis,
    `<think>` blocks), tool calls held back and parsed at the end."""

    def __init__(self, model, ids: list[int], tools: bool, constrained: bool):
        self.format = tool_format(model)
        self.channels = reply_splitter(model, ids, constrained)
        self.tools = tools
        self.raw: list[str] = []
        self.shown: list[str] = []  # content given out
        self.held = ""  # content from a `<tool_call>` on (or a tail that may start one)
        self.calling = False

    def feed(self, text: str, final: bool) -> Delta:
        self.raw.append(text)
        reasoning, content = self.channels.feed(text, final=final) if self.channels else ("", text)
        if self.tools and self.format == "tags":
            content = self._hold(content, final)
        self.shown.append(content)
        return Delta(content, reasoning)

    def _hold(self, content: str, final: bool) -> str:
        if self.calling:
            self.held += content
            return ""
        text = self.held + content
        i = text.find(CALL_OPEN)
        if i >= 0:
            self.calling, self.held = True, text[i:]
            return text[:i]
        keep = 0
        if not final:
            for k in range(min(len(CALL_OPEN) - 1, len(text)), 0, -1):
                if CALL_OPEN.startswith(text[-k:]):
                    keep = k
                    break
        self.held = text[len(text) - keep:] if keep else ""
        return text[: len(text) - keep]

    def calls(self) -> tuple[list[ToolCall], str]:
        """(tool calls, text still to give out) at the end of the reply."""
        if not self.tools:
            return [], self.held
        if self.format == "harmony":
            return parse_harmony("".join(self.raw)), self.held
        rest, calls = parse_tags(self.held)
        if not calls:
            if self.held.startswith(CALL_OPEN) and CALL_CLOSE not in self.held:
                log.info("the reply ended inside a tool call: the call is dropped")
                return [], ""
            if self.held:
                log.info("a tool call in the reply did not parse: returned as text")
            return [], self.held
        return calls, rest


class Engine:
    """The loaded model, its slots (a cache each), and the worker threads that run requests."""

    def __init__(self, model, sampling: Sampling, lookup: int = 0, catalog: Callable[[], dict[str, str]] = dict,
                 name: Optional[str] = None, parallel: int = 1):
        """`model`: the one served at start (its id: `name`, else its file name); a model a request
        picks loads with its LoadSpec (`model.spec`: backend, device, context, budget, threads, ...
        as the command gave them). `parallel`: requests decoded together (their forwards batched:
        the backend must `batches_sequences`)."""
        self.model = model
        self.model_id = name or model_id(model.path)
        self.vocab_size = model.cfg.vocab_size
        self.spec = model.spec
        self.sampling = sampling
        self.lookup = lookup
        self.found = catalog  # id -> path of the GGUF files (a models folder) a request may pick
        self.first = (self.model_id, model.path)  # the model served at start stays one of them
        if parallel > 1 and not model.be.batches_sequences:
            raise UsageError(f"--parallel {parallel}: the {model.be.name} backend runs one sequence per forward "
                             "(use --parallel 1, or a backend that batches sequences: --backend vulkan, cpu or numpy)")
        self.parallel = parallel
        # what the last requests left, reused by the next
        self.slots = [Slot(i, PrefixCache(model.new_cache())) for i in range(parallel)]
        self.prompts = PromptCache(prompt_cache_bytes(model.plan))  # prefixes saved beside the slots
        # a step: one prompt chunk and the others' verify rows (the memory plan counts as many)
        self.batcher = Batcher(lambda: self.model, step_rows=SWA_ROWS + (parallel - 1) * (1 + MAX_DRAFTS)) \
            if parallel > 1 else None
        self.gate = threading.Condition()  # slots taken and given back; a switch waits for no running request
        self.users = 0  # requests running on the loaded model
        self.switching = 0  # requests waiting for the running ones to end, to load another model
        self.counting = threading.Lock()
        self.queue: "queue.Queue[Optional[Job]]" = queue.Queue()
        self.stopping = False
        self.served = 0
        self.generated = 0  # tokens generated over all requests (cancelled ones too)
        self.prompt_tokens = self.cached_tokens = 0  # of the prompts run, and of them: tokens not run again
        self.problem: Optional[str] = None  # why no model is loaded (a failed switch or reload): 503s
        self.threads = [threading.Thread(target=self._loop, name=f"onebit-serve-worker-{i}", daemon=True)
                        for i in range(parallel)]
        for t in self.threads:
            t.start()

    # -- the event loop's side ----------------------------------------------------------

    def catalog(self) -> dict[str, str]:
        return {self.first[0]: self.first[1], **self.found()}

    def models(self) -> list[str]:
        ids = [self.model_id]
        for name in self.catalog():
            if name not in ids:
                ids.append(name)
        return ids

    def context_length(self) -> int:
        m = self.model
        return m.context_length if m is not None else (self.spec.n_ctx or 1 << 20)

    def check_model(self, name: Optional[str]) -> None:
        if name in (None, "", self.model_id):
            return
        if name not in self.catalog():
            raise ApiError(f"The model '{name}' does not exist (GET /v1/models lists the models served)",
                           404, code="model_not_found", param="model")

    def submit(self, work: Work, notify: Callable[[tuple], None]) -> Job:
        if self.stopping:
            raise ApiError("the server is shutting down", 503, "server_error", "shutdown")
        self.check_model(work.model)
        job = Job(work, notify)
        self.queue.put(job)
        return job

    def waiting(self) -> int:
        return self.queue.qsize()

    def processing(self) -> int:
        """Requests running now (one per busy slot)."""
        return sum(s.job is not None for s in self.slots)

    def busy(self) -> bool:
        return self.processing() > 0 or self.queue.qsize() > 0

    def stop(self) -> None:
        """Refuse new requests, cancel the running and queued ones (the worker stops at the
        next token), and let the worker end."""
        self.stopping = True
        while True:
            try:
                job = self.queue.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.cancel()
                job.put("error", ApiError("the server is shutting down", 503, "server_error", "shutdown"))
        for slot in self.slots:
            job = slot.job
            if job is not None:
                job.cancel()
        for _ in self.threads:
            self.queue.put(None)

    def join(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds for the workers to end (after `stop`); whether they did."""
        end = time.monotonic() + timeout
        for t in self.threads:
            t.join(max(end - time.monotonic(), 0.0))
        return not any(t.is_alive() for t in self.threads)

    def close(self, timeout: float = 5.0) -> None:
        self.stop()
        if self.join(timeout):
            if self.batcher is not None:
                self.batcher.close()
            if self.model is not None:
                self.model.close()

    # -- the worker thread ----------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            job = self.queue.get()
            if job is None:
                return
            if job.cancelled.is_set():
                continue
            try:
                with self._model_turn(job.work.model):
                    self._run(job)
            except ApiError as e:
                job.put("error", e)
            except OnebitError as e:
                job.put("error", ApiError(self.scrub(str(e)), 400 if e.exit_code == 2 else 500,
                                          "invalid_request_error" if e.exit_code == 2 else "server_error"))
            except Exception as e:  # noqa: BLE001 - a bug: one log line, an error object (its slot: a fresh cache)
                log.error("internal error in a request: %s: %s", type(e).__name__, e)
                job.put("error", ApiError("internal error (the server log says more)", 500, "server_error"))
            finally:
                with self.counting:
                    self.served += 1

    @contextmanager
    def _model_turn(self, name: Optional[str]):
        """A request's use of the loaded model: `name` switched in first (`_switch`) where no other
        request runs. A request for another model (or while none is loaded) waits for the running
        ones to end, and none starts before it meanwhile."""
        def served() -> bool:
            return self.model is not None and name in (None, "", self.model_id)

        with self.gate:
            while self.users and (self.switching or not served()):
                if served():
                    self.gate.wait()
                    continue
                self.switching += 1
                try:
                    while self.users:
                        self.gate.wait()
                finally:
                    self.switching -= 1
            if not self.users:
                self._switch(name)
            self.users += 1
        try:
            yield
        finally:
            with self.gate:
                self.users -= 1
                self.gate.notify_all()

    def _take_slot(self, job: Job, ids: list[int]) -> Slot:
        """The free slot whose cache goes on with `ids` (the longest prefix, where it shares at
        least SIMILAR of what the slot holds), else the one used least recently (what it holds
        goes to the prompt cache: PromptCache.recall)."""
        def shared(s: Slot) -> int:
            n = common_length(s.prefix.tokens, ids)
            return n if n and n >= SIMILAR * len(s.prefix.tokens) else 0

        with self.gate:
            free = [s for s in self.slots if s.job is None]  # (never empty: a worker holds one slot at most)
            slot = max(free, key=lambda s: (shared(s), -s.used))
            slot.job = job
            return slot

    def _give_back(self, slot: Slot) -> None:
        with self.gate:
            slot.job, slot.used = None, time.monotonic()

    def scrub(self, message: str) -> str:
        """`message` as a client may see it: a served file's path replaced by its model id, any
        other absolute path by <path>."""
        for name, path in [(self.model_id, self.model.path if self.model is not None else None),
                           *self.catalog().items()]:
            if path:
                for p in {path, str(Path(path).resolve())}:
                    message = message.replace(p, name)
        return _ABSOLUTE.sub("<path>", message)

    def _load_failure(self, name: str, e: Exception) -> str:
        """What a client is told of a load that raised `e` (the log has the whole of it)."""
        log.error("cannot load %s: %s: %s", name, type(e).__name__, e)
        if isinstance(e, OnebitError):
            return self.scrub(str(e))
        return "internal error (the server log says more)"

    def _fresh_cache(self, slots: Optional[list[Slot]] = None) -> None:
        """An empty cache for `slots` (None: every slot, as after a load)."""
        if self.model is None:
            return
        if slots is None:  # (another model: the saved prefixes are the last one's)
            self.prompts = PromptCache(prompt_cache_bytes(self.model.plan))
        for slot in self.slots if slots is None else slots:
            try:
                slot.prefix = PrefixCache(self.model.new_cache())
            except Exception:  # noqa: BLE001 - the next request tries again
                slot.prefix.tokens, slot.prefix.checkpoints = [], []

    def _load(self, name: str, path: str) -> None:
        import onebit

        self.model = onebit.load(self.spec, path=path)
        self.model_id = name
        self.vocab_size = self.model.cfg.vocab_size
        self.problem = None
        self._fresh_cache()

    def _unload(self) -> None:
        self.prompts.clear()  # (the next model's load is planned without them)
        if self.model is not None:
            self.model.close()
            self.model = None

    def _unservable(self) -> ApiError:
        return ApiError(f"the server cannot serve: {self.problem}", 503, "server_error", "model_unavailable")

    def _switch(self, name: Optional[str]) -> None:
        """Make `name` the loaded model (closing the one loaded now). A load that fails, however
        it fails, loads the model served before again; if that fails too, the server has no
        model (`problem` says why) and answers 503 until a request's model loads."""
        if name in (None, ""):
            name = self.model_id
        if self.model is not None and name == self.model_id:
            self._reload_if_changed()
            return
        path = self.catalog().get(name)
        if path is None:
            raise ApiError(f"The model '{name}' does not exist", 404, code="model_not_found", param="model")
        before = (self.model_id, self.model.path) if self.model is not None else None
        log.info("loading %s in place of %s", name, self.model_id)
        self._unload()
        try:
            self._load(name, path)
        except Exception as e:  # noqa: BLE001 - any failure: the model served before comes back
            why = self._load_failure(name, e)
            if before is not None:
                try:
                    self._load(*before)
                except Exception as again:  # noqa: BLE001
                    self.model_id = before[0]
                    self.problem = f"the model '{before[0]}' did not load again: {self._load_failure(*before[:1], again)}"
            else:
                self.problem = f"the model '{name}' did not load: {why}"
                raise self._unservable() from None
            raise ApiError(f"the model '{name}' could not be loaded: {why}", 400, code="model_load_failed",
                           param="model") from None

    def _reload_if_changed(self) -> None:
        """The served file changed on disk (rewritten, replaced, even touched): load it again,
        or say why not."""
        changed = self.model.gguf.changes()
        if not changed:
            return
        log.warning("the model file changed (%s): loading %s again", changed[0], self.model_id)
        path = self.model.path
        self._unload()
        try:
            self._load(self.model_id, path)
        except Exception as e:  # noqa: BLE001
            self.problem = f"the model file of '{self.model_id}' changed and did not load again: " \
                           f"{self._load_failure(self.model_id, e)}"
            raise self._unservable() from None

    def _prompt_ids(self, work: Work, limit: int) -> list[int]:
        """The prompt's token ids; a text is tokenized only as far as shows it holds more than
        `limit` tokens (then ApiError), so a huge prompt costs what a prompt of the context costs."""
        m = self.model
        where = "messages" if work.messages is not None else "prompt"
        if work.messages is None:
            if isinstance(work.prompt, str):
                return self._tokens_within(work.prompt, limit, where, add_special=True)
            ids = list(work.prompt)
            bad = [t for t in ids if not 0 <= t < m.cfg.vocab_size]
            if bad:
                raise ApiError(f"token id {bad[0]} is out of range for this model's vocabulary of "
                               f"{m.cfg.vocab_size}", param="prompt")
            return ids
        messages, tools = work.messages, work.tools
        if tools and not template_shows_tools(m):  # the generic tool-call prompt
            messages, tools = generic_tool_messages(messages, tools), None
        if len(messages) > limit:  # every message renders to a token at least
            raise _too_long(limit, f"more than {limit}", where)
        text = m.apply_chat_template(messages, tools=tools, template_kwargs=work.template_kwargs)
        ids = self._tokens_within(text, limit, where, add_special=False)
        bos = m.tokenizer.bos_id  # as Model.chat_tokens: BOS only where the template did not write it
        if m.tokenizer.add_bos and bos is not None and (not ids or ids[0] != bos):
            ids = [bos] + ids
        return ids

    def _tokens_within(self, text: str, limit: int, where: str, add_special: bool) -> list[int]:
        """Tokens of `text`, tokenizing prefixes four times longer each time while the text goes
        on: a prefix of more than `limit` + SLACK tokens ends it (a prefix cut mid-word may
        tokenize to a few more tokens than its part of the whole)."""
        slack = 16
        n = 4 * (limit + slack)  # characters
        while n < len(text):
            head = self.model.tokenize(text[:n], add_special=add_special, parse_special=True)
            if len(head) > limit + slack:
                raise _too_long(limit, f"more than {len(head) - slack}", where)
            n *= 4
        return self.model.tokenize(text, add_special=add_special, parse_special=True)

    def _processors(self, work: Work, ids: list[int]) -> list:
        s = work.sampling
        procs = list(make_logits_processors(s.repeat_penalty))
        extra = penalties(s.presence_penalty, s.frequency_penalty, s.logit_bias)
        if extra is not None:
            procs.append(extra)
        if work.forced_tools is not None or work.schema is not None:
            from ..chat_formats.structured import Constraint, json_grammar
            from ..chat_formats.toolcall import forced_grammar

            if work.forced_tools is not None:
                grammar = forced_grammar(self.model, work.forced_tools)
            else:
                grammar = json_grammar(work.schema or None)
            procs.append(Constraint(self.model, grammar))  # last: nothing may lift a masked token
        if work.logprobs is not None:
            procs.append(LogprobRecorder(self.model.tokenizer, work.logprobs))  # sees what the sampler sees
        return procs

    def _run(self, job: Job) -> None:
        work = job.work
        if self.model is None:
            raise self._unservable()
        m = self.model
        if work.task is not None:  # (with slots in parallel: run between their steps, on the batch's thread)
            job.put("start", {"model": self.model_id})
            job.put("done", work.task(m) if self.batcher is None else self.batcher.call(lambda: work.task(m)))
            return
        ctx = m.context_length
        ids = self._prompt_ids(work, ctx - 1)
        if not ids:
            raise ApiError("the prompt is empty", param="prompt")
        if len(ids) >= ctx:
            raise _too_long(ctx - 1, str(len(ids)), "messages" if work.messages is not None else "prompt")
        s = work.sampling
        sampler = make_sampler(s.temperature, s.top_p, s.min_p, s.top_k, s.seed)
        procs = self._processors(work, ids)
        recorder = procs[-1] if work.logprobs is not None else None
        constrained = work.forced_tools is not None or work.schema is not None
        reply = ReplySplitter(m, ids, tools=work.tools is not None or work.forced_tools is not None,
                              constrained=constrained and work.messages is not None)
        max_tokens = ctx if work.max_tokens is None else work.max_tokens
        slot = self._take_slot(job, ids)
        net = m.net
        if self.batcher is not None:
            self.batcher.join()
            net = BatchedDecoder(self.batcher)
        try:
            self._generate(job, slot, m, net, ids, sampler, procs, recorder, reply, max_tokens)
        finally:
            if self.batcher is not None:
                self.batcher.leave()
            self._give_back(slot)

    def _generate(self, job: Job, slot: Slot, m, net, ids: list[int], sampler, procs, recorder, reply,
                  max_tokens: int) -> None:
        """The request's reply from `slot`'s cache, its forwards run by `net`."""
        work = job.work
        prefix = slot.prefix
        self.prompts.recall(prefix, ids, SIMILAR)
        common = prefix.reuse(ids)
        with self.counting:
            self.prompt_tokens += len(ids)
            self.cached_tokens += common
        job.put("start", {"model": self.model_id, "prompt_tokens": len(ids), "cached_tokens": common})
        generated: list[int] = []
        pending: list[TokenLogprob] = []  # logprobs of tokens whose text is not given out yet
        last = None
        counted = 0  # of this request's tokens, added to self.generated
        replies = None
        t0 = time.perf_counter()
        ahead = 0.0  # seconds of the prompt run before generation (recurrent state: up to a checkpoint)
        try:
            held = prefix.prefill(net, ids, common, hook=m.hook)
            if held != common:
                ahead = time.perf_counter() - t0
            replies = stream_generate(m, ids[held:], max_tokens=max_tokens, sampler=sampler, processors=procs,
                                      stop=work.stop, cache=prefix.cache, prompt_prefix=ids[:held], hook=m.hook,
                                      lookup=self.lookup if recorder is None else 0, net=net)  # (one row a token)
            for r in replies:
                if job.cancelled.is_set():
                    break
                if r.token is not None:
                    generated.append(r.token)
                    if recorder is not None:
                        entry = recorder.entry(r.token)
                        if r.token not in m.tokenizer.stop_ids:  # (an end token is no part of the reply)
                            pending.append(entry)
                with self.counting:
                    self.generated += r.generation_tokens - counted
                counted = r.generation_tokens
                last = r
                if r.finish_reason is None and self.stopping:
                    break
                d = reply.feed(r.text, final=r.finish_reason is not None)
                if d.content or d.reasoning:
                    d.logprobs, pending = pending, []
                    job.put("delta", d)
        except Exception:
            self._fresh_cache([slot])
            raise
        finally:
            if replies is not None:
                replies.close()  # the cache settles before we record what it holds
            slot.prefix.settle(ids + generated)
        if last is None or last.finish_reason is None:
            job.put("error", ApiError("the request was cancelled", 499 if not self.stopping else 503,
                                      "server_error" if self.stopping else "invalid_request_error", "cancelled"))
            return
        calls, rest = reply.calls()
        finish = "tool_calls" if calls else last.finish_reason
        job.put("done", Done(finish, len(ids), last.generation_tokens, common, calls, rest,
                             last.prompt_time + ahead, last.generation_time, pending))


def _too_long(limit: int, size: str, where: str) -> ApiError:
    return ApiError(f"This model's maximum context length is {limit + 1} tokens; the prompt is {size} "
                    f"tokens, which leaves no room for a reply", code="context_length_exceeded", param=where)


def new_id(prefix: str) -> str:
    import secrets

    return f"{prefix}-{secrets.token_hex(12)}"


def now() -> int:
    return int(time.time())


__all__ = ["ApiError", "Engine", "Sampling", "Work", "Delta", "Done", "model_id", "new_id"]
