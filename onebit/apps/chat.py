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

from ..cache import PrefixCache
from ..errors import UsageError
from ..generate import GenerationResponse, stream_generate
from ..lookup import DEFAULT_DRAFTS, LookupStats, lookup_budget
from ..sample import make_logits_processors, make_sampler
from ..chat_formats.think import reply_splitter


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
        self.prefix = PrefixCache(model.new_cache())  # the conversation so far, reused turn to turn
        self.last = TurnStats()
        self.total_generated = 0
        self.lookup = lookup_budget(lookup, default=0 if model.hook is not None else DEFAULT_DRAFTS)
        self.lookup_stats = LookupStats()  # over the whole conversation

    def reset(self) -> None:
        self.history.clear()
        self.prefix.clear()

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
        prefix = self.prefix
        common = prefix.reuse(ids)
        stats = TurnStats(prompt_tokens=len(ids), prompt_tokens_computed=len(ids) - common, dropped_turns=dropped)
        self.last = stats
        reply: list[str] = []
        generated: list[int] = []
        self.history.append({"role": "assistant", "content": ""})
        t0 = time.perf_counter()
        ahead = 0.0
        replies = None
        splitter = reply_splitter(self.model, ids)  # harmony channels or a <think> block (think.py)
        try:
            held = prefix.prefill(self.model.net, ids, common, hook=self.model.hook)  # (recurrent state)
            if held != common:
                ahead = time.perf_counter() - t0
            replies = stream_generate(self.model, ids[held:], max_tokens=self.max_tokens, sampler=self.sampler,
                                      processors=self.processors, cache=prefix.cache, prompt_prefix=ids[:held],
                                      hook=self.model.hook, lookup=self.lookup, lookup_stats=self.lookup_stats)
            for r in replies:
                if splitter is not None:  # the reply's text, and its reasoning apart
                    thinking, text = splitter.feed(r.text, final=r.finish_reason is not None)
                    r = dataclasses.replace(r, text=text, reasoning=thinking)
                    if splitter.thinking:
                        self.history[-1][splitter.history_key] = splitter.thinking
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
            prefix.settle(ids + generated)
