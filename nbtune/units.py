"""Sizes in words: the one ``format_bytes`` every message, table and chart label uses."""

from __future__ import annotations


def format_bytes(nbytes: float) -> str:
    """Binary units, one decimal: ``format_bytes(3 << 30) == "3.0 GiB"``; negative sizes
    (a change, a shortfall) keep their unit."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(nbytes) >= size:
            return f"{nbytes / size:.1f} {unit}"
    return f"{int(nbytes)} B"
