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


class _HighWaterTracker(MemTracker):
    """MemTracker that keeps each category's high-water mark and only the global peak.

    The per-module peak snapshots of the base class are not used here and cost a loop
    over all modules on every operator, so they are skipped.
    """

    def __init__(self) -> None:
        super().__init__()
        self.highs: dict[str, int] = {}

    def _update_snap(self, *args, **kwargs) -> None:
        super()._update_snap(*args, **kwargs)
        for snap in self._curr_mem_snap.values():
            for ref, nbytes in snap.items():
                if nbytes > self.highs.get(ref, 0):
                    self.highs[ref] = nbytes

    def _track_module_params_and_buffers(self, module, install_grad_hooks=True):
        # The base class hooks every parameter, and torch refuses hooks on frozen ones
        # (LoRA's base weights): hook only those that will get a gradient.
        result = super()._track_module_params_and_buffers(module, install_grad_hooks=False)
        if install_grad_hooks:
            def file_grad(grad: torch.Tensor) -> None:
                self._update_and_maybe_create_winfos(grad, _MemRefType.GRAD)

            for param in module.parameters():
                if param.requires_grad and self._param_to_grad_hook_handles.get(param) is None:
                    self._param_to_grad_hook_handles[param] = (
                        param.register_hook(file_grad),
                        param.register_post_accumulate_grad_hook(lambda p: file_grad(p.grad)))
        return result

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

    def __enter__(self) -> "CpuStepMemory":
        self._tracker.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._tracker.__exit__(*exc)

    def before_forward(self) -> None:
        # MemTracker refuses a second forward of the root module unless its stats are reset.
        self._tracker.reset_mod_stats()

    def after_forward(self) -> None:
        pass

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


def _tensor_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if t is not None:
            storage = t.untyped_storage()
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
        grads = _tensor_bytes(p.grad for p in self.model.parameters())
        self.gradients = max(self.gradients, grads)

    def result(self) -> MemoryBreakdown:
        params = _tensor_bytes(list(self.model.parameters()) + list(self.model.buffers()))
        optim = optimizer_state_bytes(self.optimizer)
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
