"""Streamed experts on the Vulkan backend: the pool's slots in device memory, read directly by
the expert kernels.

The pool's slot arrays (one per size class and expert part, `[n_slots, rows, row_bytes]`) are
mapped Vulkan buffers (`SlotArrays`), so the pool's reader threads write expert bytes straight
into device-visible memory (on unified memory: the memory the GPU reads, no copy). Every
streamed layer is a pause point of the recorded forward (recording.py): there the host acquires
the experts the rows route to and writes the slot table (each row's slot indices, in place
of expert ids) that the recorded expert kernels read; the next segment runs over the slot
buffers; then the experts are released.

Bit-identity with the resident backend: the expert kernels compute each row on its own, with
the same arithmetic in the same order whichever buffer holds the weights. Where the pool
cannot pin even one row's top-k at once (the "layer" policy with very few slots), that row's
experts are copied, a few at a time, into a small staging buffer (`stage`) the kernels read.
"""

from __future__ import annotations

import numpy as np

from ...formats.gguf_file import EXPERT_PARTS
from ..experts import StreamedExperts
from .device import Buffer, Device, VulkanUnavailableError
from .kernels import bound_bytes


class SlotArrays:
    """`allocate(shape)` for ExpertPool: uint8 arrays that are mapped, host-visible Vulkan buffers."""

    def __init__(self, dev: Device):
        self.dev = dev
        self._bufs: list[tuple[np.ndarray, Buffer]] = []

    def __call__(self, shape) -> np.ndarray:
        shape = tuple(int(s) for s in shape)
        n = int(np.prod(shape, dtype=np.int64))
        buf = self.dev.buffer(bound_bytes(n), host_visible=True)  # room for kernels.bound_bytes's rounding
        if not buf.host_visible:
            buf.destroy()
            raise VulkanUnavailableError(f"{self.dev.info.name}: no host-visible memory for expert slots")
        arr = buf.view(np.uint8, shape)
        self._bufs.append((arr, buf))
        return arr

    def buffer_of(self, arr: np.ndarray) -> Buffer:
        for a, b in self._bufs:
            if a is arr:
                return b
        raise KeyError("array was not allocated here")

    @property
    def nbytes(self) -> int:
        return sum(b.size for _, b in self._bufs)

    def destroy(self) -> None:
        for _, b in self._bufs:
            b.destroy()
        self._bufs = []


class SlotTable:
    """The pool's expert -> slot table ([layers, experts] int32, StreamedExperts.track) in a
    mapped device buffer: routers read it in steps that run with no pause (recording.py)."""

    def __init__(self, dev: Device, pool: StreamedExperts, gguf):
        layers = max(pool.streamed_layers) + 1
        self.width = max(gguf.tensor(f"blk.{layer}.{EXPERT_PARTS[0]}.weight").shape[0]
                         for layer in pool.streamed_layers)  # experts per layer
        n = layers * self.width * 4
        self.buffer = dev.buffer(n, host_visible=True)
        if not self.buffer.host_visible:
            self.buffer.destroy()
            raise VulkanUnavailableError(f"{dev.info.name}: no host-visible memory for the expert slot table")
        self.s = self.buffer.slice(0, n)
        pool.track(self.buffer.view(np.int32, (layers, self.width)))

    def destroy(self) -> None:
        self.buffer.destroy()
