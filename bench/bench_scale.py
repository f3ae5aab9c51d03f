"""A model larger than memory, measured end to end: onebit resident, streamed at budgets, with
and without prediction, squeezed; llama.cpp resident and squeezed; every figure beside the
machine's limit.

    python tools/make_synthetic_moe.py --like qwen3-30b-a3b -o /work/big/q3-30b-shape.gguf
    python bench/bench_scale.py /work/big/q3-30b-shape.gguf --llama-bench PATH/llama-bench \\
        [--budgets 8GiB] [--predict off,block] [--squeeze 12GiB] [--rounds 3]

Each onebit configuration runs in its own process (peak RSS is the process's own), through
the Python API as `generate` uses it: a warm-up prompt, then a timed ~128-token prompt and N
greedy decode tokens in the same process (the pool warm, as in a chat's second turn), plus a
12-token prompt's time to first token. Configurations alternate within a round; figures are
medians over rounds. What each line prints:

- prompt tok/s (the ~128-token prompt after the warm-up), ttft (12-token prompt, seconds),
  decode tok/s, and for a pool: hit rate (prefetch hits included), prefetch hits, stall and
  MiB read per decode token, the drive's GB/s while busy, peak RSS;
- limits: resident decode at the machine's memory bandwidth (active bytes a token / the
  measured read rate of two threads), streamed decode at what the drive and the kernels allow
  together (max(resident step, missed bytes / measured O_DIRECT rate); the bytes alone when
  no resident run was measured), and the ratio to each; "of run": a streamed run's decode
  against the same limit at the rate its own reads ran at while the drive was busy (the drive's
  rate moves from run to run, and reading beside the kernels it is often slower than alone).

The squeeze: a helper process locks N GiB with mlock (root, or a raised RLIMIT_MEMLOCK) so
only the rest is left, as on a smaller machine; it is released when the run ends. Never lock
more than the machine can spare (the script refuses to leave less than 4 GiB).

llama.cpp: `llama-bench -m FILE -p 128 -n N -t 2` with the whole file read into memory
(`--load-mode none`: the fair resident peer for a big file) and, squeezed, with its default
(mmap).
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import random
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PROMPT = ("The json module encodes Python objects as JSON text and decodes them back. "
          "It can serialize dicts, lists, strings, numbers and None, and accepts hooks for other types. ")


def machine(path: str) -> dict:
    """Memory read rate (numpy sum over 1 GiB, two threads) and O_DIRECT random reads of one
    expert's three parts from the file (two reader threads, as the pool runs)."""
    import threading

    from machine import memory_read_gbs

    mem_gbs = memory_read_gbs()

    from onebit.formats.gguf_file import GGUFFile

    g = GGUFFile(path)
    parts = [t for n, t in g.tensors.items() if n.startswith("blk.0.ffn_") and n.endswith("_exps.weight")]
    sizes = [t.n_bytes // t.shape[0] for t in parts]
    size = os.path.getsize(path)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    got = []

    def work(seed):
        rng = random.Random(seed)
        bufs = [mmap.mmap(-1, (s + 8191) // 4096 * 4096) for s in sizes]
        n = 0
        for _ in range(100):
            for b in bufs:
                n += os.preadv(fd, [b], rng.randrange(0, size - len(b)) // 4096 * 4096)
        got.append(n)

    t0 = time.perf_counter()
    ts = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    [t.start() for t in ts]
    [t.join() for t in ts]
    direct = sum(got) / (time.perf_counter() - t0)
    os.close(fd)
    return {"mem_gbs": mem_gbs, "direct_gbs": direct / 1e9, "expert_bytes": sum(sizes)}


def active_bytes(path: str) -> tuple[int, int]:
    """(bytes a decode token reads resident: every non-expert matrix but the embedding table plus
    top-k experts of every MoE layer, bytes of one expert)."""
    from onebit.formats.gguf_file import GGUFFile, is_expert_tensor

    g = GGUFFile(path)
    k = next(v for key, v in g.metadata.items() if key.endswith(".expert_used_count"))
    dense = sum(t.n_bytes for n, t in g.tensors.items() if not is_expert_tensor(n) and n != "token_embd.weight")
    experts = [t for n, t in g.tensors.items() if is_expert_tensor(n) and n.endswith(".weight")]
    per_layer = {}
    for t in experts:
        layer = int(t.name.split(".")[1])
        per_layer[layer] = per_layer.get(layer, 0) + t.n_bytes // t.shape[0]
    return dense + k * sum(per_layer.values()), next(iter(per_layer.values()))


def run_onebit(cfg: dict) -> dict:
    """One configuration, in this process (called in a child): JSON-able figures."""
    import onebit

    t_load = time.perf_counter()
    m = onebit.load(cfg["model"], backend=cfg.get("backend", "cpu"), budget=cfg.get("budget"),
                    predict=cfg.get("predict"), n_ctx=cfg.get("ctx"))
    t_load = time.perf_counter() - t_load
    out = {"decision": getattr(m, "decision", ""), "load_s": t_load}
    ids = m.tokenize(PROMPT * 8)
    warm, timed = ids[:64], ids[64 : 64 + cfg["prompt"]]
    short = m.tokenize("Tell me about the json module, briefly.")[:12]
    pool = m.pool

    def snap():
        s = pool.stats if pool else None
        return (s.bytes_read, s.stall_seconds, s.hits, s.prefetch_hits, s.demand_misses, s.busy_seconds) if s else None

    # time to first token: a 12-token prompt in a fresh cache (the first thing a user sees)
    t0 = time.perf_counter()
    m.net.forward(np.array(short), m.new_cache(), last_only=True)
    out["ttft_s"] = time.perf_counter() - t0
    cache = m.new_cache()
    m.net.forward(np.array(warm), cache, last_only=True)  # warm-up prompt: the pool warm, kernels loaded
    del cache  # (before the next is made: one KV cache at a time, as the plan counts)
    cache = m.new_cache()
    t0 = time.perf_counter()
    logits = m.net.forward(np.array(timed), cache, last_only=True)
    out["prompt_tps"] = len(timed) / (time.perf_counter() - t0)
    tok = int(logits[-1].argmax())
    toks = [tok]
    before = snap()
    t0 = time.perf_counter()
    for _ in range(cfg["tokens"]):
        logits = m.net.forward(np.array([tok]), cache, last_only=True)
        tok = int(logits[-1].argmax())
        toks.append(tok)
    dt = time.perf_counter() - t0
    out["decode_tps"] = cfg["tokens"] / dt
    out["tokens"] = toks
    if pool is not None:
        after = snap()
        d = [b - a for a, b in zip(before, after)]
        n = cfg["tokens"]
        looked = d[2] + d[3] + d[4]
        out.update(hit_rate=(d[2] + d[3]) / looked if looked else 0.0, prefetch_hits=d[3] / n,
                   stall_ms=1000 * d[1] / n, read_mib=d[0] / n / 2**20,
                   drive_gbs=d[0] / d[5] / 1e9 if d[5] else 0.0, slots=pool.n_slots, stall_share=d[1] / dt)
    out["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30
    m.close()
    return out


def child(cfg: dict, squeeze: int = 0) -> dict:
    r = _run(squeeze, [sys.executable, __file__, "--child", json.dumps(cfg)])
    if r.returncode:
        return {"error": (r.stderr.strip().splitlines() or ["?"])[-1]}
    return json.loads(r.stdout.strip().splitlines()[-1])


def _run(squeeze: int, cmd: list[str]) -> subprocess.CompletedProcess:
    """Run `cmd` (an hour at most), with `squeeze` bytes locked by another process meanwhile."""
    locker = _squeeze(squeeze) if squeeze else None
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    finally:
        if locker is not None:
            locker.kill()
            locker.wait()


def _squeeze(nbytes: int) -> subprocess.Popen:
    """A process that mlocks `nbytes` and holds them until killed (waits until locked)."""
    code = ("import mmap,ctypes,sys,time\n"
            f"n={nbytes}\n"
            "m=mmap.mmap(-1,n,flags=mmap.MAP_PRIVATE|mmap.MAP_ANONYMOUS)\n"
            "lib=ctypes.CDLL(None,use_errno=True)\n"
            "addr=ctypes.addressof(ctypes.c_char.from_buffer(m))\n"
            "r=lib.mlock(ctypes.c_void_p(addr),ctypes.c_size_t(n))\n"
            "print('locked' if r==0 else 'failed %d'%ctypes.get_errno(),flush=True)\n"
            "time.sleep(86400)\n")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    line = p.stdout.readline().strip()
    if line != "locked":
        p.kill()
        raise SystemExit(f"could not lock {nbytes >> 30} GiB for the squeeze ({line}): run as root")
    return p


def llama_bench(binary: str, path: str, prompt: int, tokens: int, resident: bool, squeeze: int = 0) -> dict:
    cmd = [binary, "-m", path, "-p", str(prompt), "-n", str(tokens), "-t", "2", "-r", "1", "-o", "json"]
    if resident:
        cmd += ["--load-mode", "none"]
    r = _run(squeeze, cmd)
    if r.returncode:
        return {"error": (r.stderr.strip().splitlines() or ["?"])[-1]}
    rows = json.loads(r.stdout)
    out = {}
    for row in rows:
        key = "prompt_tps" if row.get("n_prompt") else "decode_tps"
        out[key] = row["avg_ts"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?")
    ap.add_argument("--child")
    ap.add_argument("--budgets", default="8GiB")
    ap.add_argument("--predict", default="off,block", help="prediction modes for the streamed runs")
    ap.add_argument("--resident", action="store_true", help="also onebit with every expert in memory")
    ap.add_argument("--default", action="store_true", help="also onebit with no flags (its own plan)")
    ap.add_argument("--squeeze", help="lock this much (e.g. 12GiB) for the squeezed runs")
    ap.add_argument("--llama-bench", help="llama-bench binary (resident and squeezed peers)")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--json", help="write every run's figures here")
    a = ap.parse_args()
    if a.child:
        print(json.dumps(run_onebit(json.loads(a.child))))
        return
    from onebit.memory.budget import format_bytes, parse_size

    squeeze = parse_size(a.squeeze) if a.squeeze else 0
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if squeeze and total - squeeze < 4 << 30:
        raise SystemExit("refusing to lock so much that under 4 GiB is left")
    mach = machine(a.model)
    active, expert = active_bytes(a.model)
    print(f"file {a.model}: {format_bytes(os.path.getsize(a.model))}; {format_bytes(active)} read a decode token "
          f"resident; an expert {format_bytes(expert)}")
    print(f"machine: memory {mach['mem_gbs']:.1f} GB/s (2 threads), O_DIRECT expert reads {mach['direct_gbs']:.2f} "
          f"GB/s (2 threads); resident decode limit {mach['mem_gbs'] * 1e9 / active:.1f} tok/s")
    base = {"model": a.model, "prompt": a.prompt, "tokens": a.tokens, "backend": a.backend}
    configs: dict[str, tuple[dict, int]] = {}
    if a.resident:
        configs["onebit resident"] = ({**base, "budget": "1TiB"}, 0)
    for b in filter(None, a.budgets.split(",")):  # (--budgets "": no streamed runs)
        for p in a.predict.split(","):
            configs[f"onebit {b} predict={p}"] = ({**base, "budget": b, "predict": p}, 0)
    if a.default:
        configs["onebit no flags"] = (dict(base), 0)
    if squeeze:
        configs[f"onebit no flags, {a.squeeze} locked"] = (dict(base), squeeze)
    peers: dict[str, tuple] = {}
    if a.llama_bench:
        peers["llama.cpp resident (--load-mode none)"] = (True, 0)
        if squeeze:
            peers[f"llama.cpp mmap, {a.squeeze} locked"] = (False, squeeze)
    runs: dict[str, list] = {k: [] for k in [*configs, *peers]}
    for r in range(a.rounds):
        for name, (cfg, sq) in configs.items():
            runs[name].append(child(cfg, sq))
            print(f"  round {r + 1} {name}: {json.dumps({k: v for k, v in runs[name][-1].items() if k != 'tokens'})}",
                  file=sys.stderr)
        for name, (res, sq) in peers.items():
            runs[name].append(llama_bench(a.llama_bench, a.model, a.prompt, a.tokens, res, sq))
            print(f"  round {r + 1} {name}: {runs[name][-1]}", file=sys.stderr)
    med = lambda name, key: statistics.median([x[key] for x in runs[name] if key in x]) if any(
        key in x for x in runs[name]) else float("nan")
    ref = next((k for k in peers if "resident" in k), None)
    resident_step = None
    if "onebit resident" in runs:
        resident_step = 1 / med("onebit resident", "decode_tps")
    print()
    print(f"{'run':<44} {'prompt':>7} {'ttft':>6} {'decode':>7} {'vs llama':>8} {'hit':>6} {'pf hit':>6} "
          f"{'stall':>7} {'read':>8} {'drive':>6} {'limit':>6} {'of lim':>6} {'of run':>6} {'RSS':>6}")
    for name in runs:
        if not any("decode_tps" in x for x in runs[name]):
            print(f"{name:<44} failed: {runs[name][0].get('error')}")
            continue
        dec = med(name, "decode_tps")
        vs = dec / med(ref, "decode_tps") if ref else float("nan")
        read = med(name, "read_mib") if any("read_mib" in x for x in runs[name]) else 0.0
        of_run = float("nan")
        if name.startswith("onebit") and read > 0:
            limit = 1 / max(resident_step or 0.0, read * 2**20 / (mach["direct_gbs"] * 1e9))
            if med(name, "drive_gbs") > 0:
                of_run = dec * max(resident_step or 0.0, read * 2**20 / (med(name, "drive_gbs") * 1e9))
        elif name.startswith("onebit") and resident_step:
            limit = 1 / resident_step
        else:
            limit = mach["mem_gbs"] * 1e9 / active
        print(f"{name:<44} {med(name, 'prompt_tps'):7.2f} {med(name, 'ttft_s'):6.2f} {dec:7.2f} {vs:8.2f} "
              f"{med(name, 'hit_rate'):6.1%} {med(name, 'prefetch_hits'):6.1f} {med(name, 'stall_ms'):6.0f}ms "
              f"{read:6.0f}Mi {med(name, 'drive_gbs'):6.2f} {limit:6.2f} {dec / limit:6.2f} {of_run:6.2f} "
              f"{med(name, 'peak_rss_gib'):6.2f}")
    if a.json:
        Path(a.json).write_text(json.dumps({"machine": mach, "active_bytes": active, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
