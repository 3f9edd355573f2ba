"""Trainer: the one owner of training state, and the only code that changes it.

Model, optimizer, data position, RNG, step count and history live here, each with a
``state_dict``. Commands (``step``, ``set``, ``load_state_dict``) are transactions: they
either complete or leave the state exactly as it was.

* A step notes what it will change before it starts (data position, RNG, learning rates,
  history length) and, where the update may write weights in place before it can fail
  (optimizer stepped in backward, an optimizer failing half-way), keeps a host copy of
  each weight and its optimizer state taken just before that weight's update
  (``undo.UndoCopy``; when, by ``rollback`` and the host's free memory: ``_undo_for``).
  On any exception it drops the gradients, restores what it noted and what the update had
  written, clears the traceback's frames (they hold the step's activations, and IPython
  keeps the last traceback alive) and re-raises. Without a copy, Ctrl-C waits for the end
  of the update, and an update that still fails half-way marks the state damaged, naming
  the restore point ``session.recover()`` returns to.
* A non-finite loss or gradient stops the step before the optimizer runs
  (``NonFiniteError``).
* ``set`` checks everything it can first (``plan.check``), builds the new components beside
  the old ones while a ``ModelJournal`` keeps what the model transform replaces, and swaps
  them in only when all were built; otherwise it puts the old ones back.
"""

from __future__ import annotations

import contextlib
import gc
import time
import traceback
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from ..data import BatchStream
from ..interrupts import StepHold, ctrl_c_held
from ..memory import MemoryBreakdown
from ..units import format_bytes
from ..oom import OutOfMemory, explain, held_now
from ..predict import Predictor
from .. import host
from ..optim import OptimizerInBackward, build_optimizer, release_optimizer
from ..peft import adapter_state_dict, has_lora
from ..plan import (REBUILDS_DATA, REBUILDS_MODEL, REBUILDS_OPTIMIZER, RETUNES_MODEL, SHARDED_FIELDS,
                   SHARDED_REASON, ModelJournal, check, reference_problems, transform_model)
from ..objectives.reference import COPIES, copy_for, precomputed, restore_logps
from ..step import NonFiniteError, StepContext, StepOptions, StepReport, held_out_loss, train_step
from ..techniques import Techniques
from ..state import (base_fingerprint, check_optimizer_state, check_param_groups, check_weights,
                    full_weights, rng_problem, rng_state, set_rng_state, write_weights)
from ..undo import ROLLBACK_MODES, RestoreCopy, UndoCopy, copy_bytes, undo_units, undo_wanted



class DamagedStateError(RuntimeError):
    """An update failed half-way with no copy to undo it: the weights are not trustworthy."""


class HostMemoryError(MemoryError):
    """rollback='copy' asks for an undo copy the host's free memory cannot hold."""


@dataclass(frozen=True)
class RestorePoint:
    """A state the run can return to (``Session.recover``): a training checkpoint saved or
    loaded (``folder``), a LoRA run's restore copy in host memory (``undo.RestoreCopy``), or
    step 0, the base model's weights as loaded from its files (``folder`` None for both)."""

    step: int
    description: str
    folder: str | None = None

    def __str__(self) -> str:
        return f"step {self.step} ({self.description})"


@dataclass
class _Prepared:
    """Components built for new techniques, not yet swapped in."""

    techniques: Techniques
    stream: BatchStream
    optimizer: torch.optim.Optimizer
    journal: ModelJournal | None
    base_changed: bool
    messages: list
    rng: dict  # new adapters draw their initial values: an abort puts the RNG back
    copy: object = None  # a full finetune's reference copy (``objectives.reference.FrozenCopy``)


class Trainer:
    """Owns the model, optimizer, data stream, RNG, step count and history of one run.

    ``data`` (a ``TrainingData``) makes the batch stream and the held-out batches for a
    batch shape. What the user should read (a reset optimizer, rows skipped, no undo copy)
    collects in ``notes``; whoever drives the trainer takes them (``take_notes``) and says
    them. ``base``: the folder or parsed GGUF file the model was read from, so that a damaged
    full finetune can go back to step 0 (``recover``); None for a model built in code.
    """

    def __init__(self, model: nn.Module, data, techniques: Techniques, device: torch.device,
                 *, parallel=None, base=None, base_name: str | None = None) -> None:
        problems = check(techniques, model, device.type) + data.problems(techniques)
        if parallel is not None:
            from ..distributed import check_sharding

            problems += check_sharding(parallel.sharding, model, techniques, device.type,
                                       parallel.world)
        if problems:
            raise ValueError(" ".join(problems))
        self.parallel = parallel  # a distributed.Parallel under torchrun, else None
        self.device, self.data = device, data
        self.notes: list[str] = []  # for the user, until taken
        self._eval_peak: int | None = None  # the last measured evaluation's peak
        self._generation_peak = 0  # GRPO's: the last measured writing of the completions
        self._generation_measured: tuple | None = None  # ... under these techniques, optimizer
        # a preference objective's precomputed reference: ((seq_len, pairs, rows), [pairs, 2])
        self._reference: tuple | None = None
        self._copy = None  # a full finetune's frozen reference copy (``reference="copy"``)
        self.stream = self._new_stream(techniques, with_reference=False)  # the model comes next
        if parallel is None:
            self.model = model.to(device)
            self.base_fingerprint = base_fingerprint(self.model)  # of the weights as loaded
            transform_model(self.model, techniques, previous=None)
        else:  # each rank's share, built transformed and sharded (``shards.build_sharded``)
            self.model = model
            self.base_fingerprint = base_fingerprint(self.model)  # (a collective)
        self._primed = False  # FSDP2's gather buffers made (``step``)
        self.optimizer = build_optimizer(self.model, techniques)
        self.techniques = techniques
        self.history: list[StepReport] = []
        self.stream.reference_logps = self._reference_of(self.stream, techniques)
        self._copy = self._copy_for(techniques)
        self.base_changed = False  # True once full training or a merge altered the base weights
        # Under torchrun a failed step ends the job (the other ranks wait in a collective), so
        # no undo copy is kept there.
        self.rollback = "auto" if parallel is None else "none"
        self.damaged: str | None = None  # why the state cannot be trusted, after a failed update
        self.base, self.base_name = base, base_name
        self.checkpoint: RestorePoint | None = None  # the last checkpoint saved or loaded
        self._kept = RestoreCopy()  # a LoRA run's state after a recent step, in host memory
        self._kept_said = False
        self.last_memory: MemoryBreakdown | None = None
        self.last_undo_bytes = 0  # host bytes the last step's undo copy held
        self._undo = UndoCopy(device)
        # the model's Predictor, held: its estimates outlive the registry's few shapes, so a
        # step never re-estimates because the notebook asked about other models meanwhile
        self._predictor: Predictor | None = None
        self._kept_loss: tuple = (None, False)  # (configuration, gradients in forward?)
        self._undo_said: tuple | None = None  # the last "no copy kept" said, not to repeat it
        self._new_optimizer = True  # no update made by this optimizer yet
        self._interrupted = False
        self._start_rng = rng_state()  # step 0's, for ``reset``
        self.phase: list = ["done"]  # the step under way's phase ("done" between steps): for a heartbeat

    @property
    def restore_point(self) -> RestorePoint | None:
        """The newest state the run can return to (see ``RestorePoint``), or None."""
        kept = self._kept.state is not None and not self.base_changed and (
            self.checkpoint is None or self._kept.step > self.checkpoint.step)
        if kept:
            return RestorePoint(self._kept.step, "a copy of the trainable state kept in host memory")
        if self.checkpoint is not None:
            return self.checkpoint
        if self.base is not None and self.parallel is None and self.techniques.method == "full":
            return RestorePoint(0, f"the base weights read again from {self.base_name}, a fresh "
                                   "optimizer and the data from its start")
        return None

    def note_checkpoint(self, folder) -> None:
        """``folder`` now holds this run's state at its current step (saved or loaded)."""
        self.checkpoint = RestorePoint(len(self.history), f"the checkpoint in {folder}", str(folder))

    rank_memory = None  # each rank's breakdowns: the ranks' trainer has them (``RanksTrainer``)

    @property
    def trainable(self) -> int:
        """Weights trained (a sharded parameter counts whole)."""
        return sum(p.numel() for p in self.model.parameters() if p.requires_grad)

    def take_notes(self) -> list[str]:
        """What the trainer had to say since last asked, oldest first (then forgotten)."""
        notes, self.notes = self.notes, []
        return notes

    def _new_stream(self, t: Techniques, with_reference: bool = True) -> BatchStream:
        stream, notes = self.data.stream(t)
        self.notes += notes
        if with_reference:
            stream.reference_logps = self._reference_of(stream, t)
        return stream

    def _reference_of(self, stream: BatchStream, t: Techniques) -> torch.Tensor | None:
        """The precomputed reference of ``stream``'s pairs (``reference="precomputed"``; see
        ``objectives.reference.precomputed``), kept while the pairs' tokens stay the same."""
        if t.reference_kind != "precomputed":
            return None
        previous = getattr(self, "techniques", None)  # None while the trainer is being made
        copied = previous is not None and previous.reference_kind in COPIES  # (the reference: the copy's)
        self._reference, note = precomputed(
            None if copied else self._reference, stream, t, self._copy.model if copied else self.model, self.data, self.device,
            base=previous is not None and previous.reference_kind in ("adapters_off", *COPIES),
            trained_against=any(r.preference is not None for r in getattr(self, "history", [])))
        self.notes += [note] if note else []
        return self._reference[1]

    def _copy_for(self, t: Techniques, weights: dict | None = None, fresh: bool = False):
        """A full finetune's frozen reference copy for ``t`` (``objectives.reference.copy_for``):
        the one held (unless ``fresh``), else one of ``weights`` or of the model's now."""
        return copy_for(None if fresh else self._copy, t, self.model, self.device, weights=weights,
                        ranks=self.parallel is not None, previous=getattr(self, "techniques", None),
                        trained=any(r.preference is not None for r in self.history))

    @property
    def reference_copy(self):
        """The frozen reference copy held (``reference="copy"``), else None."""
        return self._copy

    # ---- commands ------------------------------------------------------------------------

    def set(self, new: Techniques, checked: bool = False) -> set[str]:
        """Switch to ``new`` techniques, all or nothing; returns the fields that changed.
        ``checked``: the rules were checked on them already (a queued change, on the
        techniques in use), so they are not checked twice."""
        self.check_usable()
        changed = new.changed(self.techniques)
        if changed:
            self.commit(self.prepare(new, checked))
        return changed

    def prepare(self, new: Techniques, checked: bool = False):
        """The first half of ``set``: build what ``new`` needs beside what is in use, changing
        nothing in use. ``commit`` swaps it in (it cannot fail), ``abort`` drops it: several
        ranks change together, or none does."""
        self.check_usable()
        fixed = new.changed(self.techniques) & SHARDED_FIELDS
        if fixed and self.parallel is not None:
            raise ValueError(f"{', '.join(sorted(fixed))} cannot change while {SHARDED_REASON}.")
        if self.parallel is not None and new.batch_size % self.parallel.world:
            raise ValueError(f"batch_size={new.batch_size} does not split over {self.parallel.world} "
                             "ranks: it is the global batch, so make it a multiple of the number of "
                             "processes.")
        return self._prepare(new, checked=checked)

    def commit(self, prepared) -> None:
        self._commit(prepared)

    def abort(self, prepared) -> None:
        self._abort(prepared)

    def step(self, track: bool, usage: bool = False) -> StepReport:
        """One optimizer step, all or nothing. ``track``: measure its memory (else the report
        carries the last measurement, ``measured=False``); ``usage``: meter its cheap figure
        (``memory.usage``: it resets the process's peak resident memory on a CPU)."""
        self.check_usable()
        t = self.techniques
        options = self._step_options(t)
        if self.parallel is not None and not self._primed:  # FSDP2's gather buffers made before
            from ..distributed import prime_units              # the first step (not while loading)

            prime_units(self.model)
            self._primed = True
        mark = self._mark()
        undo = self._undo_for(t)
        if isinstance(self.optimizer, OptimizerInBackward):
            self.optimizer.stepped = 0
        phase = self.phase = [None]
        number, shape = len(self.history) + 1, None
        # Ctrl-C (or SIGTERM in nbtune train) counts at the step's stop points, or once the
        # step is recorded: the step is undone whole, or completes
        with StepHold() as held:
            try:
                batches = [self.stream.next() for _ in range(t.grad_accum)]
                if self.parallel is not None:  # the global batch: this rank keeps its rows
                    batches = [self.parallel.rows(b, pairs=t.paired) for b in batches]
                if t.objective == "grpo":  # prompts: their completions written and rewarded first
                    phase[0] = "generation"
                    batches, rollouts = self._rollouts(batches, t, options, number, track, held.stop_point)
                batches = [{k: v.to(self.device) for k, v in b.items()} for b in batches]
                shape = max((tuple(b["input_ids"].shape) for b in batches), key=lambda s: s[0] * s[1])
                for group in self.optimizer.param_groups:
                    group["lr"] = t.lr_at(number)
                context = StepContext(phase=phase, writing=held.writing, stop_point=held.stop_point, undo=undo,
                                      parallel=self.parallel, copy=self._copy)
                report = train_step(self.model, self.optimizer, batches, options, context,
                                    pad_id=self.data.pad_id, step=number, track=track, usage=usage)
                if t.objective == "grpo":
                    report = replace(report, rollouts=rollouts[1], seconds=report.seconds + rollouts[0],
                                     memory=report.memory and replace(report.memory,
                                                                      generation_peak=self._generation_peak))
            except BaseException as err:
                oom = isinstance(err, torch.OutOfMemoryError) and not isinstance(err, OutOfMemory)
                held = held_now(self.model, self.optimizer, self.device) if oom else None
                written = getattr(self.optimizer, "stepped", 0)  # weights the update had written
                self._roll_back(mark, undo, phase[0], t)
                _drop_frames(err)
                damaged = self.damaged  # None when the step started: set if this one was half-written
                if isinstance(err, NonFiniteError) and damaged:  # the error must not say "unchanged"
                    raise DamagedStateError(
                        f"Step {number} could not be refused whole: the gradient of {err.tensor} is not "
                        f"finite, found after the optimizer in backward had written {written} weights. "
                        + damaged) from None
                if not oom:
                    raise
                try:  # memory is back: now the estimator can say what would fit
                    if shape is not None and t.paired:  # rows are pairs: batch_size of them
                        shape = (shape[0] // 2, shape[1])
                    elif shape is not None and t.objective == "grpo":  # prompts, and room for their completions
                        shape = (shape[0] // t.generations, t.seq_len)
                    explained = explain(err, phase[0], number, held, self.model.config, t,
                                        self.device, shape, self.parallel, damaged=damaged)
                except Exception:  # noqa: BLE001 - never hide the out-of-memory error itself
                    raise err from None
                raise explained from err
            if undo is not None:
                undo.done()
            self._new_optimizer = False
            if report.memory is not None:
                self.last_memory = report.memory
            else:
                last = self.last_memory or MemoryBreakdown(device=str(self.device))
                report = replace(report, memory=last.carried())
            if t.eval_every and self._eval_peak:  # what must fit includes the evaluations to come
                report = replace(report, memory=replace(report.memory, eval_peak=self._eval_peak))
            self.base_changed |= t.method == "full"
            self.history.append(report)
            self._keep(report)
        phase[0] = "done"
        if t.eval_every and number % t.eval_every == 0 and not held.came:
            report = self._evaluate(report, track, t)
        if held.came:  # Ctrl-C arrived while the update was being written: now it counts
            raise KeyboardInterrupt
        return report

    def _rollouts(self, batches: list[dict], t: Techniques, options: StepOptions, number: int,
                  track: bool, stop_point: Callable[[], None]):
        """GRPO's completions written and rewarded (``objectives.grpo.rollouts``); the writing's
        peak measured once a configuration (and its optimizer's state): watching every
        operator of a token-by-token loop costs ten times the writing itself."""
        from ..objectives.grpo import rollouts

        key = (t, self._new_optimizer)  # (before the first update the optimizer holds no state)
        track = track and self._generation_measured != key
        batches, made, peak = rollouts(self.model, self.optimizer, self.data, batches, t, options, number,
                                       self.parallel, track, stop_point)
        if track:
            self._generation_peak, self._generation_measured = peak, key
        return batches, made

    def steps(self, track: bool, track_rest: bool, most: int, until=None) -> list[StepReport]:
        """One step: each step here is its own command (``TrainerProtocol.steps``)."""
        return [self.step(track, usage=True)]

    def _evaluate(self, report: StepReport, track: bool, t: Techniques) -> StepReport:
        """Held-out loss after a completed step, recorded on its report. The step stands if
        the evaluation fails (it changes nothing: no gradients, no RNG, no data position)."""
        try:
            batches = self.data.eval_batches(t)
            if not batches:
                return report
            result = held_out_loss(self.model, batches, StepOptions.of(t),
                                   optimizer=self.optimizer, device=self.device,
                                   track=track or self._eval_peak is None, copy=self._copy)
        except BaseException as err:
            err.nbtune_report = report  # the step stands: the caller records it
            _drop_frames(err)
            gc.collect()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            if isinstance(err, Exception):
                err.add_note(f"nbtune: step {report.step} was applied and recorded; its held-out "
                             "evaluation (eval_every) failed. Lower batch_size or set chunked_loss "
                             "to shrink the evaluation's logits, or eval_every=0.")
            raise
        if result.memory is not None:
            self._eval_peak = result.memory.highest
        report = replace(report, eval_loss=result.loss, eval_preference=result.preference,
                         memory=replace(report.memory, eval_peak=self._eval_peak or 0))
        self.history[-1] = report
        return report

    # ---- state ---------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """The whole training state, by reference (clone it to keep it): equal state dicts give
        an equal next step. Weights are every weight after full training (NF4 ones as their
        parts), else only the LoRA adapters."""
        full = not has_lora(self.model) or self.base_changed
        return {
            "techniques": self.techniques,
            "full_weights": full,
            "weights": full_weights(self.model) if full else adapter_state_dict(self.model),
            "optimizer": self.optimizer.state_dict(),
            "data": self.stream.state_dict(),
            "rng": rng_state(),
            "history": list(self.history),
            "base_changed": self.base_changed,
            "base_fingerprint": self.base_fingerprint,
            "reference_logps": self.stream.reference_logps,  # a preference run's precomputed reference, or None
            "reference_copy": self._copy.weights() if self._copy is not None else None,  # a full finetune's
        }

    def load_state_dict(self, state: dict, *, placed: bool = False) -> None:
        """Bring the run to ``state`` (from ``state_dict`` or a checkpoint), all or nothing.

        Everything is checked before anything is written: the techniques, that the state
        belongs to this base model, every weight's name and shape, and the optimizer state
        (loaded into a fresh optimizer first). ``placed``: the weights and optimizer state
        are already in place (a sharded checkpoint, which each rank reads into its own
        shards); the rest is restored here, the techniques must be the run's own.
        """
        missing = {"techniques", "full_weights", "weights", "optimizer", "data", "rng", "history",
                   "base_changed", "base_fingerprint"} - set(state)
        if missing:
            raise ValueError(f"The training state lacks {sorted(missing)}: it was not made by "
                             "Trainer.state_dict or a complete checkpoint.")
        problem = rng_problem(state["rng"])  # the RNG is set last: checked first
        if problem:
            raise ValueError(f"The training state's RNG cannot be restored: {problem}. Nothing "
                             "was loaded.")
        if state["base_fingerprint"] != self.base_fingerprint:
            raise ValueError("This training state was made from a different base model (its "
                             "fingerprint of the base weights and config differs): load it into "
                             "a session on the model it was trained from.")
        if placed:
            if state["techniques"] != self.techniques:
                raise ValueError("This checkpoint was saved with other techniques than this run's: "
                                 "resume with the run file that wrote it.")
            stream = self.stream.copy()
            stream.load_state_dict(state["data"])
            restore_logps(stream, state, self.techniques)
            self.stream, self.history = stream, list(state["history"])
            self.base_changed, self.damaged = state["base_changed"], None
            set_rng_state(state["rng"])  # this rank's own
            self.last_memory = next((r.memory for r in reversed(self.history) if r.memory.measured), None)
            return
        if not state["full_weights"] and self.base_changed:
            raise ValueError("The state holds LoRA adapters trained on the original base weights, "
                             "but this session's base weights have changed since loading (full "
                             "training or merged adapters), so the adapters would not reproduce "
                             "the run: load it into a fresh session on the base model.")
        self.check_usable(loading=True)
        if state["techniques"].reference_kind in COPIES and state.get("reference_copy") is None:
            raise ValueError("The training state has no reference copy, but its techniques use "
                             f"reference={state['techniques'].reference_kind!r}: load a state saved with it.")
        prepared = self._prepare(state["techniques"], fresh_optimizer=True, copy=state.get("reference_copy"))
        try:
            check_weights(self.model, state["weights"], state["full_weights"])
            check_param_groups(prepared.optimizer, state["optimizer"]["param_groups"])
            prepared.optimizer.load_state_dict(state["optimizer"])
            check_optimizer_state(prepared.optimizer)  # torch's load does not check shapes
            stream = prepared.stream
            stream.load_state_dict(state["data"])
            restore_logps(stream, state, state["techniques"])
        except BaseException:
            self._abort(prepared)
            raise
        with self._critical():  # in-place writes: Ctrl-C waits until they are done
            try:
                write_weights(self.model, state["weights"], state["full_weights"])
            except BaseException:  # checked, so nearly impossible; never continue from a mix
                self._abort(prepared)
                self.damaged = ("Loading a training state failed while its weights were being "
                                "written, so the weights are part old, part new: load the state "
                                "(or a checkpoint) again to continue.")
                raise
            self._commit(replace(prepared, base_changed=state["base_changed"]), quiet=True)
            if state.get("reference_logps") is not None:  # the loaded reference is the one kept
                self._reference = ((state["techniques"].seq_len, len(self.stream.samples), id(self.data.train)),
                                   self.stream.reference_logps)
            self._kept.drop()  # from another timeline than the state now loaded
            self.history = list(state["history"])
            set_rng_state(state["rng"])
            self.damaged = None
        self.last_memory = next((r.memory for r in reversed(self.history) if r.memory.measured), None)
        if self._interrupted:
            self._interrupted = False
            raise KeyboardInterrupt

    def recover(self) -> RestorePoint:
        """Return to ``restore_point`` (a LoRA run's restore copy or the last checkpoint saved
        or loaded, whichever is newer, else step 0 with the base weights read again from
        their files, in place); returns it."""
        point = self.restore_point
        if point is None:
            raise ValueError(
                "There is no state to recover to: no checkpoint was saved or loaded, and the "
                "base weights cannot be read again (a LoRA session, or a model built in code). "
                "Load a state you kept (load_state_dict / load_checkpoint).")
        if point.folder is None and self._kept.state is not None and point.step == self._kept.step:
            kept = (self._kept.state, self._kept.step, self._kept.nbytes)
            self.load_state_dict(self._kept.copy())  # (drops the kept copy: it is still good)
            self._kept.state, self._kept.step, self._kept.nbytes = kept
        elif point.folder is not None:
            from ..checkpoint import read_training_checkpoint

            if not Path(point.folder).is_dir():
                raise FileNotFoundError(f"The checkpoint {point.folder} is gone: load another one "
                                        "(load_checkpoint) or a state you kept (load_state_dict).")
            self.load_state_dict(read_training_checkpoint(point.folder))
        else:
            from ..models.loading import reload_weights_

            self.reset(lambda model: reload_weights_(model, self.base))
        self.notes.append(f"recovered: the session is at {point}.")
        return point

    def reset(self, refill: Callable[[nn.Module], None]) -> None:
        """Back to step 0: ``refill(model)`` writes the base weights into the model in place
        (a full-finetuning model, reloaded from its files); then a fresh optimizer, the data
        from its start, the RNG as at step 0 and no history. Used to recover a damaged state
        where no checkpoint exists; if ``refill`` fails the state stays damaged."""
        if has_lora(self.model):
            raise ValueError("Only a full-finetuning model is reset to its base weights; LoRA "
                             "adapters have no state to return to but a checkpoint.")
        with self._critical():
            try:
                refill(self.model)
            except BaseException:
                self.damaged = self.damaged or ("Reloading the base weights failed part-way: the "
                                                "weights are part old, part new.")
                raise
            self._reference = None  # (scored again too)
            try:
                self._copy = None  # the reference at step 0 is the base: copied again
                self._copy = self._copy_for(self.techniques, fresh=True)
            except BaseException:
                self.damaged = self.damaged or "The base weights were read again, not their reference copy: recover again."
                raise
            optimizer, stream = build_optimizer(self.model, self.techniques), self._new_stream(self.techniques)
            release_optimizer(self.optimizer)
            self.optimizer, self.stream, self._new_optimizer = optimizer, stream, True
            self.history, self.base_changed, self.damaged = [], False, None
            self.last_memory, self._eval_peak = None, None
            self._kept.drop()
            set_rng_state(self._start_rng)
        self._undo.release()
        if self._interrupted:
            self._interrupted = False
            raise KeyboardInterrupt

    # ---- transactions --------------------------------------------------------------------

    def _prepare(self, new: Techniques, fresh_optimizer: bool = False, checked: bool = False,
                 copy: dict | None = None) -> _Prepared:
        """Build what ``new`` needs beside what exists; on failure, undo and re-raise.
        ``copy``: a loaded state's reference copy weights."""
        problems = [] if checked else check(new, self.model, self.device.type) + self.data.problems(new)
        problems += reference_problems(new, self.techniques, self.model)  # as the model is now
        if problems:
            raise ValueError(" ".join(problems))
        changed = new.changed(self.techniques)
        stream = self.stream
        if changed & REBUILDS_DATA:
            stream = self._new_stream(new)  # may refuse (rows too long): nothing changed yet
            stream.continue_from(self.stream)  # a new batch size goes on through the epoch
        elif fresh_optimizer:  # loading a state: its position goes into a copy until commit
            stream = self.stream.copy()
        journal = ModelJournal(self.model) if changed & (REBUILDS_MODEL | RETUNES_MODEL) else None
        prepared = _Prepared(new, stream, self.optimizer, journal, self.base_changed, [], rng_state())
        try:
            if journal is not None:
                base_changed, prepared.messages = transform_model(self.model, new, self.techniques)
                prepared.base_changed |= base_changed
            if changed & REBUILDS_OPTIMIZER or fresh_optimizer:
                prepared.optimizer = build_optimizer(self.model, new)
            prepared.copy = self._copy_for(new, copy)
        except BaseException:
            self._abort(prepared)
            raise
        return prepared

    def _abort(self, prepared: _Prepared) -> None:
        if prepared.optimizer is not self.optimizer:
            release_optimizer(prepared.optimizer)
        if prepared.journal is not None:
            prepared.journal.restore()
        prepared.copy = None  # (a traceback held on to must not hold a copy of the weights)
        set_rng_state(prepared.rng)

    def _commit(self, prepared: _Prepared, quiet: bool = False) -> None:
        """Swap the prepared components in (nothing here can fail half-way). ``quiet``: a
        loaded state, whose optimizer keeps the learning rates it was saved with."""
        new, messages = prepared.techniques, list(prepared.messages)
        if prepared.optimizer is not self.optimizer:
            had_state = bool(self.optimizer.state)
            release_optimizer(self.optimizer)  # hooks off, state freed
            changed = sorted(new.changed(self.techniques) & REBUILDS_OPTIMIZER)
            if had_state and changed:
                messages.append(f"optimizer state reset ({', '.join(changed)} changed).")
        if not quiet:
            for group in prepared.optimizer.param_groups:
                group["lr"], group["weight_decay"] = new.lr, new.weight_decay
        if prepared.optimizer is not self.optimizer:
            self._new_optimizer = True
        self.optimizer, self.stream, self.techniques = prepared.optimizer, prepared.stream, new
        self._copy = prepared.copy
        self._reference = self._reference if new.reference_kind == "precomputed" else None  # (else scored again)
        self._eval_peak = None  # the next evaluation is measured: it shows what changed
        self.base_changed = prepared.base_changed
        if self.base_changed:  # adapters merged: an adapters-only copy no longer loads
            self._kept.drop()
        if prepared.journal is not None:
            prepared.journal.discard()
        if not quiet:
            self.notes += messages

    def check_usable(self, loading: bool = False) -> None:
        """Refuse (DamagedStateError) while the state cannot be trusted, except to load one."""
        if self.damaged and not loading:
            raise DamagedStateError(self.damaged)

    def where(self) -> str:
        """Where this trainer is, in words (what a heartbeat says): "during the backward phase
        of step 41", "between steps (after step 40)", "while saving the checkpoint of step 40"."""
        phase, done = self.phase[0], len(self.history)
        return (f"between steps (after step {done})" if phase == "done" else
                f"while saving the checkpoint of step {done}" if phase == "saving" else
                f"during the {phase or 'data'} phase of step {done + 1}")

    @contextlib.contextmanager
    def saving(self):
        """While a checkpoint of this state is written: the phase a heartbeat reports."""
        before, self.phase[0] = self.phase[0], "saving"
        try:
            yield
        finally:
            self.phase[0] = before

    # ---- one step's undo -----------------------------------------------------------------

    def _keep(self, report: StepReport) -> None:
        """After a completed step of a LoRA run (one process): refresh the restore copy in host
        memory when due and where the host has room (else said once)."""
        if self.parallel is not None or self.base_changed or not has_lora(self.model):
            return
        if not self._kept.due(len(self.history)):
            return
        began = time.perf_counter()
        try:  # the step has counted: a failed copy only loses the copy
            room = host.room(held=self._kept.nbytes, reserve=self._host_reserve(self.techniques))
            kept = self._kept.keep(self.state_dict(), len(self.history), room)
        except Exception:  # noqa: BLE001 - (out of host memory while copying)
            self._kept.drop()
            kept = False
        self._kept.pace(time.perf_counter() - began, report.seconds)  # all of it, not the copy alone
        if not kept and not self._kept_said:
            self._kept_said = True
            self.notes.append("no restore copy is kept in host memory (it does not fit there): "
                              "a failure half-way through an update recovers to the last "
                              "checkpoint; save one now and then (session.save_checkpoint).")

    def _mark(self) -> dict:
        return {"data": self.stream.state_dict(), "rng": rng_state(),
                "lrs": [g["lr"] for g in self.optimizer.param_groups]}

    def _undo_for(self, t: Techniques) -> UndoCopy | None:
        """The undo copy for the next update, or None (then Ctrl-C waits for the update's end
        and a failure half-way is damage).

        "copy": always (refused, changing nothing, where the host cannot hold it). "none":
        never. "auto": on CUDA where the copy is small (``UNDO_AUTO_BYTES``), where the update
        spans backward (optimizer in backward) or a new optimizer makes its state (the first
        step after a rebuild), in each case only if it fits in the host's free memory (else
        said once, in words); on CPU only on that first step (weights only, no state yet),
        since a CPU out of memory kills the process rather than raising.
        """
        if self.rollback not in ROLLBACK_MODES:
            raise ValueError(f"rollback={self.rollback!r} is not one of {', '.join(ROLLBACK_MODES)}.")
        # (a CPU's later steps under "auto" or "none" keep no copy: nothing to count there)
        sized = self.rollback == "copy" or (self.rollback == "auto" and (
            self._new_optimizer or self.device.type == "cuda"))
        units = undo_units(self.model, self.optimizer) if sized else []
        size = copy_bytes(units)
        wanted = undo_wanted(self.rollback, self.device.type, in_backward=t.optimizer_in_backward,
                             first=self._new_optimizer, size=size)
        room = host.room(held=self._undo.nbytes, reserve=self._host_reserve(t)) if wanted else None
        if not wanted or (room is not None and size > room):
            self._undo.release()
            self.last_undo_bytes = 0
            if wanted and self.rollback == "copy":
                raise HostMemoryError(
                    f"rollback='copy' needs a host copy of {format_bytes(size)} (the trainable "
                    f"weights and their optimizer state) and the host has {format_bytes(max(room, 0))} "
                    "free for it (less a margin for the notebook and what the step itself puts on "
                    "the host). Nothing was changed. Set session.rollback = 'auto' (no copy where it "
                    "does not fit: Ctrl-C waits for the update, a failure half-way is recovered "
                    "with session.recover()), free host memory, or train fewer weights (LoRA).")
            if wanted:
                self._say_no_copy(t, size, room)
            return None
        self._undo.begin(units)
        self.last_undo_bytes = size
        return self._undo

    def _say_no_copy(self, t: Techniques, size: int, room: int) -> None:
        """Say once per configuration that the update runs without a copy, and what holds."""
        key = (t, self.rollback)
        if self._undo_said == key:
            return
        self._undo_said = key
        back = (f"session.recover() returns to {self.restore_point}" if self.restore_point
                else "save a checkpoint (session.save_checkpoint) to have a state to return to")
        self.notes.append(f"no undo copy is kept for this update: it needs {format_bytes(size)} of host memory "
                 f"(trainable weights and optimizer state) and {format_bytes(max(room, 0))} is free "
                 "for it. Ctrl-C waits until the update is written; if the update itself fails "
                 f"half-way the session is marked damaged and {back}.")

    def _step_options(self, t: Techniques) -> StepOptions:
        """What the step reads of ``t``. A chunked loss's pieces make their gradients in
        forward where the estimate says that raises no peak (``Predictor.keeps_loss_pieces``,
        decided once per configuration), else are recomputed, as where it cannot say.
        Across processes they are recomputed: every rank must choose alike, and the estimate
        is one process's."""
        if self._kept_loss[0] != t:
            keep = False
            if self.parallel is None and t.chunked_loss > 1:
                try:
                    keep = self._predicted().keeps_loss_pieces(t)
                except Exception as err:  # noqa: BLE001 -- the estimator's own bug: recompute
                    self.notes.append(f"the loss pieces are recomputed in backward: the memory "
                                      f"estimate failed ({type(err).__name__}: {err}).")
            self._kept_loss = (t, keep)
        return StepOptions.of(t, recompute_loss=not self._kept_loss[1])

    def _predicted(self) -> Predictor:
        if self._predictor is None:
            self._predictor = Predictor.of(self.model.config, self.device.type)
        return self._predictor

    def _host_reserve(self, t: Techniques) -> int:
        """Host bytes a step of ``t`` takes by itself (CUDA): activations offloaded to pinned
        memory (estimated once per configuration) and paged optimizer state, which the driver
        moves to the host when the card runs short."""
        if self.device.type != "cuda":
            return 0
        from ..memory.accounting import paged_state_bytes

        reserve = paged_state_bytes(self.optimizer)
        if t.activation_offloading:  # estimated once per configuration
            reserve += self._predicted().estimate(t).host.offloaded
        return reserve

    def _critical(self):
        """Defer Ctrl-C while weights are written in place with no copy."""
        return ctrl_c_held(self._came)

    def _came(self) -> None:
        """Ctrl-C while it was held: it counts once the state is whole."""
        self._interrupted = True

    def _roll_back(self, mark: dict, undo: UndoCopy | None, phase: str | None,
                   t: Techniques) -> None:
        for p in self.model.parameters():
            p.grad = None
        for group, lr in zip(self.optimizer.param_groups, mark["lrs"]):
            group["lr"] = lr
        self.stream.load_state_dict(mark["data"])
        set_rng_state(mark["rng"])
        if undo is not None:
            undo.restore()  # the weights whose update had begun, and their state
            undo.done()
        elif phase == "optimizer" or getattr(self.optimizer, "stepped", 0):  # half-written
            back = (f"session.recover() returns to {self.restore_point}" if self.restore_point else
                    "load a checkpoint or a saved state_dict (session.load_checkpoint / "
                    "session.load_state_dict)")
            self.damaged = (
                f"An update failed in the {phase} phase after it had begun writing weights and "
                f"optimizer state, and no copy was kept to undo it (rollback={self.rollback!r}). "
                f"To go on, {back}. " + ("session.rollback = 'copy' keeps a copy (host memory "
                                         "permitting) to make such failures undoable."
                                         if self.parallel is None else
                                         "Across processes no copy is kept: checkpoint often "
                                         "(checkpoint_every)."))
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def _drop_frames(err: BaseException) -> None:
    """Clear the locals of every frame in ``err``'s traceback (and its context's): they hold
    the failed step's activations, which IPython would keep alive with the traceback."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        traceback.clear_frames(err.__traceback__)
        err = err.__context__
