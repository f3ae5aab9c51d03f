"""Whether the default routing prediction (`--moe-predict auto`) costs what it cannot win back:
decode tok/s of auto, off and block (and router) on each file and memory setting, alternating,
with auto's ratio to the better of off and block.

    python bench/bench_predict_default.py FILE.gguf --slots 384 --tokens 24,160 --rounds 3
    python bench/bench_predict_default.py BIG.gguf --budget 8GiB --tokens 24,64 --rounds 2

Each run is a fresh `onebit generate` process (cpu backend, greedy, lookup decoding off so that
only prediction differs) on the same real-prose prompt; the figure is its own generation_tps
(decode tokens over decode seconds, the first token's forward included). Modes alternate within
a round; medians over rounds. The target: auto >= 0.95 of max(off, block) everywhere.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

PROMPT = ("The history of the printing press begins in the workshops of goldsmiths and wine makers along "
          "the Rhine. Movable type had been known in Korea and China for centuries, but the alphabet made "
          "it practical in Europe.")


def run(model: str, mode: str, tokens: int, memory: list[str], backend: str) -> float:
    cmd = ["onebit", "generate", "-m", model, "-p", PROMPT, "-n", str(tokens), "--moe-predict", mode,
           "--backend", backend, "--lookup", "0", "--json", *memory]
    r = subprocess.run(cmd, capture_output=True, text=True, errors="replace", timeout=3600)
    if r.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{r.stderr[-2000:]}")
    return float(json.loads(r.stdout.strip().splitlines()[-1])["generation_tps"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="+")
    ap.add_argument("--slots", help="expert slots (as --slots)")
    ap.add_argument("--budget", help="memory budget (as --budget)")
    ap.add_argument("--tokens", default="24,160")
    ap.add_argument("--modes", default="auto,off,block,router")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--backend", default="cpu")
    a = ap.parse_args()
    memory = (["--slots", a.slots] if a.slots else []) + (["--budget", a.budget] if a.budget else [])
    modes = a.modes.split(",")
    lengths = [int(n) for n in a.tokens.split(",")]
    got: dict[tuple, list[float]] = {}
    for r in range(a.rounds):
        for model in a.models:
            for n in lengths:
                for mode in modes:
                    tps = run(model, mode, n, memory, a.backend)
                    got.setdefault((model, n, mode), []).append(tps)
                    print(f"  round {r + 1} {model} {n} tokens {mode}: {tps:.2f} tok/s", file=sys.stderr, flush=True)
    print(f"memory: {' '.join(memory) or 'the plan'}; backend {a.backend}; medians of {a.rounds} rounds (tok/s)")
    print(f"{'file':<40} {'tokens':>6} " + " ".join(f"{m:>8}" for m in modes) + f" {'auto/best':>9}")
    for model in a.models:
        for n in lengths:
            med = {m: statistics.median(got[model, n, m]) for m in modes}
            best = max(med[m] for m in ("off", "block") if m in med)
            ratio = med["auto"] / best if "auto" in med else float("nan")
            print(f"{model[-40:]:<40} {n:>6} " + " ".join(f"{med[m]:8.2f}" for m in modes) + f" {ratio:9.2f}")


if __name__ == "__main__":
    main()
