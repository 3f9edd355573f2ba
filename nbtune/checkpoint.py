"""Saving a session: HF folders, PEFT adapters, merged weights, and exact training checkpoints.

Everything is safetensors plus JSON (never pickle, sharded checkpoints included), and every
folder is written to a temporary sibling and swapped in, so an interrupted save leaves the
previous one intact. Loading a checkpoint reads and checks every file and field first
(through the trust boundary, ``files``), so a damaged one is refused before any of it is
applied.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import stat
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load_file, save_file

from .files import FileRefused, inside, read_json
from .memory import MemoryBreakdown
from .models.hf import plain_state_dict, write_atomically, write_hf_folder
from .peft import adapter_config, adapter_state_dict, has_lora, merged_state_dict
from .state import rng_problem, rng_state
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
    ``state_dict`` (under torchrun, each rank its own shards: see ``_save_sharded``).
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


# ---- reading a checkpoint: every file and field checked before anything is applied -------

class CheckpointRefused(FileRefused):
    """A training checkpoint nbtune will not load (damaged, edited, or written for another
    run), naming the file and the field or tensor; nothing was loaded. A ``ValueError``."""


AGAIN = "Nothing was loaded; resume from another checkpoint, or save this one again."


def _refused(path, problem: str) -> CheckpointRefused:
    return CheckpointRefused(f"{path}: {problem}. {AGAIN}")


def _shown(value) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 60 else text[:57] + '...'}"


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


_KINDS = {
    "an integer": _is_int,
    "a number": _is_number,
    "a number or null": lambda v: v is None or _is_number(v),
    "true or false": lambda v: isinstance(v, bool),
    "a string": lambda v: isinstance(v, str),
    "a string or null": lambda v: v is None or isinstance(v, str),
    "an object": lambda v: isinstance(v, dict),
    "a list": lambda v: isinstance(v, list),
}


def _field(record: dict, name: str, kind: str, path, where: str = ""):
    """``record[name]``, refused naming the file and the field when absent or not ``kind``."""
    label = where + name
    if name not in record:
        raise _refused(path, f"the field {label!r} is missing")
    value = record[name]
    if not _KINDS[kind](value):
        raise _refused(path, f"the field {label!r} is {_shown(value)}, but it must be {kind}")
    return value


def _read_state_json(path: Path, what: str = "training checkpoint state") -> dict:
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
        raise _refused(path, f"the field 'techniques' names techniques this nbtune does not know "
                             f"({', '.join(unknown)})")
    values = dict(raw)
    if "lora_targets" in raw:
        targets = _field(raw, "lora_targets", "a list", path, "techniques.")
        if not all(isinstance(t, str) for t in targets):
            raise _refused(path, f"the field 'techniques.lora_targets' is {_shown(targets)}, but it "
                                 "must be a list of strings")
        values["lora_targets"] = tuple(targets)
    if "seed" in raw:
        _field(raw, "seed", "an integer", path, "techniques.")
    try:
        return Techniques(**values)
    except (TypeError, ValueError) as err:
        raise _refused(path, f"the field 'techniques' does not hold valid techniques ({err})") from None


_ROW_FIELDS = (("step", "an integer"), ("loss", "a number"), ("tokens", "an integer"),
               ("trained_tokens", "an integer"), ("seconds", "a number"), ("lr", "a number"),
               ("memory", "an object"))
_MEMORY_NUMBERS = tuple(f.name for f in dataclasses.fields(MemoryBreakdown) if type(f.default) is int)


def _history(rows: list, path) -> list[StepReport]:
    out = []
    for i, row in enumerate(rows):
        where = f"history[{i}]."
        if not isinstance(row, dict):
            raise _refused(path, f"the field 'history[{i}]' is {_shown(row)}, but it must be an object")
        for name, kind in _ROW_FIELDS:
            _field(row, name, kind, path, where)
        if "eval_loss" in row:
            _field(row, "eval_loss", "a number or null", path, where)
        if "shape" in row:
            shape = _field(row, "shape", "a list", path, where)
            if len(shape) != 2 or not all(_is_int(n) for n in shape):
                raise _refused(path, f"the field '{where}shape' is {_shown(shape)}, but it must be "
                                     "[batch, sequence]")
        for name in _MEMORY_NUMBERS:
            if name in row["memory"]:
                _field(row["memory"], name, "a number", path, where + "memory.")
        try:
            out += history_from_rows([row])
        except (TypeError, ValueError) as err:
            raise _refused(path, f"the field 'history[{i}]' is not a step report ({err})") from None
    return out


def _common_fields(state: dict, path) -> dict:
    """The fields single-process and sharded checkpoints share, checked and parsed."""
    techniques = _techniques(_field(state, "techniques", "an object", path), path)
    data = _field(state, "data", "an object", path)
    for name in ("seed", "epoch", "position", "samples"):
        _field(data, name, "an integer", path, "data.")
    if "source" in state:
        _field(state, "source", "a string or null", path)
    return {"techniques": techniques, "data": data,
            "history": _history(_field(state, "history", "a list", path), path),
            "base_changed": _field(state, "base_changed", "true or false", path),
            "base_fingerprint": _field(state, "base_fingerprint", "a string", path)}


def check_rng(rng: dict[str, torch.Tensor], path) -> dict[str, torch.Tensor]:
    """``rng`` if ``state.set_rng_state`` can apply it here, else refused naming ``path``:
    checked before anything else is applied, since the RNG is restored last."""
    problem = rng_problem(rng)
    if problem:
        raise _refused(path, problem)
    return rng


def _load_tensors(path: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(path))
    except Exception as err:  # safetensors raises its own error types
        raise CheckpointRefused(f"{path} is damaged ({err}). {AGAIN}") from None


def _optimizer_meta(optimizer: dict, path) -> dict:
    groups = _field(optimizer, "param_groups", "a list", path, "optimizer.")
    for i, group in enumerate(groups):
        where = f"optimizer.param_groups[{i}]"
        if not isinstance(group, dict):
            raise _refused(path, f"the field {where!r} is {_shown(group)}, but it must be an object")
        params = _field(group, "params", "a list", path, where + ".")
        if not all(_is_int(p) for p in params):
            raise _refused(path, f"the field '{where}.params' is {_shown(params)}, but it must list "
                                 "parameter numbers")
    scalars = _field(optimizer, "scalars", "an object", path, "optimizer.")
    for key, entry in scalars.items():
        if not re.fullmatch(r"0|[1-9][0-9]*", key) or not isinstance(entry, dict):
            raise _refused(path, f"the field 'optimizer.scalars.{key}' is not a parameter number "
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
    trainer = _read_state_json(path)
    if trainer.get("sharded") is True:
        raise CheckpointRefused(f"{folder} is a sharded checkpoint, saved under torchrun by "
                                f"{trainer.get('world')!r} ranks: resume it under torchrun with as "
                                "many (nbtune train RUN_FILE --resume). Nothing was loaded.")
    if trainer.get("format") != FORMAT:
        raise CheckpointRefused(f"{folder} was written by another version of nbtune (format "
                                f"{trainer.get('format')!r}, this one reads {FORMAT}): it records no "
                                "fingerprint of its base model, so it cannot be checked. Nothing was "
                                "loaded; save it again.")
    common = _common_fields(trainer, path)
    full = _field(trainer, "full_weights", "true or false", path)
    optimizer = _optimizer_meta(_field(trainer, "optimizer", "an object", path), path)
    files = trainer.get("files", {"weights": ["weights.safetensors"],
                                  "optimizer": ["optimizer.safetensors"]})
    if not isinstance(files, dict):
        raise _refused(path, f"the field 'files' is {_shown(files)}, but it must be an object")
    names = {}
    for part in ("weights", "optimizer"):
        group = _field(files, part, "a list", path, "files.")
        if not all(isinstance(name, str) for name in group):
            raise _refused(path, f"the field 'files.{part}' is {_shown(group)}, but it must list file names")
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
            tensors[part].update(_load_tensors(inside(folder, name, "checkpoint file")))
    for key in tensors["optimizer"]:
        index, _, name = key.partition(".")
        if not name or index not in optimizer["scalars"]:
            raise _refused(folder / names["optimizer"][0], f"the optimizer tensor {key!r} is not "
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
    }


# ---- sharded (torchrun, FSDP2) ----------------------------------------------------------
#
# Each rank writes its own shards of the model and optimizer state dicts as
# torch.distributed.checkpoint.state_dict arranges them (``get_state_dict``: a DTensor as its
# local shard, a plain tensor as it is) to safetensors, and the rest (step counts that are
# numbers, param_groups, which files it wrote) to JSON:
#
#   trainer_state.json                   rank 0: techniques, data position, history, world size
#   rank{r}.json                         rank r: its file names, its optimizer's non-tensor values
#   model.rank{r}.safetensors            rank r's model shards (-00001-of-0000N parts if large)
#   optimizer.rank{r}.safetensors        rank r's optimizer state shards, as "state.<fqn>.<name>"
#   rng.rank{r}.safetensors              rank r's RNG
#
# Nothing is pickled, nothing is unpickled: torch.distributed.checkpoint's own format pickles
# its metadata and unpickles it on load, so a crafted folder would run code. A resume needs
# the same number of ranks, so rank r reads back exactly the shards it wrote.

SHARDED_FORMAT = 3


def _local(value: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return value.to_local() if isinstance(value, DTensor) else value


def _failed_ranks(parallel, ok: bool) -> list[int]:
    """The ranks that report not ``ok``. A collective: every rank calls it."""
    flags = torch.zeros(parallel.world, dtype=torch.int32, device=parallel.device)
    flags[parallel.rank] = 0 if ok else 1
    parallel.sum_(flags)
    return [rank for rank, flag in enumerate(flags.tolist()) if flag]


def _share_path(parallel, path: str | None) -> str:
    """Rank 0's ``path`` on every rank ("" when it has none), as bytes in a tensor: no pickle."""
    import torch.distributed as dist

    data = os.fsencode(path or "") if parallel.rank == 0 else b""
    size = torch.tensor([len(data)], dtype=torch.int64, device=parallel.device)
    dist.broadcast(size, src=0)
    buffer = torch.tensor(list(data), dtype=torch.uint8, device=parallel.device) \
        if parallel.rank == 0 else torch.zeros(int(size.item()), dtype=torch.uint8, device=parallel.device)
    if buffer.numel():
        dist.broadcast(buffer, src=0)
    return os.fsdecode(bytes(buffer.cpu().tolist()))


def _others_failed(folder, failed: list[int]) -> RuntimeError:
    return RuntimeError(f"Rank {', '.join(map(str, failed))} could not write its part of {folder} "
                        "(its error says why): nothing was changed, and a checkpoint already "
                        "there is whole.")


def _attempt(write: Callable[[Path], object], tmp: Path) -> BaseException | None:
    try:
        write(tmp)
    except BaseException as err:  # reported after the other ranks have been told
        return err
    return None


def write_sharded(folder, parallel, write: Callable[[Path], object]) -> Path:
    """``write_atomically`` over the ranks of a torchrun job: every rank runs ``write(tmp)``
    into one temporary folder beside ``folder`` that rank 0 made, and once every rank has
    written, rank 0 puts it in place (``write_atomically``'s swap: a folder already there
    stays whole until the new one is complete and in place). A collective: every rank calls
    it. If any rank fails, nothing changes and every rank raises (the failing one its own
    error). The folder must be on a filesystem every rank sees (a shared one across machines)."""
    folder = Path(folder)
    if parallel.rank != 0:
        return _write_beside_rank0(folder, parallel, write)
    stage = "start"

    def write_all(tmp: Path) -> None:
        nonlocal stage
        _share_path(parallel, str(tmp))
        stage = "writing"
        error = _attempt(write, tmp)
        failed = _failed_ranks(parallel, error is None)
        stage = "refused" if failed else "written"
        if error is not None:
            raise error
        if failed:
            raise _others_failed(folder, failed)

    try:
        write_atomically(folder, write_all)
    except BaseException:
        if stage == "start":  # refused before the temporary folder existed: the others wait
            _share_path(parallel, "")
        elif stage == "written":  # every rank wrote; putting it in place failed
            _failed_ranks(parallel, False)
        raise
    _failed_ranks(parallel, True)  # in place: the others may go on
    return folder


def _write_beside_rank0(folder: Path, parallel, write) -> Path:
    path = _share_path(parallel, None)
    if not path:
        raise RuntimeError(f"Rank 0 could not start saving {folder} (its error says why): "
                           "nothing was written.")
    tmp = Path(path)

    def write_checked(tmp: Path) -> None:
        try:
            mode = os.lstat(tmp).st_mode
        except OSError:
            mode = 0
        if not stat.S_ISDIR(mode):  # never a link, never a folder it was not given
            raise RuntimeError(f"Rank {parallel.rank} does not see the folder {tmp} that rank 0 made "
                               "to save into: every rank must see the same checkpoint folder (a "
                               "shared filesystem across machines).")
        write(tmp)

    error = _attempt(write_checked, tmp)
    failed = _failed_ranks(parallel, error is None)
    if error is not None:
        raise error
    if failed:
        raise _others_failed(folder, failed)
    if _failed_ranks(parallel, True):
        raise RuntimeError(f"Rank 0 could not put {folder} in place (its error says why): a "
                           "checkpoint already there is whole.")
    return folder


def _json_value(value, label: str):
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (tuple, list)):
        return [_json_value(v, f"{label}[{i}]") for i, v in enumerate(value)]
    raise TypeError(f"The optimizer's {label} is a {type(value).__name__}, which a sharded "
                    "checkpoint cannot hold (tensors and JSON values only).")


def _split_optimizer(optim_sd: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """get_state_dict's optimizer state dict as (its tensors' local shards, keyed
    ``state.<fqn>.<name>``, and the rest as JSON values)."""
    tensors, state = {}, {}
    for fqn, entry in optim_sd["state"].items():
        state[fqn] = {}
        for name, value in entry.items():
            if isinstance(value, torch.Tensor):
                key = f"state.{fqn}.{name}"
                if key in tensors:
                    raise ValueError(f"Two optimizer state entries are both named {key!r}.")
                tensors[key] = _local(value)
            else:
                state[fqn][name] = _json_value(value, f"state of {fqn}: {name}")
    groups = [{key: _json_value(value, f"param_groups[{i}].{key}") for key, value in group.items()}
              for i, group in enumerate(optim_sd["param_groups"])]
    return tensors, {"state": state, "param_groups": groups}


def _host_copies(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Own host copies: safetensors refuses tensors sharing storage (tied embeddings)."""
    return {key: value.detach().to("cpu", copy=True).contiguous() for key, value in tensors.items()}


def _save_sharded(trainer, folder, parallel, source: str | None) -> Path:
    """Every rank writes its shards (see the layout above) into one temporary folder, which
    rank 0 swaps in once all have written (``write_sharded``): a crash keeps the old one."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    rank = parallel.rank

    def write(tmp: Path) -> None:
        frozen = any(not p.requires_grad for p in trainer.model.parameters())
        model_sd, optim_sd = get_state_dict(trainer.model, trainer.optimizer,
                                            options=StateDictOptions(ignore_frozen_params=frozen))
        odd = [key for key, value in model_sd.items() if not isinstance(value, torch.Tensor)]
        if odd:
            raise TypeError(f"The model's state dict holds {odd[:3]}, which are not tensors: a "
                            "sharded checkpoint holds tensors only.")
        model_parts = parts({k: _local(v) for k, v in model_sd.items()}, f"model.rank{rank}")
        opt_tensors, opt_values = _split_optimizer(optim_sd)
        opt_parts = parts(opt_tensors, f"optimizer.rank{rank}")
        for name, tensors in model_parts + opt_parts:  # one file at a time: see PART_BYTES
            save_file(_host_copies(tensors), str(tmp / name))
        save_file(rng_state(), str(tmp / f"rng.rank{rank}.safetensors"))
        (tmp / f"rank{rank}.json").write_text(json.dumps({
            "files": {"model": [n for n, _ in model_parts], "optimizer": [n for n, _ in opt_parts]},
            "optimizer": opt_values}, indent=2))
        if rank == 0:
            (tmp / TRAINER_STATE).write_text(json.dumps({
                "format": SHARDED_FORMAT, "sharded": True, "world": parallel.world,
                "frozen_skipped": frozen, "source": source,
                "techniques": trainer.techniques.as_dict(), "data": trainer.stream.state_dict(),
                "history": history_rows(trainer.history), "base_fingerprint": trainer.base_fingerprint,
                "base_changed": trainer.base_changed}, indent=2))

    return write_sharded(folder, parallel, write)


def _agree(folder, parallel, error: BaseException | None) -> None:
    """Raise on every rank if any rank failed (a collective); the failing rank its own error."""
    failed = _failed_ranks(parallel, error is None)
    if error is not None:
        raise error
    if failed:
        raise CheckpointRefused(f"{folder}: rank {', '.join(map(str, failed))} refused its part of "
                                f"the checkpoint (its error says why). {AGAIN}")


def _read_sharded_state(folder: Path, trainer, parallel) -> dict:
    """trainer_state.json of a sharded checkpoint, checked against this run."""
    path = folder / TRAINER_STATE
    if not folder.is_dir() or not path.is_file():
        raise FileNotFoundError(f"{folder} is not an nbtune training checkpoint (no {TRAINER_STATE}): "
                                "give the folder that a torchrun job of nbtune train wrote.")
    about = _read_state_json(path)
    if about.get("sharded") is not True:
        raise CheckpointRefused(f"{folder} is a single-process checkpoint; resume it without "
                                "torchrun. Nothing was loaded.")
    if about.get("format") != SHARDED_FORMAT:
        raise CheckpointRefused(
            f"{folder} was written by another version of nbtune (sharded format "
            f"{about.get('format')!r}, this one reads {SHARDED_FORMAT}; earlier versions used "
            "torch.distributed.checkpoint, whose pickled metadata nbtune no longer reads, since "
            "unpickling a crafted file runs code). Nothing was loaded; resume from a checkpoint "
            "this version wrote, or start the run again.")
    world = _field(about, "world", "an integer", path)
    if world != parallel.world:
        raise CheckpointRefused(f"{folder} was saved by {world} ranks; this job has "
                                f"{parallel.world}: resume with --nproc_per_node {world}. "
                                "Nothing was loaded.")
    frozen = _field(about, "frozen_skipped", "true or false", path)
    common = _common_fields(about, path)
    if common["techniques"] != trainer.techniques or common["base_fingerprint"] != trainer.base_fingerprint:
        raise CheckpointRefused(f"{folder} was saved with other techniques or another base model "
                                "than this run file's: resume with the run file that wrote it. "
                                "Nothing was loaded.")
    trainer.stream.check_state(common["data"])
    return {**common, "frozen_skipped": frozen}


def _part_names(files: dict, part: str, stem: str, folder: Path, path: Path) -> list[Path]:
    names = _field(files, part, "a list", path, "files.")
    pattern = re.compile(rf"{re.escape(stem)}(-[0-9]{{5}}-of-[0-9]{{5}})?\.safetensors")
    for name in names:
        if not isinstance(name, str) or not pattern.fullmatch(name):
            raise _refused(path, f"the field 'files.{part}' lists {_shown(name)}, not one of this "
                                 f"rank's files ({stem}.safetensors or its parts)")
    absent = [name for name in names if not (folder / name).is_file()]
    if absent:
        raise FileNotFoundError(f"The checkpoint {folder} is incomplete: {', '.join(absent)} missing. "
                                f"{AGAIN}")
    return [inside(folder, name, "checkpoint file") for name in names]


def _read_shards(paths: list[Path], targets: dict[str, torch.Tensor], what: str) -> dict:
    """Every tensor of ``paths``, each checked against ``targets`` (this rank's shards):
    every key present once, none unknown, the same shape and dtype."""
    found, where = {}, {}
    for path in paths:
        for key, tensor in _load_tensors(path).items():
            if key in where:
                raise _refused(path, f"the tensor {key!r} is also in {where[key].name}")
            if key not in targets:
                raise _refused(path, f"it holds {key!r}, which this run's {what} has not: it was "
                                     "saved from another model or with other settings")
            target = targets[key]
            if tensor.shape != target.shape or tensor.dtype != target.dtype:
                raise _refused(path, f"{key!r} is {tensor.dtype} {tuple(tensor.shape)}, but this "
                                     f"rank's shard of it is {target.dtype} {tuple(target.shape)}: "
                                     "it was saved from another model or with other settings")
            found[key], where[key] = tensor, path
    missing = sorted(set(targets) - set(found))
    if missing:
        named = paths[0] if len(paths) == 1 else f"{paths[0].parent} ({', '.join(p.name for p in paths)})"
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise _refused(named, f"the {what} tensor {missing[0]!r}{more} is missing")
    return found


def _like(template, value, path, label: str):
    """``value`` (from JSON) if it is what this run's optimizer holds at ``label``; a list
    becomes a tuple where the optimizer holds a tuple."""
    if isinstance(template, (tuple, list)):
        if not isinstance(value, list) or len(value) != len(template):
            raise _refused(path, f"the field {label!r} is {_shown(value)}, but this run's optimizer "
                                 f"holds {_shown(template)} there")
        return type(template)(_like(t, v, path, f"{label}[{i}]")
                              for i, (t, v) in enumerate(zip(template, value)))
    if _is_number(template):
        ok = _is_number(value)
    elif template is None or isinstance(template, (bool, str)):
        ok = type(value) is type(template)
    else:  # a value JSON does not hold
        ok = False
    if not ok:
        raise _refused(path, f"the field {label!r} is {_shown(value)}, but this run's optimizer "
                             f"holds {_shown(template)} there")
    return value


def _optimizer_values(optim_sd: dict, saved: dict, path) -> list[tuple[dict, str, object]]:
    """(record, key, value): the JSON values of ``saved`` where get_state_dict's optimizer
    state dict holds them, checked (the same parameters, names and kinds of value)."""
    state = _field(saved, "state", "an object", path, "optimizer.")
    groups = _field(saved, "param_groups", "a list", path, "optimizer.")
    out = []
    missing = sorted(set(optim_sd["state"]) - set(state))
    extra = sorted(set(state) - set(optim_sd["state"]))
    if missing or extra:
        raise _refused(path, f"the optimizer state is for other weights (missing {missing[:3]}, "
                             f"unknown {extra[:3]})")
    for fqn, entry in optim_sd["state"].items():
        values = _field(state, fqn, "an object", path, "optimizer.state.")
        wanted = {name: v for name, v in entry.items() if not isinstance(v, torch.Tensor)}
        if set(values) != set(wanted):
            raise _refused(path, f"the field 'optimizer.state.{fqn}' holds {sorted(values)}, but this "
                                 f"run's optimizer keeps {sorted(wanted)} there besides tensors")
        out += [(entry, name, _like(wanted[name], value, path, f"optimizer.state.{fqn}.{name}"))
                for name, value in values.items()]
    if len(groups) != len(optim_sd["param_groups"]):
        raise _refused(path, f"the field 'optimizer.param_groups' has {len(groups)} groups, but this "
                             f"run's optimizer has {len(optim_sd['param_groups'])}")
    for i, (group, values) in enumerate(zip(optim_sd["param_groups"], groups)):
        label = f"optimizer.param_groups[{i}]"
        if not isinstance(values, dict) or set(values) != set(group):
            raise _refused(path, f"the field {label!r} is {_shown(values)}, but this run's optimizer "
                                 f"holds the settings {sorted(group)} there")
        if values["params"] != list(group["params"]):
            raise _refused(path, f"the field '{label}.params' lists other weights than this run's")
        out += [(group, key, _like(group[key], value, path, f"{label}.{key}"))
                for key, value in values.items() if key != "params"]
    return out


def _read_rank_files(folder: Path, rank: int, model_sd: dict, optim_sd: dict) -> dict:
    """This rank's files read whole and checked against its shards of the run's state dicts
    (get_state_dict's, which are the live tensors): what to copy where, nothing copied yet."""
    path = folder / f"rank{rank}.json"
    if not path.is_file():
        raise FileNotFoundError(f"The checkpoint {folder} is incomplete: {path.name} missing. {AGAIN}")
    listing = _read_state_json(path, "checkpoint's list of one rank's files")
    files = _field(listing, "files", "an object", path)
    model_paths = _part_names(files, "model", f"model.rank{rank}", folder, path)
    optimizer_paths = _part_names(files, "optimizer", f"optimizer.rank{rank}", folder, path)
    rng_path = folder / f"rng.rank{rank}.safetensors"
    if not rng_path.is_file():
        raise FileNotFoundError(f"The checkpoint {folder} is incomplete: {rng_path.name} missing. "
                                f"{AGAIN}")
    model_targets = {key: _local(v) for key, v in model_sd.items() if isinstance(v, torch.Tensor)}
    optimizer_targets = {f"state.{fqn}.{name}": _local(value)
                         for fqn, entry in optim_sd["state"].items()
                         for name, value in entry.items() if isinstance(value, torch.Tensor)}
    model = _read_shards(model_paths, model_targets, "model")
    optimizer = _read_shards(optimizer_paths, optimizer_targets, "optimizer state")
    values = _optimizer_values(optim_sd, _field(listing, "optimizer", "an object", path), path)
    rng = check_rng(_load_tensors(inside(folder, rng_path.name, "checkpoint file")), rng_path)
    copies = [(model_targets[k], v) for k, v in model.items()]
    copies += [(optimizer_targets[k], v) for k, v in optimizer.items()]
    return {"copies": copies, "values": values, "rng": rng}


@torch.no_grad()
def _apply(read: dict) -> None:
    for target, value in read["copies"]:
        target.copy_(value)
    for record, key, value in read["values"]:
        record[key] = value


def _load_sharded(trainer, folder, parallel) -> None:
    """Continue from ``_save_sharded``'s folder: same run file, same number of ranks. Every
    rank reads and checks all its files first; only when every rank's are sound does each
    copy its shards into its model and optimizer (``set_state_dict``); the rest goes
    through the trainer's ``load_state_dict(placed=True)``."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    folder = Path(folder)
    about = error = None
    try:
        about = _read_sharded_state(folder, trainer, parallel)
    except BaseException as err:  # raised on every rank, after they agree
        error = err
    _agree(folder, parallel, error)
    frozen = about["frozen_skipped"]  # LoRA: the base weights are the run file's, not saved
    options = StateDictOptions(ignore_frozen_params=frozen, strict=not frozen)
    fresh = not trainer.optimizer.state  # get_state_dict gives a fresh optimizer its state
    read = model_sd = optim_sd = None
    try:
        model_sd, optim_sd = get_state_dict(trainer.model, trainer.optimizer, options=options)
        read = _read_rank_files(folder, parallel.rank, model_sd, optim_sd)
    except BaseException as err:
        error = err
    try:
        _agree(folder, parallel, error)
    except BaseException:
        if fresh:
            trainer.optimizer.state.clear()  # as it was: nothing was loaded
        raise
    _apply(read)
    set_state_dict(trainer.model, trainer.optimizer, model_state_dict=model_sd,
                   optim_state_dict=optim_sd, options=options)
    trainer.load_state_dict({
        "techniques": about["techniques"], "full_weights": None, "weights": None, "optimizer": None,
        "data": about["data"], "history": about["history"], "rng": read["rng"],
        "base_changed": about["base_changed"], "base_fingerprint": about["base_fingerprint"]},
        placed=True)
