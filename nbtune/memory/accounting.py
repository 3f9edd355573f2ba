"""Counting bytes held by tensors: parameters by kind, gradients, optimizer state.

Storages are deduplicated by identity (``_cdata``), not by address: fake tensors (the
estimator's) all sit at address 0, and a tied weight or a view must count once.
"""

from __future__ import annotations

import torch
from torch import nn
# torch internal: a subclass (NF4, quantized state) is counted by its inner tensors.
from torch.utils._python_dispatch import is_traceable_wrapper_subclass
from torch.distributed.tensor import DTensor


def plain_tensors(value) -> list[torch.Tensor]:
    """The plain tensors behind ``value``: a tensor subclass (NF4 weight, torchao quantized
    state) is flattened to its parts, recursively; dicts are searched."""
    if is_traceable_wrapper_subclass(value):
        parts, _ = value.__tensor_flatten__()
        return [t for part in parts for t in plain_tensors(getattr(value, part))]
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in plain_tensors(v)]
    return []


def storage_bytes(tensors, seen: set | None = None) -> int:
    """Bytes of the storages behind ``tensors`` (None entries skipped), each counted once.

    ``seen`` carries the storages already counted across calls.
    """
    seen = set() if seen is None else seen
    total = 0
    for t in tensors:
        for part in plain_tensors(t) if t is not None else ():
            storage = part.untyped_storage()
            if storage._cdata not in seen:
                seen.add(storage._cdata)
                total += storage.nbytes()
    return total


def parameter_bytes(model: nn.Module) -> dict[str, int]:
    """The model's weights by kind: ``trainable``, ``frozen`` (dense, buffers included) and
    ``quantized`` (NF4 weights: 4-bit codes plus scales)."""
    seen: set = set()
    out = {"trainable": 0, "frozen": 0, "quantized": 0}
    for p in model.parameters():
        local = p.to_local() if isinstance(p, DTensor) else p  # FSDP2: this rank's shard
        kind = ("trainable" if p.requires_grad
                else "quantized" if is_traceable_wrapper_subclass(local) else "frozen")
        out[kind] += storage_bytes([p], seen)
    out["frozen"] += storage_bytes(model.buffers(), seen)
    return out


def gradient_bytes(model: nn.Module) -> int:
    return storage_bytes(p.grad for p in model.parameters())


def optimizer_state_bytes(optimizer: torch.optim.Optimizer,
                          device: torch.device | None = None) -> int:
    """Bytes held in optimizer state tensors, deduplicated by storage.

    Quantized state (torchao's tensor subclasses) counts as the plain tensors it is made of:
    codes, block scales and lookup table; bitsandbytes' lookup tables, shared between
    parameters, count once. With ``device``, only state on that device counts: offloaded
    state lives on the CPU, not on the GPU; bitsandbytes' paged state is a CPU view of CUDA
    unified memory, counted on the GPU it pages to.
    """
    def home(tensor: torch.Tensor) -> torch.device:
        paged = getattr(tensor, "is_paged", False)
        return torch.device("cuda", tensor.page_deviceid) if paged else tensor.device

    seen: set = set()
    return sum(storage_bytes([t], seen) for state in optimizer.state.values()
               for t in plain_tensors(state) if device is None or home(t) == device)


def paged_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of bitsandbytes paged state: CUDA managed memory, outside torch's allocator."""
    seen: set = set()
    return sum(storage_bytes([t], seen) for state in optimizer.state.values()
               for t in plain_tensors(state) if getattr(t, "is_paged", False))


def gather_buffers(model: nn.Module) -> list[torch.Tensor]:
    """The tensors FSDP2 gathers each unit's weights into (every parameter's all-gather
    outputs, kept between steps with their storage resized to nothing): the gathered weights
    live in their storages. Empty for a model that is not sharded, or before a unit's first
    gather (``prime_units``)."""
    from torch.distributed.fsdp import FSDPModule

    out = []
    for module in model.modules():
        if isinstance(module, FSDPModule):
            # torch internal: FSDP2's parameter groups and their all-gather outputs. If they
            # move, a rank's peak misses the gathered weights and offloading parks them
            # (tests/cli/test_distributed.py, tests/test_offload_ranks.py).
            for group in module._get_fsdp_state()._fsdp_param_groups:
                for param in group.fsdp_params:
                    out += param.all_gather_outputs
    return out
