"""`VulkanBackend`: the NumpyBackend interface, computed by the Vulkan kernels.

Weights are uploaded once, at load, in their quantized layout (one memcpy per tensor from the
GGUF memory map on unified memory). The methods below take and return numpy arrays, so the
model graphs in onebit/models run unchanged over them (prefill, steps with a hook, and any
model the recorded step does not cover); the expert FFN (gate, up, SwiGLU, down with the
routing weights fused and summed) is one recorded sequence with no host round trip inside it.

One-row decode of a resident model skips all that: `attach_model` routes it to graph.py's
`DecodeGraph`, the whole step recorded once into one command buffer and replayed per token,
and `make_cache` puts the KV cache in device memory that both paths read and write.

Anything the kernels cannot take (a weight type without a shader, a row length that is not
whole blocks) runs on the numpy reference instead, and says so once in the log.
"""

from __future__ import annotations

import logging
from typing import Optional

import numpy as np

from ...gguf_file import GGUFFile
from ..numpy_backend import NumpyBackend, dequantize
from .device import Device, Slice, default_device
from .kernels import SUPPORTED_TYPES, DeviceTensor, Kernels, WeightStore, shader_qk

log = logging.getLogger(__name__)

class VulkanBackend:
    name = "vulkan"

    def __init__(self, gguf: GGUFFile, device: Optional[Device] = None):
        self.gguf = gguf
        self.dev = device or default_device()
        self.k = Kernels(self.dev)
        self._np = NumpyBackend(gguf)
        self._weights: dict[str, np.ndarray] = {}  # small host copies (norm weights, biases)
        self._scratch: list = []
        self._warned: set[str] = set()
        store = WeightStore(self.dev)
        names = []
        for name, t in gguf.tensors.items():
            if len(t.shape) < 2 or self._streamed(name):
                continue
            type_name = t.type_name
            if type_name not in SUPPORTED_TYPES or t.shape[-1] % shader_qk(type_name):
                self._fallback(name, f"{type_name} rows of {t.shape[-1]}")
                continue
            store.add(name, t.raw, type_name, t.shape)
            names.append(name)
        self.weight_bytes = store.planned_bytes
        self.tensors: dict[str, DeviceTensor] = dict(zip(names, store.commit()))
        self._store = store
        # The decode step as one recorded command buffer (graph.py), for resident models.
        self.use_graph = type(self)._streamed is VulkanBackend._streamed  # streamed experts: layer by layer
        self.graph_recordings = 0
        self._graph_consts = None
        self._graphs = None
        log.info("vulkan: %d tensors, %.1f MiB of weights on %s", len(names), self.weight_bytes / 2**20,
                 self.dev.info.name)

    def _streamed(self, name: str) -> bool:
        """Tensors not uploaded at load (StreamingVulkanBackend: the routed experts)."""
        return False

    def _fallback(self, what: str, why: str) -> None:
        if what not in self._warned:
            self._warned.add(what)
            log.warning("vulkan: %s runs on numpy (%s)", what, why)

    # -- the recorded decode step (graph.py) ------------------------------------------------

    def _graph_runner(self):
        if self._graphs is None:
            from .graph import GraphRunner

            self._graphs = GraphRunner(self)
        return self._graphs

    def graph_consts(self):
        if self._graph_consts is None:
            from .graph import GraphConsts

            self._graph_consts = GraphConsts(self)
        return self._graph_consts

    def make_cache(self, model, capacity: int = 0):
        """KV caches in device memory (so the recorded step and the per-op path share them), or
        None where the model cannot use the recorded step (the caller makes host caches)."""
        if not self.use_graph:
            return None
        return self._graph_runner().make_cache(model, capacity)

    def attach_model(self, model) -> None:
        """Route one-row forwards without a hook through the recorded decode step."""
        if not self.use_graph:
            return
        per_op = model.forward
        runner = self._graph_runner()

        def forward(ids, cache, hook=None, last_only=False):
            if hook is None and len(ids) == 1 and self.use_graph:
                logits = runner.forward_one(model, int(ids[0]), cache)
                if logits is not None:
                    return logits
            return per_op(ids, cache, hook=hook, last_only=last_only)

        forward.__doc__ = per_op.__doc__
        forward.per_op = per_op
        model.forward = forward

    # -- scratch buffers, reused across calls -----------------------------------------------

    def _tmp(self, i: int, nbytes: int) -> Slice:
        nbytes = max(16, (nbytes + 15) // 16 * 16)
        while len(self._scratch) <= i:
            self._scratch.append(None)
        buf = self._scratch[i]
        if buf is None or buf.size < nbytes:
            if buf is not None:
                buf.destroy()
            buf = self._scratch[i] = self.dev.buffer(max(nbytes, 4096))
        return buf.slice(0, nbytes)

    def _put(self, i: int, a: np.ndarray, dtype=np.float32) -> Slice:
        a = np.ascontiguousarray(a, dtype=dtype)
        s = self._tmp(i, a.nbytes)
        s.buffer.write(a)
        return s

    def _run(self, record) -> None:
        seq = self.dev.sequence()
        try:
            record(seq)
            seq.run()
        finally:
            seq.close()

    @staticmethod
    def _get(s: Slice, shape, dtype=np.float32) -> np.ndarray:
        return s.buffer.read(dtype, shape, s.offset)

    # -- weights ------------------------------------------------------------------------

    def has(self, name: str) -> bool:
        return name in self.gguf.tensors

    def weight(self, name: str) -> np.ndarray:
        w = self._weights.get(name)
        if w is None:
            w = self._weights[name] = dequantize(self.gguf.tensor(name))
        return w

    def embed(self, name: str, ids: np.ndarray) -> np.ndarray:
        t = self.tensors.get(name)
        if t is None:
            return self._np.embed(name, ids)
        ids = np.asarray(ids, dtype=np.int32)
        n = len(ids)
        ids_s, out = self._put(0, ids, np.int32), self._tmp(1, n * t.ncols * 4)
        self._run(lambda seq: self.k.get_rows(seq, t, ids_s, out, n, t.ncols))
        return self._get(out, (n, t.ncols))

    def linear(self, x: np.ndarray, name: str) -> np.ndarray:
        """x: [R, in] @ W[out, in].T -> [R, out]."""
        t = self.tensors.get(name)
        if t is None or x.shape[-1] % 4:
            self._fallback(name, "no device copy")
            return self._np.linear(x, name)
        R, n_in = x.shape
        n_out = t.shape[0]
        out = np.empty((R, n_out), np.float32)
        # Keep each output binding under maxStorageBufferRange (prefill logits can exceed it).
        step = max(1, min(R, self.dev.info.max_storage_buffer_range // (4 * max(n_out, n_in))))
        for r0 in range(0, R, step):
            xs = x[r0 : r0 + step]
            n = xs.shape[0]
            x_s, y_s = self._put(0, xs), self._tmp(1, n * n_out * 4)
            self._run(lambda seq: self.k.matmul(seq, t, x_s, y_s, n, n_in, n_out))
            out[r0 : r0 + n] = self._get(y_s, (n, n_out))
        return out

    # -- elementwise and normalisation --------------------------------------------------

    def rms_norm(self, x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
        n = x.shape[-1]
        rows = x.size // n
        x_s, w_s, o_s = self._put(0, x), self._put(1, w), self._tmp(2, x.size * 4)
        self._run(lambda seq: self.k.rms_norm(seq, x_s, w_s, o_s, rows, n, eps))
        return self._get(o_s, x.shape)

    def silu(self, x: np.ndarray) -> np.ndarray:
        x_s, o_s = self._put(0, x), self._tmp(1, x.size * 4)
        self._run(lambda seq: self.k.elementwise(seq, "silu", x_s, None, o_s, x.size))
        return self._get(o_s, x.shape)

    def rope(self, x: np.ndarray, pos: np.ndarray, n_rot: int, theta: float, neox: bool,
             scale: float = 1.0) -> np.ndarray:
        R, H, D = x.shape
        x_s, p_s, o_s = self._put(0, x), self._put(1, pos, np.int32), self._tmp(2, x.size * 4)
        self._run(lambda seq: self.k.rope(seq, x_s, p_s, o_s, R, H, D, n_rot, theta, neox, scale))
        return self._get(o_s, x.shape)

    softmax = staticmethod(NumpyBackend.softmax)

    # -- attention ----------------------------------------------------------------------

    def attention(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, q_pos: np.ndarray) -> np.ndarray:
        """q: [R, H, D]; k: [S, Hkv, D], v: [S, Hkv, Dv] -> [R, H * Dv] (causal, GQA)."""
        R, H, D = q.shape
        S, Hkv, Dv = v.shape
        q_s, k_s, v_s = self._put(0, q), self._put(1, k), self._put(2, v)
        p_s, o_s = self._put(3, q_pos, np.int32), self._tmp(4, R * H * Dv * 4)
        self._run(lambda seq: self.k.attention(seq, q_s, k_s, v_s, p_s, o_s, R, H, Hkv, D, Dv, S))
        return self._get(o_s, (R, H * Dv))

    # -- mixture of experts -------------------------------------------------------------

    def route(self, logits: np.ndarray, k: int, norm: bool) -> tuple[np.ndarray, np.ndarray]:
        R, E = logits.shape
        l_s, i_s, w_s = self._put(0, logits), self._tmp(1, R * k * 4), self._tmp(2, R * k * 4)
        self._run(lambda seq: self.k.softmax_topk(seq, l_s, i_s, w_s, R, E, k, norm))
        return self._get(i_s, (R, k), np.int32).astype(np.int64), self._get(w_s, (R, k))

    def experts(self, x: np.ndarray, prefix: str, ids: np.ndarray, weights: np.ndarray) -> np.ndarray:
        """sum_s weights[r, s] * down(silu(gate(x)) * up(x)) over each row's experts ids[r, s]."""
        names = [f"{prefix}.ffn_{p}_exps.weight" for p in ("gate", "up", "down")]
        gate, up, down = (self.tensors.get(n) for n in names)
        if gate is None or up is None or down is None:
            self._fallback(prefix + " experts", "no device copy")
            return self._np.experts(x, prefix, ids, weights)
        return self._expert_ffn(gate, up, down, x, ids, weights)

    def _expert_ffn(self, gate: DeviceTensor, up: DeviceTensor, down: DeviceTensor, x: np.ndarray, ids: np.ndarray,
                    weights: np.ndarray) -> np.ndarray:
        """The expert FFN as one sequence; ids index the first axis of gate/up/down (expert ids for
        resident tensors, slot ids for slot buffers)."""
        R, dim = x.shape
        k = ids.shape[1]
        F = gate.shape[1]
        x_s = self._put(0, x)
        i_s, w_s = self._put(1, ids, np.int32), self._put(2, weights)
        g_s, u_s, h_s = self._tmp(3, R * k * F * 4), self._tmp(4, R * k * F * 4), self._tmp(5, R * k * F * 4)
        y_s = self._tmp(6, R * dim * 4)

        def record(seq):
            self.k.mul_mv_id(seq, gate, x_s, g_s, i_s, w_s, R, k, dim, 0, F)  # [R, k, F]
            self.k.mul_mv_id(seq, up, x_s, u_s, i_s, w_s, R, k, dim, 0, F)
            self.k.elementwise(seq, "swiglu", g_s, u_s, h_s, R * k * F)
            self.k.mul_mv_id(seq, down, h_s, y_s, i_s, w_s, R, k, k * F, F, dim, mode="sum")  # [R, dim]

        self._run(record)
        return self._get(y_s, (R, dim))

    def close(self) -> None:
        if self._graphs is not None:
            self._graphs.close()
            self._graphs = None
        if self._graph_consts is not None:
            self._graph_consts.close()
            self._graph_consts = None
        for b in self._scratch:
            if b is not None:
                b.destroy()
        self._scratch = []
        for b in self._store.buffers:
            b.destroy()
        self.tensors = {}


def expected_device_bytes(gguf: GGUFFile) -> int:
    """Weight bytes VulkanBackend will place on the device (before alignment padding)."""
    return sum(t.n_bytes for t in gguf.tensors.values() if len(t.shape) >= 2 and t.type_name in SUPPORTED_TYPES)

