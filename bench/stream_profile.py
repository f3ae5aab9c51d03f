#!/usr/bin/env python3
"""Where a streamed decode's time goes: the drive's busy share, reads in flight, demand misses.

    python bench/stream_profile.py MODEL.gguf [--budget 8GiB] [--predict auto] [--prompt 64]
        [--warm 6] [--tokens 24] [--readers N] [--ahead N] [--no-trial] [--prose] [--json]

Loads MODEL with the budget (cpu backend), runs a prompt of random token ids (`--prose`:
bench_predict_default's English paragraph through the file's tokenizer, for a file whose routing
follows the text), `--warm` decode steps, then times `--tokens` greedy decode steps while a thread samples the pool every 0.5 ms
(how many reads are in flight, how many queued). Prints tok/s, MiB read a token, stall a token,
demand misses and prefetches, the process's CPU time a token and the reader threads' share of it, the share of the wall time the drive had a read in flight, the
drive's rate while busy, and decode as a share of what that rate allows for the bytes read
("of limit": tok/s x MiB a token / rate). `--no-trial` keeps the prediction gate from ever
trying prediction off (before/after the gate's hold); `--readers` sets the pool's reader
threads. Run it with PYTHONPATH=OTHER_CHECKOUT for a before/after pair, alternating. Never run
by the tests.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.append(str(Path(__file__).resolve().parents[1]))  # (after PYTHONPATH: another checkout)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--budget", default="8GiB")
    ap.add_argument("--predict", default="auto")
    ap.add_argument("--ahead", type=int, default=None, help="MoE layers predicted ahead (--moe-predict-ahead)")
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--warm", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--readers", type=int)
    ap.add_argument("--no-trial", action="store_true", help="the prediction gate never tries prediction off")
    ap.add_argument("--prose", action="store_true", help="the prompt is English text, not random ids")
    ap.add_argument("--json", action="store_true", help="one JSON line only")
    a = ap.parse_args()

    import onebit
    import onebit.memory.pool as pool_mod
    import onebit.moe.predict as predict_mod

    if a.readers:
        pool_mod.READERS = a.readers
    if a.no_trial:
        predict_mod.Gate.FIRST = 10**9
    m = onebit.load(a.model, backend="cpu", budget=a.budget, predict=predict_mod.settings_from(mode=a.predict, ahead=a.ahead))
    pool = m.pool
    if pool is None:
        raise SystemExit(f"{a.model} loaded resident at {a.budget}: nothing streams")
    cache = m.new_cache()
    rng = np.random.default_rng(1)
    if a.prose:
        from bench_predict_default import PROMPT

        logits = m.net.forward(np.array(m.tokenizer.encode(PROMPT), np.int64), cache, last_only=True)
        tok = np.array([int(np.argmax(logits[-1]))])
    else:
        m.net.forward(rng.integers(100, 5000, a.prompt), cache, last_only=True)
        tok = np.array([42])
    for _ in range(a.warm):
        tok = np.array([int(np.argmax(m.net.forward(tok, cache, last_only=True)[-1]))])
    flight, queued, stop = collections.Counter(), collections.Counter(), [False]

    def sample():
        while not stop[0]:
            flight[pool.in_flight] += 1
            queued[min(len(pool.queue), 9)] += 1
            time.sleep(0.0005)

    before = dict(pool.stats.__dict__)
    read_cpu, cpu0 = pool.read_cpu_seconds, time.process_time()
    th = threading.Thread(target=sample, daemon=True)
    th.start()
    t0 = time.perf_counter()
    for _ in range(a.tokens):
        tok = np.array([int(np.argmax(m.net.forward(tok, cache, last_only=True)[-1]))])
    dt = time.perf_counter() - t0
    cpu = time.process_time() - cpu0
    stop[0] = True
    th.join()
    d = {k: v - before[k] for k, v in pool.stats.__dict__.items() if isinstance(v, (int, float))}
    n = a.tokens
    mib = d["bytes_read"] / n / 2**20
    rate = d["bytes_read"] / d["busy_seconds"] if d["busy_seconds"] else 0.0
    out = {"tok_s": round(n / dt, 3), "mib_tok": round(mib, 1), "stall_ms_tok": round(1000 * d["stall_seconds"] / n, 1),
           "cpu_ms_tok": round(1000 * cpu / n, 1),
           "read_cpu_ms_tok": round(1000 * (pool.read_cpu_seconds - read_cpu) / n, 1),
           "demand_misses": d["demand_misses"], "prefetches": d["prefetches"], "wasted": d["wasted_prefetches"],
           "busy_share": round(d["busy_seconds"] / dt, 3), "gbs_busy": round(rate / 1e9, 3),
           "of_limit": round(n / dt * mib * 2**20 / rate, 3) if rate else None}
    print(json.dumps(out))
    if not a.json:
        total = sum(flight.values())
        print("reads in flight (share of samples):", {k: round(v / total, 3) for k, v in sorted(flight.items())})
        print("reads queued (share of samples):", {k: round(v / total, 3) for k, v in sorted(queued.items())})
    m.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
