"""The compiled shaders in `spv/`, one method per kernel, recording into a `Sequence`.

Methods take device slices and shapes, check what the shaders assume (row lengths in whole
blocks, 16-byte aligned rows), split work that exceeds a device limit (bindings larger than
maxStorageBufferRange are `Part`s of a `DeviceTensor`; grids wider than
maxComputeWorkGroupCount fold into a second dimension), pack push constants and record.
`ops.VulkanOps` wraps them numpy-in / numpy-out for the tests; `reference` has the twins.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from importlib import resources
from typing import Optional, Sequence as Seq

import numpy as np

from ...formats.quants import QTYPES_BY_NAME, iq4_values, iq_grid
from .device import Buffer, Device, Pipeline, Sequence, Slice, VulkanKernelError

# Weights per shader block where it differs from the GGML block: float rows are read in runs of 16.
SHADER_QK = {"F32": 16, "F16": 16, "BF16": 16}
# Units (runs of weights sharing one scale) per shader block: QK / QU in shaders/dequant.glsl.
UNITS_PER_BLOCK = {"Q1_0": 4, "Q2_K": 16, "Q3_K": 16, "Q4_K": 8, "Q5_K": 8, "Q6_K": 16, "TQ1_0": 16, "TQ2_0": 8,
                   "IQ1_S": 8, "IQ1_M": 16, "IQ2_XXS": 8, "IQ2_XS": 16, "IQ2_S": 16, "IQ3_XXS": 8, "IQ3_S": 8,
                   "IQ4_XS": 8}
# Rows per thread of the thread-per-row mat-vec (CPU devices) where measured faster than the
# rule in Kernels._mv_rows gives (bench/results/vulkan-kernels-by-type-2026-12-02.md): the IQ2 types and IQ1_S
# (whole-unit decode, shaders/dequant.glsl UNIT_QDOT), IQ3_XXS, IQ3_S, TQ1_0 (2 -> 8) and IQ1_M
# (2 -> 4 -> 8: 1.1-1.3x over 4, its pipelines compile in ~1 s). More rows cost lavapipe compile
# time: about 3 s per pipeline at 8 rows for IQ3_S.
MV_ROWS_CPU = {"IQ1_S": 8, "IQ2_XXS": 8, "IQ2_XS": 8, "IQ2_S": 8, "IQ3_XXS": 8, "IQ3_S": 8, "TQ1_0": 8, "IQ1_M": 8}
# Types whose one-row mul_mv decodes a whole unit at a time (shaders/dequant.glsl UNIT_QDOT), so
# its sums run in another order than the many-row kernels': they keep the one-row kernel.
MV_WHOLE_UNIT = frozenset({"IQ1_S", "IQ2_XXS", "IQ2_XS", "IQ2_S"})
# The types whose one-row mat-vec reads a block as the uvec4s around it (shaders/dequant.glsl
# block_window; specialization constant 3, W_ALIGNED, where rows are whole 16-byte runs); IQ1_M's
# sums stay term for term the many-row kernel's, so it is not in MV_WHOLE_UNIT.
MV_WINDOW = MV_WHOLE_UNIT | {"IQ1_M"}
# Grouped expert mat-vec (Kernels.mul_mv_id_xr) with 32 weight rows per thread, not 16: the
# types whose 32-row pipeline compiles in under 10 s on lavapipe (Q4_K 7.9 s, Q6_K 9.3 s;
# Q5_K 13.6 s and MXFP4 10.9 s did not).
MV_ID_XR_WIDE = frozenset({"Q4_K", "Q6_K", "Q8_0"})
# Weight types with shaders: those shaders/variants.py built a get_rows variant for.
SUPPORTED_TYPES = tuple(sorted(
    v[len("get_rows_"):] for v in json.loads((resources.files(__package__) / "spv" / "manifest.json").read_text())
    ["variants"] if v.startswith("get_rows_")
))

# Types whose shaders read a codebook buffer (shaders/dequant.glsl, GRID_BINDING): which grid.
GRID_OF = {"IQ1_S": "IQ1_S", "IQ1_M": "IQ1_S", "IQ2_XXS": "IQ2_XXS", "IQ2_XS": "IQ2_XS", "IQ2_S": "IQ2_S",
           "IQ3_XXS": "IQ3_XXS", "IQ3_S": "IQ3_S", "IQ4_NL": "IQ4", "IQ4_XS": "IQ4"}
# The IQ1/2/3 codebooks are bound as a uniform buffer of this size (shaders/dequant.glsl: the
# largest grid, 2048 words; a UBO's array has a fixed size), IQ4's four words as a storage buffer.
GRID_UBO_BYTES = 8192


def grid_words(grid: str) -> np.ndarray:
    """The codebook `grid` packed as the shaders read it (uint32): IQ2 entries (8 magnitudes
    below 256) as two words of four bytes, IQ3 entries (4) as one word, IQ1 entries (8 values
    of -1, 0, 1) as one word of nibbles holding value + 1, IQ4 the 16 int8 levels in 4 words."""
    if grid == "IQ4":
        return iq4_values().astype(np.int8).view(np.uint32)
    g = iq_grid(grid).astype(np.int64)
    if grid.startswith("IQ1"):
        nib = (g + 1) << (4 * np.arange(8))
        return nib.sum(axis=1).astype(np.uint32)
    b = g.reshape(-1, 4) << (8 * np.arange(4))
    return b.sum(axis=1).astype(np.uint32)


MAX_EXPERTS = 1024  # softmax_topk.comp keeps one row of logits in shared memory
MAX_TOPK = 32
MAX_GROUPS = 64  # sigmoid_topk.comp: expert groups per row
ATTN_MAX_D = 256  # attn.comp: a head of q in shared memory (GPU variant) or registers (CPU variant)
ATTN_DV_PER_THREAD = 4  # GPU variant: output dims per thread
DELTA_MAX_D = 256  # delta_rule.comp: a state column per invocation, in registers
DELTA_MAX_CHUNK = 32  # delta_chunk.comp: rows per block (its shared pair terms are MAX_C x MAX_C) ...
DELTA_CHUNK_MIN_ROWS = 16  # as the numpy backend's chunked form (GPU devices; see Kernels.delta_chunk_min_rows)
DELTA_CHUNK_KEYS = 4096  # ... and rows per block x head width <= this (the block's keys in shared memory)
DELTA_CHUNK_SHARED = 4 * (DELTA_CHUNK_KEYS + 2 * DELTA_MAX_CHUNK ** 2 + 4 * DELTA_MAX_CHUNK)  # its shared bytes


# lavapipe (llvmpipe) ends any loop of a shader invocation after 65535 iterations, counting
# nested loops' iterations too, silently (measured: the step kernel's rows past ~65535 / (3 D + 1)
# were never written). The delta kernels' row loops are long, so a chunk is split over
# dispatches of at most `delta_dispatch_rows` rows (the state carries over in place).
LOOP_LIMIT = 65535


def delta_dispatch_rows(head_dim: int, chunk: int = 0) -> int:
    """Rows per dispatch keeping delta_rule.comp (chunk 0) or delta_chunk.comp (blocks of
    `chunk` rows) under LOOP_LIMIT loop iterations per invocation, with a margin."""
    D, budget = head_dim, LOOP_LIMIT // 2 - 2 * head_dim  # half: room for how a driver counts
    if not chunk:
        return max(1, budget // (3 * D + 2))
    n = chunk
    per_block = 4 * n + (-(-n // D)) * (2 * D + 1) + (-(-n * n // D)) * (D + 1) + n * (3 * D + n + 3) + D
    return max(1, budget // per_block) * n


def delta_chunk_rows(head_dim: int) -> int:
    """delta_chunk.comp's block: the most rows its shared memory holds, at most DELTA_MAX_CHUNK."""
    return min(DELTA_MAX_CHUNK, DELTA_CHUNK_KEYS // head_dim)



def shader_qk(type_name: str) -> int:
    return SHADER_QK.get(type_name, QTYPES_BY_NAME[type_name].block_size)


@dataclass(frozen=True)
class Part:
    """Outer rows (2-D) or experts (3-D) [start, start + count) of a tensor, in one binding."""

    slice: Slice
    start: int
    count: int


@dataclass(frozen=True)
class DeviceTensor:
    """A weight tensor on the device, in its file's quantized layout. shape: numpy order."""

    name: str
    type_name: str
    shape: tuple[int, ...]
    parts: tuple[Part, ...]

    @property
    def ncols(self) -> int:
        return self.shape[-1]


@dataclass(frozen=True)
class SlotLookup:
    """A router's slot-table outputs (shaders/slot_lut.glsl): the pool's expert -> slot table
    (all layers), the [R, k] slot table it writes, the miss flag, and the layer's first entry."""

    lut: Slice
    table: Slice
    miss: Slice
    base: int

    @property
    def bindings(self) -> tuple[Slice, Slice, Slice]:
        return self.lut, self.table, self.miss


def split_rows(n_outer: int, outer_bytes: int, limit: int, name: str = "tensor") -> list[tuple[int, int]]:
    """[start, count) runs of whole outer rows/experts, each at most `limit` bytes."""
    if outer_bytes > limit:
        raise VulkanKernelError(f"{name}: one row/expert of {outer_bytes} bytes exceeds the device's binding limit "
                                f"of {limit} bytes (maxStorageBufferRange)")
    per = max(1, limit // max(outer_bytes, 1))
    return [(s, min(per, n_outer - s)) for s in range(0, n_outer, per)]


def bound_bytes(nbytes: int) -> int:
    """A weight part's binding range: its bytes rounded up to 32-bit words plus one word to spare
    (at least 16 bytes), so that decoders may read blocks whose size is not a multiple of 4 as
    pairs of aligned words (shaders/dequant.glsl field_word) without leaving the binding. The
    part's allocation holds it (WeightStore._place, streaming.SlotArrays)."""
    return max(16, (nbytes + 3) // 4 * 4 + 4)


class WeightStore:
    """Weights in a few large allocations, laid out before anything is allocated.

    `add()` plans where each tensor's parts go; `commit()` allocates the chunks and copies
    every tensor from its memory map into them (one memcpy each on unified memory)."""

    def __init__(self, dev: Device, max_part_bytes: Optional[int] = None, chunk_bytes: Optional[int] = None):
        info = dev.info
        self.dev = dev
        self.align = max(16, info.min_storage_buffer_offset_alignment)
        self.part_limit = min(max_part_bytes or info.max_storage_buffer_range, info.max_storage_buffer_range)
        self.part_limit -= self.part_limit % self.align + self.align  # room for bound_bytes's spare word
        self.chunk_limit = min(chunk_bytes or (1 << 30), info.max_memory_allocation_size)
        self._pending: list[tuple[str, str, tuple, np.ndarray, list[tuple[int, int, int, int]]]] = []
        self._chunk_sizes: list[int] = []
        self.buffers: list[Buffer] = []

    def _place(self, nbytes: int) -> tuple[int, int]:
        if nbytes > self.chunk_limit:
            raise VulkanKernelError(f"a {nbytes}-byte part does not fit one allocation ({self.chunk_limit} bytes)")
        if not self._chunk_sizes or self._chunk_sizes[-1] + nbytes > self.chunk_limit:
            self._chunk_sizes.append(0)
        off = self._chunk_sizes[-1]
        self._chunk_sizes[-1] = off + (bound_bytes(nbytes) + self.align - 1) // self.align * self.align
        return len(self._chunk_sizes) - 1, off

    def add(self, name: str, raw: np.ndarray, type_name: str, shape: Seq[int]) -> int:
        """Plan tensor `name` (raw: uint8 [*shape[:-1], row_bytes]); returns its index."""
        raw = raw.reshape(-1, raw.shape[-1]) if raw.ndim == 1 else raw
        n_outer = raw.shape[0]
        outer_bytes = raw[0].nbytes if n_outer else 0
        parts = []
        for start, count in split_rows(n_outer, outer_bytes, self.part_limit, name):
            chunk, off = self._place(count * outer_bytes)
            parts.append((chunk, off, start, count))
        self._pending.append((name, type_name, tuple(shape), raw, parts))
        return len(self._pending) - 1

    @property
    def planned_bytes(self) -> int:
        return sum(self._chunk_sizes)

    def commit(self, uploaded=None) -> list[DeviceTensor]:
        """Upload every tensor added; `uploaded(name)` is called after each one's copy."""
        self.buffers = [self.dev.buffer(size) for size in self._chunk_sizes]
        out = []
        for name, type_name, shape, raw, parts in self._pending:
            outer_bytes = raw[0].nbytes if raw.shape[0] else 0
            dparts = []
            for chunk, off, start, count in parts:
                buf = self.buffers[chunk]
                buf.write(raw[start : start + count], off)
                dparts.append(Part(buf.slice(off, bound_bytes(count * outer_bytes)), start, count))
            out.append(DeviceTensor(name, type_name, shape, tuple(dparts)))
            if uploaded is not None:
                uploaded(name)
        self._pending = []
        return out


def default_reduce(info) -> str:
    """How mat-vec splits rows on this device (see shaders/mul_mv.comp)."""
    if info.type == "cpu":
        return "none"
    return "subgroup" if info.subgroup_arithmetic else "shmem"


def _push(fmt: str, *values) -> bytes:
    return struct.pack("<" + fmt, *values)


class Kernels:
    """Pipelines for one device, and a recording method per kernel."""

    def __init__(self, dev: Device, reduce: Optional[str] = None):
        self.dev = dev
        self.reduce = reduce or default_reduce(dev.info)
        self._spv: dict[str, bytes] = {}
        self._manifest = json.loads((resources.files(__package__) / "spv" / "manifest.json").read_text())["variants"]
        # Mat-vec shape (specialization constants). A CPU device (lanes are SIMD slots, every
        # lane's load costs the same) wants one subgroup per workgroup and many rows per thread,
        # so each x load serves them all; a GPU wants threads along k and a few rows per group.
        if self.reduce == "none":
            self.mv_wg, self.mv_rows = max(dev.info.subgroup_size, 4), 8
        else:
            self.mv_wg, self.mv_rows = max(32, min(dev.info.subgroup_size, 64)), 2
        # Thread-per-row mat-vec unrolls rows x units of a block; past ~32 copies of the
        # dequantizer, LLVM (lavapipe) compiles for many seconds for little gain.
        self.mv_unrolled = 32
        # Products over several rows of x on a CPU device: up to this many rows per weight decode
        # (shaders/mul_mv.comp XROWS), mv_xr_nr weight rows per thread; 0 or 1: mat-vec per row.
        # Measured on lavapipe (bench/results/execution-modes-2026-12-01.md): 16 rows x 8 weight rows
        # per thread beat 4-8 x 1-4 at 16 rows of x; pipelines compile in 2-6 s.
        self.mv_xrows = 16 if self.reduce == "none" else 0
        self.mv_xr_nr = 8
        # Routed experts are grouped per expert (mul_mv_id_xr) where each expert gets at least this
        # many slots on average (n_tokens * k / n_experts). Measured on lavapipe, Q4_K gate + down
        # (bench/results/execution-modes-2026-12-01.md): 64 experts top 8, 0.5 / 1.1 / 2 / 3 / 8 slots
        # per expert 0.77x / 0.89x / 1.04-1.24x / 1.56x / 2.0x; 4 experts top 2, 1.5 / 2 / 3 / 4:
        # 1.13x / 1.23x / 1.68x / 1.78x.
        self.mv_id_xr_min_slots = 2
        # Grouped experts: rows of x per decode at most 8 and more weight rows per thread than the
        # dense kernel (x is a storage buffer there, each read a bounds-checked gather, so it
        # pays to serve more rows): Q4_K experts at 256 tokens 2.2x with 8 rows x 16 wide,
        # 3.0x with 16 x 8, 3.9x with 32 x 8 (bench/results/execution-modes-2026-12-01.md).
        self.mv_id_xrows = 8
        self.mv_id_xr_nr = 16
        # The many-row kernels reading x from a storage buffer (the grouped experts, and dense where
        # x fits no uniform buffer) read each vec4 of a unit once per subgroup and shuffle it to the
        # lanes (mul_mv.comp X_SHUFFLE): a workgroup of one subgroup of at least 8 lanes (the widest
        # unit, 32 weights, is 8 vec4s). Lavapipe: grouped Q4_K experts 1.13-1.17x, Q6_K 1.00-1.07x.
        self.x_shuffle = self.reduce == "none" and dev.info.subgroup_shuffle and dev.info.subgroup_size >= 8 \
            and self.mv_wg == dev.info.subgroup_size
        # The dense many-row kernel: x from a uniform buffer where a chunk of rows fits one (a
        # uniform read is one load on lavapipe, a storage read a loop over the lanes), unless x
        # is shuffled: then from storage, all rows in one dispatch (lavapipe, [out x 1024] at
        # 2-256 rows, 12 types: 1.03-1.80x; bench/results/execution-modes-2026-12-01.md).
        self.mv_xr_uniform = not self.x_shuffle
        self._scratch: list[Buffer] = []
        # Up to this many rows of x, products use mat-vec per row; beyond, the tiled mat-mat.
        # On a CPU device mat-vec per row is faster at any size (the tiled kernel's shared
        # memory and barriers are slow there), so it is always used.
        self.mv_max_rows = 1 << 30 if dev.info.type == "cpu" else 4
        # Routed experts take the tiled expert mat-mat (mul_mm_id: each expert's weights read once
        # per 32 of its slots, where the per-slot mat-vec reads them once per slot) where the
        # experts get at least this many slots each on average. Not measured on a GPU; the rule
        # is a model of one: a tile always computes 32 slots, so an expert with s slots costs the
        # tiled kernel about 32 * 2 / (bytes per weight) flops per weight byte against the
        # mat-vec's s weight reads, and on an APU (~256 GB/s, a few TFLOPS from this simple
        # kernel) that evens out near s = 6. CPU devices never take it: they group experts on the
        # thread-per-row kernel (mul_mv_id_xr), since shared memory and barriers are slow there.
        self.mm_id_min_slots = math.inf if dev.info.type == "cpu" else 8
        # Prompt chunks of at least this many rows take the chunked delta rule (delta_chunk.comp),
        # fewer the one-step-per-row kernel; 0: never. On lavapipe the chunked kernel measured no
        # faster end to end (bench/results/hybrid-deltanet-2026-12-02.md), so CPU devices keep the step
        # kernel; GPUs take the numpy backend's threshold (not measured on a GPU), if the kernel's
        # shared memory fits (Vulkan guarantees only 16 KiB).
        self.delta_chunk_min_rows = 0 if dev.info.type == "cpu" or \
            dev.info.max_compute_shared_memory_size < DELTA_CHUNK_SHARED else DELTA_CHUNK_MIN_ROWS
        self.wg = 64
        # rms_norm's and the routers' workgroup (a row each): on CPU devices one subgroup (lavapipe
        # runs a workgroup of several subgroups as coroutines switching at every barrier)
        self.row_wg = dev.info.subgroup_size if dev.info.type == "cpu" and dev.info.subgroup_size >= 4 else self.wg
        # CPU devices: attention over at least this many rows takes attn.comp ROWS (the lanes walk
        # the keys together, one row each; needs a subgroup of at most 16 lanes with arithmetic and
        # shuffle); 0: the one-row kernel at any R.
        # (Bit for bit, a row's result depends on which of the two kernels ran it: `row_chunks`
        # gives a forward of more than one row no one-row chunk.)
        info = dev.info
        self.attn_rows_able = self.reduce == "none" and info.subgroup_arithmetic and info.subgroup_shuffle \
            and 4 <= info.subgroup_size <= 16
        self.attn_rows = 2 if self.attn_rows_able else 0
        self.attn_rows_heads = 4  # ... query heads of one KV head per workgroup (K/V read once for them)
        self._grids: dict[str, Buffer] = {}  # codebooks of the IQ types, uploaded on first use

    # -- pipelines ------------------------------------------------------------------------

    def spirv(self, variant: str) -> bytes:
        code = self._spv.get(variant)
        if code is None:
            if variant not in self._manifest:
                raise VulkanKernelError(f"kernel {variant}: no such shader variant in the package "
                                        "(rebuild with shaders/build.py)")
            try:
                code = (resources.files(__package__) / "spv" / f"{variant}.spv").read_bytes()
            except OSError as e:
                raise VulkanKernelError(f"kernel {variant}: its SPIR-V is missing from the package ({e})") from e
            self._spv[variant] = code
        return code

    def pipeline(self, variant: str, n_bindings: int, spec: Seq[int | float] = (), uniform: Seq[int] = ()) -> Pipeline:
        return self.dev.pipeline(variant, self.spirv(variant), n_bindings, spec, uniform)

    X_UNIFORM_MAX = 65536  # shaders/mul_mv.comp X_UNIFORM: x4[4096]

    def _mv_variant(self, name: str, type_name: str, n_bindings: int, x: Slice) -> tuple[str, tuple[int, ...]]:
        """A mat-vec variant and its uniform-buffer bindings: the `_ux` one (x read from a uniform
        buffer, binding 1) where the package has it and x fits the device's uniform buffer limits."""
        uniform = self._grid_ubo(type_name, n_bindings)
        info = self.dev.info
        if (f"{name}_ux" in self._manifest and x.size <= min(info.max_uniform_buffer_range, self.X_UNIFORM_MAX)
                and x.offset % info.min_uniform_buffer_offset_alignment == 0):
            return f"{name}_ux", (1, *uniform)
        return name, uniform

    @staticmethod
    def _grid_ubo(type_name: str, n_bindings: int) -> tuple[int, ...]:
        """The bindings a weight type's shaders read as uniform buffers: the IQ1/2/3 codebook (last)."""
        grid = GRID_OF.get(type_name)
        return (n_bindings - 1,) if grid is not None and grid != "IQ4" else ()

    def _extra(self, type_name: str) -> tuple[Slice, ...]:
        """Buffers a weight type's shaders bind after the kernel's own: an IQ type's codebook."""
        grid = GRID_OF.get(type_name)
        if grid is None:
            return ()
        buf = self._grids.get(grid)
        if buf is None:
            words = grid_words(grid)
            if grid != "IQ4":  # the uniform buffer's declared size
                words = np.concatenate([words, np.zeros(GRID_UBO_BYTES // 4 - words.size, np.uint32)])
            buf = self._grids[grid] = self.dev.upload(words)
        return (buf.slice(0, buf.size),)

    def _grid(self, n: int) -> tuple[int, int]:
        """Fold n workgroups into (x, y) under maxComputeWorkGroupCount; kernels use flat_group()."""
        mx = self.dev.info.max_workgroup_count[0]
        if n <= mx:
            return max(n, 1), 1
        return mx, math.ceil(n / mx)

    @staticmethod
    def _check_rows(kernel: str, type_name: str, ncols: int, *strides: int) -> None:
        if type_name not in SUPPORTED_TYPES:
            raise VulkanKernelError(f"kernel {kernel}: weight type {type_name} has no shader")
        qk = shader_qk(type_name)
        if ncols % qk:
            raise VulkanKernelError(f"kernel {kernel}_{type_name}: row length {ncols} is not a multiple of {qk}")
        if any(s % 4 for s in strides):
            raise VulkanKernelError(f"kernel {kernel}_{type_name}: row strides {strides} must be multiples of 4 floats")

    # -- matrix products ------------------------------------------------------------------

    def _mv_rows(self, type_name: str) -> int:
        if self.reduce != "none":
            return self.mv_rows
        if type_name in MV_ROWS_CPU:
            return min(self.mv_rows, MV_ROWS_CPU[type_name])
        # codebook lookups are per-lane gathers, each many instructions on lavapipe: fewer rows
        cost = UNITS_PER_BLOCK.get(type_name, 1) * (4 if type_name in GRID_OF else 1)
        return max(2, min(self.mv_rows, self.mv_unrolled // cost))

    @staticmethod
    def _w_aligned(w: DeviceTensor) -> int:
        """1 where a block's offset within 16 bytes is the same in every row of w (MV_WINDOW types:
        the one-row mat-vec then takes it from the block's index in its row, the same in every
        lane): every row a whole number of 16 bytes, every part's binding on a 16-byte boundary."""
        if w.type_name not in MV_WINDOW:
            return 0
        cls = QTYPES_BY_NAME[w.type_name]
        row_bytes = w.ncols // cls.block_size * cls.type_size
        return int(row_bytes % 16 == 0 and all(p.slice.offset % 16 == 0 for p in w.parts))

    def _mv_spec(self, w: DeviceTensor) -> tuple[int, ...]:
        """The one-row mat-vec's specialization constants: workgroup, rows per thread (or group),
        and for the MV_WINDOW types (constant 2, XROWS' width, unused there) W_ALIGNED."""
        spec = (self.mv_wg, self._mv_rows(w.type_name))
        return spec + (1, 1) if self._w_aligned(w) else spec

    def _mv_rows_per_group(self, type_name: str) -> int:
        return self._mv_rows(type_name) * (self.mv_wg if self.reduce == "none" else 1)

    def matmul(self, seq: Sequence, w: DeviceTensor, x: Slice, y: Slice, n_rows: int, x_stride: int, y_stride: int,
               accumulate: bool = False) -> None:
        """y[r, :] (+)= W @ x[r, :], with mat-vec or the tiled mat-mat, whichever suits n_rows here."""
        mul = self.mul_mv if n_rows <= self.mv_max_rows else self.mul_mm
        mul(seq, w, x, y, n_rows, x_stride, y_stride, accumulate)

    def mul_mv(self, seq: Sequence, w: DeviceTensor, x: Slice, y: Slice, n_rows: int, x_stride: int, y_stride: int,
               accumulate: bool = False) -> None:
        """y[r, :] (+)= W @ x[r, :] for r < n_rows; W: [out, in]."""
        self._check_rows("mul_mv", w.type_name, w.ncols, x_stride)
        # (not the whole-unit IQ types: their one-row dot, unit_qdot, sums in another order, and a
        # row must get the same bits from either kernel)
        if n_rows > 1 and self.mv_xrows > 1 and self.reduce == "none" and w.type_name not in MV_WHOLE_UNIT \
                and x.offset % 16 == 0 \
                and x.offset % self.dev.info.min_storage_buffer_offset_alignment == 0 \
                and x_stride * 4 % self.dev.info.min_storage_buffer_offset_alignment == 0:
            self.mul_mv_xr(seq, w, x, y, n_rows, x_stride, y_stride, accumulate)
            return
        extra = self._extra(w.type_name)
        name, uniform = self._mv_variant(f"mul_mv_{w.type_name}_{self.reduce}", w.type_name, 3 + len(extra), x)
        p = self.pipeline(name, 3 + len(extra), self._mv_spec(w), uniform)
        for part in w.parts:
            gx, gy = self._grid(math.ceil(part.count / self._mv_rows_per_group(w.type_name)))
            push = _push("10I", w.ncols, part.count, part.start, x_stride, y_stride, int(accumulate), 0, 0, 0, 0)
            seq.dispatch(p, (part.slice, x, y, *extra), push, (gx, gy, n_rows), writes=(2,))

    XR_WIDTHS = (2, 4, 8, 16)  # XROWS pipelines compiled (rows of x per weight decode)

    def _xr_width(self, n: int) -> int:
        """The XROWS pipeline for chunks of n rows: the narrowest width >= n (its rows past n are
        computed and dropped; a width per n would be 15 pipelines of 2-5 s compile each)."""
        return next((v for v in self.XR_WIDTHS if v >= min(n, self.mv_xrows)), self.XR_WIDTHS[-1])

    def _xr_chunks(self, n_rows: int, per: int) -> list[tuple[int, int]]:
        """[r0, count) chunks of at most `per` rows, as even as possible (count <= the first's)."""
        n = math.ceil(n_rows / per)
        size = math.ceil(n_rows / n)
        return [(r0, min(size, n_rows - r0)) for r0 in range(0, n_rows, size)]

    def mul_mv_xr(self, seq: Sequence, w: DeviceTensor, x: Slice, y: Slice, n_rows: int, x_stride: int,
                  y_stride: int, accumulate: bool = False) -> None:
        """mul_mv with each weight unit decoded once for up to mv_xrows rows of x (thread per row,
        CPU devices). Rows go in even chunks of at most mv_xrows, one per workgroup layer z; a
        dispatch takes as many chunks as its x binding holds: all of them from a storage buffer
        (shuffled where x_shuffle), or a 64 KiB uniform window's worth (mv_xr_uniform)."""
        self._check_rows("mul_mv", w.type_name, w.ncols, x_stride)
        info = self.dev.info
        row_bytes = x_stride * 4
        ubo = min(info.max_uniform_buffer_range, self.X_UNIFORM_MAX)
        per_ubo = ubo // row_bytes if x.offset % info.min_uniform_buffer_offset_alignment == 0 \
            and row_bytes % info.min_uniform_buffer_offset_alignment == 0 else 0
        uniform = self.mv_xr_uniform and per_ubo >= min(2, n_rows)
        per = min(self.mv_xrows, per_ubo) if uniform else self.mv_xrows
        extra = self._extra(w.type_name)
        n_bind = 3 + len(extra)
        name = f"mul_mv_{w.type_name}_none_{'xr' if uniform else 'xrs'}"
        ubos = ((1,) if uniform else ()) + self._grid_ubo(w.type_name, n_bind)
        nr, chunks = self.mv_xr_nr, self._xr_chunks(n_rows, per)
        size = chunks[0][1]  # rows per layer (the last chunk may have fewer)
        shuffle = int(self.x_shuffle and not uniform)
        p = self.pipeline(name, n_bind, (self.mv_wg, nr, self._xr_width(size), 0, shuffle), ubos)
        layers = max(1, per_ubo // size) if uniform else len(chunks)  # chunks per dispatch
        for i in range(0, len(chunks), layers):
            group = chunks[i : i + layers]
            r0, count = group[0][0], sum(c for _, c in group)
            off = r0 * row_bytes  # x bound from row r0 on (row strides are whole 16-byte words)
            xs = x.buffer.slice(x.offset + off, min(count * row_bytes, x.size - off) if uniform else x.size - off)
            for part in w.parts:
                gx, gy = self._grid(math.ceil(part.count / (nr * self.mv_wg)))
                push = _push("13I", w.ncols, part.count, part.start, x_stride, y_stride, int(accumulate), 0, 0, 0, 0,
                             count, r0, size)
                seq.dispatch(p, (part.slice, xs, y, *extra), push, (gx, gy, len(group)), writes=(2,))

    def mul_mm(self, seq: Sequence, w: DeviceTensor, x: Slice, y: Slice, n_rows: int, x_stride: int, y_stride: int,
               accumulate: bool = False) -> None:
        """Tiled y[r, :] (+)= W @ x[r, :] for r < n_rows (prefill)."""
        self._check_rows("mul_mm", w.type_name, w.ncols, x_stride)
        extra = self._extra(w.type_name)
        p = self.pipeline(f"mul_mm_{w.type_name}", 3 + len(extra), (), self._grid_ubo(w.type_name, 3 + len(extra)))
        for part in w.parts:
            push = _push("7I", w.ncols, part.count, part.start, n_rows, x_stride, y_stride, int(accumulate))
            groups = (math.ceil(part.count / 32), math.ceil(n_rows / 32), 1)  # 32 x 32 output tiles
            seq.dispatch(p, (part.slice, x, y, *extra), push, groups, writes=(2,))

    def mul_mv_id(self, seq: Sequence, w: DeviceTensor, x: Slice, y: Slice, ids: Slice, wts: Slice, n_tokens: int,
                  k: int, x_stride: int, x_slot_stride: int, y_stride: int, mode: str = "slots",
                  accumulate: bool = False, n_experts: Optional[int] = None) -> None:
        """Expert mat-vec; W: [n_experts, out, in], ids/wts: [n_tokens, k] on the device.

        mode "slots":    y[t*k + s, :] = W[ids[t, s]] @ x[t, s]
        mode "weighted": same, times wts[t, s] (the routing weight fused)
        mode "sum":      y[t, :] (+)= sum_s wts[t, s] * W[ids[t, s]] @ x[t, s]
        x[t, s] starts at t * x_stride + s * x_slot_stride (x_slot_stride 0: shared by all slots).
        n_experts: the model's experts, which sets whether the slots are grouped per expert (default
        W's count; a pool's slot tensors pass the model's, so streamed runs the kernels resident does).
        """
        self._check_rows("mul_mv_id", w.type_name, w.ncols, x_stride, x_slot_stride)
        info = self.dev.info
        grouped = n_tokens * k >= self.mv_id_xr_min_slots * (n_experts or w.shape[0])
        if (self.reduce == "none" and self.mv_xrows > 1 and grouped and n_tokens * k <= self.XR_MAX_IDS
                and w.type_name not in MV_WHOLE_UNIT and ids.offset % info.min_uniform_buffer_offset_alignment == 0):
            self.mul_mv_id_xr(seq, w, x, y, ids, wts, n_tokens, k, x_stride, x_slot_stride, y_stride, mode, accumulate,
                              n_experts)
            return
        if n_tokens > 1 and n_tokens * k >= self.mm_id_min_slots * (n_experts or w.shape[0]):
            self.mul_mm_id(seq, w, x, y, ids, wts, n_tokens, k, x_stride, x_slot_stride, y_stride, mode, accumulate)
            return
        flags = {"slots": 0, "weighted": 4, "sum": 2}[mode]
        extra = self._extra(w.type_name)
        name, uniform = self._mv_variant(f"mul_mv_id_{w.type_name}_{self.reduce}", w.type_name, 5 + len(extra), x)
        p = self.pipeline(name, 5 + len(extra), self._mv_spec(w), uniform)
        nrows = w.shape[1]
        gx, gy = self._grid(math.ceil(nrows / self._mv_rows_per_group(w.type_name)))
        gz = n_tokens if mode == "sum" else n_tokens * k
        for i, part in enumerate(w.parts):
            acc = int(mode == "sum" and (accumulate or i > 0))
            push = _push("10I", w.ncols, nrows, 0, x_stride, y_stride, flags | acc, k, x_slot_stride, part.start,
                         part.count)
            seq.dispatch(p, (part.slice, x, y, ids, wts, *extra), push, (gx, gy, gz), writes=(2,))

    XR_MAX_IDS = 4096  # shaders/mul_mv.comp XROWS + MUL_ID: ids4[1024]

    def _scratch_slice(self, nbytes: int) -> Slice:
        """A device buffer of at least nbytes for kernels' intermediates (grown, never freed while
        recorded sequences may use the old ones; hazards are tracked per slice as for any buffer)."""
        if not self._scratch or self._scratch[-1].size < nbytes:
            self._scratch.append(self.dev.buffer(max(nbytes, 2 * self._scratch[-1].size if self._scratch else 0)))
        return self._scratch[-1].slice(0, nbytes)

    def mul_mv_id_xr(self, seq: Sequence, w: DeviceTensor, x: Slice, y: Slice, ids: Slice, wts: Slice, n_tokens: int,
                     k: int, x_stride: int, x_slot_stride: int, y_stride: int, mode: str = "slots",
                     accumulate: bool = False, n_experts: Optional[int] = None) -> None:
        """mul_mv_id with the slots grouped per expert on the device (CPU devices): each unit of an
        expert's rows decoded once for up to mv_xrows of the slots that chose it. "sum" writes the
        weighted slots to a scratch buffer, then moe_sum adds each token's."""
        extra = self._extra(w.type_name)
        n_bind = 5 + len(extra)
        nr, nrows = self.mv_id_xr_nr * (2 if w.type_name in MV_ID_XR_WIDE else 1), w.shape[1]
        # width: about the slots each expert gets (an expert with more runs several passes)
        per = min(self.mv_id_xrows, self._xr_width(max(2, n_tokens * k // (n_experts or w.shape[0]))))
        p = self.pipeline(f"mul_mv_id_{w.type_name}_none_xrs", n_bind, (self.mv_wg, nr, per, 0, int(self.x_shuffle)),
                          (3, *self._grid_ubo(w.type_name, n_bind)))
        if mode == "sum":
            out, out_stride, flags = self._scratch_slice(n_tokens * k * nrows * 4), nrows, 4
        else:
            out, out_stride, flags = y, y_stride, 4 if mode == "weighted" else 0
        ids_u = ids.buffer.slice(ids.offset, min(ids.size, self.XR_MAX_IDS * 4))
        gx, gy = self._grid(math.ceil(nrows / (nr * self.mv_wg)))
        for part in w.parts:
            push = _push("12I", w.ncols, nrows, 0, x_stride, out_stride, flags, k, x_slot_stride, part.start,
                         part.count, n_tokens, 0)
            seq.dispatch(p, (part.slice, x, out, ids_u, wts, *extra), push, (gx, gy, part.count), writes=(2,))
        if mode == "sum":
            self._moe_sum(seq, w, out, ids, y, n_tokens, k, y_stride, accumulate)

    def _moe_sum(self, seq: Sequence, w: DeviceTensor, p: Slice, ids: Slice, y: Slice, n_tokens: int, k: int,
                 y_stride: int, accumulate: bool) -> None:
        """y[t, :] (+)= the sum of token t's weighted slot rows in p ([n_tokens * k, out]), for the
        slots whose expert is in one of w's parts (the grouped kernels' "sum" mode)."""
        nrows = w.shape[1]
        e_lo, e_hi = w.parts[0].start, w.parts[-1].start + w.parts[-1].count
        vec = 4 if nrows % 4 == 0 and y_stride % 4 == 0 and y.offset % 16 == 0 and p.offset % 16 == 0 else 1
        ps = self.pipeline("moe_sum4" if vec == 4 else "moe_sum", 3, (256,))
        gx, gy = self._grid(math.ceil(n_tokens * nrows // vec / 256))
        seq.dispatch(ps, (p, ids, y), _push("5I2i", nrows, n_tokens, k, y_stride, int(accumulate), e_lo, e_hi),
                     (gx, gy, 1), writes=(2,))

    def mul_mm_id(self, seq: Sequence, w: DeviceTensor, x: Slice, y: Slice, ids: Slice, wts: Slice, n_tokens: int,
                  k: int, x_stride: int, x_slot_stride: int, y_stride: int, mode: str = "slots",
                  accumulate: bool = False) -> None:
        """mul_mv_id over many slots per expert on GPUs, tiled: moe_group lists each expert's slots, then
        mul_mm_id reads each 32-row weight tile of an expert once for up to 32 of its slots (the
        per-slot mat-vec reads the expert's weights once per slot). "sum" writes the weighted
        slots to scratch and moe_sum adds each token's. An expert may have any of the n_tokens * k
        slots (a router's ids per token are distinct, but a streamed pass over a row group points
        every other row's slots at one pool slot), so that is the lists' stride and the slot tiles'
        count; the tiles past an expert's own count return at once."""
        self._check_rows("mul_mm_id", w.type_name, w.ncols, x_stride, x_slot_stride)
        n_e, nrows = w.shape[0], w.shape[1]
        align = self.dev.info.min_storage_buffer_offset_alignment
        n_slots = n_tokens * k
        lists_at = -(-n_e * 4 // align) * align  # (binding offsets: aligned)
        out_at = -(-(lists_at + n_e * n_slots * 4) // align) * align
        total = out_at + (n_slots * nrows * 4 if mode == "sum" else 0)
        s = self._scratch_slice(total)
        counts = s.buffer.slice(s.offset, n_e * 4)
        lists = s.buffer.slice(s.offset + lists_at, n_e * n_slots * 4)
        pg = self.pipeline("moe_group", 3)
        seq.dispatch(pg, (ids, counts, lists), _push("3I", n_slots, n_slots, n_e), self._grid(n_e), writes=(1, 2))
        if mode == "sum":
            out, out_stride, flags = s.buffer.slice(s.offset + out_at, n_slots * nrows * 4), nrows, 4
        else:
            out, out_stride, flags = y, y_stride, 4 if mode == "weighted" else 0
        extra = self._extra(w.type_name)
        n_bind = 6 + len(extra)
        p = self.pipeline(f"mul_mm_id_{w.type_name}", n_bind, (), self._grid_ubo(w.type_name, n_bind))
        for part in w.parts:
            push = _push("10I", w.ncols, nrows, 0, n_slots, x_stride, out_stride, flags, k, x_slot_stride, part.start)
            groups = (math.ceil(nrows / 32), math.ceil(n_slots / 32), part.count)  # 32 x 32 tiles per expert
            seq.dispatch(p, (part.slice, x, out, counts, lists, wts, *extra), push, groups, writes=(2,))
        if mode == "sum":
            self._moe_sum(seq, w, out, ids, y, n_tokens, k, y_stride, accumulate)

    # -- lookups and elementwise --------------------------------------------------------------

    def get_rows(self, seq: Sequence, w: DeviceTensor, ids: Slice, out: Slice, n_ids: int, out_stride: int) -> None:
        """out[r, :] = dequantized W[ids[r], :]."""
        self._check_rows("get_rows", w.type_name, w.ncols, out_stride)
        extra = self._extra(w.type_name)
        p = self.pipeline(f"get_rows_{w.type_name}", 3 + len(extra), (self.wg,), self._grid_ubo(w.type_name, 3 + len(extra)))
        gx = math.ceil(w.ncols // 4 / self.wg)
        for part in w.parts:
            push = _push("4I", w.ncols, part.count, part.start, out_stride)
            seq.dispatch(p, (part.slice, ids, out, *extra), push, (gx, n_ids, 1), writes=(2,))

    def elementwise(self, seq: Sequence, op: str, a: Slice, b: Optional[Slice], out: Slice, n: int,
                    nb: Optional[int] = None) -> None:
        """out = a + b | a * b | silu(a) | silu(a) * b | gelu(a) * b | b * tanh(a / b) over n floats
        (b repeats every nb)."""
        p = self.pipeline(op, 3, (256,))
        gx, gy = self._grid(math.ceil(n / 256))
        seq.dispatch(p, (a, b if b is not None else a, out), _push("2I", n, nb or n), (gx, gy, 1), writes=(2,))

    def expert_glu_oai(self, seq: Sequence, g: Slice, u: Slice, ids: Slice, bg: Slice, bu: Slice, h: Slice,
                       n_slots: int, F: int, alpha: float, limit: float) -> None:
        """gpt-oss: h = glu(g + bg[ids], u + bu[ids]) per expert slot; g, u, h: [n_slots, F],
        ids: [n_slots] expert ids, bg, bu: [E, F] (glu: `NumpyBackend.glu_oai`)."""
        p = self.pipeline("expert_glu_oai", 6, (256,))
        n = n_slots * F
        gx, gy = self._grid(math.ceil(n / 256))
        seq.dispatch(p, (g, u, ids, bg, bu, h), _push("3I2f", n, F, 1, alpha, limit), (gx, gy, 1), writes=(5,))

    def expert_down_bias(self, seq: Sequence, y: Slice, ids: Slice, wts: Slice, bd: Slice, n_rows: int, k: int,
                         dim: int) -> None:
        """gpt-oss: y[r] += sum_s wts[r, s] * bd[ids[r, s]]; y: [R, dim], ids/wts: [R, k], bd: [E, dim]."""
        p = self.pipeline("expert_down_bias", 4, (256,))
        n = n_rows * dim
        gx, gy = self._grid(math.ceil(n / 256))
        seq.dispatch(p, (y, ids, wts, bd), _push("3I2f", n, dim, k, 0.0, 0.0), (gx, gy, 1), writes=(0,))

    def rms_norm(self, seq: Sequence, x: Slice, w: Optional[Slice], out: Slice, n_rows: int, n: int, eps: float,
                 x_stride: Optional[int] = None, out_stride: Optional[int] = None) -> None:
        vec = n % 4 == 0 and (x_stride or n) % 4 == 0 and (out_stride or n) % 4 == 0 \
            and all(s.offset % 16 == 0 for s in (x, out, *((w,) if w is not None else ())))
        p = self.pipeline("rms_norm4" if vec else "rms_norm", 3, (self.row_wg,))
        gx, gy = self._grid(n_rows)
        push = _push("3IfI", n, x_stride or n, out_stride or n, eps, int(w is not None))
        seq.dispatch(p, (x, w if w is not None else x, out), push, (gx, gy, 1), writes=(2,))

    def rope(self, seq: Sequence, x: Slice, pos: Slice, out: Slice, n_rows: int, n_heads: int, head_dim: int,
             n_rot: int, theta: float, neox: bool, scale: float = 1.0, x_stride: Optional[int] = None,
             out_stride: Optional[int] = None, factors: Optional[Slice] = None) -> None:
        """factors: [n_rot/2] floats that divide each frequency (Llama 3's `rope_freqs.weight`)."""
        if head_dim % 2 or n_rot % 2 or n_rot > head_dim:
            raise VulkanKernelError(f"kernel rope: n_rot {n_rot} / head_dim {head_dim} must be even, n_rot <= head_dim")
        p = self.pipeline("rope", 4, (self.wg,))
        row = n_heads * head_dim
        push = _push("5I2f2I", n_heads, head_dim, n_rot, x_stride or row, out_stride or row, math.log2(theta), scale,
                     int(neox), int(factors is not None))
        seq.dispatch(p, (x, pos, out, factors if factors is not None else pos), push,
                     (math.ceil(n_heads * head_dim // 2 / self.wg), n_rows, 1), writes=(2,))

    def softmax_topk(self, seq: Sequence, logits: Slice, ids: Slice, wts: Slice, n_rows: int, n_experts: int, k: int,
                     norm: bool, stride: Optional[int] = None, lut: Optional[SlotLookup] = None) -> None:
        """lut: also write each chosen expert's pool slot (shaders/slot_lut.glsl)."""
        if n_experts > MAX_EXPERTS or not 0 < k <= min(MAX_TOPK, n_experts):
            raise VulkanKernelError(f"kernel softmax_topk: {n_experts} experts / top {k} outside its limits "
                                    f"({MAX_EXPERTS} experts, top {MAX_TOPK})")
        gx, gy = self._grid(n_rows)
        push = _push("4I", n_experts, k, stride or n_experts, int(norm))
        if lut is None:
            seq.dispatch(self.pipeline("softmax_topk", 3, (self.row_wg,)), (logits, ids, wts), push, (gx, gy, 1),
                         writes=(1, 2))
            return
        seq.dispatch(self.pipeline("softmax_topk_lut", 6, (self.row_wg,)), (logits, ids, wts, *lut.bindings),
                     push + _push("I", lut.base), (gx, gy, 1), writes=(1, 2, 4, 5))

    def sigmoid_topk(self, seq: Sequence, logits: Slice, bias: Optional[Slice], ids: Slice, wts: Slice, n_rows: int,
                     n_experts: int, k: int, norm: bool, scale: float = 1.0, groups: int = 1, groups_used: int = 1,
                     stride: Optional[int] = None, lut: Optional[SlotLookup] = None) -> None:
        """GLM-4.5's router (numpy twin: NumpyBackend.route_sigmoid): the top k by sigmoid(logit)
        + bias within the best `groups_used` of `groups` groups, weighted by sigmoid(logit)."""
        bad_groups = groups < 1 or n_experts % groups or groups > MAX_GROUPS or not 1 <= groups_used <= groups
        if n_experts > MAX_EXPERTS or not 0 < k <= min(MAX_TOPK, n_experts) or bad_groups:
            raise VulkanKernelError(f"kernel sigmoid_topk: {n_experts} experts in {groups} groups ({groups_used} "
                                    f"used) / top {k} outside its limits ({MAX_EXPERTS} experts, {MAX_GROUPS} "
                                    f"groups, top {MAX_TOPK})")
        gx, gy = self._grid(n_rows)
        flags = int(norm) | (2 if bias is not None else 0)
        push = _push("6If", n_experts, k, stride or n_experts, flags, groups, groups_used, scale)
        bufs = (logits, bias if bias is not None else logits, ids, wts)
        if lut is None:
            seq.dispatch(self.pipeline("sigmoid_topk", 4, (self.row_wg,)), bufs, push, (gx, gy, 1), writes=(2, 3))
            return
        seq.dispatch(self.pipeline("sigmoid_topk_lut", 7, (self.row_wg,)), (*bufs, *lut.bindings),
                     push + _push("I", lut.base), (gx, gy, 1), writes=(2, 3, 5, 6))

    def argmax(self, seq: Sequence, x: Slice, out: Slice, n_rows: int, n: int, stride: Optional[int] = None) -> None:
        p = self.pipeline("argmax", 2, (self.wg,))
        gx, gy = self._grid(n_rows)
        seq.dispatch(p, (x, out), _push("2I", n, stride or n), (gx, gy, 1), writes=(1,))

    def greedy_next(self, seq: Sequence, logits: Slice, tok: Slice, pos: Slice, out: Slice, n: int) -> None:
        """A greedy step's tail: tok[0] = argmax of logits[:n] (the lowest index of ties), pos[0]
        += 1, out[0:2] = (that token, 1 if any logit is NaN or inf else 0)."""
        p = self.pipeline("greedy_next", 4, (self.wg,))
        seq.dispatch(p, (logits, out, tok, pos), _push("2I", n, n), (1, 1, 1), writes=(1, 2, 3))

    def nonfinite(self, seq: Sequence, x: Slice, flag: Slice, n: int) -> None:
        """flag[0] |= 1 if any of the n floats in x is NaN or inf (the caller zeroes it first)."""
        p = self.pipeline("nonfinite", 2, (self.wg,))
        gx, gy = self._grid(math.ceil(n / (16 * self.wg)))
        seq.dispatch(p, (x, flag), _push("I", n), (gx, gy, 1), writes=(1,))

    def attention(self, seq: Sequence, q: Slice, k: Slice, v: Slice, pos: Slice, out: Slice, n_rows: int,
                  n_heads: int, n_kv_heads: int, head_dim: int, head_dim_v: int, n_kv: int, window: int = 0,
                  scale: Optional[float] = None, sinks: Optional[Slice] = None) -> None:
        """Causal GQA attention of rows at positions pos[r] over cached positions 0..pos[r] (with a
        window > 0: only the last `window` positions up to pos[r]); scores q.k * scale (default
        1/sqrt(head_dim)); sinks: [H] logits that join each head's softmax denominator (gpt-oss).
        q: [R, H, D]; k: [S, Hkv, D]; v: [S, Hkv, Dv], S = n_kv, holding position p in row p % S
        (a sliding-window ring: S is its capacity); out: [R, H * Dv]."""
        cpu = self.reduce == "none"
        max_dv = ATTN_MAX_D if cpu else ATTN_DV_PER_THREAD * self.wg
        bad_dims = head_dim > ATTN_MAX_D or head_dim_v > max_dv or (cpu and (head_dim | head_dim_v) % 4)
        if bad_dims or n_heads % n_kv_heads:
            raise VulkanKernelError(f"kernel attn: head dims {head_dim}/{head_dim_v}, heads {n_heads}/{n_kv_heads} "
                                    "outside its limits")
        push = _push("9If2I", n_heads, n_kv_heads, head_dim, head_dim_v, n_kv, n_heads * head_dim, n_kv_heads * head_dim,
                     n_kv_heads * head_dim_v, n_heads * head_dim_v, 1.0 / math.sqrt(head_dim) if scale is None else scale,
                     int(window), int(sinks is not None))
        sg = self.dev.info.subgroup_size
        groups = (n_heads, n_rows, 1)
        if cpu and self.attn_rows and n_rows >= self.attn_rows:  # a workgroup per gh heads and WG rows
            group = n_heads // n_kv_heads
            # (at most 256 dims of q and output per lane over its heads: LLVM's compile time on
            # lavapipe grows with the unrolled body, 8.6 s at 4 heads of 64)
            most = min(group, self.attn_rows_heads, max(1, 256 // max(head_dim, head_dim_v)))
            gh = max(g for g in range(1, most + 1) if group % g == 0)
            p = self.pipeline("attn_rows", 6, (sg, head_dim, head_dim_v, gh))
            push += _push("I", n_rows)
            groups = (n_heads // gh, math.ceil(n_rows / sg), 1)
        elif cpu:  # one subgroup per workgroup; head dims are specialization constants
            p = self.pipeline("attn_none", 6, (sg, head_dim, head_dim_v))
        else:
            p = self.pipeline("attn", 6, (self.wg,))
        seq.dispatch(p, (q, k, v, pos, out, sinks if sinks is not None else q), push, groups, writes=(4,))

    def set_rows(self, seq: Sequence, src: Slice, pos: Slice, dst: Slice, n_rows: int, n: int,
                 src_stride: Optional[int] = None, dst_stride: Optional[int] = None, dst_rows: int = 0) -> None:
        """dst[pos[r], :n] = src[r, :n] (K/V into the cache at device-side positions); with
        dst_rows > 0, row pos[r] % dst_rows (a sliding-window ring)."""
        p = self.pipeline("set_rows", 3, (self.wg,))
        seq.dispatch(p, (src, pos, dst), _push("4I", n, src_stride or n, dst_stride or n, dst_rows),
                     (math.ceil(n / self.wg), n_rows, 1), writes=(2,))

    def set_rows_q(self, seq: Sequence, src: Slice, pos: Slice, dst: Slice, n_rows: int, n: int, type_name: str,
                   row_bytes: int, dst_rows: int = 0) -> None:
        """set_rows into a KV cache stored as ggml blocks of `type_name` (F16, Q8_0, Q4_0): row r
        of src quantized into row pos[r] (% dst_rows) of dst, `row_bytes` bytes a row."""
        p = self.pipeline(f"set_rows_{type_name}", 3, (self.wg,))
        seq.dispatch(p, (src, pos, dst), _push("4I", n, n, row_bytes, dst_rows),
                     (math.ceil(math.ceil(n / 32) / self.wg), n_rows, 1), writes=(2,))

    def hadamard(self, seq: Sequence, x: Slice, out: Slice, n_values: int, n: int) -> None:
        """out = x with every chunk of n floats rotated by the n x n Walsh-Hadamard matrix over
        sqrt(n) (numpy twin: cache.hadamard; n a power of two)."""
        p = self.pipeline("hadamard", 2, (64, n))
        chunks = n_values // n
        gx, gy = self._grid(math.ceil(chunks / 64))
        seq.dispatch(p, (x, out), _push("If", chunks, float(np.float32(1 / np.sqrt(n)))), (gx, gy, 1), writes=(1,))

    def kv_rows(self, seq: Sequence, cache: Slice, rows: Slice, out: Slice, n_kv: int, n: int, type_name: str,
                pos: Slice, n_rows: int) -> None:
        """out[i, :n] = row i of a KV cache stored as ggml blocks, dequantized (get_rows over
        rows 0 .. n_kv-1; `rows`: those ids, int32), the rows up to the forward's last position
        only (pos[n_rows - 1], read on the device; the attention reads no other)."""
        self._check_rows("get_rows", type_name, n, n)
        p = self.pipeline(f"kv_rows_{type_name}", 4, (self.wg,))
        gx = math.ceil(n // 4 / self.wg)
        chunk = 1 << 15  # (a grid's y at most 65535)
        for r0 in range(0, n_kv, chunk):
            m = min(chunk, n_kv - r0)
            ids = Slice(rows.buffer, rows.offset + 4 * r0, 4 * m)
            part = Slice(out.buffer, out.offset + 4 * n * r0, 4 * n * m)
            seq.dispatch(p, (cache, ids, part, pos), _push("5I", n, n_kv, 0, n, n_rows - 1), (gx, m, 1), writes=(2,))

    # -- Gated DeltaNet ----------------------------------------------------------------------

    def cols(self, seq: Sequence, a: Slice, out: Slice, n_rows: int, n: int, c0: int, w: int) -> None:
        """out[r, :w] = a[r, c0:c0 + w] over rows of length n (a split along the last axis)."""
        p = self.pipeline("cols", 2, (256,))
        gx, gy = self._grid(math.ceil(n_rows * w / 256))
        seq.dispatch(p, (a, out), _push("4I", n_rows, n, c0, w), (gx, gy, 1), writes=(1,))

    def gdn_gates(self, seq: Sequence, b: Slice, a: Slice, dt: Slice, A: Slice, beta: Slice, g: Slice,
                  n_rows: int, n_heads: int) -> None:
        """beta = sigmoid(b), g = softplus(a + dt) * A over [n_rows, n_heads]."""
        p = self.pipeline("gdn_gates", 6, (self.wg,))
        n = n_rows * n_heads
        gx, gy = self._grid(math.ceil(n / self.wg))
        seq.dispatch(p, (b, a, dt, A, beta, g), _push("2I", n, n_heads), (gx, gy, 1), writes=(4, 5))

    def ssm_conv(self, seq: Sequence, x: Slice, hist: Slice, w: Slice, out: Slice, n_rows: int, channels: int,
                 taps: int) -> None:
        """out = silu(causal conv of x [R, C] after hist [K-1, C], taps w [C, K]); hist moves on, in place."""
        p = self.pipeline("ssm_conv", 4, (self.wg,))
        seq.dispatch(p, (x, hist, w, out), _push("3I", n_rows, channels, taps), (math.ceil(channels / self.wg), 1, 1),
                     writes=(1, 3))

    def delta_rule(self, seq: Sequence, q: Slice, k: Slice, v: Slice, g: Slice, beta: Slice, state: Slice,
                   out: Slice, n_rows: int, n_k_heads: int, n_v_heads: int, head_dim: int, eps: float,
                   tiled: bool) -> None:
        """The gated delta rule over R rows, one step per row; state [Hv, D, D] in place; out [R, Hv, D]."""
        if head_dim > DELTA_MAX_D or head_dim > self.dev.info.max_workgroup_size[0] or n_v_heads % n_k_heads:
            raise VulkanKernelError(f"kernel delta_rule: head width {head_dim}, heads {n_v_heads}/{n_k_heads} "
                                    f"outside its limits (width <= {DELTA_MAX_D})")
        p = self.pipeline("delta_rule", 7, (head_dim,))
        step = delta_dispatch_rows(head_dim)
        for r0 in range(0, n_rows, step):
            push = _push("5IfI", min(step, n_rows - r0), n_k_heads, n_v_heads, head_dim, int(tiled), eps, r0)
            seq.dispatch(p, (q, k, v, g, beta, state, out), push, (n_v_heads, 1, 1), writes=(5, 6))

    def delta_chunk(self, seq: Sequence, q: Slice, k: Slice, v: Slice, g: Slice, beta: Slice, state: Slice,
                    out: Slice, n_rows: int, n_k_heads: int, n_v_heads: int, head_dim: int, eps: float,
                    tiled: bool, chunk: int = 0) -> None:
        """The gated delta rule over R rows in its chunked form, blocks of `chunk` rows; state
        [Hv, D, D] in place; out [R, Hv, D] (chunk 0: `delta_chunk_rows`). The same sums as
        `delta_rule` in another order."""
        chunk = chunk or delta_chunk_rows(head_dim)
        if head_dim > DELTA_MAX_D or head_dim > self.dev.info.max_workgroup_size[0] or n_v_heads % n_k_heads \
                or not 1 <= chunk <= min(DELTA_MAX_CHUNK, DELTA_CHUNK_KEYS // head_dim):
            raise VulkanKernelError(f"kernel delta_chunk: head width {head_dim}, heads {n_v_heads}/{n_k_heads}, "
                                    f"block {chunk} outside its limits (width <= {DELTA_MAX_D}, "
                                    f"block <= {DELTA_MAX_CHUNK} and <= {DELTA_CHUNK_KEYS} / width)")
        p = self.pipeline("delta_chunk", 7, (head_dim,))
        step = delta_dispatch_rows(head_dim, chunk)
        for r0 in range(0, n_rows, step):
            push = _push("5IfII", min(step, n_rows - r0), n_k_heads, n_v_heads, head_dim, int(tiled), eps, chunk, r0)
            seq.dispatch(p, (q, k, v, g, beta, state, out), push, (n_v_heads, 1, 1), writes=(5, 6))

    def copy(self, seq: Sequence, src: Slice, dst: Slice) -> None:
        """dst = src with a shader (16-byte words); vkCmdCopyBuffer is `seq.copy`."""
        n = src.size // 16
        p = self.pipeline("copy", 2, (256,))
        gx, gy = self._grid(math.ceil(n / 256))
        seq.dispatch(p, (src, dst), _push("I", n), (gx, gy, 1), writes=(1,))
