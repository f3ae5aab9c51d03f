"""The whole decode step as one pre-recorded command buffer, replayed per token.

DESIGN.md "Data flow of one decode step": for resident models, Python leaves the per-token
loop. `DecodeGraph` records, once per (model, KV storage), every dispatch of a one-row
forward pass into a single `Sequence`:

    get_rows(token_embd, tok) -> x
    per layer: rms_norm -> q/k/v mat-vec (+ bias) -> q/k norm (per head or full) -> rope (pos
    read on the device) -> set_rows K/V into the device KV cache at pos -> attention over the
    cache (its length is pos + 1, read on the device) -> output proj accumulated into x ->
    rms_norm -> router mat-vec -> softmax/top-k -> expert gate/up (mul_mv_id reading the ids
    on the device) -> SwiGLU -> expert down with the routing weights fused, summed into x
    (+ the sigmoid-gated shared expert; or the dense SwiGLU FFN)
    output norm -> output head -> logits -> argmax

Per token the host writes the token id and the position (8 bytes), submits once, waits, and
reads the logits. Nothing is recorded again until the KV storage grows.

The KV cache lives in device memory (`DeviceKV`), mapped on the host: the per-op path
(prefill, hooks) writes the same memory through `DeviceKVCache`, a `KVCache` whose keys and
values are views of it, so trim / snapshot / restore keep working (a position is just the
length). The sigmoid gate of qwen2moe's shared expert has no kernel of its own: it is a
two-way softmax over [g, 0] (softmax([g, 0])[0] = sigmoid(g)), and the shared expert's down
projection runs as a one-part expert tensor whose second "expert" lies outside the part, so
the expert kernel adds sigmoid(g) * down(h) into x and skips the other.
"""

from __future__ import annotations

import logging
import time
import weakref
from typing import Optional

import numpy as np

from ...cache import KVCache
from .device import Buffer, Slice, VulkanKernelError
from .kernels import DeviceTensor, Part, WeightStore

log = logging.getLogger(__name__)

# Architectures whose forward (onebit/models/<arch>.py) is the graph recorded here.
GRAPH_ARCHS = ("qwen3moe", "qwen2moe", "olmoe", "llama", "qwen2", "qwen3")
MIN_CAPACITY = 256


# -- the KV cache in device memory ---------------------------------------------------------


class DeviceKV:
    """Every layer's keys [cap, Hkv, D] and values [cap, Hkv, Dv] in mapped device buffers."""

    def __init__(self, dev, cfg, capacity: int):
        self.dev, self.cfg = dev, cfg
        self.capacity = int(capacity)
        self.users: "weakref.WeakSet[DeviceKVCache]" = weakref.WeakSet()
        self.graph: Optional["DecodeGraph"] = None
        self._alloc()

    def _alloc(self) -> None:
        cfg, cap = self.cfg, self.capacity
        kshape, vshape = (cap, cfg.n_kv_heads, cfg.head_dim), (cap, cfg.n_kv_heads, cfg.head_dim_v)
        self.buffers: list[tuple[Buffer, Buffer]] = []
        self.keys: list[np.ndarray] = []
        self.values: list[np.ndarray] = []
        for _ in range(cfg.n_layers):
            kb = self.dev.buffer(int(np.prod(kshape)) * 4, host_visible=True)
            vb = self.dev.buffer(int(np.prod(vshape)) * 4, host_visible=True)
            if not (kb.host_visible and vb.host_visible):
                kb.destroy()
                vb.destroy()
                raise VulkanKernelError("KV cache: the device has no host-visible memory")
            self.buffers.append((kb, vb))
            k, v = kb.view(np.float32, kshape), vb.view(np.float32, vshape)
            k.fill(0)
            v.fill(0)
            self.keys.append(k)
            self.values.append(v)

    def k_slice(self, layer: int) -> Slice:
        return self.buffers[layer][0].slice(0, self.keys[layer].nbytes)

    def v_slice(self, layer: int) -> Slice:
        return self.buffers[layer][1].slice(0, self.values[layer].nbytes)

    @property
    def in_use(self) -> bool:
        return len(self.users) > 0

    def grow(self, n: int) -> None:
        """Room for at least n positions: new buffers (double), contents copied, graph dropped."""
        cap = self.capacity
        while cap < n:
            cap *= 2
        old_bufs, old_k, old_v = self.buffers, self.keys, self.values
        self.capacity = cap
        self._alloc()
        for layer in range(self.cfg.n_layers):
            self.keys[layer][: old_k[layer].shape[0]] = old_k[layer]
            self.values[layer][: old_v[layer].shape[0]] = old_v[layer]
        del old_k, old_v
        self.drop_graph()
        for kb, vb in old_bufs:
            kb.destroy()
            vb.destroy()

    def drop_graph(self) -> None:
        if self.graph is not None:
            self.graph.close()
            self.graph = None

    def destroy(self) -> None:
        self.drop_graph()
        for kb, vb in self.buffers:
            kb.destroy()
            vb.destroy()
        self.buffers, self.keys, self.values = [], [], []

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in zip(self.keys, self.values))


class DeviceKVCache(KVCache):
    """One layer's view of a `DeviceKV`: the KVCache interface over device memory."""

    def __init__(self, storage: DeviceKV, layer: int):
        self.storage, self.layer = storage, layer
        self.offset = 0
        storage.users.add(self)

    @property
    def keys(self) -> np.ndarray:
        return self.storage.keys[self.layer]

    @property
    def values(self) -> np.ndarray:
        return self.storage.values[self.layer]

    def update_and_fetch(self, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        n = self.offset + k.shape[0]
        if n > self.storage.capacity:
            self.storage.grow(n)
        self.keys[self.offset : n] = k
        self.values[self.offset : n] = v
        self.offset = n
        return self.keys[:n], self.values[:n]

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes


# -- small tensors on the device (norm weights, biases) -----------------------------------


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


# -- the recorded step -------------------------------------------------------------------


def unsupported(be, model) -> Optional[str]:
    """Why `model` cannot decode through a DecodeGraph on backend `be` (None: it can)."""
    cfg = model.cfg
    if cfg.arch not in GRAPH_ARCHS:
        return f"architecture {cfg.arch}"
    names = ["token_embd.weight", "output.weight" if be.has("output.weight") else "token_embd.weight"]
    for layer in range(cfg.n_layers):
        p = f"blk.{layer}"
        names += [f"{p}.attn_{n}.weight" for n in ("q", "k", "v", "output")]
        if model.layer_has_moe(layer):
            names += [f"{p}.ffn_gate_inp.weight"] + [f"{p}.ffn_{n}_exps.weight" for n in ("gate", "up", "down")]
            if cfg.shared_expert_hidden_dim:
                names += [f"{p}.ffn_{n}_shexp.weight" for n in ("gate", "up", "down")]
        else:
            names += [f"{p}.ffn_{n}.weight" for n in ("gate", "up", "down")]
    missing = [n for n in names if n not in be.tensors]
    if missing:
        return f"{missing[0]} is not on the device"
    if cfg.shared_expert_hidden_dim:
        for layer in range(cfg.n_layers):
            if model.layer_has_moe(layer) and len(be.tensors[f"blk.{layer}.ffn_down_shexp.weight"].parts) != 1:
                return "a shared expert larger than one binding"
    widths = (cfg.dim, cfg.n_heads * cfg.head_dim_v, cfg.hidden_dim if not cfg.is_moe else 4,
              cfg.expert_hidden_dim if cfg.is_moe else 4, cfg.shared_expert_hidden_dim or 4)
    if any(w % 4 for w in widths):
        return "a row length that is not a multiple of 4"
    return None


class DecodeGraph:
    """One-row forward of `model` recorded into one command buffer against `kv`'s buffers."""

    recordings = 0  # every DecodeGraph ever recorded (tests check replays do not re-record)

    def __init__(self, be, model, kv: DeviceKV):
        self.be, self.model, self.cfg, self.kv = be, model, model.cfg, kv
        self.dev, self.k = be.dev, be.k
        self.consts = be.graph_consts()
        self._bufs: list[Buffer] = []
        self.seq = self.dev.sequence()
        self.n_replays = 0
        self.host_s = 0.0  # CPU time in step() outside the fence wait
        self.wait_s = 0.0
        try:
            self._build()
            self.seq.record()
        except Exception:
            self.close()
            raise
        DecodeGraph.recordings += 1
        be.graph_recordings += 1
        ffi, vk = self.dev.vk.ffi, self.dev.vk
        self._submit = ffi.new("VkSubmitInfo*", {
            "sType": vk.VK_STRUCTURE_TYPE_SUBMIT_INFO, "commandBufferCount": 1, "pCommandBuffers": self.seq._cmd_ptr,
        })
        log.info("vulkan: decode step recorded: %d dispatches, %d barriers, KV capacity %d",
                 len(self.seq.ops), self.seq.n_barriers, kv.capacity)

    def _buf(self, n: int, dtype=np.float32) -> Slice:
        nbytes = max(16, (n * np.dtype(dtype).itemsize + 15) // 16 * 16)
        b = self.dev.buffer(nbytes)
        b.write(np.zeros(nbytes, np.uint8))
        self._bufs.append(b)
        return b.slice(0, nbytes)

    def _build(self) -> None:
        cfg, K, seq, T, C = self.cfg, self.k, self.seq, self.be.tensors, self.consts
        d, H, Hkv, D, Dv = cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.head_dim_v
        eps, cap = cfg.norm_eps, self.kv.capacity
        io = self._buf(4, np.int32)
        self._io = io.buffer.view(np.int32, (4,))
        self.tok = io.buffer.slice(0, 16)
        pos_buf = self._buf(4, np.int32)
        self._pos = pos_buf.buffer.view(np.int32, (4,))
        pos = pos_buf
        x, xn = self._buf(d), self._buf(d)
        q, kk, v = self._buf(H * D), self._buf(Hkv * D), self._buf(Hkv * Dv)
        q2, k2 = self._buf(H * D), self._buf(Hkv * D)
        qr, kr = self._buf(H * D), self._buf(Hkv * D)
        o = self._buf(H * Dv)
        E, k_used, F = cfg.n_experts, cfg.n_experts_used, cfg.expert_hidden_dim
        S = cfg.shared_expert_hidden_dim
        width = max(F * max(k_used, 1), cfg.hidden_dim, S, 4)
        g, u, a = self._buf(width), self._buf(width), self._buf(width)
        if cfg.is_moe:
            rl, ids, wts = self._buf(E), self._buf(k_used, np.int32), self._buf(k_used)
        if S:
            sl, sids, swts = self._buf(4), self._buf(2, np.int32), self._buf(2)
        vocab = cfg.vocab_size
        self.logits = self._buf(vocab)
        self._logits = self.logits.buffer.view(np.float32, (vocab,))
        amax = self._buf(1, np.int32)
        self._amax = amax.buffer.view(np.int32, (4,))

        K.get_rows(seq, T["token_embd.weight"], self.tok, x, 1, d)
        for layer in range(cfg.n_layers):
            p = f"blk.{layer}"
            K.rms_norm(seq, x, C.vec(f"{p}.attn_norm.weight"), xn, 1, d, eps)
            for n, out, tmp, w in (("q", q, q2, H * D), ("k", kk, k2, Hkv * D), ("v", v, o, Hkv * Dv)):
                bias = f"{p}.attn_{n}.bias"
                if cfg.attn_bias and self.be.has(bias):
                    K.mul_mv(seq, T[f"{p}.attn_{n}.weight"], xn, tmp, 1, d, w)
                    K.elementwise(seq, "add", tmp, C.vec(bias), out, w)
                else:
                    K.mul_mv(seq, T[f"{p}.attn_{n}.weight"], xn, out, 1, d, w)
            qn, kn = q, kk
            if cfg.qk_norm == "full":
                K.rms_norm(seq, q, C.vec(f"{p}.attn_q_norm.weight"), q2, 1, H * D, eps)
                K.rms_norm(seq, kk, C.vec(f"{p}.attn_k_norm.weight"), k2, 1, Hkv * D, eps)
                qn, kn = q2, k2
            elif cfg.qk_norm == "head":
                K.rms_norm(seq, q, C.vec(f"{p}.attn_q_norm.weight"), q2, H, D, eps)
                K.rms_norm(seq, kk, C.vec(f"{p}.attn_k_norm.weight"), k2, Hkv, D, eps)
                qn, kn = q2, k2
            K.rope(seq, qn, pos, qr, 1, H, D, cfg.rope_dim, cfg.rope_theta, cfg.rope_neox, cfg.rope_scale)
            K.rope(seq, kn, pos, kr, 1, Hkv, D, cfg.rope_dim, cfg.rope_theta, cfg.rope_neox, cfg.rope_scale)
            kc, vc = self.kv.k_slice(layer), self.kv.v_slice(layer)
            K.set_rows(seq, kr, pos, kc, 1, Hkv * D)
            K.set_rows(seq, v, pos, vc, 1, Hkv * Dv)
            K.attention(seq, qr, kc, vc, pos, o, 1, H, Hkv, D, Dv, cap)
            K.mul_mv(seq, T[f"{p}.attn_output.weight"], o, x, 1, H * Dv, d, accumulate=True)  # x += attn
            K.rms_norm(seq, x, C.vec(f"{p}.ffn_norm.weight"), xn, 1, d, eps)
            if self.model.layer_has_moe(layer):
                K.mul_mv(seq, T[f"{p}.ffn_gate_inp.weight"], xn, rl, 1, d, E)
                K.softmax_topk(seq, rl, ids, wts, 1, E, k_used, cfg.expert_weights_norm)
                K.mul_mv_id(seq, T[f"{p}.ffn_gate_exps.weight"], xn, g, ids, wts, 1, k_used, d, 0, F)
                K.mul_mv_id(seq, T[f"{p}.ffn_up_exps.weight"], xn, u, ids, wts, 1, k_used, d, 0, F)
                K.elementwise(seq, "swiglu", g, u, a, k_used * F)
                K.mul_mv_id(seq, T[f"{p}.ffn_down_exps.weight"], a, x, ids, wts, 1, k_used, k_used * F, F, d,
                            mode="sum", accumulate=True)  # x += sum_s w_s * expert_s
                if S:
                    self._shared_expert(p, xn, x, g, u, a, sl, sids, swts)
            else:
                Fd = cfg.hidden_dim
                K.mul_mv(seq, T[f"{p}.ffn_gate.weight"], xn, g, 1, d, Fd)
                K.mul_mv(seq, T[f"{p}.ffn_up.weight"], xn, u, 1, d, Fd)
                K.elementwise(seq, "swiglu", g, u, a, Fd)
                K.mul_mv(seq, T[f"{p}.ffn_down.weight"], a, x, 1, Fd, d, accumulate=True)
        K.rms_norm(seq, x, C.vec("output_norm.weight"), xn, 1, d, eps)
        head = "output.weight" if self.be.has("output.weight") else "token_embd.weight"
        K.mul_mv(seq, T[head], xn, self.logits, 1, d, vocab)
        K.argmax(seq, self.logits, amax, 1, vocab)

    def _shared_expert(self, p, xn, x, g, u, a, sl, sids, swts) -> None:
        """x += sigmoid(xn . w_gate) * down(silu(gate(xn)) * up(xn))."""
        K, seq, T, S, d = self.k, self.seq, self.be.tensors, self.cfg.shared_expert_hidden_dim, self.cfg.dim
        K.mul_mv(seq, T[f"{p}.ffn_gate_shexp.weight"], xn, g, 1, d, S)
        K.mul_mv(seq, T[f"{p}.ffn_up_shexp.weight"], xn, u, 1, d, S)
        K.elementwise(seq, "swiglu", g, u, a, S)
        # sl = [g, 0]: only sl[0] is ever written, sl[1] stays 0.
        K.mul_mv(seq, self.consts.row_tensor(f"{p}.ffn_gate_inp_shexp.weight"), xn, sl, 1, d, 1)
        K.softmax_topk(seq, sl, sids, swts, 1, 2, 2, False)  # weight of id 0: sigmoid(g)
        down = T[f"{p}.ffn_down_shexp.weight"]
        (part,) = down.parts
        as_expert = DeviceTensor(down.name, down.type_name, (2, *down.shape), (Part(part.slice, 0, 1),))
        K.mul_mv_id(seq, as_expert, a, x, sids, swts, 1, 2, S, 0, d, mode="sum", accumulate=True)

    # -- replay ------------------------------------------------------------------------

    def step(self, token: int, pos: int) -> np.ndarray:
        """Run the recorded step for `token` at position `pos`; returns logits [vocab] (a copy).
        The argmax is in `last_argmax`."""
        t0 = time.perf_counter()
        if not 0 <= pos < self.kv.capacity:
            raise ValueError(f"position {pos} outside the recorded KV capacity {self.kv.capacity}")
        self._io[0] = token
        self._pos[0] = pos
        dev = self.dev
        lib = dev.vk.lib
        if lib.vkResetFences(dev.handle, 1, dev._fence_ptr) != 0:
            raise VulkanKernelError("vkResetFences failed")
        res = lib.vkQueueSubmit(dev.queue, 1, self._submit, dev.fence)
        if res != 0:
            raise VulkanKernelError(f"submitting the decode step failed (VkResult {res})")
        t1 = time.perf_counter()
        res = lib.vkWaitForFences(dev.handle, 1, dev._fence_ptr, 1, 0xFFFFFFFFFFFFFFFF)
        t2 = time.perf_counter()
        if res != 0:
            raise VulkanKernelError(f"waiting for the decode step failed (VkResult {res}; device lost?)")
        logits = self._logits.copy()
        self.last_argmax = int(self._amax[0])
        t3 = time.perf_counter()
        self.n_replays += 1
        dev.wait_s += t2 - t1
        dev.n_submits += 1
        self.wait_s += t2 - t1
        self.host_s += (t1 - t0) + (t3 - t2)
        return logits

    def close(self) -> None:
        if self.seq is not None:
            self.seq.close()
            self.seq = None
        for b in self._bufs:
            b.destroy()
        self._bufs = []


# -- glue for VulkanBackend ----------------------------------------------------------------


class GraphRunner:
    """Per-backend state: which models can use a graph, the KV storages and their graphs."""

    def __init__(self, be):
        self.be = be
        self.storages: list[DeviceKV] = []
        self._why: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()

    def reason(self, model) -> Optional[str]:
        if model not in self._why:
            why = unsupported(self.be, model)
            if why is not None:
                log.warning("vulkan: decode runs op by op for %s (%s)", model.cfg.arch, why)
            self._why[model] = why
        return self._why[model]

    def make_cache(self, model, capacity: int = 0) -> Optional[list]:
        if self.reason(model) is not None:
            return None
        cfg = model.cfg
        want = max(int(capacity), 1)
        free = [s for s in self.storages if not s.in_use and s.cfg is cfg]
        pick = next((s for s in free if s.capacity >= want), None)
        for s in free:  # idle storages that will not be reused: give their memory back
            if s is not pick:
                self.storages.remove(s)
                s.destroy()
        if pick is None:  # positions past a reused storage's length are never read: no clearing
            pick = DeviceKV(self.be.dev, cfg, int(capacity) if capacity else MIN_CAPACITY)
            self.storages.append(pick)
        return [DeviceKVCache(pick, layer) for layer in range(cfg.n_layers)]

    def forward_one(self, model, token: int, cache) -> Optional[np.ndarray]:
        """Logits [1, vocab] for one token through the graph, or None (use the per-op path)."""
        if not cache or not isinstance(cache[0], DeviceKVCache) or self.reason(model) is not None:
            return None
        kv = cache[0].storage
        if any(getattr(c, "storage", None) is not kv for c in cache) or kv.cfg is not model.cfg:
            return None
        pos = cache[0].offset
        if any(c.offset != pos for c in cache) or not 0 <= token < model.cfg.vocab_size:
            return None  # the per-op path says what is wrong
        if pos + 1 > kv.capacity:
            kv.grow(pos + 1)
        if kv.graph is None or kv.graph.model is not model:
            kv.drop_graph()
            try:
                kv.graph = DecodeGraph(self.be, model, kv)
            except VulkanKernelError as e:
                log.warning("vulkan: decode step could not be recorded (%s); running op by op", e)
                self._why[model] = str(e)
                return None
        logits = kv.graph.step(int(token), pos)
        for c in cache:
            c.offset = pos + 1
        return logits.reshape(1, -1)

    def close(self) -> None:
        for s in self.storages:
            s.destroy()
        self.storages = []
