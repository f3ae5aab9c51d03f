"""Invariant 1: our logits match independent implementations on the same weights.

References were recorded by tools/make_fixtures.py: HF transformers (f32 files) and
llama.cpp's CPU backend (every file), teacher-forced at every position.
"""

from __future__ import annotations

import numpy as np
import pytest

import onebit
from conftest import FIXTURES, cosine_rows

REFS = sorted(FIXTURES.glob("*.ref.npz"))
HF_REFS = [p for p in REFS if "logits_hf" in np.load(p).files]


def test_fixtures_present():
    assert len(REFS) >= 30, "oracle fixtures missing: run tools/make_fixtures.py"
    arches = {onebit.load(p.with_name(p.name.replace(".ref.npz", ".gguf")), backend="cpu").cfg.arch for p in HF_REFS}
    assert arches == {"qwen3moe", "qwen2moe", "olmoe", "llama", "qwen2", "qwen3", "gemma3", "gpt-oss", "glm4moe",
                      "qwen3next", "qwen35moe"}


# The reference backend and the cpu backend (numba kernels: same decoded weights, float32
# activations; within 2e-5 of numpy, tests/test_cpu_backend.py) are held to the same bars.
BACKENDS = ["numpy", "cpu"]


def _run(ref_path, backend="numpy"):
    model = onebit.load(ref_path.with_name(ref_path.name.replace(".ref.npz", ".gguf")), backend=backend)
    ref = np.load(ref_path)
    tokens = ref["tokens"].astype(np.int64)
    margins = []  # per position: smallest gap, over MoE layers, between the k-th and (k+1)-th router logit

    def hook(layer, ids, logits):
        k = model.cfg.n_experts_used
        top = -np.sort(-logits, axis=-1)
        margins.append(top[:, k - 1] - top[:, k] if k < logits.shape[1] else np.full(len(logits), np.inf))

    logits = model.net.forward(tokens, model.new_cache(), hook=hook)
    margin = np.min(margins, axis=0) if margins else np.full(len(tokens), np.inf)
    return model, ref, logits, margin


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("ref_path", HF_REFS, ids=lambda p: p.name.replace(".ref.npz", ""))
def test_f32_matches_transformers(ref_path, backend):
    model, ref, logits, margin = _run(ref_path, backend)
    hf = ref["logits_hf"]
    assert logits.shape == hf.shape
    cos = cosine_rows(logits, hf)
    maxdiff = np.abs(logits - hf).max(axis=1)
    ok = (cos >= 0.99999) & (maxdiff <= 1e-2)
    bad = np.nonzero(~ok)[0]
    detail = ", ".join(f"pos {i}: cos {cos[i]:.6f} maxdiff {maxdiff[i]:.3g} router margin {margin[i]:.2e}" for i in bad)
    assert ok.mean() >= 0.97, f"{ref_path.name}: {len(bad)}/{len(ok)} positions outside the bar: {detail}"


# Measured: at 48 positions these fall 1-2 positions short of the bar (cosines 0.988-0.9989 at
# 3-4 positions). test_quantized_difference_is_llama_cpp_activation_rounding shows the cause:
# llama.cpp rounds activations to Q8_K for these types; modelling that gives cosine >= 0.9999.
# The same holds for four of the IQ files (3-17 positions; IQ types are dotted against Q8_K
# activations too): q3moe256-IQ1_S, -IQ2_XXS, -IQ3_XXS, -IQ4_XS.
BELOW_BAR = {"q3moe256-Q5_K_M", "q3moe256-TQ1_0", "q3moe256-TQ2_0", "q3moe256-IQ1_S", "q3moe256-IQ2_XXS",
             "q3moe256-IQ3_XXS", "q3moe256-IQ4_XS"}


# The random hybrid model is chaotic under rounding (see tests/test_hybrid.py, which holds this
# file to llama.cpp with its activation rounding modelled): measured 16/48 positions at cosine 0.999.
CHAOTIC = {"qwen3next-Q8_0"}


def _llama_param(p):
    name = p.name.replace(".ref.npz", "")
    if name in CHAOTIC:
        reason = "a random hybrid model: Q8 activation rounding alone moves cosines by up to 1e-3"
        return pytest.param(p, id=name, marks=pytest.mark.xfail(strict=True, reason=reason))
    if name in BELOW_BAR:
        reason = "llama.cpp's Q8_K activation rounding moves 3-17 of 48 positions below cosine 0.999"
        return pytest.param(p, id=name, marks=pytest.mark.xfail(strict=True, reason=reason))
    return pytest.param(p, id=name)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("ref_path", [_llama_param(p) for p in REFS])
def test_matches_llama_cpp(ref_path, backend):
    model, ref, logits, margin = _run(ref_path, backend)
    ll = ref["logits_llama"]
    assert logits.shape == ll.shape
    cos = cosine_rows(logits, ll)
    ok = cos >= 0.999
    bad = np.nonzero(~ok)[0]
    detail = ", ".join(f"pos {i}: cos {cos[i]:.5f} router margin {margin[i]:.2e}" for i in bad)
    assert ok.mean() >= 0.95, f"{ref_path.name}: {len(bad)}/{len(ok)} positions below cosine 0.999: {detail}"


# Files whose big matrices llama.cpp multiplies against Q8_K-rounded activations.
Q8K_REFS = [p for p in REFS if any(t in p.name for t in ("Q4_K", "Q5_K", "Q6_K", "TQ1_0", "TQ2_0", "Q2_K", "IQ1_S",
                                                         "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ3_XXS", "IQ3_S", "IQ4_XS"))]


@pytest.mark.parametrize("ref_path", Q8K_REFS, ids=lambda p: p.name.replace(".ref.npz", ""))
def test_quantized_difference_is_llama_cpp_activation_rounding(ref_path):
    """With llama.cpp's activation rounding modelled, quantized files agree far more closely:
    the weights we decode are the weights llama.cpp uses."""
    from llamacpp_numerics import LlamaCppRoundingBackend

    model = onebit.load(ref_path.with_name(ref_path.name.replace(".ref.npz", ".gguf")), backend="numpy")
    model.net.be = LlamaCppRoundingBackend(model.gguf)
    ref = np.load(ref_path)
    cos = cosine_rows(model.logits(ref["tokens"].astype(np.int64)), ref["logits_llama"])
    # (median 0.9995, not 0.9999: on a fresh Debian VM on 2026-12-02 (00e6b80) glm256-Q4_K_M gave a median of
    # 0.99984 at the code that had passed 0.9999 in CI before, so the last digit depends on the
    # machine's float sums; >= 0.999 on 95% of positions is the bar for quantized files)
    assert np.median(cos) >= 0.9995 and (cos >= 0.999).mean() >= 0.95, (np.median(cos), np.sort(cos)[:4])


DEQUANT_REFS = [p for p in REFS if "logits_hf_dequant" in np.load(p).files]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("ref_path", DEQUANT_REFS, ids=lambda p: p.name.replace(".ref.npz", ""))
def test_quantized_matches_transformers_on_dequantized_weights(ref_path, backend):
    """HF transformers run on the file's weights as dequantized by the gguf package: our f32
    forward over quantized weights must meet the f32 bar against it."""
    model, ref, logits, margin = _run(ref_path, backend)
    hf = ref["logits_hf_dequant"]
    cos = cosine_rows(logits, hf)
    maxdiff = np.abs(logits - hf).max(axis=1)
    ok = (cos >= 0.99999) & (maxdiff <= 1e-2)
    assert ok.mean() >= 0.97, [(i, cos[i], maxdiff[i], margin[i]) for i in np.nonzero(~ok)[0]]


# Each feature the llama3rope and gemma3 fixtures exist for, turned off: the oracle must notice
# (so the tests above prove the feature, not just the rest of the model).
FEATURES = [
    ("llama3rope-f32", dict(rope_factors=False)),  # rope_freqs.weight ignored
    ("gemma3-f32", dict(swa_layers=())),  # every layer global
    ("gemma3-f32", dict(rope_theta_swa=0.0)),  # local layers with the global RoPE base
    ("gemma3-f32", dict(rope_scale_swa=0.0)),  # ... and the global layers' linear scaling
    ("gemma3-f32", dict(embed_scale=1.0)),
    ("gemma3-f32", dict(final_logit_softcap=0.0)),
    ("gemma3-f32", dict(attn_scale=0.5)),  # a query scale other than 1/sqrt(head_dim)
]


@pytest.mark.parametrize("name,change", FEATURES, ids=lambda v: v if isinstance(v, str) else ",".join(map(str, v)))
def test_fixture_features_are_load_bearing(name, change):
    import dataclasses

    model = onebit.load(FIXTURES / f"{name}.gguf", backend="cpu")
    model.net.arch.cfg = model.cfg = dataclasses.replace(model.cfg, **change)
    ref = np.load(FIXTURES / f"{name}.ref.npz")
    cos = cosine_rows(model.logits(ref["tokens"].astype(np.int64)), ref["logits_hf"])
    assert (cos >= 0.99999).mean() < 0.5, f"{name} with {change}: still matches HF ({np.median(cos)})"
