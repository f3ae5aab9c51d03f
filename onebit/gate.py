"""A two-state switch (on / off) decided by measured speed, for policies that only change how
work is done, never its result (routing prediction, lookup drafts)."""

from __future__ import annotations

from typing import Optional


class SpeedGate:
    """Runs whichever state has measured faster. The caller times its work in windows and
    hands each window's figure (seconds per unit of output: lower is better) to `window`; the
    figure goes to a running mean (weight 1 - DECAY for the newest) for the state it ran in.
    The gate starts on. After `first` windows (default EXPLORE) it switches to the other state
    for one window, an exploration; after an exploration, and otherwise every window once both
    states have a mean, it takes the faster one. The next exploration comes EXPLORE windows
    after the last; each one that leaves the gate where it was doubles that gap, up to `cap`
    windows (default EXPLORE: a fixed gap), and a switch sets it back to EXPLORE. So a state
    measured slower costs at most about 1 / EXPLORE of the difference, and less the longer it
    keeps losing. `state` (a dict) holds what it learned, so a caller can keep it across runs."""

    def __init__(self, explore: int, decay: float, state: Optional[dict] = None,
                 first: Optional[int] = None, cap: Optional[int] = None):
        self.explore, self.decay = explore, decay
        self.cap = max(explore, cap or explore)
        self.state = {} if state is None else state
        self.state.setdefault("on", True)
        self.state.setdefault("mean", {True: None, False: None})
        self.state.setdefault("windows", 0)
        self.state.setdefault("next", first or explore)  # the window count at which to explore
        self.state.setdefault("gap", explore)
        self.state.setdefault("trial", None)  # the state an exploration left, while it runs

    @property
    def on(self) -> bool:
        return self.state["on"]

    @property
    def windows(self) -> int:
        return self.state["windows"]

    @property
    def mean(self) -> dict:
        return self.state["mean"]

    def window(self, figure: float, hold: bool = False) -> bool:
        """A window measured in the current state; True if the gate switched state. `hold`:
        the caller's own measurements say the current state wins by far, so an exploration due
        now is skipped, as if it had run and lost (the gap doubles)."""
        s, cur = self.state, self.state["on"]
        old = s["mean"][cur]
        s["mean"][cur] = figure if old is None else self.decay * old + (1 - self.decay) * figure
        s["windows"] += 1
        faster = cur if s["mean"][not cur] is None else min((True, False), key=lambda k: s["mean"][k])
        if s["trial"] is not None:  # an exploration ends: it won (gap back to EXPLORE) or not (doubled)
            s["gap"] = self.explore if faster != s["trial"] else min(2 * s["gap"], self.cap)
            s["next"] = s["windows"] + s["gap"] - 1  # (the trial was one window of the gap)
            s["trial"] = None
            nxt = faster
        elif s["windows"] >= s["next"] and hold:
            s["gap"] = min(2 * s["gap"], self.cap)
            s["next"] = s["windows"] + s["gap"]
            nxt = cur
        elif s["windows"] >= s["next"]:
            s["trial"] = cur
            nxt = not cur
        else:
            nxt = faster
            if nxt != cur:  # the means crossed (a loaded machine, a state that got cheaper)
                s["gap"], s["next"] = self.explore, s["windows"] + self.explore
        s["on"] = nxt
        return nxt != cur
