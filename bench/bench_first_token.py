"""First answer on a fresh machine: `onebit generate` and `onebit chat` with an empty numba cache.

    python bench/bench_first_token.py [--runs 3] [--tree PATH] [--only generate|chat]

A fresh machine is imitated by pointing NUMBA_CACHE_DIR at an empty folder (no compiled
kernel); a warm one by running again on the folder the cold run filled. Per run, alternating
cold and warm:

- generate: `onebit generate -p hi -n 8` (the shipped model, --backend cpu), seconds from start
  to exit (the answer printed);
- chat: `onebit chat --backend cpu` in a tmux terminal; "hi" is typed as soon as the prompt
  shows; seconds from start to the prompt (ready) and to the next prompt (the reply done).

Prints each run and the medians. --tree runs another checkout's onebit (PYTHONPATH; it needs
`onebit/cli` and `onebit/memory` symlinks to its cli/ and memory/, as bench_modes.py says).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def env_for(cache: str, tree: Path | None) -> dict:
    env = dict(os.environ, NUMBA_CACHE_DIR=cache)
    if tree is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tree), env.get("PYTHONPATH")]))
    return env


def time_generate(cache: str, tree: Path | None) -> float:
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "onebit.cli.main", "generate", "-p", "hi", "-n", "8", "--backend", "cpu"],
                       env=env_for(cache, tree), capture_output=True, text=True, cwd=tree or ROOT, timeout=900)
    took = time.perf_counter() - t0
    if r.returncode != 0 or not r.stdout.strip():
        raise SystemExit(f"generate failed ({r.returncode}): {r.stderr[-2000:]}")
    return took


def time_chat(cache: str, tree: Path | None) -> tuple[float, float]:
    """(seconds to the first prompt, seconds to the prompt after the reply to "hi")."""
    name = f"onebit-first-{uuid.uuid4().hex[:8]}"
    env = env_for(cache, tree)
    exports = " ".join(f"{k}={env[k]!r}" for k in ("NUMBA_CACHE_DIR", "PYTHONPATH") if k in env)
    cmd = f"cd {str(tree or ROOT)!r} && env {exports} {sys.executable} -m onebit.cli.main chat --backend cpu; sleep 30"

    def screen() -> str:
        return subprocess.run(["tmux", "capture-pane", "-p", "-t", name, "-S", "-200"], capture_output=True,
                              text=True).stdout

    def prompts(s: str) -> int:
        lines = [ln for ln in s.splitlines() if ln.strip()]
        n = sum(1 for ln in lines if ln.startswith("> ") or ln.rstrip() == ">")
        return n if lines and lines[-1].strip() == ">" else 0

    t0 = time.perf_counter()
    subprocess.run(["tmux", "new-session", "-d", "-s", name, "-x", "160", "-y", "50", cmd], check=True)
    try:
        ready = done = None
        while time.perf_counter() - t0 < 900:
            n = prompts(screen())
            if ready is None and n >= 1:
                ready = time.perf_counter() - t0
                subprocess.run(["tmux", "send-keys", "-t", name, "hi", "Enter"], check=True)
            elif ready is not None and n >= 2:
                done = time.perf_counter() - t0
                break
            time.sleep(0.05)
        if done is None:
            raise SystemExit(f"chat did not answer; screen:\n{screen()}")
        return ready, done
    finally:
        subprocess.run(["tmux", "kill-session", "-t", name], capture_output=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--tree", type=Path, help="another checkout to run instead of this one")
    ap.add_argument("--only", choices=("generate", "chat"))
    args = ap.parse_args()
    if args.only != "generate" and shutil.which("tmux") is None:
        raise SystemExit("chat needs tmux (or pass --only generate)")
    rows: dict[str, list[float]] = {}
    for r in range(args.runs):
        for what in ("generate", "chat"):
            if args.only not in (None, what):
                continue
            cache = tempfile.mkdtemp(prefix="onebit-numba-")
            try:
                for state in ("cold", "warm"):
                    if what == "generate":
                        got = {f"generate {state}": time_generate(cache, args.tree)}
                    else:
                        ready, done = time_chat(cache, args.tree)
                        got = {f"chat {state}: ready": ready, f"chat {state}: answered": done}
                    for k, v in got.items():
                        rows.setdefault(k, []).append(v)
                        print(f"run {r + 1}  {k:24s} {v:7.1f} s", flush=True)
            finally:
                shutil.rmtree(cache, ignore_errors=True)
    print(f"\nmedians over {args.runs} runs ({args.tree or ROOT}):")
    for k, v in rows.items():
        print(f"  {k:24s} {statistics.median(v):7.1f} s")


if __name__ == "__main__":
    main()
