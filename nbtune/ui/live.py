"""A chart that redraws in place: one output per cell, however many steps run."""

from __future__ import annotations

import time

from matplotlib.figure import Figure

from ..overhead import OverheadBudget
from ..charts import draw_memory, figure_png


def in_notebook() -> bool:
    """True inside a Jupyter kernel (where display handles update in place)."""
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and type(shell).__name__ == "ZMQInteractiveShell"


class PacedRedraw:
    """Draws when the session's ``OverheadBudget`` has room for one more drawing.

    A drawing's cost is taken to be what the last one cost; the first is always allowed
    (nothing would show otherwise), and ``force`` draws regardless (the last step of a run).
    A chart not redrawn for ``LONGEST_WAIT`` seconds (or 50 drawings' time, if longer) is
    redrawn anyway: memory tracking can use the whole budget, and a chart that stays still
    for minutes of training looks frozen. That floor costs at most 2 % more.
    """

    LONGEST_WAIT = 10.0

    def __init__(self, budget: OverheadBudget) -> None:
        self.budget = budget
        self._cost: float | None = None
        self._last = 0.0  # time.perf_counter() when the last drawing ended

    def due(self, force: bool = False) -> bool:
        if force or self._cost is None or self.budget.allows(self._cost):
            return True
        return time.perf_counter() - self._last > max(self.LONGEST_WAIT, 50 * self._cost)

    def drew(self, started: float) -> None:
        """Charge a drawing that began at ``started`` (time.perf_counter())."""
        self._last = time.perf_counter()
        self._cost = self._last - started
        self.budget.charge(self._cost)


class LiveChart:
    """Displays the memory chart once, then updates that same output.

    A redraw costs tens of milliseconds, so updates are paced by the session's overhead
    budget; ``force=True`` always draws (the last step).
    """

    def __init__(self, budget: OverheadBudget) -> None:
        self.figure = Figure(figsize=(9, 4))
        self.pacer = PacedRedraw(budget)
        self._handle = None

    def update(self, history: list, force: bool = False) -> bool:
        if not self.pacer.due(force):
            return False
        from IPython.display import Image, display

        started = time.perf_counter()
        image = Image(data=figure_png(draw_memory(self.figure, history)), format="png")
        if self._handle is None:
            self._handle = display(image, display_id=True)
        else:
            self._handle.update(image)
        self.pacer.drew(started)
        return True
