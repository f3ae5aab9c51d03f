"""The cpu backend: the numpy backend's schedule, with its weight products in numba kernels.

Mat-vec / mat-mat (`linear`), get_rows (`embed`) and the routed experts run in
`cpu_kernels`, reading the quantized blocks where they lie (file map or pool slot); the
small ops (norms, rope, attention, routing) are the numpy twins'. A tensor whose type the
kernels do not decode takes the numpy reference path (said once, on stderr).
"""

from __future__ import annotations

import logging
import sys

import numpy as np

from ..gguf_file import EXPERT_PARTS
from .numpy_backend import NumpyBackend

log = logging.getLogger("onebit")


def _readonly(a: np.ndarray) -> np.ndarray:
    """A C-contiguous read-only view: the kernels are compiled for one array type, not two."""
    a = np.ascontiguousarray(a)
    if a.flags.writeable:
        a = a.view()
        a.flags.writeable = False
    return a


def _f32(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x, dtype=np.float32)


def threads() -> int:
    import numba

    return numba.get_num_threads()


class CpuBackend(NumpyBackend):
    name = "cpu"

    def __init__(self, gguf):
        super().__init__(gguf)
        from . import cpu_kernels as K

        self.K = K
        self.threads = threads()
        seconds, compiled = K.warm_up()
        if compiled:  # the first run on this machine; later runs load the kernels from numba's disk cache
            sys.stderr.write(f"onebit: compiled the cpu kernels in {seconds:.1f} s (once: they are cached on disk)\n")
        slow = sorted({t.type_name for t in gguf.tensors.values() if t.qtype not in K.SUPPORTED and len(t.shape) > 1})
        if slow:
            msg = f"{', '.join(slow)} tensors have no cpu kernel yet: they run on the numpy reference path"
            sys.stderr.write(f"onebit: note: {msg}\n")
            log.info(msg)
        self._raw: dict[str, tuple] = {}

    def describe(self) -> str:
        return f"{self.threads} threads"

    def _kernel_raw(self, name: str):
        """The tensor and its raw bytes as the kernels take them, or None for the numpy path."""
        t = self.gguf.tensor(name)
        if t.qtype not in self.K.SUPPORTED:
            return t, None
        hit = self._raw.get(name)
        if hit is None or hit[0] is not t.raw:  # a memory plan may swap the map for a copy
            hit = self._raw[name] = (t.raw, _readonly(t.raw))
        return t, hit[1]

    def embed(self, name: str, ids: np.ndarray) -> np.ndarray:
        t, raw = self._kernel_raw(name)
        if raw is None:
            return super().embed(name, ids)
        out = np.empty((len(ids), t.shape[-1]), np.float32)  # [R, dim]
        self.K.get_rows(out, raw, np.asarray(ids, dtype=np.int64), t.qtype, self.K.LUT, self.K.M)
        return out

    def linear(self, x: np.ndarray, name: str) -> np.ndarray:
        t, raw = self._kernel_raw(name)
        if raw is None or raw.ndim != 2:
            return super().linear(x, name)
        out = np.empty((x.shape[0], t.shape[0]), np.float32)  # [R, out]
        small = x.shape[0] * raw.shape[0] * t.shape[-1] < self.K.SERIAL_WORK
        (self.K.matmul_serial if small else self.K.matmul)(out, _f32(x), raw, t.qtype)
        return out

    # -- mixture of experts -------------------------------------------------------------

    @staticmethod
    def routed_rows(ids: np.ndarray, weights: np.ndarray):
        """The experts chosen (ascending) and, per expert, the rows it serves and their weights:
        experts [n], offs [n+1], rows [R*k], rw [R*k] (expert j serves rows[offs[j]:offs[j+1]])."""
        flat = ids.reshape(-1)
        order = np.argsort(flat, kind="stable")
        experts, counts = np.unique(flat[order], return_counts=True)
        offs = np.zeros(len(experts) + 1, np.int64)
        np.cumsum(counts, out=offs[1:])
        rows = (order // ids.shape[1]).astype(np.int64)
        rw = np.ascontiguousarray(weights.reshape(-1)[order], dtype=np.float32)
        return experts.astype(np.int64), offs, rows, rw

    def _expert_parts(self, layer: int):
        parts = [self.gguf.tensor(f"blk.{layer}.{p}.weight") for p in EXPERT_PARTS]
        return parts, all(t.qtype in self.K.SUPPORTED for t in parts)

    def expert_call(self, out, x, parts, raws, sel, offs, rows, rw) -> None:
        """out[rows] += rw * expert FFN, for experts raws[*][sel[j]] (in order j)."""
        g, u, d = parts
        self.K.expert_ffn(out, x, raws[0], raws[1], raws[2], sel, offs, rows, rw,
                          g.qtype, u.qtype, d.qtype)

    def experts(self, x: np.ndarray, layer: int, ids: np.ndarray, weights: np.ndarray) -> np.ndarray:
        parts, fast = self._expert_parts(layer)
        if not fast:
            return super().experts(x, layer, ids, weights)
        x = _f32(x)
        out = np.zeros_like(x)
        experts, offs, rows, rw = self.routed_rows(ids, weights)
        raws = [self._kernel_raw(t.name)[1] for t in parts]
        self.expert_call(out, x, parts, raws, experts, offs, rows, rw)
        return out


class StreamingCpuBackend(CpuBackend):
    """Routed experts from a slot pool: the same kernel, reading slots instead of the file map,
    over the same experts in the same order, so the output is bit-identical to resident."""

    def __init__(self, gguf, pool):
        super().__init__(gguf)
        self.pool = pool

    def experts(self, x: np.ndarray, layer: int, ids: np.ndarray, weights: np.ndarray) -> np.ndarray:
        parts, fast = self._expert_parts(layer)
        x = _f32(x)
        out = np.zeros_like(x)
        experts, offs, rows, rw = self.routed_rows(ids, weights)
        cap = self.pool.capacity(layer)
        ci = self.pool.class_of_layer[layer]
        bufs = [_readonly(self.pool.buffers[ci][p]) for p in EXPERT_PARTS]  # [slots, rows, row_bytes]
        for start in range(0, len(experts), cap):  # a prefill may route to more experts than fit
            group = [int(e) for e in experts[start : start + cap]]
            slots = self.pool.acquire(layer, group)
            try:
                if fast:
                    o = offs[start : start + len(group) + 1]
                    self.expert_call(out, x, parts, bufs, np.asarray(slots, np.int64), o - o[0],
                                     rows[o[0] : o[-1]], rw[o[0] : o[-1]])
                else:
                    for e, slot in zip(group, slots):
                        raws = [self.pool.slot_view(layer, slot, p) for p in EXPERT_PARTS]
                        self.expert_ffn(out, x, ids, weights, e, parts, raws)
            finally:
                self.pool.release(layer, group)
        return out
