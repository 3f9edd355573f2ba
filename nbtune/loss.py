"""Token cross-entropy: summed over trained positions, normalised by the caller.

Summing (rather than averaging per micro-batch) lets gradient accumulation divide by the
number of trained tokens across all micro-batches, so k micro-batches equal one batch
k times larger.

Chunked: the vocabulary projection and the loss run one slice of the sequence at a time, so
no whole-batch logits (or their float32 upcast) are ever made. Each piece makes its gradients
in forward, right after its loss, and frees its logits before the next piece (as Liger's fused
linear cross-entropy does): neither torchtune's kept float32 log-probabilities nor a second run
of the head in backward. Or (``recompute``) each piece runs under activation checkpointing:
forward keeps just the hidden states, backward recomputes the piece's logits. The trainer
recomputes only where the gradients in forward would raise the step's predicted peak
(``Predictor.keeps_loss_pieces``) or the estimate fails; sequence tiling and several processes
always do.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable
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


def loss_pieces(tokens: int, chunks: int = 0, tile_tokens: int = 0) -> int:
    """How many pieces a sequence of ``tokens`` is taken in: ``chunks`` of it, or pieces of
    at most ``tile_tokens`` (sequence tiling), whichever makes more."""
    tiles = -(-tokens // tile_tokens) if tile_tokens else 0
    return max(chunks, tiles, 1)


def cross_entropy_sum(lm_head: nn.Module, hidden: torch.Tensor, labels: torch.Tensor,
                      chunks: int = 0, compiled: bool = False, *, norm: nn.Module | None = None,
                      tile_tokens: int = 0, recompute: bool = True, divisor: int = 1) -> torch.Tensor:
    """Sum of token losses over ``divisor``; ``hidden`` [B, T, D] is projected by ``lm_head``
    in ``loss_pieces`` parts, each recomputed in backward (``recompute``) or with its gradients
    made in forward (``_GradientInForward``). ``norm`` (the final norm, when ``hidden`` is
    taken before it) runs inside each part: in pieces, it keeps only its slice of ``hidden``
    for backward too, rather than a float32 copy of the whole sequence."""
    loss = _compiled_chunk_loss() if compiled else _chunk_loss
    pieces = loss_pieces(hidden.shape[1], chunks, tile_tokens)
    if pieces > 1 and not recompute and torch.is_grad_enabled():
        parts = hidden.chunk(pieces, dim=1)  # each its own input: backward joins their gradients
        return _GradientInForward.apply(labels, functools.partial(loss, lm_head, norm=norm),
                                        divisor, len(parts), *parts, *_trainable(lm_head, norm))
    if pieces <= 1:
        total = loss(lm_head, hidden, labels, norm)
    else:
        total = hidden.new_zeros((), dtype=torch.float32)
        for h, y in zip(hidden.chunk(pieces, dim=1), labels.chunk(pieces, dim=1)):
            total = total + checkpoint(loss, lm_head, h, y, norm, use_reentrant=False)
    return total / divisor if divisor != 1 else total


def _trainable(*modules: nn.Module | None) -> list[nn.Parameter]:
    seen: dict[int, nn.Parameter] = {}
    for module in modules:
        for p in module.parameters() if module is not None else ():
            if p.requires_grad:
                seen.setdefault(id(p), p)
    return list(seen.values())


class _GradientInForward(torch.autograd.Function):
    """The pieces' loss with its gradients made in forward, piece by piece (as Liger's fused
    linear cross-entropy does on CUDA): each piece's logits and float32 log-probabilities are
    freed before the next piece's are made, and backward has only to scale and hand on what is
    kept, the hidden states' gradient and the head's (and final norm's) weight gradients. So no
    log-probabilities are held for backward and no head is recomputed in it. The gradients are
    those of ``sum / divisor``: the caller's division, made before the casts as autograd would,
    so the result is bit for bit the recomputed pieces' (the last pieces' gradients are summed
    first, in backward's order). Hooks on the head's and norm's weights (the memory tracker
    files what they see as gradients) see each piece's gradient in forward, then the sum in
    backward."""

    @staticmethod
    def forward(ctx, labels, run, divisor, pieces, *inputs):
        parts, params = inputs[:pieces], inputs[pieces:]
        scale = torch.ones((), dtype=torch.float32, device=labels.device) / divisor
        wanted = parts[0].requires_grad
        grads: list[torch.Tensor | None] = [None] * (pieces + len(params))
        losses = [None] * pieces
        for k, y in reversed(list(enumerate(labels.chunk(pieces, dim=1)))):
            h = parts[k].detach().requires_grad_(wanted)
            with torch.enable_grad():
                loss = run(h, y)
                leaves = ([h] if wanted else []) + list(params)
                got = list(torch.autograd.grad(loss, leaves, scale, allow_unused=True)) if leaves else []
            losses[k] = loss.detach()
            if wanted:
                grads[k] = got.pop(0)
            for i in range(len(got)):  # summed as backward sums them (no name left holding one)
                if got[i] is not None:
                    at = pieces + i
                    grads[at] = got[i] if grads[at] is None else grads[at].add_(got[i])
            del loss, got, h
        total = losses[0].new_zeros(())
        for loss in losses:
            total = total + loss
        ctx.kept = grads
        return total / divisor

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        if ctx.kept is None:
            raise RuntimeError("A chunked loss whose gradients were made in forward hands them on "
                               "once: its backward cannot run twice (retain_graph=True).")
        grads, ctx.kept = ctx.kept, None  # handed on, scaled in place (exact where grad is 1)
        return (None, None, None, None, *[g.mul_(grad) if g is not None else None for g in grads])
