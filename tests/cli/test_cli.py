"""`nbtune demo`, run as a user runs it, trains the embedded default visibly."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest


def nbtune_command() -> list[str]:
    script = Path(sys.executable).parent / "nbtune"
    if script.exists():
        return [str(script)]
    return [shutil.which("nbtune") or sys.exit("the nbtune console script is not installed")]


@pytest.mark.slow
def test_demo_learns_and_writes_chart_and_summary(tmp_path):
    # 150 of the default 300 steps: enough to halve the loss and lift the accuracy (CI time)
    done = subprocess.run([*nbtune_command(), "demo", "--steps", "150", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("step ")]
    assert [int(line.split()[1]) for line in lines] == [1] + list(range(15, 151, 15))
    assert "loss" in lines[0] and "peak" in lines[0]
    assert len(done.stdout.splitlines()) <= 20  # a screenful; every step is in the JSON
    summary = json.loads((tmp_path / "demo_summary.json").read_text())
    for key in ("loss_first", "loss_last", "heldout_accuracy_before", "heldout_accuracy_after",
                "steps", "seconds", "peak_bytes"):
        assert key in summary
    assert summary["steps"] == 150 and [row["step"] for row in summary["history"]] == list(range(1, 151))
    assert summary["loss_last"] <= summary["loss_first"] / 2
    assert summary["heldout_accuracy_after"] > summary["heldout_accuracy_before"]
    assert summary["peak_bytes"] > 0
    busy = summary["busy_cores"]  # other processes' share of the cores: said when it slowed the run
    assert busy is not None and busy >= 0 and ("machine busy" in done.stdout) == (busy >= 0.25)
    png = (tmp_path / "demo_memory.png").read_bytes()
    assert png[:4] == b"\x89PNG" and len(png) > 10_000


def test_help_and_argument_errors_answer_before_torch_is_imported():
    """``nbtune --help`` took 26 s (torch and the rest imported before parsing): help, a
    refused argument and a malformed --set now answer with the standard library alone."""
    probe = ("import sys\n"
             "import nbtune.cli.main as cli\n"
             "for argv in (['--help'], ['train', '--help'], ['demo', '--method', 'lorra'],\n"
             "             ['train', 'run.yaml', '--set', 'novalue'], ['trian', 'run.yaml']):\n"
             "    try:\n"
             "        cli.main(argv)\n"
             "    except SystemExit as done:\n"
             "        print('exit', done.code)\n"
             "print('torch imported:', 'torch' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("exit 0") == 2 and done.stdout.count("exit 2") == 3, done.stdout
    assert "torch imported: False" in done.stdout
    assert "invalid choice: 'lorra'" in done.stderr and "write FIELD=VALUE" in done.stderr
    assert "no command 'trian': did you mean 'train'?" in done.stderr
    assert "seed 001" not in done.stdout  # user text says what the ladder is
