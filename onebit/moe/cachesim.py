"""Replay a routing trace through expert-cache policies (`onebit cache-sim`).

The pool holds N experts. Tokens are replayed one at a time, layer by layer; a layer's k
routed experts are pinned together (none of them can evict another). Hit rates count
decode tokens only; the prompt warms the pool. Policies:
  lru, lfu, slru        one cache per layer, N split evenly among the MoE layers
  global-lru            one LRU order across all layers (the engine's default)
  global-lfu            one cache across layers, least frequently used with exponential decay
  belady                global, evicts the expert used furthest in the future: the optimum
"""

from __future__ import annotations

import json
from collections import OrderedDict, defaultdict
from dataclasses import dataclass

from ..config import MAX_EXPERTS, MAX_LAYERS
from ..errors import UsageError
from .trace import Access, Trace, TraceError

Key = tuple[int, int]  # (layer, expert)


MAX_LINE = 16 << 20  # bytes in one trace line (a 512-row prefill record of a k=8 model is ~200 KB)


def _header_int(header: dict, key: str, lo: int, hi: int, path: str) -> int:
    v = header.get(key)
    if type(v) is not int or not lo <= v <= hi:
        raise TraceError(f"{path}:1: trace header {key!r} = {v!r} is not an integer in {lo}..{hi}")
    return v


def load_trace(path: str) -> Trace:
    """Read a routing trace for `cache-sim`, checking it as the GGUF loader checks a file: the
    header's n_layers, n_experts and k are integers in range; every record's layer, phase, and
    expert rows (1..k distinct integer ids below n_experts) agree with it; no line is longer than
    MAX_LINE; at least one record. Errors are one `TraceError` naming the line."""
    try:
        f = open(path, "rb")
    except OSError as e:
        raise TraceError(f"{path}: cannot read the trace ({e.strerror})") from None
    with f:
        lines = iter(lambda: f.readline(MAX_LINE + 1), b"")
        header = _json_line(next(lines, b""), path, 1, "not an onebit routing trace (bad header line)")
        if not isinstance(header, dict) or header.get("onebit_trace") != 1:
            raise TraceError(f"{path}: not an onebit routing trace (bad header line)")
        n_layers = _header_int(header, "n_layers", 1, MAX_LAYERS, path)
        n_experts = _header_int(header, "n_experts", 1, MAX_EXPERTS, path)
        k = _header_int(header, "k", 1, n_experts, path)
        accesses: list[Access] = []
        # Rows of one forward pass are consecutive tokens; a pass starts when the layer does not
        # rise (the same rule as trace.read_trace).
        token_base, first_layer, rows_in_pass = 0, None, 0
        for n, raw in enumerate(lines, start=2):
            if not raw.strip():
                continue
            rec = _json_line(raw, path, n, "malformed trace record")
            layer, phase, rows = _record(rec, path, n, n_layers, n_experts, k)
            if first_layer is None or layer <= first_layer:
                token_base += rows_in_pass
                first_layer, rows_in_pass = layer, len(rows)
            for r, row in enumerate(rows):
                accesses.append(Access(token_base + r, phase == "decode", layer, row))
    if not accesses:
        raise TraceError(f"{path}: the trace holds no records, only its header (was the run stopped before its "
                         "first token?)")
    accesses.sort(key=lambda a: (a.token, a.layer))
    return Trace(header, accesses)


def _json_line(raw: bytes, path: str, n: int, what: str):
    if len(raw) > MAX_LINE:
        raise TraceError(f"{path}:{n}: line longer than {MAX_LINE:,} bytes; not a trace onebit wrote")
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise TraceError(f"{path}:{n}: {what}") from None


def _record(rec, path: str, n: int, n_layers: int, n_experts: int, k: int):
    """(layer, phase, rows as tuples of ids) of one record, or a TraceError naming line n."""
    where = f"{path}:{n}"
    if not isinstance(rec, dict):
        raise TraceError(f"{where}: malformed trace record (not a JSON object)")
    layer, phase, rows = rec.get("layer"), rec.get("phase"), rec.get("experts")
    if type(layer) is not int or not 0 <= layer < n_layers:
        raise TraceError(f"{where}: layer {layer!r} is not an integer in 0..{n_layers - 1} (the header's n_layers)")
    if phase not in ("prompt", "decode"):
        raise TraceError(f"{where}: phase {phase!r} is not 'prompt' or 'decode'")
    if not isinstance(rows, list) or not rows:
        raise TraceError(f"{where}: 'experts' is not a non-empty list of rows")
    out = []
    for row in rows:
        if not isinstance(row, list) or not 1 <= len(row) <= k:
            width = len(row) if isinstance(row, list) else type(row).__name__
            raise TraceError(f"{where}: a row of experts has {width} entries; the header's k is {k}")
        for e in row:
            if type(e) is not int or not 0 <= e < n_experts:
                raise TraceError(f"{where}: expert id {e!r} is not an integer in 0..{n_experts - 1} "
                                 "(the header's n_experts)")
        if len(set(row)) != len(row):
            raise TraceError(f"{where}: a row routes to the same expert twice ({row})")
        out.append(tuple(row))
    return layer, phase, out


class LRU:
    def __init__(self, cap: int):
        self.cap, self.d = cap, OrderedDict()

    def access(self, key, pinned, t) -> bool:
        if key in self.d:
            self.d.move_to_end(key)
            return True
        if len(self.d) >= self.cap:
            victim = next((k for k in self.d if k not in pinned), None)
            if victim is None:
                return False  # everything pinned: read without caching
            del self.d[victim]
        self.d[key] = True
        return False


class LFU:
    """Least frequently used; counts kept while resident; ties go to the least recent."""

    def __init__(self, cap: int, decay: float = 1.0):
        self.cap, self.decay = cap, decay
        self.score: dict[Key, float] = {}
        self.last: dict[Key, int] = {}
        self.t_decay = 0

    def tick(self) -> None:
        if self.decay < 1.0:
            for k in self.score:
                self.score[k] *= self.decay

    def access(self, key, pinned, t) -> bool:
        self.last[key] = t
        if key in self.score:
            self.score[key] += 1.0
            return True
        if len(self.score) >= self.cap:
            cands = [k for k in self.score if k not in pinned]
            if not cands:
                return False
            victim = min(cands, key=lambda k: (self.score[k], self.last[k]))
            del self.score[victim]
        self.score[key] = 1.0
        return False


class SLRU:
    """Segmented LRU: new entries go to probation; a second hit promotes to the protected part."""

    def __init__(self, cap: int, protected_share: float = 0.8):
        self.cap = cap
        self.pcap = max(int(cap * protected_share), 1) if cap > 1 else 0
        self.prob, self.prot = OrderedDict(), OrderedDict()

    def _evict_from(self, seg, pinned):
        victim = next((k for k in seg if k not in pinned), None)
        if victim is not None:
            del seg[victim]
        return victim

    def access(self, key, pinned, t) -> bool:
        if key in self.prot:
            self.prot.move_to_end(key)
            return True
        if key in self.prob:
            del self.prob[key]
            if len(self.prot) >= self.pcap:
                demoted = self._evict_from(self.prot, pinned)
                if demoted is not None:
                    self.prob[demoted] = True
            if len(self.prot) < self.pcap:
                self.prot[key] = True
            else:
                self.prob[key] = True
            return True
        if len(self.prob) + len(self.prot) >= self.cap:
            if self._evict_from(self.prob, pinned) is None and self._evict_from(self.prot, pinned) is None:
                return False
        self.prob[key] = True
        return False


class Belady:
    """Evict the resident expert whose next use is furthest away (never used again first)."""

    def __init__(self, cap: int, next_use: list[int]):
        self.cap, self.next_use = cap, next_use
        self.when: dict[Key, int] = {}  # resident key -> its next use time

    def access(self, key, pinned, t) -> bool:
        hit = key in self.when
        if not hit and len(self.when) >= self.cap:
            cands = [k for k in self.when if k not in pinned]
            if not cands:
                return False
            victim = max(cands, key=lambda k: self.when[k])
            del self.when[victim]
        self.when[key] = self.next_use[t]
        return hit


@dataclass
class SimResult:
    policy: str
    slots: int
    hits: int
    accesses: int

    @property
    def hit_rate(self) -> float:
        return self.hits / self.accesses if self.accesses else 0.0


POLICIES = ("lru", "lfu", "slru", "global-lru", "global-lfu", "belady")


def simulate(trace: Trace, policy: str, slots: int, decay: float = 0.95) -> SimResult:
    if policy not in POLICIES:
        raise UsageError(f"unknown policy {policy!r} (choose from {', '.join(POLICIES)})")
    if slots < 1:
        raise UsageError(f"--slots {slots}: the pool needs at least 1 slot")
    if not trace.accesses:
        raise UsageError("the trace holds no records to replay")
    layers = sorted({a.layer for a in trace.accesses})
    k = max((len(a.experts) for a in trace.accesses), default=1)
    per_layer = policy in ("lru", "lfu", "slru")
    if slots < k * (len(layers) if per_layer else 1):
        need = k * (len(layers) if per_layer else 1)
        raise UsageError(f"--slots {slots} is too few for {policy}: at least {need} are needed")
    # Flatten to one access per expert, in execution order, for next-use times.
    flat: list[tuple[Key, int, bool, int]] = []  # key, group id, decode, token
    for g, a in enumerate(trace.accesses):
        for e in a.experts:
            flat.append(((a.layer, e), g, a.decode, a.token))
    next_use = [0] * len(flat)
    seen: dict[Key, int] = {}
    for i in range(len(flat) - 1, -1, -1):
        next_use[i] = seen.get(flat[i][0], 1 << 62)
        seen[flat[i][0]] = i
    if per_layer:
        cap = slots // len(layers)
        make = {"lru": LRU, "lfu": LFU, "slru": SLRU}[policy]
        caches = defaultdict(lambda: make(cap))
    elif policy == "global-lru":
        shared = LRU(slots)
    elif policy == "global-lfu":
        shared = LFU(slots, decay)
    else:
        shared = Belady(slots, next_use)
    hits = total = 0
    group_keys: dict[int, set] = defaultdict(set)
    for key, g, _, _ in flat:
        group_keys[g].add(key)
    last_token = None
    for t, (key, g, decode, token) in enumerate(flat):
        if token != last_token and policy == "global-lfu":
            shared.tick()
        last_token = token
        cache = caches[key[0]] if per_layer else shared
        hit = cache.access(key, group_keys[g], t)
        if decode:
            total += 1
            hits += hit
    return SimResult(policy, slots, hits, total)


def format_table(results: list[SimResult], decode_tokens: int) -> str:
    slots = sorted({r.slots for r in results})
    pols = [p for p in POLICIES if any(r.policy == p for r in results)]
    by = {(r.policy, r.slots): r for r in results}
    lines = [f"hit rate over {decode_tokens} decode tokens (prompt warms the pool)", ""]
    lines.append(f"{'policy':<12}" + "".join(f"{'slots ' + str(s):>12}" for s in slots))
    for p in pols:
        row = f"{p:<12}"
        for s in slots:
            r = by.get((p, s))
            row += f"{(f'{100 * r.hit_rate:.1f}%' if r else '-'):>12}"
        lines.append(row)
    return "\n".join(lines)
