"""What an expert pool learned about a file, kept between processes so the next one starts warm.

One record per model file, a small JSON file in the user's cache folder (`pool-<hash of the
file's real path>.json`: one record per path, rewritten in place, so a file that changes does
not leave old records behind). Per streamed layer it holds each expert's use count (acquires
that asked for it: one a decode step, one a prompt chunk), the tick of its last use (the
pool's acquire count then) and the experts the pool held when the model was closed. Counts of
older processes are halved each time a later one writes the record, so what the file is used
for lately weighs most. The 30B-A3B shape (48 layers of 128 experts): under 100 KB, written in
about 7 ms and read in 3 (2-core VM).

The record names the file by its real path, size and modification time: a stat, nothing read
from the file (a hash of its header would cost a read of the tokenizer's megabytes, and two
files whose headers agree, such as synthetic files of one shape, would share a record). A file
rewritten in place gets a new time, and its old record is ignored, then replaced.

A record is a hint, never trusted: one that cannot be read, that names another file, or whose
layers or expert ids do not fit the file is ignored with one log line. Only the order in which
a pool reads experts depends on it, never what a forward computes.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

log = logging.getLogger("onebit")

VERSION = 1
KEEP = 0.5  # weight of the record's counts when one more process adds its own


@dataclass
class Learned:
    """One layer's figures: hot[e] (uses, older processes' halved), last[e] (tick of the last use,
    -1: none in the process that wrote it), held (experts in the pool at its close)."""

    hot: list[float]
    last: list[int]
    held: list[int]


def file_key(path: str) -> dict:
    """What a record is matched to: the file's real path, size and modification time (ns)."""
    st = os.stat(path)
    return {"path": os.path.realpath(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def record_path(directory: str | os.PathLike, path: str) -> Path:
    digest = hashlib.sha256(os.path.realpath(path).encode("utf-8", "surrogateescape")).hexdigest()[:24]
    return Path(directory) / f"pool-{digest}.json"


def read_record(directory: str | os.PathLike, path: str, shape: dict[int, int]) -> Optional[dict[int, Learned]]:
    """The record of model file `path` in `directory`, checked against the file (its key) and
    `shape` ({streamed layer: its expert count}); None when there is none, or (with one log line)
    when it is unreadable, names another file or version of it, or does not fit `shape`."""
    where = record_path(directory, path)
    try:
        text = where.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as e:
        log.info("expert pool record %s ignored: cannot read it (%s)", where, e)
        return None
    try:
        data = json.loads(text)
        return _parse(data, file_key(path), shape)
    except (ValueError, TypeError, KeyError, AttributeError, OSError) as e:
        log.info("expert pool record %s ignored: %s", where, e)
        return None


def _parse(data, key: dict, shape: dict[int, int]) -> dict[int, Learned]:
    if not isinstance(data, dict) or data.get("version") != VERSION:
        raise ValueError(f"not a version {VERSION} record")
    if data.get("file") != key:
        raise ValueError("it was written for another file, or the file changed since")
    layers = data["layers"]
    if not isinstance(layers, dict) or {int(k) for k in layers} != set(shape):
        raise ValueError("its layers are not the file's streamed layers")
    out = {}
    for k, v in layers.items():
        layer, n = int(k), shape[int(k)]
        hot, last, held = v["hot"], v["last"], v["held"]
        if not (isinstance(hot, list) and isinstance(last, list) and isinstance(held, list)):
            raise ValueError(f"layer {layer}: hot, last and held must be lists")
        if len(hot) != n or len(last) != n:
            raise ValueError(f"layer {layer}: {len(hot)} counts for {n} experts")
        if not all(type(h) in (int, float) and 0 <= h < 1e18 for h in hot):
            raise ValueError(f"layer {layer}: a count out of range")
        if not all(type(t) is int and -1 <= t < 2**62 for t in last):
            raise ValueError(f"layer {layer}: a last-use tick out of range")
        if not all(type(e) is int and 0 <= e < n for e in held):
            raise ValueError(f"layer {layer}: an expert id out of range (0..{n - 1})")
        out[layer] = Learned([float(h) for h in hot], list(last), sorted(set(held)))
    return out


def merged(old: Optional[dict[int, Learned]], new: dict[int, Learned]) -> dict[int, Learned]:
    """The record one more process writes: its counts plus the old record's, halved (KEEP); its
    own last uses and held experts."""
    if old is None:
        return new
    return {layer: Learned([h + KEEP * o for h, o in zip(v.hot, old[layer].hot)], v.last, v.held)
            for layer, v in new.items()}


def write_record(directory: str | os.PathLike, path: str, learned: dict[int, Learned]) -> bool:
    """Write the record of `path` atomically (a temporary file renamed over the old record);
    False, with one log line, when the folder cannot be written (nothing is raised)."""
    where = record_path(directory, path)
    tmp = where.with_name(f"{where.name}.{os.getpid()}.tmp")
    try:
        data = {"version": VERSION, "file": file_key(path),
                "layers": {str(layer): {"hot": [round(h, 3) for h in v.hot], "last": v.last, "held": v.held}
                           for layer, v in sorted(learned.items())}}
        where.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(data, separators=(",", ":")), encoding="utf-8")
        os.replace(tmp, where)
        return True
    except OSError as e:
        log.info("expert pool record %s not written: %s", where, e)
        try:
            tmp.unlink()
        except OSError:
            pass
        return False


def warm_order(learned: dict[int, Learned], k: int) -> list[tuple[int, int]]:
    """(layer, expert) in the order a pool warms them: each layer's experts ranked by use count
    (then held at the close, then the latest use), taken k at a time (k: the experts a token
    routes to), every layer's first k in layer order before any layer's next k, so that what a
    first token most likely needs in every layer comes first. Experts never used and not held
    are left out."""
    ranked = {}
    for layer, v in learned.items():
        held = set(v.held)
        used = [e for e in range(len(v.hot)) if v.hot[e] > 0 or e in held]
        ranked[layer] = sorted(used, key=lambda e: (-v.hot[e], e not in held, -v.last[e], e))
    deepest = max((len(r) for r in ranked.values()), default=0)
    return [(layer, e) for start in range(0, deepest, max(k, 1)) for layer in sorted(ranked)
            for e in ranked[layer][start : start + max(k, 1)]]
