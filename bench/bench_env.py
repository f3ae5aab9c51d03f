"""Decode and prompt tok/s of `onebit generate` under variants of its environment, alternating:
for settings that are read from the environment (OpenMP's wait policy, numba's threads) or
for comparing a flag's values.

    python bench/bench_env.py FILE.gguf --variant OMP_WAIT_POLICY=ACTIVE --variant OMP_WAIT_POLICY=PASSIVE \
        [--args "--budget 8GiB"] [--tokens 32] [--rounds 3]

Each run is a fresh process (cpu backend, greedy, lookup off) on bench_predict_default's prose prompt; a
variant is `NAME=VALUE[,NAME=VALUE...]` set for its runs (an empty one: `--variant ""`, the
environment as it is). Variants take turns within a round; medians over rounds, with each
variant's ratio to the first.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys

from bench_predict_default import PROMPT


def run(model: str, tokens: int, extra: list[str], env: dict) -> dict:
    cmd = ["onebit", "generate", "-m", model, "-p", PROMPT, "-n", str(tokens), "--backend", "cpu",
           "--lookup", "0", "--json", *extra]
    r = subprocess.run(cmd, capture_output=True, text=True, errors="replace", timeout=3600, env={**os.environ, **env})
    if r.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--variant", action="append", required=True, help="NAME=VALUE[,NAME=VALUE...]")
    ap.add_argument("--args", default="", help="more `onebit generate` flags, e.g. \"--budget 8GiB\"")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    variants = [dict(kv.split("=", 1) for kv in v.split(",") if kv) for v in a.variant]
    got: dict[int, list[dict]] = {i: [] for i in range(len(variants))}
    for r in range(a.rounds):
        order = range(len(variants)) if r % 2 == 0 else reversed(range(len(variants)))
        for i in order:
            out = run(a.model, a.tokens, shlex.split(a.args), variants[i])
            got[i].append(out)
            print(f"  round {r + 1} {a.variant[i] or '(as is)'}: prompt {out['prompt_tps']:.2f}, "
                  f"decode {out['generation_tps']:.2f} tok/s", file=sys.stderr, flush=True)
    med = {i: (statistics.median(x["prompt_tps"] for x in v), statistics.median(x["generation_tps"] for x in v))
           for i, v in got.items()}
    print(f"{a.model} {a.args}; {a.tokens} tokens; medians of {a.rounds} rounds (tok/s)")
    print(f"{'variant':<40} {'prompt':>8} {'decode':>8} {'decode / first':>15}")
    for i, v in enumerate(a.variant):
        print(f"{v or '(as is)':<40} {med[i][0]:8.2f} {med[i][1]:8.2f} {med[i][1] / med[0][1]:15.2f}")


if __name__ == "__main__":
    main()
