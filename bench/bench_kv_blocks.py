"""Decode CPU time a token with each KV cache type on the cpu backend, its attention reading a
quantized cache's blocks as stored (the default) against decoding the layer's rows to float32
every step (as before kv_attention.py; the backend's `reads_kv_blocks` turned off). CPU time
(every thread's), min over --reps: meaningful on a busy machine, where wall time is not.

    python bench/bench_kv_blocks.py FILE [--context 1024] [--tokens 8] [--reps 3] [--types q8_0,q4_0]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import onebit


def decode_cpu(path: str, t: str, blocks: bool, context: int, tokens: int, reps: int) -> float:
    """Seconds of CPU a decode token, after a prompt of `context` tokens."""
    with onebit.load(path, backend="cpu", n_ctx=max(2048, context + tokens * reps + 1), cache_type_k=t,
                     cache_type_v=t) as m:
        m.be.reads_kv_blocks = blocks
        ids = np.random.default_rng(0).integers(3, m.cfg.vocab_size, context)
        cache = m.net.make_cache()
        tok = int(m.net.forward(ids, cache, last_only=True)[-1].argmax())
        best = float("inf")
        for _ in range(reps):
            c0 = time.process_time()
            for _ in range(tokens):
                tok = int(m.net.forward(np.array([tok]), cache)[-1].argmax())
            best = min(best, (time.process_time() - c0) / tokens)
        return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("file")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--types", default="q8_0,q4_0")
    args = ap.parse_args()
    base = decode_cpu(args.file, "f32", False, args.context, args.tokens, args.reps)
    print(f"decode at a {args.context}-token context, CPU ms a token (x f32's tokens per CPU-second)")
    print("| cache | decoded each step | blocks read as stored |\n|---|---:|---:|")
    print(f"| f32 | {base * 1e3:.1f} (1.00x) | |")
    for t in args.types.split(","):
        old, new = (decode_cpu(args.file, t, b, args.context, args.tokens, args.reps) for b in (False, True))
        print(f"| {t} | {old * 1e3:.1f} ({base / old:.2f}x) | {new * 1e3:.1f} ({base / new:.2f}x) |")


if __name__ == "__main__":
    main()
