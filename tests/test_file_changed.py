"""The model file changes under a running model (truncated, overwritten by a smaller file, zeroed
in place, replaced): one line naming the file and what changed, exit 1, results already written
kept. Was: a bare SIGBUS (exit 135, nothing on stderr), or garbage written with exit 0."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import onebit
from conftest import fixture_path
from onebit.errors import ModelFileChangedError

SRC = fixture_path("qwen3moe-f32.gguf")
SMALLER = fixture_path("qwen3-f32.gguf")
pytestmark = pytest.mark.kernels_of(SRC, SMALLER)  # (for its `onebit` processes)

# Runs the CLI with the backends' forward wrapped so that, once the first result is in the output
# file, the model file is changed: just before a forward ("during": its reads hit the changed
# file) or just after one ("between": before its logits are used).
DRIVER = r"""
import json, os, sys
path, out, change, when = sys.argv[1:5]
args = sys.argv[5:]
state = {"done": False}

def apply():
    if state["done"] or not os.path.exists(out) or not open(out).read().count("\n"):
        return
    state["done"] = True
    size = os.path.getsize(path)
    mtime = os.stat(path).st_mtime_ns
    if change == "truncate":
        os.truncate(path, 5000)
    elif change == "smaller":
        with open(path, "wb") as f:  # same file, new contents (cp smaller.gguf model.gguf)
            f.write(open(os.environ["SMALLER"], "rb").read())
    elif change == "zero":
        with open(path, "r+b") as f:
            f.write(bytes(size))
        if os.stat(path).st_mtime_ns == mtime:  # the same clock tick as the load: make it visible
            os.utime(path, ns=(mtime, mtime + 1_000_000_000))

def wrap(cls):
    forward = cls.forward
    def fwd(self, *a, **k):
        if when == "during":
            apply()
        r = forward(self, *a, **k)
        if when == "between":
            apply()
        return r
    cls.forward = fwd

from onebit.backends.numpy_backend import NumpyBackend
wrap(NumpyBackend)
if "vulkan" in args:
    from onebit.backends import BACKENDS
    from onebit.backends.vulkan.backend import VulkanBackend
    BACKENDS["vulkan"] = VulkanBackend  # a real Vulkan run, no fall back
    wrap(VulkanBackend)
from onebit.cli.main import main
sys.argv = ["onebit", "generate", "--model", path, "--output", out, *args]
main()
"""


def _run(tmp_path, change: str, when: str, *args: str):
    model = tmp_path / "m.gguf"
    model.write_bytes(SRC.read_bytes())
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("first prompt\nsecond prompt\nthird prompt\n")
    out = tmp_path / "out.jsonl"
    env = dict(os.environ, SMALLER=str(SMALLER))
    r = subprocess.run([sys.executable, "-c", DRIVER, str(model), str(out), change, when, "--input", str(prompts),
                        "--raw", "--max-tokens", "4", *args], capture_output=True, text=True, env=env, timeout=300)
    return model, out, r


EXPECT = {
    "truncate": r"size 773152 -> 5000 bytes \(truncated\?\)",
    "smaller": r"size 773152 -> 440928 bytes \(truncated\?\)",
    "zero": r"modified in place \(its mtime changed\)",
}

CASES = [
    ("truncate", "during", ()),  # numpy reads the memory map: a SIGBUS, caught by the handler
    ("truncate", "between", ()),
    ("smaller", "between", ()),
    ("zero", "during", ()),
    ("zero", "between", ()),
    ("truncate", "during", ("--slots", "2", "--budget", "1GiB")),  # streamed experts: the pool's reads
    ("zero", "between", ("--slots", "2", "--budget", "1GiB")),
    # streamed experts on Vulkan: 2 slots a layer miss every step, and the check after a
    # forward whose pool reads completed finds the change
    ("zero", "between", ("--backend", "vulkan", "--slots", "2", "--budget", "1GiB")),
    ("truncate", "during", ("--backend", "vulkan", "--slots", "2", "--budget", "1GiB")),
    # weights on the device; the predictor's host ops read the memory map: the check after the step
    ("truncate", "during", ("--backend", "vulkan", "--moe-predict", "router")),
    ("zero", "during", ("--backend", "vulkan", "--moe-predict", "router")),
]


@pytest.mark.parametrize("change,when,args", CASES, ids=[f"{c}-{w}-{'-'.join(a) or 'numpy'}" for c, w, a in CASES])
def test_file_changed_while_generating(tmp_path, change, when, args):
    import re

    model, out, r = _run(tmp_path, change, when, *args)
    lines = [ln for ln in r.stderr.splitlines()  # (not a warning, nor the memory plan's line at load)
             if ln.strip() and not ln.startswith(("onebit: warning", "onebit: memory:"))]
    assert r.returncode == 1, (r.returncode, r.stderr[-2000:])
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert lines[0].startswith(f"onebit: error: {model}: file changed while running")
    assert re.search(EXPECT[change], lines[0]) or (change == "truncate" and "ended early" in lines[0]), lines[0]
    results = [json.loads(ln) for ln in out.read_text().splitlines()]  # the first result is kept, whole
    assert [x["id"] for x in results] == ["1"] and results[0]["tokens"]


@pytest.mark.parametrize("change", ["truncate", "zero"])
def test_resident_vulkan_runs_on_when_it_reads_nothing_from_the_file(tmp_path, change):
    """Every weight on the device and nothing read from the file after load (the model counts
    the reads outside the memory map: gguf.reads): a change under the run changes nothing, so it runs
    to the end with the results of an untouched file."""
    _, want, r = _run(tmp_path, "none", "during", "--backend", "vulkan", "--seed", "1")
    assert r.returncode == 0, r.stderr[-2000:]
    want = [json.loads(ln) for ln in want.read_text().splitlines()]
    _, out, r = _run(tmp_path, change, "during", "--backend", "vulkan", "--seed", "1")
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-2000:]
    got = [json.loads(ln) for ln in out.read_text().splitlines()]
    assert [x["id"] for x in got] == ["1", "2", "3"]
    assert [x["tokens"] for x in got] == [x["tokens"] for x in want]


def test_api_zeroed_in_place_stops_generation(tmp_path):
    model = tmp_path / "m.gguf"
    model.write_bytes(SRC.read_bytes())
    m = onebit.load(model, backend="cpu")
    before = os.stat(model).st_mtime_ns
    gen = m.generate([1, 2, 3], max_tokens=8)
    next(gen)
    with open(model, "r+b") as f:
        f.write(bytes(os.path.getsize(model)))
    if os.stat(model).st_mtime_ns == before:
        os.utime(model, ns=(before, before + 1_000_000_000))
    with pytest.raises(ModelFileChangedError, match="modified in place"):
        list(gen)


def test_api_replaced_or_removed(tmp_path):
    model = tmp_path / "m.gguf"
    model.write_bytes(SRC.read_bytes())
    m = onebit.load(model, backend="cpu")
    cache = m.new_cache()
    m.net.forward(np.array([1, 2]), cache)
    new = tmp_path / "new.gguf"
    new.write_bytes(SRC.read_bytes())
    os.replace(new, model)  # same bytes, another inode
    with pytest.raises(ModelFileChangedError, match="replaced by another file"):
        m.net.forward(np.array([3]), cache)
    os.unlink(model)
    with pytest.raises(ModelFileChangedError, match="can no longer be opened"):
        m.net.forward(np.array([3]), cache)


def test_unchanged_file_runs_on():
    m = onebit.load(SRC, backend="cpu")
    assert len([r for r in m.generate([1, 2, 3], max_tokens=5)]) >= 1
    m.gguf.check_unchanged()
