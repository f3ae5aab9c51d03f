#!/usr/bin/env python3
"""Prompt and decode speed with each KV cache type (--cache-type-k / -v), one model loaded per
type, the types taking turns over rounds (ABAB: a noisy machine moves every type alike); prints
the median tok/s of each and the cache's bytes at the context. The prompt is long enough that
the attention's reads of the cache show.

    python bench/bench_kv_types.py FILE [--backend cpu] [--types f32,f16,q8_0,q4_0] [--prompt 1024]
                                        [--gen 64] [--rounds 3] [--ctx 2048]
"""

from __future__ import annotations

import argparse
import statistics

import onebit
from onebit.apps.bench import run_bench
from onebit.cache import KVTypes, kv_cache_bytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("file")
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--types", default="f32,f16,q8_0,q4_0")
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--ctx", type=int, default=2048)
    args = ap.parse_args()
    types = args.types.split(",")
    models = {t: onebit.load(args.file, backend=args.backend, n_ctx=args.ctx, cache_type_k=t, cache_type_v=t)
              for t in types}
    got: dict[str, list[tuple[float, float]]] = {t: [] for t in types}
    try:
        for _ in range(args.rounds):
            for t in types:
                r = run_bench(models[t], args.prompt, args.gen, 1, warmup=not got[t])
                got[t].append((r["prompt_tps"], r["decode_tps"]))
        print(f"{args.file}, backend {models[types[0]].be.name}, prompt {args.prompt}, decode {args.gen}, "
              f"{args.rounds} rounds (medians)")
        print(f"{'type':6s} {'KV bytes at ctx':>16s} {'prompt tok/s':>13s} {'decode tok/s':>13s} "
              f"{'decode vs ' + types[0]:>14s}")
        base = statistics.median(d for _, d in got[types[0]])
        for t in types:
            p, d = statistics.median(p for p, _ in got[t]), statistics.median(d for _, d in got[t])
            kv = kv_cache_bytes(models[t].cfg, args.ctx, KVTypes(t, t))
            print(f"{t:6s} {kv:16,d} {p:13.1f} {d:13.1f} {d / base:14.2f}")
    finally:
        for m in models.values():
            m.close()


if __name__ == "__main__":
    main()
