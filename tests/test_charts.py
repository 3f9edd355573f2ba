"""Every chart renders to PNG with labelled axes, units by size, a legend and fixed colours."""

import matplotlib.colors as mcolors
import pytest

from nbtune.ui.charts import (COLORS, LABELS, byte_unit, draw_memory, figure_png, ladder_figure,
                              memory_figure, steps_figure)

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
    import dataclasses

    from matplotlib.figure import Figure

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
