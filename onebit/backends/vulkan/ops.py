"""Each Vulkan kernel numpy-in / numpy-out, with the same signature as its twin in `reference`.

Inputs are uploaded to fresh buffers, outputs are allocated poisoned (NaN, or -1 for ids) so
an element a kernel forgot to write fails the comparison, one sequence is recorded and run,
and everything is freed again. This is the test harness and the bench's way in; the backend
keeps its tensors on the device instead.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from .device import Buffer, Device, Slice, default_device
from .kernels import DeviceTensor, Kernels, SlotLookup, WeightStore


class VulkanOps:
    def __init__(self, dev: Optional[Device] = None, reduce: Optional[str] = None,
                 max_part_bytes: Optional[int] = None):
        """max_part_bytes: bind weights in parts of at most this many bytes (tests use it to
        exercise the split that tensors larger than maxStorageBufferRange need)."""
        self.dev = dev or default_device()
        self.k = Kernels(self.dev, reduce)
        self.max_part_bytes = max_part_bytes
        self._temps: list[Buffer] = []

    # -- plumbing -------------------------------------------------------------------------

    def _in(self, a: np.ndarray, dtype=np.float32) -> Slice:
        a = np.ascontiguousarray(a, dtype=dtype)
        buf = self.dev.buffer(a.nbytes)
        buf.write(a)
        self._temps.append(buf)
        return buf.slice(0, max(a.nbytes, 16))

    def _out(self, shape, dtype=np.float32) -> tuple[Slice, tuple, np.dtype]:
        dtype = np.dtype(dtype)
        n = int(np.prod(shape)) * dtype.itemsize
        buf = self.dev.buffer(n)
        poison = np.full(int(np.prod(shape)), np.nan if dtype.kind == "f" else -1, dtype)
        buf.write(poison)
        self._temps.append(buf)
        return buf.slice(0, max(n, 16)), tuple(shape), dtype

    def _weights(self, w_raw: np.ndarray, type_name: str, shape) -> DeviceTensor:
        store = WeightStore(self.dev, self.max_part_bytes)
        store.add("w", w_raw, type_name, shape)
        (t,) = store.commit()
        self._temps.extend(store.buffers)
        return t

    def _run(self, record, *outs):
        seq = self.dev.sequence()
        try:
            record(seq)
            seq.run()
            res = tuple(o[0].buffer.read(o[2], o[1], o[0].offset) for o in outs)
        finally:
            seq.close()
            for b in self._temps:
                b.destroy()
            self._temps = []
        return res[0] if len(res) == 1 else res

    @staticmethod
    def _shape(w_raw: np.ndarray, type_name: str) -> tuple[int, ...]:
        from .kernels import QTYPES_BY_NAME

        cls = QTYPES_BY_NAME[type_name]
        return (*w_raw.shape[:-1], w_raw.shape[-1] // cls.type_size * cls.block_size)

    # -- kernels (signatures as in reference.py) ---------------------------------------------

    def mul_mv(self, w_raw: np.ndarray, type_name: str, x: np.ndarray) -> np.ndarray:
        shape = self._shape(w_raw, type_name)
        R, n_in = x.shape
        w = self._weights(w_raw, type_name, shape)
        xs, y = self._in(x), self._out((R, shape[0]))
        return self._run(lambda s: self.k.mul_mv(s, w, xs, y[0], R, n_in, shape[0]), y)

    def mul_mm(self, w_raw: np.ndarray, type_name: str, x: np.ndarray) -> np.ndarray:
        shape = self._shape(w_raw, type_name)
        R, n_in = x.shape
        w = self._weights(w_raw, type_name, shape)
        xs, y = self._in(x), self._out((R, shape[0]))
        return self._run(lambda s: self.k.mul_mm(s, w, xs, y[0], R, n_in, shape[0]), y)

    def mul_mv_id(self, w_raw: np.ndarray, type_name: str, x: np.ndarray, ids: np.ndarray,
                  wts: Optional[np.ndarray] = None, mode: str = "slots") -> np.ndarray:
        shape = self._shape(w_raw, type_name)  # [E, out, in]
        R, k = ids.shape
        n_in = shape[-1]
        w = self._weights(w_raw, type_name, shape)
        xs = self._in(x)
        x_stride, x_slot = (n_in, 0) if x.ndim == 2 else (k * n_in, n_in)
        ids_s = self._in(ids, np.int32)
        wts_s = self._in(wts if wts is not None else np.ones((R, k), np.float32))
        y = self._out((R, shape[1]) if mode == "sum" else (R, k, shape[1]))
        return self._run(lambda s: self.k.mul_mv_id(s, w, xs, y[0], ids_s, wts_s, R, k, x_stride, x_slot, shape[1],
                                                    mode), y)

    def get_rows(self, w_raw: np.ndarray, type_name: str, ids: np.ndarray) -> np.ndarray:
        shape = self._shape(w_raw, type_name)
        w = self._weights(w_raw, type_name, shape)
        ids_s = self._in(ids, np.int32)
        out = self._out((len(ids), shape[-1]))
        return self._run(lambda s: self.k.get_rows(s, w, ids_s, out[0], len(ids), shape[-1]), out)

    def rms_norm(self, x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
        n = x.shape[-1]
        rows = x.size // n
        xs, ws, out = self._in(x), self._in(w), self._out(x.shape)
        return self._run(lambda s: self.k.rms_norm(s, xs, ws, out[0], rows, n, eps), out)

    def rope(self, x: np.ndarray, pos: np.ndarray, n_rot: int, theta: float, neox: bool,
             scale: float = 1.0, factors: Optional[np.ndarray] = None) -> np.ndarray:
        R, H, D = x.shape
        xs, ps, out = self._in(x), self._in(pos, np.int32), self._out(x.shape)
        fs = self._in(factors) if factors is not None else None
        return self._run(lambda s: self.k.rope(s, xs, ps, out[0], R, H, D, n_rot, theta, neox, scale,
                                               factors=fs), out)

    def router(self, logits: np.ndarray, k: int, norm: bool, lut: Optional[np.ndarray] = None, layer: int = 0):
        """ids, weights; with lut ([layers, E] pool slots or -1) also the slot table and the miss flag."""
        R, E = logits.shape
        ls = self._in(logits)
        ids, wts = self._out((R, k), np.int32), self._out((R, k))
        look, extra = self._slot_lut(lut, layer, R, k)
        return self._run(lambda s: self.k.softmax_topk(s, ls, ids[0], wts[0], R, E, k, norm, lut=look), ids, wts,
                         *extra)

    def sigmoid_router(self, logits: np.ndarray, bias: Optional[np.ndarray], k: int, norm: bool, scale: float = 1.0,
                       groups: int = 1, groups_used: int = 1, lut: Optional[np.ndarray] = None, layer: int = 0):
        R, E = logits.shape
        ls = self._in(logits)
        bs = self._in(bias) if bias is not None else None
        ids, wts = self._out((R, k), np.int32), self._out((R, k))
        look, extra = self._slot_lut(lut, layer, R, k)
        return self._run(lambda s: self.k.sigmoid_topk(s, ls, bs, ids[0], wts[0], R, E, k, norm, scale, groups,
                                                       groups_used, lut=look), ids, wts, *extra)

    def _slot_lut(self, lut: Optional[np.ndarray], layer: int, R: int, k: int):
        """The routers' SlotLookup over a host table, and the outputs it adds (table, miss flag)."""
        if lut is None:
            return None, ()
        table, miss = self._out((R, k), np.int32), self._in(np.zeros(1, np.int32), np.int32)
        look = SlotLookup(self._in(lut, np.int32), table[0], miss, layer * lut.shape[1])
        return look, (table, (miss, (1,), np.dtype(np.int32)))

    def _binary(self, op: str, a: np.ndarray, b: Optional[np.ndarray]) -> np.ndarray:
        a_s = self._in(a)
        b_s = self._in(b) if b is not None else None
        out = self._out(a.shape)
        nb = b.size if b is not None else None
        return self._run(lambda s: self.k.elementwise(s, op, a_s, b_s, out[0], a.size, nb), out)

    def add(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return self._binary("add", a, b)

    def mul(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return self._binary("mul", a, b)

    def silu(self, a: np.ndarray) -> np.ndarray:
        return self._binary("silu", a, None)

    def swiglu(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return self._binary("swiglu", a, b)

    def geglu(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return self._binary("geglu", a, b)

    def softcap(self, a: np.ndarray, cap: float) -> np.ndarray:
        return self._binary("softcap", a, np.array([cap], np.float32))

    def argmax(self, x: np.ndarray) -> np.ndarray:
        n = x.shape[-1]
        rows = x.size // n
        xs, out = self._in(x), self._out(x.shape[:-1], np.int32)
        return self._run(lambda s: self.k.argmax(s, xs, out[0], rows, n), out)

    def greedy_next(self, logits: np.ndarray, pos: int) -> tuple[int, int, int, bool]:
        n = logits.shape[-1]
        xs = self._in(logits)
        tok, p, out = self._out((1,), np.int32), self._in(np.array([pos], np.int32), np.int32), self._out((2,), np.int32)
        pos_out = (p, (1,), np.dtype(np.int32))
        got_tok, got_pos, got = self._run(lambda s: self.k.greedy_next(s, xs, tok[0], p, out[0], n), tok, pos_out, out)
        return int(got_tok[0]), int(got_pos[0]), int(got[0]), bool(got[1])

    def nonfinite(self, x: np.ndarray) -> bool:
        xs, flag = self._in(x), self._in(np.zeros(1, np.int32), np.int32)  # (zeroed, as a forward does)
        return bool(self._run(lambda s: self.k.nonfinite(s, xs, flag, x.size), (flag, (1,), np.dtype(np.int32)))[0])

    def attention(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, q_pos: np.ndarray, window: int = 0,
                  scale: Optional[float] = None, sinks: Optional[np.ndarray] = None) -> np.ndarray:
        R, H, D = q.shape
        S, Hkv, Dv = v.shape
        qs, ks, vs, ps = self._in(q), self._in(k), self._in(v), self._in(q_pos, np.int32)
        ss = self._in(sinks) if sinks is not None else None
        out = self._out((R, H * Dv))
        return self._run(lambda s: self.k.attention(s, qs, ks, vs, ps, out[0], R, H, Hkv, D, Dv, S, window, scale,
                                                    ss), out)

    def expert_glu_oai(self, g: np.ndarray, u: np.ndarray, ids: np.ndarray, bg: np.ndarray, bu: np.ndarray,
                       alpha: float, limit: float) -> np.ndarray:
        R, k, F = g.shape
        gs, us, ids_, bgs, bus = self._in(g), self._in(u), self._in(ids, np.int32), self._in(bg), self._in(bu)
        out = self._out((R, k, F))
        return self._run(lambda s: self.k.expert_glu_oai(s, gs, us, ids_, bgs, bus, out[0], R * k, F, alpha, limit),
                         out)

    def expert_down_bias(self, y: np.ndarray, ids: np.ndarray, wts: np.ndarray, bd: np.ndarray) -> np.ndarray:
        (R, k), dim = ids.shape, y.shape[1]
        ys = self._in(y)  # not poisoned: the biases are added to it
        out = (ys, y.shape, np.dtype(np.float32))
        ids_, ws, bds = self._in(ids, np.int32), self._in(wts), self._in(bd)
        return self._run(lambda s: self.k.expert_down_bias(s, ys, ids_, ws, bds, R, k, dim), out)

    def set_rows(self, dst: np.ndarray, src: np.ndarray, pos: np.ndarray, wrap: bool = False) -> np.ndarray:
        n = int(np.prod(dst.shape[1:]))
        d = self._in(dst)  # not poisoned: rows not in pos must keep their values
        out = (d, dst.shape, np.dtype(np.float32))
        ss, ps = self._in(src), self._in(pos, np.int32)
        rows = len(dst) if wrap else 0
        return self._run(lambda s: self.k.set_rows(s, ss, ps, d, len(pos), n, dst_rows=rows), out)

    def set_rows_q(self, dst: np.ndarray, src: np.ndarray, pos: np.ndarray, type_name: str,
                   wrap: bool = False) -> np.ndarray:
        row_bytes = dst.shape[1]
        d = self._in(np.concatenate([dst.reshape(-1), np.zeros(-dst.size % 4, np.uint8)]).view(np.uint32), np.uint32)
        out = (d, dst.shape, np.dtype(np.uint8))
        ss, ps = self._in(src), self._in(pos, np.int32)
        rows = len(dst) if wrap else 0
        return self._run(lambda s: self.k.set_rows_q(s, ss, ps, d, len(pos), src.shape[1], type_name, row_bytes,
                                                     dst_rows=rows), out)

    def hadamard(self, x: np.ndarray, n: int) -> np.ndarray:
        xs, out = self._in(x), self._out(x.shape)
        return self._run(lambda s: self.k.hadamard(s, xs, out[0], x.size, n), out)

    def kv_rows(self, raw: np.ndarray, type_name: str, n: int, last: int) -> np.ndarray:
        """The rows of a KV cache of ggml blocks (uint8 [rows, row bytes]) up to row `last`
        (a forward's last position), decoded: [rows, n]; the others are left unwritten."""
        cs = self._in(np.concatenate([raw.reshape(-1), np.zeros(-raw.size % 4, np.uint8)]).view(np.uint32), np.uint32)
        ids, out = self._in(np.arange(len(raw)), np.int32), self._out((len(raw), n))
        pos = self._in(np.array([last]), np.int32)
        return self._run(lambda s: self.k.kv_rows(s, cs, ids, out[0], len(raw), n, type_name, pos, 1), out)

    # -- Gated DeltaNet (signatures as in reference.py) -------------------------------------

    def cols(self, a: np.ndarray, c0: int, w: int) -> np.ndarray:
        n = a.shape[-1]
        rows = a.size // n
        xs, out = self._in(a), self._out((*a.shape[:-1], w))
        return self._run(lambda s: self.k.cols(s, xs, out[0], rows, n, c0, w), out)

    def sigmoid_mul(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return self._binary("sigmoid_mul", a, b)

    def gdn_gates(self, b: np.ndarray, a: np.ndarray, dt: np.ndarray, A: np.ndarray):
        R, H = b.shape
        bs, as_, ds, As = self._in(b), self._in(a), self._in(dt), self._in(A)
        beta, g = self._out((R, H)), self._out((R, H))
        return self._run(lambda s: self.k.gdn_gates(s, bs, as_, ds, As, beta[0], g[0], R, H), beta, g)

    def ssm_conv(self, x: np.ndarray, hist: np.ndarray, w: np.ndarray):
        R, C = x.shape
        xs, ws = self._in(x), self._in(w)
        hs = self._in(hist)  # not poisoned: read, then moved on in place
        h = (hs, hist.shape, np.dtype(np.float32))
        out = self._out((R, C))
        return self._run(lambda s: self.k.ssm_conv(s, xs, hs, ws, out[0], R, C, w.shape[1]), out, h)

    def delta_rule(self, q, k, v, g, beta, state, eps: float, tiled: bool = False):
        return self._delta(self.k.delta_rule, q, k, v, g, beta, state, eps, tiled)

    def delta_chunk(self, q, k, v, g, beta, state, eps: float, tiled: bool = False, chunk: int = 0):
        return self._delta(self.k.delta_chunk, q, k, v, g, beta, state, eps, tiled, chunk)

    def _delta(self, kernel, q, k, v, g, beta, state, eps: float, *modes):
        """A delta-rule kernel (step or chunked form) over these rows: (out, the state after)."""
        R, Hk, D = q.shape
        Hv = v.shape[1]
        qs, ks, vs, gs, bs = (self._in(a) for a in (q, k, v, g, beta))
        ss = self._in(state)  # read, then updated in place
        st = (ss, state.shape, np.dtype(np.float32))
        out = self._out((R, Hv, D))
        return self._run(lambda s: kernel(s, qs, ks, vs, gs, bs, ss, out[0], R, Hk, Hv, D, eps, *modes), out, st)
