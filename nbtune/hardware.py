"""Facts about the processor that change what a toggle costs, probed once per process.

On CPUs without native bf16 (AVX2-only ones), torch runs bf16 matmuls in a slow fallback:
about 250x slower than fp32 on one AMD EPYC measured here, while a Xeon with AMX runs them
faster than fp32. A notebook user who picks bf16 on the first kind sees steps that seem never
to finish, so the session says so at the first bf16 step (``Session``) and the peer benchmark
skips bf16 rungs there.
"""

from __future__ import annotations

import functools
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
