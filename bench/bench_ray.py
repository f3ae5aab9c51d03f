"""Batch generation on Ray (issue 37): prompts/s with 1 and 2 workers against a single process,
the workers' memory, and the driver's single writer (fsynced result lines per second).

    python bench/bench_ray.py [--prompts 200] [--max-tokens 32] [--rounds 2] [--dir DIR]

Every run is the `onebit generate` command a user types (a subprocess, shown in the table).
A Ray run starts its own local Ray instance (`--ray local`), so the Ray daemons, the driver
and the workers are all in the process tree this script samples for memory. prompts/s is
the generation phase (the driver's --stats line: from the first prompt sent to the last
result written; model loads excluded); `wall s` is the whole command (Ray start, loads, exit).
Rounds alternate the configurations (ABAB); medians are printed. The machine is shared:
compare rows of one run, not runs.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import psutil

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from onebit.apps import batch  # noqa: E402


def prompts_file(path: str, n: int) -> None:
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"id": f"q{i}", "prompt": f"Question {i}: explain what {i} + {3 * i} is, step by step."})
                    + "\n")


class TreeMemory:
    """Peak RSS of a process tree, sampled: the whole tree, and the largest worker actor; and
    the CPU seconds (user + system) each process had used when last seen, workers apart."""

    def __init__(self, pid: int, out: str):
        self.root, self.peak_tree, self.peak_worker, self.workers = pid, 0, 0, set()
        self.cpu: dict[int, float] = {}
        self.out, self.first = out, None  # (lines, process CPU) when the first results were seen
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                procs = [psutil.Process(self.root)] + psutil.Process(self.root).children(recursive=True)
            except psutil.Error:
                procs = []
            total = 0
            for p in procs:
                try:
                    t = p.cpu_times()
                    self.cpu[p.pid] = t.user + t.system
                    rss = p.memory_info().rss
                    total += rss
                    if any("BatchWorker" in c for c in p.cmdline()):
                        self.workers.add(p.pid)
                        self.peak_worker = max(self.peak_worker, rss)
                except psutil.Error:
                    pass
            self.peak_tree = max(self.peak_tree, total)
            if self.first is None and os.path.exists(self.out) and os.path.getsize(self.out) > 0:
                with open(self.out, "rb") as f:
                    self.first = (f.read().count(b"\n"), dict(self.cpu))
            time.sleep(0.05)

    def stop(self) -> None:
        self._stop.set()
        self._t.join()


def run(cmd: list[str], env: dict[str, str], out: str) -> dict:
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    mem = TreeMemory(proc.pid, out)
    _, err = proc.communicate()
    wall = time.perf_counter() - t0
    mem.stop()
    err = err.decode()
    if proc.returncode != 0:
        raise SystemExit(f"failed ({proc.returncode}): {' '.join(cmd)}\n{err}")
    m = re.search(r"all: (\d+) prompt\(s\) in ([\d.]+) s", err)
    return {"wall": wall, "prompts": int(m.group(1)) if m else None, "run_s": float(m.group(2)) if m else None,
            "tree_mib": mem.peak_tree / 2**20, "worker_mib": mem.peak_worker / 2**20,
            "cpu_all": sum(mem.cpu.values()), "cpu_gen": _cpu_per_prompt(mem, proc.pid)}


def _cpu_per_prompt(mem: TreeMemory, driver: int) -> float:
    """CPU seconds per prompt while generating: what the generating processes (the workers, or
    the single process) used from the first result seen to their last sample, per result since."""
    if mem.first is None:
        return float("nan")
    lines0, cpu0 = mem.first
    with open(mem.out, "rb") as f:
        lines = f.read().count(b"\n")
    pids = mem.workers or {driver}
    used = sum(mem.cpu.get(p, 0.0) - cpu0.get(p, 0.0) for p in pids)
    return used / max(1, lines - lines0)


def single_timed(cmd: list[str], env: dict[str, str], out: str) -> dict:
    """A single-process run: its generation phase is the sum of the results' own prompt and
    generation times (the single run prints no run line); wall includes the load."""
    r = run(cmd, env, out)
    recs = [json.loads(line) for line in open(out)]
    r["prompts"] = len(recs)
    r["run_s"] = sum(x["prompt_seconds"] + x["generation_seconds"] for x in recs)
    return r


def writer_rate(directory: str, n: int) -> tuple[float, float, int]:
    """The driver's writer alone: BatchRun.record of n typical results, one fsynced line each."""
    rec = {"id": "", "text": "x" * 200, "tokens": list(range(100, 132)), "prompt_tokens": 30, "generation_tokens": 32,
           "finish_reason": "length", "prompt_seconds": 0.01, "generation_seconds": 0.1, "prompt_tps": 3000.0,
           "generation_tps": 320.0}
    path = os.path.join(directory, "writer.jsonl")
    with batch.ResultsFile.open(path) as f:
        run = batch.BatchRun(f, "bench")
        t0 = time.perf_counter()
        for i in range(n):
            item = batch.PromptItem(f"w{i}", i + 1, prompt="p")
            run.record(item, dict(rec, id=item.id))
        dt = time.perf_counter() - t0
    size = os.path.getsize(path) // n
    os.unlink(path)
    return n / dt, n * size / dt / 2**20, size


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=200)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--writes", type=int, default=2000)
    ap.add_argument("--dir", default=None, help="work folder (default: a temporary one)")
    a = ap.parse_args()
    work = a.dir or tempfile.mkdtemp(prefix="bench_ray_")
    os.makedirs(work, exist_ok=True)
    prompts = os.path.join(work, "prompts.jsonl")
    prompts_file(prompts, a.prompts)
    onebit = [sys.executable, "-m", "onebit.cli.main", "generate", "-i", prompts, "-n", str(a.max_tokens),
              "--seed", "1", "--temperature", "0.7"]
    configs = [  # (name, extra args, NUMBA_NUM_THREADS of the driver process or None)
        ("single process, 2 threads", [], "2"),
        ("single process, 1 thread", [], "1"),
        ("ray local, 1 worker x 1 thread", ["--ray", "local", "--workers", "1", "--worker-cpus", "1", "--stats"], None),
        ("ray local, 2 workers x 1 thread", ["--ray", "local", "--workers", "2", "--worker-cpus", "1", "--stats"], None),
        ("ray local, 1 worker x 2 threads", ["--ray", "local", "--workers", "1", "--worker-cpus", "2", "--stats"], None),
    ]
    rows: dict[str, list[dict]] = {name: [] for name, _, _ in configs}
    cmds = {}
    for rnd in range(a.rounds):
        for name, extra, threads in configs:
            out = os.path.join(work, "out.jsonl")
            if os.path.exists(out):
                os.unlink(out)
            env = dict(os.environ)
            if threads is not None:
                env["NUMBA_NUM_THREADS"] = threads
            cmd = onebit + ["-o", out] + extra
            cmds[name] = (f"NUMBA_NUM_THREADS={threads} " if threads else "") + "onebit " + " ".join(cmd[3:])
            r = single_timed(cmd, env, out) if not extra else run(cmd, env, out)
            assert r["prompts"] == a.prompts, r
            rows[name].append(r)
            print(f"round {rnd + 1}: {name}: {r['prompts'] / r['run_s']:.2f} prompts/s, wall {r['wall']:.1f} s",
                  file=sys.stderr)
    print(f"{a.prompts} prompts, --max-tokens {a.max_tokens}, seeded sampling; medians of {a.rounds} rounds (ABAB)\n")
    print("| run | prompts/s (generation) | wall s (whole command) | CPU ms per prompt, generating | CPU s, whole "
          "command, all processes | peak RSS, process tree MiB | peak RSS, one worker MiB |")
    print("|---|---|---|---|---|---|---|")
    for name, _, _ in configs:
        rs = rows[name]
        pps = statistics.median(r["prompts"] / r["run_s"] for r in rs)
        wall = statistics.median(r["wall"] for r in rs)
        tree = statistics.median(r["tree_mib"] for r in rs)
        worker = statistics.median(r["worker_mib"] for r in rs)
        cpu_all = statistics.median(r["cpu_all"] for r in rs)
        per = statistics.median(1000 * r["cpu_gen"] for r in rs)
        print(f"| {name} | {pps:.2f} | {wall:.1f} | {per:.1f} | {cpu_all:.1f} | {tree:.0f} | "
              + (f"{worker:.0f} |" if worker else "(the process itself) |"))
    print("\ncommands:")
    for name, cmd in cmds.items():
        print(f"  {name}: {cmd}")
    lines, mib, size = writer_rate(work, a.writes)
    print(f"\ndriver's writer (BatchRun.record, one fsynced line per result, {size}-byte lines, {a.writes} lines, "
          f"in {work}): {lines:.0f} lines/s ({mib:.2f} MiB/s)")


if __name__ == "__main__":
    main()
