"""A two-state switch (on / off) decided by measured speed, for policies that only change how
work is done, never its result (routing prediction, lookup drafts)."""

from __future__ import annotations

from typing import Optional


class SpeedGate:
    """Runs whichever state has measured faster. The caller times its work in windows and
    hands each window's figure (seconds per unit of output: lower is better) to `window`; the
    figure goes to a running mean (weight 1 - DECAY for the newest) for the state it ran in.
    The gate starts on; every EXPLORE-th window it switches to the other state for one window
    (so off is first tried after EXPLORE windows, and a state measured slower costs at most
    about 1 / EXPLORE of the difference); otherwise it takes the faster state once both have
    a mean. `state` (a dict) holds what it learned, so a caller can keep it across runs."""

    def __init__(self, explore: int, decay: float, state: Optional[dict] = None):
        self.explore, self.decay = explore, decay
        self.state = {} if state is None else state
        self.state.setdefault("on", True)
        self.state.setdefault("mean", {True: None, False: None})
        self.state.setdefault("windows", 0)

    @property
    def on(self) -> bool:
        return self.state["on"]

    @property
    def windows(self) -> int:
        return self.state["windows"]

    @property
    def mean(self) -> dict:
        return self.state["mean"]

    def window(self, figure: float) -> bool:
        """A window measured in the current state; True if the gate switched state."""
        s, cur = self.state, self.state["on"]
        old = s["mean"][cur]
        s["mean"][cur] = figure if old is None else self.decay * old + (1 - self.decay) * figure
        s["windows"] += 1
        other = not cur
        if s["windows"] % self.explore == 0:
            nxt = other
        elif s["mean"][other] is None:
            nxt = cur
        else:
            nxt = min((True, False), key=lambda k: s["mean"][k])
        s["on"] = nxt
        return nxt != cur
