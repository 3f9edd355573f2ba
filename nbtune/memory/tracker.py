"""Per-step memory tracking: a dispatch-level tracker on CPU, allocator statistics on CUDA.

The training step tells the tracker where it is (``before_forward``, ``after_forward``,
``after_backward``, ``before_optimizer``); the tracker turns what it saw into a
``MemoryBreakdown`` with the peak of each phase.

On CPU there is no caching allocator to ask, so every tensor the step creates is seen
at dispatch and filed by role: torch's ``MemTracker`` does that. It is a private torch
API, so all of its use stays in this file.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import nn
# torch internal (pyproject pins torch <2.14): MemTracker, its reference types and snapshot key.
# If torch renames or reshapes them, every measured and estimated breakdown breaks: the
# trackers subclass MemTracker and read its snapshots (tests/memory/test_memory.py fails first).
from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker, _MemRefType, _UpdateType
from torch.distributed.tensor import DTensor
from torch._guards import active_fake_mode
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from .accounting import (gather_buffers, gradient_bytes, optimizer_state_bytes, paged_state_bytes,
                         parameter_bytes)
from .breakdown import CATEGORIES, MemoryBreakdown, phase_summary

# MemTracker's reference types -> our categories.
_CATEGORY_OF = {
    _MemRefType.PARAM: "parameters", _MemRefType.BUFFER: "parameters",
    _MemRefType.GRAD: "gradients", _MemRefType.OPT: "optimizer_state",
    _MemRefType.ACT: "activations", _MemRefType.TEMP: "other", _MemRefType.OTH: "other",
}


TOTAL_KEY = _TOTAL_KEY  # a snapshot's key of its total
_CPU = torch.device("cpu")  # the device counted (the estimator parks off-device tensors on meta)
_ACT = _MemRefType.ACT
_META = torch.device("meta")  # where the estimator parks what leaves the device (filed as "meta", ref)


def host_refs() -> tuple:
    """The reference types FSDP2's CPU offload keeps in host memory: the sharded weights,
    their gradients and the optimizer state (its step runs there too)."""
    return (_MemRefType.PARAM, _MemRefType.GRAD, _MemRefType.OPT)


def _by_category(snapshot: dict, state: int) -> dict[str, int]:
    """A MemTracker snapshot in our categories.

    MemTracker files every tensor made inside ``optimizer.step()`` as optimizer state,
    temporaries included; the real state is what the optimizer holds afterwards (``state``),
    and the excess is moved to "other".
    """
    out = dict.fromkeys(CATEGORIES, 0)
    for ref, nbytes in snapshot.items():
        if ref in _CATEGORY_OF:
            out[_CATEGORY_OF[ref]] += nbytes
    excess = max(0, out["optimizer_state"] - state)
    out["optimizer_state"] -= excess
    out["other"] += excess
    return out


@dataclass
class Segment:
    """One stretch of a step (a phase, or one decoder layer's forward or backward in it): the
    MemTracker snapshot at its most-held moment and each reference type's high in it."""

    peak: dict = field(default_factory=dict)
    highs: dict = field(default_factory=dict)

    @property
    def offloaded(self) -> int:
        """The most activation bytes parked off the device (on "meta": what the estimator
        files as offloaded to the host) at any moment of the stretch."""
        return self.highs.get(("meta", _ACT), 0)


class Moments(NamedTuple):
    """What one stretch of a step held (a segment, from one tile's start to the next), as the
    estimator carries a step to more tiles (``nbtune.predict.carry``): ``peaks``, the
    snapshot at each op's end (values in ``Recorder.peak_keys`` order) where something was
    freed since the one before (else the one before cannot be a first most-held moment and
    is replaced); ``values``, each type's bytes each time it fell, and at the end."""

    peaks: list
    values: dict


class Recorder:
    """Every moment of a step, apart per stretch, for ``Moments``. A moment the next one
    holds everything of and more is left out, as a value before it rose again: a step
    that makes a tensor per tile at once (backward prefetching a layer's parked tiles)
    takes one moment, at any number of tiles."""

    def __init__(self) -> None:
        self.stretches: dict[tuple, Moments] = {}  # (segment, tiles begun in it) -> Moments
        self.tiles: dict[tuple, int] = {}  # segment -> tiles begun in it
        self.peak_keys: tuple = ()
        self.whole = True  # every snapshot had the keys of the first
        self._pending: dict[tuple, int] = {}  # (stretch, key) -> bytes since it last fell
        self._begun: set = set()  # segments seen updating
        self._fell = True  # something on the device fell since the last op's end
        self._last = None  # the stretch of the last op's end

    def begin_tile(self, segment: tuple) -> None:
        self.tiles[segment] = self.tiles.get(segment, 0) + 1

    def _where(self, segment: tuple) -> tuple:
        return (segment, self.tiles.get(segment, 0))

    def _stretch(self, where: tuple) -> Moments:
        found = self.stretches.get(where)
        if found is None:
            found = self.stretches[where] = Moments([], {})
        return found

    def update(self, segment: tuple, snaps: dict, device, moved: dict) -> None:
        """``moved``: bytes by which each of ``device``'s types changed (rose or fell).
        A segment's first update takes every value (its highs start there)."""
        if device not in (_CPU, _META):
            return
        where = self._where(segment)
        for key, by in moved.items():
            name = key if device == _CPU else ("meta", key)
            if by < 0:
                if device == _CPU:
                    self._fell = True
                if (where, name) in self._pending:
                    self._stretch(where).values.setdefault(name, []).append(
                        self._pending.pop((where, name)))
            elif by > 0:
                self._pending[(where, name)] = snaps.get(device, {}).get(key, 0)
        if segment not in self._begun:
            self._begun.add(segment)
            for dev, tag in ((_CPU, None), (_META, "meta")):
                for key, nbytes in snaps.get(dev, {}).items():
                    self._pending[(where, key if tag is None else (tag, key))] = nbytes

    def moment(self, segment: tuple, snap: dict) -> None:
        """An op ended: the device's snapshot ``snap``."""
        if not self.peak_keys:
            self.peak_keys = tuple(snap)
        elif len(snap) != len(self.peak_keys):  # (never seen: a new kind of reference)
            self.whole = False
        where, moment = self._where(segment), tuple(snap.values())
        peaks = self._stretch(where).peaks
        if peaks and self._last == where and (not self._fell or peaks[-1] == moment):
            peaks[-1] = moment
        else:
            peaks.append(moment)
        self._last, self._fell = where, False

    def result(self) -> tuple[dict, tuple, dict] | None:
        """(Moments by stretch, peak keys, tiles begun by segment), or None where a snapshot
        had other keys."""
        for (where, name), nbytes in self._pending.items():
            self._stretch(where).values.setdefault(name, []).append(nbytes)
        self._pending.clear()
        return (self.stretches, self.peak_keys, dict(self.tiles)) if self.whole else None


class _StepPhase:
    """Stands in for MemTracker's ModTracker, which hooks every module call.

    Those hooks tie grad hooks to every module output, and the cycles they make through
    autograd nodes outlived the step: parameters replaced by a toggle (LoRA adapters
    after a merge) stayed alive. The step says itself when backward starts instead.
    """

    def __init__(self) -> None:
        self.is_bw = False
        self.phase = "forward"
        self.parents = {"Global"}

    def register_user_hooks(self, *hooks) -> None:
        pass

    def clear_user_hooks(self) -> None:
        pass

    def __enter__(self) -> "_StepPhase":
        return self

    def __exit__(self, *exc) -> None:
        pass


class _HighWaterTracker(MemTracker):
    """MemTracker that keeps each category's high-water mark and the peak of each phase.

    Phases come from the training step (``_StepPhase``), not module hooks; tensors made
    in backward are filed as temporaries until they turn out to be gradients.
    """

    def __init__(self) -> None:
        super().__init__()
        self._mod_tracker = _StepPhase()  # MemTracker's own attribute, replaced
        # (phase, micro-batch, part, layer index or None) -> Segment, in the order first seen
        self.segment: tuple = ("forward", 0, "start", None)
        self.segments: dict[tuple, Segment] = {}
        self.track_resizes = False
        self.recorder: Recorder | None = None  # every moment, where recording

    def __enter__(self) -> "_HighWaterTracker":
        super().__enter__()
        # What torch 2.13's enter keeps for the dispatch below; 2.11's (the rented GPU
        # machines' build, benchmarks/gpu_acceptance.py) keeps nothing.
        self._fake_mode_on_entry = active_fake_mode()
        return self

    def begin_tile(self, *args) -> None:
        """A tile (or a loss piece) begins: what follows is recorded apart."""
        self.recorder.begin_tile(self.segment)

    # MemTracker also swaps torch.UntypedStorage.resize_ process-wide on enter and puts back
    # what it saw on exit: two trackers in two threads would restore out of order. Only
    # FSDP2 resizes storages (its gathered weights), and a sharded run has no second thread,
    # so the patch is on for sharded models only.

    @property
    def phase(self) -> "_StepPhase":
        """Which phase of the step runs now (set by the step's callbacks, read by hooks)."""
        return self._mod_tracker
    def _track_resize(self) -> None:
        if self.track_resizes:
            super()._track_resize()

    def _restore_resize(self) -> None:
        if self.track_resizes:
            super()._restore_resize()

    def track_gathered_weights(self, model: nn.Module) -> None:
        """Count the full weights FSDP2 gathers for the unit running, filed as "other".

        FSDP2 keeps each unit's gather buffers between steps with their storage resized to
        zero, and grows them (``UntypedStorage.resize_``, which dispatch does not see) for
        the unit's forward and backward: without this a rank's peak leaves them out.
        """
        from torch.distributed.fsdp import FSDPModule

        self.track_resizes = self.track_resizes or any(isinstance(m, FSDPModule) for m in model.modules())
        for buffer in gather_buffers(model):  # made by the first gather (``prime_units``)
            self._update_and_maybe_create_winfos(buffer, _MemRefType.TEMP)

    def _register_global_optimizer_hook(self) -> None:
        # MemTracker hooks every optimizer's step, process-wide. A background run trains
        # while the panel estimates in another thread: each tracker only counts the steps
        # taken in the thread that tracks with it (its dispatch mode is per thread too).
        owner = threading.get_ident()

        def pre(optimizer, args, kwargs) -> None:
            if threading.get_ident() == owner:
                self._in_opt = True

        def post(optimizer, args, kwargs) -> None:
            if threading.get_ident() == owner:
                self._track_optimizer_states(_MemRefType.OPT, optimizer)
                self._in_opt = False

        self._optimizer_hook_handles = (register_optimizer_step_pre_hook(pre),
                                        register_optimizer_step_post_hook(post))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        """MemTracker's own dispatch, step for step, minus its generic output walk: an
        estimate dispatches some 100,000 ops (a third of them the autograd engine asking a
        gradient its device, which makes nothing), so this costs ~20 % of its time.

        torch internal: mirrors ``MemTracker.__torch_dispatch__`` (torch 2.13). If torch
        changes what it files there, the estimates drift from the measured steps
        (tests/memory/test_memory.py and tests/predict/test_estimate.py compare both)."""
        if func is _WAIT_TENSOR or any(t is DTensor for t in types):
            return super().__torch_dispatch__(func, types, args, kwargs)
        res = func(*args, **(kwargs or {}))
        if active_fake_mode() is not self._fake_mode_on_entry:
            return res
        if func is not _DEVICE_QUERY:  # (a torch.device: nothing to file)
            if self._in_opt:
                reftype = _MemRefType.OPT
            elif self._mod_tracker.is_bw and not self._in_ac:
                reftype = _MemRefType.TEMP
            else:
                reftype = _ACT
            if isinstance(res, torch.Tensor):
                self._track(reftype, res)
            elif isinstance(res, (tuple, list)):
                _file_outputs(self, reftype, res)
        self._update_peak_stats(None)
        return res

    def _current(self) -> Segment:
        segment = self.segments.get(self.segment)
        if segment is None:
            segment = self.segments[self.segment] = Segment()
        return segment

    def _update_snap(self, u_type, winfo, old_mem_consumed=None, old_reftype=None) -> None:
        super()._update_snap(u_type, winfo, old_mem_consumed, old_reftype)
        highs = self._current().highs
        for ref, nbytes in self._curr_mem_snap.get(_CPU, {}).items():
            if nbytes > highs.get(ref, 0):
                highs[ref] = nbytes
        for ref, nbytes in self._curr_mem_snap.get(_META, {}).items():
            if nbytes > highs.get(("meta", ref), 0):
                highs[("meta", ref)] = nbytes
        if self.recorder is not None:
            self._record_update(u_type, winfo, old_mem_consumed, old_reftype)

    def _record_update(self, u_type, winfo, old_mem_consumed, old_reftype) -> None:
        """Tell the recorder what rose and what fell: a tensor made or freed, its type
        changed (a temporary found to be a gradient), a storage resized."""
        if u_type == _UpdateType.REF:
            moved = {winfo.reftype: winfo.mem_consumed, old_reftype: -winfo.mem_consumed}
        else:
            change = {_UpdateType.ADD: winfo.mem_consumed,
                      _UpdateType.DEL: -winfo.mem_consumed}.get(u_type)
            if change is None:  # a resize
                change = winfo.mem_consumed - old_mem_consumed
            moved = {winfo.reftype: change, _TOTAL_KEY: change}
        self.recorder.update(self.segment, self._curr_mem_snap, winfo.device, moved)

    def track_gradients(self, model: nn.Module) -> None:
        """File every gradient the model's trainable parameters receive as a gradient.

        (Frozen parameters get no hook: torch refuses hooks on them.)
        """
        def file_grad(grad: torch.Tensor | None) -> None:
            if grad is not None:  # None: an optimizer in backward already stepped and dropped it
                self._update_and_maybe_create_winfos(grad, _MemRefType.GRAD)

        for param in model.parameters():
            if param.requires_grad and self._param_to_grad_hook_handles.get(param) is None:
                self._param_to_grad_hook_handles[param] = (
                    param.register_hook(file_grad),
                    param.register_post_accumulate_grad_hook(lambda p: file_grad(p.grad)))

    def _update_peak_stats(self, peak_state) -> None:
        snap = self._curr_mem_snap.get(_CPU)
        if snap:
            if self.recorder is not None:
                self.recorder.moment(self.segment, snap)
            segment = self._current()
            if snap[_TOTAL_KEY] > segment.peak.get(_TOTAL_KEY, 0):
                segment.peak = dict(snap)


_DEVICE_QUERY = torch.ops.prim.device.default
_WAIT_TENSOR = torch.ops._c10d_functional.wait_tensor.default


def _file_outputs(tracker: MemTracker, reftype, outputs) -> None:
    """Track each tensor of an op's (nested) tuple or list of outputs, in order."""
    for out in outputs:
        if isinstance(out, torch.Tensor):
            tracker._track(reftype, out)
        elif isinstance(out, (tuple, list)):
            _file_outputs(tracker, reftype, out)


def breakdown_of(segments, state: int, weights: dict[str, int]) -> MemoryBreakdown:
    """A CPU step's ``MemoryBreakdown`` from its segments ((key, Segment) pairs in the order
    they were first seen; a key starts with its phase), the optimizer state it ended with and
    the model's weights by kind."""
    highs: dict = {}
    peaks: dict[str, dict] = {}  # phase -> snapshot at its peak (the first, where equal)
    for key, segment in segments:
        for ref, nbytes in segment.highs.items():
            if not isinstance(ref, tuple):  # ("meta", ref): off the device, not counted here
                highs[ref] = max(highs.get(ref, 0), nbytes)
        phase, total = key[0], segment.peak.get(_TOTAL_KEY, 0)
        if total > peaks.get(phase, {}).get(_TOTAL_KEY, 0):
            peaks[phase] = segment.peak
    # The optimizer's temporaries came and went at one moment: a high of their own.
    excess = max(0, highs.get(_MemRefType.OPT, 0) - state)
    highs[_MemRefType.TEMP] = max(highs.get(_MemRefType.TEMP, 0), excess)
    highs[_MemRefType.OPT] = state
    highs = _by_category(highs, state)
    phases = {name: _by_category(snap, state) for name, snap in peaks.items()}
    at_peak = max(phases.values(), key=lambda snap: sum(snap.values()), default={})
    highs["parameters"] = sum(weights.values())
    return MemoryBreakdown(**highs, peak=sum(at_peak.values()), **weights, device="cpu",
                           at_peak=at_peak, phases=phase_summary(phases))


class CpuStepMemory:
    """Tracks one step on CPU by watching every tensor it allocates.

    ``by_layer``: file what each decoder layer's forward and backward hold under segments of
    their own (phase, micro-batch, "layer", index), apart from the embedding, the head and
    the rest of each phase: the estimator extrapolates a deep model's step from two shallow
    ones with them (``nbtune.predict.estimator``).

    ``tiles``: modules called once at the start of each tile (or loss piece): every moment is
    then recorded, apart per tile (``recorded``), for the estimator to carry the step to
    more tiles (``nbtune.predict.carry``).
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, *inputs: torch.Tensor,
                 by_layer: bool = False, tiles: tuple[nn.Module, ...] = (), copy=None):
        self._model, self._optimizer, self._copy = model, optimizer, copy
        self._tracker = _HighWaterTracker()
        if tiles:
            self._tracker.recorder = Recorder()
        self._tracker.track_external(model, optimizer, *inputs, *([copy.model] if copy is not None else []))
        self._tracker.track_gradients(model)
        self._tracker.track_gathered_weights(model)
        self._micro = -1
        self._hooks = _layer_hooks(model, self._tracker) if by_layer else []
        self._hooks += [m.register_forward_pre_hook(self._tracker.begin_tile) for m in tiles]

    def __enter__(self) -> "CpuStepMemory":
        self._tracker.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for hook in self._hooks:
            hook.remove()
        self._tracker.__exit__(*exc)

    def _enter(self, phase: str, part: str) -> None:
        self._tracker.phase.phase = phase
        self._tracker.phase.is_bw = phase != "forward"
        self._tracker.segment = (phase, max(self._micro, 0), part, None)

    def before_forward(self) -> None:
        self._micro += 1
        self._enter("forward", "start")

    def after_forward(self) -> None:
        self._enter("backward", "head")

    def after_backward(self) -> None:
        self._enter("backward", "end")

    def before_optimizer(self) -> None:
        self._enter("optimizer", "step")

    @property
    def recorded(self) -> tuple[dict, tuple, dict] | None:
        """Every moment, where recorded (``Recorder.result``)."""
        recorder = self._tracker.recorder
        return recorder.result() if recorder is not None else None

    @property
    def segments(self) -> dict[tuple, Segment]:
        """What each stretch of the step held (see ``Segment``), in the order first seen."""
        return self._tracker.segments

    def result(self) -> MemoryBreakdown:
        return breakdown_of(self.segments.items(), optimizer_state_bytes(self._optimizer),
                            weights_of(self._model, self._copy))


def _layer_hooks(model: nn.Module, tracker: _HighWaterTracker) -> list:
    """Hooks that move ``tracker.segment`` to each decoder layer as forward and backward reach
    it, to the head after the last layer's forward, and to the embedding's backward once the
    first layer's has ended. (A checkpointed layer recomputed in backward calls no module
    hooks: its recomputation belongs to its backward segment.)"""
    layers = model.model.layers

    def move_to(part: str, index: int | None):
        def hook(module, *args) -> None:
            if tracker.phase.phase == "forward":
                tracker.segment = ("forward", tracker.segment[1], part, index)
        return hook

    def backward_from(part: str, index: int | None):
        """On a module's output: its gradient is ready when backward reaches the module."""
        def hook(module, args, output) -> None:
            if tracker.phase.phase != "forward" or not output.requires_grad:
                return
            key = ("backward", tracker.segment[1], part, index)

            def reached(grad) -> None:
                tracker.segment = key
            output.register_hook(reached)
        return hook

    hooks = [model.model.embed_tokens.register_forward_hook(backward_from("embedding", None))]
    for i, layer in enumerate(layers):
        hooks.append(layer.register_forward_pre_hook(move_to("layer", i)))
        hooks.append(layer.register_forward_hook(backward_from("layer", i)))
    # What runs between two layers belongs to the first; after the last, the head's begins.
    hooks.append(layers[-1].register_forward_hook(move_to("head", None)))
    return hooks


class CudaStepMemory:
    """Tracks one step on CUDA from the caching allocator plus accounting of live tensors.

    The allocator's peak is read and reset at each phase boundary (host-side counters: no
    synchronisation). Parameters, gradients and optimizer state are counted tensor by
    tensor; activations are what forward left allocated. At each phase's peak, whatever is
    not parameters, gradients or optimizer state is filed as activations (forward,
    backward) or other (the optimizer step).
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, *inputs: torch.Tensor, copy=None):
        self.model, self.optimizer, self.copy = model, optimizer, copy
        self.device = next(model.parameters()).device
        self.activations = self.gradients = self.reserved = 0
        self._forward_start = 0
        self._phase_peak: dict[str, int] = {}
        self._phase_grads: dict[str, int] = {}
        self._state_before = 0  # optimizer state in the allocator when the step began

    def __enter__(self) -> "CudaStepMemory":
        # Paged state lives in managed memory, outside the allocator whose peaks are read.
        self._state_before = (optimizer_state_bytes(self.optimizer, self.device)
                              - paged_state_bytes(self.optimizer))
        torch.cuda.reset_peak_memory_stats(self.device)
        return self

    def __exit__(self, *exc) -> None:
        self._close_phase("optimizer", gradients=0)

    def _close_phase(self, phase: str, gradients: int) -> None:
        peak = torch.cuda.max_memory_allocated(self.device)
        if peak > self._phase_peak.get(phase, -1):
            self._phase_peak[phase], self._phase_grads[phase] = peak, gradients
        self.reserved = max(self.reserved, torch.cuda.max_memory_reserved(self.device))
        torch.cuda.reset_peak_memory_stats(self.device)

    def before_forward(self) -> None:
        self._forward_start = torch.cuda.memory_allocated(self.device)

    def after_forward(self) -> None:
        self._close_phase("forward", gradients=self.gradients)
        held = torch.cuda.memory_allocated(self.device) - self._forward_start
        self.activations = max(self.activations, held)

    def after_backward(self) -> None:
        self.gradients = max(self.gradients, gradient_bytes(self.model))

    def before_optimizer(self) -> None:
        self._close_phase("backward", gradients=self.gradients)

    def result(self) -> MemoryBreakdown:
        weights = weights_of(self.model, self.copy)
        params = sum(weights.values())
        state = optimizer_state_bytes(self.optimizer, self.device)  # offloaded state is not here
        paged = paged_state_bytes(self.optimizer)
        phases = {}
        for phase, peak in self._phase_peak.items():
            held = {"parameters": params, "gradients": self._phase_grads[phase],
                    "optimizer_state": state - paged if phase == "optimizer" else self._state_before}
            rest = max(0, peak - sum(held.values()))
            held["other" if phase == "optimizer" else "activations"] = rest
            phases[phase] = held
        at_peak = max(phases.values(), key=lambda snap: sum(snap.values()), default={})
        peak = max(self._phase_peak.values(), default=0)
        other = max(0, peak - params - (state - paged) - self.activations)
        free, total = torch.cuda.mem_get_info(self.device)
        outside = max(0, total - free - torch.cuda.memory_reserved(self.device))
        return MemoryBreakdown(parameters=params, gradients=self.gradients, optimizer_state=state,
                               activations=self.activations, other=other, peak=peak,
                               reserved=self.reserved, outside=outside, **weights,
                               device=str(self.device), at_peak=at_peak,
                               phases=phase_summary(phases))


def track_step(model: nn.Module, optimizer: torch.optim.Optimizer, *inputs: torch.Tensor, copy=None):
    """The tracker for the device the model lives on; ``copy``: a full finetune's reference
    copy (``objectives.reference.FrozenCopy``), its weights on the device counted as frozen."""
    device = next(model.parameters()).device
    cls = CudaStepMemory if device.type == "cuda" else CpuStepMemory
    return cls(model, optimizer, *inputs, copy=copy)


def weights_of(model: nn.Module, copy) -> dict[str, int]:
    """The model's weights by kind, with a reference copy's on the device as frozen ones."""
    weights = parameter_bytes(model)
    if copy is not None:
        weights["frozen"] += copy.device_bytes()
    return weights
