"""Where `onebit serve --parallel N` spends a step: N requests decoding together against the
same requests one at a time, in process (the engine without HTTP), as bench_serve.py sends
them (distinct questions, greedy, the end-of-generation tokens banned, --max-tokens each).

For each phase (the requests one after another, then all at once) it prints tokens, steps and
rows per step, and CPU time (every thread's: the cpu backend's kernels run on threads of their
own; CPU time ratios mean something on a busy machine, wall times do not), split into:
- the forwards (the batch thread's forward_batch), profiled with cProfile on CPU time and
  summed by what each function is: expert products (the routed experts' matrices), other
  matrix products, attention, the rest (norms, rope, routing, the logits' checks);
- the requests' own threads (sampling, lookup drafting, detokenizing, the stop checks): their
  thread CPU time, which runs between steps (a step waits for every member's rows);
- the expert rows: per step, the distinct experts routed over all rows against one row's.

    python bench/profile_serve_step.py --model M.gguf [--backend cpu] [--parallel 4]
        [--max-tokens 32] [--lookup 0] [--top 15]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import onebit  # noqa: E402
from onebit.apps.serve import Engine, Sampling, Work  # noqa: E402

# what a function's own time is, by its name (cProfile sees the Python function that calls a
# numba kernel: the kernel's time is that function's own)
KINDS = [("expert products", ("experts", "expert_call", "expert_ffn", "expert_ffn_oai", "one_expert", "routed_rows",
                                "_experts_of")),
         ("matrix products", ("linear", "linears", "_fuse", "matmul", "matmul3", "matmul_serial", "get_rows")),
         ("attention", ("attention", "attention_sinks", "_attend", "write", "_read", "read", "dequantize",
                        "hadamard"))]


def kind_of(func: str) -> str:
    for kind, names in KINDS:
        if func in names:
            return kind
    return "other"


class Probe:
    """Times the engine's forwards (the batch thread) and the requests' threads."""

    def __init__(self, m):
        self.m = m
        self.prof = cProfile.Profile(timer=time.process_time)
        self.forward_cpu = 0.0
        self.steps = 0
        self.rows = 0
        self.experts = []  # (distinct experts of the step's rows, rows) per MoE layer and step
        self.request_cpu = 0.0
        self.forward_wall, self.gaps, self.last_end = 0.0, [], None  # wall: forwards, and between them
        self.lock = threading.Lock()
        net = m.net
        batch = net.forward_batch

        def timed(fn, rows):
            def run(*a, **kw):
                c0, w0 = time.process_time(), time.perf_counter()
                if self.last_end is not None:
                    self.gaps.append(w0 - self.last_end)
                self.prof.enable()
                try:
                    return fn(*a, **kw)
                finally:
                    self.prof.disable()
                    self.forward_cpu += time.process_time() - c0
                    self.last_end = time.perf_counter()
                    self.forward_wall += self.last_end - w0
                    self.steps += 1
                    self.rows += rows(*a)
            return run

        net.forward_batch = timed(batch, lambda seqs, *a: sum(len(ids) for ids, _ in seqs))

        def hook_route(layer, ids, logits):
            self.experts.append((len(np.unique(ids)), ids.shape[0]))

        self.hook_route = hook_route

    def wrap_engine(self, engine: Engine) -> None:
        generate = engine._generate

        def run(*a, **kw):
            c0 = time.thread_time()
            try:
                return generate(*a, **kw)
            finally:
                with self.lock:
                    self.request_cpu += time.thread_time() - c0

        engine._generate = run

    def reset(self) -> None:
        self.prof = cProfile.Profile(timer=time.process_time)
        self.forward_cpu = self.request_cpu = 0.0
        self.steps = self.rows = 0
        self.experts = []
        self.forward_wall, self.gaps, self.last_end = 0.0, [], None


class RouteHook:
    """A hook that counts the experts each step's rows route to (observing: the forward does not
    pause for it)."""

    needs_pause = False

    def __init__(self, probe: Probe):
        self.probe = probe

    def __call__(self, layer, ids, logits) -> None:  # ids: [R, k] experts of each row
        self.probe.hook_route(layer, np.asarray(ids), logits)


def run_phase(engine: Engine, probe: Probe, questions: list[str], clients: int, max_tokens: int, ban: dict):
    done = []

    def one(q: str) -> None:
        finished = threading.Event()
        events = []

        def notify(ev):
            events.append(ev)
            if ev[0] in ("done", "error"):
                finished.set()

        engine.submit(Work(model=None, messages=[{"role": "user", "content": q}], max_tokens=max_tokens,
                           sampling=Sampling(temperature=0.0, logit_bias=ban)), notify)
        finished.wait(3600)
        kind, value = events[-1]
        if kind != "done":
            raise SystemExit(f"a request failed: {value}")
        done.append(value.completion_tokens)

    probe.reset()
    w0, c0 = time.perf_counter(), time.process_time()
    for start in range(0, len(questions), clients):
        threads = [threading.Thread(target=one, args=(q,)) for q in questions[start:start + clients]]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    return sum(done), time.perf_counter() - w0, time.process_time() - c0


def report(name: str, probe: Probe, tokens: int, wall: float, cpu: float, top: int) -> dict:
    stats = pstats.Stats(probe.prof)
    by_kind: dict[str, float] = defaultdict(float)
    funcs = []
    for (file, line, func), (cc, nc, tt, ct, callers) in stats.stats.items():
        by_kind[kind_of(func)] += tt
        funcs.append((tt, f"{Path(file).name}:{line}({func})", nc))
    total = sum(by_kind.values()) or 1.0
    rows = probe.rows / max(probe.steps, 1)
    moe = [e for e in probe.experts]
    distinct = np.mean([e for e, _ in moe]) if moe else 0.0
    print(f"\n## {name}: {tokens} tokens, {probe.steps} steps, {rows:.2f} rows a step; wall {wall:.2f} s, "
          f"CPU {cpu:.2f} s ({tokens / cpu:.2f} tokens per CPU-second)")
    print(f"- forwards: {probe.forward_cpu:.2f} s CPU ({probe.forward_cpu / cpu:.0%}), "
          f"{probe.forward_cpu / max(probe.steps, 1) * 1e3:.1f} ms a step")
    print(f"- requests' threads (sampling, drafting, detokenizing, stops): {probe.request_cpu:.2f} s CPU "
          f"({probe.request_cpu / cpu:.0%}), {probe.request_cpu / max(tokens, 1) * 1e3:.2f} ms a token")
    gaps = np.asarray(probe.gaps)
    if gaps.size:  # (wall time: meaningful on a quiet machine only)
        print(f"- wall: forwards {probe.forward_wall:.2f} s; between consecutive forwards median "
              f"{np.median(gaps) * 1e3:.2f} ms (the requests' turns and the hand-over; a request's end and the "
              f"next one's start fall here too)")
    print(f"- experts routed a MoE layer a step: {distinct:.1f} distinct (over {rows:.2f} rows)")
    print("| what (cProfile, CPU time, the forwards) | s | share |\n|---|---:|---:|")
    for kind, t in sorted(by_kind.items(), key=lambda kv: -kv[1]):
        print(f"| {kind} | {t:.2f} | {t / total:.0%} |")
    print(f"| function (own time) | calls | s |\n|---|---:|---:|")
    for tt, label, nc in sorted(funcs, reverse=True)[:top]:
        print(f"| {label} | {nc} | {tt:.3f} |")
    return {"tokens": tokens, "cpu": cpu, "forward": probe.forward_cpu, "steps": probe.steps,
            "experts": by_kind["expert products"] / total, "distinct": distinct,
            "kinds": {k: t / max(probe.steps, 1) for k, t in by_kind.items()},
            "funcs": {label: tt / max(probe.steps, 1) for tt, label, _ in funcs}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(ROOT / "onebit" / "data" / "default.gguf"))
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--parallel", type=int, default=4)
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--lookup", type=int, default=None, help="lookup drafts (default: serve's)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--top", type=int, default=15)
    args = ap.parse_args()
    from onebit.lookup import DEFAULT_DRAFTS

    m = onebit.load(args.model, backend=args.backend, n_ctx=args.ctx, sequences=args.parallel, threads=args.threads)
    probe = Probe(m)
    m.hook = RouteHook(probe)
    engine = Engine(m, Sampling(), lookup=DEFAULT_DRAFTS if args.lookup is None else args.lookup,
                    parallel=args.parallel)
    probe.wrap_engine(engine)
    ban = {t: -100.0 for t in m.tokenizer.stop_ids}
    questions = [f"Question {n}: what is {n} times {n % 7 + 2}?" for n in range(args.parallel)]
    run_phase(engine, probe, [f"Warm-up {n}?" for n in range(args.parallel)], args.parallel, 4, ban)
    print(f"model {Path(args.model).name}, --backend {args.backend}, --parallel {args.parallel}, "
          f"{args.max_tokens} tokens a request, lookup {engine.lookup}")
    one = report("one at a time", probe, *run_phase(engine, probe, questions, 1, args.max_tokens, ban), args.top)
    together = report(f"{args.parallel} together", probe,
                      *run_phase(engine, probe, [q + " " for q in questions], args.parallel, args.max_tokens, ban),
                      args.top)
    print(f"\n| per step, CPU ms | one at a time | {args.parallel} together | ratio |\n|---|---:|---:|---:|")
    for k in sorted(together["kinds"], key=lambda k: -together["kinds"][k]):
        a, b = one["kinds"].get(k, 0.0), together["kinds"][k]
        print(f"| {k} | {a * 1e3:.2f} | {b * 1e3:.2f} | {b / a if a else float('nan'):.2f}x |")
    grown = sorted(together["funcs"], key=lambda f: -(together["funcs"][f] - one["funcs"].get(f, 0.0)))
    print(f"\n| function, own CPU ms a step | one at a time | {args.parallel} together |\n|---|---:|---:|")
    for f in grown[: args.top]:
        print(f"| {f} | {one['funcs'].get(f, 0.0) * 1e3:.3f} | {together['funcs'][f] * 1e3:.3f} |")
    print(f"\ntokens per CPU-second, {args.parallel} together / one at a time: "
          f"{together['tokens'] / together['cpu'] / (one['tokens'] / one['cpu']):.2f}x; forward CPU a step: "
          f"{together['forward'] / together['steps'] / (one['forward'] / one['steps']):.2f}x of one row's; "
          f"distinct experts a layer: {together['distinct'] / max(one['distinct'], 1e-9):.2f}x")
    engine.close()


if __name__ == "__main__":
    main()
