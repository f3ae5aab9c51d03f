"""Expert sources: where a MoE layer's routed experts' bytes come from.

Every backend is handed one. `FileExperts` reads them where they lie in the model file (its
memory map): every layer resident. The expert pool (memory/pool.py `ExpertPool`) is the other
source: a bounded set of slots the experts stream into from the drive. A backend's expert op
asks the source for the layer's arrays and for the experts a step routes to, pinned while it
uses them; which source it is changes where the bytes are, never the arithmetic, so streamed
output is bit-identical to resident (invariant 3).
"""

from __future__ import annotations

from typing import Iterator, Protocol

import numpy as np

from ..gguf_file import EXPERT_PARTS


class ExpertSource(Protocol):
    streamed_layers: frozenset  # the layers whose experts are not all in memory (they pause)

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
    """Every expert where it lies in the model file: resident, nothing to wait for."""

    streamed_layers: frozenset = frozenset()

    def __init__(self, gguf):
        self.gguf = gguf
        self._arrays: dict[int, tuple] = {}  # layer -> (the tensors' raw arrays, read-only views)

    def arrays(self, layer: int) -> list[np.ndarray]:
        raws = [self.gguf.tensor(f"blk.{layer}.{p}.weight").raw for p in EXPERT_PARTS]
        hit = self._arrays.get(layer)
        if hit is None or any(a is not b for a, b in zip(hit[0], raws)):  # (a plan may swap a map for a copy)
            hit = self._arrays[layer] = (raws, [read_only(r) for r in raws])
        return hit[1]

    def pinned(self, layer: int, experts):
        yield 0, experts, experts
