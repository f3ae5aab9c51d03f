"""The expert slot pool: routed experts live in a fixed number of slots, read from the file on demand.

Slots come in size classes (experts whose gate/up/down parts have the same byte sizes); each
class holds one buffer per part, `[n_slots, part_bytes]`, so a kernel can index slot i
directly. One LRU order across all layers decides evictions by default ("global"; a prompt
chunk's acquires of most of a layer's experts are scans, which keep out of it: see ExpertPool);
"layer" splits each class's slots evenly among its layers. Reads run on a few reader
threads, demand reads ahead of prefetches, with O_DIRECT where the filesystem allows it
(pread plus POSIX_FADV_DONTNEED otherwise, so the page cache does not hold a second copy).

API: `acquire(layer, experts)` blocks until resident and pins; `arriving(layer, experts)` pins
them too and yields them as they become resident, the hits first (both take the forward's
routing, `routed`, to keep a prompt chunk's last rows' experts); `release(layer, experts)`;
`prefetch(layer, experts)` only queues. `stats` counts hits, prefetch hits, demand misses,
wasted prefetches, bytes read and stall time. `warm(order)` fills empty slots in the background
with what an earlier process used (memory/warm.py), after every other read; `learned()` is what
this pool would tell the next one.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import mmap
import os
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional

import numpy as np

from onebit.backends.experts import StreamedExperts, read_only
from onebit.errors import ModelFileError, OnebitError, UsageError

from .plan import EXPERT_PARTS, SizeClass
from .warm import Learned

ALIGN = 4096
READERS = 4  # reader threads (reads in flight). 2, 4, 8 on the 30B-A3B shape's experts, 384 random
# prefetches drained, twice each on a busy 2-core VM: 1.21/1.56, 1.61/1.35, 1.39/1.06 GB/s: no clear winner
PROMPT_SHARE = 0.75  # an acquire of this share of a layer's experts is a scan (a prompt's chunk): see _scan_victim
READ_AHEAD = 1  # the stream region holds this many layers' experts beside the scanned layer's
KEEP_ROWS = 8  # a prompt chunk keeps the experts of its last this many rows for the decode (see ExpertPool)
DEMAND, PREFETCH, WARM = 0, 1, 2  # read priorities: a smaller one is read first
KEEP_WARMED = 2  # warmed experts no acquire used yet are evicted last for this many acquires a layer (see warm)


class StreamReadError(OnebitError):
    """The model file could not be read while streaming experts (I/O error, truncation)."""

    exit_code = 1


@dataclass
class PoolStats:
    hits: int = 0  # acquire found the expert resident (not counting prefetch hits)
    prefetch_hits: int = 0  # acquire found it resident or in flight thanks to a prefetch
    demand_misses: int = 0  # acquire had to read it
    prefetches: int = 0  # prefetch reads issued
    wasted_prefetches: int = 0  # prefetched experts evicted before any acquire used them
    bytes_read: int = 0
    stall_seconds: float = 0.0  # time acquire spent waiting for reads
    acquires: int = 0
    busy_seconds: float = 0.0  # wall time with at least one read in flight (bytes_read / it: drive rate)
    warm_start: str = ""  # where the pool's warming came from ("": none; see ExpertPool.warm)
    warm_reads: int = 0  # experts read by warming
    warm_hits: int = 0  # acquires that found an expert warming read, not used before (counted in hits too)
    warm_wasted: int = 0  # experts warming read that were evicted before any acquire used them

    def to_dict(self) -> dict:
        d = dict(self.__dict__)
        total = self.hits + self.prefetch_hits + self.demand_misses
        d["hit_rate"] = (self.hits + self.prefetch_hits) / total if total else 0.0
        d["read_gb_per_s"] = self.bytes_read / self.busy_seconds / 1e9 if self.busy_seconds > 0 else 0.0
        return d

    def line(self, tokens: int) -> str:
        """One line for --stats and /stats; per token over `tokens` rows run (prompt and decode)."""
        total = self.hits + self.prefetch_hits + self.demand_misses
        rate = f"{100 * (self.hits + self.prefetch_hits) / total:.1f}%" if total else "-"
        n = max(tokens, 1)
        gbs = self.bytes_read / self.busy_seconds / 1e9 if self.busy_seconds > 0 else 0.0
        return (f"hit rate {rate} ({self.hits} hits, {self.prefetch_hits} prefetch hits, {self.demand_misses} "
                f"misses); prefetches {self.prefetches}, wasted {self.wasted_prefetches}; per token: "
                f"{self.bytes_read / n / 2**20:.2f} MiB read, {1000 * self.stall_seconds / n:.1f} ms stalled; "
                f"reads at {gbs:.2f} GB/s while busy" + self.warm_line())

    def warm_line(self) -> str:
        if not self.warm_start:
            return ""
        return (f"; warm start {self.warm_start}: {self.warm_reads} experts read, {self.warm_hits} used, "
                f"{self.warm_wasted} evicted unused")


@dataclass
class _Slot:
    cls: int
    index: int
    key: Optional[tuple[int, int]] = None  # (layer, expert)
    pins: int = 0
    ready: threading.Event = field(default_factory=threading.Event)
    prefetched: bool = False  # loaded by a prefetch and not yet acquired
    warmed: bool = False  # loaded by warming and not yet acquired
    stream: bool = False  # in the stream region (see ExpertPool)
    kept: int = -1  # the prompt pass that keeps this slot's expert for the decode after it (see _keep_last)
    error: Optional[BaseException] = None
    parts_left: int = 0  # parts of the expert still to read (ready when none)
    started: float = 0.0  # when the first of them started


class _Source:
    """Where one expert part lives in the file: offset of expert 0 and bytes per expert."""

    def __init__(self, tensor):
        self.file = tensor.file
        self.offset = tensor.offset
        self.nbytes = tensor.n_bytes // tensor.shape[0]
        self.n_experts = tensor.shape[0]
        self.shape = tuple(tensor.raw.shape[1:])  # one expert as the file has it: [rows, row bytes]
        self.pack: Optional[Callable] = None  # pack(src, dst): into a slot as the backend holds it


class _Reader:
    """Positioned reads, O_DIRECT when the filesystem takes it, into aligned bounce buffers."""

    def __init__(self, path: str, direct: bool):
        self.path = path
        self.direct = False
        self.fd = -1
        if direct and hasattr(os, "O_DIRECT"):
            try:
                self.fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
                self.direct = True
            except OSError:
                self.fd = -1
        if self.fd < 0:
            try:
                self.fd = os.open(path, os.O_RDONLY)
            except OSError as e:
                raise ModelFileError(f"{path}: cannot open for streaming ({e.strerror})") from None
        self._local = threading.local()

    def _bounce(self, n: int) -> mmap.mmap:
        buf = getattr(self._local, "buf", None)
        if buf is None or len(buf) < n:
            buf = mmap.mmap(-1, max(n, ALIGN))  # anonymous maps are page aligned
            self._local.buf = buf
        return buf

    def read_into(self, dst: np.ndarray, offset: int, shape: Optional[tuple] = None,
                  pack: Optional[Callable] = None) -> int:
        """Read dst.nbytes bytes at `offset` into dst; or, with `pack`, the bytes of an array
        of `shape` at `offset`, which pack(src, dst) writes into dst as it holds them."""
        if pack is not None:
            n = int(np.prod(shape))
            buf = self._bounce(n + 2 * ALIGN)
            if self.direct:
                start = offset // ALIGN * ALIGN
                end = (offset + n + ALIGN - 1) // ALIGN * ALIGN
                got = self._pread(memoryview(buf)[: end - start], start)
                if got is None:
                    return self.read_into(dst, offset, shape, pack)
            else:
                start, end = offset, offset + n
                got = os.preadv(self.fd, [memoryview(buf)[:n]], offset)
                self._drop_cached(offset, n)
            if got < offset + n - start:
                raise StreamReadError(f"{self.path}: file ended early while reading experts (truncated?)")
            pack(np.frombuffer(buf, np.uint8, n, offset - start).reshape(shape), dst)
            return end - start
        n = dst.nbytes
        if self.direct:
            start = offset // ALIGN * ALIGN
            end = (offset + n + ALIGN - 1) // ALIGN * ALIGN
            buf = self._bounce(end - start)
            got = self._pread(memoryview(buf)[: end - start], start)
            if got is None:
                return self.read_into(dst, offset)
            if got < offset + n - start:
                raise StreamReadError(f"{self.path}: file ended early while reading experts (truncated?)")
            dst[...] = np.frombuffer(buf, np.uint8, n, offset - start).reshape(dst.shape)
            return end - start
        got = os.preadv(self.fd, [memoryview(dst.reshape(-1))], offset)
        if got < n:
            raise StreamReadError(f"{self.path}: file ended early while reading experts (truncated?)")
        self._drop_cached(offset, n)
        return n

    def _pread(self, view: memoryview, start: int) -> Optional[int]:
        """An O_DIRECT read, or None when the filesystem refuses O_DIRECT after all (EINVAL): the
        file is then open for buffered reads, and the caller reads again."""
        try:
            return os.preadv(self.fd, [view], start)
        except OSError as e:
            if e.errno == 22:
                self._reopen_buffered()
                return None
            raise

    def _drop_cached(self, offset: int, n: int) -> None:
        """A buffered read's pages out of the page cache (it would hold a second copy)."""
        try:
            os.posix_fadvise(self.fd, offset, n, os.POSIX_FADV_DONTNEED)
        except (AttributeError, OSError):
            pass

    def _reopen_buffered(self) -> None:
        os.close(self.fd)
        self.fd = os.open(self.path, os.O_RDONLY)
        self.direct = False

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class ExpertPool(StreamedExperts):
    """Scans: a prompt's chunk routes to nearly every expert of every layer, so its acquires
    walk all of the file's experts in layer order, one pass a prompt. Under plain LRU each
    pass would evict what the next pass needs first and no prompt after the first would hit.
    So a scan's misses go only into empty slots and the stream region (a class's slots from
    `stream_from[class]` on: READ_AHEAD + 1 layers' worth), and the other slots keep what they
    hold for every later pass to hit; a scan also reads ahead into the stream region, as far
    as it has room, so the drive stays busy while resident layers compute. On the 30B-A3B
    shape at 8 GiB (2056 slots) a 128-token prompt after another read 13.3 GB instead of all
    18.8. Decode steps (a few experts a layer) use every slot in one LRU order.

    The decode after a prompt routes much as the prompt's last tokens did, so a prompt chunk
    (a sequence with more than KEEP_ROWS rows in the forward) given its routing (`routed`, one
    array per sequence: a forward over several sequences' rows may put them in any order)
    keeps the experts of each sequence's last KEEP_ROWS rows: at its release every other
    expert it used becomes the least recently used, so slots are taken from those first; and a
    kept expert found in the stream region trades regions with a slot of the other, one holding
    an expert of a layer this pass has already used that those rows did not (the oldest first),
    so nothing is read for it and a scan's read-ahead will not overwrite it. A later scan loses
    no hit by it: every expert the slots hold is one hit a pass, whichever. On the 30B-A3B
    trained-routing shape at 8 GiB, the first 8 tokens after a 175-token prompt missed 113
    experts a token before this, 81 with it, and 71 once the decode had settled; most of that
    prompt's layers route to fewer experts than a scan, so the LRU order does most of it. (A
    batched prompt runs layer by layer, so without this its late layers' experts push out the
    early layers' experts of its last rows: bench/results/prompt-order-lru-30b-trained-2026-12-07-3dcd630.md.)"""

    def __init__(self, gguf, classes: list[SizeClass], slots: list[int], policy: str = "global",
                 readers: Optional[int] = None, direct: bool = True,
                 allocate: Optional[Callable[[tuple], np.ndarray]] = None, layout=None):
        """allocate(shape) -> a writable uint8 array of that shape for one part's slots (e.g. a
        mapped device buffer a kernel reads, see vulkan.backend.SlotArrays); numpy memory if None.
        layout: the backend's ExpertLayout (backends/experts.py): the parts it packs are held
        packed in their slots, packed by the reader thread that reads them."""
        if policy not in ("global", "layer"):
            raise UsageError(f"unknown pool policy {policy!r} (global or layer)")
        if len(slots) != len(classes):
            raise UsageError("one slot count per size class is needed")
        self.policy = policy
        self.gguf = gguf
        self.classes = classes
        self.class_of_layer = {layer: i for i, c in enumerate(classes) for layer in c.layers}
        self.sources = {
            (layer, part): _Source(gguf.tensor(f"blk.{layer}.{part}.weight"))
            for c in classes for layer in c.layers for part in EXPERT_PARTS
        }
        self.layout = layout  # (the cpu backend reads the slots' type ids from it)
        for (layer, part), src in self.sources.items():
            t = gguf.tensor(f"blk.{layer}.{part}.weight")
            if layout is not None and layout.packs(t):
                src.pack = functools.partial(layout.pack, t)
        self.buffers: list[dict[str, np.ndarray]] = []
        self._views: list[list[np.ndarray]] = []  # per class: the parts' buffers, read only (arrays())
        self.slots: list[list[_Slot]] = []
        for ci, (c, n) in enumerate(zip(classes, slots)):
            if n < 1:
                raise UsageError(f"size class {ci} needs at least one slot")
            layer0 = c.layers[0]
            bufs = {}
            for part in EXPERT_PARTS:
                t = gguf.tensor(f"blk.{layer0}.{part}.weight")
                held = t.raw.shape[1:] if self.sources[(layer0, part)].pack is None else layout.shape(t)
                shape = (n, *held)  # [slots, rows, row_bytes]
                bufs[part] = np.zeros(shape, np.uint8) if allocate is None else allocate(shape)
                if bufs[part].shape != shape or bufs[part].dtype != np.uint8:
                    raise UsageError(f"slot allocator returned {bufs[part].dtype} {bufs[part].shape}, "
                                     f"wanted uint8 {shape}")
                bufs[part].fill(0)  # touch every page now: the plan counts the slots as used
            self.buffers.append(bufs)
            self._views.append([read_only(bufs[p]) for p in EXPERT_PARTS])
            self.slots.append([_Slot(ci, i) for i in range(n)])
        self.where: dict[tuple[int, int], _Slot] = {}
        self.lru: list[OrderedDict] = [OrderedDict() for _ in classes]  # unpinned slots, oldest first
        # the stream region: slots [stream_from[ci], n) of each class at first (_keep_last trades
        # slots in and out of it, `_Slot.stream`); lru_stream keeps its unpinned slots that no
        # prefetch is waiting to be used from, oldest first
        self.stream_from = [len(ss) - self._stream_slots(ci, len(ss)) for ci, ss in enumerate(self.slots)]
        for ci, ss in enumerate(self.slots):
            for s in ss[self.stream_from[ci]:]:
                s.stream = True
        self._pass, self._pass_at = 0, None  # the prompt pass (a chunk's walk over the layers), its last layer
        self._passed: list[OrderedDict] = [OrderedDict() for _ in classes]  # see _keep_last
        self._last: dict[int, set] = {}  # layer -> the experts a prompt chunk's acquire keeps, until its release
        self.lru_stream: list[OrderedDict] = [OrderedDict() for _ in classes]
        # unpinned slots warming filled and no acquire used yet, while they are kept (see warm)
        self.lru_warm: list[OrderedDict] = [OrderedDict() for _ in classes]
        self._warm_until = -1  # the acquire count at which they stop being kept (-1: none are)
        for ss in self.slots:
            for s in ss:
                self._to_lru(s)
        self.stats = PoolStats()
        self.table: Optional[np.ndarray] = None  # see track()
        # per layer, for the predictor's ledger (moe/predict.py): prefetch hits, demand misses,
        # wasted prefetches, stall seconds, stall seconds of acquires that had a demand miss
        self.by_layer: dict[int, list] = {layer: [0, 0, 0, 0.0, 0.0] for layer in self.class_of_layer}
        # per layer, what `learned()` reports: each expert's acquires and the tick (stats.acquires) of its last
        self.uses = {layer: [0] * self.sources[(layer, EXPERT_PARTS[0])].n_experts for layer in self.class_of_layer}
        self.last_use = {layer: [-1] * len(u) for layer, u in self.uses.items()}
        self._warm: list[tuple[int, int]] = []  # (layer, expert) still to warm, the next last (see warm)
        self._warm_slots: dict[tuple[int, range], list[int]] = {}  # (class, partition) -> its slots warming may fill
        self._warming = 0  # warming's part reads in flight
        self.reads, self.read_seconds = 0, 0.0  # experts read and their summed durations (first part start to last end)
        self.read_cpu_seconds = 0.0  # the reader threads' CPU time for them (what a read takes from compute)
        self.lock = threading.Condition()
        # Acquires waiting in _victim for a slot to be unpinned. A release wakes the lock's
        # waiters only when there are some: the reader threads wait on the same lock, and waking
        # them at each of a decode step's releases (one per MoE layer) cost the step its GIL.
        self._slot_waiters = 0
        self.readers = {}
        for (layer, part), src in self.sources.items():
            if src.file not in self.readers:
                self.readers[src.file] = _Reader(src.file, direct)
        self.queue: list = []
        self.in_flight = 0
        self._busy_since = 0.0
        self.seq = itertools.count()
        self.closed = False
        self.threads = [threading.Thread(target=self._work, daemon=True, name=f"expert-reader-{i}")
                        for i in range(max(1, READERS if readers is None else readers))]
        for t in self.threads:
            t.start()

    # -- public API -------------------------------------------------------------------

    @property
    def n_slots(self) -> int:
        return sum(len(s) for s in self.slots)

    def capacity(self, layer: int) -> int:
        """How many experts of `layer` can be pinned at once."""
        return len(self._partition(layer, self.class_of_layer[layer]))

    def acquire(self, layer: int, experts: Iterable[int], routed=None) -> list[int]:
        """Block until every expert is resident; pin them; return their slot indices. `routed`:
        the forward's routing, if it has it: per sequence in the forward, its rows' expert ids
        [rows, k] in row order (a prompt chunk keeps its last rows' experts: see the class)."""
        experts = [int(e) for e in experts]
        t0 = time.perf_counter()
        waits, misses = self._pin_routed(layer, experts, routed)
        for s in waits:
            if not s.ready.is_set():
                s.ready.wait()
            if s.error is not None:
                self._unpin_failed(waits)
        self._set_table(layer, experts, waits)
        self._count_stall(layer, time.perf_counter() - t0, misses)
        return [s.index for s in waits]

    def arriving(self, layer: int, experts: Iterable[int], routed=None):
        """Yield (positions, slots) as `experts` become resident: those resident now first, then
        the others as their reads complete (with any that completed meanwhile), so a caller
        computes with the hits while the misses are read. `positions` index `experts`; every
        expert stays pinned until the generator ends (it releases them all). More experts than
        `capacity(layer)` come as `pinned` gives them, one group at a time. `routed`: as for
        `acquire`."""
        experts = [int(e) for e in experts]
        if len(set(experts)) > self.capacity(layer):
            for start, group, slots in self.pinned(layer, experts):
                yield list(range(start, start + len(group))), slots
            return
        t0 = time.perf_counter()
        waits, misses = self._pin_routed(layer, experts, routed)
        stalled, failed = time.perf_counter() - t0, False
        try:
            pending = list(range(len(experts)))
            while pending:
                if not any(waits[j].ready.is_set() for j in pending):  # (reads end about as claimed)
                    t = time.perf_counter()
                    waits[pending[0]].ready.wait()
                    stalled += time.perf_counter() - t
                ready = [j for j in pending if waits[j].ready.is_set()]
                if any(waits[j].error is not None for j in ready):
                    failed = True
                    self._unpin_failed(waits)
                pending = [j for j in pending if j not in ready]
                self._set_table(layer, [experts[j] for j in ready], [waits[j] for j in ready])
                yield ready, [waits[j].index for j in ready]
        finally:
            self._count_stall(layer, stalled, misses)
            if not failed:
                self.release(layer, experts)

    def _pin_routed(self, layer: int, experts: list[int], routed=None) -> tuple[list, int]:
        """Pin `experts`' slots, resident ones first, a read claimed for each of the others;
        (their slots in order, the demand misses)."""
        if len(set(experts)) > self.capacity(layer):
            raise UsageError(f"layer {layer} asks for {len(set(experts))} experts at once but only "
                             f"{self.capacity(layer)} slots are available to it")
        ci = self.class_of_layer[layer]
        scan = len(experts) >= PROMPT_SHARE * self.sources[(layer, EXPERT_PARTS[0])].n_experts
        with self.lock:
            self._check_open()
            self.stats.acquires += 1
            self._count_uses(layer, experts)
            self._keep_warmed()
            chunk = routed is not None and any(len(r) > KEEP_ROWS for r in routed)  # (a prompt's chunk)
            self._track_pass(layer, chunk)
            self._last.pop(layer, None)  # (an acquire that failed left its own: never released)
            # Pin the resident experts first, so a miss below cannot evict one of them.
            got: dict[int, _Slot] = {}
            per = self.by_layer[layer]
            misses = 0
            for e in experts:
                s = self.where.get((layer, e))
                if s is not None:
                    if s.prefetched:
                        self.stats.prefetch_hits += 1
                        per[0] += 1
                        s.prefetched = False
                    else:
                        self.stats.hits += 1
                        if s.warmed:
                            self.stats.warm_hits += 1
                            s.warmed = False
                    self._pin(s)
                    got[e] = s
            for e in experts:
                if e not in got:
                    self.stats.demand_misses += 1
                    misses += 1
                    s = self._claim(layer, (layer, e), DEMAND, self._scan_victim(ci, layer, layer) if scan else None)
                    self._pin(s)
                    got[e] = s
            if chunk:
                self._keep_last(ci, layer, got, routed)
            if scan:
                self._drop_unrouted(layer, experts)
                self._read_ahead(ci, layer)
        return [got[e] for e in experts], misses

    def _unpin_failed(self, waits: list) -> None:
        """Unpin `waits` and raise the first failed read's error."""
        with self.lock:
            for w in waits:
                w.pins -= 1
                if w.pins == 0:
                    self._to_lru(w)
            self.lock.notify_all()
        raise next(w.error for w in waits if w.error is not None)

    def _set_table(self, layer: int, experts: list[int], slots: list) -> None:
        if self.table is not None:  # (pinned: no claim can clear these meanwhile)
            for e, s in zip(experts, slots):
                self.table[layer, e] = s.index

    def _count_stall(self, layer: int, dt: float, misses: int) -> None:
        per = self.by_layer[layer]
        self.stats.stall_seconds += dt
        per[1] += misses
        per[3] += dt
        if misses:
            per[4] += dt

    @property
    def streamed_layers(self) -> frozenset:
        """The layers whose experts stream through this pool (an expert source, backends/experts.py)."""
        return frozenset(self.class_of_layer)

    def arrays(self, layer: int) -> list[np.ndarray]:
        """gate, up, down slots of layer's size class: read-only views [slots, rows, row_bytes]."""
        return self._views[self.class_of_layer[layer]]

    def pinned(self, layer: int, experts: list[int]):
        """Yield (start, group, slots) over `experts` in groups of at most capacity(layer) (a
        prompt may route to more experts than fit at once), each group acquired (pinned)
        while the caller uses it and released after."""
        cap = self.capacity(layer)
        for start in range(0, len(experts), cap):
            group = experts[start : start + cap]
            slots = self.acquire(layer, group)
            try:
                yield start, group, slots
            finally:
                self.release(layer, group)

    def track(self, table: np.ndarray) -> None:
        """Keep table[layer, expert] (an int32 array, e.g. mapped device memory) = the slot that
        holds that expert, complete, or -1. An entry is set when an acquire has the expert
        resident and cleared when its slot is claimed for another, so a kernel may read the
        table's slots without acquiring, as long as nothing calls acquire or prefetch meanwhile
        (the Vulkan backend's steps with no pause, vulkan/recording.py); `touch` then counts the use."""
        with self.lock:
            table.fill(-1)
            for (layer, e), s in self.where.items():
                if s.ready.is_set() and s.error is None and not s.prefetched:
                    table[layer, e] = s.index
            self.table = table

    def untrack(self) -> None:
        """Stop writing the tracked table (its memory is about to be freed)."""
        with self.lock:
            self.table = None

    def touch(self, used: Iterable[tuple[int, Iterable[int]]]) -> None:
        """Experts a step used through the tracked table, [(layer, [int expert ids])]: counted as
        hits and made most recently used, as an acquire and release of each layer's experts would."""
        with self.lock:
            table, where, lru = self.table, self.where, self.lru
            for layer, experts in used:
                self.stats.acquires += 1
                experts = [int(e) for e in experts]
                self._count_uses(layer, experts)
                self._keep_warmed()
                for e in experts:
                    s = where.get((layer, e))
                    if s is None or table is None or table[layer, e] != s.index:
                        raise RuntimeError(f"expert pool: layer {layer} expert {e} was used through the slot "
                                           "table but is not resident")
                    self.stats.hits += 1
                    if s.warmed:
                        self.stats.warm_hits += 1
                        s.warmed = False
                        if s.pins == 0:
                            self._off_lru(s)
                            self._to_lru(s)
                    elif s.pins == 0:
                        lru[s.cls].move_to_end(id(s))
                        if id(s) in self.lru_stream[s.cls]:
                            self.lru_stream[s.cls].move_to_end(id(s))

    def release(self, layer: int, experts: Iterable[int]) -> None:
        with self.lock:
            last = self._last.pop(layer, None)  # (a prompt chunk's: the others go first, see _keep_last)
            for e in experts:
                s = self.where.get((layer, int(e)))
                if s is not None and s.pins > 0:
                    s.pins -= 1
                    if s.pins == 0:
                        self._to_lru(s)
                        if last is not None and int(e) not in last and id(s) in self.lru[s.cls]:
                            self.lru[s.cls].move_to_end(id(s), last=False)
                            if id(s) in self.lru_stream[s.cls]:
                                self.lru_stream[s.cls].move_to_end(id(s), last=False)
            if self._slot_waiters:
                self.lock.notify_all()

    def prefetch(self, layer: int, experts: Iterable[int], keep: Iterable[tuple[int, int]] = ()) -> int:
        """Queue reads for experts not resident; never blocks, never evicts a pinned slot or one
        holding a `keep` key ((layer, expert): e.g. what the current layer routes to), nor an
        expert this same call queued. Returns how many reads were queued."""
        queued = 0
        with self.lock:
            if self.closed:
                return 0
            avoid = {(int(a), int(b)) for a, b in keep}
            for e in experts:
                key = (layer, int(e))
                if key in self.where:
                    continue
                ci = self.class_of_layer[layer]
                victim = self._free_slot(layer, ci, avoid)
                if victim is None:
                    break  # nothing may be evicted for it: a prefetch must not wait
                self._claim(layer, key, PREFETCH, victim)
                avoid.add(key)
                self.stats.prefetches += 1
                queued += 1
        return queued

    def warm(self, order: Iterable[tuple[int, int]], source: str = "from a record") -> int:
        """Read experts `order` names ((layer, expert), the first first) into empty slots, in the
        background: a reader takes the next of them only when no demand read or prefetch is
        queued, on all readers but one at most (one, beside other reads), so a demand read finds
        a reader free and shares the drive with one warming read at most. Only slots empty now and outside the stream region (the global policy's:
        kept for the first misses and a prompt's scans) are filled, never an expert evicted for
        it, so warming stops at those slots; one a demand read takes first is not warmed. Experts
        that no slot is left for are dropped. For the next KEEP_WARMED acquires a layer (about as
        many forwards) a miss evicts a warmed expert no acquire used yet only when no other slot
        is free: under plain LRU a first prompt's misses at one layer would evict what was warmed
        for the layers after it, which it has not reached yet; after them, those left unused are
        the least recently used. Changes which reads happen, never what a forward computes.
        Returns how many experts are queued; `stats` counts what became of them."""
        queued = []
        with self.lock:
            self._check_open()
            room: dict[tuple[int, range], list[int]] = {}
            taken: dict[tuple[int, range], int] = {}
            queued_keys: set = set()
            for layer, e in order:
                layer, e = int(layer), int(e)
                ci = self.class_of_layer.get(layer)
                if ci is None or not 0 <= e < len(self.uses[layer]):
                    raise UsageError(f"cannot warm expert {e} of layer {layer}: the pool streams no such expert")
                if (layer, e) in self.where:
                    continue
                part = self._partition(layer, ci)
                if (ci, part) not in room:  # the partition's empty slots, the highest index taken first
                    room[ci, part] = [i for i in part if not self.slots[ci][i].stream
                                      and self.slots[ci][i].key is None and self.slots[ci][i].pins == 0]
                    taken[ci, part] = 0
                if taken[ci, part] < len(room[ci, part]) and (layer, e) not in queued_keys:
                    taken[ci, part] += 1
                    queued.append((layer, e))
                    queued_keys.add((layer, e))
            self._warm_slots = room
            self._warm = queued[::-1]
            self._warm_until = self.stats.acquires + KEEP_WARMED * len(self.uses)
            self.stats.warm_start = source
            self.lock.notify_all()
        return len(queued)

    def learned(self) -> dict:
        """What this pool knows about its file, per streamed layer: {layer: Learned(uses, last use,
        held)}: each expert's acquires, the tick (acquire count) of its last one (-1: none), and
        the experts resident now (memory/warm.py keeps it for the next process)."""
        with self.lock:
            held = {layer: [] for layer in self.uses}
            for (layer, e), s in self.where.items():
                if s.ready.is_set() and s.error is None:
                    held[layer].append(e)
            return {layer: Learned([float(n) for n in u], list(self.last_use[layer]), sorted(held[layer]))
                    for layer, u in self.uses.items()}

    def drain(self, timeout: float = 30) -> None:
        """Wait until no read is queued or in flight, nor any left to warm."""
        deadline = time.monotonic() + timeout
        with self.lock:
            while (self.queue or self.in_flight or self._warm) and time.monotonic() < deadline:
                self.lock.wait(timeout=0.1)

    def slot_view(self, layer: int, slot: int, part: str) -> np.ndarray:
        """The raw bytes of `part` in slot `slot` of layer's class: [rows, row_bytes]."""
        return self.buffers[self.class_of_layer[layer]][part][slot]

    def close(self) -> None:
        with self.lock:
            self.closed = True
            self.lock.notify_all()
        for t in self.threads:
            t.join(timeout=5)
        for r in self.readers.values():
            r.close()

    @property
    def packed(self) -> dict:
        """(layer, part) -> whether its slots hold it in the backend's layout (packed as read)."""
        return {key: src.pack is not None for key, src in self.sources.items()}

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for bufs in self.buffers for b in bufs.values())

    # -- internals --------------------------------------------------------------------

    def _count_uses(self, layer: int, experts: list[int]) -> None:
        uses, last, tick = self.uses[layer], self.last_use[layer], self.stats.acquires
        for e in experts:
            uses[e] += 1
            last[e] = tick

    def _claim_warm(self) -> bool:
        """Claim the next expert to warm, if any is left that a slot is left for: its reads queued
        at WARM priority (under the lock). False when warming is done."""
        while self._warm:
            layer, e = self._warm.pop()
            if (layer, e) in self.where:
                continue
            ci = self.class_of_layer[layer]
            free = self._warm_slots[ci, self._partition(layer, ci)]
            while free:
                s = self.slots[ci][free.pop()]
                if s.key is None and s.pins == 0:
                    self._claim(layer, (layer, e), WARM, s)
                    self.stats.warm_reads += 1
                    return True
        return False

    def _check_open(self):
        if self.closed:
            raise UsageError("the expert pool is closed")

    def _pin(self, s: _Slot) -> None:
        if s.pins == 0:
            self._off_lru(s)
        s.pins += 1

    def _to_lru(self, s: _Slot) -> None:
        """An unpinned slot, as the most recently used (one warming filled: kept apart while
        warmed experts are kept)."""
        if s.warmed and self._warm_until >= 0:
            self.lru_warm[s.cls][id(s)] = s
            return
        self.lru[s.cls][id(s)] = s
        if s.stream and not s.prefetched:
            self.lru_stream[s.cls][id(s)] = s

    def _off_lru(self, s: _Slot) -> None:
        self.lru[s.cls].pop(id(s), None)
        self.lru_stream[s.cls].pop(id(s), None)
        self.lru_warm[s.cls].pop(id(s), None)

    def _keep_warmed(self) -> None:
        """At the acquire count `_warm_until`: what warming read and no acquire used becomes the
        least recently used, the last read first (under the lock)."""
        if not 0 <= self._warm_until <= self.stats.acquires:
            return
        self._warm_until = -1
        for ci, kept in enumerate(self.lru_warm):
            for s in list(kept.values()):
                kept.pop(id(s))
                self._to_lru(s)
                self.lru[ci].move_to_end(id(s), last=False)

    def _stream_slots(self, ci: int, n: int) -> int:
        """The stream region's size: READ_AHEAD + 1 layers' experts, at least one layer's, at
        most half the slots (all of them when fewer than one layer's fit); none under the
        "layer" policy, whose layers have their own slots."""
        if self.policy != "global":
            return 0
        per_layer = self.sources[(self.classes[ci].layers[0], EXPERT_PARTS[0])].n_experts
        return min(n, max(per_layer, min((READ_AHEAD + 1) * per_layer, n // 2)))

    def _scan_victim(self, ci: int, layer: int, target: int) -> Optional[_Slot]:
        """A slot for a scan at `layer` to read an expert of layer `target` into (target ==
        layer: a miss; target > layer: a read ahead): an empty one, else the least recently
        used of the stream region whose expert this pass needs no sooner than target's (its
        layer is not in (layer, target]); None if there is none (never waits)."""
        lru = self.lru[ci]
        if lru:
            s = lru[next(iter(lru))]
            if s.key is None and s.index in self._partition(layer, ci):
                return s
        for s in self.lru_stream[ci].values():
            if s.key is None or not layer < s.key[0] <= target:
                return s
        return None

    def _track_pass(self, layer: int, chunk: bool) -> None:
        """A prompt chunk's acquire at a layer no later than the last one's starts a new pass;
        any other acquire ends the pass (under the lock)."""
        if chunk and self._pass_at is not None and layer > self._pass_at:
            self._pass_at = layer
            return
        if chunk or self._pass_at is not None:
            self._pass += 1
            for passed in self._passed:
                passed.clear()
        self._pass_at = layer if chunk else None

    def _keep_last(self, ci: int, layer: int, got: dict, routed) -> None:
        """A prompt chunk's slots `got` ({expert: slot}, pinned): keep the experts of the last
        KEEP_ROWS rows of each sequence's routing in `routed` for the decode after the prompt. Each in the
        stream region trades regions with the oldest main-region slot this pass used at an
        earlier layer that no kept expert holds (`_passed`), so a scan's read-ahead will not
        overwrite it; the layer's other main-region slots join `_passed`, and its other experts
        become the least recently used at their release (`_last`) (under the lock)."""
        last = {int(e) for r in routed for e in np.asarray(r)[-KEEP_ROWS:].ravel()}
        self._last[layer] = last
        if self.policy != "global":
            return
        passed = self._passed[ci]
        for e in last:
            s = got.get(e)
            if s is None:
                continue
            s.kept = self._pass
            while s.stream and passed:
                _, (v, key) = passed.popitem(last=False)
                if v.key != key or v.pins or v.stream or v.kept == self._pass or not v.ready.is_set():
                    continue  # (refilled, pinned or kept since)
                s.stream, v.stream = False, True
                if not v.prefetched and id(v) in self.lru[ci]:  # (unpinned: now the stream region's next victim)
                    self.lru_stream[ci][id(v)] = v
                    self.lru_stream[ci].move_to_end(id(v), last=False)
        for s in got.values():
            if not s.stream and s.kept != self._pass:
                passed[id(s)] = (s, s.key)

    def _drop_unrouted(self, layer: int, routed: list[int]) -> None:
        """A scan at `layer` routes to none of its other experts: a prefetch of one (the scan's
        own read-ahead reads every expert, a predictor its guesses) is wasted, and its slot
        the stream region's first victim, not kept waiting for a use (under the lock)."""
        routed = set(routed)
        for e in range(self.sources[(layer, EXPERT_PARTS[0])].n_experts):
            s = self.where.get((layer, e))
            if s is None or not s.prefetched or e in routed:
                continue
            s.prefetched = False
            self.stats.wasted_prefetches += 1
            self.by_layer[layer][2] += 1
            if s.pins == 0 and s.stream:
                self.lru_stream[s.cls][id(s)] = s
                self.lru_stream[s.cls].move_to_end(id(s), last=False)

    def _read_ahead(self, ci: int, layer: int) -> int:
        """A scan at `layer` will go on through the next layers' experts: queue reads of those
        not resident, in layer order, into slots _scan_victim gives, until it gives none (under
        the lock). Returns the reads queued."""
        queued = 0
        where = self.where
        for nxt in self.classes[ci].layers:
            if nxt <= layer:
                continue
            for e in range(self.sources[(nxt, EXPERT_PARTS[0])].n_experts):
                if (nxt, e) in where:
                    continue
                victim = self._scan_victim(ci, layer, nxt)
                if victim is None:
                    return queued
                self._claim(nxt, (nxt, e), PREFETCH, victim)
                self.stats.prefetches += 1
                queued += 1
        return queued

    def _partition(self, layer: int, ci: int) -> range:
        """Slot indices a layer may use: all of its class (global) or its fixed share (layer)."""
        n = len(self.slots[ci])
        if self.policy == "global":
            return range(n)
        layers = self.classes[ci].layers
        q = max(n // len(layers), 1)
        j = layers.index(layer) % max(n // q, 1)
        return range(j * q, min((j + 1) * q, n))

    def _victim(self, layer: int, ci: int) -> _Slot:
        """The least recently used unpinned slot this layer may use; waits while all are pinned
        (a reader thread holds them), and gives up after a minute rather than hang."""
        part = self._partition(layer, ci)
        deadline = time.monotonic() + 60
        while True:
            for s in self.lru[ci].values():
                if s.index in part:
                    return s
            for s in reversed(self.lru_warm[ci].values()):  # (kept warmed experts: the last read first)
                if s.index in part:
                    return s
            if time.monotonic() > deadline:
                raise StreamReadError("every expert slot stayed pinned for a minute: use more slots (--slots)")
            self._slot_waiters += 1
            try:
                self.lock.wait(timeout=1)
            finally:
                self._slot_waiters -= 1
            self._check_open()

    def _free_slot(self, layer: int, ci: int, avoid: set) -> Optional[_Slot]:
        """The least recently used unpinned slot this layer may use, not holding an `avoid` key;
        None if there is none (never waits)."""
        part = self._partition(layer, ci)
        for s in self.lru[ci].values():
            if s.index in part and s.key not in avoid:
                return s
        return None

    def _claim(self, layer: int, key: tuple[int, int], priority: int, victim: Optional[_Slot] = None) -> _Slot:
        """Slot `victim` (or the least recently used this layer may use) for `key`, its read
        queued at `priority` (a PREFETCH or WARM read: unpinned, most recently used, `prefetched`
        or `warmed`)."""
        ci = self.class_of_layer[layer]
        s = victim if victim is not None else self._victim(layer, ci)
        self._off_lru(s)
        if s.key is not None:
            if self.table is not None:
                self.table[s.key] = -1
            if s.prefetched:
                self.stats.wasted_prefetches += 1
                self.by_layer[s.key[0]][2] += 1
            if s.warmed:
                self.stats.warm_wasted += 1
            del self.where[s.key]
        s.key = key
        s.ready = threading.Event()
        s.error = None
        s.prefetched = priority == PREFETCH
        s.warmed = priority == WARM
        s.parts_left = len(EXPERT_PARTS)
        self.where[key] = s
        if priority != DEMAND:
            self._to_lru(s)  # unpinned, but most recently used
        for part in EXPERT_PARTS:  # (each part its own read: readers pack one while others read)
            heapq.heappush(self.queue, (priority, next(self.seq), s, key, part))
        if self._slot_waiters:  # (an acquire waiting for a slot waits on the same lock)
            self.lock.notify_all()
        else:
            self.lock.notify(len(EXPERT_PARTS))  # (a reader each; a busy one takes the next when done)
        return s

    def _work(self) -> None:
        """A reader thread: one part of one expert at a time, demand reads first, warming's last:
        on all readers but one while nothing else is read, on one beside other reads (so they
        share the drive with one warming read at most). The expert's slot is ready when its last
        part is in (or one failed: the error is the slot's)."""
        warm_cap = max(1, len(self.threads) - 1)
        while True:
            with self.lock:
                while not self.closed:
                    if self.queue and (self.queue[0][0] != WARM or self._warming < (
                            warm_cap if self.in_flight == self._warming else 1)):
                        break
                    if not self.queue and self._claim_warm():
                        continue
                    self.lock.wait()
                if self.closed:
                    return
                priority, _, s, key, part = heapq.heappop(self.queue)
                if s.key != key:  # evicted before its read started
                    continue
                if priority == WARM:
                    self._warming += 1
                # Demand reads bypass queued prefetches; pin while reading so it is not reused.
                if s.pins == 0:
                    self._off_lru(s)
                s.pins += 1
                if self.in_flight == 0:
                    self._busy_since = time.perf_counter()
                self.in_flight += 1
                if s.parts_left == len(EXPERT_PARTS):
                    s.started = time.perf_counter()
            layer, e = key
            err = None
            n = 0
            c0 = time.thread_time()
            src = self.sources[(layer, part)]
            try:
                dst = self.buffers[s.cls][part][s.index]
                at = src.offset + e * src.nbytes
                if src.pack is not None:
                    n = self.readers[src.file].read_into(dst, at, src.shape, src.pack)
                else:
                    n = self.readers[src.file].read_into(dst, at)
            except StreamReadError as ex:
                err = ex
            except OSError as ex:
                err = StreamReadError(f"{src.file}: read error while streaming experts ({ex.strerror or ex})")
            cpu = time.thread_time() - c0
            with self.lock:
                if priority == WARM:
                    self._warming -= 1
                self.stats.bytes_read += n
                self.read_cpu_seconds += cpu
                self.in_flight -= 1
                if self.in_flight == 0:
                    self.stats.busy_seconds += time.perf_counter() - self._busy_since
                if err is not None and s.error is None:
                    s.error = err
                s.pins -= 1
                s.parts_left -= 1
                if s.parts_left == 0:
                    self.reads += 1
                    self.gguf.reads += 1  # (the model checks the file after a forward when this moved)
                    self.read_seconds += time.perf_counter() - s.started
                    if s.error is not None and s.key == key:
                        del self.where[key]
                        s.key = None
                    s.ready.set()
                if s.pins == 0:
                    self._to_lru(s)
                # Wake only who may go on now: an acquire waiting for a slot, a reader held back
                # by warming's cap. (Waking every idle reader at each read cost the step's CPU.)
                if self._slot_waiters or self._warm or (self.queue and self.queue[0][0] == WARM):
                    self.lock.notify_all()
