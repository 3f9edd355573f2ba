"""What a trainer and a run provide, written down: the contract the ``Runner``, the
``Session`` and the exit hooks rely on, so that a new kind of trainer (the ranks', the next
objective's) or run (a new front end's) knows what it must have, and none is probed for a
member with ``getattr``.

``trainer.Trainer`` (one process) and ``ranked.RanksTrainer`` (every rank behind the kernel)
are ``TrainerProtocol``s; ``factory.Run`` and ``ranked.RankedRun`` are ``RunProtocol``s.
``tests/run/test_protocol.py`` checks each: every member present, methods with the protocol's
parameters (``check``), and the live objects ``isinstance`` of it.
"""

from __future__ import annotations

import inspect
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch
    from torch import nn

    from ..generate import Reply
    from .runner import Runner
    from ..step import StepReport
    from ..techniques import Techniques


@runtime_checkable
class TrainerProtocol(Protocol):
    """The training state and the step, as the ``Runner`` drives them."""

    model: nn.Module  # what is trained (on ranks: its shape on the meta device)
    device: torch.device
    data: Any  # a TrainingData, or the ranks' stand-in: ``problems(techniques)``
    history: list[StepReport]  # one report a step taken
    optimizer: Any  # None where it lives on the ranks
    base_changed: bool  # full training or a merge altered the base weights
    rollback: str  # "auto", "full" or "none": what a failed step is undone with
    damaged: str | None  # why the state cannot be trusted (``recover()`` first), or None
    trainable: int  # weights trained, over every rank
    rank_memory: dict[int, list] | None  # step -> each rank's MemoryBreakdown; None in one process
    checkpoint: Any  # the last checkpoint saved or loaded (``trainer.RestorePoint``), or None
    techniques: Techniques  # what the next step trains with (``set`` changes it)

    def check_usable(self, loading: bool = False) -> None:
        """Raise where the state must be recovered (or the ranks restarted) first."""

    def take_notes(self) -> list[str]:
        """What the user should read since the last call (and forget it)."""

    def step(self, track: bool, usage: bool = False) -> StepReport:
        """One training step; ``track``: measure its memory."""

    def steps(self, track: bool, track_rest: bool, most: int,
              until: Callable[[], bool] | None = None) -> list[StepReport]:
        """Up to ``most`` steps in one go (one, where each step is its own command), ended at
        a step boundary once ``until()``; the first measured if ``track``, the rest if
        ``track_rest``. A KeyboardInterrupt after steps stood carries them as
        ``nbtune_reports``."""

    def set(self, new: Techniques, checked: bool = False) -> set[str]:
        """Take ``new`` techniques (or refuse, changing nothing); the fields changed.
        ``checked``: the rules were checked on them already, on the techniques in use."""

    def recover(self) -> Any:
        """Return to the newest state the run can, after a failure; what it returned to."""

    def state_dict(self) -> dict:
        """The whole training state, to keep in memory."""

    def load_state_dict(self, state: dict) -> None:
        """Put back a ``state_dict``."""


@runtime_checkable
class RunProtocol(Protocol):
    """A run's parts, as the ``Session`` fronts them: its trainer, runner and tokenizer,
    where it came from, and what is done with the model."""

    trainer: TrainerProtocol
    runner: Runner
    tokenizer: Any
    device: torch.device
    parallel: Any  # how the model is sharded across ranks, or None
    source: str | None  # the base model's folder, repo id or .gguf file
    match: Any  # how ``evaluate`` scores replies
    data_files: dict
    demo_name: str | None
    settings: Any  # a run file's ``run`` section, written back by ``save_config``
    ranks: Any  # the ranks a kernel drives (``processes.Processes``), or None
    data: Any  # the training data (on ranks: a stand-in, the rows are there)

    def close(self) -> None:
        """End what the run holds outside this process (its ranks)."""

    def save_checkpoint(self, folder: str | os.PathLike) -> Path:
        """The training state in ``folder``."""

    def load_checkpoint(self, folder: str | os.PathLike) -> None:
        """Back to the state ``save_checkpoint`` wrote."""

    def save(self, folder, merge: bool = False, format: str = "hf",
             quantization: str | None = None) -> Path:
        """The model (or its adapter) for others to load."""

    def generate(self, prompt: str, **settings) -> Reply:
        """A reply to ``prompt``."""

    def chat(self, message: str, history: list[dict], stream, **settings) -> Reply:
        """The next reply in a conversation (``history`` grows by the turn)."""

    def evaluate(self, examples=None, match=None) -> float:
        """The share of held-out examples answered right."""


def members(protocol: type) -> list[str]:
    """The members ``protocol`` declares: its attributes and its methods and properties."""
    return sorted({*getattr(protocol, "__annotations__", {}),
                   *(name for name, value in vars(protocol).items() if not name.startswith("_")
                     and (inspect.isfunction(value) or isinstance(value, property)))})


def check(cls: type, protocol: type) -> list[str]:
    """What the class ``cls`` lacks of ``protocol``'s methods and properties, read from the
    class (no instance made): each missing, and each method without one of the protocol's
    parameters. Data attributes, set by ``__init__``, are checked on live objects with
    ``isinstance`` (the protocols are runtime-checkable)."""
    problems = []
    for name in members(protocol):
        theirs = inspect.getattr_static(protocol, name, None)
        if not (inspect.isfunction(theirs) or isinstance(theirs, property)):
            continue
        mine = inspect.getattr_static(cls, name, None)
        if mine is None:
            problems.append(f"{cls.__name__} lacks {name}")
        elif inspect.isfunction(theirs):
            if not inspect.isfunction(mine):
                problems.append(f"{cls.__name__}.{name} is not a method")
                continue
            have = inspect.signature(mine).parameters
            for p in inspect.signature(theirs).parameters.values():
                if p.kind != p.VAR_KEYWORD and p.name not in have \
                        and not any(q.kind == q.VAR_KEYWORD for q in have.values()):
                    problems.append(f"{cls.__name__}.{name} lacks parameter {p.name}")
    return problems


__all__ = ["RunProtocol", "TrainerProtocol", "check", "members"]
