"""Streamed experts on the Vulkan backend: the expert kernels read the pool's slots directly.

The pool's slot arrays (one per size class and expert part, `[n_slots, rows, row_bytes]`) are
mapped Vulkan buffers (`SlotArrays`), so the pool's reader threads write expert bytes straight
into device-visible memory (on unified memory: the memory the GPU reads, no copy). A MoE
layer's experts() acquires the experts its rows route to, writes the slot table (each row's
slot indices, in place of expert ids) into the ids buffer, and runs the resident backend's
expert sequence over the slot buffers; then releases.

Bit-identity with the resident backend: the expert kernels compute each row on its own, with
the same arithmetic in the same order whichever buffer holds the weights; so rows are split
into groups whose experts fit the pool at once (a prefill may route to more experts than
there are slots) and each group runs the same kernels. Where the pool cannot pin even one
row's top-k at once (the "layer" policy with very few slots), that row's experts are copied,
a few at a time, into a small staging buffer of k experts and the kernels read that.
"""

from __future__ import annotations

import logging
from typing import Optional

import numpy as np

from ...gguf_file import GGUFFile
from ..streaming import PARTS, StreamingNumpyBackend
from .backend import VulkanBackend
from .device import Buffer, Device, VulkanKernelError, VulkanUnavailableError, default_device
from .kernels import SUPPORTED_TYPES, DeviceTensor, Part, shader_qk, split_rows

log = logging.getLogger(__name__)


class SlotArrays:
    """`allocate(shape)` for ExpertPool: uint8 arrays that are mapped, host-visible Vulkan buffers."""

    def __init__(self, dev: Device):
        self.dev = dev
        self._bufs: list[tuple[np.ndarray, Buffer]] = []

    def __call__(self, shape) -> np.ndarray:
        shape = tuple(int(s) for s in shape)
        n = int(np.prod(shape, dtype=np.int64))
        buf = self.dev.buffer(n, host_visible=True)
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


class StreamingVulkanBackend(VulkanBackend):
    """VulkanBackend whose routed experts live in an ExpertPool allocated with `SlotArrays`."""

    def __init__(self, gguf: GGUFFile, pool, slot_arrays: SlotArrays, device: Optional[Device] = None):
        self.pool = pool
        self.slot_arrays = slot_arrays
        self._streamed_names = {f"blk.{layer}.{part}.weight" for layer, part in pool.sources}
        super().__init__(gguf, device or slot_arrays.dev)
        self._np_stream = StreamingNumpyBackend(gguf, pool)
        self._layer_tensors: dict[tuple[int, str], Optional[tuple[DeviceTensor, ...]]] = {}
        self._stage: dict[int, dict[str, np.ndarray]] = {}  # size class -> part -> [k, rows, row_bytes]

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

    # -- device views of slot arrays ------------------------------------------------------------

    def _tensors_over(self, layer: int, arrays: dict[str, np.ndarray], key: str) -> Optional[tuple[DeviceTensor, ...]]:
        """gate/up/down DeviceTensors over `arrays` ([n, rows, row_bytes] mapped buffers) typed as
        layer's expert tensors; None where the resident backend would not have them either."""
        cached = self._layer_tensors.get((layer, key), False)
        if cached is not False:
            return cached
        info = self.dev.info
        align = max(16, info.min_storage_buffer_offset_alignment)
        limit = info.max_storage_buffer_range - info.max_storage_buffer_range % align
        out = []
        for p in PARTS:
            t = self.gguf.tensor(f"blk.{layer}.{p}.weight")
            if t.type_name not in SUPPORTED_TYPES or t.shape[-1] % shader_qk(t.type_name):
                self._fallback(f"blk.{layer}.{p}.weight", f"{t.type_name} rows of {t.shape[-1]}")
                out = None
                break
            arr = arrays[p]
            buf = self.slot_arrays.buffer_of(arr)
            n, per = arr.shape[0], arr[0].nbytes
            parts = []
            for start, count in split_rows(n, per, limit, t.name):
                off = start * per
                if off % align:
                    raise VulkanKernelError(f"{t.name}: expert slots of {per} bytes cannot be split at "
                                            f"{align}-byte aligned offsets")
                parts.append(Part(buf.slice(off, max(count * per, 16)), start, count))
            out.append(DeviceTensor(t.name, t.type_name, (n, *t.shape[1:]), tuple(parts)))
        res = tuple(out) if out is not None else None
        self._layer_tensors[(layer, key)] = res
        return res

    def _staging(self, layer: int, k: int) -> dict[str, np.ndarray]:
        ci = self.pool.class_of_layer[layer]
        st = self._stage.get(ci)
        if st is None or st[PARTS[0]].shape[0] < k:
            st = self._stage[ci] = {p: self.slot_arrays((k, *self.pool.buffers[ci][p].shape[1:])) for p in PARTS}
            self._layer_tensors = {key: v for key, v in self._layer_tensors.items() if key[1] != "stage"}
        return st

    # -- experts --------------------------------------------------------------------------------

    def experts(self, x: np.ndarray, prefix: str, ids: np.ndarray, weights: np.ndarray) -> np.ndarray:
        layer = int(prefix.split(".")[1])
        if layer not in self.pool.class_of_layer:
            return super().experts(x, prefix, ids, weights)
        slot_ts = self._tensors_over(layer, self.pool.buffers[self.pool.class_of_layer[layer]], "slots")
        if slot_ts is None:
            return self._np_stream.experts(x, prefix, ids, weights)
        R, dim = x.shape
        k = ids.shape[1]
        cap = self.pool.capacity(layer)
        out = np.empty((R, dim), np.float32)
        for r0, r1 in _row_groups(ids, max(cap, k)):
            rows_ids = ids[r0:r1]
            experts = [int(e) for e in np.unique(rows_ids)]
            if len(experts) <= cap:
                slots = self.pool.acquire(layer, experts)
                try:
                    table = _slot_table(rows_ids, experts, slots)
                    out[r0:r1] = self._expert_ffn(*slot_ts, x[r0:r1], table, weights[r0:r1])
                finally:
                    self.pool.release(layer, experts)
            else:  # fewer slots than one row's top-k: stage the experts, cap at a time
                stage = self._staging(layer, len(experts))
                for g0 in range(0, len(experts), cap):
                    group = experts[g0 : g0 + cap]
                    slots = self.pool.acquire(layer, group)
                    try:
                        for j, slot in enumerate(slots):
                            for p in PARTS:
                                stage[p][g0 + j] = self.pool.slot_view(layer, slot, p)
                    finally:
                        self.pool.release(layer, group)
                stage_ts = self._tensors_over(layer, stage, "stage")
                table = _slot_table(rows_ids, experts, list(range(len(experts))))
                out[r0:r1] = self._expert_ffn(*stage_ts, x[r0:r1], table, weights[r0:r1])
        return out

    def close(self) -> None:
        self.pool.close()  # reader threads stop before the memory they write goes away
        super().close()
        self.slot_arrays.destroy()
        self._stage = {}
        self._layer_tensors = {}


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
    lut = dict(zip(experts, slots))
    return np.vectorize(lambda e: lut[int(e)], otypes=[np.int32])(ids).reshape(ids.shape)
