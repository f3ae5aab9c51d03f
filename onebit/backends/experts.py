"""Expert sources: where a MoE layer's routed experts' bytes come from.

Every backend is handed one. `FileExperts` reads them where they lie in the model file (its
memory map): every layer resident. The expert pool (memory/pool.py `ExpertPool`) is the other
source: a bounded set of slots the experts stream into from the drive. A backend's expert op
asks the source for the layer's arrays and for the experts a step routes to, pinned while it
uses them; which source it is changes where the bytes are, never the arithmetic, so streamed
output is bit-identical to resident (invariant 3).
"""

from __future__ import annotations

import sys
from typing import Iterable, Iterator, Protocol

import numpy as np
from tqdm import tqdm

from ..formats.gguf_file import EXPERT_PARTS


class ExpertLayout(Protocol):
    """How a backend holds some routed-expert tensors other than as the file has them (the cpu
    backend's X16 layouts of Q4_K, Q6_K, MXFP4, Q4_0, Q5_0, IQ4_XS and Q8_0 experts): every source
    of that backend holds them so, the file's (packed at load) and a pool's slots (packed as each is
    filled), so the kernels read the same bytes whichever source it is."""

    def packs(self, t) -> bool:
        """Whether expert tensor t (a gguf_file.Tensor, [E, rows, cols]) is held packed."""

    def shape(self, t) -> tuple[int, int]:
        """One expert of t as held: (rows, bytes a row)."""

    def pack(self, t, src: np.ndarray, dst: np.ndarray) -> None:
        """One expert of t, its rows src [rows, file row bytes], into dst [rows, held row bytes],
        on the calling thread (releasing the interpreter lock)."""

    def pack_all(self, t, raw: np.ndarray) -> np.ndarray:
        """Every expert of t, raw [E, rows, file row bytes] -> a read-only packed copy."""


class ExpertSource(Protocol):
    streamed_layers: frozenset  # the layers whose experts are not all in memory (they pause)
    layout: "ExpertLayout | None"  # which tensors it holds packed (None: all as in the file)

    def arrays(self, layer: int) -> list[np.ndarray]:
        """gate, up, down of `layer`: read-only uint8 arrays [n, rows, row_bytes], indexed by
        what `pinned` yields (expert ids for the file, slot indices for a pool)."""

    def pinned(self, layer: int, experts) -> Iterator[tuple[int, list[int], list[int]]]:
        """Yield (start, group, index) over `experts` (ascending ids: a list or an int64 array;
        the file yields them back as given) in groups, each group's
        experts resident and pinned while the caller uses them: experts[start:start+len(group)]
        are at index[j] of `arrays(layer)`."""

    def arriving(self, layer: int, experts, routed=None) -> Iterator[tuple[list[int], list[int]]]:
        """Yield (positions, index) until every one of `experts` (as for `pinned`) came once,
        each batch resident and pinned until the generator ends: experts[positions[j]] is at
        index[j] of `arrays(layer)`. The file's come at once, in order; a pool's those resident
        first, then the others as their reads complete. `routed`: the forward's routing, one
        array [rows, k] per sequence in it, its rows in order, which a pool may use to choose what
        it keeps (never what is computed)."""


class StreamCounts(Protocol):
    """A pool's counts that a backend reads (memory/pool.py PoolStats keeps more)."""

    demand_misses: int  # experts an acquire had to read (neither resident nor being read)


class StreamedExperts(ExpertSource, Protocol):
    """What a backend asks of an expert source whose layers stream (`streamed_layers` not
    empty): the expert pool (memory/pool.py ExpertPool, which subclasses this to declare it). A
    backend whose kernels read the slots where they lie (Vulkan: mapped device buffers) pins
    experts itself, a step's at a time, instead of through `pinned`.

    Slots: the streamed layers fall into size classes (layers whose expert parts have the same
    shapes); each class has one array per part, [n_slots, rows, row_bytes], whose slot i holds
    one expert's part as the backend holds it (packed where `layout` packs it). An expert an
    acquire returned a slot for stays in that slot, complete, until its release; an unpinned
    slot may be refilled by the pool at any time.

    Threads: the pool's own threads read experts into slots; every member here may be called
    while they run. A backend calls them from one thread, the one running its forwards.

    A Protocol, as ExpertSource is, so a stand-in needs no base class; the pool subclasses it
    to declare what it implements (tests/test_streamed_experts.py checks every member's
    signature, and that the Vulkan backend uses nothing else of the pool).
    """

    # per size class: part name (gguf_file.EXPERT_PARTS) -> the class's slot array [n_slots,
    # rows, row_bytes], writable, as the allocator the pool was given made it (Vulkan: SlotArrays)
    buffers: list[dict[str, np.ndarray]]
    class_of_layer: dict[int, int]  # streamed layer -> its size class (an index into `buffers`)
    stats: StreamCounts

    def capacity(self, layer: int) -> int:
        """How many experts of `layer` can be pinned at once: the most one acquire may ask for."""

    def acquire(self, layer: int, experts: Iterable[int], routed=None) -> list[int]:
        """Block until every one of `experts` (distinct ids of `layer`, at most capacity(layer))
        is resident, pin each once more and return their slots, in `experts`' order. A read that
        failed raises the pool's error (an OnebitError) with nothing left pinned. `routed`: as
        for `arriving`."""

    def release(self, layer: int, experts: Iterable[int]) -> None:
        """Unpin once each of `experts` of `layer` (what an acquire pinned); never waits for a read."""

    def slot_view(self, layer: int, slot: int, part: str) -> np.ndarray:
        """The bytes of `part` in slot `slot` of layer's class, [rows, row_bytes]: a view of
        `buffers`, valid while the expert in that slot stays pinned."""

    def track(self, table: np.ndarray) -> None:
        """Keep table[layer, expert] (int32 [layers, experts], e.g. mapped device memory) = the
        slot that holds that expert complete, or -1, until `untrack`: set when an acquire has the
        expert resident, cleared when its slot is claimed for another. A kernel may read slots
        through the table without acquiring them as long as nothing calls acquire or prefetch
        meanwhile; `touch` then counts the use."""

    def touch(self, used: Iterable[tuple[int, Iterable[int]]]) -> None:
        """Experts a step used through the tracked table, [(layer, [expert ids])]: counted as
        hits and made most recently used, as an acquire and release of them would. An expert the
        table does not hold raises RuntimeError (the kernel read a slot the pool did not vouch for)."""

    def untrack(self) -> None:
        """Stop writing the tracked table (its memory is about to be freed)."""

    def close(self) -> None:
        """Stop the pool's threads (they write into the slot arrays: a backend closes the pool
        before it frees their memory); acquire fails after this."""


def read_only(a: np.ndarray) -> np.ndarray:
    """A C-contiguous read-only view (the cpu kernels are compiled for one array type)."""
    a = np.ascontiguousarray(a)
    if a.flags.writeable:
        a = a.view()
        a.flags.writeable = False
    return a


class FileExperts:
    """Every expert where it lies in the model file: resident, nothing to wait for. With a
    `layout`, the tensors it packs are held as a packed copy made at their first use (or all at
    once by `pack`, at load), whose map pages are then given back."""

    streamed_layers: frozenset = frozenset()

    def __init__(self, gguf, layout: "ExpertLayout | None" = None):
        self.gguf = gguf
        self.layout = layout
        self._arrays: dict[int, tuple] = {}  # layer -> (the tensors' raw arrays, the arrays as held)

    def arrays(self, layer: int) -> list[np.ndarray]:
        tensors = [self.gguf.tensor(f"blk.{layer}.{p}.weight") for p in EXPERT_PARTS]
        raws = [t.raw for t in tensors]
        hit = self._arrays.get(layer)
        if hit is None or any(a is not b for a, b in zip(hit[0], raws)):  # (a plan may swap a map for a copy)
            hit = self._arrays[layer] = (raws, [self._held(t) for t in tensors])
        return hit[1]

    def _held(self, t) -> np.ndarray:
        if self.layout is None or not self.layout.packs(t):
            return read_only(t.raw)
        self.gguf.populate(t)  # (mapped in one call rather than page by page as the packing reads)
        packed = self.layout.pack_all(t, t.raw)
        self.gguf.release(t, uncache=True)
        return packed

    def pack(self) -> None:
        """Make every layer's packed copies now (at load, not inside the first prompt)."""
        if self.layout is None:
            return
        layers = sorted({int(n.split(".")[1]) for n in self.gguf.tensors if n.endswith("_exps.weight")})
        total = sum(t.n_bytes for t in self.gguf.tensors.values() if t.name.endswith("_exps.weight")
                    and self.layout.packs(t))
        with tqdm(total=total, unit="B", unit_scale=True, desc="repacking experts", file=sys.stderr, leave=False,
                  disable=True if total < (256 << 20) else None) as bar:
            for layer in layers:
                self.arrays(layer)
                bar.update(sum(t.n_bytes for t in (self.gguf.tensor(f"blk.{layer}.{p}.weight") for p in EXPERT_PARTS)
                               if self.layout.packs(t)))

    def pinned(self, layer: int, experts):
        yield 0, experts, experts

    def arriving(self, layer: int, experts, routed=None):
        yield np.arange(len(experts), dtype=np.int64), experts
