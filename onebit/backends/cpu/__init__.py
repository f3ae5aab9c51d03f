"""The cpu backend (backend.py) and its numba kernels."""

from .backend import CpuBackend, X16Experts

__all__ = ["CpuBackend", "X16Experts"]
