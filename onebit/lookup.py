"""Lookup decoding: draft tokens by n-gram lookup in the context, verified in one forward.

The drafter keeps an index from every n-gram of the context (n = 1..n_max) to the position
that followed its most recent occurrence, updated as each token arrives (n_max dict writes
per token), so a proposal costs O(n_max) lookups per drafted token, never a rescan. A
proposal takes the longest n-gram ending the context that occurred before and proposes the
token that followed it, then drafts on as if that token had been accepted.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional, Sequence

from .errors import UsageError

MAX_DRAFTS = 8
NGRAM_MAX = 4
LOOKUP_ENV = "ONEBIT_LOOKUP"


def lookup_budget(n: Optional[int | str]) -> int:
    """Drafts per forward from a flag or the environment: 0 (off) .. 8; larger budgets are clamped."""
    if n is None:
        n = os.environ.get(LOOKUP_ENV, "0").strip() or "0"
    try:
        v = int(n)
    except (TypeError, ValueError):
        raise UsageError(f"lookup must be a whole number of drafts (0 = off), got {n!r}") from None
    if v < 0:
        raise UsageError(f"lookup must be >= 0 drafts (0 = off), got {v}")
    return min(v, MAX_DRAFTS)


class NgramDrafter:
    """Proposes the continuation of the longest recent n-gram that occurred earlier in the context."""

    def __init__(self, tokens: Sequence[int] = (), n_max: int = NGRAM_MAX):
        self.n_max = n_max
        self.tokens: list[int] = []
        self.follows: dict[tuple[int, ...], int] = {}  # n-gram -> index of the token after its latest occurrence
        for t in tokens:
            self.push(t)

    def push(self, tok: int) -> None:
        toks = self.tokens
        i = len(toks)
        for n in range(1, min(self.n_max, i) + 1):
            self.follows[tuple(toks[i - n : i])] = i
        toks.append(int(tok))

    def _next(self, tail: list[int]) -> Optional[int]:
        for n in range(min(self.n_max, len(tail)), 0, -1):
            j = self.follows.get(tuple(tail[-n:]))
            if j is not None:
                return self.tokens[j]
        return None

    def propose(self, k: int) -> list[int]:
        """Up to k draft tokens to follow the context (fewer, or none, when nothing matches)."""
        if k <= 0:
            return []
        tail = self.tokens[-self.n_max :]
        out: list[int] = []
        while len(out) < k:
            t = self._next(tail)
            if t is None:
                break
            out.append(t)
            tail = (tail + [t])[-self.n_max :]
        return out


@dataclass
class LookupStats:
    """Counters of lookup decoding over one generation (or a chat's turns, when summed)."""

    proposed: int = 0  # draft tokens sent to verification
    accepted: int = 0  # of those, kept
    forwards: int = 0  # decode forwards run (verification or plain one-row steps)
    tokens: int = 0  # tokens those forwards produced

    @property
    def accept_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def tokens_per_forward(self) -> float:
        return self.tokens / self.forwards if self.forwards else 0.0

    def add(self, other: "LookupStats") -> None:
        self.proposed += other.proposed
        self.accepted += other.accepted
        self.forwards += other.forwards
        self.tokens += other.tokens

    def to_dict(self) -> dict:
        return {"drafts_proposed": self.proposed, "drafts_accepted": self.accepted,
                "accept_rate": round(self.accept_rate, 4), "decode_forwards": self.forwards,
                "tokens_per_forward": round(self.tokens_per_forward, 4)}

    def line(self) -> str:
        return (f"lookup: drafts proposed {self.proposed}, accepted {self.accepted} "
                f"({100 * self.accept_rate:.1f}%), tokens per forward {self.tokens_per_forward:.2f}")
