"""`onebit serve` through the real `openai` client: one server for the module, on a free
loopback port, serving the shipped model, with a models folder holding a gpt-oss fixture and
a Qwen3-templated fixture (loaded when a request names them)."""

from __future__ import annotations

from http.client import HTTPConnection
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("llguidance")
pytest.importorskip("fastapi")

from conftest import fixture_path, stop_process  # noqa: E402
from ggufedit import rewrite  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEFAULT = str(ROOT / "onebit" / "data" / "default.gguf")
QWEN3_TEMPLATE = (ROOT / "tests" / "templates" / "Qwen-Qwen3-0.6B.jinja").read_text()
CTX = 512  # the fixtures' own context length; the Qwen3 template with a tool takes 392 tokens
START_WAIT_S = 180  # bounds on loops (hang guards), never asserted as timings
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                   "required": ["city"], "additionalProperties": False}}}
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


def start(args, log_path) -> tuple[subprocess.Popen, str]:
    """Start `onebit serve ... --port 0`; returns (process, base URL) once it listens."""
    log = open(log_path, "w")
    proc = subprocess.Popen([sys.executable, "-m", "onebit.cli.main", "serve", *args, "--host", "127.0.0.1",
                             "--port", "0"], stdout=log, stderr=log, text=True)
    deadline = time.monotonic() + START_WAIT_S
    while time.monotonic() < deadline:
        m = re.search(r"on (http://127\.0\.0\.1:\d+)/v1", Path(log_path).read_text())
        if m:
            return proc, m.group(1)
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    proc.kill()
    raise AssertionError("the server did not start:\n" + Path(log_path).read_text())


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve")
    models = tmp / "models"
    models.mkdir()
    shutil.copy(fixture_path("gptoss-f32.gguf"), models / "gptoss.gguf")
    rewrite(fixture_path("qwen3moe-f32.gguf"), models / "qwen3tools.gguf",
            meta={"tokenizer.chat_template": QWEN3_TEMPLATE})
    (models / "broken.gguf").write_bytes(b"GGUF" + b"\xff" * 60)  # a file that does not load
    log = tmp / "server.log"
    proc, url = start([DEFAULT, "--backend", "numpy", "--ctx", str(CTX), "--temp", "0", "--models-dir",
                       str(models)], log)
    try:
        yield url, log
    finally:
        stop_process(proc)


@pytest.fixture(scope="module")
def ban():
    """logit_bias that bans the shipped model's end-of-generation tokens: a reply then runs to
    its max_tokens or the context's end, unless stopped."""
    import onebit

    return {str(t): -100 for t in onebit.load(DEFAULT, backend="numpy").tokenizer.stop_ids}


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0, timeout=300)


def call(url, method="GET", body=None, raw: bytes | None = None):
    """(status, text, headers) of one plain HTTP request (the standard library's client)."""
    u = re.match(r"http://([^:/]+):(\d+)(/.*)", url)
    conn = HTTPConnection(u.group(1), int(u.group(2)), timeout=300)
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    conn.request(method, u.group(3), body=data, headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    text = r.read().decode()
    conn.close()
    return r.status, text, dict(r.getheaders())


def chat(client, content, model="default", **kw):
    kw.setdefault("temperature", 0)
    return client.chat.completions.create(model=model, messages=[{"role": "user", "content": content}], **kw)


# -- plain, streamed, completions ------------------------------------------------------------

def test_models_and_health(server, client):
    ids = [m.id for m in client.models.list().data]
    assert ids[0] == "default" and {"gptoss", "qwen3tools"} <= set(ids)
    assert client.models.retrieve("default").id == "default"
    status, text, _ = call(server[0] + "/health")
    assert status == 200 and json.loads(text)["status"] == "ok"


def test_greedy_reply_equals_onebit_generate(client):
    r = chat(client, "Tell me about onebit.", max_tokens=24)
    g = subprocess.run([sys.executable, "-m", "onebit.cli.main", "generate", "-m", DEFAULT, "--backend", "numpy",
                        "-p", "Tell me about onebit.", "-n", "24", "--temp", "0", "--json"],
                       capture_output=True, text=True, timeout=300)
    assert g.returncode == 0, g.stderr
    want = json.loads(g.stdout)
    assert r.choices[0].message.content == want["text"]
    assert r.choices[0].finish_reason == want["finish_reason"]
    assert r.usage.prompt_tokens == want["prompt_tokens"]
    assert r.usage.completion_tokens == want["generation_tokens"]
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.model_extra["timings"]["predicted_n"] == r.usage.completion_tokens - 1  # llama-server's field


def test_stream_equals_plain_with_usage(server, client):
    plain = chat(client, "Write a haiku.", max_tokens=16)
    chunks = list(chat(client, "Write a haiku.", max_tokens=16, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content and text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [plain.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
    # the same prompt again: all of it but the last token came from the KV cache
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == plain.usage.prompt_tokens - 1
    status, text, headers = call(server[0] + "/v1/chat/completions", "POST", {
        "messages": [{"role": "user", "content": "Write a haiku."}], "max_tokens": 3, "stream": True})
    events = [ln for ln in text.splitlines() if ln.startswith("data: ")]
    assert status == 200 and headers["content-type"].startswith("text/event-stream") and events[-1] == "data: [DONE]"


def test_stop_string(client):
    full = chat(client, "Hello", max_tokens=20).choices[0].message.content
    words = full.split()
    assert len(words) >= 4, full
    stop = " " + words[2]
    r = chat(client, "Hello", max_tokens=20, stop=[stop, "@@never@@"])
    assert r.choices[0].message.content == full[: full.index(stop)]
    assert r.choices[0].finish_reason == "stop"


def test_completions_plain_and_streamed(client):
    r = client.completions.create(model="default", prompt="Once upon a time", max_tokens=8, temperature=0)
    s = client.completions.create(model="default", prompt="Once upon a time", max_tokens=8, temperature=0,
                                  stream=True)
    assert "".join(c.choices[0].text for c in s) == r.choices[0].text
    assert r.usage.completion_tokens <= 8 and r.choices[0].finish_reason in ("stop", "length")


def test_max_tokens_beyond_context_is_clipped(client, ban):
    ids = [100 + i % 50 for i in range(CTX - 5)]
    r = client.completions.create(model="default", prompt=ids, max_tokens=100_000, temperature=0, logit_bias=ban)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == CTX - 5 and r.usage.completion_tokens == 5


def test_continuing_conversation_reuses_the_cache(client):
    first = chat(client, "Hi there", max_tokens=8)
    msgs = [{"role": "user", "content": "Hi there"},
            {"role": "assistant", "content": first.choices[0].message.content},
            {"role": "user", "content": "And then?"}]
    second = client.chat.completions.create(model="default", messages=msgs, max_tokens=4, temperature=0)
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens


# -- structured output -----------------------------------------------------------------------

def test_json_schema_parsed_and_valid(client):
    from pydantic import BaseModel, Field

    class Person(BaseModel):
        name: str = Field(max_length=10)
        age: int = Field(ge=0, le=120)

    r = client.chat.completions.parse(model="default", temperature=0, max_tokens=40, response_format=Person,
                                      messages=[{"role": "user", "content": "Describe a person."}])
    assert r.choices[0].finish_reason == "stop"
    p = r.choices[0].message.parsed
    assert isinstance(p, Person) and len(p.name) <= 10 and 0 <= p.age <= 120


def test_json_schema_sampled_and_streamed(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    for seed in (1, 2):
        r = chat(client, "A person, please.", temperature=1.0, seed=seed, max_tokens=40, response_format=fmt)
        obj = json.loads(r.choices[0].message.content)
        assert set(obj) == {"name", "age"} and isinstance(obj["name"], str) and len(obj["name"]) <= 10
        assert isinstance(obj["age"], int) and 0 <= obj["age"] <= 120
    s = chat(client, "A person, please.", max_tokens=40, response_format=fmt, stream=True)
    json.loads("".join(c.choices[0].delta.content or "" for c in s if c.choices))


def test_json_object_mode(client):
    r = chat(client, "Reply in JSON.", max_tokens=60, response_format={"type": "json_object"})
    text = r.choices[0].message.content
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:  # cut at max_tokens: still a prefix of an object
        assert text.startswith("{")


# -- tool calls ------------------------------------------------------------------------------

@pytest.mark.parametrize("model", ["qwen3tools", "gptoss"])
def test_tool_call_round_trip(client, model):
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = client.chat.completions.create(model=model, messages=msgs, tools=[WEATHER], tool_choice="required",
                                       temperature=0, max_tokens=60)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id
    args = json.loads(call.function.arguments)
    assert set(args) == {"city"} and isinstance(args["city"], str)
    # streamed: the same call as a delta
    s = list(client.chat.completions.create(model=model, messages=msgs, tools=[WEATHER], temperature=0,
                                            tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                            max_tokens=60, stream=True))
    deltas = [tc for c in s if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert [(d.function.name, json.loads(d.function.arguments)) for d in deltas] == [("get_weather", args)]
    assert [c.choices[0].finish_reason for c in s if c.choices and c.choices[0].finish_reason] == ["tool_calls"]
    # the result goes back as a `tool` message and the model answers
    msgs += [choice.message.model_dump(exclude_none=True),
             {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temp_c": 21})}]
    back = client.chat.completions.create(model=model, messages=msgs, tools=[WEATHER], temperature=0, max_tokens=8)
    assert back.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert back.usage.prompt_tokens > r.usage.prompt_tokens


def test_json_schema_on_gptoss(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    r = chat(client, "A person, please.", model="gptoss", max_tokens=40, response_format=fmt)
    obj = json.loads(r.choices[0].message.content)
    assert set(obj) == {"name", "age"} and r.choices[0].finish_reason == "stop"


def test_a_model_that_does_not_load(client):
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, "hi", model="broken", max_tokens=2)
    assert e.value.code == "model_load_failed"
    assert chat(client, "hi", max_tokens=2).model == "default"  # the server serves on


def test_unparseable_tool_call_is_text():
    from onebit.chat_formats.toolcall import parse_harmony, parse_tags

    assert parse_tags('hi <tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>')[1][0].name == "f"
    for bad in ('<tool_call>{"name": "f", "arguments": {</tool_call>', '<tool_call>{"name": "f"',
                '<tool_call>[1, 2]</tool_call>', 'x <tool_call>{"arguments": {}}</tool_call>'):
        assert parse_tags(bad) == (bad, [])
    assert parse_harmony("<|channel|>commentary to=functions.f <|constrain|>json<|message|>{oops") == []


# -- many clients, dropped clients, bad input ------------------------------------------------

def test_sixteen_concurrent_clients(client):
    prompts = [f"Question number {i}: what is {i} + {i}?" for i in range(16)]
    alone = [0, 7, 15]
    want = [chat(client, prompts[i], max_tokens=4).choices[0].message.content for i in alone]
    got: dict[int, str] = {}
    errors = []

    def ask(i):
        try:
            got[i] = chat(client, prompts[i], max_tokens=4).choices[0].message.content
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors and len(got) == 16
    assert [got[i] for i in alone] == want  # the same reply as alone
    assert all(isinstance(got[i], str) and got[i] for i in range(16))


def long_stream(url: str, ban: dict, max_tokens: int):
    """A streamed chat request for a long story, its end-of-generation tokens banned: (its
    connection, its response), the status checked."""
    u = re.match(r"http://([^:/]+):(\d+)", url)
    conn = HTTPConnection(u.group(1), int(u.group(2)), timeout=300)
    conn.request("POST", "/v1/chat/completions", headers={"Content-Type": "application/json"}, body=json.dumps({
        "messages": [{"role": "user", "content": "Tell me a long story."}], "max_tokens": max_tokens,
        "stream": True, "temperature": 0, "logit_bias": ban}))
    r = conn.getresponse()
    assert r.status == 200
    return conn, r


def drop_stream(conn, r) -> None:
    """Read a few streamed lines, then go away mid-stream."""
    for _ in range(6):
        r.fp.readline()
    conn.sock.close()
    conn.close()


def test_dropped_client_frees_the_model(server, client, ban):
    url = server[0]
    health = lambda: json.loads(call(url + "/health")[1])  # noqa: E731
    before = health()["generated"]
    u = re.match(r"http://([^:/]+):(\d+)", url)
    drop_stream(*long_stream(url, ban, 300))
    # the next request runs, and the dropped one stopped far short of its 300 tokens
    r = chat(client, "Hello", max_tokens=3)
    assert r.choices[0].finish_reason == "length"
    for _ in range(100):
        h = health()
        if not h["busy"]:
            break
        time.sleep(0.1)
    assert h["generated"] - before < 100
    # a request that does not stream, dropped while it generates, stops too
    before = h["generated"]
    conn = HTTPConnection(u.group(1), int(u.group(2)), timeout=300)
    conn.request("POST", "/v1/chat/completions", headers={"Content-Type": "application/json"}, body=json.dumps({
        "messages": [{"role": "user", "content": "Tell me another story."}], "max_tokens": 300, "seed": -5,
        "temperature": 0.5, "logit_bias": ban}))
    for _ in range(600):
        if health()["generated"] > before:
            break
        time.sleep(0.05)
    conn.sock.close()
    conn.close()
    for _ in range(600):
        h = health()
        if not h["busy"]:
            break
        time.sleep(0.05)
    assert 0 < h["generated"] - before < 150


@pytest.mark.parametrize("body, status, code", [
    ({"messages": [{"role": "user", "content": "hi"}], "model": "no-such-model"}, 404, "model_not_found"),
    ({"messages": [{"role": "user", "content": "word " * 2000}]}, 400, "context_length_exceeded"),
    ({"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, 400, None),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, 400, None),
    ({"messages": []}, 400, None),
    ({"messages": [{"role": "user", "content": "hi"}], "n": 99}, 400, None),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": -1}, 400, None),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER],
      "tool_choice": {"type": "function", "function": {"name": "nope"}}}, 400, None),
    ({"messages": [{"role": "user", "content": "hi"}],
      "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     400, None),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400, None),
])
def test_bad_requests_get_openai_errors(server, body, status, code):
    got, text, _ = call(server[0] + "/v1/chat/completions", "POST", body)
    assert got == status, text
    err = json.loads(text)["error"]
    assert err["message"] and err["type"] and set(err) >= {"message", "type", "code"}
    if code:
        assert err["code"] == code


def test_malformed_and_unknown_routes(server):
    url = server[0]
    for method, path, content in (("POST", "/v1/chat/completions", b"{not json"),
                                  ("POST", "/v1/chat/completions", b"[1, 2]"),
                                  ("POST", "/v1/completions", b'{"prompt": 5}'),
                                  ("GET", "/v1/nothing", None), ("GET", "/v1/chat/completions", None)):
        status, text, _ = call(url + path, method, raw=content)
        assert 400 <= status < 500, (path, status, text)
        assert json.loads(text)["error"]["message"]
    log = server[1].read_text()
    assert "Traceback" not in log
    assert not re.search(r" (GET|POST) \S+ 5\d\d \d+ ms", log)  # no 5xx status (" 500 " matched a 500 ms request)
    assert re.search(r"POST /v1/chat/completions 400 \d+ ms: the request body is not valid JSON", log)


# -- the API key, and SIGTERM ----------------------------------------------------------------

def test_api_key_and_sigterm(tmp_path):
    proc, url = start([DEFAULT, "--backend", "numpy", "--ctx", "256", "--api-key", "sekrit", "-q"],
                      tmp_path / "server.log")
    try:
        bad = openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
        assert call(url + "/v1/models")[0] == 401
        good = openai.OpenAI(base_url=url + "/v1", api_key="sekrit", max_retries=0, timeout=300)
        assert [m.id for m in good.models.list().data] == ["default"]
        # SIGTERM while a stream runs: the stream ends, the process exits 0
        got = []
        stream = good.chat.completions.create(model="default", messages=[{"role": "user", "content": "Go on"}],
                                              max_tokens=200, stream=True, temperature=0)
        it = iter(stream)
        got.append(next(it))
        proc.send_signal(signal.SIGTERM)
        reader = threading.Thread(target=lambda: got.extend(_drain(it)), daemon=True)
        reader.start()
        assert proc.wait(60) == 0
        reader.join(60)
        assert not reader.is_alive()
        assert isinstance(got[-1], openai.APIError) and "cancelled" in str(got[-1]), got[-1]  # said, not cut
    finally:
        if proc.poll() is None:
            proc.kill()
    log = (tmp_path / "server.log").read_text()
    assert "Traceback" not in log and "stopped" in log


def _drain(it):
    out = []
    try:
        for c in it:
            out.append(c)
    except Exception as e:  # noqa: BLE001 - the server said it is shutting down
        out.append(e)
    return out


# -- pieces without a server ----------------------------------------------------------------

def test_reply_splitter_reasoning_and_held_tool_call(server):
    import onebit
    from onebit.apps.serve import ReplySplitter

    g = onebit.load(fixture_path("gptoss-f32.gguf"), backend="numpy")
    s = ReplySplitter(g, [], tools=True, constrained=False)
    raw = ("<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>commentary "
           "to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"Oslo\"}")
    deltas = [s.feed(raw[i:i + 7], final=False) for i in range(0, len(raw), 7)] + [s.feed("", final=True)]
    assert "".join(d.reasoning for d in deltas) == "Need weather."
    assert "".join(d.content for d in deltas) == ""
    calls, rest = s.calls()
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Oslo"})]

    q = onebit.load(Path(server[1]).parent / "models" / "qwen3tools.gguf", backend="numpy")
    s = ReplySplitter(q, [], tools=True, constrained=False)
    raw = "<think>\nLet me see.\n</think>\n\nSure. <tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": 1}}\n</tool_call>"
    deltas = [s.feed(raw[i:i + 3], final=False) for i in range(0, len(raw), 3)] + [s.feed("", final=True)]
    assert "".join(d.reasoning for d in deltas) == "Let me see."
    assert "".join(d.content for d in deltas) == "Sure. "  # the call is held back, not shown as text
    calls, rest = s.calls()
    assert [c.name for c in calls] == ["f"] and rest == ""
    s = ReplySplitter(q, [], tools=True, constrained=False)
    s.feed("Sure. <tool_call>{\"name\": oops</tool_call>", final=False)
    s.feed("", final=True)
    assert s.calls() == ([], "<tool_call>{\"name\": oops</tool_call>")  # does not parse: given out as text
    s = ReplySplitter(q, [], tools=True, constrained=False)
    s.feed("Sure. <tool_call>{\"name\": \"f\", \"argu", final=False)
    s.feed("", final=True)
    assert s.calls() == ([], "")  # cut off inside the call: no markup in the content


def test_generate_json_schema(tmp_path):
    schema = tmp_path / "person.json"
    schema.write_text(json.dumps(PERSON))
    r = subprocess.run([sys.executable, "-m", "onebit.cli.main", "generate", "-m", DEFAULT, "--backend", "numpy",
                        "-p", "Describe a person.", "-n", "40", "--json-schema-file", str(schema), "--json",
                        "--temp", "0.8", "--seed", "3"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    rec = json.loads(r.stdout)
    obj = json.loads(rec["text"])
    assert rec["finish_reason"] == "stop" and set(obj) == {"name", "age"} and 0 <= obj["age"] <= 120
    schema.write_text('{"type": "nonsense"}')
    r = subprocess.run([sys.executable, "-m", "onebit.cli.main", "generate", "-m", DEFAULT, "-p", "x",
                        "--json-schema-file", str(schema)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "not usable as a JSON schema" in r.stderr


def test_list_finds_models_dir_hub_ollama_lmstudio(tmp_path):
    (tmp_path / "dir" / "sub").mkdir(parents=True)
    (tmp_path / "dir" / "sub" / "a.gguf").write_bytes(b"GGUF")
    (tmp_path / "dir" / "b-00002-of-00002.gguf").write_bytes(b"GGUF")  # a later part of a split file
    hub = tmp_path / "hub" / "models--org--repo" / "snapshots" / "abc"
    hub.mkdir(parents=True)
    (hub / "m-Q4_K_M.gguf").write_bytes(b"GGUF")
    olla = tmp_path / "ollama"
    (olla / "manifests" / "registry.ollama.ai" / "library" / "qwen3").mkdir(parents=True)
    (olla / "blobs").mkdir()
    (olla / "blobs" / "sha256-00ff").write_bytes(b"GGUF")
    (olla / "manifests" / "registry.ollama.ai" / "library" / "qwen3" / "4b").write_text(json.dumps(
        {"layers": [{"mediaType": "application/vnd.ollama.image.model", "digest": "sha256:00ff"}]}))
    lms = tmp_path / "home" / ".lmstudio" / "models" / "pub" / "repo"
    lms.mkdir(parents=True)
    (lms / "x.gguf").write_bytes(b"GGUF")
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "OLLAMA_MODELS": str(olla),
           "HOME": str(tmp_path / "home")}
    r = subprocess.run([sys.executable, "-m", "onebit.cli.main", "list", "--models-dir", str(tmp_path / "dir"),
                        "--json"], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    got = {(e["id"], e["source"]) for e in json.loads(r.stdout)}
    assert got == {("sub/a", "models-dir"), ("org/repo/m-Q4_K_M", "huggingface"), ("qwen3:4b", "ollama"),
                   ("pub/repo/x", "lmstudio")}
