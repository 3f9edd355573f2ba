"""Token cross-entropy: summed over trained positions, normalised by the caller.

Summing (rather than averaging per micro-batch) lets gradient accumulation divide by the
number of trained tokens across all micro-batches, so k micro-batches equal one batch
k times larger.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .data import IGNORE


def cross_entropy_sum(lm_head: nn.Module, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of token losses; ``hidden`` [B, T, D] is projected by ``lm_head`` and upcast to fp32."""
    logits = lm_head(hidden).float()  # [B, T, V]
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE,
                           reduction="sum")
