"""`GreedyChain`: greedy decoding with the device a step ahead of the host, replaying a one-row
recording whose tail writes the next step's token and position on the device."""

from __future__ import annotations

from typing import Optional

from .kv import DeviceCache
from .recording import NO_PAUSE_LAYERS, Recording


class GreedyChain:
    """Greedy decoding with the device a step ahead of the host. Each step ends in the greedy
    tail (argmax -> the next step's token, position + 1, on the device), so the step after it
    is queued before the host reads this one's token: the host's work per token (the read, the
    checks, the caller's detokenizing) overlaps the device's next step. Two copies of the one-row
    recording alternate (a command buffer is resubmitted only once its fence is waited on).
    `cache.offset` counts the queued steps; `close()` waits for them (the caller then trims what
    it does not keep)."""

    def __init__(self, runner: "GraphRunner", model, cache: DeviceCache, limit: Optional[int] = None):
        self.runner, self.model, self.cache = runner, model, cache
        self.limit = limit  # no step at this position or later (the context's end)
        self.rings = [cache[i] for i in cache.storage.rings]
        self.rec: Optional[Recording] = None
        self.parts: list = []
        self.queued: list[int] = []  # indices into parts, oldest first
        self._next = 0

    def _room(self) -> bool:
        kv, at = self.cache.storage, self.cache.offset
        return at < kv.capacity and (self.limit is None or at < self.limit)

    def _queue(self) -> None:
        for c in self.rings:
            c.advance(self.cache.offset, 1)
        seq, fence, _ = self.parts[self._next]
        seq.submit(fence)
        self.cache.offset += 1
        self.queued.append(self._next)
        self._next ^= 1

    def step(self, tok: int) -> Optional[tuple[int, bool]]:
        """(the token after `tok`, whether that step's logits were all finite), or None where
        no step can start here (the context's end). `tok`: the first token, then always the
        token the last call returned. A step whose logits were not finite is the last: the
        steps queued behind it are undone."""
        kv = self.cache.storage
        if not self.queued:
            if self.limit is not None and self.cache.offset >= self.limit:
                return None
            if self.cache.offset >= kv.capacity:
                kv.grow(self.cache.offset + 1)  # (drops the recordings: ours too)
            if self.rec is None or self.rec.logits is None:
                self.rec = self.runner._recording(self.model, kv, 1, False, NO_PAUSE_LAYERS)
                self.parts, self._next = self.rec.chain(), 0
            self.rec._tok[0], self.rec._pos[0] = tok, self.cache.offset
            self._queue()
        if len(self.queued) < 2 and self._room():
            self._queue()  # (behind the step read below: its token is the tail's to write)
        i = self.queued.pop(0)
        seq, fence, out = self.parts[i]
        seq.wait(fence)
        self.rec.n_replays += 1
        nxt, finite = int(out[0]), not out[1]
        if not finite:
            behind = len(self.queued)
            self.close()
            self.cache.trim(behind)
        return nxt, finite

    def close(self) -> None:
        """Wait for every queued step (they stay in the cache)."""
        if self.rec is not None and self.rec._chain is not self.parts:
            self.queued = []  # the recording was closed under us, after waiting for the device
        while self.queued:
            seq, fence, _ = self.parts[self.queued.pop(0)]
            seq.wait(fence)
