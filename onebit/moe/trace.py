"""Routing traces: every token's routed experts per layer, prompt and decode marked.

A trace is JSONL: a header line, then one line per (forward pass, MoE layer):
  {"phase": "prompt"|"decode", "layer": l, "experts": [[ids of row 0], ...],
   "ranked": [[top 2k expert ids by router logit, row 0], ...], "logits": [[their logits], ...]}
Rows are tokens in order; the router's deeper ranks let prediction studies see near misses.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Iterator, Optional

import numpy as np

from ..errors import OnebitError, UsageError
from ..pause import PhasedHook


class TraceError(OnebitError):
    """A trace file is unreadable or malformed."""


class TraceWriter(PhasedHook):
    """A model hook that records routing, each call under the `phase` generation sets.

    A call keeps copies of the arrays; `drain()` writes what was kept (the Vulkan backend calls
    it while the device runs the next step, so the formatting costs the step nothing), as does
    every BATCH-th call and `close()`."""

    needs_pause = False  # it only observes: a recorded step may call it after the experts ran
    BATCH = 64

    def __init__(self, path: str, model_name: str, n_layers: int, n_experts: int, k: int):
        try:
            self.f = open(path, "w", encoding="utf-8")
        except OSError as e:
            raise UsageError(f"{path}: cannot write the trace ({e.strerror})") from None
        self.path = path
        self.phase = "prompt"
        self.k = k
        self._kept: list[tuple[str, int, np.ndarray, np.ndarray]] = []
        header = {"onebit_trace": 1, "model": model_name, "n_layers": n_layers, "n_experts": n_experts, "k": k}
        self.f.write(json.dumps(header) + "\n")

    def __call__(self, layer: int, ids: np.ndarray, logits: np.ndarray) -> None:
        self._kept.append((self.phase, int(layer), np.array(ids), np.array(logits)))
        if len(self._kept) >= self.BATCH:
            self.drain()

    def drain(self) -> None:
        """Write the records of the calls so far."""
        kept, self._kept = self._kept, []
        for phase, layer, ids, logits in kept:
            depth = min(2 * self.k, logits.shape[1])
            ranked = np.argsort(-logits, axis=-1, kind="stable")[:, :depth]
            # rounded as float64: float32's nearest to 1.304 prints as 1.3040000200271606
            top = np.take_along_axis(logits, ranked, axis=-1).astype(np.float64)
            rec = {
                "phase": phase,
                "layer": layer,
                "experts": ids.tolist(),
                "ranked": ranked.tolist(),
                "logits": np.round(top, 5).tolist(),
            }
            self.f.write(json.dumps(rec) + "\n")

    def close(self) -> None:
        if not self.f.closed:
            self.drain()
            self.f.close()


@dataclass
class Access:
    """One token's routing in one layer."""

    token: int  # index of the token in the trace
    decode: bool
    layer: int
    experts: tuple[int, ...]


@dataclass
class Trace:
    header: dict
    accesses: list[Access]

    @property
    def n_layers(self) -> int:
        return int(self.header["n_layers"])


def read_trace(path: str) -> Trace:
    """Parse a trace into per-token, per-layer accesses in execution order."""
    try:
        f = open(path, "rb")
    except OSError as e:
        raise TraceError(f"{path}: cannot read the trace ({e.strerror})") from None
    with f:
        lines = f.read().splitlines()
    if not lines:
        raise TraceError(f"{path}: empty trace file")
    try:
        header = json.loads(lines[0])
        assert isinstance(header, dict) and header.get("onebit_trace") == 1
    except (json.JSONDecodeError, AssertionError, UnicodeDecodeError):
        raise TraceError(f"{path}: not an onebit routing trace (bad header line)") from None
    accesses: list[Access] = []
    token_base = 0  # tokens of completed forward passes
    first_layer: Optional[int] = None
    rows_in_pass = 0
    for n, raw in enumerate(lines[1:], start=2):
        try:
            rec = json.loads(raw)
            layer, phase, experts = int(rec["layer"]), rec["phase"], rec["experts"]
            assert phase in ("prompt", "decode") and isinstance(experts, list)
        except (json.JSONDecodeError, KeyError, TypeError, ValueError, AssertionError, UnicodeDecodeError):
            raise TraceError(f"{path}:{n}: malformed trace record") from None
        if first_layer is None or layer <= first_layer:  # a new forward pass starts
            token_base += rows_in_pass
            first_layer = layer
            rows_in_pass = len(experts)
        for r, row in enumerate(experts):
            accesses.append(Access(token_base + r, phase == "decode", layer, tuple(int(e) for e in row)))
    # Order by token, then layer: the order a one-token-at-a-time run touches experts in.
    accesses.sort(key=lambda a: (a.token, a.layer))
    return Trace(header, accesses)


def iter_tokens(trace: Trace) -> Iterator[list[Access]]:
    cur: list[Access] = []
    for a in trace.accesses:
        if cur and a.token != cur[0].token:
            yield cur
            cur = []
        cur.append(a)
    if cur:
        yield cur
