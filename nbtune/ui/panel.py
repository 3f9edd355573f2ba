"""The control panel: ipywidgets bound both ways to ``session.techniques``, plus the chart.

Widget -> session: a changed control calls ``session.set``; if the value is refused the
control snaps back and the reason is shown. Session -> widget: the panel subscribes to
the session, so ``session.set(...)`` from code moves the controls too.
"""

from __future__ import annotations

import time

import ipywidgets as w

from ..techniques import DTYPES, HELP, METHODS
from .charts import draw_memory, figure_png, format_bytes
from matplotlib.figure import Figure


def _controls(session) -> dict[str, w.ValueWidget]:
    """One control per toggle, keyed by the Techniques field it edits."""
    layers = len(session.model.model.layers)
    limit = session.model.config.max_position_embeddings
    style = {"description_width": "150px"}
    wide = w.Layout(width="420px")
    return {
        "method": w.Dropdown(options=METHODS, description="method", style=style, layout=wide),
        "dtype": w.Dropdown(options=DTYPES, description="dtype", style=style, layout=wide),
        "activation_checkpointing": w.IntSlider(
            min=0, max=layers, description="checkpoint every N layers", style=style, layout=wide),
        "batch_size": w.IntSlider(min=1, max=64, description="batch size", style=style, layout=wide),
        "grad_accum": w.IntSlider(min=1, max=16, description="gradient accumulation",
                                  style=style, layout=wide),
        "seq_len": w.IntSlider(min=16, max=limit, step=16, description="sequence length",
                               style=style, layout=wide),
        "lr": w.FloatLogSlider(base=10, min=-6, max=-1, step=0.1, readout_format=".1e",
                               description="learning rate", style=style, layout=wide),
    }


def _widget_value(name: str, value):
    # activation_checkpointing is True/False/N in Techniques and 0..N on the slider.
    return int(value) if name == "activation_checkpointing" else value


class Panel(w.VBox):
    """Controls, Step / Run buttons, a status line and the live memory chart of a session."""

    def __init__(self, session, min_redraw_interval: float = 0.5) -> None:
        self.session = session
        self.controls = _controls(session)
        for name, control in self.controls.items():
            control.tooltip = HELP[name]
            control.value = _widget_value(name, getattr(session.techniques, name))
            control.observe(self._on_control, names="value")
        self.steps = w.BoundedIntText(value=20, min=1, max=100_000, description="steps",
                                      layout=w.Layout(width="160px"))
        self.step_button = w.Button(description="Step", icon="forward",
                                    tooltip="Run one optimizer step")
        self.run_button = w.Button(description="Run", icon="play", button_style="primary",
                                   tooltip="Run the number of steps on the left")
        self.step_button.on_click(lambda _: self._train(1))
        self.run_button.on_click(lambda _: self._train(self.steps.value))
        self.status = w.HTML()
        self.chart = w.Image(format="png")
        self._figure = Figure(figsize=(9, 4))
        self._min_redraw_interval = min_redraw_interval
        self._last_draw = float("-inf")
        self._syncing = False
        super().__init__([
            w.HTML("<b>nbtune</b>: change a toggle, run a few steps, watch where memory goes."),
            *self.controls.values(),
            w.HBox([self.step_button, self.steps, self.run_button]),
            self.status, self.chart])
        session.subscribe(self._on_session)
        self._redraw(force=True)

    # widget -> session
    def _on_control(self, change) -> None:
        if self._syncing:
            return
        name = next(n for n, c in self.controls.items() if c is change["owner"])
        try:
            self.session.set(**{name: change["new"]})
        except (ValueError, TypeError) as err:
            self._sync_from(self.session.techniques)  # snap back: nothing was applied
            self._say(f"⚠ {err}", error=True)

    # session -> widget
    def _on_session(self, event: str, payload) -> None:
        if event == "techniques":
            self._sync_from(payload)
        elif event == "step":
            self._redraw()

    def _sync_from(self, techniques) -> None:
        self._syncing = True
        try:
            for name, control in self.controls.items():
                control.value = _widget_value(name, getattr(techniques, name))
        finally:
            self._syncing = False

    def _train(self, steps: int) -> None:
        for button in (self.step_button, self.run_button):
            button.disabled = True
        try:
            self.session.run(steps, progress=False, live=False)
        except Exception as err:  # show it in the panel; the session stays usable
            self._say(f"⚠ {type(err).__name__}: {err}", error=True)
        finally:
            for button in (self.step_button, self.run_button):
                button.disabled = False
            self._redraw(force=True)

    def _redraw(self, force: bool = False) -> None:
        if not force and time.monotonic() - self._last_draw < self._min_redraw_interval:
            return
        history = self.session.history
        self.chart.value = figure_png(draw_memory(self._figure, history))
        self._last_draw = time.monotonic()
        if history:
            last = history[-1]
            self._say(f"step {last.step}: loss {last.loss:.3f}, peak {format_bytes(last.memory.peak)}, "
                      f"{last.tokens_per_second:,.0f} tokens/s")

    def _say(self, text: str, error: bool = False) -> None:
        color = "#b00" if error else "#333"
        self.status.value = f"<span style='color:{color}'>{text}</span>"
