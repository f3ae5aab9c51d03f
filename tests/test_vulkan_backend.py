"""VulkanBackend == NumpyBackend on the fixtures: logits within tolerance, greedy tokens identical.

Invariant 2 of docs/DESIGN.md. Every architecture (f32 fixtures) and every quant type (the
q3moe256 files, which mix types the way llama-quantize does) runs the whole forward pass on
lavapipe: prefill (tiled mat-mat) and one-token decode steps (mat-vec).
"""

from __future__ import annotations

import numpy as np
import pytest

import onebit
from conftest import fixture_path, greedy_tokens
from onebit.backends import BACKENDS
from onebit.backends.vulkan.backend import VulkanBackend

ARCH = ["qwen3moe-f32", "qwen2moe-f32", "olmoe-f32", "llama-f32", "mixtral-f32", "qwen2-f32", "qwen3-f32",
        "llama3rope-f32", "gemma3-f32"]
QUANT = ["q3moe256-" + t for t in ("F16", "BF16", "Q8_0", "Q4_0", "Q4_K_M", "Q5_K_M", "Q6_K", "MXFP4_MOE",
                                   "Q1_0", "TQ1_0", "TQ2_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "IQ1_S", "IQ1_M",
                                   "IQ2_XXS", "IQ2_XS", "IQ3_XXS", "IQ3_S", "IQ4_NL", "IQ4_XS")]
# Both backends dequantize to the same float32 weights; only float32 summation order differs.
LOGIT_TOL = 1e-4


@pytest.fixture(autouse=True)
def vulkan_registered(monkeypatch):
    monkeypatch.setitem(BACKENDS, "vulkan", VulkanBackend)



@pytest.mark.parametrize("name", ARCH + QUANT)
def test_vulkan_matches_numpy(name):
    path = fixture_path(f"{name}.gguf")
    ids = np.load(fixture_path(f"{name}.ref.npz"))["tokens"][:12].astype(np.int64)
    ref, vk = onebit.load(path, backend="numpy"), onebit.load(path, backend="vulkan")
    assert isinstance(vk.be, VulkanBackend) and vk.be.tensors  # the weights really are on the device
    # every matrix runs in its own type's shaders (none dequantized to F32 at load)
    moved = {n: (t.type_name, vk.be.tensors[n].type_name) for n, t in vk.gguf.tensors.items()
             if n in vk.be.tensors and vk.be.tensors[n].type_name != t.type_name}
    assert not moved, moved
    want, got = ref.logits(ids), vk.logits(ids)
    np.testing.assert_allclose(got, want, rtol=0, atol=LOGIT_TOL * np.abs(want).max())
    assert greedy_tokens(vk, ids[:6], 6) == greedy_tokens(ref, ids[:6], 6)
