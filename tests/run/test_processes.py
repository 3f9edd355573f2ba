"""Several processes driven from the kernel (ipyparallel engines, each a gloo rank) against one
process on the same run file, and no process left behind."""

import threading
import time
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest
import torch

from safetensors.torch import load_file

import nbtune as nt
from nbtune import Session
from nbtune.peft import adapter_state_dict
from nbtune.run.processes import HEARTBEAT, Processes, _where
from nbtune.run.ranked import RanksTrainer

RUN = ("demo: tiny\ntechniques: {{{techniques}}}\nrun: {{steps: 5, checkpoint_every: 0, save: []}}\n")


@pytest.mark.slow
@pytest.mark.parametrize("techniques", [  # (full finetuning: notebook 07, on the same checks)
    "method: lora, batch_size: 4, seq_len: 96, lr: 1e-3, lora_rank: 4",
    "method: qlora, batch_size: 4, seq_len: 96, lr: 1e-3, lora_rank: 4"], ids=["lora", "qlora"])
def test_two_processes_from_the_kernel_equal_one_process_and_leave_nothing_behind(tmp_path, techniques,
                                                                                  capsys):
    """Steps, a compare (LoRA: its rows on ranks of their own), changes mid-run (all ranks at one
    boundary: checkpointing turned on from the panel, then offloading), a sampled reply and
    a checkpoint loaded back: as one process gives them on the same batches, weights too; the
    refused change changed nothing on any rank, and the panel shows what ranks cannot change.
    Then a fault (Ctrl-C and a hung rank; a killed rank), and no process is left."""
    path = tmp_path / "run.yaml"
    path.write_text(RUN.format(techniques=techniques))
    alone = Session.from_config(path)
    one = [alone.step() for _ in range(2)]
    alone.set(lr=3e-4, grad_accum=2, activation_checkpointing=True)
    one += alone.run(2, progress=False)
    alone.set(activation_offloading=True)
    one += alone.run(1, progress=False)
    reply = alone.generate("Which letter is a capital?", input="Krqt", max_new_tokens=6,
                           temperature=1.0, seed=3)
    assert reply  # (greedy says nothing yet: the end of the reply comes first)
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    ranks = Session.from_config(path, processes=2)
    try:  # (kept as processes: one whose parent was killed is no longer a child of this one)
        started = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
        assert len(started) >= 3 and set(ranks.parts.ranks.pids) <= {p.pid for p in started}  # a controller, two engines
        controller = [p.cmdline() for p in started if "ipyparallel.controller" in " ".join(p.cmdline())]
        assert controller and set(HEARTBEAT) <= set(controller[0])  # (its beat: a start 5 s sooner)
        reports = [ranks.step(), ranks.step()]
        if techniques.startswith("method: lora"):  # (its two ranks of its own: 20 s of CPU; once)
            ladder = ranks.compare([{}, {"batch_size": 8}], steps=2)  # on two ranks of its own
            assert [row.techniques.batch_size for row in ladder] == [4, 8] and not ladder[0].error
            assert ladder[1].peak > ladder[0].peak > 0 and ladder[1].change > 0
            assert all(row.tokens_per_second > 0 and row.estimated_peak > 0 for row in ladder)
        with pytest.raises(ValueError, match="refused the change, so no rank made it"):
            ranks.set(lr=3e-4, lora_rank=8)  # fixed while the model is sharded
        assert ranks.techniques.lr == 1e-3
        assert ranks.set(lr=3e-4, grad_accum=2).grad_accum == 2
        panel = ranks.panel()
        assert panel.controls["lora_rank"].disabled and "fixed on ranks" in panel.controls["lora_rank"].tooltip
        assert not panel.controls["activation_checkpointing"].disabled
        panel.controls["activation_checkpointing"].value = 1  # through the panel's own path
        assert ranks.techniques.checkpoint_every == 1 and "applied" in panel.status.value
        reports += ranks.run(2, progress=False)
        ranks.set(activation_offloading=True)
        reports += ranks.run(1, progress=False)
        saved = load_file(ranks.save(tmp_path / "adapter") / "adapter_model.safetensors")
        reached = {k: v for k, v in adapter_state_dict(alone.model).items()}
        assert saved.keys() == reached.keys()
        assert max((saved[k] - reached[k]).abs().max().item() for k in saved) <= 1e-5
        assert ranks.generate("Which letter is a capital?", input="Krqt", max_new_tokens=6,
                              temperature=1.0, seed=3) == reply
        assert ranks.parts.ranks.rank_steps == [5, 5]
        client = ranks.parts.ranks.client  # a long run keeps no answer per command in the kernel
        assert not client.results and not client.history and len(client.metadata) < 2
        ranks.save_checkpoint(tmp_path / "at-5")
        sixth = ranks.step()
        ranks.load_checkpoint(tmp_path / "at-5")  # each rank its own shard, back to step 5
        assert len(ranks.history) == 5 and ranks.step().loss == sixth.loss
        if techniques.startswith("method: lora"):
            _set_then_stop_in_the_background(ranks)
            _ctrl_c_then_a_hung_rank(ranks, capsys)
            _a_twin_never_interrupted_gives_each_step(alone, ranks.history, sixth)
        else:
            _a_killed_rank(ranks, tmp_path / "at-5")
        with pytest.raises(nt.RankFailed, match="recover()"):
            ranks.step()  # the ranks were ended: the session says so (notebook 07 recovers)
        if techniques.startswith("method: lora"):
            _a_stopped_rank_then_recover(ranks, sixth)
            _out_of_memory_on_a_rank(ranks)
        else:
            _a_killed_controller_then_recover(ranks, sixth)
    finally:
        ranks.close()
    assert [r.step for r in reports] == [1, 2, 3, 4, 5] and ranks.history[:5] == reports
    for a, b in zip(one, reports):
        assert abs(a.loss - b.loss) <= 1e-5 and a.tokens == b.tokens
    # each rank's memory, as the kernel gathered it: half the single process's state each
    for rank in ranks.ranks_memory[5]:
        assert abs(rank.categories["parameters"] / one[-1].memory.categories["parameters"] - 0.5) < 0.02
    gone, still = psutil.wait_procs(started, timeout=20)
    still = [p for p in still if p.is_running()]  # (not a number since reused: its start time differs)
    assert not still, [p.pid for p in still]


KERNEL = """
import sys
from nbtune import Session
ranks = Session.from_config(sys.argv[1], processes=2)
ranks.step()
print("READY", flush=True)
sys.stdin.read()  # until killed
"""


@pytest.mark.slow
def test_a_killed_kernel_leaves_no_rank_and_no_controller_behind(tmp_path):
    """SIGKILL gives the kernel no chance to stop its cluster: each engine notices that the
    process that started it is gone, ends the controller and itself."""
    import signal
    import subprocess
    import sys

    path = tmp_path / "run.yaml"
    path.write_text(RUN.format(techniques="batch_size: 4, seq_len: 96, lr: 1e-3"))
    kernel = subprocess.Popen([sys.executable, "-c", KERNEL, str(path)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    started = []
    try:
        assert kernel.stdout.readline().strip() == "READY"
        started = psutil.Process(kernel.pid).children(recursive=True)
        assert sum("ipyparallel.engine" in " ".join(p.cmdline()) for p in started) >= 2
        assert any("ipyparallel.controller" in " ".join(p.cmdline()) for p in started)
        kernel.send_signal(signal.SIGKILL)
        kernel.wait(10)
        gone, still = psutil.wait_procs(started, timeout=30)
        assert not still, [p.cmdline() for p in still]
    finally:
        if kernel.poll() is None:
            kernel.kill()
        for process in started:  # where the behaviour broke, leave the machine clean anyway
            try:
                process.kill()
            except psutil.NoSuchProcess:
                pass


def _set_then_stop_in_the_background(session) -> None:
    """Short steps go many to a command (here: as many as asked, 10,000); a change queued
    mid-run ends the command at a boundary, where every rank makes it; Stop ends the next.
    Without the stop file both would wait out 10,000 steps."""
    import time

    ranks = session.parts.ranks
    session.parts.trainer.SECONDS_PER_COMMAND = 1e9
    before = len(session.history)
    run = session.start(10_000)
    # a few steps each side of the change, scaled by the last step (a loaded machine is slower)
    pause = max(1.5, 3 * session.history[-1].seconds)
    time.sleep(pause)
    session.set(lr=1e-4)
    time.sleep(pause)
    run.stop(timeout=60)
    session.parts.trainer.SECONDS_PER_COMMAND = type(session.parts.trainer).SECONDS_PER_COMMAND
    assert not run.running and run.error is None and 2 < len(run.reports) < 10_000
    at = len(session.history)
    assert ranks.rank_steps == [at, at] and session.history[before:] == run.reports
    assert [t.lr for _, t in ranks.each(_where)] == [1e-4, 1e-4]  # made on every rank
    lrs = [r.lr for r in session.history]  # (rank 0's; the ranks step in lockstep)
    changed = lrs.index(1e-4)
    assert before < changed < at and set(lrs[changed:]) == {1e-4} and 1e-4 not in lrs[:changed]


def _ctrl_c_then_a_hung_rank(session, capsys) -> None:
    """Ctrl-C in the kernel lets the step under way end on every rank, then stops; a rank
    that does not answer within its timeout is named as hung and the ranks are ended."""
    import signal
    import time

    ranks = session.parts.ranks
    capsys.readouterr()
    threading.Timer(1.0, signal.raise_signal, (signal.SIGINT,)).start()
    interrupted = session.run(10_000, progress=False)
    at = len(session.history)
    assert 0 < len(interrupted) < 10_000 and ranks.rank_steps == [at, at]
    assert f"interrupted: stopped after {len(interrupted)} of 10000 steps" in capsys.readouterr().out
    purge, calls = ranks.client.purge_local_results, []

    def ctrl_c_once_the_ranks_answered(*args, **kwargs):  # (the command done, not yet recorded)
        calls.append(1)
        if len(calls) == 2:
            signal.raise_signal(signal.SIGINT)
        return purge(*args, **kwargs)
    ranks.client.purge_local_results = ctrl_c_once_the_ranks_answered
    try:
        start = len(session.history)
        interrupted = session.run(10_000, progress=False)
    finally:
        ranks.client.purge_local_results = purge
    at = len(session.history)
    assert len(calls) == 2 and 0 < len(interrupted) == at - start
    try:  # in the background, right after Ctrl-C: as many steps as asked
        assert len(session.start(3).wait(timeout=120)) == 3
    except KeyboardInterrupt:
        pytest.fail("the run in the background was stopped by the Ctrl-C of the run before it")
    assert ranks.rank_steps == [at + 3, at + 3]
    ranks.timeout = 2
    with pytest.raises(nt.RankFailed, match="Rank 1 failed: no answer within 2 s from rank 1"):
        ranks.each(time.sleep, lambda rank: (30 * rank,))


def _a_twin_never_interrupted_gives_each_step(alone, history, sixth) -> None:
    """Every step the ranks took from step 6 on (a background run stopped, a change made
    mid-run, two Ctrl-Cs: one mid-command, one after the ranks answered but before the kernel
    recorded it; three more steps in the background) is the step one process never
    interrupted gives, at the learning rate each step reported."""
    assert len(history) > 6 and history[5].loss == sixth.loss
    for report in history[5:]:
        if report.lr != alone.techniques.lr:
            alone.set(lr=report.lr)
        twin = alone.step()
        assert (twin.step, twin.tokens) == (report.step, report.tokens)
        # sums over two ranks round apart from one process's, and more so as steps add up
        # (how many depends on the machine's pace): 1e-5 more a step; a wrong learning rate
        # at one step moved the loss by 1.6e-2
        drift = 1e-5 * (report.step - 5)
        assert abs(twin.loss - report.loss) <= drift, (report.step, twin.loss, report.loss)


def _a_killed_rank(session, checkpoint) -> None:
    """SIGKILL on rank 1 during a run: named, the other rank and the controller ended."""
    import os
    import signal

    ranks = session.parts.ranks
    started = psutil.Process().children(recursive=True)
    threading.Timer(1.0, os.kill, (ranks.pids[1], signal.SIGKILL)).start()
    with pytest.raises(nt.RankFailed) as failed:
        session.run(10_000, progress=False)
    assert failed.value.rank == 1 and "Rank 1 failed" in str(failed.value)
    assert f"recover() starts them again from {checkpoint}" in str(failed.value)
    gone, still = psutil.wait_procs(started, timeout=30)  # rank 0 ended too: no process left
    assert not still, [p.cmdline() for p in still]


def _a_stopped_rank_then_recover(session, sixth) -> None:
    """recover() gives back the step after the checkpoint, as the session gave it before any
    fault; then rank 1 stopped (SIGSTOP: neither dead nor answering) mid-run is named by its
    heartbeat within hang_seconds with where it was last heard (not ipyparallel's "Engine 1
    died" 45 s on), no rank is left, and recover() gives that step again."""
    import os
    import signal

    session.parts.ranks.timeout = 600  # (the hung-rank check before set it to 2 s)
    assert "at-5" in session.recover()
    assert session.step().loss == sixth.loss
    ranks = session.parts.ranks
    ranks.pulses.hang = 3
    engines = [psutil.Process(pid) for pid in ranks.pids]
    threading.Timer(2.0, os.kill, (ranks.pids[1], signal.SIGSTOP)).start()
    started = time.monotonic()
    with pytest.raises(nt.RankFailed) as failed:
        session.run(10_000, progress=False)
    took = time.monotonic() - 2.0 - started
    said = str(failed.value)
    assert failed.value.rank == 1 and said.startswith("Rank 1 stopped answering (no heartbeat for 3 s; last heard ")
    assert ("phase of step " in said or "between steps" in said) and "recover()" in said
    assert took < 30, took  # (3 s of silence, then the cluster ended: ipyparallel's own took 45 s)
    gone, still = psutil.wait_procs(engines, timeout=20)
    assert not still, [p.pid for p in still]
    session.recover()
    assert len(session.history) == 5 and session.step().loss == sixth.loss


def _plant_out_of_memory_on_rank_1() -> None:
    """On an engine: rank 1's next step runs out of memory at the end of its backward, before
    its optimizer step (a card's limit, planted on the CPU); rank 0 goes on."""
    import torch

    import nbtune.step
    from nbtune.run.processes import ENGINE_STATE

    if ENGINE_STATE["rank"] == 1:
        def out_of_memory(self):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (planted)")
        nbtune.step._Phases.before_optimizer = out_of_memory


_plant_out_of_memory_on_rank_1.__module__ = "__main__"  # (ipyparallel sends its code)


def _out_of_memory_on_a_rank(session) -> None:
    """Out of memory on rank 1 in a run from the notebook: named with its phase and step, the
    ranks ended, and the advice is the notebook's (``session.set`` after ``recover()``), not
    the run file and ``--resume`` of a torchrun job."""
    ranks = session.parts.ranks
    engines = [psutil.Process(pid) for pid in ranks.pids]
    ranks.each(_plant_out_of_memory_on_rank_1)
    step = len(session.history) + 1
    with pytest.raises(nt.RankFailed) as failed:
        session.run(3, progress=False)
    said = str(failed.value)
    assert failed.value.rank == 1 and failed.value.out_of_memory
    assert said.startswith(f"Rank 1 of 2 ran out of memory in the backward phase of step {step}.\n"), said
    assert "After session.recover() has started the ranks again, apply one with session.set(" in said, said
    assert "--resume" not in said and "run file" not in said and "Predicted peak per rank now" in said, said
    assert "\nThe other ranks were ended (they would have waited for it); the kernel goes on" in said, said
    gone, still = psutil.wait_procs(engines, timeout=20)
    assert not still, [p.pid for p in still]


def _a_killed_controller_then_recover(session, sixth) -> None:
    """recover() after a killed rank gives back the step after the checkpoint; then
    ipyparallel's controller SIGKILLed mid-run (no answer can come back, though every rank
    still beats): named within seconds, not after the command's timeout, no rank is left,
    and recover() gives that step again."""
    import signal

    session.recover()
    assert len(session.history) == 5 and session.step().loss == sixth.loss
    ranks = session.parts.ranks
    engines = [psutil.Process(pid) for pid in ranks.pids]
    controller = psutil.Process(ranks.cluster.controller.process.pid)
    parts = controller.children(recursive=True)  # (its heart monitor: init adopts it once it is killed)
    assert parts
    threading.Timer(2.0, controller.send_signal, (signal.SIGKILL,)).start()
    started = time.monotonic()
    with pytest.raises(nt.RankFailed, match=r"controller \(process \d+\) ended \(killed\?\)") as failed:
        session.run(10_000, progress=False)
    # (named at the kernel's next look, a second; ending the cluster takes the rest: 15 s
    # once on a loaded machine. Unnoticed, the command would wait out its 600 s timeout.)
    assert time.monotonic() - 2.0 - started < 60 and "recover()" in str(failed.value)
    gone, still = psutil.wait_procs(engines + parts, timeout=20)
    assert not [p for p in still if p.is_running()], [p.pid for p in still]
    session.recover()
    assert len(session.history) == 5 and session.step().loss == sixth.loss


def _twins(**changes):
    return [Session.demo("tiny", batch_size=4, seq_len=96, **changes) for _ in range(2)]


def test_ipyparallels_beat_takes_engines_in_within_a_second_and_leaves_a_stopped_rank_to_nbtune():
    """The controller's heartbeat settings are ipyparallel's own traits (a misspelt one would
    be ignored with a warning), fast enough that an engine is taken in within two beats of a
    second, and slow enough to call an engine dead no sooner than nbtune's heartbeat names a
    stopped rank at the default hang_seconds (so the user reads where it stopped, not 'Engine
    died'). (The two-process test checks the controller was started with them.)"""
    from ipyparallel.controller.heartmonitor import HeartMonitor

    from nbtune.runfile import RunSettings

    settings = dict(arg.removeprefix("--").split("=") for arg in HEARTBEAT)
    traits = HeartMonitor.class_traits(config=True)
    assert {name.removeprefix("HeartMonitor.") for name in settings} <= set(traits)
    period = int(settings["HeartMonitor.period"]) / 1000
    misses = int(settings["HeartMonitor.max_heartmonitor_misses"])
    assert 2 * period <= 1.0
    assert period * (misses + 1) >= RunSettings().hang_seconds


def test_a_prepared_change_dropped_leaves_the_next_step_as_a_twin_never_asked_gives_it():
    """The ranks' two-phase set: each builds the change beside what it uses; when another rank
    refused, abort() must leave this one exactly as it was (optimizer state, data, RNG)."""
    asked, twin = _twins()
    asked.run(2, progress=False), twin.run(2, progress=False)
    trainer = asked.trainer
    prepared = trainer.prepare(trainer.techniques.replace(optimizer="sgd", batch_size=8, lr=1e-2))
    trainer.abort(prepared)
    a, b = asked.step(), twin.step()
    assert a.loss == b.loss and asked.techniques == twin.techniques
    assert all(torch.equal(x, y) for x, y in zip(asked.model.parameters(), twin.model.parameters()))


def test_while_sharded_only_what_fsdp2_sharded_and_compile_are_fixed():
    """A sharded trainer (``parallel`` set) refuses what made the weights FSDP2 sharded (method,
    dtype, the LoRA shape) and compile (it would wrap FSDP2's hooks), and a batch that does not
    split over the ranks, naming them; the flags layers read as they run (checkpointing,
    tiling), the adapters' scaling and dropout and the rest are prepared."""
    session = Session.demo("tiny", batch_size=4, seq_len=96, method="lora", lora_rank=4)
    trainer = session.trainer
    trainer.parallel = SimpleNamespace(world=2)  # only its size is read here
    t = trainer.techniques
    for field, value in [("method", "full"), ("dtype", "bf16"), ("lora_rank", 8),
                         ("lora_targets", ("q_proj",)), ("compile", True)]:
        with pytest.raises(ValueError, match=f"{field} cannot change while the model is sharded"):
            trainer.prepare(t.replace(**{field: value}))
    with pytest.raises(ValueError, match="batch_size=5 does not split over 2 ranks"):
        trainer.prepare(t.replace(batch_size=5))
    trainer.abort(trainer.prepare(t.replace(lr=1e-3, grad_accum=2, batch_size=8, optimizer="sgd",
                                            activation_checkpointing=True, tile_tokens=16,
                                            lora_alpha=8.0, lora_dropout=0.1,
                                            activation_offloading=True, chunked_loss=4)))
    assert trainer.techniques == t


class _InOneProcess(Processes):
    """Two ranks' engine functions run here in turn, each on its own run: the kernel's side
    of a command without the processes (``each`` as the engines would answer it)."""

    def __init__(self, runs):
        self.world, self.techniques, self.interrupted = len(runs), runs[0].trainer.techniques, False
        self.about = {"config": runs[0].model.config, "trainable": 0}
        self.states = [{"rank": rank, "run": run} for rank, run in enumerate(runs)]

    stop_flag = None  # (set by a test that stops steps several to a command)

    def each(self, function, args_of=lambda rank: (), poll=None, extra=0.0):
        from nbtune.run.processes import ENGINE_STATE

        answers = []
        for rank, state in enumerate(self.states):
            ENGINE_STATE.clear()
            ENGINE_STATE.update(state)
            answers.append(function(*args_of(rank)))
            self.states[rank] = dict(ENGINE_STATE)
        ENGINE_STATE.clear()
        return answers


def test_a_change_one_rank_refuses_is_made_by_no_rank():
    """Rank 1 refuses (here: its model is sharded, rank 0's not), so rank 0, which had built
    the change, drops it: its next step is the step of a twin never asked."""
    rank0, rank1, twin = (Session.demo("tiny", batch_size=4, seq_len=96) for _ in range(3))
    rank1.trainer.parallel = SimpleNamespace(world=2)
    trainer = RanksTrainer(_InOneProcess([rank0.parts, rank1.parts]))  # the kernel's side
    t = trainer.techniques
    with pytest.raises(ValueError, match="Rank 1 refused the change, so no rank made it: "
                                         "method cannot change"):
        trainer.set(t.replace(optimizer="sgd", method="lora"))
    assert rank0.techniques == twin.techniques and trainer.techniques == twin.techniques
    assert rank0.step().loss == twin.step().loss
    assert trainer.set(t.replace(lr=3e-3)) == {"lr"}
    assert trainer.techniques.lr == rank0.techniques.lr == rank1.techniques.lr == 3e-3


def test_several_steps_to_a_command_end_at_the_first_boundary_any_rank_saw_stop(tmp_path):
    """``rank_steps``: the first step is always taken (the kernel asked for it); before each
    later one, one all-reduce of who saw the stop file, and they end where any rank did."""
    from nbtune.run.processes import ENGINE_STATE, rank_steps

    flag = tmp_path / "stop"

    class OtherRank:  # the all-reduce, with the other rank seeing the file at its 3rd boundary
        seen: list = []

        def sum_(self, tensor):
            self.seen.append(tensor.item())
            return tensor + (1.0 if len(self.seen) == 3 else 0.0)

    session, twin = _twins()
    ENGINE_STATE.update(run=session.parts, parallel=OtherRank())
    try:
        taken = rank_steps(True, False, 10, str(flag))  # stopped by the other rank
        assert [r.step for r, _ in taken] == [1, 2, 3] and OtherRank.seen == [0.0, 0.0, 0.0]
        assert [r.memory.measured for r, _ in taken] == [True, False, False]
        flag.touch()  # this rank sees it: only the step asked for
        assert [r.step for r, _ in rank_steps(False, True, 10, str(flag))] == [4]
        assert OtherRank.seen[-1] == 1.0
        flag.unlink()
        assert [r.step for r, _ in rank_steps(True, True, 2, str(flag))] == [5, 6]  # most
    finally:
        ENGINE_STATE.clear()
    assert [r.loss for r in session.history] == [r.loss for r in twin.run(6, progress=False)]


def test_the_kernel_sends_as_many_steps_as_fill_its_seconds_per_command(tmp_path):
    """``RanksTrainer.steps``: one step while the pace is unknown, then as many as take about
    ``SECONDS_PER_COMMAND`` (never more than asked); each rank's memory kept per step."""
    rank0, rank1 = _twins()
    ranks = _InOneProcess([rank0.parts, rank1.parts])
    ranks.stop_flag = tmp_path / "stop"
    for state in ranks.states:  # (in turn, not together: each rank's all-reduce is its own)
        state["parallel"] = SimpleNamespace(sum_=lambda tensor: tensor)
    trainer = RanksTrainer(ranks)
    assert len(trainer.steps(True, False, 50)) == 1  # no step yet: its pace unknown
    pace = trainer.history[-1].seconds
    trainer.SECONDS_PER_COMMAND = 3.5 * pace
    reports = trainer.steps(True, False, 50)
    assert [r.step for r in reports] == [2, 3, 4] and trainer.history[1:] == reports
    assert len(trainer.steps(True, False, 2)) == 2 and ranks.step_number == 6
    assert sorted(trainer.rank_memory) == [1, 2, 3, 4, 5, 6]
    assert all(len(memory) == 2 for memory in trainer.rank_memory.values())
    assert [r.loss for r in rank0.history] == [r.loss for r in rank1.history]


@pytest.mark.slow
def test_a_rank_started_on_another_machine_joins_the_kernels_ranks(tmp_path, capsys):
    """processes=2, local=1: one rank starts here, the other joins as an ipengine started
    apart with the printed connection file (another machine's, here on this one at
    127.0.0.1): the two train as one process does."""
    import glob
    import subprocess
    import sys
    import tempfile

    path = tmp_path / "run.yaml"
    path.write_text(RUN.format(techniques="method: lora, batch_size: 4, seq_len: 96, lr: 1e-3, lora_rank: 4"))
    alone = Session.from_config(path)
    one = alone.run(2, progress=False)
    before = set(glob.glob(f"{tempfile.gettempdir()}/nbtune-ranks-*"))
    made, joined = [], []

    def start():
        made.append(Session.from_config(path, processes=2, local=1, address="127.0.0.1"))

    starting = threading.Thread(target=start)
    starting.start()
    deadline = time.monotonic() + 120
    while not joined and time.monotonic() < deadline:
        for folder in set(glob.glob(f"{tempfile.gettempdir()}/nbtune-ranks-*")) - before:
            for file in Path(folder).glob("security/ipcontroller-*-engine.json"):
                joined.append(subprocess.Popen([sys.executable, "-m", "ipyparallel.engine",
                                                f"--file={file}", "--log-level=40"]))
        time.sleep(0.2)
    starting.join(timeout=300)
    assert made, "the ranks did not start"
    ranks = made[0]
    try:
        assert "ipengine --file=ipcontroller-engine.json" in capsys.readouterr().out
        two = ranks.run(2, progress=False)
        assert [round(r.loss, 5) for r in two] == [round(r.loss, 5) for r in one]
    finally:
        ranks.close()
        joined[0].wait(timeout=60)


def test_a_collective_failing_on_a_dead_peer_names_the_peer_not_the_rank_that_saw_it():
    """Rank 0's gloo error comes the moment rank 1 is killed, often before rank 1's death is
    seen: the rank named is the dead one (on a busy machine the live one was named)."""
    import subprocess
    import sys

    from nbtune.run.processes import Processes

    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    killed = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        ranks = Processes.__new__(Processes)
        ranks.pids, ranks._here = [alive.pid, killed.pid], [True, True]
        gloo = "RuntimeError: [gloo/transport/tcp/pair.cc:534] Connection closed by peer"
        assert ranks._dead_peer(gloo, grace=0.2) is None  # both alive: the error is rank 0's own
        killed.kill()  # not reaped yet: a zombie, as a killed engine is until its launcher polls
        assert ranks._dead_peer(gloo, grace=2.0) == 1
        assert ranks._dead_peer("ValueError: a bad row", grace=0.2) is None  # not a peer's loss
        ranks._here = [True, False]  # a rank on another machine: its pid is not ours to read
        assert ranks._dead_peer(gloo, grace=0.2) is None
    finally:
        alive.kill()
        killed.wait(), alive.wait()


def test_a_rank_failing_between_its_future_done_and_ipyparallels_ready_flag_is_named():
    """ipyparallel sets an AsyncResult's ready flag in a callback after its future is done;
    a rank's failure seen in between (successful() raises then, get(0) times out) is still
    named with its own error and the out-of-memory kind (a CI run met that moment); nbtune's
    own account of an out of memory, which names the rank and what to change, is said whole."""
    from concurrent import futures

    from ipyparallel.error import RemoteError

    from nbtune.run.processes import Processes, RankFailed

    class Between(futures.Future):  # done, not yet ready, as ipyparallel's AsyncResult can be
        def successful(self):
            raise RuntimeError("Cannot check successful() if not done.")

        def get(self, timeout=-1):
            raise TimeoutError("Result not ready.")

    class Engine:
        def __init__(self, error):
            self.error, self.history = error, []

        def apply_async(self, function, *args):
            result = Between()
            if self.error is None:
                result.set_result("fine")
            else:
                result.set_exception(self.error)
            return result

    oom = RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
    oom.ename = "OutOfMemoryError"
    # nbtune's own account (oom.explain), several lines naming the rank: said whole, as it is
    explained = RemoteError("OutOfMemory", "Rank 1 of 2 ran out of memory in the backward phase of "
                            "step 3.\nApply one with session.set(x=1).", "(the engine's traceback)")
    cases = [(oom, f"RuntimeError: {oom}", False, True), (ValueError("a bad row"), "ValueError: a bad row", False, False),
             (explained, explained.evalue.rstrip("."), True, True)]
    for error, why, named, out_of_memory in cases:
        ranks = Processes.__new__(Processes)
        ranks._engines, ranks.timeout, ranks.pulses = [Engine(None), Engine(error)], 30.0, None
        failures = []

        def fail(rank, why, named=False, out_of_memory=False):
            failures.append((rank, why, named, out_of_memory))
            raise RankFailed(why, rank, out_of_memory)
        ranks._fail = fail
        with pytest.raises(RankFailed):
            ranks._each(lambda: None, lambda rank: (), None, 0.0)
        assert failures == [(1, why, named, out_of_memory)]
