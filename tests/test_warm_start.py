"""A streamed model's next process starts warm: what the pool learned about a file is kept in a
record (memory/warm.py), the next load reads its experts into empty slots behind every other
read (ExpertPool.warm), and nothing a forward computes changes."""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import time

import numpy as np
import pytest

import onebit
from conftest import fixture_path, run_cli
from onebit.errors import UsageError
from onebit.formats import tokenizer
from onebit.formats.gguf_file import GGUFFile
from onebit.memory.plan import EXPERT_PARTS, size_classes
from onebit.memory.pool import ExpertPool
from onebit.memory.warm import KEEP, Learned, merged, read_record, record_path, warm_order, write_record

MODEL = str(fixture_path("qwen3moe-f32.gguf"))  # 2 MoE layers of 8 experts, top-2
SLOTS = 14  # stream region 8 (one layer's experts): slots 0-5 are what warming may fill
SHAPE = {0: 8, 1: 8}


@pytest.fixture
def cache(tmp_path):
    """The folder records are kept in (formats.tokenizer.set_cache_dir, as the CLI sets it)."""
    before = tokenizer.cache_dir()
    tokenizer.set_cache_dir(tmp_path)
    yield tmp_path
    tokenizer.set_cache_dir(before)


def learned_by_hand() -> dict:
    return {0: Learned([3.0, 0.0, 1.0, 5.0, 0.0, 1.0, 0.0, 2.0], [4, -1, 2, 9, -1, 7, -1, 8], [3, 5, 7]),
            1: Learned([0.0, 4.0, 0.0, 0.0, 4.0, 0.0, 6.0, 0.0], [-1, 5, -1, -1, 9, -1, 3, -1], [1, 4])}


def test_a_record_round_trips_and_older_counts_halve(tmp_path):
    got = learned_by_hand()
    assert write_record(tmp_path, MODEL, got)
    assert read_record(tmp_path, MODEL, SHAPE) == got
    assert [p.name for p in tmp_path.iterdir()] == [record_path(tmp_path, MODEL).name]  # no temporary file left
    new = {0: Learned([1.0] * 8, [0] * 8, [0]), 1: Learned([0.0] * 8, [-1] * 8, [])}
    both = merged(got, new)
    assert both[0].hot == [1 + KEEP * 3, 1, 1 + KEEP * 1, 1 + KEEP * 5, 1, 1 + KEEP * 1, 1, 1 + KEEP * 2]
    assert both[1].hot == [0, KEEP * 4, 0, 0, KEEP * 4, 0, KEEP * 6, 0]
    assert both[0].held == [0] and both[1].last == [-1] * 8  # (the newer process's own)


def test_the_warm_order_is_hottest_first_a_tier_of_k_per_layer_in_layer_order():
    # layer 0 by count: 3 (5), 0 (3), 7 (2), then 2 and 5 (1 each: 5 is held), 1 4 6 never used
    # layer 1: 6 (6), then 1 and 4 (4 each, both held; 4 used last), 0 2 3 5 7 never used
    assert warm_order(learned_by_hand(), 2) == [(0, 3), (0, 0), (1, 6), (1, 4), (0, 7), (0, 5), (1, 1), (0, 2)]


@pytest.mark.parametrize("damage", ["garbage", "not an object", "version", "other file", "changed file",
                                    "layers", "length", "id out of range", "negative count", "NaN count",
                                    "tick", "unreadable"])
def test_a_bad_record_is_ignored_with_one_log_line(tmp_path, caplog, damage):
    write_record(tmp_path, MODEL, learned_by_hand())
    where = record_path(tmp_path, MODEL)
    data = json.loads(where.read_text())
    layer = data["layers"]["0"]
    text = None
    if damage == "garbage":
        text = '{"version": 1, "file": {"pa'
    elif damage == "not an object":
        text = "[1, 2, 3]"
    elif damage == "version":
        data["version"] = 99
    elif damage == "other file":
        data["file"]["path"] = "/elsewhere/model.gguf"
    elif damage == "changed file":
        data["file"]["mtime_ns"] -= 10**9
    elif damage == "layers":
        data["layers"]["7"] = layer
    elif damage == "length":
        layer["hot"] = layer["hot"][:5]
    elif damage == "id out of range":
        layer["held"] = [3, 8]
    elif damage == "negative count":
        layer["hot"][0] = -1
    elif damage == "NaN count":
        layer["hot"][0] = float("nan")
    elif damage == "tick":
        layer["last"][0] = 1.5
    where.write_text(text if text is not None else json.dumps(data))
    if damage == "unreadable":
        where.unlink()
        where.mkdir()  # (a folder where the record should be: reading it fails)
    with caplog.at_level(logging.INFO, logger="onebit"):
        assert read_record(tmp_path, MODEL, SHAPE) is None
    lines = [r for r in caplog.records if "record" in r.getMessage()]
    assert len(lines) == 1 and "ignored" in lines[0].getMessage()


def test_no_record_says_nothing(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="onebit"):
        assert read_record(tmp_path, MODEL, SHAPE) is None
    assert not caplog.records


def test_a_folder_that_cannot_be_written_loses_the_record_quietly(tmp_path, caplog):
    blocked = tmp_path / "file"
    blocked.write_text("")
    with caplog.at_level(logging.INFO, logger="onebit"):
        assert not write_record(blocked / "sub", MODEL, learned_by_hand())  # (a file where a folder should be)
    assert len(caplog.records) == 1


def greedy(m, prompt, n=8) -> list[int]:
    cache = m.new_cache()
    tok = int(m.net.forward(prompt, cache)[-1].argmax())
    out = [tok]
    for _ in range(n):
        tok = int(m.net.forward(np.array([tok]), cache)[-1].argmax())
        out.append(tok)
    return out


def prompt_of(n=12):
    return np.load(MODEL.replace(".gguf", ".ref.npz"))["tokens"][:n].astype(np.int64)


def load(backend="numpy", **kw):
    return onebit.load(MODEL, slots=SLOTS, budget="1GiB", backend=backend, predict="off", **kw)


@pytest.mark.parametrize("backend", ["numpy", "cpu"])
def test_the_next_load_warms_its_pool_and_generates_the_same_tokens(cache, backend):
    """The first load has no record and writes one at close; the second reads it, its pool holds
    the first's hottest experts before its first forward, whose acquires hit them; the tokens of
    both, and of a load with warm_start off, are the same."""
    prompt = prompt_of()
    first = load(backend)
    assert first.warm_start == "no record"
    want = greedy(first, prompt)
    first_misses = first.pool.stats.demand_misses
    first.close()
    record = read_record(cache, MODEL, SHAPE)
    assert record is not None and sum(sum(v.hot) for v in record.values()) > 0
    second = load(backend)
    try:
        assert second.warm_start == "from a record (6 experts)"  # slots 0-5: the rest is the stream region
        second.pool.drain()
        assert set(second.pool.where) == set(warm_order(record, 2)[:6])
        assert all(s.key is not None for s in second.pool.slots[0][:6])
        assert all(s.key is None for s in second.pool.slots[0][6:])  # (the stream region left empty)
        assert greedy(second, prompt) == want
        st = second.pool.stats
        assert st.warm_reads == 6 and st.warm_hits > 0 and st.demand_misses < first_misses, (first_misses, st)
        assert "warm start from a record: 6 experts read" in second.pool.stats.line(1)
    finally:
        second.close()
    off = load(backend, warm_start=False)
    try:
        assert off.warm_start == "off" and off.pool.stats.warm_reads == 0
        assert greedy(off, prompt) == want
    finally:
        off.close()
    assert read_record(cache, MODEL, SHAPE) != record  # the second load's uses added (off keeps nothing)


def test_a_bad_record_loads_cold_and_is_replaced(cache):
    prompt = prompt_of()
    where = record_path(cache, MODEL)
    where.write_text("not json")
    m = load()
    try:
        assert m.warm_start == "record ignored" and m.pool.stats.warm_reads == 0
        tokens = greedy(m, prompt)
    finally:
        m.close()
    assert read_record(cache, MODEL, SHAPE) is not None  # written again at close
    m = load()
    try:
        assert m.warm_start.startswith("from a record") and greedy(m, prompt) == tokens
    finally:
        m.close()


def test_no_folder_keeps_nothing(tmp_path):
    before = tokenizer.cache_dir()
    tokenizer.set_cache_dir(None)
    try:
        m = load()
        greedy(m, prompt_of(), 2)
        m.close()
        assert m.warm_start == "off"
    finally:
        tokenizer.set_cache_dir(before)


def make_pool(slots=SLOTS, **kw):
    g = GGUFFile(MODEL)
    return g, ExpertPool(g, size_classes(g), [slots], **kw)


def test_warming_fills_only_empty_slots_outside_the_stream_region_and_evicts_nothing():
    g, pool = make_pool()
    try:
        assert pool.stream_from == [6]
        pool.acquire(0, [0, 1])  # two slots taken by a demand read (the LRU's first: 0 and 1), still pinned
        order = [(1, e) for e in range(8)] + [(0, e) for e in range(8)]
        assert pool.warm(order) == 4  # slots 2-5; (0, 0) and (0, 1) are resident already
        pool.drain()
        assert set(pool.where) == {(0, 0), (0, 1), (1, 0), (1, 1), (1, 2), (1, 3)}
        assert pool.stats.warm_reads == 4 and pool.stats.demand_misses == 2
        raw = g.tensor("blk.1.ffn_up_exps.weight").raw
        for e in range(4):
            assert np.array_equal(pool.slot_view(1, pool.where[1, e].index, "ffn_up_exps"), raw[e])
        pool.release(0, [0, 1])
        assert pool.acquire(1, [2]) == [pool.where[1, 2].index]
        assert pool.stats.warm_hits == 1 and pool.stats.hits == 1
        pool.release(1, [2])
        with pytest.raises(UsageError):
            pool.warm([(0, 8)])
    finally:
        pool.close()


def _blocking_reads(pool):
    """Replace the pool's reads with ones that log (layer, expert, part) and, for layer 0's
    experts (those the tests warm), wait on `gate` while it is clear; returns (log, gate)."""
    where = {}
    for (layer, part), src in pool.sources.items():
        for e in range(src.n_experts):
            where[src.offset + e * src.nbytes] = (layer, e, part)
    log, gate = [], threading.Event()
    reader = next(iter(pool.readers.values()))
    read = reader.read_into

    def logged(dst, offset, *args):
        log.append(where[offset])
        if where[offset][0] == 0:
            gate.wait(timeout=30)
        return read(dst, offset, *args)

    reader.read_into = logged
    return log, gate


def _wait(cond, seconds=10):
    deadline = time.monotonic() + seconds
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_a_demand_read_queued_while_warming_is_read_first():
    """One reader, busy with warming's first part: the demand read queued meanwhile goes before
    the rest of warming's parts (its own expert's two others included)."""
    g, pool = make_pool(readers=1)
    log, gate = _blocking_reads(pool)
    try:
        pool.warm([(0, 0), (0, 1)])
        _wait(lambda: len(log) == 1)
        got = []
        t = threading.Thread(target=lambda: got.append(pool.acquire(1, [5])))
        t.start()
        _wait(lambda: len(pool.queue) == 2 + len(EXPERT_PARTS))  # warming's two parts left, the demand's three
        gate.set()
        t.join(timeout=30)
        pool.drain()
        assert got and log[0] == (0, 0, EXPERT_PARTS[0])
        assert log[1:4] == [(1, 5, p) for p in EXPERT_PARTS]
        assert log[4:] == [(0, 0, p) for p in EXPERT_PARTS[1:]] + [(0, 1, p) for p in EXPERT_PARTS]
    finally:
        gate.set()
        pool.close()


def test_warming_leaves_a_reader_free_for_demand_reads():
    """Two readers: warming never reads on both at once, so a demand read goes ahead while a
    warming read is stuck."""
    g, pool = make_pool(readers=2)
    log, gate = _blocking_reads(pool)
    try:
        pool.warm([(0, e) for e in range(6)])
        _wait(lambda: len(log) == 1)
        time.sleep(0.05)  # (the other reader would have taken a warming part by now, were it allowed)
        assert len(log) == 1
        got = []
        t = threading.Thread(target=lambda: got.append(pool.acquire(1, [5])))
        t.start()
        t.join(timeout=10)
        assert got, "the demand read waited for warming"
        assert log[1:] == [(1, 5, p) for p in EXPERT_PARTS] and pool.stats.demand_misses == 1
        gate.set()
        pool.drain()
        assert pool.stats.warm_reads == 5  # the demand read took slot 0 first, the sixth's: not warmed
        assert (1, 5) in pool.where and (0, 5) not in pool.where
    finally:
        gate.set()
        pool.close()


def test_the_command_says_whether_a_record_was_used(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("ONEBIT_CACHE_DIR", str(tmp_path))
    args = ["generate", MODEL, "-p", "The json module", "-n", "3", "--backend", "numpy", "--slots", str(SLOTS),
            "--budget", "1GiB", "--moe-predict", "off"]
    code, _, err = run_cli(monkeypatch, capsys, *args, "--no-warm-start")
    assert code == 0 and "warm start off" in err and not list(tmp_path.iterdir())
    code, first, err = run_cli(monkeypatch, capsys, *args)
    assert code == 0 and "warm start no record" in err and record_path(tmp_path, MODEL).exists()
    code, again, err = run_cli(monkeypatch, capsys, *args, "--stats")
    assert code == 0 and "warm start from a record (6 experts)" in err and again == first
    # (--stats; how many of the 6 warming reads before a demand read takes their slot is timing's)
    got = re.search(r"warm start from a record: (\d+) experts read, (\d+) used", err)
    assert got and 1 <= int(got[1]) <= 6 and int(got[2]) <= int(got[1]), err


def test_misses_evict_warmed_experts_not_yet_used_last_for_a_while():
    """A first prompt's misses at one layer must not evict what was warmed for the layers after
    it (plain LRU would: warming read them before anything else). For KEEP_WARMED acquires a
    layer (4 here) they go last; then the unused ones are the least recently used, the last
    read first."""
    g, pool = make_pool(readers=1)  # (one reader: warming's reads finish in order)
    try:
        assert pool.warm([(1, e) for e in range(6)]) == 6
        pool.drain()
        warmed = {(1, e) for e in range(6)}
        for group in ([0, 1, 2, 3], [4, 5, 6, 7]):  # 8 misses: the stream region's 8 empty slots
            pool.acquire(0, group)
            pool.release(0, group)
        pool.acquire(1, [6])  # a miss with no empty slot: a layer-0 expert goes, the oldest
        pool.release(1, [6])
        assert warmed <= set(pool.where) and (0, 0) not in pool.where
        assert pool.stats.warm_wasted == 0
        pool.acquire(1, [0, 1, 2, 3])  # the 4th acquire: warmed experts are kept no longer
        pool.release(1, [0, 1, 2, 3])
        assert pool.stats.warm_hits == 4
        pool.acquire(0, [0])  # a miss: the unused warmed expert read last goes first
        pool.release(0, [0])
        assert (1, 5) not in pool.where and (1, 4) in pool.where and pool.stats.warm_wasted == 1
    finally:
        pool.close()
