"""Optimizer factory: what ``Techniques.optimizer`` names, over the trainable parameters."""

from __future__ import annotations

import torch
from torch import nn

from .techniques import Techniques


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    seen, out = set(), []
    for p in model.parameters():
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def build_optimizer(model: nn.Module, techniques: Techniques) -> torch.optim.Optimizer:
    params = trainable_parameters(model)
    if techniques.optimizer == "adamw":
        # fused keeps no per-group temporaries on CUDA; foreach is the fast path on CPU.
        on_cuda = params[0].is_cuda
        return torch.optim.AdamW(params, lr=techniques.lr, weight_decay=techniques.weight_decay,
                                 fused=on_cuda or None, foreach=None if on_cuda else True)
    if techniques.optimizer == "sgd":
        return torch.optim.SGD(params, lr=techniques.lr, weight_decay=techniques.weight_decay)
    raise ValueError(f"optimizer {techniques.optimizer!r} is not built by this version.")


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes held in optimizer state tensors (deduplicated by storage)."""
    seen, total = set(), 0
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                key = value.untyped_storage().data_ptr()
                if key not in seen:
                    seen.add(key)
                    total += value.untyped_storage().nbytes()
    return total
