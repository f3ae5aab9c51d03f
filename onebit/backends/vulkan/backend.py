"""`VulkanBackend`: a model's schedule recorded into command buffers (recording.py) and replayed.

Weights are uploaded once, at load, in their quantized layout (one memcpy per tensor from the
GGUF memory map on unified memory). A weight whose type has no shader (or whose rows are not
whole shader blocks) is dequantized once at load and uploaded as F32, and the log says so;
a model the kernels cannot run at all (e.g. a row length that is not a multiple of 4) is
refused at load with `VulkanUnavailableError`, which `onebit.load` turns into its one
fallback rule (the next backend, said in one line).

Every forward (decode, verify rows, prefill chunks) replays a recording specialised on its
row count; the KV cache lives in device memory (kv.DeviceKV). The routed experts come from
the backend's expert source: uploaded from the file, or a pool's slots in device memory
(slots.py), acquired at the recording's pause points, where the pause clients are served too
(onebit/pause.py).
"""

from __future__ import annotations

import logging
from typing import Optional

import numpy as np

from ...cache import SWA_ROWS
from ...formats.gguf_file import EXPERT_PARTS, GGUFFile
from ...pause import NO_PAUSES, Pauses
from ..base import Backend
from ..experts import FileExperts, StreamedExperts
from ..numpy_backend import dequantize
from .device import (Buffer, Device, Slice, VulkanKernelError, VulkanUnavailableError, choose_device, default_device,
                     list_devices)
from .kernels import SUPPORTED_TYPES, DeviceTensor, Kernels, Part, WeightStore, bound_bytes, shader_qk, split_rows
from .slots import SlotArrays, SlotTable

log = logging.getLogger(__name__)


class VulkanBackend(Backend):
    name = "vulkan"
    runs_on_host = False
    reads_map = False  # the model file is read at load, to record a new shape (gguf.reads counts those) and by a pool
    batches_sequences = True  # (recordings over several sequences' rows: runner.GraphRunner.forward_batch)

    @property
    def overlaps_host(self) -> bool:
        """The host's work overlaps the device's compute, except on a CPU device (lavapipe), whose
        compute runs on the same cores."""
        return self.dev.info.type != "cpu"

    @property
    def host_reads_slots(self) -> bool:
        """Slots are device memory the host maps: read by the host only where that memory is the
        host's own (unified: an APU, a CPU device; on a discrete GPU such reads are uncached, far
        slower than a prediction is worth)."""
        return self.dev.info.unified

    @classmethod
    def find_device(cls, selector) -> None:
        if selector is not None:
            choose_device(list_devices(), selector)  # (VulkanUnavailableError: no such device, or unusable)

    @classmethod
    def open_device(cls, selector) -> Device:
        return default_device(selector)  # (a device that cannot open: VulkanUnavailableError)

    @classmethod
    def device_limits(cls, selector) -> dict:
        """The device's memory: its largest device-local heap (the heap budget where the driver
        reports no live budget), largest allocation and largest storage-buffer binding."""
        d = choose_device(list_devices(), selector)
        heaps = [h.size for h in d.heaps if h.device_local] or [h.size for h in d.heaps]
        return {"device_heap": max(heaps), "max_allocation": d.max_memory_allocation_size,
                "max_storage_range": d.max_storage_buffer_range}

    @classmethod
    def slot_allocator(cls, device: Device) -> SlotArrays:
        return SlotArrays(device)  # slots in mapped device buffers the expert kernels read

    @classmethod
    def open(cls, gguf, experts=None, device=None, slot_arrays=None, policy=None, threads=None) -> "VulkanBackend":
        return cls(gguf, experts, device, slot_arrays)

    def __init__(self, gguf: GGUFFile, experts=None, device: Optional[Device] = None,
                 slot_arrays: Optional[SlotArrays] = None):
        """`experts`: the expert source (backends/experts.py); an ExpertPool whose slots are
        `slot_arrays` (mapped device buffers, slots.py) streams its layers' experts; None:
        every expert is uploaded from the file."""
        from .arena import Arena
        from .runner import GraphRunner

        self.gguf = gguf
        self.dev = device or (slot_arrays.dev if slot_arrays is not None else default_device())
        self.source = experts if experts is not None else FileExperts(gguf)
        self.streamed_layers = frozenset(self.source.streamed_layers)
        self.pool: Optional[StreamedExperts] = experts if self.streamed_layers else None
        self.slot_arrays = slot_arrays
        if self.pool is not None and slot_arrays is None:
            raise ValueError("a streamed Vulkan backend needs the pool's slots in device memory (SlotArrays)")
        self._streamed_names = {f"blk.{layer}.{part}.weight" for layer in self.streamed_layers for part in EXPERT_PARTS}
        self._layer_tensors: dict[tuple[int, str], tuple[DeviceTensor, ...]] = {}
        self._stage: dict[int, dict[str, np.ndarray]] = {}  # size class -> part -> [n, rows, row_bytes]
        self.k = Kernels(self.dev)
        self._weights: dict[str, np.ndarray] = {}  # small host copies (norm weights, biases)
        store = WeightStore(self.dev)
        names = []
        for name, t in gguf.tensors.items():
            if len(t.shape) < 2 or name.endswith(".bias") or name in self._streamed_names:
                continue  # (1-D tensors and biases, gpt-oss's [E, F] expert biases too: GraphConsts)
            raw, type_name = t.raw, t.type_name
            if type_name not in SUPPORTED_TYPES or t.shape[-1] % shader_qk(type_name):
                if t.shape[-1] % shader_qk("F32"):
                    continue  # attach_model names what is missing
                log.warning("vulkan: %s (%s rows of %d) has no shader: uploaded as F32", name, type_name, t.shape[-1])
                raw, type_name = dequantize(t).view(np.uint8), "F32"
            store.add(name, raw, type_name, t.shape)
            names.append(name)
        self.weight_bytes = store.planned_bytes
        # (each tensor's map pages dropped once it is in its buffer: read through the map, they
        # counted in resident memory beside the copy, a 30B-A3B's 0.96 GiB twice)
        self.tensors: dict[str, DeviceTensor] = dict(zip(names, store.commit(
            uploaded=lambda name: gguf.release(gguf.tensor(name)))))
        self._store = store
        self.consts = GraphConsts(self)
        self.arena = Arena(self.dev)
        self.runner = GraphRunner(self)
        self.recordings = 0  # every recording made (tests check replays do not re-record)
        self.closed = False
        self.slot_lut = None
        if self.pool is not None:
            for layer in self.streamed_layers:
                self.expert_tensors(layer)  # a type without a shader: refused here, at load
            self.slot_lut = SlotTable(self.dev, self.pool, gguf)
        log.info("vulkan: %d tensors, %.1f MiB of weights on %s", len(names), self.weight_bytes / 2**20,
                 self.dev.info.name)

    def streamed(self, layer: int) -> bool:
        return layer in self.streamed_layers

    def describe(self) -> str:
        return f"{self.dev.info.name}, {self.dev.info.type}"

    def expert_tensors(self, layer: int) -> tuple[DeviceTensor, ...]:
        """gate, up, down of `layer`'s routed experts: indexed by expert id, or for a streamed
        layer over the pool's slot buffers, indexed by slot."""
        if layer not in self.streamed_layers:
            return tuple(self.tensors[f"blk.{layer}.{p}.weight"] for p in EXPERT_PARTS)
        return self._tensors_over(layer, self.pool.buffers[self.pool.class_of_layer[layer]], "slots")

    def stage(self, layer: int, n: int) -> tuple[dict[str, np.ndarray], tuple[DeviceTensor, ...]]:
        """Staging arrays for n of `layer`'s experts (part -> [n, rows, row_bytes]) and tensors over them."""
        ci = self.pool.class_of_layer[layer]
        st = self._stage.get(ci)
        if st is None or st[EXPERT_PARTS[0]].shape[0] < n:
            st = self._stage[ci] = {p: self.slot_arrays((n, *self.pool.buffers[ci][p].shape[1:])) for p in EXPERT_PARTS}
            self._layer_tensors = {key: v for key, v in self._layer_tensors.items() if key[1] != "stage"}
        return st, self._tensors_over(layer, st, "stage")

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
        for p in EXPERT_PARTS:
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

    # -- the model ------------------------------------------------------------------------

    def attach_model(self, model, kv_capacity: int = 0) -> None:
        """Record one decode step of architecture `model` now, so a model the kernels cannot run
        is refused at load (into a KV storage of the capacity its caches will have, `kv_capacity`,
        so the step is reused)."""
        cfg = model.cfg
        widths = (cfg.dim, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, cfg.n_heads * cfg.head_dim_v,
                  cfg.n_kv_heads * cfg.head_dim_v, cfg.hidden_dim, cfg.expert_hidden_dim, cfg.shared_expert_hidden_dim)
        if any(w % 4 for w in widths):
            raise VulkanUnavailableError(f"{self.gguf.path}: a row length of {cfg.arch} is not a multiple of 4, "
                                         "which the Vulkan kernels need")
        cache = self.make_cache(cfg, kv_capacity)
        try:
            self.runner._recording(model, cache.storage, 1, True, self.streamed_layers)
            if self.pool is not None and self.streamed_layers and not cfg.recurrent_layers:
                self.runner._recording(model, cache.storage, 1, True, frozenset(), by_table=True)  # (recording.py)
        except VulkanKernelError as e:
            raise VulkanUnavailableError(f"{self.gguf.path}: the Vulkan kernels cannot run this model ({e})") from e
        finally:
            del cache

    def make_cache(self, cfg, capacity: int = 0, swa_rows: int = SWA_ROWS):
        """A sequence whose KV cache is in device memory (sliding-window layers: rings sized for
        forwards of `swa_rows` rows, 0: none)."""
        return self.runner.make_cache(cfg, capacity, swa_rows)

    def forward(self, model, ids: np.ndarray, cache, pauses: Pauses = NO_PAUSES,
                last_only: bool = False) -> tuple[np.ndarray, bool]:
        return self.runner.forward(model, ids, cache, pauses, last_only)

    def forward_batch(self, model, seqs, pauses: Pauses = NO_PAUSES,
                      last_only: tuple = ()) -> tuple[list[np.ndarray], bool]:
        """`forward` over the rows of several sequences at once (see NumpyBackend.forward_batch):
        one recorded forward whose linear and expert ops run over every row (a streamed expert
        acquired once for all of them at its pause), attention and recurrent state per sequence
        over its own device cache."""
        return self.runner.forward_batch(model, seqs, pauses, last_only)

    def greedy_chain(self, model, cache, limit=None):
        """Greedy decoding a step ahead on the device (chain.GreedyChain), where a step needs
        nothing of the host but its token; else None. The model asks only without a predictor."""
        return self.runner.greedy_chain(model, cache, limit)

    # -- weights ------------------------------------------------------------------------

    def has(self, name: str) -> bool:
        return name in self.gguf.tensors

    def weight(self, name: str) -> np.ndarray:
        w = self._weights.get(name)
        if w is None:
            w = self._weights[name] = dequantize(self.gguf.tensor(name))
            self.gguf.reads += 1  # (the model checks the file after a forward that read it)
        return w

    def close(self) -> None:
        """Free the device memory it allocated: weights, recordings, KV storage, the slot table.
        Not the expert pool nor its slots (`slot_arrays`): their owner (the Model) frees them after."""
        if self.closed:
            return
        self.closed = True
        if self.pool is not None:
            self.pool.untrack()  # (the pool writes no more into the table freed below)
        self.runner.close()
        self.consts.close()
        self.arena.close()
        for b in self._store.buffers:
            b.destroy()
        self.tensors = {}
        if self.slot_lut is not None:
            self.slot_lut.destroy()
            self.slot_lut = None
        self._stage = {}
        self._layer_tensors = {}


class GraphConsts:
    """Float32 copies of the 1-D tensors the graph reads (norms, biases), uploaded once."""

    def __init__(self, be):
        self.be = be
        self._vecs: dict[str, Slice] = {}
        self._tensors: dict[str, DeviceTensor] = {}
        self._buffers: list[Buffer] = []

    def vec(self, name: str) -> Slice:
        s = self._vecs.get(name)
        if s is None:
            w = np.ascontiguousarray(self.be.weight(name), dtype=np.float32).reshape(-1)
            buf = self.be.dev.buffer(max(w.nbytes, 16))
            buf.write(w)
            self._buffers.append(buf)
            s = self._vecs[name] = buf.slice(0, max(w.nbytes, 16))
        return s

    def rows(self, n: int) -> Slice:
        """An int32 buffer holding 0 .. n-1 (the rows a quantized KV cache's layer decodes)."""
        key = f"rows:{n}"
        s = self._vecs.get(key)
        if s is None:
            w = np.arange(n, dtype=np.int32)
            buf = self.be.dev.buffer(max(w.nbytes, 16))
            buf.write(w)
            self._buffers.append(buf)
            s = self._vecs[key] = buf.slice(0, max(w.nbytes, 16))
        return s

    def array(self, values: np.ndarray) -> Slice:
        """A float32 buffer holding `values` (arrays the config computes: YaRN's RoPE divisors)."""
        w = np.ascontiguousarray(values, dtype=np.float32).reshape(-1)
        key = f"array:{w.tobytes().hex()}"
        s = self._vecs.get(key)
        if s is None:
            buf = self.be.dev.buffer(max(w.nbytes, 16))
            buf.write(w)
            self._buffers.append(buf)
            s = self._vecs[key] = buf.slice(0, max(w.nbytes, 16))
        return s

    def scalar(self, value: float) -> Slice:
        """A one-float buffer holding `value` (an elementwise op's broadcast operand)."""
        key = f"scalar:{float(value)!r}"
        s = self._vecs.get(key)
        if s is None:
            buf = self.be.dev.buffer(16)
            buf.write(np.array([value, 0, 0, 0], np.float32))
            self._buffers.append(buf)
            s = self._vecs[key] = buf.slice(0, 16)
        return s

    def row_tensor(self, name: str) -> DeviceTensor:
        """A 1-D weight as a [1, n] F32 matrix (for a dot product by mul_mv)."""
        t = self._tensors.get(name)
        if t is None:
            w = np.ascontiguousarray(self.be.weight(name), dtype=np.float32).reshape(1, -1)
            store = WeightStore(self.be.dev)
            store.add(name, w.view(np.uint8), "F32", w.shape)
            (t,) = store.commit()
            self._buffers.extend(store.buffers)
            self._tensors[name] = t
        return t

    def close(self) -> None:
        for b in self._buffers:
            b.destroy()
        self._buffers, self._vecs, self._tensors = [], {}, {}
