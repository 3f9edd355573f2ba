"""The planner: ``Techniques`` -> the built model transform and optimizer, one path per toggle.

The session's trainer, ``estimate`` and ``compare`` all build through here, so a toggle
reaches the maths in one way only. ``check`` says everything that can be known to fail
before anything is built (device rules, the model's context, which weights NF4 can hold),
so a refused change never touches the model.
"""

from __future__ import annotations

from torch import nn
# torch internal: tensor subclasses (NF4 weights) are not cast with the rest of the model.
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from .activations import set_activation_checkpointing, set_compiled, set_tiling
from .models.filling import DTYPES
from .peft import (NF4_BLOCK, LoRALinear, adapters_untrained, apply_lora, cast_model, drop_lora,
                   has_lora, is_nf4, merge_lora, replace_adapters, set_lora_options, target_of)
from .techniques import LORA_TARGETS, Techniques

# Which built component each toggle invalidates. Anything not listed is read live each step.
REBUILDS_MODEL = frozenset({"dtype", "method", "lora_rank", "lora_targets"})
RETUNES_MODEL = frozenset({"lora_alpha", "lora_dropout", "activation_checkpointing", "tile_tokens",
                           "compile"})
REBUILDS_DATA = frozenset({"seq_len", "batch_size", "seed", "packing", "objective", "reference",
                           "max_completion"})  # (GRPO's prompts must leave it room)
REBUILDS_OPTIMIZER = REBUILDS_MODEL | {"optimizer", "optimizer_in_backward", "cpu_offload_optimizer"}
# Fixed while the model is sharded over ranks: what FSDP2 sharded (the weights as method,
# dtype and the LoRA shape made them) and compile, which would wrap the hooks FSDP2 put on
# each layer. The rest of RETUNES_MODEL are flags each layer reads as it runs (checkpointing,
# tiling) or the adapters' scaling and dropout: they change on ranks as in one process.
SHARDED_FIELDS = REBUILDS_MODEL | {"compile"}
SHARDED_REASON = ("the model is sharded over ranks as these settings made it (and compile would wrap "
                  "the hooks FSDP2 put on each layer): change it in the run file and start the "
                  "ranks again")


def projections(model: nn.Module) -> set[str]:
    """The names of the projections ``model`` has that LoRA can adapt (adapted or not)."""
    return {target_of(name) for name, m in model.named_modules()
            if isinstance(m, (nn.Linear, LoRALinear))} & set(LORA_TARGETS)


def check(t: Techniques, model: nn.Module, device: str) -> list[str]:
    """Every reason ``t`` cannot be built on ``model`` on ``device``, each naming the fix."""
    problems = [rule.reason for rule in t.conflicts(device)]
    limit = model.config.max_position_embeddings
    if t.seq_len > limit:
        problems.append(f"seq_len={t.seq_len} is beyond this model's context of {limit} tokens "
                        f"(max_position_embeddings): set seq_len <= {limit}.")
    if t.method in ("lora", "qlora"):
        has = projections(model)
        if not has & set(t.lora_targets):
            problems.append(f"lora_targets={t.lora_targets} names no projection of this model; "
                            f"it has {', '.join(p for p in LORA_TARGETS if p in has)}: name some of those.")
        if t.method == "qlora":  # what QLoRA stores as NF4: the targets, and any experts
            bad = [name for name, m in model.named_modules()
                   if isinstance(m, nn.Linear) and target_of(name) in t.nf4_targets
                   and not is_nf4(m.weight) and (m.weight.dim() != 2 or m.weight.numel() % NF4_BLOCK)]
            if bad:
                problems.append(
                    f"method='qlora' cannot store {', '.join(bad[:3])}{' ...' if len(bad) > 3 else ''} "
                    f"as NF4 (it needs 2-D weights whose size is a multiple of {NF4_BLOCK}): drop "
                    "those projections from lora_targets or use method='lora'.")
    return problems


def reference_problems(new: Techniques, previous: Techniques, model: nn.Module) -> list[str]:
    """A preference objective's reference is the model as it is when the objective starts:
    with adapters already trained (sft steps, a loaded adapter), switching their update off
    would compare against the base instead, so that choice is refused, naming the one that
    keeps it (computed once from the model as it is)."""
    # (already against the base under the same kind of objective: dpo and ipo, or grpo's kl)
    same = previous.reference_kind == "adapters_off" and previous.paired == new.paired
    if new.reference_kind != "adapters_off" or same or not has_lora(model) or adapters_untrained(model):
        return []
    if new.objective == "grpo":  # its completions are new each step: nothing can be precomputed
        return ["kl > 0 measures GRPO's distance to the base (the adapters switched off), but the "
                "adapters are already trained (by earlier steps or a loaded adapter), so the base is "
                "not the model GRPO starts from: keep kl=0, or start GRPO with kl > 0 on fresh "
                "adapters."]
    return [f"objective={new.objective!r} would compare with the base (the adapters switched off), "
            "but the adapters are already trained, so that is not the model this objective starts "
            "from: set reference='precomputed' (every pair scored once by the model as it is now)."]


def transform_model(model: nn.Module, new: Techniques, previous: Techniques | None,
                    cast: bool = True) -> tuple[bool, list[str]]:
    """Bring ``model`` to ``new``'s method, dtype, checkpointing and compile, keeping what it
    learned. Returns (whether the base weights changed, messages for the user).

    Messages are returned, not printed, so a caller that has to undo the change says nothing.
    ``cast=False``: the model is already in ``new.dtype`` (the estimator casts on the meta
    device, since fake tensors cannot be swapped for cast ones).
    """
    messages, base_changed = [], False
    reshape = previous is None or bool(new.changed(previous) & {"method", "lora_rank", "lora_targets"})
    if reshape and previous is not None and previous.method == new.method == "qlora":
        # New rank or targets: fresh adapters on the same NF4 base. Folding the old ones
        # in would quantize the base again, losing precision each time.
        if cast and previous.dtype != new.dtype:
            cast_model(model, DTYPES[new.dtype])
        replace_adapters(model, new.lora_targets, new.lora_rank, new.lora_alpha,
                         new.lora_dropout, quantize_base=True)
        messages.append("new zero-initialised QLoRA adapters; the previous ones were dropped "
                        "(folding them into the NF4 base would quantize it again).")
    else:
        if reshape and adapters_untrained(model) and not any(is_nf4(p) for p in model.parameters()):
            drop_lora(model)  # never trained: nothing to fold in, the base stays as loaded
        elif reshape and has_lora(model):
            merge_lora(model)  # adapters are folded into the base, not thrown away
            base_changed = True
            messages.append("LoRA adapters merged into the base weights.")
        if cast and (previous is None or previous.dtype != new.dtype):
            cast_model(model, DTYPES[new.dtype])  # model.to(dtype) would densify NF4 weights
        if reshape:
            if new.method in ("lora", "qlora"):
                apply_lora(model, new.lora_targets, new.lora_rank, new.lora_alpha,
                           new.lora_dropout, quantize_base=new.method == "qlora")
            else:
                model.requires_grad_(True)
        elif new.method in ("lora", "qlora"):
            set_lora_options(model, new.lora_alpha, new.lora_dropout)
    set_activation_checkpointing(model, new.checkpoint_every)
    set_tiling(model, new.tile_tokens)
    if previous is None or previous.compile != new.compile:
        set_compiled(model, new.compile)
    model.train()
    return base_changed, messages


class ModelJournal:
    """What a model transform may change, noted so that ``restore`` undoes it exactly.

    Each module's attribute dict (parameters, buffers, submodules, flags such as
    ``checkpointed``) is copied shallowly, and each parameter's data tensor and
    ``requires_grad`` kept. Transforms replace tensors rather than write into them
    (``merge_lora`` assigns new weights, ``model.to`` swaps ``param.data``), so holding the
    old ones is enough. Cost: whatever the transform replaces stays alive until ``discard``
    (a dtype switch holds both copies of the weights for that moment).
    """

    def __init__(self, model: nn.Module) -> None:
        self._modules = [(m, _copied(m.__dict__)) for m in model.modules()]
        self._params = [(p, p.data, p.requires_grad) for m in model.modules()
                        for p in m._parameters.values()
                        if p is not None and not is_traceable_wrapper_subclass(p)]

    def restore(self) -> None:
        for module, saved in self._modules:
            module.__dict__.clear()
            module.__dict__.update(_copied(saved))
        for param, data, requires_grad in self._params:
            if param.untyped_storage()._cdata != data.untyped_storage()._cdata:
                param.data = data  # model.to(dtype) swapped it
            param.requires_grad_(requires_grad)

    def discard(self) -> None:
        self._modules, self._params = [], []


def _copied(attrs: dict) -> dict:
    out = dict(attrs)
    for key in ("_parameters", "_buffers", "_modules"):
        if key in out:
            out[key] = dict(out[key])
    return out
