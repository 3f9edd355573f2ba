"""Hugging Face folders in and out: config.json + *.safetensors (never pickle)."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from .config import ModelConfig
from .decoder import CausalLM

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
          "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_folder(path_or_id: str | os.PathLike, revision: str | None = None) -> Path:
    """A local folder as is; otherwise a Hub repo id fetched (safetensors and json only)."""
    path = Path(path_or_id).expanduser()
    if path.is_dir():
        return path
    name = str(path_or_id)
    if path.exists() or name.startswith((".", "/", "~")) or name.count("/") != 1:
        raise FileNotFoundError(
            f"{name!r} is neither a model folder nor a Hub repo id ('owner/name'). "
            "Give a folder holding config.json and *.safetensors, or a repo id.")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(
            name, revision=revision,
            allow_patterns=["*.json", "*.safetensors", "tokenizer.model"]))
    except LocalEntryNotFoundError as err:
        raise FileNotFoundError(
            f"{name!r} is not in the local Hugging Face cache and the Hub cannot be reached "
            "(offline, or HF_HUB_OFFLINE=1). Download it once with network access, "
            "or pass a local folder.") from err


def _weight_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / s for s in shards]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        pickles = [p.name for p in folder.glob("*.bin")] + [p.name for p in folder.glob("*.pt")]
        hint = (f" It holds {', '.join(pickles)}: nbtune never loads pickle files; convert "
                "them to safetensors first.") if pickles else ""
        raise FileNotFoundError(f"No *.safetensors weights in {folder}.{hint}")
    return files


def load_model(path_or_id: str | os.PathLike, dtype: str | torch.dtype = "fp32",
               device: str | torch.device = "cpu", revision: str | None = None) -> CausalLM:
    """Load a Hugging Face-format causal LM folder (or Hub repo id) into nbtune's decoder.

    The model is built on the meta device and filled shard by shard, so no random
    weights are ever materialised and each tensor is cast as it is read.
    """
    folder = resolve_folder(path_or_id, revision)
    config = ModelConfig.from_file(folder / "config.json")
    dtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
    with torch.device("meta"):
        model = CausalLM(config)
    expected = {k: v for k, v in model.state_dict().items()}
    if config.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    loaded: dict[str, torch.Tensor] = {}
    for file in _weight_files(folder):
        try:
            with safe_open(str(file), framework="pt", device="cpu") as shard:
                for key in shard.keys():
                    if key not in expected:
                        if key == "lm_head.weight" and config.tie_word_embeddings:
                            continue  # some tied checkpoints still store the head
                        raise ValueError(
                            f"{file.name} holds {key!r}, which a {config.model_type} model with this "
                            "config.json does not have: config and weights disagree.")
                    tensor = shard.get_tensor(key)
                    if tuple(tensor.shape) != tuple(expected[key].shape):
                        raise ValueError(
                            f"{key} in {file.name} has shape {tuple(tensor.shape)} but config.json "
                            f"implies {tuple(expected[key].shape)}: config and weights disagree.")
                    loaded[key] = tensor.to(device=device, dtype=dtype)
        except (SafetensorError, OSError) as err:
            raise ValueError(f"Cannot read {file}: the file is damaged or not safetensors "
                             f"({err}). Download or save it again.") from err
    missing = sorted(set(expected) - set(loaded))
    if missing:
        raise ValueError(f"{folder} lacks weights for {missing[:4]}{' ...' if len(missing) > 4 else ''}: "
                         "config and weights disagree.")
    model.load_state_dict(loaded, assign=True, strict=False)
    model.tie_weights()
    return model


def plain_state_dict(model: CausalLM) -> dict[str, torch.Tensor]:
    """Weights under HF names, without the tied head (safetensors refuses shared storage)."""
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return state


def write_atomically(folder: str | os.PathLike, write) -> Path:
    """Run ``write(tmp_dir)`` then swap tmp_dir into place: a crash leaves the old folder intact."""
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        write(tmp)
        if folder.exists():
            old = folder.with_name(f".{folder.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            folder.rename(old)
            tmp.rename(folder)
            shutil.rmtree(old)
        else:
            tmp.rename(folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return folder


def save_model(model: CausalLM, folder: str | os.PathLike, tokenizer=None) -> Path:
    """Write ``model`` (and its tokenizer) as a Hugging Face folder that transformers loads."""
    state = plain_state_dict(model)
    unknown = [k for k in state if "lora_" in k or "base_layer" in k]
    if unknown:
        raise ValueError("The model still carries LoRA layers; merge them first "
                         "(nbtune.peft.merge_lora) to save full weights.")
    dtype = next(iter(state.values())).dtype
    hf_config = model.config.to_hf()
    hf_config["torch_dtype"] = str(dtype).removeprefix("torch.")

    def write(tmp: Path) -> None:
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(hf_config, indent=2))
        if tokenizer is not None:
            tokenizer.save(tmp)

    return write_atomically(folder, write)
