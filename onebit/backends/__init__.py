"""Compute backends. `numpy` is the reference every other backend is checked against.

`auto` (the default) is Vulkan on a GPU (integrated or discrete), else the fast `cpu`
backend; a CPU-type Vulkan device (lavapipe) only when asked for: `--backend vulkan`, or a
device named (`device`: the CLI's `--device`, else $ONEBIT_VULKAN_DEVICE).
"""

from __future__ import annotations

import logging

from ..errors import BackendUnavailableError, UsageError
from .base import Backend
from .cpu import CpuBackend
from .numpy_backend import NumpyBackend
from .vulkan.backend import VulkanBackend

log = logging.getLogger("onebit")

# Fastest first: a backend that cannot run gives way to the next (onebit.load). Each class answers
# for itself (backends/base.py): the loader and the planner ask it, never name it.
BACKENDS: dict[str, type[Backend]] = {"vulkan": VulkanBackend, "cpu": CpuBackend, "numpy": NumpyBackend}
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


def backend_class(name: str) -> type[Backend]:
    """The class of backend `name` (one of BACKENDS: `resolve` names one)."""
    return BACKENDS[name]


def host_backend(gguf, experts=None, threads=None, repack_from=None) -> Backend:
    """Host ops for a device backend's predictor: the cpu backend's kernels (no float32 copy of
    a weight, unlike numpy's reference ops), or numpy's where the cpu backend cannot run; with
    a pool (`experts`), routed experts from its slots (acquired, as the layer itself acquires
    them). It repacks nothing at load: only the matrices it uses, when it uses them."""
    try:
        return CpuBackend.open(gguf, experts, policy=CpuBackend.memory_policy(gguf, repack_from), threads=threads)
    except BackendUnavailableError:
        return NumpyBackend.open(gguf, experts)


def describe(be) -> str:
    """A backend in a few words, for `onebit bench` and logs: its name and threads or device."""
    return be.describe()
