"""Cache policies on synthetic traces whose optimum is found by exhaustive search."""

from __future__ import annotations

import json
import subprocess
import sys
from functools import lru_cache

import numpy as np
import pytest

from onebit.errors import UsageError
from onebit.moe.cachesim import POLICIES, simulate
from onebit.moe.trace import Access, Trace, TraceWriter, read_trace


def make_trace(seq, warm=0, layer_of=lambda e: 0):
    """One token per item of seq, each routing to one expert (k=1)."""
    acc = [Access(t, t >= warm, layer_of(e), (e,)) for t, e in enumerate(seq)]
    return Trace({"onebit_trace": 1, "n_layers": 1, "n_experts": 8, "k": 1}, acc)


def optimal_hits(seq, cap, warm):
    """Maximum decode hits over every possible eviction choice (dynamic programming). An expert
    must be resident to be used, so a miss always inserts it (no bypass)."""

    @lru_cache(maxsize=None)
    def best(i, cache):
        if i == len(seq):
            return 0
        e = seq[i]
        gain = 1 if (e in cache and i >= warm) else 0
        if e in cache:
            return gain + best(i + 1, cache)
        if len(cache) < cap:
            return best(i + 1, tuple(sorted(cache + (e,))))
        options = []
        for v in cache:
            options.append(best(i + 1, tuple(sorted(tuple(c for c in cache if c != v) + (e,)))))
        return max(options)

    return best(0, ())


@pytest.mark.parametrize("seed", range(12))
def test_belady_is_optimal_and_bounds_every_policy(seed):
    rng = np.random.default_rng(seed)
    seq = [int(x) for x in rng.integers(0, 5, 14)]
    trace = make_trace(seq, warm=3)
    for cap in (2, 3):
        opt = optimal_hits(tuple(seq), cap, 3)
        assert simulate(trace, "belady", cap).hits == opt
        for p in POLICIES:
            assert simulate(trace, p, cap).hits <= opt


def test_lru_thrashes_on_a_cycle_that_belady_serves():
    seq = [0, 1, 2] * 10
    t = make_trace(seq, warm=3)
    assert simulate(t, "global-lru", 2).hits == 0
    assert simulate(t, "belady", 2).hit_rate >= 0.45
    assert simulate(t, "global-lru", 3).hit_rate == 1.0


def test_per_layer_split_and_pinning():
    # two layers, k=2: both experts of a token's layer are pinned together
    acc = []
    for t in range(20):
        acc.append(Access(t, t >= 4, 0, (0, 1)))
        acc.append(Access(t, t >= 4, 1, (t % 3, 3)))
    tr = Trace({"onebit_trace": 1, "n_layers": 2, "n_experts": 4, "k": 2}, acc)
    r = simulate(tr, "lru", 4)  # 2 slots per layer: layer 0 always hits, layer 1 hits only expert 3
    assert r.accesses == 16 * 4
    assert r.hits == 16 * 2 + sum(1 for t in range(4, 20) if (t % 3) == 3) + 16
    with pytest.raises(UsageError):
        simulate(tr, "lru", 3)  # fewer than k per layer


def test_trace_file_roundtrip_and_cli(tmp_path):
    path = tmp_path / "t.jsonl"
    w = TraceWriter(str(path), "m", 2, 4, 2)
    rng = np.random.default_rng(0)
    for phase, rows in (("prompt", 5), ("decode", 1), ("decode", 1), ("decode", 1)):
        w.phase = phase
        for layer in range(2):
            logits = rng.standard_normal((rows, 4)).astype(np.float32)
            ids = np.argsort(-logits, axis=1)[:, :2]
            w(layer, ids, logits)
    w.close()
    tr = read_trace(str(path))
    assert len(tr.accesses) == 8 * 2 and sum(a.decode for a in tr.accesses) == 6
    assert [a.token for a in tr.accesses][:4] == [0, 0, 1, 1]
    r = subprocess.run([sys.executable, "-m", "onebit.cli.main", "cache-sim", str(path), "--slots", "2",
                        "--slots", "4", "--json"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    # per-layer policies need k slots per layer (4): they run at 4 slots only
    assert {x["policy"] for x in rows} == set(POLICIES) and len(rows) == 3 + len(POLICIES)
    assert all(0.0 <= x["hit_rate"] <= 1.0 and x["accesses"] == 12 for x in rows)
    bad = tmp_path / "bad.jsonl"
    bad.write_text("hello\n")
    r = subprocess.run([sys.executable, "-m", "onebit.cli.main", "cache-sim", str(bad), "--slots", "2"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "not an onebit routing trace" in r.stderr


def test_trace_logits_are_written_to_five_decimals(tmp_path):
    """The router logits in a trace line are rounded to 5 decimals as written (float32's nearest
    to 1.304 would print as 1.3040000200271606)."""
    path = tmp_path / "t.jsonl"
    w = TraceWriter(str(path), "m", 1, 4, 1)
    w(0, np.array([[0]]), np.array([[1.304, -0.25, 0.123456, 2.0]], np.float32))
    w.close()
    line = path.read_text().splitlines()[1]
    rec = json.loads(line)
    assert rec["ranked"] == [[3, 0]] and rec["logits"] == [[2.0, 1.304]] and '"logits": [[2.0, 1.304]]' in line
