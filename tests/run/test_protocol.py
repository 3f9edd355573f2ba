"""The run's written contract (``nbtune/run/protocol.py``): each trainer and each run has
every member the Runner and the Session use, and none of them is probed for with getattr."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest

import nbtune as nt
from nbtune.run.ranked import RankedRun, RanksTrainer
from nbtune.run.protocol import RunProtocol, TrainerProtocol, check, members
from nbtune.run.factory import Run
from nbtune.run.trainer import Trainer

from helpers import small_session

PACKAGE = Path(nt.__file__).parent


@pytest.mark.parametrize("cls, protocol", [(Trainer, TrainerProtocol), (RanksTrainer, TrainerProtocol),
                                           (Run, RunProtocol), (RankedRun, RunProtocol)])
def test_each_trainer_and_run_has_the_protocols_methods(cls, protocol):
    assert check(cls, protocol) == []


def test_the_check_names_what_a_class_lacks():
    class Partial:
        def step(self, track):  # no usage parameter
            return None

    problems = check(Partial, TrainerProtocol)
    assert "Partial.step lacks parameter usage" in problems and "Partial lacks steps" in problems
    assert "Partial lacks set" in problems


def test_live_trainers_and_runs_are_instances_of_the_protocols():
    """The data members too (set in ``__init__``), on a session here and on the ranks'
    trainer built over a stand-in for its processes."""
    session = small_session()
    assert isinstance(session.trainer, TrainerProtocol) and isinstance(session.parts, RunProtocol)
    assert session.trainer.trainable == sum(p.numel() for p in session.model.parameters() if p.requires_grad)
    assert session.trainer.rank_memory is None and session.parts.ranks is None
    ranks = SimpleNamespace(about={"config": session.model.config, "trainable": 7},
                            techniques=session.techniques, alive=True)
    trainer = RanksTrainer(ranks)
    assert isinstance(trainer, TrainerProtocol) and trainer.trainable == 7
    assert not isinstance(SimpleNamespace(step=None), TrainerProtocol)
    assert "steps" in members(TrainerProtocol) and "ranks" in members(RunProtocol)


def test_a_trainer_takes_one_step_a_command_and_the_runner_asks_through_steps():
    session = small_session()
    asked = []
    real = session.trainer.steps
    session.trainer.steps = lambda *args: asked.append(args) or real(*args)
    session.run(3)
    assert len(session.history) == 3 and len(asked) == 3  # one step each, through steps()


def test_no_trainer_or_run_is_probed_for_a_member():
    probe = re.compile(r"getattr\(\s*(self\.)?(session\.)?(trainer|parts|run)\b")
    found = [f"{path.relative_to(PACKAGE)}:{n}" for path in PACKAGE.rglob("*.py")
             for n, line in enumerate(path.read_text().splitlines(), 1) if probe.search(line)]
    assert found == []
