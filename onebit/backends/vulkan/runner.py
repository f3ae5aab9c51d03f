"""`GraphRunner`: which recording a forward replays. It holds a backend's KV storages and their
recordings, splits a forward into recorded row counts (`row_chunks`), and decides when a step
runs with no pause over streamed experts (by the pool's slot table) and when it pauses."""

from __future__ import annotations

import threading
from typing import Optional

import numpy as np

from ...cache import SWA_ROWS
from ...pause import NO_PAUSES, Pauses
from .chain import GreedyChain
from .kv import MAX_ROWS, DeviceCache, DeviceKV
from .recording import NO_PAUSE_LAYERS, Recording

MIN_CAPACITY = 256
EXACT_ROWS = 16  # forwards of up to this many rows are recorded for their exact R
BATCH_RECORDINGS = 32  # recordings over several sequences' rows kept (the last made or used)


def row_chunks(n: int, limit: int = MAX_ROWS) -> list[int]:
    """Split n rows into recorded sizes: n itself when small, else powers of two, then the rest.
    A forward of more than one row gets no one-row chunk (limit >= 3): one row takes other
    kernels (attention over keys split across lanes) whose sums run in another order, so a
    row's logits would depend on where a split fell (a ring's smaller limit moves it)."""
    out = []
    while n > 0:
        if n <= min(EXACT_ROWS, limit):
            out.append(n)
            break
        step = min(limit, 1 << (n.bit_length() - 1))
        if n - step == 1 and step > 2:  # [step - 1, 2]: the same passes over the weights
            step -= 1
        out.append(step)
        n -= step
    return out


def rounds(counts: list[int], limits: list[int], kept: list[int], logit_rows: int) -> list[list[tuple[int, int, int]]]:
    """Forwards over several sequences' rows: sequence i's counts[i] rows in the chunks its own
    forward takes (row_chunks within limits[i]), in order, each forward a list of (sequence,
    first row, rows) of at most MAX_ROWS rows and `logit_rows` rows of logits kept (kept[i]:
    sequence i's per chunk: 1 or all). Every sequence with a chunk left rides in the next
    forward where it fits."""
    queues = [row_chunks(n, lim) for n, lim in zip(counts, limits)]
    at = [0] * len(counts)
    out = []
    while any(queues):
        rnd, rows, logits = [], 0, 0
        for i, q in enumerate(queues):
            if not q:
                continue
            n = q[0]
            k = min(kept[i], n)
            if rnd and (rows + n > MAX_ROWS or logits + k > logit_rows):
                continue
            q.pop(0)
            rnd.append((i, at[i], n))
            at[i] += n
            rows, logits = rows + n, logits + k
        out.append(rnd)
    return out


class _held_interrupts:
    """Ctrl-C held until a chunk's forward completes, where the recurrent state is updated in
    place on the device: an interrupt between its submission and the position moving on would
    leave state and position apart. (Main thread only; elsewhere nothing is held.)"""

    def __init__(self, on: bool):
        self.on, self.got, self.old = on, None, None

    def __enter__(self):
        import signal
        import threading

        if self.on and threading.current_thread() is threading.main_thread():
            self.old = signal.signal(signal.SIGINT, lambda *a: setattr(self, "got", a))
        return self

    def __exit__(self, *exc):
        import signal

        if self.old is not None:
            signal.signal(signal.SIGINT, self.old)
            if self.got is not None and exc[0] is None and callable(self.old):
                self.old(*self.got)  # the interrupt, now that the step is whole
        return False


class GraphRunner:
    """Per-backend state: the KV storages and, per storage, its recordings."""

    def __init__(self, be):
        self.be = be
        self.storages: list[DeviceKV] = []
        # Held by every call that makes, replays or frees recordings or storages: serve's slots
        # make caches on their own threads while the batch's thread runs a step, and a storage
        # given back closes the recordings over several sequences it shares with the others.
        self.lock = threading.RLock()
        # Steps with no pause over streamed experts (Recording.by_table; off: every streamed layer
        # pauses): tried after `_calm_needed` steps in a row whose every expert was a hit; a
        # refused try doubles how many it waits for.
        self.pool_table_steps = True
        self._calm, self._calm_needed = 0, 1
        self.table_steps, self.table_steps_refused = 0, 0  # (counts: the tests and benches read them)
        self.batches: dict = {}  # the recordings over several sequences' rows, least recently used first

    def make_cache(self, cfg, capacity: int = 0, swa_rows: int = SWA_ROWS) -> DeviceCache:
        with self.lock:
            return self._make_cache(cfg, capacity, swa_rows)

    def _make_cache(self, cfg, capacity: int, swa_rows: int) -> DeviceCache:
        want = max(int(capacity), 1)
        types = self.be.kv_types
        free = [s for s in self.storages if not s.in_use and s.cfg is cfg and s.swa_rows == swa_rows
                and s.types == types]
        pick = next((s for s in free if s.capacity >= want), None)
        for s in free:  # idle storages that will not be reused: give their memory back
            if s is not pick:
                self.storages.remove(s)
                s.destroy()
        if pick is None:  # positions past a reused storage's length are never read: no clearing
            pick = DeviceKV(self.be.dev, cfg, int(capacity) if capacity else MIN_CAPACITY, swa_rows, types)
            self.storages.append(pick)
        return DeviceCache(pick)

    def forward(self, model, ids: np.ndarray, cache: DeviceCache, pauses: Pauses = NO_PAUSES,
                last_only: bool = False) -> tuple[np.ndarray, bool]:
        """(logits, whether all are finite): see NumpyBackend.forward."""
        with self.lock:
            return self._forward_one(model, ids, cache, pauses, last_only)

    def _forward_one(self, model, ids: np.ndarray, cache: DeviceCache, pauses: Pauses,
                     last_only: bool) -> tuple[np.ndarray, bool]:
        cfg = model.cfg
        if not isinstance(cache, DeviceCache) or cache.storage.cfg is not cfg:
            raise ValueError("this cache was not made by this network on the Vulkan backend (use model.new_cache() "
                             "or model.net.make_cache())")
        n = len(ids)
        if n == 0:
            return np.zeros((0, cfg.vocab_size), np.float32), True
        kv = cache.storage
        if cache.offset + n > kv.capacity:
            kv.grow(cache.offset + n)
        if n == 1 and pauses.hook is None and pauses.predictor is None and self._host_free(cfg):
            return self._step(model, kv, cache, int(ids[0]))  # a resident decode step: the short way
        with np.errstate(all="ignore"):  # (a predictor's and a hook's host math: see NumpyBackend.forward)
            return self._forward(model, ids, cache, pauses, last_only)

    def _forward(self, model, ids: np.ndarray, cache: DeviceCache, pauses: Pauses,
                 last_only: bool) -> tuple[np.ndarray, bool]:
        cfg, kv, n = model.cfg, cache.storage, len(ids)
        limit = min(MAX_ROWS if last_only else self._logit_rows(cfg), kv.forward_rows)
        out, s, finite = [], 0, True
        for R in row_chunks(n, limit):  # with last_only, every chunk's head runs on its last row only
            logits, ok = self._run(model, [(ids[s : s + R], cache, last_only)], pauses)
            s += R
            out.append(logits)
            finite = finite and ok
        return out[-1] if last_only or len(out) == 1 else np.concatenate(out), finite

    def _logit_rows(self, cfg) -> int:
        """The most rows one forward keeps every logit of: all-row logits are one binding, kept
        under the device's limit."""
        return max(1, min(MAX_ROWS, self.be.dev.info.max_storage_buffer_range // (4 * cfg.vocab_size)))

    def forward_batch(self, model, seqs, pauses: Pauses = NO_PAUSES,
                      last_only: tuple = ()) -> tuple[list[np.ndarray], bool]:
        """(logits per sequence, whether all are finite): see NumpyBackend.forward_batch. The rows
        run as recorded forwards over several sequences' rows (`rounds`): each sequence's rows in
        the chunks its own forward would take, in order, at most MAX_ROWS rows a forward."""
        with self.lock:
            return self._forward_batch(model, seqs, pauses, last_only)

    def _forward_batch(self, model, seqs, pauses: Pauses, last_only: tuple) -> tuple[list[np.ndarray], bool]:
        cfg = model.cfg
        last_only = tuple(last_only) or (False,) * len(seqs)
        for _, cache in seqs:
            if not isinstance(cache, DeviceCache) or cache.storage.cfg is not cfg:
                raise ValueError("this cache was not made by this network on the Vulkan backend (use "
                                 "model.new_cache() or model.net.make_cache())")
        if len({id(cache.storage) for _, cache in seqs}) < len(seqs):
            raise ValueError("two sequences of one forward share a KV cache")
        for ids, cache in seqs:
            if cache.offset + len(ids) > cache.storage.capacity:
                cache.storage.grow(cache.offset + len(ids))
        counts = [len(ids) for ids, _ in seqs]
        limits = [min(MAX_ROWS if lo else self._logit_rows(cfg), c.storage.forward_rows)
                  for lo, (_, c) in zip(last_only, seqs)]
        got: list[list[np.ndarray]] = [[] for _ in seqs]
        bad: list[Optional[np.ndarray]] = [None] * len(seqs)  # per sequence: its first logits not all finite
        finite = True
        with np.errstate(all="ignore"):  # (a predictor's and a hook's host math: see NumpyBackend.forward)
            for rnd in rounds(counts, limits, [1 if lo else n for lo, n in zip(last_only, counts)],
                              self._logit_rows(cfg)):
                # (in one order, whatever the order handed in: the same caches with the same rows
                # replay one recording)
                rnd = sorted(rnd, key=lambda part: id(seqs[part[0]][1].storage))
                parts = [(seqs[i][0][s : s + n], seqs[i][1], last_only[i]) for i, s, n in rnd]
                logits, ok = self._run(model, parts, pauses)
                finite = finite and ok
                kept = [1 if lo and len(ids) > 1 else len(ids) for ids, _, lo in parts]
                for (i, _, _), lg in zip(rnd, np.split(logits, np.cumsum(kept)[:-1])):
                    if not ok and bad[i] is None and not np.isfinite(lg).all():
                        bad[i] = lg
                    got[i].append(lg)
        out = []
        for lo, rows, b in zip(last_only, got, bad):
            if not rows:  # (no rows)
                out.append(np.zeros((0, cfg.vocab_size), np.float32))
            elif lo:  # (an earlier chunk's logits that were not finite, where the last chunk's are: reported)
                out.append(rows[-1] if b is None else b)
            else:
                out.append(rows[0] if len(rows) == 1 else np.concatenate(rows))
        return out, finite

    def _run(self, model, parts: list, pauses: Pauses) -> tuple[np.ndarray, bool]:
        """One recorded forward over parts [(ids, cache, last_only)]: one sequence's chunk, or
        several sequences' (each within the rows its rings hold), every cache moved on by its
        rows. (logits: one sequence's, or each one's kept rows in order; whether all are finite)"""
        cfg = model.cfg
        # A hook that only observes (pauses.observing, e.g. a routing trace) is called after the
        # step with every layer's ids; a client that acts pauses every MoE layer.
        layers = pauses.layers(cfg, self.be.streamed_layers)
        observe = pauses.observing
        R = sum(len(ids) for ids, _, _ in parts)
        for ids, cache, _ in parts:
            for i in cache.storage.rings:
                cache[i].advance(cache.offset, len(ids))
        if len(parts) == 1:
            ((tokens, cache, last_only),) = parts
            kv, start = cache.storage, cache.offset

            def recording(layers, by_table=False):
                return self._recording(model, kv, R, last_only, layers, observe, by_table)
        else:
            tokens = np.concatenate([ids for ids, _, _ in parts])
            start = tuple(cache.offset for _, cache, _ in parts)
            shape = tuple((cache.storage, len(ids), lo) for ids, cache, lo in parts)

            def recording(layers, by_table=False):
                return self._batch_recording(model, shape, layers, observe, by_table)
        # Steps by the slot table: only where the pauses are the pool's alone (no client acts),
        # for decode and verify rows (a prompt chunk's many experts would often miss, and a
        # refused chunk costs a chunk), and not over recurrent state (a refused step would
        # have moved it).
        pool = self.be.pool
        by_table = (self.pool_table_steps and pool is not None and bool(layers) and not pauses.acting
                    and not cfg.recurrent_layers)
        logits = None
        if by_table and R <= EXACT_ROWS and self._calm >= self._calm_needed:
            rec = recording(NO_PAUSE_LAYERS, by_table=True)
            logits = rec.run(tokens, start, pauses, pool)
            self.table_steps += 1
            if logits is None:  # an expert outside the pool: with pauses, below
                self.table_steps_refused += 1
                self._calm, self._calm_needed = 0, min(2 * self._calm_needed, 64)
            else:
                self._calm_needed = 1
        if logits is None:
            rec = recording(layers)
            misses = pool.stats.demand_misses if by_table else 0
            with _held_interrupts(bool(cfg.recurrent_layers)):
                logits = rec.run(tokens, start, pauses, pool)
                for ids, cache, _ in parts:
                    cache.offset += len(ids)
            if by_table:
                self._calm = self._calm + 1 if pool.stats.demand_misses == misses else 0
        else:
            for ids, cache, _ in parts:
                cache.offset += len(ids)
        return logits, rec.finite()

    def _host_free(self, cfg) -> bool:
        """Whether a forward with no pause client needs nothing of the host between submission
        and logits: every layer resident, no recurrent state (whose chunks hold Ctrl-C, and
        which a trim cannot undo). `_step` and `greedy_chain` rest on it."""
        return not self.be.streamed_layers and not cfg.recurrent_layers

    def _step(self, model, kv: DeviceKV, cache: DeviceCache, token: int) -> tuple[np.ndarray, bool]:
        """forward() of one row with nothing to pause for, observe or hold (every layer
        resident, no hook, predictor or recurrent state): the same recording, replayed with
        none of the bookkeeping those need (a decode step's host time is a share of its own)."""
        rec = self._recording(model, kv, 1, False, NO_PAUSE_LAYERS)
        at = cache.offset
        for i in kv.rings:
            cache[i].advance(at, 1)
        logits = rec.step(token, at)
        cache.offset = at + 1
        return logits, rec.finite()

    def greedy_chain(self, model, cache, limit: Optional[int] = None) -> Optional[GreedyChain]:
        """Greedy decoding a step ahead on the device (GreedyChain), where a step needs nothing
        of the host but its token: every layer resident, no predictor, and no recurrent state
        (the step queued past the last token kept is undone by a trim). Else None."""
        if not isinstance(cache, DeviceCache) or cache.storage.cfg is not model.cfg:
            return None
        return GreedyChain(self, model, cache, limit) if self._host_free(model.cfg) else None

    def _recording(self, model, kv: DeviceKV, R: int, last_only: bool, layers: frozenset,
                   observe: bool = False, by_table: bool = False) -> Recording:
        last_only = last_only and R > 1  # one row: the same forward either way
        chunked = 0 < self.be.k.delta_chunk_min_rows <= R  # the delta rule's kernel is recorded in
        key = (id(model), R, last_only, layers, observe, chunked, by_table)
        rec = kv.recordings.get(key)
        if rec is None:
            rec = kv.recordings[key] = Recording(self.be, model, kv, R, last_only, layers, observe, by_table)
        return rec

    def _batch_recording(self, model, shape: tuple, layers: frozenset, observe: bool = False,
                         by_table: bool = False) -> Recording:
        """The recording over several sequences' rows, shape = ((storage, rows, last_only), ...):
        kept in each of those storages (dropped when any of them grows or goes), the last
        BATCH_RECORDINGS made or used kept at all (row counts beside each other vary more than
        one sequence's)."""
        shape = tuple((kv, n, lo and n > 1) for kv, n, lo in shape)
        key = (id(model), sum(n for _, n, _ in shape), tuple(lo for _, _, lo in shape), layers, observe,
               tuple((id(kv), n) for kv, n, _ in shape), by_table)
        rec = self.batches.pop(key, None)
        if rec is None or rec.closed:
            rec = Recording(self.be, model, None, key[1], any(key[2]), layers, observe, by_table, seqs=shape)
            for kv, _, _ in shape:
                kv.recordings[key] = rec
        self.batches[key] = rec  # (the most recently used last)
        while len(self.batches) > BATCH_RECORDINGS:
            self.batches.pop(next(iter(self.batches))).close()
        return rec

    def close(self) -> None:
        with self.lock:
            self.batches = {}
            for s in self.storages:
                s.destroy()
            self.storages = []
