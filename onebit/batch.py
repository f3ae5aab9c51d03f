"""Batch generation: many prompts in, one JSON line out per prompt, resumable.

Results are appended and flushed (and fsynced) as each prompt finishes, so a crash loses at
most the prompt in flight; a rerun skips ids already in the output. Each prompt's sampling
seed is derived from the run's seed and the prompt id, so a prompt gives the same text
whether it ran in the first run or after a resume.
"""

from __future__ import annotations

import io
import json
import os
import zlib
from dataclasses import dataclass
from typing import Any, Iterator, Optional

from .errors import OnebitError, UsageError


class PromptFileError(OnebitError):
    """A line of the prompts file is unusable."""


@dataclass
class PromptItem:
    id: str
    line: int
    prompt: Optional[str] = None
    messages: Optional[list[dict]] = None


@dataclass
class BadLine:
    line: int
    reason: str


def _parse_json_line(text: str, lineno: int) -> PromptItem | BadLine:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        return BadLine(lineno, f"not valid JSON ({e.msg} at column {e.colno})")
    if isinstance(obj, str):
        obj = {"prompt": obj}
    if not isinstance(obj, dict):
        return BadLine(lineno, "expected a JSON object with 'prompt' or 'messages'")
    pid = obj.get("id", lineno)
    if not isinstance(pid, (str, int)) or isinstance(pid, bool):
        return BadLine(lineno, "'id' must be a string or an integer")
    if "messages" in obj:
        msgs = obj["messages"]
        ok = isinstance(msgs, list) and msgs and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in msgs
        )
        if not ok:
            return BadLine(lineno, "'messages' must be a non-empty list of {role, content} strings")
        return PromptItem(str(pid), lineno, messages=msgs)
    prompt = obj.get("prompt")
    if not isinstance(prompt, str):
        return BadLine(lineno, "missing 'prompt' (a string) or 'messages'")
    if not prompt.strip():
        return BadLine(lineno, "the prompt is empty")
    return PromptItem(str(pid), lineno, prompt=prompt)


def read_prompts(stream: io.BufferedIOBase, fmt: str = "auto", name: str = "<input>") -> Iterator[PromptItem | BadLine]:
    """Prompts from a binary stream: JSONL objects ({"id", "prompt"} or {"id", "messages"})
    or plain text, one prompt per line. `fmt` is auto, jsonl or text; auto looks at the
    first non-empty line."""
    if fmt not in ("auto", "jsonl", "text"):
        raise UsageError(f"unknown input format {fmt!r} (auto, jsonl or text)")
    for lineno, raw in enumerate(stream, start=1):
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            yield BadLine(lineno, f"not valid UTF-8 (byte {e.start})")
            continue
        text = text.rstrip("\r\n")
        if not text.strip():
            continue
        if fmt == "auto":
            fmt = "jsonl" if text.lstrip().startswith("{") else "text"
        if fmt == "jsonl":
            yield _parse_json_line(text, lineno)
        else:
            yield PromptItem(str(lineno), lineno, prompt=text)


def completed_ids(path: str) -> set[str]:
    """Ids already in an output file. A torn last line (a crash mid-write) is cut off."""
    if not os.path.exists(path):
        return set()
    done: set[str] = set()
    with open(path, "rb+") as f:
        data = f.read()
        good = 0
        for line in data.splitlines(keepends=True):
            if not line.endswith(b"\n"):
                break
            try:
                obj = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError):
                break
            if isinstance(obj, dict) and "id" in obj:
                done.add(str(obj["id"]))
            good += len(line)
        if good < len(data):
            f.truncate(good)
    return done


def prompt_seed(seed: Optional[int], pid: str) -> Optional[int]:
    if seed is None:
        return None
    return (seed * 1_000_003 + zlib.crc32(pid.encode())) % (1 << 63)


def generate_one(model, item: PromptItem, *, chat: bool, system: Optional[str], seed: Optional[int],
                 **gen: Any) -> dict[str, Any]:
    """Run one prompt to completion and return its result record."""
    if item.messages is not None:
        prompt: Any = item.messages
    elif chat:
        prompt = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": item.prompt}]
    else:
        prompt = item.prompt
    pieces, tokens, last = [], [], None
    for r in model.generate(prompt, seed=prompt_seed(seed, item.id), **gen):
        pieces.append(r.text)
        if r.token is not None:
            tokens.append(r.token)
        last = r
    return {
        "id": item.id,
        "text": "".join(pieces),
        "tokens": tokens,
        "prompt_tokens": last.prompt_tokens,
        "generation_tokens": last.generation_tokens,
        "finish_reason": last.finish_reason,
        "prompt_seconds": round(last.prompt_time, 4),
        "generation_seconds": round(last.generation_time, 4),
        "prompt_tps": round(last.prompt_tps, 2),
        "generation_tps": round(last.generation_tps, 2),
    }


def append_result(f, record: dict[str, Any]) -> None:
    f.write(json.dumps(record, ensure_ascii=False) + "\n")
    f.flush()
    os.fsync(f.fileno())
