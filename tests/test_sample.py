"""Samplers and stop-string handling."""

from __future__ import annotations

import numpy as np
import pytest

from onebit.errors import UsageError
from onebit.generate import _stop_cut
from onebit.sample import make_logits_processors, make_sampler

LOGITS = np.log(np.array([0.1, 0.5, 0.3, 0.05, 0.05], np.float32))


def test_greedy_is_argmax():
    assert make_sampler(0.0)(LOGITS) == 1


def test_temperature_one_draws_the_softmax_distribution():
    s = make_sampler(1.0, seed=0)
    counts = np.bincount([s(LOGITS) for _ in range(4000)], minlength=5) / 4000
    np.testing.assert_allclose(counts, [0.1, 0.5, 0.3, 0.05, 0.05], atol=0.03)


def _draws(n=300, **kw):
    s = make_sampler(**kw)
    return [s(LOGITS) for _ in range(n)]


def test_seed_makes_draws_reproducible():
    assert _draws(50, temp=0.8, seed=7) == _draws(50, temp=0.8, seed=7)
    assert _draws(50, temp=0.8, seed=7) != _draws(50, temp=0.8, seed=8)


def test_top_k_top_p_min_p_filter():
    assert set(_draws(temp=1.0, top_k=2, seed=0)) == {1, 2}
    # top-p 0.75: 0.5 + 0.3 reaches it, so tokens 1 and 2 only
    assert set(_draws(temp=1.0, top_p=0.75, seed=0)) == {1, 2}
    # min-p 0.25 of the best (0.5) keeps p >= 0.125: tokens 1 and 2
    assert set(_draws(temp=1.0, min_p=0.25, seed=0)) == {1, 2}
    assert set(_draws(temp=1.0, top_p=0.4, seed=0)) == {1}
    assert set(_draws(temp=1.0, seed=0)) == {0, 1, 2, 3, 4}


@pytest.mark.parametrize("kw", [dict(temp=-1.0), dict(temp=1.0, top_p=0.0), dict(temp=1.0, min_p=2.0),
                                dict(temp=1.0, top_k=-1)])
def test_bad_settings_are_usage_errors(kw):
    with pytest.raises(UsageError):
        make_sampler(**kw)


def test_repetition_penalty():
    (proc,) = make_logits_processors(2.0)
    logits = np.array([1.0, -1.0, 2.0, 0.5], np.float32)
    out = proc([0, 1, 1], logits)
    np.testing.assert_allclose(out, [0.5, -2.0, 2.0, 0.5])
    assert make_logits_processors(1.0) == []


def test_stop_cut():
    assert _stop_cut("hello wor", ["world"]) == (6, False)  # hold back "wor"
    assert _stop_cut("hello world!", ["world"]) == (6, True)
    assert _stop_cut("abc", []) == (3, False)
    assert _stop_cut("a</s", ["</s>", "xx"]) == (1, False)
