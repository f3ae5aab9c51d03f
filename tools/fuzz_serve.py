#!/usr/bin/env python3
"""Request fuzzer for `onebit serve`: hostile requests on loopback while a second client checks
the server stays answered and correct.

Each case is one request drawn from a seeded generator: malformed or truncated JSON, bodies of
the wrong shape, fields of the wrong type, oversized bodies (by Content-Length or chunked),
bodies or headers sent slowly and abandoned, hostile JSON schemas and tools, control characters
in model names, sampling edges. A case passes when the server answers it with a status below
500 or 503 (or closes a connection it was right to close). All the while a second client asks
one fixed greedy question and must get the reply it got alone; its worst latency is reported
(never asserted: the machine may be loaded).

    python tools/fuzz_serve.py --url http://127.0.0.1:8080 --cases 500 --seed 1

(against a server started with `onebit serve --temp 0 ...`; tests/test_serve_fuzz.py runs a
short one in process).
"""

from __future__ import annotations

import argparse
import json
import random
import re
import socket
import sys
import threading
import time
from http.client import HTTPConnection

WAIT_S = 120  # a socket's hang guard
CUT_SHORT = 599  # a structured reply that is not JSON yet says it stopped: counted as a failure
CHECK = {"messages": [{"role": "user", "content": "What is two plus two?"}], "max_tokens": 4, "temperature": 0}
SCHEMAS = [
    {"$ref": "#"},
    {"$defs": {"A": {"$ref": "#/$defs/B"}, "B": {"$ref": "#/$defs/A"}}, "$ref": "#/$defs/A"},
    {"type": "object", "properties": {"a": {"type": "string", "pattern": "^(a{1000}){1000}$"}}, "required": ["a"]},
    {"anyOf": [{"type": "object", "properties": {f"k{i}": {"const": i}}, "required": [f"k{i}"]} for i in range(3000)]},
    {"type": "nonsense"},
    {"type": "object", "properties": {"n": {"type": "integer", "minimum": 5, "maximum": 1}}},
    {"type": "array", "items": {"$ref": "#/items"}},
]


def _host(url: str) -> tuple[str, int]:
    m = re.match(r"http://([^:/]+):(\d+)", url)
    return m.group(1), int(m.group(2))


def request(url: str, method: str, path: str, body: bytes | None, headers: dict | None = None,
            chunked: bool = False, structured: bool = False) -> int:
    """The status of one request (0: the server closed the connection). `structured`: a 200
    must hold JSON unless cut by max_tokens (else CUT_SHORT: a constraint that gave up quietly)."""
    host, port = _host(url)
    conn = HTTPConnection(host, port, timeout=WAIT_S)
    try:
        if chunked:
            parts = [body[i : i + 4096] for i in range(0, len(body), 4096)]
            conn.request(method, path, body=iter(parts), headers={"Content-Type": "application/json", **(headers or {})},
                         encode_chunked=True)
        else:
            conn.request(method, path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
        r = conn.getresponse()
        data = r.read()
        if structured and r.status == 200:
            choice = json.loads(data)["choices"][0]
            try:
                json.loads(choice["message"]["content"] or "")
            except ValueError:
                if choice["finish_reason"] == "stop":
                    return CUT_SHORT
        return r.status
    except (ConnectionError, BrokenPipeError):
        return 0  # closed by the server (an oversized body may be cut off while it is sent)
    finally:
        conn.close()


def _chat(**kw) -> bytes:
    return json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **kw}).encode()


def case(rng: random.Random, url: str, max_body: int) -> tuple[str, int]:
    """Send one hostile request; (what it was, the status: 0 = connection closed by the server)."""
    kind = rng.choice(["bad_json", "shape", "types", "oversized", "chunked", "slow_body", "slow_head",
                       "schema", "tools", "name", "sampling", "big_prompt", "many_messages"])
    p = "/v1/chat/completions"
    if kind == "bad_json":
        body = rng.choice([b"{", b"{not json", b"[1,2", b"\xff\xfe", b"", b"null", b'{"messages": [{"role": "user"']).ljust(0)
        return kind, request(url, "POST", p, body)
    if kind == "shape":
        body = json.dumps(rng.choice([[1, 2], "x", 5, {"messages": {}}, {"messages": [5]}, {"prompt": {}}])).encode()
        return kind, request(url, "POST", rng.choice([p, "/v1/completions"]), body)
    if kind == "types":
        field, value = rng.choice([("temperature", "hot"), ("max_tokens", -5), ("stop", 7), ("seed", "x"),
                                   ("logit_bias", {"x": 1}), ("tool_choice", {"type": "function", "function": "x"}),
                                   ("response_format", {"type": "json_schema"}), ("n", 3), ("top_p", 0)])
        return kind, request(url, "POST", p, _chat(**{field: value}))
    if kind in ("oversized", "chunked"):
        body = _chat(model="x" * (max_body + rng.randrange(1, 4096)))
        return kind, request(url, "POST", p, body, chunked=kind == "chunked")
    if kind in ("slow_body", "slow_head"):
        host, port = _host(url)
        s = socket.create_connection((host, port), timeout=WAIT_S)
        try:
            if kind == "slow_head":
                s.sendall(b"POST " + p.encode() + b" HTTP/1.1\r\nHost: x\r\n")
            else:
                s.sendall(b"POST " + p.encode() + b" HTTP/1.1\r\nHost: x\r\nContent-Length: 500\r\n\r\n{\"mess")
            time.sleep(rng.uniform(0, 0.2))
        finally:
            s.close()  # abandoned: the server must drop it and go on
        return kind, 0
    if kind == "schema":
        schema = rng.choice(SCHEMAS)
        return kind, request(url, "POST", p, _chat(response_format={"type": "json_schema",
                                                                    "json_schema": {"name": "x", "schema": schema}}),
                             structured=True)
    if kind == "tools":
        params = rng.choice(SCHEMAS + [{"type": "object"}])
        tool = {"type": "function", "function": {"name": "f", "parameters": params}}
        return kind, request(url, "POST", p, _chat(tools=[tool], tool_choice=rng.choice(
            ["required", {"type": "function", "function": {"name": "f"}}, "auto"])))
    if kind == "name":
        name = rng.choice(["x\nonebit serve: FORGED", "\x1b[31mred", "../../etc/passwd", "/etc/passwd", "a" * 5000, ""])
        return kind, request(url, "POST", p, _chat(model=name))
    if kind == "sampling":
        kw = rng.choice([{"repeat_penalty": 1e-300, "temperature": 0.7}, {"temperature": 2, "top_k": 1},
                         {"logit_bias": {str(i): -100 for i in range(rng.choice([10, 5000]))}},
                         {"seed": -(2**70)}, {"presence_penalty": 2, "frequency_penalty": -2}])
        return kind, request(url, "POST", p, _chat(**kw))
    if kind == "big_prompt":
        text = rng.choice(["word ", "a", "\u00e9\u4e2d", " "]) * rng.choice([10_000, 1_000_000])
        return kind, request(url, "POST", rng.choice([p, "/v1/completions"]),
                             _chat(messages=[{"role": "user", "content": text}]) if rng.random() < 0.5
                             else json.dumps({"prompt": text, "max_tokens": 1}).encode())
    n = rng.choice([1000, 100_000])
    return kind, request(url, "POST", p, json.dumps({"messages": [{"role": "user", "content": "x"}] * n}).encode())


def run(url: str, cases: range, seed: int, max_body: int = 32 << 20, log=print) -> dict:
    """Fuzz `url` with the cases while a checker asks CHECK; returns counts, failures, and the
    checker's answers and worst latency."""
    def ask() -> tuple[int, str]:
        host, port = _host(url)
        conn = HTTPConnection(host, port, timeout=WAIT_S)
        conn.request("POST", "/v1/chat/completions", body=json.dumps(CHECK), headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        body = r.read()
        conn.close()
        return r.status, (json.loads(body)["choices"][0]["message"]["content"] if r.status == 200 else body.decode())

    status, want = ask()
    assert status == 200, want
    stop = threading.Event()
    checks = {"n": 0, "wrong": [], "worst_s": 0.0}

    def checker():
        while not stop.is_set():
            t0 = time.perf_counter()
            try:
                got = ask()
            except OSError as e:
                got = (0, f"{type(e).__name__}: {e}")
            checks["worst_s"] = max(checks["worst_s"], time.perf_counter() - t0)
            checks["n"] += 1
            if got != (200, want):
                checks["wrong"].append(got)

    t = threading.Thread(target=checker, daemon=True)
    t.start()
    counts: dict[str, int] = {}
    slowest: dict[str, float] = {}  # seconds of the slowest case of each kind
    failures = []
    t0 = time.perf_counter()
    try:
        for i in cases:
            rng = random.Random(f"{seed}:{i}")
            c0 = time.perf_counter()
            kind, status = case(rng, url, max_body)
            counts[kind] = counts.get(kind, 0) + 1
            slowest[kind] = round(max(slowest.get(kind, 0.0), time.perf_counter() - c0), 3)
            if status >= 500 and status != 503:
                failures.append({"case": i, "kind": kind, "status": status})
                log(f"FAIL case {i} ({kind}): status {status}")
    finally:
        stop.set()
        t.join(WAIT_S)
    return {"cases": len(cases), "seed": seed, "kinds": counts, "slowest_s": slowest, "failures": failures,
            "checks": checks["n"], "wrong": checks["wrong"][:5], "n_wrong": len(checks["wrong"]),
            "worst_check_s": round(checks["worst_s"], 3), "seconds": round(time.perf_counter() - t0, 1)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", required=True, help="the server, e.g. http://127.0.0.1:8080 (started with --temp 0)")
    ap.add_argument("--cases", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the summary to this file")
    a = ap.parse_args(argv)
    res = run(a.url, range(a.cases), a.seed)
    print(f"{res['cases']} cases (seed {a.seed}) in {res['seconds']} s: {len(res['failures'])} failures; checker "
          f"{res['checks']} requests, {res['n_wrong']} wrong, worst latency {res['worst_check_s']} s")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=2)
    return 1 if res["failures"] or res["n_wrong"] else 0


if __name__ == "__main__":
    sys.exit(main())
