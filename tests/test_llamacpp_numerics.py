"""tests/llamacpp_numerics.py's model of llama.cpp CPU's activation rounding, against llama.cpp.

The reference (tests/fixtures/llamacpp-rounding.npz) is made by tools/make_rounding_ref.py, which
calls the built libggml-cpu's own from_float (Q8_0, Q8_K) and vec_dot through ctypes. The oracle
tests and tools/sweep_quants.py explain quantized files' differences from llama.cpp with this
model, so it has to be llama.cpp's rounding to the bit.
"""

from __future__ import annotations

import numpy as np
import pytest

from conftest import fixture_path
from llamacpp_numerics import q8_1_correction, round_activation
from onebit.formats.quants import QTYPES

REF = np.load(fixture_path("llamacpp-rounding.npz"))
BY_NAME = {q.name: q for q in QTYPES.values()}
WEIGHTS = sorted(k[2:] for k in REF.files if k.startswith("w_"))


@pytest.mark.parametrize("act,weight", [("Q8_0", "Q4_0"), ("Q8_K", "Q4_K"), ("F16", "F16"), ("BF16", "BF16")])
def test_rounding_is_llama_cpp_from_float(act, weight):
    got = round_activation(REF["x"], BY_NAME[weight].type_id)
    np.testing.assert_array_equal(got, REF[f"rounded_{act}"])


@pytest.mark.parametrize("weight", WEIGHTS)
def test_rounded_dot_is_llama_cpp_vec_dot(weight):
    """round_activation(x) . our decoded weight row (+ the Q8_1 block-sum term) == llama.cpp's
    vec_dot, up to float32 summation order."""
    q = BY_NAME[weight]
    raw = REF[f"w_{weight}"]
    w = q.dequantize(raw).astype(np.float64)  # [256]
    xr = round_activation(REF["x"], q.type_id).astype(np.float64)
    ours = xr @ w
    corr = q8_1_correction(REF["x"], raw[None], q.type_id)
    if corr is not None:
        ours = ours + corr[:, 0]
    scale = np.abs(xr) @ np.abs(w)
    err = np.abs(ours - REF[f"dot_{weight}"])
    assert np.all(err <= 2e-6 * scale), (weight, err / scale)


def test_gelu_is_llama_cpp_f16_table():
    """llama.cpp's CPU GELU (Gemma's GeGLU) reads an f16 table at f16(x) (GGML_GELU_FP16):
    llamacpp_numerics.gelu_f16_table is that table, to the bit."""
    from llamacpp_numerics import gelu_f16_table
    from onebit.backends.numpy_backend import NumpyBackend

    x, want = REF["gelu_x"], REF["gelu"]
    np.testing.assert_array_equal(gelu_f16_table(x), want)
    assert (NumpyBackend.gelu_tanh(x) == want).mean() < 0.5  # the plain f32 GELU is not it
