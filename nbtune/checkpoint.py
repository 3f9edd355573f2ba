"""Saving a session: HF folders, PEFT adapters, merged weights, and exact training checkpoints.

Everything is safetensors plus JSON (never pickle), and every folder is written to a
temporary sibling and swapped in, so an interrupted save leaves the previous one intact.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from .memory import MemoryBreakdown
from .models.hf import plain_state_dict, write_atomically, write_hf_folder
from .peft import adapter_config, adapter_state_dict, has_lora, is_nf4, merged_state_dict
from .step import StepReport

ADAPTER_WEIGHTS, ADAPTER_CONFIG = "adapter_model.safetensors", "adapter_config.json"
TRAINER_STATE = "trainer_state.json"


def save_session(session, folder, merge: bool = False) -> Path:
    """Full weights as an HF folder, or (LoRA) a PEFT adapter folder; ``merge`` folds adapters in."""
    model, config = session.model, session.model.config
    if has_lora(model) and not merge:
        if session.base_changed:
            raise ValueError(
                "The base weights changed since loading (full finetuning or merged adapters), "
                "so an adapter alone would not reproduce this model. Save with merge=True.")
        state = adapter_state_dict(model)
        peft_config = adapter_config(model, session.source)

        def write(tmp: Path) -> None:
            save_file(state, str(tmp / ADAPTER_WEIGHTS), metadata={"format": "pt"})
            (tmp / ADAPTER_CONFIG).write_text(json.dumps(peft_config, indent=2))
            session.tokenizer.save(tmp)

        return write_atomically(folder, write)
    if has_lora(model):
        state = merged_state_dict(model)
        if config.tie_word_embeddings:
            state.pop("lm_head.weight", None)  # safetensors refuses shared storage
    else:
        state = plain_state_dict(model)
    return write_hf_folder(folder, state, config, session.tokenizer)


# ---- training checkpoints ---------------------------------------------------------------

def _optimizer_files(optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """Optimizer state as (tensors for safetensors, the rest as JSON)."""
    state_dict = optimizer.state_dict()
    tensors, scalars = {}, {}
    for index, entry in state_dict["state"].items():
        scalars[str(index)] = {}
        for name, value in entry.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{index}.{name}"] = value.contiguous()
            else:
                scalars[str(index)][name] = value
    return tensors, {"param_groups": state_dict["param_groups"], "scalars": scalars}


def _optimizer_state(tensors: dict, meta: dict) -> dict:
    state = {int(i): dict(values) for i, values in meta["scalars"].items()}
    for key, value in tensors.items():
        index, _, name = key.partition(".")
        state[int(index)][name] = value
    return {"state": state, "param_groups": meta["param_groups"]}


def _rng_tensors() -> dict[str, torch.Tensor]:
    out = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        out.update({f"cuda{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())})
    return out


def save_training_checkpoint(session, folder) -> Path:
    """Everything a run needs to continue exactly: weights, optimizer, RNG, data position."""
    full_weights = not has_lora(session.model) or session.base_changed
    weights = (_full_weights(session.model) if full_weights
               else adapter_state_dict(session.model))
    opt_tensors, opt_meta = _optimizer_files(session.optimizer)
    stream = session._stream
    trainer = {
        "format": 1, "source": session.source, "base_changed": session.base_changed,
        "full_weights": full_weights, "techniques": session.techniques.as_dict(),
        "steps": len(session.history), "optimizer": opt_meta,
        "data": {"seed": stream.seed, "epoch": stream.epoch, "position": stream.position,
                 "examples": len(session.train_examples)},
        "history": [{**{k: v for k, v in vars(r).items() if k != "memory"},
                     "memory": r.memory.as_dict()} for r in session.history],
    }

    def write(tmp: Path) -> None:
        save_file(weights, str(tmp / "weights.safetensors"))
        save_file(opt_tensors, str(tmp / "optimizer.safetensors"))
        save_file(_rng_tensors(), str(tmp / "rng.safetensors"))
        (tmp / TRAINER_STATE).write_text(json.dumps(trainer, indent=2))

    return write_atomically(folder, write)


def load_training_checkpoint(session, folder) -> None:
    """Bring ``session`` (same base model and data) to the checkpoint's exact training state."""
    folder = Path(folder)
    if not (folder / TRAINER_STATE).exists():
        raise FileNotFoundError(f"{folder} is not an nbtune training checkpoint (no {TRAINER_STATE}).")
    trainer = json.loads((folder / TRAINER_STATE).read_text())
    data = trainer["data"]
    if data["examples"] != len(session.train_examples):
        raise ValueError(f"The checkpoint was trained on {data['examples']} rows but this session "
                         f"has {len(session.train_examples)}: resume with the same data.")
    techniques = dict(trainer["techniques"], lora_targets=tuple(trainer["techniques"]["lora_targets"]))
    session.set(**techniques)  # builds LoRA layers, dtype, data stream, a fresh optimizer
    weights = load_file(str(folder / "weights.safetensors"))
    if trainer["full_weights"]:
        missing = _load_plain(session.model, weights)
        if missing:
            raise ValueError(f"The checkpoint lacks weights for {missing[:3]}: not this model.")
    else:
        _load_adapters(session.model, weights)
    session.optimizer.load_state_dict(_optimizer_state(
        load_file(str(folder / "optimizer.safetensors")), trainer["optimizer"]))
    rng = load_file(str(folder / "rng.safetensors"))
    torch.set_rng_state(rng["cpu"])
    if torch.cuda.is_available():
        torch.cuda.set_rng_state_all([rng[k] for k in sorted(k for k in rng if k.startswith("cuda"))])
    session._stream.epoch, session._stream.position = data["epoch"], data["position"]
    session._stream._order = session._stream._shuffle()
    session.base_changed = trainer["base_changed"]
    session.history = [StepReport(**{**r, "memory": MemoryBreakdown(**r["memory"])})
                       for r in trainer["history"]]


def _full_weights(model) -> dict[str, torch.Tensor]:
    """Weights under their parameter names, without the tied head; an NF4 weight as its parts
    (``<name>.nf4.<part>``), so a resumed run gets it bit for bit (dequantized and quantized
    again it would differ)."""
    out = {}
    for name, value in model.state_dict().items():
        if is_nf4(value):
            parts, _ = value.__tensor_flatten__()
            out.update({f"{name}.nf4.{part}": getattr(value, part).contiguous() for part in parts})
        else:
            out[name] = value.detach().contiguous()
    if model.config.tie_word_embeddings:
        out.pop("lm_head.weight", None)  # safetensors refuses shared storage
    return out


@torch.no_grad()
def _load_plain(model, weights: dict) -> list[str]:
    """Copy weights saved under ``model``'s own parameter names; return the names missing."""
    missing = []
    for name, param in model.named_parameters():  # a tied head is listed once, as the embedding
        if is_nf4(param) and f"{name}.nf4.quantized_data" in weights:
            for part in param.__tensor_flatten__()[0]:
                getattr(param, part).copy_(weights[f"{name}.nf4.{part}"])
        elif name in weights:
            param.copy_(weights[name])  # into an NF4 weight: torchao quantizes the dense value
        else:
            missing.append(name)
    return missing


@torch.no_grad()
def _load_adapters(model, weights: dict) -> None:
    params = dict(model.named_parameters())
    for key, value in weights.items():
        name = key.removeprefix("base_model.model.")
        if name not in params:
            raise ValueError(f"The checkpoint's adapter {name} does not match this model's LoRA layers.")
        params[name].copy_(value)
