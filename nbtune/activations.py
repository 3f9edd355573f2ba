"""Activations: checkpointing (recompute in backward) and offloading (park them in CPU memory)."""

from __future__ import annotations

import weakref

import torch
from torch import nn
# torch internal: tensor subclasses (NF4 weights) are told apart: never parked.
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from .memory.accounting import gather_buffers


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
            # torch internal: what nn.Module.compile sets. If it is renamed, turning compile
            # off leaves the layers compiled (tests/properties/test_every_field.py checks compile's effect).
            layer._compiled_call_impl = None


class _Parked:
    """One saved tensor parked in host memory: where it came from, its host copy, the event
    its copy ends at (CUDA), and its copy back to the device once prefetched."""

    __slots__ = ("device", "host", "done", "index", "window", "fetched", "__weakref__")

    def __init__(self, device, host, done, index: int, window: range) -> None:
        self.device, self.host, self.done, self.index = device, host, done, index
        self.window = window  # what its unpack starts bringing back (``prefetch_window``)
        self.fetched = None  # (device tensor, event) once a prefetch has started


def prefetch_window(runs: list[tuple[int | None, int]]) -> range:
    """``runs``: (decoder layer, first index) of each run of tensors parked so far, in pack
    order (layer None: parked outside the layers). When backward unpacks the first tensor of
    the last run (the last of its layer's tensors that backward needs), it starts bringing
    back the run before: the previous layer's, which backward needs next. So one layer's
    worth is in flight however deep the model (and the estimate of a deep model stays what
    its shallow runs extrapolate)."""
    if len(runs) < 2:
        return range(0)
    return range(runs[-2][1], runs[-1][1])


MIN_BYTES = 1024  # smaller saved tensors stay on the device (a copy costs more than it frees)


class OffloadActivations(torch.autograd.graph.saved_tensors_hooks):
    """Within this context, tensors saved for backward are copied to CPU memory and the
    originals released; backward brings each back when it needs it.

    Weights are never copied (they stay put anyway, or FSDP2 frees and gathers them again):
    not the parameters, not views of them, not the weights FSDP2 gathers (their storages are
    its gather buffers: ``memory.accounting.gather_buffers``), not a tensor subclass such as
    an NF4 weight; nor tensors below ``min_bytes``. Parked under FSDP2, a rank's gathered
    layers would each cross to the host and back every step (8B in bf16: 15 GiB a rank).
    With checkpointing on, what is saved is each checkpointed layer's input (torch's
    non-reentrant checkpoint saves its inputs through these hooks), so only those leave
    the card. On CUDA the copies go to pinned memory on a side stream, overlapping with
    compute, and backward prefetches: unpacking the first tensor a layer parked starts
    copying back the previous layer's (``prefetch_window``; each parked tensor knows its
    layer from forward hooks), on the side stream, so with checkpointing the next layer's
    input is on its way while this layer recomputes. On CPU there is
    nothing to gain, but the same copy path runs (and is what the CPU tests prove equal).
    ``to="meta"`` (the estimator, on fake tensors) keeps only the shape: the tensor leaves
    the device and comes back empty, prefetched as on CUDA (so the device bytes of the
    tensors in flight are counted).

    A tensor saved again (the same tensor, unchanged: the rope tables every checkpointed
    layer takes as input) is copied to the host once; each save keeps its own place in the
    prefetch order and comes back on its own. An 8B model at 128k tokens parked 2 GiB of
    copies of its rope tables, one a layer; now 64 MiB.
    """

    def __init__(self, model: nn.Module, min_bytes: int = MIN_BYTES, to: str | None = None) -> None:
        weights = list(model.parameters()) + gather_buffers(model)
        self._keep = {w.untyped_storage()._cdata for w in weights}
        self._device = next(model.parameters()).device
        self._stream = torch.cuda.Stream(self._device) if self._device.type == "cuda" else None
        self._min_bytes, self._to = min_bytes, to
        self._layers = list(getattr(getattr(model, "model", None), "layers", ()))
        self._handles: list = []
        self._inside = [None]  # the decoder layer running forward now, None between layers
        self._parked: list = []  # weak references, in pack order: what backward may prefetch
        # id(tensor) -> (weak reference to it, its version, host copy, copy's event): a tensor
        # parked before, still alive and unchanged, is not copied again
        self._copies: dict[int, tuple] = {}
        self.runs: list[tuple[int | None, int]] = []  # (layer, first index) of each run
        self.log: list[tuple[str, int]] = []  # ("fetch" | "unpack", index): for the tests
        self.parked_bytes = 0  # what the host copies made so far hold
        super().__init__(self._pack, self._unpack)

    def _pack(self, t: torch.Tensor):
        if (is_traceable_wrapper_subclass(t) or t.untyped_storage()._cdata in self._keep
                or t.numel() * t.element_size() < self._min_bytes):
            return t
        index, layer = len(self._parked), self._inside[0]
        if not self.runs or self.runs[-1][0] != layer:
            self.runs.append((layer, index))
        # the first tensor of a run is the last its layer's backward unpacks: then the
        # run before starts coming back (with checkpointing: the layer's only tensor)
        window = prefetch_window(self.runs) if self.runs[-1][1] == index else range(0)
        entry = _Parked(t.device, *self._copy(t), index, window)
        self._parked.append(weakref.ref(entry))
        return entry

    def _copy(self, t: torch.Tensor) -> tuple:
        """(host copy, event its copy ends at): made once per tensor and version."""
        known = self._copies.get(id(t))
        # torch internal: ``_version`` counts in-place changes. Were it gone, a tensor changed
        # in place would come back as its old value (test_long_context compares gradients).
        if known is not None and known[0]() is t and known[1] == t._version:
            return known[2], known[3]
        done, stream = None, self._stream
        if self._to == "meta":
            host = t.detach().to("meta")
        elif stream is None:
            host = t.detach().clone()
        else:
            stream.wait_stream(torch.cuda.current_stream(self._device))
            with torch.cuda.stream(stream):
                host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                host.copy_(t, non_blocking=True)
                done = torch.cuda.Event()
                done.record(stream)
            t.record_stream(stream)  # the allocator must not reuse t before the copy ends
        self._copies[id(t)] = (weakref.ref(t), t._version, host, done)
        self.parked_bytes += t.numel() * t.element_size()
        return host, done

    def _fetch(self, entry: "_Parked") -> None:
        """Start bringing ``entry`` back to its device (CUDA: on the side stream)."""
        stream = self._stream
        if entry.fetched is not None or (stream is None and self._to != "meta"):
            return
        self.log.append(("fetch", entry.index))
        if self._to == "meta":
            entry.fetched = (torch.empty_like(entry.host, device=entry.device), None)
            return
        with torch.cuda.stream(stream):
            stream.wait_event(entry.done)
            back = entry.host.to(entry.device, non_blocking=True)
            arrived = torch.cuda.Event()
            arrived.record(stream)
        entry.fetched = (back, arrived)

    def _unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        self.log.append(("unpack", packed.index))
        for i in packed.window:
            earlier = self._parked[i]()
            if earlier is not None:
                self._fetch(earlier)
        if self._stream is None and self._to != "meta":
            return packed.host
        self._fetch(packed)
        back, arrived = packed.fetched
        packed.fetched = None  # the device copy belongs to autograd from here on
        if arrived is not None:
            current = torch.cuda.current_stream(packed.device)
            current.wait_event(arrived)
            back.record_stream(current)  # made on the side stream, used on this one
        return back

    def __enter__(self):
        """Also note which decoder layer runs, so each parked tensor knows its layer."""
        for i, layer in enumerate(self._layers):
            self._handles.append(layer.register_forward_pre_hook(
                lambda module, args, i=i: self._inside.__setitem__(0, i)))
            self._handles.append(layer.register_forward_hook(
                lambda module, args, out: self._inside.__setitem__(0, None)))
        return super().__enter__()

    def __exit__(self, *exc):
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._copies.clear()  # the parked entries keep what backward needs
        self._inside[0] = None
        return super().__exit__(*exc)
