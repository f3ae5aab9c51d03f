"""Samplers are closures over their settings: logits [vocab] -> token id."""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import numpy as np

from .errors import UsageError

Sampler = Callable[[np.ndarray], int]
LogitsProcessor = Callable[[Sequence[int], np.ndarray], np.ndarray]


def make_sampler(
    temp: float = 0.0, top_p: float = 1.0, min_p: float = 0.0, top_k: int = 0, seed: Optional[int] = None
) -> Sampler:
    """Greedy at temp 0; otherwise top-k, then top-p, then min-p filtering, then a draw."""
    if not np.isfinite(temp) or temp < 0:
        raise UsageError(f"temperature must be >= 0, got {temp}")
    if not 0.0 < top_p <= 1.0:
        raise UsageError(f"top-p must be in (0, 1], got {top_p}")
    if not 0.0 <= min_p <= 1.0:
        raise UsageError(f"min-p must be in [0, 1], got {min_p}")
    if top_k < 0:
        raise UsageError(f"top-k must be >= 0, got {top_k}")
    if temp == 0:
        return lambda logits: int(np.argmax(logits))
    rng = np.random.default_rng(seed)

    def sample(logits: np.ndarray) -> int:
        x = logits.astype(np.float64) / temp
        order = np.argsort(-x, kind="stable")  # best first
        if top_k:
            order = order[:top_k]
        p = np.exp(x[order] - x[order[0]])
        p /= p.sum()
        if top_p < 1.0:
            keep = int(np.searchsorted(np.cumsum(p), top_p) + 1)  # smallest prefix with mass >= top_p
            order, p = order[:keep], p[:keep]
        if min_p > 0.0:
            mask = p >= min_p * p[0]
            order, p = order[mask], p[mask]
        p = p / p.sum()
        return int(order[rng.choice(len(order), p=p)])

    return sample


def make_logits_processors(repetition_penalty: float = 1.0, context_size: int = 64) -> list[LogitsProcessor]:
    """llama.cpp / HF-style repetition penalty over the last `context_size` tokens."""
    if repetition_penalty <= 0 or not np.isfinite(repetition_penalty):
        raise UsageError(f"repetition penalty must be > 0, got {repetition_penalty}")
    if repetition_penalty == 1.0:
        return []

    def penalize(tokens: Sequence[int], logits: np.ndarray) -> np.ndarray:
        recent = np.unique(np.asarray(tokens[-context_size:], dtype=np.int64))
        if recent.size == 0:
            return logits
        logits = logits.copy()
        sel = logits[recent]
        logits[recent] = np.where(sel > 0, sel / repetition_penalty, sel * repetition_penalty)
        return logits

    return [penalize]
