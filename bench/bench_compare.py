#!/usr/bin/env python3
"""onebit against llama.cpp on the same GGUF files, alternating, as users run each.

    python bench/bench_compare.py MODEL.gguf [MODEL2.gguf ...] --llama-bench PATH/llama-bench
        [--rounds 3] [--prompt 64] [--tokens 32] [--other DIR] [--llama-args "--load-mode none"]
        [--json OUT.json]
    python bench/bench_compare.py MODEL.gguf ... --other DIR    # this checkout against another only

Per file and round, in turn: `onebit bench FILE --backend cpu --prompt-tokens P --gen-tokens N
--runs 1` (each a fresh process: load, then onebit bench's untimed warm-up run, as llama-bench's,
then one timed prompt and one timed decode of N tokens; a checkout before the warm-up run came
to onebit bench times its first run), the same with the checkout --other (before/after a
change), and `llama-bench -m FILE
-p P -n N -t 2 -r 1` with llama.cpp's defaults (2 threads, weight repacking on; extra flags from
--llama-args). The table gives each one's median over the rounds, and onebit / llama.cpp (without
--llama-bench: this checkout / the --other one).
The --other checkout runs with PYTHONPATH=DIR; with onebit installed editable, `onebit.memory`
still maps to the installed tree's `memory/` unless DIR has an `onebit/memory` link to its own
(`ln -s ../memory DIR/onebit/memory`). Never run by the tests.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def onebit_run(root: Path, model: str, prompt: int, tokens: int, extra: tuple = ()) -> tuple[float, float]:
    env = dict(os.environ, PYTHONPATH=str(root))
    cmd = [sys.executable, "-c", "from cli.main import main; main()", "bench", model, "--backend", "cpu",
           "--prompt-tokens", str(prompt), "--gen-tokens", str(tokens), "--runs", "1", *extra]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=root, timeout=3600)
    got = dict(re.findall(r"^(prompt|decode)\s+\d+ tokens: ([\d.]+) tok/s", out.stdout, re.M))
    if len(got) != 2:
        raise SystemExit(f"onebit bench failed ({root}):\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
    return float(got["prompt"]), float(got["decode"])


def llama_run(binary: str, model: str, prompt: int, tokens: int, extra: list[str]) -> tuple[float, float]:
    cmd = [binary, "-m", model, "-p", str(prompt), "-n", str(tokens), "-t", "2", "-r", "1", "-o", "json", *extra]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if out.returncode:
        raise SystemExit(f"llama-bench failed:\n{out.stderr[-2000:]}")
    rows = json.loads(out.stdout)
    pp = next(r["avg_ts"] for r in rows if r["n_prompt"] and not r["n_gen"])
    tg = next(r["avg_ts"] for r in rows if r["n_gen"] and not r["n_prompt"])
    return float(pp), float(tg)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="+")
    ap.add_argument("--llama-bench", help="llama.cpp's llama-bench (without it: --other is the peer)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--other", type=Path, help="another onebit checkout, run beside this one")
    ap.add_argument("--llama-args", default="", help="extra llama-bench flags, e.g. '--load-mode none'")
    ap.add_argument("--onebit-args", default="", help="extra `onebit bench` flags, e.g. '--budget 1TiB' (every expert resident)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    mine = tuple(shlex.split(args.onebit_args))
    runs = [("onebit", lambda m: onebit_run(ROOT, m, args.prompt, args.tokens, mine))]
    if args.other:
        runs.append(("onebit --other", lambda m: onebit_run(args.other, m, args.prompt, args.tokens, mine)))
    if args.llama_bench:
        runs.append(("llama.cpp", lambda m: llama_run(args.llama_bench, m, args.prompt, args.tokens,
                                                       args.llama_args.split())))
    elif not args.other:
        ap.error("give --llama-bench, --other, or both")
    peer = "llama.cpp" if args.llama_bench else "onebit --other"
    results = {}
    for model in args.models:
        got = {name: [] for name, _ in runs}
        for r in range(args.rounds):
            for name, fn in runs:
                got[name].append(fn(model))
                print(f"  {Path(model).name} round {r + 1} {name}: prompt {got[name][-1][0]:.1f} decode "
                      f"{got[name][-1][1]:.1f}", file=sys.stderr, flush=True)
        results[model] = {n: {"prompt": [p for p, _ in v], "decode": [d for _, d in v]} for n, v in got.items()}
    print(f"prompt {args.prompt} tokens, decode {args.tokens} tokens; medians of {args.rounds} alternating rounds")
    print()
    print(f"| file | run | prompt tok/s | decode tok/s | prompt x {peer} | decode x {peer} |")
    print("|---|---|---:|---:|---:|---:|")
    for model, res in results.items():
        lp, ld = (statistics.median(res[peer][k]) for k in ("prompt", "decode"))
        for name, v in res.items():
            p, d = statistics.median(v["prompt"]), statistics.median(v["decode"])
            print(f"| {Path(model).name} | {name} | {p:.1f} | {d:.1f} | {p / lp:.2f} | {d / ld:.2f} |")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
