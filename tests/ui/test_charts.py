"""Every chart renders to PNG with labelled axes, units by size, a legend and fixed colours."""

import dataclasses

import matplotlib.colors as mcolors
import pytest
from matplotlib.figure import Figure

from nbtune.memory import CATEGORIES, MemoryBreakdown
from nbtune.memory.usage import SOURCES, Usage
from nbtune.units import format_bytes
from nbtune.step import StepReport
from nbtune.charts import (COLORS, HIGH_LABEL, LABELS, byte_unit, draw_memory, figure_png,
                              ladder_figure, memory_figure, steps_figure)

from helpers import small_session


@pytest.fixture(scope="module")
def trained():
    session = small_session()
    session.run(4, progress=False, live=False)
    ladder = session.compare([{}, {"activation_checkpointing": True}], steps=2, progress=False)
    return session, ladder


def _category_colours(fig) -> dict[str, set]:
    """Legend label -> face colours of the bars carrying it."""
    out = {}
    for ax in fig.axes:
        for container in ax.containers:
            label = container.get_label()
            out.setdefault(label, set()).update(
                mcolors.to_hex(patch.get_facecolor()) for patch in container.patches)
    return out


def _charts(session, ladder):
    return {"live": memory_figure(session.history), "steps": steps_figure(session.history),
            "ladder": ladder_figure(ladder)}


@pytest.mark.slow
def test_each_chart_renders_a_png_with_units_legend_and_fixed_colours(trained):
    session, ladder = trained
    for name, fig in _charts(session, ladder).items():
        png = figure_png(fig)
        assert png.startswith(b"\x89PNG") and len(png) > 5000, name
        labels = [ax.get_ylabel() for ax in fig.axes] + [ax.get_xlabel() for ax in fig.axes]
        assert any("(MiB)" in label for label in labels), (name, labels)  # tens of MiB here
        legend = [t.get_text() for t in fig.legends[0].get_texts()]
        assert {LABELS[c] for c in COLORS} <= set(legend), name
        colours = _category_colours(fig)
        for category, colour in COLORS.items():
            assert colours[LABELS[category]] == {colour.lower()}, (name, category)


def test_ladder_bars_add_up_to_each_rows_peak(trained):
    _, ladder = trained
    fig = ladder_figure(ladder)
    ax = fig.axes[0]
    ends = {}
    for container in ax.containers:
        for y, patch in enumerate(container.patches):
            ends[y] = max(ends.get(y, 0), patch.get_x() + patch.get_width())
    size = 2**20
    assert sorted(ends.values(), reverse=True) == pytest.approx(
        sorted((r.peak / size for r in ladder), reverse=True), rel=1e-6)


def test_units_follow_the_size():
    assert byte_unit(512) == ("B", 1)
    assert byte_unit(3 * 2**20) == ("MiB", 2**20)
    assert byte_unit(20 * 2**30) == ("GiB", 2**30)


def test_timeline_shows_reserved_memory_when_there_is_some(trained):
    session, _ = trained
    history = [dataclasses.replace(r, memory=dataclasses.replace(r.memory, reserved=2 * r.memory.peak))
               for r in session.history]
    fig = draw_memory(Figure(), history)
    lines = [line.get_label() for ax in fig.axes for line in ax.get_lines()]
    assert "reserved by the allocator" in lines
    assert "reserved by the allocator" not in [
        line.get_label() for ax in draw_memory(Figure(), session.history).axes for line in ax.get_lines()]


def test_empty_history_draws_a_placeholder():
    assert figure_png(steps_figure([])).startswith(b"\x89PNG")
    assert figure_png(memory_figure([])).startswith(b"\x89PNG")


# ---- charts that tell the truth: built from reports directly (no training) ------------------

MiB = 2**20
AT_PEAK = {"parameters": 30 * MiB, "gradients": 5 * MiB, "optimizer_state": 60 * MiB,
           "activations": 20 * MiB, "other": 4 * MiB}
HIGHS = {"parameters": 30 * MiB, "gradients": 30 * MiB, "optimizer_state": 60 * MiB,
         "activations": 55 * MiB, "other": 9 * MiB}  # each category's own high point


def _report(step, measured=True, at_peak=True, reserved=0, peak_extra=0):
    split = {k: v + (peak_extra if k == "activations" else 0) for k, v in AT_PEAK.items()}
    memory = MemoryBreakdown(**HIGHS, peak=sum(split.values()), reserved=reserved,
                             at_peak=split if at_peak else {})
    return StepReport(step=step, loss=4.0 - step / 10, tokens=100, trained_tokens=90, seconds=0.1,
                      lr=1e-3, memory=memory if measured else memory.carried())


def _history(measured_steps, last=10, **kw):
    """Steps 1..last; those not in ``measured_steps`` carry the last measurement over, as the
    trainer does (a carried report repeats the measured breakdown with measured=False)."""
    out, latest = [], None
    for step in range(1, last + 1):
        if step in measured_steps:
            latest = _report(step, peak_extra=step * MiB, **kw)
            out.append(latest)
        else:
            out.append(dataclasses.replace(latest, step=step, loss=4.0 - step / 10,
                                           memory=latest.memory.carried()))
    return out


def _bar_heights(ax) -> dict[str, float]:
    """Legend label -> summed heights of the bars carrying it."""
    return {c.get_label(): sum(p.get_height() for p in c.patches) for c in ax.containers}


def _finite(values):
    return [v for v in values if v == v]


def test_the_bar_is_the_moment_of_the_peak_and_reaches_exactly_the_peak():
    history = _history({1, 2, 5})
    fig = draw_memory(Figure(), history)
    bars = fig.axes[0]
    last = history[4].memory  # step 5, the last measured: steps 6..10 carry it over
    heights = _bar_heights(bars)
    for name in CATEGORIES:
        assert heights[LABELS[name]] == pytest.approx(last.at_peak[name] / MiB)
    assert sum(heights.values()) == pytest.approx(last.peak / MiB)
    assert sum(heights.values()) < sum(last.categories.values()) / MiB  # the old, taller bar
    assert "step 5" in bars.get_xticklabels()[0].get_text()
    assert "last broken down,\n5 steps ago" in bars.get_xticklabels()[0].get_text()  # the latest is 10


def test_each_categorys_own_high_point_is_a_marker_in_its_colour():
    history = _history({1})
    fig = draw_memory(Figure(), history)
    markers = {line.get_gid(): line for line in fig.axes[0].get_lines()
               if (line.get_gid() or "").startswith("high:")}
    assert set(markers) == {f"high:{name}" for name in CATEGORIES}
    for name in CATEGORIES:
        line = markers[f"high:{name}"]
        assert list(line.get_ydata()) == pytest.approx([HIGHS[name] / MiB])
        assert mcolors.to_hex(line.get_color()) == COLORS[name].lower()
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert HIGH_LABEL in legend


def test_without_a_split_at_the_peak_the_bar_says_it_stacks_high_points():
    history = _history({1, 2}, last=3, at_peak=False)
    fig = draw_memory(Figure(), history)
    bars = fig.axes[0]
    assert sum(_bar_heights(bars).values()) == pytest.approx(sum(HIGHS.values()) / MiB)
    assert "not recorded" in bars.get_title()
    assert not [line for line in bars.get_lines() if (line.get_gid() or "").startswith("high:")]


def test_timeline_plots_only_measured_steps_and_never_joins_across_a_gap():
    measured = {1, 2, 5, 9}
    history = _history(measured, reserved=200 * MiB)
    fig = draw_memory(Figure(), history)
    timeline, loss_ax = fig.axes[1], fig.axes[2]
    for line in timeline.get_lines():
        xs = list(line.get_xdata())
        assert set(_finite(xs)) <= measured, line.get_label()
        # a line only joins neighbouring steps: every drawn segment spans one step
        if line.get_linestyle() not in ("None", "none", ""):
            pairs = [(a, b) for a, b in zip(xs, xs[1:]) if a == a and b == b]
            assert all(b - a == 1 for a, b in pairs), xs
    peak = next(line for line in timeline.get_lines() if line.get_label().startswith("peak memory"))
    assert sorted(_finite(peak.get_xdata())) == sorted(measured)
    assert "reserved by the allocator" in [line.get_label() for line in timeline.get_lines()]
    assert "4 of 10" in timeline.get_xlabel()
    loss = loss_ax.get_lines()[0]
    assert list(loss.get_xdata()) == list(range(1, 11))  # the loss covers every step


def test_steps_figure_has_a_bar_at_each_measured_step_only_reaching_its_peak():
    measured = {1, 2, 5, 9}
    history = _history(measured)
    fig = steps_figure(history)
    ax = fig.axes[0]
    tops: dict[float, float] = {}
    for container in ax.containers:
        for patch in container.patches:
            x = round(patch.get_x() + patch.get_width() / 2)
            tops[x] = tops.get(x, 0) + patch.get_height()
    assert set(tops) == measured
    for report in history:
        if report.step in measured:
            assert tops[report.step] == pytest.approx(report.memory.peak / MiB)
    for line in ax.get_lines():
        assert set(_finite(line.get_xdata())) <= measured
    assert "4 of 10" in ax.get_xlabel()


def test_every_step_measured_draws_one_unbroken_line():
    history = _history(set(range(1, 11)))
    fig = draw_memory(Figure(), history)
    peak = next(line for line in fig.axes[1].get_lines() if line.get_label() == "peak memory")
    assert list(peak.get_xdata()) == list(range(1, 11))
    assert fig.axes[1].get_xlabel() == "step"


def test_nothing_measured_draws_no_memory_but_the_loss():
    history = [StepReport(step=i, loss=2.0, tokens=1, trained_tokens=1, seconds=0.1, lr=1e-3,
                          memory=MemoryBreakdown(measured=False)) for i in range(1, 6)]
    for fig in (memory_figure(history), steps_figure(history)):
        assert figure_png(fig).startswith(b"\x89PNG")
        assert not any(ax.containers for ax in fig.axes)
        assert not [line for ax in fig.axes for line in ax.get_lines() if len(line.get_xdata())
                    and line.get_label() != "loss"]


def test_held_out_loss_and_the_evaluation_peak_are_drawn():
    from dataclasses import replace

    from nbtune.charts import EVAL_COLOR, memory_figure

    history = [_report(i) for i in range(1, 5)]
    history[1] = replace(history[1], eval_loss=2.5)
    history[3] = replace(history[3], eval_loss=2.0,
                         memory=replace(history[3].memory, eval_peak=300 << 20))
    fig = memory_figure(history)
    bars, timeline, loss_ax = fig.axes
    held = [line for line in loss_ax.get_lines() if line.get_label() == "held-out loss"]
    assert len(held) == 1 and list(held[0].get_xdata()) == [2, 4]
    assert list(held[0].get_ydata()) == [2.5, 2.0] and held[0].get_color() == EVAL_COLOR
    dotted = [line for line in bars.get_lines() if "held-out evaluation peak" in line.get_label()]
    assert len(dotted) == 1 and dotted[0].get_ydata()[0] == 300  # MiB: the axis fits it
    assert bars.get_ylim()[1] >= 300


def test_a_preference_runs_reward_margin_is_drawn_beside_the_loss():
    from dataclasses import replace

    from nbtune.charts import MARGIN_COLOR, memory_figure
    from nbtune.objectives.preference import PreferenceMetrics

    history = [replace(_report(i), preference=PreferenceMetrics(0.1 * i, -0.1, 0.1 * i - 0.25, 0.5))
               for i in range(1, 4)]
    loss_ax = memory_figure(history).axes[2]
    (margin,) = [line for line in loss_ax.get_lines() if line.get_label() == "reward margin"]
    assert list(margin.get_xdata()) == [1, 2, 3] and margin.get_color() == MARGIN_COLOR
    assert list(margin.get_ydata()) == pytest.approx([-0.15, -0.05, 0.05])
    assert loss_ax.get_ylim()[0] <= -0.15  # a negative margin stays on the axis


def test_breakdown_bars_are_each_entrys_bytes_by_category_first_on_top():
    from nbtune.charts import breakdown_figure

    MiB = 2**20
    bars = {"before": {"parameters": 10 * MiB, "activations": 30 * MiB},
            "after": {"parameters": 10 * MiB, "activations": 5 * MiB, "other": 1 * MiB}}
    fig = breakdown_figure(bars, "before and after")
    ax = fig.axes[0]
    widths = {}  # (category label, y) -> width in MiB
    for container in ax.containers:
        for patch in container.patches:
            widths[(container.get_label(), patch.get_y() + patch.get_height() / 2)] = patch.get_width()
    assert widths[(LABELS["activations"], 1)] == 30 and widths[(LABELS["activations"], 0)] == 5
    assert widths[(LABELS["other"], 0)] == 1 and widths[(LABELS["gradients"], 1)] == 0
    ticks = {t.get_text(): t.get_position()[1] for t in ax.get_yticklabels()}
    assert ticks == {"before": 1, "after": 0}  # the first entry on top
    assert {t.get_text() for t in ax.texts} == {"40.0 MiB", "16.0 MiB"}
    assert figure_png(fig).startswith(b"\x89PNG")


# ---- every step's cheap figure (``report.usage``) --------------------------------------------

def _metered(history, source="resident", reserved=0):
    return [dataclasses.replace(r, usage=Usage((200 + r.step) * MiB, reserved, source)) for r in history]


def test_every_step_is_a_line_and_the_broken_down_steps_are_points():
    measured = {1, 2, 5, 9}
    fig = draw_memory(Figure(), _metered(_history(measured)))
    timeline = fig.axes[1]
    usage = next(line for line in timeline.get_lines() if line.get_gid() == "usage")
    assert list(usage.get_xdata()) == list(range(1, 11))
    assert list(usage.get_ydata()) == pytest.approx([200 + s for s in range(1, 11)])  # MiB
    assert usage.get_label() == SOURCES["resident"]
    broken = next(line for line in timeline.get_lines() if line.get_gid() == "broken-down")
    assert set(_finite(broken.get_xdata())) == measured
    assert "broken down by category on 4 of 10 steps" in timeline.get_xlabel()


def test_step_ticks_are_whole_numbers():
    fig = draw_memory(Figure(), _metered(_history({1}, last=3)))
    figure_png(fig)  # drawn: the locator has placed its ticks
    ticks = [t for t in fig.axes[1].get_xticks() if 1 <= t <= 3]
    assert ticks and all(float(t).is_integer() for t in ticks), ticks


def test_on_cuda_the_allocators_line_is_drawn_where_steps_were_not_broken_down():
    sampled = draw_memory(Figure(), _metered(_history({1, 5}), "allocator", reserved=300 * MiB))
    labels = [line.get_label() for line in sampled.axes[1].get_lines()]
    assert SOURCES["allocator"] in labels and "reserved by the allocator (every step)" in labels
    every = draw_memory(Figure(), _metered(_history(set(range(1, 11))), "allocator"))
    labels = [line.get_label() for line in every.axes[1].get_lines()]
    assert SOURCES["allocator"] not in labels and "peak memory" in labels  # the same figure once


def test_a_session_meters_every_step_and_a_bare_trainer_does_not(trained):
    session, _ = trained
    assert all(r.usage is not None and r.usage.source == "resident" for r in session.history)
    # the process's peak resident memory holds at least the step's tensors at their peak
    assert all(r.usage.peak >= r.memory.peak for r in session.history if r.memory.measured)
    # the runtime (the process before its first session loaded: interpreter, torch) is left
    # out of the line the chart draws beside the tensors' peaks, and the legend says how much
    runtime = session.history[0].usage.runtime
    assert runtime > 50 * MiB and all(r.usage.runtime == runtime for r in session.history)
    fig = draw_memory(Figure(), session.history)
    line = next(line for line in fig.axes[1].get_lines() if line.get_gid() == "usage")
    drawn = [r.usage.peak - runtime for r in session.history]
    assert list(line.get_ydata()) == pytest.approx([d / drawn[0] * line.get_ydata()[0] for d in drawn])
    assert line.get_label() == f"process peak less {format_bytes(runtime)} runtime (every step)"
    bare = small_session()
    assert bare.trainer.step(track=True).usage is None


def test_each_steps_figure_is_its_own_peak_not_the_processes_lifetime_one():
    """A step's figure is the peak during that step: memory the process touched and freed
    before it does not show (the meter resets the high-water mark at the step's start)."""
    import mmap

    from nbtune.memory.usage import _resident

    session = small_session()
    session.step()
    # 400 MiB touched, then unmapped: its own mapping, so freeing it surely returns it to the
    # system (a malloc'd array once stayed resident inside the full suite: a flaky pass)
    big = mmap.mmap(-1, 400 * 2**20)
    for at in range(0, len(big), mmap.PAGESIZE):
        big[at] = 1
    high = _resident()
    big.close()
    report = session.step()
    assert report.usage.peak < high - 200 * 2**20, (report.usage.peak, high)


def test_the_steps_figure_puts_the_process_on_its_own_axis():
    """The process's resident memory (GiB here) would flatten the tensors' bars (MiB): it
    gets the right axis, the bars keep theirs."""
    history = [dataclasses.replace(r, usage=Usage(3 * 2**30 + r.step * MiB, 0, "resident"))
               for r in _history({1, 2, 5})]
    fig = steps_figure(history)
    left, right = fig.axes[0], fig.axes[1]
    assert left.get_ylabel() == "memory (MiB)" and right.get_ylabel() == "process memory (GiB)"
    usage = next(line for line in right.get_lines() if line.get_gid() == "usage")
    assert list(usage.get_xdata()) == list(range(1, 11))
    assert SOURCES["resident"] in [t.get_text() for t in fig.legends[0].get_texts()]


def test_on_cuda_a_tracked_steps_figure_is_the_trackers_whole_step_peak(monkeypatch):
    """The CUDA tracker reads and resets the allocator's peak at every phase boundary, so the
    meter's own reading at the end holds the last phase only: a tracked step's figure is
    the tracker's whole-step peak; an untracked one's is the meter's."""
    import torch

    from nbtune.memory.usage import UsageMeter

    counters = {"peak": 0}
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda d=None: counters.update(peak=0))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d=None: counters["peak"])
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda d=None: 2 * counters["peak"])
    meter = UsageMeter(torch.device("cuda", 0))
    with meter:
        counters["peak"] = 900  # forward's peak; the tracker then resets at the boundary
        torch.cuda.reset_peak_memory_stats()
        counters["peak"] = 300  # the optimizer phase
    assert meter.result == Usage(300, 600, "allocator")  # the last phase alone
    assert meter.settle(MemoryBreakdown(peak=900, reserved=1800)) == Usage(900, 1800, "allocator")
    assert meter.settle(None) == meter.result  # untracked: the counters are the whole step's
