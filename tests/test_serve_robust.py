"""`onebit serve` against hostile clients and failing models, in process: a uvicorn server on a
free loopback port in a thread, over the shipped model copied into a models folder (numpy
backend), so a test can break the model's file, make a load fail, or watch the tokenizer.
Every case: the client at fault gets one 4xx (or 503), and the server keeps answering."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import socket
import threading
import time
from http.client import HTTPConnection
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")

import onebit  # noqa: E402
from onebit.apps import serve_app  # noqa: E402
from onebit.apps.serve import Engine, Sampling  # noqa: E402
from onebit.apps.serve_app import create_app, uvicorn_options  # noqa: E402
from onebit.apps.serve_routes import build_app  # noqa: E402
from onebit.apps.serve_extra import DetokenizeRequest, EmbeddingRequest, TokenizeRequest  # noqa: E402
from onebit.apps.serve_ollama import OllamaChat, OllamaEmbed, OllamaGenerate  # noqa: E402
from onebit.apps.serve_responses import ResponsesRequest  # noqa: E402
from onebit.formats import catalog  # noqa: E402
from ggufedit import rewrite  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEFAULT = ROOT / "onebit" / "data" / "default.gguf"
CTX = 512  # room for a tool the generic tool prompt writes into the system message
WAIT_S = 60  # bounds on loops and sockets (hang guards), never asserted as timings


class Served:
    """A server in this process: `url`, `engine`, `models` (the folder), `stop()`."""

    def __init__(self, tmp: Path, api_key=None, head_timeout=30.0, max_connections=64, every_route=False):
        self.models = tmp / "models"
        self.models.mkdir(exist_ok=True)
        shutil.copy(DEFAULT, self.models / "main.gguf")
        model = onebit.load(str(self.models / "main.gguf"), backend="numpy", n_ctx=CTX)
        found = lambda: {e.id: e.path for e in catalog.find([str(self.models)])}  # noqa: E731
        self.engine = Engine(model, Sampling(temperature=0), lookup=0, catalog=found)
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sock.listen(128)
        self.url = "http://127.0.0.1:%d" % sock.getsockname()[1]
        app = build_app(self.engine, api_key) if every_route else create_app(self.engine, api_key)
        config = uvicorn.Config(app, log_level="warning", access_log=False,
                                lifespan="off", **uvicorn_options(head_timeout, max_connections))
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + WAIT_S
        while not self.server.started and time.monotonic() < deadline:
            time.sleep(0.02)
        self.sock = sock

    def stop(self):
        self.server.should_exit = True
        self.thread.join(WAIT_S)
        self.engine.close()
        self.sock.close()


@pytest.fixture
def served(tmp_path):
    s = Served(tmp_path)
    yield s
    s.stop()


def call(url, method="GET", body=None, raw=None, headers=None):
    """(status, parsed JSON or text) of one request."""
    u = re.match(r"http://([^:/]+):(\d+)(/.*)", url)
    conn = HTTPConnection(u.group(1), int(u.group(2)), timeout=WAIT_S)
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    conn.request(method, u.group(3), body=data, headers={"Content-Type": "application/json", **(headers or {})})
    r = conn.getresponse()
    text = r.read().decode()
    conn.close()
    try:
        return r.status, json.loads(text)
    except ValueError:
        return r.status, text


def ask(s, model=None, content="hi", **kw):
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 2, "temperature": 0, **kw}
    if model is not None:
        body["model"] = model
    return call(s.url + "/v1/chat/completions", "POST", body)


def no_leak(message: str, s: Served):
    assert str(s.models) not in message and "/tmp" not in message and "Error:" not in message, message


# -- 1, 13: a failed switch ----------------------------------------------------------------

def test_a_load_that_raises_anything_leaves_the_server_serving(served, monkeypatch):
    shutil.copy(DEFAULT, served.models / "boom.gguf")
    real = onebit.load

    def load(spec, **kw):
        if str(kw.get("path", "")).endswith("boom.gguf"):
            raise AttributeError("'NoneType' object has no attribute 'x'")  # a bug deep in a load
        return real(spec, **kw)

    monkeypatch.setattr(onebit, "load", load)
    status, body = ask(served, "boom")
    assert status == 400 and body["error"]["code"] == "model_load_failed", body
    no_leak(body["error"]["message"], served)
    assert "NoneType" not in body["error"]["message"]
    for model in (None, "main"):
        status, body = ask(served, model)
        assert status == 200 and body["model"] == "main", body
    assert call(served.url + "/health")[0] == 200


def test_wrong_value_types_and_a_foreign_file_are_one_clear_400(served):
    rewrite(DEFAULT, served.models / "u32tokens.gguf", meta={"tokenizer.ggml.tokens": 5})
    (served.models / "notes.gguf").write_text("root:x:0:0:root:/root:/bin/bash\n")
    status, body = ask(served, "u32tokens")
    assert status == 400 and "tokenizer.ggml.tokens" in body["error"]["message"], body
    no_leak(body["error"]["message"], served)
    status, body = ask(served, "notes")
    assert status == 400 and "root" not in body["error"]["message"], body
    no_leak(body["error"]["message"], served)
    assert ask(served)[0] == 200


def test_when_the_served_model_cannot_come_back_health_says_why(served):
    shutil.copy(DEFAULT, served.models / "other.gguf")
    (served.models / "broken.gguf").write_bytes(b"GGUF" + b"\xff" * 60)
    saved = (served.models / "main.gguf").read_bytes()
    (served.models / "main.gguf").unlink()  # the served file is gone: a failed switch cannot go back
    shutil.copy(DEFAULT, served.models / "main.gguf.part")  # (not a .gguf: not in the catalog)
    served.engine.first = ("main", str(served.models / "main.gguf"))
    status, body = ask(served, "broken")
    assert status == 400 and body["error"]["code"] == "model_load_failed"
    status, health = call(served.url + "/health")
    assert status == 503 and "main" in health["reason"], health
    status, body = ask(served)
    assert status == 503 and "cannot serve" in body["error"]["message"], body
    assert ask(served, "other")[0] == 200  # a model that loads serves again
    assert call(served.url + "/health")[0] == 200
    (served.models / "main.gguf").write_bytes(saved)
    status, body = ask(served, "main")
    assert status == 200 and body["model"] == "main"


# -- 4: the served file changes ------------------------------------------------------------

def test_a_touched_model_file_is_reloaded_and_a_broken_one_reported(served):
    path = served.models / "main.gguf"
    assert ask(served)[0] == 200
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    status, body = ask(served)
    assert status == 200, body
    assert ask(served)[0] == 200
    tmp = served.models / "main.new"
    tmp.write_bytes(b"GGUF" + b"\x00" * 100)
    os.replace(tmp, path)  # replaced by a file that does not load
    status, body = ask(served)
    assert status == 503, body
    status, health = call(served.url + "/health")
    assert status == 503 and "changed" in health["reason"], health
    no_leak(health["reason"], served)
    shutil.copy(DEFAULT, tmp)
    os.replace(tmp, path)
    assert ask(served, "main")[0] == 200
    assert call(served.url + "/health")[0] == 200


# -- 2, 3: bounded work --------------------------------------------------------------------

def test_a_huge_prompt_is_refused_after_tokenizing_a_context_of_it(served, monkeypatch):
    seen = []
    model = served.engine.model
    real = model.tokenize
    monkeypatch.setattr(model, "tokenize", lambda text, **kw: seen.append(len(text)) or real(text, **kw))
    big = "word " * 400_000  # 2 MB
    status, body = call(served.url + "/v1/completions", "POST", {"prompt": big, "max_tokens": 1})
    assert status == 400 and body["error"]["code"] == "context_length_exceeded", body
    status, body = ask(served, content=big)
    assert status == 400 and body["error"]["code"] == "context_length_exceeded", body
    assert seen and max(seen) < 100 * CTX, seen  # only a prefix was tokenized
    assert ask(served)[0] == 200


def test_many_messages_are_refused_and_bodies_parsed_off_the_event_loop(served, monkeypatch):
    threads = []
    real = serve_app.chat_work
    monkeypatch.setattr(serve_app, "chat_work", lambda *a: threads.append(threading.current_thread()) or real(*a))
    assert ask(served)[0] == 200
    assert threads and threads[0] is not served.thread  # not on the event loop's thread
    body = {"messages": [{"role": "user", "content": "x"}] * 100_000}
    status, got = call(served.url + "/v1/chat/completions", "POST", body)
    assert status == 400 and got["error"]["code"] == "context_length_exceeded", got


BIG = "word " * 1_000_000  # 5 MB of text: far past the context
# Each route, its request's class, and a huge body for it (/tokenize's not huge: it tokenizes all of it)
HUGE = [("/v1/responses", ResponsesRequest, {"input": BIG, "max_output_tokens": 1}),
        ("/api/chat", OllamaChat, {"messages": [{"role": "user", "content": BIG}], "stream": False}),
        ("/api/generate", OllamaGenerate, {"prompt": BIG, "stream": False}),
        ("/api/embed", OllamaEmbed, {"input": BIG}),
        ("/v1/embeddings", EmbeddingRequest, {"input": [BIG, "hi"]}),
        ("/tokenize", TokenizeRequest, {"content": "word " * 2000}),
        ("/detokenize", DetokenizeRequest, {"tokens": [1] * 1_000_000})]


@pytest.mark.parametrize("route, cls, body", HUGE, ids=[h[0] for h in HUGE])
def test_a_huge_body_on_each_route_is_parsed_while_health_answers(tmp_path, monkeypatch, route, cls, body):
    """The request's validation held in its parse until /health has answered: /health answers
    while the huge request is in flight (its parse is off the event loop), then the huge one gets
    one 400 for its length, and the server keeps answering."""
    s = Served(tmp_path, every_route=True)
    entered, release = threading.Event(), threading.Event()
    real = cls.model_validate

    def held(obj, *a, **kw):
        entered.set()
        release.wait(WAIT_S)
        return real(obj, *a, **kw)

    monkeypatch.setattr(cls, "model_validate", held)
    got = []
    big = threading.Thread(target=lambda: got.append(call(s.url + route, "POST", body)))
    try:
        big.start()
        assert entered.wait(WAIT_S), f"{route}: the body was not validated by the request's class"
        status, health = call(s.url + "/health")
        assert status == 200 and health["status"] == "ok" and big.is_alive() and not release.is_set()
        release.set()
        big.join(WAIT_S)
        status, answer = got[0]
        if route == "/tokenize":  # (llama-server's: every token, whatever the context)
            assert status == 200 and len(answer["tokens"]) >= 2000, (route, answer)
        elif route == "/detokenize":
            assert status == 200 and isinstance(answer["content"], str), route
        else:
            assert status == 400 and "context" in json.dumps(answer), (route, answer)
        assert ask(s)[0] == 200
    finally:
        release.set()
        big.join(WAIT_S)
        s.stop()


def test_embedding_inputs_are_tokenized_only_as_far_as_the_context(tmp_path, monkeypatch):
    s = Served(tmp_path, every_route=True)
    try:
        seen = []
        model = s.engine.model
        real = model.tokenize
        monkeypatch.setattr(model, "tokenize", lambda text, **kw: seen.append(len(text)) or real(text, **kw))
        for route in ("/v1/embeddings", "/api/embed"):
            status, body = call(s.url + route, "POST", {"input": BIG})
            assert status == 400 and "context" in json.dumps(body), body
        assert seen and max(seen) < 100 * CTX, seen  # only prefixes were tokenized
        status, body = call(s.url + "/v1/embeddings", "POST", {"input": "hi"})
        assert status == 200 and len(body["data"][0]["embedding"]) == model.cfg.dim, body
    finally:
        s.stop()


def test_a_chunked_body_over_the_limit_is_413(served, monkeypatch):
    monkeypatch.setattr(serve_app, "MAX_BODY", 4096)
    body = json.dumps({"messages": [{"role": "user", "content": "y " * 4000}], "max_tokens": 1}).encode()
    u = re.match(r"http://([^:/]+):(\d+)", served.url)
    conn = HTTPConnection(u.group(1), int(u.group(2)), timeout=WAIT_S)
    conn.request("POST", "/v1/chat/completions", body=iter([body[i:i + 1000] for i in range(0, len(body), 1000)]),
                 headers={"Content-Type": "application/json"}, encode_chunked=True)
    r = conn.getresponse()
    assert r.status == 413, r.read()
    conn.close()
    assert ask(served)[0] == 200


# -- 16: slow senders, many connections ----------------------------------------------------

def test_slow_headers_and_bodies_are_cut_off(tmp_path, monkeypatch):
    monkeypatch.setattr(serve_app, "BODY_TIMEOUT_S", 1.0)
    s = Served(tmp_path, head_timeout=1.0)
    try:
        host, port = re.match(r"http://([^:/]+):(\d+)", s.url).groups()
        half = socket.create_connection((host, int(port)), timeout=WAIT_S)
        half.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")  # never ends its headers
        assert half.recv(100) == b""  # closed by the server (a timeout here raises: the test fails)
        half.close()
        slow = socket.create_connection((host, int(port)), timeout=WAIT_S)
        slow.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"messa")
        reply = slow.recv(1000)
        assert reply.startswith(b"HTTP/1.1 408"), reply
        slow.close()
        assert ask(s)[0] == 200
    finally:
        s.stop()


def test_connections_past_the_cap_get_503(tmp_path):
    s = Served(tmp_path, max_connections=4)
    held = []
    try:
        host, port = re.match(r"http://([^:/]+):(\d+)", s.url).groups()
        for _ in range(4):
            held.append(socket.create_connection((host, int(port)), timeout=WAIT_S))
        assert ask(s)[0] == 503
        for c in held:
            c.close()
        deadline = time.monotonic() + WAIT_S
        while ask(s)[0] != 200 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ask(s)[0] == 200
    finally:
        s.stop()


# -- 15, 17: the key -----------------------------------------------------------------------

def test_a_utf8_key_matches_and_health_without_it_says_only_the_status(tmp_path):
    s = Served(tmp_path, api_key="clé-ключ")
    try:
        u = re.match(r"http://([^:/]+):(\d+)", s.url)
        conn = HTTPConnection(u.group(1), int(u.group(2)), timeout=WAIT_S)
        conn.putrequest("GET", "/v1/models")
        conn.putheader("Authorization", b"Bearer " + "clé-ключ".encode())
        conn.endheaders()
        r = conn.getresponse()
        assert r.status == 200, r.read()
        conn.close()
        status, body = call(s.url + "/health")
        assert status == 200 and body == {"status": "ok"}, body
        assert call(s.url + "/v1/models")[0] == 401
    finally:
        s.stop()


# -- 9, 10, 12: sampling edges, a malformed tool_choice, the log ---------------------------

def test_sampling_edges_and_a_malformed_tool_choice_are_400(served):
    ban = {str(t): -100 for t in range(served.engine.vocab_size)}
    for temp in (0, 0.7):
        status, body = ask(served, logit_bias=ban, temperature=temp)
        assert status == 400 and "no token" in body["error"]["message"], body
    status, body = ask(served, repeat_penalty=1e-300, temperature=0.7)
    assert status == 400, body
    tool = {"type": "function", "function": {"name": "x", "parameters": {"type": "object"}}}
    status, body = ask(served, tools=[tool], tool_choice={"type": "function", "function": "x"})
    assert status == 400 and body["error"]["param"] == "tool_choice", body
    assert ask(served)[0] == 200


def test_names_with_control_characters_are_logged_escaped(served):
    shutil.copy(DEFAULT, served.models / "other.gguf")  # two models: a name is checked, not taken as any
    lines = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(handler.format(record))
    log = logging.getLogger("onebit.apps.serve")
    log.addHandler(handler)
    level, disabled = log.level, log.disabled
    log.setLevel(logging.INFO)
    log.disabled = False  # (a library configuring logging in this test process may have disabled it)
    try:
        status, _ = ask(served, "x\nonebit serve: FORGED\x1b[31m")
        assert status == 404
        deadline = time.monotonic() + 10  # (the request's line is logged as its response ends: maybe after)
        while not lines and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
        log.disabled = disabled
    assert lines and not any("\n" in line or "\x1b" in line for line in lines), lines


# -- 6, 8: schemas ---------------------------------------------------------------------------

CITY = {"$defs": {"City": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}},
                           "required": ["name"], "additionalProperties": False}},
        "type": "object", "properties": {"city": {"$ref": "#/$defs/City"}}, "required": ["city"],
        "additionalProperties": False}  # as pydantic writes a nested model
HOSTILE = {
    "pattern": {"type": "object", "properties": {"a": {"type": "string", "pattern": "^(a{1000}){1000}$"}},
                "required": ["a"]},
    "anyOf": {"anyOf": [{"type": "object", "properties": {f"k{i}": {"const": i}}, "required": [f"k{i}"]}
                        for i in range(5000)]},
    "self": {"$ref": "#"},
    "loop": {"$defs": {"A": {"$ref": "#/$defs/B"}, "B": {"$ref": "#/$defs/A"}}, "$ref": "#/$defs/A"},
}


def test_a_forced_tool_whose_parameters_use_defs(served):
    tool = {"type": "function", "function": {"name": "weather", "parameters": CITY}}
    status, body = ask(served, tools=[tool], tool_choice={"type": "function", "function": {"name": "weather"}},
                       max_tokens=40)
    assert status == 200, body


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_a_schema_the_grammar_engine_gives_up_on_is_400(served, name):
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": HOSTILE[name]}}
    status, body = ask(served, response_format=fmt, max_tokens=8)
    assert status == 400, body
    message = body["error"]["message"]
    assert "\n" not in message and len(message) < 500, message
    assert ask(served)[0] == 200
