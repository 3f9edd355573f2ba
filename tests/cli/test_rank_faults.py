"""The catalogue of rank faults under torchrun (2 gloo ranks, LoRA): rank 1 killed while
loading, in each phase of a step, between steps and while writing its part of a sharded
checkpoint, or its disk full there (tests/fault_worker.py plants each). Each case against a
twin that nothing stopped. (The agent killed and a rank hung: test_distributed.py.)"""

import os
import subprocess
import sys
import time

import psutil
import pytest

from helpers import torchrun
from test_distributed import LORA, close, metrics, run_file, weights


@pytest.fixture(scope="module")
def six_steps_twin(tmp_path_factory):
    """A LoRA run of six steps on two ranks that nothing stopped (the faults' twin)."""
    folder = tmp_path_factory.mktemp("twin")
    path = run_file(folder, LORA, steps=6)
    torchrun(path, folder / "out")
    return path, folder / "out"


# fault planted in rank 1 (tests/fault_worker.py): (the step it strikes, where rank 0 says rank
# 1 was last heard, the newest checkpoint left whole)
RANK_FAULTS = {
    "loading": (0, "while loading the model", None),
    "forward": (3, "during the forward phase of step 3", 2),
    "backward": (3, "during the backward phase of step 3", 2),
    "optimizer": (3, "during the optimizer phase of step 3", 2),
    "between": (3, "between steps (after step 3)", 2),
    "write": (4, "while saving the checkpoint of step 4", 2),
    "disk-full": (4, None, 2),
}


@pytest.mark.slow
@pytest.mark.parametrize("fault", RANK_FAULTS)
def test_a_rank_fault_at_each_phase_is_named_and_the_resume_equals_a_run_never_stopped(
        tmp_path, six_steps_twin, fault):
    """The catalogue: rank 1 killed (SIGKILL: the OOM killer, a crash) while loading, in each
    phase of a step, between steps or while writing its part of a sharded checkpoint, or its
    disk full there. Rank 0 names it and where it was, the job ends with no rank left, the
    newest complete checkpoint is whole (no half-written one claimed), and --resume gives the
    never-stopped twin's losses and adapters, bit for bit."""
    from nbtune.run.checkpoints import checkpoints

    step, where, newest = RANK_FAULTS[fault]
    path, twin = six_steps_twin
    out = tmp_path / "out"
    worker = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fault_worker.py")
    started = time.monotonic()
    agent = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                              "2", worker, fault, str(step), "train", str(path), "--out", str(out)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    ranks = []
    while agent.poll() is None and len(ranks) < 2 and time.monotonic() - started < 60:
        time.sleep(0.1)
        try:
            ranks = [p for p in psutil.Process(agent.pid).children() if "fault_worker" in " ".join(p.cmdline())]
        except psutil.Error:  # (one just ended)
            pass
    err = agent.communicate(timeout=240)[1]
    assert len(ranks) == 2, err[-3000:]  # (seen while they ran: the check below is of both)
    _, alive = psutil.wait_procs(ranks, timeout=5)
    assert agent.returncode != 0 and not alive, (agent.returncode, [p.pid for p in alive])
    if where is not None:
        said = [line for line in err.splitlines() if "rank 1 ended (" in line]
        assert len(said) == 1 and f"last heard {where}" in said[0] and "--resume" in said[0], err[-3000:]
    else:  # its own error, and rank 0's naming it
        assert "No space left on device" in err and "Rank 1 could not write its part" in err, err[-3000:]
    ranks_tracebacks = [t for t in err.split("Traceback (most recent call last):")[1:]
                        if "fault_worker.py" in t.splitlines()[1]]  # (not torchrun's own)
    assert not ranks_tracebacks, ranks_tracebacks[0][-3000:]
    left = checkpoints(out)
    assert [int(c.name.split("-")[1]) for c in left] == ([newest] if newest else [])
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [c.name for c in left] \
        if newest else True  # (nothing half-written beside it)
    torchrun(path, out, "--resume")
    assert [m["loss"] for m in metrics(out)] == [m["loss"] for m in metrics(twin)]
    close(weights(out), weights(twin), tol=0.0)
