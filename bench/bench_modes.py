"""Execution modes on the Vulkan backend, this tree against another (e.g. the commit before a change).

For each file and mode, rounds alternate between the two trees (A B B A A B ...: one fresh
process per measurement, so each tree runs its own code), and the table gives medians and
the ratio this tree / the other. Modes:

- resident: greedy decode, every weight on the device;
- hook:     the same with a routing-trace hook (onebit.moe.trace.TraceWriter) set;
- pausehook: the same with a plain function as the hook (it may act before the experts run:
            the step pauses at every MoE layer);
- stream50: experts streamed through a pool of 50% of them (misses read from the drive);
- streamhit: a pool of all experts but one per size class, warmed by the same decode first,
            so (nearly) every acquire is a hit;
- prefill:  a 256-token prompt in one forward (prompt tok/s);
- greedy:   greedy decode as `generate_step` runs it (no drafts; in trees with GreedyChain, a
            step queued ahead on the device): per token, the time between two tokens.

Per decode token: tok/s (1 / median step) and host time as a share of the step (step minus the
fence waits). The other tree needs `onebit/memory` and `onebit/cli` (symlinks to its top-level
`memory/` and `cli/`): `git worktree add /tmp/before HEAD~1 && ln -s ../memory /tmp/before/onebit/memory
&& ln -s ../cli /tmp/before/onebit/cli`.

    python bench/bench_modes.py --other /tmp/before [--tokens 16] [--rounds 4] FILE.gguf ...

`--within` instead compares this tree's modes with its own resident decode, in one process:
one sequence per mode (resident / hook / pausehook / streamhit), stepped a token each in turn,
so the ratios to resident are measured under the same load:

    python bench/bench_modes.py --within [--tokens 16] [--rounds 6] FILE.gguf ...
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODES = ("resident", "hook", "pausehook", "stream50", "streamhit", "prefill", "greedy")


def worker(tree: str, path: str, mode: str, n_tokens: int) -> dict:
    sys.path.insert(0, tree)
    import numpy as np

    import onebit

    probe = onebit.load(path)
    cfg = probe.cfg
    n_experts = cfg.n_experts * sum(1 for n in probe.gguf.tensors if n.endswith("ffn_gate_exps.weight"))
    del probe
    slots = None
    if mode == "stream50":
        slots = n_experts // 2
    elif mode == "streamhit":
        slots = n_experts - 2  # two size classes at most in these files: one slot fewer in each
    m = onebit.load(path, backend="vulkan", slots=slots)
    assert m.be.name == "vulkan", "Vulkan backend not in use"
    dev = m.be.dev
    rng = np.random.default_rng(0)
    prompt = rng.integers(1, cfg.vocab_size, 8).astype(np.int64)
    hook = None
    if mode == "hook":
        from onebit.moe.trace import TraceWriter

        tmp = tempfile.NamedTemporaryFile(suffix=".jsonl", delete=False)
        hook = TraceWriter(tmp.name, "bench", cfg.n_layers, cfg.n_experts, cfg.n_experts_used)
    if mode == "pausehook":
        hook = lambda layer, ids, logits: None  # noqa: E731
    if mode == "prefill":
        long = rng.integers(1, cfg.vocab_size, 256).astype(np.int64)
        times = []
        for _ in range(3):  # the first also records
            cache = m.new_cache()
            t0 = time.perf_counter()
            m.net.forward(long, cache, last_only=True)
            times.append(time.perf_counter() - t0)
        return {"tok_s": 256 / statistics.median(times[1:]), "host_share": float("nan")}

    def decode(n):
        cache = m.new_cache()
        logits = m.net.forward(prompt, cache, hook=hook, last_only=True)
        tok = int(logits[-1].argmax())
        steps, hosts = [], []
        for _ in range(n):
            w0 = dev.wait_s
            t0 = time.perf_counter()
            logits = m.net.forward(np.array([tok], np.int64), cache, hook=hook)
            dt = time.perf_counter() - t0
            steps.append(dt)
            hosts.append(dt - (dev.wait_s - w0))
            tok = int(logits[-1].argmax())
        return steps, hosts

    if mode == "greedy":
        from onebit.generate import generate_step
        from onebit.sample import make_sampler

        def decode(n):  # noqa: F811 (this mode's decode)
            gen = generate_step(m.net, prompt.tolist(), m.new_cache(), make_sampler(0.0))
            next(gen)
            steps, hosts = [], []
            for _ in range(n):
                w0, t0 = dev.wait_s, time.perf_counter()
                next(gen)
                dt = time.perf_counter() - t0
                steps.append(dt)
                hosts.append(dt - (dev.wait_s - w0))
            gen.close()
            return steps, hosts

    decode(min(4, n_tokens))  # warm up: pipelines, recordings
    if mode == "streamhit":
        decode(n_tokens)  # the same tokens again fill the pool
        s0 = m.pool.stats.as_dict() if hasattr(m.pool.stats, "as_dict") else vars(m.pool.stats).copy()
    steps, hosts = decode(n_tokens)
    out = {"tok_s": 1 / statistics.median(steps), "host_share": statistics.median(h / s for h, s in zip(hosts, steps))}
    if m.pool is not None:
        st = vars(m.pool.stats)
        hits = st.get("hits", 0) + st.get("prefetch_hits", 0)
        total = hits + st.get("demand_misses", 0)
        if mode == "streamhit":
            hits -= s0.get("hits", 0) + s0.get("prefetch_hits", 0)
            total -= s0.get("hits", 0) + s0.get("prefetch_hits", 0) + s0.get("demand_misses", 0)
        out["hit_rate"] = hits / total if total else float("nan")
    m.close()
    return out


def within(path: Path, n_tokens: int, rounds: int) -> dict:
    """Per-token step medians of each mode and resident, interleaved token by token in one
    process: one sequence per mode, stepped in turn (the order rotating), so that every mode's
    steps see the same machine (on the VM a round's median moved by up to 2x between rounds).
    A sequence restarts from the prompt every n_tokens steps; rounds x n_tokens steps a mode."""
    import numpy as np

    import onebit
    from onebit.moe.trace import TraceWriter

    m = onebit.load(path, backend="vulkan")
    cfg = m.cfg
    n_experts = cfg.n_experts * sum(1 for n in m.gguf.tensors if n.endswith("ffn_gate_exps.weight"))
    ms = onebit.load(path, backend="vulkan", slots=n_experts - 2)
    assert m.be.name == ms.be.name == "vulkan" and ms.pool is not None
    trace = TraceWriter(tempfile.NamedTemporaryFile(suffix=".jsonl", delete=False).name, "bench", cfg.n_layers,
                        cfg.n_experts, cfg.n_experts_used)
    prompt = np.random.default_rng(0).integers(1, cfg.vocab_size, 8).astype(np.int64)
    modes = {"resident": (m, None), "hook": (m, trace), "pausehook": (m, lambda *a: None), "streamhit": (ms, None)}

    class Seq:
        def __init__(self, model, hook):
            self.model, self.hook, self.left = model, hook, 0

        def step(self) -> tuple[float, float]:
            """One decode step: (seconds, seconds waiting for the device)."""
            model, hook = self.model, self.hook
            if self.left == 0:
                self.cache, self.left = model.new_cache(), n_tokens
                self.tok = int(model.net.forward(prompt, self.cache, hook=hook, last_only=True)[-1].argmax())
            dev = model.be.dev
            w0, t0 = dev.wait_s, time.perf_counter()
            self.tok = int(model.net.forward(np.array([self.tok], np.int64), self.cache, hook=hook)[-1].argmax())
            self.left -= 1
            return time.perf_counter() - t0, dev.wait_s - w0

        def no_pause_steps(self) -> int:  # (the streamed model's, so far)
            r = self.model.be.runner
            return r.table_steps - r.table_steps_refused

    seqs = {k: Seq(*v) for k, v in modes.items()}
    for _ in range(2 * n_tokens):  # warm up; the pool gets every expert the decode routes to
        for q in seqs.values():
            q.step()
    s0 = vars(ms.pool.stats).copy()
    steps = {k: [] for k in modes}
    names = list(modes)
    streamed, lookups, counted = seqs["streamhit"], 0, 0
    for i in range(rounds * n_tokens):
        for k in names[i % len(names):] + names[: i % len(names)]:
            if k == "streamhit":
                before = streamed.left, streamed.no_pause_steps()
                steps[k].append(streamed.step())
                if before[0] > 0:  # (not counting a step that restarts from the prompt)
                    lookups += streamed.no_pause_steps() - before[1]
                    counted += 1
            else:
                steps[k].append(seqs[k].step())
    st = vars(ms.pool.stats)
    med = {k: statistics.median(t for t, _ in v) for k, v in steps.items()}
    host = {k: statistics.median((t - w) / t for t, w in v) for k, v in steps.items()}
    return {"tok_s": {k: 1 / v for k, v in med.items()}, "host_share": host,
            "misses": st["demand_misses"] - s0["demand_misses"],
            "lookups": (lookups, counted)}


def measure(tree: Path, path: Path, mode: str, n_tokens: int) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree))
    cmd = [sys.executable, __file__, "--worker", str(tree), str(path), mode, str(n_tokens)]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if res.returncode != 0:
        raise SystemExit(f"{tree} {path.name} {mode} failed:\n{res.stderr[-2000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        _, _, tree, path, mode, n = sys.argv
        print(json.dumps(worker(tree, path, mode, int(n))))
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+", type=Path)
    ap.add_argument("--other", type=Path, help="the tree to compare with")
    ap.add_argument("--within", action="store_true", help="modes against resident, in one process")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--modes", default=",".join(MODES))
    a = ap.parse_args()
    if a.within:
        print(f"Vulkan backend, this tree; {a.rounds} x {a.tokens} decode steps a mode, the modes interleaved step "
              "by step in one process (medians of per-token steps)")
        print(f"{'file':<28} {'mode':<10} {'tok/s':>8} {'x resident':>10} {'host':>6}")
        for f in a.files:
            res = within(f, a.tokens, a.rounds)
            base = res["tok_s"]["resident"]
            for k, v in res["tok_s"].items():
                extra = (f"  (pool demand misses while measured: {res['misses']}; decode steps with no pause: "
                         "{} of {})".format(*res["lookups"])) if k == "streamhit" else ""
                print(f"{f.name:<28} {k:<10} {v:>8.1f} {v / base:>10.2f} {100 * res['host_share'][k]:>5.1f}%{extra}",
                      flush=True)
        return
    if a.other is None:
        ap.error("give --other TREE (or --within)")
    trees = {"this": ROOT, "other": a.other.resolve()}
    print(f"Vulkan backend; {a.tokens} decode tokens, {a.rounds} rounds alternating trees (medians); "
          f"this = {ROOT}, other = {trees['other']}")
    hdr = (f"{'file':<28} {'mode':<9} {'this tok/s':>10} {'other tok/s':>11} {'ratio':>6} {'this host':>9} "
           f"{'other host':>10} {'hit this/other':>15}")
    print(hdr)
    print("-" * len(hdr))
    for f in a.files:
        base = None
        for mode in a.modes.split(","):
            res = {k: [] for k in trees}
            for r in range(a.rounds):
                order = list(trees) if r % 2 == 0 else list(trees)[::-1]
                for k in order:
                    res[k].append(measure(trees[k], f, mode, a.tokens))
            med = {k: {key: statistics.median(x[key] for x in v) for key in v[0]} for k, v in res.items()}
            t, o = med["this"], med["other"]
            hit = f"{t['hit_rate']:.2f}/{o['hit_rate']:.2f}" if "hit_rate" in t else ""
            host = (lambda x: "" if x != x else f"{100 * x:.1f}%")
            print(f"{f.name:<28} {mode:<9} {t['tok_s']:>10.1f} {o['tok_s']:>11.1f} {t['tok_s'] / o['tok_s']:>6.2f} "
                  f"{host(t['host_share']):>9} {host(o['host_share']):>10} {hit:>15}", flush=True)
            if mode == "resident":
                base = t["tok_s"]
            elif base and mode in ("hook", "pausehook", "streamhit"):
                print(f"{'':<28} {'':<9} {'(this tree: ' + format(t['tok_s'] / base, '.2f') + 'x of resident)':>30}")


if __name__ == "__main__":
    main()
