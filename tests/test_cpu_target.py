"""The cpu kernels' compile target (backends/cpu/target.py): the AVX2 target's kernels, compiled on
this machine whatever its CPU, hold no AVX-512 instruction and match the numpy reference; the
command line names the target and reports it.

The AVX2 check compiles a subset in CI (tests/cpu_target_check.py: the kernels of a Q4_K_M MoE
fixture, Q4_K, Q6_K and F32, with the small ops and the expert kernel; the dense products of
Q8_0, Q4_1, Q5_K, MXFP4 and IQ2_XXS): about 55 s on the 2-core VM. Every type's kernels:
`python tests/cpu_target_check.py --all` under the same environment (minutes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import fixture_path
from cpu_target_check import avx512_in_asm
from onebit.backends.cpu import target
from onebit.errors import UsageError

HERE = os.path.dirname(os.path.abspath(__file__))
LOGIT_TOL, FLOAT_TOL, ACT_TOL = 1e-4, 2e-5, 1.5e-4  # as tests/test_cpu_backend.py's


def avx2_env(cache) -> dict:
    env = dict(os.environ, NUMBA_CPU_NAME="haswell", NUMBA_CPU_FEATURES=target.AVX2_FEATURES,
               NUMBA_CACHE_DIR=str(cache))
    env.pop("ONEBIT_CPU_TARGET", None)
    return env


def test_the_scanner_sees_avx512_and_passes_avx2():
    """avx512_in_asm on lines written by hand: each EVEX-only form caught, AVX2 code passed."""
    evex = ["vpdpbusd\t%zmm1, %zmm2, %zmm3", "vaddps\t%ymm17, %ymm1, %ymm2", "kmovw\t%k1, %eax",
            "vpaddd\t%ymm1, %ymm2, %ymm3 {%k1}", "vmovdqu64\t(%rdi), %ymm0", "vpternlogd\t$150, %ymm1, %ymm2, %ymm3",
            "vpmovdb\t%ymm0, %xmm1", "vpermt2d\t%ymm1, %ymm2, %ymm3", "vcvttps2udq\t%ymm0, %ymm1",
            "vpdpbusd\t%ymm1, %ymm2, %ymm3", "vbroadcastss\t(%rax){1to8}, %ymm0", "vpsravw\t%ymm1, %ymm2, %ymm3",
            "vpcompressd\t%ymm0, (%rdi)", "vpmullq\t%ymm1, %ymm2, %ymm3", "vmovaps\t%ymm0, %ymm1 {%k1} {z}"]
    avx2 = ["vperm2i128\t$33, %ymm13, %ymm12, %ymm4", "vpmaddwd\t%ymm1, %ymm2, %ymm3", "vpcmpeqb\t%ymm1, %ymm2, %ymm3",
            "vcvtps2ph\t$4, %ymm0, %xmm1", "vpbroadcastd\t(%rax), %ymm0", "vfmadd231ps\t%ymm1, %ymm2, %ymm3",
            "vpermd\t%ymm1, %ymm2, %ymm3", "vpshufb\t%ymm1, %ymm2, %ymm3", "vmovdqu\t(%rdi), %ymm15",
            "kernel_loop:", ".p2align 4", "vpblendvb\t%ymm1, %ymm2, %ymm3, %ymm4", "vpsllvd\t%ymm1, %ymm2, %ymm3",
            "vcvttps2dq\t%ymm0, %ymm1", "vextracti128\t$1, %ymm0, %xmm1", "vpmovmskb\t%ymm0, %eax"]
    for line in evex:
        assert avx512_in_asm(f"\t{line}\n") == [line], line
    assert avx512_in_asm("\n".join(f"\t{line}" for line in avx2)) == []


def test_avx2_kernels_hold_no_avx512_and_match_numpy(tmp_path):
    """Kernels compiled for the AVX2 target (NUMBA_CPU_NAME=haswell and its features) in a process
    of their own with a fresh kernel cache: numba's assembly of every kernel compiled holds no
    AVX-512 instruction, the kernels say so (cpu_target, no VNNI path), and their outputs match
    the numpy reference (a model's logits, the dense products of more types)."""
    r = subprocess.run([sys.executable, os.path.join(HERE, "cpu_target_check.py")], env=avx2_env(tmp_path / "cache"),
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-4000:]
    report = json.loads(r.stdout)
    assert report["target"] == {"cpu": "haswell", "isa": ["sse4.2", "avx", "avx2", "fma", "f16c"]}
    assert report["vnni"] is False
    assert report["eo_copy"] is True
    names = {k["name"].split("__")[0] for k in report["kernels"]}
    assert {"matmul", "matmul_serial", "matmul3", "get_rows", "expert_ffn", "rms_norm", "rope", "attention",
            "route", "routed_rows"} <= names
    for k in report["kernels"]:
        assert k["chars"] > 10000, f"{k['name']}: no assembly (loaded from a cache, not compiled here)"
        assert k["avx512"] == [], f"{k['name']} {k['sig']}: {k['avx512']}"
    errors = report["errors"]
    assert errors.pop("model logits") < LOGIT_TOL
    assert len(errors) >= 6
    for what, err in errors.items():
        name = what.split()[0]
        assert err < (ACT_TOL if name in report["int_types"] else FLOAT_TOL), (what, err)


def run(*args, env=None):
    return subprocess.run([sys.executable, "-m", "onebit.cli.main", *args], capture_output=True, text=True,
                          timeout=300, env=env)


def test_info_reports_the_target_the_command_line_names():
    path = str(fixture_path("qwen3moe-f32.gguf"))
    env = dict(os.environ)
    env.pop("ONEBIT_CPU_TARGET", None)
    native = json.loads(run("info", path, "--json", env=env).stdout)["cpu_target"]
    assert native["cpu"].startswith("host (") and "sse4.2" in native["isa"]
    avx2 = json.loads(run("--cpu-target", "avx2", "info", path, "--json", env=env).stdout)["cpu_target"]
    assert avx2 == {"cpu": "haswell", "isa": ["sse4.2", "avx", "avx2", "fma", "f16c"]}
    env["ONEBIT_CPU_TARGET"] = "avx2"
    assert json.loads(run("info", path, "--json", env=env).stdout)["cpu_target"] == avx2
    assert "cpu target      haswell: sse4.2 avx avx2 fma f16c" in run("info", path, env=env).stdout
    bad = run("--cpu-target", "avx3", "info", path)
    assert bad.returncode == 2 and "the targets are native, avx2" in bad.stderr and "Traceback" not in bad.stderr


def test_a_target_cannot_change_once_kernels_are_made():
    """numba fixes its code generator when the first kernel is made: a later target is refused."""
    from onebit.backends.cpu import kernels  # noqa: F401  (the kernels of this process: the host's target)
    from numba.core import config

    before = (config.CPU_NAME, config.CPU_FEATURES)
    if before == target.TARGETS["avx2"]:
        pytest.skip("this process compiles for the avx2 target already")
    with pytest.raises(UsageError, match="already made"):
        target.use("avx2")
    assert (config.CPU_NAME, config.CPU_FEATURES) == before
