"""Caches typed per layer, held by the `Cache` of one sequence, which also holds the position.

A layer's cache is the state its mixer keeps between forward passes: `KVCache` for attention
(keys and values by position), `RingKVCache` for a sliding-window attention layer (the last
positions only, as a ring), `RecurrentCache` for a Gated DeltaNet layer (conv history and
delta-rule state: a constant size, no positions, so it cannot trim). Every layer cache says
whether it can `trim` (drop the last positions in place) and gives a `snapshot` / `restore`
of its state; speculative decoding and prefix reuse (`PrefixCache`: a chat's turns, serve's
requests) roll back through `Cache.trim`, or, where a layer cannot trim, to a
`Cache.checkpoint` taken at the position to return to. `PromptCache` keeps copies of several
PrefixCaches' content beside them (serve's --cache-ram), least recently used dropped first.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np

from .errors import UsageError
from .formats.quants import QTYPES_BY_NAME
from .pause import PhasedHook

# The types a KV cache stores keys and values in, by llama.cpp's names for them (--cache-type-k,
# --cache-type-v): f32 (the default), or ggml's f16, q8_0 and q4_0 rows (the quantized ones in
# blocks of 32 values along each head, an f16 scale each).
KV_TYPES = ("f32", "f16", "q8_0", "q4_0")


def hadamard_size(which: str, width: int) -> int:
    """The Walsh-Hadamard rotation a quantized cache applies to each head's keys ("k") or values
    ("v") of `width` before quantizing, as llama.cpp does (llama-kv-cache.cpp, attn_rot_k / _v):
    for heads a multiple of 64 wide, keys in chunks of the largest power of two dividing the
    width, values in chunks of 64; 0 (none) for other widths. Spreading an outlier over the
    chunk keeps the blocks' scales small. Rotating q and k alike leaves q.k as it is (H is
    orthonormal and its own inverse): the attention reads the rotated rows, rotates q (R rows,
    not the cache's n) and rotates its output back where values are rotated."""
    if width % 64:
        return 0
    if which == "v":
        return 64
    n = 64
    while width % (2 * n) == 0:
        n *= 2
    return n


def hadamard(x: np.ndarray, n: int) -> np.ndarray:
    """x [..., W] with every chunk of n values (W a multiple of n, n a power of two) times the
    n x n Walsh-Hadamard matrix in Sylvester's order over sqrt(n) (ggml_gen_hadamard's). That
    matrix is H_a (x) H_b for n = a b, so a chunk as an a x b matrix X becomes H_a X H_b: two
    small products whatever n (a few calls for the one row of a decode step)."""
    a, b = _hadamard_factors(n)
    y = np.asarray(x, np.float32).reshape(-1, a.shape[0], b.shape[0])  # [chunks, a, b]
    return np.matmul(np.matmul(a, y), b).reshape(x.shape)


_FACTORS: dict[int, tuple[np.ndarray, np.ndarray]] = {}


def _hadamard_factors(n: int) -> tuple[np.ndarray, np.ndarray]:
    """(H_a / sqrt(a), H_b / sqrt(b)) with a b = n, a <= b, Sylvester's order, float32."""
    f = _FACTORS.get(n)
    if f is None:
        def sylvester(m: int) -> np.ndarray:
            h = np.ones((1, 1))
            while len(h) < m:
                h = np.block([[h, h], [h, -h]])
            return (h / np.sqrt(m)).astype(np.float32)

        a = 1 << (n.bit_length() - 1) // 2
        f = _FACTORS[n] = (sylvester(a), sylvester(n // a))
    return f


@dataclass(frozen=True)
class KVTypes:
    """The types one cache's keys (`k`) and values (`v`) are stored in; a quantized type needs
    head widths that are a multiple of its block (32)."""

    k: str = "f32"
    v: str = "f32"

    def __post_init__(self):
        for flag, name in (("--cache-type-k", self.k), ("--cache-type-v", self.v)):
            if name not in KV_TYPES:
                raise UsageError(f"{flag} {name!r} is not a cache type: use one of {', '.join(KV_TYPES)}")

    @property
    def plain(self) -> bool:
        """Both float32: the cache holds plain arrays."""
        return self.k == self.v == "f32"

    def qtype(self, which: str):
        """The quants class keys ("k") or values ("v") are stored as."""
        return QTYPES_BY_NAME[(self.k if which == "k" else self.v).upper()]

    def check(self, cfg) -> None:
        """Refuse a quantized type whose blocks would cross a head of this model (as llama.cpp does)."""
        for flag, which, width in (("--cache-type-k", "k", cfg.head_dim), ("--cache-type-v", "v", cfg.head_dim_v)):
            block = self.qtype(which).block_size
            if width % block:
                raise UsageError(f"{flag} {getattr(self, which)}: this model's heads are {width} wide, not a "
                                 f"multiple of the type's block of {block}; use f16 or f32")

    def position_bytes(self, cfg) -> int:
        """Bytes of one position's keys and values in one attention layer."""
        return cfg.n_kv_heads * (self.qtype("k").row_bytes(cfg.head_dim) + self.qtype("v").row_bytes(cfg.head_dim_v))


F32_KV = KVTypes()


class KVRows:
    """Keys or values of one layer stored in a ggml type other than f32: raw rows [positions, Hkv,
    row bytes] of its blocks. Indexed like the float32 array [positions, Hkv, width] it stands for:
    a read dequantizes (as ggml does), a write of float32 rows quantizes them (a write of KVRows
    copies their blocks). `rot` > 0: each head rotated in chunks of `rot` before quantizing and
    back after dequantizing (`hadamard_size`); `read` gives the rows still rotated, as the
    attention takes them."""

    def __init__(self, qtype, raw: np.ndarray, width: int, rot: int = 0):
        self.qtype, self.raw, self.width, self.rot = qtype, raw, width, rot

    @classmethod
    def zeros(cls, qtype, positions: int, heads: int, width: int, rot: int = 0) -> "KVRows":
        return cls(qtype, np.zeros((positions, heads, qtype.row_bytes(width)), np.uint8), width, rot)

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.raw.shape[0], self.raw.shape[1], self.width)

    @property
    def nbytes(self) -> int:
        return self.raw.nbytes

    def fill(self, value: float) -> None:
        """Every value `value`, as stored (one row quantized, its blocks copied to every row)."""
        row = np.full((1, 1, self.width), value, np.float32)
        self.raw[...] = self.qtype.quantize(hadamard(row, self.rot) if self.rot else row)

    def __getitem__(self, index) -> np.ndarray:
        raw = self.raw[index]  # [n, Hkv, row bytes]
        if raw.size == 0:
            return np.zeros((*raw.shape[:-1], self.width), np.float32)
        x = self.qtype.dequantize(raw)  # [n, Hkv, width]
        return hadamard(x, self.rot) if self.rot else x

    def read(self, index) -> np.ndarray:
        """Rows as stored, dequantized but not rotated back."""
        raw = self.raw[index]
        if raw.size == 0:
            return np.zeros((*raw.shape[:-1], self.width), np.float32)
        return self.qtype.dequantize(raw)

    def __setitem__(self, index, x) -> None:
        if isinstance(x, KVRows):
            self.raw[index] = x.raw
        else:
            self.raw[index] = self.qtype.quantize(hadamard(x, self.rot) if self.rot else x)

    def stored(self, x: np.ndarray) -> np.ndarray:
        """Rows x as `read` gives them back once written."""
        return self.qtype.dequantize(self.qtype.quantize(hadamard(x, self.rot) if self.rot else x))

    def view(self, n: int) -> "KVRows":
        """The first n positions' blocks, not copied."""
        return KVRows(self.qtype, self.raw[:n], self.width, self.rot)

    def head(self, n: int) -> "KVRows":
        """A copy of the first n positions' blocks."""
        return KVRows(self.qtype, self.raw[:n].copy(), self.width, self.rot)

    def grown(self, cap: int) -> "KVRows":
        out = KVRows.zeros(self.qtype, cap, self.raw.shape[1], self.width, self.rot)
        out.raw[: self.raw.shape[0]] = self.raw
        return out


def kv_rows(types: KVTypes, which: str, positions: int, heads: int, width: int):
    """Storage for one layer's keys ("k") or values ("v"): a float32 array, or KVRows of the type."""
    name = types.k if which == "k" else types.v
    if name == "f32":
        return np.zeros((positions, heads, width), np.float32)
    return KVRows.zeros(types.qtype(which), positions, heads, width, kv_rotation(name, which, width))


def kv_rotation(name: str, which: str, width: int) -> int:
    """The rotation (`hadamard_size`) a cache of type `name` applies to keys or values: quantized
    types only (llama.cpp's ggml_is_quantized: not f16)."""
    return hadamard_size(which, width) if name in ("q8_0", "q4_0") else 0


def _as_stored(a, x: np.ndarray) -> np.ndarray:
    """Rows x as storage `a` gives them to the attention once written (quantized, dequantized)."""
    return a.stored(x) if isinstance(a, KVRows) else x


def _read(a, index) -> np.ndarray:
    """Keys or values as the attention takes them: float32 rows (KVRows: still rotated)."""
    return a[index] if type(a) is np.ndarray else a.read(index)


def _view(a, n: int):
    """The first n positions of keys or values as stored, not copied."""
    return a.view(n) if isinstance(a, KVRows) else a[:n]


def _rotation(a) -> int:
    return a.rot if isinstance(a, KVRows) else 0


def _head(a, n: int):
    """A copy of the first n positions of keys or values as stored (a snapshot's)."""
    return a.head(n) if isinstance(a, KVRows) else a[:n].copy()


class KVCache:
    """Keys and values of one attention layer, by position, grown in steps.

    Positions past the sequence's length are never read, so trimming is free: the sequence
    moves its position back and later writes overwrite what was there."""

    step = 256
    can_trim = True
    plain = True  # float32 keys and values (else KVRows of ggml blocks)
    # the Hadamard chunk (`hadamard_size`; 0: none) of the keys and of the values `write`
    # returns: the attention rotates q by the first and its output back by the second
    rotation = (0, 0)

    def __init__(self, n_kv_heads: int, head_dim: int, head_dim_v: int, capacity: int = 0,
                 types: KVTypes = F32_KV):
        # capacity > 0: allocate (and touch) it all now, as the memory plan counted it
        self.keys = kv_rows(types, "k", capacity, n_kv_heads, head_dim)  # [cap, Hkv, D]
        self.values = kv_rows(types, "v", capacity, n_kv_heads, head_dim_v)  # [cap, Hkv, Dv]
        if not types.plain:
            self.plain, self.rotation = False, (_rotation(self.keys), _rotation(self.values))
        if capacity:
            self.keys.fill(0)
            self.values.fill(0)

    def write(self, start: int, k: np.ndarray, v: np.ndarray, blocks: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """Store k: [R, Hkv, D], v: [R, Hkv, Dv] at positions start..start+R-1; return every
        key and value up to the last of them: [start + R, Hkv, *] (rotated as `rotation` says).
        `blocks`: a quantized cache's as stored (KVRows, not decoded: for an attention that
        reads the blocks, `Backend.reads_kv_blocks`)."""
        n = start + k.shape[0]
        if n > self.keys.shape[0]:
            cap = (n + self.step - 1) // self.step * self.step
            self.keys = _grow(self.keys, cap)
            self.values = _grow(self.values, cap)
        self.keys[start:n] = k
        self.values[start:n] = v
        if self.plain:
            return self.keys[:n], self.values[:n]
        if blocks:
            return _view(self.keys, n), _view(self.values, n)
        return _read(self.keys, slice(0, n)), _read(self.values, slice(0, n))

    def trim(self, length: int) -> None:
        """The sequence is now `length` positions long (nothing to do: see the class note)."""

    def can_trim_to(self, length: int) -> bool:
        return True

    def reset(self) -> None:
        """An empty sequence."""
        self.trim(0)

    def snapshot(self, length: int):
        return _head(self.keys, length), _head(self.values, length)

    def restore(self, state) -> None:
        k, v = state
        self.write(0, k, v)

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes


SWA_ROWS = 256  # rows one forward may write into a ring before reading it (generate's prefill chunk,
# the Vulkan runner's MAX_ROWS): a ring holds window + SWA_ROWS - 1 positions
MIN_SWA_ROWS = 9  # 1 + lookup.MAX_DRAFTS: a verify forward's rows, so rejected drafts can always be trimmed


def ring_capacity(window: int, rows: int = SWA_ROWS) -> int:
    """Positions a sliding-window layer's ring holds: window + rows - 1 (see `RingKVCache`)."""
    return window + max(rows, MIN_SWA_ROWS) - 1


class RingKVCache:
    """Keys and values of one sliding-window attention layer: only its last `capacity` positions,
    position p in row p % capacity (rows grown in steps up to `capacity`, so a short sequence
    never holds more than it uses).

    The slack, from the facts of who reads what:
    - A row at position p attends to positions p - window + 1 .. p. A forward of R rows at
      start .. start+R-1 therefore reads window - 1 + R positions, after writing its own R: a
      ring of window + R - 1 positions holds all of them. `rows` (SWA_ROWS = 256 by default,
      the prefill chunk of generate and the largest forward the Vulkan runner records) is the R
      the ring is sized for: capacity = window + rows - 1 (rows below MIN_SWA_ROWS count as
      MIN_SWA_ROWS). llama.cpp sizes its SWA cache alike: min(context, window + one ubatch),
      padded to 256 cells. A forward of more rows still runs here: `write` returns the earlier
      positions the rows need and their own K/V together, read before the ring overwrites
      them; the Vulkan runner splits such a forward into chunks of `rows`.
    - Trimming to length L needs positions L - window + 1 .. L - 1 still held. After a forward
      of R <= rows rows at start, the ring holds start + R - capacity .. start + R - 1, so a trim
      back to any L >= start (lookup decoding rejects drafts of its last forward only, at most
      MAX_DRAFTS = 8 rows, and rows >= MIN_SWA_ROWS = 9) always succeeds.
    - Further back (a chat turn that keeps a common prefix shorter than what was run since) the
      ring may no longer hold what the prefix's end needs: `can_trim_to` says so, and the caller
      runs the prefix again (trimming to 0 always succeeds).
    `held_from` is the first position still held (positions below it were overwritten).
    snapshot / restore copy the ring (at most `capacity` positions) and `held_from`."""

    step = 256
    can_trim = True
    plain = KVCache.plain
    rotation = KVCache.rotation

    def __init__(self, n_kv_heads: int, head_dim: int, head_dim_v: int, window: int, capacity: int = 0,
                 rows: int = SWA_ROWS, types: KVTypes = F32_KV):
        self.window = int(window)
        self.capacity = ring_capacity(self.window, rows)
        self.rows = self.rows_for(self.window, rows)  # rows a forward writes before reading, at most
        n = min(int(capacity), self.capacity)  # capacity > 0: allocate (and touch) it now, as planned
        self.keys = kv_rows(types, "k", n, n_kv_heads, head_dim)  # [rows held, Hkv, D]
        self.values = kv_rows(types, "v", n, n_kv_heads, head_dim_v)
        if not types.plain:
            self.plain, self.rotation = False, (_rotation(self.keys), _rotation(self.values))
        if n:
            self.keys.fill(0)
            self.values.fill(0)
        self.held_from = 0

    @staticmethod
    def rows_for(window: int, rows: int = SWA_ROWS) -> int:
        """The most rows one forward may write into a ring sized for `rows` and still read."""
        return ring_capacity(window, rows) - window + 1

    def _need(self, length: int) -> int:
        """The first position a row at position `length` reads (besides its own)."""
        return max(0, length - self.window + 1)

    def can_trim_to(self, length: int) -> bool:
        need = self._need(length)
        return need >= length or need >= self.held_from

    def trim(self, length: int) -> None:
        """The sequence is now `length` positions long; positions past it are overwritten later."""
        if not self.can_trim_to(length):
            raise ValueError(f"a sliding-window ring of {self.capacity} positions no longer holds position "
                             f"{self._need(length)} (it holds {self.held_from} on): restore a snapshot or run "
                             "the prefix again")
        if length == 0:
            self.held_from = 0

    def reset(self) -> None:
        """An empty sequence."""
        self.trim(0)

    def advance(self, start: int, n: int) -> None:
        """Positions start .. start+n-1 are being written (on the host or the device): check the
        rows can read what they need, and note what the ring no longer holds."""
        if not self.can_trim_to(start):
            raise ValueError(f"sliding-window ring: position {self._need(start)} was overwritten")
        self.held_from = max(self.held_from, start + n - self.capacity)

    def _room(self, n: int) -> None:
        if n > self.keys.shape[0]:
            cap = min((n + self.step - 1) // self.step * self.step, self.capacity)
            self.keys = _grow(self.keys, cap)
            self.values = _grow(self.values, cap)

    def write(self, start: int, k: np.ndarray, v: np.ndarray, blocks: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """Store k: [R, Hkv, D], v: [R, Hkv, Dv] at positions start..start+R-1; return keys and
        values holding every position these rows read, position p in row p % (their length)
        (the attention op's contract): the ring itself, or, for a forward of more rows than the
        ring is sized for, the earlier positions they read and their own, read before writing.
        `blocks`: the ring of a quantized cache as stored (KVCache.write)."""
        R = k.shape[0]
        n = start + R
        self.advance(start, R)
        self._room(n)
        C = self.keys.shape[0]
        if R <= self.rows or n <= C:
            slots = np.arange(start, n) % C
            self.keys[slots] = k
            self.values[slots] = v
            if self.plain or blocks:
                return self.keys, self.values
            return _read(self.keys, slice(0, C)), _read(self.values, slice(0, C))
        lo = self._need(start)
        old = np.arange(lo, start) % C
        keys = np.concatenate([_read(self.keys, old), _as_stored(self.keys, k)])
        values = np.concatenate([_read(self.values, old), _as_stored(self.values, v)])
        m = min(R, C)  # the ring keeps the last C positions
        last = np.arange(n - m, n) % C
        self.keys[last] = k[R - m :]
        self.values[last] = v[R - m :]
        shift = lo % (n - lo)  # row p % (n - lo) holds position p
        return np.roll(keys, shift, axis=0), np.roll(values, shift, axis=0)

    def snapshot(self, length: int):
        rows = self.keys.shape[0] if self.held_from or length > self.keys.shape[0] else length
        return _head(self.keys, rows), _head(self.values, rows), self.held_from

    def restore(self, state) -> None:
        k, v, held_from = state
        self._room(k.shape[0])
        self.keys[: k.shape[0]] = k
        self.values[: v.shape[0]] = v
        self.held_from = held_from

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes


class RecurrentCache:
    """A Gated DeltaNet layer's state after the sequence's last position: the conv's input
    history (the last kernel - 1 rows) and the delta rule's state per value head.

    It holds no positions, so it cannot go back by itself: rolling back means restoring a
    snapshot taken at the position to return to (`Cache.checkpoint` / `Cache.rollback`)."""

    can_trim = False

    def __init__(self, conv_kernel: int, conv_channels: int, n_heads: int, head_dim: int):
        self.conv = np.zeros((conv_kernel - 1, conv_channels), np.float32)  # [K-1, C], oldest first
        self.state = np.zeros((n_heads, head_dim, head_dim), np.float32)  # [Hv, Dk, Dv]

    def trim(self, length: int) -> None:
        """Nothing to drop (`Cache.trim` refuses a real trim; a rollback restores a snapshot)."""

    def can_trim_to(self, length: int) -> bool:
        return False

    def reset(self) -> None:
        """The state of an empty sequence."""
        self.conv.fill(0)
        self.state.fill(0)

    def snapshot(self, length: int = 0):
        return self.conv.copy(), self.state.copy()

    def restore(self, state) -> None:
        conv, st = state
        self.conv[...] = conv
        self.state[...] = st

    @property
    def nbytes(self) -> int:
        return self.conv.nbytes + self.state.nbytes


def recurrent_state_bytes(cfg, elem_bytes: int = 4) -> int:
    """Bytes of every recurrent layer's state for one sequence (whatever its length)."""
    per = (cfg.ssm_conv_kernel - 1) * cfg.ssm_conv_channels + cfg.ssm_time_step_rank * cfg.ssm_state_size ** 2
    return len(cfg.recurrent_layers) * per * elem_bytes


def _grow(a, cap: int):
    if isinstance(a, KVRows):
        return a.grown(cap)
    out = np.zeros((cap, *a.shape[1:]), a.dtype)
    out[: a.shape[0]] = a
    return out


class Cache:
    """One sequence: a cache per layer, and `offset`, the number of positions it holds."""

    def __init__(self, layers: list):
        self.layers = layers
        self.offset = 0

    def __len__(self) -> int:
        return len(self.layers)

    def __getitem__(self, layer: int):
        return self.layers[layer]

    def __iter__(self):
        return iter(self.layers)

    @property
    def can_trim(self) -> bool:
        return all(c.can_trim for c in self.layers)

    def can_trim_to(self, length: int) -> bool:
        """Whether `trim` can bring the sequence back to `length` positions (a sliding-window
        ring may no longer hold what that length's next row reads)."""
        if length >= self.offset:
            return True
        return all(c.can_trim_to(length) for c in self.layers)

    def trim(self, n: int) -> int:
        """Drop the last n positions (fewer if it holds fewer); returns how many were dropped."""
        n = max(0, min(self.offset, n))
        if n and not self.can_trim_to(self.offset - n):
            raise ValueError(f"this cache cannot trim back to {self.offset - n} positions: restore a snapshot "
                             "instead (or run the sequence again)")
        self.offset -= n
        for c in self.layers:
            c.trim(self.offset)
        return n

    def snapshot(self):
        return self.offset, [c.snapshot(self.offset) for c in self.layers]

    def restore(self, state) -> None:
        self.offset, layers = state
        for c, s in zip(self.layers, layers):
            c.restore(s)

    def checkpoint(self):
        """What `rollback` needs to return to this position: the layers that cannot trim are
        copied (recurrent state: a constant size), the others will trim."""
        return self.offset, {i: c.snapshot(self.offset) for i, c in enumerate(self.layers) if not c.can_trim}

    def rollback(self, point) -> None:
        """Back to a checkpoint taken at a position this sequence has not since gone below."""
        offset, saved = point
        if offset > self.offset:
            raise ValueError(f"cannot roll forward from {self.offset} to {offset}")
        self.offset = offset
        for i, c in enumerate(self.layers):
            if i in saved:
                c.restore(saved[i])
            else:
                c.trim(offset)

    def clear(self) -> None:
        """An empty sequence (recurrent layers back to zero state)."""
        self.offset = 0
        for c in self.layers:
            c.reset()

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.layers)


def make_cache(cfg, capacity: int = 0, swa_rows: int = SWA_ROWS, types: KVTypes = F32_KV) -> Cache:
    """A cache per layer: recurrent (Gated DeltaNet) layers their state; sliding-window layers a
    ring sized for forwards of `swa_rows` rows (0: no rings, every attention layer holds every
    position); keys and values stored as `types` says."""
    def layer(i: int):
        if cfg.layer_is_recurrent(i):
            return RecurrentCache(cfg.ssm_conv_kernel, cfg.ssm_conv_channels, cfg.ssm_time_step_rank,
                                  cfg.ssm_state_size)
        w = cfg.layer_window(i)
        if w > 0 and swa_rows:
            return RingKVCache(cfg.n_kv_heads, cfg.head_dim, cfg.head_dim_v, w, capacity, swa_rows, types)
        return KVCache(cfg.n_kv_heads, cfg.head_dim, cfg.head_dim_v, capacity, types)

    return Cache([layer(i) for i in range(cfg.n_layers)])


def layer_positions(cfg, layer: int, n_ctx: int, swa_rows: int = SWA_ROWS) -> int:
    """Positions layer `layer`'s cache holds for a context of n_ctx: a sliding-window layer's
    ring holds at most `ring_capacity` of them, a recurrent layer none."""
    if cfg.layer_is_recurrent(layer):
        return 0
    w = cfg.layer_window(layer)
    return min(n_ctx, ring_capacity(w, swa_rows)) if w > 0 and swa_rows else n_ctx


def kv_cache_bytes(cfg, n_ctx: int, types: KVTypes = F32_KV, swa_rows: int = SWA_ROWS) -> int:
    """Bytes of every attention layer's keys and values for n_ctx positions (sliding-window
    layers: their ring's positions), stored as `types` says."""
    per_pos = types.position_bytes(cfg)
    return sum(layer_positions(cfg, i, n_ctx, swa_rows) for i in range(cfg.n_layers)) * per_pos


MAX_CHECKPOINTS = 4  # recurrent-state checkpoints a PrefixCache keeps (each: every recurrent layer's state)


class PrefixCache:
    """One sequence's cache kept from one prompt to the next (a chat's turns, serve's requests),
    and the tokens it holds. A new prompt keeps the longest prefix it shares with them, and only
    the rest is run. A cache with recurrent state cannot trim: it goes back only to positions
    where a checkpoint was taken (the end of each prompt but its last token, `prefill`; the end
    of each reply, `settle`), so the prefix kept is the longest of those within the shared one."""

    def __init__(self, cache):
        self.cache = cache
        self.tokens: list[int] = []  # the tokens whose K/V (or state) the cache holds, in order
        self.checkpoints: list = []  # Cache.checkpoint()s by position, at most MAX_CHECKPOINTS

    def clear(self) -> None:
        self.cache.clear()
        self.tokens, self.checkpoints = [], []

    def reuse(self, ids: list[int]) -> int:
        """Keep the longest prefix of `ids` the cache holds and can go back to, leaving at least
        one token of `ids` to run (its logits are the first reply token's); returns its length."""
        common = 0
        for a, b in zip(self.tokens, ids):
            if a != b:
                break
            common += 1
        common = min(common, len(ids) - 1)
        cache = self.cache
        if cache.offset <= common:  # all it holds is reused (recurrent state too)
            common = cache.offset
        elif cache.can_trim:
            if cache.can_trim_to(common):
                cache.trim(cache.offset - common)
            else:  # a sliding-window ring no longer holds what the prefix's end reads: run it again
                cache.clear()
                common = 0
        else:  # recurrent state: back to the last checkpoint within the prefix
            self.checkpoints = [c for c in self.checkpoints if c[0] <= common]
            if self.checkpoints:
                cache.rollback(self.checkpoints[-1])
            else:
                cache.clear()
            common = cache.offset
        self.tokens = list(ids[:common])
        return common

    def prefill(self, net, ids: list[int], common: int, hook=None, chunk: int = 256) -> int:
        """Where the cache cannot trim: run ids[common:-1] through `net` (a runner.Runner) and
        checkpoint after them, as the next prompt starts with this one whatever the reply turns
        out to be. Returns how many of `ids` the cache holds (`common` where nothing ran)."""
        if self.cache.can_trim or len(ids) - common <= 1:
            return common
        if isinstance(hook, PhasedHook):
            hook.phase = "prompt"
        rest = np.asarray(ids[common:-1], dtype=np.int64)
        for start in range(0, len(rest), chunk):
            net.forward(rest[start : start + chunk], self.cache, hook=hook, last_only=True)
            self.tokens = list(ids[: self.cache.offset])
        self.checkpoint()
        return self.cache.offset

    def checkpoint(self) -> None:
        """A checkpoint at the cache's position (none twice at one position; the oldest dropped)."""
        if self.cache.offset and (not self.checkpoints or self.checkpoints[-1][0] < self.cache.offset):
            self.checkpoints = self.checkpoints[-(MAX_CHECKPOINTS - 1):] + [self.cache.checkpoint()]

    def settle(self, fed: list[int]) -> None:
        """After a reply: which of the tokens fed (prompt and reply) the cache holds (an
        interrupted step adds none: the sequence's length moves only when a forward completes),
        and, where the cache cannot trim, a checkpoint there."""
        self.tokens = list(fed[: self.cache.offset])
        if not self.cache.can_trim:
            self.checkpoint()


def common_length(a, b) -> int:
    """How many tokens sequences a and b share from their start."""
    n = min(len(a), len(b))
    if not n:
        return 0
    diff = np.flatnonzero(np.asarray(a[:n], np.int64) != np.asarray(b[:n], np.int64))
    return int(diff[0]) if diff.size else n


def state_bytes(state) -> int:
    """Bytes of the arrays in a snapshot or checkpoint (nested tuples, lists and dicts of them)."""
    if isinstance(state, (np.ndarray, KVRows)):
        return state.nbytes
    if isinstance(state, dict):
        return sum(state_bytes(v) for v in state.values())
    if isinstance(state, (tuple, list)):
        return sum(state_bytes(v) for v in state)
    return 0


@dataclass
class SavedPrefix:
    """A PrefixCache's content copied out of its cache: the tokens, the cache's snapshot at their
    end, the checkpoints to go back to, and the bytes they take."""

    tokens: np.ndarray  # [n] int32
    state: object  # Cache.snapshot()
    checkpoints: list
    nbytes: int


class PromptCache:
    """Prefixes kept beside the caches of serve's slots, in host memory, as llama-server's prompt
    cache (--cache-ram): when a request would drop most of what its slot's cache holds, that
    content is saved here first (`save`), and a request that shares more with a saved prefix
    than with its slot gets it back (`take` it out, `restore` it into the slot's cache: `recall`
    does both). At most `budget` bytes (the memory plan's "prompt cache"); the least recently
    used prefix is dropped first. Thread-safe: each slot's worker saves and loads on its own
    thread."""

    def __init__(self, budget: int):
        self.budget = int(budget)
        self.entries: list[SavedPrefix] = []  # least recently used first
        self.lock = threading.Lock()
        self.saves = self.loads = self.drops = 0  # prefixes saved, loaded back, dropped for room
        self.tokens_loaded = 0  # tokens of requests' prompts the loaded prefixes held

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries)

    def save(self, prefix: PrefixCache) -> bool:
        """Copy `prefix`'s content in (replacing a saved prefix of the same tokens), dropping the
        least recently used ones until it fits; False where it alone is over the budget."""
        if not prefix.tokens:
            return False
        cache = prefix.cache
        state = cache.snapshot()
        nbytes = state_bytes(state) + state_bytes(prefix.checkpoints)
        if nbytes > self.budget:
            return False
        tokens = np.asarray(prefix.tokens, np.int32)
        with self.lock:
            self.entries = [e for e in self.entries if not np.array_equal(e.tokens, tokens)]
            while self.entries and self.nbytes + nbytes > self.budget:
                self.entries.pop(0)
                self.drops += 1
            self.entries.append(SavedPrefix(tokens, state, list(prefix.checkpoints), nbytes))
            self.saves += 1
        return True

    def recall(self, prefix: PrefixCache, ids, similar: float) -> None:
        """Before `prefix`'s cache runs `ids`: the saved prefix that shares more of them than it
        does is moved into it, and what it held is saved first where it is replaced so, or
        where `ids` keep less than the share `similar` of it."""
        keep = common_length(prefix.tokens, ids)
        saved = self.take(ids, keep)
        if saved is not None or keep < similar * len(prefix.tokens):
            self.save(prefix)
        if saved is not None:
            self.restore(prefix, saved)

    def take(self, ids, more_than: int) -> SavedPrefix | None:
        """The saved prefix sharing the most tokens with `ids`, out of the cache, where it shares
        more than `more_than` (what the slot's cache holds of them already); else None."""
        with self.lock:
            n, i = max(((common_length(e.tokens, ids), i) for i, e in enumerate(self.entries)), default=(0, -1))
            if n <= more_than:
                return None
            self.loads += 1
            self.tokens_loaded += n
            return self.entries.pop(i)

    @staticmethod
    def restore(prefix: PrefixCache, saved: SavedPrefix) -> None:
        """`prefix`'s cache back to `saved` (what it held is overwritten: `save` it first)."""
        prefix.cache.restore(saved.state)
        prefix.tokens, prefix.checkpoints = saved.tokens.tolist(), saved.checkpoints

    def clear(self) -> None:
        with self.lock:
            self.entries = []


def scratch_kv_bytes(cfg, rows: int = 1) -> int:
    """Bytes of one predicted layer's scratch state (moe/predict.py): this step's keys and
    values (float32)."""
    return 4 * rows * cfg.n_kv_heads * (cfg.head_dim + cfg.head_dim_v)


def scratch_state_bytes(cfg, layer: int) -> int:
    """Bytes of predicted layer `layer`'s scratch: K/V of one row, or (a recurrent layer) a copy
    of its conv history and delta-rule state, which the speculative step writes."""
    if cfg.layer_is_recurrent(layer):
        return recurrent_state_bytes(cfg) // len(cfg.recurrent_layers)
    return scratch_kv_bytes(cfg)
