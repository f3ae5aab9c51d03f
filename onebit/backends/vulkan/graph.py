"""A model's schedule recorded into Vulkan command buffers, specialised on the row count R.

The architecture's schedule (onebit/models: blocks over the ops of `models/blocks.py`) is
run once against a `Recorder`, whose ops record dispatches instead of computing: values are
device buffers with shapes, taken from an arena and given back when the schedule drops them
(CPython frees a value as soon as nothing refers to it, so buffers are reused in recording
order, and the sequence's barriers order every reuse). The result, a `Recording`, is kept per
(KV storage, model, R, last_only, pause layers, observing hook, chunked delta rule, by slot
table: `GraphRunner._recording`'s key) and replayed: per forward the host writes R token ids
and positions into mapped buffers, submits, waits and reads the logits.

Pause points (the protocol: onebit/pause.py). At a MoE layer's pause the recording is cut
into segments when that layer needs the host: a client that acts (a hook, the predictor) or
streamed experts. Between segments the host reads the layer's expert ids and router logits
from mapped memory, calls the hook, acquires the experts in the pool and writes the slot
table the expert kernels read, then submits the next segment, and the predictor ranks while
the device runs it. With nothing to pause the whole forward is one submission; a hook that only
observes (`needs_pause = False`: a routing trace) keeps it so, and is called after the step
with every layer's ids and logits, which the recording keeps in buffers of their own. When a pool cannot
pin every expert the rows route to at once (a prefill chunk, a small per-layer partition),
the experts run in passes over groups of rows (weights of the other rows set to zero, their
table entries pointing at a pinned slot) accumulating into the layer's expert output, then
the rest of the segment runs: the same kernels, per row, as one pass, so the result is the
same bit for bit.

The KV cache lives in device memory (`DeviceKV`), mapped on the host, so trim / snapshot /
restore work on it as on host arrays. A sliding-window layer's buffers are a ring (position p
in row p % its rows: set_rows and attn wrap), and a forward runs in chunks no longer than the
rows its rings are sized for. qwen2moe's shared-expert gate has no kernel of its
own: it is a two-way softmax over [g, 0] (softmax([g, 0])[0] = sigmoid(g)), and the shared
expert's down projection runs as a one-part expert tensor whose second "expert" lies
outside the part, so the expert kernel adds sigmoid(g) * down(h) and skips the other.
"""

from __future__ import annotations

import logging
import weakref
from collections import defaultdict, deque
from typing import Optional

import numpy as np

from ...cache import SWA_ROWS, Cache, KVCache, RecurrentCache, RingKVCache, layer_positions
from ...pause import NO_PAUSES, PauseContext, Pauses
from .device import Buffer, Fence, Slice, VulkanKernelError
from .kernels import DeviceTensor, Part, SlotLookup

log = logging.getLogger(__name__)

MIN_CAPACITY = 256
EXACT_ROWS = 16  # forwards of up to this many rows are recorded for their exact R
MAX_ROWS = 256  # longer ones run as chunks of powers of two up to this
NO_PAUSE_LAYERS: frozenset = frozenset()


def row_chunks(n: int, limit: int = MAX_ROWS) -> list[int]:
    """Split n rows into recorded sizes: n itself when small, else powers of two, then the rest.
    A forward of more than one row gets no one-row chunk (limit >= 3): one row takes other
    kernels (attention over keys split across lanes) whose sums run in another order, so a
    row's logits would depend on where a split fell (a ring's smaller limit moves it)."""
    out = []
    while n > 0:
        if n <= min(EXACT_ROWS, limit):
            out.append(n)
            break
        step = min(limit, 1 << (n.bit_length() - 1))
        if n - step == 1 and step > 2:  # [step - 1, 2]: the same passes over the weights
            step -= 1
        out.append(step)
        n -= step
    return out


# -- the KV cache in device memory ---------------------------------------------------------


class DeviceKV:
    """Every layer's keys [cap, Hkv, D] and values [cap, Hkv, Dv] in mapped device buffers; a
    sliding-window layer's ring holds at most its `ring_capacity` positions (`swa_rows`: the
    rows its forwards are sized for, 0: no rings), position p in row p % its rows."""

    def __init__(self, dev, cfg, capacity: int, swa_rows: int = SWA_ROWS):
        self.dev, self.cfg = dev, cfg
        self.capacity = int(capacity)
        self.swa_rows = int(swa_rows)
        self.rings = [i for i in range(cfg.n_layers) if swa_rows and cfg.layer_window(i) > 0]
        self.users: "weakref.WeakSet[DeviceCache]" = weakref.WeakSet()
        self.recordings: dict = {}
        self._alloc()
        # A Gated DeltaNet layer's conv history [K-1, C] and state [Hv, D, D]: a constant size
        # (they never grow), mapped like the K/V so checkpoints and rollback work on the host.
        self.rbuffers: dict[int, tuple[Buffer, Buffer]] = {}
        self.conv: dict[int, np.ndarray] = {}
        self.state: dict[int, np.ndarray] = {}
        for layer in cfg.recurrent_layers:
            cshape = (cfg.ssm_conv_kernel - 1, cfg.ssm_conv_channels)
            sshape = (cfg.ssm_time_step_rank, cfg.ssm_state_size, cfg.ssm_state_size)
            cb = self.dev.buffer(max(int(np.prod(cshape)) * 4, 16), host_visible=True)
            sb = self.dev.buffer(int(np.prod(sshape)) * 4, host_visible=True)
            self.rbuffers[layer] = (cb, sb)
            self.conv[layer], self.state[layer] = cb.view(np.float32, cshape), sb.view(np.float32, sshape)

    def conv_slice(self, layer: int) -> Slice:
        return self.rbuffers[layer][0].slice(0, self.rbuffers[layer][0].size)

    def state_slice(self, layer: int) -> Slice:
        return self.rbuffers[layer][1].slice(0, self.state[layer].nbytes)

    def _alloc(self) -> None:
        cfg, cap = self.cfg, self.capacity
        self.buffers: list[tuple[Buffer, Buffer]] = []
        self.keys: list[np.ndarray] = []
        self.values: list[np.ndarray] = []
        for layer in range(cfg.n_layers):
            n = max(1, layer_positions(cfg, layer, cap, self.swa_rows))  # a DeltaNet layer keeps no K/V
            kshape, vshape = (n, cfg.n_kv_heads, cfg.head_dim), (n, cfg.n_kv_heads, cfg.head_dim_v)
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

    def rows(self, layer: int) -> int:
        """Positions layer's buffers hold (position p in row p % rows)."""
        return self.keys[layer].shape[0]

    @property
    def forward_rows(self) -> int:
        """The most rows one recorded forward may have: a ring's rows read after they are written."""
        return min(RingKVCache.rows_for(self.cfg.layer_window(i), self.swa_rows) for i in self.rings) if self.rings \
            else MAX_ROWS

    @property
    def in_use(self) -> bool:
        return len(self.users) > 0

    def grow(self, n: int) -> None:
        """Room for at least n positions: new buffers (double), contents copied, recordings dropped."""
        cap = max(self.capacity, 1)
        while cap < n:
            cap *= 2
        old_bufs, old_k, old_v = self.buffers, self.keys, self.values
        self.capacity = cap
        self._alloc()
        for layer in range(self.cfg.n_layers):  # (a ring that already wrapped keeps its size)
            self.keys[layer][: old_k[layer].shape[0]] = old_k[layer]
            self.values[layer][: old_v[layer].shape[0]] = old_v[layer]
        del old_k, old_v
        self.drop_recordings()
        for kb, vb in old_bufs:
            kb.destroy()
            vb.destroy()

    def drop_recordings(self) -> None:
        for r in self.recordings.values():
            r.close()
        self.recordings = {}

    def destroy(self) -> None:
        self.drop_recordings()
        for kb, vb in [*self.buffers, *self.rbuffers.values()]:
            kb.destroy()
            vb.destroy()
        self.buffers, self.keys, self.values = [], [], []
        self.rbuffers, self.conv, self.state = {}, {}, {}

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in zip(self.keys, self.values)) + \
            sum(self.conv[l].nbytes + self.state[l].nbytes for l in self.conv)


class _DeviceKVView:
    """A layer cache whose keys and values are layer `layer`'s buffers in a `DeviceKV`."""

    storage: DeviceKV
    layer: int

    @property
    def keys(self) -> np.ndarray:
        return self.storage.keys[self.layer]

    @property
    def values(self) -> np.ndarray:
        return self.storage.values[self.layer]


class DeviceKVCache(_DeviceKVView, KVCache):
    """One layer's view of a `DeviceKV`: a `KVCache` whose keys and values are device memory."""

    def __init__(self, storage: DeviceKV, layer: int):
        self.storage, self.layer = storage, layer

    def write(self, start: int, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if start + k.shape[0] > self.storage.capacity:
            self.storage.grow(start + k.shape[0])  # every layer's buffers at once
        return super().write(start, k, v)


class DeviceRingKVCache(_DeviceKVView, RingKVCache):
    """One sliding-window layer's ring in a `DeviceKV`: the device writes and reads it; the host
    keeps what it holds (`advance`, called by the runner per forward), trims and snapshots it."""

    def __init__(self, storage: DeviceKV, layer: int):
        self.storage, self.layer = storage, layer
        self.window = storage.cfg.layer_window(layer)
        self.capacity = layer_positions(storage.cfg, layer, 1 << 62, storage.swa_rows)
        self.rows = self.capacity - self.window + 1
        self.held_from = 0

    def _room(self, n: int) -> None:
        if n > self.keys.shape[0] and self.keys.shape[0] < self.capacity:
            self.storage.grow(n)  # every layer's buffers at once


class DeviceRecurrentCache(RecurrentCache):
    """One Gated DeltaNet layer's view of a `DeviceKV`: conv history and state in device memory."""

    def __init__(self, storage: DeviceKV, layer: int):
        self.storage, self.layer = storage, layer

    @property
    def conv(self) -> np.ndarray:
        return self.storage.conv[self.layer]

    @property
    def state(self) -> np.ndarray:
        return self.storage.state[self.layer]


class DeviceCache(Cache):
    """A sequence whose layers' K/V (and recurrent state) live in one `DeviceKV`."""

    def __init__(self, storage: DeviceKV):
        cfg = storage.cfg

        def layer_cache(layer: int):
            if cfg.layer_is_recurrent(layer):
                return DeviceRecurrentCache(storage, layer)
            return DeviceRingKVCache(storage, layer) if layer in storage.rings else DeviceKVCache(storage, layer)

        super().__init__([layer_cache(layer) for layer in range(cfg.n_layers)])
        self.storage = storage
        storage.users.add(self)
        for c in self.layers:  # a new sequence: zero state (a reused storage holds the last one's)
            if isinstance(c, RecurrentCache):
                c.reset()


# -- values: device buffers with shapes ------------------------------------------------------


class Arena:
    """Scratch buffers by size, shared by every recording of a backend (only one runs at a time).

    A buffer given back is taken again only after MIN_AGE more ops were recorded: reusing it
    at once would make the next op wait (a barrier) for the ops still reading it."""

    MIN_AGE = 8

    def __init__(self, dev):
        self.dev = dev
        self._free: dict[int, deque[tuple[Slice, int]]] = defaultdict(deque)
        self._buffers: list[Buffer] = []
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

    def give(self, s: Slice) -> None:
        self._free[s.size].append((s, self.clock()))

    @property
    def nbytes(self) -> int:
        return sum(b.size for b in self._buffers)

    def close(self) -> None:
        for b in self._buffers:
            b.destroy()
        self._buffers, self._free = [], defaultdict(deque)


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


# -- recording ---------------------------------------------------------------------------------


class PausePoint:
    """Where a recording stops for the host: after layer's router, before its experts."""

    def __init__(self, layer: int, at: int, ids: Val, logits: Val, h: Optional[Val] = None):
        self.layer, self.at = layer, at  # `at`: index of the first op after the pause
        self.ids, self.logits = ids, logits
        # The residual stream at the pause (a predictor reads it). Its buffer is kept by
        # slice: the residual add after the experts takes the Val over, in place.
        self.h = None if h is None else (h.s, h.shape, h.dtype)
        self.weights: Optional[Val] = None  # the routing weights (set by the experts op)
        self.table: Optional[Val] = None  # slot indices the expert kernels read (streamed layers)
        self.y: Optional[Val] = None  # the experts' output
        self.span = (at, at)  # the expert ops
        self.record_experts = None  # (seq, tensors, index, accumulate) -> None
        self.solo: dict = {}  # expert-only sequences by tensors, for passes over row groups
        self.post = None  # the segment after the pause without the expert ops


class Recorder:
    """The ops of models/blocks.py, recording dispatches for R rows into one op list."""

    def __init__(self, rec: "Recording"):
        self.rec, self.be, self.k, self.seq = rec, rec.be, rec.be.k, rec.collector
        self.cfg = rec.cfg
        self.R = rec.R
        self.tensor_names = rec.be.gguf.tensors

    def _new(self, shape, dtype=np.float32) -> Val:
        n = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        return Val(self.rec.arena.take(n), shape, dtype, arena=self.rec.arena)

    def _tensor(self, name: str) -> DeviceTensor:
        t = self.be.tensors.get(name)
        if t is None:
            raise VulkanKernelError(f"{name} is not on the device")
        return t

    def embed(self, name: str) -> Val:
        t = self._tensor(name)
        out = self._new((self.R, t.ncols))
        self.k.get_rows(self.seq, t, self.rec.tok, out.s, self.R, t.ncols)
        return out

    def norm(self, x: Val, name: str, eps: float) -> Val:
        n = x.shape[-1]
        out = self._new(x.shape)
        self.k.rms_norm(self.seq, x.s, self.be.consts.vec(name), out.s, x.size // n, n, eps)
        return out

    def linears(self, x: Val, names, biases) -> list[Val]:
        return [self.linear(x, n, b) for n, b in zip(names, biases)]

    def linear(self, x: Val, name: str, bias: Optional[str] = None) -> Val:
        t = self._tensor(name)
        n_in, n_out = x.width, t.shape[0]
        y = self._new((x.rows, n_out))

        def record(out: Slice, accumulate: bool) -> None:
            self.k.matmul(self.seq, t, x.s, out, x.rows, n_in, n_out, accumulate=accumulate)

        start = len(self.seq.ops)
        record(y.s, False)
        if bias is None:
            if len(t.parts) == 1:  # (parts add one by one: x + a + b is not x + (a + b))
                y.redo = (start, len(self.seq.ops), record)
            return y
        out = self._new(y.shape)
        self.k.elementwise(self.seq, "add", y.s, self.be.consts.vec(bias), out.s, y.size, n_out)
        return out

    @staticmethod
    def view(x: Val, shape) -> Val:
        return Val(x.s, (x.rows, *shape), x.dtype, base=x)

    def rope(self, x: Val, n_rot: int, theta: float, neox: bool, scale: float, factors=None) -> Val:
        R, H, D = x.shape
        out = self._new(x.shape)
        if factors is None or isinstance(factors, str):
            f = self.be.consts.vec(factors) if factors is not None else None
        else:  # an array from the config (YaRN's divisors)
            f = self.be.consts.array(factors)
        self.k.rope(self.seq, x.s, self.rec.pos, out.s, R, H, D, n_rot, theta, neox, scale, factors=f)
        return out

    def attention(self, layer: int, q: Val, k: Val, v: Val, window: int = 0, scale: Optional[float] = None,
                  sinks: Optional[str] = None) -> Val:
        R, H, D = q.shape
        _, Hkv, Dv = v.shape
        kv = self.rec.kv
        kc, vc = kv.k_slice(layer), kv.v_slice(layer)
        n_kv = kv.rows(layer)  # position p in row p % n_kv (a sliding-window ring wraps)
        self.k.set_rows(self.seq, k.s, self.rec.pos, kc, R, Hkv * D, dst_rows=n_kv)
        self.k.set_rows(self.seq, v.s, self.rec.pos, vc, R, Hkv * Dv, dst_rows=n_kv)
        out = self._new((R, H * Dv))
        sk = self.be.consts.vec(sinks) if sinks is not None else None
        self.k.attention(self.seq, q.s, kc, vc, self.rec.pos, out.s, R, H, Hkv, D, Dv, n_kv, window, scale, sk)
        return out

    def residual(self, x: Val, y: Val) -> Val:
        """x + y where the schedule uses neither again: when y's last ops can add into x's
        buffer (a product, the experts), they are recorded again to do so; else an add."""
        ops = self.seq.ops
        if y.redo is None or y.redo[1] != len(ops) or x._arena is None or x._base is not None:
            return self.add(x, y)
        start, _, record = y.redo
        del ops[start:]
        record(x.s, True)  # x += y, in place
        out = Val(x.s, x.shape, x.dtype, arena=x._arena)  # the buffer now belongs to the sum
        x._arena, x.s, y.redo = None, None, None  # a later use of x fails loudly
        return out

    def _elementwise(self, op: str, a: Val, b: Slice, *broadcast) -> Val:
        """out = op(a, b) elementwise (b: a Val's slice, or a broadcast scalar with `1`)."""
        out = self._new(a.shape)
        self.k.elementwise(self.seq, op, a.s, b, out.s, a.size, *broadcast)
        return out

    def add(self, a: Val, b: Val) -> Val:
        return self._elementwise("add", a, b.s)

    def swiglu(self, a: Val, b: Val) -> Val:
        return self._elementwise("swiglu", a, b.s)

    def geglu(self, a: Val, b: Val) -> Val:
        return self._elementwise("geglu", a, b.s)

    def scale(self, x: Val, s: float) -> Val:
        return self._elementwise("mul", x, self.be.consts.scalar(s), 1)

    def softcap(self, x: Val, cap: float) -> Val:
        return self._elementwise("softcap", x, self.be.consts.scalar(cap), 1)

    def _router(self, ids: Val, record) -> None:
        """Record a router; ids.redo keeps how to record it again writing slots (pause())."""
        start = len(self.seq.ops)
        record(None)
        ids.redo = (start, len(self.seq.ops), record)

    def route(self, logits: Val, k: int, norm: bool):
        R, E = logits.shape
        ids, w = self._new((R, k), np.int32), self._new((R, k))
        self._router(ids, lambda lut: self.k.softmax_topk(self.seq, logits.s, ids.s, w.s, R, E, k, norm, lut=lut))
        return ids, w

    def route_sigmoid(self, logits: Val, k: int, bias: Optional[str], norm: bool, scale: float,
                      groups: int = 1, groups_used: int = 1):
        R, E = logits.shape
        ids, w = self._new((R, k), np.int32), self._new((R, k))
        b = self.be.consts.vec(bias) if bias is not None else None
        self._router(ids, lambda lut: self.k.sigmoid_topk(self.seq, logits.s, b, ids.s, w.s, R, E, k, norm, scale,
                                                          groups, groups_used, lut=lut))
        return ids, w

    def pause(self, layer: int, ids: Val, logits: Val, h: Val) -> None:
        if self.rec.observe:  # kept (their buffers not reused) for the hook after the step
            self.rec.observed.append((layer, ids, logits))
        if layer in self.rec.pause_layers:
            self.rec.pauses.append(PausePoint(layer, len(self.seq.ops), ids, logits, h))
        elif self.rec.by_table and self.be.streamed(layer):  # the router writes the slot table too
            ops = self.seq.ops
            if ids.redo is None or ids.redo[1] != len(ops):
                raise VulkanKernelError(f"layer {layer}: the pause point does not follow the router")
            start, _, record = ids.redo
            del ops[start:]
            R, k = ids.shape
            table = self.rec.fixed((R, k), np.int32)
            record(SlotLookup(self.be.slot_lut.s, table.s, self.rec.miss.s, layer * self.be.slot_lut.width))
            self.rec.by_table_ids[layer] = (ids, table)
        ids.redo = None

    def experts(self, layer: int, x: Val, ids: Val, w: Val, glu=None) -> Val:
        R, k = ids.shape
        tensors = self.be.expert_tensors(layer)
        gate = tensors[0]
        dim, F = x.width, gate.shape[1]
        pp = self.rec.pauses[-1] if self.rec.pauses and self.rec.pauses[-1].layer == layer else None
        index = ids
        if self.be.streamed(layer):
            if pp is not None:
                index = pp.table = self.rec.fixed((R, k), np.int32)
            elif layer in self.rec.by_table_ids:
                index = self.rec.by_table_ids[layer][1]
            else:
                raise VulkanKernelError(f"layer {layer}: streamed experts without a pause point")
        if pp is not None:  # kept by pp.record_experts for passes at replay: one set for every pause layer
            g, u, h = (self.rec.shared(i, (R, k, F)) for i in range(3))
        else:
            g, u, h = self._new((R, k, F)), self._new((R, k, F)), self._new((R, k, F))
        y = self._new((R, dim))
        K = self.k
        biases = None  # gpt-oss: the parts' biases (by expert id, resident), with the clamped SwiGLU
        if glu is not None:
            biases = [self.be.consts.vec(f"blk.{layer}.{p}.bias") for p in ("ffn_gate_exps", "ffn_up_exps",
                                                                             "ffn_down_exps")]

        def record(seq, ts, idx: Val, accumulate: bool, out: Optional[Slice] = None) -> None:
            gt, ut, dt = ts
            E = self.cfg.n_experts  # not the pool's slots: streamed runs the kernels resident does
            K.mul_mv_id(seq, gt, x.s, g.s, idx.s, w.s, R, k, dim, 0, F, n_experts=E)  # [R, k, F]
            K.mul_mv_id(seq, ut, x.s, u.s, idx.s, w.s, R, k, dim, 0, F, n_experts=E)
            if biases is None:
                K.elementwise(seq, "swiglu", g.s, u.s, h.s, R * k * F)
            else:
                K.expert_glu_oai(seq, g.s, u.s, ids.s, biases[0], biases[1], h.s, R * k, F, *glu)
            K.mul_mv_id(seq, dt, h.s, out or y.s, idx.s, w.s, R, k, k * F, F, dim, mode="sum",
                        accumulate=accumulate, n_experts=E)  # [R, dim]
            if biases is not None:  # weighted as the products are (row-group passes zero the others' weights)
                K.expert_down_bias(seq, out or y.s, ids.s, w.s, biases[2], R, k, dim)

        start = len(self.seq.ops)
        record(self.seq, tensors, index, False)
        if pp is not None:
            pp.weights, pp.y, pp.span, pp.record_experts = w, y, (start, len(self.seq.ops)), record
        # Not where passes over row groups accumulate into y itself, nor over several parts, nor
        # with down biases (x + (S + B) whether streamed or not: the same bits).
        if (pp is None or pp.table is None) and len(tensors[2].parts) == 1 and biases is None:
            y.redo = (start, len(self.seq.ops), lambda out, acc: record(self.seq, tensors, index, acc, out))
        return y

    def shared_expert(self, layer: int, x: Val) -> Val:
        """sigmoid(x . w_gate) * down(silu(gate(x)) * up(x)), per row."""
        p = f"blk.{layer}"
        R, S = x.rows, self.cfg.shared_expert_hidden_dim
        h = self.swiglu(self.linear(x, f"{p}.ffn_gate_shexp.weight"), self.linear(x, f"{p}.ffn_up_shexp.weight"))
        sl = self.rec.fixed((R, 2))  # [g, 0] per row: only column 0 is ever written
        self.k.mul_mv(self.seq, self.be.consts.row_tensor(f"{p}.ffn_gate_inp_shexp.weight"), x.s, sl.s, R, x.width, 2)
        sids, swts = self._new((R, 2), np.int32), self._new((R, 2))
        self.k.softmax_topk(self.seq, sl.s, sids.s, swts.s, R, 2, 2, False)  # weight of id 0: sigmoid(g)
        down = self._tensor(f"{p}.ffn_down_shexp.weight")
        if len(down.parts) != 1:
            raise VulkanKernelError(f"{down.name}: a shared expert larger than one binding")
        (part,) = down.parts
        as_expert = DeviceTensor(down.name, down.type_name, (2, *down.shape), (Part(part.slice, 0, 1),))
        y = self._new((R, x.width))

        def record(out: Slice, accumulate: bool) -> None:
            self.k.mul_mv_id(self.seq, as_expert, h.s, out, sids.s, swts.s, R, 2, S, 0, x.width, mode="sum",
                             accumulate=accumulate)

        start = len(self.seq.ops)
        record(y.s, False)
        y.redo = (start, len(self.seq.ops), record)
        return y

    # -- Gated DeltaNet ------------------------------------------------------------------------

    def split(self, x: Val, sizes) -> list[Val]:
        n = x.shape[-1]
        rows, c0, outs = x.size // n, 0, []
        for w in sizes:
            out = self._new((*x.shape[:-1], w))
            self.k.cols(self.seq, x.s, out.s, rows, n, c0, w)
            outs.append(out)
            c0 += w
        return outs

    def sigmoid_gate(self, x: Val, gate: Val) -> Val:
        return self._elementwise("sigmoid_mul", x, gate.s)

    def ssm_conv(self, layer: int, x: Val, name: str) -> Val:
        R, C = x.shape
        out = self._new((R, C))
        self.k.ssm_conv(self.seq, x.s, self.rec.kv.conv_slice(layer), self.be.consts.vec(name), out.s, R, C,
                        self.cfg.ssm_conv_kernel)
        return out

    def gdn_gates(self, b: Val, a: Val, dt: str, A: str):
        R, H = b.rows, b.width
        beta, g = self._new((R, H)), self._new((R, H))
        self.k.gdn_gates(self.seq, b.s, a.s, self.be.consts.vec(dt), self.be.consts.vec(A), beta.s, g.s, R, H)
        return beta, g

    def delta_rule(self, layer: int, q: Val, k: Val, v: Val, g: Val, beta: Val, eps: float, tiled: bool = False) -> Val:
        R, Hk, D = q.shape
        Hv = v.shape[1]
        out = self._new((R, Hv, D))
        # a prompt chunk: the chunked form (see Kernels.delta_chunk_min_rows); decode / verify rows: one step per row
        step = self.k.delta_chunk if 0 < self.k.delta_chunk_min_rows <= R else self.k.delta_rule
        step(self.seq, q.s, k.s, v.s, g.s, beta.s, self.rec.kv.state_slice(layer), out.s, R, Hk, Hv, D, eps, tiled)
        return out

    def last_row(self, x: Val) -> Val:
        off = (x.rows - 1) * x.width * 4
        if off % self.be.dev.info.min_storage_buffer_offset_alignment == 0:
            return Val(Slice(x.s.buffer, x.s.offset + off, x.width * 4), (1, *x.shape[1:]), base=x)
        out = self._new((1, *x.shape[1:]))
        self.seq.copy(Slice(x.s.buffer, x.s.offset + off, x.width * 4), Slice(out.s.buffer, out.s.offset, x.width * 4))
        return out


class Recording:
    """One model forward over R rows against one KV storage, recorded once and replayed."""

    def __init__(self, be, model, kv: DeviceKV, R: int, last_only: bool, pause_layers: frozenset,
                 observe: bool = False, by_table: bool = False):
        self.be, self.model, self.cfg, self.kv = be, model, model.cfg, kv
        self.dev, self.R, self.last_only, self.pause_layers = be.dev, R, last_only, pause_layers
        self.observe = observe  # keep every MoE layer's ids and logits for an observing hook
        self.observed: list[tuple[int, Val, Val]] = []
        # by_table: streamed layers with no pause point read the pool's slots through its table
        # (the router writes the slot table); a step that routed to an expert not there is
        # refused (run() returns None) and run again with pauses.
        self.by_table = by_table
        self.by_table_ids: dict[int, tuple[Val, Val]] = {}  # layer -> (ids, slot table), kept for touch()
        self.arena = be.arena
        self._bufs: list[Buffer] = []
        self._shared: dict[tuple, Val] = {}  # see shared()
        self.collector = self.dev.sequence()
        self.arena.clock = lambda: len(self.collector.ops)
        self.pauses: list[PausePoint] = []
        self.segments = []
        self._chain: Optional[list] = None  # GreedyChain's parts (chain())
        self.n_replays = 0
        try:
            tok, pos = self.fixed((R,), np.int32), self.fixed((R,), np.int32)
            self.tok, self.pos = tok.s, pos.s
            self._tok, self._pos = tok.host(), pos.host()
            if by_table:  # set by a router that found an expert outside the pool
                self.miss = self.fixed((1,), np.int32)
                self._miss = self.miss.host()
            self._rows = np.arange(R, dtype=np.int32)
            self.logits = model.schedule(Recorder(self), last_only)  # [R or 1, vocab]
            # then the forward's check of its logits: the host reads one word, not the rows
            self.body = len(self.collector.ops)
            bad = self.fixed((1,), np.int32)
            self._bad = bad.host()
            be.k.nonfinite(self.collector, self.logits.s, bad.s, self.logits.size)
            self.arena.clock = lambda: 1 << 62  # between recordings every free buffer may be taken
            self._logits = self.logits.host()
            ops = self.collector.ops
            cuts = [0] + [pp.at for pp in self.pauses] + [len(ops)]
            for a, b in zip(cuts, cuts[1:]):
                self.segments.append(self._sequence(ops[a:b]))
        except Exception:
            self.close()
            raise
        be.recordings += 1
        log.info("vulkan: recorded %s rows=%d: %d dispatches in %d segments, KV capacity %d", model.cfg.arch, R,
                 len(ops), len(self.segments), kv.capacity)

    def fixed(self, shape, dtype=np.float32) -> Val:
        """A zeroed buffer of this recording's own (inputs, outputs the host reads or writes)."""
        n = max(16, (int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize + 15) // 16 * 16)
        b = self.dev.buffer(n)
        b.write(np.zeros(n, np.uint8))
        self._bufs.append(b)
        return Val(b.slice(0, n), shape, dtype)

    def shared(self, n: int, shape, dtype=np.float32) -> Val:
        """The n-th buffer of this shape that every pause layer's expert ops use (layers run one
        at a time). Their ops are kept to be recorded again at replay (passes over row groups),
        so buffers from the arena would never go back: 3 of [R, k, F] a streamed layer, 555 MiB
        at 96 rows on the 30B-A3B shape (48 layers), which the memory plan does not count."""
        key = (n, tuple(shape), np.dtype(dtype).str)
        if key not in self._shared:
            self._shared[key] = self.fixed(shape, dtype)
        return self._shared[key]

    def _sequence(self, ops):
        seq = self.dev.sequence()
        seq.ops = list(ops)
        seq.record()
        return seq

    # -- replay ------------------------------------------------------------------------

    def run(self, tokens: np.ndarray, start: int, pauses: Pauses = NO_PAUSES, pool=None) -> Optional[np.ndarray]:
        """Forward tokens [R] at positions start..start+R-1, the pause points served by `pauses`
        (pause.py) and the pool; returns logits (a copy), or None where a step by the slot
        table routed to an expert the pool did not hold (nothing was called or counted: the
        caller runs the rows again with pauses, over what this step wrote). `finite()` then
        says whether every logit is finite."""
        self._bad[0] = 0
        if self.R == 1:  # (a decode step: item writes cost less than the array ops)
            self._tok[0], self._pos[0] = tokens[0], start
        else:
            self._tok[:] = tokens
            np.add(self._rows, start, out=self._pos)
        # Work a hook put off, done while the device runs; not on a CPU device, whose threads
        # it slows (lavapipe, qwen3moe-f32: a routing trace's formatting there made a 1.8 ms
        # step 230-270 us longer than leaving it to TraceWriter.BATCH).
        drain = None if self.dev.info.type == "cpu" else pauses.drain
        if self.by_table:
            self._miss[0] = 0
            self._first(drain)
            if self._miss[0]:
                return None
            # (a few ids a layer: a set is faster than np.unique)
            pool.touch([(layer, sorted(set(ids.host().ravel().tolist()))) for layer, (ids, _) in self.by_table_ids.items()])
            self.n_replays += 1
            self._observed(pauses)
            return self._logits.copy()
        held = None
        pauses.begin(self.R)
        predicting = pauses.predicting  # (off: no copies of h, ids and logits to make)
        if predicting:
            kv = self.kv
            frozen: dict = {}  # recurrent layers ahead: their state before this step, read before the device moves it
            ctx = PauseContext(start, self.R, lambda l: kv.keys[l], lambda l: kv.values[l],
                               frozen.__getitem__ if self.cfg.recurrent_layers else None)
        # Experts still pinned for a segment that has finished: released after the next
        # submission, so that the host's work between two segments (the device idle) is only
        # what the next one needs (unless this layer's experts need those slots: _at_pause).
        done = [None]
        try:
            self._first(drain)
            for pp, seg in zip(self.pauses, self.segments[1:]):
                if predicting:  # read now: the next segment adds into h in place
                    hs, hshape, hdtype = pp.h
                    h = hs.buffer.view(hdtype, hshape, hs.offset).copy()
                    ids, logits = pp.ids.host().astype(np.int64), pp.logits.host().copy()
                    frozen.clear()
                    for l in pauses.states_ahead(pp.layer):
                        frozen[l] = _StateCopy(kv.conv[l].copy(), kv.state[l].copy())
                done[0], held = held, None
                held, seg = self._at_pause(pp, pauses, pool, seg, done)
                seg.submit()
                if done[0] is not None:
                    pool.release(*done[0])
                    done[0] = None
                if predicting:  # the host ranks the next layers while the device runs
                    pauses.predict(ctx, pp.layer, ids, logits, h)
                seg.wait()
        finally:
            for pinned in (held, done[0]):
                if pinned is not None:
                    pool.release(*pinned)
        self.n_replays += 1
        self._observed(pauses)
        return self._logits.copy()

    def step(self, token: int, start: int) -> np.ndarray:
        """run() of a one-row recording with no pause points, hook or predictor: logits (a copy)."""
        self._bad[0] = 0
        self._tok[0], self._pos[0] = token, start
        seg = self.segments[0]
        seg.submit()
        seg.wait()
        self.n_replays += 1
        return self._logits.copy()

    def finite(self) -> bool:
        """Whether the logits of the last run are free of NaN and inf (the device checked)."""
        return not self._bad[0]

    def _first(self, drain) -> None:
        """Run the first segment; meanwhile the hook's put-off work, if any."""
        self.segments[0].submit()
        try:
            if drain is not None:
                drain()
        finally:
            self.segments[0].wait()

    def _observed(self, pauses: Pauses) -> None:
        """An observing hook's calls, after the step: every MoE layer's routing, kept by the recording."""
        for layer, ids, logits in self.observed:
            pauses.observe(layer, ids.host().astype(np.int64), logits.host().copy())

    def _at_pause(self, pp: PausePoint, pauses: Pauses, pool, seg, done: list):
        """The host's turn at a pause point: the hook, then the pool. Returns (what to release
        after the next segment, the segment to run next). done[0]: (layer, experts) the last
        segment read, which the caller releases after the next submission; released here first
        (and set to None) where this layer's experts might need their slots."""
        ids = pp.ids.host()  # [R, k] int32, in mapped memory
        if pauses.hook_acts:
            pauses.at_pause(pp.layer, ids.astype(np.int64), pp.logits.host().copy())
        if pp.table is None:
            return None, seg
        layer, table = pp.layer, pp.table.host()
        experts = sorted(set(ids.ravel().tolist()))  # (a decode step's 8 ids: faster than np.unique)
        cap = pool.capacity(layer)
        if done[0] is not None and len(done[0][1]) + len(experts) > cap:
            pool.release(*done[0])
            done[0] = None
        if len(experts) <= cap:
            slots = pool.acquire(layer, experts)
            table[:] = _slot_table(ids, experts, slots)
            return (layer, experts), seg
        # More experts than the pool pins at once: passes over row groups, then the rest.
        weights = pp.weights.host()
        w0 = weights.copy()
        pp.y.host().fill(0)
        k = ids.shape[1]
        for r0, r1 in _row_groups(ids, max(cap, k)):
            group = [int(e) for e in np.unique(ids[r0:r1])]
            weights[:] = 0
            weights[r0:r1] = w0[r0:r1]
            if len(group) <= cap:
                slots = pool.acquire(layer, group)
                try:
                    table[:] = slots[0]
                    table[r0:r1] = _slot_table(ids[r0:r1], group, slots)
                    self._solo(pp, self.be.expert_tensors(layer)).run()
                finally:
                    pool.release(layer, group)
            else:  # fewer slots than one row's top-k: copy them into staging, cap at a time
                stage, tensors = self.be.stage(layer, len(group))
                for g0 in range(0, len(group), cap):
                    part = group[g0 : g0 + cap]
                    slots = pool.acquire(layer, part)
                    try:
                        for j, slot in enumerate(slots):
                            for name, arr in stage.items():
                                arr[g0 + j] = pool.slot_view(layer, slot, name)
                    finally:
                        pool.release(layer, part)
                table[:] = 0
                table[r0:r1] = _slot_table(ids[r0:r1], group, list(range(len(group))))
                self._solo(pp, tensors).run()
        if pp.post is None:
            i = self.pauses.index(pp)
            end = self.pauses[i + 1].at if i + 1 < len(self.pauses) else len(self.collector.ops)
            pp.post = self._sequence(self.collector.ops[pp.span[1] : end])
        return None, pp.post

    def _solo(self, pp: PausePoint, tensors):
        """The layer's expert ops alone, over `tensors`, accumulating into its output."""
        key = tuple(id(t) for t in tensors)
        seq = pp.solo.get(key)
        if seq is None:
            for old in pp.solo.values():  # staging grew: the old tensors are gone
                old.close()
            pp.solo = {}
            seq = self.dev.sequence()
            pp.record_experts(seq, tensors, pp.table, True)
            seq.record()
            pp.solo[key] = seq
        return seq

    def chain(self) -> list:
        """[(sequence, fence, host view of its (token, non-finite) output)] x 2: this one-row,
        one-segment step twice, each ending in the greedy tail (the next token and position
        written for the next replay), each with an output and a fence of its own (built once)."""
        if self._chain is None:
            if self.R != 1 or len(self.segments) != 1 or self.by_table:
                raise ValueError("a greedy chain replays a one-row step with no pause points")
            parts = self._chain = []
            for _ in range(2):
                out = self.fixed((2,), np.int32)
                tail = self.dev.sequence()
                self.be.k.greedy_next(tail, self.logits.s, self.tok, self.pos, out.s, self.cfg.vocab_size)
                parts.append((self._sequence(self.collector.ops[: self.body] + tail.ops), Fence(self.dev), out.host()))
        return self._chain

    def close(self) -> None:
        if self._chain is not None:
            # a chain's queued step may still be running (a generator left suspended, then the
            # storage grown or the model closed): nothing it writes is freed under it
            self.dev.vk.vkDeviceWaitIdle(self.dev.handle)
            for seq, fence, _ in self._chain:
                seq.close()
                fence.destroy()
        self._chain = None
        for s in self.segments:
            s.close()
        for pp in self.pauses:
            for s in pp.solo.values():
                s.close()
            if pp.post is not None:
                pp.post.close()
        self.segments, self.pauses = [], []
        self.logits = None
        self.by_table_ids = {}
        self.collector.close()
        for b in self._bufs:
            b.destroy()
        self._bufs = []


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


class _StateCopy:
    """A recurrent layer's conv history and state as they were at a pause point (host copies)."""

    def __init__(self, conv: np.ndarray, state: np.ndarray):
        self.conv, self.state = conv, state


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
    lut = np.zeros(max(experts) + 1, np.int32)
    lut[experts] = slots
    return lut[ids]


class _held_interrupts:
    """Ctrl-C held until a chunk's forward completes, where the recurrent state is updated in
    place on the device: an interrupt between its submission and the position moving on would
    leave state and position apart. (Main thread only; elsewhere nothing is held.)"""

    def __init__(self, on: bool):
        self.on, self.got, self.old = on, None, None

    def __enter__(self):
        import signal
        import threading

        if self.on and threading.current_thread() is threading.main_thread():
            self.old = signal.signal(signal.SIGINT, lambda *a: setattr(self, "got", a))
        return self

    def __exit__(self, *exc):
        import signal

        if self.old is not None:
            signal.signal(signal.SIGINT, self.old)
            if self.got is not None and exc[0] is None and callable(self.old):
                self.old(*self.got)  # the interrupt, now that the step is whole
        return False


# -- the runner: which recording a forward replays -----------------------------------------------


class GraphRunner:
    """Per-backend state: the KV storages and, per storage, its recordings."""

    def __init__(self, be):
        self.be = be
        self.storages: list[DeviceKV] = []
        # Steps with no pause over streamed experts (Recording.by_table; off: every streamed layer
        # pauses): tried after `_calm_needed` steps in a row whose every expert was a hit; a
        # refused try doubles how many it waits for.
        self.pool_table_steps = True
        self._calm, self._calm_needed = 0, 1
        self.table_steps, self.table_steps_refused = 0, 0  # (counts: the tests and benches read them)

    def make_cache(self, cfg, capacity: int = 0, swa_rows: int = SWA_ROWS) -> DeviceCache:
        want = max(int(capacity), 1)
        free = [s for s in self.storages if not s.in_use and s.cfg is cfg and s.swa_rows == swa_rows]
        pick = next((s for s in free if s.capacity >= want), None)
        for s in free:  # idle storages that will not be reused: give their memory back
            if s is not pick:
                self.storages.remove(s)
                s.destroy()
        if pick is None:  # positions past a reused storage's length are never read: no clearing
            pick = DeviceKV(self.be.dev, cfg, int(capacity) if capacity else MIN_CAPACITY, swa_rows)
            self.storages.append(pick)
        return DeviceCache(pick)

    def forward(self, model, ids: np.ndarray, cache: DeviceCache, pauses: Pauses = NO_PAUSES,
                last_only: bool = False) -> tuple[np.ndarray, bool]:
        """(logits, whether all are finite): see NumpyBackend.forward."""
        cfg = model.cfg
        if not isinstance(cache, DeviceCache) or cache.storage.cfg is not cfg:
            raise ValueError("this cache was not made by this network on the Vulkan backend (use model.new_cache() "
                             "or model.net.make_cache())")
        n = len(ids)
        if n == 0:
            return np.zeros((0, cfg.vocab_size), np.float32), True
        kv = cache.storage
        if cache.offset + n > kv.capacity:
            kv.grow(cache.offset + n)
        if n == 1 and pauses.hook is None and pauses.predictor is None and self._host_free(cfg):
            return self._step(model, kv, cache, int(ids[0]))  # a resident decode step: the short way
        with np.errstate(all="ignore"):  # (a predictor's and a hook's host math: see NumpyBackend.forward)
            return self._forward(model, ids, cache, pauses, last_only)

    def _forward(self, model, ids: np.ndarray, cache: DeviceCache, pauses: Pauses,
                 last_only: bool) -> tuple[np.ndarray, bool]:
        cfg, kv, n = model.cfg, cache.storage, len(ids)
        # A hook that only observes (pauses.observing, e.g. a routing trace) is called after the
        # step with every layer's ids; a client that acts pauses every MoE layer.
        layers = pauses.layers(cfg, self.be.streamed_layers)
        observe = pauses.observing
        # All-row logits are one binding: keep it under the device's limit.
        limit = MAX_ROWS if last_only else max(1, min(MAX_ROWS, self.be.dev.info.max_storage_buffer_range
                                                       // (4 * cfg.vocab_size)))
        limit = min(limit, kv.forward_rows)  # a ring's rows must still hold what they read
        rings = [cache[i] for i in kv.rings]
        # Steps by the slot table: only where the pauses are the pool's alone (no client acts),
        # for decode and verify rows (a prompt chunk's many experts would often miss, and a
        # refused chunk costs a chunk), and not over recurrent state (a refused step would
        # have moved it).
        pool = self.be.pool
        by_table = (self.pool_table_steps and pool is not None and bool(layers) and not pauses.acting
                    and not cfg.recurrent_layers)
        out, s, finite = [], 0, True
        for R in row_chunks(n, limit):  # with last_only, every chunk's head runs on its last row only
            for c in rings:
                c.advance(cache.offset, R)
            logits = None
            if by_table and R <= EXACT_ROWS and self._calm >= self._calm_needed:
                rec = self._recording(model, kv, R, last_only, NO_PAUSE_LAYERS, observe, by_table=True)
                logits = rec.run(ids[s : s + R], cache.offset, pauses, pool)
                self.table_steps += 1
                if logits is None:  # an expert outside the pool: with pauses, below
                    self.table_steps_refused += 1
                    self._calm, self._calm_needed = 0, min(2 * self._calm_needed, 64)
                else:
                    self._calm_needed = 1
            if logits is None:
                rec = self._recording(model, kv, R, last_only, layers, observe)
                misses = pool.stats.demand_misses if by_table else 0
                with _held_interrupts(bool(cfg.recurrent_layers)):
                    logits = rec.run(ids[s : s + R], cache.offset, pauses, pool)
                    cache.offset += R
                if by_table:
                    self._calm = self._calm + 1 if pool.stats.demand_misses == misses else 0
            else:
                cache.offset += R
            s += R
            out.append(logits)
            finite = finite and rec.finite()
        return out[-1] if last_only or len(out) == 1 else np.concatenate(out), finite

    def _host_free(self, cfg) -> bool:
        """Whether a forward with no pause client needs nothing of the host between submission
        and logits: every layer resident, no recurrent state (whose chunks hold Ctrl-C, and
        which a trim cannot undo). `_step` and `greedy_chain` rest on it."""
        return not self.be.streamed_layers and not cfg.recurrent_layers

    def _step(self, model, kv: DeviceKV, cache: DeviceCache, token: int) -> tuple[np.ndarray, bool]:
        """forward() of one row with nothing to pause for, observe or hold (every layer
        resident, no hook, predictor or recurrent state): the same recording, replayed with
        none of the bookkeeping those need (a decode step's host time is a share of its own)."""
        rec = self._recording(model, kv, 1, False, NO_PAUSE_LAYERS)
        at = cache.offset
        for i in kv.rings:
            cache[i].advance(at, 1)
        logits = rec.step(token, at)
        cache.offset = at + 1
        return logits, rec.finite()

    def greedy_chain(self, model, cache, limit: Optional[int] = None) -> Optional[GreedyChain]:
        """Greedy decoding a step ahead on the device (GreedyChain), where a step needs nothing
        of the host but its token: every layer resident, no predictor, and no recurrent state
        (the step queued past the last token kept is undone by a trim). Else None."""
        if not isinstance(cache, DeviceCache) or cache.storage.cfg is not model.cfg:
            return None
        return GreedyChain(self, model, cache, limit) if self._host_free(model.cfg) else None

    def _recording(self, model, kv: DeviceKV, R: int, last_only: bool, layers: frozenset,
                   observe: bool = False, by_table: bool = False) -> Recording:
        last_only = last_only and R > 1  # one row: the same forward either way
        chunked = 0 < self.be.k.delta_chunk_min_rows <= R  # the delta rule's kernel is recorded in
        key = (id(model), R, last_only, layers, observe, chunked, by_table)
        rec = kv.recordings.get(key)
        if rec is None:
            rec = kv.recordings[key] = Recording(self.be, model, kv, R, last_only, layers, observe, by_table)
        return rec

    def close(self) -> None:
        for s in self.storages:
            s.destroy()
        self.storages = []
