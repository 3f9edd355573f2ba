"""Per-step memory tracking: a dispatch-level tracker on CPU, allocator statistics on CUDA.

The training step tells the tracker where it is (``before_forward``, ``after_forward``,
``after_backward``); the tracker turns what it saw into a ``MemoryBreakdown``.

On CPU there is no caching allocator to ask, so every tensor the step creates is seen
at dispatch and filed by role: torch's ``MemTracker`` does that. It is a private torch
API, so all of its use stays in this file.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed._tools.common_utils import get_untyped_storages
from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker, _MemRefType

from ..optim import optimizer_state_bytes
from .breakdown import MemoryBreakdown

# MemTracker's reference types -> our categories.
_CATEGORY_OF = {
    _MemRefType.PARAM: "parameters", _MemRefType.BUFFER: "parameters",
    _MemRefType.GRAD: "gradients", _MemRefType.OPT: "optimizer_state",
    _MemRefType.ACT: "activations", _MemRefType.TEMP: "other", _MemRefType.OTH: "other",
}


def _by_category(snapshot: dict) -> dict[str, int]:
    out = dict.fromkeys(("parameters", "gradients", "optimizer_state", "activations", "other"), 0)
    for ref, nbytes in snapshot.items():
        if ref in _CATEGORY_OF:
            out[_CATEGORY_OF[ref]] += nbytes
    return out


class _StepPhase:
    """Stands in for MemTracker's ModTracker, which hooks every module call.

    Those hooks tie grad hooks to every module output, and the cycles they make through
    autograd nodes outlived the step: parameters replaced by a toggle (LoRA adapters
    after a merge) stayed alive. The step says itself when backward starts instead.
    """

    def __init__(self) -> None:
        self.is_bw = False
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
    """MemTracker that keeps each category's high-water mark and only the global peak.

    Phases come from the training step (``_StepPhase``), not module hooks; tensors made
    in backward are filed as temporaries until they turn out to be gradients.
    """

    def __init__(self) -> None:
        super().__init__()
        self._mod_tracker = _StepPhase()
        self.highs: dict[str, int] = {}

    def _update_snap(self, *args, **kwargs) -> None:
        super()._update_snap(*args, **kwargs)
        for snap in self._curr_mem_snap.values():
            for ref, nbytes in snap.items():
                if nbytes > self.highs.get(ref, 0):
                    self.highs[ref] = nbytes

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
        for dev, snap in self._curr_mem_snap.items():
            if snap[_TOTAL_KEY] > self._peak_mem.get(dev, 0):
                self._peak_mem[dev] = snap[_TOTAL_KEY]
                self._peak_mem_snap[dev] = dict(snap)


class CpuStepMemory:
    """Tracks one step on CPU by watching every tensor it allocates."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, *inputs: torch.Tensor):
        self._optimizer = optimizer
        self._tracker = _HighWaterTracker()
        self._tracker.track_external(model, optimizer, *inputs)
        self._tracker.track_gradients(model)

    def __enter__(self) -> "CpuStepMemory":
        self._tracker.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._tracker.__exit__(*exc)

    def before_forward(self) -> None:
        self._tracker._mod_tracker.is_bw = False

    def after_forward(self) -> None:
        self._tracker._mod_tracker.is_bw = True

    def after_backward(self) -> None:
        pass

    def result(self) -> MemoryBreakdown:
        # MemTracker files every tensor made inside optimizer.step() as optimizer state,
        # temporaries included; the real state is what the optimizer holds afterwards, and
        # the excess is moved to "other".
        state = optimizer_state_bytes(self._optimizer)
        highs = {ref: self._tracker.highs.get(ref, 0) for ref in _CATEGORY_OF}
        step_temporaries = max(0, highs[_MemRefType.OPT] - state)
        highs[_MemRefType.TEMP] = max(highs[_MemRefType.TEMP], step_temporaries)
        highs[_MemRefType.OPT] = state
        peak_snap = dict(next(iter(self._tracker._peak_mem_snap.values()), {}))
        if peak_snap.get(_MemRefType.OPT, 0) > state:
            peak_snap[_MemRefType.TEMP] = peak_snap.get(_MemRefType.TEMP, 0) + peak_snap[_MemRefType.OPT] - state
            peak_snap[_MemRefType.OPT] = state
        return MemoryBreakdown(**_by_category(highs), peak=peak_snap.get(_TOTAL_KEY, 0),
                               device="cpu", at_peak=_by_category(peak_snap))


def storage_bytes(tensors) -> int:
    """Bytes of the storages behind ``tensors``, each counted once, as MemTracker counts them.

    A tensor subclass (an NF4 weight: 4-bit codes, int8 and float scales) is counted by
    the storages of its inner tensors; its own ``untyped_storage()`` is an empty stand-in.
    """
    seen, total = set(), 0
    for t in tensors:
        for storage in (get_untyped_storages(t) if t is not None else ()):
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
    return total


class CudaStepMemory:
    """Tracks one step on CUDA from the caching allocator plus accounting of live tensors.

    parameters, gradients and optimizer state are counted tensor by tensor; activations are
    what forward left allocated; other is the rest of the allocator's peak.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, *inputs: torch.Tensor):
        self.model, self.optimizer = model, optimizer
        self.device = next(model.parameters()).device
        self.activations = self.gradients = 0
        self._forward_start = 0

    def __enter__(self) -> "CudaStepMemory":
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        return self

    def __exit__(self, *exc) -> None:
        torch.cuda.synchronize(self.device)

    def before_forward(self) -> None:
        self._forward_start = torch.cuda.memory_allocated(self.device)

    def after_forward(self) -> None:
        held = torch.cuda.memory_allocated(self.device) - self._forward_start
        self.activations = max(self.activations, held)

    def after_backward(self) -> None:
        grads = storage_bytes(p.grad for p in self.model.parameters())
        self.gradients = max(self.gradients, grads)

    def result(self) -> MemoryBreakdown:
        params = storage_bytes(list(self.model.parameters()) + list(self.model.buffers()))
        optim = optimizer_state_bytes(self.optimizer, self.device)  # offloaded state is not here
        peak = torch.cuda.max_memory_allocated(self.device)
        other = max(0, peak - params - optim - self.activations)
        return MemoryBreakdown(parameters=params, gradients=self.gradients, optimizer_state=optim,
                               activations=self.activations, other=other, peak=peak,
                               reserved=torch.cuda.max_memory_reserved(self.device),
                               device=str(self.device))


def track_step(model: nn.Module, optimizer: torch.optim.Optimizer, *inputs: torch.Tensor):
    """The tracker for the device the model lives on."""
    device = next(model.parameters()).device
    cls = CudaStepMemory if device.type == "cuda" else CpuStepMemory
    return cls(model, optimizer, *inputs)
