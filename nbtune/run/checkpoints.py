"""A run's checkpoints, with one owner: when to save, how many to keep, what a stop signal
does, and where a run resumes (as torchtune keeps them together in its CheckpointClient).

Two kinds of run use it:

* ``nbtune train`` (``StepCheckpoints``): ``checkpoints/step-NNNNNNNN/`` under its out
  folder every ``checkpoint_every`` steps and at the end, the newest ``keep_checkpoints``
  kept; when it is interrupted (Ctrl-C, or SIGTERM / SIGHUP turned into Ctrl-C by
  ``stop_signals``) the last completed step is saved; ``--resume`` continues the newest.
* a notebook's ``session.run`` / ``start(steps, checkpoint=folder)``: the folder the user
  named, every ``checkpoint_minutes`` (``PeriodicCheckpoint``); ``start`` also arms a
  ``SaveOnExit``: on SIGTERM or SIGHUP (in a kernel, where cells run on the main thread) and
  at interpreter exit (a kernel shut down from JupyterLab exits that way) while the run
  trains, the run stops at the end of the step under way, a checkpoint of the last completed
  step is written to ``folder``, and a SIGTERM or SIGHUP then ends the process with the usual
  128 + the signal's number. Nothing is written once the run has ended, and anywhere but
  ``folder``.

Rented GPUs are stopped with SIGTERM (spot instances, ``docker stop``, a platform's stop
button), followed by SIGKILL 10-30 s later; SIGHUP comes when the terminal goes away;
jupyter_server waits 5 s after a shutdown request before SIGTERM and SIGKILL follow
(``shutdown_wait_time``). The step under way and the save must end within that:
``benchmarks/checkpoint_save.py`` measures the save.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Callable

from ..interrupts import held

SIGNALS = ("SIGTERM", "SIGHUP")  # what stops a run's process from outside
CHECKPOINTS = "checkpoints"  # nbtune train's checkpoint folders, under its out folder


def install(handler) -> dict[int, object]:
    """``handler`` for each of ``SIGNALS`` this platform has; the handlers it replaced.
    (Handlers only exist in the main thread; call it there.)"""
    numbers = [getattr(signal, name) for name in SIGNALS if hasattr(signal, name)]
    return {number: signal.signal(number, handler) for number in numbers}


@contextlib.contextmanager
def stop_signals(saves: bool = True):
    """While training, SIGTERM and SIGHUP end the run as Ctrl-C does: the step in flight
    finished or undone, a checkpoint saved (unless not ``saves``: under torchrun, where the
    ranks may stop at different steps), the exit code 128 + the signal's number. Yields
    the list the signal's number goes in. A second signal while saving is ignored: the save
    it would cut short is what the first one asked for. (Elsewhere than the main thread the
    signals keep their defaults.)"""
    stopped: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield stopped
        return

    def handler(signum, frame) -> None:
        if stopped:
            return
        stopped.append(signum)
        sys.stderr.write(f"\nnbtune: {signal.Signals(signum).name}: ending the step" + (
            ", then saving a checkpoint\n" if saves else " (the newest checkpoint is where --resume goes on)\n"))
        came = held()
        if came is None:
            raise KeyboardInterrupt
        came()  # a step's update is being written: it ends as a Ctrl-C then would

    previous = install(handler)
    try:
        yield stopped
    finally:
        for number, old in previous.items():
            signal.signal(number, old)


def checkpoints(out: Path) -> list[Path]:
    """Complete checkpoint folders under ``out`` (``nbtune train``'s), oldest first."""
    folder = out / CHECKPOINTS
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir()
                  if p.is_dir() and p.name.startswith("step-") and (p / "trainer_state.json").is_file())


class StepCheckpoints:
    """``nbtune train``'s checkpoints of ``parts`` (a run) under ``out``: every ``every``
    steps (None: never) and at step ``total``, the newest ``keep`` kept; ``lead``: this
    process prunes (rank 0); under torchrun (``parallel``) every rank saves its part and they
    meet after each save."""

    def __init__(self, parts, out: Path, every: int | None, keep: int, total: int,
                 lead: bool = True, parallel=None) -> None:
        self.parts, self.out, self.every, self.keep, self.total = parts, Path(out), every, keep, total
        self.lead, self.parallel = lead, parallel

    def resume(self, say: Callable[[str], None]) -> None:
        """Continue the newest checkpoint (``--resume``), or say there is none."""
        found = checkpoints(self.out)
        if found:
            self.parts.load_checkpoint(found[-1])
            say(f"resumed from {found[-1]} (step {len(self.parts.history)})")
        else:
            say(f"no checkpoint under {self.out / CHECKPOINTS}: starting at step 0")

    def after_step(self, report) -> None:
        if self.every and (report.step % self.every == 0 or report.step == self.total):
            self.save()

    def save(self) -> Path:
        """The run's state at its current step, the oldest beyond ``keep`` removed."""
        folder = self.parts.save_checkpoint(self.out / CHECKPOINTS / f"step-{len(self.parts.history):08d}")
        if self.lead:
            for old in checkpoints(self.out)[:-self.keep]:
                shutil.rmtree(old)
        if self.parallel is not None:
            self.parallel.barrier()
        return folder

    def interrupted(self, resume_with: str, say: Callable[[str], None]) -> None:
        """An interrupted run (Ctrl-C, SIGTERM, SIGHUP): save the last completed step and say
        how to continue (``resume_with``); under torchrun (the ranks may not all have stopped
        at the same step) say which checkpoint is the newest instead."""
        steps = len(self.parts.history)
        if steps and self.parallel is None:
            say(f"interrupted after step {steps}: saved {self.save()}; continue with {resume_with}")
        elif self.parallel is not None:
            found = checkpoints(self.out)
            say(f"interrupted after step {steps}: under torchrun no checkpoint is written on an "
                "interrupt; " + (f"the newest is {found[-1]} (--resume continues it)"
                                 if found else "none was written before it"))


class SaveOnExit:
    """Save ``session`` to ``folder`` if the process is stopped while ``run`` trains."""

    def __init__(self, session, run, folder: Path) -> None:
        self.session, self.run, self.folder = session, run, Path(folder)
        self.saved: Path | None = None
        self._lock = threading.Lock()
        self._previous: dict[int, object] = {}
        atexit.register(self._at_exit)
        if threading.current_thread() is threading.main_thread():  # handlers live there only
            self._previous = install(self._on_signal)

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
    from ..distributed import Parallel

    if isinstance(parts.parallel, Parallel):  # each rank's clock would differ
        raise ValueError(f"{name}: checkpoint= is not taken under torchrun, where every rank must "
                         "save at the same step: set the run file's checkpoint_every instead.")
    if Path(checkpoint).exists() and not Path(checkpoint).is_dir():
        raise ValueError(f"{name}: checkpoint={str(checkpoint)!r} is a file; name a folder "
                         "for the run's checkpoints.")
    return PeriodicCheckpoint(parts.save_checkpoint, checkpoint, minutes, say)


__all__ = ["CHECKPOINTS", "SIGNALS", "PeriodicCheckpoint", "SaveOnExit", "StepCheckpoints",
           "checkpoints", "install", "periodic_checkpoint", "stop_signals"]
