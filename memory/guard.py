"""The memory guard: stop generation cleanly before the machine runs out of memory.

Called once per generated token, it samples memory at most every `interval` seconds (a
psutil call plus the cgroup files), so a fast decode loop pays a clock read. When available
memory (or what the cgroup still allows) falls under the floor, generation stops with a
clear error instead of meeting the kernel's OOM killer or a swap storm.
"""

from __future__ import annotations

import time
from typing import Optional

import psutil

from onebit.errors import OnebitError

from .budget import cgroup_limit_left, format_bytes


class MemoryGuardError(OnebitError):
    exit_code = 1


def default_floor() -> int:
    return max(256 << 20, psutil.virtual_memory().total // 50)


class MemoryGuard:
    def __init__(self, floor: Optional[int] = None, interval: float = 0.1):
        self.floor = default_floor() if floor is None else floor
        self.interval = interval
        self._next = 0.0  # monotonic time of the next sample

    def available(self) -> int:
        avail = int(psutil.virtual_memory().available)
        cg = cgroup_limit_left()
        return min(avail, cg) if cg is not None else avail

    def check(self) -> None:
        now = time.monotonic()
        if now < self._next:
            return
        self._next = now + self.interval
        avail = self.available()
        if avail < self.floor:
            raise MemoryGuardError(
                f"stopped to protect the machine: available memory fell to {format_bytes(avail)}, under the "
                f"guard's floor of {format_bytes(self.floor)}; free memory, or use fewer --slots / a shorter --ctx"
            )
