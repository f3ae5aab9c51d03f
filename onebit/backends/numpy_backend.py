"""The numpy reference backend: float32 activations, weights dequantized per use.

Every op here is the plain twin that faster backends are checked against. Weights stay in
the file's memory map; a quantized matrix is dequantized when a matmul needs it and
dropped afterwards, so the process never holds a float32 copy of the model.
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np

from ..cache import SWA_ROWS, Cache, hadamard, make_cache
from ..formats.gguf_file import EXPERT_PARTS, GGUFFile, Tensor
from ..pause import NO_PAUSES, PauseContext, Pauses
from ..formats.quants import QTYPES
from .base import DELTA_CHUNK, SCORE_TILE, Backend, MemoryPolicy
from .experts import ExpertSource, FileExperts


def dequantize(t: Tensor, index=None) -> np.ndarray:
    """float32 values of tensor `t` (or of `t.raw[index]`, e.g. one expert or some rows)."""
    raw = t.raw if index is None else t.raw[index]
    return QTYPES[t.qtype].dequantize(raw)


class DequantizingPolicy(MemoryPolicy):
    """The numpy reference's memory: the file's tensors as they are, and a float32 copy of the
    largest matrix (or one expert's) while a product uses it."""

    def decoded_bytes(self) -> int:
        experts = tuple(f".{p}.weight" for p in EXPERT_PARTS)
        return 4 * max([t.n_elements // t.shape[0] if t.name.endswith(experts) else t.n_elements
                        for t in self.gguf.tensors.values()], default=0)


class NumpyBackend(Backend):
    name = "numpy"
    reference = True
    batches_sequences = True

    def __init__(self, gguf: GGUFFile, experts: Optional[ExpertSource] = None):
        self.gguf = gguf
        self.source = experts if experts is not None else FileExperts(gguf)  # where routed experts' bytes are

    @classmethod
    def memory_policy(cls, gguf, repack_from: Optional[int] = None) -> MemoryPolicy:
        return DequantizingPolicy(cls, gguf)

    def close(self) -> None:
        """Nothing to free: weights stay in the file's memory map."""

    def describe(self) -> str:
        """The backend in a few words (`onebit bench`, logs)."""
        return "reference"

    def attach_model(self, model, kv_capacity: int = 0) -> None:
        """Architecture `model` is run on this backend, its caches `kv_capacity` positions up
        front (a device backend records a step here)."""

    def make_cache(self, cfg, capacity: int = 0, swa_rows: int = SWA_ROWS) -> Cache:
        """A cache for one sequence, in host memory (see cache.make_cache), keys and values stored
        as `kv_types` says."""
        return make_cache(cfg, capacity, swa_rows, self.kv_types)

    def greedy_chain(self, model, cache, limit=None):
        """Greedy steps queued ahead of the host: a device backend's (Vulkan); none here."""
        return None

    def forward(self, model, ids: np.ndarray, cache, pauses: Pauses = NO_PAUSES,
                last_only: bool = False) -> tuple[np.ndarray, bool]:
        """Run `model`'s schedule eagerly over token ids [R] at the cache's next positions, its
        pause points served by `pauses`: (logits, whether every logit is finite); the cache
        holds the rows either way. NaN and inf give no numpy warnings: the model reports them
        as one error."""
        with np.errstate(all="ignore"):
            pauses.begin(len(ids))
            step = EagerStep(self, ids, cache, pauses)
            logits = model.schedule(step, last_only)
            step.commit()
            cache.offset += len(ids)
            # (a sum is non-finite if any logit is, and one reduction costs less than isfinite's
            # array and its all(); a finite sum that overflows is told apart by the full check)
            return logits, math.isfinite(float(logits.sum())) or bool(np.isfinite(logits).all())

    def forward_batch(self, model, seqs, pauses: Pauses = NO_PAUSES,
                      last_only: tuple = ()) -> tuple[list[np.ndarray], bool]:
        """`forward` over the rows of several sequences at once, seqs = [(ids [R_i], cache_i)]:
        every row through each linear and expert op together (a layer's expert is applied once
        to every row routed to it), attention and recurrent state per sequence over its own
        cache. last_only[i]: sequence i's last row's logits only. (logits per sequence, whether
        every logit is finite); each cache holds its rows."""
        with np.errstate(all="ignore"):
            step = BatchStep(self, seqs, pauses, last_only)
            pauses.begin(len(step.ids))
            logits = model.schedule(step, any(step.last_only))  # [sum of kept rows, vocab]
            step.commit()
            for ids, cache in seqs:
                cache.offset += len(ids)
            finite = math.isfinite(float(logits.sum())) or bool(np.isfinite(logits).all())
            return np.split(logits, np.cumsum(step.kept[:-1])), finite

    # -- weights ------------------------------------------------------------------------

    def has(self, name: str) -> bool:
        return name in self.gguf.tensors

    def weight(self, name: str) -> np.ndarray:
        return dequantize(self.gguf.tensor(name))

    def embed(self, name: str, ids: np.ndarray) -> np.ndarray:
        """get_rows: [R] token ids -> [R, dim], dequantizing only the rows asked for."""
        return dequantize(self.gguf.tensor(name), np.asarray(ids, dtype=np.int64))

    def linear(self, x: np.ndarray, name: str) -> np.ndarray:
        """x: [R, in] @ W[out, in].T -> [R, out]."""
        return x @ dequantize(self.gguf.tensor(name)).T

    def linears(self, x: np.ndarray, names) -> Optional[list[np.ndarray]]:
        """x @ W.T for several matrices of one input in one call, where the backend fuses them
        (cpu); None: the step runs them one by one."""
        return None

    # -- elementwise and normalisation --------------------------------------------------

    @staticmethod
    def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
        ms = np.mean(np.square(x, dtype=np.float32), axis=-1, keepdims=True, dtype=np.float32)
        return (x / np.sqrt(ms + np.float32(eps))) * w

    @staticmethod
    def silu(x: np.ndarray) -> np.ndarray:
        return x / (np.float32(1.0) + np.exp(-x))

    @staticmethod
    def gelu_tanh(x: np.ndarray) -> np.ndarray:
        """gelu by its tanh approximation, 0.5 x (1 + tanh(u)) = x * sigmoid(2u) (no overflow)."""
        u = np.float32(math.sqrt(2.0 / math.pi)) * (x + np.float32(0.044715) * x * x * x)
        with np.errstate(over="ignore"):  # exp -> inf: x / inf = -0, the right limit
            return x / (np.float32(1.0) + np.exp(np.float32(-2.0) * u))

    @staticmethod
    def softcap(x: np.ndarray, cap: float) -> np.ndarray:
        return np.float32(cap) * np.tanh(x / np.float32(cap))

    @staticmethod
    def rope(x: np.ndarray, pos: np.ndarray, n_rot: int, theta: float, neox: bool, scale: float = 1.0,
             factors: np.ndarray | None = None) -> np.ndarray:
        """x: [R, H, D] rotated in its first n_rot dims by each row's position pos: [R].
        factors: [n_rot/2] per-frequency divisors (`rope_freqs.weight`, Llama 3 rope scaling)."""
        inv_freq = theta ** (-np.arange(0, n_rot, 2, dtype=np.float64) / n_rot)  # [n_rot/2]
        if factors is not None:
            inv_freq = inv_freq / np.asarray(factors, dtype=np.float64).reshape(-1)[: n_rot // 2]
        ang = (pos.astype(np.float64) * scale)[:, None] * inv_freq[None, :]  # [R, n_rot/2]
        cos = np.cos(ang).astype(np.float32)[:, None, :]  # [R, 1, n_rot/2]
        sin = np.sin(ang).astype(np.float32)[:, None, :]
        out = x.copy()
        if neox:
            half = n_rot // 2
            a, b = x[..., :half], x[..., half:n_rot]
            out[..., :half] = a * cos - b * sin
            out[..., half:n_rot] = a * sin + b * cos
        else:
            a, b = x[..., 0:n_rot:2], x[..., 1:n_rot:2]
            out[..., 0:n_rot:2] = a * cos - b * sin
            out[..., 1:n_rot:2] = a * sin + b * cos
        return out

    @staticmethod
    def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
        e = np.exp(x - np.max(x, axis=axis, keepdims=True))
        return e / np.sum(e, axis=axis, keepdims=True)

    # -- attention ----------------------------------------------------------------------

    def attention(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, q_pos: np.ndarray, window: int = 0,
                  scale: float | None = None, sinks: np.ndarray | None = None) -> np.ndarray:
        """Causal GQA attention (window > 0: each row sees only the last `window` positions;
        scores q.k times `scale`, default 1/sqrt(D); sinks [H]: one logit per head that joins
        the softmax's denominator and weights no value, gpt-oss).

        q: [R, H, D] at positions q_pos; k: [S, Hkv, D], v: [S, Hkv, Dv] hold position p in row
        p % S (a cache of every position: S > every position, row p; a sliding-window ring:
        S = its capacity). Only the positions some row sees are read, in position order.
        Returns [R, H * Dv].
        """
        R, H, D = q.shape
        S, Hkv, Dv = v.shape
        group = H // Hkv
        hi = int(q_pos.max()) + 1 if R else 0
        lo = max(0, int(q_pos.min()) - window + 1) if window > 0 and R else 0
        tile = max(1, SCORE_TILE // max(H * (hi - lo), 1))
        if R > tile:  # a long prompt over a long cache: query rows in tiles, so the scores stay bounded
            return np.concatenate([self.attention(q[i : i + tile], k, v, q_pos[i : i + tile], window, scale, sinks)
                                   for i in range(0, R, tile)])
        if hi <= S:
            k, v = k[lo:hi], v[lo:hi]
        else:  # a ring
            rows = np.arange(lo, hi) % S
            k, v = k[rows], v[rows]
        kpos = np.arange(lo, hi)  # [S'] the positions read
        qg = q.reshape(R, Hkv, group, D).transpose(1, 2, 0, 3)  # [Hkv, G, R, D]
        kt = k.transpose(1, 2, 0)  # [Hkv, D, S']
        scale = 1.0 / np.sqrt(D) if scale is None else scale
        scores = (qg @ kt[:, None]) * np.float32(scale)  # [Hkv, G, R, S']
        mask = kpos[None, :] > q_pos[:, None]  # [R, S']
        if window > 0:
            mask |= kpos[None, :] <= q_pos[:, None] - window
        scores = np.where(mask, np.float32(-np.inf), scores)
        if sinks is None:
            p = self.softmax(scores)
        else:
            sink = np.asarray(sinks, np.float32).reshape(Hkv, group, 1, 1)
            m = np.maximum(np.max(scores, axis=-1, keepdims=True), sink)
            e = np.exp(scores - m)
            p = e / (np.sum(e, axis=-1, keepdims=True) + np.exp(sink - m))
        out = p @ v.transpose(1, 0, 2)[:, None]  # [Hkv, G, R, Dv]
        return out.transpose(2, 0, 1, 3).reshape(R, H * Dv)

    # -- Gated DeltaNet (linear attention) ---------------------------------------------

    @staticmethod
    def sigmoid(x: np.ndarray) -> np.ndarray:
        with np.errstate(over="ignore"):  # exp -> inf: 1 / inf = 0, the right limit
            return np.float32(1.0) / (np.float32(1.0) + np.exp(-x))

    @staticmethod
    def softplus(x: np.ndarray) -> np.ndarray:
        return np.logaddexp(np.float32(0.0), x).astype(np.float32)

    def ssm_conv(self, x: np.ndarray, hist: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """silu of the depthwise causal conv of x: [R, C] after the history hist: [K-1, C] (the
        previous rows' inputs, oldest first) with taps w: [C, K]; and the new history."""
        K = w.shape[1]
        full = np.concatenate([hist, x], axis=0)  # [K-1+R, C]
        R = x.shape[0]
        y = full[0:R] * w[:, 0]
        for j in range(1, K):
            y = y + full[j : j + R] * w[:, j]  # [R, C]
        return self.silu(y), full[R:].copy()

    def gdn_gates(self, b: np.ndarray, a: np.ndarray, dt_bias: np.ndarray, ssm_a: np.ndarray):
        """beta = sigmoid(b) and the log decay g = softplus(a + dt_bias) * ssm_a (ssm_a = -exp(A_log),
        so g < 0): b, a: [R, Hv] -> [R, Hv] each."""
        return self.sigmoid(b), self.softplus(a + dt_bias) * ssm_a

    @staticmethod
    def l2_norm(x: np.ndarray, eps: float) -> np.ndarray:
        return x / np.sqrt(np.sum(np.square(x), axis=-1, keepdims=True, dtype=np.float32) + np.float32(eps))

    def delta_rule(self, q, k, v, g, beta, state, eps: float, tiled: bool = False, chunk: int = 0):
        """The gated delta rule over R rows: q, k: [R, Hk, D] (l2-normalised here, q also scaled
        by 1/sqrt(D)), v: [R, Hv, D], g (log decay), beta: [R, Hv], state: [Hv, D, D] (key x
        value). Value head j reads key head j % Hk (`tiled`) or j // (Hv / Hk). Per row t and head:
            S = exp(g_t) S;  u = beta_t (v_t - S^T k_t);  S = S + k_t u^T;  o_t = S^T q_t.
        `chunk` > 0: the chunked (WY) form in blocks of that many rows, the same sums in another
        order. Returns o: [R, Hv, D] and the new state."""
        R, Hk, D = q.shape
        Hv = v.shape[1]
        heads = np.arange(Hv) % Hk if tiled else np.arange(Hv) // (Hv // Hk)
        q = self.l2_norm(q, eps)[:, heads] * np.float32(1.0 / np.sqrt(D))  # [R, Hv, D]
        k = self.l2_norm(k, eps)[:, heads]
        if chunk > 0:
            return self._delta_chunked(q, k, v, g, beta, state, chunk)
        S = state.copy()
        o = np.empty_like(v)
        decay = np.exp(g)  # [R, Hv]
        for t in range(R):  # (sums of products, not einsum: its BLAS threads would contend with the cpu kernels')
            S *= decay[t][:, None, None]
            kv = (k[t][:, :, None] * S).sum(axis=1)  # [Hv, D]
            u = (v[t] - kv) * beta[t][:, None]
            S += k[t][:, :, None] * u[:, None, :]
            o[t] = (q[t][:, :, None] * S).sum(axis=1)
        return o, S

    @staticmethod
    def _delta_chunked(q, k, v, g, beta, state, C: int):
        """In each block of C rows (G: g summed within the block, s <= t):
            u = (I + A)^-1 beta (v - exp(G_t) k_t S0),  A_ts = beta_t exp(G_t - G_s) k_t.k_s (s < t)
            o_t = exp(G_t) q_t S0 + sum_s exp(G_t - G_s) (q_t.k_s) u_s
            S   = exp(G_C) S0 + sum_s exp(G_C - G_s) k_s u_s^T"""
        R = q.shape[0]
        S = state.copy()  # [H, Dk, Dv]
        out = np.empty_like(v)
        qh, kh, vh = (x.transpose(1, 0, 2) for x in (q, k, v))  # [H, R, D]
        gh, bh = g.T.astype(np.float32), beta.T.astype(np.float32)  # [H, R]
        for c0 in range(0, R, C):
            sl = slice(c0, min(c0 + C, R))
            qc, kc, vc, bc = qh[:, sl], kh[:, sl], vh[:, sl], bh[:, sl]
            n = qc.shape[1]
            G = np.cumsum(gh[:, sl], axis=1)  # [H, n]
            diff = G[:, :, None] - G[:, None, :]  # [H, t, s]
            lower = np.tril(np.ones((n, n), bool), -1)
            dec = np.where(np.tril(np.ones((n, n), bool)), np.exp(np.minimum(diff, 0)), 0).astype(np.float32)
            A = np.where(lower, bc[:, :, None] * dec * (kc @ kc.transpose(0, 2, 1)), 0).astype(np.float32)
            eg = np.exp(G)[:, :, None]  # [H, n, 1]
            rhs = bc[:, :, None] * (vc - eg * (kc @ S))  # [H, n, Dv]
            u = np.linalg.solve(np.eye(n, dtype=np.float32) + A, rhs).astype(np.float32)
            att = dec * (qc @ kc.transpose(0, 2, 1))  # [H, t, s], s <= t
            out[sl] = (eg * (qc @ S) + att @ u).transpose(1, 0, 2)
            tail = np.exp(G[:, -1:] - G)[:, :, None]  # [H, n, 1]
            S = np.exp(G[:, -1])[:, None, None] * S + (kc * tail).transpose(0, 2, 1) @ u
        return out, S.astype(np.float32)

    # -- mixture of experts -------------------------------------------------------------

    def route(self, logits: np.ndarray, k: int, norm: bool) -> tuple[np.ndarray, np.ndarray]:
        """Softmax over all experts, keep the top k. logits: [R, E] -> ids [R, k], weights [R, k]."""
        probs = self.softmax(logits)
        ids = np.argsort(-probs, axis=-1, kind="stable")[:, :k]  # [R, k]
        w = np.take_along_axis(probs, ids, axis=-1)
        if norm:
            w = w / np.sum(w, axis=-1, keepdims=True)
        return ids, w.astype(np.float32)

    @staticmethod
    def selection_scores(logits: np.ndarray, bias: np.ndarray | None, groups: int = 1,
                         groups_used: int = 1) -> np.ndarray:
        """What sigmoid routing ranks experts by: sigmoid(logits) + bias [E] (the expert-score
        correction bias), -inf outside the `groups_used` of `groups` equal groups of experts
        whose two best such scores sum highest (ties: the lower group). [R, E] -> [R, E]."""
        sel = np.float32(1.0) / (np.float32(1.0) + np.exp(-logits))
        if bias is not None:
            sel = sel + np.asarray(bias, np.float32).reshape(-1)
        if groups > 1:
            R, E = sel.shape
            by_group = sel.reshape(R, groups, E // groups)  # [R, G, E/G]
            top2 = -np.sort(-by_group, axis=-1)[..., :2].sum(-1)  # [R, G]
            kept = np.argsort(-top2, axis=-1, kind="stable")[:, :groups_used]  # [R, used]
            mask = np.ones((R, groups), bool)
            np.put_along_axis(mask, kept, False, axis=-1)
            sel = np.where(np.repeat(mask, E // groups, axis=-1), np.float32(-np.inf), sel)
        return sel

    def route_sigmoid(self, logits: np.ndarray, k: int, bias: np.ndarray | None, norm: bool, scale: float,
                      groups: int = 1, groups_used: int = 1) -> tuple[np.ndarray, np.ndarray]:
        """GLM-4.5 routing: the top k by `selection_scores` (ties: the lower expert), weighted by
        their unbiased sigmoid scores, renormalised to sum 1 if `norm` (the sum clamped below at
        2^-14, as llama.cpp does), times `scale`. logits: [R, E] -> ids [R, k], weights [R, k]."""
        ids = np.argsort(-self.selection_scores(logits, bias, groups, groups_used), axis=-1, kind="stable")[:, :k]
        w = np.float32(1.0) / (np.float32(1.0) + np.exp(-np.take_along_axis(logits, ids, axis=-1)))
        if norm:
            w = w / np.maximum(np.sum(w, axis=-1, keepdims=True), np.float32(6.103515625e-5))
        if scale != 1.0:
            w = w * np.float32(scale)
        return ids, w.astype(np.float32)

    def experts(self, layer: int, x: np.ndarray, ids: np.ndarray, weights: np.ndarray, glu=None,
                seqs=None) -> np.ndarray:
        """Weighted sum over each row's chosen experts of down(silu(gate(x)) * up(x)) (glu =
        (alpha, limit): gpt-oss's clamped variant, see `glu_oai`; the parts' biases, where the
        file has them, are added to their products). The experts' bytes come from the
        backend's expert source (the file, or a pool's slots), in the same order either way.

        x: [R, dim]; ids, weights: [R, k]. Expert e of `ffn_gate_exps` is raw[e]: [hidden, dim].
        seqs: where the forward runs several sequences, each one's rows (slices of ids), which
        a backend that passes the routing to its pool gives it per sequence (cpu); here unused.
        """
        parts = [self.gguf.tensor(f"blk.{layer}.{p}.weight") for p in EXPERT_PARTS]
        biases = self.expert_biases(layer)
        out = np.zeros_like(x)
        arrays = self.source.arrays(layer)  # gate, up, down: [E or slots, rows, row_bytes]
        # (a read that fails because the file changed is named by the model's forward)
        for _, group, index in self.source.pinned(layer, [int(e) for e in np.unique(ids)]):
            for e, i in zip(group, index):
                self.expert_ffn(out, x, ids, weights, e, parts, [a[i] for a in arrays], biases, glu)
        return out

    def expert_biases(self, layer: int):
        """[E, width] biases of the gate, up and down parts (gpt-oss), or None."""
        names = [f"blk.{layer}.{p}.bias" for p in EXPERT_PARTS]
        if names[0] not in self.gguf.tensors:
            return None
        return [self.weight(n).reshape(self.gguf.tensor(n).shape) for n in names]

    @staticmethod
    def glu_oai(gate: np.ndarray, up: np.ndarray, alpha: float, limit: float) -> np.ndarray:
        """gpt-oss's SwiGLU: gate clamped above at limit, up to [-limit, limit], then
        gate * sigmoid(alpha * gate) * (up + 1)."""
        gate = np.minimum(gate, np.float32(limit))
        up = np.clip(up, np.float32(-limit), np.float32(limit))
        return gate / (np.float32(1.0) + np.exp(np.float32(-alpha) * gate)) * (up + np.float32(1.0))

    def expert_ffn(self, out, x, ids, weights, e: int, parts, raws, biases=None, glu=None) -> None:
        """out[rows routed to e] += weight * down(silu(gate(x)) * up(x)), with expert e's raw
        gate/up/down bytes `raws` (from the file map, or from a streaming pool's slot)."""
        gate, up, down = (QTYPES[t.qtype].dequantize(r) for t, r in zip(parts, raws))
        rows, slot = np.nonzero(ids == e)
        xe = x[rows]  # [n, dim]
        g, u = xe @ gate.T, xe @ up.T  # [n, hidden]
        if biases is not None:
            g, u = g + biases[0][e], u + biases[1][e]
        h = self.silu(g) * u if glu is None else self.glu_oai(g, u, *glu)
        y = h @ down.T  # [n, dim]
        if biases is not None:
            y = y + biases[2][e]
        out[rows] += y * weights[rows, slot][:, None]  # [n, dim]


DELTA_CHUNK_MIN_ROWS = 16  # fewer rows (decode, verify rows) take the one-step-per-row form


class EagerStep:
    """The ops of a model schedule (models/blocks.py), each run at once on numpy arrays, for
    token ids [R] at the cache's next positions."""

    def __init__(self, be: NumpyBackend, ids: np.ndarray, cache, pauses: Pauses = NO_PAUSES):
        self.be, self.ids, self.cache, self.pauses = be, ids, cache, pauses
        self._pause_ctx = None
        self._staged: dict = {}  # recurrent layer -> its new (conv, state), written when the step completes
        self.start = cache.offset
        self.pos = np.arange(self.start, self.start + len(ids), dtype=np.int64)  # [R]
        self.pos.flags.writeable = False  # (the cpu kernels take it as it is)
        self.tensor_names = be.gguf.tensors

    def embed(self, name: str) -> np.ndarray:
        return self.be.embed(name, self.ids)  # [R, dim]

    def norm(self, x: np.ndarray, name: str, eps: float) -> np.ndarray:
        return self.be.rms_norm(x, self.be.weight(name), eps)

    def linear(self, x: np.ndarray, name: str, bias: str | None = None) -> np.ndarray:
        y = self.be.linear(x, name)
        return y + self.be.weight(bias) if bias is not None else y

    def linears(self, x: np.ndarray, names, biases) -> list[np.ndarray]:
        ys = self.be.linears(x, names)  # (cpu: one parallel region for all of them)
        if ys is None:
            return [self.linear(x, n, b) for n, b in zip(names, biases)]
        return [y + self.be.weight(b) if b is not None else y for y, b in zip(ys, biases)]

    @staticmethod
    def view(x: np.ndarray, shape) -> np.ndarray:
        return x.reshape(x.shape[0], *shape)

    def rope(self, x: np.ndarray, n_rot: int, theta: float, neox: bool, scale: float,
             factors=None) -> np.ndarray:
        """factors: a tensor name, or an array the config computed (YaRN's divisors)."""
        f = self.be.weight(factors) if isinstance(factors, str) else factors
        return self.be.rope(x, self.pos, n_rot, theta, neox, scale, f)

    def attention(self, layer: int, q: np.ndarray, k: np.ndarray, v: np.ndarray, window: int = 0,
                  scale: float | None = None, sinks: str | None = None) -> np.ndarray:
        w = self.be.weight(sinks) if sinks is not None else None
        return self._attend(self.cache[layer], self.start, q, k, v, self.pos, window, scale, w)

    def _attend(self, c, start: int, q, k, v, pos, window: int, scale, sinks) -> np.ndarray:
        """One sequence's rows: k, v written to its layer cache c at `start`, q attending over
        what it holds (a backend that reads a quantized cache's blocks gets them as stored)."""
        keys, values = c.write(start, k, v, blocks=True) if self.be.reads_kv_blocks else \
            c.write(start, k, v)  # [S, Hkv, D], [S, Hkv, Dv] (a device's caches take no `blocks`)
        rk, rv = c.rotation  # a quantized cache's heads, rotated (cache.hadamard_size)
        if rk:
            q = hadamard(q, rk)  # q.k as before the rotation
        out = self.be.attention(q, keys, values, pos, window, scale, sinks)  # [R, H*Dv]
        return hadamard(out, rv) if rv else out

    @staticmethod
    def add(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return a + b

    residual = add

    def swiglu(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return self.be.silu(a) * b

    def geglu(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return self.be.gelu_tanh(a) * b

    @staticmethod
    def scale(x: np.ndarray, s: float) -> np.ndarray:
        return x * np.float32(s)

    def softcap(self, x: np.ndarray, cap: float) -> np.ndarray:
        return self.be.softcap(x, cap)

    def route(self, logits: np.ndarray, k: int, norm: bool):
        return self.be.route(logits, k, norm)

    def route_sigmoid(self, logits: np.ndarray, k: int, bias: str | None, norm: bool, scale: float,
                      groups: int = 1, groups_used: int = 1):
        b = self.be.weight(bias) if bias is not None else None
        return self.be.route_sigmoid(logits, k, b, norm, scale, groups, groups_used)

    def pause(self, layer: int, ids: np.ndarray, logits: np.ndarray, h: np.ndarray) -> None:
        p = self.pauses
        p.at_pause(layer, ids, logits)
        p.observe(layer, ids, logits)  # (eager: an observer's data is at hand now)
        if p.predicting:
            if self._pause_ctx is None:  # made once per forward, at its first pause point
                c = self.cache
                self._pause_ctx = PauseContext(self.start, len(self.ids), lambda l: c[l].keys, lambda l: c[l].values,
                                               lambda l: c[l])
            p.predict(self._pause_ctx, layer, ids, logits, h)

    def experts(self, layer: int, x: np.ndarray, ids: np.ndarray, weights: np.ndarray, glu=None) -> np.ndarray:
        return self.be.experts(layer, x, ids, weights, glu)

    def shared_expert(self, layer: int, x: np.ndarray) -> np.ndarray:
        """qwen2moe's always-on expert, scaled per row by a sigmoid gate."""
        p = f"blk.{layer}"
        h = self.swiglu(self.linear(x, f"{p}.ffn_gate_shexp.weight"), self.linear(x, f"{p}.ffn_up_shexp.weight"))
        y = self.linear(h, f"{p}.ffn_down_shexp.weight")  # [R, dim]
        w = self.be.weight(f"{p}.ffn_gate_inp_shexp.weight").reshape(-1, 1)  # [dim, 1]
        gate = x @ w  # [R, 1]
        return y / (np.float32(1.0) + np.exp(-gate))

    @staticmethod
    def last_row(x: np.ndarray) -> np.ndarray:
        return x[-1:]

    # -- hybrid (Gated DeltaNet) models ---------------------------------------------------

    @staticmethod
    def split(x: np.ndarray, sizes) -> list[np.ndarray]:
        """x: [..., sum(sizes)] -> one array per size along the last axis."""
        return np.split(x, np.cumsum(sizes)[:-1], axis=-1)

    def sigmoid_gate(self, x: np.ndarray, gate: np.ndarray) -> np.ndarray:
        """x * sigmoid(gate) (gated attention's output gate)."""
        return x * self.be.sigmoid(gate)

    def recurrent(self, layer: int):
        """Where `layer`'s recurrent state is read (the sequence's own cache, as it was before
        this step: new state is staged, see `commit`)."""
        return self.cache[layer]

    def stage(self, layer: int, conv=None, state=None) -> None:
        """Hold a recurrent layer's new conv history / state until the step completes, so that a
        step stopped half way (an interrupt, an error) leaves the sequence as it was."""
        old = self._staged.get(layer, (None, None))
        self._staged[layer] = (conv if conv is not None else old[0], state if state is not None else old[1])

    def commit(self) -> None:
        """The step completed: write the staged recurrent state into the cache."""
        for layer, (conv, state) in self._staged.items():
            c = self.cache[layer]
            if conv is not None:
                c.conv[...] = conv
            if state is not None:
                c.state[...] = state
        self._staged.clear()

    def ssm_conv(self, layer: int, x: np.ndarray, name: str) -> np.ndarray:
        """silu(causal conv of x: [R, C] after the layer's history), the history moved on."""
        y, conv = self.be.ssm_conv(x, self.recurrent(layer).conv, self.be.weight(name))
        self.stage(layer, conv=conv)
        return y  # [R, C]

    def gdn_gates(self, b: np.ndarray, a: np.ndarray, dt_bias: str, ssm_a: str):
        return self.be.gdn_gates(b, a, self.be.weight(dt_bias), self.be.weight(ssm_a))  # [R, Hv] x 2

    def delta_rule(self, layer: int, q, k, v, g, beta, eps: float, tiled: bool = False) -> np.ndarray:
        """The gated delta rule over the layer's state: one step per row for decode and verify
        rows, the chunked form for a prompt chunk. -> [R, Hv, D]"""
        chunk = DELTA_CHUNK if q.shape[0] >= DELTA_CHUNK_MIN_ROWS else 0
        o, state = self.be.delta_rule(q, k, v, g, beta, self.recurrent(layer).state, eps, tiled, chunk)
        self.stage(layer, state=state)
        return o


class BatchStep(EagerStep):
    """EagerStep over the rows of several sequences, each at its own cache's next positions
    (NumpyBackend.forward_batch): rows of sequence i are rows[slices[i]]. The ops that read a
    sequence's state (attention, the recurrent mixer) run per sequence over its own cache,
    with the rows it would have alone; every other op runs over all rows."""

    def __init__(self, be: NumpyBackend, seqs, pauses: Pauses = NO_PAUSES, last_only: tuple = ()):
        counts = [len(ids) for ids, _ in seqs]
        self.be, self.pauses = be, pauses
        self._pause_ctx = None  # what a predictor's pauses get (router prediction reads no cache)
        self.ids = np.concatenate([np.asarray(ids, dtype=np.int64) for ids, _ in seqs])  # [R]
        self.caches = [cache for _, cache in seqs]
        self.starts = [cache.offset for cache in self.caches]
        ends = np.cumsum(counts)
        self.slices = [slice(int(e - n), int(e)) for e, n in zip(ends, counts)]
        self.pos = np.concatenate([np.arange(s, s + n, dtype=np.int64) for s, n in zip(self.starts, counts)])
        self.pos.flags.writeable = False
        self.last_only = tuple(last_only) or (False,) * len(seqs)
        self.kept = [1 if lo else n for lo, n in zip(self.last_only, counts)]  # logits rows per sequence
        self._staged = [{} for _ in seqs]  # per sequence: recurrent layer -> (conv, state), as EagerStep's
        self.tensor_names = be.gguf.tensors

    def attention(self, layer: int, q: np.ndarray, k: np.ndarray, v: np.ndarray, window: int = 0,
                  scale: float | None = None, sinks: str | None = None) -> np.ndarray:
        w = self.be.weight(sinks) if sinks is not None else None
        out = []
        for cache, start, sl in zip(self.caches, self.starts, self.slices):
            out.append(self._attend(cache[layer], start, q[sl], k[sl], v[sl], self.pos[sl], window, scale, w))
        return np.concatenate(out)  # [R, H*Dv]

    def pause(self, layer: int, ids: np.ndarray, logits: np.ndarray, h: np.ndarray) -> None:
        """The hook's turn over all rows, then a predictor's that reads no cache (router
        prediction: the runner passes no other): its context has no cache to show."""
        p = self.pauses
        p.at_pause(layer, ids, logits)
        p.observe(layer, ids, logits)
        if p.predicting:
            if self._pause_ctx is None:  # (once a forward)
                self._pause_ctx = PauseContext(0, len(self.ids), None, None)
            p.predict(self._pause_ctx, layer, ids, logits, h)

    def experts(self, layer: int, x: np.ndarray, ids: np.ndarray, weights: np.ndarray, glu=None) -> np.ndarray:
        return self.be.experts(layer, x, ids, weights, glu, self.slices)  # (each sequence's rows: see NumpyBackend)

    def last_row(self, x: np.ndarray) -> np.ndarray:
        rows = [np.arange(sl.start, sl.stop)[-1:] if lo else np.arange(sl.start, sl.stop)
                for sl, lo in zip(self.slices, self.last_only)]
        return x[np.concatenate(rows)]  # [sum of kept rows, ...]

    def ssm_conv(self, layer: int, x: np.ndarray, name: str) -> np.ndarray:
        w = self.be.weight(name)
        out = []
        for i, (cache, sl) in enumerate(zip(self.caches, self.slices)):
            y, conv = self.be.ssm_conv(x[sl], cache[layer].conv, w)
            self._stage(i, layer, conv=conv)
            out.append(y)
        return np.concatenate(out)  # [R, C]

    def delta_rule(self, layer: int, q, k, v, g, beta, eps: float, tiled: bool = False) -> np.ndarray:
        out = []
        for i, (cache, sl) in enumerate(zip(self.caches, self.slices)):
            chunk = DELTA_CHUNK if sl.stop - sl.start >= DELTA_CHUNK_MIN_ROWS else 0
            o, state = self.be.delta_rule(q[sl], k[sl], v[sl], g[sl], beta[sl], cache[layer].state, eps, tiled, chunk)
            self._stage(i, layer, state=state)
            out.append(o)
        return np.concatenate(out)  # [R, Hv, D]

    def _stage(self, i: int, layer: int, conv=None, state=None) -> None:
        old = self._staged[i].get(layer, (None, None))
        self._staged[i][layer] = (conv if conv is not None else old[0], state if state is not None else old[1])

    def commit(self) -> None:
        for cache, staged in zip(self.caches, self._staged):
            for layer, (conv, state) in staged.items():
                if conv is not None:
                    cache[layer].conv[...] = conv
                if state is not None:
                    cache[layer].state[...] = state
            staged.clear()
