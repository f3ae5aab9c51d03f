"""A model larger than memory, measured end to end, on one or more files alternating: onebit
resident, streamed at budgets with each prediction mode, with no flags, squeezed; llama.cpp
resident and squeezed; every figure beside the machine's limit and the routing it saw.

    python tools/make_synthetic_moe.py --like qwen3-30b-a3b --routing trained -o /work/big/q3-30b-trained.gguf
    python tools/make_synthetic_moe.py --like qwen3-30b-a3b -o /work/big/q3-30b-random.gguf
    python bench/bench_scale.py /work/big/q3-30b-trained.gguf /work/big/q3-30b-random.gguf \\
        --llama PATH/llama-completion --resident --default --budgets 8GiB --predict auto,off,block \\
        --squeeze 12GiB [--cold] [--rounds 2] [--tokens 48]

Each onebit configuration runs in its own process (peak RSS is the process's own), through
the Python API as `generate` uses it: a 12-token prompt's time to first token, a warm-up
prompt, then a timed prompt of real prose (the start of PROSE, at most --prompt tokens) and N greedy decode tokens in
the same process (the pool warm, as in a chat's second turn). Configurations and files
alternate within a round; figures are medians over rounds. What each line prints:

- prompt tok/s (the prose prompt after the warm-up), ttft (12-token prompt, seconds), decode
  tok/s, and for a pool: hit rate (prefetch hits included), prefetch hits, stall and MiB read
  per decode token, the drive's GB/s while busy, peak RSS;
- the decode's routing (onebit.moe.routing over the run's own trace): reuse of the previous
  token's experts, within 8 tokens, and cache-sim's LRU and Belady hit rates with the run's own
  number of slots (per layer, as the pool holds them: same-size experts share one class);
- limits: resident decode at the machine's memory bandwidth (active bytes a token / the
  measured read rate of two threads), streamed decode at what the drive and the kernels allow
  together (max(resident step, missed bytes / measured O_DIRECT rate); the bytes alone when
  no resident run was measured), and the ratio to each; "of run": a streamed run's decode
  against the same limit at the rate its own reads ran at while the drive was busy;
- "cores": the process's CPU seconds per decode second (every thread: the kernels' and the
  pool's readers, which read and repack each expert), out of the machine's cores;
- "same": whether the greedy tokens equal the resident run's (or the first onebit run's).

--cold adds, per configuration, a fresh process started with the page cache dropped (root):
seconds from the process's start to the first token of the 12-token prompt (import, load and
prompt together), as a user starting `onebit generate` on a cold machine sees it. Where experts
stream, it starts a second such process after it, the page cache dropped again, which warms its
pool from the record the first wrote at close (memory/warm.py; each configuration's records in
a folder of their own, empty before the first): "cold" is the first, "cold 2" the second, and
"warmed" how many experts the second read for warming / how many of them its prompt used. The
first process ran the same 12-token prompt, so its record fits the second's prompt as well as
a record can. --cold-no-drop runs the same processes without dropping the page cache (no root;
to check the script: its times are not a cold start).

The squeeze: a helper process locks N GiB with mlock (root, or a raised RLIMIT_MEMLOCK) so
only the rest is left, as on a smaller machine; it is released when the run ends. Never lock
more than the machine can spare (the script refuses to leave less than 4 GiB).

llama.cpp: `llama-completion -m FILE -p PROSE -n N -t 2 --temp 0` (its own timings: prompt
eval and eval), resident with `--load-mode none` (the whole file read into memory) and, squeezed, with
its default (mmap). Not llama-bench: its decode feeds random tokens, which route like no text.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import random
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

WARM = ("The json module encodes Python objects as JSON text and decodes them back. "
        "It can serialize dicts, lists, strings, numbers and None, and accepts hooks for other types. ") * 3
PROSE = ("The history of the printing press begins in the workshops of goldsmiths and wine makers along "
         "the Rhine. Movable type had been known in Korea and China for centuries, but the alphabet made "
         "it practical in Europe: a few dozen letters, cast in metal from a single mould, could be set "
         "into lines, inked, pressed onto damp paper and then taken apart and used again for the next "
         "page. Within fifty years presses were at work in more than two hundred cities, and the price of "
         "a book fell so far that merchants, students and artisans could own one. Scholars argue about")
SHORT = "Tell me about the json module, briefly."


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
    from onebit.moe.trace import TraceWriter

    if cfg.get("records"):  # (the folder the pool's record is kept in, as the CLI's cache folder)
        from onebit.formats.tokenizer import set_cache_dir

        set_cache_dir(cfg["records"])
    t_load = time.perf_counter()
    m = onebit.load(cfg["model"], backend=cfg.get("backend", "cpu"), budget=cfg.get("budget"),
                    predict=cfg.get("predict"), n_ctx=cfg.get("ctx"))
    t_load = time.perf_counter() - t_load
    out = {"decision": getattr(m, "decision", ""), "load_s": t_load}
    short = m.tokenize(SHORT)[:12]
    if cfg.get("cold"):  # a fresh process on a cold page cache: start to the first token, then done
        m.net.forward(np.array(short), m.new_cache(), last_only=True)
        out["start_to_token_s"] = time.time() - cfg["started"]
        if m.pool is not None:
            s = m.pool.stats
            out.update(warm_start=m.warm_start, warm_reads=s.warm_reads, warm_hits=s.warm_hits,
                       warm_wasted=s.warm_wasted, demand_misses=s.demand_misses, read_gib=s.bytes_read / 2**30,
                       read_cpu_s=m.pool.read_cpu_seconds)  # (the readers' CPU: reading and packing)
        out["peak_rss_gib"] = peak_rss() / 2**30
        m.close()
        return out
    warm, timed = m.tokenize(WARM)[:64], m.tokenize(cfg["prose"])
    pool = m.pool
    trace = cfg.get("trace")
    if trace:  # every forward's routing (a hook that copies each layer's ids: no pause, no sync)
        m.hook = TraceWriter(trace, m.path, m.cfg.n_layers, m.cfg.n_experts, m.cfg.n_experts_used)

    def snap():
        s = pool.stats if pool else None
        return (s.bytes_read, s.stall_seconds, s.hits, s.prefetch_hits, s.demand_misses, s.busy_seconds) if s else None

    # time to first token: a 12-token prompt in a fresh cache (the first thing a user sees)
    t0 = time.perf_counter()
    m.net.forward(np.array(short), m.new_cache(), hook=m.hook, last_only=True)
    out["ttft_s"] = time.perf_counter() - t0
    cache = m.new_cache()
    m.net.forward(np.array(warm), cache, hook=m.hook, last_only=True)  # warm-up prompt: the pool warm, kernels loaded
    del cache  # (before the next is made: one KV cache at a time, as the plan counts)
    cache = m.new_cache()
    t0 = time.perf_counter()
    logits = m.net.forward(np.array(timed), cache, hook=m.hook, last_only=True)
    out["prompt_tps"] = len(timed) / (time.perf_counter() - t0)
    out["prompt_tokens"] = len(timed)
    tok = int(logits[-1].argmax())
    toks = [tok]
    if trace:
        m.hook.phase = "decode"
    before = snap()
    cpu0 = time.process_time()
    t0 = time.perf_counter()
    for _ in range(cfg["tokens"]):
        logits = m.net.forward(np.array([tok]), cache, hook=m.hook, last_only=True)
        tok = int(logits[-1].argmax())
        toks.append(tok)
    dt = time.perf_counter() - t0
    out["cpu_per_token_s"] = (time.process_time() - cpu0) / cfg["tokens"]  # (every thread: kernels, readers)
    if trace:
        m.hook.close()
        m.hook = None
    out["decode_tps"] = cfg["tokens"] / dt
    out["tokens"] = toks
    out["text"] = m.detokenize(toks[: cfg["tokens"]])  # (llama-completion -n N prints N tokens)
    if pool is not None:
        after = snap()
        d = [b - a for a, b in zip(before, after)]
        n = cfg["tokens"]
        looked = d[2] + d[3] + d[4]
        out.update(hit_rate=(d[2] + d[3]) / looked if looked else 0.0, prefetch_hits=d[3] / n,
                   stall_ms=1000 * d[1] / n, read_mib=d[0] / n / 2**20,
                   drive_gbs=d[0] / d[5] / 1e9 if d[5] else 0.0, slots=pool.n_slots, stall_share=d[1] / dt)
    out["peak_rss_gib"] = peak_rss() / 2**30
    m.close()
    return out


def peak_rss() -> int:
    """This process's peak resident bytes since it started: VmHWM, the peak of its own memory map.
    Not getrusage's ru_maxrss, which a child started by fork and exec takes over from its parent
    (this script's parent holds the 1 GiB that `machine` measures with: every child read 1.03 GiB)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def routing(trace: str, slots: int) -> dict:
    """Statistics of a run's trace (its prompts warm the simulated caches, decode is counted):
    reuse, within 8, busiest 20%, and LRU / Belady hit rates, with the pool's own slots and its
    policy (one LRU over every layer) where it had a pool, else with 36% of each layer's experts
    (per-layer LRU, the issue's table)."""
    from onebit.moe.cachesim import load_trace, simulate
    from onebit.moe.routing import layer_stats, summary

    t = load_trace(trace)
    sm = summary(layer_stats(t))
    n = slots or max(int(t.header["k"]), round(0.36 * int(t.header["n_experts"]))) * t.n_layers
    return {"reuse": sm["reuse_prev"], "within8": sm["reuse_window"], "busiest20": sm["busiest_20"],
            "lru": simulate(t, "global-lru" if slots else "lru", n).hit_rate,
            "belady": simulate(t, "belady", n).hit_rate}


def child(cfg: dict, squeeze: int = 0) -> dict:
    r = _run(squeeze, [sys.executable, __file__, "--child", json.dumps(cfg)])
    if r.returncode:
        return {"error": (r.stderr.strip().splitlines() or ["?"])[-1]}
    return json.loads(r.stdout.strip().splitlines()[-1])


def _run(squeeze: int, cmd: list[str]) -> subprocess.CompletedProcess:
    """Run `cmd` (an hour at most), with `squeeze` bytes locked by another process meanwhile."""
    locker = _squeeze(squeeze) if squeeze else None
    try:
        return subprocess.run(cmd, capture_output=True, text=True, errors="replace", timeout=3600)
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


def prose(path: str, n: int) -> str:
    """The longest start of PROSE (whole tokens) that the file's tokenizer makes at most `n`
    tokens of, BOS included: both engines get this text."""
    from onebit.formats.gguf_file import GGUFFile
    from onebit.formats.tokenizer import Tokenizer

    tok = Tokenizer.from_metadata(GGUFFile(path).metadata, path)
    ids = tok.encode(PROSE, add_special=True, parse_special=False)
    if len(ids) <= n:
        return PROSE
    return tok.decode(ids[len(tok.encode("", add_special=True, parse_special=False)):n])


def llama_completion(binary: str, path: str, text: str, tokens: int, resident: bool, squeeze: int = 0) -> dict:
    """llama.cpp generating `tokens` greedy tokens from `text`: its own prompt and eval timings."""
    cmd = [binary, "-m", path, "-p", text, "-n", str(tokens), "-t", "2", "--temp", "0", "-no-cnv",
           "--ignore-eos", "-c", "4096", "--no-warmup", "--no-display-prompt"]
    if resident:
        cmd += ["--load-mode", "none"]
    t0 = time.time()
    r = _run(squeeze, cmd)
    if r.returncode:
        return {"error": (r.stderr.strip().splitlines() or ["?"])[-1]}
    out = {"wall_s": time.time() - t0, "text": r.stdout}
    for line in r.stderr.splitlines():
        got = re.search(r"(prompt eval|\beval) time = .*?([0-9.]+) tokens per second", line)
        if got:
            out["prompt_tps" if got.group(1) == "prompt eval" else "decode_tps"] = float(got.group(2))
        got = re.search(r"load time = +([0-9.]+) ms", line)
        if got:
            out["load_s"] = float(got.group(1)) / 1000
    if "decode_tps" not in out:
        return {"error": "no eval timings in llama-completion's output"}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="*")
    ap.add_argument("--child")
    ap.add_argument("--budgets", default="8GiB")
    ap.add_argument("--predict", default="auto,off,block", help="prediction modes for the streamed runs")
    ap.add_argument("--resident", action="store_true", help="also onebit with every expert in memory")
    ap.add_argument("--default", action="store_true", help="also onebit with no flags (its own plan)")
    ap.add_argument("--squeeze", help="lock this much (e.g. 12GiB) for the squeezed runs")
    ap.add_argument("--llama", help="llama-completion binary (resident and squeezed peers)")
    ap.add_argument("--cold", action="store_true", help="also start-to-first-token on a dropped page cache, "
                    "streamed: a second process warmed by the first's record")
    ap.add_argument("--cold-no-drop", action="store_true", help="the --cold processes without dropping the page "
                    "cache (checks the script; not a cold start)")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--prompt", type=int, default=128, help="tokens of PROSE in the timed prompt (at most)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--json", help="write every run's figures here")
    a = ap.parse_args()
    if a.child:
        print(json.dumps(run_onebit(json.loads(a.child))))
        return
    if not a.models:
        ap.error("give one or more GGUF files")
    from onebit.memory.budget import format_bytes, parse_size

    squeeze = parse_size(a.squeeze) if a.squeeze else 0
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if squeeze and total - squeeze < 4 << 30:
        raise SystemExit("refusing to lock so much that under 4 GiB is left")
    if a.cold and os.geteuid() != 0:
        raise SystemExit("--cold drops the page cache: run as root")
    drop = a.cold
    a.cold = a.cold or a.cold_no_drop
    tmp = Path(tempfile.mkdtemp(prefix="bench_scale_"))
    files = {}
    for path in a.models:
        mach = machine(path)
        active, expert = active_bytes(path)
        files[path] = {"machine": mach, "active": active, "prose": prose(path, a.prompt)}
        print(f"file {path}: {format_bytes(os.path.getsize(path))}; {format_bytes(active)} read a decode token "
              f"resident; an expert {format_bytes(expert)}")
        print(f"  machine: memory {mach['mem_gbs']:.1f} GB/s (2 threads), O_DIRECT expert reads "
              f"{mach['direct_gbs']:.2f} GB/s (2 threads); resident decode limit {mach['mem_gbs'] * 1e9 / active:.1f} tok/s")
    configs: dict[str, tuple[dict, int]] = {}
    base = {"tokens": a.tokens, "backend": a.backend}
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
    if a.llama:
        peers["llama.cpp resident (--load-mode none)"] = (True, 0)
        if squeeze:
            peers[f"llama.cpp mmap, {a.squeeze} locked"] = (False, squeeze)
    runs = {(f, k): [] for f in files for k in [*configs, *peers]}
    cold = {(f, k): [] for f in files for k in configs} if a.cold else {}
    cold2 = {(f, k): [] for f in files for k in configs} if a.cold else {}
    for r in range(a.rounds):
        for path in files:
            for name, (cfg, sq) in configs.items():
                trace = str(tmp / f"trace-{len(os.listdir(tmp))}.jsonl")
                got = child({**cfg, "model": path, "trace": trace, "prose": files[path]["prose"]}, sq)
                if "decode_tps" in got:
                    got.update(routing(trace, got.get("slots", 0)))
                os.unlink(trace) if os.path.exists(trace) else None
                runs[path, name].append(got)
                print(f"  round {r + 1} {Path(path).name} {name}: "
                      f"{json.dumps({k: v for k, v in got.items() if k != 'tokens'})}", file=sys.stderr)
                if a.cold and not sq:  # (a squeeze's lock would count in the start-up)
                    records = Path(tempfile.mkdtemp(dir=tmp, prefix="records-"))  # (empty: no record)
                    for again, into in ((False, cold), (True, cold2)):
                        if drop:
                            drop_page_cache()
                        got = child({**cfg, "model": path, "cold": True, "records": str(records),
                                     "started": time.time()}, sq)
                        into[path, name].append(got)
                        print(f"  round {r + 1} {Path(path).name} {name} cold{' 2' if again else ''}: {got}",
                              file=sys.stderr)
                        if "warm_start" not in got:  # (resident: no pool, no record, no second process)
                            break
            for name, (res, sq) in peers.items():
                runs[path, name].append(llama_completion(a.llama, path, files[path]["prose"], a.tokens, res, sq))
                print(f"  round {r + 1} {Path(path).name} {name}: {runs[path, name][-1]}", file=sys.stderr)
    for path in files:
        report(path, files[path], {k: v for (f, k), v in runs.items() if f == path},
               {k: v for (f, k), v in cold.items() if f == path}, {k: v for (f, k), v in cold2.items() if f == path})
    if a.json:
        Path(a.json).write_text(json.dumps({"files": files, "tokens": a.tokens, "rounds": a.rounds,
                                            "runs": {f"{f} | {k}": v for (f, k), v in runs.items()},
                                            "cold": {f"{f} | {k}": v for (f, k), v in cold.items()},
                                            "cold2": {f"{f} | {k}": v for (f, k), v in cold2.items()}}, indent=1))


def drop_page_cache() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def report(path: str, info: dict, runs: dict, cold: dict, cold2: dict) -> None:
    mach, active = info["machine"], info["active"]
    has = lambda name, key: any(key in x for x in runs[name])
    med = lambda name, key: statistics.median([x[key] for x in runs[name] if key in x]) if has(name, key) \
        else float("nan")
    ref = next((k for k in runs if k.startswith("llama") and "resident" in k), None)
    resident_step = 1 / med("onebit resident", "decode_tps") if "onebit resident" in runs else None
    same_as = "onebit resident" if "onebit resident" in runs else next(iter(runs))
    print(f"\n{path}")
    print(f"{'run':<40} {'prompt':>7} {'ttft':>6} {'decode':>7} {'vs llama':>8} {'hit':>6} {'pf hit':>6} "
          f"{'stall':>7} {'read':>8} {'drive':>6} {'limit':>6} {'of lim':>6} {'of run':>6} {'RSS':>6} "
          f"{'reuse':>6} {'win8':>6} {'lru':>6} {'belady':>6} {'cores':>5} {'same':>5}"
          + (f" {'cold':>6} {'cold 2':>6} {'warmed':>9}" if cold else ""))
    for name in runs:
        if not has(name, "decode_tps"):
            print(f"{name:<40} failed: {runs[name][0].get('error') if runs[name] else 'not run'}")
            continue
        dec = med(name, "decode_tps")
        vs = dec / med(ref, "decode_tps") if ref and has(ref, "decode_tps") else float("nan")
        read = med(name, "read_mib") if has(name, "read_mib") else 0.0
        of_run = float("nan")
        if name.startswith("onebit") and read > 0:
            limit = 1 / max(resident_step or 0.0, read * 2**20 / (mach["direct_gbs"] * 1e9))
            if med(name, "drive_gbs") > 0:
                of_run = dec * max(resident_step or 0.0, read * 2**20 / (med(name, "drive_gbs") * 1e9))
        elif name.startswith("onebit") and resident_step:
            limit = 1 / resident_step
        else:
            limit = mach["mem_gbs"] * 1e9 / active
        same = ""
        if name.startswith("onebit") and has(same_as, "tokens"):
            same = "yes" if all(x.get("tokens") == runs[same_as][0]["tokens"] for x in runs[name]) else "NO"
        line = (f"{name:<40} {med(name, 'prompt_tps'):7.2f} {med(name, 'ttft_s'):6.2f} {dec:7.2f} {vs:8.2f} "
                f"{med(name, 'hit_rate'):6.1%} {med(name, 'prefetch_hits'):6.1f} {med(name, 'stall_ms'):6.0f}ms "
                f"{read:6.0f}Mi {med(name, 'drive_gbs'):6.2f} {limit:6.2f} {dec / limit:6.2f} {of_run:6.2f} "
                f"{med(name, 'peak_rss_gib'):6.2f} {med(name, 'reuse'):6.3f} {med(name, 'within8'):6.3f} "
                f"{med(name, 'lru'):6.1%} {med(name, 'belady'):6.1%} {med(name, 'cpu_per_token_s') * dec:5.2f} {same:>5}")
        if cold:
            for got in (cold.get(name, []), cold2.get(name, [])):
                c = [x["start_to_token_s"] for x in got if "start_to_token_s" in x]
                line += f" {statistics.median(c):6.1f}" if c else f" {'-':>6}"
            w = [x for x in cold2.get(name, []) if "warm_reads" in x]
            line += (f" {statistics.median([x['warm_reads'] for x in w]):4.0f}/"
                     f"{statistics.median([x['warm_hits'] for x in w]):<4.0f}" if w else f" {'-':>9}")
        print(line)
    ours = next((x["text"] for k in runs if k.startswith("onebit") for x in runs[k] if "text" in x), None)
    theirs = next((x["text"] for k in runs if k.startswith("llama") for x in runs[k] if "text" in x), None)
    if ours is not None and theirs is not None:
        same = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
        print(f"greedy text, onebit against llama.cpp: the first {same} of {len(ours)} / {len(theirs)} characters "
              f"agree{' (all)' if ours == theirs else ''}")


if __name__ == "__main__":
    main()
