"""`onebit generate --input`: formats, resumption after a kill, bad lines, bad paths."""

from __future__ import annotations

import io
import json
import signal
import subprocess
import sys
import time

import pytest

from conftest import fixture_path
from onebit.apps import batch

MODEL = str(fixture_path("qwen3moe-f32.gguf"))
pytestmark = pytest.mark.kernels_of(MODEL, fixture_path("q3moe256-Q4_K_M.gguf"))  # (for its `onebit` processes)


def onebit(*args, input=None, timeout=300):
    return subprocess.run([sys.executable, "-m", "onebit.cli.main", *args], capture_output=True,
                          input=input, timeout=timeout)


def test_read_prompts_jsonl_and_text():
    src = b'{"id": "a", "prompt": "hi"}\n\n{"messages": [{"role": "user", "content": "yo"}]}\n{"prompt": ""}\nnot json\n'
    items = list(batch.read_prompts(io.BytesIO(src)))
    assert isinstance(items[0], batch.PromptItem) and items[0].id == "a" and items[0].prompt == "hi"
    assert items[1].id == "#3" and items[1].messages[0]["content"] == "yo"  # no id: "#" and its line
    assert isinstance(items[2], batch.BadLine) and items[2].line == 4 and "empty" in items[2].reason
    assert isinstance(items[3], batch.BadLine) and items[3].line == 5 and "JSON" in items[3].reason
    text = list(batch.read_prompts(io.BytesIO(b"first\nsecond \xff\nthird\n")))
    assert [getattr(i, "prompt", None) for i in text] == ["first", None, "third"]
    assert isinstance(text[1], batch.BadLine) and "UTF-8" in text[1].reason and text[1].line == 2


def test_completed_ids_cuts_a_torn_line(tmp_path):
    out = tmp_path / "o.jsonl"
    out.write_text('{"id": "1", "text": "a"}\n{"id": "2", "text": "b"}\n{"id": "3", "te')
    assert batch.completed_ids(str(out)) == {"1", "2"}
    assert out.read_text().endswith('"b"}\n')


def _prompts(tmp_path, n):
    p = tmp_path / "prompts.jsonl"
    p.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"question {i} about json"}) + "\n" for i in range(n)))
    return p


def test_batch_run_then_resume_after_kill(tmp_path):
    n = 10
    prompts = _prompts(tmp_path, n)
    out = tmp_path / "out.jsonl"
    slow = str(fixture_path("q3moe256-Q4_K_M.gguf"))  # slow enough per prompt to be killed mid-run

    def cmd(output):
        return [sys.executable, "-m", "onebit.cli.main", "generate", "--model", slow, "--input", str(prompts),
                "--output", str(output), "--max-tokens", "12", "--temperature", "0.8", "--seed", "5"]

    args = cmd(out)
    ref = tmp_path / "ref.jsonl"  # reference: an uninterrupted run
    r = subprocess.run(cmd(ref), capture_output=True, timeout=300)
    assert r.returncode == 0, r.stderr
    ref_recs = [json.loads(line) for line in ref.read_text().splitlines()]
    assert [x["id"] for x in ref_recs] == [f"p{i}" for i in range(n)]
    assert all({"text", "prompt_tokens", "generation_tokens", "finish_reason", "generation_tps"} <= set(x) for x in ref_recs)
    # killed run: wait until at least two results are written, then SIGKILL
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 240
    while time.time() < deadline and (not out.exists() or out.read_text().count("\n") < 2):
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    partial = out.read_text().count("\n")
    assert 2 <= partial < n, partial  # killed mid-run, with results already on disk
    r = subprocess.run(args, capture_output=True, timeout=300)
    assert r.returncode == 0, r.stderr
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(x["id"] for x in recs) == sorted(x["id"] for x in ref_recs)  # no duplicates, none lost
    by_id = {x["id"]: x["text"] for x in recs}
    assert by_id == {x["id"]: x["text"] for x in ref_recs}  # resumed results equal the uninterrupted run


def test_bad_line_skip_and_stop(tmp_path):
    p = tmp_path / "p.jsonl"
    p.write_text('{"id": "a", "prompt": "hello"}\n{"id": "b", "prompt": \n{"id": "c", "prompt": "bye"}\n')
    out = tmp_path / "o.jsonl"
    r = onebit("generate", "--model", MODEL, "--input", str(p), "--output", str(out), "--max-tokens", "3")
    assert r.returncode == 0
    assert f"{p}:2" in r.stderr.decode()
    assert [json.loads(x)["id"] for x in out.read_text().splitlines()] == ["a", "c"]
    out2 = tmp_path / "o2.jsonl"
    r = onebit("generate", "--model", MODEL, "--input", str(p), "--output", str(out2), "--max-tokens", "3",
               "--on-error", "stop")
    assert r.returncode == 2
    assert f"{p}:2" in r.stderr.decode() and "Traceback" not in r.stderr.decode()
    assert [json.loads(x)["id"] for x in out2.read_text().splitlines()] == ["a"]  # kept what was done


def test_stdin_text_input(tmp_path):
    out = tmp_path / "o.jsonl"
    r = onebit("generate", "--model", MODEL, "--input", "-", "--output", str(out), "--max-tokens", "3",
               input=b"one\ntwo\n")
    assert r.returncode == 0, r.stderr
    assert [json.loads(x)["id"] for x in out.read_text().splitlines()] == ["1", "2"]


def test_unwritable_output(tmp_path):
    r = onebit("generate", "--model", MODEL, "--prompt", "x", "--output", str(tmp_path / "no" / "dir" / "o.jsonl"))
    assert r.returncode == 2 and "cannot write" in r.stderr.decode()


def test_missing_input(tmp_path):
    r = onebit("generate", "--model", MODEL, "--input", str(tmp_path / "none.jsonl"), "--output", str(tmp_path / "o"))
    assert r.returncode == 2 and "none.jsonl" in r.stderr.decode()
