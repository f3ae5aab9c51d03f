"""What a streamed model's expert pool learned about its file, kept for the next process.

A trained model's routers favour some experts in every layer (the busiest fifth of a
Qwen3-30B-A3B layer's experts take more than half of its selections), and which ones is a fact
of the file, the same from one process to the next. A fresh process starts with empty slots and
learns them again one miss at a time. So the pool counts what it is asked for (`ExpertPool.uses`,
every acquire that is not a prompt's scan) and, when the model closes, `save` adds the counts to
those kept for the file (the older ones halved, so what the file is used for lately counts
most); the next load of the same file reads the most used back into the slots first
(`ExpertPool.warm`), behind every read a forward waits on.

Kept per file in `DIR/<key>.npy` (a float32 array [layers, experts], some KiB), where the key
is a digest of what makes the file's experts what they are (its size and its tensors' names,
types, shapes and offsets): a copy or a renamed file keeps its counts, a file written again
differently does not. A file that cannot be read or does not match is ignored: nothing is
lost but the head start.
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path
from typing import Optional

import numpy as np

log = logging.getLogger(__name__)

DECAY = 0.5  # the kept counts' weight against the closing process's own


def file_key(gguf) -> str:
    """A digest of the file's size and its tensor table (name, type, shape, offset of each)."""
    h = hashlib.sha256(str(gguf.file_bytes).encode())
    for name in sorted(gguf.tensors):
        t = gguf.tensors[name]
        h.update(f"{name}:{t.qtype}:{tuple(t.shape)}:{t.offset}\n".encode())
    return h.hexdigest()[:32]


class WarmStore:
    """The kept counts of one file in folder `folder`."""

    def __init__(self, folder: str | os.PathLike, gguf):
        self.path = Path(folder) / f"{file_key(gguf)}.npy"

    def load(self, shape: tuple[int, int]) -> Optional[np.ndarray]:
        """The kept counts, float32 `shape`, or None where there are none (or they do not fit)."""
        try:
            counts = np.load(self.path, allow_pickle=False)
        except (OSError, ValueError, EOFError) as e:
            if not isinstance(e, FileNotFoundError):
                log.info("expert use counts %s not read: %s", self.path, e)
            return None
        if counts.shape != shape or counts.dtype != np.float32 or not np.all(np.isfinite(counts)):
            log.info("expert use counts %s ignored: %s %s, wanted float32 %s", self.path, counts.dtype,
                     counts.shape, shape)
            return None
        return counts

    def save(self, uses: np.ndarray, kept: Optional[np.ndarray]) -> None:
        """Keep uses + DECAY * kept (written to a new file, then renamed over the old: a reader
        never sees half of one); a folder that cannot be written is said once in the log."""
        counts = uses.astype(np.float32) + (DECAY * kept if kept is not None else 0)
        tmp = self.path.with_name(f"{self.path.stem}.{os.getpid()}.tmp")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as f:
                np.save(f, counts.astype(np.float32), allow_pickle=False)
            os.replace(tmp, self.path)
        except OSError as e:
            log.warning("expert use counts not kept in %s: %s", self.path.parent, e.strerror or e)
            try:
                tmp.unlink()
            except OSError:
                pass


def warm_order(counts: np.ndarray, layers, limit: int) -> list[tuple[int, int]]:
    """The (layer, expert) pairs to read first: the `limit` most used of `layers` (counts above
    zero), in layer order (the order a prompt's forward needs them), each layer's most used first."""
    layers = sorted(layers)
    flat = [(float(counts[layer, e]), layer, e) for layer in layers for e in np.flatnonzero(counts[layer] > 0)]
    flat.sort(key=lambda x: -x[0])
    chosen = flat[:max(limit, 0)]
    chosen.sort(key=lambda x: (x[1], -x[0]))
    return [(layer, int(e)) for _, layer, e in chosen]
