"""A panel that says when its kernel is gone.

A widget's view outlives its kernel: after the kernel is shut down, restarted or killed (out
of host memory is the common case) the page still shows a blue Run and a green badge, and
clicks go nowhere. The kernel therefore ticks a hidden widget every ``BEAT_SECONDS`` from one
thread a process (it keeps ticking while a cell runs), every panel and run view holds it, and
a watcher in the page (``WATCH_JS``, shown beside them) marks one whose ticks stopped for
``GONE_SECONDS``: its controls disabled and a line saying what happened and what to do.
Ticks that come back (a page that lost its connection for a while) undo it.
"""

from __future__ import annotations

import threading

import ipywidgets as w

BEAT_SECONDS = 1.0
GONE_SECONDS = 6.0  # no tick for this long: the kernel is taken to be gone (or stopped answering)
PANEL_CLASS, BEAT_CLASS = "nbtune-panel", "nbtune-heartbeat"
GONE_TEXT = ("The kernel behind this panel is gone (shut down, restarted, or killed: running "
             "out of host memory is the common cause) or has stopped answering, so the panel "
             "controls nothing. Restart the kernel and run the cells again; a checkpoint "
             "(session.start(..., checkpoint=...)) or session.recover() brings the training back.")


class Heartbeat:
    """The hidden widget the kernel ticks; ``close()`` stops the thread."""

    def __init__(self) -> None:
        self.widget = w.HTML(value="0", layout=w.Layout(display="none"))
        self.widget.add_class(BEAT_CLASS)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="nbtune-heartbeat", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        beats = 0
        while not self._stop.wait(BEAT_SECONDS):
            beats += 1
            try:
                self.widget.value = str(beats)
            except Exception:  # noqa: BLE001 - a closed comm: nothing left to tell
                return

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.widget.close()


_SHARED: list[Heartbeat] = []
_LOCK = threading.Lock()


def heartbeat() -> w.HTML:
    """The process's heartbeat widget, started on first use and shared by every panel and
    run view (one thread a process, however many panels are made and never closed)."""
    with _LOCK:
        if not _SHARED:
            _SHARED.append(Heartbeat())
        return _SHARED[0].widget


def display_watched(widget, **kwargs) -> None:
    """Show ``widget`` and, in a notebook, the page's watcher beside it (it runs once a page).
    A closed widget shows its text."""
    from IPython.display import display

    from .live import in_notebook

    bundle = widget._repr_mimebundle_(**kwargs) if widget._repr_mimebundle_ is not None else None
    if bundle is None:
        display(repr(widget))
        return
    display(bundle, raw=True)
    if in_notebook():  # (no text: a reopened notebook runs no saved script and shows its text)
        display({"application/javascript": watch_script(), "text/plain": ""}, raw=True)


# One watcher a page: every second, each panel whose tick has not changed for GONE_SECONDS is
# marked gone (controls it disabled remembered, so that ticks coming back re-enable only those).
WATCH_JS = """
(function () {
  if (window.nbtuneWatch) { return; }
  const GONE_MS = %(gone_ms)d, TEXT = %(text)s;
  function mark(panel) {
    panel.classList.add('nbtune-gone');
    panel.querySelectorAll('button, input, select, textarea').forEach(function (el) {
      if (!el.disabled) { el.disabled = true; el.dataset.nbtuneDisabled = '1'; }
    });
    const note = document.createElement('div');
    note.className = 'nbtune-gone-note';
    note.textContent = TEXT;
    note.style.cssText = 'color:#b00020;font-weight:bold;margin:4px 0;white-space:normal';
    panel.prepend(note);
    panel.style.opacity = '0.75';
    panel.style.pointerEvents = 'none';  // sliders and tabs too
    note.style.pointerEvents = 'auto';
  }
  function revive(panel) {
    panel.classList.remove('nbtune-gone');
    panel.querySelectorAll('[data-nbtune-disabled]').forEach(function (el) {
      el.disabled = false; delete el.dataset.nbtuneDisabled;
    });
    panel.querySelectorAll('.nbtune-gone-note').forEach(function (n) { n.remove(); });
    panel.style.opacity = '';
    panel.style.pointerEvents = '';
  }
  window.nbtuneWatch = setInterval(function () {
    const now = Date.now();
    document.querySelectorAll('.%(panel)s').forEach(function (panel) {
      const beat = panel.querySelector('.%(beat)s');
      if (!beat) { return; }
      if (panel.dataset.nbtuneBeat !== beat.textContent) {
        panel.dataset.nbtuneBeat = beat.textContent;
        panel.dataset.nbtuneSeen = String(now);
        if (panel.classList.contains('nbtune-gone')) { revive(panel); }
      } else if (now - Number(panel.dataset.nbtuneSeen) > GONE_MS
                 && !panel.classList.contains('nbtune-gone')) {
        mark(panel);
      }
    });
  }, 1000);
})();
"""


def watch_script() -> str:
    """The page's watcher, with this module's figures and text."""
    import json

    return WATCH_JS % {"gone_ms": int(GONE_SECONDS * 1000), "text": json.dumps(GONE_TEXT),
                       "panel": PANEL_CLASS, "beat": BEAT_CLASS}
