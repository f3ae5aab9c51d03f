"""`onebit info` and `onebit bench`."""

from __future__ import annotations

import json
import subprocess
import sys

import gguf
import pytest

from conftest import fixture_path


def run(*args):
    return subprocess.run([sys.executable, "-m", "onebit.cli.main", *args], capture_output=True, text=True, timeout=300)


def test_info_counts_parameters_like_gguf():
    path = fixture_path("qwen2moe-f32.gguf")
    r = run("info", str(path), "--json")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    reader = gguf.GGUFReader(str(path))
    total = sum(int(t.n_elements) for t in reader.tensors)
    experts = sum(int(t.n_elements) for t in reader.tensors if "_exps." in t.name)
    assert info["parameters"] == total
    assert info["active_parameters"] == total - experts + experts * 2 // 8  # top-2 of 8
    assert info["architecture"] == "qwen2moe" and info["experts"] == 8 and info["experts_used"] == 2
    assert info["shared_expert_hidden_dim"] == 64 and info["chat_template"] is True
    assert info["types"]["F32"]["bytes"] == sum(int(t.n_bytes) for t in reader.tensors)
    text = run("info", str(path))
    assert text.returncode == 0 and "qwen2moe" in text.stdout and "active per token" in text.stdout


def test_info_types_of_a_quantized_file():
    info = json.loads(run("info", str(fixture_path("q3moe256-Q4_K_M.gguf")), "--json").stdout)
    assert set(info["types"]) == {"Q4_K", "Q6_K", "F32"}


@pytest.mark.kernels_of(fixture_path("qwen3moe-f32.gguf"))  # (for the `onebit bench` it starts)
def test_bench_json():
    r = run("bench", str(fixture_path("qwen3moe-f32.gguf")), "--prompt-tokens", "16", "--gen-tokens", "4",
            "--runs", "2", "--json")
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert res["prompt_tokens"] == 16 and res["gen_tokens"] == 4 and len(res["decode_tps_runs"]) == 2
    assert res["prompt_tps"] > 0 and res["decode_tps"] > 0
    assert res["lookup"]["max_drafts"] == 0  # bench times plain decoding unless --lookup asks
    if res["backend"] == "cpu":  # what its kernels were compiled for (tests/test_cpu_target.py: the targets)
        assert res["cpu_target"]["cpu"].startswith("host (") and "sse4.2" in res["cpu_target"]["isa"]


def test_info_missing_file():
    r = run("info", "/no/such.gguf")
    assert r.returncode == 2 and r.stderr.startswith("onebit: error:") and "Traceback" not in r.stderr


def test_bench_runs_one_uncounted_warmup_first(monkeypatch):
    """run_bench times `runs` runs after one it does not count (as llama-bench's warm-up); without
    `warmup` it times every prompt it feeds."""
    import onebit
    from onebit.apps.bench import run_bench

    m = onebit.load(fixture_path("qwen3moe-f32.gguf"), backend="numpy")
    prompts = []
    forward = m.net.forward

    def counted(ids, cache, **kw):
        if len(ids) > 1:
            prompts.append(len(ids))
        return forward(ids, cache, **kw)

    monkeypatch.setattr(m.net, "forward", counted)
    res = run_bench(m, 8, 2, 2)
    assert prompts == [8, 8, 8] and len(res["prompt_tps_runs"]) == 2 and len(res["decode_tps_runs"]) == 2
    prompts.clear()
    res = run_bench(m, 8, 2, 2, warmup=False)
    assert prompts == [8, 8] and len(res["prompt_tps_runs"]) == 2
