"""Session: a cell-by-cell trainer that owns the model, its techniques and its history."""

from __future__ import annotations

import os
import weakref
from importlib import resources
from pathlib import Path
from typing import Callable, Iterable

import torch

from .activations import set_activation_checkpointing
from .data import DataError, Example, BatchStream, format_prompt, load_examples, tokenize_all
from .models import Tokenizer, demo_model_dir, load_model
from .models.decoder import CausalLM
from .models.hf import DTYPES, resolve_folder
from .optim import build_optimizer
from .peft import apply_lora, has_lora, merge_lora, set_lora_options
from .step import StepReport, train_step
from .techniques import Techniques

DEMO_TECHNIQUES = Techniques(method="full", dtype="fp32", batch_size=16, seq_len=96, lr=1e-3)
DEMO_STEPS = 300  # enough for the embedded default to learn visibly: about a minute on 2 cores

# Which built component each toggle invalidates. Anything not listed is read live each step.
_REBUILDS_MODEL = {"dtype", "method", "lora_rank", "lora_targets"}
_RETUNES_MODEL = {"lora_alpha", "lora_dropout", "activation_checkpointing"}
_REBUILDS_DATA = {"seq_len", "batch_size", "seed"}
_REBUILDS_OPTIMIZER = _REBUILDS_MODEL | {"optimizer"}


def demo_data_file(split: str) -> Path:
    """Path of a split ("train" or "heldout") of the dataset shipped with nbtune."""
    return Path(str(resources.files("nbtune") / "datasets" / "demo" / f"{split}.jsonl"))


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _examples(data) -> list[Example]:
    if isinstance(data, (str, os.PathLike)):
        return load_examples(data)
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
        self._listeners: list[weakref.ref] = []
        techniques = techniques or Techniques()
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
        folder = resolve_folder(path_or_id, revision)
        model = load_model(folder, dtype=techniques.dtype, device=device or default_device())
        return cls(model, Tokenizer.from_folder(folder), train, heldout=held,
                   techniques=techniques, device=device)

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
        stream = self._stream
        if changed & _REBUILDS_DATA:
            stream = self._build_stream(new)
            stream.continue_from(self._stream)  # a new batch size goes on through the epoch
        if changed & (_REBUILDS_MODEL | _RETUNES_MODEL):
            self._transform_model(new, previous=self._techniques)
        if changed & _REBUILDS_OPTIMIZER:
            had_state = bool(self.optimizer.state)
            self.optimizer = build_optimizer(self.model, new)
            if had_state:
                self._say(f"optimizer state reset ({', '.join(sorted(changed & _REBUILDS_OPTIMIZER))} changed).")
        else:
            for group in self.optimizer.param_groups:
                group["lr"], group["weight_decay"] = new.lr, new.weight_decay
        self._stream, self._techniques = stream, new
        self._notify("techniques", new)
        return new

    def _build_stream(self, t: Techniques) -> BatchStream:
        samples, dropped = tokenize_all(self.train_examples, self.tokenizer, t.seq_len,
                                        source="the training data")
        if dropped:
            self._say(f"{dropped} of {len(self.train_examples)} rows have no response within "
                      f"seq_len={t.seq_len} and are skipped.")
        return BatchStream(samples, t.batch_size, self.tokenizer.pad_id, seed=t.seed)

    def _transform_model(self, new: Techniques, previous: Techniques | None) -> None:
        """Bring the model to ``new``'s method, dtype and checkpointing, keeping what it learned."""
        model = self.model
        reshape = previous is None or bool(new.changed(previous) & {"method", "lora_rank", "lora_targets"})
        if reshape and has_lora(model):
            merge_lora(model)  # adapters are folded into the base, not thrown away
            self._say("LoRA adapters merged into the base weights.")
        if previous is None or previous.dtype != new.dtype:
            model.to(DTYPES[new.dtype])
        if reshape:
            if new.method == "lora":
                apply_lora(model, new.lora_targets, new.lora_rank, new.lora_alpha, new.lora_dropout)
            else:
                model.requires_grad_(True)
        elif new.method == "lora":
            set_lora_options(model, new.lora_alpha, new.lora_dropout)
        set_activation_checkpointing(model, new.checkpoint_every)
        model.train()

    # ---- training -----------------------------------------------------------------------

    def step(self) -> StepReport:
        """One optimizer step over ``grad_accum`` micro-batches; returns and records its report."""
        batches = [{k: v.to(self.device) for k, v in self._stream.next().items()}
                   for _ in range(self._techniques.grad_accum)]
        report = train_step(self.model, self.optimizer, batches, self.tokenizer.pad_id,
                            step=len(self.history) + 1)
        self.history.append(report)
        self._notify("step", report)
        return report

    def run(self, steps: int, *, progress: bool = True, live: bool | None = None) -> list[StepReport]:
        """``steps`` steps with a progress bar; in a notebook the memory chart updates in place."""
        from tqdm.auto import tqdm

        from .ui.live import LiveChart, in_notebook

        chart = LiveChart() if (in_notebook() if live is None else live) else None
        reports = []
        with tqdm(total=steps, desc="training", unit="step", disable=not progress) as bar:
            for _ in range(steps):
                reports.append(self.step())
                bar.update()
                bar.set_postfix(loss=f"{reports[-1].loss:.3f}")
                if chart is not None:
                    chart.update(self.history)
        if chart is not None:
            chart.update(self.history, force=True)
        return reports

    # ---- using the model ----------------------------------------------------------------

    @torch.no_grad()
    def generate(self, prompt: str, *, input: str = "", max_new_tokens: int = 48,
                 raw: bool = False) -> str:
        """Greedy continuation of ``prompt``, formatted like the training rows unless ``raw``."""
        text = prompt if raw else format_prompt(prompt, input)
        bos = [] if self.tokenizer.bos_id is None else [self.tokenizer.bos_id]
        ids = torch.tensor([bos + self.tokenizer.encode(text)], device=self.device)
        limit = self.model.config.max_position_embeddings
        new: list[int] = []
        was_training = self.model.training
        self.model.eval()
        try:
            for _ in range(max_new_tokens):
                if ids.shape[1] >= limit:
                    break
                token = int(self.model(ids)[0, -1].argmax())
                if token == self.tokenizer.eos_id:
                    break
                new.append(token)
                ids = torch.cat([ids, ids.new_tensor([[token]])], dim=1)
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
            budget = len(self.tokenizer.encode(ex.reference)) + 4
            hits += self.generate(ex.prompt, raw=True, max_new_tokens=budget).strip() == ex.reference.strip()
        return hits / len(examples)

    # ---- showing ------------------------------------------------------------------------

    def chart(self):
        """A matplotlib Figure of the memory breakdown and peak over the steps so far."""
        from .ui.charts import memory_figure

        return memory_figure(self.history)

    def panel(self):
        """ipywidgets controls bound to ``techniques``, Step/Run buttons and the live chart."""
        from .ui.panel import Panel

        return Panel(self)

    def subscribe(self, callback: Callable[[str, object], None]) -> None:
        """Call ``callback(event, payload)`` on "techniques" and "step" events (held weakly)."""
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
