"""Only `onebit/backends/` and `cli/` name a backend (STYLE.md habit 15): everywhere else in the
library the loader, the planner and the facade ask a backend class (backends/base.py) for its
answers, so no line outside those folders compares a value with a backend's name."""

from __future__ import annotations

import re
from pathlib import Path

from onebit.backends import BACKENDS

ROOT = Path(__file__).resolve().parent.parent
NAME = "|".join(map(re.escape, BACKENDS))
# a comparison with a backend's name, either side: == "vulkan", "cpu" != x, in ("numpy", ...)
COMPARISON = re.compile(rf"""(==|!=|\bis\b|\bin\b)\s*[(\[{{]?\s*["']({NAME})["']|["']({NAME})["']\s*(==|!=|\bis\b)""")


def generic_files() -> list[Path]:
    """The library's modules outside backends/ (cli/ is a folder of its own): onebit/ and memory/."""
    files = [p for p in (ROOT / "onebit").rglob("*.py") if "backends" not in p.relative_to(ROOT / "onebit").parts]
    return files + sorted((ROOT / "memory").rglob("*.py"))


def comparisons(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if COMPARISON.search(line.split("#")[0])]


def test_no_backend_name_is_compared_outside_backends_and_cli():
    found = [f"{p.relative_to(ROOT)}: {line}" for p in generic_files() for line in comparisons(p.read_text("utf-8"))]
    assert found == []


def test_the_check_sees_a_comparison():
    """The grep can fail: made-up lines of each form are caught, plain keywords are not."""
    assert len(generic_files()) > 20 and not any("backends" in p.parts for p in generic_files())
    for bad in ('if name == "vulkan":', "if backend != 'cpu':", 'ok = "numpy" == be.name',
                'if name in ("cpu", "numpy"):', "x = be.name is 'vulkan'"):
        assert comparisons(bad) == [bad], bad
    for fine in ('m = load(p, backend="cpu")', 'NAMES = ("auto", "cpu")', 'if name == "auto":',
                 'x = 1  # name == "vulkan" in a comment'):
        assert comparisons(fine) == [], fine
