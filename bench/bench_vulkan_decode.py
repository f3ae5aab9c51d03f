"""Decode on the Vulkan backend: the recorded step (graph.py) against the per-op path.

For each file: one resident Vulkan model; rounds alternate graph, per-op, graph, per-op ...
(ABAB, one run, medians: the machine is shared and noisy, so read the ratios). Each round
prefills the prompt op by op into a fresh device KV cache, then decodes --tokens greedy
tokens one forward at a time. Per token:

- step: wall time of the forward call;
- host: step minus the time spent waiting on the fence (everything the CPU does: Python,
  recording/binding, writes and reads of mapped buffers, numpy between ops);
- submits: queue submissions per token.

    python bench/bench_vulkan_decode.py [--tokens 32] [--rounds 6] [FILE.gguf ...]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import onebit  # noqa: E402
from onebit.backends import BACKENDS  # noqa: E402
from onebit.backends.vulkan.backend import VulkanBackend  # noqa: E402

DEFAULT_FILES = [ROOT / "tests/fixtures/q3moe256-Q4_K_M.gguf", ROOT / "tests/fixtures/q3moe256-f32.gguf"]


def run_round(m, forward, prompt: np.ndarray, n: int) -> dict:
    dev = m.be.dev
    cache = m.new_cache()
    logits = forward(prompt, cache, last_only=True)
    tok = int(logits[-1].argmax())
    steps, hosts, subs = [], [], []
    for _ in range(n):
        w0, s0 = dev.wait_s, dev.n_submits
        t0 = time.perf_counter()
        logits = forward(np.array([tok], np.int64), cache)
        dt = time.perf_counter() - t0
        steps.append(dt)
        hosts.append(dt - (dev.wait_s - w0))
        subs.append(dev.n_submits - s0)
        tok = int(logits[-1].argmax())
    return {"step": statistics.median(steps), "host": statistics.median(hosts), "submits": statistics.median(subs),
            "host_share": statistics.median(h / s for h, s in zip(hosts, steps))}


def bench_file(path: Path, n_tokens: int, rounds: int) -> list[dict]:
    m = onebit.load(path, backend="vulkan")
    assert isinstance(m.be, VulkanBackend)
    ref = path.with_suffix(".ref.npz")
    prompt = (np.load(ref)["tokens"][:8] if ref.exists() else np.arange(1, 9)).astype(np.int64)
    paths = {"graph": m.net.forward, "per-op": m.net.forward.per_op}
    for fwd in paths.values():  # warm up: pipelines built, the step recorded
        run_round(m, fwd, prompt, 2)
    res: dict[str, list[dict]] = {k: [] for k in paths}
    for r in range(rounds):
        order = list(paths) if r % 2 == 0 else list(paths)[::-1]
        for k in order:
            res[k].append(run_round(m, paths[k], prompt, n_tokens))
    rows = []
    for k, rs in res.items():
        row = {key: statistics.median(x[key] for x in rs) for key in rs[0]}
        rows.append({"file": path.name, "path": k, **row})
    g, p = rows
    g["speedup"] = p["step"] / g["step"]
    g["host_ratio"] = p["host"] / g["host"]
    m.be.close()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="*", type=Path)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=6)
    a = ap.parse_args()
    BACKENDS["vulkan"] = VulkanBackend
    print(f"decode, {a.tokens} tokens x {a.rounds} rounds alternating (medians)")
    hdr = f"{'file':<24} {'path':<7} {'tok/s':>8} {'step ms':>8} {'host ms':>8} {'host %':>7} {'submits':>8} " \
          f"{'speedup':>8} {'host x':>7}"
    print(hdr)
    print("-" * len(hdr))
    for f in a.files or DEFAULT_FILES:
        for r in bench_file(f, a.tokens, a.rounds):
            extra = f"{r['speedup']:>7.2f}x {r['host_ratio']:>6.1f}x" if "speedup" in r else ""
            print(f"{r['file']:<24} {r['path']:<7} {1 / r['step']:>8.1f} {r['step'] * 1e3:>8.3f} "
                  f"{r['host'] * 1e3:>8.3f} {100 * r['host_share']:>6.1f}% {r['submits']:>8.0f} {extra}")
    print("speedup: per-op step / graph step; host x: per-op host time / graph host time")


if __name__ == "__main__":
    main()
