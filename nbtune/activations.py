"""Activation checkpointing: recompute chosen layers in backward instead of saving them."""

from __future__ import annotations

from torch import nn


def set_activation_checkpointing(model: nn.Module, every: int) -> int:
    """Checkpoint every ``every``-th decoder layer (0: none); returns how many are checkpointed.

    Non-reentrant ``torch.utils.checkpoint`` keeps only each checkpointed layer's input
    and recomputes the rest during backward.
    """
    layers = model.model.layers
    for i, layer in enumerate(layers):
        layer.checkpointed = every > 0 and i % every == 0
    return sum(layer.checkpointed for layer in layers)
