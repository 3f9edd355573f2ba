"""The runner: background runs (start returns at once, stop within a step, changes applied between
steps in order, the final state equal to the same changes made between synchronous steps,
and every command that would race with the training thread refused), and a change checked
once on its way from the panel to the step."""

import _thread
import dataclasses
import signal
import threading
import time

import pytest
import torch

import nbtune as nt
from nbtune.run.runner import BusyError, StepDone
from tests.helpers import small_session

pytestmark = pytest.mark.usefixtures("one_thread")


def weights(session) -> dict:
    return {k: v.detach().clone() for k, v in session.model.state_dict().items()}


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def applied_at(session) -> list[tuple[int, nt.Techniques]]:
    """Record (steps done, techniques) each time a change is applied."""
    seen = []

    def listen(event):
        if event.kind == "techniques":
            seen.append((len(session.history), event.techniques))

    session.subscribe(listen)
    return seen


def test_start_returns_at_once_and_stop_lands_within_a_step():
    s = small_session()
    s.step()  # the first step builds optimizer state: time the steady ones
    run = s.start(10_000)
    assert run.running and s.current_run is run
    while len(run.reports) < 3:
        time.sleep(0.01)
    slowest = max(r.seconds for r in run.reports)
    asked = time.monotonic()
    s.stop()
    latency = time.monotonic() - asked
    assert not run.running and s.current_run is None
    assert run.stopped and run.error is None
    assert latency < slowest * 3 + 0.5, (latency, slowest)
    assert len(s.history) == 1 + len(run.reports)
    assert [r.step for r in run.reports] == list(range(2, 2 + len(run.reports)))
    assert s.stop() is None  # nothing left to stop


def test_changes_during_a_run_equal_the_same_changes_between_synchronous_steps():
    s = small_session()
    seen = applied_at(s)
    run = s.start(8)
    while len(run.reports) < 2:
        time.sleep(0.005)
    planned = s.set(lr=3e-4)
    s.set(max_grad_norm=0.5)
    assert planned.lr == 3e-4 and s.set.__self__ is s
    run.wait()
    assert s.pending == [] and len(run.reports) == 8
    assert [t.lr for _, t in seen] == [3e-4, 3e-4] and seen[-1][1].max_grad_norm == 0.5
    first, second = seen[0][0], seen[1][0]
    assert first == second  # both landed at the same step boundary, in order
    assert s.techniques.lr == 3e-4 and s.techniques.max_grad_norm == 0.5
    assert all(r.lr == pytest.approx(3e-4) for r in s.history[first:])
    assert all(r.lr == pytest.approx(1e-3) for r in s.history[:first])

    twin = small_session()
    for _ in range(first):
        twin.step()
    twin.set(lr=3e-4)
    twin.set(max_grad_norm=0.5)
    for _ in range(8 - first):
        twin.step()
    assert [r.loss for r in twin.history] == [r.loss for r in s.history]
    assert same(weights(twin), weights(s))


def test_a_rebuilding_change_mid_run_is_applied_whole():
    s = small_session(method="lora", lora_rank=4, lr=1e-2)
    seen = applied_at(s)
    run = s.start(6)
    while len(run.reports) < 1:
        time.sleep(0.005)
    s.set(lora_rank=8, batch_size=2)
    run.wait()
    (at, t), = seen
    assert t.lora_rank == 8 and s.model.model.layers[0].self_attn.q_proj.lora_A.weight.shape[0] == 8
    assert all(r.shape[0] == 2 for r in s.history[at:]) and all(r.shape[0] == 4 for r in s.history[:at])

    twin = small_session(method="lora", lora_rank=4, lr=1e-2)
    for _ in range(at):
        twin.step()
    twin.set(lora_rank=8, batch_size=2)
    for _ in range(6 - at):
        twin.step()
    assert [r.loss for r in twin.history] == [r.loss for r in s.history]
    assert same(weights(twin), weights(s))


def test_commands_that_would_race_are_refused_and_change_nothing():
    s = small_session()
    run = s.start(10_000)
    try:
        for command in (s.step, lambda: s.run(2), lambda: s.start(2), lambda: s.generate("hi"),
                        s.state_dict, lambda: s.save("/tmp/never-written"),
                        lambda: s.compare([{}])):
            with pytest.raises(BusyError, match="background run|already training"):
                command()
        with pytest.raises(ValueError):
            s.set(lr=-1.0)  # a bad value is refused in the caller's cell, nothing queued
        with pytest.raises(TypeError, match="no_such_toggle"):
            s.set(no_such_toggle=1)
        assert s.pending == []
        s.estimate()  # reads only the config: allowed meanwhile
        len(s.history)
    finally:
        s.stop()
    assert not run.running
    s.step()  # usable again


def test_a_change_refused_at_the_boundary_is_reported_and_the_run_goes_on(monkeypatch):
    s = small_session()
    real = s.trainer.set

    def refuse_seq_len(new, checked=False):
        if new.seq_len != 96:
            raise ValueError("seq_len refused at the boundary (injected)")
        return real(new, checked=checked)

    monkeypatch.setattr(s.trainer, "set", refuse_seq_len)
    run = s.start(4)
    with pytest.raises(ValueError, match="seq_len"):
        s.set(seq_len=4096)  # beyond the model's context: refused in the caller's cell
    assert s.pending == []
    s.set(seq_len=64)  # passes the checks made at once, fails where it is applied
    run.wait()
    assert len(run.reports) == 4 and s.techniques.seq_len == 96 and s.pending == []
    assert any("seq_len refused at the boundary" in m and "not applied" in m for m in run.messages)


def test_a_queued_change_is_checked_once_and_the_plan_is_kept_not_replayed(monkeypatch):
    """A change made during a run is checked (the plan's rules, the data's) when it is made,
    not again at the boundary on the techniques it was checked on; reading the plan replays
    nothing. After a change before it is refused at the boundary, the ones after it follow
    from what is in use and are checked again."""
    import nbtune.plan as plan
    import nbtune.run.runner as runner_module
    import nbtune.run.trainer as trainer_module

    s = small_session()
    checks = []
    real = plan.check

    def counted(t, *args, **kwargs):
        checks.append(t)
        return real(t, *args, **kwargs)

    monkeypatch.setattr(plan, "check", counted)
    monkeypatch.setattr(trainer_module, "check", counted)
    gate = threading.Event()
    s.runner.subscribe(lambda event: gate.wait(30) if isinstance(event, runner_module.StepDone) else None)
    run = s.start(3)
    s.set(lr=3e-4)
    s.set(max_grad_norm=0.5)
    replays = []
    monkeypatch.setattr(nt.Techniques, "replace",
                        lambda self, **c: replays.append(c) or dataclasses.replace(self, **c))
    assert [s.planned.lr for _ in range(50)] == [3e-4] * 50 and replays == []  # kept, not replayed
    assert s.planned.max_grad_norm == 0.5 and s.pending == [{"lr": 3e-4}, {"max_grad_norm": 0.5}]
    gate.set()
    run.wait()
    assert s.techniques.lr == 3e-4 and s.techniques.max_grad_norm == 0.5
    before = nt.Techniques().max_grad_norm
    assert [(t.lr, t.max_grad_norm) for t in checks] == [(3e-4, before), (3e-4, 0.5)]  # once each


def test_two_threads_queueing_at_once_chain_their_changes(monkeypatch):
    """Two panels (or a panel and a cell) set during a run at the same moment: the plan is
    both changes, each checked on the other's result, not two plans from one base."""
    s = small_session()
    real = s.runner.check
    inside = threading.Event()

    def slow_check(t):
        inside.set()
        time.sleep(0.3)  # a check takes a while: the other thread's set arrives meanwhile
        return real(t)

    monkeypatch.setattr(s.runner, "check", slow_check)
    gate = threading.Event()
    s.runner.subscribe(lambda event: gate.wait(30) if isinstance(event, StepDone) else None)
    run = s.start(3)
    first = threading.Thread(target=lambda: s.set(lr=3e-4))
    first.start()
    inside.wait(10)
    s.set(max_grad_norm=0.5)
    first.join()
    assert (s.planned.lr, s.planned.max_grad_norm) == (3e-4, 0.5)
    gate.set()
    run.wait()
    assert (s.techniques.lr, s.techniques.max_grad_norm) == (3e-4, 0.5) and s.planned == s.techniques


def test_after_a_refusal_at_the_boundary_the_rest_of_the_queue_is_checked_again(monkeypatch):
    s = small_session()
    real = s.trainer.set
    given = []

    def refuse_seq_len(new, checked=False):
        given.append((new.seq_len, new.lr, checked))
        if new.seq_len != 96:
            raise ValueError("seq_len refused at the boundary (injected)")
        return real(new, checked=checked)

    monkeypatch.setattr(s.trainer, "set", refuse_seq_len)
    gate = threading.Event()
    s.runner.subscribe(lambda event: gate.wait(30) if isinstance(event, StepDone) else None)
    run = s.start(3)
    s.set(seq_len=64)
    s.set(lr=3e-4)
    assert s.planned.seq_len == 64 and s.planned.lr == 3e-4
    gate.set()
    run.wait()
    # the first refused; the second applied on seq_len 96, checked again (not its old result)
    assert given == [(64, 1e-3, True), (96, 3e-4, False)]
    assert s.techniques.seq_len == 96 and s.techniques.lr == 3e-4 and s.planned == s.techniques


def test_an_error_in_the_thread_ends_the_run_and_leaves_the_twin_state(monkeypatch):
    s = small_session()
    calls = {"n": 0}
    real = s.trainer.step

    def failing(track, usage=False):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected")
        return real(track, usage)

    monkeypatch.setattr(s.trainer, "step", failing)
    run = s.start(6)
    with pytest.raises(RuntimeError, match="injected"):
        run.wait()
    assert len(run.reports) == 2 and s.current_run is None
    assert any("injected" in m for m in run.messages)
    twin = small_session()
    twin.run(2, progress=False)
    assert same(weights(twin), weights(s))


def test_ctrl_c_while_waiting_stops_the_run():
    # A shell starts background jobs with SIGINT ignored, and then interrupt_main does nothing:
    # give the test the handler a terminal has, so it cannot wait for ever.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    s = small_session()
    run = s.start(10_000)
    threading.Timer(0.5, _thread.interrupt_main).start()
    try:
        reports = run.wait()
    finally:
        signal.signal(signal.SIGINT, previous)
    assert not run.running and run.stopped and reports == run.reports
    assert len(s.history) == len(reports)


@pytest.mark.slow
def test_an_estimate_beside_a_training_run_is_the_same_as_alone():
    s = small_session()
    alone = s.estimate()
    s.memory_tracking = "every_step"  # the training thread tracks too: both trackers active
    run = s.start(10_000)
    try:
        beside = [s.estimate() for _ in range(3)]
    finally:
        s.stop()
    assert all(b == alone and b.at_peak == alone.at_peak for b in beside)
    assert len(run.reports) >= 1


def test_a_change_made_as_the_run_ends_is_applied_not_stranded():
    s = small_session()
    run = s.start(1)
    for lr in (1e-4, 2e-4, 3e-4, 4e-4):
        s.set(lr=lr)
        time.sleep(0.05)
    run.wait()
    assert s.pending == [] and s.techniques.lr == 4e-4


def test_eval_every_without_held_out_rows_is_refused_with_the_fix():
    s = small_session()
    s.data.heldout = []
    with pytest.raises(ValueError, match="heldout="):
        s.set(eval_every=2)
    run = s.start(10_000)
    try:
        with pytest.raises(ValueError, match="heldout="):
            s.set(eval_every=2)
    finally:
        s.stop()
    assert s.techniques.eval_every == 0


def test_trackers_in_two_threads_leave_storage_resize_as_it_was():
    real = torch.UntypedStorage.resize_
    s = small_session()
    s.memory_tracking = "every_step"
    s.start(3)
    for _ in range(2):
        s.estimate()
    s.wait()
    assert torch.UntypedStorage.resize_ is real


@pytest.mark.slow
def test_a_reply_during_a_run_comes_between_two_steps_and_changes_no_step():
    """The panel's "Try it": a greedy reply queued during a background run is made at the
    next step boundary on the run's thread. The run's losses and weights are bit for bit a
    run's without it, and the reply is what a twin gives after as many steps."""
    prompt, trained = "Is 7 even or odd?", 40  # by then the demo answers in several tokens
    s = small_session()
    s.run(trained, progress=False, live=False)
    run = s.start(6)
    while len(run.reports) < 2:
        time.sleep(0.005)
    pieces = []
    asked = s.runner.between_steps(
        lambda: (len(s.history), threading.current_thread() is run.thread,
                 s.generate(prompt, max_new_tokens=12, stream=pieces.append)))
    try:
        step, on_run_thread, reply = asked.result(120)
    finally:
        run.wait()  # no thread left inside torch if the reply failed
    assert on_run_thread and trained + 2 <= step < trained + 6 and len(run.reports) == 6
    assert "".join(pieces) == reply and len(pieces) > 1  # streamed piece by piece

    plain = small_session()
    plain.run(trained + 6, progress=False, live=False)
    assert [r.loss for r in plain.history] == [r.loss for r in s.history]
    assert same(weights(plain), weights(s))
    twin = small_session()
    twin.run(step, progress=False, live=False)
    assert twin.generate(prompt, max_new_tokens=12) == reply
    # with no run it is made at once, in this thread; an error reaches the future
    assert s.runner.between_steps(lambda: threading.current_thread()).result(0) is threading.current_thread()
    with pytest.raises(ZeroDivisionError):
        s.runner.between_steps(lambda: 1 / 0).result(0)


def test_a_run_armed_to_save_on_exit_saves_its_last_step_once_and_only_there(tmp_path, capsys):
    """What a kernel's SIGTERM or exit triggers (``tests/run/test_kernel_exit.py`` sends them to a
    real kernel): the run stops after the step under way and that step is saved, once, to
    the folder named; afterwards nothing is written."""
    s = small_session()
    folder = tmp_path / "saved"
    with pytest.raises(ValueError, match="is a file"):
        s.start(10, checkpoint=__file__)
    run = s.start(100_000, checkpoint=folder)
    while len(run.reports) < 3:
        time.sleep(0.005)
    saved = run.on_exit.save("a test")
    assert saved == folder and not run.running and run.error is None
    assert "saved" in capsys.readouterr().err
    assert run.on_exit.save("again") == saved  # once
    back = small_session()
    back.load_checkpoint(folder)
    assert [r.loss for r in back.history] == [r.loss for r in s.history]
    run.on_exit._at_exit()  # the run has ended: nothing more
    assert sorted(p.name for p in tmp_path.iterdir()) == ["saved"]
