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
from .peft import adapter_config, adapter_state_dict, has_lora, merged_state_dict
from .state import rng_state
from .step import StepReport
from .techniques import Techniques

ADAPTER_WEIGHTS, ADAPTER_CONFIG = "adapter_model.safetensors", "adapter_config.json"
TRAINER_STATE = "trainer_state.json"
FORMAT = 2  # 2: records the base model's fingerprint and the data position as a state dict
# safetensors moves all of a file's CUDA tensors to the host at once before writing, so a
# checkpoint's weights and optimizer state are written in files of at most this many bytes
# (or one tensor), one file at a time: host memory for an 8B full checkpoint stays at a
# GiB or two instead of the 15-30 GiB of one file. Trainer state lists the files.
PART_BYTES = 1 << 30


SAVE_FORMATS = ("hf", "gguf")
GGUF_FILE, MODELFILE = "model.gguf", "Modelfile"


def check_save_args(format: str, quantization: str | None) -> None:
    """Refuse bad ``save`` arguments before anything is computed or written."""
    from .models.gguf import QUANTIZATIONS

    if format not in SAVE_FORMATS:
        raise ValueError(f"format={format!r} is not one of {', '.join(map(repr, SAVE_FORMATS))}: "
                         "'hf' writes safetensors (or a PEFT adapter), 'gguf' one GGUF file.")
    if format == "gguf" and quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization={quantization!r} is not one nbtune writes to GGUF; pass one "
                         f"of {', '.join(map(repr, QUANTIZATIONS))}.")
    if format == "hf" and quantization is not None:
        raise ValueError("quantization applies to format='gguf' only; safetensors keep the "
                         "session's dtype. Pass format='gguf' or drop quantization.")


def save_gguf(session, folder, quantization: str) -> Path:
    """The full (LoRA: merged) weights as ``model.gguf`` plus an Ollama ``Modelfile``."""
    from .models.gguf import modelfile, write_gguf

    model = session.model
    state = merged_state_dict(model) if has_lora(model) else plain_state_dict(model)
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # GGUF ties by leaving output.weight out
    name = Path(session.source).stem if session.source else "nbtune model"

    def write(tmp: Path) -> None:
        write_gguf(tmp / GGUF_FILE, state, model.config, session.tokenizer, quantization,
                   name=f"{name} (nbtune)")
        (tmp / MODELFILE).write_text(modelfile(GGUF_FILE, session.tokenizer))

    return write_atomically(folder, write)


def save_session(session, folder, merge: bool = False, format: str = "hf",
                 quantization: str | None = None) -> Path:
    """Full weights as an HF folder, or (LoRA) a PEFT adapter folder; ``merge`` folds adapters
    in. ``format="gguf"``: one GGUF file (always full weights) and an Ollama Modelfile."""
    check_save_args(format, quantization)
    if format == "gguf":
        return save_gguf(session, folder, quantization)
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


def save_sharded_session(session, folder, merge: bool = False, format: str = "hf",
                         quantization: str | None = None) -> Path:
    """``save_session`` under torchrun: every rank gathers the shards, rank 0 writes."""
    import types

    from .distributed import unsharded_copy

    whole = unsharded_copy(session.model, session.techniques)
    if session.parallel.rank == 0:
        view = types.SimpleNamespace(model=whole, tokenizer=session.tokenizer, source=session.source,
                                     base_changed=session.base_changed)
        save_session(view, folder, merge=merge, format=format, quantization=quantization)
    del whole
    session.parallel.barrier()
    return Path(folder)


# ---- training checkpoints ---------------------------------------------------------------

def _optimizer_files(state_dict: dict) -> tuple[dict, dict]:
    """An optimizer state dict as (tensors for safetensors, the rest as JSON)."""
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


def history_rows(history) -> list[dict]:
    """Step reports as JSON-ready dicts (``history_from_rows`` reads them back)."""
    return [{**{k: v for k, v in vars(r).items() if k != "memory"}, "memory": r.memory.as_dict()}
            for r in history]


def history_from_rows(rows: list[dict]) -> list[StepReport]:
    return [StepReport(**{**r, "shape": tuple(r.get("shape", (0, 0))),
                          "memory": MemoryBreakdown(**r["memory"])}) for r in rows]


def parts(tensors: dict[str, torch.Tensor], stem: str) -> list[tuple[str, dict]]:
    """(file name, tensors) of ``stem`` cut into files of at most ``PART_BYTES`` (a larger
    tensor alone): ``stem.safetensors`` when one file holds them all, else
    ``stem-00001-of-00003.safetensors`` and so on."""
    groups: list[dict] = [{}]
    size = 0
    for key, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if groups[-1] and size + nbytes > PART_BYTES:
            groups.append({})
            size = 0
        groups[-1][key] = tensor
        size += nbytes
    if len(groups) == 1:
        return [(f"{stem}.safetensors", groups[0])]
    return [(f"{stem}-{i:05d}-of-{len(groups):05d}.safetensors", group)
            for i, group in enumerate(groups, 1)]


def save_checkpoint(trainer, folder, source: str | None = None, parallel=None) -> Path:
    """Everything a run needs to continue exactly, in ``folder``: the trainer's whole
    ``state_dict`` (under torchrun, each rank's shards through torch.distributed.checkpoint).
    ``source``: where the base model came from, recorded for the reader."""
    if parallel is not None:
        return _save_sharded(trainer, folder, parallel, source)
    path = _save_single(trainer, folder, source)
    trainer.note_checkpoint(path)
    return path


def load_checkpoint(trainer, folder, parallel=None) -> None:
    """Bring ``trainer`` (same base model and data) to the checkpoint's exact training state
    through its own ``load_state_dict``: the whole checkpoint is read and checked first."""
    if parallel is not None:
        _load_sharded(trainer, folder, parallel)
        return
    trainer.load_state_dict(read_training_checkpoint(folder))
    trainer.note_checkpoint(folder)


def _save_single(trainer, folder, source: str | None) -> Path:
    state = trainer.state_dict()
    weights = parts({k: v.contiguous() for k, v in state["weights"].items()}, "weights")
    opt_tensors, opt_meta = _optimizer_files(state["optimizer"])
    optimizer = parts(opt_tensors, "optimizer")
    trainer = {
        "format": FORMAT, "source": source, "base_changed": state["base_changed"],
        "base_fingerprint": state["base_fingerprint"], "full_weights": state["full_weights"],
        "techniques": state["techniques"].as_dict(), "steps": len(state["history"]),
        "optimizer": opt_meta, "data": state["data"],
        "history": history_rows(state["history"]),
        "files": {"weights": [name for name, _ in weights],
                  "optimizer": [name for name, _ in optimizer]},
    }

    def write(tmp: Path) -> None:
        for name, tensors in weights + optimizer:  # one file at a time: see PART_BYTES
            save_file(tensors, str(tmp / name))
        save_file(state["rng"], str(tmp / "rng.safetensors"))
        (tmp / TRAINER_STATE).write_text(json.dumps(trainer, indent=2))

    return write_atomically(folder, write)


def read_training_checkpoint(folder) -> dict:
    """A checkpoint folder as a trainer state dict; every file is read and checked first."""
    folder = Path(folder)
    if not folder.is_dir() or not (folder / TRAINER_STATE).is_file():
        raise FileNotFoundError(f"{folder} is not an nbtune training checkpoint (no {TRAINER_STATE}): "
                                "give the folder that session.save_checkpoint wrote.")
    try:
        trainer = json.loads((folder / TRAINER_STATE).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{folder / TRAINER_STATE} is damaged ({err}). Nothing was loaded.") from None
    if not isinstance(trainer, dict) or trainer.get("format") != FORMAT:
        version = trainer.get("format") if isinstance(trainer, dict) else None
        raise ValueError(f"{folder} was written by another version of nbtune (format "
                         f"{version!r}, this one reads {FORMAT}): it records no "
                         "fingerprint of its base model, so it cannot be checked. Save it again.")
    files = trainer.get("files") or {"weights": ["weights.safetensors"],
                                     "optimizer": ["optimizer.safetensors"]}
    names = {part: [str(name) for name in files.get(part, [])] for part in ("weights", "optimizer")}
    names["rng"] = ["rng.safetensors"]
    listed = [name for group in names.values() for name in group]
    if any(Path(name).name != name for name in listed):  # a name must stay in the folder
        raise ValueError(f"{folder / TRAINER_STATE} names files outside the checkpoint folder: "
                         "it is damaged. Nothing was loaded.")
    absent = [name for name in listed if not (folder / name).is_file()]
    if absent:
        raise FileNotFoundError(f"The checkpoint {folder} is incomplete: {', '.join(absent)} missing. "
                                "Nothing was loaded; save the checkpoint again.")
    tensors = {}
    for part, group in names.items():
        tensors[part] = {}
        for name in group:
            try:
                tensors[part].update(load_file(str(folder / name)))
            except Exception as err:  # safetensors raises its own error types
                raise ValueError(f"{folder / name} is damaged ({err}). Nothing was loaded.") from None
    techniques = dict(trainer["techniques"], lora_targets=tuple(trainer["techniques"]["lora_targets"]))
    return {
        "techniques": Techniques(**techniques),
        "full_weights": trainer["full_weights"],
        "weights": tensors["weights"],
        "optimizer": _optimizer_state(tensors["optimizer"], trainer["optimizer"]),
        "data": trainer["data"],
        "rng": tensors["rng"],
        "history": history_from_rows(trainer["history"]),
        "base_changed": trainer["base_changed"],
        "base_fingerprint": trainer["base_fingerprint"],
    }


# ---- sharded (torchrun, FSDP2) ----------------------------------------------------------

def _save_sharded(trainer, folder, parallel, source: str | None) -> Path:
    """torch.distributed.checkpoint's folder (each rank writes its shards) plus rank 0's JSON
    of the rest; written beside and renamed, so a crash keeps the old one."""
    import shutil

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    folder = Path(folder)
    tmp = folder.with_name(folder.name + ".tmp")
    if parallel.rank == 0 and tmp.exists():
        shutil.rmtree(tmp)
    parallel.barrier()
    frozen = any(not p.requires_grad for p in trainer.model.parameters())
    model_sd, optim_sd = get_state_dict(trainer.model, trainer.optimizer,
                                        options=StateDictOptions(ignore_frozen_params=frozen))
    dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=str(tmp / "shards"))
    save_file(rng_state(), str(tmp / f"rng.rank{parallel.rank}.safetensors"))
    if parallel.rank == 0:
        (tmp / TRAINER_STATE).write_text(json.dumps({
            "source": source, "sharded": True, "world": parallel.world, "frozen_skipped": frozen,
            "techniques": trainer.techniques.as_dict(), "data": trainer.stream.state_dict(),
            "history": history_rows(trainer.history), "base_fingerprint": trainer.base_fingerprint,
            "base_changed": trainer.base_changed}, indent=2))
    parallel.barrier()
    if parallel.rank == 0:
        if folder.exists():
            shutil.rmtree(folder)
        tmp.rename(folder)
    parallel.barrier()
    return folder


def _load_sharded(trainer, folder, parallel) -> None:
    """Continue from ``_save_sharded``'s folder: same run file, same number of ranks. Every
    rank reads its shards into its model and optimizer; the rest goes through the trainer's
    ``load_state_dict(placed=True)``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    folder = Path(folder)
    about = json.loads((folder / TRAINER_STATE).read_text())
    if not about.get("sharded"):
        raise ValueError(f"{folder} is a single-process checkpoint; resume it without torchrun.")
    if about["world"] != parallel.world:
        raise ValueError(f"{folder} was saved by {about['world']} ranks; this job has "
                         f"{parallel.world}: resume with --nproc_per_node {about['world']}.")
    saved = Techniques(**{**about["techniques"], "lora_targets": tuple(about["techniques"]["lora_targets"])})
    if saved != trainer.techniques or about["base_fingerprint"] != trainer.base_fingerprint:
        raise ValueError(f"{folder} was saved with other techniques or another base model than "
                         "this run file's: resume with the run file that wrote it.")
    trainer.stream.check_state(about["data"])  # before any shard is read in
    options = StateDictOptions(ignore_frozen_params=about["frozen_skipped"])
    model_sd, optim_sd = get_state_dict(trainer.model, trainer.optimizer, options=options)
    state = {"model": model_sd, "optimizer": optim_sd}
    dcp.load(state, checkpoint_id=str(folder / "shards"))
    set_state_dict(trainer.model, trainer.optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optimizer"], options=options)
    trainer.load_state_dict({
        "techniques": saved, "full_weights": None, "weights": None, "optimizer": None,
        "data": about["data"], "history": history_from_rows(about["history"]),
        "rng": load_file(str(folder / f"rng.rank{parallel.rank}.safetensors")),
        "base_changed": about["base_changed"], "base_fingerprint": about["base_fingerprint"]},
        placed=True)
