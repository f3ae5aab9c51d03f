"""`onebit generate --ray` (issue 37) on a local Ray instance: 2 workers give the single-process
run's results id by id; a driver killed with SIGKILL leaves a file a rerun completes exactly
once; a worker killed mid-run loses nothing and writes nothing twice; a worker whose model file
differs is refused, named; without Ray, --ray says how to install it.

One Ray instance serves the whole module (2 CPUs, a small object store, no dashboard); the
drivers under test are `onebit` subprocesses that connect to it, as on a real cluster."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time

import psutil
import pytest

from conftest import run_cli
from onebit.apps import cluster
from onebit.model import shipped_model_path

ray = pytest.importorskip("ray", reason="the cluster extra (ray) is not installed")

MODEL = shipped_model_path()
pytestmark = pytest.mark.kernels_of(MODEL)  # (for its workers)
N = 40
TIMINGS = {"prompt_seconds", "generation_seconds", "prompt_tps", "generation_tps"}


@pytest.fixture(scope="module")
def address():
    ray.init(address="local", num_cpus=2, include_dashboard=False, object_store_memory=80 << 20,
             log_to_driver=False, logging_level=logging.ERROR)
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    p = tmp_path_factory.mktemp("ray") / "prompts.jsonl"
    p.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"Question {i}: what is {i} times {i + 3}?"}) + "\n"
                         for i in range(N)))
    return p


def single_process(prompts, out, *args):
    """The reference: the same command without --ray, in this process."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sys, "argv", ["onebit", "generate", "-i", str(prompts), "-o", str(out), *args])
        with pytest.raises(SystemExit) as e:
            from onebit.cli.main import main

            main()
    assert e.value.code == 0
    return results(out)


@pytest.fixture(scope="module")
def greedy_ref(prompts, tmp_path_factory):
    return single_process(prompts, tmp_path_factory.mktemp("ref") / "greedy.jsonl", *GREEDY)


GREEDY = ("-n", "24")  # long enough per prompt for a kill to land mid-run


def results(path):
    """{id: result without its timings}; every id exactly once."""
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    ids = [r["id"] for r in recs]
    assert len(ids) == len(set(ids)), sorted(i for i in ids if ids.count(i) > 1)
    return {r["id"]: {k: v for k, v in r.items() if k not in TIMINGS} for r in recs}


def on_ray(address, prompts, out, *args):
    return [sys.executable, "-m", "onebit.cli.main", "generate", "-i", str(prompts), "-o", str(out),
            "--ray", address, "--workers", "2", *args]


def wait_for_lines(out, proc, n, timeout=120):
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        if out.exists() and out.read_text().count("\n") >= n:
            return
        time.sleep(0.02)
    raise AssertionError(f"{out}: fewer than {n} results before the run ended or {timeout} s passed")


def test_two_workers_give_the_single_process_results(address, prompts, tmp_path):
    sampled = ("-n", "6", "--temperature", "0.8", "--seed", "5")
    ref = single_process(prompts, tmp_path / "ref.jsonl", *sampled)
    out = tmp_path / "out.jsonl"
    r = subprocess.run(on_ray(address, prompts, out, *sampled, "--stats"), capture_output=True, timeout=180)
    err = r.stderr.decode()
    assert r.returncode == 0, err
    assert results(out) == ref and len(ref) == N
    rows = [line.split() for line in err.splitlines() if line[:1] in ("1", "2") and line.endswith(" ok")]
    assert len(rows) == 2 and all(int(row[5]) > 0 for row in rows), err  # both workers ran prompts
    assert sum(int(row[5]) for row in rows) == N, err


def test_driver_killed_then_rerun_completes_exactly_once(address, prompts, greedy_ref, tmp_path):
    out = tmp_path / "out.jsonl"
    args = on_ray(address, prompts, out, *GREEDY)
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_for_lines(out, proc, 3)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    partial = results(out)  # whole lines only
    assert 3 <= len(partial) < N
    assert all(partial[k] == greedy_ref[k] for k in partial)
    r = subprocess.run(args, capture_output=True, timeout=180)  # the killed driver's workers are gone
    assert r.returncode == 0, r.stderr.decode()
    assert results(out) == greedy_ref


def batch_workers(since):
    """The worker actors started after `since` (descendants of this process's raylet)."""
    return [p for p in psutil.Process().children(recursive=True)
            if any("BatchWorker" in part for part in _cmdline(p)) and _started(p) >= since]


def _started(p):
    try:
        return p.create_time() if p.status() != psutil.STATUS_ZOMBIE else 0.0
    except psutil.Error:
        return 0.0


def _cmdline(p):
    try:
        return p.cmdline()
    except psutil.Error:
        return []


def test_worker_killed_mid_run_loses_nothing(address, prompts, greedy_ref, tmp_path):
    out = tmp_path / "out.jsonl"
    since = time.time() - 1  # (create_time is rounded)
    proc = subprocess.Popen(on_ray(address, prompts, out, *GREEDY, "--stats"), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    wait_for_lines(out, proc, 3)
    victims = batch_workers(since)
    assert len(victims) == 2, victims
    victims[0].kill()
    _, err = proc.communicate(timeout=180)
    err = err.decode()
    assert proc.returncode == 0, err
    assert "was lost" in err and "went back to the queue" in err, err
    assert results(out) == greedy_ref  # none missing, none twice, each the single-process result


def test_worker_whose_model_file_differs_is_refused(address, tmp_path):
    other = tmp_path / "model.gguf"
    shutil.copyfile(MODEL, other)
    size = other.stat().st_size
    with open(other, "r+b") as f:  # same size; one byte changed inside a sampled block
        f.seek(size * 4 // 9 + 10)
        b = f.read(1)
        f.seek(size * 4 // 9 + 10)
        f.write(bytes([b[0] ^ 0xFF]))
    driver = cluster.Fingerprint.of(MODEL)
    assert cluster.Fingerprint.of(str(other)).difference(driver) == "same size, different content (header or sampled blocks)"
    with cluster.RayBatch(None, cluster.LoadSpec(path=str(other)), cluster.Work(), workers=2, say=lambda m: None) as rb:
        with pytest.raises(cluster.ModelMismatchError) as e:
            rb.start(driver)  # workers check their file against the driver's; nothing is loaded
    msg = str(e.value)
    assert e.value.exit_code == 2 and "differs from the driver's on 2 of 2 worker(s)" in msg, msg
    assert "worker 1 on node" in msg and "worker 2 on node" in msg and "same size, different content" in msg, msg


def test_fingerprint_sees_a_shorter_file(tmp_path):
    short = tmp_path / "short.gguf"
    short.write_bytes(open(MODEL, "rb").read()[:-1])
    why = cluster.Fingerprint.of(str(short)).difference(cluster.Fingerprint.of(MODEL))
    assert why == f"{os.path.getsize(MODEL) - 1} bytes, the driver's has {os.path.getsize(MODEL)}"


def test_without_ray_says_how_to_install_it(tmp_path, monkeypatch, capsys, prompts):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` fails as if it were not installed
    out = tmp_path / "out.jsonl"
    code, _, err = run_cli(monkeypatch, capsys, "generate", "-i", str(prompts), "-o", str(out), "--ray", "local")
    assert code == 2 and "pip install 'onebit[cluster]'" in err and err.count("\n") == 1, err
    assert not out.exists()


def test_every_worker_lost_stops_the_run_with_exit_1(address, tmp_path):
    from onebit.apps import batch

    out = tmp_path / "out.jsonl"
    items = [batch.PromptItem(f"p{i}", i + 1, prompt=f"question {i}") for i in range(4)]
    with cluster.RayBatch(None, cluster.LoadSpec(), cluster.Work(gen={"max_tokens": 2}), workers=2,
                          say=lambda m: None) as rb:
        rb.start(cluster.Fingerprint.of(MODEL))
        for w in rb.workers:
            ray.kill(w.actor)
        with batch.ResultsFile.open(str(out)) as f:
            with pytest.raises(cluster.ClusterError, match="every worker was lost") as e:
                rb.run(batch.BatchRun(f, "p.jsonl"), iter(items))
    assert e.value.exit_code == 1 and "rerun the same command to resume" in str(e.value)
    assert out.read_text() == ""


def test_a_prompt_whose_worker_is_lost_twice_gets_an_error_result(tmp_path):
    from collections import Counter, deque

    from onebit.apps import batch

    said = []
    rb = cluster.RayBatch(None, cluster.LoadSpec(), cluster.Work(), workers=2, say=said.append)
    killed = []

    class NoRay:  # the queue's bookkeeping alone: no Ray call (ray.kill with no Ray running would start one)
        kill = staticmethod(killed.append)

    rb.ray = NoRay()
    a, b = cluster.Worker(1, "actor a"), cluster.Worker(2, "actor b")
    rb.workers = [a, b]
    x, y = batch.PromptItem("x", 1, prompt="one"), batch.PromptItem("y", 2, prompt="two")
    out = tmp_path / "out.jsonl"
    with batch.ResultsFile.open(str(out)) as f:
        run = batch.BatchRun(f, "p.jsonl", warn=said.append)
        owner, queue, losses = {"r1": a, "r2": a}, deque(), Counter()
        a.in_flight.extend([("r1", x), ("r2", y)])  # x running, y waiting
        rb._lose(a, "killed", owner, queue, losses, run)
        assert list(queue) == [x, y] and owner == {} and not a.alive  # both back, in order
        queue.clear()
        owner["r3"] = b
        b.in_flight.append(("r3", x))
        rb._lose(b, "killed", owner, queue, losses, run)  # x's second loss while running
        assert list(queue) == [] and not b.alive
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(recs) == 1 and recs[0]["id"] == "x" and recs[0]["finish_reason"] == "error"
    assert "lost 2 times" in recs[0]["error"] and any("error result written" in m for m in said)
    assert killed == ["actor a", "actor b"]  # a lost worker is killed, so it sends nothing more


@pytest.mark.parametrize("args, says", [
    (("--workers", "2"), "go with --ray"),
    (("--ray", "local", "--trace", "t.jsonl"), "without --ray"),
    (("--ray", "local", "--workers", "0"), "at least 1"),
])
def test_bad_ray_arguments_are_one_line_exit_2(tmp_path, monkeypatch, capsys, prompts, args, says):
    out = tmp_path / "out.jsonl"
    code, _, err = run_cli(monkeypatch, capsys, "generate", "-i", str(prompts), "-o", str(out), *args)
    assert code == 2 and says in err and err.count("\n") == 1, err


def test_ray_without_input_is_refused(monkeypatch, capsys):
    code, _, err = run_cli(monkeypatch, capsys, "generate", "-p", "hi", "--ray", "local")
    assert code == 2 and "--ray runs a prompts file" in err, err
