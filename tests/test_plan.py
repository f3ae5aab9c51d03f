"""Memory plan arithmetic against hand-computed bytes, and `onebit plan` exit codes."""

from __future__ import annotations

import json
import subprocess
import sys

import gguf
import pytest

from conftest import fixture_path
from onebit.backends.cpu import int_dots
from onebit.backends.cpu import CpuBackend
from onebit.backends.numpy_backend import NumpyBackend
from onebit.errors import UsageError
from onebit.formats.gguf_file import GGUFFile
from onebit.memory.budget import Budget, parse_size
from onebit.memory.plan import make_plan, parse_layers
from onebit.models import network_class

Q4K = "q3moe256-Q4_K_M.gguf"


def load(name):
    g = GGUFFile(fixture_path(name))
    return g, network_class(g.architecture, g.path).config(g)


def budget(n):
    return Budget(n, "test", available=n)


def test_parse_layers_and_sizes():
    assert parse_layers("1,2,5-7,0", 8) == [0, 1, 2, 5, 6, 7]
    assert parse_layers("", 8) == []
    for bad in ("1-", "a", "3-1", "8", "1,,2"):
        with pytest.raises(UsageError):
            parse_layers(bad, 8)
    assert parse_size("12GiB") == 12 << 30 and parse_size("512 MiB") == 512 << 20 and parse_size("1.5GB") == 1_500_000_000
    for bad in ("12XB", "", "-1G", "GiB"):
        with pytest.raises(UsageError):
            parse_size(bad)


@pytest.mark.skipif(not int_dots.VNNI, reason="the cpu backend's X16 layouts are AVX-512 VNNI's")
def test_plan_bytes_match_hand_computation():
    g, cfg = load(Q4K)
    # (the layouts asked for on this small file: by default a file under X16_FROM keeps its rows)
    p = make_plan(g, cfg, budget(1 << 30), ctx=256, layers="0-1", verify_rows=8,
                  policy=CpuBackend.memory_policy(g, repack_from=0))
    items = {i.component: i.bytes for i in p.items}
    # Resident = every tensor but the expert parts, sized by gguf's own reader.
    r = gguf.GGUFReader(str(fixture_path(Q4K)))
    resident = sum(int(t.n_bytes) for t in r.tensors if "_exps." not in t.name)
    # The cpu kernels hold [N, K] Q4_K matrices (N of 16 or more; not the token embedding)
    # 16 rows to a group with their scales decoded: 64 bytes more per 16 x 144 (quants.X16_BLOCK).
    repacked = sum(int(t.n_bytes) for t in r.tensors if "_exps." not in t.name and t.tensor_type.name == "Q4_K"
                   and len(t.shape) == 2 and int(t.shape[1]) >= 16 and not t.name.startswith("token_embd"))
    assert repacked > 0
    assert items["resident weights"] == resident + repacked * 64 // (16 * 144)
    on_numpy = make_plan(g, cfg, budget(1 << 30), ctx=256, layers="0-1", verify_rows=8,
                         policy=NumpyBackend.memory_policy(g))
    assert next(i.bytes for i in on_numpy.items if i.component == "resident weights") == resident
    by_default = make_plan(g, cfg, budget(1 << 30), ctx=256, layers="0-1", verify_rows=8,
                           policy=CpuBackend.memory_policy(g))  # (under X16_FROM: as the file has them)
    assert next(i.bytes for i in by_default.items if i.component == "resident weights") == resident
    # KV: 2 layers x 256 positions x 2 kv heads x (64 + 64) x 4 bytes.
    assert items["KV cache"] == 2 * 256 * 2 * 128 * 4
    # Experts: 256x256 matrices; Q4_K is 144 bytes per 256 weights (148 as the cpu backend holds
    # them, 16 rows to a group as above: 256 rows), Q6_K 210.
    q4k, q6k = 256 * 148, 256 * 210
    classes = sorted((c.expert_bytes, c.types, c.layers) for c in p.classes)
    assert classes == sorted([(3 * q4k, ("Q4_K",) * 3, (0,)), (2 * q4k + q6k, ("Q4_K", "Q4_K", "Q6_K"), (1,))])
    assert p.all_experts == 8 and p.min_slots == 4
    assert sum(p.slots) == 8 and not p.streaming  # a 1 GiB budget holds every expert
    assert items["expert slots"] == 4 * 3 * q4k + 4 * (2 * q4k + q6k)
    in_file = sorted(c.expert_bytes for c in on_numpy.classes)
    assert in_file == sorted([3 * 256 * 144, 2 * 256 * 144 + q6k])
    assert p.total == sum(items.values()) and p.fits


def test_auto_slots_fill_what_is_left():
    g, cfg = load(Q4K)
    full = make_plan(g, cfg, budget(1 << 30), ctx=256)
    fixed = full.total - next(i.bytes for i in full.items if i.component == "expert slots")
    one_class = min(c.expert_bytes for c in full.classes)
    p = make_plan(g, cfg, budget(fixed + 2 * 3 * 256 * 144 + 2 * (2 * 256 * 144 + 256 * 210) + one_class // 2), ctx=256)
    assert sum(p.slots) == 4 and p.streaming and p.fits  # the minimum: top-2 in each class
    tiny = make_plan(g, cfg, budget(fixed // 2), ctx=256)
    assert not tiny.fits and tiny.advice


def test_slots_below_minimum_and_bad_ctx():
    g, cfg = load(Q4K)
    with pytest.raises(UsageError, match="minimum of 4"):
        make_plan(g, cfg, budget(1 << 30), slots=3)
    with pytest.raises(UsageError, match="--ctx"):
        make_plan(g, cfg, budget(1 << 30), ctx=10**9)
    p = make_plan(g, cfg, budget(1 << 30), slots=6)
    assert sum(p.slots) == 6 and p.streaming


def test_dense_model_has_no_slots():
    g, cfg = load("qwen3-f32.gguf")
    p = make_plan(g, cfg, budget(1 << 30))
    assert p.slots == [] and not p.streaming and p.fits


def run_plan(*args):
    return subprocess.run([sys.executable, "-m", "onebit.cli.main", "plan", *args], capture_output=True, text=True,
                          timeout=120)


def test_cli_exit_codes():
    m = str(fixture_path(Q4K))
    ok = run_plan(m, "--ctx", "256", "--budget", "320MiB", "--json")  # (the runtime's 256 MiB counted)
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["fits"] is True
    no = run_plan(m, "--ctx", "256", "--budget", "1MiB")
    assert no.returncode == 1 and "DOES NOT FIT" in no.stdout
    for bad in (["--layers", "0-9"], ["--slots", "1"], ["--budget", "lots"], ["--ctx", "0"]):
        r = run_plan(m, *bad)
        assert r.returncode == 2 and r.stderr.count("\n") == 1, (bad, r.stderr)


def test_budget_detection_takes_the_smallest_source():
    from onebit.memory.budget import detect_budget

    b = detect_budget(reserve="1GiB", device_heap=1 << 20, max_allocation=1 << 19, max_storage_range=1 << 18)
    assert b.bytes == 1 << 20 and b.source == "Vulkan device heap" and b.max_allocation == 1 << 19
    big = detect_budget(reserve="0", device_heap=1 << 60)
    assert big.bytes <= big.available and "available memory" in big.source
    assert detect_budget("3GiB").bytes == 3 << 30


def test_plan_with_vulkan_limits():
    r = run_plan(str(fixture_path(Q4K)), "--backend", "vulkan", "--ctx", "256", "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["device_heap_bytes"] > 0 and d["max_storage_range_bytes"] > 0
