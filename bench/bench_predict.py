"""Routing prediction and prefetch, measured: recall, and streamed decode against resident.

Part 1, recall: per-layer recall (predicted and routed / routed) of router and block mode at
1, 2 and 3 layers ahead, on a greedy decode of the resident model (predictions do not depend
on the pool).

Part 2, streamed decode: the pool at several fractions of all routed experts, reading the
file with O_DIRECT (so the page cache is not involved: nothing to drop between runs), decode
tok/s for prediction off / router / block / block two ahead (the second layer by the router
form, or chained through its own block) / router two ahead, and resident (no pool) as the
reference. Modes alternate in ABBA order within one run; each mode's figure is the median of
its reps; every mode's tokens are asserted equal to resident's. Per mode: prefetch hits,
wasted prefetches, stall and bytes read per token, and the pool's read rate while busy.
The drive's own O_DIRECT ceiling (random expert-sized reads, two threads) is printed first.

    python bench/bench_predict.py --model M.gguf [--backend numpy] [--backend vulkan]
        [--fractions 25,50,75] [--tokens 24] [--reps 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Optional

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import onebit  # noqa: E402
from onebit.moe.predict import settings_from  # noqa: E402

PROMPT = "def loads(s): Deserialize s (a str instance containing a JSON document) to a Python object."
MODES = [("off", {}), ("router", dict(mode="router")), ("block", dict(mode="block")),
         ("block-2", dict(mode="block", ahead=2)), ("block-2-chain", dict(mode="block", ahead=2, chain=True)),
         ("router-2", dict(mode="router", ahead=2))]


def drive_ceiling(path: str, chunk: int, seconds: float = 3.0, threads: int = 2) -> float:
    """GB/s of random O_DIRECT reads of `chunk` bytes (4 KiB aligned) from the file."""
    size = os.path.getsize(path)
    chunk = max(4096, chunk // 4096 * 4096)
    total = [0]
    lock = threading.Lock()
    stop = time.perf_counter() + seconds

    def work(seed):
        import mmap

        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
        buf = mmap.mmap(-1, chunk)
        rng = np.random.default_rng(seed)
        n = 0
        try:
            while time.perf_counter() < stop:
                off = int(rng.integers(0, max(1, (size - chunk) // 4096))) * 4096
                n += os.preadv(fd, [buf], off)
        finally:
            os.close(fd)
        with lock:
            total[0] += n

    t0 = time.perf_counter()
    ts = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return total[0] / (time.perf_counter() - t0) / 1e9


def prompt_ids(m) -> np.ndarray:
    return np.asarray(m.tokenize(PROMPT * 4)[:48], np.int64)


def decode(m, ids, n: int, cpu: Optional[list] = None):
    """(tokens, decode seconds): greedy, n tokens after the prompt; EOS does not stop it.
    `cpu`: appends the decode's CPU seconds (all of this process's threads: compute, the
    predictor, the readers), which other processes' load disturbs less than wall time."""
    cache = m.new_cache()
    logits = m.net.forward(ids, cache, last_only=True)
    toks = [int(logits[-1].argmax())]
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(n - 1):
        logits = m.net.forward(np.array([toks[-1]]), cache, last_only=True)
        toks.append(int(logits[-1].argmax()))
    if cpu is not None:
        cpu.append(time.process_time() - c0)
    return toks, time.perf_counter() - t0


def recall_table(path: str, backend: str, n: int) -> None:
    m = onebit.load(path, backend=backend)
    ids = prompt_ids(m)
    print(f"## recall on {backend}: {n}-token greedy decode after a {len(ids)}-token prompt, per row\n")
    print("| mode | 1 ahead | 2 ahead | 3 ahead | per layer (1 ahead) |")
    print("|---|---|---|---|---|")
    for mode, chain in (("router", False), ("block", False), ("block", True)):
        m.set_predict(settings_from(mode=mode, ahead=3, chain=chain))
        decode(m, ids, n)
        p = m.predictor
        d = {k: h / r for k, (h, r) in p.by_distance.items() if r}
        per = ", ".join(f"{l}: {s.recall:.2f}" for l, s in p.stats.items() if s.predictions)
        print(f"| {mode}{' (chained)' if chain else ''} | " + " | ".join(f"{d.get(j, float('nan')):.3f}" for j in (1, 2, 3)) + f" | {per} |")
    m.set_predict("off")
    m.close()
    print()


def streamed_table(path: str, backend: str, fractions, n: int, reps: int, modes=MODES) -> None:
    ref = onebit.load(path, backend=backend)
    cfg = ref.cfg
    ids = prompt_ids(ref)
    want, _ = decode(ref, ids, n)
    res_t = [decode(ref, ids, n)[1] for _ in range(reps)]
    ref.close()
    resident_tps = (n - 1) / statistics.median(res_t)
    total = sum(cfg.n_experts for i in range(cfg.n_layers) if cfg.layer_is_moe(i))
    print(f"## streamed decode on {backend}: {n} greedy tokens, ABBA x {reps}; resident: {resident_tps:.2f} tok/s\n")
    print("| pool | mode | tok/s | vs resident | vs off | prefetch hits/tok | wasted/tok | stall ms/tok "
          "| MiB read/tok | read GB/s | CPU ms/tok | layers block/router/none at the end |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for f in fractions:
        slots = max(cfg.n_experts_used, round(total * f / 100))
        m = onebit.load(path, backend=backend, slots=slots, budget="64GiB")
        if m.pool is None:
            print(f"| {f}% ({slots}) | - | all resident: no pool | | | | | | | | | |")
            m.close()
            continue
        results = {name: [] for name, _ in modes}
        levels = {}  # mode -> layers at block / router / none when its last run ended
        cpu = {}  # mode -> CPU seconds of each run's decode
        for rep in range(reps):
            order = modes if rep % 2 == 0 else modes[::-1]
            for name, kw in order:
                m.set_predict(settings_from(**kw) if kw else "off")
                before = dict(m.pool.stats.__dict__)
                toks, dt = decode(m, ids, n, cpu.setdefault(name, []))
                m.pool.drain()
                after = m.pool.stats.__dict__
                assert toks == want, f"{name} at {f}% changed the output"
                results[name].append((dt, {k: after[k] - before[k] for k in before}))
                if getattr(m.predictor, "ledger", None) is not None:
                    lv = list(m.predictor.ledger.level.values())
                    levels[name] = "/".join(str(lv.count(x)) for x in (2, 1, 0)) + ("" if m.predictor.gate.on else " gate off")
        off_tps = (n - 1) / statistics.median(dt for dt, _ in results["off"])
        for name, _ in modes:
            runs = results[name]
            tps = (n - 1) / statistics.median(dt for dt, _ in runs)

            def per_tok(key):
                return statistics.median(d[key] for _, d in runs) / n

            busy = sum(d["busy_seconds"] for _, d in runs)
            rate = sum(d["bytes_read"] for _, d in runs) / busy / 1e9 if busy else 0.0
            print(f"| {f}% ({slots}) | {name} | {tps:.2f} | {tps / resident_tps:.2f}x | {tps / off_tps:.2f}x | "
                  f"{per_tok('prefetch_hits'):.1f} | {per_tok('wasted_prefetches'):.1f} | "
                  f"{1000 * per_tok('stall_seconds'):.1f} | {per_tok('bytes_read') / 2**20:.2f} | {rate:.2f} | "
                  f"{1000 * statistics.median(cpu[name]) / (n - 1):.2f} | {levels.get(name, '')} |")
        m.set_predict("off")
        m.close()
    print()


def recall_why(path: str, n: int, backend: str = "numpy") -> None:
    """Why block mode misses at one layer ahead: layer l + 1 is predicted at layer l's pause
    point, from the residual before layer l's experts have added their output. Per target
    layer, recall (top-k, one row per decode step) of block mode with that residual as it is,
    and with layer l's expert output added back: exactly (the bound), only its top-1 expert,
    only the routed experts that were predicted for layer l (what a pool would have read
    ahead: a proxy for "the experts that are resident"), or a linear map of layer l's FFN
    input fitted online (ridge least squares over every earlier row, the prompt included)."""
    from onebit.moe.predict import Predictor
    from onebit.pause import PauseContext

    m = onebit.load(path, backend=backend)
    cfg, be = m.cfg, m.be
    ids0 = prompt_ids(m)
    k = cfg.n_experts_used
    variants = ["as today", "+ exact expert output (bound)", "+ top-1 expert only", "+ predicted experts only",
                "+ linear fit", "router form, + exact expert output"]

    class Why(Predictor):
        def __init__(self):
            super().__init__(m.gguf, cfg, settings_from(mode="block"), None, be)
            self.pred = {}  # target -> {variant: set}
            self.fit = {}  # layer -> [XtX, XtY]
            self.hits = {}  # target -> {variant: [hits, routed]}

        def at_pause(self, ctx: PauseContext, layer: int, ids, logits, h):
            x = be.rms_norm(h, be.weight(self.arch.router_names(cfg, layer)[0]), cfg.norm_eps)  # [R, dim]
            _, w = be.route(logits, k, cfg.expert_weights_norm)
            y = be.experts(layer, x, ids, w)  # [R, dim]: layer's real expert output
            got = self.pred.pop(layer, None)
            if got is not None and len(ids) == 1:
                acc = self.hits.setdefault(layer, {v: [0, 0] for v in variants})
                routed = set(int(e) for e in ids[0])
                for v, sel in got.items():
                    acc[v][0] += len(routed & sel)
                    acc[v][1] += k
            i = self.moe_layers.index(layer)
            if i + 1 < len(self.moe_layers) and len(ids) == 1:
                t = self.moe_layers[i + 1]
                guess = getattr(self, "_guess", {}).get(layer, set())
                part = [j for j in range(k) if int(ids[0, j]) in guess]
                A = self.fit.get(layer)
                lin = h + x @ np.linalg.solve(A[0] + 1e-2 * np.trace(A[0]) / cfg.dim * np.eye(cfg.dim), A[1]) \
                    if A is not None else h
                rs = {"as today": h, "+ exact expert output (bound)": h + y,
                      "+ top-1 expert only": h + be.experts(layer, x, ids[:, :1], w[:, :1]),
                      "+ predicted experts only": h + (be.experts(layer, x, ids[:, part], w[:, part]) if part else 0),
                      "+ linear fit": lin}
                out = {}
                for v, r in rs.items():
                    out[v] = set(int(e) for e in np.argsort(-self._router(t, self._block(ctx, t, r))[0])[:k])
                out["router form, + exact expert output"] = set(int(e) for e in np.argsort(-self._router(t, h + y)[0])[:k])
                self.pred[t] = out
                self._guess = {t: out["as today"]}
            A = self.fit.setdefault(layer, [np.zeros((cfg.dim, cfg.dim)), np.zeros((cfg.dim, cfg.dim))])
            A[0] += x.T.astype(np.float64) @ x
            A[1] += x.T.astype(np.float64) @ y

    why = Why()
    m.net.predictor = why
    decode(m, ids0, n)
    m.net.predictor = None
    print(f"## why block mode misses at 1 ahead: {n}-token greedy decode, {backend}, top-{k} recall per target layer\n")
    layers = sorted(why.hits)
    print("| residual layer l + 1 is predicted from | " + " | ".join(f"layer {l}" for l in layers) + " | all |")
    print("|---|" + "---|" * (len(layers) + 1))
    for v in variants:
        hr = [why.hits[l][v] for l in layers]
        print(f"| {v} | " + " | ".join(f"{a / b:.2f}" for a, b in hr) +
              f" | {sum(a for a, _ in hr) / sum(b for _, b in hr):.3f} |")
    print()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="GGUF file (default: the shipped model)")
    ap.add_argument("--backend", action="append", default=None)
    ap.add_argument("--fractions", default="25,50,75", help="pool sizes, percent of all routed experts")
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--no-recall", action="store_true")
    ap.add_argument("--modes", default=None, help="only these rows of the streamed table, e.g. off,router,block")
    ap.add_argument("--why", action="store_true", help="only the table of why block mode misses")
    a = ap.parse_args()
    want = a.modes.split(",") if a.modes else [name for name, _ in MODES]
    unknown = sorted(set(want) - {name for name, _ in MODES})
    if unknown or "off" not in want:
        sys.exit(f"bench_predict: --modes takes off plus any of {', '.join(n for n, _ in MODES[1:])}, "
                 f"got {a.modes}")
    modes = [mk for mk in MODES if mk[0] in want]
    from onebit.cli.main import default_model_path
    from onebit.formats.gguf_file import GGUFFile

    path = a.model or default_model_path()
    g = GGUFFile(path)
    t = next(t for name, t in g.tensors.items() if "ffn_gate_exps" in name)
    expert = 3 * t.n_bytes // t.shape[0]
    print(f"model: {path}\n")
    print(f"drive: O_DIRECT random reads of {expert / 2**20:.2f} MiB (one expert), 2 threads: "
          f"{drive_ceiling(path, expert):.2f} GB/s\n")
    if a.why:
        recall_why(path, a.tokens, (a.backend or ["numpy"])[0])
        return
    fractions = [int(x) for x in a.fractions.split(",")]
    for backend in a.backend or ["numpy"]:
        if not a.no_recall:
            recall_table(path, backend, a.tokens)
        streamed_table(path, backend, fractions, a.tokens, a.reps, modes)


if __name__ == "__main__":
    main()
