"""Batch output safety (issue 14): resume never deletes results, one run per output file,
outputs that are not regular files, write failures leave no torn line, ids, BOM, long prompts."""

from __future__ import annotations

import errno
import fcntl
import io
import json
import os
import resource
import signal
import subprocess
import sys

import pytest

import onebit
from conftest import fixture_path, run_cli
from onebit.apps import batch
from onebit.errors import UsageError

MODEL = str(fixture_path("qwen3moe-f32.gguf"))
pytestmark = pytest.mark.kernels_of(MODEL)  # (for its `onebit` processes)



def onebit_proc(*args, input=None, timeout=120):
    return subprocess.run([sys.executable, "-m", "onebit.cli.main", *args], capture_output=True, input=input,
                          timeout=timeout)


def rec(pid, text="t"):
    return json.dumps({"id": pid, "text": text}) + "\n"


def prompts_file(tmp_path, ids):
    p = tmp_path / "p.jsonl"
    p.write_text("".join(json.dumps({"id": i, "prompt": f"question {i} about json"}) + "\n" for i in ids))
    return p


def result_ids(path):
    return [json.loads(line)["id"] for line in path.read_text().splitlines() if line.startswith("{")]


# -- 1. resume keeps every result ---------------------------------------------------------


def test_resume_keeps_results_after_a_blank_or_unreadable_middle_line(tmp_path):
    out = tmp_path / "o.jsonl"
    body = rec("1") + "\n" + "not json at all\n" + rec("2") + "[1, 2]\n" + rec("3")
    out.write_text(body)
    with batch.ResultsFile.open(str(out)) as f:
        assert f.resume() == {"1", "2", "3"}
        assert f.unreadable_lines == [3, 5]  # reported; the blank line 2 is harmless
    assert out.read_text() == body  # nothing deleted


def test_resume_cuts_only_a_torn_final_line(tmp_path):
    out = tmp_path / "o.jsonl"
    out.write_text(rec("1") + "garbage\n" + '{"id": "2", "te')
    assert batch.completed_ids(str(out)) == {"1"}
    assert out.read_text() == rec("1") + "garbage\n"
    out.write_text(rec("1") + rec("2").rstrip("\n"))  # a whole result that only lost its newline: kept
    assert batch.completed_ids(str(out)) == {"1", "2"}
    assert out.read_text() == rec("1") + rec("2")


def test_cli_resume_after_a_bad_middle_line_regenerates_nothing(tmp_path, monkeypatch, capsys):
    p = prompts_file(tmp_path, ["a", "b", "c"])
    out = tmp_path / "o.jsonl"
    out.write_text(rec("a", "A") + "\n" + "oops\n" + rec("b", "B"))
    code, _, err = run_cli(monkeypatch, capsys, "generate", "-m", MODEL, "-i", str(p), "-o", str(out), "-n", "2")
    assert code == 0, err
    assert result_ids(out) == ["a", "b", "c"]  # a and b kept, only c generated
    assert "oops\n" in out.read_text() and "kept" in err


# -- 2. one run per output file -------------------------------------------------------------


def test_second_writer_of_an_output_is_refused_naming_the_holder(tmp_path):
    out = tmp_path / "o.jsonl"
    with batch.ResultsFile.open(str(out)):
        with pytest.raises(UsageError, match=f"another onebit run \\(pid {os.getpid()}\\)") as e:
            batch.ResultsFile.open(str(out))
        assert e.value.exit_code == 2
    batch.ResultsFile.open(str(out)).close()  # released when the first run closes


def test_cli_refuses_an_output_another_run_holds(tmp_path):
    p = prompts_file(tmp_path, ["a"])
    out = tmp_path / "o.jsonl"
    out.touch()
    with open(out, "ab") as held:  # another run's lock, held by this test process
        fcntl.flock(held.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        r = onebit_proc("generate", "-m", MODEL, "-i", str(p), "-o", str(out), "-n", "2")
    err = r.stderr.decode()
    assert r.returncode == 2 and err.count("\n") == 1 and f"pid {os.getpid()}" in err, err
    assert out.read_text() == ""


# -- 3. outputs and inputs that are not regular files ---------------------------------------


def test_output_dash_is_stdout(tmp_path):
    p = prompts_file(tmp_path, ["a", "b"])
    r = onebit_proc("generate", "-m", MODEL, "-i", str(p), "-o", "-", "-n", "2")
    assert r.returncode == 0, r.stderr
    assert [json.loads(line)["id"] for line in r.stdout.decode().splitlines()] == ["a", "b"]
    assert not (tmp_path / "-").exists()


def test_output_dev_null_works(tmp_path, monkeypatch, capsys):
    p = prompts_file(tmp_path, ["a"])
    code, _, err = run_cli(monkeypatch, capsys, "generate", "-m", MODEL, "-i", str(p), "-o", os.devnull, "-n", "2")
    assert code == 0, err


def test_resume_never_reads_a_device():
    assert batch.completed_ids("/dev/zero") == set()  # an endless read before
    with batch.ResultsFile.open("/dev/zero") as f:
        assert not f.regular and f.resume() == set()


def test_fifo_output_without_a_reader_is_refused_not_a_hang(tmp_path, monkeypatch, capsys):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    p = prompts_file(tmp_path, ["a"])
    code, _, err = run_cli(monkeypatch, capsys, "generate", "-m", MODEL, "-i", str(p), "-o", str(fifo))
    assert code == 2 and "no reader" in err


def test_fifo_output_whose_reader_goes_away_is_an_error(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    with batch.ResultsFile.open(str(fifo)) as f:
        f.write({"id": "1"})
        assert os.read(reader, 100) == b'{"id": "1"}\n'
        os.close(reader)
        with pytest.raises(batch.OutputError, match="reader went away"):
            f.write({"id": "2"})


def test_fifo_input_is_read_once(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    out = tmp_path / "o.jsonl"
    proc = subprocess.Popen([sys.executable, "-m", "onebit.cli.main", "generate", "-m", MODEL, "-i", str(fifo),
                             "-o", str(out), "-n", "2"], stderr=subprocess.PIPE)
    with open(fifo, "wb") as w:  # blocks until onebit opens it for reading
        w.write(b"one\ntwo\n")
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert result_ids(out) == ["1", "2"]


def test_endless_input_line_is_refused():
    with open("/dev/zero", "rb") as f:
        with pytest.raises(batch.PromptFileError, match="longer than"):
            list(batch.read_prompts(f, name="/dev/zero"))


# -- 4. write failures: one line, exit 1, no torn line, a rerun resumes ---------------------


def _failing_write(monkeypatch, path, after, how):
    """Make os.write on `path` fail after `after` successful writes: how = 'short' or an errno."""
    real = os.write
    count = [0]

    def write(fd, data):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}") == str(path)
        except OSError:
            target = False
        if target:
            count[0] += 1
            if count[0] > after:
                if how == "short":
                    return real(fd, bytes(data)[: len(data) // 2])
                raise OSError(how, os.strerror(how))
        return real(fd, data)

    monkeypatch.setattr(os, "write", write)


@pytest.mark.parametrize("how", ["short", errno.ENOSPC, errno.EIO])
def test_write_failure_leaves_no_torn_line(tmp_path, how):
    out = tmp_path / "o.jsonl"
    mp = pytest.MonkeyPatch()
    try:
        with batch.ResultsFile.open(str(out)) as f:
            f.write({"id": "1", "text": "a"})
            _failing_write(mp, out, 0, how)
            with pytest.raises(batch.OutputError, match="rerun") as e:
                f.write({"id": "2", "text": "b" * 1000})
            assert e.value.exit_code == 1
    finally:
        mp.undo()
    assert out.read_text() == json.dumps({"id": "1", "text": "a"}) + "\n"


@pytest.mark.parametrize("how", ["short", errno.ENOSPC, errno.EIO])
def test_cli_write_failure_exits_1_and_a_rerun_resumes(tmp_path, monkeypatch, capsys, how):
    p = prompts_file(tmp_path, ["a", "b", "c"])
    out = tmp_path / "o.jsonl"
    args = ("generate", "-m", MODEL, "-i", str(p), "-o", str(out), "-n", "2")
    with monkeypatch.context() as mp:
        _failing_write(mp, out, 1, how)
        code, _, err = run_cli(mp, capsys, *args)
    why = "bytes written" if how == "short" else os.strerror(how)
    assert code == 1 and why in err and "internal error" not in err, err
    assert len([ln for ln in err.splitlines() if ln.strip()]) == 1, err
    assert result_ids(out) == ["a"] and out.read_text().endswith("\n")
    code, _, err = run_cli(monkeypatch, capsys, *args)
    assert code == 0, err
    assert result_ids(out) == ["a", "b", "c"]


def test_file_size_limit_mid_line_leaves_no_torn_line(tmp_path):
    """A real short write: the kernel stops the write at RLIMIT_FSIZE (then EFBIG)."""
    p = prompts_file(tmp_path, ["a", "b"])
    out = tmp_path / "o.jsonl"
    out.write_text(rec("a"))
    limit = out.stat().st_size + 40  # room for part of b's line

    def limited():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    args = [sys.executable, "-m", "onebit.cli.main", "generate", "-m", MODEL, "-i", str(p), "-o", str(out), "-n", "2"]
    r = subprocess.run(args, capture_output=True, timeout=120, preexec_fn=limited)
    err = r.stderr.decode()
    assert r.returncode == 1 and err.count("\n") == 1 and "internal error" not in err, err
    assert out.read_text() == rec("a")  # b's partial line was cut back
    r = subprocess.run(args, capture_output=True, timeout=120)
    assert r.returncode == 0 and result_ids(out) == ["a", "b"]


def test_dev_full_output_is_one_line_exit_1(tmp_path):
    p = prompts_file(tmp_path, ["a"])
    r = onebit_proc("generate", "-m", MODEL, "-i", str(p), "-o", "/dev/full", "-n", "2")
    err = r.stderr.decode()
    assert r.returncode == 1 and "No space left" in err and err.count("\n") == 1, err


def test_write_only_output_cannot_resume(tmp_path, monkeypatch):
    out = tmp_path / "o.jsonl"
    out.write_text(rec("1"))
    real = os.open

    def no_read(path, flags, *a):  # as a mode 0200 file for a user who is not root
        if str(path) == str(out) and flags & os.O_RDWR:
            raise PermissionError(errno.EACCES, "Permission denied")
        return real(path, flags, *a)

    monkeypatch.setattr(os, "open", no_read)
    with batch.ResultsFile.open(str(out)) as f:
        with pytest.raises(batch.OutputError, match="cannot read") as e:
            f.resume()
        assert e.value.exit_code == 1
    assert out.read_text() == rec("1")


# -- 5, 6. ids and the BOM ---------------------------------------------------------------------


def test_duplicate_ids_name_both_lines_and_7_is_the_same_id_as_quoted_7():
    src = b'{"id": 7, "prompt": "a"}\n{"id": "x", "prompt": "b"}\n{"id": "7", "prompt": "c"}\n{"id": "x", "prompt": "d"}\n'
    items = list(batch.read_prompts(io.BytesIO(src)))
    assert [type(i).__name__ for i in items] == ["PromptItem", "PromptItem", "BadLine", "BadLine"]
    assert items[0].id == "7"
    assert items[2].line == 3 and "duplicate id '7'" in items[2].reason and "line 1" in items[2].reason
    assert items[3].line == 4 and "line 2" in items[3].reason


def test_generated_ids_cannot_collide_with_given_ids():
    src = b'{"prompt": "no id"}\n{"id": "1", "prompt": "given 1"}\n{"id": 2, "prompt": "given 2"}\n{"prompt": "x"}\n'
    items = list(batch.read_prompts(io.BytesIO(src)))
    assert all(isinstance(i, batch.PromptItem) for i in items)
    ids = [i.id for i in items]
    assert len(set(ids)) == 4 and ids[1:3] == ["1", "2"]
    bad = list(batch.read_prompts(io.BytesIO(b'{"id": "#1", "prompt": "a"}\n')))
    assert isinstance(bad[0], batch.BadLine) and "reserved" in bad[0].reason


def test_bom_at_the_start_is_skipped():
    items = list(batch.read_prompts(io.BytesIO(b'\xef\xbb\xbf{"id": "a", "prompt": "hi"}\n{"id": "b", "prompt": "yo"}\n')))
    assert [(i.id, i.prompt) for i in items] == [("a", "hi"), ("b", "yo")]
    text = list(batch.read_prompts(io.BytesIO(b"\xef\xbb\xbfhello\n"), fmt="text"))
    assert text[0].prompt == "hello"


# -- 7. a prompt longer than the context -------------------------------------------------------


def test_prompt_longer_than_context_is_an_error_result():
    m = onebit.load(MODEL, n_ctx=16, backend="cpu")
    item = batch.PromptItem("a", 1, prompt="word " * 40)
    r = batch.generate_one(m, item, chat=True, system=None, seed=0, max_tokens=4)
    assert r["finish_reason"] == "error" and "16-token context" in r["error"] and "text" not in r
    ok = batch.generate_one(m, batch.PromptItem("b", 2, prompt="hi"), chat=False, system=None, seed=0, max_tokens=2)
    assert "error" not in ok and ok["generation_tokens"] >= 1


def test_cli_long_prompt_in_a_batch_and_alone(tmp_path, monkeypatch, capsys):
    p = tmp_path / "p.jsonl"
    p.write_text(json.dumps({"id": "long", "prompt": "word " * 600}) + "\n" + json.dumps({"id": "s", "prompt": "hi"}) + "\n")
    out = tmp_path / "o.jsonl"
    code, _, err = run_cli(monkeypatch, capsys, "generate", "-m", MODEL, "-i", str(p), "-o", str(out), "-n", "2")
    assert code == 0, err
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert recs[0]["id"] == "long" and recs[0]["finish_reason"] == "error" and "context" in err
    assert recs[1]["id"] == "s" and recs[1]["generation_tokens"] >= 1
    code, _, err = run_cli(monkeypatch, capsys, "generate", "-m", MODEL, "-p", "word " * 600, "-n", "2")
    assert code == 2 and "no room to generate" in err
