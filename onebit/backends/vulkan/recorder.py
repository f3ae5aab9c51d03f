"""`Recorder`: the ops of models/blocks.py recording dispatches for R rows instead of computing,
and the `PausePoint`s where a recording stops for the host.

The architecture's schedule (onebit/models) is run once against a Recorder; its values are
`arena.Val`s. qwen2moe's shared-expert gate has no kernel of its own: it is a two-way softmax
over [g, 0] (softmax([g, 0])[0] = sigmoid(g)), and the shared expert's down projection runs as
a one-part expert tensor whose second "expert" lies outside the part, so the expert kernel adds
sigmoid(g) * down(h) and skips the other.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from .arena import Val
from .device import Slice, VulkanKernelError
from .kernels import DeviceTensor, Part, SlotLookup


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
        sk = self.be.consts.vec(sinks) if sinks is not None else None
        seqs = self.rec.seqs
        if len(seqs) == 1:
            return self._attend(layer, seqs[0], q, *self._store(layer, seqs[0], k, v), window, scale, sk)
        # Several sequences: each one's rows written into its own cache, then each attending over
        # it with the rows it has alone (all writes first: one barrier between them and the reads).
        stored = {sq.r0: self._store(layer, sq, self._part(k, sq), self._part(v, sq)) for sq in seqs}
        return self._per_sequence((q.rows, q.shape[1] * v.shape[2]), lambda sq, into: self._attend(
            layer, sq, self._part(q, sq), *stored[sq.r0], window, scale, sk, into))

    def _store(self, layer: int, sq, k: Val, v: Val) -> tuple[Val, Val, int, int]:
        """Write sequence sq's rows k [n, Hkv, D] and v [n, Hkv, Dv] into its layer cache at their
        positions; return the keys and values its attention reads ([n_kv, Hkv, D or Dv]: the
        cache itself, or its rows decoded from ggml blocks) and their rotations (0: none)."""
        n, Hkv, D = k.shape
        Dv = v.shape[2]
        kv = sq.kv
        kc, vc = kv.k_slice(layer), kv.v_slice(layer)
        n_kv = kv.rows(layer)  # position p in row p % n_kv (a sliding-window ring wraps)
        if kv.types.plain:
            self.k.set_rows(self.seq, k.s, sq.pos, kc, n, Hkv * D, dst_rows=n_kv)
            self.k.set_rows(self.seq, v.s, sq.pos, vc, n, Hkv * Dv, dst_rows=n_kv)
            return Val(kc, (n_kv, Hkv, D)), Val(vc, (n_kv, Hkv, Dv)), 0, 0
        # ggml blocks: the attention reads every row decoded into float32 scratch
        kf, rk = self._store_blocks(k, kc, kv.types.k, kv.keys[layer], n_kv, sq.pos)  # [n_kv, Hkv, D]
        vf, rv = self._store_blocks(v, vc, kv.types.v, kv.values[layer], n_kv, sq.pos)  # [n_kv, Hkv, Dv]
        return kf, vf, rk, rv

    def _attend(self, layer: int, sq, q: Val, keys: Val, values: Val, rk: int, rv: int, window: int,
                scale: Optional[float], sinks: Optional[Slice], into: Optional[Val] = None) -> Val:
        """Sequence sq's rows q [n, H, D] attending over its layer cache (keys, values as `_store`
        gave them) -> [n, H * Dv], written into `into` where given."""
        n, H, D = q.shape
        n_kv, Hkv, Dv = values.shape
        if rk:  # rotated heads (cache.hadamard_size): q too, so q.k is as before
            turned = self._new(q.shape)
            self.k.hadamard(self.seq, q.s, turned.s, q.size, rk)
            q = turned
        out = into if into is not None and not rv else self._new((n, H * Dv))
        self.k.attention(self.seq, q.s, keys.s, values.s, sq.pos, out.s, n, H, Hkv, D, Dv, n_kv, window, scale, sinks)
        if rv:  # and the output back
            back = into if into is not None else self._new(out.shape)
            self.k.hadamard(self.seq, out.s, back.s, out.size, rv)
            out = back
        return out

    def _store_blocks(self, x: Val, cache: Slice, type_name: str, rows, n_kv: int, pos: Slice) -> tuple[Val, int]:
        """Write rows x [R, Hkv, W] into a layer's K or V cache of ggml blocks (`rows`: its host
        view, KVRows, which says the rotation) at positions `pos`; return every row of it
        decoded, still rotated: [n_kv, Hkv, W], and the rotation (0: none)."""
        R, Hkv, W = x.shape
        t = type_name.upper()
        if t == "F32":  # (one of K and V quantized, the other not)
            self.k.set_rows(self.seq, x.s, pos, cache, R, Hkv * W, dst_rows=n_kv)
            return Val(cache, (n_kv, Hkv, W)), 0
        if rows.rot:
            turned = self._new(x.shape)
            self.k.hadamard(self.seq, x.s, turned.s, R * Hkv * W, rows.rot)
            x = turned
        self.k.set_rows_q(self.seq, x.s, pos, cache, R, Hkv * W, t, rows.raw[0].nbytes, dst_rows=n_kv)
        out = self._new((n_kv, Hkv, W))
        self.k.kv_rows(self.seq, cache, self.be.consts.rows(n_kv), out.s, n_kv, Hkv * W, t, pos, R)
        return out, rows.rot

    # -- several sequences' rows (Recording's seqs) ---------------------------------------------

    @staticmethod
    def _span(x: Val, r0: int, n: int) -> Slice:
        """Rows r0 .. r0 + n - 1 of x's buffer."""
        rb = x.width * np.dtype(x.dtype).itemsize
        return Slice(x.s.buffer, x.s.offset + r0 * rb, n * rb)

    def _rows_of(self, x: Val, sq) -> Optional[Val]:
        """Sequence sq's rows of x as a view of its buffer, or None where their offset is not
        aligned for a binding."""
        if sq.r0 == 0 and sq.n == x.rows:
            return x
        span = self._span(x, sq.r0, sq.n)
        if span.offset % self.be.dev.info.min_storage_buffer_offset_alignment:
            return None
        return Val(span, (sq.n, *x.shape[1:]), x.dtype, base=x)

    def _part(self, x: Val, sq) -> Val:
        """Sequence sq's rows of x: a view, or a copy where a view could not be bound."""
        view = self._rows_of(x, sq)
        if view is not None:
            return view
        out = self._new((sq.n, *x.shape[1:]), x.dtype)
        self.seq.copy(self._span(x, sq.r0, sq.n), self._span(out, 0, sq.n))
        return out

    def _per_sequence(self, shape, fn) -> Val:
        """An op over each sequence's own state: fn(sq, into) records it for sequence sq's rows,
        writing into `into` (its rows of the result, a view) where given, else into a value it
        returns, copied there. One sequence: fn's own value."""
        seqs = self.rec.seqs
        if len(seqs) == 1:
            return fn(seqs[0], None)
        out = self._new(shape)
        for sq in seqs:
            into = self._rows_of(out, sq)
            y = fn(sq, into)
            if into is None:
                self.seq.copy(self._span(y, 0, sq.n), self._span(out, sq.r0, sq.n))
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
        w = self.be.consts.vec(name)

        def conv(sq, into: Optional[Val]) -> Val:  # over the sequence's own conv history
            out = into if into is not None else self._new((sq.n, C))
            self.k.ssm_conv(self.seq, self._part(x, sq).s, sq.kv.conv_slice(layer), w, out.s, sq.n, C,
                            self.cfg.ssm_conv_kernel)
            return out

        return self._per_sequence((R, C), conv)

    def gdn_gates(self, b: Val, a: Val, dt: str, A: str):
        R, H = b.rows, b.width
        beta, g = self._new((R, H)), self._new((R, H))
        self.k.gdn_gates(self.seq, b.s, a.s, self.be.consts.vec(dt), self.be.consts.vec(A), beta.s, g.s, R, H)
        return beta, g

    def delta_rule(self, layer: int, q: Val, k: Val, v: Val, g: Val, beta: Val, eps: float, tiled: bool = False) -> Val:
        R, Hk, D = q.shape
        Hv = v.shape[1]

        def delta(sq, into: Optional[Val]) -> Val:  # over the sequence's own state, with the rows it has alone
            n = sq.n
            out = into if into is not None else self._new((n, Hv, D))
            # a prompt chunk: the chunked form (see Kernels.delta_chunk_min_rows); decode / verify rows: one step per row
            step = self.k.delta_chunk if 0 < self.k.delta_chunk_min_rows <= n else self.k.delta_rule
            qi, ki, vi, gi, bi = (self._part(t, sq) for t in (q, k, v, g, beta))
            step(self.seq, qi.s, ki.s, vi.s, gi.s, bi.s, sq.kv.state_slice(layer), out.s, n, Hk, Hv, D, eps, tiled)
            return out

        return self._per_sequence((R, Hv, D), delta)

    def last_row(self, x: Val) -> Val:
        """The last row of x; of several sequences' rows: each one's last row, or all its rows
        where it keeps every row's logits."""
        seqs = self.rec.seqs
        if len(seqs) > 1:
            keep = [(sq.r0 + sq.n - 1, 1) if sq.last_only else (sq.r0, sq.n) for sq in seqs]
            out = self._new((sum(n for _, n in keep), *x.shape[1:]))
            at = 0
            for r0, n in keep:
                self.seq.copy(self._span(x, r0, n), self._span(out, at, n))
                at += n
            return out
        off = (x.rows - 1) * x.width * 4
        if off % self.be.dev.info.min_storage_buffer_offset_alignment == 0:
            return Val(Slice(x.s.buffer, x.s.offset + off, x.width * 4), (1, *x.shape[1:]), base=x)
        out = self._new((1, *x.shape[1:]))
        self.seq.copy(Slice(x.s.buffer, x.s.offset + off, x.width * 4), Slice(out.s.buffer, out.s.offset, x.width * 4))
        return out
