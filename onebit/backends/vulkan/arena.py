"""Values of a recorded schedule: device buffers with shapes (`Val`), taken from an `Arena` and
given back when the schedule drops them (CPython frees a value as soon as nothing refers to it,
so buffers are reused in recording order, and the sequence's barriers order every reuse)."""

from __future__ import annotations

from collections import defaultdict, deque
from typing import Optional

import numpy as np

from .device import Buffer, Slice


class Arena:
    """Scratch buffers by size, shared by every recording of a backend (only one runs at a time).

    A buffer given back is taken again only after MIN_AGE more ops were recorded: reusing it
    at once would make the next op wait (a barrier) for the ops still reading it."""

    MIN_AGE = 8

    def __init__(self, dev):
        self.dev = dev
        self._free: dict[int, deque[tuple[Slice, int]]] = defaultdict(deque)
        self._buffers: list[Buffer] = []
        self._kept: dict = {}  # see kept()
        self.clock = lambda: 0  # ops recorded so far (set by the recording being made)

    def take(self, nbytes: int) -> Slice:
        size = 1 << max(8, (nbytes - 1).bit_length())  # powers of two: other row counts reuse them
        now = self.clock()
        for cls in (size, 2 * size, 4 * size):
            free = self._free.get(cls)
            if free:
                freed = free[0][1]
                if now - freed >= self.MIN_AGE or freed > now:  # freed > now: by an earlier recording
                    return free.popleft()[0]
        buf = self.dev.buffer(size)
        self._buffers.append(buf)
        return buf.slice(0, size)

    def kept(self, key, nbytes: int) -> Slice:
        """A zeroed buffer of nbytes by `key`, made once, that recordings bind for good (the same
        one for every recording that asks: only one runs at a time)."""
        s = self._kept.get(key)
        if s is None:
            buf = self.dev.buffer(nbytes)
            buf.write(np.zeros(nbytes, np.uint8))
            self._buffers.append(buf)
            s = self._kept[key] = buf.slice(0, nbytes)
        return s

    def give(self, s: Slice) -> None:
        self._free[s.size].append((s, self.clock()))

    @property
    def nbytes(self) -> int:
        return sum(b.size for b in self._buffers)

    def close(self) -> None:
        for b in self._buffers:
            b.destroy()
        self._buffers, self._free, self._kept = [], defaultdict(deque), {}


class Val:
    """A value of the recorded schedule: `shape` (rows first) in the bytes of slice `s`."""

    __slots__ = ("s", "shape", "dtype", "_arena", "_base", "redo", "_host")

    def __init__(self, s: Slice, shape: tuple[int, ...], dtype=np.float32, arena: Optional[Arena] = None,
                 base: Optional["Val"] = None):
        self.s, self.shape, self.dtype, self._arena, self._base = s, tuple(shape), dtype, arena, base
        # (first op, after last op, record(out, accumulate)): how the last ops made this value,
        # so `residual` can have them add into the residual stream instead (a router's ids:
        # record(lut), so `pause` can have it write the slot table too)
        self.redo = None
        self._host = None

    @property
    def rows(self) -> int:
        return self.shape[0]

    @property
    def width(self) -> int:
        return int(np.prod(self.shape[1:], dtype=np.int64))

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    def host(self) -> np.ndarray:
        """The value in mapped memory (made once: pause points read theirs every step)."""
        if self._host is None:
            self._host = self.s.buffer.view(self.dtype, self.shape, self.s.offset)
        return self._host

    def __del__(self):
        if self._arena is not None:
            self._arena.give(self.s)
