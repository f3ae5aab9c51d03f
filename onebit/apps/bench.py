"""`onebit bench`: prompt and decode speed of one model on this machine (medians of runs)."""

from __future__ import annotations

import statistics
import time

import numpy as np

from ..generate import generate_step
from ..lookup import LookupStats
from ..backends import describe
from ..sample import make_sampler

BENCH_TEXT = (
    "The quick brown fox jumps over the lazy dog. Python's standard library offers json, os, re and "
    "many other modules for everyday work. "
)


def bench_prompt(model, n: int) -> list[int]:
    ids = model.tokenize(BENCH_TEXT, add_special=False)
    reps = n // max(len(ids), 1) + 1
    return (ids * reps)[:n]


def run_bench(model, prompt_tokens: int, gen_tokens: int, runs: int, lookup: int = 0, warmup: bool = True) -> dict:
    """Medians over runs of prompt tok/s (chunks of 256) and decode tok/s (greedy, a fixed count
    of tokens: EOS does not end a benchmark; with `lookup`, drafts verified per forward). With
    `warmup`, one run first that is not counted, as llama-bench's warm-up run: a process's first
    prompt pays one-time costs (Gemma 3 270M, 64 tokens on the 2-core VM: 499 tok/s, then
    607-615 in the runs after)."""
    if prompt_tokens + gen_tokens > model.context_length:
        from ..errors import UsageError

        raise UsageError(f"{prompt_tokens} prompt + {gen_tokens} decode tokens exceed the "
                         f"{model.context_length}-token context")
    prompt = np.asarray(bench_prompt(model, prompt_tokens), dtype=np.int64)
    greedy = make_sampler(0.0)

    def one(stats: LookupStats) -> tuple[float, float]:
        cache = model.new_cache()
        t0 = time.perf_counter()
        logits = None
        for s in range(0, len(prompt), 256):
            logits = model.net.forward(prompt[s : s + 256], cache, last_only=True)
        pp = len(prompt) / (time.perf_counter() - t0)
        tok = greedy(logits[-1])
        t0 = time.perf_counter()
        # decode: gen_tokens tokens (plain decoding: one forward each; the first feeds the prompt's token)
        steps = generate_step(model.net, [tok], cache, greedy, history=list(prompt), lookup=lookup,
                              max_tokens=gen_tokens, max_positions=model.context_length, stats=stats)
        for _ in range(gen_tokens):
            next(steps)
        steps.close()
        return pp, gen_tokens / (time.perf_counter() - t0)

    if warmup:
        one(LookupStats())
    lk = LookupStats()
    pp, tg = (list(r) for r in zip(*(one(lk) for _ in range(runs))))
    return {
        "model": model.path,
        "backend": model.be.name,
        "backend_detail": describe(model.be),
        "threads": model.be.threads,
        "cpu_target": model.be.cpu_target,  # (the cpu backend's: the CPU model and instruction sets compiled for)
        "prompt_tokens": len(prompt),
        "gen_tokens": gen_tokens,
        "runs": runs,
        "prompt_tps": statistics.median(pp),
        "decode_tps": statistics.median(tg),
        "prompt_tps_runs": pp,
        "decode_tps_runs": tg,
        "lookup": lk.to_dict() | {"max_drafts": lookup},
    }
