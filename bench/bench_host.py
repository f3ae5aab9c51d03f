"""The host's share of a resident Vulkan decode step, this tree against another, alternating processes.

Per process: greedy decode of rounds x 16 tokens from an 8-token random prompt (a fresh cache
each round, the first two rounds not counted); a step is one `model.net.forward` of one token,
the host's part of it everything but the fence waits. Prints the medians of step, wait, host and
host / step for each process, trees alternating (A B A B ...: the VM's speed drifts between
minutes, so compare rows measured next to each other).

    python bench/bench_host.py --other /tmp/onebit-before [--runs 3] tests/fixtures/qwen3moe-f32.gguf
    python bench/bench_host.py tests/fixtures/gemma3-f32.gguf   # this tree alone (an architecture the other lacks)

The other tree needs `onebit/memory` and `onebit/cli` symlinks (see bench_modes.py).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def worker(path: str, rounds: int) -> dict:
    import numpy as np

    import onebit

    m = onebit.load(path, backend="vulkan")
    assert m.be.name == "vulkan"
    prompt = np.random.default_rng(0).integers(1, m.cfg.vocab_size, 8).astype(np.int64)
    dev = m.be.dev
    steps, waits = [], []
    for r in range(rounds + 2):
        cache = m.new_cache()
        tok = int(m.net.forward(prompt, cache, last_only=True)[-1].argmax())
        for _ in range(16):
            w0, t0 = dev.wait_s, time.perf_counter()
            tok = int(m.net.forward(np.array([tok], np.int64), cache)[-1].argmax())
            if r >= 2:
                steps.append(time.perf_counter() - t0)
                waits.append(dev.wait_s - w0)
    host = [s - w for s, w in zip(steps, waits)]
    return {"step": statistics.median(steps), "wait": statistics.median(waits), "host": statistics.median(host),
            "share": statistics.median(h / s for h, s in zip(host, steps))}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        _, _, tree, path, rounds = sys.argv
        sys.path.insert(0, tree)
        print(json.dumps(worker(path, int(rounds))))
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("file", type=Path)
    ap.add_argument("--other", type=Path, help="the tree to compare with (none: this tree alone)")
    ap.add_argument("--runs", type=int, default=3, help="processes per tree")
    ap.add_argument("--rounds", type=int, default=10, help="rounds of 16 tokens per process")
    a = ap.parse_args()
    trees = {"this": ROOT} if a.other is None else {"this": ROOT, "other": a.other.resolve()}
    print(f"resident Vulkan decode of {a.file.name}, {a.rounds} x 16 tokens a process; this = {ROOT}"
          + (f", other = {trees['other']}" if a.other is not None else ""))
    print(f"{'tree':<6} {'step us':>8} {'wait us':>8} {'host us':>8} {'host share':>10}")
    for _ in range(a.runs):
        for name, tree in trees.items():
            env = dict(os.environ, PYTHONPATH=str(tree))
            res = subprocess.run([sys.executable, __file__, "--worker", str(tree), str(a.file), str(a.rounds)],
                                 env=env, capture_output=True, text=True, timeout=1800)
            if res.returncode != 0:
                raise SystemExit(f"{tree}: failed:\n{res.stderr[-2000:]}")
            r = json.loads(res.stdout.strip().splitlines()[-1])
            print(f"{name:<6} {1e6 * r['step']:>8.0f} {1e6 * r['wait']:>8.0f} {1e6 * r['host']:>8.0f} "
                  f"{100 * r['share']:>9.1f}%", flush=True)


if __name__ == "__main__":
    main()
