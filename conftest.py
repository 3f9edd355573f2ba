"""Turns between pytest-xdist's workers (``python -m pytest`` runs two, one per core).

Every test and notebook cell holds a shared lock while it runs; a test marked ``alone``
(it counts what other processes keep busy, so a second worker would be its subject) waits
for the exclusive one, and no other test starts while it runs.
"""

import fcntl
import os
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import pytest


def _lock_path() -> Path | None:
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")  # one process: every test is alone already
    return Path(tempfile.gettempdir()) / f"nbtune-tests-{run}.lock" if run else None


def pytest_unconfigure(config):
    """A worker done: the other, if still running, is alone anyway."""
    if (lock_path := _lock_path()) is not None:
        lock_path.unlink(missing_ok=True)


@contextmanager
def _turn(alone: bool):
    lock_path = _lock_path()
    if lock_path is None:
        yield
        return
    waiting = lock_path.with_suffix(".waiting")  # an alone test waits: start nothing new
    with open(lock_path, "a") as lock:
        if alone:
            waiting.touch()
            fcntl.flock(lock, fcntl.LOCK_EX)
        else:
            while waiting.exists():
                time.sleep(0.05)
            fcntl.flock(lock, fcntl.LOCK_SH)
        try:
            if alone:
                waiting.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    with _turn(item.get_closest_marker("alone") is not None):
        yield
