"""Generation is a generator: prefill the prompt in chunks, then decode one token at a time."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator, Optional, Sequence

import numpy as np

from .lookup import DraftPolicy, LookupStats, NgramDrafter
from .pause import PhasedHook
from .sample import LogitsProcessor, Sampler, as_sampler

if TYPE_CHECKING:
    from .runner import Decoder


@dataclass
class GenerationResponse:
    text: str  # new text since the previous response (complete UTF-8 only)
    token: Optional[int]  # the token just generated (None on a final flush)
    finish_reason: Optional[str]  # None while running; then "stop" or "length"
    prompt_tokens: int
    generation_tokens: int
    prompt_time: float  # seconds until the first token (prompt pass + first sample)
    generation_time: float  # seconds after the first token
    reasoning: str = ""  # harmony chats (gpt-oss): new reasoning text; `text` is then the reply only

    @property
    def prompt_tps(self) -> float:
        return self.prompt_tokens / self.prompt_time if self.prompt_time > 0 else 0.0

    @property
    def generation_tps(self) -> float:
        # The first token comes out of the prompt pass; decode speed counts the ones after it.
        n = self.generation_tokens - 1
        return n / self.generation_time if self.generation_time > 0 and n > 0 else 0.0


def generate_step(
    net: "Decoder", prompt: Sequence[int], cache, sampler: Sampler | Callable[[np.ndarray], int],
    processors: Sequence[LogitsProcessor] = (), prefill_chunk: int = 256, hook=None, history: Sequence[int] = (),
    lookup: int = 0, max_tokens: Optional[int] = None, max_positions: Optional[int] = None, stats: Optional[LookupStats] = None,
) -> Iterator[int]:
    """Yield sampled tokens until the caller stops; the cache holds the context (`history`:
    tokens already in the cache before `prompt`, seen by the logits processors). `sampler`: a
    Sampler, or any callable of the logits (sample.as_sampler).

    With `lookup` > 0, each decode forward also verifies up to that many drafted tokens (n-gram
    lookup in the context) in one forward over 1 + drafts rows; the tokens yielded are exactly
    those plain decoding yields (greedy), or distributed exactly as its draws (sampling). When
    the caller stops, the cache holds what plain decoding's would: every yielded token but the
    last. `max_tokens` / `max_positions` bound the drafts (no row past what can be used).

    Plain greedy decoding (no drafts, hook or logits processors) runs a step ahead on the
    device where the backend offers it (`net.greedy_steps`): the same tokens, the host's work
    per token overlapping the device's next step."""
    sampler = as_sampler(sampler)
    phased = hook if isinstance(hook, PhasedHook) else None  # a routing trace marks prompt and decode tokens
    tokens = list(history) + list(prompt)
    ids = np.asarray(prompt, dtype=np.int64)
    base = cache.offset + len(ids)  # positions held once the prompt is in
    stats = stats if stats is not None else LookupStats()
    lookup = max(lookup, 0)
    # A cache with recurrent layers cannot trim: a verify forward is preceded by a checkpoint,
    # and a rejected draft rolls back to it and runs the accepted rows again.
    rollback = lookup and not cache.can_trim
    point = None  # (checkpoint, the rows run after it) of the last verify forward
    drafter = NgramDrafter(tokens) if lookup else None
    # row-count timings, accept rates and the gate outlive one generation where the runner keeps them.
    # A seeded draw is not: a row's logits differ in the last bits with the rows beside it
    # (batched kernels sum in another order), so a draw near the edge of a probability would
    # follow the timings; its draft counts come from this generation's tokens alone.
    seeded = not sampler.greedy and sampler.seed is not None
    if not lookup:
        policy = None
    elif seeded:
        policy = DraftPolicy(fixed=True)
    else:
        policy = DraftPolicy(times=net.draft_times, learned=net.draft_learned)
    made = 0  # tokens the last decode forward produced
    yielded = 0
    logits = None
    chain = None  # greedy steps queued ahead on the device
    if phased is not None:
        phased.phase = "prompt"
    for start in range(0, len(ids), prefill_chunk):
        chunk = ids[start : start + prefill_chunk]
        logits = net.forward(chunk, cache, hook=hook, last_only=True)  # [1, vocab]

    def process(row):
        for proc in processors:
            row = proc(tokens, row)
        return row

    try:
        tok = sampler(process(logits[-1]))
        if drafter is None and hook is None and not processors and sampler.greedy:
            chain = net.greedy_steps(cache, max_positions)
        while True:
            tokens.append(tok)
            if drafter is not None:
                drafter.push(tok)
            yielded += 1
            yield tok
            if phased is not None:
                phased.phase = "decode"
            if chain is not None:
                nxt = chain.step(tok)
                if nxt is not None:
                    stats.forwards += 1
                    stats.tokens += 1
                    tok = nxt
                    continue
                chain = None  # (the context's end: nothing queued; the forward below says so)
            room = lookup
            if max_tokens is not None:
                room = min(room, max_tokens - yielded)
            if max_positions is not None:
                room = min(room, max_positions - cache.offset - 1)
            drafts = []
            if drafter is not None:
                drafts, lengths = drafter.propose_matched(lookup)
                drafts = drafts[: min(policy.choose(tokens, drafts, lengths), max(room, 0))]
            rows = np.asarray([tok, *drafts], dtype=np.int64)
            point = (cache.checkpoint(), rows) if rollback and drafts else None
            if policy is not None:
                policy.started(made)
            made = 1
            t0 = time.perf_counter()
            logits = net.forward(rows, cache, hook=hook, last_only=not drafts)  # [1 + drafts, vocab]
            spent = time.perf_counter() - t0
            if policy is not None and point is None:
                policy.timed(len(rows), spent)
            stats.forwards += 1
            stats.proposed += len(drafts)
            for i, d in enumerate(drafts):
                ok, tok = sampler.verify(process(logits[i]), d)
                stats.tokens += 1
                if not ok:
                    t0 = time.perf_counter()
                    _drop_rows(net, cache, len(drafts) - i, point, hook)  # the rows after the rejected draft
                    if point is not None:  # a rollback runs the kept rows again: part of the verify's cost
                        policy.timed(len(rows), spent + time.perf_counter() - t0)
                        point = None
                    break
                stats.accepted += 1
                made += 1
                tokens.append(d)
                drafter.push(d)
                yielded += 1
                yield d
            else:
                tok = sampler(process(logits[-1]))
                stats.tokens += 1
                if point is not None:  # every draft accepted: no rollback
                    policy.timed(len(rows), spent)
    finally:
        if chain is not None:
            chain.close()  # the step queued past the last token yielded: trimmed below
        # Stopped inside accepted drafts (a stop string, max tokens, an interrupt): drop the
        # rows past the last token yielded, as if they had never been proposed.
        keep = base + max(yielded - 1, 0)
        if cache.offset > keep and (cache.can_trim or point is not None):
            _drop_rows(net, cache, cache.offset - keep, point, hook)


def _drop_rows(net, cache, n: int, point, hook=None) -> None:
    """Take the last n rows out of the cache: trim, or (recurrent state) roll back to the
    checkpoint before the verify forward and run the rows to keep again."""
    if cache.can_trim:
        cache.trim(n)
        return
    checkpoint, rows = point
    keep = cache.offset - n - checkpoint[0]
    cache.rollback(checkpoint)
    if keep > 0:
        net.forward(rows[:keep], cache, hook=hook, last_only=True)


def _stop_cut(text: str, stops: Sequence[str]) -> tuple[int, bool]:
    """(how much of `text` is safe to emit, whether a stop string was found)."""
    best = None
    for s in stops:
        i = text.find(s)
        if i >= 0 and (best is None or i < best):
            best = i
    if best is not None:
        return best, True
    # Hold back a tail that could be the start of a stop string.
    hold = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:n]):
                hold = max(hold, n)
                break
    return len(text) - hold, False


def stream_generate(
    model, prompt_ids: Sequence[int], *, max_tokens: int, sampler: Sampler,
    processors: Sequence[LogitsProcessor] = (), stop: Sequence[str] = (), cache=None, hook=None,
    prompt_prefix: Sequence[int] = (), lookup: int = 0, lookup_stats: Optional[LookupStats] = None,
    net: Optional["Decoder"] = None,
) -> Iterator[GenerationResponse]:
    """Yield text pieces as tokens arrive; stops on EOS, a stop string, max_tokens or a full context.
    `prompt_prefix`: tokens the given cache already holds, in front of `prompt_ids`. `lookup`:
    drafts verified per decode forward (0 = plain decoding), counted in `lookup_stats`. `net`:
    what runs the forwards (default `model.net`; serve's parallel slots: a share of a batch)."""
    cache = model.new_cache() if cache is None else cache
    ctx = model.context_length
    n_prompt = len(prompt_prefix) + len(prompt_ids)
    t0 = time.perf_counter()
    net = model.net if net is None else net
    steps = generate_step(net, prompt_ids, cache, sampler, processors, hook=hook, history=prompt_prefix,
                          lookup=lookup, max_tokens=max_tokens, max_positions=ctx, stats=lookup_stats)
    try:
        yield from _responses(model, steps, max_tokens, stop, n_prompt, t0)
    finally:
        steps.close()  # settles the cache (drafts past the last token dropped) before the caller looks


def _responses(model, steps, max_tokens, stop, n_prompt, t0) -> Iterator[GenerationResponse]:
    ctx = model.context_length
    decoder = model.tokenizer.stream()
    t_prompt = 0.0
    pending = ""  # decoded text not yet emitted (held back for stop strings)
    n_gen = 0
    finish = None
    if max_tokens <= 0 or n_prompt >= ctx:
        finish = "length"
    guard = model.guard
    final_tok = None  # the last token, when it ends generation but belongs to the output
    while finish is None:
        guard.check()
        tok = next(steps)
        if n_gen == 0:
            t_prompt = time.perf_counter() - t0
            t1 = time.perf_counter()
        n_gen += 1
        if tok in model.tokenizer.stop_ids:
            finish = "stop"
            pending += decoder.flush()
            break
        pending += decoder.push(tok)
        cut, hit = _stop_cut(pending, stop)
        if hit:
            pending = pending[:cut]
            finish, final_tok = "stop", tok
            break
        if n_gen >= max_tokens or n_prompt + n_gen >= ctx:
            finish, final_tok = "length", tok
            pending += decoder.flush()
            break
        text, pending = pending[:cut], pending[cut:]
        yield GenerationResponse(text, tok, None, n_prompt, n_gen, t_prompt, time.perf_counter() - t1)
    steps.close()
    gen_time = time.perf_counter() - t1 if n_gen else 0.0
    yield GenerationResponse(pending, final_tok, finish, n_prompt, n_gen, t_prompt, gen_time)
