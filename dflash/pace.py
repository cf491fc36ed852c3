"""The pace of an attempt: every step's time against the best pace the attempt has held, written on each `step`
event (`pace`, `pace_ref_s`) so opsctl can say when a week-long run got slower and by how much.

Why in the trainer: it sees every step, while a client may see a thinned backlog (watch) or the last steps (status);
the ratio travels in the event, so status, watch and the wrapper's notify read one number (opsctl/remote/rules.py
`slowdown` holds the threshold). Why medians of windows: one slow step (a page fault, a neighbour's burst) is no
slowdown; a throttled GPU, another job on the same GPUs or a degraded link is, and it lasts. Why the best window and
not the first: an attempt that settled while a neighbour's job shared its GPUs would otherwise take the slow pace as
its norm, and the next slow spell after the neighbour left would never be said.
"""

from __future__ import annotations

import collections
import statistics

SETTLE_S = 300.0  # wall seconds after the attempt's first step before the reference is taken (allocator, evaluations)
WINDOW = 100  # steps in the reference and in the recent window


class Pace:
    """Feed it each step's time (`note`); `fields()` is what the step event carries once the reference exists."""

    def __init__(self, settle_s: float | None = None, window: int | None = None) -> None:
        self.settle_s = SETTLE_S if settle_s is None else settle_s
        self.window = WINDOW if window is None else window
        self.start: float | None = None  # when the attempt's first step ended (that step compiled: never counted)
        self.first: list[float] = []  # the reference window's step times
        self.ref: float | None = None  # the fastest median of `window` steps held since (the first window's at first)
        self.recent: collections.deque[float] = collections.deque(maxlen=window)

    def note(self, step_time_s: float, now: float) -> None:
        if self.start is None:
            self.start = now
            return
        if now - self.start < self.settle_s:
            return
        if self.ref is None:
            self.first.append(step_time_s)
            if len(self.first) == self.window:
                self.ref = statistics.median(self.first)
            return
        self.recent.append(step_time_s)
        if len(self.recent) == self.window:
            self.ref = min(self.ref, statistics.median(self.recent))

    def fields(self) -> dict[str, float]:
        """`pace`: the median of the last `window` steps over the reference (1.0 = as fast as the attempt's best, 1.3 =
        30 % slower); `pace_ref_s`: the reference, seconds per step. Empty until both windows are full."""
        if self.ref is None or self.ref <= 0 or len(self.recent) < self.window:
            return {}
        return {"pace": round(statistics.median(self.recent) / self.ref, 3), "pace_ref_s": round(self.ref, 4)}
