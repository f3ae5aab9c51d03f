"""The API surface of `onebit serve` beyond chat and completions, through real clients (the
openai SDK, the `ollama` client) and raw HTTP in their shapes: one single-model server for the
module (the shipped model, `--cors https://app.example`), and one with a models folder holding
a Qwen3-templated fixture for tool calls; the chat page in headless chromium."""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from http.client import HTTPConnection

import numpy as np
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("llguidance")
pytest.importorskip("fastapi")

from conftest import fixture_path, stop_process  # noqa: E402
from ggufedit import rewrite  # noqa: E402
from test_serve import CTX, DEFAULT, QWEN3_TEMPLATE, call, start  # noqa: E402

# a tool whose parameters do not say additionalProperties (pydantic's and LangChain's do not)
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
WAIT_S = 120  # bounds on loops in the browser (hang guards), never asserted as timings
OPEN_WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                   "required": ["city"]}}}


@pytest.fixture(scope="module")
def one(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve-one")
    log = tmp / "server.log"
    proc, url = start([DEFAULT, "--backend", "numpy", "--ctx", str(CTX), "--temp", "0", "--cors",
                       "https://app.example"], log)
    try:
        yield url, log
    finally:
        stop_process(proc)


@pytest.fixture(scope="module")
def tools(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve-tools")
    models = tmp / "models"
    models.mkdir()
    rewrite(fixture_path("qwen3moe-f32.gguf"), models / "qwen3tools.gguf",
            meta={"tokenizer.chat_template": QWEN3_TEMPLATE})
    log = tmp / "server.log"
    proc, url = start([str(models / "qwen3tools.gguf"), "--backend", "numpy", "--ctx", str(CTX), "--temp", "0",
                       "--models-dir", str(models)], log)
    try:
        yield url, log
    finally:
        stop_process(proc)


@pytest.fixture(scope="module")
def client(one):
    return openai.OpenAI(base_url=one[0] + "/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def ref():
    import onebit

    return onebit.load(DEFAULT, backend="numpy")


def log_softmax(x):
    x = np.asarray(x, dtype=np.float64)
    m = x.max()
    return x - (m + np.log(np.exp(x - m).sum()))


# -- 1. schemas closed, no markup from a cut-off call ----------------------------------------

def test_close_objects_by_hand():
    from onebit.apps.serve_app import close_objects

    schema = {"type": "object", "properties": {
        "a": {"type": "object", "properties": {"x": {"type": "integer"}}},
        "b": {"type": "array", "items": {"type": "object", "properties": {"y": {}}, "additionalProperties": True}},
        "c": {"anyOf": [{"type": "object", "properties": {"z": {}}}, {"type": "null"}]},
        "d": {"type": "object"}},
        "$defs": {"T": {"type": "object", "properties": {"t": {}}}}}
    want = {"type": "object", "properties": {
        "a": {"type": "object", "properties": {"x": {"type": "integer"}}, "additionalProperties": False},
        "b": {"type": "array", "items": {"type": "object", "properties": {"y": {}}, "additionalProperties": True}},
        "c": {"anyOf": [{"type": "object", "properties": {"z": {}}, "additionalProperties": False}, {"type": "null"}]},
        "d": {"type": "object"}},
        "$defs": {"T": {"type": "object", "properties": {"t": {}}, "additionalProperties": False}},
        "additionalProperties": False}
    assert close_objects(schema) == want
    assert "additionalProperties" not in schema  # the request's own object is left as it was


def test_forced_call_on_an_open_schema_keeps_to_its_keys(tools):
    c = openai.OpenAI(base_url=tools[0] + "/v1", api_key="unused", max_retries=0, timeout=300)
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    for seed in range(4):
        r = c.chat.completions.create(model="qwen3tools", messages=msgs, tools=[OPEN_WEATHER], tool_choice="required",
                                      temperature=1.0, seed=seed, max_tokens=120)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        assert set(json.loads(choice.message.tool_calls[0].function.arguments)) == {"city"}
    # cut off inside the call: finish_reason length, and no raw markup in the content
    r = c.chat.completions.create(model="qwen3tools", messages=msgs, tools=[OPEN_WEATHER], tool_choice="required",
                                  temperature=0, max_tokens=4)
    assert r.choices[0].finish_reason == "length"
    assert "<tool_call>" not in (r.choices[0].message.content or "") and not r.choices[0].message.tool_calls


def test_response_format_schema_closed(client):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}}, "required": ["name"]}
    for seed in range(3):
        r = client.chat.completions.create(model="x", messages=[{"role": "user", "content": "A name"}], seed=seed,
                                           temperature=1.0, max_tokens=40, response_format={
                                               "type": "json_schema", "json_schema": {"name": "n", "schema": schema}})
        assert r.choices[0].finish_reason == "stop"
        assert set(json.loads(r.choices[0].message.content)) == {"name"}


# -- 2. unknown fields, any model name, paths without /v1, 503 while loading -----------------

def test_unknown_fields_warned_and_ignored(one, client):
    r = client.chat.completions.create(model="gpt-4o-mini", messages=[{"role": "user", "content": "Hi"}],
                                       max_tokens=3, extra_body={"prompt_cache_key": "k", "verbosity": "low"},
                                       stream_options=None)
    assert r.model == "default" and r.choices[0].message.content  # any model name: the one served
    s = list(client.chat.completions.create(model="x", messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                            stream=True, stream_options={"include_usage": True,
                                                                         "include_obfuscation": False}))
    assert s[-1].usage.completion_tokens == 3
    log = one[1].read_text()
    assert "ignored unknown request fields: prompt_cache_key, verbosity" in log
    assert "ignored unknown request fields: stream_options.include_obfuscation" in log


def test_paths_without_v1(one, client):
    bare = openai.OpenAI(base_url=one[0], api_key="unused", max_retries=0, timeout=300)
    want = client.chat.completions.create(model="x", messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    got = bare.chat.completions.create(model="x", messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    assert got.choices[0].message.content == want.choices[0].message.content
    assert [m.id for m in bare.models.list().data] == ["default"]
    assert bare.completions.create(model="x", prompt="Once", max_tokens=2).choices[0].text


def test_loading_answer_is_503():
    from onebit.apps.serve_loading import LoadingAnswer

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    answer = LoadingAnswer(sock)
    try:
        for _ in range(2):
            conn = HTTPConnection("127.0.0.1", sock.getsockname()[1], timeout=30)
            conn.request("GET", "/health")
            r = conn.getresponse()
            assert r.status == 503 and json.loads(r.read())["status"] == "loading"
            conn.close()
    finally:
        answer.stop()
    # the socket listens on for the server that follows: a connection made now waits in the backlog
    probe = socket.create_connection(sock.getsockname(), timeout=5)
    conn, _ = sock.accept()
    conn.close()
    probe.close()
    sock.close()


def test_health_from_the_start(tmp_path):
    """From the moment the port listens, /health answers at once: 503 `loading` until the model
    is in, then 200 (on the shipped model the load may be over before the first poll)."""
    log = tmp_path / "server.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "onebit.cli.main", "serve", DEFAULT, "--backend", "numpy",
                                 "--port", "0"], stdout=out, stderr=out)
    try:
        port = None
        for _ in range(1200):
            m = re.search(r"http://127\.0\.0\.1:(\d+)/health answers 503", log.read_text())
            if m or proc.poll() is not None:
                port = m and int(m.group(1))
                break
            time.sleep(0.05)
        assert port, log.read_text()
        seen = []
        for _ in range(2400):
            conn = HTTPConnection("127.0.0.1", port, timeout=10)  # (a port nobody reads would time out)
            conn.request("GET", "/health")
            r = conn.getresponse()
            body = json.loads(r.read())
            conn.close()
            seen.append((r.status, body["status"]))
            if r.status == 200:
                break
            time.sleep(0.02)
        assert seen[-1] == (200, "ok") and set(seen[:-1]) <= {(503, "loading")}, seen
    finally:
        stop_process(proc)


# -- 3. embeddings, logprobs, echo, n --------------------------------------------------------

def test_embeddings_are_pooled_hidden_states(client, ref):
    from onebit.apps.embed import hidden_states, pool
    from onebit.backends.numpy_backend import dequantize

    texts = ["The cat sat on the mat.", "Stock prices fell sharply."]
    r = client.embeddings.create(model="text-embedding-3-small", input=texts)  # (the SDK asks for base64)
    got = [np.asarray(d.embedding) for d in r.data]
    assert [d.index for d in r.data] == [0, 1] and r.usage.prompt_tokens == sum(len(ref.tokenize(t)) for t in texts)
    for text, v in zip(texts, got):
        ids = ref.tokenize(text)
        h = hidden_states(ref, ids)
        # the hidden states are what the output head reads: times it, they are the model's logits
        name = "output.weight" if "output.weight" in ref.net.gguf.tensors else "token_embd.weight"
        np.testing.assert_allclose(h @ dequantize(ref.net.gguf.tensor(name)).T, ref.logits(ids), atol=1e-4)
        mean = h.astype(np.float64).mean(axis=0)
        np.testing.assert_allclose(v, mean / np.linalg.norm(mean), atol=1e-5)
    assert abs(np.linalg.norm(got[0]) - 1) < 1e-5
    f = client.embeddings.create(model="x", input="The cat sat on the mat.", encoding_format="float")
    np.testing.assert_allclose(f.data[0].embedding, got[0], atol=1e-6)
    # pooling by hand
    h = np.array([[3.0, 0.0], [0.0, 4.0], [1.0, 1.0]])
    np.testing.assert_allclose(pool(h, "last"), [2 ** -0.5, 2 ** -0.5], atol=1e-6)
    np.testing.assert_allclose(pool(h, "cls"), [1, 0], atol=1e-6)
    np.testing.assert_allclose(pool(h, "mean"), np.array([4, 5]) / 41 ** 0.5, atol=1e-6)  # mean (4/3, 5/3)
    with pytest.raises(openai.BadRequestError):
        client.embeddings.create(model="x", input="")


def test_hidden_states_on_vulkan_equal_numpy(ref):
    import onebit
    from onebit.apps.embed import hidden_states
    from onebit.backends.vulkan.device import VulkanUnavailableError

    try:
        v = onebit.load(DEFAULT, backend="vulkan")
    except VulkanUnavailableError as e:
        pytest.skip(f"no Vulkan device: {e}")
    try:
        for text in ("Hi", "The cat sat on the mat, and then it slept."):  # one row, and many
            ids = ref.tokenize(text)
            np.testing.assert_allclose(hidden_states(v, ids), hidden_states(ref, ids), atol=1e-4)
    finally:
        v.close()


def test_logprobs_match_the_model(client, ref):
    r = client.completions.create(model="x", prompt="Once upon", max_tokens=4, logprobs=3, temperature=0)
    lp = r.choices[0].logprobs
    ids = ref.tokenize("Once upon")
    gen = ref.tokenize(r.choices[0].text, add_special=False)
    assert "".join(lp.tokens) == r.choices[0].text and len(lp.tokens) == 4
    logits = ref.logits(ids + gen)  # one forward over prompt and reply: an independent path
    for i, (tok, value, top) in enumerate(zip(lp.tokens, lp.token_logprobs, lp.top_logprobs)):
        row = log_softmax(logits[len(ids) + i - 1])
        want = int(np.argmax(row))
        assert ref.tokenizer.token_bytes(want).decode() == tok
        assert abs(value - row[want]) < 1e-3
        assert len(top) == 3 and max(top.values()) == pytest.approx(value)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(4)]
    # chat, and streamed: the same entries
    kw = dict(model="x", messages=[{"role": "user", "content": "Hi"}], max_tokens=5, temperature=0, logprobs=True,
              top_logprobs=2)
    plain = client.chat.completions.create(**kw).choices[0]
    streamed = [e for c in client.chat.completions.create(**kw, stream=True) if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content]
    assert [e.token for e in plain.logprobs.content] == [e.token for e in streamed]
    # (the second request reuses the cached prompt: float32 sums in another order)
    np.testing.assert_allclose([e.logprob for e in plain.logprobs.content], [e.logprob for e in streamed], atol=1e-4)
    assert "".join(e.token for e in plain.logprobs.content) == plain.message.content
    assert all(e.top_logprobs[0].logprob == e.logprob and len(e.top_logprobs) == 2 for e in plain.logprobs.content)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(**{**kw, "top_logprobs": 50})


def test_echo_and_n(client):
    r = client.completions.create(model="x", prompt="Once upon", max_tokens=4, echo=True, temperature=0)
    alone = client.completions.create(model="x", prompt="Once upon", max_tokens=4, temperature=0)
    assert r.choices[0].text == "Once upon" + alone.choices[0].text
    s = "".join(c.choices[0].text for c in client.completions.create(model="x", prompt="Once upon", max_tokens=4,
                                                                        echo=True, temperature=0, stream=True))
    assert s == r.choices[0].text
    one = client.chat.completions.create(model="x", messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    three = client.chat.completions.create(model="x", messages=[{"role": "user", "content": "Hi"}], max_tokens=4, n=3)
    assert [c.index for c in three.choices] == [0, 1, 2]
    assert {c.message.content for c in three.choices} == {one.choices[0].message.content}  # greedy: the same
    assert three.usage.completion_tokens == 3 * one.usage.completion_tokens
    assert three.usage.prompt_tokens == one.usage.prompt_tokens
    sampled = client.chat.completions.create(model="x", messages=[{"role": "user", "content": "Tell a story"}],
                                             max_tokens=12, n=4, temperature=2.0, seed=7)
    assert len({c.message.content for c in sampled.choices}) > 1  # seeds 7, 8, 9, 10
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="x", messages=[{"role": "user", "content": "Hi"}], n=2, stream=True)


# -- 4. ollama's API -------------------------------------------------------------------------

def test_ollama_client(one, client):
    ollama = pytest.importorskip("ollama")
    c = ollama.Client(host=one[0])
    assert [m.model for m in c.list().models] == ["default"]
    want = client.chat.completions.create(model="x", messages=[{"role": "user", "content": "Hi"}], max_tokens=5)
    r = c.chat(model="default:latest", messages=[{"role": "user", "content": "Hi"}],
               options={"num_predict": 5, "temperature": 0})
    assert r.message.content == want.choices[0].message.content and r.done and r.eval_count == 5
    parts = list(c.chat(model="default", messages=[{"role": "user", "content": "Hi"}],
                        options={"num_predict": 5, "temperature": 0}, stream=True))
    assert "".join(p.message.content for p in parts) == r.message.content
    assert parts[-1].done and parts[-1].done_reason == "length" and not any(p.done for p in parts[:-1])
    g = c.generate(model="default", prompt="Hi", options={"num_predict": 5, "temperature": 0})
    assert g.response == r.message.content  # a non-raw prompt goes through the chat template
    raw = c.generate(model="default", prompt="Once upon", raw=True, options={"num_predict": 4, "temperature": 0})
    assert raw.response == client.completions.create(model="x", prompt="Once upon", max_tokens=4).choices[0].text
    js = c.chat(model="default", messages=[{"role": "user", "content": "JSON"}], format="json",
                options={"num_predict": 30, "temperature": 0})
    assert js.message.content.startswith("{")
    e = c.embed(model="default", input=["a cat", "a dog"])
    ref = client.embeddings.create(model="x", input=["a cat", "a dog"], encoding_format="float")
    np.testing.assert_allclose(e.embeddings, [d.embedding for d in ref.data], atol=1e-6)
    show = c.show("default")
    assert show.details.family == "qwen3moe" and show.modelinfo["qwen3moe.context_length"] == CTX
    assert [m.model for m in c.ps().models] == ["default"]
    # a conversation with a call and its result, in ollama's shapes (arguments as an object)
    history = [{"role": "user", "content": "Weather in Oslo?"},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
               {"role": "tool", "content": "21 C", "tool_name": "get_weather"}]
    t = c.chat(model="default", messages=history, tools=[OPEN_WEATHER], options={"num_predict": 2})
    short = c.chat(model="default", messages=history[:1], tools=[OPEN_WEATHER], options={"num_predict": 2})
    assert t.prompt_eval_count > short.prompt_eval_count + 10
    status, text, _ = call(one[0] + "/api/version")
    assert status == 200 and json.loads(text)["version"]
    # NDJSON by default, as ollama sends it
    status, text, headers = call(one[0] + "/api/generate", "POST", {"model": "default", "prompt": "Hi",
                                                                    "options": {"num_predict": 3}})
    lines = [json.loads(x) for x in text.splitlines()]
    assert status == 200 and headers["content-type"] == "application/x-ndjson" and lines[-1]["done"]


# -- 5. the Responses API --------------------------------------------------------------------

def test_responses_text_and_stream(client):
    want = client.chat.completions.create(model="x", messages=[{"role": "system", "content": "Be brief."},
                                                               {"role": "user", "content": "Hi"}], max_tokens=6)
    r = client.responses.create(model="x", instructions="Be brief.", input="Hi", max_output_tokens=6, temperature=0)
    assert r.output_text == want.choices[0].message.content
    assert r.status == "incomplete" and r.usage.output_tokens == 6
    events = list(client.responses.create(model="x", instructions="Be brief.", input="Hi", max_output_tokens=6,
                                          temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.incomplete"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == r.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}}, "required": ["name"]}
    s = client.responses.create(model="x", input="A name", max_output_tokens=40, temperature=0,
                                text={"format": {"type": "json_schema", "name": "n", "schema": schema}})
    assert set(json.loads(s.output_text)) == {"name"}
    with pytest.raises(openai.BadRequestError, match="previous_response_id"):
        client.responses.create(model="x", input="Go on", previous_response_id="resp_1")  # nothing is stored


def test_responses_function_tools(tools):
    c = openai.OpenAI(base_url=tools[0] + "/v1", api_key="unused", max_retries=0, timeout=300)
    tool = {"type": "function", "name": "get_weather", "description": "The weather in a city",
            "parameters": OPEN_WEATHER["function"]["parameters"]}
    r = c.responses.create(model="qwen3tools", input="Weather in Paris?", tools=[tool], tool_choice="required",
                           max_output_tokens=60, temperature=0)
    (item,) = [o for o in r.output if o.type == "function_call"]
    assert item.name == "get_weather" and set(json.loads(item.arguments)) == {"city"}
    # the call and its output go back as input items; the model answers
    back = c.responses.create(model="qwen3tools", tools=[tool], max_output_tokens=8, temperature=0, input=[
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": item.call_id, "name": item.name, "arguments": item.arguments},
        {"type": "function_call_output", "call_id": item.call_id, "output": "21 C"}])
    assert back.usage.input_tokens > r.usage.input_tokens
    streamed = list(c.responses.create(model="qwen3tools", input="Weather in Paris?", tools=[tool],
                                       tool_choice="required", max_output_tokens=60, temperature=0, stream=True))
    done = [e for e in streamed if e.type == "response.function_call_arguments.done"]
    assert [json.loads(e.arguments) for e in done] == [json.loads(item.arguments)]


# -- 6. CORS, /metrics, /tokenize, /detokenize, /props, /slots -------------------------------

def _options(url, origin):
    u = re.match(r"http://([^:/]+):(\d+)", url)
    conn = HTTPConnection(u.group(1), int(u.group(2)), timeout=60)
    conn.request("OPTIONS", "/v1/chat/completions", headers={
        "Origin": origin, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type"})
    r = conn.getresponse()
    r.read()
    conn.close()
    return r.status, r.getheader("access-control-allow-origin")


def test_cors(one):
    assert _options(one[0], "http://localhost:3000") == (200, "http://localhost:3000")
    assert _options(one[0], "http://127.0.0.1:5173") == (200, "http://127.0.0.1:5173")
    assert _options(one[0], "https://app.example") == (200, "https://app.example")  # --cors
    assert _options(one[0], "https://evil.example")[1] is None
    u = re.match(r"http://([^:/]+):(\d+)", one[0])
    conn = HTTPConnection(u.group(1), int(u.group(2)), timeout=60)
    conn.request("GET", "/v1/models", headers={"Origin": "https://evil.example"})
    r = conn.getresponse()
    r.read()
    assert r.getheader("access-control-allow-origin") is None


def test_tokenize_metrics_props_slots(one, ref, client):
    status, text, _ = call(one[0] + "/tokenize", "POST", {"content": "Hello world"})
    ids = json.loads(text)["tokens"]
    assert status == 200 and ids == ref.tokenize("Hello world", add_special=False)
    status, text, _ = call(one[0] + "/detokenize", "POST", {"tokens": ids})
    assert json.loads(text)["content"] == "Hello world"
    assert call(one[0] + "/detokenize", "POST", {"tokens": [10 ** 9]})[0] == 400
    client.chat.completions.create(model="x", messages=[{"role": "user", "content": "Hi"}], max_tokens=3)
    status, text, headers = call(one[0] + "/metrics")
    values = dict(re.findall(r"^(onebit_\w+) (\d+)$", text, re.M))
    assert status == 200 and headers["content-type"].startswith("text/plain")
    assert int(values["onebit_requests_total"]) >= 1 and int(values["onebit_tokens_generated_total"]) >= 3
    props = json.loads(call(one[0] + "/props")[1])
    assert props["n_ctx"] == CTX and props["default_generation_settings"]["params"]["temperature"] == 0
    slots = json.loads(call(one[0] + "/slots")[1])
    assert slots[0]["n_ctx"] == CTX and slots[0]["is_processing"] is False


def test_page_is_served(one):
    status, text, headers = call(one[0] + "/")
    assert status == 200 and headers["content-type"].startswith("text/html")
    assert "v1/chat/completions" in text and not re.search(r"(src|href)=\"https?://", text)  # nothing fetched


# -- 9. store names on every command ---------------------------------------------------------

def _stores(tmp_path):
    """An HF hub cache and an ollama store, each holding the shipped model."""
    hub = tmp_path / "hub" / "models--org--repo" / "snapshots" / "abc"
    hub.mkdir(parents=True)
    shutil.copy(DEFAULT, hub / "tiny-Q8_0.gguf")
    olla = tmp_path / "ollama"
    (olla / "manifests" / "registry.ollama.ai" / "library" / "tinymoe").mkdir(parents=True)
    (olla / "blobs").mkdir()
    shutil.copy(DEFAULT, olla / "blobs" / "sha256-00ff")
    (olla / "manifests" / "registry.ollama.ai" / "library" / "tinymoe" / "latest").write_text(json.dumps(
        {"layers": [{"mediaType": "application/vnd.ollama.image.model", "digest": "sha256:00ff"}]}))
    return tmp_path / "hub", olla


def test_store_names_on_every_command(tmp_path):
    hub, olla = _stores(tmp_path)
    env = {**os.environ, "HF_HUB_CACHE": str(hub), "OLLAMA_MODELS": str(olla), "HOME": str(tmp_path / "home")}
    onebit = [sys.executable, "-m", "onebit.cli.main"]
    want = subprocess.run([*onebit, "generate", "-m", DEFAULT, "-p", "Once upon", "-n", "4", "--temp", "0",
                           "--backend", "numpy"], capture_output=True, text=True, timeout=300, env=env)
    assert want.returncode == 0, want.stderr
    for name in ("tinymoe:latest", "tinymoe", "org/repo/tiny-Q8_0"):
        got = subprocess.run([*onebit, "generate", name, "-p", "Once upon", "-n", "4", "--temp", "0",
                              "--backend", "numpy"], capture_output=True, text=True, timeout=300, env=env)
        assert got.returncode == 0 and got.stdout == want.stdout, (name, got.stderr)
    r = subprocess.run([*onebit, "info", "tinymoe:latest"], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0 and "qwen3moe" in r.stdout, r.stderr
    r = subprocess.run([*onebit, "info", "nosuch:latest"], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 2 and "nosuch:latest: no such file" in r.stderr and "Traceback" not in r.stderr
    # --models-dir on a store gives the ids `list` shows for it
    for folder, ids in ((olla, ["tinymoe:latest"]), (hub, ["org/repo/tiny-Q8_0"])):
        r = subprocess.run([*onebit, "list", "--models-dir", str(folder), "--json"], capture_output=True, text=True,
                           timeout=120, env={**env, "HF_HUB_CACHE": str(tmp_path / "none"),
                                             "OLLAMA_MODELS": str(tmp_path / "none")})
        assert [e["id"] for e in json.loads(r.stdout) if e["source"] == "models-dir"] == ids
    # serve by a store name: the model answers by that name
    log = tmp_path / "server.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([*onebit, "serve", "tinymoe:latest", "--backend", "numpy", "--ctx", "256", "--port",
                                 "0"], stdout=out, stderr=out, env=env)
    try:
        url = None
        for _ in range(1200):
            m = re.search(r"on (http://127\.0\.0\.1:\d+)/v1", log.read_text())
            if m or proc.poll() is not None:
                url = m and m.group(1)
                break
            time.sleep(0.1)
        assert url, log.read_text()
        assert [m["id"] for m in json.loads(call(url + "/v1/models")[1])["data"]] == ["tinymoe:latest"]
    finally:
        proc.kill()
        proc.wait(30)


def test_ollama_system_store_searched(tmp_path):
    from onebit.formats.catalog import Stores, lookup

    hub, olla = _stores(tmp_path)
    stores = Stores(ollama=(tmp_path / "empty", olla))  # the user's store, then the system install's
    assert lookup("tinymoe", (), stores).path == str(olla / "blobs" / "sha256-00ff")
    assert lookup("org/repo/tiny-Q8_0", (), Stores(hf=hub)).source == "huggingface"
    assert lookup("nothing", (), stores) is None


# -- 7. the generic tool-call prompt, --chat-template ----------------------------------------

def test_generic_tool_prompt_by_hand(ref):
    import onebit
    from onebit.apps.tool_prompt import generic_tool_messages, template_shows_tools

    assert not template_shows_tools(ref)  # the shipped model's template has no tools
    q = onebit.load(fixture_path("qwen3moe-f32.gguf"), backend="numpy")
    q.chat_template = QWEN3_TEMPLATE
    assert template_shows_tools(q)
    msgs = [{"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
            {"role": "tool", "tool_call_id": "c1", "name": "get_weather", "content": "21 C"},
            {"role": "user", "content": "Thanks"}]
    got = generic_tool_messages(msgs, [OPEN_WEATHER])
    assert [m["role"] for m in got] == ["system", "user", "assistant", "user"]
    assert got[0]["content"].startswith("You can call functions.") and '"name": "get_weather"' in got[0]["content"]
    assert got[2]["content"] == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    assert got[3]["content"] == "<tool_response>\n21 C\n</tool_response>\nThanks"
    text = ref.apply_chat_template(got)
    assert "<tools>" in text and "<tool_response>\n21 C" in text


def test_tools_on_a_template_without_them(client):
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    plain = client.chat.completions.create(model="x", messages=msgs, max_tokens=1)
    auto = client.chat.completions.create(model="x", messages=msgs, tools=[OPEN_WEATHER], max_tokens=1)
    assert auto.usage.prompt_tokens > plain.usage.prompt_tokens + 50  # the tools are shown, not dropped
    r = client.chat.completions.create(model="x", messages=msgs, tools=[OPEN_WEATHER], tool_choice="required",
                                       max_tokens=80)
    (c,) = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and c.function.name == "get_weather"
    assert set(json.loads(c.function.arguments)) == {"city"}
    back = client.chat.completions.create(model="x", tools=[OPEN_WEATHER], max_tokens=4, messages=msgs + [
        r.choices[0].message.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": c.id, "content": "21 C"}])
    assert back.usage.prompt_tokens > auto.usage.prompt_tokens


def test_chat_template_file(tmp_path):
    path = tmp_path / "qwen3.jinja"
    path.write_text(QWEN3_TEMPLATE)
    proc, url = start([DEFAULT, "--backend", "numpy", "--ctx", str(CTX), "--chat-template-file", str(path),
                       "--jinja", "--api-key", "k"], tmp_path / "server.log")
    try:
        assert call(url + "/")[0] == 200 and call(url + "/props")[0] == 401  # the page itself needs no key
        u = re.match(r"http://([^:/]+):(\d+)", url)
        conn = HTTPConnection(u.group(1), int(u.group(2)), timeout=60)
        conn.request("GET", "/props", headers={"Authorization": "Bearer k"})
        props = json.loads(conn.getresponse().read())
        assert props["chat_template"] == QWEN3_TEMPLATE
        c = openai.OpenAI(base_url=url + "/v1", api_key="k", max_retries=0, timeout=300)
        r = c.chat.completions.create(model="x", messages=[{"role": "user", "content": "Hi"}], max_tokens=1,
                                      tools=[OPEN_WEATHER])
        import onebit

        m = onebit.load(DEFAULT, backend="numpy")
        m.chat_template = QWEN3_TEMPLATE
        want = m.chat_tokens([{"role": "user", "content": "Hi"}], tools=[OPEN_WEATHER])
        assert r.usage.prompt_tokens == len(want)  # Qwen3's template, showing the tool itself
    finally:
        stop_process(proc)
    for args in (["--chat-template", str(tmp_path / "none")], ["--chat-template-file", str(tmp_path / "none")],
                 ["--chat-template", str(path), "--chat-template-file", str(path)]):
        r = subprocess.run([sys.executable, "-m", "onebit.cli.main", "serve", *args, "--port", "0"],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and "--chat-template" in r.stderr and r.stderr.count("\n") == 1, r.stderr


# -- 8. the chat page in a browser -----------------------------------------------------------

class Page:
    """One browser tab over the DevTools protocol: `evaluate` runs JavaScript and returns its value."""

    def __init__(self, ws):
        self.ws = ws
        self.ids = itertools.count(1)

    def send(self, method: str, **params):
        i = next(self.ids)
        self.ws.send(json.dumps({"id": i, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv(timeout=WAIT_S))
            if msg.get("id") == i:
                if "error" in msg:
                    raise AssertionError(f"{method}: {msg['error']}")
                return msg.get("result", {})

    def evaluate(self, js: str):
        r = self.send("Runtime.evaluate", expression=js, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in r:
            raise AssertionError(f"{js}: {r['exceptionDetails']}")
        return r["result"].get("value")

    def wait(self, js: str, what: str):
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            value = self.evaluate(js)
            if value:
                return value
            time.sleep(0.1)
        raise AssertionError(f"the page never showed {what}")


@pytest.fixture
def browser(tmp_path):
    if CHROMIUM is None:
        pytest.skip("needs Debian's chromium (apt install chromium)")
    ws_client = pytest.importorskip("websockets.sync.client")
    proc = subprocess.Popen([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                             "--disable-extensions", "--remote-debugging-port=0", f"--user-data-dir={tmp_path / 'profile'}",
                             "about:blank"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        port = None
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline and port is None:
            line = proc.stderr.readline()
            if not line and proc.poll() is not None:
                break
            m = re.search(r"DevTools listening on ws://[^:]+:(\d+)/", line)
            port = int(m.group(1)) if m else None
        assert port, "chromium did not start its DevTools endpoint"
        targets = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=30).read())
        ws_url = next(t for t in targets if t["type"] == "page")["webSocketDebuggerUrl"]
        with ws_client.connect(ws_url, max_size=None, open_timeout=30) as ws:
            yield Page(ws)
    finally:
        stop_process(proc)


def test_chat_page_streams_a_reply(tmp_path, browser):
    """The chat page at `/` in a real headless browser (Debian's `chromium`, driven over the
    DevTools protocol): a message typed and sent; the reply streams in (several updates) and
    equals the API's own reply, with tokens per second shown; Stop ends a long reply."""
    proc, url = start([DEFAULT, "--backend", "numpy", "--ctx", "512"], tmp_path / "server.log")
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
        want = client.chat.completions.create(
            model="default", max_tokens=12, temperature=0,
            messages=[{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello there"}])
        browser.send("Page.enable")
        browser.send("Page.navigate", url=url + "/")
        browser.wait("document.readyState === 'complete' && document.getElementById('model').textContent",
                     "the model's name")
        assert browser.evaluate("document.getElementById('model').textContent") == "default"
        # count the reply's updates as they land (a streamed reply changes the text several times)
        browser.evaluate("""
            window.updates = 0;
            new MutationObserver(() => { window.updates += 1; })
              .observe(document.getElementById('log'), {childList: true, subtree: true, characterData: true});
            document.getElementById('temperature').value = '0';
            document.getElementById('max_tokens').value = '12';
            document.getElementById('system').value = 'You are terse.';
            const box = document.getElementById('input');
            box.focus();
            true""")
        browser.send("Input.insertText", text="Hello there")  # typed, as a user would
        browser.send("Input.dispatchKeyEvent", type="keyDown", key="Enter", code="Enter", windowsVirtualKeyCode=13)
        browser.send("Input.dispatchKeyEvent", type="keyUp", key="Enter", code="Enter", windowsVirtualKeyCode=13)
        stats = browser.wait("document.getElementById('stats').textContent", "the reply's statistics")
        assert re.match(r"12 tokens, [\d.]+ tokens/s", stats), stats
        reply = browser.evaluate("document.querySelector('.msg.assistant').textContent")
        assert reply == want.choices[0].message.content
        assert browser.evaluate("document.querySelector('.msg.user').textContent") == "Hello there"
        assert browser.evaluate("window.updates") > 3  # the reply came in pieces
        assert browser.evaluate("document.getElementById('send').disabled") is False
        # Stop: a long reply (150 tokens at temperature 0) stopped after its first piece, on the server too
        health = lambda: json.loads(call(url + "/health")[1])  # noqa: E731
        before = health()["generated"]
        browser.evaluate("""
            document.getElementById('max_tokens').value = '300';
            document.getElementById('input').value = 'Tell me a long story.';
            document.getElementById('form').requestSubmit();
            true""")
        browser.wait("(document.querySelectorAll('.msg.assistant')[1] || {}).textContent", "the second reply")
        browser.evaluate("document.getElementById('stop').click(); true")
        browser.wait("!document.getElementById('send').disabled", "Send enabled again")
        for _ in range(600):
            h = health()
            if not h["busy"]:
                break
            time.sleep(0.05)
        assert not h["busy"] and 0 < h["generated"] - before < 100
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)

