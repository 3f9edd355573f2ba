"""Turns between pytest-xdist's workers (``python -m pytest`` runs two, one per core).

Every test and notebook cell a worker runs holds a shared lock; a test marked ``alone`` (it
counts what other processes keep busy, so a second worker would be its subject) takes the
exclusive one, and no other test starts while it waits or runs. Processes the other worker
keeps between its tests (an idle notebook kernel) still exist meanwhile. The locks are
``flock``s on two files in a folder the controller makes for the run: the kernel drops them
with a process that ends or dies, so nothing is left to clear. A pytest started by a test (not an
xdist worker of this run) takes no turns.
"""

import collections
import fcntl
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

import pytest

TURNS = "NBTUNE_TEST_TURNS"  # the run's folder, set by the controller for its workers

if os.environ.get("PYTEST_XDIST_WORKER"):  # one worker per core: one thread each, and in the
    os.environ["OMP_NUM_THREADS"] = "1"  # processes its tests start (kernels, CLI runs) unless
    # they choose their own, else the workers' OpenMP threads spin against each other


MADE = pytest.StashKey[str]()

# Files whose few tests run longest: the browser's 5 take 5 minutes of a worker. xdist hands
# out the files with the most tests first, which sent this one last and left the other worker
# idle for most of it (a CI run at c7e8e8d: its 25 min 52 s against 24 min 9 s of tests per
# worker); handed out first, the other files fill in beside it.
FIRST = ("tests/ui/test_browser.py",)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """xdist's order of files (the most tests first; ``--no-loadscope-reorder`` in addopts
    leaves it to this hook), with ``FIRST`` before the rest. Each file's tests keep theirs."""
    files = [item.nodeid.split("::")[0] for item in items]
    count = collections.Counter(files)
    order = {f: (f not in FIRST, -count[f], place) for place, f in enumerate(dict.fromkeys(files))}
    items.sort(key=lambda item: order[item.nodeid.split("::")[0]])


def pytest_configure(config):
    if not hasattr(config, "workerinput") and getattr(config.option, "numprocesses", None):
        config.stash[MADE] = os.environ[TURNS] = tempfile.mkdtemp(prefix="nbtune-test-turns-")


def pytest_unconfigure(config):
    if MADE in config.stash:  # (only the folder this controller made)
        shutil.rmtree(config.stash[MADE], ignore_errors=True)


_TO_THE_END = []


def pytest_sessionfinish(session):
    """A worker done with its tests still works as it exits (pytest collects its garbage,
    seconds of a core with torch loaded): it keeps a shared lock that its exit drops."""
    folder = os.environ.get(TURNS)
    if hasattr(session.config, "workerinput") and folder:
        held = open(Path(folder) / "tests", "a")
        fcntl.flock(held, fcntl.LOCK_SH)
        _TO_THE_END.append(held)


@contextmanager
def _turn(item):
    folder = os.environ.get(TURNS)
    if not hasattr(item.config, "workerinput") or not folder:
        yield  # one process: every test is alone already
        return
    alone = item.get_closest_marker("alone") is not None
    # the gate: an alone test holds it from its wait to its end, so no test starts meanwhile
    with open(Path(folder) / "gate", "a") as gate, open(Path(folder) / "tests", "a") as tests:
        fcntl.flock(gate, fcntl.LOCK_EX)
        try:
            fcntl.flock(tests, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
            if not alone:
                fcntl.flock(gate, fcntl.LOCK_UN)
            yield
        finally:
            fcntl.flock(tests, fcntl.LOCK_UN)
            fcntl.flock(gate, fcntl.LOCK_UN)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    with _turn(item):
        yield
