"""GGUF files on this machine: a models folder, and where other tools keep theirs.

Read only: the Hugging Face hub cache (`models--ORG--NAME/snapshots/REV/*.gguf`), ollama's
store (a manifest per `name:tag` whose model layer is a GGUF blob) and LM Studio's folder
(`PUBLISHER/REPO/*.gguf`), at the places a `Stores` names (the `onebit` command finds them from
HF_HUB_CACHE / HF_HOME, OLLAMA_MODELS, the home folder and ollama's system install). Each file
gets an id a request or a command can name (`lookup`): its file name without `.gguf` for a
models folder, `org/name/file` for the hub, `name:tag` for ollama. A models folder that is a hub
cache or an ollama store gets the ids of that store.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional, Sequence

MAX_DEPTH = 4  # folders below a models folder that are searched
MAX_FILES = 2000  # entries looked at per place (a huge folder is not walked to the end)
_SPLIT = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.I)


@dataclass(frozen=True)
class Stores:
    """Where other tools keep GGUF files: the Hugging Face hub cache, ollama's models folder and
    LM Studio's folders (None / empty: not searched)."""

    hf: Optional[Path] = None
    ollama: tuple[Path, ...] = ()  # the user's store, then a system install's
    lmstudio: tuple[Path, ...] = ()

    def places(self) -> list[str]:
        return [str(p) for p in (self.hf, *self.ollama, *self.lmstudio) if p is not None]


@dataclass(frozen=True)
class Entry:
    id: str
    path: str
    source: str  # models-dir | huggingface | ollama | lmstudio
    size: int


def _is_first_part(name: str) -> bool:
    m = _SPLIT.search(name)
    return m is None or int(m.group(1)) == 1


def _is_model(name: str) -> bool:
    low = name.lower()
    return low.endswith(".gguf") and not low.startswith("mmproj") and _is_first_part(name)


def _files(root: Path, depth: int = MAX_DEPTH) -> Iterator[Path]:
    """Files under root, at most `depth` folders down (hidden folders skipped), at most
    MAX_FILES entries looked at."""
    seen = 0
    stack = [(root, 0)]
    while stack:
        folder, d = stack.pop()
        try:
            items = sorted(os.scandir(folder), key=lambda e: e.name)
        except OSError:
            continue
        for e in items:
            seen += 1
            if seen > MAX_FILES:
                return
            try:
                if e.is_dir() and d < depth and not e.name.startswith("."):
                    stack.append((Path(e.path), d + 1))
                elif e.is_file():
                    yield Path(e.path)
            except OSError:
                continue


def _models(root: Path, depth: int = MAX_DEPTH) -> Iterator[Path]:
    return (p for p in _files(root, depth) if _is_model(p.name))


def _size(p: Path) -> int:
    try:
        return p.stat().st_size
    except OSError:
        return 0


def scan_dir(folder: str) -> list[Entry]:
    root = Path(folder)
    out = []
    for p in _models(root):
        rel = p.relative_to(root).as_posix()
        out.append(Entry(rel[: -len(".gguf")], str(p), "models-dir", _size(p)))
    return out


def scan_hf(root: Path) -> list[Entry]:
    out = []
    if not root.is_dir():
        return out
    for repo in sorted(root.glob("models--*")):
        name = repo.name[len("models--"):].replace("--", "/")
        for p in _models(repo / "snapshots", depth=3):
            file = p.name[: -len(".gguf")]
            out.append(Entry(f"{name}/{file}", str(p), "huggingface", _size(p)))
    return out


def scan_ollama(root: Path) -> list[Entry]:
    manifests = root / "manifests"
    out = []
    if not manifests.is_dir():
        return out
    for m in _files(manifests, depth=5):
        try:
            data = json.loads(m.read_bytes()[: 1 << 20])
            layer = next(x for x in data.get("layers", []) if x.get("mediaType") == "application/vnd.ollama.image.model")
            digest = layer["digest"].replace(":", "-")
        except (OSError, ValueError, StopIteration, KeyError, AttributeError, TypeError):
            continue
        blob = root / "blobs" / digest
        if not blob.is_file():
            continue
        parts = m.relative_to(manifests).parts  # registry / namespace / name / tag
        name = parts[-2] if len(parts) >= 2 else m.parent.name
        if len(parts) >= 3 and parts[-3] != "library":
            name = f"{parts[-3]}/{name}"
        out.append(Entry(f"{name}:{parts[-1]}", str(blob), "ollama", _size(blob)))
    return out


def scan_lmstudio(roots: Sequence[Path]) -> list[Entry]:
    out = []
    for root in roots:
        if root.is_dir():
            for e in scan_dir(str(root)):
                out.append(Entry(e.id, e.path, "lmstudio", e.size))
    return out


def find(models_dirs: Sequence[str] = (), stores: Stores = Stores()) -> list[Entry]:
    """Every GGUF found: the given folders first, then the other tools' `stores`.
    An id found twice keeps its first place."""
    found: list[Entry] = []
    for d in models_dirs:
        root = Path(d)
        if (root / "manifests").is_dir() and (root / "blobs").is_dir():
            found += [Entry(e.id, e.path, "models-dir", e.size) for e in scan_ollama(root)]
        elif any(root.glob("models--*")):
            found += [Entry(e.id, e.path, "models-dir", e.size) for e in scan_hf(root)]
        else:
            found += scan_dir(d)
    if stores.hf is not None:
        found += scan_hf(stores.hf)
    for root in stores.ollama:
        found += scan_ollama(root)
    found += scan_lmstudio(stores.lmstudio)
    seen, out = set(), []
    for e in found:
        if e.id not in seen:
            seen.add(e.id)
            out.append(e)
    return out


def lookup(name: str, models_dirs: Sequence[str] = (), stores: Stores = Stores()) -> Optional[Entry]:
    """The GGUF file `name` stands for, as `find` lists it (`qwen3:4b`, `org/repo/file`, a
    models folder's `sub/file`); ollama's `name` alone is `name:latest`. None: no such entry."""
    entries = {e.id: e for e in find(models_dirs, stores)}
    for key in (name, name[: -len(".gguf")] if name.lower().endswith(".gguf") else None,
                None if ":" in name else f"{name}:latest"):
        if key is not None and key in entries:
            return entries[key]
    return None
