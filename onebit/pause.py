"""The MoE pause point: where the host may act between a layer's router and its experts.

One protocol for every backend. A forward gets a `Pauses` (made by the network from its hook
and predictor) and calls, in this order:

    begin(rows)                     once per forward (or per chunk of rows the backend runs)
    at_pause(layer, ids, logits)    at each MoE layer it pauses at, before the layer's experts
    predict(ctx, layer, ids, logits, h)   after at_pause, when `predicting`; a device backend
                                    calls it while the device already runs the next segment
    observe(layer, ids, logits)     for a hook that only observes (`needs_pause = False`):
                                    at the pause on a host backend, after the step on a device

Which layers pause: every MoE layer when a client acts there (`acting`), else only those
whose experts stream (the expert source's, memory/pool.py). What a client may read: the
rows' routing and router logits, the residual stream h at the pause, and (through the
`PauseContext`) the real cache's earlier positions, read only; recurrent layers' states only
as they were before the step (`states_ahead` says which a predictor needs, so a device
backend copies them before it moves them on). The expert pool is reached through the
backend's expert source, not through here: its acquire is the experts op's own first step.
"""

from __future__ import annotations

from typing import Callable, Optional

import numpy as np

# hook(layer, ids [R, k], logits [R, E]), called at the pause point of MoE layer `layer`. A hook
# may set `needs_pause = False` (it only observes: a recorded step may call it after the
# experts ran) and may have `drain()`, work it put off, called while a device runs a step.
ExpertHook = Callable[[int, np.ndarray, np.ndarray], None]


class PhasedHook:
    """A hook told which tokens the forwards that follow run (a routing trace marks them):
    generation sets `phase` to "prompt" before the prompt and to "decode" after it."""

    phase = "prompt"


class PauseContext:
    """What a client gets at a pause point besides the routing: the rows' first position and
    count, and views of the real cache's earlier keys and values (read only)."""

    def __init__(self, start: int, rows: int, keys, values, states=None):
        self.start, self.rows = start, rows
        self.keys, self.values = keys, values  # layer -> [S, Hkv, D] arrays, position p in row p % S
        self.states = states  # layer -> its RecurrentCache (conv, state) before these rows (hybrid models)


class PauseClient:
    """A client that acts at pause points (the routing predictor). Defaults: acts every forward,
    reads no recurrent state ahead, reads one sequence's cache (`per_sequence`: a forward over
    several sequences' rows, which has no one cache, does not call it)."""

    per_sequence = True

    def begin(self, rows: int) -> bool:
        """A forward over `rows` rows starts; whether this client has work at its pauses."""
        return True

    def states_ahead(self, layer: int) -> tuple[int, ...]:
        """Recurrent layers whose state (as before this step) the client reads at `layer`'s pause."""
        return ()

    def at_pause(self, ctx: PauseContext, layer: int, ids: np.ndarray, logits: np.ndarray, h: np.ndarray) -> None:
        raise NotImplementedError


class Pauses:
    """The clients of one forward's pause points: a hook and a predictor, either may be None."""

    def __init__(self, hook: Optional[ExpertHook] = None, predictor: Optional[PauseClient] = None):
        self.hook, self.predictor = hook, predictor
        # (a hook is any callable: `needs_pause` is its one optional attribute, read here only)
        self.observing = hook is not None and not getattr(hook, "needs_pause", True)
        self.hook_acts = hook is not None and not self.observing
        self.predicting = False  # set by begin(): the predictor has work this forward

    @property
    def acting(self) -> bool:
        """Whether a client acts at every MoE layer (the forward pauses there)."""
        return self.hook_acts or self.predictor is not None

    @property
    def drain(self):
        """The hook's put-off work, which a device backend may run while a step computes; or None."""
        return getattr(self.hook, "drain", None) if self.hook is not None else None

    def layers(self, cfg, streamed: frozenset) -> frozenset:
        """The layers this forward pauses at: the streamed ones, and every MoE layer when a client acts."""
        if self.acting:
            return streamed | {i for i in range(cfg.n_layers) if cfg.layer_is_moe(i)}
        return streamed

    def begin(self, rows: int) -> None:
        self.predicting = self.predictor is not None and self.predictor.begin(rows)

    def at_pause(self, layer: int, ids: np.ndarray, logits: np.ndarray) -> None:
        if self.hook_acts:
            self.hook(layer, ids, logits)

    def predict(self, ctx: PauseContext, layer: int, ids: np.ndarray, logits: np.ndarray, h: np.ndarray) -> None:
        if self.predicting:
            self.predictor.at_pause(ctx, layer, ids, logits, h)

    def observe(self, layer: int, ids: np.ndarray, logits: np.ndarray) -> None:
        if self.observing:
            self.hook(layer, ids, logits)

    def states_ahead(self, layer: int) -> tuple[int, ...]:
        return self.predictor.states_ahead(layer) if self.predicting else ()


NO_PAUSES = Pauses()
