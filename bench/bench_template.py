"""What the bounded chat-template worker costs a chat turn (issue 36).

Renders the shipped model's chat template for a conversation of 1..TURNS turns, as `onebit chat`
does each turn, two ways: through the worker process (`render_chat`: one pickle + pipe round
trip + JSON reply) and in this process without limits (`render_here`), alternating, and prints
the median of each and their difference per conversation length. The first call (the worker's
start) is reported separately.

    python bench/bench_template.py [--turns 50] [--reps 20] [MODEL]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", default=str(ROOT / "onebit" / "data" / "default.gguf"))
    ap.add_argument("--turns", type=int, default=50)
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args()

    from onebit.chat_formats import chat_template as ct
    from onebit.formats.gguf_file import GGUFFile

    g = GGUFFile(a.model)
    template = g.get("tokenizer.chat_template") or ct.fallback_template(g.get("tokenizer.ggml.tokens"))[1]
    print(f"model {a.model}: template of {len(template)} characters")
    t0 = time.perf_counter()
    ct.render_chat(template, [{"role": "user", "content": "hi"}], source=a.model)
    print(f"first render (starts the worker): {1e3 * (time.perf_counter() - t0):.1f} ms")
    msgs: list[dict] = []
    print(f"{'turns':>5} {'chars':>7} {'worker ms':>10} {'in-process ms':>14} {'cost ms':>8}")
    for turn in range(1, a.turns + 1):
        msgs += [{"role": "user", "content": f"Question {turn}: what is {turn} times seven, and why?"},
                 {"role": "assistant", "content": f"It is {7 * turn}: seven added {turn} times. " * 3}]
        ask = msgs[:-1]
        context = dict(messages=ask, add_generation_prompt=True, bos_token="", eos_token="", tools=None)
        limit = ct.MIN_OUTPUT_CHARS + 8 * ct._size_of(ask)
        w, h = [], []
        for _ in range(a.reps):
            t = time.perf_counter()
            text = ct.render_chat(template, ask, source=a.model)
            w.append(time.perf_counter() - t)
            t = time.perf_counter()
            here = ct.render_here(template, context, limit, a.model)
            h.append(time.perf_counter() - t)
            assert text == here
        if turn in (1, 2, 5, 10, 20, 50, 100, 200, 500) or turn == a.turns:
            mw, mh = statistics.median(w) * 1e3, statistics.median(h) * 1e3
            print(f"{turn:5d} {len(text):7d} {mw:10.3f} {mh:14.3f} {mw - mh:8.3f}")
    print(f"worker processes started: {ct._WORKER.started}")


if __name__ == "__main__":
    main()
