"""What every architecture shares: construction, tensor checks, and the forward pass, which
runs the architecture's per-layer schedule on whichever backend holds the model."""

from __future__ import annotations

import numpy as np

from ..cache import SWA_ROWS, Cache
from ..config import ModelConfig
from ..errors import NonFiniteError, OnebitError, UsageError
from ..pause import PauseClient, Pauses
from . import blocks


class TransformerLM:
    """A decoder over one sequence. An architecture file gives `config()` (its metadata mapping)
    and, where the shared `blocks.decoder_layer` does not fit, its own `layer()`."""

    def __init__(self, gguf, backend, cfg: ModelConfig | None = None, kv_capacity: int = 0):
        self.gguf = gguf
        self.be = backend
        self.kv_capacity = kv_capacity  # positions a new cache holds up front (0: grown as needed)
        self.rows_run = 0
        self.draft_times: dict[int, float] = {}  # lookup decoding: seconds of a forward by row count
        self.draft_learned: dict = {}  # lookup decoding: accept rates by match length, the gate's means
        self.cfg: ModelConfig = cfg if cfg is not None else self.config(gguf)
        self.predictor: PauseClient | None = None  # routing prediction at the pause points (moe/predict.py)
        blocks.check_tensors(gguf, self.expected_tensors(gguf))
        backend.attach_model(self)  # (Vulkan: records a step now, so a model it cannot run is refused at load)

    @staticmethod
    def config(gguf) -> ModelConfig:
        raise NotImplementedError

    def expected_tensors(self, gguf) -> dict[str, tuple[int, ...]]:
        """Every tensor the schedule reads, with its shape (numpy order)."""
        return blocks.expected_tensors(self.cfg, gguf)

    @staticmethod
    def mixer(g, cfg: ModelConfig, layer: int, x):
        """Layer's token mixer over x = norm(residual) (the predictor runs it speculatively)."""
        return blocks.mixer(g, cfg, layer, x)

    @staticmethod
    def router_names(cfg: ModelConfig, layer: int) -> tuple[str, str, str | None]:
        """GGUF names of the layer's FFN norm, router weight and router bias (None: no bias)."""
        return f"blk.{layer}.{cfg.ffn_norm}.weight", f"blk.{layer}.ffn_gate_inp.weight", None

    def layer(self, g, i: int, x):
        """Layer i of the schedule, as block calls on the running step `g`."""
        return blocks.decoder_layer(g, self.cfg, i, x)

    def schedule(self, g, last_only: bool = False):
        """The whole forward pass as ops on `g`: embedding, every layer, the output head."""
        x = g.embed("token_embd.weight")  # [R, dim]
        if self.cfg.embed_scale != 1.0:
            x = g.scale(x, self.cfg.embed_scale)
        for i in range(self.cfg.n_layers):
            x = self.layer(g, i, x)
        if last_only:
            x = g.last_row(x)  # [1, dim]
        return blocks.output_head(g, self.cfg, x)  # [R, vocab]

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
        self.rows_run += len(ids)  # rows (tokens) through the model so far: per-token stats divide by it
        unchanged = self.gguf.check_unchanged  # the file is read while running
        if self._file_reads() is None:  # (else the check after will do)
            unchanged()
        try:  # (backends run their host math under np.errstate: NaN / inf are reported below, once)
            logits, finite = self.be.forward(self, ids, cache, Pauses(hook, self.predictor), last_only)
        except OnebitError:
            unchanged()  # a read that failed because the file changed says how it changed
            raise
        self._check_file(unchanged)  # before these logits are used: they may come from a changed file
        if not finite:  # (each backend checks its logits: Vulkan on the device)
            raise self._nonfinite(ids, cache, last_only)
        return logits

    _reads_checked: int | None = None  # _file_reads() when the file was last checked

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

    def greedy_steps(self, cache: Cache, limit: int | None = None) -> "GreedySteps | None":
        """Greedy decoding with the device a step ahead of the host, where the backend offers it
        (Vulkan, every layer resident, no predictor); else None. `limit`: no position at or past it."""
        chain = self.be.greedy_chain(self, cache, limit) if self.predictor is None else None
        return None if chain is None else GreedySteps(self, cache, chain)

    def _nonfinite(self, ids, cache, last_only: bool) -> NonFiniteError:
        from ..nonfinite import first_nonfinite

        self.gguf.check_unchanged()  # (the re-run reads the weights from the file)
        where = first_nonfinite(self, ids, cache, last_only)
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

    def __init__(self, model: TransformerLM, cache: Cache, chain):
        self.model, self.cache, self.chain = model, cache, chain

    def step(self, tok: int) -> int | None:
        got = self.chain.step(tok)
        if got is None:
            return None
        nxt, finite = got
        self.model.rows_run += 1
        self.model._check_file(self.model.gguf.check_unchanged)
        if not finite:
            raise self.model._nonfinite(np.array([tok], np.int64), self.cache, False)
        return nxt

    def close(self) -> None:
        self.chain.close()


def check_ids(ids: np.ndarray, vocab_size: int) -> None:
    """Token ids outside the vocabulary are the caller's error (on a device: out-of-bounds reads)."""
    if ids.size <= 16:  # (a decode step's: Python's min and max cost less than two reductions)
        vals = ids.ravel().tolist()
        lo, hi = (min(vals), max(vals)) if vals else (0, 0)
    else:
        lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= vocab_size:
        raise UsageError(f"token ids must be in [0, {vocab_size}), got {lo}..{hi}")
