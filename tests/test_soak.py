"""Soak at CI size (issue 36): 120 batch prompts with the shipped model's experts streamed
through 40 slots, then a 40-turn chat, in one process: resident memory flat after warm-up
(under 5%, medians of fifths), no file-descriptor or thread growth, one template worker for the
whole run, the expert pool's counters consistent. The long runs (2,000 prompts, 500 turns):
bench/soak.py and bench/results/issue36-bounds.md."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import soak  # noqa: E402


def test_soak_batch_and_chat_stay_flat():
    res = soak.run(prompts=120, turns=40, slots=40, backend="cpu", log=None)
    assert res["failures"] == [], res
    assert res["batch"]["samples"] == 120 and res["chat"]["samples"] == 40
    pool = res["pool"]
    assert pool["demand_misses"] > 0 and pool["hits"] > 0  # it streamed, and the pool served hits
    assert res["batch"]["workers_started"] == res["chat"]["workers_started"]


def _samples(n, **grow):
    base = {"rss": 100 << 20, "fds": 10, "threads": 2, "os_threads": 5, "worker_rss": 30 << 20,
            "workers_started": 1}
    return [{k: v + grow.get(k, 0) * i for k, v in base.items()} for i in range(n)]


def test_the_checks_can_fail():
    assert soak.check(_samples(100), "x") == []
    assert "resident memory grew" in soak.check(_samples(100, rss=100_000), "x")[0]  # 100 kB a prompt: ~7%
    assert "fds grew" in soak.check(_samples(100, fds=1), "x")[0]
    assert "os_threads grew" in soak.check(_samples(100, os_threads=1), "x")[0]
    assert "workers_started grew" in soak.check(_samples(100, workers_started=1), "x")[0]
    assert "template worker" in soak.check(_samples(100, worker_rss=100_000), "x")[0]
    # one spike does not count: medians of fifths
    spiky = _samples(100)
    spiky[-1]["rss"] *= 2
    assert soak.check(spiky, "x") == []
