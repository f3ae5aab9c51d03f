"""`Recording`: a model's schedule recorded into Vulkan command buffers, specialised on the row
count R, and replayed.

The schedule is run once against a `Recorder` (recorder.py). The result is kept per (KV storage,
model, R, last_only, pause layers, observing hook, chunked delta rule, by slot table:
`GraphRunner._recording`'s key) and replayed: per forward the host writes R token ids and
positions into mapped buffers, submits, waits and reads the logits.

Pause points (the protocol: onebit/pause.py). At a MoE layer's pause the recording is cut
into segments when that layer needs the host: a client that acts (a hook, the predictor) or
streamed experts. Between segments the host reads the layer's expert ids and router logits
from mapped memory, calls the hook, acquires the experts in the pool and writes the slot
table the expert kernels read, then submits the next segment, and the predictor ranks while
the device runs it. With nothing to pause the whole forward is one submission; a hook that only
observes (`needs_pause = False`: a routing trace) keeps it so, and is called after the step
with every layer's ids and logits, which the recording keeps in buffers of their own. When a pool cannot
pin every expert the rows route to at once (a prefill chunk, a small per-layer partition),
the experts run in passes over groups of rows (weights of the other rows set to zero, their
table entries pointing at a pinned slot) accumulating into the layer's expert output, then
the rest of the segment runs: the same kernels, per row, as one pass, so the result is the
same bit for bit.
"""

from __future__ import annotations

import logging
from typing import Optional

import numpy as np

from ...pause import NO_PAUSES, PauseContext, Pauses
from ..experts import StreamedExperts
from .arena import Val
from .device import Buffer, Fence, Slice
from .kv import DeviceKV
from .recorder import PausePoint, Recorder

log = logging.getLogger(__name__)

NO_PAUSE_LAYERS: frozenset = frozenset()  # a recording's pause layers where nothing pauses


class SequenceRows:
    """One sequence's rows in a recording: rows r0 .. r0 + n - 1, at the next positions of the
    sequence whose K/V (and recurrent state) storage is `kv`; `pos` holds their positions on
    the device (`host`: the mapped view a replay writes), `last_only`: only the last row's logits."""

    def __init__(self, kv: DeviceKV, r0: int, n: int, last_only: bool, pos: Slice, host: Optional[np.ndarray]):
        self.kv, self.r0, self.n, self.last_only, self.pos, self.host = kv, r0, n, last_only, pos, host


class Recording:
    """One model forward over R rows, recorded once and replayed: the rows of one sequence, or
    of several (`seqs`), each at its own KV storage's next positions."""

    def __init__(self, be, model, kv: Optional[DeviceKV], R: int, last_only: bool, pause_layers: frozenset,
                 observe: bool = False, by_table: bool = False, seqs: tuple = ()):
        """seqs: several sequences' rows, ((storage, rows, last_only), ...) in row order, every
        other op over all their rows together (kv is then None, R their sum, last_only whether
        any keeps only its last row's logits)."""
        self.be, self.model, self.cfg, self.kv = be, model, model.cfg, kv
        self.dev, self.R, self.last_only, self.pause_layers = be.dev, R, last_only, pause_layers
        self.observe = observe  # keep every MoE layer's ids and logits for an observing hook
        self.observed: list[tuple[int, Val, Val]] = []
        # by_table: streamed layers with no pause point read the pool's slots through its table
        # (the router writes the slot table); a step that routed to an expert not there is
        # refused (run() returns None) and run again with pauses.
        self.by_table = by_table
        self.by_table_ids: dict[int, tuple[Val, Val]] = {}  # layer -> (ids, slot table), kept for touch()
        self.arena = be.arena
        self._bufs: list[Buffer] = []
        self._shared: dict[tuple, Val] = {}  # see shared()
        self.collector = self.dev.sequence()
        self.arena.clock = lambda: len(self.collector.ops)
        self.pauses: list[PausePoint] = []
        self.segments = []
        self._chain: Optional[list] = None  # GreedyChain's parts (chain())
        self.n_replays = 0
        self.closed = False
        self.seqs: list[SequenceRows] = []
        try:
            tok, pos = self.fixed((R,), np.int32), self.fixed((R,), np.int32)
            self.tok, self.pos = tok.s, pos.s
            self._tok, self._pos = tok.host(), pos.host()
            if not seqs:
                self.seqs = [SequenceRows(kv, 0, R, last_only, self.pos, None)]
            r0 = 0
            for storage, n, lo in seqs:  # (each its own positions: a binding's offset must be aligned)
                p = self.fixed((n,), np.int32)
                self.seqs.append(SequenceRows(storage, r0, n, lo, p.s, p.host()))
                r0 += n
            if by_table:  # set by a router that found an expert outside the pool
                self.miss = self.fixed((1,), np.int32)
                self._miss = self.miss.host()
            self._rows = np.arange(R, dtype=np.int32)
            self.logits = model.schedule(Recorder(self), last_only)  # [R or 1, vocab]
            # then the forward's check of its logits: the host reads one word, not the rows
            self.body = len(self.collector.ops)
            bad = self.fixed((1,), np.int32)
            self._bad = bad.host()
            be.k.nonfinite(self.collector, self.logits.s, bad.s, self.logits.size)
            self.arena.clock = lambda: 1 << 62  # between recordings every free buffer may be taken
            self._logits = self.logits.host()
            ops = self.collector.ops
            cuts = [0] + [pp.at for pp in self.pauses] + [len(ops)]
            for a, b in zip(cuts, cuts[1:]):
                self.segments.append(self._sequence(ops[a:b]))
        except Exception:
            self.close()
            raise
        be.recordings += 1
        log.info("vulkan: recorded %s rows=%d: %d dispatches in %d segments, KV capacity %s", model.cfg.arch, R,
                 len(ops), len(self.segments), "/".join(str(sq.kv.capacity) for sq in self.seqs))

    def fixed(self, shape, dtype=np.float32) -> Val:
        """A zeroed buffer of this recording's own (inputs, outputs the host reads or writes)."""
        n = max(16, (int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize + 15) // 16 * 16)
        b = self.dev.buffer(n)
        b.write(np.zeros(n, np.uint8))
        self._bufs.append(b)
        return Val(b.slice(0, n), shape, dtype)

    def shared(self, n: int, shape, dtype=np.float32) -> Val:
        """The n-th buffer of this shape that every pause layer's expert ops use (layers run one
        at a time), in this recording and every other of the backend (one runs at a time). Their
        ops are kept to be recorded again at replay (passes over row groups), so buffers from the
        arena's pool would never go back: 3 of [R, k, F] a streamed layer, 555 MiB at 96 rows on
        the 30B-A3B shape (48 layers), which the memory plan does not count."""
        key = (n, tuple(shape), np.dtype(dtype).str)
        if key not in self._shared:
            nbytes = max(16, (int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize + 15) // 16 * 16)
            self._shared[key] = Val(self.arena.kept(("pause experts", *key), nbytes), shape, dtype)
        return self._shared[key]

    def _sequence(self, ops):
        seq = self.dev.sequence()
        seq.ops = list(ops)
        seq.record()
        return seq

    # -- replay ------------------------------------------------------------------------

    def run(self, tokens: np.ndarray, start: int, pauses: Pauses = NO_PAUSES,
            pool: Optional[StreamedExperts] = None) -> Optional[np.ndarray]:
        """Forward tokens [R] at positions start..start+R-1, the pause points served by `pauses`
        (pause.py) and the pool; returns logits (a copy), or None where a step by the slot
        table routed to an expert the pool did not hold (nothing was called or counted: the
        caller runs the rows again with pauses, over what this step wrote). `finite()` then
        says whether every logit is finite."""
        self._bad[0] = 0
        if self.R == 1:  # (a decode step: item writes cost less than the array ops)
            self._tok[0], self._pos[0] = tokens[0], start
        elif self.kv is not None:
            self._tok[:] = tokens
            np.add(self._rows, start, out=self._pos)
        else:  # several sequences: start holds each one's first position
            self._tok[:] = tokens
            for sq, at in zip(self.seqs, start):
                np.add(self._rows[: sq.n], at, out=sq.host)
                self._pos[sq.r0 : sq.r0 + sq.n] = sq.host
        # Work a hook put off, done while the device runs; not on a CPU device, whose threads
        # it slows (lavapipe, qwen3moe-f32: a routing trace's formatting there made a 1.8 ms
        # step 230-270 us longer than leaving it to TraceWriter.BATCH).
        drain = None if self.dev.info.type == "cpu" else pauses.drain
        if self.by_table:
            self._miss[0] = 0
            self._first(drain)
            if self._miss[0]:
                return None
            # (a few ids a layer: a set is faster than np.unique)
            pool.touch([(layer, sorted(set(ids.host().ravel().tolist()))) for layer, (ids, _) in self.by_table_ids.items()])
            self.n_replays += 1
            self._observed(pauses)
            return self._logits.copy()
        held = None
        pauses.begin(self.R)
        predicting = pauses.predicting  # (off: no copies of h, ids and logits to make)
        if predicting:
            kv = self.kv
            frozen: dict = {}  # recurrent layers ahead: their state before this step, read before the device moves it
            if kv is None:  # several sequences: no one cache to show (a predictor that reads none: router)
                ctx = PauseContext(0, self.R, None, None)
            else:
                ctx = PauseContext(start, self.R, lambda l: kv.keys[l], lambda l: kv.values[l],
                                   frozen.__getitem__ if self.cfg.recurrent_layers else None)
        # Experts still pinned for a segment that has finished: released after the next
        # submission, so that the host's work between two segments (the device idle) is only
        # what the next one needs (unless this layer's experts need those slots: _at_pause).
        done = [None]
        try:
            self._first(drain)
            for pp, seg in zip(self.pauses, self.segments[1:]):
                if predicting:  # read now: the next segment adds into h in place
                    hs, hshape, hdtype = pp.h
                    h = hs.buffer.view(hdtype, hshape, hs.offset).copy()
                    ids, logits = pp.ids.host().astype(np.int64), pp.logits.host().copy()
                    frozen.clear()
                    for l in pauses.states_ahead(pp.layer):
                        frozen[l] = _StateCopy(kv.conv[l].copy(), kv.state[l].copy())
                done[0], held = held, None
                held, seg = self._at_pause(pp, pauses, pool, seg, done)
                seg.submit()
                if done[0] is not None:
                    pool.release(*done[0])
                    done[0] = None
                if predicting:  # the host ranks the next layers while the device runs
                    pauses.predict(ctx, pp.layer, ids, logits, h)
                seg.wait()
        finally:
            for pinned in (held, done[0]):
                if pinned is not None:
                    pool.release(*pinned)
        self.n_replays += 1
        self._observed(pauses)
        return self._logits.copy()

    def step(self, token: int, start: int) -> np.ndarray:
        """run() of a one-row recording with no pause points, hook or predictor: logits (a copy)."""
        self._bad[0] = 0
        self._tok[0], self._pos[0] = token, start
        seg = self.segments[0]
        seg.submit()
        seg.wait()
        self.n_replays += 1
        return self._logits.copy()

    def finite(self) -> bool:
        """Whether the logits of the last run are free of NaN and inf (the device checked)."""
        return not self._bad[0]

    def _first(self, drain) -> None:
        """Run the first segment; meanwhile the hook's put-off work, if any."""
        self.segments[0].submit()
        try:
            if drain is not None:
                drain()
        finally:
            self.segments[0].wait()

    def _observed(self, pauses: Pauses) -> None:
        """An observing hook's calls, after the step: every MoE layer's routing, kept by the recording."""
        for layer, ids, logits in self.observed:
            pauses.observe(layer, ids.host().astype(np.int64), logits.host().copy())

    def _at_pause(self, pp: PausePoint, pauses: Pauses, pool: Optional[StreamedExperts], seg, done: list):
        """The host's turn at a pause point: the hook, then the pool. Returns (what to release
        after the next segment, the segment to run next). done[0]: (layer, experts) the last
        segment read, which the caller releases after the next submission; released here first
        (and set to None) where this layer's experts might need their slots."""
        ids = pp.ids.host()  # [R, k] int32, in mapped memory
        if pauses.hook_acts:
            pauses.at_pause(pp.layer, ids.astype(np.int64), pp.logits.host().copy())
        if pp.table is None:
            return None, seg
        layer, table = pp.layer, pp.table.host()
        experts = sorted(set(ids.ravel().tolist()))  # (a decode step's 8 ids: faster than np.unique)
        cap = pool.capacity(layer)
        if done[0] is not None and len(done[0][1]) + len(experts) > cap:
            pool.release(*done[0])
            done[0] = None
        if len(experts) <= cap:
            slots = pool.acquire(layer, experts, [ids[sq.r0 : sq.r0 + sq.n] for sq in self.seqs])
            table[:] = _slot_table(ids, experts, slots)
            return (layer, experts), seg
        # More experts than the pool pins at once: passes over row groups, then the rest.
        weights = pp.weights.host()
        w0 = weights.copy()
        pp.y.host().fill(0)
        k = ids.shape[1]
        for r0, r1 in _row_groups(ids, max(cap, k)):
            group = [int(e) for e in np.unique(ids[r0:r1])]
            weights[:] = 0
            weights[r0:r1] = w0[r0:r1]
            if len(group) <= cap:
                slots = pool.acquire(layer, group)
                try:
                    table[:] = slots[0]
                    table[r0:r1] = _slot_table(ids[r0:r1], group, slots)
                    self._solo(pp, self.be.expert_tensors(layer)).run()
                finally:
                    pool.release(layer, group)
            else:  # fewer slots than one row's top-k: copy them into staging, cap at a time
                stage, tensors = self.be.stage(layer, len(group))
                for g0 in range(0, len(group), cap):
                    part = group[g0 : g0 + cap]
                    slots = pool.acquire(layer, part)
                    try:
                        for j, slot in enumerate(slots):
                            for name, arr in stage.items():
                                arr[g0 + j] = pool.slot_view(layer, slot, name)
                    finally:
                        pool.release(layer, part)
                table[:] = 0
                table[r0:r1] = _slot_table(ids[r0:r1], group, list(range(len(group))))
                self._solo(pp, tensors).run()
        if pp.post is None:
            i = self.pauses.index(pp)
            end = self.pauses[i + 1].at if i + 1 < len(self.pauses) else len(self.collector.ops)
            pp.post = self._sequence(self.collector.ops[pp.span[1] : end])
        return None, pp.post

    def _solo(self, pp: PausePoint, tensors):
        """The layer's expert ops alone, over `tensors`, accumulating into its output."""
        key = tuple(id(t) for t in tensors)
        seq = pp.solo.get(key)
        if seq is None:
            for old in pp.solo.values():  # staging grew: the old tensors are gone
                old.close()
            pp.solo = {}
            seq = self.dev.sequence()
            pp.record_experts(seq, tensors, pp.table, True)
            seq.record()
            pp.solo[key] = seq
        return seq

    def chain(self) -> list:
        """[(sequence, fence, host view of its (token, non-finite) output)] x 2: this one-row,
        one-segment step twice, each ending in the greedy tail (the next token and position
        written for the next replay), each with an output and a fence of its own (built once)."""
        if self._chain is None:
            if self.R != 1 or len(self.segments) != 1 or self.by_table:
                raise ValueError("a greedy chain replays a one-row step with no pause points")
            parts = self._chain = []
            for _ in range(2):
                out = self.fixed((2,), np.int32)
                tail = self.dev.sequence()
                self.be.k.greedy_next(tail, self.logits.s, self.tok, self.pos, out.s, self.cfg.vocab_size)
                parts.append((self._sequence(self.collector.ops[: self.body] + tail.ops), Fence(self.dev), out.host()))
        return self._chain

    def close(self) -> None:
        """Free what it recorded (once; a recording over several storages leaves each one's list)."""
        if self.closed:
            return
        self.closed = True
        if self.kv is None:
            for sq in self.seqs:
                for key in [key for key, r in list(sq.kv.recordings.items()) if r is self]:
                    del sq.kv.recordings[key]
        if self._chain is not None:
            # a chain's queued step may still be running (a generator left suspended, then the
            # storage grown or the model closed): nothing it writes is freed under it
            self.dev.vk.vkDeviceWaitIdle(self.dev.handle)
            for seq, fence, _ in self._chain:
                seq.close()
                fence.destroy()
        self._chain = None
        for s in self.segments:
            s.close()
        for pp in self.pauses:
            for s in pp.solo.values():
                s.close()
            if pp.post is not None:
                pp.post.close()
        self.segments, self.pauses = [], []
        self.logits = None
        self.by_table_ids = {}
        self.collector.close()
        for b in self._bufs:
            b.destroy()
        self._bufs = []


class _StateCopy:
    """A recurrent layer's conv history and state as they were at a pause point (host copies)."""

    def __init__(self, conv: np.ndarray, state: np.ndarray):
        self.conv, self.state = conv, state


def _row_groups(ids: np.ndarray, bound: int) -> list[tuple[int, int]]:
    """Consecutive row ranges, each routing to at most `bound` distinct experts (a single row's
    experts always count as one group, so a row is never split)."""
    groups, start, seen = [], 0, set()
    for r in range(ids.shape[0]):
        row = {int(e) for e in ids[r]}
        if r > start and len(seen | row) > bound:
            groups.append((start, r))
            start, seen = r, set()
        seen |= row
    if ids.shape[0]:
        groups.append((start, ids.shape[0]))
    return groups


def _slot_table(ids: np.ndarray, experts: list[int], slots: list[int]) -> np.ndarray:
    """ids [R, k] of expert ids -> the slot table [R, k] the expert kernel indexes through."""
    lut = np.zeros(max(experts) + 1, np.int32)
    lut[experts] = slots
    return lut[ids]
