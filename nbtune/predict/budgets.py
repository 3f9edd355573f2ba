"""Budgets: sizes and card names parsed, and the share of a card or host a step may hold."""

from __future__ import annotations

import math
import numbers
import os
import re

import torch

from ..host import margin as host_margin
from ..memory.breakdown import MemoryBreakdown
from .tables import (ALLOCATOR_MARGIN, CARDS, CUBLAS_THREADS, CUBLAS_WORKSPACE, CUDA_CONTEXT, GiB,
                     HOST_RAM)

_UNITS = {"": 1, "b": 1,
          "k": 2**10, "kib": 2**10, "kb": 10**3,
          "m": 2**20, "mib": 2**20, "mb": 10**6,
          "g": 2**30, "gib": 2**30, "gb": 10**9,
          "t": 2**40, "tib": 2**40, "tb": 10**12}
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*", re.IGNORECASE)


def _card_key(name: str) -> str:
    return re.sub(r"[\s_\-]", "", name).lower()


_CARD_KEYS = {_card_key(name): name for name in CARDS}


def parse_budget(value) -> int:
    """Bytes from a size or a card's name.

    GiB/MiB/KiB (and bare G/M/K) are powers of 2, GB/MB/KB powers of 10: "24 GB" is 24e9 bytes,
    about 22.4 GiB. A card's name gives its whole memory; ``fit`` keeps back the CUDA context
    and an allocator margin from it (``usable``).

    Args:
        value: An int (bytes), a size ("24GiB", "24 GB", "512MiB", "1.5 GiB") or a card name
            from ``CARDS`` (any case, spaces optional: "rtx 4090", "A100-80GB").

    Returns:
        The bytes.

    Raises:
        ValueError: Neither a size nor a known card, with the names it knows.
    """
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        if value > 0:
            return int(value)
    elif isinstance(value, float) and math.isfinite(value) and value >= 1:
        return int(value)
    elif isinstance(value, str):
        card = _CARD_KEYS.get(_card_key(value))
        if card is not None:
            return CARDS[card]
        match = _SIZE.fullmatch(value)
        if match and match.group(2).lower() in _UNITS:
            size = int(float(match.group(1)) * _UNITS[match.group(2).lower()])
            if size > 0:
                return size
    raise ValueError(
        f"budget={value!r} is not a memory size. Give bytes as an int (e.g. {24 * GiB}), a "
        "size with a unit ('24GiB', '16 GiB', '512MiB', '24 GB'; GiB/MiB/KiB and bare G/M/K "
        "are powers of 2, GB/MB/KB powers of 10) or a card: " + ", ".join(CARDS) + ".")


_MACHINE = re.compile(r"(.+?)\s*\+\s*(.+?)\s*(?:of\s+)?(?:ram|host)?\s*", re.IGNORECASE)


def parse_machine(value) -> tuple[int, int | None]:
    """A card's memory and its host's.

    Args:
        value: What ``parse_budget`` takes (a card name brings its usual host memory,
            ``HOST_RAM``; a size alone leaves the host unknown), "<card or size> + <size> RAM"
            ("RTX 3090 + 64 GB RAM", "24GiB + 32GiB") or a (device, host) pair.

    Returns:
        (device bytes, host bytes or None).
    """
    if isinstance(value, tuple) and len(value) == 2:
        device, machine_host = value
        return parse_budget(device), None if machine_host is None else parse_budget(machine_host)
    if isinstance(value, str):
        both = _MACHINE.fullmatch(value)
        if both:
            return parse_budget(both.group(1)), parse_budget(both.group(2))
        card = _CARD_KEYS.get(_card_key(value))
        if card is not None:
            return CARDS[card], HOST_RAM[card]
    return parse_budget(value), None


_CARDS_PREFIX = re.compile(r"\s*([0-9]+)\s*[x\u00d7]\s*(.+)", re.IGNORECASE)


def parse_cards(value) -> tuple[int, object]:
    """(how many cards, the rest) from "2x RTX 3090 + 64 GB RAM" (also "2 x", "2\u00d7"); one
    card, and ``value`` as it is, otherwise. The rest is what ``parse_machine`` takes: one
    card's memory, and the host's, which every card's process shares."""
    if isinstance(value, str):
        match = _CARDS_PREFIX.fullmatch(value)
        if match:
            count = int(match.group(1))
            if count < 1:
                raise ValueError(f"{value!r}: give at least one card (\"2x RTX 3090\").")
            return count, match.group(2)
    return 1, value


def host_usable(budget: int) -> int:
    """Bytes of a host of ``budget`` that a run may hold: less the margin ``nbtune.host``
    keeps free (the notebook server, the page cache weights stream through)."""
    return max(0, budget - host_margin(budget))


def usable(budget: int, device: str = "cuda", reserve: int | None = None,
           margin: float | None = None) -> int:
    """Bytes of ``budget`` that a step's tensors may hold on ``device``.

    CUDA: less ``reserve`` (default ``CUDA_CONTEXT``) and then ``margin`` of the rest
    (default ``ALLOCATOR_MARGIN``). Pass ``reserve=0`` for a budget measured with the
    context already made (free memory plus what this process's allocator holds). CPU: all.
    """
    cuda = str(device).startswith("cuda")
    reserve = (CUDA_CONTEXT if cuda else 0) if reserve is None else reserve
    margin = (ALLOCATOR_MARGIN if cuda else 0.0) if margin is None else margin
    return max(0, int((budget - reserve) * (1.0 - margin)))


def required(memory: MemoryBreakdown) -> int:
    """Device bytes a step needs: its highest moment (training step, or held-out evaluation
    where the breakdown has one) plus memory outside the allocator (paged optimizer state:
    it sits on the card until memory runs short)."""
    highest = getattr(memory, "highest", memory.peak)
    return highest + memory.outside


_WORKSPACE_PAIR = re.compile(r":([0-9]+):([0-9]+)")


def cublas_workspaces(capability: tuple[int, int] | None = None) -> int:
    """Bytes of cuBLAS workspace a training step finds in torch's allocator (``tables``:
    ``CUBLAS_THREADS`` threads). ``capability``: the card's compute capability; None asks the
    attached GPU, and without one takes the larger size."""
    if capability is None and torch.cuda.is_available():
        capability = torch.cuda.get_device_capability()
    default = CUBLAS_WORKSPACE["before 9.0" if capability and capability[0] < 9 else "9.0 and later"]
    pairs = _WORKSPACE_PAIR.findall(os.environ.get("CUBLAS_WORKSPACE_CONFIG", ""))
    size = sum(int(kib) * 1024 * int(count) for kib, count in pairs) if pairs else default
    return CUBLAS_THREADS * size
