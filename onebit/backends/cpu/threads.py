"""How the kernels' OpenMP worker threads wait between parallel regions: spin briefly on an idle
machine, sleep at once on a busy one (`wait_policy`). Set through OMP_WAIT_POLICY and
GOMP_SPINCOUNT, which GNU OpenMP reads once, when numba first starts its threads (its first
parallel region, or numba.get_num_threads): the backend sets them when it opens, before it
starts them. Nothing is set when this module is imported."""

from __future__ import annotations

import os


def _others_running() -> float:
    """Tasks other than this process that want a core now: Linux's count of runnable tasks
    (/proc/loadavg) less this one, the mean of 5 looks 2 ms apart; elsewhere the 1-minute load
    average (which also counts what this program ran a minute ago)."""
    import time

    try:
        seen = []
        for i in range(5):
            with open("/proc/loadavg") as f:
                seen.append(int(f.read().split()[3].split("/")[0]) - 1)
            if i < 4:
                time.sleep(0.002)
        return sum(seen) / len(seen)
    except (OSError, ValueError, IndexError):
        return os.getloadavg()[0]


def wait_policy() -> None:
    """How numba's OpenMP workers wait between parallel regions (a decode token runs about three
    a layer), unless the user set OMP_WAIT_POLICY. On an idle machine they spin a little
    (GOMP_SPINCOUNT 10000, well under a millisecond) before sleeping: waking a sleeping worker
    costs each region tens of microseconds (Gemma 3 270M decode on the 2-core VM: 17.7 ms a token
    spinning, 23.9 sleeping at once). When other work wants at least half the cores they sleep
    at once: spinning workers starve the thread that has the work (same file with one busy
    process beside it: 32.4 ms sleeping, 65.2 spinning; earlier, 1.0 vs 8.4 tok/s decode on 2
    cores under load 6). Takes effect only if called before numba starts its threads (see the
    module's docstring); later calls change the environment and nothing else."""
    if "OMP_WAIT_POLICY" in os.environ:
        return
    try:
        busy = _others_running() >= 0.5 * (os.cpu_count() or 1)
    except OSError:  # no way to tell: the safe choice
        busy = True
    if busy:
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    else:
        os.environ["OMP_WAIT_POLICY"] = "ACTIVE"
        os.environ.setdefault("GOMP_SPINCOUNT", "10000")
