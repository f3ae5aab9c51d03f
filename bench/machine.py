"""What this machine gives the engine: cores' worth under load, a drive read's wall and CPU
time, and one Vulkan submission's cost. The figures that decide whether streamed experts can
be read beside the compute (bench/results/routing-prediction-2026-12-01.md) and what a pause point costs at
least (execution-modes-2026-12-01.md).

- cores: N busy processes (a counter loop for --seconds each, N = 1 and every core): the work
  they did together as a multiple of one process alone (the cores' worth the machine gives
  busy threads; on a shared VM a core can be scheduled, CPU time / wall time 1.0, and still
  run slower), and each one's CPU time / wall time.
- reads (with --file): random 4 KiB-aligned O_DIRECT reads of 144 KiB, 432 KiB and 1 MiB
  from the file, 300 each: wall and CPU time (this thread's) per read, and GB/s.
- vulkan: a recorded sequence of one 16-byte copy run 500 times, 7 rounds (median): submit +
  fence wait per run, and the host's part of it (everything but the wait).

    python bench/machine.py [--file MODEL.gguf] [--seconds 3]
"""

from __future__ import annotations

import argparse
import mmap
import multiprocessing as mp
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _busy(seconds: float, out) -> None:
    t0, c0, n = time.perf_counter(), time.process_time(), 0
    while time.perf_counter() - t0 < seconds:
        n += 1
    wall = time.perf_counter() - t0
    out.put(((time.process_time() - c0) / wall, n / wall))


def cores(seconds: float) -> None:
    n_cpu = os.cpu_count() or 1
    alone = None
    for n in sorted({1, n_cpu}):
        q = mp.Queue()
        procs = [mp.Process(target=_busy, args=(seconds, q)) for _ in range(n)]
        for p in procs:
            p.start()
        got = [q.get() for _ in procs]
        for p in procs:
            p.join()
        rate = sum(r for _, r in got)
        alone = alone or rate
        print(f"cores: {n} busy process(es): {rate / alone:.2f}x the work of one alone "
              f"(CPU / wall each {', '.join(f'{c:.2f}' for c, _ in got)}; {n_cpu} cores)")


def memory_read_gbs() -> float:
    """Memory read rate, GB/s: numpy sums over the two halves of a 1 GiB float32 array on two
    threads at once, best of 5 (the yardstick bench_scale and bench_roofline divide by)."""
    import threading

    import numpy as np

    a = np.ones(1 << 28, np.float32)
    halves = [a[: len(a) // 2], a[len(a) // 2 :]]
    best = 0.0
    for _ in range(5):
        t0 = time.perf_counter()
        ts = [threading.Thread(target=np.sum, args=(h,)) for h in halves]
        [t.start() for t in ts]
        [t.join() for t in ts]
        best = max(best, a.nbytes / (time.perf_counter() - t0))
    return best / 1e9


def reads(path: str, n: int = 300) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError as e:
        print(f"reads: {path}: no O_DIRECT here ({e.strerror})")
        return
    size = os.fstat(fd).st_size
    rng = random.Random(0)
    try:
        for nbytes in (144 << 10, 432 << 10, 1 << 20):
            if size < nbytes + 4096:
                continue
            buf = mmap.mmap(-1, nbytes)  # page aligned, as O_DIRECT needs
            offs = [rng.randrange(0, size - nbytes) // 4096 * 4096 for _ in range(n)]
            t0, c0 = time.perf_counter(), time.thread_time()
            for off in offs:
                os.preadv(fd, [buf], off)
            dt, dc = time.perf_counter() - t0, time.thread_time() - c0
            print(f"reads: {nbytes >> 10} KiB O_DIRECT: {1e6 * dt / n:.0f} us wall, {1e6 * dc / n:.0f} us CPU "
                  f"each; {nbytes * n / dt / 1e9:.2f} GB/s")
    finally:
        os.close(fd)


def vulkan() -> None:
    try:
        from onebit.backends.vulkan.device import default_device

        dev = default_device()
    except Exception as e:  # no loader, no device: say so, measure the rest
        print(f"vulkan: not measured ({e})")
        return
    a, b = dev.buffer(256), dev.buffer(256)
    seq = dev.sequence()
    seq.copy(a.slice(0, 16), b.slice(0, 16))
    seq.record()
    for _ in range(50):
        seq.run()
    runs = []
    for _ in range(7):
        t0, w0 = time.perf_counter(), dev.wait_s
        for _ in range(500):
            seq.run()
        runs.append(((time.perf_counter() - t0) / 500, (dev.wait_s - w0) / 500))
    total, wait = statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)
    print(f"vulkan: {dev.info.name}: submit + fence wait {1e6 * total:.1f} us a run, "
          f"host (all but the wait) {1e6 * (total - wait):.1f} us")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--file", help="a large file to read from (e.g. a GGUF model)")
    ap.add_argument("--seconds", type=float, default=3.0)
    a = ap.parse_args()
    cores(a.seconds)
    if a.file:
        reads(a.file)
    vulkan()


if __name__ == "__main__":
    main()
