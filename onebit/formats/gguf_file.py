"""GGUF files: memory-mapped, validated, split-aware.

The header parser checks every length and count against the file's real size before it
trusts it (a mutated array length must not loop for 2**64 steps or allocate gigabytes),
then every tensor's extent, and that the tensors' data tiles the data section (aligned, in
bounds, no overlap or gap). What a header can make it hold or walk is bounded whatever its
counts say (MAX_* below): the vocabulary is read at its own size, long arrays outside it are
stepped over without reading their items, and counts past the bounds are refused, so any
header is accepted or refused in well under a second and tens of MB. It reads numeric arrays with one numpy view and string arrays in
one pass, so a 150k-token vocabulary loads in a fraction of a second; tests check that it
agrees with the `gguf` package's `GGUFReader` on every fixture. Nothing here copies weights:
`Tensor.raw` is a view into the file's memory map, so `GGUFFile` also remembers each part's
stat at load (`check_unchanged`) and turns a bus error from a shrunken file into one line.
"""

from __future__ import annotations

import errno
import math
import mmap
import os
import re
import signal
import stat
import struct
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np

from ..errors import ModelFileChangedError, ModelFileError, UnsupportedModelError
from .quants import QTYPES, type_name

GGUF_MAGIC = b"GGUF"
MAX_DIMS = 4
MAX_KEY_LEN = 1 << 16
MAX_NESTING = 4

# GGUF value types: id -> (struct format, byte size); 8 = string, 9 = array.
_SCALARS = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9

# Routed-expert tensors: [n_expert, rows, cols] per layer, streamed by the expert pool.
EXPERT_PARTS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")


MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # (Linux's value; Python 3.11 lacks the name)


def is_expert_tensor(name: str) -> bool:
    return any(f".{p}." in name for p in EXPERT_PARTS)


_SPLIT_RE = re.compile(r"^(?P<stem>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


@dataclass(frozen=True)
class Tensor:
    name: str
    qtype: int  # GGML type id
    shape: tuple[int, ...]  # numpy order: rows..., row length last
    raw: np.ndarray  # uint8 [*shape[:-1], row_bytes], a view into the file map
    file: str
    offset: int = 0  # byte offset of the data in `file`

    @property
    def type_name(self) -> str:
        return type_name(self.qtype)

    @property
    def n_bytes(self) -> int:
        return int(self.raw.size)

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


class _Cursor:
    """Bounds-checked little-endian reads over a bytes-like header."""

    def __init__(self, buf, path: str):
        self.buf, self.pos, self.path = buf, 0, path
        self.size = len(buf)

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            raise ModelFileError(
                f"{self.path}: truncated or corrupt GGUF header ({what} at byte {self.pos} runs past "
                f"the end of the {self.size}-byte file)"
            )

    def u32(self, what: str) -> int:
        self.need(4, what)
        (v,) = struct.unpack_from("<I", self.buf, self.pos)
        self.pos += 4
        return v

    def u64(self, what: str) -> int:
        self.need(8, what)
        (v,) = struct.unpack_from("<Q", self.buf, self.pos)
        self.pos += 8
        return v

    def string(self, what: str, max_len: int | None = None, budget: _Budget | None = None) -> bytes:
        """A length-prefixed string; its length is checked against the file (and `max_len`, and
        what `budget` has left) before a byte is copied."""
        n = self.u64(f"length of {what}")
        if max_len is not None and n > max_len:
            raise ModelFileError(f"{self.path}: corrupt GGUF header ({what} claims {n} bytes)")
        self.need(n, what)
        if budget is not None:
            budget.keep(n, what)
        s = bytes(self.buf[self.pos : self.pos + n])
        self.pos += n
        return s

    def text(self, what: str, budget: _Budget | None = None) -> str:
        """A length-prefixed string decoded straight from the file (one copy: the str)."""
        n = self.u64(f"length of {what}")
        self.need(n, what)
        if budget is not None:
            budget.keep(n, what)
        s = str(memoryview(self.buf)[self.pos : self.pos + n], "utf-8", "replace")
        self.pos += n
        return s

    def skip_string(self, what: str) -> None:
        n = self.u64(f"length of {what}")
        self.need(n, what)
        self.pos += n


_SCALAR_FMT = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_SCALAR_NP = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8", 12: "<f8"}

# What a header may make the parser hold or walk, whatever its counts say. The vocabulary (these
# keys) is the one thing kept at the file's own size; everything else is bounded below.
VOCAB_KEYS = frozenset({"tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type",
                        "tokenizer.ggml.merges"})
MAX_VOCAB = 1 << 22  # entries in a vocabulary array (the largest real vocabularies hold about 262k)
MAX_TENSORS = 1 << 15  # tensor entries in one file part (large models have a few thousand)
MAX_KV = 1 << 14  # metadata entries (files have tens to hundreds)
MAX_ARRAY_KEPT = 1 << 16  # items in a kept metadata array outside the vocabulary; longer numeric ones are skipped
MAX_WALKED = 1 << 19  # string items (an item of a nested array counts 4) read one by one outside the vocabulary
MAX_KEPT_BYTES = 32 << 20  # bytes of metadata kept outside the vocabulary (keys, strings, arrays)


@dataclass(frozen=True)
class SkippedArray:
    """A metadata array longer than onebit reads outside the vocabulary: its element type and
    length, the elements themselves left in the file."""

    etype: int
    count: int


class _Budget:
    """What a header has used so far of the bounds above."""

    def __init__(self, path: str):
        self.path, self.walked, self.kept = path, 0, 0

    def walk(self, n: int, key: str) -> None:
        self.walked += n
        if self.walked > MAX_WALKED:
            raise ModelFileError(
                f"{self.path}: corrupt GGUF header (array {key!r}: more string or nested-array items outside the "
                f"vocabulary than onebit reads: {MAX_WALKED} strings, a nested array counting 4)"
            )

    def keep(self, n: int, key: str) -> None:
        self.kept += n
        if self.kept > MAX_KEPT_BYTES:
            raise ModelFileError(
                f"{self.path}: GGUF metadata outside the vocabulary exceeds {MAX_KEPT_BYTES >> 20} MiB (at {key!r}); "
                "onebit refuses such headers"
            )


def _read_value(cur: _Cursor, vtype: int, key: str, budget: _Budget, depth: int = 0, keep: bool = True) -> Any:
    """One metadata value: scalars as Python values, strings as str, numeric arrays as numpy
    arrays, string arrays as lists, arrays of arrays (which no model uses) and long arrays outside
    the vocabulary as `SkippedArray`. Every length is checked against the bytes left in the file
    before anything is read or allocated; with keep=False the value is only stepped over."""
    if vtype in _SCALARS:
        n = _SCALARS[vtype]
        cur.need(n, f"value of {key!r}")
        (v,) = struct.unpack_from(_SCALAR_FMT[vtype], cur.buf, cur.pos)
        cur.pos += n
        return v
    if vtype == _STRING:
        if not keep:
            cur.skip_string(f"string in {key!r}")
            return None
        return cur.text(f"string in {key!r}", None if key in VOCAB_KEYS else budget)
    if vtype != _ARRAY:
        raise ModelFileError(f"{cur.path}: corrupt GGUF header (unknown value type {vtype} for {key!r})")
    if depth >= MAX_NESTING:
        raise ModelFileError(f"{cur.path}: corrupt GGUF header (arrays nested too deep in {key!r})")
    etype = cur.u32(f"array type of {key!r}")
    count = cur.u64(f"array length of {key!r}")
    vocab = key in VOCAB_KEYS and depth == 0
    if vocab and count > MAX_VOCAB:
        raise ModelFileError(f"{cur.path}: corrupt GGUF header (array {key!r} claims {count} items; at most "
                             f"{MAX_VOCAB} are supported)")
    if etype in _SCALARS:
        n = count * _SCALARS[etype]
        cur.need(n, f"array {key!r} of {count} items")
        if not keep or (not vocab and count > MAX_ARRAY_KEPT):
            cur.pos += n
            return SkippedArray(etype, count)
        if not vocab:
            budget.keep(n, key)
        arr = np.frombuffer(cur.buf, dtype=_SCALAR_NP[etype], count=count, offset=cur.pos).copy()
        cur.pos += n
        return arr.astype(arr.dtype.newbyteorder("="), copy=False)
    if etype not in (_STRING, _ARRAY):
        raise ModelFileError(f"{cur.path}: corrupt GGUF header (unknown array type {etype} in {key!r})")
    # Every element takes at least 8 (string) or 12 (array) bytes: a count the file cannot hold is corrupt.
    if count * (8 if etype == _STRING else 12) > cur.size - cur.pos:
        raise ModelFileError(f"{cur.path}: corrupt GGUF header (array {key!r} claims {count} items)")
    if vocab and etype == _STRING:
        return [cur.string(f"string in {key!r}").decode("utf-8", "replace") for _ in range(count)]
    budget.walk(count * (4 if etype == _ARRAY else 1), key)
    if etype == _ARRAY or not keep or count > MAX_ARRAY_KEPT:
        for _ in range(count):
            _read_value(cur, etype, key, budget, depth + 1, keep=False)
        return SkippedArray(etype, count)
    return [_read_value(cur, etype, key, budget, depth + 1) for _ in range(count)]


_INTS, _FLOATS, _BOOL = frozenset({0, 1, 2, 3, 4, 5, 10, 11}), frozenset({6, 12}), 7
_KINDS = {"an integer": _INTS, "a number": _INTS | _FLOATS, "a bool": {_BOOL}, "a string": {_STRING}}
# The value type each key the loader reads must have: (kind, element kind for an array)
_VALUE_TYPES = [
    (re.compile(r"general\.architecture|tokenizer\.ggml\.(model|pre)|tokenizer\.chat_template(\..+)?"),
     ("a string", None)),
    (re.compile(r"tokenizer\.ggml\.(tokens|merges)"), ("an array", "a string")),
    (re.compile(r"tokenizer\.ggml\.scores"), ("an array", "a number")),
    (re.compile(r"tokenizer\.ggml\.token_type"), ("an array", "an integer")),
    (re.compile(r"tokenizer\.ggml\.\w+_token_id"), ("an integer", None)),
    (re.compile(r"tokenizer\.ggml\.add_\w+"), ("a bool", None)),
    (re.compile(r"[\w.]+\.(context_length|block_count|embedding_length|vocab_size|"
                r"expert_count|expert_used_count|expert_feed_forward_length)"), ("an integer", None)),
]
_TYPE_NAMES = {0: "u8", 1: "i8", 2: "u16", 3: "i16", 4: "u32", 5: "i32", 6: "f32", 7: "bool", 8: "string",
               9: "array", 10: "u64", 11: "i64", 12: "f64"}


def _check_value_type(path: str, key: str, vtype: int, etype: Optional[int]) -> None:
    """One clear error for a key the loader reads stored with the wrong GGUF value type (tokens
    as u32, a token id as a string, ...), before anything reads it as the type it should be."""
    for pattern, (kind, element) in _VALUE_TYPES:
        if not pattern.fullmatch(key):
            continue
        if element is None:
            ok = vtype in _KINDS[kind]
            want = kind
        else:
            ok = vtype == _ARRAY and etype in _KINDS[element]
            want = f"an array of {element[2:] if element.startswith('a ') else element[3:]}s"
        if not ok:
            got = _TYPE_NAMES.get(vtype, str(vtype))
            if vtype == _ARRAY:
                got = f"an array of {_TYPE_NAMES.get(etype, str(etype))}"
            raise ModelFileError(f"{path}: metadata {key!r} is stored as {got}; it must be {want} "
                                 "(the file was written wrong: convert it again)")
        return


def _parse_header(buf, path: str) -> tuple[dict[str, Any], list[tuple[str, list[int], int, int]]]:
    """Parse the header, checking every length, count and tensor extent against the file.
    Returns the metadata and (name, ggml dims, type id, absolute data offset) per tensor."""
    cur = _Cursor(buf, path)
    cur.need(4, "magic")
    if bytes(buf[:4]) != GGUF_MAGIC:
        raise ModelFileError(f"{path}: not a GGUF file (it does not begin with 'GGUF')")
    cur.pos = 4
    version = cur.u32("version")
    if version & 0xFFFF == 0 and version != 0:
        raise ModelFileError(f"{path}: big-endian GGUF files are not supported")
    if version not in (2, 3):
        raise ModelFileError(f"{path}: unsupported GGUF version {version} (expected 2 or 3)")
    n_tensors = cur.u64("tensor count")
    n_kv = cur.u64("metadata count")
    # A key/value takes at least 8 + 4 + 1 bytes and a tensor entry at least 8 + 4 + 8 + 4 + 8.
    if n_kv * 13 + n_tensors * 32 > cur.size - cur.pos:
        raise ModelFileError(
            f"{path}: corrupt GGUF header ({n_kv} metadata entries / {n_tensors} tensors cannot fit in "
            f"the {cur.size - cur.pos} bytes after the counts)"
        )
    for count, most, what in ((n_tensors, MAX_TENSORS, "tensors"), (n_kv, MAX_KV, "metadata entries")):
        if count > most:
            raise ModelFileError(f"{path}: GGUF header lists {count} {what}; onebit reads at most {most} "
                                 "(no model has more)")
    budget = _Budget(path)
    alignment = 32
    meta: dict[str, Any] = {}
    for i in range(n_kv):
        key = cur.string(f"key {i}", MAX_KEY_LEN, budget).decode("utf-8", "replace")
        vtype = cur.u32(f"type of {key!r}")
        if key in meta:
            raise ModelFileError(f"{path}: metadata key {key!r} appears twice")
        if vtype == _ARRAY and cur.pos + 4 <= cur.size:
            _check_value_type(path, key, vtype, int.from_bytes(bytes(buf[cur.pos : cur.pos + 4]), "little"))
        else:
            _check_value_type(path, key, vtype, None)
        meta[key] = _read_value(cur, vtype, key, budget)
        if key == "general.alignment":
            alignment = meta[key]
            if vtype != 4 or alignment == 0 or alignment & (alignment - 1):
                raise ModelFileError(f"{path}: general.alignment {alignment!r} is not a power-of-two uint32")
    if n_tensors * 32 > cur.size - cur.pos:
        raise ModelFileError(
            f"{path}: corrupt GGUF header ({n_tensors} tensors cannot fit in the {cur.size - cur.pos} bytes "
            "left after the metadata)"
        )
    entries = []
    names: set[str] = set()
    for i in range(n_tensors):
        name = cur.string(f"tensor name {i}", MAX_KEY_LEN, budget).decode("utf-8", "replace")
        n_dims = cur.u32(f"dimension count of {name!r}")
        if not 1 <= n_dims <= MAX_DIMS:
            raise ModelFileError(f"{path}: tensor {name!r} has {n_dims} dimensions (1 to {MAX_DIMS} allowed)")
        dims = [cur.u64(f"dimensions of tensor {name!r}") for _ in range(n_dims)]
        type_id = cur.u32(f"type of tensor {name!r}")
        offset = cur.u64(f"offset of tensor {name!r}")
        if name in names:
            raise ModelFileError(f"{path}: tensor {name!r} appears twice")
        names.add(name)
        entries.append((name, dims, type_id, offset))
    data_start = (cur.pos + alignment - 1) // alignment * alignment
    extents = []  # (offset in the data section, bytes, name)
    for name, dims, type_id, offset in entries:
        q = QTYPES.get(type_id)
        if q is None:
            raise UnsupportedModelError(
                f"{path}: tensor {name!r} has type {type_name(type_id)}, which onebit does not support "
                f"(supported: {', '.join(sorted(c.name for c in QTYPES.values()))})"
            )
        if any(d == 0 for d in dims):
            raise ModelFileError(f"{path}: tensor {name!r} has an empty dimension {dims}")
        if dims[0] % q.block_size:
            raise ModelFileError(
                f"{path}: tensor {name!r} row length {dims[0]} is not a multiple of {q.name}'s block of {q.block_size}"
            )
        n_bytes = dims[0] // q.block_size * q.type_size
        for d in dims[1:]:
            n_bytes *= d  # Python ints: no overflow, and we stop as soon as it exceeds the file
            if n_bytes > cur.size:
                break
        start = data_start + offset
        if offset % alignment:
            raise ModelFileError(f"{path}: tensor {name!r} data offset {offset} is not {alignment}-aligned")
        if start + n_bytes > cur.size:
            raise ModelFileError(
                f"{path}: tensor {name!r} ({q.name}, dims {dims}) needs bytes up to {start + n_bytes} but the "
                f"file has {cur.size}: the file is truncated or corrupt"
            )
        extents.append((offset, n_bytes, name))
    _check_layout(extents, alignment, path)
    return meta, [(name, dims, type_id, data_start + offset) for name, dims, type_id, offset in entries]


def _check_layout(extents: list[tuple[int, int, str]], alignment: int, path: str) -> None:
    """Tensor data must tile the data section: in offset order, each tensor starts where the one
    before it ends, rounded up to the alignment, and the first at 0 (the layout every GGUF writer
    makes and llama.cpp requires). So no tensor overlaps or aliases another, and a type or shape
    edit that changes a tensor's byte size is caught at its neighbour's offset."""
    expected, before = 0, None
    for offset, n_bytes, name in sorted(extents, key=lambda e: e[0]):  # stable: ties keep header order
        if offset < expected:
            b_off, b_n, b_name = before
            raise ModelFileError(
                f"{path}: tensor {name!r} (data bytes {offset}..{offset + n_bytes}) overlaps tensor {b_name!r} "
                f"(bytes {b_off}..{b_off + b_n}): the header's tensor offsets, types or shapes are corrupt"
            )
        if offset > expected:
            where = f"the tensor before it, {before[2]!r}, ends at {before[0] + before[1]}" if before else \
                "the data section starts at 0"
            raise ModelFileError(
                f"{path}: tensor {name!r} starts at data offset {offset} but {where} (next tensor expected at "
                f"{expected}): the header's tensor offsets, types or shapes are corrupt"
            )
        before = (offset, n_bytes, name)
        expected = (offset + n_bytes + alignment - 1) // alignment * alignment


def _check_path(path: str) -> None:
    """A ModelFileError that says what is wrong with `path` if it is not a regular file to read."""
    try:
        st = os.stat(path)
    except OSError as e:
        why = {errno.ENOENT: "no such file", errno.ELOOP: "a loop of symbolic links",
               errno.ENOTDIR: "a part of the path is not a folder", errno.EACCES: "permission denied",
               errno.ENAMETOOLONG: "the path is too long"}.get(e.errno, e.strerror or str(e))
        if e.errno == errno.ENOENT and os.path.islink(path):
            why = f"a broken symbolic link (to {os.readlink(path)})"
        raise ModelFileError(f"{path}: {why}") from None
    if stat.S_ISDIR(st.st_mode):
        raise ModelFileError(f"{path}: is a directory, not a regular file")
    if not stat.S_ISREG(st.st_mode):
        raise ModelFileError(f"{path}: not a regular file")


def _split_paths(path: Path) -> list[Path]:
    m = _SPLIT_RE.match(path.name)
    if not m:
        return [path]
    count = int(m.group("count"))
    if count < 1 or count > 9999:
        raise ModelFileError(f"{path}: bad split file name")
    paths = [path.with_name(f"{m.group('stem')}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise ModelFileError(f"{path}: split model is missing part(s): {', '.join(missing)}")
    return paths


class GGUFFile:
    """One model: metadata from the first part, tensors from every part of a split file."""

    def __init__(self, path: str | os.PathLike):
        self.path = str(path)
        self.reads = 0  # reads of the file outside its memory map (an expert pool's, a device backend's copies)
        if not self.path:
            raise ModelFileError("the model path is empty: give a GGUF file")
        _check_path(self.path)
        p = Path(path)
        self.paths = [str(x) for x in _split_paths(p)]
        self._identity: dict[str, tuple[int, int, int, int]] = {}  # part -> its stat at load
        self.metadata: dict[str, Any] = {}
        self.tensors: dict[str, Tensor] = {}
        self.set_aside: dict[str, Tensor] = {}  # tensors in the file that the model never reads (config.py)
        self.file_bytes = 0
        self._maps: dict[str, np.memmap] = {}  # part path -> its map (release)
        for i, part in enumerate(self.paths):
            meta, tensors = self._read_part(part)
            if i == 0:
                self.metadata = meta
            for t in tensors:
                if t.name in self.tensors:
                    raise ModelFileError(f"{part}: tensor {t.name!r} appears in more than one split part")
                self.tensors[t.name] = t
        count = self.metadata.get("split.count")
        if count is not None and int(count) != len(self.paths):
            raise ModelFileError(
                f"{self.path}: file says it is split into {count} parts but {len(self.paths)} were found; "
                "pass the first part (*-00001-of-0000N.gguf) with all parts beside it"
            )

    def _read_part(self, path: str) -> tuple[dict[str, Any], list[Tensor]]:
        try:
            size = os.path.getsize(path)
            with open(path, "rb") as f:
                if size == 0:
                    raise ModelFileError(f"{path}: empty file, not a GGUF model")
                self._identity[path] = _identity(os.fstat(f.fileno()))
                with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                    meta, entries = _parse_header(buf, path)
        except PermissionError as e:
            raise ModelFileError(f"{path}: cannot read file ({e.strerror})") from None
        except IsADirectoryError:
            raise ModelFileError(f"{path}: is a directory, not a GGUF file") from None
        except OSError as e:
            raise ModelFileError(f"{path}: cannot read file ({e.strerror or e})") from None
        self.file_bytes += size
        _watch_sigbus(self)  # from here on the process reads the file through a memory map
        data = np.memmap(path, dtype=np.uint8, mode="r")
        self._maps[path] = data
        tensors = []
        for name, dims, type_id, start in entries:
            q = QTYPES[type_id]
            shape = tuple(reversed(dims))  # numpy order: row length last
            row_bytes = dims[0] // q.block_size * q.type_size
            n_bytes = row_bytes * math.prod(shape[:-1])
            raw = data[start : start + n_bytes].reshape(*shape[:-1], row_bytes)
            tensors.append(Tensor(name=name, qtype=type_id, shape=shape, raw=raw, file=path, offset=start))
        return meta, tensors

    def release(self, t: Tensor, uncache: bool = False, lo: int = 0, hi: Optional[int] = None) -> None:
        """Drop this process's pages of tensor `t`'s map (it has been copied elsewhere: a device
        buffer): pages read through a map count in the process's resident memory until then.
        The page cache keeps them (not ours; a later read through the map faults them back)
        unless `uncache`: for a copy made to be read instead of them for as long as the model
        is loaded (a backend's repacked layout), their page cache pages go too, so they do not
        crowd out pages still read through the map (the 30B-A3B shape resident on 24 GiB: its
        repacked experts beside the whole file's pages would not fit). lo, hi: only the tensor's
        bytes [lo, hi) (a copy made a part at a time), the pages wholly below hi."""
        data = self._maps.get(t.file)
        m = getattr(data, "_mmap", None)
        if m is None or not hasattr(mmap, "MADV_DONTNEED"):
            return
        start = (t.offset + lo) // mmap.PAGESIZE * mmap.PAGESIZE
        end = t.offset + t.n_bytes if hi is None or hi >= t.n_bytes else (t.offset + hi) // mmap.PAGESIZE * mmap.PAGESIZE
        if end <= start:
            return
        try:
            m.madvise(mmap.MADV_DONTNEED, start, end - start)
        except (OSError, ValueError):
            pass  # (advice only)
        if uncache and hasattr(os, "posix_fadvise"):
            try:
                fd = os.open(t.file, os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, start, end - start, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)
            except OSError:
                pass  # (advice only)

    def populate(self, t: Tensor) -> bool:
        """Map every page of tensor `t` into this process now (MADV_POPULATE_READ, Linux 5.14+;
        reading the file where the page cache lacks it), as llama.cpp's map does at load: a
        page first touched in a decode step costs a fault there. False where the system
        cannot (the pages then map on first touch, as before)."""
        data = self._maps.get(t.file)
        m = getattr(data, "_mmap", None)
        if m is None:
            return False
        start = t.offset // mmap.PAGESIZE * mmap.PAGESIZE
        try:
            m.madvise(MADV_POPULATE_READ, start, t.offset + t.n_bytes - start)
        except (OSError, ValueError):
            return False
        return True

    # -- the file under us -------------------------------------------------------------

    def changes(self) -> list[str]:
        """'PATH: what changed' for each part that is no longer the file that was loaded."""
        out = []
        for path, before in self._identity.items():
            what = _what_changed(path, before)
            if what:
                out.append(f"{path}: {what}")
        return out

    def check_unchanged(self) -> None:
        """Raise ModelFileChangedError if a part's size, mtime or identity (device, inode) is not
        what it was at load: weights are read from the file's memory map (or streamed from it),
        so a file truncated, rewritten or replaced under a running model gives a bus error or
        garbage. One os.stat per part; the model checks before and after every forward."""
        changed = self.changes()
        if changed:
            raise ModelFileChangedError(changed[0])

    # -- conveniences -----------------------------------------------------------------

    @property
    def architecture(self) -> str:
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise ModelFileError(f"{self.path}: metadata has no general.architecture")
        return arch

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def tensor(self, name: str) -> Tensor:
        t = self.tensors.get(name)
        if t is None:
            raise ModelFileError(f"{self.path}: tensor {name!r} is missing")
        return t


def _identity(st: os.stat_result) -> tuple[int, int, int, int]:
    return st.st_size, st.st_mtime_ns, st.st_dev, st.st_ino


def _what_changed(path: str, before: tuple[int, int, int, int]) -> str:
    """How the file at `path` differs from its stat at load ('' if it does not)."""
    try:
        now = _identity(os.stat(path))
    except OSError as e:
        return f"file changed while running: it can no longer be opened ({e.strerror})"
    if now[2:] != before[2:]:
        return "file changed while running: replaced by another file (a different inode)"
    if now[0] != before[0]:
        why = " (truncated?)" if now[0] < before[0] else ""
        return f"file changed while running: size {before[0]} -> {now[0]} bytes{why}"
    if now[1] != before[1]:
        return "file changed while running: modified in place (its mtime changed)"
    return ""


# Files whose memory maps a bus error may come from; the handler names the ones that changed.
_MAPPED: "weakref.WeakSet[GGUFFile]" = weakref.WeakSet()
_SIGBUS_HANDLER = None


def _watch_sigbus(g: GGUFFile) -> None:
    """Touching a page of a memory map past the end of a file that shrank raises SIGBUS, which
    would kill the process with nothing on stderr (exit 135). A Python signal handler cannot
    help (the faulting access inside numpy's C code would just repeat), so a C-level handler
    (through ctypes) prints one line naming the file and what changed, then exits with 1."""
    global _SIGBUS_HANDLER
    _MAPPED.add(g)
    if _SIGBUS_HANDLER is not None or not hasattr(signal, "SIGBUS"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL(None)
        handler = ctypes.CFUNCTYPE(None, ctypes.c_int)(_on_sigbus)
        libc.signal.restype = ctypes.c_void_p
        libc.signal.argtypes = [ctypes.c_int, ctypes.c_void_p]
        libc.signal(signal.SIGBUS, ctypes.cast(handler, ctypes.c_void_p))
        _SIGBUS_HANDLER = handler  # keep the callback alive
    except (OSError, AttributeError, TypeError):  # no libc to call: the default action stays
        _SIGBUS_HANDLER = False


def _on_sigbus(signo: int) -> None:
    try:
        changed = [c for g in list(_MAPPED) for c in g.changes()]
        if changed:
            msg = changed[0]
        else:
            paths = ", ".join(p for g in list(_MAPPED) for p in g.paths) or "the model file"
            msg = f"{paths}: bus error reading the file's memory map (truncated while running, or an I/O error)"
        os.write(2, f"onebit: error: {msg}\n".encode("utf-8", "replace"))
    finally:
        os._exit(1)


def read_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """Metadata of a GGUF file (first part of a split model) as plain Python values."""
    return GGUFFile(path).metadata
