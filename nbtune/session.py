"""Session: a cell-by-cell trainer that owns the model, its techniques and its history."""

from __future__ import annotations

import dataclasses
import os
import weakref
from importlib import resources
from pathlib import Path
from typing import Callable, Iterable

import torch

from .activations import set_activation_checkpointing, set_compiled
from .data import (BatchStream, DataError, Example, check_renderable, load_examples, pack,
                   prompt_and_reference, prompt_ids, prompt_text, tokenize_all)
from .generate import generate_ids
from .hub import resolve_data_file, resolve_model_folder
from .memory import MemoryBreakdown
from .memory.sampling import MemorySampler
from .models import Tokenizer, demo_model_dir, load_model
from .models.decoder import CausalLM
from .models.hf import DTYPES
from .optim import build_optimizer, release_optimizer
from .overhead import OverheadBudget
from .peft import apply_lora, cast_model, has_lora, merge_lora, replace_adapters, set_lora_options
from .step import StepReport, train_step
from .techniques import Techniques

DEMO_TECHNIQUES = Techniques(method="full", dtype="fp32", batch_size=16, seq_len=96, lr=1e-3)
DEMO_STEPS = 300  # enough for the embedded default to learn visibly: about a minute on 2 cores

# Which built component each toggle invalidates. Anything not listed is read live each step.
_REBUILDS_MODEL = {"dtype", "method", "lora_rank", "lora_targets"}
_RETUNES_MODEL = {"lora_alpha", "lora_dropout", "activation_checkpointing", "compile"}
_REBUILDS_DATA = {"seq_len", "batch_size", "seed", "packing"}
_REBUILDS_OPTIMIZER = _REBUILDS_MODEL | {"optimizer", "optimizer_in_backward",
                                          "cpu_offload_optimizer"}


def demo_data_file(split: str) -> Path:
    """Path of a split ("train" or "heldout") of the dataset shipped with nbtune."""
    return Path(str(resources.files("nbtune") / "datasets" / "demo" / f"{split}.jsonl"))


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _examples(data) -> list[Example]:
    """Rows from a local path, an ``hf://datasets/owner/name[@rev]/file`` URL, or an iterable."""
    if isinstance(data, (str, os.PathLike)):
        return load_examples(resolve_data_file(data))
    return list(data)


class Session:
    """Finetune one model cell by cell: ``step()``, ``run(n)``, ``set(...)``, ``panel()``.

    Every toggle lives in ``session.techniques``; ``set`` changes it and rebuilds only
    what depends on the changed fields. Each step appends a ``StepReport`` (loss, tokens,
    seconds, memory breakdown) to ``history``.
    """

    def __init__(self, model: CausalLM, tokenizer: Tokenizer, train: Iterable[Example] | str,
                 *, heldout: Iterable[Example] | str | None = None,
                 techniques: Techniques | None = None, device: str | torch.device | None = None):
        self.tokenizer = tokenizer
        self.device = torch.device(device) if device is not None else default_device()
        self.train_examples = _examples(train)
        self.heldout_examples = _examples(heldout) if heldout is not None else []
        self.history: list[StepReport] = []
        self.source: str | None = None  # the folder or repo id the base model came from
        self.base_changed = False  # True once full training or a merge altered the base weights
        self._listeners: list[weakref.ref] = []
        self.overhead = OverheadBudget()  # what memory tracking and live charts may cost
        self._sampler = MemorySampler(self.overhead)
        self._last_memory: MemoryBreakdown | None = None
        techniques = techniques or Techniques()
        self._check_device_rules(techniques)
        self._stream = self._build_stream(techniques)
        self.model = model.to(self.device)
        self._transform_model(techniques, previous=None)
        self.optimizer = build_optimizer(self.model, techniques)
        self._techniques = techniques

    # ---- construction -------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, path_or_id: str | os.PathLike, data, *, heldout=None,
                        techniques: Techniques | None = None, device=None,
                        revision: str | None = None) -> "Session":
        """Load a Hugging Face folder or Hub repo id and the training data (JSONL path)."""
        techniques = techniques or Techniques()
        train = _examples(data)  # read the data before the weights: fail fast on bad rows
        held = _examples(heldout) if heldout is not None else None
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
        return self._techniques

    @techniques.setter
    def techniques(self, value: Techniques) -> None:
        self.set(**{name: getattr(value, name) for name in value.changed(self._techniques)})

    def set(self, **changes) -> Techniques:
        """Change toggles; rebuilds only what depends on them. Bad values change nothing."""
        new = self._techniques.replace(**changes)  # validates the whole combination first
        changed = new.changed(self._techniques)
        if not changed:
            return new
        self._check_device_rules(new)
        stream = self._stream
        if changed & _REBUILDS_DATA:
            stream = self._build_stream(new)
            stream.continue_from(self._stream)  # a new batch size goes on through the epoch
        if changed & (_REBUILDS_MODEL | _RETUNES_MODEL):
            self._transform_model(new, previous=self._techniques)
        if changed & _REBUILDS_OPTIMIZER:
            had_state = bool(self.optimizer.state)
            release_optimizer(self.optimizer)  # hooks off, state freed before the new one exists
            self.optimizer = build_optimizer(self.model, new)
            if had_state:
                self._say(f"optimizer state reset ({', '.join(sorted(changed & _REBUILDS_OPTIMIZER))} changed).")
        else:
            for group in self.optimizer.param_groups:
                group["lr"], group["weight_decay"] = new.lr, new.weight_decay
        self._stream, self._techniques = stream, new
        self._sampler.stale = True  # the next step is measured: it shows what the change did
        self._notify("techniques", new)
        return new

    def _check_device_rules(self, t: Techniques) -> None:
        broken = t.conflicts(self.device.type)
        if broken:
            raise ValueError(" ".join(rule.reason for rule in broken))

    def _build_stream(self, t: Techniques) -> BatchStream:
        samples, dropped = tokenize_all(self.train_examples, self.tokenizer, t.seq_len,
                                        source="the training data")
        if dropped:
            self._say(f"{dropped} of {len(self.train_examples)} rows have no response within "
                      f"seq_len={t.seq_len} and are skipped; raise seq_len to keep them.")
        if t.packing:
            samples = pack(samples, t.seq_len)
        return BatchStream(samples, t.batch_size, self.tokenizer.pad_id, seed=t.seed)

    def _transform_model(self, new: Techniques, previous: Techniques | None) -> None:
        """Bring the model to ``new``'s method, dtype and checkpointing, keeping what it learned."""
        model = self.model
        reshape = previous is None or bool(new.changed(previous) & {"method", "lora_rank", "lora_targets"})
        if reshape and previous is not None and previous.method == new.method == "qlora":
            # New rank or targets: fresh adapters on the same NF4 base. Folding the old ones
            # in would quantize the base again, losing precision each time.
            cast_model(model, DTYPES[new.dtype])
            replace_adapters(model, new.lora_targets, new.lora_rank, new.lora_alpha,
                             new.lora_dropout, quantize_base=True)
            self._say("new zero-initialised QLoRA adapters; the previous ones were dropped "
                      "(folding them into the NF4 base would quantize it again).")
        else:
            if reshape and has_lora(model):
                merge_lora(model)  # adapters are folded into the base, not thrown away
                self.base_changed = True
                self._say("LoRA adapters merged into the base weights.")
            if previous is None or previous.dtype != new.dtype:
                cast_model(model, DTYPES[new.dtype])  # model.to(dtype) would densify NF4 weights
            if reshape:
                if new.method in ("lora", "qlora"):
                    apply_lora(model, new.lora_targets, new.lora_rank, new.lora_alpha,
                               new.lora_dropout, quantize_base=new.method == "qlora")
                else:
                    model.requires_grad_(True)
            elif new.method in ("lora", "qlora"):
                set_lora_options(model, new.lora_alpha, new.lora_dropout)
        set_activation_checkpointing(model, new.checkpoint_every)
        if previous is None or previous.compile != new.compile:
            set_compiled(model, new.compile)
        model.train()

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
        t = self._techniques
        batches = [{k: v.to(self.device) for k, v in self._stream.next().items()}
                   for _ in range(t.grad_accum)]
        step = len(self.history) + 1
        for group in self.optimizer.param_groups:
            group["lr"] = t.lr_at(step)
        track = self._sampler.should_track(self.device.type, sampled)
        report = train_step(self.model, self.optimizer, batches, self.tokenizer.pad_id, step=step,
                            loss_chunks=t.chunked_loss, offload_activations=t.activation_offloading,
                            max_grad_norm=t.max_grad_norm, compiled_loss=t.compile, track=track)
        self._sampler.record(report.seconds, track, self.device.type)
        if report.memory is not None:
            self._last_memory = report.memory
        else:
            last = self._last_memory or MemoryBreakdown(device=str(self.device))
            report = dataclasses.replace(report, memory=last.carried())
        self.base_changed |= self._techniques.method == "full"
        self.history.append(report)
        self._notify("step", report)
        return report

    def run(self, steps: int, *, progress: bool = True, live: bool | None = None) -> list[StepReport]:
        """``steps`` steps with a progress bar; in a notebook the memory chart updates in place."""
        from tqdm.auto import tqdm

        from .ui.live import LiveChart, in_notebook

        chart = LiveChart(self.overhead) if (in_notebook() if live is None else live) else None
        reports = []
        with tqdm(total=steps, desc="training", unit="step", disable=not progress) as bar:
            for _ in range(steps):
                reports.append(self._step(sampled=True))
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

        return estimate(self.model.config, self._techniques, batch_size=batch_size,
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
        rows = ladder_techniques(self._techniques, configs)
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
        except torch.OutOfMemoryError:
            trial.optimizer.zero_grad(set_to_none=True)
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
        self._last_memory = next((r.memory for r in reversed(self.history) if r.memory.measured), None)
        self._notify("techniques", self._techniques)

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
                f"{self._techniques})")
