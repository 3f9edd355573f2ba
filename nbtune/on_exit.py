"""A run's checkpoints where the user allows disk: every so many minutes of training
(``PeriodicCheckpoint``), and the last one when its process is stopped: a notebook kernel shut
down, or the machine stopped (SIGTERM from a spot instance's end, ``docker stop``, a
platform's stop button; SIGHUP when a terminal goes away).

``session.start(steps, checkpoint=folder)`` arms a ``SaveOnExit``: on SIGTERM or SIGHUP (in
a kernel, where cells run on the main thread) and at interpreter exit (a kernel shut down
from JupyterLab exits that way) while the run trains, the run stops at the end of the step
under way, a checkpoint of the last completed step is written to ``folder``, and a SIGTERM
or SIGHUP then ends the process with the usual 128 + the signal's number. Nothing is written
once the run has ended, and anywhere but ``folder``.

Time: jupyter_server waits 5 s after a shutdown request before SIGTERM and SIGKILL follow
(``shutdown_wait_time``); platforms wait 10-30 s after SIGTERM. The step under way and the
save must end within that: ``benchmarks/checkpoint_save.py`` measures the save.
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Callable

SIGNALS = ("SIGTERM", "SIGHUP")


class SaveOnExit:
    """Save ``session`` to ``folder`` if the process is stopped while ``run`` trains."""

    def __init__(self, session, run, folder: Path) -> None:
        self.session, self.run, self.folder = session, run, Path(folder)
        self.saved: Path | None = None
        self._lock = threading.Lock()
        self._previous: dict[int, object] = {}
        atexit.register(self._at_exit)
        if threading.current_thread() is threading.main_thread():  # handlers live there only
            for name in SIGNALS:
                if hasattr(signal, name):
                    number = getattr(signal, name)
                    self._previous[number] = signal.signal(number, self._on_signal)

    def save(self, why: str) -> Path | None:
        """Stop the run at the end of its step and write the checkpoint, once; None when the
        run had ended already, or had not completed a step."""
        with self._lock:
            if self.saved is not None or not self.run.running:
                return self.saved
            self.run.stop_event.set()
            self.run.thread.join()  # the step under way completes (or is undone if it fails)
            if not self.session.history:
                return None
            point = self.session.trainer.checkpoint
            if point is not None and point.step == len(self.session.history) \
                    and point.folder is not None and Path(point.folder) == self.folder:
                self.saved = self.folder  # the periodic save has just written this very step
            else:
                try:
                    self.saved = self.session.save_checkpoint(self.folder)
                except Exception as err:  # noqa: BLE001 - the process is ending: say it, do not hide the exit
                    _say(f"nbtune: {why}: the checkpoint to {self.folder} failed: "
                         f"{type(err).__name__}: {err}")
                    return None
        _say(f"nbtune: {why}: the background run stopped after step {len(self.session.history)}; "
             f"saved {self.saved} (continue with session.load_checkpoint({str(self.saved)!r}))")
        return self.saved

    def _on_signal(self, signum, frame) -> None:
        if self.run.running:
            self.save(signal.Signals(signum).name)
            sys.stdout.flush()
            os._exit(128 + signum)  # as the signal's default would end it, after the save
        previous = self._previous.get(signum, signal.SIG_DFL)
        if callable(previous):
            previous(signum, frame)
        elif previous != signal.SIG_IGN:  # the default: end the process as the signal does
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    def _at_exit(self) -> None:
        if self.run.running:
            self.save("the process is exiting (a kernel shut down?)")


def _say(text: str) -> None:
    """To the notebook (a kernel's stderr goes to its cell) and to the process's own stderr
    (the terminal or the server's log, which outlives the kernel)."""
    for stream in dict.fromkeys((sys.stderr, sys.__stderr__)):
        if stream is not None:
            try:
                stream.write("\n" + text + "\n")
                stream.flush()
            except (OSError, ValueError):  # closed as the process ends
                pass


class PeriodicCheckpoint:
    """A checkpoint to ``folder`` (the one the user named) after the first step that ends
    ``minutes`` or more after the last one: what ``recover()`` returns to after a failure, and
    what a new kernel resumes from, is at most that much training old. Each save replaces the
    last atomically; one that fails (a full disk) is said and the run goes on."""

    def __init__(self, save: Callable[[Path], Path], folder, minutes: float,
                 say: Callable[[str], None], clock: Callable[[], float] = time.monotonic) -> None:
        if isinstance(minutes, bool) or not isinstance(minutes, (int, float)) or not minutes > 0:
            raise ValueError(f"checkpoint_minutes={minutes!r}: give a positive number of minutes "
                             "(e.g. 30) between the run's checkpoints.")
        self.save, self.folder, self.minutes, self.say, self.clock = save, Path(folder), minutes, say, clock
        self.since = clock()
        self.saved: Path | None = None

    def after_step(self) -> None:
        if self.clock() - self.since < 60 * self.minutes:
            return
        try:
            self.saved = self.save(self.folder)
        except Exception as err:  # noqa: BLE001 - the run goes on; the last good checkpoint stays
            self.say(f"the checkpoint every {self.minutes:g} minutes to {self.folder} failed "
                     f"({type(err).__name__}: {err}); the run goes on, the last one stays.")
        finally:
            self.since = self.clock()


def periodic_checkpoint(name: str, checkpoint, minutes, parts, say) -> PeriodicCheckpoint | None:
    """``run``/``start``'s ``checkpoint=`` folder as a ``PeriodicCheckpoint`` (None: no folder,
    nothing written to disk)."""
    if checkpoint is None:
        return None
    from .distributed import Parallel

    if isinstance(parts.parallel, Parallel):  # each rank's clock would differ
        raise ValueError(f"{name}: checkpoint= is not taken under torchrun, where every rank must "
                         "save at the same step: set the run file's checkpoint_every instead.")
    if Path(checkpoint).exists() and not Path(checkpoint).is_dir():
        raise ValueError(f"{name}: checkpoint={str(checkpoint)!r} is a file; name a folder "
                         "for the run's checkpoints.")
    return PeriodicCheckpoint(parts.save_checkpoint, checkpoint, minutes, say)
