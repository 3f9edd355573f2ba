"""A Session's run on N ranks: ``Session.from_config(run_file, processes=N)``.

The session in the kernel is the ordinary ``Session`` with its ordinary ``Runner`` (the loop,
background runs and Stop, changes queued for a step boundary, out-of-memory handling, events,
progress bars, live charts, the panel); only the trainer and the run it fronts are these two,
which send each command to every rank (``Processes``, ``processes.py``) and bring rank 0's
answer back. So a step is one command to every rank (short steps several to a command, ended
together at a boundary when the kernel asks), and everything the Runner does between two steps
(a queued ``set``, Stop, Ctrl-C) happens at the same step boundary on every rank.

``set`` is two-phase: every rank builds what the change needs beside what it uses
(``Trainer.prepare``), and only when every rank could does every rank swap it in; if one
refused, every rank drops it and the error names the rank. The kernel holds no weights: the
model here is the run's shape on the meta device (for checks and estimates).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from .processes import Processes, RankFailed, rank_propose, rank_settle, rank_steps
from .runner import Runner


class _Sharding:
    """What ``Session.parallel`` says of the ranks: how many, and how the model is sharded."""

    def __init__(self, world: int, sharding) -> None:
        self.world, self.sharding, self.rank = world, sharding, None

    def __repr__(self) -> str:
        return f"<{self.world} ranks driven from this kernel>"


class _RanksData:
    """The data lives on the ranks; a change the data cannot take is refused there."""

    train = heldout = ()
    pairs = False  # not known here: the rows are on the ranks

    @staticmethod
    def check_rows() -> None:
        """The ranks read their rows from the run file, which names them."""

    @staticmethod
    def problems(techniques) -> list[str]:
        if techniques.objective == "grpo":  # its reward functions are the kernel's Python
            return ["objective='grpo' does not yet run on ranks driven from a notebook (the reward "
                    "functions would have to reach every rank): run its file with nbtune train "
                    "under torchrun (the file names them), or train GRPO in one process."]
        if techniques.reference_kind in ("copy", "copy_host"):
            return [f"reference={techniques.reference_kind!r} is not yet made for several ranks (the copy "
                    "would be sharded too): use reference='precomputed'."]
        return []

    @property
    def rewards(self) -> tuple:
        return ()

    @rewards.setter
    def rewards(self, value) -> None:
        raise ValueError("session.rewards: the data lives on the ranks, and objective='grpo' does not "
                         "yet run on ranks driven from a notebook: run a run file naming the rewards "
                         "with nbtune train under torchrun, or train GRPO in one process.")


class RanksTrainer:
    """What the ``Runner`` drives, with every rank behind it: the step and the change."""

    rollback = "none"  # a failed rank ends them all: recover() returns to the last checkpoint
    optimizer = None  # on the ranks
    base_changed = False
    checkpoint = None  # the ranks keep theirs (``Processes.checkpoint``)

    def __init__(self, ranks: Processes) -> None:
        from ..models.decoder import CausalLM

        self.ranks = ranks
        with torch.device("meta"):
            self.model = CausalLM(ranks.about["config"])  # the shape, for checks and estimates
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.trainable = ranks.about["trainable"]  # weights trained, over all ranks
        self.data = _RanksData()
        self.history: list = []  # rank 0's StepReports
        self.rank_memory: dict[int, list] = {}  # step -> each rank's MemoryBreakdown
        self.notes: list[str] = []
        self.damaged = None

    techniques = property(lambda self: self.ranks.techniques)

    def check_usable(self, loading: bool = False) -> None:
        if not self.ranks.alive:
            raise RankFailed("These ranks were ended; session.recover() starts them again from "
                             "the last checkpoint.", None)

    def take_notes(self) -> list[str]:
        notes, self.notes = self.notes, []
        return notes

    SECONDS_PER_COMMAND = 1.0  # short steps go several to a command, about this long in all

    def step(self, track: bool, usage: bool = False):
        """One step on every rank; Ctrl-C meanwhile lets it finish on every rank, then stops."""
        return self.steps(track, track, 1)[0]

    def steps(self, track: bool, track_rest: bool, most: int, until=None) -> list:
        """Up to ``most`` steps on every rank in one command: as many as take about
        ``SECONDS_PER_COMMAND`` at the last step's pace, so that a short step does not pay a
        round trip through the controller each (issue 36: 1.28x torchrun's time at 64 ms).
        The ranks end them together at the next step boundary once ``until()`` (Stop, a
        queued change) or Ctrl-C: the kernel makes the ranks' stop file. Rank 0's reports."""
        ranks, last = self.ranks, self.history[-1].seconds if self.history else 0.0
        count = max(1, min(most, int(self.SECONDS_PER_COMMAND / last) if last > 0 else 1))
        flag = ranks.stop_flag

        def poll() -> None:
            if ranks.interrupted or (until is not None and until()):
                flag.touch()
        with ranks.holding_ctrl_c():  # (Ctrl-C is said once every step the ranks took is kept)
            flag.unlink(missing_ok=True)
            answers = ranks.each(rank_steps, lambda rank: (track, track_rest, count, str(flag)),
                                 poll=poll if count > 1 else None, extra=2 * count * last)
            reports = []
            for i, (report, notes) in enumerate(answers[0]):
                self.history.append(report)
                self.rank_memory[report.step] = [answer[i][0].memory for answer in answers]
                self.notes += notes
                reports.append(report)
            ranks.step_number = reports[-1].step
        if ranks.interrupted:  # (the steps it took are said, as steps, before it stops)
            interrupted = KeyboardInterrupt()
            interrupted.nbtune_reports = reports
            raise interrupted
        return reports

    def set(self, new, checked: bool = False) -> set[str]:
        """``new`` techniques on every rank, or on none (the refusal names the rank); each
        rank checks them on its own model (``checked``: the kernel's check, on a shape)."""
        changed = new.changed(self.techniques)
        if not changed:
            return changed
        problems = _RanksData.problems(new)
        if problems:
            raise ValueError(" ".join(problems))
        answers = self.ranks.each(rank_propose, lambda rank: (new,))
        refused = next(((rank, why) for rank, why in enumerate(answers) if why is not None), None)
        commit = refused is None
        notes = self.ranks.each(rank_settle, lambda rank: (commit,))[0]
        if not commit:
            rank, why = refused
            raise ValueError(f"Rank {rank} refused the change, so no rank made it: {why}")
        self.ranks.techniques = new
        self.notes += notes
        return changed

    def recover(self) -> str:
        """The ranks started again from the last checkpoint saved or loaded (else step 0)."""
        self.ranks.restart()
        self.replaced()
        self.notes.append(f"recovered: the ranks are at step {self.ranks.step_number}.")
        where = self.ranks.checkpoint
        return f"the checkpoint in {where}" if where is not None else "step 0 (the run file)"

    def replaced(self) -> None:
        """The ranks' state was replaced (restarted, loaded): keep the steps up to theirs."""
        del self.history[self.ranks.step_number:]
        for step in [step for step in self.rank_memory if step > self.ranks.step_number]:
            del self.rank_memory[step]

    def state_dict(self) -> dict:
        raise NotImplementedError("state_dict: the state lives on the ranks; use "
                                  "save_checkpoint(folder) and load_checkpoint(folder).")

    def load_state_dict(self, state: dict) -> None:
        self.state_dict()


class RankedRun:
    """The run a ``Session`` fronts, on N ranks (``factory.Run``'s commands, sent to each)."""

    def __init__(self, run_file, processes: int, overrides: dict | None = None,
                 timeout: float = 600.0, local: int | None = None, address: str | None = None) -> None:
        from .. import runfile

        config = run_file if isinstance(run_file, runfile.RunConfig) else runfile.load(run_file, overrides)
        problems = _RanksData.problems(config.to_techniques())  # before any rank starts
        if problems:
            raise ValueError(" ".join(problems))
        self.ranks = Processes(run_file, processes, overrides=overrides, timeout=timeout,
                               local=local, address=address)
        about, config = self.ranks.about, self.ranks.config
        self.trainer = RanksTrainer(self.ranks)
        self.runner = Runner(self.trainer)
        self.runner.sampler.mode = config.memory_tracking
        self.tokenizer, self.device = about["tokenizer"], self.trainer.device
        self.data = self.trainer.data
        self.parallel = _Sharding(processes, config.to_sharding())
        self.source, self.match, self.data_files = about["source"], about["match"], about["data_files"]
        self.demo_name, self.settings = about["demo_name"], about["settings"]

    def save_checkpoint(self, folder: str | os.PathLike) -> Path:
        return self.ranks.save_checkpoint(folder)

    def load_checkpoint(self, folder: str | os.PathLike) -> None:
        with self.runner.replacing():
            self.ranks.load_checkpoint(folder)
            self.trainer.replaced()

    def save(self, folder, merge: bool = False, format: str = "hf",
             quantization: str | None = None) -> Path:
        return Path(self.ranks.call("save", str(Path(folder).resolve()), merge=merge,
                                    format=format, quantization=quantization))

    def generate(self, prompt: str, *, stream=None, **settings):
        """Every rank generates (each gathers one layer at a time), rank 0 answers; a sampled
        reply uses one seed on every rank, so that they agree. ``stream`` is given the reply
        whole."""
        from ..generate import Reply

        if settings.get("temperature") and settings.get("seed") is None:
            settings["seed"] = int.from_bytes(os.urandom(4), "little")
        return _streamed(Reply(self.ranks.call("generate", prompt, **settings)), stream)

    def chat(self, message: str, history: list[dict], stream, **settings):
        from ..generate import Reply

        if settings.get("temperature") and settings.get("seed") is None:
            settings["seed"] = int.from_bytes(os.urandom(4), "little")
        reply = Reply(self.ranks.call("chat", message, list(history), None, **settings))
        history += [{"role": "user", "content": message}, {"role": "assistant", "content": str(reply)}]
        return _streamed(reply, stream)

    def evaluate(self, examples=None, match=None) -> float:
        if match is not None and not isinstance(match, str):
            raise ValueError('evaluate: across processes match is "exact" or "json_keys" (a '
                             "function cannot be sent to the ranks).")
        rows = list(examples) if examples is not None else None
        return self.ranks.call("evaluate", rows, match)

    def close(self) -> None:
        self.ranks.close()


def _streamed(reply, stream):
    if stream is True:
        print(reply, flush=True)
    elif callable(stream):
        stream(str(reply))
    return reply
