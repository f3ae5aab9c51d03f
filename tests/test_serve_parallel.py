"""`onebit serve --parallel N` through real concurrent HTTP clients: requests decode together
(their forwards batched), each greedy reply the one it gets sent alone; a dropped client leaves
the others running; /slots and /metrics show the N slots; a hybrid (recurrent) model keeps two
conversations' prefixes side by side, through checkpoints; the prompt cache (--cache-ram) keeps
conversations' prefixes beyond the slots, counted by /metrics and by the memory plan."""

from __future__ import annotations

import json
import re
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("llguidance")
pytest.importorskip("fastapi")

from conftest import fixture_path, stop_process  # noqa: E402
from test_serve import DEFAULT, ban, call, drop_stream, long_stream, start  # noqa: E402, F401 (ban is a fixture)

WAIT_S = 60  # bounds on polling loops (hang guards), never asserted as timings
PROMPTS = ["The capital of France is", "Once upon a time, in a land far away,", "1, 2, 3, 4,",
           "def fibonacci(n):"]
LENGTHS = [24, 9, 17, 30]  # tokens each: the requests leave the batch at different steps


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    proc, url = start([DEFAULT, "--backend", "numpy", "--ctx", "512", "--temp", "0", "--parallel", "4"],
                      tmp_path_factory.mktemp("parallel") / "server.log")
    try:
        yield url
    finally:
        stop_process(proc)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=300)


def metrics(url: str) -> dict[str, float]:
    text = call(url + "/metrics")[1]
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(\w+) (\S+)$", text, re.M)}


# per request: a stop string; seeded sampling, each request its own sampler (on numpy a row's logits
# beside others differ from alone in their last bits at most: no draw here lies that close to an edge)
OPTIONS = [{}, {"temperature": 0.9, "seed": 11}, {"stop": [","]}, {"temperature": 0.7, "top_k": 20, "seed": 5}]


def ask(client, i: int) -> tuple[str, str]:
    """Request i: even ones through the completions API, odd ones as a streamed chat."""
    kw = {"temperature": 0, **OPTIONS[i]}
    if i % 2 == 0:
        r = client.completions.create(model="default", prompt=PROMPTS[i], max_tokens=LENGTHS[i], **kw)
        return r.choices[0].text, r.choices[0].finish_reason
    parts, finish = [], None
    extra = {"top_k": kw.pop("top_k")} if "top_k" in kw else None
    for chunk in client.chat.completions.create(model="default", messages=[{"role": "user", "content": PROMPTS[i]}],
                                                max_tokens=LENGTHS[i], stream=True, extra_body=extra, **kw):
        if chunk.choices:
            parts.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
    return "".join(parts), finish


def concurrently(fn, n: int) -> dict[int, object]:
    got, errors = {}, []

    def run(i):
        try:
            got[i] = fn(i)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors
    return got


def test_four_concurrent_requests_equal_one_at_a_time(server, client):
    alone = [ask(client, i) for i in range(4)]
    shared = metrics(server)["onebit_batched_steps_total"]
    got = concurrently(lambda i: ask(client, i), 4)
    assert [got[i] for i in range(4)] == alone
    assert all(text for text, _ in alone)
    assert alone[2][1] == "stop" and "," not in alone[2][0]  # (the stop string cut the reply)
    # they ran together: steps over several requests' rows
    assert metrics(server)["onebit_batched_steps_total"] > shared


@pytest.mark.kernels_of(DEFAULT)
def test_cpu_backend_concurrent_requests_equal_one_at_a_time(tmp_path):
    proc, url = start([DEFAULT, "--backend", "cpu", "--ctx", "512", "--temp", "0", "--parallel", "4"],
                      tmp_path / "server.log")
    try:
        c = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
        alone = [ask(c, i) for i in range(4)]
        got = concurrently(lambda i: ask(c, i), 4)
        assert [got[i] for i in range(4)] == alone
        assert metrics(url)["onebit_batched_steps_total"] > 0
    finally:
        stop_process(proc)


def test_slots_and_metrics_show_the_slots(server, client):
    slots = json.loads(call(server + "/slots")[1])
    assert [s["id"] for s in slots] == [0, 1, 2, 3]
    assert json.loads(call(server + "/props")[1])["total_slots"] == 4
    m = metrics(server)
    assert m["onebit_slots"] == 4 and m["onebit_requests_processing"] == 0
    # a prompt sent again goes to the slot that holds it: its prefix is reused
    first = client.completions.create(model="default", prompt=PROMPTS[0] + " Paris.", max_tokens=2, temperature=0)
    again = client.completions.create(model="default", prompt=PROMPTS[0] + " Paris.", max_tokens=2, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens == first.usage.prompt_tokens - 1


def test_dropped_client_leaves_the_others_running(server, client, ban):
    want = ask(client, 2)
    before = metrics(server)["onebit_tokens_generated_total"]
    conn, r = long_stream(server, ban, 400)
    got = concurrently(lambda i: ask(client, 2), 2)  # two more beside the long one
    drop_stream(conn, r)  # the client goes away mid-stream
    assert got[0] == got[1] == want
    deadline = time.monotonic() + WAIT_S
    while metrics(server)["onebit_requests_processing"] and time.monotonic() < deadline:
        time.sleep(0.05)
    m = metrics(server)
    assert m["onebit_requests_processing"] == 0
    assert m["onebit_tokens_generated_total"] - before < 2 * LENGTHS[2] + 400  # the long one stopped short


def test_hybrid_model_keeps_two_conversations(tmp_path):
    """qwen3next (Gated DeltaNet layers: their state cannot trim) with two slots: greedy replies
    together equal to alone; a conversation that goes on after another one ran reuses its
    prefix (a checkpoint of its slot), which one shared cache would have lost."""
    proc, url = start([str(fixture_path("qwen3next-f32.gguf")), "--backend", "numpy", "--temp", "0",
                       "--parallel", "2"], tmp_path / "server.log")
    try:
        c = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
        prompts = ["a b c d e f g h i j", "one two three four five six seven"]

        def complete(p, n=12):
            return c.completions.create(model="m", prompt=p, max_tokens=n, temperature=0)

        alone = [complete(p).choices[0].text for p in prompts]
        got = concurrently(lambda i: complete(prompts[i]).choices[0].text, 2)
        assert [got[0], got[1]] == alone
        a = complete(prompts[0])
        complete(prompts[1])  # the other conversation, between A's turns
        more = complete(prompts[0] + a.choices[0].text + " k l m")
        assert more.usage.prompt_tokens_details.cached_tokens >= a.usage.prompt_tokens - 1
    finally:
        stop_process(proc)


@pytest.mark.parametrize("model", [DEFAULT, str(fixture_path("qwen3next-f32.gguf"))], ids=["default", "hybrid"])
def test_prompt_cache_keeps_conversations_beyond_the_slots(tmp_path, model):
    """Two chats taking turns on one slot: with --cache-ram each turn gets its conversation's
    prefix back from the prompt cache (the other's was saved, not dropped), counted by /metrics;
    every greedy reply is the one a server without saved prefixes gives. The hybrid model
    (qwen3next: recurrent state) gets its checkpoints back with it."""
    servers = [start([model, "--backend", "numpy", "--ctx", "512", "--temp", "0", "--cache-ram", ram],
                     tmp_path / f"server-{ram}.log") for ram in ("64", "0")]
    try:
        turns = {}
        for (_, url), ram in zip(servers, ("64", "0")):
            c = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
            chats = {"a": [{"role": "user", "content": "Tell me about the history of the city of Rome."}],
                     "b": [{"role": "user", "content": "Write a short poem about autumn leaves falling."}]}
            got = []
            for who in "abab":
                r = c.chat.completions.create(model="m", messages=chats[who], max_tokens=8, temperature=0)
                text = r.choices[0].message.content
                chats[who] += [{"role": "assistant", "content": text}, {"role": "user", "content": "Go on."}]
                got.append((text, r.usage.prompt_tokens, r.usage.prompt_tokens_details.cached_tokens))
            turns[ram] = got, metrics(url)
        (cached, m), (fresh, m0) = turns["64"], turns["0"]
        assert [t[0] for t in cached] == [t[0] for t in fresh]
        for first, again in ((cached[0], cached[2]), (cached[1], cached[3])):  # each chat's second turn
            assert again[2] >= first[1] - 1  # its first prompt was held (recurrent state: but its last token)
        for first, again in ((fresh[0], fresh[2]), (fresh[1], fresh[3])):
            assert again[2] < first[1] - 1  # one slot, no saved prefixes: the other chat's turn overwrote it
        assert m["onebit_prompt_cache_loads_total"] == 2 and m0["onebit_prompt_cache_loads_total"] == 0
        assert m["onebit_prompt_cache_saves_total"] == 3  # a, then b, then a again
        assert m["onebit_prompt_cache_budget_bytes"] == 64 << 20 and m0["onebit_prompt_cache_budget_bytes"] == 0
        assert m["onebit_prompt_tokens_cached_total"] == sum(t[2] for t in cached)
        assert m["onebit_prompt_tokens_total"] == sum(t[1] for t in cached)
    finally:
        for proc, _ in servers:
            stop_process(proc)


def test_embeddings_and_another_model_beside_running_requests(tmp_path):
    """With --models-dir: a request for another model waits for the running ones to end, then
    loads it; an embedding runs between the batch's steps; every answer is the one it gets alone."""
    import shutil

    models = tmp_path / "models"
    models.mkdir()
    shutil.copy(fixture_path("qwen3moe-f32.gguf"), models / "other.gguf")
    proc, url = start([DEFAULT, "--backend", "numpy", "--ctx", "512", "--temp", "0", "--parallel", "2",
                       "--models-dir", str(models)], tmp_path / "server.log")
    try:
        c = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
        jobs = [lambda: c.completions.create(model="default", prompt=PROMPTS[0], max_tokens=20,
                                             temperature=0).choices[0].text,
                lambda: c.completions.create(model="other", prompt=PROMPTS[1], max_tokens=8,
                                             temperature=0).choices[0].text,
                lambda: c.embeddings.create(model="default", input="hello there").data[0].embedding,
                lambda: c.completions.create(model="default", prompt=PROMPTS[3], max_tokens=12,
                                             temperature=0).choices[0].text]
        alone = [job() for job in jobs]
        got = concurrently(lambda i: jobs[i](), len(jobs))
        assert [got[i] for i in range(len(jobs))] == alone
    finally:
        stop_process(proc)


def test_a_step_holds_at_most_its_rows():
    """The Batcher's steps: every member's hand-in once per step; fewest rows first, and a prompt
    chunk past `step_rows` waits for the next step (the memory plan counts step_rows)."""
    from types import SimpleNamespace

    from onebit.apps.serve_batch import Batcher

    steps = []

    def forward_batch(seqs, hook=None, last_only=()):
        steps.append(sorted(len(ids) for ids, _ in seqs))
        return [np.zeros((1, 4), np.float32) for _ in seqs]

    model = SimpleNamespace(net=SimpleNamespace(forward_batch=forward_batch), hook=None)
    b = Batcher(lambda: model, step_rows=260)
    hand_ins = [[1] * 256, [1] * 256, [1], [1] * 3]  # two prompt chunks, a decode row, verify rows
    for _ in hand_ins:
        b.join()

    def member(rows):
        b.forward(rows, None, True)
        b.leave()

    threads = [threading.Thread(target=member, args=(rows,)) for rows in hand_ins]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_S)
    b.close()
    assert steps == [[1, 3, 256], [256]]


def test_parallel_needs_a_backend_that_batches(capsys):
    """A backend that runs one sequence per forward refuses --parallel > 1 at start."""
    import onebit
    from onebit.apps.serve import Engine, Sampling
    from onebit.errors import UsageError

    m = onebit.load(fixture_path("qwen3moe-f32.gguf"), backend="numpy")
    m.be.batches_sequences = False  # (as a backend class that declares none)
    with pytest.raises(UsageError, match="--parallel 2: the numpy backend runs one sequence per forward"):
        Engine(m, Sampling(), parallel=2)
    m.close()


def test_vulkan_concurrent_requests_equal_one_at_a_time(tmp_path):
    """`onebit serve --backend vulkan --parallel 3` (Mesa's lavapipe here): each request's reply
    beside the others is the one it gets alone, and steps ran over several requests' rows."""
    log = tmp_path / "server.log"
    proc, url = start([DEFAULT, "--backend", "vulkan", "--ctx", "512", "--temp", "0", "--parallel", "3"], log)
    try:
        assert "warning" not in log.read_text()  # (Vulkan loaded: no fallback to another backend)
        c = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
        alone = [ask(c, i) for i in range(3)]
        shared = metrics(url)["onebit_batched_steps_total"]
        got = concurrently(lambda i: ask(c, i), 3)
        assert [got[i] for i in range(3)] == alone
        assert all(text for text, _ in alone)
        assert metrics(url)["onebit_batched_steps_total"] > shared
    finally:
        stop_process(proc)


def test_parallel_out_of_range_is_refused():
    import subprocess

    for n in ("0", "65"):
        r = subprocess.run([sys.executable, "-m", "onebit.cli.main", "serve", DEFAULT, "--parallel", n],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 2
        assert r.stderr.strip() == f"onebit: error: --parallel must be 1-64 (the open connections served), got {n}"


def test_parallel_caches_that_do_not_fit_are_refused():
    """--parallel asks for its caches: a plan that cannot hold them is refused, not loaded anyway."""
    import subprocess

    from onebit.backends.numpy_backend import NumpyBackend
    from onebit.formats.gguf_file import GGUFFile
    from onebit.memory.budget import detect_budget
    from onebit.memory.plan import plan_load
    from onebit.models import network_class

    path = fixture_path("qwen3moe-f32.gguf")
    g = GGUFFile(path)
    cfg = network_class(g.architecture, g.path).config(g)
    one, many = (plan_load(g, cfg, detect_budget("1GiB"), ctx=512, policy=NumpyBackend.memory_policy(g),
                           sequences=n).total for n in (1, 64))
    budget = (one + many) // 2  # room for one sequence's cache, not for 64
    r = subprocess.run([sys.executable, "-m", "onebit.cli.main", "serve", str(path), "--backend", "numpy",
                        "--parallel", "64", "--ctx", "512", "--budget", str(budget), "--port", "0"],
                       capture_output=True, text=True, timeout=120)
    last = r.stderr.strip().splitlines()[-1]
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert last.startswith("onebit: error: ") and "the memory plan needs" in last and "--parallel 64" in last


def test_prompt_cache_is_planned():
    """`onebit plan --cache-ram` counts the saved prefixes (auto: what the plan leaves within its
    margin); serve refuses a negative --cache-ram, and one its budget cannot hold, in one line."""
    import subprocess

    from onebit.backends.numpy_backend import NumpyBackend
    from onebit.formats.gguf_file import GGUFFile
    from onebit.memory.budget import detect_budget
    from onebit.memory.plan import DEFAULT_PROMPT_CACHE, RESIDENT_SHARE, plan_load, prompt_cache_bytes
    from onebit.models import network_class

    path = fixture_path("qwen3moe-f32.gguf")
    g = GGUFFile(path)
    cfg = network_class(g.architecture, g.path).config(g)
    policy = NumpyBackend.memory_policy(g)

    def plan(budget, cache):
        return plan_load(g, cfg, detect_budget(budget), ctx=512, policy=policy, sequences=2, prompt_cache=cache)

    none, some = plan("1GiB", 0), plan("1GiB", 100 << 20)
    assert prompt_cache_bytes(none) == 0 and prompt_cache_bytes(some) == 100 << 20
    assert some.total - none.total == 100 << 20
    auto = plan("1GiB", None)  # (the room left within the margin)
    assert prompt_cache_bytes(auto) == int(RESIDENT_SHARE * (1 << 30)) - none.total
    assert prompt_cache_bytes(plan("64GiB", None)) == DEFAULT_PROMPT_CACHE
    r = subprocess.run([sys.executable, "-m", "onebit.cli.main", "plan", str(path), "--backend", "numpy", "--ctx",
                        "512", "--parallel", "2", "--cache-ram", "100", "--budget", "1GiB", "--json"],
                       capture_output=True, text=True, timeout=120)
    items = {i["component"]: i["bytes"] for i in json.loads(r.stdout)["items"]}
    assert r.returncode == 0 and items["prompt cache"] == 100 << 20
    r = subprocess.run([sys.executable, "-m", "onebit.cli.main", "serve", str(path), "--cache-ram", "-1"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip() == "onebit: error: --cache-ram must be at least 0 MiB (0: no saved prefixes), got -1"
    r = subprocess.run([sys.executable, "-m", "onebit.cli.main", "serve", str(path), "--backend", "numpy", "--ctx",
                        "512", "--budget", "1GiB", "--cache-ram", "2048", "--port", "0"],
                       capture_output=True, text=True, timeout=120)
    last = r.stderr.strip().splitlines()[-1]
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert last.startswith("onebit: error: ") and "--cache-ram 2048" in last
