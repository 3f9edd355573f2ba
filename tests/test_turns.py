"""conftest.py's turns between pytest-xdist's workers: a test marked ``alone`` overlaps none."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TIMED = '''import time, pytest

def log(name, edge):
    with open("log", "a") as f:
        f.write(f"{name} {edge} {time.time()}\\n")

def timed(name):
    log(name, "start")
    time.sleep(0.3)
    log(name, "end")
'''


@pytest.mark.slow
def test_an_alone_test_overlaps_no_other_workers_test(tmp_path):
    shutil.copy(ROOT / "conftest.py", tmp_path)
    (tmp_path / "test_one.py").write_text(TIMED + '''
def other_started():
    try:
        with open("log") as f:
            return "other0 start" in f.read()
    except FileNotFoundError:
        return False

def test_first():  # not alone: waits until the other worker's tests are under way
    deadline = time.time() + 120
    while not other_started():
        assert time.time() < deadline, "the other worker never started"
        time.sleep(0.05)

@pytest.mark.alone
def test_alone():
    timed("alone")
''')
    (tmp_path / "test_other.py").write_text(TIMED + '''
@pytest.mark.parametrize("i", range(8))
def test_other(i):
    timed(f"other{i}")
''')
    temp = tmp_path / "temp"
    temp.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}  # not this run's
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2",
                           "--dist", "loadfile", "-o", "markers=alone"], cwd=tmp_path,
                          env={**env, "TMPDIR": str(temp)}, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    spans = {}
    for line in (tmp_path / "log").read_text().splitlines():
        name, edge, when = line.split()
        spans.setdefault(name, {})[edge] = float(when)
    assert len(spans) == 9
    alone = spans.pop("alone")
    assert all(s["end"] <= alone["start"] or s["start"] >= alone["end"] for s in spans.values()), spans
    assert spans["other0"]["start"] < alone["start"]  # the two workers did run side by side
    assert not [p for p in temp.iterdir() if p.name.startswith("nbtune-test-turns-")]  # cleared
