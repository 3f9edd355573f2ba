"""Memory charts drawn with matplotlib's object API (no pyplot: nothing re-shown at cell end)."""

from __future__ import annotations

import io

from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from .memory import CATEGORIES
from .memory.usage import SOURCES
from .units import format_bytes

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
RESIDENT_COLOR = "#17BECF"  # the process's peak resident memory (a CPU's every-step figure)
LOSS_COLOR = "#999999"
EVAL_COLOR = "#E377C2"  # held-out loss and the evaluation's memory
MARGIN_COLOR = "#8C564B"  # a preference objective's reward margin (chosen minus rejected)
GENERATION_COLOR = "#BCBD22"  # GRPO: its mean reward and the writing of its completions
_UNITS = (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10), ("B", 1))


def byte_unit(nbytes: float) -> tuple[str, int]:
    """The largest binary unit in which ``nbytes`` is at least 1."""
    for name, size in _UNITS:
        if nbytes >= size:
            return name, size
    return "B", 1


def _legend(fig: Figure, axes, ncol: int = 4) -> None:
    handles, labels = [], []
    for ax in axes:
        h, l = ax.get_legend_handles_labels()
        for handle, label in zip(h, l):
            if label not in labels:
                handles.append(handle)
                labels.append(label)
    fig.legend(handles, labels, loc="lower center", ncol=ncol, fontsize=8, frameon=False)


def _stack(ax, x, values: dict[str, list[float]], width: float, hatch: str | None = None,
           labelled: bool = True) -> None:
    """Bars at ``x``, one segment per category, in the fixed category order and colours."""
    bottom = [0.0] * len(x)
    for name in CATEGORIES:
        ax.bar(x, values[name], bottom=bottom, width=width, color=COLORS[name], hatch=hatch,
               edgecolor="white" if hatch else None, linewidth=0,
               label=LABELS[name] if labelled else "_nolegend_")
        bottom = [b + v for b, v in zip(bottom, values[name])]


def _empty(fig: Figure, text: str) -> Figure:
    ax = fig.subplots()
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes)
    ax.set_axis_off()
    return fig


def _composition(memory) -> dict[str, int]:
    """What held memory at the step's peak moment: ``at_peak``, which sums to ``peak``
    (empty where it was not recorded: then each category's own high point)."""
    return {name: memory.at_peak.get(name, 0) for name in CATEGORIES} if memory.at_peak \
        else memory.categories


def _measured(history: list) -> list:
    """The reports whose memory was measured on their own step (the others carry it over)."""
    return [r for r in history if r.memory.measured]


def _top(reports: list, history: list = ()) -> float:
    """The highest number of bytes any memory chart of ``reports`` draws, with every step's
    cheap figure in ``history`` (at least 1)."""
    return max([1] + [max(sum(_composition(r.memory).values()), r.memory.peak, r.memory.reserved,
                          r.memory.eval_peak, r.memory.generation_peak, *r.memory.categories.values())
                      for r in reports]
               + [max(r.usage.drawn, r.usage.reserved) for r in history if r.usage is not None])


HIGH_LABEL = "category's own high point"


def draw_memory(fig: Figure, history: list, ranks: list | None = None) -> Figure:
    """Left, "Where memory went": the latest measured step at its peak moment, one stacked
    segment per category (``MemoryBreakdown.at_peak``), so the bar's top is the step's peak.
    Beside it, one stem per category (its colour) rises to that category's own high point,
    the most it held at any moment of the step, peak or not: the stems do not add up, and
    the bar shows which of those highs coincided. Where the split at the peak was not
    recorded, the bar stacks the own high points instead (the title says so) and the dashed
    peak line shows how far that overshoots the peak.

    Right: every step's cheap figure as a line (``report.usage``: the allocator's peak and
    reserved on CUDA, the process's peak resident memory on a CPU), and the peak of the steps
    broken down by category as points, joined only between consecutive ones (the x label
    says how many were broken down). The loss line covers every step.

    ``ranks`` (a session on several processes): step -> each rank's ``MemoryBreakdown``;
    the left bar is then one bar per rank, side by side, for the latest measured step."""
    fig.clear()
    if not history:
        return _empty(fig, "no steps yet")
    bars, timeline = fig.subplots(1, 2, gridspec_kw={"width_ratios": [1.15, 2.2]})
    measured = _measured(history)
    per_rank = ranks.get(measured[-1].step) if ranks and measured else None
    top = max([_top(measured)] + [m.peak for m in per_rank or ()])  # the bar's own scale
    unit, size = byte_unit(top)
    if per_rank:
        _draw_rank_bars(bars, per_rank, measured[-1].step, size)
    elif measured:
        _draw_peak_bar(bars, measured[-1], history[-1].step, size)
    else:
        bars.text(0.5, 0.5, "memory not measured\non any step", ha="center", va="center",
                  fontsize=8, transform=bars.transAxes)
        bars.set_xticks([])
        bars.set_yticks([])
        bars.set_title("Where memory went", fontsize=10)
    bars.set_ylabel(f"memory ({unit})" if measured else "memory")
    bars.set_ylim(0, top / size * 1.1)

    every = _top(measured, history)
    _timeline(timeline, history, *byte_unit(every)[::-1], every)
    loss_ax = timeline.twinx()
    loss_ax.plot([r.step for r in history], [r.loss for r in history], color=LOSS_COLOR,
                 linewidth=1.2, label="loss")
    held_out = [r for r in history if getattr(r, "eval_loss", None) is not None]
    if held_out:
        loss_ax.plot([r.step for r in held_out], [r.eval_loss for r in held_out], color=EVAL_COLOR,
                     linewidth=1.2, marker="o", markersize=3, label="held-out loss")
    paired = [r for r in history if getattr(r, "preference", None) is not None]
    if paired:  # a preference objective: what its users watch beside the loss
        margins = [r.preference.margin for r in paired]
        loss_ax.plot([r.step for r in paired], margins, color=MARGIN_COLOR, linewidth=1.2,
                     linestyle="--", label="reward margin")
    rewarded = [r for r in history if getattr(r, "rollouts", None) is not None]
    if rewarded:  # GRPO: its loss hovers near 0 on policy; the reward is what moves
        loss_ax.plot([r.step for r in rewarded], [r.rollouts.reward for r in rewarded],
                     color=GENERATION_COLOR, linewidth=1.2, linestyle="--", label="mean reward")
    loss_ax.set_ylabel("loss" + (" and margin" if paired else " and reward" if rewarded else ""))
    loss_ax.set_ylim(bottom=min([0.0] + [r.preference.margin for r in paired]
                                + [r.rollouts.reward for r in rewarded]))
    timeline.set_title("Peak memory and loss per step", fontsize=10)
    _legend(fig, (bars, timeline, loss_ax), ncol=3)
    fig.subplots_adjust(left=0.08, right=0.93, top=0.9, bottom=0.4, wspace=0.4)
    return fig


def _draw_peak_bar(ax, report, latest_step: int, size: int) -> None:
    memory = report.memory
    split = bool(memory.at_peak)
    composition = _composition(memory)
    _stack(ax, [0], {name: [composition[name] / size] for name in CATEGORIES}, width=0.5)
    ax.axhline(memory.peak / size, color=PEAK_COLOR, linestyle="--", linewidth=1,
               label=f"peak at one moment ({format_bytes(memory.peak)})")
    if memory.eval_peak:
        ax.axhline(memory.eval_peak / size, color=EVAL_COLOR, linestyle=":", linewidth=1.4,
                   label=f"held-out evaluation peak ({format_bytes(memory.eval_peak)})")
    if memory.generation_peak:
        ax.axhline(memory.generation_peak / size, color=GENERATION_COLOR, linestyle=":", linewidth=1.4,
                   label=f"writing the completions ({format_bytes(memory.generation_peak)})")
    old = latest_step - report.step  # the sampled breakdown can be far behind: say how far
    step = f"step {report.step}" + ("" if not old else
                                    f"\n(last broken down,\n{old} step{'s' if old > 1 else ''} ago)")
    if split:
        # One stem per category, spread so that equal highs stay apart.
        xs = [0.5 + 0.1 * i for i in range(len(CATEGORIES))]
        for x, name in zip(xs, CATEGORIES):
            high = getattr(memory, name) / size
            ax.vlines(x, 0, high, color=COLORS[name], linewidth=1.2)
            ax.plot([x], [high], linestyle="none", marker="v", markersize=6,
                    color=COLORS[name], gid=f"high:{name}")
        ax.plot([], [], color="#555555", linewidth=1.2, marker="v", markersize=6,
                label=HIGH_LABEL)  # the legend's entry: one neutral stem for all five
        ax.set_xticks([0, xs[2]], [f"at the peak\n{step}", "own\nhigh points"], fontsize=8)
        ax.set_xlim(-0.4, xs[-1] + 0.15)
        ax.set_title("Where memory went", fontsize=10)
    else:
        ax.set_xticks([0], [step], fontsize=8)
        ax.set_xlim(-0.5, 0.5)
        ax.set_title("Where memory went\n(own high points: split at the peak not recorded)",
                     fontsize=8)


def _draw_rank_bars(ax, memories: list, step: int, size: int) -> None:
    """Each rank's memory at its own peak moment in ``step``, one stacked bar per rank."""
    for rank, memory in enumerate(memories):
        composition = _composition(memory)
        _stack(ax, [rank], {name: [composition[name] / size] for name in CATEGORIES}, width=0.6,
               labelled=rank == 0)
    top = max(m.peak for m in memories)
    ax.axhline(top / size, color=PEAK_COLOR, linestyle="--", linewidth=1,
               label=f"highest rank's peak ({format_bytes(top)})")
    ax.set_xticks(range(len(memories)), [f"rank {rank}" for rank in range(len(memories))], fontsize=8)
    ax.set_xlim(-0.6, len(memories) - 0.4)
    ax.set_title(f"Where memory went, per rank (step {step})", fontsize=10)


def _measured_line(reports: list, value) -> tuple[list, list, list]:
    """x and y of the measured reports, with a break (NaN) wherever an unmeasured one lies
    between two measured ones, and the measured points that stand alone (no line shows them)."""
    xs, ys, alone = [], [], []
    run: list = []
    for report in reports + [None]:
        if report is not None and report.memory.measured:
            run.append(report)
            continue
        if run:
            if xs:
                xs.append(float("nan"))
                ys.append(float("nan"))
            xs += [r.step for r in run]
            ys += [value(r.memory) for r in run]
            if len(run) == 1:
                alone.append(run[0])
        run = []
    return xs, ys, alone


def _usage_line(history: list, value) -> tuple[list, list]:
    """x and y of every step's cheap figure, broken (NaN) where a step has none."""
    xs, ys = [], []
    for r in history:
        xs.append(r.step)
        ys.append(value(r.usage) if r.usage is not None else float("nan"))
    return xs, ys


def _source(history: list) -> str | None:
    """Where the steps' cheap figures come from (``SOURCES``), or None without any."""
    metered = [r for r in history if r.usage is not None]
    return metered[-1].usage.source if metered else None


def _usage_label(history: list, source: str) -> str:
    """The every-step line's legend: what it is, and on a CPU how much runtime it leaves out."""
    runtime = max((r.usage.runtime for r in history if r.usage is not None), default=0)
    if not runtime:
        return SOURCES[source]
    return f"process peak less {format_bytes(runtime)} runtime (every step)"  # (short: the legend's width)


def _resident_axis(ax, history: list):
    """The process's peak resident memory of every step on an axis of its own (right): it
    counts the whole process, far above the tensors on the left axis."""
    other = ax.twinx()
    top = max(r.usage.drawn for r in history if r.usage is not None)
    unit, size = byte_unit(top)
    xs, ys = _usage_line(history, lambda u: u.drawn / size)
    other.plot(xs, ys, color=RESIDENT_COLOR, linewidth=1.2, label=_usage_label(history, "resident"),
               gid="usage")
    other.set_ylabel(f"process memory ({unit})")
    other.set_ylim(0, top / size * 1.1)
    return other


def _timeline(ax, history: list, size: int, unit: str, top: float, usage: bool = True) -> None:
    """Every step's cheap figure as a line (``usage``: here); the peak of the steps broken
    down by category as a line where every step was, else as points (joined between
    consecutive ones). On CUDA the cheap figure is the same allocator peak: drawn only where
    steps were not broken down."""
    measured = _measured(history)
    every = bool(measured) and len(measured) == len(history)
    metered = [r for r in history if r.usage is not None] if usage else []
    source = _source(metered)
    if metered and not (every and source == "allocator"):
        xs, ys = _usage_line(history, lambda u: u.drawn / size)
        ax.plot(xs, ys, color=PEAK_COLOR if source == "allocator" else RESIDENT_COLOR,
                linewidth=1.2, label=_usage_label(metered, source), gid="usage")
        if any(r.usage.reserved for r in metered):
            xs, ys = _usage_line(history, lambda u: u.reserved / size)
            ax.plot(xs, ys, color=RESERVED_COLOR, linestyle="--", linewidth=1.2,
                    label="reserved by the allocator (every step)")
    if measured:
        xs, ys, alone = _measured_line(history, lambda m: m.peak / size)
        label = "peak memory" + ("" if every else ", broken down by category")
        ax.plot(xs, ys, color=PEAK_COLOR, linewidth=1.2 if every else 0.8,
                linestyle="-" if every else ":", label=label, gid="broken-down")
        dots = measured if len(measured) < 60 else alone
        ax.plot([r.step for r in dots], [r.memory.peak / size for r in dots],
                linestyle="none", marker="o", markersize=3, color=PEAK_COLOR)
        if not any(r.usage.reserved for r in metered) and any(r.memory.reserved for r in measured):
            xs, ys, alone = _measured_line(history, lambda m: m.reserved / size)
            ax.plot(xs, ys, color=RESERVED_COLOR, linestyle="--", linewidth=1.2,
                    label="reserved by the allocator")
    if not measured and not metered:
        ax.set_yticks([])
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("step" if every else
                  f"step (broken down by category on {len(measured)} of {len(history)} steps)")
    ax.set_ylabel(f"memory ({unit})" if measured or metered else "memory")
    ax.set_ylim(0, top / size * 1.1)


def steps_figure(history: list) -> "ChartFigure":
    """Each measured step at its peak moment as a stacked bar (``at_peak``: the bar's top is
    the step's peak), and the peak as points and a line over consecutive measured steps.
    Steps whose memory was carried over from an earlier measurement get no bar (the title
    says so, the x label how many were measured). A step without a recorded split at the
    peak is hatched and stacks each category's own high point instead."""
    fig = ChartFigure(figsize=(9, 4))
    if not history:
        return _empty(fig, "no steps yet")
    ax = fig.subplots()
    measured = _measured(history)
    resident = _source(history) == "resident"  # a figure of its own scale: its own axis
    top = _top(measured, [] if resident else history)
    unit, size = byte_unit(top)
    split = [r for r in measured if r.memory.at_peak]
    highs = [r for r in measured if not r.memory.at_peak]
    for reports, hatch in ((split, None), (highs, "//")):
        if reports:  # the legend names each category once
            _stack(ax, [r.step for r in reports],
                   {name: [_composition(r.memory)[name] / size for r in reports]
                    for name in CATEGORIES}, width=0.8, hatch=hatch,
                   labelled=hatch is None or not split)
    _timeline(ax, history, size, unit, top, usage=not resident)
    axes = (ax, _resident_axis(ax, history)) if resident else (ax,)
    ax.set_xlim(history[0].step - 1, history[-1].step + 1)
    notes = []
    if len(measured) < len(history):
        notes.append("steps whose memory was not measured have no bar")
    if highs:
        notes.append("hatched: own high points, split at the peak not recorded")
    title = "Memory by category at each step's peak"
    ax.set_title(title + (f"\n({'; '.join(notes)})" if notes else ""), fontsize=9 if notes else 10)
    _legend(fig, axes, ncol=3)
    fig.subplots_adjust(left=0.09, right=0.91 if resident else 0.97, top=0.88, bottom=0.34)
    return fig


def ladder_figure(ladder) -> "ChartFigure":
    """A bar per configuration: its peak, split by what held memory at that moment, and
    the estimate beside it."""
    rows = list(ladder)
    return breakdown_figure(
        {r.label: r.at_peak for r in rows},
        f"Technique ladder: peak memory per configuration ({ladder.device})",
        totals=[r.peak for r in rows], notes=[r.error for r in rows],
        estimates=[r.estimated_peak for r in rows])


def breakdown_figure(bars: dict[str, dict], title: str, *, totals: list | None = None,
                     notes: list | None = None, estimates: list | None = None,
                     xlabel: str = "peak memory") -> "ChartFigure":
    """A horizontal bar per entry of ``bars`` (label -> bytes per category), split by
    category in the fixed colours, first on top: before and after a change, per rank, per
    configuration. ``totals`` (default: the sum) is written at each bar's end, or the
    entry's ``notes`` text where it has one; ``estimates`` are marked on the bars."""
    labels = list(bars)
    fig = ChartFigure(figsize=(9, 1.2 + 0.45 * max(len(labels), 1)))
    if not labels:
        return _empty(fig, "nothing to show")
    totals = totals or [sum(bars[k].get(n, 0) for n in CATEGORIES) for k in labels]
    notes = notes or [None] * len(labels)
    estimates = estimates or [None] * len(labels)
    ax = fig.subplots()
    top = max(list(totals) + [e or 0 for e in estimates] + [1])
    unit, size = byte_unit(top)
    y = list(range(len(labels)))[::-1]  # first on top
    left = [0.0] * len(labels)
    for name in CATEGORIES:
        widths = [bars[k].get(name, 0) / size for k in labels]
        ax.barh(y, widths, left=left, height=0.6, color=COLORS[name], label=LABELS[name])
        left = [a + b for a, b in zip(left, widths)]
    marked = [(yi, e / size) for yi, e in zip(y, estimates) if e]
    if marked:
        ax.plot([e for _, e in marked], [yi for yi, _ in marked], linestyle="none",
                marker="|", markersize=16, markeredgewidth=2, color=PEAK_COLOR, label="estimated peak")
    for yi, total, note in zip(y, totals, notes):
        ax.text(total / size + top / size * 0.01, yi, note or format_bytes(total), va="center",
                fontsize=8)
    ax.set_yticks(y, labels, fontsize=8)
    ax.set_xlabel(f"{xlabel} ({unit})")
    ax.set_xlim(0, top / size * 1.18)
    ax.set_title(title, fontsize=10)
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


def ranks_figure(memories: list, step: int) -> ChartFigure:
    """Each rank's memory at its peak in one step (``MemoryBreakdown`` per rank), by kind."""
    bars = {f"rank {rank}": dict(memory.at_peak) for rank, memory in enumerate(memories)}
    return breakdown_figure(bars, f"step {step}: each rank's peak, by kind of memory",
                            totals=[memory.peak for memory in memories])
