#!/usr/bin/env python3
"""Mutation fuzzer: corrupt real fixture GGUF files and check that onebit fails cleanly.

Each case takes one fixture from tests/fixtures/, applies one to three mutations (byte
flips in the header or the tensor data, truncation, tensor offset / type / dimension edits,
metadata value and array-length edits; with --types, metadata values of another value type), and hands the file to a worker process that loads
it as `onebit.load` does and, when it loads, tokenizes, runs a short prefill and decodes two
tokens, and computes `onebit info` and `onebit plan`. A case passes when that ends normally
or with an `OnebitError` (the one-line error the CLI prints). It fails on any other
exception (the CLI's `internal error`), an escaped warning (with numpy RuntimeWarnings: the
user's terminal), a crash (signal), a hang (per-case timeout), or memory out of proportion
(tracemalloc peak per case, and an address-space limit on the worker).

    python tools/fuzz_gguf.py                 # 300 cases (the CI run: tests/test_fuzz_mutation.py)
    python tools/fuzz_gguf.py --long          # 10,000 cases
    python tools/fuzz_gguf.py --cases 50 --seed 7 --fixture qwen3moe-f32
    python tools/fuzz_gguf.py --case 1234 --keep DIR    # redo one case, keep its file
    python tools/fuzz_gguf.py --types --cases 500   # metadata values given other GGUF value types
    python tools/fuzz_gguf.py --hostile       # hostile header shapes at the issue's sizes (issue 36)
    python tools/fuzz_gguf.py --templates 3000 --seed 1 # random chat templates in the bounded worker

Cases are numbered; case i of a seed is always the same mutation, so a failure can be
replayed with --case. Exit 0 when every case passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import select
import signal
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures"
DEFAULT_FIXTURES = ["qwen3moe-f32", "qwen2moe-f32", "olmoe-f32", "llama-f32", "mixtral-f32", "qwen3-f32",
                    "qwen2-f32", "gemma3-f32", "llama3rope-f32", "q3moe256-Q4_K_M", "q3moe256-Q8_0",
                    "q3moe256-TQ1_0", "q3moe256-MXFP4_MOE", "q3moe256-Q5_0", "q3moe256-IQ2_XS", "q3moe256-IQ4_NL"]
CASE_TIMEOUT = 30.0  # seconds; a healthy case takes well under one
PEAK_LIMIT = 256 << 20  # tracemalloc peak per case (fixtures are at most a few MB)
AS_LIMIT = 8 << 30  # address space of the worker: a backstop against a runaway allocation

# GGUF value types with a fixed size (id -> struct format); 8 = string, 9 = array.
_FMT = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<B", 10: "<Q", 11: "<q", 12: "<d"}
_INT_EDGES = [0, 1, 2, 3, 7, 100000, 2**31 - 1, 2**31, 2**32 - 1]
_FLOAT_EDGES = [0.0, -0.0, -1.0, 1.0, 1e-45, 1e30, 1e38, float("nan"), float("inf"), float("-inf")]


_ERR_SHAPE = re.compile(r"'[^']*'|\b\d[\d.e+-]*\b|\[[^\]]*\]")

# -- where things are in a GGUF header ------------------------------------------------------


@dataclass
class KV:
    key: str
    vtype: int
    pos: int  # where the value starts (for an array: its element type)
    etype: int = -1  # array element type
    count_pos: int = -1  # array length field
    end: int = -1  # where the value ends


@dataclass
class TensorInfo:
    name: str
    dims_pos: int
    n_dims: int
    type_pos: int
    offset_pos: int
    dims: list[int] = field(default_factory=list)
    offset: int = 0


@dataclass
class Layout:
    kvs: list[KV]
    tensors: list[TensorInfo]
    header_end: int
    data_start: int
    alignment: int


def layout(buf: bytes) -> Layout:
    """Positions of every metadata value and tensor-info field of a well-formed GGUF file."""
    pos = 8
    n_tensors, n_kv = struct.unpack_from("<QQ", buf, pos)
    pos += 16
    kvs, alignment = [], 32

    def skip_value(vtype: int, pos: int) -> int:
        if vtype in _FMT:
            return pos + struct.calcsize(_FMT[vtype])
        if vtype == 8:
            (n,) = struct.unpack_from("<Q", buf, pos)
            return pos + 8 + n
        etype, count = struct.unpack_from("<IQ", buf, pos)
        pos += 12
        for _ in range(count):
            pos = skip_value(etype, pos)
        return pos

    for _ in range(n_kv):
        (n,) = struct.unpack_from("<Q", buf, pos)
        key = buf[pos + 8 : pos + 8 + n].decode("utf-8", "replace")
        pos += 8 + n
        (vtype,) = struct.unpack_from("<I", buf, pos)
        pos += 4
        kv = KV(key, vtype, pos)
        if vtype == 9:
            kv.etype = struct.unpack_from("<I", buf, pos)[0]
            kv.count_pos = pos + 4
        if key == "general.alignment":
            alignment = struct.unpack_from("<I", buf, pos)[0]
        kvs.append(kv)
        pos = skip_value(vtype, pos)
        kv.end = pos
    tensors = []
    for _ in range(n_tensors):
        (n,) = struct.unpack_from("<Q", buf, pos)
        name = buf[pos + 8 : pos + 8 + n].decode("utf-8", "replace")
        pos += 8 + n
        (n_dims,) = struct.unpack_from("<I", buf, pos)
        dims = list(struct.unpack_from(f"<{n_dims}Q", buf, pos + 4))
        t = TensorInfo(name, pos + 4, n_dims, pos + 4 + 8 * n_dims, pos + 8 + 8 * n_dims, dims)
        t.offset = struct.unpack_from("<Q", buf, t.offset_pos)[0]
        tensors.append(t)
        pos = t.offset_pos + 8
    data_start = (pos + alignment - 1) // alignment * alignment
    return Layout(kvs, tensors, pos, data_start, alignment)


# -- mutations -------------------------------------------------------------------------------


def _put(buf: bytearray, pos: int, fmt: str, value) -> None:
    """Write value at pos if it fits there (in the buffer, and in the field's type: an edge
    value too wide for a small integer field is skipped)."""
    if 0 <= pos and pos + struct.calcsize(fmt) <= len(buf):
        try:
            struct.pack_into(fmt, buf, pos, value)
        except struct.error:
            pass


def mutate(data: bytes, lay: Layout, rng: random.Random) -> tuple[bytes, list[str]]:
    """One to three mutations of a fixture's bytes; returns the bytes and what was done."""
    buf = bytearray(data)
    done = []
    numeric = [kv for kv in lay.kvs if kv.vtype in _FMT]
    arrays = [kv for kv in lay.kvs if kv.vtype == 9]
    for _ in range(rng.choice([1, 1, 1, 2, 3])):
        kind = rng.choice(["meta", "meta", "meta", "offset", "offset", "type", "type", "dim", "header_byte",
                           "header_byte", "data_byte", "data_byte", "truncate", "count", "swap_offsets"])
        if kind == "meta" and numeric:
            kv = rng.choice(numeric)
            fmt = _FMT[kv.vtype]
            if fmt in ("<f", "<d"):
                v = rng.choice(_FLOAT_EDGES + [rng.uniform(-10, 10)])
            elif kv.pos + struct.calcsize(fmt) > len(buf):  # truncated by an earlier mutation
                continue
            else:
                (cur,) = struct.unpack_from(fmt, buf, kv.pos)
                bits = 8 * struct.calcsize(fmt)
                v = rng.choice(_INT_EDGES + [cur - 1, cur + 1, cur * 2, cur // 2, rng.randrange(0, 64)])
                v &= (1 << bits) - 1
                if fmt[1].islower() and v >= 1 << (bits - 1):
                    v -= 1 << bits
            _put(buf, kv.pos, fmt, v)
            done.append(f"meta {kv.key}={v!r}")
        elif kind == "count" and arrays:
            kv = rng.choice(arrays)
            if kv.count_pos + 8 > len(buf):
                continue
            (cur,) = struct.unpack_from("<Q", buf, kv.count_pos)
            v = rng.choice([0, 1, cur - 1, cur + 1, cur * 2, 2**32, 2**63, 2**64 - 1])
            _put(buf, kv.count_pos, "<Q", v)
            done.append(f"count {kv.key}={v}")
        elif kind == "offset" and lay.tensors:
            t = rng.choice(lay.tensors)
            other = rng.choice(lay.tensors)
            a = lay.alignment
            v = rng.choice([0, other.offset, t.offset + a, max(t.offset - a, 0), t.offset + 1,
                            rng.randrange(0, max(len(buf) - lay.data_start, 1)) // a * a, 2**40, 2**64 - a])
            _put(buf, t.offset_pos, "<Q", v)
            done.append(f"offset {t.name}={v}")
        elif kind == "swap_offsets" and len(lay.tensors) > 1:
            t, u = rng.sample(lay.tensors, 2)
            _put(buf, t.offset_pos, "<Q", u.offset)
            _put(buf, u.offset_pos, "<Q", t.offset)
            done.append(f"swap offsets {t.name} {u.name}")
        elif kind == "type" and lay.tensors:
            t = rng.choice(lay.tensors)
            v = rng.choice([0, 1, 2, 3, 6, 7, 8, 10, 11, 12, 13, 14, 30, 34, 35, 39, 40, 41, 23, 99, 2**32 - 1])
            _put(buf, t.type_pos, "<I", v)
            done.append(f"type {t.name}={v}")
        elif kind == "dim" and lay.tensors:
            t = rng.choice(lay.tensors)
            i = rng.randrange(t.n_dims)
            d = t.dims[i]
            v = rng.choice([0, 1, d - 1, d + 1, d * 2, d // 2, 2**32, 2**63])
            _put(buf, t.dims_pos + 8 * i, "<Q", max(v, 0))
            done.append(f"dim {t.name}[{i}]={v}")
        elif kind == "header_byte":
            i = rng.randrange(min(lay.header_end, len(buf)))
            v = rng.randrange(256)
            buf[i] = v
            done.append(f"byte {i}={v}")
        elif kind == "data_byte" and len(buf) > lay.data_start:
            i = rng.randrange(lay.data_start, len(buf))
            v = rng.choice([0xFF, 0x7F, 0x80, rng.randrange(256)])  # exponent bits: inf / NaN floats
            for j in range(i, min(i + rng.choice([1, 4, 64]), len(buf))):
                buf[j] = v
            done.append(f"data {i}={v:#x}")
        elif kind == "truncate":
            n = rng.choice([rng.randrange(lay.header_end + 1), rng.randrange(len(buf)), len(buf) - 1])
            del buf[n:]
            done.append(f"truncate {n}")
    return bytes(buf), done


def _typed_value(vtype: int, rng: random.Random, etype: int = -1) -> bytes:
    """A well-formed value of GGUF type `vtype` (an array: of `etype`, 0-3 elements)."""
    if vtype == 8:
        return _gguf_str(rng.choice([b"", b"x", b"qwen2", b"<s>"]))
    if vtype == 9:
        etype = etype if etype >= 0 else rng.choice([4, 5, 6, 7, 8])
        n = rng.randrange(4)
        return struct.pack("<IQ", etype, n) + b"".join(_typed_value(etype, rng) for _ in range(n))
    fmt = _FMT[vtype]
    if fmt in ("<f", "<d"):
        return struct.pack(fmt, rng.choice(_FLOAT_EDGES))
    bits = 8 * struct.calcsize(fmt)
    v = rng.choice([0, 1, 2, 100]) if vtype != 7 else rng.randrange(2)
    return struct.pack(fmt, v & ((1 << bits) - 1))


def retype(data: bytes, lay: Layout, rng: random.Random) -> tuple[bytes, list[str]]:
    """One or two metadata values given another GGUF value type (a well-formed value of it: a
    u32 where strings were, a string where a token id was, an array of bools ...), the tensor
    data kept where the header's new length puts it. Keys the loader reads are picked most."""
    read = [kv for kv in lay.kvs if kv.key.startswith(("tokenizer.", "general.architecture"))
            or kv.key.endswith(("context_length", "block_count", "embedding_length", "expert_count",
                                "expert_used_count", "head_count", "head_count_kv"))]
    done = []
    chosen = {}
    for _ in range(rng.choice([1, 1, 2])):
        kv = rng.choice(read if read and rng.random() < 0.8 else lay.kvs)
        if kv.key == "general.alignment":
            continue
        types = [t for t in (0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12) if t != kv.vtype]
        vtype = rng.choice(types)
        etype = -1
        if vtype == 9 or (kv.vtype == 9 and rng.random() < 0.5):  # an array of another element type
            vtype = 9
            etype = rng.choice([t for t in (0, 4, 5, 6, 7, 8, 10, 12) if t != kv.etype])
        chosen[kv.pos] = (kv, struct.pack("<I", vtype) + _typed_value(vtype, rng, etype))
        done.append(f"retype {kv.key}: {kv.vtype}{f'[{kv.etype}]' if kv.vtype == 9 else ''} -> "
                    f"{vtype}{f'[{etype}]' if vtype == 9 else ''}")
    out, at = bytearray(), 0
    for pos in sorted(chosen):
        kv, value = chosen[pos]
        out += data[at : kv.pos - 4] + value  # (the type field sits just before the value)
        at = kv.end
    out += data[at : lay.header_end]
    out += bytes(-len(out) % lay.alignment)  # tensor offsets count from the aligned end of the header
    out += data[lay.data_start :]
    return bytes(out), done


# -- hostile headers: well-formed files whose counts ask for time or memory ------------------

HOSTILE_SHAPES = ("nested_empty_arrays", "empty_array_keys", "empty_strings", "one_element_tensors",
                  "vocab_count", "long_string")


def _gguf_str(s: bytes) -> bytes:
    return struct.pack("<Q", len(s)) + s


def hostile_header(shape: str, n: int) -> bytes:
    """A GGUF file (version 3) of one hostile shape at size n:
    nested_empty_arrays  one key holding an array of n empty arrays (12 bytes each)
    empty_array_keys     n keys, each an empty uint8 array
    empty_strings        one key holding an array of n empty strings (8 bytes each)
    one_element_tensors  n F32 tensors of one element each (the header and 32 bytes of data each)
    vocab_count          a 4-token vocabulary whose array claims n tokens
    long_string          one metadata string of n bytes"""
    kv, tensors, data = [], [], b""
    if shape == "nested_empty_arrays":
        kv.append(_gguf_str(b"hostile.nested") + struct.pack("<IIQ", 9, 9, n) + struct.pack("<IQ", 0, 0) * n)
    elif shape == "empty_array_keys":
        kv.extend(_gguf_str(b"k%d" % i) + struct.pack("<IIQ", 9, 0, 0) for i in range(n))
    elif shape == "empty_strings":
        kv.append(_gguf_str(b"hostile.strings") + struct.pack("<IIQ", 9, 8, n) + struct.pack("<Q", 0) * n)
    elif shape == "one_element_tensors":
        tensors.extend(_gguf_str(b"t%d" % i) + struct.pack("<IQIQ", 1, 1, 0, 32 * i) for i in range(n))
        data = bytes(32 * n)
    elif shape == "vocab_count":
        kv.append(_gguf_str(b"tokenizer.ggml.tokens") + struct.pack("<IIQ", 9, 8, n)
                  + b"".join(_gguf_str(t) for t in (b"a", b"b", b"c", b"d")))
    elif shape == "long_string":
        kv.append(_gguf_str(b"general.description") + struct.pack("<I", 8) + _gguf_str(b"x" * n))
    else:
        raise ValueError(f"unknown hostile shape {shape!r}")
    head = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(kv)) + b"".join(kv) + b"".join(tensors)
    return head + bytes(-len(head) % 32) + data


def check_header(path: str, traced: bool = True) -> tuple[str, str, int]:
    """(status, detail, peak traced bytes) of parsing one file's header as the loader does
    (traced=False: without tracemalloc, which slows the parser's loops several times; peak 0)."""
    import tracemalloc

    from onebit.errors import OnebitError
    from onebit.formats.gguf_file import GGUFFile

    if traced:
        tracemalloc.start()
    try:
        GGUFFile(path)
        result = ("ok", "")
    except OnebitError as e:
        result = ("error", str(e))
    peak = 0
    if traced:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    return (*result, peak)


def hostile_run(sizes: list[tuple[str, int]] | None = None, log=print) -> list[dict]:
    """Each hostile shape at the issue's sizes and just under the parser's bounds, parsed in a
    fresh process: its verdict, the parse's wall time, its tracemalloc peak and the process's
    peak RSS beyond the interpreter's."""
    sizes = sizes or HOSTILE_SIZES
    rows = []
    with tempfile.TemporaryDirectory(prefix="onebit-hostile-") as tmp:
        for shape, n in sizes:
            path = os.path.join(tmp, f"{shape}.gguf")
            with open(path, "wb") as f:
                f.write(hostile_header(shape, n))
            # VmHWM, not ru_maxrss: the latter keeps the parent's peak across fork + exec
            code = ("import json, re, sys, time; sys.path.insert(0, sys.argv[2]); import fuzz_gguf; "
                    "import onebit.formats.gguf_file; hwm = lambda: int(re.search(r'VmHWM:\\s+(\\d+)', "
                    "open('/proc/self/status').read()).group(1)); base = hwm(); "
                    "t = time.perf_counter(); st, d, _ = fuzz_gguf.check_header(sys.argv[1], traced=False); "
                    "dt = time.perf_counter() - t; rss = hwm() - base; "
                    "_, _, peak = fuzz_gguf.check_header(sys.argv[1]); "
                    "print(json.dumps([st, d, peak, dt, rss * 1024]))")
            env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
            r = subprocess.run([sys.executable, "-c", code, path, str(ROOT / "tools")], capture_output=True,
                               text=True, env=env, timeout=600)
            if r.returncode != 0:
                row = {"shape": shape, "n": n, "status": "fail", "detail": r.stderr[-2000:]}
            else:
                st, detail, peak, dt, rss = json.loads(r.stdout)
                row = {"shape": shape, "n": n, "file_mib": round(os.path.getsize(path) / 2**20, 1), "status": st,
                       "detail": detail.replace(path, "FILE"), "seconds": round(dt, 3),
                       "traced_peak_mib": round(peak / 2**20, 2), "rss_growth_mib": round(rss / 2**20, 1)}
            os.remove(path)
            rows.append(row)
            if log:
                log(json.dumps(row))
    return rows


# The sizes (8 million empty arrays: 96 MB; 1 million one-element tensors), the other
# shapes at comparable file sizes, then each shape at the largest size the parser accepts.
HOSTILE_SIZES = [("nested_empty_arrays", 8_000_000), ("empty_array_keys", 1_000_000), ("empty_strings", 8_000_000),
                 ("one_element_tensors", 1_000_000), ("vocab_count", 1 << 62), ("long_string", 100_000_000),
                 ("nested_empty_arrays", (1 << 19) // 4), ("empty_array_keys", 1 << 14), ("empty_strings", 1 << 19),
                 ("one_element_tensors", 1 << 15), ("long_string", (32 << 20) - 64)]


# -- the template fuzzer: random compositions of filters and loops -----------------------------

_T_VALUES = ["'x' * {n}", "[0] * {n}", "range({k}) | list", "messages", "messages | map(attribute='content') | list",
             "'%s-' * {k}", "[{n}]", "'abc'", "(messages | tojson)", "[[1, 2]] * {k}", "'a b c d ' * {k}",
             "namespace(s='y')", "[messages] * {k}", "{{'k': 'v' * {k}}}", "['x' * {n}] * {k}",
             "[[0] * {n}] * {k}"]
_T_FILTERS = ["join", "join(' ')", "sum(start=[])", "sum", "list", "sort", "unique | list", "reverse | list",
              "map('string') | list", "map('upper') | list", "tojson", "string", "length", "center({n})",
              "indent({k})", "replace('x', 'xx')", "replace('a', 'aaaa')", "batch({k}) | list", "slice({k}) | list",
              "format(*([1] * {k}))", "wordwrap({k})", "title", "trim", "first", "last", "upper", "int",
              "default('d')", "count", "dictsort", "truncate({k})", "striptags", "urlencode", "wordcount",
              "select | list", "reject | list", "groupby(0) | list", "min", "max", "items | list"]
_T_OPS = ["{a} * {k}", "{a} + {a}", "{a} ~ {a}", "({a}) * ({a})", "'%s' % ({a},)", "{a} * {n}"]


def _t_expr(rng: random.Random, depth: int) -> str:
    n = rng.choice([1, 10, 1000, 100_000, 1_000_000, 10 ** 7, 10 ** 9])
    k = rng.choice([0, 1, 2, 7, 64, 1000, 100_000])
    if depth <= 0 or rng.random() < 0.3:
        return "(" + rng.choice(_T_VALUES).format(n=n, k=k) + ")"
    if rng.random() < 0.6:
        return f"({_t_expr(rng, depth - 1)} | {rng.choice(_T_FILTERS).format(n=n, k=k)})"
    a = _t_expr(rng, depth - 1)
    return "(" + rng.choice(_T_OPS).format(a=a, n=n, k=k) + ")"


def random_template(rng: random.Random) -> str:
    """A random composition of filters, operators and (nested) loops that grow a namespace."""
    body = []
    for _ in range(rng.randint(1, 3)):
        expr = _t_expr(rng, rng.randint(1, 4))
        kind = rng.random()
        if kind < 0.4:
            body.append("{{ " + expr + " }}")
        elif kind < 0.8:
            k = rng.choice([2, 10, 40, 1000, 100_000])
            inner = "{% set ns.s = ns.s ~ " + expr + " %}" if rng.random() < 0.5 else "{{ " + expr + " }}"
            if rng.random() < 0.3:
                inner = "{% for j in range(" + str(rng.choice([2, 100, 10_000])) + ") %}" + inner + "{% endfor %}"
            body.append("{% for i in range(" + str(k) + ") %}" + inner + "{% endfor %}")
        else:
            body.append("{% set ns.s = " + expr + " %}{{ ns.s | length }}")
    return "{% set ns = namespace(s='') %}" + "".join(body) + "{{ messages[0]['content'] }}"


def template_run(cases: range, seed: int, timeout_s: float = 2.0, log=print) -> dict:
    """Render random templates; a case passes with text or one TemplateError line naming the
    source. Counts the verdicts by kind, and samples this (the caller's) process's RSS."""
    import psutil

    from onebit.chat_formats import chat_template as ct
    from onebit.errors import TemplateError

    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    kinds: dict[str, int] = {}
    failures = []
    proc = psutil.Process()
    rss0 = None
    t0 = time.perf_counter()
    for i in cases:
        tpl = random_template(random.Random(f"tpl:{seed}:{i}"))
        try:
            ct.render_chat(tpl, msgs, source="fuzz.gguf", timeout_s=timeout_s)
            kind = "rendered"
        except TemplateError as e:
            msg = str(e)
            if not msg.startswith("fuzz.gguf: ") or "\n" in msg:
                failures.append({"case": i, "template": tpl, "detail": msg[:500]})
                kind = "fail"
            elif "of memory" in msg:
                kind = "memory limit"
            elif "did not finish" in msg:
                kind = "time limit"
            elif "too large" in msg or "computed width" in msg:
                kind = "growth cap"
            else:
                kind = "other template error"
        except BaseException as e:  # noqa: BLE001 - what the fuzzer looks for
            if isinstance(e, KeyboardInterrupt):
                raise
            failures.append({"case": i, "template": tpl, "detail": f"{type(e).__name__}: {e}"[:500]})
            kind = "fail"
        kinds[kind] = kinds.get(kind, 0) + 1
        if i == cases.start + min(50, len(cases) - 1):
            rss0 = proc.memory_info().rss
        if log and (i - cases.start + 1) % 500 == 0:
            log(f"  {i - cases.start + 1} templates: {kinds}")
    rss1 = proc.memory_info().rss
    return {"cases": len(cases), "seed": seed, "kinds": kinds, "failures": failures,
            "seconds": round(time.perf_counter() - t0, 1), "workers_started": ct._WORKER.started,
            "caller_rss_mib": [round((rss0 or rss1) / 2**20, 1), round(rss1 / 2**20, 1)]}


# -- the worker: load + short forward, in a process of its own --------------------------------


def check_file(path: str) -> tuple[str, str]:
    """('ok' | 'error' | 'fail', detail) for one file, as the CLI would see it."""
    import traceback
    import tracemalloc
    import warnings

    import numpy as np

    import onebit
    from onebit.errors import OnebitError
    from onebit.apps.info import model_info
    from onebit.memory.budget import Budget
    from onebit.memory.plan import make_plan

    tracemalloc.start()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # an escaped warning is a failure
            m = onebit.load(path)
            try:
                model_info(m.gguf, m.cfg)
                make_plan(m.gguf, m.cfg, Budget(1 << 30, "fuzz", 1 << 30), ctx=min(64, m.cfg.context_length))
                ids = m.tokenize("Hello world, fuzz!")[:4]
                m.detokenize(ids)
                if not ids:
                    ids = [0]
                for _ in m.generate(ids, max_tokens=2, temperature=0.0):
                    pass
                logits = m.logits(np.asarray(ids[:2]))
                if logits.shape != (len(ids[:2]), m.cfg.vocab_size) or not np.isfinite(logits).all():
                    raise AssertionError(f"logits of shape {logits.shape} (finite: {np.isfinite(logits).all()})")
            finally:
                m.close()
        result = ("ok", "")
    except OnebitError as e:
        msg = str(e)
        result = ("error", msg) if msg.strip() else ("fail", f"{type(e).__name__} with an empty message")
    except BaseException as e:  # noqa: BLE001 - anything else is what the fuzzer looks for
        if isinstance(e, KeyboardInterrupt):
            raise
        result = ("fail", "".join(traceback.format_exception(e))[-3000:])
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    if peak > PEAK_LIMIT:
        result = ("fail", f"peak traced memory {peak >> 20} MiB (limit {PEAK_LIMIT >> 20} MiB); was {result[0]}")
    return result


def worker() -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (AS_LIMIT, AS_LIMIT))
    sys.path.insert(0, str(ROOT))
    out = sys.stdout
    sys.stdout = sys.stderr  # nothing but results on the pipe
    out.write("ready\n")
    out.flush()
    for line in sys.stdin:
        req = json.loads(line)
        status, detail = check_file(req["path"])
        out.write(json.dumps({"case": req["case"], "status": status, "detail": detail}) + "\n")
        out.flush()


class Worker:
    """A worker process; restarted after a crash or a hang."""

    def __init__(self):
        self.p = None

    def start(self) -> None:
        env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1",
                   PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
        self.p = subprocess.Popen([sys.executable, __file__, "--worker"], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
        if self._readline(120.0) != "ready":
            raise RuntimeError("fuzz worker did not start")

    def _readline(self, timeout: float):
        r, _, _ = select.select([self.p.stdout], [], [], timeout)
        if not r:
            return None
        line = self.p.stdout.readline()
        return line.strip() if line else ""

    def run(self, case: int, path: str) -> tuple[str, str]:
        if self.p is None or self.p.poll() is not None:
            self.start()
        self.p.stdin.write(json.dumps({"case": case, "path": path}) + "\n")
        self.p.stdin.flush()
        line = self._readline(CASE_TIMEOUT)
        if line is None:
            self.stop()
            return "fail", f"hang: no result in {CASE_TIMEOUT:.0f} s"
        if not line:
            rc = self.p.wait()
            self.p = None
            how = f"signal {signal.Signals(-rc).name}" if rc < 0 else f"exit {rc}"
            return "fail", f"worker died ({how})"
        res = json.loads(line)
        return res["status"], res["detail"]

    def stop(self) -> None:
        if self.p is not None:
            self.p.kill()
            self.p.wait()
            self.p = None


def case_file(case: int, seed: int, fixtures: list[str], cache: dict,
              types: bool = False) -> tuple[str, bytes, list[str]]:
    rng = random.Random(f"{seed}:{case}" + (":types" if types else ""))
    name = rng.choice(fixtures)
    if name not in cache:
        data = (FIXTURES / f"{name}.gguf").read_bytes()
        cache[name] = (data, layout(data))
    data, lay = cache[name]
    out, done = (retype if types else mutate)(data, lay, rng)
    return name, out, done


def run(cases: range, seed: int, fixtures: list[str], keep: str | None = None, log=print,
        types: bool = False) -> dict:
    """Run the cases; returns counts and the failures."""
    counts = {"ok": 0, "error": 0, "fail": 0}
    failures = []
    kinds: dict[str, int] = {}  # clean errors by message shape
    cache: dict = {}
    w = Worker()
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="onebit-fuzz-") as tmp:
        path = os.path.join(keep or tmp, "case.gguf")
        try:
            for i in cases:
                name, data, done = case_file(i, seed, fixtures, cache, types)
                if keep:
                    path = os.path.join(keep, f"case-{i}.gguf")
                with open(path, "wb") as f:
                    f.write(data)
                status, detail = w.run(i, path)
                counts[status] += 1
                if status == "error":
                    kind = _ERR_SHAPE.sub("#", detail.replace(path, "FILE"))[:90]
                    kinds[kind] = kinds.get(kind, 0) + 1
                if status == "fail":
                    failures.append({"case": i, "fixture": name, "mutations": done, "detail": detail})
                    last = detail.strip().splitlines()[-1] if detail.strip() else ""
                    log(f"FAIL case {i} ({name}: {'; '.join(done)}): {last}")
        finally:
            w.stop()
    top = dict(sorted(kinds.items(), key=lambda kv: -kv[1]))
    return {"cases": len(cases), "seed": seed, "counts": counts, "failures": failures,
            "seconds": round(time.perf_counter() - t0, 1), "errors": top}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", type=int, default=300)
    ap.add_argument("--long", action="store_true", help="10,000 cases")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--start", type=int, default=0, help="first case number")
    ap.add_argument("--case", type=int, help="run this one case only")
    ap.add_argument("--fixture", action="append", help="fixture name (repeatable; default: a mix)")
    ap.add_argument("--keep", help="write each case's file into this folder and keep it")
    ap.add_argument("--json", help="write the summary (with every failure) to this file")
    ap.add_argument("-v", "--verbose", action="store_true", help="print the clean errors by kind")
    ap.add_argument("--types", action="store_true", help="mutate metadata value types, not values")
    ap.add_argument("--hostile", action="store_true", help="parse the hostile header shapes at the issue's sizes")
    ap.add_argument("--templates", type=int, metavar="N", help="render N random templates instead")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        worker()
        return 0
    if a.hostile:
        rows = hostile_run()
        if a.json:
            Path(a.json).write_text(json.dumps(rows, indent=2) + "\n")
        return 1 if any(r["status"] == "fail" or r.get("traced_peak_mib", 0) > 100 for r in rows) else 0
    if a.templates:
        sys.path.insert(0, str(ROOT))
        res = template_run(range(a.start, a.start + a.templates), a.seed)
        print(f"{res['cases']} templates (seed {a.seed}) in {res['seconds']} s: {res['kinds']}; worker processes "
              f"started {res['workers_started']}; caller RSS {res['caller_rss_mib']} MiB")
        for f in res["failures"][:10]:
            print("FAIL", json.dumps(f))
        if a.json:
            Path(a.json).write_text(json.dumps(res, indent=2) + "\n")
        return 1 if res["failures"] else 0
    fixtures = a.fixture or DEFAULT_FIXTURES
    if a.case is not None:
        cases = range(a.case, a.case + 1)
    else:
        cases = range(a.start, a.start + (10_000 if a.long else a.cases))
    res = run(cases, a.seed, fixtures, a.keep, types=a.types)
    c = res["counts"]
    print(f"{res['cases']} cases (seed {a.seed}) in {res['seconds']} s: {c['ok']} loaded and ran, "
          f"{c['error']} clean errors, {c['fail']} failures")
    if a.verbose:
        for kind, n in res["errors"].items():
            print(f"{n:6d}  {kind}")
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=2) + "\n")
    return 1 if c["fail"] else 0


if __name__ == "__main__":
    sys.exit(main())
