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


class LiveChart:
    """Displays the memory chart once, then updates that same output.

    Redrawing costs tens of milliseconds, so updates closer together than
    ``min_interval`` seconds are skipped; ``force=True`` always draws (the last step).
    """

    def __init__(self, min_interval: float = 0.5) -> None:
        self.figure = Figure(figsize=(9, 4))
        self.min_interval = min_interval
        self.draws = 0
        self._handle = None
        self._last = float("-inf")

    def update(self, history: list, force: bool = False) -> bool:
        now = time.monotonic()
        if not force and now - self._last < self.min_interval:
            return False
        from IPython.display import Image, display

        image = Image(data=figure_png(draw_memory(self.figure, history)), format="png")
        if self._handle is None:
            self._handle = display(image, display_id=True)
        else:
            self._handle.update(image)
        self._last = time.monotonic()
        self.draws += 1
        return True
