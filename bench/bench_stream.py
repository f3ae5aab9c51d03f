"""Streamed decode against fully resident decode on the same file, in one run.

    python bench/bench_stream.py MODEL.gguf [--tokens 16] [--fractions 0.25,0.5,0.75,1.0] [--trace out.jsonl]

For each fraction of all experts kept in slots, decode the same greedy continuation and
print tok/s (and its ratio to the resident run), bytes read per token against the minimum
(the routed experts' bytes), stall per token and the pool's hit rate. Runs alternate
(resident, streamed, resident, ...) and report medians, since this machine is shared.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

import onebit
from onebit.formats.gguf_file import is_expert_tensor
from onebit.memory.budget import format_bytes


def decode(model, prompt: np.ndarray, n: int) -> tuple[float, list[int]]:
    cache = model.new_cache()
    logits = model.net.forward(prompt, cache, last_only=True)
    tok = int(logits[-1].argmax())
    toks = [tok]
    t0 = time.perf_counter()
    for _ in range(n):
        logits = model.net.forward(np.array([tok]), cache, last_only=True)
        tok = int(logits[-1].argmax())
        toks.append(tok)
    return n / (time.perf_counter() - t0), toks


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--fractions", default="0.25,0.5,0.75,1.0")
    ap.add_argument("--ctx", type=int, default=512)
    args = ap.parse_args()
    resident = onebit.load(args.model, n_ctx=args.ctx)
    cfg = resident.cfg
    prompt = np.array(resident.tokenize("The json module encodes Python objects as JSON text."), dtype=np.int64)
    all_experts = cfg.n_experts * cfg.n_layers
    per_expert = sum(t.n_bytes // t.shape[0] for n, t in resident.gguf.tensors.items() if is_expert_tensor(n)) / cfg.n_layers
    print(f"model {args.model}: {cfg.n_layers} layers x {cfg.n_experts} experts, top-{cfg.n_experts_used}, "
          f"{format_bytes(per_expert)} per expert; {args.tokens} decode tokens, median of {args.runs} runs")
    print(f"{'resident':>9} {'slots':>6} {'tok/s':>8} {'vs all':>7} {'read/tok':>10} {'min/tok':>10} "
          f"{'stall/tok':>10} {'hit rate':>9}")
    min_per_tok = per_expert * cfg.n_experts_used * cfg.n_layers
    for frac in [float(x) for x in args.fractions.split(",")]:
        slots = max(int(round(frac * all_experts)), cfg.n_experts_used * 2)
        ref_tps, stream_tps, reads, stalls, hits = [], [], [], [], []
        for _ in range(args.runs):
            tps, ref_toks = decode(resident, prompt, args.tokens)
            ref_tps.append(tps)
            m = onebit.load(args.model, n_ctx=args.ctx, slots=slots, budget="1TiB")
            if m.pool is None:  # every expert fits: the resident path
                tps, toks = decode(m, prompt, args.tokens)
                stream_tps.append(tps)
                reads.append(0)
                stalls.append(0)
                hits.append(1.0)
                continue
            cache = m.new_cache()
            m.net.forward(prompt, cache, last_only=True)  # the prompt warms the pool
            warm = m.pool.stats.bytes_read, m.pool.stats.stall_seconds, m.pool.stats.hits, m.pool.stats.demand_misses
            tok = ref_toks[0]
            t0 = time.perf_counter()
            for i in range(args.tokens):
                logits = m.net.forward(np.array([tok]), cache, last_only=True)
                tok = int(logits[-1].argmax())
                assert tok == ref_toks[i + 1], "streamed decode diverged from resident"
            stream_tps.append(args.tokens / (time.perf_counter() - t0))
            st = m.pool.stats
            reads.append((st.bytes_read - warm[0]) / args.tokens)
            stalls.append((st.stall_seconds - warm[1]) / args.tokens)
            h, mi = st.hits - warm[2], st.demand_misses - warm[3]
            hits.append(h / (h + mi) if h + mi else 0.0)
            m.close()
        med = statistics.median
        print(f"{frac:>8.0%} {slots:>6} {med(stream_tps):>8.2f} {med(stream_tps) / med(ref_tps):>7.2f} "
              f"{format_bytes(med(reads)):>10} {format_bytes(min_per_tok):>10} {1000 * med(stalls):>8.2f}ms "
              f"{med(hits):>9.1%}")


if __name__ == "__main__":
    main()
