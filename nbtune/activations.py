"""Activations: checkpointing (recompute in backward) and offloading (park them in CPU memory)."""

from __future__ import annotations

import torch
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


def set_tiling(model: nn.Module, tokens: int) -> None:
    """Run each decoder layer's norm + MLP ``tokens`` tokens at a time (0: whole sequence),
    each tile recomputed in backward (``decoder.tiled``)."""
    for layer in model.model.layers:
        layer.tile_tokens = tokens


def set_compiled(model: nn.Module, on: bool) -> None:
    """torch.compile each decoder layer in place (names and weights unchanged), or undo it."""
    for layer in model.model.layers:
        if on:
            layer.compile()
        else:
            layer._compiled_call_impl = None  # what nn.Module.compile sets


class OffloadActivations(torch.autograd.graph.saved_tensors_hooks):
    """Within this context, tensors saved for backward are copied to CPU memory and the
    originals released; backward brings each back when it needs it.

    Parameters are never copied (they stay put anyway), nor tensors below ``min_bytes``.
    On CUDA the copies go to pinned memory on a side stream, overlapping with compute; on
    CPU there is nothing to gain, but the same copy path runs (and is what the CPU tests
    prove equal). ``to="meta"`` (the estimator, on fake tensors) keeps only the shape:
    the tensor leaves the device and comes back empty.
    """

    def __init__(self, model: nn.Module, min_bytes: int = 1024, to: str | None = None) -> None:
        keep = {p.untyped_storage()._cdata for p in model.parameters()}
        device = next(model.parameters()).device
        stream = torch.cuda.Stream(device) if device.type == "cuda" else None

        def pack(t: torch.Tensor):
            if (t.untyped_storage()._cdata in keep
                    or t.numel() * t.element_size() < min_bytes):
                return t
            if to == "meta":
                return (t.device, t.detach().to("meta"), None)
            if stream is None:
                return (t.device, t.detach().clone(), None)
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                host.copy_(t, non_blocking=True)
                done = torch.cuda.Event()
                done.record(stream)
            t.record_stream(stream)  # the allocator must not reuse t before the copy ends
            return (t.device, host, done)

        def unpack(packed):
            if isinstance(packed, torch.Tensor):
                return packed
            device, host, done = packed
            if host.device.type == "meta":
                return torch.empty_like(host, device=device)
            if done is None:
                return host
            torch.cuda.current_stream(device).wait_event(done)
            return host.to(device, non_blocking=True)

        super().__init__(pack, unpack)
