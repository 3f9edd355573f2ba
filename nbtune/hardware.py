"""Facts about the processor that change what a toggle costs, probed once per process.

On CPUs without native bf16 (AVX2-only ones), torch runs bf16 matmuls in a slow fallback:
about 250x slower than fp32 on one AMD EPYC measured here, while a Xeon with AMX runs them
faster than fp32. A notebook user who picks bf16 on the first kind sees steps that seem never
to finish, so the session says so at the first bf16 step (``Session``) and the peer benchmark
skips bf16 rungs there.
"""

from __future__ import annotations

import functools
import os
import time

import torch

SLOW_BF16 = 4.0  # a bf16 matmul this many times slower than fp32: no native bf16


@functools.cache
def bf16_slowdown() -> float:
    """How many times longer a 256 x 256 bf16 matmul takes than fp32 on this CPU (the best of
    five tries each, ~0.1 s, or ~0.5 s where bf16 is slow)."""
    a = torch.randn(256, 256)

    def best(x: torch.Tensor) -> float:
        x @ x  # warm-up: first-call dispatch and any packing
        times = []
        for _ in range(5):
            started = time.perf_counter()
            x @ x
            times.append(time.perf_counter() - started)
        return min(times)

    return best(a.bfloat16()) / max(best(a), 1e-9)


BUSY_CORES = 0.25  # other processes using this much of a core on average: a timing is suspect
BUSY_SECONDS = 5.0  # a run's share of the machine is said once it has run this long (less is noise)


def busy_words(others: float | None) -> str:
    """What a reader of a speed should know when other processes kept the cores busy ("" when
    they did not, or the machine does not say): a quarter of a core on a small machine, a
    tenth of its cores on a big one. Said of a run in one process on a CPU only (a GPU's step
    barely waits on the cores; a job's other ranks are its own work, not contention)."""
    if others is None or others < max(BUSY_CORES, 0.1 * (os.cpu_count() or 1)):
        return ""
    return (f"machine busy: other processes used {others:.1f} of {os.cpu_count()} cores, "
            "so this runs slower than it would alone")


def _busy_jiffies() -> int | None:
    """CPU time spent on anything but idle and I/O wait, over all cores (Linux ``/proc/stat``,
    in clock ticks), or None without it."""
    try:
        with open("/proc/stat", "rb") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != b"cpu":
        return None
    # user nice system idle iowait irq softirq steal (guest time is inside user already)
    values = [int(v) for v in fields[1:9]]
    return sum(values) - values[3] - values[4]


class Contention:
    """How many cores other processes kept busy while the ``with`` block ran, on average
    (``others``: None where the machine does not say); ``so_far()`` while it runs. A speed
    measured while they did is the machine's, not the technique's."""

    def __init__(self) -> None:
        self.others: float | None = None
        self._started, self._busy, self._ours = time.monotonic(), _busy_jiffies(), os.times()

    def __enter__(self) -> "Contention":
        self._started, self._busy, self._ours = time.monotonic(), _busy_jiffies(), os.times()
        return self

    def so_far(self) -> float | None:
        """Cores other processes kept busy on average since the start (None: not known)."""
        busy, ours, wall = _busy_jiffies(), os.times(), time.monotonic() - self._started
        if busy is None or self._busy is None or wall <= 0:
            return None
        total = (busy - self._busy) / os.sysconf("SC_CLK_TCK")
        own = (ours.user - self._ours.user) + (ours.system - self._ours.system)
        return max(0.0, total - own) / wall

    def __exit__(self, *exc) -> None:
        self.others = self.so_far()
