"""Saving a session: HF folders, PEFT adapters, merged weights, and exact training checkpoints.

Everything is safetensors plus JSON (never pickle, sharded checkpoints included), and every
folder is written to a temporary sibling and swapped in, so an interrupted save leaves the
previous one intact. Loading a checkpoint reads and checks every file and field first
(through the trust boundary, ``files``), so a damaged one is refused before any of it is
applied.

This module is single-process. Under torchrun (sharded checkpoints, one set of files per
rank, and a session's weights gathered to rank 0) see ``sharded_checkpoint``, which builds on
the helpers here and picks single-process or sharded for ``Session``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from .files import FileRefused, inside, read_json, shown
from .memory import MemoryBreakdown
from .memory.usage import SOURCES, Usage
from .models.filling import check_finite
from .objectives.grpo import RolloutMetrics
from .objectives.preference import PreferenceMetrics
from .models.hf import (PART_BYTES, dense_weights, stream_safetensors, write_atomically,
                        write_hf_folder)
from .peft import AdapterWeights, adapter_config, has_lora
from .state import OptimizerGroupsDiffer, rng_problem
from .step import StepReport
from .techniques import Techniques

from .adapters import ADAPTER_CONFIG, ADAPTER_WEIGHTS, BASE_NOTE, TECHNIQUES_NOTE, base_name  # noqa: E402
TRAINER_STATE = "trainer_state.json"
FORMAT = 2  # 2: records the base model's fingerprint and the data position as a state dict
# safetensors moves all of a file's CUDA tensors to the host at once before writing, so a
# checkpoint's weights and optimizer state are written in files of at most PART_BYTES
# (or one tensor), one file at a time: host memory for an 8B full checkpoint stays at a
# GiB or two instead of the 15-30 GiB of one file. Trainer state lists the files.


SAVE_FORMATS = ("hf", "gguf")
GGUF_FILE, MODELFILE = "model.gguf", "Modelfile"


def check_save_args(format: str, quantization: str | None) -> None:
    """Refuse bad ``save`` arguments before anything is computed or written."""
    from .models.gguf import QUANTIZATIONS
    from .models.kquants import K_QUANTS, llama_cpp

    if format not in SAVE_FORMATS:
        raise ValueError(f"format={format!r} is not one of {', '.join(map(repr, SAVE_FORMATS))}: "
                         "'hf' writes safetensors (or a PEFT adapter), 'gguf' one GGUF file.")
    if format == "gguf" and quantization not in QUANTIZATIONS + tuple(K_QUANTS):
        raise ValueError(f"quantization={quantization!r} is not one nbtune writes to GGUF; pass one "
                         f"of {', '.join(map(repr, QUANTIZATIONS + tuple(K_QUANTS)))}.")
    if format == "gguf" and quantization in K_QUANTS:
        llama_cpp()  # llama.cpp's quantizer is there, or say how to get it before writing
    if format == "hf" and quantization is not None:
        raise ValueError("quantization applies to format='gguf' only; safetensors keep the "
                         "session's dtype. Pass format='gguf' or drop quantization.")


def save_gguf(session, folder, quantization: str, state=None) -> Path:
    """The full (LoRA: merged) weights as ``model.gguf`` plus an Ollama ``Modelfile``;
    ``state``: the weights to write (default ``dense_weights`` of the session's model)."""
    from .models.gguf import modelfile, write_gguf
    from .models.kquants import K_QUANTS, quantize

    model = session.model
    if state is None:  # made one at a time as written; GGUF too ties by leaving the head out
        state = dense_weights(model)
    name = Path(session.source).stem if session.source else "nbtune model"

    def write(tmp: Path) -> None:
        if quantization in K_QUANTS:  # llama.cpp quantizes the f16 file, which then goes
            plain = write_gguf(tmp / "model-f16.gguf", state, model.config, session.tokenizer,
                               "f16", name=f"{name} (nbtune)")
            quantize(plain, tmp / GGUF_FILE, quantization)
            plain.unlink()
        else:
            write_gguf(tmp / GGUF_FILE, state, model.config, session.tokenizer, quantization,
                       name=f"{name} (nbtune)")
        (tmp / MODELFILE).write_text(modelfile(GGUF_FILE, session.tokenizer))

    return write_atomically(folder, write)


def save_session(session, folder, merge: bool = False, format: str = "hf",
                 quantization: str | None = None, gathered=None) -> Path:
    """Full weights as an HF folder, or (LoRA) a PEFT adapter folder; ``merge`` folds adapters
    in. ``format="gguf"``: one GGUF file (always full weights) and an Ollama Modelfile. Every
    weight is made as it is written. ``gathered(weights)``: what makes them across ranks
    (``shards.Gathered``), given the model's."""
    check_save_args(format, quantization)
    model, config = session.model, session.model.config
    gathered = gathered or (lambda weights: weights)
    if format == "gguf":
        return save_gguf(session, folder, quantization, gathered(dense_weights(model)))
    if has_lora(model) and not merge:
        if session.base_changed:
            raise ValueError(
                "The base weights changed since loading (full finetuning or merged adapters), "
                "so an adapter alone would not reproduce this model. Save with merge=True.")
        state = gathered(AdapterWeights(model))
        name, note = base_name(session.source)
        peft_config = adapter_config(model, name)

        def write(tmp: Path) -> None:
            stream_safetensors(tmp / ADAPTER_WEIGHTS, state, metadata={"format": "pt"})
            (tmp / ADAPTER_CONFIG).write_text(json.dumps(peft_config, indent=2))
            if note is not None:
                (tmp / BASE_NOTE).write_text(json.dumps(note, indent=2))
            (tmp / TECHNIQUES_NOTE).write_text(json.dumps(session.techniques.as_dict(), indent=2))
            session.tokenizer.save(tmp)

        return write_atomically(folder, write)
    return write_hf_folder(folder, gathered(dense_weights(model)), config, session.tokenizer)


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
    return [{**{k: v for k, v in vars(r).items() if k not in ("memory", "usage", "rollouts") + _PREFERENCES},
             "memory": r.memory.as_dict(), "usage": r.usage.as_dict() if r.usage else None,
             "rollouts": dataclasses.asdict(r.rollouts) if r.rollouts else None,
             **{k: dataclasses.asdict(getattr(r, k)) if getattr(r, k) else None for k in _PREFERENCES}}
            for r in history]


def history_from_rows(rows: list[dict]) -> list[StepReport]:
    return [StepReport(**{**r, "shape": tuple(r.get("shape", (0, 0))),
                          "memory": MemoryBreakdown(**r["memory"]),
                          "usage": Usage(**r["usage"]) if r.get("usage") else None,
                          "rollouts": RolloutMetrics(**r["rollouts"]) if r.get("rollouts") else None,
                          **{k: PreferenceMetrics(**r[k]) if r.get(k) else None for k in _PREFERENCES}})
            for r in rows]


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


def save_checkpoint(trainer, folder, source: str | None = None) -> Path:
    """Everything a run needs to continue exactly, in ``folder``: the trainer's whole
    ``state_dict`` (under torchrun, each rank its own shards: ``sharded_checkpoint``).
    ``source``: where the base model came from, recorded for the reader."""
    path = _save_single(trainer, folder, source)
    trainer.note_checkpoint(path)
    return path


def load_checkpoint(trainer, folder) -> None:
    """Bring ``trainer`` (same base model and data) to the checkpoint's exact training state
    through its own ``load_state_dict``: the whole checkpoint is read and checked first."""
    state = read_training_checkpoint(folder)
    try:
        trainer.load_state_dict(state)
    except OptimizerGroupsDiffer as err:  # named with the file that holds them
        raise refused(Path(folder) / TRAINER_STATE, str(err)) from None
    trainer.note_checkpoint(folder)


def _save_single(trainer, folder, source: str | None) -> Path:
    state = trainer.state_dict()
    weights = parts({k: v.contiguous() for k, v in state["weights"].items()}, "weights")
    opt_tensors, opt_meta = _optimizer_files(state["optimizer"])
    optimizer = parts(opt_tensors, "optimizer")
    copy = parts({k: v.contiguous() for k, v in state["reference_copy"].items()}, "reference_copy") \
        if state.get("reference_copy") is not None else []  # a full finetune's reference (kept: see above)
    trainer = {
        "format": FORMAT, "source": source, "base_changed": state["base_changed"],
        "base_fingerprint": state["base_fingerprint"], "full_weights": state["full_weights"],
        "techniques": state["techniques"].as_dict(), "steps": len(state["history"]),
        "optimizer": opt_meta, "data": state["data"],
        "history": history_rows(state["history"]),
        "files": {"weights": [name for name, _ in weights],
                  "optimizer": [name for name, _ in optimizer],
                  **({"reference_logps": ["reference_logps.safetensors"]} if state.get("reference_logps") is not None else {}),
                  **({"reference_copy": [name for name, _ in copy]} if copy else {})},
    }

    def write(tmp: Path) -> None:
        for name, tensors in weights + optimizer + copy:  # one file at a time: see PART_BYTES
            save_file(tensors, str(tmp / name))
        save_file(state["rng"], str(tmp / "rng.safetensors"))
        if state.get("reference_logps") is not None:  # the weights it came from may be gone: kept
            save_file({"reference_logps": state["reference_logps"].contiguous()}, str(tmp / "reference_logps.safetensors"))
        (tmp / TRAINER_STATE).write_text(json.dumps(trainer, indent=2))

    return write_atomically(folder, write)


# ---- reading a checkpoint: every file and field checked before anything is applied -------

class CheckpointRefused(FileRefused):
    """A training checkpoint nbtune will not load (damaged, edited, or written for another
    run), naming the file and the field or tensor; nothing was loaded. A ``ValueError``."""


AGAIN = "Nothing was loaded; resume from another checkpoint, or save this one again."


def refused(path, problem: str) -> CheckpointRefused:
    return CheckpointRefused(f"{path}: {problem}. {AGAIN}")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


_KINDS = {
    "an integer": _is_int,
    "a number": is_number,
    "a number or null": lambda v: v is None or is_number(v),
    "true or false": lambda v: isinstance(v, bool),
    "a string": lambda v: isinstance(v, str),
    "a string or null": lambda v: v is None or isinstance(v, str),
    "an object": lambda v: isinstance(v, dict),
    "a list": lambda v: isinstance(v, list),
}


def state_field(record: dict, name: str, kind: str, path, where: str = ""):
    """``record[name]``, refused naming the file and the field when absent or not ``kind``."""
    label = where + name
    if name not in record:
        raise refused(path, f"the field {label!r} is missing")
    value = record[name]
    if not _KINDS[kind](value):
        raise refused(path, f"the field {label!r} is {shown(value)}, but it must be {kind}")
    return value


def read_state_json(path: Path, what: str = "training checkpoint state") -> dict:
    """A checkpoint's JSON through the trust boundary (bounded, regular file, an object)."""
    try:
        return read_json(path, what, "state_bytes")
    except FileRefused as err:
        detail = str(err)
        if detail.startswith(str(path)):
            detail = "it" + detail[len(str(path)):]
        raise CheckpointRefused(f"{path} is damaged: {detail} {AGAIN}") from None


def _techniques(raw: dict, path) -> Techniques:
    known = {f.name for f in dataclasses.fields(Techniques)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise refused(path, f"the field 'techniques' names techniques this nbtune does not know "
                             f"({', '.join(unknown)})")
    values = dict(raw)
    if "lora_targets" in raw:
        targets = state_field(raw, "lora_targets", "a list", path, "techniques.")
        if not all(isinstance(t, str) for t in targets):
            raise refused(path, f"the field 'techniques.lora_targets' is {shown(targets)}, but it "
                                 "must be a list of strings")
        values["lora_targets"] = tuple(targets)
    if "seed" in raw:
        state_field(raw, "seed", "an integer", path, "techniques.")
    try:
        return Techniques(**values)
    except (TypeError, ValueError) as err:
        raise refused(path, f"the field 'techniques' does not hold valid techniques ({err})") from None


_ROW_FIELDS = (("step", "an integer"), ("loss", "a number"), ("tokens", "an integer"),
               ("trained_tokens", "an integer"), ("seconds", "a number"), ("lr", "a number"),
               ("memory", "an object"))
_MEMORY_NUMBERS = tuple(f.name for f in dataclasses.fields(MemoryBreakdown) if type(f.default) is int)
_PREFERENCE_NUMBERS = tuple(f.name for f in dataclasses.fields(PreferenceMetrics))
_PREFERENCES = ("preference", "eval_preference")  # a step's PreferenceMetrics, as JSON objects
_ROLLOUT_NUMBERS = tuple(f.name for f in dataclasses.fields(RolloutMetrics) if f.name != "rewards")


def _rollouts(row: dict, path, where: str) -> None:
    """GRPO's ``rollouts`` of a history row: its numbers, and each reward function's mean."""
    metrics = state_field(row, "rollouts", "an object", path, where)
    if set(metrics) != {*_ROLLOUT_NUMBERS, "rewards"}:
        raise refused(path, f"the field '{where}rollouts' must hold exactly "
                            f"{', '.join(_ROLLOUT_NUMBERS)} and rewards")
    for name in _ROLLOUT_NUMBERS:
        state_field(metrics, name, "a number", path, f"{where}rollouts.")
    rewards = state_field(metrics, "rewards", "an object", path, f"{where}rollouts.")
    for name in rewards:
        state_field(rewards, name, "a number", path, f"{where}rollouts.rewards.")


def _history(rows: list, path) -> list[StepReport]:
    out = []
    for i, row in enumerate(rows):
        where = f"history[{i}]."
        if not isinstance(row, dict):
            raise refused(path, f"the field 'history[{i}]' is {shown(row)}, but it must be an object")
        for name, kind in _ROW_FIELDS:
            state_field(row, name, kind, path, where)
        if row.get("rollouts") is not None:
            _rollouts(row, path, where)
        for name in ("eval_loss", "router_loss", "mean_kl"):
            if name in row:
                state_field(row, name, "a number or null", path, where)
        for key in (k for k in _PREFERENCES if row.get(k) is not None):
            metrics = state_field(row, key, "an object", path, where)
            for name in _PREFERENCE_NUMBERS:
                state_field(metrics, name, "a number", path, f"{where}{key}.")
            if set(metrics) != set(_PREFERENCE_NUMBERS):
                raise refused(path, f"the field '{where}{key}' must hold exactly "
                                     f"{', '.join(_PREFERENCE_NUMBERS)}")
        if "shape" in row:
            shape = state_field(row, "shape", "a list", path, where)
            if len(shape) != 2 or not all(_is_int(n) for n in shape):
                raise refused(path, f"the field '{where}shape' is {shown(shape)}, but it must be "
                                     "[batch, sequence]")
        for name in _MEMORY_NUMBERS:
            if name in row["memory"]:
                state_field(row["memory"], name, "a number", path, where + "memory.")
        if row.get("usage") is not None:
            usage = state_field(row, "usage", "an object", path, where)
            for name in ("peak", "reserved") + (("runtime",) if "runtime" in usage else ()):
                if state_field(usage, name, "an integer", path, where + "usage.") < 0:
                    raise refused(path, f"the field '{where}usage.{name}' is negative")
            if state_field(usage, "source", "a string", path, where + "usage.") not in SOURCES:
                raise refused(path, f"the field '{where}usage.source' must be one of "
                                    f"{', '.join(SOURCES)}")
        try:
            out += history_from_rows([row])
        except (TypeError, ValueError) as err:
            raise refused(path, f"the field 'history[{i}]' is not a step report ({err})") from None
    return out


def common_fields(state: dict, path) -> dict:
    """The fields single-process and sharded checkpoints share, checked and parsed."""
    techniques = _techniques(state_field(state, "techniques", "an object", path), path)
    data = state_field(state, "data", "an object", path)
    streamed = "streamed" in data  # a streamed file's position: what decides its order, not a count
    for name in ("seed", "epoch", "position") + (() if streamed else ("samples",)):
        state_field(data, name, "an integer", path, "data.")
    if streamed:
        state_field(data, "streamed", "a list", path, "data.")
    if "source" in state:
        state_field(state, "source", "a string or null", path)
    return {"techniques": techniques, "data": data,
            "history": _history(state_field(state, "history", "a list", path), path),
            "base_changed": state_field(state, "base_changed", "true or false", path),
            "base_fingerprint": state_field(state, "base_fingerprint", "a string", path)}


def check_rng(rng: dict[str, torch.Tensor], path) -> dict[str, torch.Tensor]:
    """``rng`` if ``state.set_rng_state`` can apply it here, else refused naming ``path``:
    checked before anything else is applied, since the RNG is restored last."""
    problem = rng_problem(rng)
    if problem:
        raise refused(path, problem)
    return rng


def load_tensors(path: Path) -> dict[str, torch.Tensor]:
    """A checkpoint file's tensors, refused (naming file and tensor) if any holds NaN or
    infinity, as a model's weights are: a diverged run's state would train on silently."""
    try:
        tensors = load_file(str(path))
    except Exception as err:  # safetensors raises its own error types
        raise CheckpointRefused(f"{path} is damaged ({err}). {AGAIN}") from None
    for name, tensor in tensors.items():
        try:
            check_finite(name, tensor, path, CheckpointRefused)
        except CheckpointRefused as err:
            raise CheckpointRefused(f"{err} {AGAIN}") from None
    return tensors


def _optimizer_meta(optimizer: dict, path) -> dict:
    groups = state_field(optimizer, "param_groups", "a list", path, "optimizer.")
    for i, group in enumerate(groups):
        where = f"optimizer.param_groups[{i}]"
        if not isinstance(group, dict):
            raise refused(path, f"the field {where!r} is {shown(group)}, but it must be an object")
        params = state_field(group, "params", "a list", path, where + ".")
        if not all(_is_int(p) for p in params):
            raise refused(path, f"the field '{where}.params' is {shown(params)}, but it must list "
                                 "parameter numbers")
    scalars = state_field(optimizer, "scalars", "an object", path, "optimizer.")
    for key, entry in scalars.items():
        if not re.fullmatch(r"0|[1-9][0-9]*", key) or not isinstance(entry, dict):
            raise refused(path, f"the field 'optimizer.scalars.{key}' is not a parameter number "
                                 "with an object of values")
    return optimizer


def read_training_checkpoint(folder) -> dict:
    """A checkpoint folder as a trainer state dict; every file and field is read and checked
    first (``CheckpointRefused`` names the file and the field), the RNG state included, so a
    damaged checkpoint is refused before any of it is applied."""
    folder = Path(folder)
    path = folder / TRAINER_STATE
    if not folder.is_dir() or not os.path.lexists(path):  # a pipe there is refused when read
        raise FileNotFoundError(f"{folder} is not an nbtune training checkpoint (no {TRAINER_STATE}): "
                                "give the folder that session.save_checkpoint wrote.")
    trainer = read_state_json(path)
    if trainer.get("sharded") is True:
        raise CheckpointRefused(f"{folder} is a sharded checkpoint, saved under torchrun by "
                                f"{trainer.get('world')!r} ranks: resume it under torchrun with as "
                                "many (nbtune train RUN_FILE --resume). Nothing was loaded.")
    if trainer.get("format") != FORMAT:
        raise CheckpointRefused(f"{folder} was written by another version of nbtune (format "
                                f"{trainer.get('format')!r}, this one reads {FORMAT}): it records no "
                                "fingerprint of its base model, so it cannot be checked. Nothing was "
                                "loaded; save it again.")
    common = common_fields(trainer, path)
    full = state_field(trainer, "full_weights", "true or false", path)
    optimizer = _optimizer_meta(state_field(trainer, "optimizer", "an object", path), path)
    files = trainer.get("files", {"weights": ["weights.safetensors"],
                                  "optimizer": ["optimizer.safetensors"]})
    if not isinstance(files, dict):
        raise refused(path, f"the field 'files' is {shown(files)}, but it must be an object")
    names = {}
    for part in ("weights", "optimizer") + tuple(p for p in ("reference_logps", "reference_copy") if p in files):
        group = state_field(files, part, "a list", path, "files.")
        if not all(isinstance(name, str) for name in group):
            raise refused(path, f"the field 'files.{part}' is {shown(group)}, but it must list file names")
        names[part] = group
    names["rng"] = ["rng.safetensors"]
    listed = [name for group in names.values() for name in group]
    if any(not name or Path(name).name != name for name in listed):  # a name stays in the folder
        raise CheckpointRefused(f"{path} names files outside the checkpoint folder: it is damaged. "
                                "Nothing was loaded.")
    absent = [name for name in listed if not (folder / name).is_file()]
    if absent:
        raise FileNotFoundError(f"The checkpoint {folder} is incomplete: {', '.join(absent)} missing. "
                                "Nothing was loaded; save the checkpoint again.")
    tensors = {}
    for part, group in names.items():
        tensors[part] = {}
        for name in group:
            tensors[part].update(load_tensors(inside(folder, name, "checkpoint file")))
    for key in tensors["optimizer"]:
        index, _, name = key.partition(".")
        if not name or index not in optimizer["scalars"]:
            raise refused(folder / names["optimizer"][0], f"the optimizer tensor {key!r} is not "
                           f"'<parameter number>.<name>' of a parameter {TRAINER_STATE} lists")
    return {
        "techniques": common["techniques"],
        "full_weights": full,
        "weights": tensors["weights"],
        "optimizer": _optimizer_state(tensors["optimizer"], optimizer),
        "data": common["data"],
        "rng": check_rng(tensors["rng"], folder / "rng.safetensors"),
        "history": common["history"],
        "base_changed": common["base_changed"],
        "base_fingerprint": common["base_fingerprint"],
        "reference_logps": reference_of(tensors.get("reference_logps"), common["data"], folder),
        "reference_copy": tensors.get("reference_copy"),  # checked against the model as it is made
    }


def reference_of(tensors: dict | None, data: dict, folder: Path) -> torch.Tensor | None:
    """A preference run's precomputed reference: one (chosen, rejected) pair of float32
    log-probs per pair of the data, or refused naming the file."""
    if tensors is None:
        return None
    values = tensors.get("reference_logps")
    if (set(tensors) != {"reference_logps"} or values.dtype != torch.float32
            or tuple(values.shape) != (data["samples"], 2)):
        raise refused(folder / "reference_logps.safetensors",
                      f"it must hold one float32 tensor 'reference_logps' of [{data['samples']}, 2] (the "
                      f"data's pairs), not {sorted(tensors)}")
    return values
