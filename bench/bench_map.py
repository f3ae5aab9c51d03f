"""A resident MoE file's first prompt and decode with its expert pages mapped at load
(`Model._map_experts`, MADV_POPULATE_READ) against left to first touch, alternating.

    python bench/bench_map.py MODEL.gguf [--rounds 2] [--prompt 128] [--tokens 32]

Each run is a fresh process: load with every expert resident (--budget 1TiB, cpu backend),
one prompt of `--prompt` tokens in a fresh cache, then `--tokens` greedy tokens (different
experts each token, as in use). "touch" turns the load's mapping off (the pages then map
when a step first reads them). Prints load seconds, prompt and decode tok/s per run and the
medians. The file should be in the page cache for both (run once before to warm it).
Never run by the tests.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def child(model: str, mode: str, prompt: int, tokens: int) -> dict:
    sys.path.insert(0, str(ROOT))
    import onebit
    from bench_vs_llamacpp import time_onebit
    from onebit import model as M

    if mode == "touch":
        M.Model._map_experts = lambda self: None
    t0 = time.perf_counter()
    m = onebit.load(model, backend="cpu", budget="1TiB")
    load = time.perf_counter() - t0
    ids = m.tokenize("The quick brown fox jumps over the lazy dog. " * (prompt // 4 + 8))[:prompt]
    pp, tg = time_onebit(m, ids, tokens)
    return {"load_s": load, "prompt_tps": pp, "decode_tps": tg}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.model, a.child, a.prompt, a.tokens)))
        return
    runs: dict[str, list[dict]] = {"touch": [], "mapped": []}
    for r in range(a.rounds):
        for mode in runs:
            out = subprocess.run([sys.executable, __file__, a.model, "--child", mode, "--prompt", str(a.prompt),
                                  "--tokens", str(a.tokens)], capture_output=True, text=True, check=True)
            got = json.loads(out.stdout.strip().splitlines()[-1])
            runs[mode].append(got)
            print(f"  round {r + 1} {mode:7s} load {got['load_s']:.1f} s  prompt {got['prompt_tps']:.2f} tok/s  "
                  f"decode {got['decode_tps']:.2f} tok/s", flush=True)
    print(f"\n{Path(a.model).name}: {a.prompt}-token prompt, {a.tokens} greedy tokens, medians of {a.rounds}")
    for mode, rs in runs.items():
        med = {k: statistics.median(x[k] for x in rs) for k in rs[0]}
        print(f"{mode:7s} load {med['load_s']:.1f} s  prompt {med['prompt_tps']:.2f} tok/s  decode {med['decode_tps']:.2f} tok/s")


if __name__ == "__main__":
    main()
