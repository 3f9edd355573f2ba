"""Token cross-entropy: summed over trained positions, normalised by the caller.

Summing (rather than averaging per micro-batch) lets gradient accumulation divide by the
number of trained tokens across all micro-batches, so k micro-batches equal one batch
k times larger.

Chunked: the vocabulary projection and the loss run one slice of the sequence at a time, so
no whole-batch logits (or their float32 upcast) are ever made. Each piece keeps its float32
log-probabilities for backward, as torchtune's chunked loss does, or (``recompute``) runs under
activation checkpointing: forward keeps just the hidden states, backward recomputes each
piece's logits when it needs them. The trainer recomputes only where keeping them would raise
the step's predicted peak (``Predictor.keeps_loss_pieces``) or the estimate fails; sequence
tiling and several processes always do.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from .data import IGNORE


def _chunk_loss(lm_head: nn.Module, hidden: torch.Tensor, labels: torch.Tensor,
                norm: nn.Module | None = None) -> torch.Tensor:
    if norm is not None:
        hidden = norm(hidden)
    return _piece_loss(lm_head(hidden), labels)


def _piece_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = logits.float()  # [B, t, V], upcast for a stable softmax
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE,
                           reduction="sum")


@functools.cache
def _compiled_chunk_loss():
    """torch.compile'd ``_chunk_loss``, made once on first use (compiling is slow)."""
    return torch.compile(_chunk_loss)


@functools.cache
def _compiled_piece_loss():
    """torch.compile'd ``_piece_loss`` (kept pieces: their heads run first, uncompiled)."""
    return torch.compile(_piece_loss)


def loss_pieces(tokens: int, chunks: int = 0, tile_tokens: int = 0) -> int:
    """How many pieces a sequence of ``tokens`` is taken in: ``chunks`` of it, or pieces of
    at most ``tile_tokens`` (sequence tiling), whichever makes more."""
    tiles = -(-tokens // tile_tokens) if tile_tokens else 0
    return max(chunks, tiles, 1)


def cross_entropy_sum(lm_head: nn.Module, hidden: torch.Tensor, labels: torch.Tensor,
                      chunks: int = 0, compiled: bool = False, *, norm: nn.Module | None = None,
                      tile_tokens: int = 0, recompute: bool = True) -> torch.Tensor:
    """Sum of token losses; ``hidden`` [B, T, D] is projected by ``lm_head`` in
    ``loss_pieces`` parts, each recomputed in backward (``recompute``) or keeping its
    log-probabilities. ``norm`` (the final norm, when ``hidden`` is taken before it) runs
    inside each part: in pieces, it keeps only its slice of ``hidden`` for backward too,
    rather than a float32 copy of the whole sequence."""
    loss = _compiled_chunk_loss() if compiled else _chunk_loss
    pieces = loss_pieces(hidden.shape[1], chunks, tile_tokens)
    if pieces <= 1:
        return loss(lm_head, hidden, labels, norm)
    total = hidden.new_zeros((), dtype=torch.float32)
    if recompute:
        for h, y in zip(hidden.chunk(pieces, dim=1), labels.chunk(pieces, dim=1)):
            total = total + checkpoint(loss, lm_head, h, y, norm, use_reentrant=False)
        return total
    # Kept: every piece's logits first, then each piece's loss, as torchtune orders them. The
    # backward (latest first) then frees every piece's float32 log-probabilities before the
    # head's gradient is summed over the pieces, rather than beside it (benchmarks/peers.py's
    # bf16 chunked-loss rung at 125M: 1,020.1 MB piece by piece, 1,000.5 MB so).
    piece_loss = _compiled_piece_loss() if compiled else _piece_loss
    logits = [lm_head(norm(h) if norm is not None else h) for h in hidden.chunk(pieces, dim=1)]
    for y in labels.chunk(pieces, dim=1):
        total = total + piece_loss(logits.pop(0), y)
    return total
