"""Files from anywhere (issue 28): every crafted file in hostile_cases.py, each in a forked
child capped at 1 GiB more memory and killed after 10 s, gets exactly its listed outcome:
refused with nbtune's error naming the input within 5 s of CPU time, or accepted and
checked correct. No payload runs."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import hostile_cases

HERE = Path(__file__).parent
CPU_SECONDS = 5.0
MEMORY = 1 << 30


@pytest.fixture(scope="module")
def zygote():
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(HERE)}
    proc = subprocess.Popen([sys.executable, str(HERE / "hostile_zygote.py")], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=env, cwd=HERE)

    def ask(name: str) -> dict:
        proc.stdin.write(name + "\n")
        proc.stdin.flush()
        line = proc.stdout.readline()
        assert line, "the case runner died"
        return json.loads(line)

    yield ask
    proc.stdin.close()
    proc.wait(timeout=60)


def test_the_suite_covers_every_class_of_the_issue():
    names = list(hostile_cases.CASES)
    assert len(names) >= 60
    for prefix in ("config_", "weights_", "gguf_", "data_", "runfile_", "cli_", "save_config_",
                   "checkpoint_"):
        assert sum(n.startswith(prefix) for n in names) >= 2, prefix


@pytest.mark.parametrize("name", list(hostile_cases.CASES))
def test_a_crafted_file_gets_exactly_its_outcome(zygote, name):
    _, expected, words = hostile_cases.CASES[name]
    got = zygote(name)
    assert got["outcome"] not in ("killed", "memory", "crashed"), got
    assert not got["payload_ran"], f"{name}: a payload ran"
    assert got["cpu"] < CPU_SECONDS, f"{name}: {got['cpu']:.1f} s of CPU"
    assert got["rss_growth"] < MEMORY, f"{name}: {got['rss_growth'] / 2**20:.0f} MiB"
    if expected == "accepted":
        assert got["outcome"] == "accepted", got
        return
    error = expected.split(":")[1]
    assert got["outcome"] == "refused" and got["error"] == error, got
    assert got["module"] in ("builtins",) or got["module"].startswith("nbtune"), got
    missing = [w for w in words if w not in got["message"]]
    assert not missing, f"{name}: {missing} not in {got['message']!r}"
