"""Batch generation over a Ray cluster: one model per worker actor, one writer.

The driver reads the prompts, hands them to worker actors as they finish the ones they hold
(no static split: a slow node takes fewer), and writes every result itself through
`batch.BatchRun`, so the output keeps the single-machine guarantees: the lock, one fsynced
line per result, resume by id, per-id seeds, error results. A worker loads the model once,
with the flags of a single run (`LoadSpec`), after checking that its model file is the
driver's (`Fingerprint`). A lost worker's prompts in flight go back to the queue; a result
arriving for an id that has one already is dropped, so no id is written twice.

Ray is an optional extra (`pip install 'onebit[cluster]'`); this module imports it only when
a run starts.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import logging
import os
import socket
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

from . import batch
from ..errors import OnebitError, UsageError
from ..model import LoadSpec
from ..runner import pool_line

INSTALL_HINT = ("--ray needs Ray, an optional extra of onebit: pip install 'onebit[cluster]' "
                "(in a source checkout: pip install -e '.[cluster]')")
HEADER_BYTES = 1 << 20  # the fingerprint hashes the file's first MiB (the GGUF header and more) ...
BLOCK_BYTES = 64 << 10  # ... and blocks of this size ...
SAMPLED_BLOCKS = 8  # ... at this many evenly spaced offsets, and the file's last block
IN_FLIGHT = 2  # prompts sent to a worker at a time: one running, one waiting (no idle round trip)
MAX_LOSSES = 2  # a prompt whose worker was lost this many times while running it gets an error result
START_NOTE_S = 15.0  # say what the run waits for when workers take longer than this to start
WAIT_S = 0.5  # the driver's longest wait for a result (the progress bar's refresh)


class ClusterError(OnebitError):
    """The cluster could not finish the run (every worker lost, a worker failing to start)."""

    exit_code = 1


class ModelMismatchError(OnebitError):
    """A worker's model file is not the driver's."""


class WorkerError(OnebitError):
    """An error a worker raised, named with its node; exits with the worker's exit code."""

    def __init__(self, msg: str, exit_code: int):
        super().__init__(msg)
        self.exit_code = exit_code


def import_ray():
    try:
        import ray
    except ImportError:
        raise UsageError(INSTALL_HINT) from None
    return ray


# -- what every worker must agree on ------------------------------------------------------


@dataclass(frozen=True)
class Fingerprint:
    """A model file's size and a hash of its header and a few sampled blocks: cheap to take on
    every node, and different for a different file, a truncated copy or another quantization."""

    size: int
    digest: str

    @classmethod
    def of(cls, path: str) -> "Fingerprint":
        h = hashlib.blake2b(digest_size=16)
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            for off, n in _sampled_spans(size):
                f.seek(off)
                h.update(f.read(n))
        return cls(size, h.hexdigest())

    def difference(self, other: "Fingerprint") -> Optional[str]:
        """How `self` differs from `other` (the driver's), or None."""
        if self.size != other.size:
            return f"{self.size} bytes, the driver's has {other.size}"
        if self.digest != other.digest:
            return "same size, different content (header or sampled blocks)"
        return None


def _sampled_spans(size: int) -> list[tuple[int, int]]:
    spans = [(0, min(size, HEADER_BYTES))]
    if size > HEADER_BYTES:
        spans += [(size * k // (SAMPLED_BLOCKS + 1), BLOCK_BYTES) for k in range(1, SAMPLED_BLOCKS + 1)]
        spans.append((max(0, size - BLOCK_BYTES), BLOCK_BYTES))
    return spans


@dataclass(frozen=True)
class Work:
    """What to do with each prompt: `batch.generate_one`'s arguments (gen: max_tokens,
    temperature, ..., lookup, show_reasoning; no lookup_stats: each worker keeps its own)."""

    raw: bool = False
    system: Optional[str] = None
    seed: Optional[int] = None
    gen: dict = field(default_factory=dict)


# -- the worker actor ---------------------------------------------------------------------


class _Collect(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


class BatchWorker:
    """A Ray actor (made one with `ray.remote` by the driver): checks its model file, loads the
    model once, then runs the prompts the driver sends, one at a time, in the order sent.
    Failures a user can cause come back as {"error", "exit_code"}, not as exceptions."""

    def __init__(self, spec: LoadSpec, work: Work):
        self.spec, self.work = spec, work
        self.model = None
        self.lookup_stats = None
        self.gen: dict = {}
        self.chat = False

    def where(self) -> dict[str, Any]:
        import ray

        return {"node": ray.get_runtime_context().get_node_id(), "ip": ray.util.get_node_ip_address(),
                "host": socket.gethostname(), "pid": os.getpid(), "threads": self.spec.threads}

    def fingerprint(self) -> Fingerprint | str:
        path = self.spec.model_path()
        try:
            return Fingerprint.of(path)
        except OSError as e:
            return f"cannot read {path} ({e.strerror})"

    def load(self) -> dict[str, Any]:
        from ..lookup import LookupStats

        t0 = time.perf_counter()
        collect = _Collect()
        log = logging.getLogger("onebit")
        log.addHandler(collect)
        try:
            from ..model import load

            self.model = load(self.spec)
        except OnebitError as e:
            return {"error": str(e), "exit_code": e.exit_code}
        finally:
            log.removeHandler(collect)
        self.chat = not self.work.raw and self.model.chat_template is not None
        self.gen = dict(self.work.gen)
        if self.gen.get("lookup"):
            self.lookup_stats = self.gen["lookup_stats"] = LookupStats()
        return {"seconds": time.perf_counter() - t0, "warnings": collect.messages}

    def run(self, item: batch.PromptItem) -> dict[str, Any]:
        try:
            rec = batch.generate_one(self.model, item, chat=self.chat, system=self.work.system, seed=self.work.seed,
                                     **self.gen)
        except OnebitError as e:
            return {"error": str(e), "exit_code": e.exit_code}
        return {"result": rec}

    def stats(self) -> list[str]:
        """The lines a single run's --stats prints: lookup decoding, then the expert pool."""
        m, lines = self.model, []
        if m is None:
            return lines
        if self.lookup_stats is not None:
            lines.append(self.lookup_stats.line())
        lines.append(pool_line(m.pool, m.net.rows_run))
        return lines


# -- the driver ---------------------------------------------------------------------------


@dataclass
class Worker:
    """The driver's view of one worker actor and what it has done."""

    index: int
    actor: Any
    where: dict[str, Any] = field(default_factory=dict)
    in_flight: collections.deque = field(default_factory=collections.deque)  # (ref, item), oldest = running
    alive: bool = True
    lost: str = ""
    load_seconds: float = 0.0
    prompts: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    prompt_seconds: float = 0.0
    generation_seconds: float = 0.0
    stats_lines: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        w = self.where
        if not w:
            return f"worker {self.index}"
        return f"worker {self.index} on node {w['host']} ({w['ip']}, pid {w['pid']})"

    def account(self, rec: dict[str, Any]) -> None:
        self.prompts += 1
        self.prompt_tokens += rec.get("prompt_tokens", 0)
        self.generation_tokens += rec.get("generation_tokens", 0)
        self.prompt_seconds += rec.get("prompt_seconds", 0.0)
        self.generation_seconds += rec.get("generation_seconds", 0.0)


@dataclass
class Progress:
    """What the progress bar shows besides the prompts done."""

    tokens_per_s: float
    alive: int
    workers: int


class RayBatch:
    """One batch over a Ray cluster. `address`: `local` (start a Ray instance here, stopped at
    the end), `auto`, `ray://host:10001` or a cluster's GCS address; None: the connection this
    process already has (ray.init called by the caller). Use as a context manager: leaving it
    kills the workers and disconnects what it connected."""

    def __init__(self, address: Optional[str], spec: LoadSpec, work: Work, workers: Optional[int] = None,
                 worker_cpus: float = 1, say: Callable[[str], None] = print):
        if workers is not None and workers < 1:
            raise UsageError(f"--workers must be at least 1, got {workers}")
        if worker_cpus <= 0:
            raise UsageError(f"--worker-cpus must be more than 0, got {worker_cpus}")
        if spec.path is not None and not os.path.isabs(spec.path):
            raise UsageError(f"{spec.path}: the model path for Ray workers must be absolute")
        self.address, self.spec, self.work = address, spec, work
        self.n_workers, self.worker_cpus, self.say = workers, worker_cpus, say
        self.workers: list[Worker] = []
        self.ray = import_ray()
        self.own_connection = False
        self.started = 0.0

    # connection

    def __enter__(self) -> "RayBatch":
        ray = self.ray
        if self.address is None:  # a program that called ray.init itself: use its connection, leave it open
            if not ray.is_initialized():
                raise UsageError("RayBatch(None, ...) runs on this process's Ray connection: call ray.init first")
            return self
        self.own_connection = True
        kw: dict[str, Any] = dict(log_to_driver=False, logging_level=logging.ERROR)  # Ray's notices are not ours
        try:
            if self.address == "local":
                ray.init(address="local", include_dashboard=False, **kw)
            else:
                ray.init(address=self.address, **kw)
        except (ConnectionError, ValueError, RuntimeError) as e:
            why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise UsageError(f"--ray {self.address}: cannot connect to a Ray cluster ({why}){_auth_hint(e)}") from None
        return self

    def __exit__(self, *exc) -> None:
        for w in self.workers:
            try:
                self.ray.kill(w.actor)
            except Exception:  # already gone with its node
                pass
        if self.own_connection:
            self.ray.shutdown()

    # start: place, check, load

    def start(self, reference: Fingerprint) -> None:
        """Start the workers, check every model file against `reference` (the driver's) before
        any loads, then load the model on each. A file that differs is refused, naming its node."""
        ray = self.ray
        n = self.n_workers or sum(1 for node in ray.nodes() if node.get("Alive"))
        cpus = ray.cluster_resources().get("CPU", 0)
        if n * self.worker_cpus > cpus:
            raise UsageError(f"{n} worker(s) of {self.worker_cpus:g} CPU(s) need {n * self.worker_cpus:g} CPUs; the Ray "
                             f"cluster has {cpus:g} (use fewer --workers or a smaller --worker-cpus)")
        # each worker's cpu backend runs as many threads as it claims CPUs (-t sets them instead)
        spec = self.spec if self.spec.threads is not None else dataclasses.replace(
            self.spec, threads=max(1, int(self.worker_cpus)))
        actor = ray.remote(BatchWorker).options(num_cpus=self.worker_cpus, max_restarts=0, scheduling_strategy="SPREAD")
        self.workers = [Worker(i + 1, actor.remote(spec, self.work)) for i in range(n)]
        checks = self._gather("start", [(w, w.actor.where.remote()) for w in self.workers])
        for w, where in zip(self.workers, checks):
            w.where = where
        prints = self._gather("check its model file", [(w, w.actor.fingerprint.remote()) for w in self.workers])
        bad = []
        for w, fp in zip(self.workers, prints):
            why = fp if isinstance(fp, str) else fp.difference(reference)
            if why is not None:
                bad.append(f"{w.name}: {why}")
        if bad:
            path = self.spec.path or "the shipped model"
            raise ModelMismatchError(f"the model file {path} differs from the driver's on {len(bad)} of {n} worker(s): "
                                     + "; ".join(bad) + ". Copy the driver's file to the same path on those nodes")
        loads = self._gather("load the model", [(w, w.actor.load.remote()) for w in self.workers])
        for w, out in zip(self.workers, loads):
            if "error" in out:
                raise WorkerError(f"{w.name}: {out['error']}", out["exit_code"])
            w.load_seconds = out["seconds"]
            for msg in dict.fromkeys(out["warnings"]):
                self.say(f"{w.name}: {msg}")
        nodes = len({w.where["node"] for w in self.workers})
        loads = sorted(w.load_seconds for w in self.workers)
        self.say(f"{n} worker(s) ready on {nodes} node(s), {self.worker_cpus:g} CPU(s) each; model loaded in "
                 f"{loads[0]:.1f}-{loads[-1]:.1f} s")

    def _gather(self, what: str, calls: list[tuple[Worker, Any]]) -> list[Any]:
        """Every call's value, waiting as long as the workers take (placement may wait for
        free CPUs); a worker lost meanwhile fails the start."""
        ray = self.ray
        refs = [ref for _, ref in calls]
        t0, noted = time.monotonic(), False
        while True:
            ready, pending = ray.wait(refs, num_returns=len(refs), timeout=WAIT_S)
            if not pending:
                break
            if not noted and time.monotonic() - t0 > START_NOTE_S:
                self.say(f"waiting for {len(pending)} of {len(refs)} worker(s) to {what} "
                         f"(free CPUs in the cluster: {ray.available_resources().get('CPU', 0):g})")
                noted = True
        out = []
        for w, ref in calls:
            try:
                out.append(ray.get(ref))
            except self.ray.exceptions.RayError as e:
                raise ClusterError(f"{w.name} failed to {what}: {_reason(e)}") from None
        return out

    # the run

    def run(self, run: batch.BatchRun, items: Iterator[batch.PromptItem],
            progress: Callable[[Progress], None] = lambda p: None) -> None:
        """Run `items` on the workers, writing each result through `run` as it arrives."""
        ray = self.ray
        lost_errors = (ray.exceptions.RayActorError, ray.exceptions.WorkerCrashedError, ray.exceptions.NodeDiedError,
                       ray.exceptions.ObjectLostError)
        queue: collections.deque = collections.deque()  # prompts given back by lost workers: sent first
        losses: collections.Counter = collections.Counter()
        owner: dict[Any, Worker] = {}
        source = iter(items)
        self.started = time.perf_counter()
        tokens = 0

        def next_item() -> Optional[batch.PromptItem]:
            return queue.popleft() if queue else next(source, None)

        while True:
            if not any(w.alive for w in self.workers):
                if next_item() is not None:
                    raise ClusterError(f"every worker was lost ({self._losses()}); {len(run.done)} result(s) are "
                                       f"in {run.results.path}: rerun the same command to resume")
                break
            for w in self.workers:
                while w.alive and len(w.in_flight) < IN_FLIGHT:
                    item = next_item()
                    if item is None:
                        break
                    ref = w.actor.run.remote(item)
                    w.in_flight.append((ref, item))
                    owner[ref] = w
            if not owner:  # nothing left to send, nothing in flight
                break
            ready, _ = ray.wait(list(owner), num_returns=1, timeout=WAIT_S)
            for ref in ready:
                w = owner.get(ref)
                if w is None:  # its worker was lost while an earlier result was handled
                    continue
                try:
                    out = ray.get(ref)
                except lost_errors as e:
                    self._lose(w, _reason(e), owner, queue, losses, run)
                    continue
                except ray.exceptions.RayError as e:
                    raise ClusterError(f"{w.name}: {_reason(e)}") from None
                entry = next(x for x in w.in_flight if x[0] == ref)
                w.in_flight.remove(entry)
                del owner[ref]
                item = entry[1]
                if "error" in out:
                    raise WorkerError(f"{w.name}: {out['error']}", out["exit_code"])
                rec = out["result"]
                w.account(rec)
                tokens += rec.get("generation_tokens", 0)
                run.record(item, rec)
            progress(self.progress(tokens))

    def progress(self, tokens: int) -> Progress:
        dt = time.perf_counter() - self.started
        return Progress(tokens / dt if dt > 0 else 0.0, sum(w.alive for w in self.workers), len(self.workers))

    def _lose(self, w: Worker, why: str, owner: dict, queue: collections.deque, losses: collections.Counter,
              run: batch.BatchRun) -> None:
        """Worker w is gone: its prompts in flight go back to the front of the queue, except
        one that was running on lost workers MAX_LOSSES times, which gets an error result."""
        w.alive, w.lost = False, why
        items = [item for ref, item in w.in_flight]
        for ref, _ in w.in_flight:
            owner.pop(ref, None)
        w.in_flight.clear()
        try:
            self.ray.kill(w.actor)  # unreachable but perhaps alive: make sure it sends nothing more
        except Exception:
            pass
        back = items
        if items:
            running = items[0]
            losses[running.id] += 1
            if losses[running.id] >= MAX_LOSSES:
                back = items[1:]
                run.record(running, {"id": running.id, "finish_reason": "error",
                                     "error": f"the worker running this prompt was lost {MAX_LOSSES} times "
                                              f"(last: {w.name}: {why})"})
        queue.extendleft(reversed(back))
        alive = sum(x.alive for x in self.workers)
        self.say(f"{w.name} was lost ({why}); {len(back)} prompt(s) it held went back to the queue; "
                 f"{alive} worker(s) left")

    def _losses(self) -> str:
        return "; ".join(f"{w.name}: {w.lost}" for w in self.workers if not w.alive)

    def collect_stats(self) -> None:
        """Ask each live worker for its lookup and expert-pool lines (for --stats)."""
        for w in self.workers:
            if w.alive:
                try:
                    w.stats_lines = self.ray.get(w.actor.stats.remote(), timeout=30)
                except self.ray.exceptions.RayError as e:
                    w.stats_lines = [f"(no stats: {_reason(e)})"]

    def table(self) -> str:
        """Per-worker figures: where it ran, what it did, how fast."""
        wall = time.perf_counter() - self.started if self.started else 0.0
        head = f"{'worker':<7} {'node (ip) x threads':<28} {'load s':>7} {'prompts':>8} {'prompt tok':>10} {'gen tok':>8} " \
               f"{'busy s':>7} {'gen tok/s':>9} {'prompts/s':>9}  state"
        rows = [head]
        for w in self.workers:
            busy = w.prompt_seconds + w.generation_seconds
            node = f"{w.where.get('host', '?')} ({w.where.get('ip', '?')}) x{w.where.get('threads', '?')}"
            tps = w.generation_tokens / w.generation_seconds if w.generation_seconds else 0.0
            pps = w.prompts / wall if wall else 0.0
            state = "ok" if w.alive else f"lost: {w.lost}"
            rows.append(f"{w.index:<7} {node[:28]:<28} {w.load_seconds:>7.2f} {w.prompts:>8} {w.prompt_tokens:>10} "
                        f"{w.generation_tokens:>8} {busy:>7.2f} {tps:>9.1f} {pps:>9.2f}  {state}")
            rows += [f"        {line}" for line in w.stats_lines]
        total = sum(w.prompts for w in self.workers)
        rows.append(f"all: {total} prompt(s) in {wall:.2f} s: {total / wall if wall else 0.0:.2f} prompts/s")
        return "\n".join(rows)


def _auth_hint(e: Optional[BaseException]) -> str:
    """A hint when the cluster refused this driver's token (Ray's token authentication)."""
    from ray.exceptions import AuthenticationError

    while e is not None:  # (Ray 2.60 wraps it in a RuntimeError that carries only its traceback's text)
        if isinstance(e, AuthenticationError) or "InvalidAuthToken" in str(e):
            return ("; the cluster uses token authentication: set RAY_AUTH_MODE=token here and give its token "
                    "(~/.ray/auth_token or RAY_AUTH_TOKEN)")
        e = e.__cause__ or e.__context__
    return ""


def _reason(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:300]}" if text else type(e).__name__
