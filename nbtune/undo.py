"""Undoing an update that failed half-way: host copies of what it writes, nothing more.

An update writes each trainable weight and its optimizer state in place: all of them at
``optimizer.step()``, or one weight at a time during backward when the optimizer steps in
backward. ``UndoCopy`` copies each weight and its state just before that weight's own
update, into host buffers made once and reused from step to step, and after a failure
restores exactly the weights whose update had begun.

On CUDA the copies are issued at the start of backward on a side stream into pinned
buffers (weights and state do not change in backward), overlapping with its compute; each
update waits for its own copy on the device, never on the host. On CPU a copy is made right
before its update, so it does not sit beside the step's activations.
"""

from __future__ import annotations

import torch
from torch import nn

from .memory.accounting import plain_tensors, storage_bytes

ROLLBACK_MODES = ("auto", "copy", "none")
# On CUDA "auto" keeps the undo copy whenever it is at most this big (any LoRA run, small
# models), and beyond it where the update spans backward or a new optimizer makes its state.
UNDO_AUTO_BYTES = 256 << 20


def undo_wanted(mode: str, device: str, *, in_backward: bool, first: bool, size: int) -> bool:
    """Whether ``rollback=mode`` keeps an undo copy of the next update (the host's room is
    checked after): see ``Trainer._undo_for``. ``first``: the optimizer's first update (it
    makes its state then, and a new optimizer can fail on its own: torchao compiles)."""
    if mode != "auto":
        return mode == "copy"
    return first or (device == "cuda" and (in_backward or size <= UNDO_AUTO_BYTES))


_ABSENT = object()  # a weight with no optimizer state yet (its first update creates it)


def undo_units(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[tuple]:
    """(tensor, state dict that holds its entry or None) for everything an update writes:
    each optimizer's parameters with their state, and trainable weights the optimizers do not
    hold (an offloaded optimizer steps host copies and writes the weights back)."""
    from .optim import OptimizerInBackward, trainable_parameters

    if isinstance(optimizer, OptimizerInBackward):
        inner = optimizer.optimizers
    elif hasattr(optimizer, "inner"):  # torchao's CPUOffloadOptimizer, as optim wraps it
        inner = optimizer.inner()
    else:
        inner = [optimizer]
    units, seen = [], set()
    for opt in inner:
        for group in opt.param_groups:
            for p in group["params"]:
                if id(p) not in seen:
                    seen.add(id(p))
                    units.append((p, opt.state))
    units += [(p, None) for p in trainable_parameters(model) if id(p) not in seen]
    return units


def copy_bytes(units: list[tuple]) -> int:
    """Host bytes a copy of ``units`` holds: the tensors and their present state."""
    seen: set = set()
    total = storage_bytes([p for p, _ in units], seen)
    for p, state in units:
        if state is not None and p in state:
            total += storage_bytes(plain_tensors(state[p]), seen)
    return total


class UndoCopy:
    """The host copy of one update, made piece by piece; see the module's docstring.

    Per step: ``begin(units)``, then ``stage()`` when backward starts, ``before_update(p)``
    right before ``p`` is written (or ``before_update()`` for all of them), and after a
    failure ``restore()``. ``nbytes`` is what its buffers hold; ``release()`` frees them.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._cuda = device.type == "cuda"
        self._stream = torch.cuda.Stream(device) if self._cuda else None
        self._buffers: dict[tuple, torch.Tensor] = {}
        self._units: dict[int, tuple] = {}  # id(tensor) -> (tensor, state dict or None)
        self._copies: dict[int, tuple] = {}  # id(tensor) -> (weight, state entry, event or None)
        self._updated: list[int] = []
        self._staged = False

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def begin(self, units: list[tuple]) -> None:
        """A new step: nothing copied or updated yet. CUDA: pinned buffers of tensors still
        written are kept for reuse (pinning is slow), the others freed."""
        self._units = {id(p): (p, state) for p, state in units}
        self._copies, self._updated, self._staged = {}, [], False
        self._buffers = {key: b for key, b in self._buffers.items() if key[0] in self._units}

    def done(self) -> None:
        """The step succeeded. CPU: free the copies (kept, they would sit beside the next
        step's activations); CUDA: keep the pinned buffers for the next step."""
        self._copies, self._updated = {}, []
        if not self._cuda:
            self._buffers = {}

    def release(self) -> None:
        self._buffers, self._units, self._copies, self._updated = {}, {}, {}, []

    # ---- copying ------------------------------------------------------------------------

    def _buffer(self, key: tuple, part: torch.Tensor) -> torch.Tensor:
        buffer = self._buffers.get(key)
        if buffer is None or buffer.shape != part.shape or buffer.dtype != part.dtype:
            buffer = torch.empty(part.shape, dtype=part.dtype, device="cpu", pin_memory=self._cuda)
            self._buffers[key] = buffer
        return buffer

    def _take(self, value, key: tuple):
        """``value`` noted for ``restore``: tensors as (object, [(part, host copy)]), dicts as
        (object, {key: noted}), anything else as itself."""
        if isinstance(value, torch.Tensor):
            parts = plain_tensors(value)
            copies = []
            for i, part in enumerate(parts):
                buffer = self._buffer(key + (i,), part)
                buffer.copy_(part.detach(), non_blocking=self._cuda)
                copies.append((part, buffer))
            return ("tensor", value, copies)
        if isinstance(value, dict):
            return ("dict", value, {k: self._take(v, key + (k,)) for k, v in value.items()})
        return ("value", value)

    def _copy(self, index: int) -> None:
        tensor, state = self._units[index]
        entry = _ABSENT if state is None or tensor not in state else self._take(state[tensor], (index, "state"))
        self._copies[index] = (self._take(tensor, (index, "weight")), entry, None)

    @torch.no_grad()
    def stage(self) -> None:
        """CUDA: copy every unit now on the side stream (backward does not change them), each
        with an event its update waits for. CPU: nothing (each copy waits for its update)."""
        if not self._cuda or self._staged:
            return
        self._staged = True
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            for index in reversed(list(self._units)):  # backward reaches the last layers first
                self._copy(index)
                event = torch.cuda.Event()
                event.record(self._stream)
                weight, entry, _ = self._copies[index]
                self._copies[index] = (weight, entry, event)

    @torch.no_grad()
    def before_update(self, tensor: torch.Tensor | None = None) -> None:
        """``tensor`` (None: every unit) is about to be written: have its copy first."""
        indices = list(self._units) if tensor is None else [id(tensor)]
        for index in indices:
            if index not in self._units or index in self._updated:
                continue
            if index not in self._copies:
                self._copy(index)
            event = self._copies[index][2]
            if event is not None:
                torch.cuda.current_stream(self.device).wait_event(event)
            self._updated.append(index)

    # ---- restoring ----------------------------------------------------------------------

    @property
    def updated(self) -> int:
        """How many units had begun their update (and are restored by ``restore``)."""
        return len(self._updated)

    @torch.no_grad()
    def restore(self) -> None:
        """Put back every unit whose update had begun, bit for bit: its weight, and its state
        entry as it was (the same tensor objects holding the old bytes; an entry the update
        created is removed)."""
        if self._cuda:
            torch.cuda.current_stream(self.device).wait_stream(self._stream)
        for index in self._updated:
            tensor, state = self._units[index]
            weight, entry, _ = self._copies[index]
            _put(weight)
            if state is None:
                continue
            if entry is _ABSENT:
                state.pop(tensor, None)
            else:
                state[tensor] = _put(entry)
        if self._cuda:
            torch.cuda.synchronize(self.device)
        self._updated = []


def _put(noted):
    kind, value, inner = noted[0], noted[1], noted[2] if len(noted) > 2 else None
    if kind == "tensor":
        for part, copy in inner:
            part.copy_(copy, non_blocking=True)
        return value
    if kind == "dict":
        restored = {k: _put(v) for k, v in inner.items()}
        value.clear()
        value.update(restored)
        return value
    return value


class RestoreCopy:
    """A LoRA run's whole training state after a completed step, kept in host memory, so that
    ``recover()`` after a half-written update returns there rather than to the last
    checkpoint or step 0. It is small (the adapters and their optimizer state, not the base),
    kept only where the host has room for it, and refreshed at most as often as keeps its
    copying under ``SHARE`` of the training time (1 %: what it measures is not all it costs,
    and the whole stays under 2 %, ``benchmarks/restore_copy_cost.py``)."""

    SHARE = 0.01

    def __init__(self) -> None:
        self.state: dict | None = None
        self.step, self.nbytes, self.every = 0, 0, 1

    def due(self, step: int) -> bool:
        return self.state is None or step - self.step >= self.every

    def keep(self, state: dict, step: int, room: int | None) -> bool:
        """Copy ``state`` (``Trainer.state_dict``'s, by reference) to host memory; False (and
        nothing kept) where the host has no room for it."""
        size = storage_bytes(list(_tensors(state)))
        self.drop()  # the old copy goes first: never two in host memory at once
        if room is not None and size > room:
            return False
        self.state, self.step, self.nbytes = _to_host(state), step, size
        return True

    def pace(self, spent: float, step_seconds: float) -> None:
        """Refresh every so many steps that keeping (``spent`` seconds, all of it) stays
        under ``SHARE`` of the training time."""
        import math

        self.every = max(1, math.ceil(spent / (self.SHARE * step_seconds))) if step_seconds > 0 else 1

    def copy(self) -> dict:
        """The kept state, copied again (loading it must not alias what stays kept)."""
        return _to_host(self.state)

    def drop(self) -> None:
        self.state, self.step, self.nbytes = None, 0, 0


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)


def _to_host(value):
    """``value`` with every tensor copied to host memory (containers rebuilt, the rest shared)."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: _to_host(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_to_host(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_to_host(v) for v in value)
    return value
