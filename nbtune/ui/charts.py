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
    "other": "other (temporaries, recomputation, inputs)",
}
PEAK_COLOR = "#000000"  # the peak at one moment, and estimates of it
RESERVED_COLOR = "#7F7F7F"  # what the CUDA caching allocator held
LOSS_COLOR = "#999999"
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


def _legend(fig: Figure, axes, ncol: int = 4) -> None:
    handles, labels = [], []
    for ax in axes:
        h, l = ax.get_legend_handles_labels()
        for handle, label in zip(h, l):
            if label not in labels:
                handles.append(handle)
                labels.append(label)
    fig.legend(handles, labels, loc="lower center", ncol=ncol, fontsize=8, frameon=False)


def _stack(ax, x, values: dict[str, list[float]], width: float) -> None:
    """Bars at ``x``, one segment per category, in the fixed category order and colours."""
    bottom = [0.0] * len(x)
    for name in CATEGORIES:
        ax.bar(x, values[name], bottom=bottom, width=width, color=COLORS[name], label=LABELS[name])
        bottom = [b + v for b, v in zip(bottom, values[name])]


def _empty(fig: Figure, text: str) -> Figure:
    ax = fig.subplots()
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes)
    ax.set_axis_off()
    return fig


def draw_memory(fig: Figure, history: list) -> Figure:
    """Latest step's breakdown as a stacked bar; peak (and reserved) memory and loss over
    the steps. Filled markers are measured steps, the line between them carries the last
    measurement."""
    fig.clear()
    if not history:
        return _empty(fig, "no steps yet")
    bars, timeline = fig.subplots(1, 2, gridspec_kw={"width_ratios": [1, 2.2]})
    last = history[-1].memory
    top = max(sum(last.categories.values()), max(max(r.memory.peak, r.memory.reserved)
                                                  for r in history))
    unit, size = byte_unit(top)

    _stack(bars, [0], {name: [getattr(last, name) / size] for name in CATEGORIES}, width=0.6)
    bars.axhline(last.peak / size, color="black", linestyle="--", linewidth=1.2,
                 label=f"peak at one moment ({format_bytes(last.peak)})")
    note = "" if last.measured else " (last measured)"
    bars.set_xticks([0], [f"step {history[-1].step}{note}"])
    bars.set_xlim(-0.6, 0.6)
    bars.set_ylabel(f"memory ({unit})")
    bars.set_title("Where memory went", fontsize=10)

    _timeline(timeline, history, size, unit, top)
    loss_ax = timeline.twinx()
    loss_ax.plot([r.step for r in history], [r.loss for r in history], color=LOSS_COLOR,
                 linewidth=1.2, label="loss")
    loss_ax.set_ylabel("loss")
    loss_ax.set_ylim(bottom=0)
    timeline.set_title("Peak memory and loss per step", fontsize=10)
    _legend(fig, (bars, timeline, loss_ax))
    fig.subplots_adjust(left=0.08, right=0.93, top=0.9, bottom=0.3, wspace=0.45)
    return fig


def _timeline(ax, history: list, size: int, unit: str, top: float) -> None:
    steps = [r.step for r in history]
    ax.plot(steps, [r.memory.peak / size for r in history], color=PEAK_COLOR, linewidth=1.2,
            label="peak memory")
    measured = [r for r in history if r.memory.measured]
    if len(measured) < 60:
        ax.plot([r.step for r in measured], [r.memory.peak / size for r in measured],
                linestyle="none", marker="o", markersize=3, color=PEAK_COLOR)
    if any(r.memory.reserved for r in history):
        ax.plot(steps, [r.memory.reserved / size for r in history], color=RESERVED_COLOR,
                linestyle="--", linewidth=1.2, label="reserved by the allocator")
    ax.set_xlabel("step")
    ax.set_ylabel(f"memory ({unit})")
    ax.set_ylim(0, top / size * 1.1)


def steps_figure(history: list) -> "ChartFigure":
    """Every step's breakdown as a stacked bar, with the peak of each step as a line."""
    fig = ChartFigure(figsize=(9, 4))
    if not history:
        return _empty(fig, "no steps yet")
    ax = fig.subplots()
    top = max(max(sum(r.memory.categories.values()), r.memory.peak, r.memory.reserved)
              for r in history)
    unit, size = byte_unit(top)
    steps = [r.step for r in history]
    _stack(ax, steps, {name: [getattr(r.memory, name) / size for r in history]
                       for name in CATEGORIES}, width=0.8)
    _timeline(ax, history, size, unit, top)
    ax.set_title("Memory by category, per step", fontsize=10)
    _legend(fig, (ax,))
    fig.subplots_adjust(left=0.09, right=0.97, top=0.9, bottom=0.3)
    return fig


def ladder_figure(ladder) -> "ChartFigure":
    """A bar per configuration: its peak, split by what held memory at that moment, and
    the estimate beside it."""
    rows = list(ladder)
    fig = ChartFigure(figsize=(9, 1.2 + 0.45 * max(len(rows), 1)))
    if not rows:
        return _empty(fig, "no configurations")
    ax = fig.subplots()
    top = max([r.peak for r in rows] + [r.estimated_peak or 0 for r in rows] + [1])
    unit, size = byte_unit(top)
    y = list(range(len(rows)))[::-1]  # first row on top
    left = [0.0] * len(rows)
    for name in CATEGORIES:
        widths = [r.at_peak.get(name, 0) / size for r in rows]
        ax.barh(y, widths, left=left, height=0.6, color=COLORS[name], label=LABELS[name])
        left = [a + b for a, b in zip(left, widths)]
    estimated = [(yi, r.estimated_peak / size) for yi, r in zip(y, rows) if r.estimated_peak]
    if estimated:
        ax.plot([e for _, e in estimated], [yi for yi, _ in estimated], linestyle="none",
                marker="|", markersize=16, markeredgewidth=2, color=PEAK_COLOR, label="estimated peak")
    for yi, r in zip(y, rows):
        text = r.error or format_bytes(r.peak)
        ax.text(r.peak / size + top / size * 0.01, yi, text, va="center", fontsize=8)
    ax.set_yticks(y, [r.label for r in rows], fontsize=8)
    ax.set_xlabel(f"peak memory ({unit})")
    ax.set_xlim(0, top / size * 1.18)
    ax.set_title(f"Technique ladder: peak memory per configuration ({ladder.device})", fontsize=10)
    _legend(fig, (ax,), ncol=3)
    fig.subplots_adjust(left=0.3, right=0.97, top=1 - 0.45 / fig.get_figheight(),
                        bottom=min(0.45, 0.95 / fig.get_figheight()))
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
