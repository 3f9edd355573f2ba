"""Memory charts drawn with matplotlib's object API (no pyplot: nothing re-shown at cell end)."""

from __future__ import annotations

import io

from matplotlib.figure import Figure

from ..memory import CATEGORIES

# One colour per category, the same in every chart.
COLORS = {
    "parameters": "#4C72B0",
    "gradients": "#DD8452",
    "optimizer_state": "#55A868",
    "activations": "#C44E52",
    "other": "#8172B3",
}
LABELS = {
    "parameters": "parameters",
    "gradients": "gradients",
    "optimizer_state": "optimizer state",
    "activations": "activations",
    "other": "other (temporaries, inputs)",
}
_UNITS = (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10), ("B", 1))


def byte_unit(nbytes: float) -> tuple[str, int]:
    """The largest binary unit in which ``nbytes`` is at least 1."""
    for name, size in _UNITS:
        if nbytes >= size:
            return name, size
    return "B", 1


def format_bytes(nbytes: float) -> str:
    unit, size = byte_unit(nbytes)
    return f"{nbytes / size:.1f} {unit}" if size > 1 else f"{int(nbytes)} B"


def draw_memory(fig: Figure, history: list) -> Figure:
    """Latest step's breakdown as a stacked bar; peak memory and loss over the steps."""
    fig.clear()
    bars, timeline = fig.subplots(1, 2, gridspec_kw={"width_ratios": [1, 2.2]})
    if not history:
        for ax in (bars, timeline):
            ax.text(0.5, 0.5, "no steps yet", ha="center", va="center", transform=ax.transAxes)
            ax.set_axis_off()
        return fig
    last = history[-1].memory
    top = max(sum(last.categories.values()), max(r.memory.peak for r in history))
    unit, size = byte_unit(top)

    bottom = 0.0
    for name in CATEGORIES:
        value = getattr(last, name) / size
        bars.bar(0, value, bottom=bottom, width=0.6, color=COLORS[name], label=LABELS[name])
        bottom += value
    bars.axhline(last.peak / size, color="black", linestyle="--", linewidth=1.2,
                 label=f"peak at one moment ({format_bytes(last.peak)})")
    bars.set_xticks([0], [f"step {history[-1].step}"])
    bars.set_xlim(-0.6, 0.6)
    bars.set_ylabel(f"memory ({unit})")
    bars.set_title("Where memory went", fontsize=10)

    steps = [r.step for r in history]
    timeline.plot(steps, [r.memory.peak / size for r in history], color="black",
                  marker="o" if len(history) < 40 else None, markersize=3, label="peak memory")
    timeline.set_xlabel("step")
    timeline.set_ylabel(f"peak memory ({unit})")
    timeline.set_ylim(0, top / size * 1.1)
    timeline.set_title("Peak memory and loss per step", fontsize=10)
    loss_ax = timeline.twinx()
    loss_ax.plot(steps, [r.loss for r in history], color="#999999", linewidth=1.2, label="loss")
    loss_ax.set_ylabel("loss")
    loss_ax.set_ylim(bottom=0)

    handles, labels = bars.get_legend_handles_labels()
    for ax in (timeline, loss_ax):
        h, l = ax.get_legend_handles_labels()
        handles, labels = handles + h, labels + l
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=8, frameon=False)
    fig.subplots_adjust(left=0.08, right=0.93, top=0.9, bottom=0.3, wspace=0.45)
    return fig


def figure_png(fig: Figure, dpi: int = 80) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi)
    return buffer.getvalue()


class ChartFigure(Figure):
    """A Figure that shows itself as a PNG in Jupyter.

    Jupyter's inline backend only renders figures once pyplot is imported, and nbtune
    avoids pyplot (it re-shows every open figure at the end of each cell).
    """

    def _repr_png_(self) -> bytes:
        return figure_png(self, dpi=100)


def memory_figure(history: list) -> ChartFigure:
    return draw_memory(ChartFigure(figsize=(9, 4)), history)
