"""The environment is read in `cli/` only (STYLE.md habit 16): the library (`onebit/`, `memory/`)
takes explicit settings, and the command line reads $ONEBIT_* and the other variables and passes
them down."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from conftest import run_cli

ROOT = Path(__file__).resolve().parent.parent
LIBRARY = ("onebit", "memory")
ENV = {"environ", "environb", "getenv", "getenvb", "putenv", "unsetenv"}  # os's names for the environment
# The one module that touches the environment, and why: GNU OpenMP (numba's threading layer here)
# is configured only through its variables, read once when numba starts its threads; the cpu
# backend sets the wait policy there as it opens, leaving a user's own OMP_WAIT_POLICY alone.
RUNTIME_KNOBS = {"onebit/backends/cpu/threads.py"}


def env_uses(source: str) -> list[tuple[int, str]]:
    """(line, what) for each touch of the process environment in Python `source`: os.environ and
    the other names in ENV (through any name `os` is imported as, or imported from os), and
    $HOME through os.path.expanduser and Path.home."""
    tree = ast.parse(source)
    os_names = {"os"}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            os_names |= {a.asname or a.name for a in node.names if a.name == "os"}
        elif isinstance(node, ast.ImportFrom) and node.module in ("os", "os.path"):
            found += [(node.lineno, f"from {node.module} import {a.name}") for a in node.names
                      if a.name in ENV or a.name == "expanduser"]
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        v = node.value
        if isinstance(v, ast.Name) and v.id in os_names and node.attr in ENV:
            found.append((node.lineno, f"{v.id}.{node.attr}"))
        elif isinstance(v, ast.Name) and v.id in ENV and node.attr == "get":
            found.append((node.lineno, f"{v.id}.get"))
        elif node.attr == "expanduser" and isinstance(v, ast.Attribute) and v.attr == "path":
            found.append((node.lineno, "os.path.expanduser"))
        elif node.attr == "home" and isinstance(v, ast.Name) and v.id == "Path":
            found.append((node.lineno, "Path.home"))
    return sorted(set(found))


def test_the_library_reads_no_environment():
    found = []
    for top in LIBRARY:
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT)
            if rel.as_posix() in RUNTIME_KNOBS:
                continue
            found += [f"{rel}:{line}: {what}" for line, what in env_uses(path.read_text(encoding="utf-8"))]
    assert not found, "the environment is read outside cli/ (take it as an argument, read it in cli/):\n" + \
        "\n".join(found)


@pytest.mark.parametrize("source, what", [
    ("import os\nx = os.environ.get('A')", "os.environ"),
    ("import os\nx = os.environ['A']", "os.environ"),
    ("import os\nos.environ['A'] = '1'", "os.environ"),
    ("import os\nif 'A' in os.environ: pass", "os.environ"),
    ("import os\nx = os.getenv('A')", "os.getenv"),
    ("import os as o\nx = o.environ.get('A')", "o.environ"),
    ("from os import environ\nx = environ.get('A')", "environ.get"),
    ("from os import getenv", "from os import getenv"),
    ("import subprocess, os\nsubprocess.run(['x'], env=dict(os.environ, A='1'))", "os.environ"),
    ("import os\nd = os.path.expanduser('~')", "os.path.expanduser"),
    ("from pathlib import Path\nd = Path.home()", "Path.home"),
])
def test_env_uses_finds_each_way_of_reading(source, what):
    assert what in [w for _, w in env_uses(source)]


def test_env_uses_passes_what_is_not_the_environment():
    source = ("import os\nfrom os import path\nx = os.path.join('a', 'b')\nd = {}.get('environ')\n"
              "n = os.cpu_count()\nhome = cfg.home\nsettings.environ_name = 1\n")
    assert env_uses(source) == []


def test_the_cli_passes_the_environment_down(monkeypatch, capsys, tmp_path):
    """$ONEBIT_LOOKUP, $ONEBIT_MOE_PREDICT*, $ONEBIT_VULKAN_DEVICE and $ONEBIT_CACHE_DIR reach the
    library through the CLI: read by cli/options, a flag over its variable."""
    from onebit.formats import tokenizer
    from onebit.cli import options

    monkeypatch.setenv("ONEBIT_LOOKUP", "3")
    assert options._lookup(None, default=8) == 3 and options._lookup(5, default=8) == 5
    monkeypatch.setenv("ONEBIT_LOOKUP", " ")
    assert options._lookup(None, default=0) == 0
    monkeypatch.setenv("ONEBIT_MOE_PREDICT", "block")
    monkeypatch.setenv("ONEBIT_MOE_PREDICT_DEPTH", "6")
    monkeypatch.setenv("ONEBIT_MOE_PREDICT_NO_ATTN", "1")
    s = options._predict(ahead="2", depth=None)
    assert (s.mode, s.depth, s.no_attn, s.ahead) == ("block", 6, True, 2)
    assert options._predict(mode="router").mode == "router"
    monkeypatch.setenv("ONEBIT_VULKAN_DEVICE", "llvmpipe")
    assert options._device(None) == "llvmpipe" and options._device("1") == "1"
    monkeypatch.setenv("ONEBIT_CACHE_DIR", str(tmp_path))
    assert options.cache_dir() == tmp_path
    monkeypatch.setenv("ONEBIT_CACHE_DIR", "off")
    assert options.cache_dir() is None
    monkeypatch.delenv("ONEBIT_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert options.cache_dir() == tmp_path / "onebit"
    seen = []  # (run_cli puts the tests' folder back after `onebit` sets the user's)
    monkeypatch.setattr(tokenizer, "set_cache_dir", seen.append)
    run_cli(monkeypatch, capsys, "--version")
    assert seen[0] == tmp_path / "onebit"  # set by `onebit` as it starts
