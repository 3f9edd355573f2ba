"""``nbtune train run.yaml``: a saved run unattended, on the notebook's own step.

The run factory (``nbtune.run.factory``) builds the run a notebook's ``Session.from_config`` would
wrap, and its runner trains (the same loop, trainer and transactions as a notebook's
``run``); after each step this module writes the metrics line, checkpoints and logs, and a
subscriber prints what the run says. Output
folder:

* ``run.yaml``: the configuration as run (flags applied);
* ``metrics.jsonl``: one JSON object per optimizer step (``step``, ``loss``, ``tokens``,
  ``seconds``, ``peak_bytes``, ``rank`` and more);
* ``checkpoints/step-NNNNNNNN/``: exact training state every ``checkpoint_every`` steps and at
  the end (always when interrupted: Ctrl-C, SIGTERM, SIGHUP), the newest ``keep_checkpoints`` kept; ``--resume``
  continues the newest, also to train further with a larger ``--steps``;
* ``final/`` (and ``merged/``, ``gguf/``): the saves the run file asks for;
* ``summary.json``: the run in numbers.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .. import files, runfile
from ..run import factory
from ..atomic import write_file_atomically
from ..hardware import Contention, busy_words
from ..run.checkpoints import CHECKPOINTS, StepCheckpoints, checkpoints, stop_signals
from ..units import format_bytes

METRICS = "metrics.jsonl"


def metrics_row(report, rank: int = 0) -> dict:
    memory = report.memory
    return {"step": report.step, "loss": report.loss, "tokens": report.tokens,
            "trained_tokens": report.trained_tokens, "seconds": report.seconds,
            "tokens_per_second": report.tokens_per_second, "lr": report.lr,
            "peak_bytes": memory.peak, "memory_measured": memory.measured,
            "memory": memory.categories, "eval_loss": report.eval_loss, "rank": rank,
            **({"router_loss": report.router_loss} if report.router_loss is not None else {}),
            **_rewards("rewards/", report.preference), **_rewards("eval/rewards/", report.eval_preference),
            **_rollouts(report)}


def _rollouts(report) -> dict:
    """A GRPO step's rewards and completions under TRL's metric names."""
    r = report.rollouts
    if r is None:
        return {}
    return {"reward": r.reward, "reward_std": r.reward_std,
            **{f"rewards/{name}/mean": value for name, value in r.rewards.items()},
            "completions/mean_length": r.completion_length, "completions/clipped_ratio": r.clipped,
            **({"kl": report.mean_kl} if report.mean_kl is not None else {})}


GRPO_KEYS = ("reward", "reward_std", "kl")  # (with rewards/NAME/mean and completions/..., TRL's names)
TRL_NAMES = {"chosen_reward": "chosen", "rejected_reward": "rejected", "margin": "margins",
             "accuracy": "accuracies"}  # as TRL logs them (``rewards/margins``, ...)


def _rewards(prefix: str, metrics) -> dict:
    """A preference step's (or held-out evaluation's) rewards under TRL's metric names."""
    return {} if metrics is None else {prefix + TRL_NAMES[k]: v for k, v in vars(metrics).items()}


def total_steps(settings, parts) -> int:
    """``steps``, or ``epochs`` turned into optimizer steps over this run's batches."""
    if settings.steps is not None:
        return settings.steps
    t = parts.techniques
    per_epoch = math.ceil(len(parts.trainer.stream.samples) / (t.batch_size * t.grad_accum))
    return max(1, math.ceil((settings.epochs or 1) * per_epoch))


class _Loggers:
    """metrics.jsonl always; TensorBoard when the run file asks (checked before any work)."""

    def __init__(self, out: Path, settings, rank: int, resumed_at: int) -> None:
        self.rank = rank
        name = METRICS if rank == 0 else f"metrics.rank{rank}.jsonl"
        self.path = out / name
        kept = []
        if resumed_at and self.path.exists():  # lines past the checkpoint are re-done
            lines = files.read_text(self.path, "metrics log", "state_bytes").split("\n")
            for number, line in enumerate(lines, 1):
                try:
                    if line.strip() and json.loads(line)["step"] <= resumed_at:
                        kept.append(line)
                except (ValueError, KeyError, TypeError):
                    if number >= len(lines) - 1:  # the last line, cut short by a kill: re-done
                        break
                    raise runfile.RunFileError(
                        f"{self.path}, line {number}: not a metrics line nbtune wrote; the file "
                        "is damaged. Move it away to resume (the checkpoint holds the run).") from None
        write_file_atomically(self.path, "".join(line + "\n" for line in kept))
        self.file = self.path.open("a")
        self.tensorboard = None
        if "tensorboard" in settings.log and rank == 0:
            from torch.utils.tensorboard import SummaryWriter

            self.tensorboard = SummaryWriter(str(out / "tensorboard"))

    def write(self, report) -> None:
        row = metrics_row(report, self.rank)
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        if self.tensorboard is not None:
            for key in ("loss", "tokens_per_second", "peak_bytes", "lr"):
                self.tensorboard.add_scalar(f"train/{key}", row[key], report.step)
            if report.eval_loss is not None:
                self.tensorboard.add_scalar("eval/loss", report.eval_loss, report.step)
            if report.router_loss is not None:
                self.tensorboard.add_scalar("train/router_loss", report.router_loss, report.step)
            for key in (k for k in row if "rewards/" in k or k in GRPO_KEYS or k.startswith("completions/")):
                self.tensorboard.add_scalar(key if key.startswith("eval/") else f"train/{key}",
                                            row[key], report.step)

    def close(self) -> None:
        self.file.close()
        if self.tensorboard is not None:
            self.tensorboard.close()


def check_loggers(settings) -> None:
    if "tensorboard" in settings.log:
        try:
            import tensorboard  # noqa: F401
        except ImportError:
            raise runfile.RunFileError("run.log asks for tensorboard, which is not installed: "
                                       "pip install tensorboard, or drop it from run.log.") from None


def rank_memory(parts, parallel) -> list[dict] | None:
    """Each rank's last measured breakdown (a collective under torchrun), else None."""
    if parallel is None:
        return None
    memory = parts.trainer.last_memory
    return parallel.gather({"rank": parallel.rank, "peak": memory.peak if memory else 0,
                            **(memory.categories if memory else {})})


def rank_table(rows: list[dict]) -> str:
    keys = [k for k in rows[0] if k not in ("rank",)]
    head = "rank  " + "  ".join(f"{k.replace('_', ' '):>16}" for k in keys)
    lines = [head] + [f"{r['rank']:4d}  " + "  ".join(f"{format_bytes(r[k]):>16}" for k in keys)
                      for r in rows]
    return "memory per rank (last measured step):\n" + "\n".join(lines)


def _line(report) -> str:
    memory = report.memory
    mark = "" if memory.measured else " (last measured)"
    eval_part = f"  eval {report.eval_loss:.3f}" if report.eval_loss is not None else ""
    eval_part += f"  balance {report.router_loss:.3f}" if report.router_loss is not None else ""
    if report.preference is not None:
        eval_part += (f"  margin {report.preference.margin:.3f}"
                      f"  accuracy {report.preference.accuracy:.0%}")
    if report.rollouts is not None:
        eval_part += f"  reward {report.rollouts.reward:.3f}"
    return (f"step {report.step:5d}  loss {report.loss:7.4f}{eval_part}  "
            f"{report.tokens_per_second:7.0f} tok/s  peak {format_bytes(memory.peak)}{mark}")


OURS = ".nbtune-run"  # marks an output folder nbtune train made: only such a folder is reused


def _ours(out_dir: Path) -> bool:
    """Whether nbtune train wrote ``out_dir``: its marker, or (folders of earlier versions)
    the run.yaml it writes, or a checkpoint it made."""
    return ((out_dir / OURS).is_file() or runfile.written_by_nbtune(out_dir / "run.yaml")
            or any(out_dir.glob(f"{CHECKPOINTS}/step-*/trainer_state.json")))


def check_out(out_dir: Path, run_file: Path) -> None:
    """Refuse an output folder that is a file, holds the run file, or holds files nbtune did
    not write: the run writes run.yaml, summary.json and more there, over what is in it."""
    if os.path.lexists(out_dir) and not out_dir.is_dir():
        raise runfile.RunFileError(f"The output folder {out_dir} is a file: choose a folder with "
                                   "--out or run.out.")
    if not out_dir.is_dir():
        return
    folder, given = out_dir.resolve(), run_file.resolve()
    own_copy = given == folder / "run.yaml" and runfile.written_by_nbtune(given)  # resuming from it
    if (folder == given.parent or folder in given.parents) and not own_copy:
        raise runfile.RunFileError(f"The output folder {out_dir} holds the run file {run_file}, "
                                   "which the run would write over: set run.out (or --out) to a "
                                   "folder of its own, e.g. out: nbtune-run.")
    foreign = [p.name for p in out_dir.iterdir() if not p.name.startswith(".")]
    if foreign and not _ours(out_dir):
        raise runfile.RunFileError(f"The output folder {out_dir} holds files nbtune did not write "
                                   f"({', '.join(sorted(foreign)[:3])}{', ...' if len(foreign) > 3 else ''}); "
                                   "they are left as they are. Choose a new or empty folder with "
                                   "--out or run.out.")


def train(path: str, *, overrides: dict, out: str | None, resume: bool, device: str | None,
          progress: bool = True) -> int:
    """Run a run file; returns the process exit code (0 done, 130 interrupted by Ctrl-C, 143
    by SIGTERM, 129 by SIGHUP: each saves a checkpoint first)."""
    from tqdm.auto import tqdm

    from ..distributed import Parallel
    from ..run.runner import Message

    config = runfile.load(path, overrides)
    settings = config.run
    out_dir = Path(out) if out is not None else Path(config.path(settings.out))
    check_loggers(settings)
    check_out(out_dir, Path(path))
    if not resume and ((out_dir / METRICS).exists() or checkpoints(out_dir)):
        raise runfile.RunFileError(
            f"{out_dir} already holds a run ({METRICS} or {CHECKPOINTS}/): pass --resume to continue "
            "it, or choose another folder with --out.")
    if config.processes is not None and int(os.environ.get("WORLD_SIZE", "1") or 1) < 2:
        raise runfile.RunFileError(
            f"{path}: processes: {config.processes} starts ranks from a notebook; from a terminal "
            f"start them with torchrun: torchrun --nproc_per_node {config.processes} -m nbtune "
            f"train {path}")
    parallel = Parallel.from_env(config.to_sharding())  # under torchrun: FSDP2 over its ranks
    rank = parallel.rank if parallel is not None else 0
    lead = rank == 0  # rank 0 prints and writes the shared files

    def say(text: str) -> None:
        if lead:
            tqdm.write(text)

    try:
        started = time.perf_counter()
        parts = factory.from_config(config, device=device, parallel=parallel)
        parts.runner.subscribe(lambda event: say(f"nbtune: {event.text}")
                               if isinstance(event, Message) else None)
        parts.runner.relay()  # what building the run had to say (rows skipped)
        if lead:
            out_dir.mkdir(parents=True, exist_ok=True)
            write_file_atomically(out_dir / OURS, json.dumps({"written_by": "nbtune train"}))
            effective = config.model_copy(update={
                "run": settings.model_copy(update={"out": str(out_dir.resolve())}),
                "model": config.path(config.model), "rewards": config.rewards_absolute(),
                "data": config.data.model_copy(update={
                    "train": config.path(config.data.train), "heldout": config.path(config.data.heldout)})})
            write_file_atomically(out_dir / "run.yaml", runfile.dump(effective))
        if parallel is not None:
            parallel.barrier()
        with stop_signals() as stopped:
            try:
                code = _run(parts, TrainJob(path, out, out_dir, settings, resume, parallel, rank,
                                            say, started, progress))
            except Exception as err:  # a rank or its machine gone: named, not a traceback
                lost = parallel.lost(err) if parallel is not None else None
                if lost is None:
                    raise
                parts = None
                raise lost from None
        if parallel is not None and code == 0:
            parallel.barrier()  # every rank done with the group before any tears it down
        return 128 + stopped[0] if code == 130 and stopped else code
    finally:
        parts = None  # (the sharded model holds the group: dropped, so close() frees it)
        if parallel is not None:
            parallel.close()


@dataclass
class TrainJob:
    """What ``nbtune train`` runs, besides the run itself: the run file, where its outputs go
    (``out`` as given, ``out_dir`` resolved), its ``run`` settings, whether it resumes, the
    ranks (``parallel``, this process's ``rank``), how it speaks, when it started, and
    whether a progress bar shows."""

    path: str
    out: str | None
    out_dir: Path
    settings: object
    resume: bool
    parallel: object
    rank: int
    say: Callable[[str], None]
    started: float
    progress: bool


def _run(parts, job: TrainJob) -> int:
    from tqdm.auto import tqdm

    path, out, out_dir, settings, parallel, say = (job.path, job.out, job.out_dir, job.settings,
                                                   job.parallel, job.say)
    lead = job.rank == 0
    saver = StepCheckpoints(parts, out_dir, settings.checkpoint_every, settings.keep_checkpoints,
                            0, lead, parallel)
    if job.resume:
        saver.resume(say)
    total = saver.total = total_steps(settings, parts)
    model = parts.model
    numbers = [sum(p.numel() for p in model.parameters()), sum(p.numel() for p in model.parameters()
                                                               if p.requires_grad)]
    where = (f"{parts.device}" if parallel is None else
             f"{parallel.world} ranks (FSDP2, {parts.device}),")
    say(f"nbtune train {path}: {model.config.model_type}, {where} {numbers[0] / 1e6:.1f}M parameters "
        f"({numbers[1] / 1e6:.2f}M trained), {parts.techniques.method}, {total} steps -> {out_dir}")
    summary = {"run_file": str(Path(path).resolve()), "steps": total, "resumed_at": len(parts.history),
               "ranks": parallel.world if parallel is not None else 1}
    evaluate = settings.evaluate and parts.data.heldout and parallel is None
    if settings.evaluate and parallel is not None:
        say("nbtune: run.evaluate is skipped under torchrun (generation is not sharded yet).")
    if evaluate:
        summary["heldout_accuracy_before"] = parts.evaluate()
        say(f"held-out accuracy before: {summary['heldout_accuracy_before']:.0%}")
    loggers = _Loggers(out_dir, settings, rank=job.rank, resumed_at=len(parts.history))
    logged = [len(parts.history)]  # the last step written to metrics.jsonl
    interrupted, others = False, Contention()
    try:
        with tqdm(total=total, initial=len(parts.history), desc="training", unit="step",
                  disable=None if job.progress and lead else True, file=sys.stderr) as bar:
            def after(report) -> None:  # between steps, in the runner's loop
                logged[0] = report.step
                loggers.write(report)
                say(_line(report))
                bar.update()
                bar.set_postfix(report.watched)
                saver.after_step(report)

            if len(parts.history) < total:
                parts.runner.run(total - len(parts.history), shown=after)
            # Ctrl-C during a step: the runner rolled it back and ended the run (consistent)
            interrupted = len(parts.history) < total
    except KeyboardInterrupt:  # between steps: the state is that of the last completed step
        interrupted = True
    finally:
        # a signal between a step's end and its row (the step stands, and is checkpointed):
        # its row still goes to metrics.jsonl, so the log and the checkpoint agree
        for report in parts.history[logged[0]:]:
            loggers.write(report)
        loggers.close()
    if interrupted:
        saver.interrupted(f"nbtune train {path} --resume" + (f" --out {out}" if out else ""), say)
        return 130
    ranks = rank_memory(parts, parallel)
    if ranks is not None:
        summary["rank_memory"] = ranks
        say(rank_table(ranks))
    saved = _save_outputs(parts, out_dir, settings.save)
    if not lead:
        return 0
    losses = [r.loss for r in parts.history]
    window = losses[-10:]
    summary.update({
        "loss_first": losses[0], "loss_last": sum(window) / len(window),
        "peak_bytes": max(r.memory.peak for r in parts.history),
        "seconds": time.perf_counter() - job.started, "saved": saved,
        "techniques": parts.techniques.as_dict(), "device": str(parts.device),
        "busy_cores": others.so_far() if parallel is None and parts.device.type == "cpu" else None})
    if evaluate:
        summary["heldout_accuracy_after"] = parts.evaluate()
        say(f"held-out accuracy after: {summary['heldout_accuracy_after']:.0%}")
    write_file_atomically(out_dir / "summary.json", json.dumps(summary, indent=2))
    say(f"done: {len(parts.history)} steps, loss {summary['loss_first']:.3f} -> "
          f"{summary['loss_last']:.3f} (mean of steps {len(losses) - len(window) + 1}-{len(losses)}), peak "
          f"{format_bytes(summary['peak_bytes'])}, {summary['seconds']:.0f} s; saved "
          + (", ".join(saved.values()) or "nothing") + f"; metrics in {out_dir / METRICS}"
          + "".join(f"; {busy}" for busy in [busy_words(summary["busy_cores"])] if busy))
    return 0


def _save_outputs(parts, out_dir: Path, kinds) -> dict:
    """The saves the run file asks for ("hf", "merged", "gguf"): kind -> folder."""
    saved = {}
    for kind in kinds:
        folder = out_dir / {"hf": "final", "merged": "merged", "gguf": "gguf"}[kind]
        if kind == "merged" and parts.techniques.method == "full":
            continue  # full weights are already whole: "hf" holds them
        parts.save(folder, merge=kind == "merged", format="gguf" if kind == "gguf" else "hf")
        saved[kind] = str(folder)
    return saved
