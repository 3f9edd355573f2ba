"""OverheadBudget: instrumentation (memory tracking, chart redraws) takes a fixed share of
the training time, however fast or slow the steps are.

Training time is what steps cost without instrumentation; each instrumented action is
allowed when everything instrumentation has cost so far, plus its expected cost, stays
within ``share`` of the total. Idle time between cells earns nothing, so a pause does not
buy a burst of redraws afterwards.
"""

from __future__ import annotations


class OverheadBudget:
    """Seconds of instrumentation allowed per second of training: ``share`` of the total."""

    def __init__(self, share: float = 0.02) -> None:
        self.share = share
        self.worked = 0.0  # seconds of plain training
        self.spent = 0.0  # seconds of instrumentation

    def work(self, seconds: float) -> None:
        self.worked += max(0.0, seconds)

    def allows(self, cost: float) -> bool:
        total = self.worked + self.spent + cost
        return self.spent + cost <= self.share * total

    def charge(self, seconds: float) -> None:
        self.spent += max(0.0, seconds)

    @property
    def overhead(self) -> float:
        """Instrumentation's share of the time so far."""
        total = self.worked + self.spent
        return self.spent / total if total else 0.0
