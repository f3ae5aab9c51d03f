"""Soak: one process generating many prompts (batch, streamed experts) and a long chat, checking
that nothing grows once it is warm (issue 36).

Per phase it samples, after every prompt / turn (with a gc.collect() first): the process's
resident memory, its open file descriptors, its threads (Python's and the OS's), and the chat
template worker's resident memory and process count; at the end it checks the expert pool's
counters against each other. Growth is measured robustly: the median of the last fifth of the
samples against the median of the fifth after the warm-up (the first quarter), so one
allocator hiccup does not count and a steady leak does; descriptors, threads and worker starts
may not rise at all in the second half of the samples after warm-up.

    python bench/soak.py --prompts 2000 --turns 500                 # the long run (bench/results/)
    python bench/soak.py --model /work/scratch-36/big.gguf --prompts 200 --slots 64
    python bench/soak.py --prompts 200 --turns 50 --json out.json   # the CI size (tests/test_soak.py)

Exit 1 if a check fails.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = str(ROOT / "onebit" / "data" / "default.gguf")
GROWTH_LIMIT = 0.05


def _sample(proc, ct) -> dict:
    gc.collect()
    worker = ct._WORKER.proc
    worker_rss = 0
    if worker is not None and worker.poll() is None:
        import psutil

        worker_rss = psutil.Process(worker.pid).memory_info().rss
    return {"rss": proc.memory_info().rss, "fds": len(os.listdir("/proc/self/fd")),
            "threads": threading.active_count(), "os_threads": proc.num_threads(),
            "worker_rss": worker_rss, "workers_started": ct._WORKER.started}


def growth(values: list[float], warm: float = 0.25) -> float:
    """Relative growth: median of the last fifth over the median of the fifth after warm-up."""
    n = len(values)
    start = int(n * warm)
    fifth = max((n - start) // 5, 1)
    base = statistics.median(values[start:start + fifth])
    end = statistics.median(values[-fifth:])
    return end / base - 1.0 if base else 0.0


def check(samples: list[dict], what: str) -> list[str]:
    """What grew past warm-up in one phase's samples ([] when nothing did)."""
    bad = []
    warm = samples[len(samples) // 4:]
    g = growth([s["rss"] for s in samples])
    if g > GROWTH_LIMIT:
        bad.append(f"{what}: resident memory grew {100 * g:.1f}% after warm-up")
    gw = growth([s["worker_rss"] for s in samples])
    if gw > GROWTH_LIMIT:
        bad.append(f"{what}: the template worker's resident memory grew {100 * gw:.1f}%")
    # Counts may not rise in the second half of the post-warm-up samples: a leak of one per prompt
    # or turn does, a thread or descriptor some library opens once, late, does not.
    late = warm[len(warm) // 2:]
    for key in ("fds", "threads", "os_threads", "workers_started"):
        if max(s[key] for s in late) > late[0][key]:
            bad.append(f"{what}: {key} grew from {late[0][key]} to {max(s[key] for s in late)} in the second half "
                       "after warm-up")
    return bad


def pool_check(model) -> list[str]:
    """The pool's counters agree with each other: every read is one expert (a demand miss or a
    prefetch) of one expert's bytes (which differ between layers where a file mixes quant types:
    the bounds are the smallest and the largest), wasted prefetches are prefetches, nothing is
    left pinned."""
    pool = model.pool
    if pool is None:
        return ["no expert pool: the run did not stream (pass --slots below the expert count)"]
    st = pool.stats
    g = model.gguf
    sizes = {sum(g.tensor(f"blk.{i}.{p}.weight").n_bytes // model.cfg.n_experts
                 for p in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"))
             for i in range(model.cfg.n_layers) if f"blk.{i}.ffn_gate_exps.weight" in g.tensors}
    from onebit.memory.pool import ALIGN

    bad = []
    reads = st.demand_misses + st.prefetches  # an O_DIRECT read of a part rounds out to ALIGN at both ends
    if not reads * min(sizes) <= st.bytes_read <= reads * (max(sizes) + 3 * 2 * ALIGN):
        bad.append(f"pool: {st.bytes_read} bytes read for {st.demand_misses} demand misses + {st.prefetches} "
                   f"prefetches of {min(sizes)}..{max(sizes)} bytes")
    if st.wasted_prefetches > st.prefetches:
        bad.append(f"pool: {st.wasted_prefetches} wasted prefetches of {st.prefetches}")
    if st.hits + st.prefetch_hits + st.demand_misses < st.acquires:
        bad.append(f"pool: {st.acquires} acquires but {st.hits + st.prefetch_hits + st.demand_misses} lookups")
    pinned = sum(s.pins for ss in pool.slots for s in ss)
    if pinned:
        bad.append(f"pool: {pinned} pins left after the run")
    return bad


def run(model_path: str = DEFAULT_MODEL, prompts: int = 200, turns: int = 50, slots: int = 40,
        backend: str = "cpu", max_tokens: int = 4, chat_tokens: int = 8, log=print, phase_done=None) -> dict:
    """The soak; `phase_done(out)`, if given, is called with the results so far after the batch
    phase (a long run's first half is kept if the second is cut short). `turns=0`: no chat."""
    import psutil

    import onebit
    from onebit.apps import batch
    from onebit.chat_formats import chat_template as ct
    from onebit.apps.chat import ChatSession

    proc = psutil.Process()
    t0 = time.perf_counter()
    m = onebit.load(model_path, backend=backend, slots=slots)
    # Warm up (kernels compiled, the template worker started), then freeze what exists so that a
    # gc.collect() before each sample scans only what the run made since (a full one takes 0.1 s).
    batch.generate_one(m, batch.PromptItem("warm", 0, prompt="Hello"), chat=True, system=None, seed=0,
                       max_tokens=max_tokens)
    gc.collect()
    gc.freeze()
    out: dict = {"model": model_path, "backend": backend, "slots": slots, "prompts": prompts, "turns": turns,
                 "failures": []}
    try:
        samples = []
        for i in range(prompts):
            item = batch.PromptItem(str(i), i + 1, prompt=f"Question {i}: what is {i % 97} plus {i % 13}?")
            rec = batch.generate_one(m, item, chat=True, system=None, seed=i, max_tokens=max_tokens,
                                     temperature=0.8)
            if "error" in rec:
                out["failures"].append(f"prompt {i}: {rec['error']}")
            samples.append(_sample(proc, ct))
            if log and (i + 1) % max(prompts // 10, 1) == 0:
                log(f"  batch {i + 1}/{prompts}: rss {samples[-1]['rss'] >> 20} MiB, fds {samples[-1]['fds']}, "
                    f"threads {samples[-1]['os_threads']}, {time.perf_counter() - t0:.0f} s")
        out["batch"] = _summary(samples)
        out["failures"] += check(samples, "batch")
        stats = m.pool.stats.to_dict() if m.pool is not None else {}
        out["pool"] = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in stats.items()}
        out["batch_seconds"] = round(time.perf_counter() - t0, 1)
        if phase_done:
            phase_done(out)
        session = ChatSession(m, max_tokens=chat_tokens, temperature=0.8, seed=1)
        samples = []
        computed = dropped = 0
        for turn in range(turns):
            for _ in session.send(f"Turn {turn}: tell me one more thing about the number {turn}."):
                pass
            computed += session.last.prompt_tokens_computed
            dropped += session.last.dropped_turns > 0
            samples.append(_sample(proc, ct))
            if log and (turn + 1) % max(turns // 10, 1) == 0:
                log(f"  chat {turn + 1}/{turns}: rss {samples[-1]['rss'] >> 20} MiB, history "
                    f"{len(session.history)} messages, {time.perf_counter() - t0:.0f} s")
        if turns:
            out["chat"] = _summary(samples)
            out["chat"].update(context=m.context_length, prompt_tokens_computed=computed, turns_that_dropped=dropped)
            out["failures"] += check(samples, "chat")
        out["failures"] += pool_check(m)
        stats = m.pool.stats.to_dict() if m.pool is not None else {}
        out["pool_end"] = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in stats.items()}
    finally:
        gc.unfreeze()
        m.close()
    out["seconds"] = round(time.perf_counter() - t0, 1)
    return out


def _summary(samples: list[dict]) -> dict:
    rss = [s["rss"] for s in samples]
    return {"samples": len(samples), "rss_first_mib": round(rss[0] / 2**20, 1),
            "rss_warm_mib": round(statistics.median(rss[len(rss) // 4:len(rss) // 4 + max(len(rss) // 5, 1)])
                                  / 2**20, 1),
            "rss_last_mib": round(rss[-1] / 2**20, 1), "rss_max_mib": round(max(rss) / 2**20, 1),
            "rss_growth_pct": round(100 * growth(rss), 2),
            "worker_rss_growth_pct": round(100 * growth([s["worker_rss"] for s in samples]), 2),
            "fds": sorted({s["fds"] for s in samples}), "os_threads": sorted({s["os_threads"] for s in samples}),
            "workers_started": samples[-1]["workers_started"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--prompts", type=int, default=2000)
    ap.add_argument("--turns", type=int, default=500)
    ap.add_argument("--slots", type=int, default=40)
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--chat-tokens", type=int, default=8)
    ap.add_argument("--json", help="write the summary here")
    a = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    def phase_done(out: dict) -> None:
        if a.json:
            Path(a.json).write_text(json.dumps(dict(out, chat="not finished"), indent=2) + "\n")

    res = run(a.model, a.prompts, a.turns, a.slots, a.backend, a.max_tokens, a.chat_tokens,
              log=lambda line: print(line, flush=True), phase_done=phase_done)
    print(json.dumps(res, indent=2))
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=2) + "\n")
    return 1 if res["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
