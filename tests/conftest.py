from __future__ import annotations

import os
from pathlib import Path

# The suite runs two processes on two cores (pytest -n 2): their kernel threads sleep between
# parallel regions rather than spin (backends/cpu/threads.wait_policy decides by the load average,
# which lags behind two workers that start together).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import functools
import shutil
import tempfile

# What the `onebit` processes the tests start keep between runs (tokenizer rankings, expert-pool
# records) goes to a folder of this test run's own, not to the user's ~/.cache/onebit; made by
# the first process of the run (pytest -n's workers inherit it) and removed when that one ends.
_CACHE_MADE = None
if "ONEBIT_CACHE_DIR" not in os.environ:
    _CACHE_MADE = os.environ["ONEBIT_CACHE_DIR"] = tempfile.mkdtemp(prefix="onebit-tests-cache-")

import numpy as np
import pytest

FIXTURES = Path(__file__).parent / "fixtures"


def pytest_unconfigure(config):
    if _CACHE_MADE is not None:
        shutil.rmtree(_CACHE_MADE, ignore_errors=True)


def pytest_configure(config):
    config.addinivalue_line("markers", "kernels_of(*paths): the test starts processes that run these model files "
                            "on the cpu backend; their kernels are compiled before it (_kernels_of_files)")


@pytest.fixture(scope="session")
def cpu_kernels():
    """The cpu backend's all-types kernels (backends/cpu: products, small ops, repacks), which the
    tests of single kernels call, compiled into numba's disk cache before the first such test:
    the parts side by side (a cold compile is minutes of one core), then loaded. Without it each
    test compiled what it called on its own core, and under pytest -n both workers compiled the
    same kernels side by side. A worker that finds another filling the cache waits for it
    (Kernels.fill_cache's lock) and loads what it compiled. Nothing compiles before a test asks."""
    from onebit.backends.cpu import kernel_sets

    kernel_sets.fill_cache()  # (a part that fails here is compiled again, and reported, by its tests)
    return kernel_sets.EVERY


@functools.cache
def _fill_kernels_of(path: str) -> None:
    from onebit.backends.cpu import CpuBackend, kernel_sets
    from onebit.formats.gguf_file import GGUFFile

    g = GGUFFile(path)
    kernel_sets.kernels_for(g, CpuBackend.memory_policy(g).repacks).fill_cache()


@pytest.fixture(autouse=True)
def _kernels_of_files(request):
    """For a test marked kernels_of(path, ..): the kernels the cpu backend takes for those files
    (kernels_for: the file's own types, or the all-types kernels once cached), compiled here
    before the test, so that the `onebit` processes it starts load them rather than compile them
    within the test's timeout. Once per file and worker."""
    for mark in request.node.iter_markers("kernels_of"):
        for path in mark.args:
            _fill_kernels_of(str(path))


FAST_TIER = Path(__file__).parent / "fast_tier.txt"  # node ids of the fast tier (tools/pick_fast_tier.py)


def pytest_collection_modifyitems(config, items):
    """Mark the fast tier's tests `fast` (`pytest -m fast`; test_fast_tier.py checks the list
    names tests that exist)."""
    listed = fast_tier()
    for item in items:
        if item.nodeid in listed:
            item.add_marker(pytest.mark.fast)


def fast_tier() -> set[str]:
    return {ln.strip() for ln in FAST_TIER.read_text().splitlines() if ln.strip() and not ln.startswith("#")}


def fixture_path(name: str) -> Path:
    p = FIXTURES / name
    if not p.exists():
        raise FileNotFoundError(f"fixture {p} is missing: run tools/make_fixtures.py (see tests/fixtures/README.md)")
    return p


def cosine_rows(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = a.astype(np.float64)
    b = b.astype(np.float64)
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


@pytest.fixture(scope="session")
def fixtures_dir() -> Path:
    return FIXTURES


def run_cli(monkeypatch, capsys, *args):
    """`onebit ARGS` in this process: (exit code, stdout, stderr)."""
    import sys

    from onebit.cli.main import main
    from onebit.formats import tokenizer

    monkeypatch.setattr(sys, "argv", ["onebit", *args])
    before = tokenizer.cache_dir()
    try:
        with pytest.raises(SystemExit) as e:
            main()
    finally:
        tokenizer.set_cache_dir(before)  # (main sets the user's cache folder: not for the tests after)
    out, err = capsys.readouterr()
    return e.value.code, out, err


def chat_repl_output(model, sampler, monkeypatch, capsys, show: bool, message: str = "Hi!") -> str:
    """One chat REPL turn (`message`, then end of input) with colour on and the model's replies
    scripted by `sampler`: what it printed, with the dim escape's per-piece restarts joined."""
    from onebit.apps import chat as chat_mod
    from onebit.cli import chat_repl

    lines = iter([message])

    def fake_input(prompt=""):
        try:
            return next(lines)
        except StopIteration:
            raise EOFError from None

    monkeypatch.setattr("builtins.input", fake_input)
    monkeypatch.setattr(chat_mod, "make_sampler", lambda *a, **kw: sampler)
    monkeypatch.setattr(chat_repl, "_colour", lambda: True)
    chat_repl.run_chat(model, show_reasoning=show, temperature=0.0, max_tokens=200)
    return capsys.readouterr().out.replace("\033[0m\033[2m", "")  # (dimmed piece by piece as it streams)


def greedy_tokens(m, ids: np.ndarray, n: int) -> list[int]:
    """n greedy tokens after prompt ids, one forward per token."""
    cache = m.new_cache()
    logits = m.net.forward(ids, cache, last_only=True)
    out = []
    for _ in range(n):
        tok = int(np.argmax(logits[-1]))
        out.append(tok)
        logits = m.net.forward(np.array([tok], np.int64), cache)
    return out


def stop_process(proc) -> None:
    """SIGTERM a server process the test started; kill it if it has not ended in 30 s."""
    import signal
    import subprocess

    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
