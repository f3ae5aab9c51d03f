"""A network's run on a backend: the architecture's schedule over the backend, and the state a
run keeps (caches made, rows run, the file checked while it is read, lookup decoding's timing
memory, the routing predictor). The architecture itself (models/) holds none of it."""

from __future__ import annotations

from typing import Optional

import numpy as np

from .cache import SWA_ROWS, Cache
from .errors import NonFiniteError, OnebitError, UsageError
from .models import blocks
from .models.base import TransformerLM, check_ids
from .pause import PauseClient, Pauses


class Decoder:
    """What generation drives (generate.generate_step): `forward` over rows of a cache. The
    optional parts have these defaults: no greedy steps queued ahead on a device, and lookup
    decoding's timings and accept rates kept for one generation only (None)."""

    draft_times: Optional[dict] = None  # seconds of a decode forward by row count (lookup.DraftPolicy)
    draft_learned: Optional[dict] = None  # accept rates by match length, the gate's means (lookup.DraftPolicy)

    def forward(self, ids, cache, hook=None, last_only: bool = False) -> np.ndarray:
        """Logits [R, vocab] (or [1, vocab]) for token ids [R] at the cache's next positions."""
        raise NotImplementedError

    def greedy_steps(self, cache, limit: Optional[int] = None) -> Optional["GreedySteps"]:
        """Greedy decoding with the device a step ahead of the host; None: not offered here."""
        return None


class Runner(Decoder):
    """Architecture `arch` run on `backend` over the tensors of `gguf`. `kv_capacity`: positions
    a new cache holds up front (0: grown as needed)."""

    def __init__(self, arch: TransformerLM, gguf, backend, kv_capacity: int = 0):
        self.arch, self.gguf, self.be = arch, gguf, backend
        self.kv_capacity = kv_capacity
        self.rows_run = 0  # rows (tokens) through the model so far: per-token stats divide by it
        self.draft_times: dict[int, float] = {}  # outlive one generation: a chat's turns go on from them
        self.draft_learned: dict = {}
        self.predictor: PauseClient | None = None  # routing prediction at the pause points (moe/predict.py)
        self._reads_checked: int | None = None  # _file_reads() when the file was last checked
        blocks.check_tensors(gguf, arch.expected_tensors(gguf))
        backend.attach_model(arch, kv_capacity)  # (Vulkan: records a step, so a model it cannot run is refused now)

    @property
    def cfg(self):
        return self.arch.cfg

    def make_cache(self, capacity: int | None = None, swa_rows: int = SWA_ROWS) -> Cache:
        """A cache for one sequence; sliding-window layers hold a ring sized for forwards of
        `swa_rows` rows (0: every layer holds every position)."""
        capacity = self.kv_capacity if capacity is None else capacity
        return self.be.make_cache(self.cfg, capacity, swa_rows)  # (Vulkan: in device memory)

    def forward(self, ids, cache: Cache, hook=None, last_only: bool = False) -> np.ndarray:
        """Logits [R, vocab] (or [1, vocab]: the last row) for token ids [R] at the cache's next
        positions; the cache then holds them too. `hook` and the predictor are the clients of
        every MoE pause point (pause.py)."""
        ids = np.asarray(ids, dtype=np.int64)
        check_ids(ids, self.cfg.vocab_size)
        self.rows_run += len(ids)
        unchanged = self.gguf.check_unchanged  # the file is read while running
        if self._file_reads() is None:  # (else the check after will do)
            unchanged()
        try:  # (backends run their host math under np.errstate: NaN / inf are reported below, once)
            logits, finite = self.be.forward(self.arch, ids, cache, Pauses(hook, self.predictor), last_only)
        except OnebitError:
            unchanged()  # a read that failed because the file changed says how it changed
            raise
        self._check_file(unchanged)  # before these logits are used: they may come from a changed file
        if not finite:  # (each backend checks its logits: Vulkan on the device)
            raise self._nonfinite(ids, cache, last_only)
        return logits

    def forward_batch(self, seqs, hook=None, last_only=()) -> list[np.ndarray]:
        """`forward` for several sequences in one pass, seqs = [(ids [R_i], cache_i)], each cache
        a sequence of its own: logits per sequence ([R_i, vocab], or [1, vocab] where
        last_only[i]). Each row's logits are those of its sequence's own forward (within float32
        rounding: a product over more rows may sum in another order). One sequence runs
        `forward` itself; several need a backend that `batches_sequences`. A predictor that reads
        one sequence's cache (`per_sequence`: block prediction) ranks one-sequence forwards only;
        router prediction ranks these too."""
        last_only = tuple(last_only) or (False,) * len(seqs)
        if len(seqs) == 1:
            (ids, cache), = seqs
            return [self.forward(ids, cache, hook, last_only[0])]
        if not self.be.batches_sequences:
            raise UsageError(f"the {self.be.name} backend runs one sequence per forward")
        seqs = [(np.asarray(ids, dtype=np.int64), cache) for ids, cache in seqs]
        for ids, _ in seqs:
            check_ids(ids, self.cfg.vocab_size)
        self.rows_run += sum(len(ids) for ids, _ in seqs)
        unchanged = self.gguf.check_unchanged
        if self._file_reads() is None:
            unchanged()
        try:
            pred = self.predictor if self.predictor is not None and not self.predictor.per_sequence else None
            logits, finite = self.be.forward_batch(self.arch, seqs, Pauses(hook, pred), last_only)
        except OnebitError:
            unchanged()
            raise
        self._check_file(unchanged)
        if not finite:
            i = next(i for i, lg in enumerate(logits) if not np.isfinite(lg).all())
            raise self._nonfinite(*seqs[i], last_only[i])
        return logits

    def _file_reads(self) -> int | None:
        """How many times the file has been read outside its memory map (gguf.reads: a pool's
        expert reads, a device backend's host copies to record a shape); None where a forward
        may read the memory map at any time (a host backend, a predictor's host ops): the file
        is then checked before and after each forward."""
        return None if self.be.reads_map or self.predictor is not None else self.gguf.reads

    def _check_file(self, unchanged) -> None:
        """After a forward: the file checked where it may have been read since the last check
        (the forward's reads, or a pool's that completed since: an expert read after one check
        and used in a later forward is covered by that forward's check)."""
        reads = self._file_reads()
        if reads is None or reads != self._reads_checked:
            unchanged()
            self._reads_checked = reads

    def greedy_steps(self, cache: Cache, limit: int | None = None) -> Optional["GreedySteps"]:
        """Greedy decoding with the device a step ahead of the host, where the backend offers it
        (Vulkan, every layer resident, no predictor); else None. `limit`: no position at or past it."""
        chain = self.be.greedy_chain(self.arch, cache, limit) if self.predictor is None else None
        return None if chain is None else GreedySteps(self, cache, chain)

    def _nonfinite(self, ids, cache, last_only: bool) -> NonFiniteError:
        from .nonfinite import first_nonfinite

        self.gguf.check_unchanged()  # (the re-run reads the weights from the file)
        where = first_nonfinite(self.arch, self.gguf, ids, cache, last_only)
        backend = self.be.name
        if where is None:
            where = ("a numpy re-run of the same step is finite: a numerics problem of the "
                     f"{backend} backend (try --backend numpy)") if not self.be.reference else \
                "but a re-run of the step found no op that made them"
        return NonFiniteError(f"{self.gguf.path}: the forward pass produced non-finite logits (NaN/inf) on the "
                              f"{backend} backend, {where}")


class GreedySteps:
    """`step(tok)`: the greedy token after `tok`, as `forward([tok])`'s logits' argmax, with the
    same checks (the file, non-finite logits); the device is already running the step after
    it. None: no step can start here (the caller runs `forward`). `close()` waits for the step
    queued ahead, which stays in the cache: the caller trims what it does not keep."""

    def __init__(self, runner: Runner, cache: Cache, chain):
        self.runner, self.cache, self.chain = runner, cache, chain

    def step(self, tok: int) -> int | None:
        got = self.chain.step(tok)
        if got is None:
            return None
        nxt, finite = got
        self.runner.rows_run += 1
        self.runner._check_file(self.runner.gguf.check_unchanged)
        if not finite:
            raise self.runner._nonfinite(np.array([tok], np.int64), self.cache, False)
        return nxt

    def close(self) -> None:
        self.chain.close()


def pool_line(pool, rows: int) -> str:
    """The expert pool's one line for --stats and /stats (`pool`: the model's, None when every
    expert is resident), per token over the `rows` rows run."""
    if pool is None:
        return "all experts resident (no streaming pool)"
    return f"experts streaming through {pool.n_slots} slots: " + pool.stats.line(rows)
