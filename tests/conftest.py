from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

FIXTURES = Path(__file__).parent / "fixtures"


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
