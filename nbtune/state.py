"""Pieces of the training state that checkpoints, resumes and the trainer share: the RNG,
the weights as saved (NF4 as its parts), their checks, and the base model's fingerprint.

Its own floor, below the trainer and the checkpoint forms, so neither imports the other
for them."""

from __future__ import annotations

import re

import hashlib
import json
import math

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from .peft import adapter_parameters, adapter_state_dict, is_nf4


def rng_state() -> dict[str, torch.Tensor]:
    out = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        out.update({f"cuda{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())})
    return out


def rng_problem(rng) -> str | None:
    """Why ``set_rng_state`` could not apply ``rng`` here (None if it can): the names and
    dtypes ``rng_state`` writes, the sizes this PyTorch's generators have."""
    if not isinstance(rng, dict) or not all(isinstance(v, torch.Tensor) for v in rng.values()):
        return "the RNG state is not a mapping of names to tensors"
    names = sorted(rng)
    odd = [n for n in names if n != "cpu" and not re.fullmatch(r"cuda(0|[1-9][0-9]*)", n)]
    if "cpu" not in rng or odd:
        return f"it holds {names}, but an RNG state is a 'cpu' tensor and a 'cuda<N>' tensor per GPU"
    for name in names:
        tensor = rng[name]
        if tensor.dtype != torch.uint8 or tensor.dim() != 1:
            return (f"the RNG state {name!r} is {tensor.dtype} of shape {tuple(tensor.shape)}, "
                    "but RNG states are 1-D torch.uint8")
    expected = torch.get_rng_state().numel()
    if rng["cpu"].numel() != expected:
        return f"the CPU RNG state has {rng['cpu'].numel()} bytes, but this PyTorch's has {expected}"
    cuda = sorted((n for n in names if n != "cpu"), key=lambda n: int(n[4:]))
    if cuda != [f"cuda{i}" for i in range(len(cuda))]:
        return f"the GPU RNG states are {cuda}, not cuda0, cuda1, ... in order"
    if cuda and torch.cuda.is_available():
        count = torch.cuda.device_count()
        if len(cuda) > count:
            return (f"it holds the RNG states of {len(cuda)} GPUs and this machine shows "
                    f"{count}: resume where as many GPUs are visible")
        size = torch.cuda.get_rng_state().numel()
        wrong = [n for n in cuda if rng[n].numel() != size]
        if wrong:
            return (f"the GPU RNG state {wrong[0]!r} has {rng[wrong[0]].numel()} bytes, but "
                    f"this PyTorch's has {size}")
    return None


def set_rng_state(state: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["cpu"])
    cuda = sorted((k for k in state if k.startswith("cuda")), key=lambda k: int(k[4:]))
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([state[k] for k in cuda])


def full_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """Weights under their parameter names, without the tied head; an NF4 weight as its parts
    (``<name>.nf4.<part>``), so it comes back bit for bit (dequantized and quantized again it
    would differ)."""
    out = {}
    for name, value in model.state_dict().items():
        if is_nf4(value):
            parts, _ = value.__tensor_flatten__()
            out.update({f"{name}.nf4.{part}": getattr(value, part) for part in parts})
        else:
            out[name] = value.detach()
    if model.config.tie_word_embeddings:
        out.pop("lm_head.weight", None)  # one tensor with the embedding
    return out


def _expected_weights(model: nn.Module, full: bool) -> dict[str, tuple]:
    """name -> shape of what ``full_weights`` / ``adapter_state_dict`` give for ``model``."""
    if full:
        out = {}
        for name, value in model.state_dict().items():
            if is_nf4(value):
                parts, _ = value.__tensor_flatten__()
                out.update({f"{name}.nf4.{p}": tuple(getattr(value, p).shape) for p in parts})
            else:
                out[name] = tuple(value.shape)
        if model.config.tie_word_embeddings:
            out.pop("lm_head.weight", None)
        return out
    return {k: tuple(v.shape) for k, v in adapter_state_dict(model).items()}


def check_weights(model: nn.Module, weights: dict, full: bool) -> None:
    """Refuse weights whose names or shapes differ from what ``model`` holds."""
    expected = _expected_weights(model, full)
    missing = sorted(set(expected) - set(weights))
    extra = sorted(set(weights) - set(expected))
    wrong = [f"{k} {tuple(weights[k].shape)} (this model: {expected[k]})"
             for k in sorted(set(expected) & set(weights)) if tuple(weights[k].shape) != expected[k]]
    if missing or extra or wrong:
        parts = ([f"missing {missing[:3]}"] if missing else []) + \
                ([f"unknown {extra[:3]}"] if extra else []) + ([f"shape {wrong[:3]}"] if wrong else [])
        raise ValueError(f"The saved weights do not fit this model ({'; '.join(parts)}): it was "
                         "saved from another model or other LoRA settings.")


# State entries that have the shape of their parameter, in torch, bitsandbytes and torchao
# optimizers (torchao's quantized ones report the logical shape).
_PARAM_SHAPED_STATE = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "state1", "state2")


def check_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Refuse optimizer state whose per-weight tensors do not have their weight's shape."""
    for param, entry in optimizer.state.items():
        for key in _PARAM_SHAPED_STATE:
            value = entry.get(key)
            if isinstance(value, torch.Tensor) and tuple(value.shape) != tuple(param.shape):
                raise ValueError(
                    f"The saved optimizer state's {key} has shape {tuple(value.shape)} for a weight "
                    f"of shape {tuple(param.shape)}: it was saved from another model or other "
                    "LoRA settings. Nothing was loaded.")


class OptimizerGroupsDiffer(ValueError):
    """Saved ``param_groups`` unlike the run's optimizer's (``check_param_groups``)."""


def check_param_groups(optimizer: torch.optim.Optimizer, groups) -> None:
    """Refuse saved ``param_groups`` that do not have the run's groups, settings and kinds of
    value: torch's ``load_state_dict`` copies every saved setting over the run's own (a
    betas of one number would fail steps later, a NaN eps would train on)."""
    ours = optimizer.state_dict()["param_groups"]
    if not isinstance(groups, list) or len(groups) != len(ours):
        count = len(groups) if isinstance(groups, list) else repr(groups)
        raise OptimizerGroupsDiffer(f"the optimizer's param_groups are {count} groups, but this "
                                    f"run's optimizer has {len(ours)}")
    for i, (mine, saved) in enumerate(zip(ours, groups)):
        label = f"optimizer.param_groups[{i}]"
        # a setting this torch's optimizer has and the file lacks is filled in by torch (an
        # older torch wrote it); one the optimizer does not know is refused
        if not isinstance(saved, dict) or not set(saved) <= set(mine) or "params" not in saved:
            held = sorted(saved) if isinstance(saved, dict) else repr(saved)
            raise OptimizerGroupsDiffer(f"the field {label!r} holds {held}, but this run's "
                                        f"optimizer holds the settings {sorted(mine)}")
        if len(saved["params"]) != len(mine["params"]):
            raise OptimizerGroupsDiffer(f"the field '{label}.params' lists {len(saved['params'])} weights, "
                                        f"this run's optimizer {len(mine['params'])}")
        for key, value in saved.items():
            if key != "params" and not _same_kind(mine[key], value):
                raise OptimizerGroupsDiffer(f"the field '{label}.{key}' is {value!r:.60}, but this run's "
                                            f"optimizer holds {mine[key]!r:.60} there")


def _same_kind(template, value) -> bool:
    if isinstance(template, (tuple, list)):
        return (isinstance(value, (tuple, list)) and len(value) == len(template)
                and all(map(_same_kind, template, value)))
    if isinstance(template, torch.Tensor):
        return isinstance(value, torch.Tensor) and value.shape == template.shape
    if template is None or isinstance(template, (bool, str)):
        return type(value) is type(template)
    if isinstance(template, (int, float)):
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return False


@torch.no_grad()
def write_weights(model: nn.Module, weights: dict, full: bool) -> None:
    """Copy checked weights into the model's own tensors (no allocation)."""
    if not full:
        params = adapter_parameters(model)  # the names adapter_state_dict gave them
        for key, value in weights.items():
            params[key].copy_(value)
        return
    for name, value in model.state_dict(keep_vars=True).items():
        if is_nf4(value):
            for part in value.__tensor_flatten__()[0]:
                getattr(value, part).copy_(weights[f"{name}.nf4.{part}"])
        elif name in weights:
            value.copy_(weights[name])


def base_fingerprint(model: nn.Module) -> str:
    """A short hash of the config and samples of the weights QLoRA never quantizes.

    Embeddings and norms stay dense in every method, and values are rounded to bf16 before
    hashing, so the same base loaded in fp32 or bf16, dense or NF4, gives the same print,
    while another model of the same shape does not. Cheap: a few hundred values per tensor.
    """
    digest = hashlib.sha256()
    config = {k: v for k, v in model.config.to_hf().items() if k != "torch_dtype"}
    digest.update(json.dumps(config, sort_keys=True, default=str).encode())
    for name, param in model.named_parameters():
        if not (name.endswith("embed_tokens.weight") or "norm" in name) or is_nf4(param):
            continue
        numel = param.numel()
        count = min(256, numel)
        index = torch.arange(count) * (numel - 1) // max(count - 1, 1)
        if isinstance(param, DTensor):  # a rank's share: the ranks put it together
            from .shards import sampled

            sample = sampled(param, index)
        else:
            flat = param.detach().reshape(-1)
            sample = flat[index.to(flat.device)].to(torch.bfloat16).float().cpu()
        digest.update(name.encode() + str(tuple(param.shape)).encode() + sample.numpy().tobytes())
    return digest.hexdigest()[:16]
