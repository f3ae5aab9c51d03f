"""The fast tier's list (tests/fast_tier.txt) names tests that exist, in every test file."""

from __future__ import annotations

import ast
from pathlib import Path


from conftest import fast_tier

TESTS = Path(__file__).parent


def test_every_listed_test_exists():
    missing = []
    for node in sorted(fast_tier()):
        file, _, name = node.partition("::")
        path = TESTS.parent / file
        func = name.split("[")[0].split("::")[-1]
        if not path.exists() or func not in {n.name for n in ast.walk(ast.parse(path.read_text()))
                                             if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}:
            missing.append(node)
    assert missing == []


def test_every_test_file_has_a_test_in_the_tier():
    files = {n.partition("::")[0] for n in fast_tier()}
    all_files = {f"tests/{p.name}" for p in TESTS.glob("test_*.py")}
    assert sorted(all_files - files) == []
