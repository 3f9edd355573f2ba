"""Ctrl-C held back while a piece of work must not be cut in two.

Python raises KeyboardInterrupt at whatever bytecode runs when SIGINT arrives (a cell's
interrupt in a kernel, Ctrl-C in a terminal), or when a stop signal (SIGTERM, SIGHUP) that
run control turns into Ctrl-C arrives. Where that would leave a half-written state (weights
written in place; a step applied but not yet recorded; the ranks' steps taken but not yet
recorded), the owner holds Ctrl-C for the block, is told it came, and acts on it once the
state is whole. A stop signal's handler asks ``held()`` first, so it waits the same way.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Callable

_holds: list[Callable[[], None]] = []  # each hold's ``came`` in force, innermost last (main thread)


@contextlib.contextmanager
def ctrl_c_held(came: Callable[[], None]):
    """Until the block ends, Ctrl-C (and a stop signal, through ``held``) calls ``came()``
    instead of raising. Main thread only: no other thread is sent signals, so elsewhere the
    block runs as it is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, lambda signum, frame: came())
    _holds.append(came)
    try:
        yield
    finally:  # (a handler set outside Python reads as None: Python's own is put back)
        _holds.pop()
        signal.signal(signal.SIGINT, previous if previous is not None else signal.default_int_handler)


def held() -> Callable[[], None] | None:
    """The innermost hold's ``came`` while one is in force, else None: a signal handler that
    would raise KeyboardInterrupt calls it instead."""
    return _holds[-1] if _holds else None


class StepHold:
    """Ctrl-C (and a stop signal) held for a whole training step, so that it never lands in
    the middle of a hook's registration or a half-entered context: it counts at the step's
    ``stop_point()``s (phase boundaries, each token written) until ``writing()`` says the
    update has begun to be written where it cannot be undone; from then it waits until the
    step is recorded (``came`` tells the owner, after the block)."""

    def __init__(self) -> None:
        self.came, self._writing, self._held = False, False, None

    def __enter__(self) -> "StepHold":
        self._held = ctrl_c_held(self._note)
        self._held.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._held.__exit__(*exc)

    def _note(self) -> None:
        self.came = True

    def stop_point(self) -> None:
        """A point where the step may end (rolled back): raise if Ctrl-C came meanwhile."""
        if self.came and not self._writing:
            self.came = False
            raise KeyboardInterrupt

    def writing(self) -> None:
        """The update is being written: a Ctrl-C from here counts once the step is recorded."""
        self._writing = True
