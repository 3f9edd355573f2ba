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
