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
