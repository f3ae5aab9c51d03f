"""`VulkanBackend`: a model's schedule recorded into command buffers (graph.py) and replayed.

Weights are uploaded once, at load, in their quantized layout (one memcpy per tensor from the
GGUF memory map on unified memory). A weight whose type has no shader (or whose rows are not
whole shader blocks) is dequantized once at load and uploaded as F32, and the log says so;
a model the kernels cannot run at all (e.g. a row length that is not a multiple of 4) is
refused at load with `VulkanUnavailableError`, which `make_backend` / `onebit.load` turn
into an explicit, logged fall back to the numpy backend.

Every forward (decode, verify rows, prefill chunks) replays a recording specialised on its
row count; the KV cache lives in device memory (graph.DeviceKV). Streamed experts
(streaming.py) and hooks are served at the recording's pause points.
"""

from __future__ import annotations

import logging
from typing import Optional

import numpy as np

from ...cache import SWA_ROWS
from ...gguf_file import EXPERT_PARTS, GGUFFile
from ..numpy_backend import dequantize
from .device import Buffer, Device, Slice, VulkanKernelError, VulkanUnavailableError, default_device
from .kernels import SUPPORTED_TYPES, DeviceTensor, WeightStore, Kernels, shader_qk

log = logging.getLogger(__name__)


class VulkanBackend:
    name = "vulkan"
    pool = None
    predictor = None  # a moe.predict.Predictor, called at every MoE pause point
    streamed_layers: frozenset = frozenset()
    host_reads = 0  # host copies made from the model file (norms, biases: to record a shape)

    @property
    def reads_file(self) -> bool:
        """Whether a forward may read the model file at any time: only with a predictor (its
        host ops read the memory map). Else it is read only where `file_reads` counts, and the
        model checks it after a forward when the count has moved (models/base.py)."""
        return self.predictor is not None

    @property
    def file_reads(self) -> int:
        """Reads of the model file so far: host copies, and a pool's expert reads (counted as
        they complete, by its reader threads; an expert is used only once its read is done)."""
        return self.host_reads + (self.pool.reads if self.pool is not None else 0)

    def __init__(self, gguf: GGUFFile, device: Optional[Device] = None):
        from .graph import Arena, GraphRunner

        self.gguf = gguf
        self.dev = device or default_device()
        self.k = Kernels(self.dev)
        self._weights: dict[str, np.ndarray] = {}  # small host copies (norm weights, biases)
        store = WeightStore(self.dev)
        names = []
        for name, t in gguf.tensors.items():
            if len(t.shape) < 2 or name.endswith(".bias") or self._streamed(name):
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
        self.tensors: dict[str, DeviceTensor] = dict(zip(names, store.commit()))
        self._store = store
        self.consts = GraphConsts(self)
        self.arena = Arena(self.dev)
        self.runner = GraphRunner(self)
        self.recordings = 0  # every recording made (tests check replays do not re-record)
        log.info("vulkan: %d tensors, %.1f MiB of weights on %s", len(names), self.weight_bytes / 2**20,
                 self.dev.info.name)

    def _streamed(self, name: str) -> bool:
        """Tensors not uploaded at load (StreamingVulkanBackend: the routed experts)."""
        return False

    def streamed(self, layer: int) -> bool:
        return layer in self.streamed_layers

    def expert_tensors(self, layer: int) -> tuple[DeviceTensor, ...]:
        """gate, up, down of `layer`'s routed experts, indexed by expert id."""
        return tuple(self.tensors[f"blk.{layer}.{p}.weight"] for p in EXPERT_PARTS)

    # -- the model ------------------------------------------------------------------------

    def attach_model(self, model) -> None:
        """Record one decode step now, so a model the kernels cannot run is refused at load (into
        a KV storage of the capacity the model's caches will have, so the step is reused)."""
        cfg = model.cfg
        widths = (cfg.dim, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, cfg.n_heads * cfg.head_dim_v,
                  cfg.n_kv_heads * cfg.head_dim_v, cfg.hidden_dim, cfg.expert_hidden_dim, cfg.shared_expert_hidden_dim)
        if any(w % 4 for w in widths):
            raise VulkanUnavailableError(f"{self.gguf.path}: a row length of {cfg.arch} is not a multiple of 4, "
                                         "which the Vulkan kernels need")
        cache = self.make_cache(cfg, model.kv_capacity)
        try:
            self.runner._recording(model, cache.storage, 1, True, self.streamed_layers)
            if self.pool is not None and self.streamed_layers and not cfg.recurrent_layers:
                self.runner._recording(model, cache.storage, 1, True, frozenset(), lookup=True)  # (graph.py)
        except VulkanKernelError as e:
            raise VulkanUnavailableError(f"{self.gguf.path}: the Vulkan kernels cannot run this model ({e})") from e
        finally:
            del cache

    def make_cache(self, cfg, capacity: int = 0, swa_rows: int = SWA_ROWS):
        """A sequence whose KV cache is in device memory (sliding-window layers: rings sized for
        forwards of `swa_rows` rows, 0: none)."""
        return self.runner.make_cache(cfg, capacity, swa_rows)

    def forward(self, model, ids: np.ndarray, cache, hook=None, last_only: bool = False) -> tuple[np.ndarray, bool]:
        return self.runner.forward(model, ids, cache, hook=hook, last_only=last_only)

    def greedy_chain(self, model, cache, limit=None):
        return self.runner.greedy_chain(model, cache, limit)

    # -- weights ------------------------------------------------------------------------

    def has(self, name: str) -> bool:
        return name in self.gguf.tensors

    def weight(self, name: str) -> np.ndarray:
        w = self._weights.get(name)
        if w is None:
            w = self._weights[name] = dequantize(self.gguf.tensor(name))
            self.host_reads += 1
        return w

    def close(self) -> None:
        self.runner.close()
        self.consts.close()
        self.arena.close()
        for b in self._store.buffers:
            b.destroy()
        self.tensors = {}


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
