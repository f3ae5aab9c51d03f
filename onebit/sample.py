"""Samplers are closures over their settings: logits [vocab] -> token id."""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import numpy as np

from .errors import UsageError

LogitsProcessor = Callable[[Sequence[int], np.ndarray], np.ndarray]


class Sampler:
    """logits [vocab] -> token id: greedy at temperature 0; otherwise top-k, then top-p, then
    min-p filtering, then a draw from the seeded generator. `verify` is the speculative
    sampling step for a drafted token, keeping the same target distribution."""

    def __init__(self, temp: float, top_p: float, min_p: float, top_k: int, seed: Optional[int]):
        self.temp, self.top_p, self.min_p, self.top_k = temp, top_p, min_p, top_k
        self.greedy = temp == 0
        self.seed = seed
        self.rng = None if self.greedy else np.random.default_rng(seed)

    def distribution(self, logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(token ids, probabilities) of the filtered target distribution, best first."""
        x = logits.astype(np.float64) / self.temp
        top = np.isposinf(x)
        if top.any():  # an infinite logit takes all the mass (shared evenly where several are)
            x = np.where(top, 0.0, -np.inf)
        order = np.argsort(-x, kind="stable")  # best first
        if self.top_k:
            order = order[: self.top_k]
        p = np.exp(x[order] - x[order[0]])
        p /= p.sum()
        if self.top_p < 1.0:
            keep = int(np.searchsorted(np.cumsum(p), self.top_p) + 1)  # smallest prefix with mass >= top_p
            order, p = order[:keep], p[:keep]
        if self.min_p > 0.0:
            mask = p >= self.min_p * p[0]
            order, p = order[mask], p[mask]
        return order, p / p.sum()

    def __call__(self, logits: np.ndarray) -> int:
        if not (logits > -np.inf).any():  # NaN compares false: no token left either
            raise UsageError("no token is left to sample: every token's logit is -inf or NaN "
                             "(a logit_bias of -100 on every token?)")
        if self.greedy:
            return int(np.argmax(logits))
        order, p = self.distribution(logits)
        return int(order[self.rng.choice(len(order), p=p)])

    def verify(self, logits: np.ndarray, draft: int) -> tuple[bool, int]:
        """(accepted, token) for a drafted token whose drafter put all its mass on it (q = 1).

        Speculative sampling accepts such a draft with probability min(1, p/q) = p(draft) and
        otherwise draws from the residual, p without the draft, renormalised. Drawing the
        token as a plain step would and accepting exactly when it equals the draft is that
        rule: the draft is kept with probability p(draft), and a rejected draw is distributed
        as p conditioned on not being the draft, which is the residual. It also uses one draw
        per token, in order, so a seeded run gives the tokens plain sampling gives."""
        tok = self(logits)
        return tok == draft, tok


class CallableSampler(Sampler):
    """A caller's own sampler (any callable of the logits) with a Sampler's parts: never
    greedy (the device does not run ahead of it), and `verify` by its own draws."""

    def __init__(self, fn: Callable[[np.ndarray], int]):
        self.fn = fn
        self.greedy = False
        self.seed = None

    def __call__(self, logits: np.ndarray) -> int:
        return int(self.fn(logits))


def as_sampler(sampler: Sampler | Callable[[np.ndarray], int]) -> Sampler:
    """A Sampler as it is, any other callable of the logits as a CallableSampler."""
    return sampler if isinstance(sampler, Sampler) else CallableSampler(sampler)


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
    return Sampler(temp, top_p, min_p, top_k, seed)


def make_logits_processors(repetition_penalty: float = 1.0, context_size: int = 64) -> list[LogitsProcessor]:
    """llama.cpp / HF-style repetition penalty over the last `context_size` tokens."""
    if not 1e-3 <= repetition_penalty <= 1e3:  # (NaN fails too) beyond these a logit overflows to inf
        raise UsageError(f"repeat penalty must be in [0.001, 1000], got {repetition_penalty}")
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
