"""Statistics of a routing trace that decide what an expert cache can do with it.

Each is per MoE layer over the decode tokens of a trace (moe/trace.py), then the mean over
layers; the tokens before a decode token (prompt ones too) count as its history:

  reuse_prev    share of a token's experts that the previous token also used
  reuse_window  share found among the previous `window` (8) tokens' experts
  busiest_20    share of the layer's selections taken by its busiest 20% of experts
  cover_90      share of the layer's experts needed to cover 90% of its selections
  distinct      share of the layer's experts selected at least once

Trained MoE models publish these (Qwen3-30B-A3B: reuse_prev 0.38-0.45, reuse_window 0.75-0.84,
busiest_20 about 0.57, cover_90 about 0.5); random routers give about k/E, 1-(1-k/E)^8, 0.2
and 0.9. `tools/routing_stats.py` prints them, with cache-sim's hit rates beside them.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import asdict, dataclass

import numpy as np

from .trace import Trace

STATS = ("reuse_prev", "reuse_window", "busiest_20", "cover_90", "distinct")


@dataclass(frozen=True)
class LayerStats:
    layer: int
    decode_tokens: int
    reuse_prev: float
    reuse_window: float
    busiest_20: float
    cover_90: float
    distinct: float


def layer_stats(trace: Trace, n_experts: int | None = None, window: int = 8) -> list[LayerStats]:
    """One LayerStats per MoE layer that has decode tokens in `trace`."""
    n_experts = int(trace.header["n_experts"]) if n_experts is None else n_experts
    by_layer: dict[int, list] = defaultdict(list)  # layer -> [(token, decode, experts)] in token order
    for a in trace.accesses:
        by_layer[a.layer].append((a.token, a.decode, frozenset(a.experts)))
    out = []
    for layer in sorted(by_layer):
        seq = sorted(by_layer[layer], key=lambda r: r[0])
        prev_hits = window_hits = chosen = 0
        counts = np.zeros(n_experts, np.int64)
        decode = 0
        for i, (_, is_decode, experts) in enumerate(seq):
            if not is_decode:
                continue
            decode += 1
            chosen += len(experts)
            for e in experts:
                counts[e] += 1
            if i > 0:
                prev_hits += len(experts & seq[i - 1][2])
                recent = frozenset().union(*(r[2] for r in seq[max(0, i - window):i]))
                window_hits += len(experts & recent)
        if not decode:
            continue
        ranked = np.sort(counts)[::-1]
        top = max(1, round(0.2 * n_experts))
        cum = np.cumsum(ranked) / max(ranked.sum(), 1)
        cover = int(np.searchsorted(cum, 0.9 - 1e-12) + 1)
        out.append(LayerStats(layer, decode, prev_hits / chosen, window_hits / chosen,
                              float(ranked[:top].sum() / max(ranked.sum(), 1)), cover / n_experts,
                              float((counts > 0).mean())))
    return out


def summary(stats: list[LayerStats]) -> dict:
    """The mean of each statistic over layers, and its range."""
    if not stats:
        return {}
    out = {"layers": len(stats), "decode_tokens": max(s.decode_tokens for s in stats)}
    for name in STATS:
        v = [getattr(s, name) for s in stats]
        out[name] = float(np.mean(v))
        out[name + "_range"] = [float(min(v)), float(max(v))]
    return out


def as_dicts(stats: list[LayerStats]) -> list[dict]:
    return [asdict(s) for s in stats]


def format_stats(stats: list[LayerStats]) -> str:
    lines = [f"{'layer':>5}  {'tokens':>6}  " + "  ".join(f"{n:>12}" for n in STATS)]
    for s in stats:
        lines.append(f"{s.layer:>5}  {s.decode_tokens:>6}  " + "  ".join(f"{getattr(s, n):>12.3f}" for n in STATS))
    m = summary(stats)
    if m:
        lines.append(f"{'mean':>5}  {m['decode_tokens']:>6}  " + "  ".join(f"{m[n]:>12.3f}" for n in STATS))
    return "\n".join(lines)
