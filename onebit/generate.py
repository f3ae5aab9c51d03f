"""Generation is a generator: prefill the prompt in chunks, then decode one token at a time."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

import numpy as np

from .sample import LogitsProcessor, Sampler


@dataclass
class GenerationResponse:
    text: str  # new text since the previous response (complete UTF-8 only)
    token: Optional[int]  # the token just generated (None on a final flush)
    finish_reason: Optional[str]  # None while running; then "stop" or "length"
    prompt_tokens: int
    generation_tokens: int
    prompt_time: float  # seconds until the first token (prompt pass + first sample)
    generation_time: float  # seconds after the first token

    @property
    def prompt_tps(self) -> float:
        return self.prompt_tokens / self.prompt_time if self.prompt_time > 0 else 0.0

    @property
    def generation_tps(self) -> float:
        # The first token comes out of the prompt pass; decode speed counts the ones after it.
        n = self.generation_tokens - 1
        return n / self.generation_time if self.generation_time > 0 and n > 0 else 0.0


def generate_step(
    net, prompt: Sequence[int], cache, sampler: Sampler, processors: Sequence[LogitsProcessor] = (),
    prefill_chunk: int = 256, hook=None, history: Sequence[int] = (),
) -> Iterator[int]:
    """Yield sampled tokens forever; the caller decides when to stop. The cache holds the context
    (`history`: tokens already in the cache before `prompt`, seen by the logits processors)."""
    tokens = list(history) + list(prompt)
    ids = np.asarray(prompt, dtype=np.int64)
    logits = None
    if hasattr(hook, "phase"):  # a routing trace marks prompt and decode tokens
        hook.phase = "prompt"
    for start in range(0, len(ids), prefill_chunk):
        chunk = ids[start : start + prefill_chunk]
        logits = net.forward(chunk, cache, hook=hook, last_only=True)  # [1, vocab]
    while True:
        row = logits[-1]
        for proc in processors:
            row = proc(tokens, row)
        tok = sampler(row)
        tokens.append(tok)
        yield tok
        if hasattr(hook, "phase"):
            hook.phase = "decode"
        logits = net.forward(np.asarray([tok], dtype=np.int64), cache, hook=hook, last_only=True)


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
    prompt_prefix: Sequence[int] = (),
) -> Iterator[GenerationResponse]:
    """Yield text pieces as tokens arrive; stops on EOS, a stop string, max_tokens or a full context.
    `prompt_prefix`: tokens the given cache already holds, in front of `prompt_ids`."""
    cache = model.new_cache() if cache is None else cache
    ctx = model.context_length
    n_prompt = len(prompt_prefix) + len(prompt_ids)
    decoder = model.tokenizer.stream()
    t0 = time.perf_counter()
    t_prompt = 0.0
    pending = ""  # decoded text not yet emitted (held back for stop strings)
    n_gen = 0
    finish = None
    steps = generate_step(model.net, prompt_ids, cache, sampler, processors, hook=hook, history=prompt_prefix)
    if max_tokens <= 0 or n_prompt >= ctx:
        finish = "length"
    guard = getattr(model, "guard", None)
    final_tok = None  # the last token, when it ends generation but belongs to the output
    while finish is None:
        if guard is not None:
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
