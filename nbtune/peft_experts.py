"""A mixture of experts' adapters in PEFT's file form for transformers 5.

nbtune adapts each expert's gate, up and down projections as Linear layers (the Hub's
per-expert weights). PEFT on transformers 5 sees a Qwen3-MoE layer's experts as two 3-D
parameters, ``gate_up_proj`` [experts, 2 * width, hidden] and ``down_proj`` [experts, hidden,
width], adapted through ``target_parameters`` (its ``ParamWrapper``): one A of
[rank * experts, in] and one B of [out, rank * experts] each, where expert e's A is rows
e * rank ... and its B the columns e, e + experts, ... (PEFT's reshapes). Its wrappers nest
in the order the module registers the parameters: ``gate_up_proj``'s inside ``down_proj``'s
(``experts.base_layer.lora_A`` and ``experts.lora_A``).

Gate and up are two rank-r updates of one fused weight, together one of rank 2r: written with
``rank_pattern`` 2r and ``alpha_pattern`` 2 alpha (the same scale), A stacked and B block-
diagonal, and read back only in that form: a fused adapter trained in PEFT is not two
halves, and is refused by name.
"""

from __future__ import annotations

import re

import torch
from torch import nn

GATE_UP, DOWN = "mlp.experts.gate_up_proj", "mlp.experts.down_proj"  # PEFT's target_parameters
_EXPERT = re.compile(r"(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)$")


class ExpertAdapterError(ValueError):
    """A fused expert adapter nbtune's per-expert adapters cannot hold."""


def expert_groups(lora: list[tuple[str, nn.Module]]) -> dict[str, dict[tuple[int, str], nn.Module]]:
    """Each experts list (``...mlp.experts``) -> {(expert, projection): its LoRA module}."""
    groups: dict[str, dict[tuple[int, str], nn.Module]] = {}
    for name, module in lora:
        match = _EXPERT.fullmatch(name)
        if match:
            groups.setdefault(match[1], {})[(int(match[2]), match[3])] = module
    return groups


def peft_names(parent: str, key) -> dict[tuple[str, str], str]:
    """(fused parameter, part) -> PEFT's file name, ``key(module name, part)`` naming it."""
    return {(proj, part): key(f"{parent}.base_layer" if proj == GATE_UP else parent, part)
            for proj in (GATE_UP, DOWN) for part in ("lora_A", "lora_B")}


def experts_of(group: dict) -> int:
    return 1 + max(e for e, _ in group)


def fused_shape(group: dict, proj: str, part: str) -> tuple[int, int]:
    """The shape PEFT gives the fused A or B of ``proj``."""
    experts = experts_of(group)
    first = group[(0, "down_proj" if proj == DOWN else "gate_proj")]
    rank = first.rank * (2 if proj == GATE_UP else 1)
    out, inp = first.lora_B.weight.shape[0] * (2 if proj == GATE_UP else 1), first.lora_A.weight.shape[1]
    return (rank * experts, inp) if part == "lora_A" else (out, rank * experts)


@torch.no_grad()
def fused(group: dict, proj: str, part: str) -> torch.Tensor:
    """PEFT's fused A or B of ``proj`` made from the experts' own adapters."""
    experts = range(experts_of(group))
    if proj == DOWN:
        parts = [getattr(group[(e, "down_proj")], part).weight for e in experts]
        return torch.cat(parts) if part == "lora_A" else torch.stack(parts, -1).flatten(1)
    gates = [group[(e, "gate_proj")] for e in experts]
    ups = [group[(e, "up_proj")] for e in experts]
    if part == "lora_A":
        return torch.cat([torch.cat([g.lora_A.weight, u.lora_A.weight]) for g, u in zip(gates, ups)])
    return torch.stack([torch.block_diag(g.lora_B.weight, u.lora_B.weight)
                        for g, u in zip(gates, ups)], -1).flatten(1)


def split(group: dict, parent: str, weights: dict[tuple[str, str], torch.Tensor], key) -> dict[str, torch.Tensor]:
    """The experts' own adapters (under ``key``'s names) from PEFT's fused A and B: each
    shape checked, and gate_up's B refused unless block-diagonal (two halves, as written)."""
    experts = experts_of(group)
    out = {}
    for proj in (GATE_UP, DOWN):
        a, b = weights[(proj, "lora_A")], weights[(proj, "lora_B")]
        for part, value in (("lora_A", a), ("lora_B", b)):
            want = fused_shape(group, proj, part)
            if tuple(value.shape) != want:
                raise ExpertAdapterError(
                    f"{parent}'s {proj} {part} is {list(value.shape)}, but this base's experts "
                    f"take {list(want)}: another base or rank.")
        rank = a.shape[0] // experts
        a, b = a.view(experts, rank, -1), b.view(b.shape[0], rank, experts)
        for e in range(experts):
            if proj == DOWN:
                pieces = {"down_proj": (a[e], b[:, :, e])}
            else:
                r, width = rank // 2, b.shape[0] // 2
                block = b[:, :, e]
                if block[:width, r:].any() or block[width:, :r].any():
                    raise ExpertAdapterError(
                        f"{parent}'s gate_up_proj adapter is one rank-{rank} update of the fused "
                        "weight, not separate gate and up halves: nbtune adapts each projection "
                        "on its own and cannot hold it. Load it with PEFT, or merge it there.")
                pieces = {"gate_proj": (a[e, :r], block[:width, :r]), "up_proj": (a[e, r:], block[width:, r:])}
            for name, (lora_a, lora_b) in pieces.items():
                module = f"{parent}.{e}.{name}"
                out[key(module, "lora_A")], out[key(module, "lora_B")] = lora_a, lora_b
    return out


def peft_config_entries(group: dict, alpha: float) -> dict:
    """adapter_config.json's entries for adapted experts. PEFT's ``ParamWrapper`` refuses any
    dropout, so the file says ``lora_dropout`` 0 for every adapter (dropout changes nothing at
    inference); an adapter read back trains on without dropout unless ``lora_dropout`` is set."""
    rank = next(iter(group.values())).rank
    return {"target_parameters": [GATE_UP, DOWN], "rank_pattern": {GATE_UP: 2 * rank},
            "alpha_pattern": {GATE_UP: 2 * alpha}, "lora_dropout": 0.0}


__all__ = ["DOWN", "GATE_UP", "ExpertAdapterError", "expert_groups", "fused", "fused_shape",
           "peft_config_entries", "peft_names", "split"]
