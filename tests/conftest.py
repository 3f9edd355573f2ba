"""Shared fixtures: offline Hub, a private cache for the embedded default, tiny data."""

import gc
import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

if os.environ.get("PYTEST_XDIST_WORKER"):  # one worker per core (see ../conftest.py)
    torch.set_num_threads(1)


@pytest.fixture(scope="session", autouse=True)
def _demo_cache(tmp_path_factory):
    """Build the embedded default once per test run, in a temporary cache."""
    os.environ["NBTUNE_CACHE"] = str(tmp_path_factory.mktemp("nbtune-cache"))
    yield


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module of many tiny steps: on 2 cores shared with other
    work, torch's two OpenMP threads spin against each other and a 0.2 s step takes seconds."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def pytest_collection_finish(session):
    """Everything imported by now (torch, transformers, the test modules) is left out of the
    garbage collector's scans: nbtune collects after each fault (0.3 s a scan with all of
    that alive), which took half of the fault tests' time."""
    gc.freeze()
