"""Measured memory agrees with the plan; the guard stops generation cleanly."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

import onebit
from conftest import fixture_path
from onebit.memory.guard import MemoryGuard, MemoryGuardError


def test_allocations_match_the_plan():
    """tracemalloc sees numpy's allocations (not interpreter noise): what stays allocated after
    load is the plan's resident weights + expert slots, and a prefill's peak stays inside the
    plan's total. Tolerance: 2% + 256 KiB for Python objects (tensor records, the tokenizer)."""
    path = fixture_path("q3moe256-f32.gguf")
    onebit.load(path, slots=5, budget="1GiB", n_ctx=512, backend="cpu").close()  # warm-up: module imports are not the plan's
    tracemalloc.start()
    m = onebit.load(path, slots=5, budget="1GiB", n_ctx=512, backend="cpu")
    try:
        loaded, _ = tracemalloc.get_traced_memory()
        items = {i.component: i.bytes for i in m.plan.items}
        persistent = items["resident weights"] + items["expert slots"]
        assert abs(loaded - persistent) <= 0.02 * persistent + (256 << 10), (loaded, persistent)
        tracemalloc.reset_peak()
        ids = np.load(str(path).replace(".gguf", ".ref.npz"))["tokens"].astype(np.int64)
        cache = m.new_cache()  # planned: allocated for the whole context now
        after_cache, _ = tracemalloc.get_traced_memory()
        kv = after_cache - loaded
        assert abs(kv - items["KV cache"]) <= 0.02 * items["KV cache"] + (64 << 10), (kv, items["KV cache"])
        m.net.forward(ids, cache, last_only=True)
        _, peak = tracemalloc.get_traced_memory()
        assert peak <= m.plan.total + (256 << 10), (peak, m.plan.total)
    finally:
        tracemalloc.stop()
        m.close()


def test_plan_that_does_not_fit_is_refused_before_loading():
    from onebit.memory.plan import PlanError

    with pytest.raises(PlanError, match="memory plan needs"):
        onebit.load(fixture_path("q3moe256-f32.gguf"), budget="1MiB", backend="cpu")


def test_guard_stops_generation():
    m = onebit.load(fixture_path("qwen3moe-f32.gguf"), backend="cpu")
    m.guard = MemoryGuard(floor=1 << 60)  # more than any machine has: trips at the first token
    with pytest.raises(MemoryGuardError, match="available memory fell"):
        list(m.generate([1, 2, 3], max_tokens=5))
    assert MemoryGuard().available() > 0
