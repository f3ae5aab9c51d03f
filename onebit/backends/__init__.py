"""Compute backends. `numpy` is the reference every other backend is checked against.

`auto` (the default) is Vulkan on a GPU (integrated or discrete), else the fast `cpu`
backend; a CPU-type Vulkan device (lavapipe) only when asked for: `--backend vulkan`, or a
device named (`device`: the CLI's `--device`, else $ONEBIT_VULKAN_DEVICE).
"""

from __future__ import annotations

import logging

from ..errors import BackendUnavailableError, UsageError
from .numpy_backend import NumpyBackend

log = logging.getLogger("onebit")


def _vulkan(gguf, experts=None, device=None, slot_arrays=None):
    from .vulkan.backend import VulkanBackend

    return VulkanBackend(gguf, experts, device, slot_arrays)


def _cpu(gguf, experts=None, device=None, slot_arrays=None):
    try:
        from .cpu import CpuBackend
    except ImportError as e:  # numba missing or broken
        raise BackendUnavailableError(f"the cpu backend cannot run here ({e})") from e
    return CpuBackend(gguf, experts)


def _numpy(gguf, experts=None, device=None, slot_arrays=None):
    return NumpyBackend(gguf, experts)


# Fastest first: a backend that cannot run gives way to the next (onebit.load).
BACKENDS = {"vulkan": _vulkan, "cpu": _cpu, "numpy": _numpy}
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


def resolve(name: str, device=None) -> str:
    """The concrete backend `name` stands for ("auto" -> "vulkan" where a GPU device is usable,
    or a device was named (`device`); else "cpu")."""
    if name not in NAMES:
        raise UsageError(f"unknown backend {name!r} (available: {', '.join(NAMES)})")
    if name != "auto":
        return name
    if device is not None or gpu_device() is not None:
        return "vulkan"
    return "cpu"


def fallback_order(name: str) -> list[str]:
    """`name` and the backends it falls back to, fastest first (vulkan -> cpu -> numpy)."""
    names = list(BACKENDS)
    return names[names.index(name):]


def open_backend(name: str, gguf, experts=None, device=None, slot_arrays=None):
    """Backend `name` over `gguf` with its expert source (`experts`: a pool, or None for the
    file), on `device` (Vulkan; None: the default one). No fallback here: a backend that
    cannot run raises BackendUnavailableError, which `onebit.load` handles."""
    return BACKENDS[name](gguf, experts, device, slot_arrays)


def device_info(be):
    """The device a backend computes on (a Vulkan device's `DeviceInfo`), or None for the host."""
    return None if be.runs_on_host else be.dev.info


def describe(be) -> str:
    """A backend in a few words, for `onebit bench` and logs: its name and threads or device."""
    return be.describe()
