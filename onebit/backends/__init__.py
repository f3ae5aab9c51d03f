"""Compute backends. `numpy` is the reference every other backend is checked against."""

from ..errors import UsageError
from .numpy_backend import NumpyBackend

BACKENDS = {"numpy": NumpyBackend}


def make_backend(name: str, gguf):
    cls = BACKENDS.get(name)
    if cls is None:
        raise UsageError(f"unknown backend {name!r} (available: {', '.join(BACKENDS)})")
    return cls(gguf)
