"""Which steps to track: all of them on CUDA (allocator counters are nearly free), a
budgeted sample on CPU (the dispatch-level tracker makes a tiny model's step ~1.6x slower).

A CPU step is tracked when fewer than two steps have been measured since the techniques
changed (a fresh optimizer makes its state during the first step, so only the second shows
the peak every later step has), else only when its extra cost fits the session's
``OverheadBudget``. Untracked steps report the last measurement, marked ``measured=False``.
"""

from __future__ import annotations

from ..overhead import OverheadBudget

_SMOOTHING = 0.3  # weight of the newest step in the running step-time averages


class MemorySampler:
    MODES = ("sampled", "every_step", "off")

    def __init__(self, budget: OverheadBudget, mode: str = "sampled") -> None:
        self.budget = budget
        self.mode = mode
        self.stale = True  # nothing measured under the current techniques
        self._tracked_s: float | None = None
        self._plain_s: float | None = None

    STEADY_AFTER = 2  # tracked steps after a change before its measurement is the steady one

    @property
    def stale(self) -> bool:
        """Whether the current techniques still lack a measurement of a steady step."""
        return self._unmeasured > 0

    @stale.setter
    def stale(self, value: bool) -> None:
        self._unmeasured = self.STEADY_AFTER if value else 0

    @property
    def mode(self) -> str:
        return self._mode

    @mode.setter
    def mode(self, value: str) -> None:
        if value not in self.MODES:
            raise ValueError(f"memory tracking {value!r} is not one of {', '.join(self.MODES)}.")
        self._mode = value

    def should_track(self, device_type: str, sampled: bool) -> bool:
        if self.mode == "off":
            return False
        if self.mode == "every_step" or device_type == "cuda" or not sampled or self.stale:
            return True
        return self.budget.allows(self._extra_cost())

    def tracks_every_step(self, device_type: str) -> bool:
        """Whether every step is tracked now, whatever the budget (steps taken several to a
        command, ``RanksTrainer.steps``, track their first as ``should_track`` says, the
        rest as this says)."""
        return self.mode != "off" and (self.mode == "every_step" or device_type == "cuda")

    def _extra_cost(self) -> float:
        if self._tracked_s is None:
            return 0.0
        return self._tracked_s - (self._plain_s or 0.0)  # unknown plain time: all of it

    def record(self, seconds: float, tracked: bool, device_type: str) -> None:
        """Charge a finished step to the budget: its tracking share as overhead."""
        if tracked:
            self._unmeasured = max(0, self._unmeasured - 1)
        if not tracked or device_type == "cuda":
            self._plain_s = _average(self._plain_s, seconds)
            self.budget.work(seconds)
            return
        self._tracked_s = _average(self._tracked_s, seconds)
        extra = min(seconds, self._extra_cost())
        self.budget.work(seconds - extra)
        self.budget.charge(extra)


def _average(old: float | None, new: float) -> float:
    return new if old is None else (1 - _SMOOTHING) * old + _SMOOTHING * new
