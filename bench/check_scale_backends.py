"""Greedy tokens and peak memory of one backend on a big file, streamed at a budget: run it once
per backend and compare the token lists (the Vulkan backend at real size against cpu).

    python bench/check_scale_backends.py /work/big/q3-30b-shape.gguf --backend cpu --budget 8GiB
    python bench/check_scale_backends.py /work/big/q3-30b-shape.gguf --backend vulkan --budget 8GiB

Prints one JSON line: the plan's decision, the greedy tokens (a 12-token prompt, then 7 more;
with `--prompt-tokens N`, a prompt of N tokens, long enough from about 24 to route to most of a
layer's experts and so take the pool's prompt path), seconds, and the process's peak RSS
(GiB). Each backend in its own process, so the peaks are its own.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--budget", default="8GiB")
    ap.add_argument("--predict", default=None, help="prediction mode (default: what a load picks)")
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=0, help="a prompt of this many tokens (0: the short one)")
    a = ap.parse_args()
    import onebit

    t0 = time.time()
    m = onebit.load(a.model, backend=a.backend, budget=a.budget, predict=a.predict)
    ids = m.tokenize("The json module encodes Python objects as JSON text.")
    if a.prompt_tokens:
        ids = (ids * (a.prompt_tokens // len(ids) + 1))[: a.prompt_tokens]
    cache = m.new_cache()
    logits = m.net.forward(np.array(ids), cache, last_only=True)
    out = [int(logits[-1].argmax())]
    for _ in range(a.tokens - 1):
        logits = m.net.forward(np.array([out[-1]]), cache, last_only=True)
        out.append(int(logits[-1].argmax()))
    print(json.dumps({"backend": m.be.name, "decision": m.decision, "tokens": out, "seconds": round(time.time() - t0),
                      "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3)}))


if __name__ == "__main__":
    main()
