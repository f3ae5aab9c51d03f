"""Lookup decoding: draft tokens by n-gram lookup in the context, verified in one forward.

The drafter keeps an index from every n-gram of the context (n = 1..n_max) to the position
that followed its most recent occurrence, updated as each token arrives (n_max dict writes
per token), so a proposal costs O(n_max) lookups per drafted token, never a rescan. A
proposal takes the longest n-gram ending the context that occurred before and proposes the
token that followed it, then drafts on as if that token had been accepted.

How many of the proposed tokens a forward verifies is the `DraftPolicy`'s choice: the one
that maximises expected tokens per second, from the accept rate of past proposals (by match
length, counted for every proposal, verified or not, against the tokens that followed) and
the measured time of forwards over R rows, behind a gate that turns drafting off while
measured decode speed says it does not pay. It changes only how many rows a forward has,
never which tokens come out.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional, Sequence

from .errors import UsageError
from .gate import SpeedGate

MAX_DRAFTS = 8
NGRAM_MAX = 4
# Drafts per forward when the caller gives none: on, at the most drafts. The
# draft policy verifies only what it expects to pay and its gate turns drafting off where it
# measures slower: on every file measured (bench/results/lookup-decoding-2026-12-01.md, 2026-12-02 at cbcf0c7) open
# prompts ran at 0.99-1.00x of plain decoding or faster, copy-heavy ones up to 1.88x.
DEFAULT_DRAFTS = MAX_DRAFTS


def lookup_budget(n: Optional[int], default: int = DEFAULT_DRAFTS) -> int:
    """Drafts per forward: `n`, 0 (off) .. 8; larger budgets are clamped. None: `default`
    (callers pass 0 where a hook watches the forwards, since a routing trace records one row per
    token and verify rows are rows too, and for a benchmark of plain decoding)."""
    if n is None:
        n = default
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

    def _next(self, tail: list[int]) -> tuple[Optional[int], int]:
        for n in range(min(self.n_max, len(tail)), 0, -1):
            j = self.follows.get(tuple(tail[-n:]))
            if j is not None:
                return self.tokens[j], n
        return None, 0

    def propose(self, k: int) -> list[int]:
        """Up to k draft tokens to follow the context (fewer, or none, when nothing matches)."""
        return self.propose_matched(k)[0]

    def propose_matched(self, k: int) -> tuple[list[int], list[int]]:
        """(drafts, the length of the n-gram match behind each)."""
        tail = self.tokens[-self.n_max :]
        out: list[int] = []
        lengths: list[int] = []
        while len(out) < k:
            t, n = self._next(tail)
            if t is None:
                break
            out.append(t)
            lengths.append(n)
            tail = (tail + [t])[-self.n_max :]
        return out, lengths


class DraftPolicy:
    """How many drafts to verify: the d maximising E(tokens | d) / T(1 + d rows), behind a gate
    that measures whether drafting pays at all.

    E(tokens | d) = 1 + sum over i <= d of prod_{j <= i} a(n_j), where a(n) is the rate at which
    a draft behind an n-token match turned out right, given the drafts before it were (counted
    for every proposal against the tokens that actually followed, so it is learned while
    drafting is off too; a cautious Beta(1, 3) start: a = 0.25 until proposals say more). T(R)
    is the running mean time of decode forwards over R rows, kept with the network across
    generations (`times`); a row count not yet measured is assumed to cost
    T(1) * (1 + 0.1 (R - 1)), a guess that the first measurement replaces.

    The accept rates, like the timings, outlive one generation (`learned`, kept with the
    network: a chat's turns and a batch's prompts go on from what the earlier ones taught).
    Their memory is bounded: once a match length has MEMORY tries, its counts are scaled down
    so that each new outcome weighs as much as one in MEMORY.

    The model above misses costs that no single forward shows (experts that verify rows pull
    into a streaming pool evict ones the next tokens need; timings of a loaded machine move),
    so a gate judges the result: decode forwards are timed start to start in windows of
    WINDOW, and each window's seconds per token produced go to a running mean for the state
    it ran in, drafting (the model's choice) or not (no drafts verified). The faster state
    runs; the other is tried one window in EXPLORE, so a wrong state costs at most about
    1/EXPLORE of the difference. Only timing decides, and it changes only how many rows a
    forward has, never which tokens come out."""

    MEMORY = 64.0
    WINDOW, EXPLORE, DECAY = 8, 8, 0.7

    def __init__(self, n_max: int = NGRAM_MAX, decay: float = 0.9, times: Optional[dict] = None,
                 learned: Optional[dict] = None, clock=time.perf_counter, fixed: bool = False):
        """`fixed`: choose from the accept rates and the cost guess alone, never from timings or
        the gate (a seeded sampled run: the same tokens give the same row counts, run after run)."""
        self.fixed = fixed
        learned = {} if learned is None else learned
        self.hits = learned.setdefault("hits", [1.0] * (n_max + 1))  # by match length; Beta(1, 3) prior
        self.tries = learned.setdefault("tries", [4.0] * (n_max + 1))
        self.gate = SpeedGate(self.EXPLORE, self.DECAY, learned.setdefault("gate", {}))
        self.time: dict[int, float] = {} if times is None else times
        self.decay = decay
        self.clock = clock
        self._open: Optional[tuple[int, list[int], list[int]]] = None  # (start, drafts, lengths) to score
        self._last: Optional[float] = None  # when the last decode forward started
        self._window = [0.0, 0, 0]  # seconds, tokens, forwards

    def started(self, made: int) -> None:
        """A decode forward starts; the one before it produced `made` tokens (its accepted
        drafts and the token after them)."""
        if self.fixed:
            return
        now = self.clock()
        w = self._window
        if self._last is not None:
            w[0] += now - self._last
            w[1] += made
            w[2] += 1
        self._last = now
        if w[2] >= self.WINDOW:
            self._window = [0.0, 0, 0]
            if self.gate.window(w[0] / max(w[1], 1)):
                self._last = None  # the next interval carries the old state's work

    def rate(self, n: int) -> float:
        return self.hits[n] / self.tries[n]

    def cost(self, rows: int) -> float:
        if rows in self.time:
            return self.time[rows]
        t1 = self.time.get(1, 1.0)
        return t1 * (1.0 + 0.1 * (rows - 1))

    def timed(self, rows: int, seconds: float) -> None:
        if self.fixed:
            return
        old = self.time.get(rows)
        self.time[rows] = seconds if old is None else self.decay * old + (1 - self.decay) * seconds

    def score(self, tokens: Sequence[int]) -> None:
        """Count the open proposal's drafts against the tokens that followed it."""
        if self._open is None:
            return
        start, drafts, lengths = self._open
        if start + len(drafts) > len(tokens) and tokens[start:] == drafts[: len(tokens) - start]:
            return  # all seen so far were right: wait for the rest
        self._open = None
        for i, (t, n) in enumerate(zip(drafts, lengths)):
            if start + i >= len(tokens):
                break
            self.tries[n] += 1
            right = tokens[start + i] == t
            self.hits[n] += right
            if self.tries[n] > self.MEMORY:
                self.hits[n] *= self.MEMORY / self.tries[n]
                self.tries[n] = self.MEMORY
            if not right:
                break

    def choose(self, tokens: Sequence[int], drafts: list[int], lengths: list[int]) -> int:
        """How many of `drafts` (proposed to follow `tokens`) to verify; opens them for scoring."""
        self.score(tokens)
        if self._open is None and drafts:
            self._open = (len(tokens), drafts, lengths)
        if not self.fixed and not self.gate.on:
            return 0
        best, best_d = 1.0 / self.cost(1), 0
        expect, chain = 1.0, 1.0
        for d, n in enumerate(lengths, start=1):
            chain *= self.rate(n)
            expect += chain
            v = expect / self.cost(d + 1)
            if v > best:
                best, best_d = v, d
        return best_d


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
