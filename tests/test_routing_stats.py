"""Routing statistics (onebit/moe/routing.py, tools/routing_stats.py) on traces with known answers."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from onebit.moe.cachesim import load_trace
from onebit.moe.routing import layer_stats, summary

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
import routing_stats  # noqa: E402


def write_trace(path: Path, n_experts: int, k: int, passes: list[tuple[str, list[list[tuple[int, ...]]]]]) -> str:
    """passes: (phase, [layer 0's rows, layer 1's rows, ...]) in order, as TraceWriter writes them."""
    n_layers = len(passes[0][1])
    lines = [json.dumps({"onebit_trace": 1, "model": "hand", "n_layers": n_layers, "n_experts": n_experts, "k": k})]
    for phase, layers in passes:
        for layer, rows in enumerate(layers):
            lines.append(json.dumps({"phase": phase, "layer": layer, "experts": [list(r) for r in rows]}))
    path.write_text("\n".join(lines) + "\n")
    return str(path)


# one prompt token then four decode tokens; layer 0 moves, layer 1 never changes
HAND = [("prompt", [[(0, 1)], [(2, 3)]]), ("decode", [[(0, 1)], [(2, 3)]]), ("decode", [[(1, 2)], [(2, 3)]]),
        ("decode", [[(2, 3)], [(3, 2)]]), ("decode", [[(0, 1)], [(2, 3)]])]


def test_hand_trace(tmp_path):
    """By hand, layer 0 (window 2): reuse of the previous token 2+1+1+0 of 8 picks, within two
    tokens 2+1+1+1; picks per expert 2, 3, 2, 1: the busiest (20% of 4 experts: one) has 3 of
    8, all four are needed for 90%. Layer 1: every pick reused, two experts take everything."""
    t = load_trace(write_trace(tmp_path / "t.jsonl", 4, 2, HAND))
    l0, l1 = layer_stats(t, window=2)
    assert (l0.layer, l0.decode_tokens) == (0, 4)
    assert (l0.reuse_prev, l0.reuse_window, l0.busiest_20, l0.cover_90, l0.distinct) == (4 / 8, 5 / 8, 3 / 8, 1.0, 1.0)
    assert (l1.reuse_prev, l1.reuse_window, l1.busiest_20, l1.cover_90, l1.distinct) == (1.0, 1.0, 0.5, 0.5, 0.5)
    m = summary([l0, l1])
    assert m["reuse_prev"] == pytest.approx(0.75) and m["reuse_prev_range"] == [0.5, 1.0]
    assert m["cover_90"] == pytest.approx(0.75)


def test_random_routing_matches_its_expectation(tmp_path):
    """Uniform independent top-8 of 128 over 3000 tokens: reuse k/E = 0.0625, within 8 tokens
    1 - (1 - k/E)^8 = 0.403, the busiest 20% near 0.2, 90% covered by about 0.9 of the experts."""
    rng = np.random.default_rng(0)
    E, k, n = 128, 8, 3000
    passes = [("decode", [[tuple(int(e) for e in rng.choice(E, k, replace=False))] for _ in range(2)])
              for _ in range(n)]
    s = summary(layer_stats(load_trace(write_trace(tmp_path / "r.jsonl", E, k, passes))))
    assert s["reuse_prev"] == pytest.approx(k / E, abs=0.01)
    assert s["reuse_window"] == pytest.approx(1 - (1 - k / E) ** 8, abs=0.015)
    assert 0.2 <= s["busiest_20"] < 0.25
    assert 0.85 <= s["cover_90"] <= 0.92


def test_tool_prints_stats_and_cache_sim(tmp_path, capsys):
    """--slots 50%: two of each layer's four experts. Per-layer LRU by hand: layer 0 hits 2, 1,
    1, 0 of its 8 picks (the prompt token warms it), layer 1 all 8: 12 of 16."""
    path = write_trace(tmp_path / "t.jsonl", 4, 2, HAND)
    assert routing_stats.main([path, "--window", "2", "--slots", "50%", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["summary"]["reuse_window"] == pytest.approx((5 / 8 + 1) / 2)
    lru = next(s for s in out["cache_sim"] if s["policy"] == "lru")
    assert (lru["slot_count"], lru["hit_rate"]) == (4, 0.75)
    belady = next(s for s in out["cache_sim"] if s["policy"] == "belady")
    assert belady["hit_rate"] >= lru["hit_rate"]
    assert routing_stats.main([path, "--slots", "50%"]) == 0
    assert "global-lru" in capsys.readouterr().out


def test_tool_refuses_a_trace_without_decode_tokens(tmp_path, capsys):
    path = write_trace(tmp_path / "p.jsonl", 4, 2, HAND[:1])
    assert routing_stats.main([path]) == 2
    assert "no decode tokens" in capsys.readouterr().err
    assert routing_stats.main([str(tmp_path / "missing.jsonl")]) == 2
