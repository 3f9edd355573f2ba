"""Several processes driven from the kernel (ipyparallel engines, each a gloo rank) against one
process on the same run file, and no process left behind."""

import json

import psutil
import pytest

from nbtune import cli
from nbtune.processes import Processes

RUN = ("demo: tiny\ntechniques: {{{techniques}}}\nrun: {{steps: 5, checkpoint_every: 0, save: []}}\n")


@pytest.mark.slow
@pytest.mark.parametrize("techniques", ["batch_size: 4, seq_len: 96, lr: 1e-3",
                                        "method: lora, batch_size: 4, seq_len: 96, lr: 1e-3, lora_rank: 4"],
                         ids=["full", "lora"])
def test_two_processes_from_the_kernel_equal_one_process_and_leave_nothing_behind(tmp_path, techniques):
    path = tmp_path / "run.yaml"
    path.write_text(RUN.format(techniques=techniques))
    assert cli.main(["train", str(path), "--out", str(tmp_path / "one")]) == 0
    one = [json.loads(line) for line in (tmp_path / "one" / "metrics.jsonl").read_text().splitlines()]
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    ranks = Processes(path, 2)
    try:
        started = {p.pid for p in psutil.Process().children(recursive=True)} - before
        assert len(started) >= 3  # a controller and two engines
        first = ranks.step()
        reports = [first] + ranks.run(4)
    finally:
        ranks.close()
    assert [r["step"] for r in reports] == [1, 2, 3, 4, 5]
    for a, b in zip(one, reports):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 and a["tokens"] == b["tokens"]
    # each rank's memory, as the kernel gathered it: half the single process's state each
    for rank in reports[-1]["ranks"]:
        assert abs(rank["parameters"] / one[-1]["memory"]["parameters"] - 0.5) < 0.02
    alive = [p for p in psutil.Process().children(recursive=True) if p.pid in started]
    gone, still = psutil.wait_procs(alive, timeout=20)
    assert not still, [p.cmdline() for p in still]


KERNEL = """
import sys
from nbtune.processes import Processes
ranks = Processes(sys.argv[1], 2)
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


@pytest.mark.slow
def test_a_killed_rank_is_named_the_others_ended_and_a_restart_comes_back_to_the_checkpoint(tmp_path):
    import os
    import signal
    import threading

    path = tmp_path / "run.yaml"
    path.write_text(RUN.format(techniques="batch_size: 4, seq_len: 96, lr: 1e-3"))
    assert cli.main(["train", str(path), "--out", str(tmp_path / "one")]) == 0
    one = [json.loads(line)["loss"] for line in (tmp_path / "one" / "metrics.jsonl").read_text().splitlines()]
    ranks = Processes(path, 2, timeout=120)
    try:
        ranks.run(2)
        ranks.save_checkpoint(tmp_path / "at-2")
        engines = ranks._all(os.getpid, lambda rank: ())
        started = psutil.Process().children(recursive=True)
        threading.Timer(1.0, os.kill, (engines[1], signal.SIGKILL)).start()
        with pytest.raises(RuntimeError) as failed:
            ranks.run(10_000)
        assert failed.value.rank == 1 and "Rank 1 failed" in str(failed.value)
        assert f"restart() starts them again from {tmp_path / 'at-2'}" in str(failed.value)
        gone, still = psutil.wait_procs(started, timeout=30)  # rank 0 ended too: no process left
        assert not still, [p.cmdline() for p in still]
        ranks.restart()
        assert ranks.step_number == 2 and [r["step"] for r in ranks.history] == [1, 2]
        after = ranks.run(3)
    finally:
        ranks.close()
    assert [r["step"] for r in after] == [3, 4, 5]
    assert all(abs(a - b["loss"]) <= 1e-5 for a, b in zip(one[2:], after))
