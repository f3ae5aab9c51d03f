"""A chat conversation over one model: history, prefix reuse of the KV cache, context limits.

Each turn renders the whole conversation with the chat template, keeps the longest prefix
already in the cache, and feeds only the rest. When the conversation no longer fits the
context, the oldest turns are dropped down to half the context (the system message stays),
so the next turns reuse the cache again, and the caller is told.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Iterator, Optional

import numpy as np

from .cache import MAX_CHECKPOINTS
from .errors import UsageError
from .harmony import HarmonyStream, is_harmony
from .think import think_stream
from .generate import GenerationResponse, stream_generate
from .lookup import DEFAULT_DRAFTS, LookupStats, lookup_budget
from .sample import make_logits_processors, make_sampler


@dataclass
class TurnStats:
    prompt_tokens: int = 0  # tokens in the rendered conversation
    prompt_tokens_computed: int = 0  # tokens actually run (the rest came from the cache)
    generation_tokens: int = 0
    prompt_time: float = 0.0
    generation_time: float = 0.0
    finish_reason: Optional[str] = None
    dropped_turns: int = 0

    @property
    def prompt_tps(self) -> float:
        return self.prompt_tokens_computed / self.prompt_time if self.prompt_time > 0 else 0.0

    @property
    def generation_tps(self) -> float:
        # Same convention as GenerationResponse: the first token belongs to the prompt pass.
        n = self.generation_tokens - 1
        return n / self.generation_time if self.generation_time > 0 and n > 0 else 0.0




class ChatSession:
    def __init__(self, model, system: Optional[str] = None, max_tokens: int = 512, temperature: float = 0.7,
                 top_k: int = 0, top_p: float = 0.95, min_p: float = 0.05, repetition_penalty: float = 1.0,
                 seed: Optional[int] = None, lookup: Optional[int] = None):
        self.model = model
        self.system = system
        self.max_tokens = max_tokens
        self.sampler = make_sampler(temperature, top_p, min_p, top_k, seed)
        self.processors = make_logits_processors(repetition_penalty)
        self.history: list[dict[str, str]] = []
        self.cache = model.new_cache()
        self.cached: list[int] = []  # the tokens whose K/V the cache holds, in order
        self.last = TurnStats()
        self.total_generated = 0
        self.lookup = lookup_budget(lookup, default=0 if model.hook is not None else DEFAULT_DRAFTS)
        self.lookup_stats = LookupStats()  # over the whole conversation
        self.harmony = is_harmony(model)  # gpt-oss: replies in channels (harmony.py)
        # A cache with recurrent state cannot trim: it can only go back to positions where a
        # checkpoint was taken (the end of each prompt but its last token, the end of each
        # turn), so the prefix reused is the longest of those within the common prefix.
        self.checkpoints: list = []

    def reset(self) -> None:
        self.history.clear()
        if self.cache.can_trim:
            self.cache.trim(len(self.cached))
        else:
            self.cache.clear()
            self.checkpoints = []
        self.cached = []

    def _reuse(self, common: int) -> int:
        """Keep the first `common` cached tokens (or, for a cache that cannot trim, the longest
        checkpointed prefix within them); returns how many were kept."""
        if self.cache.can_trim:
            if not self.cache.can_trim_to(common):  # a sliding-window ring no longer holds what the
                common = 0  # prefix's end reads: run the prefix again
            self.cache.trim(len(self.cached) - common)
            return common
        if self.cache.offset <= common:
            return self.cache.offset
        self.checkpoints = [c for c in self.checkpoints if c[0] <= common]
        if self.checkpoints:
            self.cache.rollback(self.checkpoints[-1])
        else:
            self.cache.clear()
        return self.cache.offset

    def messages(self) -> list[dict[str, str]]:
        return ([{"role": "system", "content": self.system}] if self.system else []) + self.history

    def _fit(self, history: list[dict[str, str]]) -> tuple[list[int], int]:
        """Tokens of the conversation, dropping the oldest turns of `history` (in place) if it
        does not fit with room to reply. A drop changes what follows the system message, so the
        turn after it runs the whole rest again; it therefore drops down to half the context (as
        llama.cpp's context shift does), and the next turns again run only what they add until
        the context is full again (dropping just enough would re-run everything every turn)."""
        ctx = self.model.context_length
        room = min(self.max_tokens, max(ctx // 4, 1))
        system = [{"role": "system", "content": self.system}] if self.system else []
        dropped = 0
        target = ctx
        while True:
            ids = self.model.chat_tokens(system + history)
            if len(ids) + room <= target or len(history) <= 1:
                break
            target = ctx // 2
            # drop the oldest user turn and the reply that followed it
            del history[:2 if len(history) > 2 else 1]
            dropped += 1
        if len(ids) >= ctx:
            raise UsageError(f"the message is {len(ids)} tokens, longer than the {ctx}-token context; not sent "
                             f"(shorten it, or use a larger --ctx)")
        return ids, dropped

    def send(self, text: str) -> Iterator[GenerationResponse]:
        """Add a user message and stream the reply. If the caller stops early (Ctrl-C), the partial
        reply is kept in the history and the cache stays consistent. A message that cannot fit is
        refused with the history untouched."""
        if not text.strip():
            raise UsageError("empty message")
        history = self.history + [{"role": "user", "content": text}]
        ids, dropped = self._fit(history)
        self.history[:] = history
        common = 0
        for a, b in zip(self.cached, ids):
            if a != b:
                break
            common += 1
        common = min(common, len(ids) - 1)  # always run at least one token to get logits
        common = self._reuse(common)
        self.cached = ids[:common]
        stats = TurnStats(prompt_tokens=len(ids), prompt_tokens_computed=len(ids) - common, dropped_turns=dropped)
        self.last = stats
        reply: list[str] = []
        generated: list[int] = []
        self.history.append({"role": "assistant", "content": ""})
        t0 = time.perf_counter()
        ahead = 0.0
        replies = None
        channels = HarmonyStream() if self.harmony else None
        think = None if self.harmony else think_stream(self.model, ids)  # <think> blocks (think.py)
        try:
            if not self.cache.can_trim and len(ids) - common > 1:
                # recurrent state: run the prompt but its last token first and checkpoint there (the
                # next turn's rendering starts with this prompt, whatever the reply turns out to be)
                common = self._prefill(ids, common)
                ahead = time.perf_counter() - t0
            replies = stream_generate(self.model, ids[common:], max_tokens=self.max_tokens, sampler=self.sampler,
                                      processors=self.processors, cache=self.cache, prompt_prefix=ids[:common],
                                      hook=self.model.hook, lookup=self.lookup, lookup_stats=self.lookup_stats)
            for r in replies:
                if channels is not None:  # the reply's text, and its reasoning apart
                    thinking, text = channels.feed(r.text, final=r.finish_reason is not None)
                    r = dataclasses.replace(r, text=text, reasoning=thinking)
                    if channels.thinking:
                        self.history[-1]["thinking"] = channels.thinking
                elif think is not None:  # the reply apart from its <think> block
                    thinking, text = think.feed(r.text, final=r.finish_reason is not None)
                    r = dataclasses.replace(r, text=text, reasoning=thinking)
                    if think.thinking:
                        self.history[-1]["reasoning_content"] = think.thinking
                reply.append(r.text)
                self.history[-1]["content"] = "".join(reply)
                if r.token is not None:
                    generated.append(r.token)
                stats.prompt_time = r.prompt_time + ahead
                stats.generation_time = r.generation_time
                stats.generation_tokens = r.generation_tokens
                stats.finish_reason = r.finish_reason
                yield r
        finally:
            if replies is not None:
                replies.close()  # the cache settles (drafts past the last token dropped) before we look
            if stats.finish_reason is None:
                stats.finish_reason = "interrupted"
                stats.generation_time = max(time.perf_counter() - t0 - stats.prompt_time, 0.0)
            self.total_generated += stats.generation_tokens
            self._settle(ids + generated)

    def _prefill(self, ids: list[int], common: int, chunk: int = 256) -> int:
        """Run ids[common:-1] into the cache and checkpoint after them; returns how many it holds."""
        hook = self.model.hook
        if hasattr(hook, "phase"):
            hook.phase = "prompt"
        rest = np.asarray(ids[common:-1], dtype=np.int64)
        for start in range(0, len(rest), chunk):
            self.model.net.forward(rest[start : start + chunk], self.cache, hook=hook, last_only=True)
            self.cached = ids[: self.cache.offset]
        self._checkpoint()
        return self.cache.offset

    def _checkpoint(self) -> None:
        if self.cache.offset and (not self.checkpoints or self.checkpoints[-1][0] < self.cache.offset):
            self.checkpoints = self.checkpoints[-(MAX_CHECKPOINTS - 1):] + [self.cache.checkpoint()]

    def _settle(self, fed: list[int]) -> None:
        """Record which tokens the cache holds after a turn (an interrupted step adds none: the
        sequence's length moves only when a forward pass completes)."""
        self.cached = fed[: self.cache.offset]
        if not self.cache.can_trim:
            self._checkpoint()
