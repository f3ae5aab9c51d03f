"""`GraphRunner`: which recording a forward replays. It holds a backend's KV storages and their
recordings, splits a forward into recorded row counts (`row_chunks`), and decides when a step
runs with no pause over streamed experts (by the pool's slot table) and when it pauses."""

from __future__ import annotations

from typing import Optional

import numpy as np

from ...cache import SWA_ROWS
from ...pause import NO_PAUSES, Pauses
from .chain import GreedyChain
from .kv import MAX_ROWS, DeviceCache, DeviceKV
from .recording import NO_PAUSE_LAYERS, Recording

MIN_CAPACITY = 256
EXACT_ROWS = 16  # forwards of up to this many rows are recorded for their exact R


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
        # Steps with no pause over streamed experts (Recording.by_table; off: every streamed layer
        # pauses): tried after `_calm_needed` steps in a row whose every expert was a hit; a
        # refused try doubles how many it waits for.
        self.pool_table_steps = True
        self._calm, self._calm_needed = 0, 1
        self.table_steps, self.table_steps_refused = 0, 0  # (counts: the tests and benches read them)

    def make_cache(self, cfg, capacity: int = 0, swa_rows: int = SWA_ROWS) -> DeviceCache:
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
        # A hook that only observes (pauses.observing, e.g. a routing trace) is called after the
        # step with every layer's ids; a client that acts pauses every MoE layer.
        layers = pauses.layers(cfg, self.be.streamed_layers)
        observe = pauses.observing
        # All-row logits are one binding: keep it under the device's limit.
        limit = MAX_ROWS if last_only else max(1, min(MAX_ROWS, self.be.dev.info.max_storage_buffer_range
                                                       // (4 * cfg.vocab_size)))
        limit = min(limit, kv.forward_rows)  # a ring's rows must still hold what they read
        rings = [cache[i] for i in kv.rings]
        # Steps by the slot table: only where the pauses are the pool's alone (no client acts),
        # for decode and verify rows (a prompt chunk's many experts would often miss, and a
        # refused chunk costs a chunk), and not over recurrent state (a refused step would
        # have moved it).
        pool = self.be.pool
        by_table = (self.pool_table_steps and pool is not None and bool(layers) and not pauses.acting
                    and not cfg.recurrent_layers)
        out, s, finite = [], 0, True
        for R in row_chunks(n, limit):  # with last_only, every chunk's head runs on its last row only
            for c in rings:
                c.advance(cache.offset, R)
            logits = None
            if by_table and R <= EXACT_ROWS and self._calm >= self._calm_needed:
                rec = self._recording(model, kv, R, last_only, NO_PAUSE_LAYERS, observe, by_table=True)
                logits = rec.run(ids[s : s + R], cache.offset, pauses, pool)
                self.table_steps += 1
                if logits is None:  # an expert outside the pool: with pauses, below
                    self.table_steps_refused += 1
                    self._calm, self._calm_needed = 0, min(2 * self._calm_needed, 64)
                else:
                    self._calm_needed = 1
            if logits is None:
                rec = self._recording(model, kv, R, last_only, layers, observe)
                misses = pool.stats.demand_misses if by_table else 0
                with _held_interrupts(bool(cfg.recurrent_layers)):
                    logits = rec.run(ids[s : s + R], cache.offset, pauses, pool)
                    cache.offset += R
                if by_table:
                    self._calm = self._calm + 1 if pool.stats.demand_misses == misses else 0
            else:
                cache.offset += R
            s += R
            out.append(logits)
            finite = finite and rec.finite()
        return out[-1] if last_only or len(out) == 1 else np.concatenate(out), finite

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

    def close(self) -> None:
        for s in self.storages:
            s.destroy()
        self.storages = []
