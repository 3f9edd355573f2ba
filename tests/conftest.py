"""Shared fixtures: offline Hub, a private cache for the embedded default, tiny data."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def _demo_cache(tmp_path_factory):
    """Build the embedded default once per test run, in a temporary cache."""
    os.environ["NBTUNE_CACHE"] = str(tmp_path_factory.mktemp("nbtune-cache"))
    yield


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield
