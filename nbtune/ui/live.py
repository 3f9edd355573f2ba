"""A chart that redraws in place: one output per cell, however many steps run."""

from __future__ import annotations

import time

from matplotlib.figure import Figure

from .charts import draw_memory, figure_png


def in_notebook() -> bool:
    """True inside a Jupyter kernel (where display handles update in place)."""
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and type(shell).__name__ == "ZMQInteractiveShell"


class RedrawPacer:
    """Paces redraws by their measured cost, so drawing takes at most ``share`` of the
    wall time (and happens no more often than every ``min_interval`` seconds)."""

    def __init__(self, share: float = 0.03, min_interval: float = 0.5) -> None:
        self.share, self.min_interval = share, min_interval
        self._next = float("-inf")

    def due(self) -> bool:
        return time.monotonic() >= self._next

    def drew(self, started: float) -> None:
        """Record a redraw that began at ``started`` (time.monotonic())."""
        now = time.monotonic()
        self._next = now + max(self.min_interval, (now - started) / self.share)


class LiveChart:
    """Displays the memory chart once, then updates that same output.

    A redraw costs tens of milliseconds, so updates are paced (``RedrawPacer``);
    ``force=True`` always draws (the last step).
    """

    def __init__(self, pacer: RedrawPacer | None = None) -> None:
        self.figure = Figure(figsize=(9, 4))
        self.pacer = pacer or RedrawPacer()
        self._handle = None

    def update(self, history: list, force: bool = False) -> bool:
        if not (force or self.pacer.due()):
            return False
        from IPython.display import Image, display

        started = time.monotonic()
        image = Image(data=figure_png(draw_memory(self.figure, history)), format="png")
        if self._handle is None:
            self._handle = display(image, display_id=True)
        else:
            self._handle.update(image)
        self.pacer.drew(started)
        return True
