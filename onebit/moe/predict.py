"""Routing prediction: which experts the next MoE layers will route to, so the pool can read
them while the current layer computes.

At each MoE layer's pause point (after its router, before its experts) the predictor gets
the layer's routing and the residual stream h there (the input of the layer's FFN block).
For each of the next `ahead` MoE layers l + j it ranks experts from:

- router: layer l + j's FFN norm and router applied to h (the residual available now);
- block:  layer l + j's own mixer block run speculatively first (attention over the real
          cache's earlier positions plus this step's rows, whose K/V go to that layer's
          scratch, never to the cache), then its FFN norm and router. At one ahead, h first
          gets layer l's top `own` experts' output added (what h lacks of layer l + 1's input;
          on host backends, whose experts the predictor can run); deeper layers chain
          from the predicted residual (`chain`), or take the first predicted residual to
          their routers (the cheap router form). `no_attn` drops the mixer.

The ranked candidates become a set (`select`: at least `min`, up to `depth` while within
`margin` of the best router logit), queued as pool prefetches (demand reads go first; a
prefetch never evicts what the current layer routes to). Only the ranking leaves the
predictor: the forward's arithmetic is untouched, so output with prediction on is
bit-identical to off (tested), and a poisoned scratch changes nothing.

Adaptive rule, when streaming (`Ledger`): per predicted layer, the form of prediction that
pays for itself (block, router or none), decided from what each decode step measures
directly: the host time spent predicting that layer, and the stall its prefetches took off
the drive's critical path (its prefetch hits, priced at the measured stall per demand-missed
expert, less what acquire still waited on prefetches in flight and on wrong reads). A layer
whose prediction costs more than it saves drops a level after two steps, and retries the
level above now and then. Candidates past the top-k (depth) are issued only while their own
precision stays above DEEP_ABOVE; predictions for layers more than one ahead only while that
layer's precision is above AHEAD_ABOVE. Over all of it a `Gate` turns prediction off while
whole decode steps have been faster without it (what no per-layer figure sees: reads in
flight taking cores from compute).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field, fields, replace
from typing import Callable, Optional

import numpy as np

from ..backends.numpy_backend import EagerStep, NumpyBackend
from ..cache import RecurrentCache
from ..errors import UsageError
from ..gate import SpeedGate
from ..memory.plan import parse_layers
from ..memory.pool import PROMPT_SHARE
from ..pause import NO_PAUSES, PauseClient, PauseContext

MODES = ("auto", "off", "router", "block")  # auto: where experts stream router (host) or block (device), else off (Model resolves it)
DEEP_ABOVE, AHEAD_ABOVE = 0.15, 0.50
HOLD = 0.5  # the gate explores prediction off only while the ledger prices it at under this share of a step
SETTLE = 2  # decode steps after a multi-row forward that the ledger does not measure
EMA = 0.1  # weight of the newest token in the running precisions


@dataclass(frozen=True)
class PredictSettings:
    mode: str = "auto"
    depth: int = 0  # candidates ranked per layer (0: the model's top-k)
    margin: float = math.inf  # a deeper candidate only while its logit is within this of the best
    min: int = 0  # always read at least this many (0: the model's top-k)
    layers: Optional[str] = None  # "1,2,5-9": the layers predicted (None: every MoE layer)
    ahead: int = 1  # how many MoE layers ahead
    no_attn: bool = False  # block mode without the mixer
    chain: bool = False  # block mode, > 1 ahead: run every deeper layer's block too (else router form)
    own: int = 1  # block mode: add this many of the current layer's top experts' output to the residual first
    out: Optional[str] = None  # per-token predicted / actual trace (JSONL)
    stats: bool = False  # print the per-layer table at exit
    look: bool = False  # the gate looks at the stall before predicting (the default's; see Gate)

    @property
    def on(self) -> bool:
        return self.mode not in ("off", "auto")  # (auto: as resolved at load, see Model)


def _int(name: str, v, lo: int) -> int:
    try:
        n = int(str(v).strip())
    except ValueError:
        raise UsageError(f"{name} must be a whole number, got {v!r}") from None
    if n < lo:
        raise UsageError(f"{name} must be >= {lo}, got {n}")
    return n


def _flag(name: str, v) -> bool:
    s = str(v).strip().lower()
    if s in ("1", "true", "yes", "on"):
        return True
    if s in ("0", "false", "no", "off", ""):
        return False
    raise UsageError(f"{name} must be 0 or 1, got {v!r}")


def settings_from(**given) -> PredictSettings:
    """Settings from the given fields (PredictSettings names), as the CLI's flags give them
    (strings: "6", "1.5", "1") or typed; a field None or absent keeps its default. Bad values:
    UsageError naming the flag."""
    names = [f.name for f in fields(PredictSettings)]
    unknown = sorted(set(given) - set(names))
    if unknown:
        raise TypeError(f"settings_from: no prediction setting named {', '.join(unknown)} "
                        f"(settings: {', '.join(names)})")
    raw = dict.fromkeys(names)
    raw.update({k: v for k, v in given.items() if v is not None})
    out = {}
    mode = str(raw["mode"] or "auto").strip().lower()
    if mode not in MODES:
        raise UsageError(f"--moe-predict must be one of {', '.join(MODES)}, got {raw['mode']!r}")
    out["mode"] = mode
    if raw["depth"] not in (None, ""):
        out["depth"] = _int("--moe-predict-depth", raw["depth"], 1)
    if raw["min"] not in (None, ""):
        out["min"] = _int("--moe-predict-min", raw["min"], 1)
    if raw["ahead"] not in (None, ""):
        out["ahead"] = _int("--moe-predict-ahead", raw["ahead"], 1)
    if raw["margin"] not in (None, ""):
        try:
            m = float(raw["margin"])
        except ValueError:
            raise UsageError(f"--moe-predict-margin must be a number, got {raw['margin']!r}") from None
        if not m >= 0:
            raise UsageError(f"--moe-predict-margin must be >= 0, got {raw['margin']!r}")
        out["margin"] = m
    if raw["own"] not in (None, ""):
        out["own"] = _int("--moe-predict-own", raw["own"], 0)
    if raw["layers"] not in (None, ""):
        out["layers"] = str(raw["layers"])
    if raw["no_attn"] not in (None, ""):
        out["no_attn"] = _flag("--moe-predict-no-attn", raw["no_attn"])
    if raw["chain"] not in (None, ""):
        out["chain"] = _flag("--moe-predict-chain", raw["chain"])
    if raw["stats"] not in (None, ""):
        out["stats"] = _flag("--moe-predict-stats", raw["stats"])
    if raw["out"] not in (None, ""):
        out["out"] = str(raw["out"])
    s = PredictSettings(**out)
    if s.min and s.depth and s.min > s.depth:
        raise UsageError(f"--moe-predict-min ({s.min}) is more than --moe-predict-depth ({s.depth})")
    return s


def as_settings(predict) -> PredictSettings:
    """PredictSettings from what `onebit.load(predict=...)` takes: None, a mode name, or settings."""
    if predict is None:
        return PredictSettings()
    if isinstance(predict, str):
        return settings_from(mode=predict)
    if not isinstance(predict, PredictSettings):
        raise UsageError(f"predict must be a mode name or PredictSettings, got {predict!r}")
    return predict


def _recurrent_scratch(cfg):
    return RecurrentCache(cfg.ssm_conv_kernel, cfg.ssm_conv_channels, cfg.ssm_time_step_rank, cfg.ssm_state_size)


@dataclass
class LayerStats:
    """One predicted layer: what was predicted for it and what it routed to (sets over rows)."""

    predictions: int = 0  # rows (tokens) for which the layer was predicted and then reached
    routed: int = 0  # experts those rows routed to (top-k each)
    predicted: int = 0  # experts predicted for them (the sets selected), summed
    hits: int = 0  # routed experts that were predicted
    top_hits: int = 0  # of those, within the top-k candidates
    issued: int = 0  # forwards whose prediction (the union over rows) went to the pool
    prefetched: int = 0  # experts queued by those
    precision: float = 1.0  # running (EMA) routed-and-predicted / predicted
    deep_precision: float = 1.0  # the same for candidates past the top-k
    paused: bool = False  # the ledger stopped predicting it (level none)

    @property
    def recall(self) -> float:
        return self.hits / self.routed if self.routed else 0.0


@dataclass
class _Pending:
    rows: list  # per row: (the selected set, the part always read, the top-k candidates)
    issued: bool  # sent to the pool (the union over rows)
    distance: int = 1  # how many MoE layers ahead it was made


class Gate(SpeedGate):
    """Prediction on or off by measured decode time: whichever has made decode steps faster.

    Asked for by name (router, block), prediction starts on. As the default (auto), the gate
    starts off and looks first (`look`): prediction can at most take off a step what the step
    waits on the drive, so the first LOOK decode steps run without it and measure the share of
    their time spent waiting on expert reads (the pool's stall). Under STALL_ON prediction
    would cost more than it could win back: its wrong guesses are reads too (drive time, and
    for packed layouts the readers' CPU beside the forward's), and measured on the cpu backend
    it paid only where the drive held decode steps more than half of their time (the 30B-A3B
    shape at 8 GiB: 57% and 73% stalled, router prediction 1.1-1.2x off; the 0.86B MoE with
    384 and 768 slots: 47% and 25% stalled, off the fastest; bench/results/
    trained-routing-30b-streaming-2026-12-07.md). There the gate stays off (a prompt's
    chunks, several rows, predict meanwhile as before). Otherwise it turns on. From there on
    timing decides: decode forwards (one row) are timed start to start in windows of WINDOW;
    each window's median step goes to a running mean for the state it ran in; after FIRST
    windows the gate tries the other state for a window, then runs the faster one and tries the
    other again EXPLORE windows later, the gap doubling (up to CAP windows) each time the trial
    loses (SpeedGate). A gate that looked keeps looking while off: a trial of prediction is due
    only after a window stalled STALL_ON of its time or more (else it is skipped as lost), since
    below that a trial costs its wrong reads and the prediction's compute for a step it cannot
    shorten by more than the stall (the 0.86B MoE at 768 slots: trials held the default at
    0.89-0.92 of off over 24 and 160 tokens, 3973c38). Off means
    no prediction at all (no prefetches, no prediction compute). Only which experts are read
    ahead depends on the gate, never the output."""

    WINDOW, EXPLORE, DECAY, FIRST, CAP = 8, 6, 0.7, 2, 32
    LOOK, STALL_ON = 2, 0.5

    def __init__(self, look: bool = True):
        super().__init__(self.EXPLORE, self.DECAY, state={"on": not look}, first=self.FIRST, cap=self.CAP)
        self._t: Optional[float] = None
        self._acc: list[float] = []
        self._acc_stall = 0.0  # the stall seconds of the window's steps
        self._stall: Optional[float] = None  # the pool's stall seconds when the last one-row step started
        self.looks = look  # (a trial of prediction only where a window stalled STALL_ON)
        self.looked = 0 if look else self.LOOK  # decode steps measured while looking
        self.look = [0.0, 0.0]  # their seconds and their stall seconds

    def step(self, rows: int, pays: Optional[Callable[[float], bool]] = None, stall: float = 0.0) -> bool:
        """A forward of `rows` rows starts; whether prediction runs in it. `pays(step seconds)`:
        whether, by the ledger's measurements, prediction saves so much of a step that a trial
        without it is not worth its cost (see Predictor._pays). `stall`: the pool's stall
        seconds so far (what the steps that look measure)."""
        now = time.perf_counter()
        looking = self.looked < self.LOOK
        if self._t is not None and rows == 1:
            if looking:
                self.look[0] += now - self._t
                self.look[1] += stall - self._stall
                self.looked += 1
                if self.looked == self.LOOK and self.look[1] >= self.STALL_ON * self.look[0]:
                    self.state["on"] = True
            else:
                self._acc.append(now - self._t)
                self._acc_stall += stall - self._stall
        self._t, self._stall = (now, stall) if rows == 1 else (None, None)
        if looking:
            if self.looked == self.LOOK:
                self._t = None  # (the next step is the first in the state chosen)
                return self.on
            return rows > 1  # (a prompt's chunk predicts as before: it is no decode step to look at)
        if len(self._acc) >= self.WINDOW:
            m = sorted(self._acc)[len(self._acc) // 2]  # the window's median step
            calm = self._acc_stall < self.STALL_ON * sum(self._acc)
            self._acc, self._acc_stall = [], 0.0
            hold = (pays is not None and pays(m)) if self.on else (self.looks and calm)
            if self.window(m, hold):
                self._t = None  # the first step after a switch carries the old state's work
        return self.on


NONE, ROUTER, BLOCK = 0, 1, 2  # the ledger's levels of prediction for one layer
LEVEL_NAMES = ("none", "router", "block")


class ReadCost:
    """Compute time one prefetch read takes from a decode step, measured: reads in flight
    while the host computes take a core from its kernels (and the interpreter lock from the
    loop). Per one-row step, y = the step's time less its stall and the predictor's own time
    (the compute), x = the prefetch reads queued in it; the estimate is the slope of y on x,
    a least-squares fit with older steps weighted down by DECAY each step, and never below
    the readers' own CPU time per read (`floor`, from the pool), nor above CAP times it (a
    read can hold up one of the kernels' threads for its CPU time, and the interpreter lock
    about as long again: a steeper fit is other load that happened to come with the reads).
    Until the steps' read counts have varied enough (a weighted variance of VAR reads^2 over
    at least MIN steps), the floor alone."""

    DECAY, MIN, VAR, CAP = 0.97, 8, 0.5, 2.0

    def __init__(self):
        self.w = self.x = self.y = self.xx = self.xy = 0.0
        self.n = 0
        self.floor = 0.0

    def add(self, reads: float, compute: float) -> None:
        d = self.DECAY
        self.w, self.x, self.y = d * self.w + 1, d * self.x + reads, d * self.y + compute
        self.xx, self.xy = d * self.xx + reads * reads, d * self.xy + reads * compute
        self.n += 1

    @property
    def value(self) -> float:
        if self.n < self.MIN:
            return self.floor
        mx, my = self.x / self.w, self.y / self.w
        var = self.xx / self.w - mx * mx
        if var < self.VAR:
            return self.floor
        return min(self.CAP * self.floor, max(self.floor, (self.xy / self.w - mx * my) / var))


class Ledger:
    """Per predicted layer, the level of prediction that pays for itself: block (its mixer,
    then its router), router, or none, from what each decode step (one row) measures:

      cost    host seconds spent predicting the layer (its mixer when block, norm + router,
              the selection, the prefetch call): the median of the level's last COSTS
              steps (a step the OS took the core from is not the level's cost);
      demand  experts the layer routed to that were not resident by LRU alone (its prefetch
              hits + demand misses in the pool);
      cover   (prefetch hits - the stall acquire still spent on prefetches in flight, in
              reads) / demand, each summed as a running mean: the share of the demand its
              prefetches took off the critical path (the layer's recall so far, where it
              ran without demand);
      waste   the layer's prefetches evicted unused;
      t_miss  seconds of stall per demand-missed expert (acquires that missed, all layers;
              the pool's mean read time until one is timed);
      sent    prefetch reads the layer's prediction queued, each charged `read_cost`: the
              compute a read in flight takes from the step (ReadCost).

    A level's value per step is what it saves less what it costs,

        value = (cover * demand - WASTE * waste) * t_miss - cost - read_cost * sent   (none: 0),

    with cover and waste running means (EMA) over the steps the layer ran at that level,
    demand and t_miss over every step (so a level not running is priced at today's demand).
    After WARM steps at a level (one, when its cost is more than the level could save with
    every demand read covered: `bound`) the layer takes the level of highest value; while the
    current level's value is negative, a lower level never measured is tried first
    (block -> router -> none). A layer below its top level retries the level above for WARM
    steps after `probe` steps: PROBE at first, doubled each time the retry loses, up to
    MAX_PROBE. WASTE: a wrong read holds a reader for one read; on average half of it
    delays a demand read queued behind it. With `overlapped` (a device backend: the host
    predicts while the device runs) neither the host's time nor its reads count as cost.

    Only which experts are read ahead depends on the ledger, never the output."""

    WARM, PROBE, MAX_PROBE, EMA, WASTE, COSTS = 2, 16, 128, 0.3, 0.5, 5

    def __init__(self, layers, top: int, overlapped: bool = False):
        self.top, self.overlapped = top, overlapped
        self.level = {l: top for l in layers}
        self.costs = {l: [[] for _ in range(top + 1)] for l in layers}  # per level: its last steps' seconds
        self.saved = {l: [None] * (top + 1) for l in layers}  # per level: EMA of prefetch hits less waits
        self.served = {l: [None] * (top + 1) for l in layers}  # per level: EMA of demand
        self.waste = {l: [None] * (top + 1) for l in layers}
        self.sent = {l: [None] * (top + 1) for l in layers}  # per level: EMA of prefetch reads queued
        self.read_cost = 0.0  # compute seconds one prefetch read takes from the step (ReadCost)
        self.recall: dict[int, float] = {}  # layer -> its predictions' recall so far (the predictor's)
        self.demand: dict[int, Optional[float]] = {l: None for l in layers}
        self.t_miss: Optional[float] = None
        self.seen = {l: 0 for l in layers}  # steps measured at the current level
        self.since = {l: 0 for l in layers}  # steps since the level last changed
        self.probe = {l: self.PROBE for l in layers}
        self.probing = {l: False for l in layers}
        self.changes = 0

    def _ema(self, old, new):
        return new if old is None else (1 - self.EMA) * old + self.EMA * new

    def value(self, layer: int, level: int) -> Optional[float]:
        """Seconds per step the level saves, less its cost (None: never measured)."""
        if level == NONE:
            return 0.0
        costs, waste = self.costs[layer][level], self.waste[layer][level]
        if not costs:
            return None
        served = self.served[layer][level]
        # (no demand while it ran, so no cover measured: its recall so far stands in)
        cover = self.saved[layer][level] / served if served else self.recall.get(layer, 1.0)
        return ((cover or 0.0) * (self.demand[layer] or 0.0) - self.WASTE * (waste or 0.0)) * (self.t_miss or 0.0) \
            - self._cost(layer, level)

    def _cost(self, layer: int, level: int) -> float:
        """Seconds per step the level costs: the median of its last steps' host time (of two:
        the lower), and its reads' compute where the host is not overlapped with a device."""
        costs = self.costs[layer][level]
        cost = sorted(costs)[(len(costs) - 1) // 2] if costs else 0.0
        return cost + (0.0 if self.overlapped else self.read_cost * (self.sent[layer][level] or 0.0))

    def bound(self, layer: int, level: int) -> float:
        """The most the level could be worth: every demand read covered, none wasted (+inf
        while the stall per miss or the layer's demand is not known yet)."""
        if self.t_miss is None or self.demand[layer] is None:
            return math.inf
        return (self.demand[layer] or 0.0) * (self.t_miss or 0.0) - self._cost(layer, level)

    def step(self, used: dict, cost: dict, pool_delta: dict, sent: Optional[dict] = None) -> None:
        """One decode step done with prediction on: `used` layer -> the level it was predicted
        at, `cost` layer -> seconds spent predicting it, `pool_delta` layer -> [prefetch hits,
        demand misses, wasted, stall, stall of acquires that missed] during the step, `sent`
        layer -> the prefetch reads its prediction queued. (Steps the gate runs with prediction
        off never reach the ledger: nothing is measured then, and no layer's clock runs, or a
        layer at none would climb to its retry while nothing could measure it.)"""
        sent = sent or {}
        missed = sum(d[1] for d in pool_delta.values())
        if missed:
            self.t_miss = self._ema(self.t_miss, sum(d[4] for d in pool_delta.values()) / missed)
        t = self.t_miss or 0.0
        for layer in self.level:
            d = pool_delta.get(layer, (0, 0, 0, 0.0, 0.0))
            hits, misses, wasted, stall, miss_stall = d
            demand = hits + misses
            self.demand[layer] = self._ema(self.demand[layer], demand)
            lv = used.get(layer, NONE)
            if lv != self.level[layer]:
                continue  # (the step ran before a switch: not this level's)
            if lv != NONE:
                costs = self.costs[layer][lv]
                costs.append(0.0 if self.overlapped else cost.get(layer, 0.0))
                del costs[: -self.COSTS]
                pf_wait = (stall - miss_stall) / t if t else 0.0  # in reads
                self.saved[layer][lv] = self._ema(self.saved[layer][lv], max(0.0, hits - pf_wait))
                self.served[layer][lv] = self._ema(self.served[layer][lv], demand)
                self.waste[layer][lv] = self._ema(self.waste[layer][lv], wasted)
                self.sent[layer][lv] = self._ema(self.sent[layer][lv], sent.get(layer, 0))
            self.seen[layer] += 1
            self.since[layer] += 1
            self._decide(layer)

    def _decide(self, layer: int) -> None:
        cur = self.level[layer]
        if self.seen[layer] < self.WARM and not (cur != NONE and self.bound(layer, cur) < 0):
            return  # (a level whose cost is more than it could ever save is judged after one step)
        vals = {lv: v for lv in range(self.top + 1) if (v := self.value(layer, lv)) is not None}
        new = max(vals, key=lambda lv: (vals[lv], -lv))  # ties: the cheaper level
        if vals[cur] < 0:
            untried = [lv for lv in range(cur - 1, NONE, -1) if lv not in vals]
            if untried:
                new = untried[0]
        if new == cur and cur < self.top and self.since[layer] >= self.probe[layer]:
            new = cur + 1  # retry the level above
            self.probing[layer] = True
        elif self.probing[layer]:
            self.probing[layer] = False
            if new < cur:
                self.probe[layer] = min(2 * self.probe[layer], self.MAX_PROBE)
            else:
                self.probe[layer] = self.PROBE
        if new != cur:
            self.level[layer] = new
            self.seen[layer] = 0
            self.since[layer] = 0
            self.changes += 1


class Predictor(PauseClient):
    """Ranks the next layers' experts at each pause point and feeds the pool's prefetch queue."""

    def __init__(self, gguf, cfg, settings: PredictSettings, pool=None, host=None, overlapped: bool = False,
                 own_ok: bool = True):
        """`host`: the backend whose ops the predictor runs on the host (the model's own when
        it is a host backend: numpy or cpu; for a device backend's pool, one that reads the
        pool's slots); numpy's reference ops if None. `overlapped`: the host predicts while a
        device computes (the ledger does not count the host's time). `own_ok`: block mode may
        run the current layer's top experts on the host (see `own` below)."""
        from ..models import network_class  # (models import nothing of the predictor's)

        self.cfg, self.s, self.pool = cfg, settings, pool
        self.arch = network_class(cfg.arch, str(getattr(gguf, "path", "")))  # its router names and mixer
        self.be = host if host is not None else NumpyBackend(gguf)
        self.k = cfg.n_experts_used
        self.moe_layers = [i for i in range(cfg.n_layers) if cfg.layer_is_moe(i)]
        wanted = set(parse_layers(settings.layers, cfg.n_layers)) if settings.layers else set(self.moe_layers)
        self.targets = sorted(wanted & set(self.moe_layers))
        self.depth = max(settings.depth or self.k, settings.min or self.k)
        self.min = settings.min or self.k
        self.stats = {l: LayerStats() for l in self.targets}
        self.pending: dict[int, _Pending] = {}  # target layer -> the freshest prediction for it
        self.older: dict[int, list[tuple[int, list]]] = {}  # target -> [(distance, rows)] made further back
        self.by_distance: dict[int, list[int]] = {}  # layers ahead -> [hits, routed] (recall at that distance)
        # one scratch per predicted layer: this step's K/V of a speculative block
        # (a recurrent layer's: a copy of its conv history and state, which the speculative step moves on)
        self.scratch = {l: _recurrent_scratch(cfg) if cfg.layer_is_recurrent(l) else
                        (np.zeros((1, cfg.n_kv_heads, cfg.head_dim), np.float32),
                         np.zeros((1, cfg.n_kv_heads, cfg.head_dim_v), np.float32)) for l in self.targets}
        self.forwards = 0
        # rows from which a forward routes to PROMPT_SHARE of a layer's experts (expected): the
        # pool reads ahead for such a forward, the predictor leaves it alone (begin)
        share = (1 - self.k / cfg.n_experts) if cfg.n_experts > self.k else 0.0
        self.bulk_rows = max(2, math.ceil(math.log(1 - PROMPT_SHARE) / math.log(share))) if share > 0 else 2
        self._bulk = False
        self.gate = Gate(look=settings.look)
        self.active = True
        top = BLOCK if settings.mode == "block" and not settings.no_attn else ROUTER
        # layer l's own expert output is what block mode's residual lacks (bench_predict --why):
        # its top `own` experts are added back, for softmax-routed SwiGLU experts, where the
        # host can read them (`own_ok`: a device backend's slots in memory the host reads fast)
        self.own = min(settings.own, self.k) if (top == BLOCK and own_ok and cfg.expert_gating != "sigmoid"
                                                 and cfg.arch != "gpt-oss") else 0
        self._own_stall = 0.0
        # (the first MoE layer is never predicted: nothing runs before it)
        self.ledger = Ledger(self.targets[1:] if self.targets[:1] == self.moe_layers[:1] else self.targets,
                             top, overlapped) if pool is not None else None
        self.level = {l: top for l in self.targets}  # what each layer is predicted at now
        self._idle = False  # the ledger has every layer at none (at_pause returns at once)
        self._used: dict[int, int] = {}  # this forward: layer -> the level it was predicted at
        self._cost: dict[int, float] = {}  # this forward: layer -> host seconds predicting it
        self._pool_mark = None  # the pool's per-layer counters at this forward's start
        self._stall_mark = self._queued_mark = 0
        self._t_step = 0.0  # when this forward started
        self._spent = 0.0  # this forward: host seconds in the predictor
        self._sent: dict[int, int] = {}  # this forward: layer -> prefetch reads queued for it
        self.read_cost = ReadCost()
        self._one_row = False
        self._settle = 0  # decode steps still to go before the ledger measures (after a prompt)
        self._routers: dict[int, Optional[tuple]] = {}  # layer -> (norm weight, router [E, dim], bias) in float32
        self.trace = None
        if settings.out:
            try:
                self.trace = open(settings.out, "w", encoding="utf-8")
            except OSError as e:
                raise UsageError(f"{settings.out}: cannot write the prediction trace ({e.strerror})") from None
            self.trace.write(json.dumps({"onebit_predict_trace": 1, "mode": settings.mode, "k": self.k}) + "\n")

    # -- memory ---------------------------------------------------------------------------

    @property
    def scratch_bytes(self) -> int:
        return sum(s.nbytes if hasattr(s, "nbytes") else s[0].nbytes + s[1].nbytes for s in self.scratch.values())

    # -- the pause point ------------------------------------------------------------------

    def begin(self, rows: int = 1) -> bool:
        """A forward over `rows` rows starts: predictions left from the last one are dropped;
        the gate may switch (see Gate). Returns whether this forward's pauses have work (`pausing`)."""
        self.pending.clear()
        self.older.clear()
        self.forwards += 1
        now = time.perf_counter()
        ran, self.active = self.active, (self.gate.step(rows, self._pays, self.pool.stats.stall_seconds)
                                         if self.pool is not None else True)
        # a prompt's chunk that routes to most experts: the pool reads the next layers' ahead
        # by itself (a scan's read-ahead in ExpertPool.acquire), and predicting each of its
        # rows would only cost time
        self._bulk = self.pool is not None and rows >= self.bulk_rows
        measured = self._one_row and not self._settle  # the step that ended: a decode step the ledger counts
        self._one_row = rows == 1
        # the steps right after a prompt (or verify rows) pay for, and evict, what its many
        # rows prefetched: not the level's own figures
        self._settle = SETTLE + 1 if rows > 1 else max(0, self._settle - 1)  # (+1: the prompt's own step)
        if not ran and not self.active:
            # prediction off (the gate's) for the step that ended and this one: nothing of the
            # ledger's to measure or decide, so no bookkeeping either (the pool's counters are
            # marked again when the gate next turns prediction on)
            self._pool_mark = None
            return False
        if self.ledger is not None:
            pool = self.pool
            mark = {l: list(v) for l, v in pool.by_layer.items()}
            stall, queued = pool.stats.stall_seconds, pool.stats.prefetches
            if measured and self._pool_mark is not None:
                delta = {l: [a - b for a, b in zip(v, self._pool_mark[l])] for l, v in mark.items()}
                compute = (now - self._t_step) - (stall - self._stall_mark) - self._spent
                self.read_cost.add(queued - self._queued_mark, compute)
                self.read_cost.floor = pool.read_cpu_seconds / pool.reads if pool.reads else 0.0
                self.ledger.read_cost = self.read_cost.value
                self.ledger.step(self._used, self._cost, delta, self._sent)
            self._pool_mark, self._stall_mark, self._queued_mark = mark, stall, queued
            if self.ledger.t_miss is None and pool.reads:
                self.ledger.t_miss = pool.read_seconds / pool.reads  # until a demand miss is timed
            self.level.update(self.ledger.level)
            # every predicted layer at none: nothing to rank, score or send this forward
            self._idle = all(lv == NONE for lv in self.ledger.level.values())
            for l, st in self.stats.items():
                st.paused = self.level[l] == NONE
                if st.routed:
                    self.ledger.recall[l] = st.hits / st.routed
        self._t_step = now
        self._spent = 0.0
        self._used.clear()
        self._cost.clear()
        self._sent.clear()
        return self.pausing

    def _pays(self, step: float) -> bool:
        """Whether the ledger prices prediction at more than HOLD of a decode step (`step`
        seconds): then the gate skips its trial without prediction. A trial is one window of
        demand reads that no longer overlap compute: on the 30B-A3B shape streamed at 8 GiB,
        2675 demand misses in 24 tokens with a trial among them against 620 without one, and
        1.5-2.2 tok/s against 2.1-2.4 (bench/results/larger-than-memory-2026-12-05.md, 2026-12-05: 367bf5a against 3c6fbdb)."""
        if self.ledger is None:
            return False
        saved = sum(self.ledger.value(l, lv) or 0.0 for l, lv in self.ledger.level.items())
        return saved > HOLD * step

    @property
    def per_sequence(self) -> bool:
        """Whether its pauses read one sequence's cache: block mode runs the next layer's mixer
        over it. Router prediction reads only the rows' residual, so it ranks a forward over
        several sequences' rows too (serve --parallel: their experts' union is read ahead)."""
        return self.s.mode == "block" and not self.s.no_attn

    @property
    def pausing(self) -> bool:
        """Whether this forward's pause points have work for the predictor (when not, the
        Vulkan backend makes no host copies of h, ids and logits for it)."""
        return self.active and not self._idle and not self._bulk

    def states_ahead(self, layer: int) -> tuple[int, ...]:
        """The recurrent layers whose state before this step a block-mode prediction at
        `layer`'s pause reads (their speculative DeltaNet steps start from it)."""
        if self.s.mode != "block" or self.s.no_attn or not self.cfg.recurrent_layers:
            return ()
        i = self.moe_layers.index(layer)
        return tuple(l for l in self.moe_layers[i + 1 : i + 1 + self.s.ahead] if self.cfg.layer_is_recurrent(l))

    def at_pause(self, ctx: PauseContext, layer: int, ids: np.ndarray, logits: np.ndarray, h: np.ndarray) -> None:
        if not self.pausing:
            return
        t = time.perf_counter()
        self._own_stall = 0.0
        self._predict(ctx, layer, ids, logits, h)
        self._spent += time.perf_counter() - t - self._own_stall

    def _predict(self, ctx: PauseContext, layer: int, ids: np.ndarray, logits: np.ndarray, h: np.ndarray) -> None:
        self._score(layer, ids)
        i = self.moe_layers.index(layer)
        keep = [(layer, e) for e in set(ids.ravel().tolist())]  # what this layer routes to: never evicted
        r = h
        t0 = time.perf_counter()
        nxt = self.moe_layers[i + 1 : i + 2]
        if self.own and nxt and self.level.get(nxt[0], BLOCK) == BLOCK:
            stall = self.pool.stats.stall_seconds if self.pool is not None else 0.0
            r = h + self._own_output(layer, ids, logits, h)
            if self.pool is not None:  # (the layer's own read, moved earlier: not the prediction's cost)
                self._own_stall = self.pool.stats.stall_seconds - stall
                t0 += self._own_stall
        for j, target in enumerate(self.moe_layers[i + 1 : i + 1 + self.s.ahead]):
            level = self.level.get(target, BLOCK)  # (a layer passed through: as configured)
            if (self.s.mode == "block" and not self.s.no_attn and (j == 0 or self.s.chain)
                    and level == BLOCK):
                r = self._block(ctx, target, r)
            if target not in self.stats:
                continue
            if level == NONE:
                t0 = time.perf_counter()
                continue
            rows = self.select(self._router(target, r))
            st = self.stats[target]
            issue = j == 0 or st.precision >= AHEAD_ABOVE
            if issue and self.pool is not None:
                deep = st.deep_precision >= DEEP_ABOVE
                send = set().union(*[sel if deep else base for sel, base, _ in rows])
                self._sent[target] = self._sent.get(target, 0) + self.pool.prefetch(target, sorted(send), keep=keep)
                st.prefetched += len(send)
                st.issued += 1
            old = self.pending.get(target)
            if old is not None:
                self.older.setdefault(target, []).append((old.distance, old.rows))
            self.pending[target] = _Pending(rows, issue, j + 1)
            t1 = time.perf_counter()
            self._used[target] = level
            self._cost[target] = self._cost.get(target, 0.0) + (t1 - t0)
            t0 = t1

    def _score(self, layer: int, ids: np.ndarray) -> None:
        """Compare the pending prediction for `layer` with its routing, row by row."""
        p = self.pending.pop(layer, None)
        if p is None or layer not in self.stats:
            return
        actual = [set(int(e) for e in row) for row in ids]
        for dist, rows in [(p.distance, p.rows)] + self.older.pop(layer, []):
            acc = self.by_distance.setdefault(dist, [0, 0])
            for (sel, _, _), routed in zip(rows, actual):
                acc[0] += len(routed & sel)
                acc[1] += len(routed)
        st = self.stats[layer]
        for (sel, base, top), routed in zip(p.rows, actual):
            hit = routed & sel
            st.predictions += 1
            st.routed += len(routed)
            st.predicted += len(sel)
            st.hits += len(hit)
            st.top_hits += len(routed & top)
            st.precision = (1 - EMA) * st.precision + EMA * (len(hit) / len(sel))
            deep = sel - base
            if deep:
                st.deep_precision = (1 - EMA) * st.deep_precision + EMA * (len(routed & deep) / len(deep))
        if self.trace is not None:
            for r, ((sel, base, top), routed) in enumerate(zip(p.rows, actual)):
                self.trace.write(json.dumps({"forward": self.forwards, "row": r, "layer": layer,
                                             "predicted": sorted(sel), "top": sorted(top),
                                             "actual": sorted(routed),
                                             "issued": p.issued}) + "\n")

    # -- ranking --------------------------------------------------------------------------

    def _router(self, layer: int, r: np.ndarray) -> np.ndarray:
        """What layer's router ranks experts by, for residual r: [R, E]. Its logits; with
        sigmoid routing (GLM) the route's own selection scores (sigmoid + correction bias, -inf
        outside the chosen expert groups), so a prediction is ranked by the rule that routes."""
        fast = self._routers.get(layer, False)
        if fast is False:
            fast = self._routers[layer] = self._fast_router(layer)
        if fast is not None:  # float32 weights as they lie in the file: plain numpy, no kernel call
            g, w, b = fast
            x = r if r.dtype == np.float32 else r.astype(np.float32)
            if len(x) == 1:  # a decode step: the norm's scale as one float
                hn = x * g
                hn *= np.float32(1.0 / math.sqrt(float(x[0] @ x[0]) / x.shape[1] + self.cfg.norm_eps))
            else:
                ms = np.mean(np.square(x), axis=-1, keepdims=True, dtype=np.float32)
                hn = x / np.sqrt(ms + np.float32(self.cfg.norm_eps)) * g
            logits = np.einsum("rd,ed->re", hn, w)  # [R, E] (einsum: not BLAS, whose threads would spin
            # on the cores the cpu backend's kernels run on)
            return logits if b is None else logits + b
        be, cfg = self.be, self.cfg
        norm, router, bias = self.arch.router_names(cfg, layer)
        hn = be.rms_norm(r, be.weight(norm), cfg.norm_eps)
        logits = be.linear(hn, router)
        if bias is not None:
            logits = logits + be.weight(bias)
        if cfg.expert_gating != "sigmoid":
            return logits
        correction = f"blk.{layer}.exp_probs_b.bias"
        b = be.weight(correction) if be.has(correction) else None
        return be.selection_scores(logits, b, cfg.expert_groups, cfg.expert_groups_used)

    def _own_output(self, layer: int, ids: np.ndarray, logits: np.ndarray, h: np.ndarray) -> np.ndarray:
        """The output of layer's top `own` routed experts (weighted as routed) for residual h:
        the part of the next layer's input that is known before the layer's experts run.
        Streamed, the host backend acquires them from the pool: reads the layer needs anyway."""
        be, cfg = self.be, self.cfg
        x = be.rms_norm(h, be.weight(self.arch.router_names(cfg, layer)[0]), cfg.norm_eps)  # [R, dim]
        _, w = be.route(logits, self.k, cfg.expert_weights_norm)  # (the order of ids: by weight)
        n = self.own
        return be.experts(layer, x, np.ascontiguousarray(ids[:, :n]), np.ascontiguousarray(w[:, :n]))  # [R, dim]

    def _fast_router(self, layer: int) -> Optional[tuple]:
        """(norm weight, router [E, dim], bias) as float32 views of the file, when the router
        and its norm are stored as F32 and routing is softmax (the common case); else None."""
        cfg, g = self.cfg, self.be.gguf
        if cfg.expert_gating == "sigmoid":
            return None
        names = [n for n in self.arch.router_names(cfg, layer) if n is not None]
        if any(g.tensor(n).type_name != "F32" for n in names):
            return None
        norm, router, bias = self.arch.router_names(cfg, layer)
        arr = [np.asarray(g.tensor(n).raw).view(np.float32).reshape(g.tensor(n).shape) if n else None
               for n in (norm, router, bias)]
        return arr[0], arr[1], arr[2]

    def _block(self, ctx: PauseContext, layer: int, r: np.ndarray) -> np.ndarray:
        """r + layer's mixer over norm(r), its K/V (or its recurrent state) for these rows in the
        layer's scratch."""
        if self.cfg.layer_is_recurrent(layer):
            step = _ScratchStep(self.be, ctx, layer, None, None, self._scratch_for(layer, ctx.rows))
        else:
            step = _ScratchStep(self.be, ctx, layer, *self._scratch_for(layer, ctx.rows))
        x = self.be.rms_norm(r, self.be.weight(f"blk.{layer}.attn_norm.weight"), self.cfg.norm_eps)
        return r + self.arch.mixer(step, self.cfg, layer, x)

    def _scratch_for(self, layer: int, rows: int):
        """The layer's scratch (a decode step: the one the plan counts); transient arrays for a
        prompt chunk or verify rows, or a layer passed through on the way to a deeper target."""
        if layer in self.scratch and rows == 1:
            return self.scratch[layer]
        cfg = self.cfg
        if cfg.layer_is_recurrent(layer):
            return _recurrent_scratch(cfg)
        return (np.zeros((rows, cfg.n_kv_heads, cfg.head_dim), np.float32),
                np.zeros((rows, cfg.n_kv_heads, cfg.head_dim_v), np.float32))

    def select(self, logits: np.ndarray) -> list[tuple[set, set, set]]:
        """Per row of router logits [R, E]: (the set to read, the part always read, the top-k
        candidates): the first `min` candidates, then up to `depth` while within `margin` of
        the row's best."""
        out = []
        order = np.argsort(-logits, axis=-1, kind="stable")
        for row, o in zip(logits, order):
            best = row[o[0]]
            base = set(int(e) for e in o[: self.min])
            sel = base | {int(e) for e in o[self.min : self.depth] if best - row[e] <= self.s.margin}
            out.append((sel, base, set(int(e) for e in o[: self.k])))
        return out

    # -- reporting ------------------------------------------------------------------------

    def table(self) -> str:
        lines = [f"prediction: {self.s.mode}, {self.s.ahead} ahead, depth {self.depth}, min {self.min}",
                 "layer  recall  top-k recall  precision  predicted/row  issued  prefetched  paused"]
        tot = LayerStats()
        for l, st in self.stats.items():
            if not st.predictions:
                continue
            tot.routed += st.routed
            tot.hits += st.hits
            tot.top_hits += st.top_hits
            tot.predicted += st.predicted
            tot.predictions += st.predictions
            tot.issued += st.issued
            tot.prefetched += st.prefetched
            lines.append(f"{l:5d}  {st.recall:6.3f}  {st.top_hits / st.routed:12.3f}  "
                         f"{st.hits / st.predicted if st.predicted else 0:9.3f}  "
                         f"{st.predicted / st.predictions:13.2f}  {st.issued:6d}  {st.prefetched:10d}  "
                         f"{'yes' if st.paused else 'no'}")
        if tot.predictions:
            lines.append(f"  all  {tot.recall:6.3f}  {tot.top_hits / tot.routed:12.3f}  "
                         f"{tot.hits / tot.predicted if tot.predicted else 0:9.3f}  "
                         f"{tot.predicted / tot.predictions:13.2f}  {tot.issued:6d}  {tot.prefetched:10d}")
        for dist, (hits, routed) in sorted(self.by_distance.items()):
            if len(self.by_distance) > 1:
                lines.append(f"recall {dist} layer(s) ahead: {hits / routed:.3f}")
        return "\n".join(lines)

    def close(self) -> None:
        if self.trace is not None:
            self.trace.close()
            self.trace = None


class _ScratchStep(EagerStep):
    """numpy's eager ops for a speculative block, except attention: the rows' K/V go to the
    predicted layer's scratch, and attention reads the real cache's earlier positions (views,
    not copies) plus them."""

    def __init__(self, be, ctx: PauseContext, layer: int, k_scratch: np.ndarray, v_scratch: np.ndarray,
                 state_scratch=None):
        self.be, self.ctx, self.layer, self.pauses = be, ctx, layer, NO_PAUSES
        self.k_scratch, self.v_scratch = k_scratch, v_scratch
        self.state_scratch = state_scratch  # a recurrent layer's: its real state copied in, then moved on
        self._copied = False  # the real state is copied into the scratch on the block's first read
        self.start = ctx.start
        self.pos = np.arange(ctx.start, ctx.start + ctx.rows, dtype=np.int64)
        self.tensor_names = be.gguf.tensors

    def recurrent(self, layer: int):
        """The scratch, holding the real cache's conv history and state before these rows (read,
        never written); the speculative DeltaNet step moves the scratch on."""
        if self.ctx.states is None:
            raise ValueError("this backend's pause point gives no recurrent state to predict from")
        if not self._copied:
            real = self.ctx.states(layer)
            self.state_scratch.restore((real.conv, real.state))
            self._copied = True
        return self.state_scratch

    def stage(self, layer: int, conv=None, state=None) -> None:
        """A speculative step's new state goes straight to the scratch (nothing is committed)."""
        if conv is not None:
            self.state_scratch.conv[...] = conv
        if state is not None:
            self.state_scratch.state[...] = state

    def attention(self, layer, q, k, v, window=0, scale=None, sinks=None):
        """Causal GQA over the cache's first `start` positions and these rows: scores for both
        parts, one softmax (with the sinks, gpt-oss, as one more column), two weighted sums."""
        self.k_scratch[...] = k
        self.v_scratch[...] = v
        s = self.ctx.start
        kc, vc = self.ctx.keys(layer), self.ctx.values(layer)  # position p in row p % len (a ring)
        lo = max(0, s - window + 1) if window > 0 else 0
        if s <= kc.shape[0]:
            kc, vc = kc[lo:s], vc[lo:s]  # views of the real cache
        else:  # a sliding-window ring: its positions, in order
            rows = np.arange(lo, s) % kc.shape[0]
            kc, vc = kc[rows], vc[rows]
        s = s - lo  # positions lo .. start-1 read
        R, H, D = q.shape
        Hkv = k.shape[1]
        qg = q.reshape(R, Hkv, H // Hkv, D).transpose(1, 2, 0, 3)  # [Hkv, G, R, D]
        scale = np.float32(1.0 / np.sqrt(D) if scale is None else scale)
        # (einsum, not matmul: BLAS's threads would spin on the cores the cpu kernels run on)
        sc = np.einsum("hgrd,shd->hgrs", qg, kc) * scale  # [Hkv, G, R, s]
        sn = np.einsum("hgrd,shd->hgrs", qg, self.k_scratch) * scale  # [Hkv, G, R, R]
        mask_n = np.arange(R)[None, :] > np.arange(R)[:, None]  # causal among the rows
        if window > 0:
            sc = np.where(np.arange(lo, lo + s)[None, :] <= self.pos[:, None] - window, np.float32(-np.inf), sc)
            mask_n |= self.pos[None, :] <= self.pos[:, None] - window
        sn = np.where(mask_n, np.float32(-np.inf), sn)
        if sinks is None:
            p = self.be.softmax(np.concatenate([sc, sn], axis=-1))
        else:
            sink = np.broadcast_to(self.be.weight(sinks).reshape(Hkv, H // Hkv, 1, 1), (*sc.shape[:3], 1))
            p = self.be.softmax(np.concatenate([sc, sn, sink], axis=-1))[..., :-1]
        out = np.einsum("hgrs,shd->hgrd", p[..., s:], self.v_scratch)  # [Hkv, G, R, Dv]
        if s:  # (no earlier positions, a prompt's first chunk: no einsum over an empty axis, whose
            # output was seen holding another array's old bytes, NaN among them, now and then)
            out = np.einsum("hgrs,shd->hgrd", p[..., :s], vc) + out
        return out.transpose(2, 0, 1, 3).reshape(R, H * v.shape[2])
