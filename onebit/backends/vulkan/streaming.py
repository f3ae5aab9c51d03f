"""Streamed experts on the Vulkan backend: the expert kernels read the pool's slots directly.

The pool's slot arrays (one per size class and expert part, `[n_slots, rows, row_bytes]`) are
mapped Vulkan buffers (`SlotArrays`), so the pool's reader threads write expert bytes straight
into device-visible memory (on unified memory: the memory the GPU reads, no copy). Every
streamed layer is a pause point of the recorded forward (graph.py): there the host acquires
the experts the rows route to and writes the slot table (each row's slot indices, in place
of expert ids) that the recorded expert kernels read; the next segment runs over the slot
buffers; then the experts are released.

Bit-identity with the resident backend: the expert kernels compute each row on its own, with
the same arithmetic in the same order whichever buffer holds the weights. Where the pool
cannot pin even one row's top-k at once (the "layer" policy with very few slots), that row's
experts are copied, a few at a time, into a small staging buffer (`stage`) the kernels read.
"""

from __future__ import annotations

import logging
from typing import Optional

import numpy as np

from ...gguf_file import GGUFFile
from ..streaming import PARTS
from .backend import VulkanBackend
from .device import Buffer, Device, VulkanKernelError, VulkanUnavailableError, default_device
from .kernels import SUPPORTED_TYPES, DeviceTensor, Part, bound_bytes, shader_qk, split_rows

log = logging.getLogger(__name__)


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
    """The pool's expert -> slot table ([layers, experts] int32, ExpertPool.track) in a mapped
    device buffer: routers read it in steps that run with no pause (graph.py)."""

    def __init__(self, dev: Device, pool):
        layers = max(layer for layer, _ in pool.sources) + 1
        self.width = max(src.n_experts for src in pool.sources.values())  # experts per layer
        n = layers * self.width * 4
        self.buffer = dev.buffer(n, host_visible=True)
        if not self.buffer.host_visible:
            self.buffer.destroy()
            raise VulkanUnavailableError(f"{dev.info.name}: no host-visible memory for the expert slot table")
        self.s = self.buffer.slice(0, n)
        pool.track(self.buffer.view(np.int32, (layers, self.width)))

    def destroy(self) -> None:
        self.buffer.destroy()


class StreamingVulkanBackend(VulkanBackend):
    """VulkanBackend whose routed experts live in an ExpertPool allocated with `SlotArrays`."""

    def __init__(self, gguf: GGUFFile, pool, slot_arrays: SlotArrays, device: Optional[Device] = None):
        self.pool = pool
        self.slot_arrays = slot_arrays
        self._streamed_names = {f"blk.{layer}.{part}.weight" for layer, part in pool.sources}
        self.streamed_layers = frozenset(pool.class_of_layer)
        self._layer_tensors: dict[tuple[int, str], tuple[DeviceTensor, ...]] = {}
        self._stage: dict[int, dict[str, np.ndarray]] = {}  # size class -> part -> [n, rows, row_bytes]
        super().__init__(gguf, device or slot_arrays.dev)
        for layer in self.streamed_layers:
            self.expert_tensors(layer)  # a type without a shader: refused here, at load
        self.slot_lut = SlotTable(self.dev, pool)

    @classmethod
    def create(cls, gguf: GGUFFile, classes, slots, policy: str = "global", device: Optional[Device] = None,
               **pool_kw) -> "StreamingVulkanBackend":
        """Open the device, build the pool on mapped device buffers, and the backend over it."""
        from ...memory.pool import ExpertPool

        arrays = SlotArrays(device or default_device())
        try:
            pool = ExpertPool(gguf, classes, slots, policy=policy, allocate=arrays, **pool_kw)
        except BaseException:
            arrays.destroy()
            raise
        try:
            return cls(gguf, pool, arrays)
        except BaseException:
            pool.close()
            arrays.destroy()
            raise

    def _streamed(self, name: str) -> bool:
        return name in self._streamed_names

    def expert_tensors(self, layer: int) -> tuple[DeviceTensor, ...]:
        """gate, up, down of a streamed layer over the pool's slot buffers, indexed by slot."""
        if layer not in self.streamed_layers:
            return super().expert_tensors(layer)
        return self._tensors_over(layer, self.pool.buffers[self.pool.class_of_layer[layer]], "slots")

    def stage(self, layer: int, n: int) -> tuple[dict[str, np.ndarray], tuple[DeviceTensor, ...]]:
        """Staging arrays for n of `layer`'s experts (part -> [n, rows, row_bytes]) and tensors over them."""
        ci = self.pool.class_of_layer[layer]
        st = self._stage.get(ci)
        if st is None or st[PARTS[0]].shape[0] < n:
            st = self._stage[ci] = {p: self.slot_arrays((n, *self.pool.buffers[ci][p].shape[1:])) for p in PARTS}
            self._layer_tensors = {key: v for key, v in self._layer_tensors.items() if key[1] != "stage"}
        return st, self._tensors_over(layer, st, "stage")

    # -- device views of slot arrays ------------------------------------------------------------

    def _tensors_over(self, layer: int, arrays: dict[str, np.ndarray], key: str) -> tuple[DeviceTensor, ...]:
        """gate/up/down DeviceTensors over `arrays` ([n, rows, row_bytes] mapped buffers) typed as
        layer's expert tensors."""
        cached = self._layer_tensors.get((layer, key))
        if cached is not None:
            return cached
        info = self.dev.info
        align = max(16, info.min_storage_buffer_offset_alignment)
        limit = info.max_storage_buffer_range - info.max_storage_buffer_range % align - align  # bound_bytes's spare
        out = []
        for p in PARTS:
            t = self.gguf.tensor(f"blk.{layer}.{p}.weight")
            if t.type_name not in SUPPORTED_TYPES or t.shape[-1] % shader_qk(t.type_name):
                raise VulkanUnavailableError(f"{self.gguf.path}: streamed expert tensor {t.name} is "
                                             f"{t.type_name} with rows of {t.shape[-1]}, which has no Vulkan shader")
            arr = arrays[p]
            buf = self.slot_arrays.buffer_of(arr)
            n, per = arr.shape[0], arr[0].nbytes
            parts = []
            for start, count in split_rows(n, per, limit, t.name):
                off = start * per
                if off % align:
                    raise VulkanKernelError(f"{t.name}: expert slots of {per} bytes cannot be split at "
                                            f"{align}-byte aligned offsets")
                parts.append(Part(buf.slice(off, bound_bytes(count * per)), start, count))
            out.append(DeviceTensor(t.name, t.type_name, (n, *t.shape[1:]), tuple(parts)))
        res = self._layer_tensors[(layer, key)] = tuple(out)
        return res

    def close(self) -> None:
        self.pool.close()  # reader threads stop before the memory they write goes away
        self.pool.table = None
        super().close()
        self.slot_arrays.destroy()
        if getattr(self, "slot_lut", None) is not None:
            self.slot_lut.destroy()
            self.slot_lut = None
        self._stage = {}
        self._layer_tensors = {}
