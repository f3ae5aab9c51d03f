"""Compute backends. `numpy` is the reference every other backend is checked against.

`auto` (the default) is Vulkan on a GPU (integrated or discrete), else the fast `cpu`
backend; a CPU-type Vulkan device (lavapipe) only when asked for: `--backend vulkan`, or a
device named with `--device` / $ONEBIT_VULKAN_DEVICE.
"""

from __future__ import annotations

import logging
import os
import sys

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
NAMES = ("auto", *BACKENDS)


def gpu_device():
    """The usable GPU-type (integrated or discrete) Vulkan device auto would run on, or None."""
    try:
        from .vulkan.device import VulkanUnavailableError, list_devices

        devices = list_devices()
    except (ImportError, VulkanUnavailableError):
        return None
    except Exception as e:  # a broken driver must not stop a CPU run
        log.info("Vulkan device query failed: %s", e)
        return None
    gpus = [d for d in devices if d.usable and d.type in ("integrated", "discrete")]
    return gpus[0] if gpus else None


def resolve(name: str) -> str:
    """The concrete backend `name` stands for ("auto" -> "vulkan" or "cpu")."""
    if name not in NAMES:
        raise UsageError(f"unknown backend {name!r} (available: {', '.join(NAMES)})")
    if name != "auto":
        return name
    from .vulkan.device import DEVICE_ENV

    if os.environ.get(DEVICE_ENV, "").strip() or gpu_device() is not None:
        return "vulkan"
    return "cpu"


def make_backend(name: str, gguf, fallback: bool = True, auto: bool = False):
    """The named backend; when Vulkan is unusable here, say so once and fall back (to numpy
    when Vulkan was asked for by name, to cpu when `auto` chose it)."""
    auto = auto or name == "auto"
    name = resolve(name)
    if name == "vulkan":
        from .vulkan.device import VulkanUnavailableError

        try:
            return BACKENDS["vulkan"](gguf)
        except VulkanUnavailableError as e:
            if not fallback:
                raise
            other = "cpu" if auto else "numpy"
            sys.stderr.write(f"onebit: warning: {e}; using the {other} backend\n")
            log.info("Vulkan unavailable, falling back to %s: %s", other, e)  # stderr has it already
            return BACKENDS[other](gguf)
    return BACKENDS[name](gguf)


def device_info(be):
    """The device a backend computes on (a Vulkan device's `DeviceInfo`), or None for the host."""
    dev = getattr(be, "dev", None)
    return getattr(dev, "info", None)


def describe(be) -> str:
    """A backend in a few words, for `onebit bench` and logs: its name and threads or device."""
    if hasattr(be, "describe"):
        return be.describe()
    info = device_info(be)
    if info is not None:
        return f"{info.name}, {info.type}"
    return "reference" if be.name == "numpy" else be.name
