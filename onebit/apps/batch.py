"""Batch generation: many prompts in, one JSON line out per prompt, resumable.

Results are appended one whole line per write (and fsynced) as each prompt finishes, so a
crash loses at most the prompt in flight; a rerun skips ids already in the output. The
output file is locked while a run writes it, so two runs never append to the same file.
Each prompt's sampling seed is derived from the run's seed and the prompt id, so a prompt
gives the same text whether it ran in the first run or after a resume.
"""

from __future__ import annotations

import errno
import fcntl
import io
import json
import os
import stat
import sys
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

from ..errors import OnebitError, UsageError
from ..chat_formats.think import reply_splitter

MAX_LINE = 16 << 20  # a prompts-file line longer than this is not a prompt (e.g. /dev/zero)
BOM = b"\xef\xbb\xbf"


class PromptFileError(OnebitError):
    """A line of the prompts file is unusable."""


class OutputError(OnebitError):
    """The results file could not be read back or written (disk full, I/O error, no read access)."""

    exit_code = 1


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
        # some of json's messages end in "at" ("Unterminated string starting at"): say it once
        return BadLine(lineno, f"not valid JSON ({e.msg.removesuffix(' at')} at column {e.colno})")
    if isinstance(obj, str):
        obj = {"prompt": obj}
    if not isinstance(obj, dict):
        return BadLine(lineno, "expected a JSON object with 'prompt' or 'messages'")
    if "id" in obj:
        pid = obj["id"]
        if not isinstance(pid, (str, int)) or isinstance(pid, bool):
            return BadLine(lineno, "'id' must be a string or an integer")
        pid = str(pid)  # 7 and "7" are the same id
        if pid.startswith("#"):
            return BadLine(lineno, f"id {pid!r}: ids starting with '#' are reserved for lines without an id")
    else:
        pid = f"#{lineno}"  # cannot collide with a given id (those may not start with '#')
    if "messages" in obj:
        msgs = obj["messages"]
        ok = isinstance(msgs, list) and msgs and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in msgs
        )
        if not ok:
            return BadLine(lineno, "'messages' must be a non-empty list of {role, content} strings")
        return PromptItem(pid, lineno, messages=msgs)
    prompt = obj.get("prompt")
    if not isinstance(prompt, str):
        return BadLine(lineno, "missing 'prompt' (a string) or 'messages'")
    if not prompt.strip():
        return BadLine(lineno, "the prompt is empty")
    return PromptItem(pid, lineno, prompt=prompt)


def _lines(stream: io.BufferedIOBase, name: str) -> Iterator[tuple[int, bytes]]:
    """(line number, raw line) with a bounded read per line; a UTF-8 BOM at the start is skipped."""
    lineno = 0
    while True:
        raw = stream.readline(MAX_LINE + 1)
        if not raw:
            return
        lineno += 1
        if lineno == 1 and raw.startswith(BOM):
            raw = raw[len(BOM):]
        if len(raw) > MAX_LINE:
            raise PromptFileError(f"{name}:{lineno}: a line longer than {MAX_LINE >> 20} MiB: not a prompts file")
        yield lineno, raw


def read_prompts(stream: io.BufferedIOBase, fmt: str = "auto", name: str = "<input>") -> Iterator[PromptItem | BadLine]:
    """Prompts from a binary stream: JSONL objects ({"id", "prompt"} or {"id", "messages"})
    or plain text, one prompt per line. `fmt` is auto, jsonl or text; auto looks at the
    first non-empty line. A repeated id is a bad line that names the first one's line."""
    if fmt not in ("auto", "jsonl", "text"):
        raise UsageError(f"unknown input format {fmt!r} (auto, jsonl or text)")
    seen: dict[str, int] = {}
    for lineno, raw in _lines(stream, name):
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
        item = _parse_json_line(text, lineno) if fmt == "jsonl" else PromptItem(str(lineno), lineno, prompt=text)
        if isinstance(item, PromptItem):
            if item.id in seen:
                item = BadLine(lineno, f"duplicate id {item.id!r} (first on line {seen[item.id]})")
            else:
                seen[item.id] = lineno
        yield item


def open_prompts(path: str) -> tuple[io.BufferedIOBase, Optional[int]]:
    """The prompts stream for `--input PATH` (`-`: stdin) and its number of prompts, when a
    regular file tells it (for the progress bar)."""
    if path == "-":
        return sys.stdin.buffer, None
    try:
        stream = open(path, "rb")
    except OSError as e:
        raise UsageError(f"{path}: cannot read the prompts file ({e.strerror})") from None
    return stream, count_lines(path)


def count_lines(path: str) -> Optional[int]:
    """Non-blank lines of a regular prompts file (for the progress bar); None for anything else."""
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):  # a FIFO would be consumed (or block) here
            return None
        with open(path, "rb") as f:
            return sum(1 for _, raw in _lines(f, path) if raw.strip())
    except (OSError, PromptFileError):
        return None


# -- the results file -------------------------------------------------------------------


def _lock_holder(st: os.stat_result) -> Optional[int]:
    """The pid holding a flock on the file, from /proc/locks (Linux), if it says."""
    key = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        with open("/proc/locks") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 6 and parts[1] == "FLOCK" and parts[5] == key:
                    return int(parts[4])
    except (OSError, ValueError):
        pass
    return None


@dataclass
class ResultsFile:
    """Where results go. A regular file is locked (one run at a time), read back to resume
    (never past its size), and written one whole line per os.write: a short or failed write is
    cut back, so no torn line is left behind. `-` (stdout), /dev/null, a pipe or another
    character device is a stream: written to, never read back."""

    path: str
    fd: int = -1
    regular: bool = False
    readable: bool = False
    unreadable_lines: list[int] = field(default_factory=list)  # kept as they are, not results

    @classmethod
    def open(cls, path: str) -> "ResultsFile":
        self = cls(path)
        if path == "-":
            self.fd = sys.stdout.fileno()
            return self
        try:
            st = os.stat(path)
        except FileNotFoundError:
            st = None
        except OSError as e:
            raise UsageError(f"{path}: cannot write the output file ({e.strerror})") from None
        if st is not None and stat.S_ISDIR(st.st_mode):
            raise UsageError(f"{path}: cannot write the output file (it is a directory)")
        if st is not None and stat.S_ISBLK(st.st_mode):
            raise UsageError(f"{path}: refusing to write results to a block device")
        regular = st is None or stat.S_ISREG(st.st_mode)
        base = os.O_APPEND | os.O_CREAT | os.O_NOCTTY | os.O_CLOEXEC
        try:
            if regular:
                try:
                    self.fd = os.open(path, base | os.O_RDWR, 0o666)
                    self.readable = True
                except PermissionError:
                    self.fd = os.open(path, base | os.O_WRONLY, 0o666)  # write-only: resumable only if empty
            else:  # non-blocking open: a FIFO with no reader fails at once instead of hanging
                self.fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
                os.set_blocking(self.fd, True)
        except OSError as e:
            why = "a FIFO with no reader" if e.errno == errno.ENXIO else e.strerror
            raise UsageError(f"{path}: cannot write the output file ({why})") from None
        fst = os.fstat(self.fd)
        self.regular = stat.S_ISREG(fst.st_mode)
        if self.regular:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                pid = _lock_holder(fst)
                self.close()
                holder = f" (pid {pid})" if pid else ""
                raise UsageError(f"{path} is being written by another onebit run{holder}; wait for it to "
                                 f"finish or give another --output") from None
            except OSError:
                pass  # a filesystem without locks: run unlocked
        return self

    def close(self) -> None:
        if self.fd >= 0 and self.path != "-":
            os.close(self.fd)
        self.fd = -1

    def __enter__(self) -> "ResultsFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def resume(self) -> set[str]:
        """Ids of the results already in the file. A torn last line (a crash mid-write: no final
        newline, not a whole JSON object) is cut off; any other line that is not a result is
        kept as it is (listed in `unreadable_lines`)."""
        if not self.regular:
            return set()
        size = os.fstat(self.fd).st_size
        if size == 0:
            return set()
        if not self.readable:
            raise OutputError(f"{self.path}: cannot read the results file to resume (permission denied); "
                              f"make it readable or give another --output")
        try:
            data = _pread_all(self.fd, size)
        except OSError as e:
            raise OutputError(f"{self.path}: cannot read the results file to resume ({e.strerror})") from None
        done: set[str] = set()
        lines = data.split(b"\n")
        tail = lines.pop()  # after the last newline: empty, or a line without its newline
        for lineno, line in enumerate(lines, start=1):
            pid = _result_id(line)
            if pid is not None:
                done.add(pid)
            elif line.strip():
                self.unreadable_lines.append(lineno)
        if tail:
            pid = _result_id(tail)
            try:
                if pid is None:  # torn: cut it
                    os.ftruncate(self.fd, len(data) - len(tail))
                else:  # a whole result that lost only its newline
                    done.add(pid)
                    self._write_all(b"\n")
            except OSError as e:
                raise OutputError(f"{self.path}: cannot repair the last line ({e.strerror})") from None
        return done

    def write(self, record: dict[str, Any]) -> None:
        """Append one result line, whole or not at all."""
        line = (json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8")
        if not self.regular:
            if self.path == "-":
                sys.stdout.flush()
            try:
                self._write_all(line)
            except BrokenPipeError:
                if self.path == "-":
                    raise  # stdout piped into `head`: a quiet end, as for any command
                raise OutputError(f"{self.path}: cannot write a result (the reader went away)") from None
            except OSError as e:
                raise OutputError(f"{self.path}: cannot write a result ({e.strerror})") from None
            return
        start = os.fstat(self.fd).st_size  # O_APPEND and the lock: the line goes here
        try:
            n = os.write(self.fd, line)
            if n != len(line):
                raise OSError(errno.ENOSPC, f"only {n} of {len(line)} bytes written: disk full?")
            os.fsync(self.fd)
        except OSError as e:
            try:
                os.ftruncate(self.fd, start)  # no torn line left behind
            except OSError:
                pass  # then the next resume cuts it
            raise OutputError(f"{self.path}: cannot write a result ({e.strerror}); the results before it "
                              f"are kept: rerun the same command to resume") from None

    def _write_all(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(self.fd, view):]


def _pread_all(fd: int, size: int) -> bytes:
    parts, off = [], 0
    while off < size:
        b = os.pread(fd, min(size - off, 1 << 24), off)
        if not b:
            break  # the file shrank under us
        parts.append(b)
        off += len(b)
    return b"".join(parts)


def _result_id(line: bytes) -> Optional[str]:
    try:
        obj = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    if isinstance(obj, dict) and isinstance(obj.get("id"), (str, int)) and not isinstance(obj["id"], bool):
        return str(obj["id"])
    return None


def completed_ids(path: str) -> set[str]:
    """Ids already in an output file (see ResultsFile.resume). A missing file has none."""
    if not os.path.exists(path):
        return set()
    with ResultsFile.open(path) as f:
        return f.resume()


def prompt_seed(seed: Optional[int], pid: str) -> Optional[int]:
    if seed is None:
        return None
    return (seed * 1_000_003 + zlib.crc32(pid.encode())) % (1 << 63)


def prompt_ids(model, item: PromptItem, *, chat: bool, system: Optional[str]) -> list[int]:
    """The prompt's token ids, as `model.generate` would make them."""
    if item.messages is not None:
        return model.chat_tokens(item.messages)
    if chat:
        msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": item.prompt}]
        return model.chat_tokens(msgs)
    return model.tokenize(item.prompt)


def too_long(model, n_prompt: int) -> Optional[str]:
    """Why a prompt of n_prompt tokens leaves no room to generate, or None."""
    ctx = model.context_length
    if n_prompt < ctx:
        return None
    return (f"the prompt is {n_prompt} tokens, which leaves no room to generate in the {ctx}-token context "
            f"(use a larger --ctx or a shorter prompt)")


def generate_one(model, item: PromptItem, *, chat: bool, system: Optional[str], seed: Optional[int],
                 **gen: Any) -> dict[str, Any]:
    """Run one prompt to completion and return its result record; a prompt that does not fit
    the context gives an error record ({id, error, finish_reason: "error", prompt_tokens})."""
    show_reasoning = gen.pop("show_reasoning", False)  # harmony (gpt-oss): keep the analysis channel
    constrain = gen.pop("constrain", None)  # a maker of a fresh logits processor per prompt (a grammar)
    if constrain is not None:
        gen["processors"] = [constrain()]
    ids = prompt_ids(model, item, chat=chat, system=system)
    why = too_long(model, len(ids))
    if why is not None:
        return {"id": item.id, "error": why, "finish_reason": "error", "prompt_tokens": len(ids)}
    pieces, tokens, last = [], [], None
    for r in model.generate(ids, seed=prompt_seed(seed, item.id), **gen):
        pieces.append(r.text)
        if r.token is not None:
            tokens.append(r.token)
        last = r
    text, extra = "".join(pieces), {}
    # harmony's final channel, or the reply after a <think> block; the reasoning kept apart or dropped
    if chat and (splitter := reply_splitter(model, ids)) is not None:
        thinking, text = splitter.feed(text, final=True)
        if show_reasoning:
            extra["reasoning"] = thinking
    return {
        "id": item.id,
        "text": text,
        **extra,
        "tokens": tokens,
        "prompt_tokens": last.prompt_tokens,
        "generation_tokens": last.generation_tokens,
        "finish_reason": last.finish_reason,
        "prompt_seconds": round(last.prompt_time, 4),
        "generation_seconds": round(last.generation_time, 4),
        "prompt_tps": round(last.prompt_tps, 2),
        "generation_tps": round(last.generation_tps, 2),
    }



# -- one batch run ------------------------------------------------------------------------


@dataclass
class BatchRun:
    """The bookkeeping of one batch, whoever generates its prompts (this process, or workers
    on other machines): which prompts still need a result, and writing each result once.

    `pending` yields the prompts not yet in the output, in file order; a bad line is reported
    through `warn` and skipped, or stops the run (`on_error="stop"`). `record` writes a prompt's
    result (one fsynced line) unless its id already has one, so an id is never written twice.
    `tick` is called once per input line dealt with (skipped, already done or written)."""

    results: ResultsFile
    input_name: str
    on_error: str = "skip"
    done: set[str] = field(default_factory=set)
    warn: Callable[[str], None] = lambda msg: print(f"onebit: warning: {msg}", file=sys.stderr)
    tick: Callable[[], None] = lambda: None
    skipped: int = 0  # bad input lines
    errors: int = 0  # error results written

    def pending(self, stream: io.BufferedIOBase, fmt: str = "auto") -> Iterator[PromptItem]:
        for item in read_prompts(stream, fmt, self.input_name):
            if isinstance(item, BadLine):
                self.skipped += 1
                msg = f"{self.input_name}:{item.line}: {item.reason}"
                if self.on_error == "stop":
                    raise PromptFileError(msg + self._stopped())
                self.warn(f"{msg} (skipped)")
                self.tick()
                continue
            if item.id in self.done:
                self.tick()
                continue
            yield item

    def record(self, item: PromptItem, rec: dict[str, Any]) -> bool:
        """Write `rec`, the result of `item`; False (nothing written) if the id has one already."""
        if item.id in self.done:
            return False
        if "error" in rec:
            msg = f"{self.input_name}:{item.line}: id {item.id!r}: {rec['error']}"
            if self.on_error == "stop":
                raise PromptFileError(msg + self._stopped())
            self.errors += 1
            self.warn(f"{msg} (error result written)")
        self.results.write(rec)
        self.done.add(item.id)
        self.tick()
        return True

    def summary(self) -> list[str]:
        """Closing lines for the user: what was skipped, what got error results."""
        lines = []
        if self.skipped:
            lines.append(f"onebit: {self.skipped} input line(s) skipped")
        if self.errors:
            lines.append(f"onebit: {self.errors} prompt(s) got an error result (see above; a rerun skips them: "
                         f"delete their lines to retry them)")
        return lines

    def _stopped(self) -> str:
        return f" (stopped; results so far are in {self.results.path})"
