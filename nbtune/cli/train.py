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
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .. import files, runfile
from ..run import factory
from ..atomic import write_file_atomically
from ..hardware import Contention, busy_words
from ..run.checkpoints import CHECKPOINTS, StepCheckpoints, checkpoints, stop_signals
from ..trackers import TRL_NAMES
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




def _rewards(prefix: str, metrics) -> dict:
    """A preference step's (or held-out evaluation's) rewards under TRL's metric names."""
    return {} if metrics is None else {prefix + TRL_NAMES[k]: v for k, v in vars(metrics).items()}


def total_steps(settings, parts) -> int:
    """``steps``, or ``epochs`` turned into optimizer steps over this run's batches."""
    if settings.steps is not None:
        return settings.steps
    t = parts.techniques
    if parts.trainer.stream.samples is None:  # (the run file refuses it first)
        raise ValueError("A streamed file's epoch has no length known up front: give run.steps.")
    per_epoch = math.ceil(len(parts.trainer.stream.samples) / (t.batch_size * t.grad_accum))
    return max(1, math.ceil((settings.epochs or 1) * per_epoch))


class _Loggers:
    """metrics.jsonl always; the trackers the run file's ``run.log`` names (checked before any
    work; ``nbtune.trackers``), on the first rank, with the estimate beside the first step."""

    def __init__(self, out: Path, settings, rank: int, resumed_at: int, config: dict | None = None,
                 estimate=None, say=print) -> None:
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
        self.trackers, self.estimate = None, estimate
        if settings.log and rank == 0:
            from ..trackers import Trackers

            self.trackers = Trackers(settings.log, out, config=config, say=say,  # name: the folder's
                                     resumed_at=resumed_at)

    def write(self, report) -> None:
        row = metrics_row(report, self.rank)
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        if self.trackers is not None:
            estimate, self.estimate = self.estimate, None  # beside the first step logged
            self.trackers.step(report, estimate)

    def log(self, metrics: dict, step: int) -> None:
        if self.trackers is not None:
            self.trackers.log(metrics, step)

    def close(self) -> None:
        """The metrics file; the trackers stay open for the held-out results after the run."""
        self.file.close()

    def close_trackers(self, failed: bool = False) -> None:
        if self.trackers is not None:
            self.trackers.close(failed)
            self.trackers = None


def _estimate(parts, parallel):
    """The predicted peak of this run's step, for the trackers (one process; None on ranks)."""
    if parallel is not None:
        return None
    from ..predict import Predictor

    return lambda: Predictor.of(parts.model.config, parts.device.type).estimate(parts.techniques).peak


def check_loggers(settings) -> None:
    from ..trackers import TrackerError, check_trackers

    try:
        check_trackers(settings.log)
    except TrackerError as err:
        raise runfile.RunFileError(f"run.log: {err}") from None


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
    from ..liveness import end_with_parent

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
    built: list = [None]  # the run, once built (what the heartbeat says this rank is doing)
    beat = None
    if parallel is not None:  # torchrun's agent killed: no rank lives on, waiting in a collective
        end_with_parent(f"nbtune train, rank {rank}", what="torchrun's agent")
        beat = _heartbeat(parallel, settings, built, f"nbtune train {path} --resume"
                          + (f" --out {out}" if out else ""))
    lead = rank == 0  # rank 0 prints and writes the shared files

    def say(text: str) -> None:
        if lead:
            tqdm.write(text)

    try:
        with stop_signals(saves=parallel is None) as stopped:
            try:
                code = _build_and_run(path, out, out_dir, config, settings, resume, parallel, device,
                                      progress, built, say)
            except Exception as err:  # a rank or its machine gone: named, not a traceback
                lost = parallel.lost(err) if parallel is not None else None
                if lost is None:
                    raise
                built[0] = None
                traceback.clear_frames(err.__traceback__)  # (they hold the sharded model)
                raise lost from None
        if parallel is not None and code == 0:
            parallel.barrier()  # every rank done with the group before any tears it down
        return 128 + stopped[0] if code == 130 and stopped else code
    finally:
        built[0] = None  # (the sharded model holds the group: dropped, so close() frees it)
        if beat is not None:
            beat.close()
        if parallel is not None:
            parallel.close()


def _build_and_run(path, out, out_dir: Path, config, settings, resume: bool, parallel, device,
                   progress: bool, built: list, say) -> int:
    """Build the run (``built[0]``, what the heartbeat reads), write its folder's files on rank
    0, and run it (``_run``); its exit code."""
    from ..run.runner import Message

    rank = parallel.rank if parallel is not None else 0
    started = time.perf_counter()
    try:
        parts = built[0] = factory.from_config(config, device=device, parallel=parallel)
        parts.runner.subscribe(lambda event: say(f"nbtune: {event.text}") if isinstance(event, Message) else None)
        parts.runner.relay()  # what building the run had to say (rows skipped)
        if rank == 0:
            out_dir.mkdir(parents=True, exist_ok=True)
            write_file_atomically(out_dir / OURS, json.dumps({"written_by": "nbtune train"}))
            effective = config.model_copy(update={
                "run": settings.model_copy(update={"out": str(out_dir.resolve())}),
                "model": config.path(config.model), "rewards": config.rewards_absolute(),
                "benchmark": config.benchmark_absolute(),
                "data": config.data.model_copy(update={
                    "train": config.data_absolute(config.data.train),
                    "heldout": config.data_absolute(config.data.heldout)})})
            write_file_atomically(out_dir / "run.yaml", runfile.dump(effective))
        if parallel is not None:
            parallel.barrier()
    except KeyboardInterrupt:  # (SIGTERM too: stop_signals; torchrun's, when another rank died)
        say("nbtune train: stopped while loading the model: nothing was trained.")
        return 130
    job = TrainJob(path, out, out_dir, settings, resume, parallel, rank, say, started, progress,
                   config.benchmark_absolute())
    try:
        return _run(parts, job)
    except Exception:
        if job.loggers is not None:  # the trackers' runs end marked as failed
            job.loggers.close_trackers(failed=True)
        raise


def _heartbeat(parallel, settings, built: list, resume_with: str):
    """This rank's ``liveness.Heartbeat``: where it is (loading, a step's phase, between
    steps), a silent rank named after ``run.hang_seconds``."""
    from ..liveness import Heartbeat

    def where() -> str:
        if built[0] is None:
            return "while loading the model"
        return built[0].trainer.where()

    def say(text: str) -> None:
        sys.stderr.write(f"\nnbtune train: {text}\n")
        sys.stderr.flush()
    return Heartbeat(parallel.rank, parallel.world, where, settings.hang_seconds, say,
                     f"Start it again with {resume_with} to go on from the last checkpoint.")


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
    benchmark: object = None  # the run file's benchmark: (lm-eval tasks), include_path resolved
    loggers: object = None  # the run's _Loggers, once made (closed as failed if the run raises)


def _scores(parts, job: TrainJob, loggers, when: str) -> dict:
    """Held-out accuracy (``run.evaluate``) and lm-eval's tasks (``benchmark:``) ``when``
    ("before" or "after" training), said, logged to the trackers and returned for the summary."""
    out, step = {}, len(parts.history)
    if job.parallel is not None:
        return out
    if when == "before" and step:  # resumed: "before" was the first run's, in its summary
        if job.settings.evaluate or (job.benchmark is not None and job.benchmark.tasks):
            job.say(f"nbtune: resumed at step {step}: the scores before training are the first run's, "
                    "not taken again.")
        return out
    if job.settings.evaluate and parts.data.heldout:
        out[f"heldout_accuracy_{when}"] = score = parts.evaluate()
        job.say(f"held-out accuracy {when}: {score:.0%}")
        loggers.log({"eval/score": score}, step)
    bench = job.benchmark
    if bench is not None and bench.tasks:
        from ..benchmark import flat, run

        results = run(parts.model, parts.tokenizer, bench.tasks, limit=bench.limit,
                      num_fewshot=bench.num_fewshot, include_path=bench.include_path,
                      batch_size=bench.batch_size)
        out[f"benchmark_{when}"] = results
        named = flat(results)
        job.say(f"benchmark {when}: " + ", ".join(f"{k[10:]} {v:.3f}" for k, v in named.items()))
        loggers.log(named, step)
    return out


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
    if (settings.evaluate or (job.benchmark is not None and job.benchmark.tasks)) and parallel is not None:
        say("nbtune: run.evaluate and benchmark: are skipped under torchrun (generation is not sharded yet).")
    loggers = _Loggers(out_dir, settings, rank=job.rank, resumed_at=len(parts.history),
                       config=parts.techniques.as_dict(), estimate=_estimate(parts, parallel),
                       say=lambda text: say(f"nbtune: {text}"))
    job.loggers = loggers
    summary.update(_scores(parts, job, loggers, "before"))
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
        loggers.close_trackers()
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
    summary.update(_scores(parts, job, loggers, "after"))
    loggers.close_trackers()
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
