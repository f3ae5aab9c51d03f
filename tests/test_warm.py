"""What a streamed model's pool learned about its file, kept for the next process (memory/warm.py)."""

from __future__ import annotations

import os
import shutil

import numpy as np

import onebit
from conftest import fixture_path
from onebit.formats.gguf_file import GGUFFile
from onebit.memory.plan import size_classes
from onebit.memory.pool import ExpertPool
from onebit.memory.warm import DECAY, WarmStore, file_key, warm_order

MOE = "qwen3moe-f32.gguf"  # 8 experts a layer, top 2


def test_counts_kept_and_added_to_with_decay(tmp_path):
    g = GGUFFile(fixture_path(MOE))
    store = WarmStore(tmp_path, g)
    assert store.load((2, 8)) is None  # nothing kept yet
    first = np.zeros((2, 8), np.float32)
    first[0, 3], first[1, 5] = 4, 2
    store.save(first, None)
    kept = store.load((2, 8))
    assert np.array_equal(kept, first)
    second = np.zeros((2, 8), np.float32)
    second[0, 1] = 1
    store.save(second, kept)
    got = store.load((2, 8))
    want = first * DECAY + second  # 2, 1, 1 where 4, 2 and the new 1 were
    assert np.array_equal(got, want) and got[0, 3] == 2 and got[0, 1] == 1 and got[1, 5] == 1
    assert store.load((3, 8)) is None  # another shape: not this file's


def test_a_damaged_or_unwritable_store_is_ignored(tmp_path):
    g = GGUFFile(fixture_path(MOE))
    store = WarmStore(tmp_path, g)
    store.path.write_bytes(b"\x93NUMPY garbage")
    assert store.load((2, 8)) is None
    np.save(store.path, np.full((2, 8), np.nan, np.float32))
    assert store.load((2, 8)) is None
    blocked = tmp_path / "file"
    blocked.write_text("")
    WarmStore(blocked / "sub", g).save(np.ones((2, 8), np.float32), None)  # (a file where the folder would be)


def test_the_key_follows_the_tensors_not_the_name(tmp_path):
    a = fixture_path(MOE)
    b = tmp_path / "renamed.gguf"
    shutil.copyfile(a, b)
    assert file_key(GGUFFile(a)) == file_key(GGUFFile(str(b)))
    assert file_key(GGUFFile(a)) != file_key(GGUFFile(fixture_path("qwen2moe-f32.gguf")))


def test_warm_order_takes_the_most_used_in_layer_order():
    counts = np.array([[0, 5, 1, 0], [9, 0, 0, 2], [3, 0, 7, 0]], np.float32)
    # the 4 most used: (1,0) 9, (2,2) 7, (0,1) 5, (2,0) 3; layer by layer, most used first
    assert warm_order(counts, [0, 1, 2], 4) == [(0, 1), (1, 0), (2, 2), (2, 0)]
    assert warm_order(counts, [2], 10) == [(2, 2), (2, 0)]  # only the layers asked for, never a zero
    assert warm_order(counts, [0, 1, 2], 0) == []


def test_pool_counts_uses_and_warm_reads_fill_empty_slots_as_hits():
    g = GGUFFile(fixture_path(MOE))
    pool = ExpertPool(g, size_classes(g), [6])
    try:
        pool.acquire(0, [1, 2])
        pool.release(0, [1, 2])
        pool.acquire(1, [2])
        pool.release(1, [2])
        assert pool.uses[0, 1] == 1 and pool.uses[0, 2] == 1 and pool.uses[1, 2] == 1 and pool.uses.sum() == 3
    finally:
        pool.close()
    pool = ExpertPool(g, size_classes(g), [6])
    try:
        queued = pool.warm([(0, 4), (1, 7), (0, 4), (1, 6), (0, 0), (1, 1), (1, 2), (0, 5)])  # (0, 4) twice
        assert queued == 6 and pool.stats.warm_reads == 6  # one slot short of the last
        pool.drain()
        assert [s.key for s in pool.slots[0]] == [(0, 4), (1, 7), (1, 6), (0, 0), (1, 1), (1, 2)]
        slots = pool.acquire(1, [7])
        assert np.array_equal(pool.slot_view(1, slots[0], "ffn_up_exps"),
                              g.tensor("blk.1.ffn_up_exps.weight").raw[7])
        pool.release(1, [7])
        s = pool.stats
        assert (s.hits, s.prefetch_hits, s.demand_misses, s.prefetches) == (1, 0, 0, 0)
    finally:
        pool.close()


def test_a_second_load_reads_the_first_ones_experts_first(tmp_path):
    """Generate with a streamed model and close it: its counts are kept; the next load of the
    same file reads them into its slots first, so the same generation misses less, with the
    same tokens (prediction off: its prefetches, timed, would move the counts)."""
    path = fixture_path(MOE)
    prompt = np.load(str(path).replace(".gguf", ".ref.npz"))["tokens"][:8].astype(np.int64)

    def run(warm_dir):
        m = onebit.load(path, slots=6, budget="1GiB", backend="numpy", predict="off", warm_dir=warm_dir)
        try:
            toks = [r.token for r in m.generate(prompt, max_tokens=12, lookup=0)]
            return toks, m.pool.stats
        finally:
            m.close()

    base, cold = run(None)
    assert not os.listdir(tmp_path)
    first, st1 = run(str(tmp_path))
    assert first == base and st1.warm_reads == 0
    kept = list(tmp_path.iterdir())
    assert len(kept) == 1 and kept[0].suffix == ".npy"
    second, st2 = run(str(tmp_path))
    assert second == base
    assert st2.warm_reads > 0
    assert st2.demand_misses < st1.demand_misses == cold.demand_misses
