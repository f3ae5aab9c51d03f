"""Lookup decoding: what verifying rows costs, and what lookup gains, measured in one run.

Part 1, rho(R) = T(one forward over R rows) / T(one row), R = 1..9, at a fixed context, on
each backend asked for: the R values are run in alternating order (1..9 then 9..1, repeated)
and each is the median of its runs; every forward is rolled back so all run at the same
position. Beside it, "bytes": the weight bytes a forward over R rows must read as a multiple
of one row's (every weight once, token_embd excepted where it is only a row lookup, and each
routed expert once for all the rows that chose it, by the routing these forwards took): the
floor under rho(R) where a step is bound by reading its weights.

Part 2, lookup vs plain greedy decoding on two prompt sets (copy-heavy: rewrite, quote, fix
this code; open: questions with no text to copy), at 2 and 8 drafts: the modes alternate
ABBA per prompt, outputs are asserted identical, and the table gives decode tok/s (median
over the set's prompts of each prompt's median), the ratio to plain, tokens per forward and
the accept rate.

    python bench/bench_lookup.py [--model M.gguf] [--backend numpy --backend vulkan] [--reps 5]
        [--slots N]      # routed experts streamed through a pool of N slots (default: resident)
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
from onebit.generate import generate_step  # noqa: E402
from onebit.memory.plan import size_classes  # noqa: E402
from onebit.lookup import LookupStats  # noqa: E402
from onebit.sample import make_sampler  # noqa: E402

COPY_HEAVY = [
    "Rewrite this sentence in the past tense: The cat sits on the mat and watches the birds in the garden.",
    "Quote the following line back to me exactly: To be, or not to be, that is the question.",
    "Fix the bug in this code and print the whole function:\n\ndef add(a, b):\n    return a - b\n",
    "Repeat this list, one item per line: apples, bananas, cherries, dates, elderberries, figs, grapes.",
    "Correct the spelling and repeat the text: Teh quick brwon fox jumsp over teh lazy dgo.",
    "Copy this JSON and add a field \"age\": 30: {\"name\": \"Ada\", \"city\": \"London\", \"job\": \"engineer\"}",
]
OPEN = [
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Explain what a hash table is.",
    "Give me three ideas for a birthday party.",
    "Why is the sky blue?",
    "How do I sort a list in Python?",
]


def at_context(m, ctx: int):
    """(token ids, a cache holding the first ctx of them): the forwards over R rows then take
    ids[ctx : ctx + R] and are rolled back."""
    ids = np.arange(1, ctx + 10, dtype=np.int64) % m.cfg.vocab_size
    cache = m.new_cache()
    m.net.forward(ids[:ctx], cache, last_only=True)
    return ids, cache


def rho_table(m, reps: int, ctx: int = 64) -> list[float]:
    ids, cache = at_context(m, ctx)
    times: dict[int, list[float]] = {R: [] for R in range(1, 10)}
    for R in range(1, 10):  # warm: recordings and kernels made before timing
        m.net.forward(ids[ctx : ctx + R], cache)
        cache.trim(R)
    for rep in range(reps):
        order = range(1, 10) if rep % 2 == 0 else range(9, 0, -1)
        for R in order:
            t0 = time.perf_counter()
            m.net.forward(ids[ctx : ctx + R], cache)
            times[R].append(time.perf_counter() - t0)
            cache.trim(R)
    t1 = statistics.median(times[1])
    return [statistics.median(times[R]) / t1 for R in range(1, 10)], t1


def byte_floor(m, ctx: int = 64) -> list[float]:
    """bytes(R) / bytes(1), R = 1..9, at rho_table's context and tokens (see the docstring)."""
    tensors = m.gguf.tensors
    # layer -> the bytes of one of its routed experts (the expert pool's size classes)
    per_expert = {l: c.expert_bytes for c in size_classes(m.gguf) for l in c.layers}
    every = sum(t.n_bytes for t in tensors.values())
    dense = every - sum(b * m.cfg.n_experts for b in per_expert.values())
    if "output.weight" in tensors:  # (else token_embd is the head too: read whole)
        dense -= tensors["token_embd.weight"].n_bytes
    ids, cache = at_context(m, ctx)
    need = []
    for R in range(1, 10):
        routed = {}
        m.net.forward(ids[ctx : ctx + R], cache, hook=lambda layer, e, logits: routed.__setitem__(layer, e))
        cache.trim(R)
        need.append(dense + sum(per_expert[l] * len(set(e.ravel().tolist())) for l, e in routed.items()))
    return [b / need[0] for b in need]


def decode(m, prompt_ids, lookup: int, n: int):
    """(tokens, decode seconds after the first token, stats): n greedy tokens, no EOS stop."""
    cache, st = m.new_cache(), LookupStats()
    steps = generate_step(m.net, prompt_ids, cache, make_sampler(0.0), lookup=lookup, max_tokens=n,
                          max_positions=m.context_length, stats=st)
    toks = [next(steps)]
    t0 = time.perf_counter()
    toks += [next(steps) for _ in range(n - 1)]
    dt = time.perf_counter() - t0
    steps.close()
    return toks, dt, st


def lookup_table(m, prompts, n: int, reps: int, drafts=(2, 8)):
    rows = {}
    per_prompt = {d: [] for d in (0, *drafts)}
    stats = {d: LookupStats() for d in drafts}
    for p in prompts:
        ids = m.chat_tokens([{"role": "user", "content": p}])
        times = {d: [] for d in (0, *drafts)}
        want = None
        for rep in range(reps):
            order = (0, *drafts) if rep % 2 == 0 else (*reversed(drafts), 0)
            for d in order:
                toks, dt, st = decode(m, ids, d, n)
                if want is None:
                    want = toks
                assert toks == want, f"lookup {d} changed the output of {p!r}"
                times[d].append(dt)
                if d and rep == 0:
                    stats[d].add(st)
        for d in times:
            per_prompt[d].append(statistics.median(times[d]))
    base = [n - 1 for _ in prompts]
    for d in (0, *drafts):
        tps = statistics.median([(n - 1) / t for t in per_prompt[d]])
        ratio = statistics.median([t0 / t for t0, t in zip(per_prompt[0], per_prompt[d])])
        rows[d] = (tps, ratio, stats[d] if d else None)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="GGUF file (default: the shipped model)")
    ap.add_argument("--backend", action="append", default=None)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=64, help="tokens generated per prompt")
    ap.add_argument("--no-prompts", action="store_true", help="only the rho table")
    ap.add_argument("--slots", default=None, type=lambda v: v if v == "auto" else int(v), help="stream routed experts through a pool of this many slots")
    a = ap.parse_args()
    from onebit.cli.main import default_model_path

    path = a.model or default_model_path()
    print(f"model: {path}" + (f", experts streamed through {a.slots} slots" if a.slots else "") + "\n")
    for backend in a.backend or ["numpy"]:
        m = onebit.load(path, backend=backend, slots=a.slots)
        rho, t1 = rho_table(m, a.reps)
        print(f"## {m.be.name}: rho(R) = T(R rows) / T(1 row), 64-token context, median of {a.reps}"
              f" (T(1) = {1000 * t1:.1f} ms)\n")
        print("| R | " + " | ".join(str(R) for R in range(1, 10)) + " |")
        print("|---|" + "---|" * 9)
        print("| rho | " + " | ".join(f"{r:.2f}" for r in rho) + " |")
        print("| bytes | " + " | ".join(f"{b:.2f}" for b in byte_floor(m)) + " |\n")
        if a.no_prompts:
            continue
        for name, prompts in (("copy-heavy", COPY_HEAVY), ("open", OPEN)):
            rows = lookup_table(m, prompts, a.tokens, a.reps)
            print(f"## {m.be.name}: {name} prompts ({len(prompts)}), {a.tokens} greedy tokens each, "
                  f"ABBA x {a.reps}, outputs identical\n")
            print("| mode | decode tok/s | vs plain | tokens / forward | accept rate |")
            print("|---|---|---|---|---|")
            for d, (tps, ratio, st) in rows.items():
                label = "plain" if d == 0 else f"lookup {d}"
                tpf = f"{st.tokens_per_forward:.2f}" if st else "1.00"
                acc = f"{100 * st.accept_rate:.1f}%" if st else "-"
                print(f"| {label} | {tps:.1f} | {ratio:.2f}x | {tpf} | {acc} |")
            print()
        m.close()


if __name__ == "__main__":
    main()
