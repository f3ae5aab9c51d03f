"""Compute backends. `numpy` is the reference every other backend is checked against."""

from __future__ import annotations

import logging

from ..errors import UsageError
from .numpy_backend import NumpyBackend

log = logging.getLogger("onebit")


def _vulkan(gguf):
    from .vulkan.backend import VulkanBackend

    return VulkanBackend(gguf)


def _cpu(gguf):
    from .cpu import CpuBackend

    return CpuBackend(gguf)


BACKENDS = {"numpy": NumpyBackend, "cpu": _cpu, "vulkan": _vulkan}


def make_backend(name: str, gguf, fallback: bool = True):
    """The named backend; when Vulkan is unusable here, say so once and fall back to numpy."""
    make = BACKENDS.get(name)
    if make is None:
        raise UsageError(f"unknown backend {name!r} (available: {', '.join(BACKENDS)})")
    if name == "vulkan":
        from .vulkan.device import VulkanUnavailableError

        try:
            return make(gguf)
        except VulkanUnavailableError as e:
            if not fallback:
                raise
            import sys

            sys.stderr.write(f"onebit: warning: {e}; using the numpy backend\n")
            log.warning("Vulkan unavailable, falling back to numpy: %s", e)
            return NumpyBackend(gguf)
    return make(gguf)
