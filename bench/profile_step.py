"""Where a recorded Vulkan forward spends its time, by kernel.

Runs one forward of R rows (a prompt chunk, or R = 1 for a decode step) so that every buffer
holds real data, then replays each of its dispatches alone (a one-dispatch command buffer, the
same pipeline, bindings, push constants and workgroups), `--reps` times, and sums the median
time of each by pipeline name. The sum is close to the recorded step's time on a device that
runs one dispatch at a time (lavapipe); on a GPU, where dispatches overlap, it is an upper
bound. The step itself is timed too (median of `--reps` replays of the whole forward).

    python bench/profile_step.py MODEL.gguf [--rows 256] [--reps 3] [--top 20]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import onebit  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--rows", type=int, default=256, help="rows of the forward (1: a decode step)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--top", type=int, default=20)
    args = ap.parse_args()
    m = onebit.load(args.model, backend="vulkan")
    if m.be.name != "vulkan":
        sys.exit("onebit: profile_step needs the Vulkan backend (no Vulkan device?)")
    rng = np.random.default_rng(0)
    ids = rng.integers(0, m.cfg.vocab_size, size=args.rows + 1)
    cache = m.net.make_cache()
    m.net.forward(ids[:1], cache)  # position 0, then the R rows at positions 1..R
    m.net.forward(ids[1:], cache)  # (records the R-row forward and compiles its pipelines: not timed)
    cache.offset = 1
    step = []
    for _ in range(args.reps):
        t0 = time.perf_counter()
        m.net.forward(ids[1:], cache)
        step.append(time.perf_counter() - t0)
        cache.offset = 1
    recs = [r for s in m.be.runner.storages for r in s.recordings.values() if r.R == args.rows]
    if not recs:
        sys.exit(f"onebit: no recording of {args.rows} rows (a forward of that many rows is split; try a power of two)")
    rec = recs[0]
    dev = m.be.dev
    by_name: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    for seg in rec.segments:
        for op in seg.ops:
            one = dev.sequence()
            one.ops = [op]
            one.record()
            times = []
            for _ in range(args.reps):
                t0 = time.perf_counter()
                one.run()
                times.append(time.perf_counter() - t0)
            name = getattr(op, "pipeline", None)
            name = name.name if name is not None else "copy"
            by_name[name] += statistics.median(times)
            count[name] += 1
            one.close()
    total = sum(by_name.values())
    print(f"{Path(args.model).name}: forward of {args.rows} rows, {sum(count.values())} dispatches in "
          f"{len(rec.segments)} segments; step {statistics.median(step) * 1e3:.1f} ms (median of {args.reps}), "
          f"dispatches alone {total * 1e3:.1f} ms")
    print(f"| kernel | dispatches | ms | share |\n|---|---:|---:|---:|")
    for name, t in sorted(by_name.items(), key=lambda kv: -kv[1])[: args.top]:
        print(f"| {name} | {count[name]} | {t * 1e3:.1f} | {t / total:.0%} |")
    m.close()


if __name__ == "__main__":
    main()
