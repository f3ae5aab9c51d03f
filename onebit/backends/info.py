"""`onebit devices`: the Vulkan devices, the CPU, and which backend `auto` picks."""

from __future__ import annotations

import os


def cpu_threads() -> int:
    """Threads the cpu backend's kernels use (numba's: $NUMBA_NUM_THREADS, else every core)."""
    try:
        import numba
    except ImportError:
        return 0
    return numba.config.NUMBA_NUM_THREADS


def device_report(device=None) -> str:
    """The devices, and what `auto` picks with `device` asked for (an index or part of a name; None: none)."""
    from . import resolve
    from .vulkan.device import VulkanUnavailableError, list_devices

    lines = []
    try:
        devices = list_devices()
        lines += [d.describe() + "\n" for d in devices] or ["no Vulkan devices\n"]
    except VulkanUnavailableError as e:
        lines.append(f"Vulkan: unavailable ({e})\n")
    lines.append(f"cpu: {os.cpu_count()} cores, cpu backend {cpu_threads()} threads")
    auto = resolve("auto", device)
    if auto == "cpu":
        why = "no GPU-type Vulkan device (lavapipe only by name)"
    else:
        why = "a GPU-type Vulkan device" if device is None else f"device {device!r} asked for"
    lines.append(f"--backend auto: {auto} ({why})")
    return "\n".join(lines)
