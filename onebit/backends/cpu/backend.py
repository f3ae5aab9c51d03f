"""The cpu backend: the numpy backend's schedule, with its ops in numba kernels.

Mat-vec / mat-mat (`linear`), get_rows (`embed`) and the routed experts run in the
package's products (products.py), reading the quantized blocks where they lie (file map or pool slot); the q, k
and v projections of one input run in one parallel region (the schedule's `linears` op).
The small ops (norms, rope, decode attention, routing) run in serial kernels, where numpy's
per-call overhead would cost more than the work (sigmoid routing, glm4moe's, is still numpy's). A tensor whose type the kernels do not decode takes the numpy
reference path (said once, on stderr).
"""

from __future__ import annotations

import functools
import logging
import math
import sys
import threading
from typing import Optional

import numpy as np

from ...errors import BackendUnavailableError, UsageError
from ...formats.gguf_file import EXPERT_PARTS
from ...formats.quants import QTYPES_BY_NAME, X16_ROWS, x16_bytes
from ..base import MemoryPolicy
from ...cache import SWA_ROWS, KVRows
from ..experts import FileExperts, read_only
from ..numpy_backend import NumpyBackend
from .threads import wait_policy

log = logging.getLogger("onebit")


def _f32(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x, dtype=np.float32)


def _ro32(x: np.ndarray) -> np.ndarray:
    """Float32, C order, read-only: the one array type the small-op kernels are compiled for (a
    float32 C-order array, what the ops pass from one to the next, costs a view: 0.2 us against
    0.6 through read_only's general path, and a decode layer makes about 15 of them)."""
    if type(x) is np.ndarray and x.dtype == F32 and x.flags.c_contiguous:
        if x.flags.writeable:
            x = x.view()
            x.setflags(write=False)
        return x
    return read_only(np.asarray(x, dtype=np.float32))


def _ro64(x) -> np.ndarray:
    """Int64, C order, read-only (positions): the step's own positions (read only already) as they are."""
    if type(x) is np.ndarray and x.dtype == I64 and not x.flags.writeable and x.flags.c_contiguous:
        return x
    return read_only(np.asarray(x, np.int64))


F32, I64 = np.dtype(np.float32), np.dtype(np.int64)
SMALL_WEIGHT = 1 << 16  # elements: weights up to this size are kept decoded (norms, biases, gates)


FEW_ROWS = 4  # attention of at most this many query rows runs in the serial kernel
# Bytes of a matrix's rows repacked before their pages of the file's map are given back: a
# whole output head at once (gpt-oss-20b's, 615 MB of Q8_0) held its pages and its copy
# together, and a streamed run's peak memory went 0.3-0.4 GiB past its budget at load.
REPACK_PART = 32 << 20


def _compile_progress(done: int, total: int) -> None:
    """The first run's compile, on stderr: one line rewritten in a terminal, a line each elsewhere."""
    if sys.stderr.isatty():
        sys.stderr.write(f"\ronebit: compiling kernels {done}/{total}" + ("\n" if done == total else ""))
    else:
        sys.stderr.write(f"onebit: compiling kernels {done}/{total}\n")
    sys.stderr.flush()


def default_threads() -> int:
    import numba

    return numba.get_num_threads()


def _decoded(a):
    """Keys or values as float32 rows (KVRows: decoded, still rotated, as the attention takes them)."""
    return a.read(slice(None)) if isinstance(a, KVRows) else a


@functools.cache  # (a step asks several times: the import once)
def _kernels():
    """The kernels (the package's `kernels` module), or BackendUnavailableError where numba is
    missing or broken."""
    try:
        from . import kernels
    except ImportError as e:
        raise BackendUnavailableError(f"the cpu backend cannot run here ({e})") from e
    return kernels


@functools.cache  # (once a process: the limit holds for every backend opened after)
def _one_blas_thread() -> None:
    """numpy's BLAS (a prompt's attention products, the predictor's routers) to one thread: its
    threads wait spinning for work, and beside the kernels' own threads on the same cores they
    took the cores from them. Measured on 2 cores, a 128-row prompt's attention on the 30B-A3B
    layer shape: 1.07 s a layer with OpenBLAS's 2 threads, 0.023 s with one (bench_scale's
    file; the whole 4-layer forward 13.5 s -> 5.5 s)."""
    from threadpoolctl import threadpool_limits

    threadpool_limits(1, user_api="blas")


# onebit's own layouts on AVX-512 VNNI (x16.py, "X16"): the rows of a matrix, or of each
# routed expert, 16 side by side (quants.x16_bytes: their bytes). From memory each moves at least
# its rows' GB/s on the 2-core VM (256 MiB matrices, K = 640-4096), and prompts' products run
# 1.2-2.2x faster (bench_roofline.py; bench/results/issue34-kernels.md).
X16_TYPES = frozenset(QTYPES_BY_NAME[n].type_id for n in ("Q4_K", "Q5_K", "Q6_K", "MXFP4", "Q4_0", "Q5_0", "IQ4_XS",
                                                         "Q8_0", "Q4_1", "Q5_1", "IQ4_NL", "Q2_K", "Q3_K"))
# A file takes the X16 layouts only from this many bytes of tensors (a load's `repack_from`
# setting overrides it). The layouts pay where the products read weights from memory; a smaller
# file's weights stay in the caches, and its first run on a machine would compile the layouts'
# kernels as well: the shipped model (5 MB, Q8_0) answered first in 21.1-22.1 s with Q8_0_X16
# compiled, 18.5-18.6 without (bench_first_token.py). All of the file's tensors count, not only
# those with a layout: Gemma 3 270M's (253 MB) that have one are 10 MB, and its prompt's Q4_K
# products ran 35% slower as rows.
X16_FROM = 64 << 20


class X16Policy(MemoryPolicy):
    """The cpu backend's memory: on AVX-512 VNNI, in a file of X16_FROM bytes or more (or
    `repack_from`), the matrices and routed experts of X16_TYPES in the X16 layouts, Q4_K's and
    Q5_K's grown by their decoded scales (quants.x16_bytes). `packs` (matrices) and
    `packs_experts` are the one decision: the plan counts, the loader leaves to the backend, the
    backend repacks and its expert layout holds what they say."""

    def __init__(self, backend, gguf, repack_from: Optional[int] = None):
        super().__init__(backend, gguf)
        tensors = gguf.tensors.values()
        limit = X16_FROM if repack_from is None else repack_from
        self.on = sum(t.n_bytes for t in tensors) >= limit and _kernels().VNNI  # (a small file: no kernels imported)
        self.experts = X16Experts(self) if any(self.packs_experts(t) for t in tensors) else None

    def packs(self, t) -> bool:
        """Whether matrix t (a gguf_file.Tensor) is held in an X16 layout: [N, K] of X16_TYPES, 16 rows
        or more (the last N % 16 held as rows); not the token embedding, whose rows lookups read as
        they are (a tied output head reads it as it is too)."""
        return (self.on and t.qtype in X16_TYPES and len(t.shape) == 2 and t.shape[0] >= X16_ROWS
                and not t.name.startswith("token_embd"))

    def packs_experts(self, t) -> bool:
        """Whether routed-expert tensor t ([E, N, K]) is held in an X16 layout, each expert's rows on
        their own (a pool's slot is filled with one expert's): of X16_TYPES, N at least 16, in
        a layer whose experts take the kernels' expert path (every part of a type the kernels read;
        expert biases only in gpt-oss, whose clamped SwiGLU kernel takes them: a layer with biases
        elsewhere takes the numpy path, which reads the file's blocks)."""
        if not (self.on and t.qtype in X16_TYPES and len(t.shape) == 3 and t.shape[1] >= X16_ROWS):
            return False
        tensors, layer = self.gguf.tensors, t.name.split(".")[1]
        biased = f"blk.{layer}.ffn_gate_exps.bias" in tensors
        names = [f"blk.{layer}.{p}.weight" for p in EXPERT_PARTS]
        return ((not biased or self.gguf.metadata.get("general.architecture") == "gpt-oss")
                and all(n in tensors and tensors[n].qtype in _kernels().SUPPORTED for n in names))

    def held_bytes(self, t) -> int:
        return x16_bytes(t.n_bytes, t.qtype) if self.packs(t) or self.packs_experts(t) else t.n_bytes

    @property
    def repacks(self) -> bool:
        """Whether any of the file's tensors is held in an X16 layout."""
        return self.experts is not None or any(self.packs(t) for t in self.gguf.tensors.values())


class X16Experts:
    """The cpu backend's ExpertLayout (backends/experts.py) for one file: experts of X16_TYPES (Q4_K,
    Q5_K, Q6_K, Q2_K, Q3_K, MXFP4, Q4_0, Q5_0, Q4_1, Q5_1, IQ4_NL, IQ4_XS, Q8_0) in the kernels' X16 layouts on
    AVX-512 VNNI, in layers
    whose experts take the kernels' expert path (every part of a type the kernels read; expert
    biases only in gpt-oss, whose kernel takes them: else the numpy path reads them as the file
    has them). At decode a step's experts are most of its bytes. Measured (2-core VM,
    bench/results/issue34-kernels.md), one expert from memory on one thread: the 30B-A3B shape's
    Q4_K gate 14 GB/s as rows, 26-28 repacked; its Q6_K down (768 weights a row) 15.5-16.6 as
    rows, 25-27 repacked; decode steps on that shape 91-127 ms -> 66-75 ms, on the 0.86B Q4_K_M
    file 5.8-6.2 -> 4.9-5.1 ms (Q4_K only). gpt-oss-20b's MXFP4 experts (4 of 32, 2880 x 2880,
    both threads) 18-24 GB/s as rows, 29-48 repacked; its decode 0.76x -> 0.96x llama.cpp's.
    Which tensors: `X16Policy.packs_experts`."""

    def __init__(self, policy: X16Policy):
        self.policy = policy

    def packs(self, t) -> bool:
        return self.policy.packs_experts(t)

    def shape(self, t) -> tuple[int, int]:
        return t.shape[1], x16_bytes(t.raw.shape[-1], t.qtype)

    def pack(self, t, src: np.ndarray, dst: np.ndarray) -> None:
        K = _kernels()
        K.repack_x16_serial(read_only(src), dst, t.qtype)

    def pack_all(self, t, raw: np.ndarray) -> np.ndarray:
        raw = read_only(raw)  # [E, N, row bytes]
        out = np.empty((*raw.shape[:-1], x16_bytes(raw.shape[-1], t.qtype)), np.uint8)
        if raw.shape[-2] % X16_ROWS == 0:  # (the groups of every expert at once)
            repack_on_threads(raw.reshape(-1, raw.shape[-1]), out.reshape(-1, out.shape[-1]), t.qtype)
        else:
            for a, o in zip(raw.reshape(-1, *raw.shape[-2:]), out.reshape(-1, *out.shape[-2:])):
                repack_on_threads(a, o, t.qtype)
        out.flags.writeable = False
        return out


@functools.cache
def _repack_pool(threads: int):
    from concurrent.futures import ThreadPoolExecutor

    return ThreadPoolExecutor(threads, thread_name_prefix="onebit-repack")


def repack_on_threads(raw: np.ndarray, out: np.ndarray, qtype: int) -> None:
    """Rows raw [N, row bytes] (read only) of type qtype into out in their X16 layout, on the
    kernels' threads (numba's count for the calling thread): each thread runs the serial repack
    (repack_x16_serial, nogil) on a run of whole groups of 16 rows, the last run also the N % 16
    rows after them; the same bytes as the repack of the whole. The repacks' parallel kernels
    are not used: their first compile took 3-4 times the serial ones' (Gemma 3 270M's three
    layouts: 18.3 s against 4.6 on the shared 2-core VM, bench/bench_compile.py)."""
    K = _kernels()
    import numba

    threads, groups = numba.get_num_threads(), raw.shape[0] // X16_ROWS
    per = -(-groups // threads) * X16_ROWS if groups else raw.shape[0]  # rows a thread (whole groups)
    starts = list(range(0, raw.shape[0], per)) or [0]
    if len(starts) == 1:
        K.repack_x16_serial(raw, out, qtype)
        return
    ends = starts[1:] + [raw.shape[0]]
    for f in [_repack_pool(threads).submit(K.repack_x16_serial, raw[a:b], out[a:b], qtype)
              for a, b in zip(starts, ends)]:
        f.result()


class CpuBackend(NumpyBackend):
    name = "cpu"
    reference = False  # (the numpy backend's schedule, its own kernels)

    def __init__(self, gguf, experts=None, policy: Optional[X16Policy] = None, threads: Optional[int] = None):
        """`policy`: the tensors it holds in X16 layouts (default: `memory_policy`'s); `threads`:
        the kernels' threads (default: numba's, every core)."""
        wait_policy()  # (before numba starts its worker threads: a first parallel region, or get_num_threads)
        super().__init__(gguf, experts)
        K = _kernels()
        import numba

        if threads is not None and not 1 <= threads <= numba.config.NUMBA_NUM_THREADS:
            raise UsageError(f"--threads {threads}: the cpu backend runs 1 to {numba.config.NUMBA_NUM_THREADS} "
                             "threads here (numba's thread pool: $NUMBA_NUM_THREADS, else every core)")
        self.policy = policy if policy is not None else self.memory_policy(gguf)
        self.cpu_target = K.describe_target()
        self.K = K.kernels_for(gguf, self.policy.repacks)  # compiled for the file's quant types (or all, if cached)
        self._asked_threads, self._threads_set = threads, threading.local()
        self.threads = threads if threads is not None else default_threads()
        _one_blas_thread()
        filled = 0.0
        if self.K.cache_is_cold():  # the first run of these types on this machine: say so before it starts
            sys.stderr.write(f"onebit: compiling the cpu kernels for {', '.join(self.K.names)} (once per machine: "
                             "seconds per type, split over the cores)...\n")
            filled = self.K.fill_cache(_compile_progress)
        seconds, compiled = self.K.warm_up()
        if filled or compiled:  # later runs load the kernels from numba's disk cache
            sys.stderr.write(f"onebit: compiled the cpu kernels in {filled + seconds:.1f} s (once: they are cached "
                             "on disk)\n")
        slow = sorted({t.type_name for t in gguf.tensors.values() if t.qtype not in K.SUPPORTED and len(t.shape) > 1})
        if slow:
            msg = f"{', '.join(slow)} tensors have no cpu kernel yet: they run on the numpy reference path"
            sys.stderr.write(f"onebit: note: {msg}\n")
            log.info(msg)
        self._raw: dict[str, tuple] = {}
        self._products: dict[str, tuple] = {}
        self._small: dict[str, tuple] = {}
        self._layer_parts: dict[int, tuple] = {}
        self._fused: dict[tuple, tuple] = {}
        self._inv_freq: dict[tuple, np.ndarray] = {}

    @classmethod
    def memory_policy(cls, gguf, repack_from: Optional[int] = None) -> X16Policy:
        return X16Policy(cls, gguf, repack_from)

    @classmethod
    def open(cls, gguf, experts=None, device=None, slot_arrays=None, policy=None, threads=None) -> "CpuBackend":
        return cls(gguf, experts, policy, threads)

    def _threads_here(self) -> None:
        """numba's thread count belongs to the calling thread: set the asked one in each thread
        that runs these kernels (serve runs them in its worker thread, not the loading one).
        Marked per thread, not by thread id: a thread that starts after another ended may get its
        id (the load's thread, then serve's), and numba's count starts over in it."""
        if self._asked_threads is not None and not getattr(self._threads_set, "done", False):
            import numba

            numba.set_num_threads(self._asked_threads)
            self._threads_set.done = True

    def repack(self, experts: bool = True) -> None:
        """Make every repacked matrix now (`_product_raw`), as llama.cpp repacks at load: not
        inside the first prompt; and hold the file's experts in the X16Experts layout (a pool's
        slots get it from the pool). A model's own backend does at load; one that serves a
        device backend's predictor does not: it repacks only the matrices it uses, when it
        uses them, and reads experts as its source holds them. Not the file's experts when
        `experts` is false (a model loaded resident past its budget: copies of every expert
        would take memory the file's map could at least give back)."""
        self._threads_here()
        for name, t in self.gguf.tensors.items():
            if self.policy.packs(t):
                self._product_raw(name)
        layout = self.policy.experts
        if experts and layout is not None and type(self.source) is FileExperts and self.source.layout is None:
            self.source = FileExperts(self.gguf, layout)  # (a pool packs as it fills: Model gives it the layout)
            self.source.pack()
            self._layer_parts.clear()

    def describe(self) -> str:
        return f"{self.threads} threads"

    def _kernel_raw(self, name: str):
        """The tensor and its raw bytes as the kernels take them, or None for the numpy path."""
        t = self.gguf.tensor(name)
        if t.qtype not in self.K.SUPPORTED:
            return t, None
        hit = self._raw.get(name)
        if hit is None or hit[0] is not t.raw:  # a memory plan may swap the map for a copy
            hit = self._raw[name] = (t.raw, read_only(t.raw))
        return t, hit[1]

    def _product_raw(self, name: str):
        """(tensor, type id, raw bytes) of a weight matrix as the products take it, kept per name
        (`_kept`: a linear asks every token): rows of a type with an X16 layout repacked 16 to a group
        (where the policy `packs` it) from the file's map, whose pages are then given back (a streamed
        model's load leaves these tensors mapped for this: no copy beside the repacked one);
        else `_kernel_raw`'s."""
        return self._kept(self._products, name, [name], lambda: self._product(name))

    def _product(self, name: str):
        K = _kernels()
        t, raw = self._kernel_raw(name)
        mapped = isinstance(t.raw, np.memmap) or isinstance(t.raw.base, np.memmap)
        if raw is None or not self.policy.packs(t) or not mapped:
            return t, t.qtype, raw
        packed = np.empty((raw.shape[0], x16_bytes(raw.shape[1], t.qtype)), np.uint8)
        rows = max(16, REPACK_PART // raw.shape[1] // 16 * 16)
        for a in range(0, raw.shape[0], rows):  # (a part at a time, each part's pages given back
            # as it is done: the map's pages and the copy are never both whole in memory)
            repack_on_threads(raw[a : a + rows], packed[a : a + rows], t.qtype)
            self.gguf.release(t, uncache=True, lo=a * raw.shape[1], hi=(a + rows) * raw.shape[1])
        packed.flags.writeable = False
        return t, K.x16_type(t.qtype), packed

    def weight(self, name: str) -> np.ndarray:
        """The numpy backend's float32 weight, read only; a small one (a norm's, a bias) decoded
        once and kept: a decode layer asks for four or more of them."""
        t = self.gguf.tensor(name)
        hit = self._small.get(name)
        if hit is not None and hit[0] is t.raw:  # (a memory plan may swap the map for a copy)
            return hit[1]
        w = _ro32(super().weight(name))
        if w.size <= SMALL_WEIGHT:
            self._small[name] = (t.raw, w)
        return w

    def embed(self, name: str, ids: np.ndarray) -> np.ndarray:
        t, raw = self._kernel_raw(name)
        if raw is None:
            return super().embed(name, ids)
        self._threads_here()
        out = np.empty((len(ids), t.shape[-1]), np.float32)  # [R, dim]
        self.K.get_rows(out, raw, np.asarray(ids, dtype=np.int64), t.qtype, self.K.LUT, self.K.M)
        return out

    def linears(self, x: np.ndarray, names) -> list[np.ndarray] | None:
        """x @ W.T for two or three matrices of the same input width (q, k, v; an MLP's gate and
        up) in one parallel region, or None when one of them takes another path."""
        fused = self._kept(self._fused, tuple(names), names, lambda: self._fuse(names))
        if fused is None:
            return None
        self._threads_here()
        w0, w1, w2, q0, q1, q2, a, b, n = fused
        out = np.empty((x.shape[0], n), np.float32)  # [R, N0 + N1 + N2]
        self.K.matmul3(out, _f32(x), w0, w1, w2, q0, q1, q2)
        return [out[:, :a], out[:, a:b], out[:, b:]][: len(names)]

    def _fuse(self, names):
        """matmul3's arguments for `linears` of these matrices, or None (another path)."""
        if len(names) not in (2, 3):
            return None
        got = [self._product_raw(n)[1:] for n in names]
        if any(raw is None or raw.ndim != 2 for _, raw in got):
            return None
        if len(got) == 2:  # a third matrix of no rows
            got.append((got[0][0], got[0][1][:0]))
        (q0, w0), (q1, w1), (q2, w2) = got
        a, b = w0.shape[0], w0.shape[0] + w1.shape[0]
        return w0, w1, w2, q0, q1, q2, a, b, b + w2.shape[0]

    def linear(self, x: np.ndarray, name: str) -> np.ndarray:
        t, qtype, raw = self._product_raw(name)
        if raw is None or raw.ndim != 2:
            return super().linear(x, name)
        self._threads_here()
        out = np.empty((x.shape[0], t.shape[0]), np.float32)  # [R, out]
        small = x.shape[0] * raw.shape[0] * t.shape[-1] < self.K.SERIAL_WORK
        (self.K.matmul_serial if small else self.K.matmul)(out, _f32(x), raw, qtype)
        return out

    # -- the small ops: serial kernels (numpy's per-call overhead would cost more than the work)

    def rms_norm(self, x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
        x2 = _ro32(x.reshape(-1, w.shape[-1]))  # [rows, D]: a norm over the last axis
        out = np.empty(x2.shape, np.float32)
        self.K.rms_norm(out, x2, _ro32(w), float(eps))
        return out.reshape(x.shape)

    def rope(self, x: np.ndarray, pos: np.ndarray, n_rot: int, theta: float, neox: bool, scale: float = 1.0,
             factors: np.ndarray | None = None):
        """numpy's rope in a serial kernel; `factors` (rope_freqs.weight) divide the frequencies."""
        inv = self._inv_freq.get((n_rot, theta))
        if inv is None:
            inv = theta ** (-np.arange(0, n_rot, 2, dtype=np.float64) / n_rot)  # [n_rot/2]
            inv = self._inv_freq[(n_rot, theta)] = read_only(inv)
        if factors is not None:
            inv = read_only(inv / np.asarray(factors, dtype=np.float64).reshape(-1)[: n_rot // 2])
        out = np.empty(x.shape, np.float32)  # [R, H, D]
        self.K.rope(out, _ro32(x), _ro64(pos), inv, float(scale), bool(neox))
        return out

    reads_kv_blocks = True  # decode attention reads a quantized cache's blocks (kv_attention.py)

    def make_cache(self, cfg, capacity: int = 0, swa_rows: int = SWA_ROWS):
        if not self.kv_types.plain:
            self._blocks_kernel()  # (compiled, or loaded from the disk cache, before a request needs it)
        return super().make_cache(cfg, capacity, swa_rows)

    _kv_blocks = None

    def _blocks_kernel(self):
        """(kv_attention.attention_blocks, its type codes), run once on a tiny input first
        (compiled, or loaded from numba's disk cache)."""
        if self._kv_blocks is None:
            from .kv_attention import KV_CODES, attention_blocks

            q = np.zeros((1, 1, 32), np.float32)
            kv = np.zeros((1, 1, 34), np.uint8)  # (one q8_0 block)
            attention_blocks(np.empty_like(q), q, kv, 1, kv, 1, np.zeros(1, np.int64), 0, np.float32(1),
                             self.K.LUT, self.K.M)
            self._kv_blocks = attention_blocks, KV_CODES
        return self._kv_blocks

    def attention(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, q_pos: np.ndarray, window: int = 0,
                  scale: float | None = None, sinks: np.ndarray | None = None):
        R, H, D = q.shape
        if isinstance(k, KVRows) or isinstance(v, KVRows):  # a quantized cache's blocks (reads_kv_blocks)
            if R > FEW_ROWS or sinks is not None or not (isinstance(k, KVRows) and isinstance(v, KVRows)):
                k, v = _decoded(k), _decoded(v)
            else:
                kernel, codes = self._blocks_kernel()
                out = np.empty((R, H, v.shape[2]), np.float32)  # [R, H, Dv]
                kernel(out, _ro32(q), k.raw, codes[k.qtype.name], v.raw, codes[v.qtype.name], _ro64(q_pos),
                       int(window), np.float32(1.0 / math.sqrt(D) if scale is None else scale), self.K.LUT, self.K.M)
                return out.reshape(R, -1)  # [R, H*Dv]
        if sinks is not None:  # gpt-oss: its own q.k scale too
            if R > FEW_ROWS:
                return super().attention(q, k, v, q_pos, window, scale, sinks)
            out = np.empty((R, H, v.shape[2]), np.float32)  # [R, H, Dv]
            self.K.attention_sinks(out, _ro32(q), _ro32(k), _ro32(v), _ro64(q_pos),
                                   int(window), 1.0 / math.sqrt(D) if scale is None else float(scale), _ro32(sinks))
            return out.reshape(R, -1)  # [R, H*Dv]
        if R > FEW_ROWS:  # a prompt: numpy's batched products beat a serial loop
            return super().attention(q, k, v, q_pos, window, scale)
        out = np.empty((R, H, v.shape[2]), np.float32)  # [R, H, Dv]
        self.K.attention(out, _ro32(q), _ro32(k), _ro32(v), _ro64(q_pos), int(window),
                         1.0 / math.sqrt(D) if scale is None else float(scale))
        return out.reshape(R, -1)  # [R, H*Dv]

    def route(self, logits: np.ndarray, k: int, norm: bool):
        return self.K.route(_ro32(logits), int(k), bool(norm))

    # -- mixture of experts -------------------------------------------------------------

    @staticmethod
    def routed_rows(ids: np.ndarray, weights: np.ndarray, n_experts: int):
        """The experts chosen (ascending) and, per expert, the rows it serves and their weights:
        experts [n], offs [n+1], rows [R*k], rw [R*k] (expert j serves rows[offs[j]:offs[j+1]])."""
        K = _kernels()
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        return K.routed_rows(ids, np.ascontiguousarray(weights, dtype=np.float32), int(n_experts))

    def _expert_parts(self, layer: int):
        """The layer's expert tensors, whether the kernels take them all, and their type ids as
        the source holds them (Q4_K_X16, Q6_K_X16 where its layout packs them)."""
        K = _kernels()
        parts = [self.gguf.tensor(f"blk.{layer}.{p}.weight") for p in EXPERT_PARTS]
        layout = self.source.layout  # (ExpertSource: None, or the layout it holds packed)
        qtypes = [K.x16_type(t.qtype) if layout is not None and layout.packs(t) else t.qtype for t in parts]
        return parts, all(t.qtype in self.K.SUPPORTED for t in parts), qtypes

    def expert_call(self, out, y, x, qtypes, raws, sel, js, offs, rows, rw, add, eids, biases=None, glu=None) -> None:
        """y[rows of expert j] = its FFN for j in js, expert j at raws[*][sel[i]] (js[i] = j) of
        type ids `qtypes` (as the source holds them); then, if add, out[rows] += rw * y over every
        routed row (`expert_ffn`). With `glu` (gpt-oss), the clamped SwiGLU and the biases of
        experts eids[j]."""
        qg, qu, qd = qtypes
        if glu is None:
            self.K.expert_ffn(out, y, x, raws[0], raws[1], raws[2], sel, js, offs, rows, rw, add, qg, qu, qd)
            return
        bg, bu, bd = biases
        self.K.expert_ffn_oai(out, y, x, raws[0], raws[1], raws[2], sel, js, eids, offs, rows, rw, add,
                              qg, qu, qd, bg, bu, bd, float(glu[0]), float(glu[1]))

    def expert_biases(self, layer: int):
        b = super().expert_biases(layer)
        return None if b is None else [_ro32(a) for a in b]

    def _kept(self, store: dict, key, names, make):
        """make(), kept in `store` under `key` while the file's tensors `names` are the objects
        they were when it was made (a memory plan may swap a tensor for a copy): what a decode
        step would otherwise look up again for every layer."""
        tensors = self.gguf.tensors
        hit = store.get(key)
        if hit is None or any(tensors.get(n) is not t for n, t in zip(names, hit[0])):
            hit = store[key] = ([tensors.get(n) for n in names], make())
        return hit[1]

    def _experts_of(self, layer: int):
        """(parts, fast, qtypes, biases) of `_expert_parts` and `expert_biases`, kept per layer (`_kept`)."""
        names = [f"blk.{layer}.{p}.{k}" for p in EXPERT_PARTS for k in ("weight", "bias")]
        return self._kept(self._layer_parts, layer, names, lambda: (*self._expert_parts(layer),
                                                                    self.expert_biases(layer)))

    def experts(self, layer: int, x: np.ndarray, ids: np.ndarray, weights: np.ndarray, glu=None,
                seqs=None) -> np.ndarray:
        """The numpy backend's routed experts, reading their bytes from the expert source: one
        kernel call for experts all in memory; from a pool, a call for those resident, then one
        for each batch of reads that completes (`arriving`, given each sequence's routing), the
        last adding the outputs in order, so the sums are the same whatever the source."""
        parts, fast, qtypes, biases = self._experts_of(layer)
        if not fast or (biases is None) != (glu is None):  # (biases without the clamped SwiGLU: numpy)
            return super().experts(layer, x, ids, weights, glu)
        self._threads_here()
        x = _f32(x)
        out = np.zeros_like(x)
        experts, offs, rows, rw = self.routed_rows(ids, weights, parts[0].shape[0])
        y = np.empty((rows.shape[0], x.shape[1]), np.float32)  # [routed rows, dim]: each expert's output
        arrays = self.source.arrays(layer)  # [E or slots, rows, row_bytes], read only
        done = 0
        routed = [ids] if seqs is None else [ids[rows_of] for rows_of in seqs]
        for js, index in self.source.arriving(layer, experts, routed):  # (int64 arrays from the file: no copy)
            done += len(js)
            self.expert_call(out, y, x, qtypes, arrays, np.asarray(index, np.int64), np.asarray(js, np.int64),
                             offs, rows, rw, done == len(experts), experts, biases, glu)
        return out
