"""Serve's parallel slots: the requests decoding together share each forward (continuous batching).

Each running request keeps its own thread, its own cache and the generation loop a request
has alone (generate.stream_generate: sampling, stops, max tokens, logprobs, grammars); only
its forwards go through the `Batcher`, whose thread owns the model's forwards. A step runs
once every request in the batch has handed in its rows (a decode token, a prompt chunk,
verify rows), as one `Runner.forward_batch`: the linear and expert ops see every row
together, so a streamed expert is read once for all the requests routed to it. A request
joins at the next step and leaves when it ends; no step waits for one that has left. A step
holds at most `step_rows` rows (the memory plan's count): the fewest-row hand-ins first, and a
prompt chunk that does not fit rides in the next step.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Optional

import numpy as np

from ..runner import Decoder


class _Turn:
    """One request's rows handed in for the next step, or a call to run between steps."""

    def __init__(self, ids=None, cache=None, last_only: bool = False, fn: Optional[Callable[[], Any]] = None):
        self.ids, self.cache, self.last_only, self.fn = ids, cache, last_only, fn
        self.result: Any = None
        self.error: Optional[BaseException] = None
        self.done = False


class Batcher:
    """Runs the forwards of the requests that `join`ed as one step each, on a thread of its own.
    `model()` gives the loaded model (it changes only while no request runs); a step runs at
    most `step_rows` rows, or one hand-in of more."""

    def __init__(self, model: Callable[[], Any], step_rows: int):
        self.model, self.step_rows = model, step_rows
        self.cond = threading.Condition()
        self.members = 0  # requests in the batch: a step waits for each of them to hand in rows
        self.rows: list[_Turn] = []  # rows handed in for the next step
        self.calls: list[_Turn] = []  # work to run between steps (embeddings)
        self.closed = False
        self.steps = 0  # forwards run
        self.shared = 0  # of them, forwards over the rows of several requests
        self.thread = threading.Thread(target=self._loop, name="onebit-serve-batch", daemon=True)
        self.thread.start()

    def join(self) -> None:
        with self.cond:
            self.members += 1

    def leave(self) -> None:
        with self.cond:
            self.members -= 1
            self.cond.notify_all()

    def forward(self, ids, cache, last_only: bool) -> np.ndarray:
        """The logits of a member's rows, once the step they ride in has run."""
        return self._wait(_Turn(np.asarray(ids, dtype=np.int64), cache, last_only), self.rows)

    def call(self, fn: Callable[[], Any]) -> Any:
        """fn() run on the batch's thread between steps (it may run forwards of its own)."""
        return self._wait(_Turn(fn=fn), self.calls)

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()
        self.thread.join(5.0)

    def _wait(self, turn: _Turn, queue: list) -> Any:
        with self.cond:
            if self.closed:
                raise RuntimeError("the batch is closed")
            queue.append(turn)
            self.cond.notify_all()
            while not turn.done:
                self.cond.wait()
        if turn.error is not None:
            raise turn.error
        return turn.result

    def _ready(self) -> bool:
        return bool(self.calls) or (bool(self.rows) and len(self.rows) >= self.members)

    def _step_turns(self) -> list[_Turn]:
        """The hand-ins the next step runs (taken out of `rows`): fewest rows first, within step_rows."""
        take, n = [], 0
        for t in sorted(self.rows, key=lambda t: len(t.ids)):  # (stable: arrival order among equals)
            if not take or n + len(t.ids) <= self.step_rows:
                take.append(t)
                n += len(t.ids)
        taken = {id(t) for t in take}
        self.rows = [t for t in self.rows if id(t) not in taken]
        return take

    def _loop(self) -> None:
        while True:
            with self.cond:
                while not self.closed and not self._ready():
                    self.cond.wait()
                if self.closed:
                    for t in self.rows + self.calls:
                        t.error, t.done = RuntimeError("the batch is closed"), True
                    self.cond.notify_all()
                    return
                if self.calls:
                    turns = [self.calls.pop(0)]
                else:
                    turns = self._step_turns()
            try:
                if turns[0].fn is not None:
                    turns[0].result = turns[0].fn()
                else:
                    m = self.model()
                    logits = m.net.forward_batch([(t.ids, t.cache) for t in turns], hook=m.hook,
                                                 last_only=[t.last_only for t in turns])
                    self.steps += 1
                    self.shared += len(turns) > 1
                    for t, lg in zip(turns, logits):
                        t.result = lg
            except BaseException as e:  # noqa: BLE001 - each request of the step raises it on its own thread
                for t in turns:
                    t.error = e
            with self.cond:
                for t in turns:
                    t.done = True
                self.cond.notify_all()


class BatchedDecoder(Decoder):
    """A request's share of the batch, driven by generation as it drives a Runner: `forward`
    hands the rows to the batcher and waits for their logits. The hook is the batch's (the
    model's): a step's pause points serve every request in it."""

    def __init__(self, batcher: Batcher):
        self.batcher = batcher

    def forward(self, ids, cache, hook=None, last_only: bool = False) -> np.ndarray:
        return self.batcher.forward(ids, cache, last_only)


__all__ = ["Batcher", "BatchedDecoder"]
