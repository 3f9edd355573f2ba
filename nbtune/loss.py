"""Token cross-entropy: summed over trained positions, normalised by the caller.

Summing (rather than averaging per micro-batch) lets gradient accumulation divide by the
number of trained tokens across all micro-batches, so k micro-batches equal one batch
k times larger.

Chunked: the vocabulary projection and the loss run one slice of the sequence at a time,
each under activation checkpointing, so only one chunk's logits ever exist: forward keeps
just the hidden states, backward recomputes each chunk's logits when it needs them.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from .data import IGNORE


def _chunk_loss(lm_head: nn.Module, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = lm_head(hidden).float()  # [B, t, V], upcast for a stable softmax
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE,
                           reduction="sum")


@functools.cache
def _compiled_chunk_loss():
    """torch.compile'd ``_chunk_loss``, made once on first use (compiling is slow)."""
    return torch.compile(_chunk_loss)


def cross_entropy_sum(lm_head: nn.Module, hidden: torch.Tensor, labels: torch.Tensor,
                      chunks: int = 0, compiled: bool = False) -> torch.Tensor:
    """Sum of token losses; ``hidden`` [B, T, D] is projected by ``lm_head`` in ``chunks`` parts."""
    loss = _compiled_chunk_loss() if compiled else _chunk_loss
    if chunks <= 1:
        return loss(lm_head, hidden, labels)
    total = hidden.new_zeros((), dtype=torch.float32)
    for h, y in zip(hidden.chunk(chunks, dim=1), labels.chunk(chunks, dim=1)):
        total = total + checkpoint(loss, lm_head, h, y, use_reentrant=False)
    return total
