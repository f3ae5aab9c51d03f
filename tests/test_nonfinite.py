"""NaN / inf in a forward pass stop generation with one error naming where they first appeared
(instead of sampling token 0), on every backend; numpy's RuntimeWarnings never reach the user."""

from __future__ import annotations

import numpy as np
import pytest

import onebit
from conftest import fixture_path
from ggufedit import rewrite
from onebit.errors import NonFiniteError
from test_cli import assert_one_line_error, onebit as run_cli

QWEN3MOE = fixture_path("qwen3moe-f32.gguf")


def _poison(tmp_path, tensor: str, value: float, where=None, src=QWEN3MOE):
    """A copy of src with `value` written into tensor (everywhere, or at index `where`)."""

    def fn(name, a, q):
        if name != tensor:
            return None
        a = a.copy()
        if where is None:
            a[...] = value
        else:
            a[where] = value
        return a, q

    return rewrite(src, tmp_path / "bad.gguf", tensor_fn=fn)


def _generate(m, ids=(1, 2, 3), n=3):
    return [r.token for r in m.generate(list(ids), max_tokens=n)]


@pytest.mark.parametrize("tensor,value,layer,cause", [
    ("blk.1.attn_q.weight", np.nan, "layer 1 (linear blk.1.attn_q.weight)", "holds NaN/inf"),
    ("blk.0.attn_norm.weight", np.inf, "layer 0 (norm blk.0.attn_norm.weight)", "holds NaN/inf"),
    ("blk.0.ffn_norm.weight", 3e38, "layer 0 (norm blk.0.ffn_norm.weight)", "overflowed float32"),
    ("blk.1.ffn_down_exps.weight", np.nan, "layer 1 (experts)", "'blk.1.ffn_down_exps.weight' (expert "),
    ("output.weight", np.nan, "the output head (linear output.weight)", "holds NaN/inf"),
])
def test_nonfinite_logits_name_the_first_bad_layer(tmp_path, tensor, value, layer, cause):
    m = onebit.load(_poison(tmp_path, tensor, value), backend="cpu")
    with pytest.raises(NonFiniteError) as e:
        _generate(m)
    msg = str(e.value)
    assert str(m.path) in msg and "non-finite" in msg and layer in msg and cause in msg, msg


def test_nonfinite_at_a_decode_step_is_caught_there(tmp_path):
    """Token 7's embedding row is NaN: the prompt runs, the step that feeds token 7 stops, and the
    re-run starts from the cache as it was (earlier positions' keys and values)."""
    m = onebit.load(_poison(tmp_path, "token_embd.weight", np.nan, where=7), backend="cpu")
    cache = m.new_cache()
    assert np.isfinite(m.net.forward(np.array([1, 2, 3]), cache)).all()
    with pytest.raises(NonFiniteError, match=r"the token embedding \(embed token_embd.weight\)"):
        m.net.forward(np.array([7]), cache)


def test_streamed_experts_nonfinite(tmp_path):
    m = onebit.load(_poison(tmp_path, "blk.1.ffn_gate_exps.weight", np.nan), slots=2, budget="1GiB", backend="cpu")
    assert m.pool is not None
    try:
        with pytest.raises(NonFiniteError, match=r"layer 1 \(experts\)"):
            _generate(m)
    finally:
        m.close()


def test_vulkan_nonfinite_names_the_layer_via_a_numpy_rerun(tmp_path, monkeypatch):
    from onebit.backends import BACKENDS
    from onebit.backends.vulkan.backend import VulkanBackend

    monkeypatch.setitem(BACKENDS, "vulkan", VulkanBackend)  # no silent fall back to numpy
    m = onebit.load(_poison(tmp_path, "token_embd.weight", np.nan, where=7), backend="vulkan")
    assert m.be.name == "vulkan"
    cache = m.new_cache()
    assert np.isfinite(m.net.forward(np.array([1, 2, 3]), cache)).all()
    with pytest.raises(NonFiniteError, match=r"vulkan backend, first in the token embedding"):
        m.net.forward(np.array([7]), cache)
    p = _poison(tmp_path, "blk.1.attn_q.weight", np.nan, where=(3, 5))
    m = onebit.load(p, backend="vulkan")
    with pytest.raises(NonFiniteError, match=r"layer 1 \(linear blk.1.attn_q.weight\)"):
        _generate(m)


def _routed_first_not_last(m, rows: int) -> tuple[np.ndarray, int]:
    """A prompt of `rows` tokens and an expert of the last layer that its first row routes to
    and its 2nd, 3rd and last 4 rows do not (found with a routing hook on numpy)."""
    last = m.cfg.n_layers - 1
    rng = np.random.default_rng(5)
    for _ in range(200):
        ids = rng.integers(1, m.cfg.vocab_size, rows)
        seen = {}
        m.net.forward(ids, m.new_cache(), hook=lambda layer, e, _: seen.setdefault(layer, e))
        for e in seen[last][0]:
            if not any(e in seen[last][r] for r in (1, 2, *range(rows - 4, rows))):
                return ids, int(e)
    raise AssertionError("no such prompt in 200 tries")


@pytest.mark.parametrize("backend", ["numpy", "vulkan"])
def test_nonfinite_in_an_earlier_row_alone(tmp_path, monkeypatch, backend):
    """The first row's logits are NaN and the last rows' are not (an expert of the last layer
    that they do not route to is poisoned): forwards returning every row stop, also when that
    row is in an earlier chunk than the last (20 rows on Vulkan: 16 + 4); a forward returning
    the last row alone does not."""
    from onebit.backends import BACKENDS
    from onebit.backends.vulkan.backend import VulkanBackend

    ref = onebit.load(QWEN3MOE, backend="cpu")
    ids, e = _routed_first_not_last(ref, 20)
    p = _poison(tmp_path, f"blk.{ref.cfg.n_layers - 1}.ffn_down_exps.weight", np.nan, where=e)
    monkeypatch.setitem(BACKENDS, "vulkan", VulkanBackend)  # no silent fall back to numpy
    m = onebit.load(p, backend=backend)
    assert m.be.name == backend
    for rows in (3, 20):
        assert np.isfinite(m.net.forward(ids[:rows], m.new_cache(), last_only=True)).all()
        with pytest.raises(NonFiniteError, match="experts"):
            m.net.forward(ids[:rows], m.new_cache())


def test_valid_models_are_not_flagged():
    for name in ("qwen3moe-f32.gguf", "q3moe256-Q4_K_M.gguf"):
        m = onebit.load(fixture_path(name), backend="cpu")
        assert len(_generate(m, n=4)) >= 1


def test_command_line_overflow_is_one_line_without_runtime_warnings(tmp_path):
    """Was: numpy RuntimeWarnings on stderr, then token 0 sampled from NaN logits, exit 0."""
    p = _poison(tmp_path, "blk.0.ffn_norm.weight", 3e38)
    r = run_cli("generate", "--model", str(p), "--prompt", "hello", "--max-tokens", "3", "--raw")
    line = assert_one_line_error(r, code=1)
    assert "RuntimeWarning" not in r.stderr and "layer 0" in line and str(p) in line
