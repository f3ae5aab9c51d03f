"""tools/make_synthetic_moe.py --routing trained: a small file whose routing, through the stock
forward pass and from a real prompt, has a trained model's locality; a random-router file of the
same shape has not (the same checks fail on it)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

import onebit
from onebit.moe.cachesim import load_trace
from onebit.moe.routing import layer_stats, summary
from onebit.moe.trace import TraceWriter

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
import make_synthetic_moe  # noqa: E402

PROMPT = "The history of the printing press begins in the workshops of goldsmiths and wine makers"
E, K = 32, 4  # tiny-qwen3moe's experts, top-k
RANDOM_REUSE, RANDOM_WINDOW = K / E, 1 - (1 - K / E) ** 8  # 0.125, 0.656


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("routing")
    out = {}
    for routing in ("trained", "random"):
        out[routing] = d / f"{routing}.gguf"
        make_synthetic_moe.main(["--like", "tiny-qwen3moe", "--routing", routing, "-o", str(out[routing])])
    return out


def generate(path: Path, trace: Path, n: int, **sampling) -> tuple[list[int], dict]:
    """n tokens from PROMPT on the numpy backend, with the trace's routing statistics."""
    m = onebit.load(path, backend="numpy")
    try:
        m.hook = TraceWriter(str(trace), str(path), m.cfg.n_layers, m.cfg.n_experts, m.cfg.n_experts_used)
        tokens = [r.token for r in m.generate(PROMPT, max_tokens=n, **sampling) if r.token is not None]
        m.hook.close()
    finally:
        m.close()
    return tokens, summary(layer_stats(load_trace(str(trace))))


def shortest_cycle(tokens: list[int], tail: int = 48, longest: int = 8) -> int:
    """The period (<= longest) that the last `tail` tokens repeat with, or 0."""
    t = tokens[-tail:]
    for p in range(1, longest + 1):
        if all(t[i] == t[i + p] for i in range(len(t) - p)):
            return p
    return 0


def trained_region(tokens: list[int], s: dict) -> list[str]:
    """What keeps a generation out of the trained region (empty: in it)."""
    why = []
    if s["reuse_prev"] < 2.5 * RANDOM_REUSE:
        why.append(f"reuse of the previous token's experts {s['reuse_prev']:.3f} < {2.5 * RANDOM_REUSE:.3f}")
    if s["reuse_window"] < RANDOM_WINDOW + 0.12:
        why.append(f"reuse within 8 tokens {s['reuse_window']:.3f} < {RANDOM_WINDOW + 0.12:.3f}")
    if shortest_cycle(tokens):
        why.append(f"the tokens end in a cycle of {shortest_cycle(tokens)}")
    if len(set(tokens)) < len(tokens) // 4:
        why.append(f"{len(set(tokens))} distinct tokens in {len(tokens)}")
    return why


def test_trained_routing_greedy_is_in_the_trained_region(files, tmp_path):
    tokens, s = generate(files["trained"], tmp_path / "t.jsonl", 96)
    assert len(tokens) == 96
    assert trained_region(tokens, s) == []


def test_trained_routing_sampled_is_in_the_trained_region(files, tmp_path):
    tokens, s = generate(files["trained"], tmp_path / "t.jsonl", 96, temperature=0.8, seed=1)
    assert trained_region(tokens, s) == []


def test_random_routers_are_not(files, tmp_path):
    """The same checks on random routers: reuse near k/E, so the checks can fail."""
    tokens, s = generate(files["random"], tmp_path / "t.jsonl", 96)
    assert s["reuse_prev"] == pytest.approx(RANDOM_REUSE, abs=0.06)
    assert trained_region(tokens, s)


def test_shortest_cycle():
    assert shortest_cycle([5, 1, 2, 3] * 20) == 4
    assert shortest_cycle([7] * 60) == 1
    assert shortest_cycle(list(np.random.default_rng(0).integers(0, 100, 200))) == 0
