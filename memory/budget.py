"""How many bytes the engine may use on this machine.

The budget is the smallest of: available memory (psutil), the cgroup memory limit left, and
the Vulkan heap budget when a device reports one; minus a reserve for the OS. A user value
(`--budget 12GiB`) replaces the detected one. Device limits (largest allocation, largest
storage-buffer binding) are carried along for the planner.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from onebit.errors import UsageError

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
          "t": 1000**4, "tb": 1000**4, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
DEFAULT_RESERVE = 1 << 30


def parse_size(text: str, what: str = "size") -> int:
    """'12GiB', '512MiB', '8G', '1.5 GB', '4096' -> bytes (K/M/G alone are decimal, KiB/MiB/GiB binary)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise UsageError(f"bad {what} {text!r}: use a number with an optional unit, e.g. 12GiB, 512MiB, 8GB")
    value = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if value < 0 or value > 1 << 60:
        raise UsageError(f"bad {what} {text!r}: out of range")
    return int(value)


def format_bytes(n: float) -> str:
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= div:
            return f"{n / div:.2f} {unit}"
    return f"{int(n)} B"


def cgroup_limit_left() -> Optional[int]:
    """Bytes the cgroup (v2 or v1) still lets this process use, or None when unlimited."""
    for limit_f, usage_f in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                             ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            raw = Path(limit_f).read_text().strip()
        except OSError:
            continue
        if raw == "max" or not raw.isdigit() or int(raw) >= 1 << 60:
            return None
        try:
            used = int(Path(usage_f).read_text().strip())
        except (OSError, ValueError):
            used = 0
        return max(int(raw) - used, 0)
    return None


@dataclass(frozen=True)
class Budget:
    bytes: int  # what the plan may spend
    source: str  # how it was found
    available: int  # psutil available memory
    cgroup_left: Optional[int] = None
    device_heap: Optional[int] = None
    reserve: int = 0
    max_allocation: Optional[int] = None
    max_storage_range: Optional[int] = None
    notes: list[str] = field(default_factory=list)


def detect_budget(override: Optional[str | int] = None, reserve: Optional[str | int] = None,
                  device_heap: Optional[int] = None, max_allocation: Optional[int] = None,
                  max_storage_range: Optional[int] = None) -> Budget:
    import psutil

    available = int(psutil.virtual_memory().available)
    cg = cgroup_limit_left()
    res = DEFAULT_RESERVE if reserve is None else (parse_size(reserve, "reserve") if isinstance(reserve, str) else reserve)
    if override is not None:
        b = parse_size(override, "budget") if isinstance(override, str) else int(override)
        if b <= 0:
            raise UsageError(f"the budget must be positive, got {override!r}")
        return Budget(b, "--budget", available, cg, device_heap, 0, max_allocation, max_storage_range)
    # The reserve is the OS's share of system memory; a device heap is used as it is.
    candidates = {f"available memory minus {format_bytes(res)} reserve": max(available - res, 0)}
    if cg is not None:
        candidates[f"cgroup limit left minus {format_bytes(res)} reserve"] = max(cg - res, 0)
    if device_heap is not None:
        candidates["Vulkan device heap"] = device_heap
    source = min(candidates, key=candidates.get)
    return Budget(candidates[source], source, available, cg, device_heap, res, max_allocation, max_storage_range)
