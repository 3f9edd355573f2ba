"""A cheap figure for every step, beside the breakdown by category that the tracker makes on
some of them: on CUDA the caching allocator's own counters (peak allocated and reserved,
reset at the step's start), on Linux the process's peak resident memory (``VmHWM``, reset at
the step's start by writing 5 to ``/proc/self/clear_refs``, less the runtime: the process's
resident memory before its first session loaded). Either costs microseconds, so every step
has one and the chart draws a line, not the dots of the sampled breakdown.

Resetting ``VmHWM`` also resets what ``resource.getrusage().ru_maxrss`` reports for the
process: the session meters its steps, a bare ``Trainer`` does not unless asked.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import torch

# What each source measures, as the chart's legend says it.
SOURCES = {"allocator": "allocator peak (every step)",
           "resident": "process peak resident memory (every step)"}
_CLEAR_REFS = Path("/proc/self/clear_refs")
_STATUS = Path("/proc/self/status")


@dataclass(frozen=True)
class Usage:
    """One step's cheap figure, metered on every step.

    Attributes:
        peak: Bytes: the allocator's peak on CUDA, the process's peak resident memory on a CPU.
        reserved: The allocator's reserved bytes (CUDA only).
        source: What was metered (a key of ``SOURCES``).
        runtime: On a CPU, the process's resident memory before its first session loaded
            (the interpreter, torch, the kernel): what the chart leaves out of ``peak``.
    """

    peak: int
    reserved: int = 0
    source: str = "allocator"
    runtime: int = 0

    @property
    def drawn(self) -> int:
        """What the chart draws: ``peak`` less the runtime (on a CPU, so that the line is on
        the scale of the step's tensors beside it, not the whole process's)."""
        return max(0, self.peak - self.runtime)

    def as_dict(self) -> dict:
        """The fields by name.

        Returns:
            The dict.
        """
        return asdict(self)


def _resident(field: bytes = b"VmHWM:") -> int | None:
    """The process's peak (``VmHWM``) or current (``VmRSS``) resident memory, in bytes."""
    try:
        for line in _STATUS.read_bytes().splitlines():
            if line.startswith(field):
                return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    return None


_RUNTIME: list[int] = []  # the process's resident memory before its first session loaded


def note_runtime() -> None:
    """Remember, once a process, its resident memory before a session loads anything: the
    runtime that every CPU step's figure includes and the chart leaves out."""
    if not _RUNTIME:
        _RUNTIME.append(_resident(b"VmRSS:") or 0)


class UsageMeter:
    """Meters one step (a context manager); ``result`` is its ``Usage``, or None where this
    machine offers nothing cheap (a CPU without ``/proc``, or where it is not writable)."""

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self.result: Usage | None = None
        self._armed = False

    def __enter__(self) -> "UsageMeter":
        self.result, self._armed = None, False
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self._armed = True
        elif self.device.type == "cpu":
            try:
                _CLEAR_REFS.write_text("5")  # VmHWM := the resident memory now
                self._armed = True
            except OSError:
                pass
        return self

    def settle(self, tracked) -> Usage | None:
        """The step's figure, given the tracker's breakdown where it tracked the step: on
        CUDA the tracker reads and resets the same allocator counters at every phase
        boundary, so the meter's own reading holds only the last phase; the tracker's peak
        and reserved are the whole step's."""
        if tracked is not None and self.device.type == "cuda" and self._armed:
            return Usage(tracked.peak, tracked.reserved, "allocator")
        return self.result

    def __exit__(self, *exc) -> None:
        if not self._armed or exc[0] is not None:
            return
        if self.device.type == "cuda":
            self.result = Usage(torch.cuda.max_memory_allocated(self.device),
                                torch.cuda.max_memory_reserved(self.device), "allocator")
            return
        peak = _resident()
        if peak is not None:
            self.result = Usage(peak, 0, "resident", _RUNTIME[0] if _RUNTIME else 0)
