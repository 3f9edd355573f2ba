"""CUDA allocator history over a few steps, as a file pytorch.org/memory_viz opens."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

import torch

MAX_ENTRIES = 100_000  # allocator events kept: plenty for a few steps of an 8B model


def record_snapshot(run_steps: Callable[[], object], path: str | os.PathLike,
                    device: torch.device) -> Path:
    """Record every allocation and free (with Python stacks) while ``run_steps()`` runs,
    then write the pickled snapshot to ``path``."""
    if device.type != "cuda":
        raise RuntimeError(
            f"snapshot() records the CUDA caching allocator's history, and this session runs on "
            f"{device.type}. There is no allocator history to record here: on CPU the per-step "
            "breakdown (report.memory, session.chart()) shows where memory went. Run the session "
            "on a CUDA GPU to record a snapshot for https://pytorch.org/memory_viz.")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.cuda.memory._record_memory_history(max_entries=MAX_ENTRIES)
    try:
        run_steps()
        torch.cuda.memory._dump_snapshot(str(path))
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    return path
