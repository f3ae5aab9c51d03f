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
from typing import Iterator, Protocol

import numpy as np
from tqdm import tqdm

from ..gguf_file import EXPERT_PARTS


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
