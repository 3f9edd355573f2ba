"""A background run in a notebook: its progress bar, status line and Stop button, shown in
the cell that started it (``Session.start``) and marked when the kernel is gone (``alive``)."""

from __future__ import annotations

import html
import time

import ipywidgets as w

from ..run.runner import Message, RunFinished, StepDone
from .alive import PANEL_CLASS, display_watched, heartbeat
from .status import run_status

STATUS_HELP = ("step: the session's optimizer step, the chart's count (with this run's steps "
               "done of its total where the session had steps before it); loss: the last step's mean loss per "
               "trained token; tokens/s: tokens read per second over this run's steps (padding "
               "not counted); elapsed: wall time since the run started; the time still to go "
               "(while it runs) assumes this run's pace so far; $: the price per hour times "
               "those times")


def wrapped(body: str, color: str = "#333", size: str = "100%", title: str | None = None) -> str:
    """HTML that wraps at the panel's edge: ipywidgets' HTML keeps one line and cuts the rest.
    ``title``: the hover text saying what its figures mean."""
    hover = f" title='{html.escape(title, quote=True)}'" if title else ""
    return (f"<div{hover} style='white-space:normal;overflow-wrap:anywhere;line-height:1.35;"
            f"color:{color};font-size:{size}'>{body}</div>")


def busy_of(session, run) -> float | None:
    """Other processes' share of the cores during ``run``, where it is said (``busy_words``)."""
    alone_on_cpu = session.parallel is None and session.device.type == "cpu"
    return run.others.so_far() if alone_on_cpu else None


class RunView(w.HBox):
    """A background run in a notebook: progress bar, status line and a Stop button."""

    def __init__(self, session, run) -> None:
        self.session, self.run = session, run
        self.bar = w.IntProgress(value=len(run.reports), min=0, max=run.steps,
                                 layout=w.Layout(width="240px"))
        self.line = w.HTML()
        self.stop_button = w.Button(description="Stop", icon="stop", button_style="danger",
                                    tooltip="Stop after the step under way",
                                    layout=w.Layout(width="90px"))
        self.stop_button.on_click(lambda _: self._stop())
        super().__init__([self.bar, self.stop_button, self.line, heartbeat()])
        self.add_class(PANEL_CLASS)  # marked when the kernel is gone, as the panel is
        self._subscription = session.subscribe(self._on_event)
        self._update()

    def _ipython_display_(self, **kwargs) -> None:
        display_watched(self, **kwargs)

    def close(self) -> None:
        self._subscription.close()
        super().close()

    def _stop(self) -> None:
        self.run.stop(wait=False)
        self.stop_button.disabled = True
        self.stop_button.description = "Stopping"

    def _on_event(self, event) -> None:
        if isinstance(event, (StepDone, RunFinished)):
            self._update()
            if isinstance(event, RunFinished) and event.run is self.run:
                self._subscription.close()  # its run is over: nothing more to show
        elif isinstance(event, Message) and self.run.running:
            self.line.value = wrapped(html.escape(event.text))

    def _update(self) -> None:
        run = self.run
        self.bar.value = min(len(run.reports), run.steps)
        end = run.finished or time.monotonic()
        text = run_status(run.reports, run.steps, end - run.started, self.session.price_per_hour,
                          finished=run.finished is not None, before=run.before,
                          busy=busy_of(self.session, run))
        if run.finished is not None:
            self.stop_button.layout.display = "none"
            self.bar.bar_style = "danger" if run.error else "warning" if run.stopped else "success"
            text = ("failed: " + str(run.error) + " · " if run.error else
                    "stopped · " if run.stopped else "done · ") + text
        self.line.value = wrapped(html.escape(text), title=STATUS_HELP)
