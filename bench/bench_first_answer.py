"""The first answer with a user's own file and an empty kernel cache: `onebit generate -m FILE
-p hi -n 8 --backend cpu`, each run with a fresh NUMBA_CACHE_DIR (a new empty folder, removed
after), this checkout and others alternating.

    python bench/bench_first_answer.py -m /work/models/gemma-3-270m-q4_k_m.gguf \\
        -m /work/big/q3moe-0.9b-Q4_K_M.gguf --tree /work/wt-old --runs 3
    python bench/bench_first_answer.py -m FILE --fill      # the compile alone, per process
    python bench/bench_first_answer.py --all --fill        # the all-types set (the test suite's)

Per run: seconds from start to exit (wall), the CPU seconds of the command and the processes it
started (user + system), the compile's own seconds (onebit's "compiled the cpu kernels in" line)
and the answer (the greedy tokens' text, which must be the same in every tree). Wall seconds
mean something only on a quiet machine; CPU seconds roughly on a busy one.

--fill: `Kernels.fill_cache` of the file's kernel set (with --all: the all-types set that the test
suite compiles before its first test, conftest.cpu_kernels) alone, in a process of its own, and the CPU
seconds of that process and of the worker processes it started: on a quiet machine with a core
each, the compile's wall time is about the larger of the two. --tree runs another checkout's
onebit: it needs a venv of its own at TREE/.venv (`pip install -e .` there).
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

FILL = """
import json, os, resource, sys, time
from onebit.backends.cpu import CpuBackend
from onebit.backends.cpu.kernel_sets import kernels_for
from onebit.formats.gguf_file import GGUFFile
if sys.argv[1] == "*":
    from onebit.backends.cpu.kernel_sets import EVERY as k
else:
    g = GGUFFile(sys.argv[1])
    k = kernels_for(g, CpuBackend.memory_policy(g).repacks)
plan = k.plan(os.cpu_count() or 1)[0] if hasattr(k, "plan") else None
c0, t0 = time.process_time(), time.perf_counter()
k.fill_cache()
own, wall = time.process_time() - c0, time.perf_counter() - t0
ch = resource.getrusage(resource.RUSAGE_CHILDREN)
print(json.dumps({"kernels": len(k.kernels()), "main_cpu_s": own, "workers_cpu_s": ch.ru_utime + ch.ru_stime,
                  "wall_s": wall, "plan": plan}))
"""


def python_of(tree: Path) -> str:
    exe = tree / ".venv" / "bin" / "python"
    if not exe.exists():
        raise SystemExit(f"{tree} has no .venv: make one there (python3 -m venv .venv; pip install -e .)")
    return str(exe)


def children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def generate(tree: Path, path: str) -> dict:
    cache = tempfile.mkdtemp(prefix="onebit-first-answer-")
    try:
        env = dict(os.environ, NUMBA_CACHE_DIR=cache)
        args = [python_of(tree), "-m", "onebit.cli.main", "generate", "-m", path, "-p", "hi", "-n", "8",
                "--backend", "cpu"]
        c0, t0 = children_cpu(), time.perf_counter()
        r = subprocess.run(args, env=env, capture_output=True, text=True, cwd=tree, timeout=1200)
        wall, cpu = time.perf_counter() - t0, children_cpu() - c0
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    if r.returncode != 0:
        raise SystemExit(f"generate failed in {tree} ({r.returncode}): {r.stderr[-2000:]}")
    m = re.search(r"compiled the cpu kernels in ([\d.]+) s", r.stderr)
    return {"wall_s": wall, "cpu_s": cpu, "compile_s": float(m.group(1)) if m else None, "answer": r.stdout}


def fill(tree: Path, path: str, keep: str | None) -> dict:
    import json

    cache = keep or tempfile.mkdtemp(prefix="onebit-first-answer-")
    try:
        r = subprocess.run([python_of(tree), "-c", FILL, path], env=dict(os.environ, NUMBA_CACHE_DIR=cache),
                           capture_output=True, text=True, cwd=tree, timeout=3600)
    finally:
        if keep is None:
            shutil.rmtree(cache, ignore_errors=True)
    if r.returncode != 0:
        raise SystemExit(f"the fill failed in {tree}: {r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", action="append", default=[], help="GGUF file (repeat for more)")
    ap.add_argument("--all", action="store_true", help="with --fill: the all-types kernel set")
    ap.add_argument("--cache", default=None, help="with --fill: compile into this (empty) folder and keep it")
    ap.add_argument("--tree", action="append", default=[], type=Path, help="another checkout (repeat for more)")
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--fill", action="store_true", help="the compile alone, CPU seconds per process")
    a = ap.parse_args()
    trees = [ROOT] + [t.resolve() for t in a.tree]
    if a.all and not a.fill:
        ap.error("--all goes with --fill")
    if not a.model and not a.all:
        ap.error("-m FILE (or --all --fill) is required")
    for path in a.model + (["*"] if a.all else []):
        answers = {}
        for run in range(a.runs):
            for tree in trees:  # (alternating)
                if a.fill:
                    f = fill(tree, path, a.cache)
                    print(f"{Path(path).name}  {tree}  run {run + 1}: {f['kernels']} kernels; CPU s: this process "
                          f"{f['main_cpu_s']:.1f}, workers {f['workers_cpu_s']:.1f}; wall {f['wall_s']:.1f} s"
                          + (f"; plan {f['plan']}" if f["plan"] else ""), flush=True)
                    continue
                g = generate(tree, path)
                answers.setdefault(g["answer"], []).append(str(tree))
                comp = "?" if g["compile_s"] is None else f"{g['compile_s']:.1f}"
                print(f"{Path(path).name}  {tree}  run {run + 1}: {g['wall_s']:.1f} s start to exit, "
                      f"{g['cpu_s']:.1f} s CPU, compile {comp} s", flush=True)
        if len(answers) > 1:
            print(f"  DIFFERENT ANSWERS: {answers}")
        elif answers:
            print(f"  the same answer in every tree: {next(iter(answers))!r}")


if __name__ == "__main__":
    main()
