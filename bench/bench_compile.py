"""Where a cold compile of the cpu kernels goes: per kernel (every numba function compiled,
with each of its signatures), per part of a kernel set, per quant type, and per stage (numba's
own timers: the whole compile against the time it held LLVM's lock; with --profile, the Python
time in onebit's IR generation, llvmlite's IR builder, numba's typing and lowering, and LLVM's
passes and code generation called through llvmlite.binding).

    python bench/bench_compile.py                         # the Gemma 3 270M Q4_K_M file's types
    python bench/bench_compile.py --types Q8_0,F32        # the shipped model's
    python bench/bench_compile.py --per-type              # each type of --types alone, then all
    python bench/bench_compile.py --target avx2           # the AVX2 target's kernels
    python bench/bench_compile.py --profile               # + the per-stage split (cProfile: slower)
    python bench/bench_compile.py --json out.json
    python bench/bench_compile.py --tree /work/wt-old     # another checkout's kernels (same script)

Each measurement runs in a process of its own with an empty numba cache (a fresh folder as
NUMBA_CACHE_DIR), compiling in that one process (as `Kernels.warm_up` does; the backend's first
run splits the parts over worker processes, `Kernels.fill_cache`). Times are wall seconds and
CPU seconds of that process: on a busy machine, read the CPU seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GEMMA_TYPES = "Q8_0,Q4_K,Q5_0,Q6_K,F32"  # gemma-3-270m-q4_k_m.gguf's matrices
PARTS = "dense,fused,small"


def child(types: list[str], parts: tuple[str, ...], target: str | None, profile: bool, x16: bool, tree: Path) -> dict:
    """In the measuring process: compile the set, part by part; report the timings."""
    sys.path.insert(0, str(tree))
    t0, c0 = time.perf_counter(), time.process_time()
    if target is not None:
        from onebit.backends.cpu.target import use

        use(target)
    from numba.core.registry import CPUDispatcher

    from onebit.backends.cpu import kernel_sets

    try:
        from onebit.backends.cpu.target import describe
    except ImportError:  # (a tree from before the compile target had a module)
        def describe():
            return {"cpu": "host", "isa": []}
    out = {"types": types, "parts": list(parts), "target": describe(), "vnni": kernel_sets.VNNI, "tree": str(tree),
           "import_s": time.perf_counter() - t0, "import_cpu_s": time.process_time() - c0, "by_part": {}}
    ks = kernel_sets.Kernels(types, parts, x16=x16)
    prof = None
    if profile:
        import cProfile

        prof = cProfile.Profile()
    for part in ks.parts:
        t, c = time.perf_counter(), time.process_time()
        if prof is not None:
            prof.enable()
        ks._compile(ks.names_of((part,)))
        if prof is not None:
            prof.disable()
        out["by_part"][part] = {"s": time.perf_counter() - t, "cpu_s": time.process_time() - c}
    out["total_s"] = time.perf_counter() - t0
    out["total_cpu_s"] = time.process_time() - c0

    # every dispatcher compiled: the set's kernels and the numba functions they call (their globals)
    seen, todo, kernels = set(), list(ks.kernels()), []
    while todo:
        d = todo.pop()
        if id(d) in seen:
            continue
        seen.add(id(d))
        kernels.append(d)
        todo += [v for v in d.py_func.__globals__.values() if isinstance(v, CPUDispatcher)]
    rows = []
    for d in kernels:
        for sig in d.overloads:
            timers = d.overloads[sig].metadata.get("timers", {}) if d.overloads[sig].metadata else {}
            rows.append({"kernel": d.py_func.__qualname__, "sig": str(sig),
                         "compile_s": timers.get("compiler_lock", 0.0), "llvm_s": timers.get("llvm_lock", 0.0)})
    out["kernels"] = sorted(rows, key=lambda r: -r["compile_s"])
    if prof is not None:
        out["stages"] = _stages(prof)
    return out


def _stages(prof) -> dict:
    """Seconds of own time (cProfile's tottime) by where the code lives."""
    import pstats

    st = pstats.Stats(prof)
    here = "/onebit/backends/"
    by = {"onebit IR generation": 0.0, "llvmlite IR builder": 0.0, "LLVM (llvmlite.binding)": 0.0,
          "numba typing and lowering": 0.0, "other": 0.0}
    for (file, _line, func), (_cc, _nc, tt, _ct, _callers) in st.stats.items():
        if here in file:
            key = "onebit IR generation"
        elif "llvmlite/ir" in file:
            key = "llvmlite IR builder"
        elif "llvmlite/binding" in file or func.startswith("<built-in method _ctypes") or "ctypes" in file:
            key = "LLVM (llvmlite.binding)"
        elif "/numba/" in file:
            key = "numba typing and lowering"
        else:
            key = "other"
        by[key] += tt
    return by


def measure(types, parts, target, profile, x16, tree: Path) -> dict:
    """child() in a fresh process with an empty numba cache."""
    with tempfile.TemporaryDirectory(prefix="onebit-compile-") as cache:
        env = dict(os.environ, NUMBA_CACHE_DIR=cache)
        env.pop("ONEBIT_CPU_TARGET", None)
        args = [sys.executable, __file__, "--child", "--types", ",".join(types), "--parts", ",".join(parts)]
        args += (["--target", target] if target else []) + (["--profile"] if profile else [])
        args += (["--x16"] if x16 else []) + ["--tree", str(tree)]
        r = subprocess.run(args, env=env, capture_output=True, text=True)
        if r.returncode != 0:
            raise SystemExit(f"the measuring process failed:\n{r.stderr[-3000:]}")
        return json.loads(r.stdout.strip().splitlines()[-1])


def show(res: dict, top: int) -> None:
    t = res["target"]
    print(f"types {','.join(res['types'])}  parts {','.join(res['parts'])}  target {t['cpu']} "
          f"({' '.join(t['isa'])}){'  X16 layouts' if res.get('x16') else ''}")
    print(f"  import {res['import_s']:.1f} s; total {res['total_s']:.1f} s wall, {res['total_cpu_s']:.1f} s CPU")
    for p, v in res["by_part"].items():
        print(f"  part {p:<12} {v['s']:6.1f} s wall {v['cpu_s']:6.1f} s CPU")
    print(f"  {'kernel':<44} {'compile s':>9} {'LLVM s':>7}  signature")
    for k in res["kernels"][:top]:
        print(f"  {k['kernel']:<44} {k['compile_s']:9.2f} {k['llvm_s']:7.2f}  {k['sig'][:90]}")
    if len(res["kernels"]) > top:
        print(f"  ... {len(res['kernels']) - top} more")
    print(f"  {len(res['kernels'])} compiled functions (signatures)")
    if "stages" in res:
        total = sum(res["stages"].values())
        print("  own time by stage (cProfile):")
        for k, v in res["stages"].items():
            print(f"    {k:<28} {v:6.1f} s  {100 * v / total:4.0f}%")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--types", default=GEMMA_TYPES, help="quant types, comma-separated")
    ap.add_argument("--parts", default=PARTS, help="parts of the kernel set (kernel_sets.WARM_PARTS), comma-separated")
    ap.add_argument("--per-type", action="store_true", help="each type alone first")
    ap.add_argument("--target", default=None, help="compile target (target.TARGETS: native, avx2)")
    ap.add_argument("--x16", action="store_true", help="with the X16 layouts' branches (AVX-512 VNNI)")
    ap.add_argument("--profile", action="store_true", help="split the compile by stage (cProfile)")
    ap.add_argument("--top", type=int, default=15, help="kernels shown per measurement")
    ap.add_argument("--json", default=None, help="write every measurement here")
    ap.add_argument("--tree", default=ROOT, type=Path,
                    help="the checkout whose kernels are compiled (default: this one)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    types, parts = a.types.split(","), tuple(a.parts.split(","))
    if a.child:
        res = child(types, parts, a.target, a.profile, a.x16, a.tree.resolve())
        res["x16"] = a.x16
        print(json.dumps(res))
        return
    runs = ([[t] for t in types] if a.per_type else []) + [types]
    results = []
    for ts in runs:
        res = measure(ts, parts, a.target, a.profile, a.x16, a.tree.resolve())
        res["x16"] = a.x16
        results.append(res)
        show(res, a.top)
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
