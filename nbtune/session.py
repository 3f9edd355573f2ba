"""Session: a cell-by-cell trainer that owns the model, its techniques and its history."""

from __future__ import annotations

import dataclasses
import os
import weakref
from importlib import resources
from pathlib import Path
from typing import Callable, Iterable

import torch

from .data import (BatchStream, DataError, Example, check_renderable, examples_from, pack,
                   prompt_and_reference, prompt_ids, prompt_text, tokenize_all)
from .generate import generate_ids
from .hub import resolve_model_folder
from .memory.sampling import MemorySampler
from .models import Tokenizer, demo_model_dir, load_model
from .models.decoder import CausalLM
from .overhead import OverheadBudget
from .step import StepReport
from .techniques import Techniques
from .trainer import Trainer

DEMO_TECHNIQUES = Techniques(method="full", dtype="fp32", batch_size=16, seq_len=96, lr=1e-3)
DEMO_STEPS = 300  # enough for the embedded default to learn visibly: about a minute on 2 cores

def demo_data_file(split: str) -> Path:
    """Path of a split ("train" or "heldout") of the dataset shipped with nbtune."""
    return Path(str(resources.files("nbtune") / "datasets" / "demo" / f"{split}.jsonl"))


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
                 device: str | torch.device | None = None):
        self.tokenizer = tokenizer
        self.device = torch.device(device) if device is not None else default_device()
        self.train_examples = examples_from(train)
        self.heldout_examples = examples_from(heldout, "the held-out data") if heldout is not None else []
        self.source: str | None = None  # the folder or repo id the base model came from
        self._listeners: list[weakref.ref] = []
        self.overhead = OverheadBudget()  # what memory tracking and live charts may cost
        self._sampler = MemorySampler(self.overhead)
        self.trainer = Trainer(model, self._build_stream, as_techniques(techniques), self.device,
                               tokenizer.pad_id, say=lambda message: self._say(message))

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
        """How a failed step is undone. "auto" (default): a host copy of the trainable weights
        and optimizer state is kept before each update when the optimizer steps in backward,
        on the first step after a rebuild, or when the copy is at most 256 MiB (any LoRA run);
        otherwise only Ctrl-C is held off during the in-place update, and an update that still
        fails half-way marks the session damaged until a state is loaded. "copy": always keep
        the copy. "none": never."""
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
                        revision: str | None = None) -> "Session":
        """Load a Hugging Face folder or Hub repo id and the training data (JSONL path)."""
        techniques = techniques or Techniques()
        train = examples_from(data)  # read the data before the weights: fail fast on bad rows
        held = examples_from(heldout, "the held-out data") if heldout is not None else None
        folder = resolve_model_folder(path_or_id, revision)
        tokenizer = Tokenizer.from_folder(folder)
        check_renderable(train + (held or []), tokenizer)
        quantize = techniques.lora_targets if techniques.method == "qlora" else ()
        model = load_model(folder, dtype=techniques.dtype, device=device or default_device(),
                           quantize=quantize)  # NF4 as each weight is read: lean loading
        session = cls(model, tokenizer, train, heldout=held, techniques=techniques, device=device)
        session.source = str(path_or_id)
        return session

    @classmethod
    def demo(cls, techniques: Techniques | None = None, device=None, **changes) -> "Session":
        """The embedded default: a tiny model (made on first use) and the shipped dataset."""
        techniques = (techniques or DEMO_TECHNIQUES).replace(**changes)
        return cls.from_pretrained(demo_model_dir(), demo_data_file("train"),
                                   heldout=demo_data_file("heldout"), techniques=techniques,
                                   device=device)

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
        failed change leaves the model, optimizer, data and techniques as they were."""
        new = self.techniques.replace(**changes)  # validates the whole combination first
        if self.trainer.set(new):
            self._sampler.stale = True  # the next step is measured: it shows what the change did
            self._notify("techniques", new)
        return new

    def _build_stream(self, t: Techniques) -> BatchStream:
        samples, dropped = tokenize_all(self.train_examples, self.tokenizer, t.seq_len,
                                        source="the training data")
        if dropped:
            self._say(f"{dropped} of {len(self.train_examples)} rows have no response within "
                      f"seq_len={t.seq_len} and are skipped; raise seq_len to keep them.")
        if t.packing:
            samples = pack(samples, t.seq_len)
        return BatchStream(samples, t.batch_size, self.tokenizer.pad_id, seed=t.seed)

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
        return self._step(sampled=False)

    def _step(self, sampled: bool) -> StepReport:
        track = self._sampler.should_track(self.device.type, sampled)
        report = self.trainer.step(track)
        self._sampler.record(report.seconds, track, self.device.type)
        self._notify("step", report)
        return report

    def state_dict(self) -> dict:
        """The whole training state (model or adapters, optimizer, data position, RNG, history,
        techniques), by reference: ``copy.deepcopy`` it to keep a snapshot."""
        return self.trainer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """Return to a state from ``state_dict`` (same base model and data), all or nothing."""
        self.trainer.load_state_dict(state)
        self._sampler.stale = True
        self._notify("techniques", self.techniques)

    def run(self, steps: int, *, progress: bool = True, live: bool | None = None,
            on_oom: str = "raise") -> list[StepReport]:
        """``steps`` steps with a progress bar; in a notebook the memory chart updates in place.

        Ctrl-C (Kernel > Interrupt) ends the run cleanly after rolling back the step under
        way. ``on_oom="adapt"``: when a step runs out of memory, apply the estimator's first
        suggestion (said in the output), and retry the step; at most three times a run.
        """
        from tqdm.auto import tqdm

        from .oom import OutOfMemory
        from .ui.charts import format_bytes
        from .ui.live import LiveChart, in_notebook

        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"run(steps={steps!r}): steps must be a positive int, e.g. run(50).")
        if on_oom not in ("raise", "adapt"):
            raise ValueError(f"on_oom={on_oom!r} is not 'raise' or 'adapt'.")
        chart = LiveChart(self.overhead) if (in_notebook() if live is None else live) else None
        start, reports, adapted = len(self.history), [], 0
        with tqdm(total=steps, desc="training", unit="step", disable=not progress) as bar:
            while len(reports) < steps:
                try:
                    reports.append(self._step(sampled=True))
                except OutOfMemory as err:
                    if on_oom != "adapt" or not err.suggestions or adapted == 3:
                        raise
                    best, adapted = err.suggestions[0], adapted + 1
                    self._say(f"out of memory in the {err.phase} phase: set {best.label} "
                              f"(predicted peak {format_bytes(err.predicted or 0)} -> "
                              f"{format_bytes(best.peak)}) and retried the step.")
                    self.set(**best.changes)
                    continue
                except KeyboardInterrupt:
                    # The step under way was rolled back (or, if its update was being written,
                    # completed first): the session is consistent, so the run just ends here.
                    reports = self.history[start:]
                    self._say(f"interrupted: stopped after {len(reports)} of {steps} steps; the "
                              "session is as it was after the last completed step.")
                    break
                bar.update()
                bar.set_postfix(loss=f"{reports[-1].loss:.3f}")
                if chart is not None:
                    chart.update(self.history)
        if chart is not None:
            chart.update(self.history, force=True)
        self._notify("run", reports)
        return reports

    # ---- memory: before, across configurations, in detail -----------------------------

    def estimate(self, *, batch_size: int | None = None, seq_len: int | None = None):
        """The next step's memory predicted on fake tensors for full-length rows of this
        session's shape (or ``batch_size`` x ``seq_len``): seconds, no memory used."""
        from .memory.estimate import estimate

        return estimate(self.model.config, self.techniques, batch_size=batch_size,
                        seq_len=seq_len, device=self.device.type)

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
            model = load_model(resolve_model_folder(self.source), dtype=techniques.dtype,
                               device=self.device, quantize=quantize)
        else:  # built in code: the same shapes with fresh weights (memory does not depend on values)
            model = CausalLM(self.model.config)
        trial = Session(model, self.tokenizer, self.train_examples, techniques=techniques,
                        device=self.device)
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
                         at_peak=at_peak)

    def snapshot(self, path: str | os.PathLike, steps: int = 1) -> Path:
        """CUDA only: record the allocator's history over the next ``steps`` steps to
        ``path``, a pickle that https://pytorch.org/memory_viz opens. The steps train."""
        from .memory.snapshot import record_snapshot

        return record_snapshot(lambda: [self.step() for _ in range(steps)], path, self.device)

    # ---- using the model ----------------------------------------------------------------

    def generate(self, prompt: str, *, input: str = "", max_new_tokens: int = 48,
                 temperature: float = 0.0, top_p: float = 1.0, seed: int | None = None,
                 raw: bool = False) -> str:
        """Continue ``prompt`` (greedy at temperature 0, else sampled with top-p).

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
        return self.tokenizer.decode(new)

    def evaluate(self, examples: Iterable[Example] | None = None) -> float:
        """Exact-match accuracy of greedy answers on the held-out rows (or ``examples``)."""
        examples = list(self.heldout_examples if examples is None else examples)
        if not examples:
            raise DataError("No held-out rows to evaluate on: pass heldout= when creating the "
                            "session, or give examples.")
        hits = 0
        for ex in examples:
            prompt, reference = prompt_and_reference(ex, self.tokenizer)
            budget = len(self.tokenizer.encode(reference)) + 4
            hits += self.generate(prompt, raw=True, max_new_tokens=budget).strip() == reference.strip()
        return hits / len(examples)

    # ---- saving -------------------------------------------------------------------------

    def save(self, folder: str | os.PathLike, merge: bool = False) -> Path:
        """Full finetuning: an HF folder. LoRA: a PEFT adapter folder, or with ``merge``
        the merged full weights. transformers / peft load either; the write is atomic."""
        from .checkpoint import save_session

        return save_session(self, folder, merge=merge)

    def push_to_hub(self, repo_id: str, *, merge: bool = False, private: bool | None = None,
                    token: str | None = None) -> str:
        """Save (as ``save`` would) to a temporary folder and publish it; returns the commit URL."""
        import tempfile

        from .hub import push_to_hub

        with tempfile.TemporaryDirectory() as tmp:
            folder = self.save(Path(tmp) / "upload", merge=merge)
            return push_to_hub(folder, repo_id, private=private, token=token)

    def save_checkpoint(self, folder: str | os.PathLike) -> Path:
        """Weights or adapters, optimizer state, RNG, data position and history, to resume exactly."""
        from .checkpoint import save_training_checkpoint

        return save_training_checkpoint(self, folder)

    def load_checkpoint(self, folder: str | os.PathLike) -> None:
        """Continue a run saved by ``save_checkpoint`` (same base model and training data)."""
        from .checkpoint import load_training_checkpoint

        load_training_checkpoint(self, folder)
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
        """Call ``callback(event, payload)`` on "techniques", "step" and "run" (a run ended)
        events; the callback is held weakly."""
        ref = weakref.WeakMethod(callback) if hasattr(callback, "__self__") else weakref.ref(callback)
        self._listeners.append(ref)

    def _notify(self, event: str, payload) -> None:
        alive = []
        for ref in self._listeners:
            callback = ref()
            if callback is not None:
                alive.append(ref)
                callback(event, payload)
        self._listeners = alive

    def _say(self, message: str) -> None:
        print(f"nbtune: {message}")

    def __repr__(self) -> str:
        n = sum(p.numel() for p in self.model.parameters())
        trainable = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
        return (f"Session({self.model.config.model_type}, {n / 1e6:.2f}M params, "
                f"{trainable / 1e6:.2f}M trainable, {self.device}, steps={len(self.history)}, "
                f"{self.techniques})")
