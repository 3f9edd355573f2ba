"""The heartbeat's judgement, in one process over a store both ranks share (torchrun's is a
TCPStore; a HashStore answers the same calls): a rank that falls silent is named with where
it was last heard, by the lowest rank still beating, once ``hang_seconds`` have passed; a rank
that finished (``close``) is never named. (Under torchrun: tests/cli/test_distributed.py.)"""

import time

import pytest
import torch.distributed as dist

from nbtune import liveness


@pytest.fixture
def ended(monkeypatch):
    """``os._exit`` from the heartbeat's thread recorded, and that thread stopped there."""
    calls = []

    def end(code):
        calls.append(code)
        raise SystemExit(code)  # (the thread ends there, quietly, as the process would)
    monkeypatch.setattr(liveness.os, "_exit", end)
    monkeypatch.setattr(liveness, "BEAT_SECONDS", 0.05)
    return calls


def _beat(rank, store, said, where="between steps (after step 3)", hang=0.5):
    return liveness.Heartbeat(rank, 3, lambda: where, hang, said.append, "Resume with --resume.", store=store)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # (its SystemExit)
def test_a_silent_rank_is_named_with_where_it_was_last_heard_and_a_finished_one_is_not(ended):
    store, said = dist.HashStore(), []
    beats = [_beat(0, store, said, "during the optimizer phase of step 7"),
             _beat(1, store, said, "during the backward phase of step 41"),
             _beat(2, store, said)]
    time.sleep(0.3)
    beats[0].close()  # rank 0 finished: never named, and not the one to speak
    beats[1]._stop.set()  # rank 1 falls silent without finishing
    beats[1]._thread.join()
    beats[2]._thread.join(timeout=5)
    assert ended == [1] and not beats[2]._thread.is_alive()
    assert said == ["rank 1 stopped answering (no heartbeat for 0 s; last heard during the backward "
                    "phase of step 41): the job ends here on every rank. Resume with --resume."]


def test_ranks_that_keep_beating_or_finish_are_never_named(ended):
    store, said = dist.HashStore(), []
    beats = [_beat(rank, store, said) for rank in range(3)]
    time.sleep(1.2)  # over twice hang_seconds
    for beat in beats:
        beat.close()
    assert said == [] and ended == []


def _pulse(store, rank, where, pid):
    """A rank's beat as a process on this machine would write it."""
    import json

    store.set(f"nbtune/beat/{rank}", json.dumps([1, where, liveness.HOST, pid]))


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # (its SystemExit)
def test_a_rank_whose_process_is_gone_is_named_at_once_by_one_rank_only(ended):
    """Rank 2's process (on this machine) is gone: named as ended, with where it was last
    heard, well before hang_seconds, in one line from one rank, and every rank ends."""
    import subprocess
    import sys

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    store, said = dist.HashStore(), []
    _pulse(store, 2, "during the forward phase of step 3", gone.pid)
    started = time.monotonic()
    beats = [_beat(rank, store, said, hang=30) for rank in (0, 1)]
    for beat in beats:
        beat._thread.join(timeout=5)
    assert time.monotonic() - started < 5 and sorted(ended) == [1, 1]
    assert said == ["rank 2 ended (its process is gone: killed or crashed; last heard during the "
                    "forward phase of step 3): the job ends here on every rank. Resume with --resume."]
    assert liveness.last_heard(store, 2) == "during the forward phase of step 3"
    assert liveness.last_heard(store, 5) is None


def test_a_rank_ending_for_another_reason_names_a_rank_gone_meanwhile_as_it_closes(ended, monkeypatch):
    """torchrun stops the other ranks as soon as one dies, maybe before a beat sees it: the
    rank's close() still names it (once), and a living or finished rank is never named."""
    import os
    import subprocess
    import sys

    monkeypatch.setattr(liveness, "BEAT_SECONDS", 60)  # (no beat of the thread's will see it)
    store, said = dist.HashStore(), []
    beat = _beat(0, store, said)
    time.sleep(0.2)
    _pulse(store, 1, "while saving the checkpoint of step 4", os.getpid())  # alive
    store.set("nbtune/beat/2", '["done", ""]')  # finished
    beat.close()
    assert said == [] and liveness.last_heard(store, 0) is None  # (this one is now done)
    again = [_beat(2, store, said), _beat(0, store, said)]
    time.sleep(0.2)  # (each has beaten once, and now waits)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    _pulse(store, 1, "while saving the checkpoint of step 4", gone.pid)
    for beat in again:
        beat.close()
    assert said == ["rank 1 ended (its process is gone: killed or crashed; last heard while saving "
                    "the checkpoint of step 4): the job ends here on every rank. Resume with --resume."]
    assert ended == []


def test_a_lost_rank_is_named_with_where_its_heartbeat_last_heard_it(monkeypatch):
    """Parallel.lost: a broken connection as one message naming the absent rank and its
    last words; a stop arriving during the roll call (torchrun stops every rank once one
    died) still gives a message, not a KeyboardInterrupt's traceback."""
    from nbtune.distributed import Parallel, RankLost, Sharding

    parallel = Parallel(0, 2, 0, Sharding())
    broken = RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:8078")
    monkeypatch.setattr(parallel, "_roll_call", lambda: ([1], {1: "during the backward phase of step 3"}))
    lost = parallel.lost(broken)
    assert isinstance(lost, RankLost) and "rank 1 (last heard during the backward phase of step 3) " \
        "stopped answering" in str(lost) and "--resume" in str(lost)
    assert parallel.lost(RuntimeError("a shape mismatch")) is None  # not a rank gone: its own error

    def stopped():
        raise KeyboardInterrupt
    monkeypatch.setattr(parallel, "_roll_call", stopped)
    try:
        lost = parallel.lost(broken)
    except KeyboardInterrupt:  # (not let through: pytest would end here)
        pytest.fail("a stop during the roll call came out of lost() as a KeyboardInterrupt")
    assert "torchrun stopped this rank" in str(lost)
