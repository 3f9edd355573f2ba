"""Loading a model from wherever it lives: an HF folder, a Hub repo id or a ``.gguf`` file.
Above both readers (``hf``, ``gguf``), which share ``filling`` and never import each other."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Collection

import torch

from ..hub import resolve_model_folder
from .config import ModelConfig
from .decoder import CausalLM
from .filling import torch_dtype
from .gguf import GGUFFile, config_from_gguf, gguf_weights, is_gguf, load_gguf_model
from .hf import folder_weights, load_folder


def load_model(path_or_id: str | os.PathLike, dtype: str | torch.dtype = "fp32",
               device: str | torch.device = "cpu", revision: str | None = None,
               quantize: Collection[str] = ()) -> CausalLM:
    """Load a causal LM into nbtune's decoder, without a session.

    The model is built on the meta device (no random weights are ever made) and filled tensor
    by tensor, each cast as it is read (see ``_read_tensor``), so host memory peaks near one
    copy of the weights in the target dtype.

    Args:
        path_or_id: A Hugging Face-format folder, a Hub repo id, or a ``.gguf`` file
            (dequantized as read, see ``models.gguf``).
        dtype: "fp32" or "bf16" (or a torch dtype).
        device: Where the weights go.
        revision: The Hub revision of ``path_or_id``.
        quantize: Projections to store as frozen NF4 (QLoRA's base) as each is read, by their
            last name part as ``Techniques.lora_targets`` names them (``("q_proj", "v_proj")``):
            no more than one of them is ever dense. ``apply_lora(..., quantize_base=True)`` keeps
            them as they are.

    Returns:
        The ``CausalLM``.

    Raises:
        ConfigError: The config.json is refused (an unsupported family, a missing field).
    """
    dtype = torch_dtype(dtype)  # before any file is read or fetched
    if isinstance(path_or_id, GGUFFile) or is_gguf(path_or_id):
        return load_gguf_model(path_or_id, dtype, device, quantize)
    folder = resolve_model_folder(path_or_id, revision)
    return load_folder(folder, dtype, device, quantize)


@torch.no_grad()
def reload_weights_(model: CausalLM, source) -> None:
    """Write the base weights of ``source`` (a folder or parsed GGUF file, the one ``model``
    was loaded from) into ``model``'s own tensors, one at a time: the model is back at its
    weights as loaded, with no second copy on the device or the host. Dense models only
    (full finetuning); a failure part-way leaves some weights reloaded and others not."""
    targets = {k: v for k, v in model.state_dict(keep_vars=True).items()
               if not (k == "lm_head.weight" and model.config.tie_word_embeddings)}
    dtype = next(iter(targets.values())).dtype
    device = next(iter(targets.values())).device
    written = set()
    for key, tensor in weight_stream(source, model.config, targets, dtype, device):
        targets[key].copy_(tensor)
        written.add(key)
    missing = sorted(set(targets) - written)
    if missing:
        raise ValueError(f"{source} lacks weights for {missing[:4]}: the model cannot be reloaded "
                         "from it.")


def weight_stream(source, config, expected: dict, dtype: torch.dtype, device, rows=None):
    """(name, tensor) for each weight of ``source`` (a resolved folder or parsed GGUF file),
    one at a time, checked against ``expected``; ``rows(name)``: the part of its first
    dimension to read, or None for all (see ``hf.folder_weights``)."""
    if isinstance(source, GGUFFile):
        return gguf_weights(source, config, expected, dtype, device, rows)
    return folder_weights(Path(source), config, expected, dtype, device, rows)


def read_config(source) -> ModelConfig:
    """The model config of a resolved folder (its config.json) or a parsed GGUF file."""
    if isinstance(source, GGUFFile):
        return config_from_gguf(source)
    return ModelConfig.from_file(Path(source) / "config.json")
