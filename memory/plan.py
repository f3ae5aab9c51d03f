"""The memory plan: every byte the engine will hold, from the GGUF header alone.

Modules report their own needs (the KV cache, the backend's scratch); this is the one place
that adds them up, fits expert slots into what is left, and says whether the whole fits.
Nothing here allocates.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Optional

from onebit.backends.base import Backend, MemoryPolicy
from onebit.cache import (F32_KV, MAX_CHECKPOINTS, SWA_ROWS, KVTypes, kv_cache_bytes, layer_positions,
                          recurrent_state_bytes, scratch_kv_bytes, scratch_state_bytes)
from onebit.config import ModelConfig, layer_of
from onebit.errors import OnebitError, UsageError
from onebit.formats.gguf_file import EXPERT_PARTS, GGUFFile

from .budget import Budget, format_bytes

PREFILL_ROWS = 256  # rows per prefill chunk (onebit.generate's default)
DEFAULT_CONTEXT = 4096  # the context a load gets when none is asked for (at most the model's)
# What a process holds before any model byte: the interpreter, numpy, numba with LLVM and the
# loaded kernels, the pool's reader threads. Measured: 242 MiB RSS after loading the shipped
# model on the cpu backend (its 5 MiB of weights included), 247 MiB after generating.
RUNTIME_BYTES = 256 << 20
RESIDENT_SHARE = 0.9  # a load holds every expert resident only when that plan takes <= 90% of the budget
CONTEXT_SHARE = 0.25  # a default context may take at most this share of what the expert slots get ...
DEFAULT_PROMPT_CACHE = 8 << 30  # serve's saved prefixes (--cache-ram) at most, by default (llama-server's 8192 MiB)
MIN_CONTEXT = 1024  # ... shrinking by halves, not below this (nor below what the caller asked for)
_EXPERT_RE = re.compile(r"^blk\.(\d+)\.(ffn_(?:gate|up|down)_exps)\.weight$")


class PlanError(OnebitError):
    """The memory plan does not fit the budget: refused before anything is loaded."""

    exit_code = 1

    def __init__(self, plan: "MemoryPlan"):
        self.plan = plan
        advice = "; ".join(plan.advice) or "raise --budget"
        super().__init__(f"{plan.model}: the memory plan needs {format_bytes(plan.total)} but the budget is "
                         f"{format_bytes(plan.budget.bytes)} ({plan.budget.source}): {advice}")


def parse_layers(spec: str, n_layers: int) -> list[int]:
    """'1,2,5-9,47' -> sorted layer indices; every one must be a layer of the model."""
    out: set[int] = set()
    if spec is None or not spec.strip():
        return []
    for part in spec.split(","):
        part = part.strip()
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if not m:
            raise UsageError(f"bad --layers item {part!r}: use numbers and ranges like 1,2,5-9,47")
        lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
        if hi < lo:
            raise UsageError(f"bad --layers range {part!r}: the end is before the start")
        if hi >= n_layers:
            raise UsageError(f"--layers {part!r} is out of range: the model has layers 0-{n_layers - 1}")
        out.update(range(lo, hi + 1))
    return sorted(out)


@dataclass(frozen=True)
class SizeClass:
    """Experts whose three parts have the same byte size share slots."""

    expert_bytes: int
    types: tuple[str, str, str]
    layers: tuple[int, ...]
    experts: int  # experts of this class in the whole model


@dataclass
class PlanItem:
    component: str
    bytes: int
    detail: str = ""


@dataclass
class MemoryPlan:
    model: str
    budget: Budget
    items: list[PlanItem]
    classes: list[SizeClass]
    slots: list[int]  # per size class
    min_slots: int
    all_experts: int
    ctx: int
    layers: list[int]
    verify_rows: int
    advice: list[str] = field(default_factory=list)

    decision: str = ""  # what a load does with this plan, in one line (plan_load)
    sequences: int = 1  # caches of the whole context held at once (serve --parallel)

    @property
    def total(self) -> int:
        return sum(i.bytes for i in self.items)

    @property
    def fits(self) -> bool:
        return self.total <= self.budget.bytes and sum(self.slots) >= self.min_slots

    @property
    def streaming(self) -> bool:
        return sum(self.slots) < self.all_experts

    def to_dict(self) -> dict:
        return {
            "model": self.model,
            "budget_bytes": self.budget.bytes,
            "budget_source": self.budget.source,
            "device_heap_bytes": self.budget.device_heap,
            "max_allocation_bytes": self.budget.max_allocation,
            "max_storage_range_bytes": self.budget.max_storage_range,
            "total_bytes": self.total,
            "fits": self.fits,
            "streaming": self.streaming,
            "ctx": self.ctx,
            "sequences": self.sequences,
            "predicted_layers": self.layers,
            "verify_rows": self.verify_rows,
            "slots": sum(self.slots),
            "min_slots": self.min_slots,
            "all_experts": self.all_experts,
            "size_classes": [
                {"expert_bytes": c.expert_bytes, "types": list(c.types), "layers": list(c.layers),
                 "experts": c.experts, "slots": n}
                for c, n in zip(self.classes, self.slots)
            ],
            "items": [{"component": i.component, "bytes": i.bytes, "detail": i.detail} for i in self.items],
            "advice": self.advice,
            "decision": self.decision,
        }

    def table(self) -> str:
        b = self.budget.bytes
        w = max(len(i.component) for i in self.items)
        lines = [f"model   {self.model}", f"budget  {format_bytes(b)} ({self.budget.source})"]
        if self.budget.max_allocation:
            lines.append(f"device  largest allocation {format_bytes(self.budget.max_allocation)}, largest binding "
                         f"{format_bytes(self.budget.max_storage_range)}")
        lines.append("")
        lines.append(f"{'component':<{w}}  {'bytes':>12}  {'share':>6}  detail")
        for i in self.items:
            share = f"{100 * i.bytes / b:5.1f}%" if b else "   -  "
            lines.append(f"{i.component:<{w}}  {format_bytes(i.bytes):>12}  {share:>6}  {i.detail}")
        lines.append(f"{'total':<{w}}  {format_bytes(self.total):>12}  "
                     f"{(100 * self.total / b if b else 0):5.1f}%")
        lines.append("")
        mode = (f"streaming, {sum(self.slots)} of {self.all_experts} experts in slots" if self.streaming
                else f"all {self.all_experts} resident" if self.all_experts else "none (dense model)")
        lines.append(f"experts {mode}")
        if self.decision:
            lines.append(f"load    {self.decision}")
        if self.fits:
            lines.append(f"verdict FITS: {format_bytes(self.total)} of {format_bytes(b)}")
        else:
            lines.append(f"verdict DOES NOT FIT: needs {format_bytes(self.total)}, budget {format_bytes(b)}")
            lines += [f"  - {a}" for a in self.advice]
        return "\n".join(lines)


def size_classes(g: GGUFFile, policy: Optional[MemoryPolicy] = None) -> list[SizeClass]:
    """Experts grouped by the bytes of their parts as a backend holds them (`policy`, its
    backends.base.MemoryPolicy for this file; None: as the file has them)."""
    policy = policy if policy is not None else MemoryPolicy(Backend, g)
    per_layer: dict[int, dict[str, tuple[int, str, int]]] = {}
    for t in g.tensors.values():
        m = _EXPERT_RE.match(t.name)
        if m:
            n = policy.held_bytes(t) // t.shape[0]
            per_layer.setdefault(int(m.group(1)), {})[m.group(2)] = (n, t.type_name, t.shape[0])
    groups: dict[tuple, list[int]] = {}
    counts: dict[tuple, int] = {}
    for layer, parts in sorted(per_layer.items()):
        if set(parts) != set(EXPERT_PARTS):
            continue
        key = (sum(parts[p][0] for p in EXPERT_PARTS), tuple(parts[p][1] for p in EXPERT_PARTS))
        groups.setdefault(key, []).append(layer)
        counts[key] = counts.get(key, 0) + parts["ffn_gate_exps"][2]
    return [SizeClass(k[0], k[1], tuple(v), counts[k]) for k, v in sorted(groups.items(), key=lambda kv: kv[1][0])]


def make_plan(g: GGUFFile, cfg: ModelConfig, budget: Budget, ctx: Optional[int] = None, layers: str = "",
              slots: str | int = "auto", verify_rows: int = 8, kv: KVTypes = F32_KV,
              policy: Optional[MemoryPolicy] = None, sequences: int = 1, prompt_cache: int = 0) -> MemoryPlan:
    """The plan at one context and slot count. `policy`: the backend's answers for this file
    (`Backend.memory_policy`: the bytes it holds for each tensor, its scratch, whether it runs on
    the host); None: the file's tensors as they are, read in place on the host. `kv`: the types
    the KV cache stores keys and values in (its bytes per position). `sequences`: caches held at
    once (serve's --parallel), each of the whole context. `prompt_cache`: bytes of the prefixes
    serve saves beside them (--cache-ram)."""
    policy = policy if policy is not None else MemoryPolicy(Backend, g)
    ctx = cfg.context_length if ctx is None else ctx
    if ctx < 1 or ctx > cfg.context_length:
        raise UsageError(f"--ctx {ctx} is out of range: the model supports 1-{cfg.context_length}")
    if verify_rows < 1:
        raise UsageError(f"verify rows must be >= 1, got {verify_rows}")
    if sequences < 1:
        raise UsageError(f"--parallel must be at least 1, got {sequences}")
    predicted = parse_layers(layers, cfg.n_layers)
    classes = size_classes(g, policy)
    expert_names = {t for t in g.tensors if _EXPERT_RE.match(t)}
    resident = [t for t in g.tensors.values() if t.name not in expert_names]
    by_type: dict[str, int] = {}
    for t in resident:
        by_type[t.type_name] = by_type.get(t.type_name, 0) + t.n_bytes
    detail = ", ".join(f"{k} {format_bytes(v)}" for k, v in sorted(by_type.items(), key=lambda kv: -kv[1]))
    grown = sum(policy.held_bytes(t) - t.n_bytes for t in resident)  # (layouts of the backend's own)
    if grown:
        detail += f"; matrices repacked for the {policy.backend.name} kernels: +{format_bytes(grown)}"
    items = [PlanItem("runtime", RUNTIME_BYTES, "interpreter, numpy, numba and the loaded kernels (measured)"),
             PlanItem("resident weights", sum(by_type.values()) + grown, detail)]
    kv_detail = _kv_detail(cfg, ctx) + ("" if kv.plain else f"; keys {kv.k}, values {kv.v}")
    items.append(PlanItem("KV cache", sequences * kv_cache_bytes(cfg, ctx, kv),
                          (f"{sequences} sequences x " if sequences > 1 else "") + kv_detail))
    # a cache of ggml blocks: one layer's keys and values decoded to float32 for its attention
    kv_decoded = 0 if kv.plain else ctx * cfg.n_kv_heads * (cfg.head_dim + cfg.head_dim_v) * 4
    # sequences decoded together: a step holds one prompt chunk and the others' verify rows
    rows, others = min(PREFILL_ROWS, ctx), (sequences - 1) * (verify_rows + 1)
    items.append(PlanItem("compute scratch", policy.scratch_bytes(cfg, rows + others, ctx) + policy.decoded_bytes()
                          + kv_decoded, f"{rows}-row prefill chunk"
                          + (f" + {others} rows of the other sequences" if others else "")
                          + (", a layer's K/V decoded" if kv_decoded else "")))
    # a predicted layer: one decode row's activations, and its scratch K/V (moe/predict.py)
    per_pred = policy.scratch_bytes(cfg, 1, ctx) + scratch_kv_bytes(cfg)
    pred_bytes = per_pred * len(predicted)
    if cfg.recurrent_layers:  # a DeltaNet layer's scratch is a copy of its state, not one row's K/V
        per_pred = policy.scratch_bytes(cfg, 1, ctx)
        pred_bytes = sum(per_pred + scratch_state_bytes(cfg, l) for l in predicted)
        per_pred = pred_bytes // max(len(predicted), 1)
    items.append(PlanItem("predicted-layer scratch", pred_bytes,
                          f"{len(predicted)} layer(s) x {format_bytes(per_pred)}" if predicted else "no --layers"))
    if not policy.backend.runs_on_host and predicted:
        # the predictor runs on the host beside a device backend: the cpu kernels' runtime, and
        # the weights it reads through the file's map (each predicted layer's mixer and router,
        # its FFN norm), resident pages of this process (measured on the 30B-A3B shape at 8 GiB:
        # peak RSS 8.17 GiB without prediction, 8.77 GiB with block prediction, before this item)
        host = sum(t.n_bytes for t in resident if layer_of(t.name) in predicted
                   and ("ffn" not in t.name or t.name.endswith(("ffn_gate_inp.weight", "ffn_norm.weight"))))
        items.append(PlanItem("predictor on the host", RUNTIME_BYTES + host,
                              f"cpu kernels' runtime + {format_bytes(host)} of weights read through the map"))
    items.append(PlanItem("verify scratch", policy.scratch_bytes(cfg, verify_rows, ctx, all_logits=True),
                          f"{verify_rows} rows"))
    if cfg.recurrent_layers:  # constant per sequence, whatever its length
        state = recurrent_state_bytes(cfg)
        per = f" x {sequences} sequences" if sequences > 1 else ""
        items.append(PlanItem("recurrent state", sequences * state,
                              f"{len(cfg.recurrent_layers)} DeltaNet layers, per sequence (not per token){per}"))
        # copies to roll back to (a state cannot trim): a chat's checkpoints and lookup's one
        n = MAX_CHECKPOINTS + 1
        items.append(PlanItem("recurrent checkpoints", sequences * n * state,
                              f"{n} x {format_bytes(state)}{per} (chat prefix reuse, lookup rollback)"))
    if prompt_cache:
        items.append(_prompt_cache_item(prompt_cache, sequences))
    fixed = sum(i.bytes for i in items)
    all_experts = sum(c.experts for c in classes)
    k = max(cfg.n_experts_used, 1)
    min_slots = k * len(classes)  # one layer's top-k in each size class
    advice: list[str] = []
    if classes:
        if slots == "auto" or slots is None:
            left = max(budget.bytes - fixed, 0)
            counts = _fit_slots(classes, left, k)
        else:
            try:
                n = int(slots)
            except ValueError:
                raise UsageError(f"--slots must be a number or auto, got {slots!r}") from None
            if n < min_slots:
                raise UsageError(f"--slots {n} is below the minimum of {min_slots} "
                                 f"(top-{k} experts of one layer{' per size class' if len(classes) > 1 else ''})")
            counts = _split_slots(classes, min(n, all_experts), k)
        counts = [min(c, cl.experts) for c, cl in zip(counts, classes)]
        slot_bytes = sum(n * c.expert_bytes for n, c in zip(counts, classes))
        detail = ", ".join(f"{n} x {format_bytes(c.expert_bytes)} ({'/'.join(c.types)})" for n, c in zip(counts, classes))
        items.append(PlanItem("expert slots", slot_bytes, detail))
    else:
        counts = []
    plan = MemoryPlan(g.path, budget, items, classes, counts, min_slots if classes else 0, all_experts, ctx,
                      predicted, verify_rows, advice, sequences=sequences)
    if not plan.fits:
        over = plan.total - budget.bytes
        if classes and sum(counts) > min_slots and slots not in ("auto", None):
            advice.append(f"use fewer expert slots (--slots {min_slots} is the minimum; each costs "
                          f"{format_bytes(classes[0].expert_bytes)})")
        if sequences > 1:
            advice.append(f"decode fewer sequences together (--parallel {sequences}: each holds "
                          f"{format_bytes(_item(items, 'KV cache') // sequences)} of KV cache)")
        if prompt_cache:
            advice.append(f"keep fewer saved prefixes (--cache-ram {prompt_cache >> 20})")
        if ctx > 512:
            advice.append(f"use a shorter context (--ctx): the KV cache costs {format_bytes(_item(items, 'KV cache'))}")
        if predicted:
            advice.append(f"predict fewer layers (--layers): {format_bytes(_item(items, 'predicted-layer scratch'))}")
        if fixed > budget.bytes:
            advice.append(f"everything but the expert slots needs {format_bytes(fixed)}: more memory is needed "
                          f"(with these slots the plan is short by {format_bytes(over)})")
    return plan


def _item(items: list[PlanItem], component: str) -> int:
    return next(i.bytes for i in items if i.component == component)


def plan_load(g: GGUFFile, cfg: ModelConfig, budget: Budget, ctx: Optional[int] = None, layers: str = "",
              slots: str | int | None = None, verify_rows: int = 8, policy: Optional[MemoryPolicy] = None,
              predict_when_streaming: bool = False, sequences: int = 1, kv: KVTypes = F32_KV,
              prompt_cache: Optional[int] = 0) -> MemoryPlan:
    """The plan a load follows (`onebit.load`, chat, generate, bench, serve) and `onebit plan`
    prints: the same function, so they agree.

    - Every expert resident when that whole plan takes at most RESIDENT_SHARE of the budget
      (the file's pages must stay in memory beside everything else), the default context
      halving for it down to MIN_CONTEXT (a 30B-A3B at Q4_K_M on 24 GiB: 4096 -> 2048, where
      streaming 6098 of its 6144 experts decoded 9.2-10.8 tok/s against 12.2-13.0 resident,
      bench/results/larger-than-memory-2026-12-05.md, 2026-12-05 at 31d7b3c); otherwise experts stream through as
      many slots as fit (`slots` overrides the count).
    - `ctx` None: the default context, min(model's, DEFAULT_CONTEXT); when streaming it halves
      while the context's memory (KV cache and attention scratch) takes more than
      CONTEXT_SHARE of what the expert slots get, or while the plan does not fit, down to
      MIN_CONTEXT. Why: a slot holds one expert of 2-12 MiB, a context of 4096 tokens costs a
      30B-A3B 768 MiB of f32 KV, about 260 slots; the hit rate of routing with little reuse
      grows with the share of experts in slots (bench/results/larger-than-memory-2026-12-05.md has the
      cache-sim figures), so context past what a user asked for is paid in decode speed.
    - `ctx` given: kept as asked; a plan that cannot fit it is refused by the caller (PlanError).
    - `predict_when_streaming`: routing prediction is on when the plan streams (a load's
      default): a streamed plan reserves every MoE layer's prediction scratch.
    - `policy`: the backend's memory policy for this file, and `kv` the KV cache's types, as
      for make_plan (a quantized cache leaves the expert slots more room).
    - `sequences`: caches held at once (serve's --parallel N: N caches of the whole context).
    - `prompt_cache`: bytes for the prefixes serve saves beside them (--cache-ram), counted like
      the caches; None: what the plan leaves within RESIDENT_SHARE of the budget, at most
      DEFAULT_PROMPT_CACHE (none where experts stream: the room is theirs), added last.
    `decision` says what was chosen in one line.
    """
    if prompt_cache is not None and prompt_cache < 0:
        raise UsageError(f"--cache-ram must be at least 0 MiB, got {prompt_cache >> 20}")
    explicit = prompt_cache or 0
    plan = _plan_load(g, cfg, budget, ctx, layers, slots, verify_rows, policy, sequences, kv, explicit)
    if predict_when_streaming and plan.streaming and not layers:
        every = ",".join(str(i) for i in range(cfg.n_layers) if cfg.layer_is_moe(i))
        plan = _plan_load(g, cfg, budget, ctx, every, slots, verify_rows, policy, sequences, kv, explicit)
    if prompt_cache is None:
        room = int(RESIDENT_SHARE * budget.bytes) - plan.total
        plan.items.append(_prompt_cache_item(min(DEFAULT_PROMPT_CACHE, max(room, 0)) if not plan.streaming else 0,
                                             sequences))
    return plan


def _prompt_cache_item(n: int, sequences: int) -> PlanItem:
    return PlanItem("prompt cache", n, f"prefixes saved beside the {sequences} sequence caches (--cache-ram "
                    f"{n >> 20}), least recently used dropped first" if n else "no saved prefixes (--cache-ram 0)")


def prompt_cache_bytes(plan: MemoryPlan) -> int:
    """Bytes the plan holds for serve's saved prefixes (0: none)."""
    return next((i.bytes for i in plan.items if i.component == "prompt cache"), 0)


def _plan_load(g, cfg, budget, ctx, layers, slots, verify_rows, policy, sequences: int = 1,
               kv: KVTypes = F32_KV, prompt_cache: int = 0) -> MemoryPlan:
    if slots is not None and slots != "auto":
        plan = make_plan(g, cfg, budget, ctx=ctx if ctx is not None else _default_ctx(cfg), layers=layers,
                         slots=slots, verify_rows=verify_rows, policy=policy, sequences=sequences, kv=kv,
                         prompt_cache=prompt_cache)
        plan.decision = _decision(plan, None)
        return plan
    asked = ctx
    ctx = ctx if ctx is not None else _default_ctx(cfg)
    plan = make_plan(g, cfg, budget, ctx=ctx, layers=layers, slots="auto", verify_rows=verify_rows, policy=policy,
                     sequences=sequences, kv=kv, prompt_cache=prompt_cache)
    if plan.classes:
        c = ctx
        while True:  # every expert resident within the margin, the default context halving for it
            everything = make_plan(g, cfg, budget, ctx=c, layers=layers, slots=plan.all_experts,
                                   verify_rows=verify_rows, policy=policy, sequences=sequences, kv=kv,
                                   prompt_cache=prompt_cache)
            if everything.total <= RESIDENT_SHARE * budget.bytes:
                everything.decision = _decision(everything, ctx if c != ctx else None, "every expert stays resident")
                return everything
            if asked is not None or c <= min(MIN_CONTEXT, ctx):
                break
            c = max(c // 2, min(MIN_CONTEXT, ctx))
        if not plan.streaming:  # everything fits, but not with the margin: the slots that fit within it
            within = make_plan(g, cfg, dataclasses.replace(budget, bytes=int(RESIDENT_SHARE * budget.bytes)),
                               ctx=ctx, layers=layers, slots="auto", verify_rows=verify_rows, policy=policy,
                               sequences=sequences, kv=kv, prompt_cache=prompt_cache)
            plan = make_plan(g, cfg, budget, ctx=ctx, layers=layers, slots=max(sum(within.slots), within.min_slots),
                             verify_rows=verify_rows, policy=policy, sequences=sequences, kv=kv,
                             prompt_cache=prompt_cache)
    first = ctx
    while asked is None and ctx > min(MIN_CONTEXT, first) and plan.streaming and (
            not plan.fits or _context_bytes(plan) > CONTEXT_SHARE * _item(plan.items, "expert slots")):
        smaller = make_plan(g, cfg, budget, ctx=max(ctx // 2, min(MIN_CONTEXT, first)), layers=layers, slots="auto",
                            verify_rows=verify_rows, policy=policy, sequences=sequences, kv=kv,
                            prompt_cache=prompt_cache)
        ctx, plan = smaller.ctx, smaller
    plan.decision = _decision(plan, first if ctx != first else None)
    return plan


def _default_ctx(cfg: ModelConfig) -> int:
    return min(DEFAULT_CONTEXT, cfg.context_length)


def _context_bytes(plan: MemoryPlan) -> int:
    """What the context costs: its KV cache (the prompt's attention scratch is tiled, so it does
    not grow with the context)."""
    return _item(plan.items, "KV cache")


def _decision(plan: MemoryPlan, reduced_from: Optional[int], why: str = "the experts keep their share") -> str:
    b = f"budget {format_bytes(plan.budget.bytes)} ({plan.budget.source})"
    if not plan.classes:
        what = "all weights resident"
    elif not plan.streaming:
        what = f"all {plan.all_experts} experts resident"
    else:
        what = (f"streaming experts: {sum(plan.slots)} of {plan.all_experts} in slots "
                f"({format_bytes(_item(plan.items, 'expert slots'))})")
    ctx = f"context {plan.ctx}" + (f" for each of {plan.sequences} sequences" if plan.sequences > 1 else "") + \
        (f" (reduced from {reduced_from} so {why})" if reduced_from else "")
    return f"{what}, {ctx}, {b}"


def _kv_detail(cfg: ModelConfig, ctx: int) -> str:
    """'N tokens x L layers' (attention layers: a hybrid model's DeltaNet layers keep no K/V), and
    the sliding-window layers' rings (min(ctx, window + rows - 1))."""
    attn = cfg.attention_layers
    swa = [i for i in attn if cfg.layer_window(i) > 0]
    full = len(attn) - len(swa)
    kind = "attention " if cfg.recurrent_layers else ""
    if not swa:
        return f"{ctx} tokens x {full} {kind}layers"
    ring = layer_positions(cfg, swa[0], ctx)
    windows = sorted({cfg.layer_window(i) for i in swa})
    return (f"{ctx} tokens x {full} layers, {ring} x {len(swa)} sliding-window layers "
            f"(window {'/'.join(map(str, windows))} + {SWA_ROWS - 1})")


def _split_slots(classes: list[SizeClass], n: int, floor: int = 1) -> list[int]:
    """n slots shared among size classes in proportion to their experts, each at least `floor`."""
    total = sum(c.experts for c in classes)
    counts = [min(max(n * c.experts // total, floor), c.experts) for c in classes]
    i = 0
    while sum(counts) < n:
        if counts[i % len(classes)] < classes[i % len(classes)].experts:
            counts[i % len(classes)] += 1
        i += 1
    return counts


def _fit_slots(classes: list[SizeClass], left: int, floor: int) -> list[int]:
    """The most slots (split in proportion to each class's experts) whose bytes fit in `left`;
    the minimum (`floor` per class) when not even that fits, so the plan reports the shortfall."""
    total = sum(c.experts for c in classes)
    lo, hi = floor * len(classes), total
    cost = lambda n: sum(k * c.expert_bytes for k, c in zip(_split_slots(classes, n, floor), classes))
    if cost(lo) > left:
        return _split_slots(classes, lo, floor)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if cost(mid) <= left:
            lo = mid
        else:
            hi = mid - 1
    return _split_slots(classes, lo, floor)
