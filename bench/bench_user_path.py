"""Decode speed through the user's paths against the raw forward loop, on one model, alternating.

    python bench/bench_user_path.py [MODEL] [--backend cpu] [--tokens 64] [--rounds 7] [--profile PATH]

MODEL defaults to the shipped model (onebit/data/default.gguf). Each round measures, one after
the other on the same loaded model (order rotated each round), from the same prompt (the
bench text, 32 tokens), `--tokens` greedy decode tokens through:

- raw: `model.net.forward([tok], cache)` then argmax, in a Python loop (the kernels' speed);
- bench: `onebit bench`'s decode figure (`run_bench`, lookup off, as the command runs it);
- generate: `stream_generate` (what `onebit generate` and `onebit chat` run), lookup off, its
  `generation_tps` (EOS does not end it: the tokenizer's stop ids are emptied for the run);
- generate+lookup: the same with the commands' default lookup decoding (8 drafts).

Prints the median tok/s of each and its ratio to raw's median (and the median of the per-round
ratios, which the machine's drift between rounds does not move). With --profile, one more
generate run of `--tokens` tokens under cProfile writes its stats to PATH (pstats) and prints
the top entries by own time.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import onebit  # noqa: E402
from onebit.apps.bench import bench_prompt, run_bench  # noqa: E402
from onebit.generate import stream_generate  # noqa: E402
from onebit.sample import make_sampler  # noqa: E402

PROMPT = 32


def raw(m, prompt: np.ndarray, n: int) -> float:
    cache = m.new_cache()
    tok = int(np.argmax(m.net.forward(prompt, cache, last_only=True)[-1]))
    t0 = time.perf_counter()
    for _ in range(n):
        tok = int(np.argmax(m.net.forward(np.array([tok], np.int64), cache)[-1]))
    return n / (time.perf_counter() - t0)


def bench(m, prompt: np.ndarray, n: int) -> float:
    return run_bench(m, len(prompt), n, 1)["decode_tps"]


def generate(m, prompt: np.ndarray, n: int, lookup: int = 0) -> float:
    """generation_tps of stream_generate: n tokens after the first (EOS does not stop it)."""
    cls = type(m.tokenizer)
    saved = cls.__dict__["stop_ids"]
    cls.stop_ids = property(lambda self: frozenset())
    try:
        last = None
        for last in stream_generate(m, [int(t) for t in prompt], max_tokens=n + 1, sampler=make_sampler(0.0),
                                    lookup=lookup):
            pass
    finally:
        cls.stop_ids = saved
    assert last.generation_tokens == n + 1, last
    return last.generation_tps


class ForwardTimer:
    """Counts the calls of net.forward and the seconds spent inside them (wraps the method)."""

    def __init__(self, net):
        self.net, self.inner = net, net.forward
        self.reset()

        def forward(*a, **kw):
            t0 = time.perf_counter()
            try:
                return self.inner(*a, **kw)
            finally:
                self.seconds += time.perf_counter() - t0
                self.calls += 1

        net.forward = forward

    def reset(self) -> None:
        self.seconds, self.calls = 0.0, 0

    def close(self) -> None:
        del self.net.forward  # (the instance attribute: the class's method again)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default=str(Path(onebit.__file__).parent / "data" / "default.gguf"))
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--profile", help="write a cProfile of one generate run here")
    args = ap.parse_args()
    m = onebit.load(args.model, backend=args.backend)
    prompt = np.asarray(bench_prompt(m, PROMPT), np.int64)
    ways = {"raw": raw, "bench": bench, "generate": generate,
            "generate+lookup": lambda m, p, n: generate(m, p, n, lookup=8)}
    for f in ways.values():  # one unmeasured run each (first-use costs)
        f(m, prompt, 8)
    got = {k: [] for k in ways}
    host = {k: [] for k in ways}  # seconds per token outside net.forward
    timer = ForwardTimer(m.net)
    names = list(ways)
    for r in range(args.rounds):
        for k in names[r % len(names):] + names[: r % len(names)]:
            timer.reset()
            t0 = time.perf_counter()
            got[k].append(ways[k](m, prompt, args.tokens))
            host[k].append((time.perf_counter() - t0 - timer.seconds) / timer.calls)
    timer.close()
    base = statistics.median(got["raw"])
    print(f"{args.model} ({m.be.name}), {PROMPT}-token prompt, {args.tokens} decode tokens, {args.rounds} rounds")
    print(f"{'path':16s} {'tok/s':>8s} {'/ raw':>7s} {'median of round ratios':>24s} {'host us / forward':>18s}")
    for k in names:
        ratios = [v / b for v, b in zip(got[k], got["raw"])]
        print(f"{k:16s} {statistics.median(got[k]):8.1f} {statistics.median(got[k]) / base:7.3f} "
              f"{statistics.median(ratios):24.3f} {1e6 * statistics.median(host[k]):18.1f}")
    print("(host us / forward: the whole call's time outside net.forward, prompt pass and setup included, "
          "per forward)")
    if args.profile:
        import cProfile
        import pstats

        pr = cProfile.Profile()
        pr.enable()
        generate(m, prompt, args.tokens)
        pr.disable()
        pr.dump_stats(args.profile)
        pstats.Stats(args.profile).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
