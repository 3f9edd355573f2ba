"""conftest.py's turns between pytest-xdist's workers: a test marked ``alone`` overlaps none."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TIMED = '''import time, pytest

def timed(name):
    with open("log", "a") as log:
        log.write(f"{name} start {time.time()}\\n")
    time.sleep(0.3)
    with open("log", "a") as log:
        log.write(f"{name} end {time.time()}\\n")
'''


@pytest.mark.slow
def test_an_alone_test_overlaps_no_other_workers_test(tmp_path):
    shutil.copy(ROOT / "conftest.py", tmp_path)
    (tmp_path / "test_one.py").write_text(TIMED + '''
@pytest.mark.alone
def test_alone():
    time.sleep(0.5)  # the other worker is under way
    timed("alone")
''')
    (tmp_path / "test_other.py").write_text(TIMED + '''
@pytest.mark.parametrize("i", range(8))
def test_other(i):
    timed(f"other{i}")
''')
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}  # not this run's
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2",
                           "--dist", "loadfile", "-o", "markers=alone"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    spans = {}
    for line in (tmp_path / "log").read_text().splitlines():
        name, edge, when = line.split()
        spans.setdefault(name, {})[edge] = float(when)
    assert len(spans) == 9
    alone = spans.pop("alone")
    assert all(s["end"] <= alone["start"] or s["start"] >= alone["end"] for s in spans.values()), spans
    assert any(s["end"] <= alone["start"] for s in spans.values())  # they did run side by side
    assert not list(Path(os.environ.get("TMPDIR", "/tmp")).glob("nbtune-tests-*.lock.waiting"))
