"""The speed cost model: a step's time with some techniques, relative to a plain step.
Rough by design: it ranks ``fit``'s candidates, it does not time them (figures: tables.py)."""

from __future__ import annotations

import math

from ..techniques import Techniques
from .tables import BF16_FACTOR_CUDA, COSTS, METHOD_FACTOR

_EIGHT_BIT = ("adamw8bit", "paged_adamw8bit", "ao_adamw8bit")
_PAGED = ("paged_adamw8bit", "paged_adamw")


def checkpointed_fraction(t: Techniques, num_layers: int | None = None) -> float:
    """Share of decoder layers checkpointed: every N-th, counting from the first."""
    every = t.checkpoint_every
    if not every:
        return 0.0
    if num_layers:
        return math.ceil(num_layers / every) / num_layers
    return 1.0 / every


def cost_terms(t: Techniques, device: str = "cuda", *, num_layers: int | None = None,
               baseline: Techniques | None = None, sharding=None) -> dict[str, float]:
    """``relative_cost``'s parts: additive overheads (fractions of a plain step) by name, and
    the factors "method", "dtype" (against ``baseline``) and "compile"; zeros left out.
    ``sharding``: FSDP2's settings over several cards (its mixed precision computes in bf16)."""
    cuda = str(device).startswith("cuda")
    base = baseline or t
    out: dict[str, float] = {}
    f = checkpointed_fraction(t, num_layers)
    out["checkpointing"] = COSTS["checkpointing"][0] * f
    if t.activation_offloading:
        out["activation_offloading"] = (f * COSTS["offload_checkpointed"][0]
                                        + (1 - f) * COSTS["offload_saved"][0])
    if t.cpu_offload_optimizer:
        key = "cpu_offload_full" if t.method == "full" else "cpu_offload_adapters"
        out["cpu_offload_optimizer"] = COSTS[key][0]
    if t.chunked_loss > 1:
        out["chunked_loss"] = COSTS["chunked_loss"][0]
    if t.tile_tokens and t.tile_tokens < t.seq_len:
        out["tiling"] = COSTS["tiling"][0]
    if t.optimizer_in_backward:
        out["optimizer_in_backward"] = COSTS["optimizer_in_backward"][0]
    if t.optimizer in _EIGHT_BIT:
        out["optimizer"] = COSTS["optimizer_8bit"][0]
    elif t.optimizer == "ao_adamw4bit":
        out["optimizer"] = COSTS["optimizer_4bit"][0]
    if t.optimizer in _PAGED:
        out["paged_optimizer"] = COSTS["paged_optimizer"][0]
    if t.grad_accum > 1:
        tokens = t.batch_size * t.seq_len
        fixed = COSTS["micro_batch"][0]
        out["micro_batch"] = fixed / tokens - fixed / (tokens * t.grad_accum)
    if sharding is not None:
        for name, on in (("fsdp_cpu_offload", sharding.cpu_offload),
                         ("fsdp_reshard", sharding.reshard_after_forward),
                         ("fsdp_shard_embeddings", sharding.shard_embeddings)):
            if on:
                out[name] = COSTS[name][0]
    out["method"] = METHOD_FACTOR[t.method] / METHOD_FACTOR[base.method]
    bf16 = BF16_FACTOR_CUDA if cuda else 1.0
    in_bf16 = t.dtype == "bf16" or (sharding is not None and sharding.mixed_precision == "bf16")
    out["dtype"] = (bf16 if in_bf16 else 1.0) / (bf16 if base.dtype == "bf16" else 1.0)
    if t.compile:
        out["compile"] = 1.0 + COSTS["compile"][0]
    return {k: v for k, v in out.items() if v != 0.0 and not (k in _FACTORS and v == 1.0)}


_FACTORS = ("method", "dtype", "compile")


def relative_cost(t: Techniques, device: str = "cuda", *, num_layers: int | None = None,
                  baseline: Techniques | None = None, sharding=None) -> float:
    """Time of one optimizer step with ``t``, relative to a plain step (1.0).

    The plain step: the same effective batch in one micro-batch, no memory technique, and
    ``baseline``'s method and dtype. The model: (1 + the overheads of ``COSTS``) times the
    method, dtype and compile factors. Rough by design: it ranks choices, it does not time them.

    Args:
        t: The techniques.
        device: "cuda" or "cpu".
        num_layers: Makes every-N checkpointing exact (else 1/N of the layers).
        baseline: Whose method and dtype the plain step has (default: ``t``'s own).
        sharding: FSDP2's settings over several cards (``distributed.Sharding``), or None.

    Returns:
        The ratio to the plain step's time.
    """
    terms = cost_terms(t, device, num_layers=num_layers, baseline=baseline, sharding=sharding)
    cost = 1.0 + sum(v for k, v in terms.items() if k not in _FACTORS)
    for name in _FACTORS:
        cost *= terms.get(name, 1.0)
    return cost

