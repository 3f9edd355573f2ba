"""Run control: who may touch the training state, the changes queued during a run, the one
training loop, and the events views and logs listen to.

The ``Runner`` sits between the front ends (``Session``, the panel, ``nbtune train``) and the
``Trainer``. Its loop reads top to bottom: apply what was queued -> decide whether this step
is measured -> ``trainer.step`` -> record -> tell the subscribers. A message is an event like
any other; the runner never prints. Whoever wants messages printed subscribes a printer (a
cell's command, the CLI's logger); a widget shows them in its own status line.
"""

from __future__ import annotations

import contextlib
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable

import torch

from .. import hardware
from ..hardware import Contention
from ..memory.sampling import MemorySampler
from ..oom import OutOfMemory
from ..overhead import OverheadBudget
from ..step import StepReport
from ..techniques import Techniques, label_of
from ..units import format_bytes


@dataclass
class Queued:
    """A change made during a background run, checked when it was made: ``result`` is the
    techniques it leads to (the plan after it), checked on ``checked_on`` (the plan before
    it). Applied at the next step boundary on that same base, it is not checked again; on
    another (a change before it was refused there) it is checked as a new one. ``result``
    None: it cannot follow the queue now (it is refused when its turn comes)."""

    changes: dict
    checked_on: Techniques | None
    result: Techniques | None


class BusyError(RuntimeError):
    """The session is training in a background run: the command would race with it."""


# ---- events --------------------------------------------------------------------------------

@dataclass(frozen=True)
class Event:
    """Something subscribers hear about; ``kind`` names it in one word."""

    kind = "event"


@dataclass(frozen=True)
class StepDone(Event):
    """A step completed.

    Attributes:
        report: Its ``StepReport``.
    """

    report: StepReport
    kind = "step"


@dataclass(frozen=True)
class TechniquesChanged(Event):
    """A change of techniques was applied.

    Attributes:
        techniques: The techniques now applied.
    """

    techniques: Techniques  # now applied
    kind = "techniques"


@dataclass(frozen=True)
class PendingChanged(Event):
    """The changes queued during a background run changed.

    Attributes:
        pending: The changes still queued, oldest first.
        planned: What they lead to.
    """

    pending: tuple  # the changes still queued, oldest first
    planned: Techniques  # what they lead to
    kind = "pending"


@dataclass(frozen=True)
class Message(Event):
    """The run said something (a row skipped, optimizer state reset, an adaptation).

    Attributes:
        text: What it said.
        thread: The thread it was said on: a command prints only its own.
    """

    text: str
    thread: int  # the thread it was said on: a command prints only its own
    kind = "message"


@dataclass(frozen=True)
class Refused(Event):
    """A queued change could not be applied at the step boundary.

    Attributes:
        changes: The change.
        error: Why.
    """

    changes: dict  # a queued change that could not be applied at the step boundary
    error: BaseException
    kind = "refused"


@dataclass(frozen=True)
class RunStarted(Event):
    """A background run started.

    Attributes:
        run: Its ``BackgroundRun``.
    """

    run: "BackgroundRun"
    kind = "started"


@dataclass(frozen=True)
class RunFinished(Event):
    """A run ended.

    Attributes:
        reports: The steps it completed.
        run: Its ``BackgroundRun``; None for a run in the caller's thread.
    """

    reports: tuple  # the steps the run completed
    run: "BackgroundRun | None"  # None for a run in the caller's thread
    kind = "finished"


class Subscription:
    """A subscriber's handle: ``close()`` and it hears nothing more (or use it in ``with``).

    Args:
        runner: The runner it listens to.
        callback: Called with each event.
    """

    def __init__(self, runner: "Runner", callback: Callable[[Event], None]) -> None:
        self.runner, self.callback = runner, callback

    def close(self) -> None:
        """Hear nothing more."""
        self.runner.unsubscribe(self)

    def __enter__(self) -> "Subscription":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ---- a run in the background ----------------------------------------------------------------

class BackgroundRun:
    """A run of ``start(steps)``: trains in a background thread, between steps applies the
    changes queued with ``set`` and stops when asked.

    ``reports`` grows as steps complete; ``error`` is what ended the run early, if anything;
    ``messages`` what the run said. In a notebook it shows itself as a progress bar with a
    Stop button (``show``, set by the session).

    Args:
        steps: How many steps the run trains.
        on_oom: "raise" or "adapt", as ``Session.run`` takes it.
        target: The function the thread runs, given the run (the runner's loop).
    """

    def __init__(self, steps: int, on_oom: str, target: Callable[["BackgroundRun"], None]) -> None:
        self.steps, self.on_oom = steps, on_oom
        self.reports: list[StepReport] = []
        self.messages: list[str] = []
        self.error: BaseException | None = None
        self.started = time.monotonic()
        self.finished: float | None = None
        self.stop_requested: float | None = None  # monotonic time Stop was asked for
        self.show: Callable[[], object] | None = None  # the widget a notebook displays
        self.on_exit = None  # a SaveOnExit where the session armed one (``start(checkpoint=)``)
        self.after_step: Callable[[], None] | None = None  # (``start(checkpoint=)``'s periodic save)
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=target, args=(self,), name="nbtune-run", daemon=True)
        self.before = 0  # the session's steps when it started: its first step is ``before + 1``
        self.others = Contention()  # other processes' share of the cores since it started
        self.shown_in: int | None = None  # the notebook cell that shows it already

    @property
    def running(self) -> bool:
        """True while the run's thread trains."""
        return self.thread.is_alive()

    @property
    def stopped(self) -> bool:
        """True when the run ended because ``stop`` was asked before its last step."""
        return self.stop_event.is_set() and len(self.reports) < self.steps

    def stop(self, wait: bool = True, timeout: float | None = None) -> "BackgroundRun":
        """Stop at the next step boundary (the step under way completes); ``wait`` for it.

        Args:
            wait: Return only once the run has ended.
            timeout: Seconds to wait at most.

        Returns:
            This run.
        """
        if self.stop_requested is None:
            self.stop_requested = time.monotonic()
        self.stop_event.set()
        if wait:
            self.wait(timeout)
        return self

    def wait(self, timeout: float | None = None) -> list[StepReport]:
        """Block until the run ends (Ctrl-C here stops it); re-raise what ended it early.

        Args:
            timeout: Seconds to wait at most (None: until it ends).

        Returns:
            The reports so far.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while self.thread.is_alive():  # short joins: Ctrl-C reaches the waiting thread
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return self.reports
                self.thread.join(0.1 if left is None else min(0.1, left))
        except KeyboardInterrupt:
            self.stop(wait=False)
            self.thread.join()
            return self.reports
        if self.error is not None:
            raise self.error
        return self.reports

    def __repr__(self) -> str:
        state = "running" if self.running else ("stopped" if self.stopped else
                                                  "failed" if self.error else "finished")
        said = f"; last said: {self.messages[-1]}" if self.messages else ""
        return f"<BackgroundRun {len(self.reports)}/{self.steps} steps, {state}{said}>"

    def _ipython_display_(self) -> None:
        from IPython import get_ipython
        from IPython.display import display

        shell = get_ipython()
        if self.shown_in is not None and shell is not None and shell.execution_count == self.shown_in:
            return  # ``start`` showed it in this cell's output already
        display(self.show() if self.show is not None else repr(self))


def check_run_args(name: str, steps, on_oom: str) -> None:
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"{name}(steps={steps!r}): steps must be a positive int, e.g. {name}(50).")
    if on_oom not in ("raise", "adapt"):
        raise ValueError(f"on_oom={on_oom!r} is not 'raise' or 'adapt'.")


# ---- the runner -----------------------------------------------------------------------------

class Runner:
    """Run control for one ``Trainer``: the claim on its state, the pending queue, the loop
    (in the caller's thread or a ``BackgroundRun``), out-of-memory adaptation, the memory
    sampler and the events."""

    MAX_ADAPT = 3  # on_oom="adapt" changes techniques at most this often per run

    def __init__(self, trainer) -> None:
        self.trainer = trainer
        self.overhead = OverheadBudget()  # what memory tracking and live charts may cost
        self.sampler = MemorySampler(self.overhead)
        self._lock = threading.Lock()
        # Queueing a change (its base read, checked, appended) is one move among setters and a
        # refusal's replan, so two panels' clicks never chain off the same base. Taken before
        # ``_lock``, never inside it.
        self._queueing = threading.Lock()
        self._subscribers: list[Subscription] = []
        self._run: BackgroundRun | None = None  # while one trains
        self._last_run: BackgroundRun | None = None
        self._pending: list[Queued] = []  # set(...) changes waiting for the next step boundary
        self._between: list[tuple] = []  # (task, Future) waiting for the next step boundary
        self._busy: threading.Thread | None = None  # a thread inside a synchronous command
        self._dtype_noted: str | None = None  # the dtype whose speed on this device was checked

    # ---- events ----------------------------------------------------------------------------

    def subscribe(self, callback: Callable[[Event], None]) -> Subscription:
        """Call ``callback(event)`` for every event from now on, until the returned
        subscription is closed. Events of a background run come from its thread."""
        subscription = Subscription(self, callback)
        with self._lock:
            self._subscribers.append(subscription)
        return subscription

    def unsubscribe(self, subscription: Subscription) -> None:
        with self._lock:
            if subscription in self._subscribers:
                self._subscribers.remove(subscription)

    def emit(self, event: Event) -> None:
        with self._lock:
            subscribers = list(self._subscribers)
        for subscription in subscribers:
            try:
                subscription.callback(event)
            except Exception as err:  # noqa: BLE001 - a broken view must not stop training
                if not isinstance(event, Message):
                    self.say(f"a subscriber failed on a {event.kind} event: "
                             f"{type(err).__name__}: {err}")

    def say(self, text: str) -> None:
        run = self._run
        if run is not None and threading.current_thread() is run.thread:
            run.messages.append(text)
        self.emit(Message(text, threading.get_ident()))

    def relay(self) -> None:
        """Say what the trainer noted (a reset optimizer, skipped rows, no undo copy)."""
        for note in self.trainer.take_notes():
            self.say(note)

    def changed(self) -> None:
        """The state was replaced wholesale (loaded, recovered): measure the next step, tell."""
        self.relay()
        self.sampler.stale = True
        self.emit(TechniquesChanged(self.trainer.techniques))

    @contextlib.contextmanager
    def replacing(self):
        """Around a command that replaces the state wholesale: on success measure the next
        step and tell the views (``changed``); either way what the trainer noted is said."""
        try:
            yield
        except BaseException:
            self.relay()
            raise
        self.changed()

    # ---- who may touch the training state ---------------------------------------------------

    @contextlib.contextmanager
    def claim(self, action: str):
        """Run a command on the training state from this thread, or refuse it: a background
        run owns the model, optimizer and data until it ends."""
        me = threading.current_thread()
        with self._lock:
            run = self._run
            if run is not None and me is not run.thread:
                raise BusyError(
                    f"{action}: a background run is training ({len(run.reports)} of {run.steps} "
                    "steps done). Stop it with session.stop() or wait for it with "
                    "session.wait(), then try again. (session.set(...) is fine meanwhile: it is "
                    "applied at the next step boundary.)")
            if self._busy is not None and self._busy is not me:
                raise BusyError(f"{action}: another thread ({self._busy.name}) is running a "
                                "command on this session; wait for it to finish.")
            outer, self._busy = self._busy, me
        try:
            yield
        finally:
            with self._lock:
                self._busy = outer

    # ---- changes -----------------------------------------------------------------------------

    @property
    def pending(self) -> list[dict]:
        """Changes made with ``set`` during a background run, not applied yet (oldest first)."""
        with self._lock:
            return [dict(queued.changes) for queued in self._pending]

    @property
    def planned(self) -> Techniques:
        """The techniques once every queued change is applied (the current ones if none):
        the last queued change's result, kept, not replayed at each read."""
        with self._lock:
            results = [q.result for q in self._pending if q.result is not None]
        return results[-1] if results else self.trainer.techniques

    def _replan(self) -> None:
        """After a queued change was refused at the boundary: the rest follow from what is
        in use now (each checked again when applied). Under the lock."""
        t = self.trainer.techniques
        for queued in self._pending:
            queued.checked_on = None
            try:
                queued.result = t = t.replace(**queued.changes)
            except (TypeError, ValueError):
                queued.result = None

    def set(self, changes: dict) -> Techniques:
        """Apply ``changes`` now, all or nothing; during a background run, check them now and
        queue them for the next step boundary. Returns the techniques they lead to."""
        with self._lock:
            run = self._run
            queue = run is not None and threading.current_thread() is not run.thread
        if queue:
            with self._queueing:
                base = self.planned
                planned = base.replace(**changes)  # bad values refused here and now, checked once
                self.check(planned)
                with self._lock:
                    queue = self._run is run  # the run may have ended meanwhile: apply it now
                    if queue:
                        self._pending.append(Queued(dict(changes), base, planned))
            if queue:
                self.emit(PendingChanged(tuple(self.pending), self.planned))
                return planned
        with self.claim("set"):
            return self.apply(changes)

    def check(self, t: Techniques) -> None:
        """Refuse, before the step boundary, what can be known now: device rules, model
        limits, what the data can do."""
        from ..plan import check

        problems = check(t, self.trainer.model, self.trainer.device.type)
        problems += self.trainer.data.problems(t)
        if problems:
            raise ValueError(" ".join(problems))

    def apply(self, changes: dict, checked: Techniques | None = None) -> Techniques:
        """``changes`` made now, all or nothing; ``checked``: their result, checked already on
        the techniques in use (a queued change on the base it was checked on)."""
        new = checked or self.trainer.techniques.replace(**changes)  # validates the whole combination
        try:
            changed = self.trainer.set(new, checked=checked is not None)
        except BaseException:
            self.relay()
            raise
        if changed:
            self.sampler.stale = True  # the next step is measured: it shows what the change did
            self.emit(TechniquesChanged(new))
        self.relay()  # after the change itself: what it did (an optimizer reset) follows it
        return new

    def apply_pending(self) -> None:
        """Apply the queued changes in order, each all or nothing (training thread)."""
        while True:
            with self._lock:
                if not self._pending:
                    return
                queued = self._pending[0]  # stays listed (and planned) until applied
            changes = queued.changes
            same = queued.checked_on is not None and queued.checked_on == self.trainer.techniques
            try:
                self.apply(changes, checked=queued.result if same else None)
            except Exception as err:  # noqa: BLE001 - one refused change does not end the run
                with self._queueing, self._lock:
                    self._pending.pop(0)
                    self._replan()
                self.say(f"{label_of(changes)} was not applied: {err}")
                self.emit(Refused(dict(changes), err))
            else:
                with self._lock:
                    self._pending.pop(0)
            self.emit(PendingChanged(tuple(self.pending), self.planned))

    # ---- steps -------------------------------------------------------------------------------

    def step(self) -> StepReport:
        """One step, always measured (unless memory tracking is "off")."""
        with self.claim("step"):
            return self._step(sampled=False)

    def _step(self, sampled: bool) -> StepReport:
        return self._steps(sampled)[0]

    def _steps(self, sampled: bool, most: int = 1,
               until: Callable[[], bool] | None = None) -> list[StepReport]:
        """One step; or, where the trainer takes several to a command (the ranks'
        ``RanksTrainer.steps``: one round trip for many short steps; a ``Trainer`` takes one),
        up to ``most``, ended at the first step boundary where ``until()`` (Stop, a queued
        change) is true. Right after a change one at a time: the sampler decides each step's
        measurement."""
        self._note_slow_dtype()
        device = self.trainer.device.type
        track = self.sampler.should_track(device, sampled)
        try:
            if most > 1 and not (self.sampler.stale and self.sampler.mode != "off"):
                rest = self.sampler.tracks_every_step(device)
                reports = self.trainer.steps(track, rest, most, until)
            else:
                reports, rest = self.trainer.steps(track, track, 1), track
        except BaseException as err:
            self.relay()
            report = getattr(err, "nbtune_report", None)  # the step stood, its evaluation failed
            stood = [report] if report is not None else getattr(err, "nbtune_reports", [])
            for report in stood:  # (or Ctrl-C came after the ranks' steps of a command)
                self.sampler.record(report.seconds, track, device)
                self.emit(StepDone(report))
            raise
        self.relay()
        for done, report in enumerate(reports):
            self.sampler.record(report.seconds, track if done == 0 else rest, device)
            self.emit(StepDone(report))
        return reports

    def _note_slow_dtype(self) -> None:
        """At the first step in a new dtype: say so if this CPU runs it far slower than fp32."""
        dtype = self.trainer.techniques.dtype
        if dtype == self._dtype_noted:
            return
        self._dtype_noted = dtype
        if dtype == "bf16" and self.trainer.device.type == "cpu":
            slow = hardware.bf16_slowdown()
            if slow > hardware.SLOW_BF16:
                self.say(f"bf16 matmuls run {slow:.0f}x slower than fp32 on this CPU (no native "
                         f"bf16; torch sees {torch.backends.cpu.get_cpu_capability()}), so these "
                         "steps will be slow. bf16 still halves the memory shown; dtype='fp32' "
                         "trains faster here.")

    def loop(self, steps: int, on_oom: str, reports: list, run: BackgroundRun | None = None,
             shown: Callable[[StepReport], None] | None = None,
             after_step: Callable[[], None] | None = None) -> list[StepReport]:
        """The one training loop: until ``steps`` steps completed (or the background run is
        stopped), apply what was queued, take a step (several, on ranks), record it, show it
        and (``after_step``) checkpoint it when due."""
        adapted = 0
        until = None if run is None else (  # what ends the ranks' several steps at a boundary
            lambda: run.stop_event.is_set() or bool(self._pending or self._between))
        while len(reports) < steps:
            if run is not None:
                self.apply_pending()
                self.run_between()
                if run.stop_event.is_set():
                    break
            try:
                taken = self._steps(True, steps - len(reports), until)
            except BaseException as err:
                stood = getattr(err, "nbtune_report", None)
                if stood is not None:
                    reports.append(stood)  # recorded before its evaluation failed
                if not isinstance(err, OutOfMemory) or stood is not None:
                    raise
                if on_oom != "adapt" or not err.suggestions or adapted == self.MAX_ADAPT \
                        or self.trainer.damaged:  # half-written: recover() first, not a retry
                    raise
                best, adapted = err.suggestions[0], adapted + 1
                self.say(f"out of memory in the {err.phase} phase: set {best.label} "
                         f"(predicted peak {format_bytes(err.predicted or 0)} -> "
                         f"{format_bytes(best.peak)}) and retried the step.")
                self.apply(best.changes)
                continue
            for report in taken:
                reports.append(report)
                if shown is not None:
                    shown(report)
            if after_step is not None:
                after_step()
        return reports

    def run(self, steps: int, on_oom: str = "raise",
            shown: Callable[[StepReport], None] | None = None,
            after_step: Callable[[], None] | None = None) -> list[StepReport]:
        """``steps`` steps in this thread. Ctrl-C ends the run cleanly after the step under
        way was rolled back (or, if its update was being written, completed first)."""
        self.ready("run", steps, on_oom)
        history = self.trainer.history
        with self.claim("run"):
            start, reports = len(history), []
            try:
                self.loop(steps, on_oom, reports, shown=shown, after_step=after_step)
            except KeyboardInterrupt:
                reports[:] = self.trainer.history[start:]
                self.say(f"interrupted: stopped after {len(reports)} of {steps} steps; the "
                         "session is as it was after the last completed step.")
        self.emit(RunFinished(tuple(reports), None))
        return reports

    # ---- work between steps ---------------------------------------------------------------

    def between_steps(self, task: Callable[[], object]) -> Future:
        """Run ``task`` on the training state between two steps, and return its ``Future``:
        at once in this thread when no background run trains, else on the run's thread at
        its next step boundary (the run waits for it). A task that leaves the state as it
        found it (a greedy reply: eval mode restored, no random numbers drawn) leaves the
        run's steps as they would have been without it."""
        future: Future = Future()
        with self._lock:
            run = self._run
            if run is not None and threading.current_thread() is not run.thread:
                self._between.append((task, future))
                return future
        _settle(future, task)
        return future

    def run_between(self) -> None:
        """Run the tasks queued for this step boundary, oldest first (training thread)."""
        while True:
            with self._lock:
                if not self._between:
                    return
                task, future = self._between.pop(0)
            _settle(future, task)

    def ready(self, name: str, steps, on_oom: str) -> None:
        """Refuse a run that cannot start (bad arguments, a damaged session, no training rows)
        before anything is drawn or started."""
        check_run_args(name, steps, on_oom)
        self.trainer.check_usable()
        self.trainer.data.check_rows()

    # ---- the background run ---------------------------------------------------------------

    def start(self, steps: int, on_oom: str = "raise",
              after_step: Callable[[], None] | None = None) -> BackgroundRun:
        """Train ``steps`` steps in a background thread; returns the ``BackgroundRun`` at once."""
        self.ready("start", steps, on_oom)
        with self._lock:
            if self._run is not None:
                raise BusyError(f"start: a background run is already training "
                                f"({len(self._run.reports)} of {self._run.steps} steps done): "
                                "session.stop() it or session.wait() for it first.")
            if self._busy is not None:
                raise BusyError(f"start: another thread ({self._busy.name}) is running a "
                                "command on this session; wait for it to finish.")
            self.trainer.check_usable()  # a damaged session says so here, not in the thread
            run = self._run = BackgroundRun(steps, on_oom, self._background)
            run.after_step = after_step
            run.before = len(self.trainer.history)
        try:
            run.thread.start()
        except BaseException:
            with self._lock:
                self._run = None
            raise
        self.emit(RunStarted(run))
        return run

    def _background(self, run: BackgroundRun) -> None:
        try:
            self.loop(run.steps, run.on_oom, run.reports, run=run, after_step=run.after_step)
        except BaseException as err:  # noqa: BLE001 - kept for wait() and shown
            run.error = err
            self.say(f"the run stopped at step {len(self.trainer.history)}: "
                     f"{type(err).__name__}: {err}")
        finally:
            try:
                while True:  # nothing stays pending or queued once the run has ended
                    self.apply_pending()
                    self.run_between()
                    with self._lock:
                        if not self._pending and not self._between:
                            self._run = None  # set() applies directly from here on
                            break
            finally:
                run.finished = time.monotonic()
                with self._lock:
                    self._run = None
                    self._last_run = run
                self.emit(RunFinished(tuple(run.reports), run))

    def stop(self, wait: bool = True) -> BackgroundRun | None:
        run = self._run
        return run.stop(wait=wait) if run is not None else None

    def wait(self, timeout: float | None = None) -> list[StepReport]:
        run = self._run or self._last_run
        return run.wait(timeout) if run is not None else []

    @property
    def current(self) -> BackgroundRun | None:
        """The background run while it trains, else None."""
        return self._run

    @property
    def last(self) -> BackgroundRun | None:
        """The background run that ended last, if any."""
        return self._last_run


def _settle(future: Future, task: Callable[[], object]) -> None:
    """Run ``task`` into ``future`` (its result, or what it raised)."""
    if not future.set_running_or_notify_cancel():
        return  # cancelled while it waited
    try:
        future.set_result(task())
    except BaseException as err:  # noqa: BLE001 - handed to whoever waits on the future
        future.set_exception(err)
