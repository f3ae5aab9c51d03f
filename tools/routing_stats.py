#!/usr/bin/env python3
"""Routing statistics of a trace written by `onebit generate --trace`, per MoE layer and overall.

    python tools/routing_stats.py trace.jsonl
    python tools/routing_stats.py trace.jsonl --slots 36% --slots 45% --json

Prints reuse from token to token, within the last 8 tokens, popularity skew (the busiest 20%'s
share, the share of experts covering 90% of selections) per layer (onebit/moe/routing.py says
what each means), and with --slots the hit rates cache-sim replays on the same trace: LRU with
that share of each layer's experts cached (per layer), one LRU over every layer (the engine's
pool), and Belady's optimum (global) as the bound.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # (run from a clone without installing)

from onebit.errors import OnebitError  # noqa: E402
from onebit.moe.cachesim import load_trace, simulate  # noqa: E402
from onebit.moe.routing import as_dicts, format_stats, layer_stats, summary  # noqa: E402

POLICIES = ("lru", "global-lru", "belady")


def slot_count(spec: str, n_layers: int, n_experts: int) -> int:
    """'36%' -> that share of every MoE layer's experts, in slots for the whole model; '2400' as is."""
    spec = spec.strip()
    if spec.endswith("%"):
        return max(1, round(float(spec[:-1]) / 100 * n_experts) * n_layers)
    return int(spec)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace")
    ap.add_argument("--window", type=int, default=8, help="tokens of history for reuse_window (default 8)")
    ap.add_argument("--slots", action="append", default=[],
                    help="pool size: a share of each layer's experts (36%%) or a slot count; repeatable")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    try:
        trace = load_trace(args.trace)
        stats = layer_stats(trace, window=args.window)
        if not stats:
            raise OnebitError(f"{args.trace}: the trace holds no decode tokens")
        n_experts = int(trace.header["n_experts"])
        sims = []
        for spec in args.slots:
            try:
                n = slot_count(spec, len(stats), n_experts)
            except ValueError:
                raise OnebitError(f"--slots {spec!r}: give a share like 36% or a number of slots") from None
            for policy in POLICIES:
                r = simulate(trace, policy, n)
                sims.append({"slots": spec, "slot_count": n, "policy": policy, "hit_rate": r.hit_rate})
    except OnebitError as e:
        print(f"routing_stats: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"trace": args.trace, "model": trace.header.get("model"), "summary": summary(stats),
                          "layers": as_dicts(stats), "cache_sim": sims}, indent=1))
        return 0
    print(format_stats(stats))
    if sims:
        print()
        print(f"{'slots':>8}  {'count':>6}  " + "  ".join(f"{p:>10}" for p in POLICIES))
        for spec in args.slots:
            row = [s for s in sims if s["slots"] == spec]
            print(f"{spec:>8}  {row[0]['slot_count']:>6}  " + "  ".join(f"{s['hit_rate']:>10.3f}" for s in row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
