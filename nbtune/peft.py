"""LoRA by swapping layers on a built model: frozen base Linear + trainable low-rank update.

Module names follow PEFT (``q_proj.base_layer``, ``q_proj.lora_A``, ``q_proj.lora_B``)
so adapters can be exported for ``peft.PeftModel`` without renaming.
"""

from __future__ import annotations

import math

import torch
from torch import nn


class LoRALinear(nn.Module):
    """``base(x) + (alpha / rank) * B(A(dropout(x)))`` with ``base`` frozen and B zero at start."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float) -> None:
        super().__init__()
        self.base_layer = base
        self.rank, self.alpha = rank, alpha
        kw = {"device": base.weight.device, "dtype": base.weight.dtype}
        self.lora_A = nn.Linear(base.in_features, rank, bias=False, **kw)
        self.lora_B = nn.Linear(rank, base.out_features, bias=False, **kw)
        self.lora_dropout = nn.Dropout(dropout) if dropout else nn.Identity()
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))  # as PEFT does
        nn.init.zeros_(self.lora_B.weight)
        base.requires_grad_(False)

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base_layer(x) + self.lora_B(self.lora_A(self.lora_dropout(x))) * self.scaling

    @torch.no_grad()
    def delta_weight(self) -> torch.Tensor:
        """The low-rank update ``scaling * B @ A`` [out, in], in fp32."""
        return (self.lora_B.weight.float() @ self.lora_A.weight.float()) * self.scaling

    @torch.no_grad()
    def merged(self) -> nn.Linear:
        """The base Linear with the low-rank update folded into its weight."""
        base = self.base_layer
        base.weight.copy_((base.weight.float() + self.delta_weight()).to(base.weight.dtype))
        return base


def _lora_modules(model: nn.Module):
    return [(name, m) for name, m in model.named_modules() if isinstance(m, LoRALinear)]


def has_lora(model: nn.Module) -> bool:
    return bool(_lora_modules(model))


def _swap(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, new)


def apply_lora(model: nn.Module, targets: tuple[str, ...], rank: int, alpha: float,
               dropout: float) -> int:
    """Freeze every weight and wrap each Linear named in ``targets``; returns how many."""
    model.requires_grad_(False)
    chosen = [(name, m) for name, m in model.named_modules()
              if isinstance(m, nn.Linear) and name.rpartition(".")[2] in targets]
    if not chosen:
        raise ValueError(f"No Linear layer is named one of {targets}; nothing to adapt.")
    for name, linear in chosen:
        _swap(model, name, LoRALinear(linear, rank, alpha, dropout))
    return len(chosen)


def merge_lora(model: nn.Module) -> int:
    """Fold every adapter into its base weight and put the plain Linear back; returns how many."""
    found = _lora_modules(model)
    for name, module in found:
        _swap(model, name, module.merged())
    return len(found)


def set_lora_options(model: nn.Module, alpha: float, dropout: float) -> None:
    """Change scaling and dropout of the adapters in place (no retraining, no new weights)."""
    for _, module in _lora_modules(model):
        module.alpha = alpha
        module.lora_dropout = nn.Dropout(dropout) if dropout else nn.Identity()


def adapter_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Adapter weights under PEFT's file names (``base_model.model.<module>.lora_A.weight``)."""
    out = {}
    for name, module in _lora_modules(model):
        out[f"base_model.model.{name}.lora_A.weight"] = module.lora_A.weight.detach().contiguous()
        out[f"base_model.model.{name}.lora_B.weight"] = module.lora_B.weight.detach().contiguous()
    return out


def adapter_config(model: nn.Module, base_model: str | None) -> dict:
    """PEFT's adapter_config.json for the adapters on ``model`` (all share one rank and alpha)."""
    found = _lora_modules(model)
    if not found:
        raise ValueError("The model has no LoRA adapters to describe.")
    first = found[0][1]
    dropout = first.lora_dropout.p if isinstance(first.lora_dropout, nn.Dropout) else 0.0
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
        "r": first.rank, "lora_alpha": first.alpha, "lora_dropout": dropout,
        "target_modules": sorted({name.rpartition(".")[2] for name, _ in found}),
        "bias": "none", "fan_in_fan_out": False, "inference_mode": True,
        "init_lora_weights": True, "use_rslora": False, "use_dora": False,
        "modules_to_save": None, "layers_to_transform": None, "layers_pattern": None,
        "rank_pattern": {}, "alpha_pattern": {},
    }


@torch.no_grad()
def merged_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The weights with every adapter folded in, under plain (HF) names; ``model`` is untouched."""
    lora = dict(_lora_modules(model))
    out = {}
    for key, value in model.state_dict().items():
        module_name, _, leaf = key.rpartition(".")
        parent, _, child = module_name.rpartition(".")
        if parent in lora:
            if child != "base_layer":
                continue  # lora_A / lora_B: folded into the weight below
            if leaf == "weight":
                value = (value.float() + lora[parent].delta_weight()).to(value.dtype)
            key = f"{parent}.{leaf}"
        out[key] = value.detach().contiguous()
    return out
