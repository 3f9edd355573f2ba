"""Sharded training checkpoints (torchrun, FSDP2): one set of files per rank, safetensors plus JSON.

Each rank writes its own shards of the model and optimizer state dicts as
torch.distributed.checkpoint.state_dict arranges them (``get_state_dict``: a DTensor as its
local shard, a plain tensor as it is) to safetensors, and the rest (step counts that are
numbers, param_groups, which files it wrote) to JSON::

  trainer_state.json                   rank 0: techniques, data position, history, world size
  rank{r}.json                         rank r: its file names, its optimizer's non-tensor values
  model.rank{r}.safetensors            rank r's model shards (-00001-of-0000N parts if large)
  optimizer.rank{r}.safetensors        rank r's optimizer state shards, as "state.<fqn>.<name>"
  rng.rank{r}.safetensors              rank r's RNG

Nothing is pickled, nothing is unpickled: torch.distributed.checkpoint's own format pickles
its metadata and unpickles it on load, so a crafted folder would run code. A resume needs
the same number of ranks, so rank r reads back exactly the shards it wrote.

``save_checkpoint`` and ``load_checkpoint`` here are what ``Session`` calls: sharded under
torchrun (``parallel``), else ``checkpoint``'s single-process ones. ``save_sharded_session``
is ``checkpoint.save_session`` under torchrun. The file reading and checking helpers are
``checkpoint``'s, shared with single-process checkpoints; files are written through
``checkpoint.save_file`` (looked up there at each call), so one replacement of it covers
every checkpoint file.
"""

from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path
from typing import Callable

import torch

from . import checkpoint
from .checkpoint import (AGAIN, TRAINER_STATE, CheckpointRefused, check_rng, common_fields,
                         history_rows, is_number, load_tensors, parts, read_state_json, refused,
                         save_session, shown, state_field)
from .files import inside
from .models.hf import write_atomically
from .state import rng_state

SHARDED_FORMAT = 3


def save_checkpoint(trainer, folder, source: str | None = None, parallel=None) -> Path:
    """Everything a run needs to continue exactly, in ``folder``: the trainer's whole
    ``state_dict`` (under torchrun, each rank its own shards: see ``save_sharded_checkpoint``;
    else ``checkpoint.save_checkpoint``). ``source``: where the base model came from,
    recorded for the reader. A damaged state (an update half-written) is refused: a
    checkpoint of it would resume a run that never was."""
    trainer.check_usable()
    with trainer.saving():
        if parallel is not None:
            return save_sharded_checkpoint(trainer, folder, parallel, source)
        return checkpoint.save_checkpoint(trainer, folder, source)


def load_checkpoint(trainer, folder, parallel=None) -> None:
    """Bring ``trainer`` (same base model and data) to the checkpoint's exact training state
    through its own ``load_state_dict``: the whole checkpoint is read and checked first
    (under torchrun, by every rank: ``load_sharded_checkpoint``)."""
    if parallel is not None:
        load_sharded_checkpoint(trainer, folder, parallel)
        return
    checkpoint.load_checkpoint(trainer, folder)


def save_sharded_session(session, folder, merge: bool = False, format: str = "hf",
                         quantization: str | None = None) -> Path:
    """``save_session`` across ranks: rank 0 writes, making each weight as it is written
    while every rank holds the FSDP2 unit it lives in gathered, one unit at a time
    (``shards.Gathered``): rank 0's host holds one file part or one tensor, as one process's
    save does, never the model. A collective: every rank calls it; if rank 0 fails, every
    rank raises."""
    from .shards import Gathered, UnitGatherer

    gatherer = UnitGatherer(session.model)
    if session.parallel.rank != 0:
        gatherer.serve()
        return Path(folder)
    written = False
    try:
        save_session(session, folder, merge=merge, format=format, quantization=quantization,
                     gathered=lambda weights: Gathered(weights, gatherer))
        written = True
    finally:
        gatherer.finish(written)
    return Path(folder)


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


class NotWritten(RuntimeError):
    """A sharded checkpoint another rank could not write its part of: nothing was changed."""


def _others_failed(folder, failed: list[int]) -> NotWritten:
    return NotWritten(f"Rank {', '.join(map(str, failed))} could not write its part of {folder} "
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
        raise NotWritten(f"Rank 0 could not start saving {folder} (its error says why): "
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
        raise NotWritten(f"Rank 0 could not put {folder} in place (its error says why): a "
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


def save_sharded_checkpoint(trainer, folder, parallel, source: str | None) -> Path:
    """Every rank writes its shards (the layout is in this module's docstring) into one
    temporary folder, which rank 0 swaps in once all have written (``write_sharded``): a
    crash keeps the old one."""
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
            checkpoint.save_file(_host_copies(tensors), str(tmp / name))
        checkpoint.save_file(rng_state(), str(tmp / f"rng.rank{rank}.safetensors"))
        (tmp / f"rank{rank}.json").write_text(json.dumps({
            "files": {"model": [n for n, _ in model_parts], "optimizer": [n for n, _ in opt_parts]},
            "optimizer": opt_values}, indent=2))
        if rank == 0:
            if trainer.stream.reference_logps is not None:  # every rank holds the same: rank 0 keeps it
                checkpoint.save_file({"reference_logps": trainer.stream.reference_logps.contiguous()},
                                     str(tmp / "reference_logps.safetensors"))
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
    about = read_state_json(path)
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
    world = state_field(about, "world", "an integer", path)
    if world != parallel.world:
        raise CheckpointRefused(f"{folder} was saved by {world} ranks; this job has "
                                f"{parallel.world}: resume with --nproc_per_node {world}. "
                                "Nothing was loaded.")
    frozen = state_field(about, "frozen_skipped", "true or false", path)
    common = common_fields(about, path)
    if common["techniques"] != trainer.techniques or common["base_fingerprint"] != trainer.base_fingerprint:
        raise CheckpointRefused(f"{folder} was saved with other techniques or another base model "
                                "than this run file's: resume with the run file that wrote it. "
                                "Nothing was loaded.")
    trainer.stream.check_state(common["data"])
    reference = None
    if common["techniques"].reference_kind == "precomputed" and (folder / "reference_logps.safetensors").is_file():
        reference = checkpoint.reference_of(
            checkpoint.load_tensors(inside(folder, "reference_logps.safetensors", "checkpoint file")),
            common["data"], folder)
    return {**common, "frozen_skipped": frozen, "reference_logps": reference}


def _part_names(files: dict, part: str, stem: str, folder: Path, path: Path) -> list[Path]:
    names = state_field(files, part, "a list", path, "files.")
    pattern = re.compile(rf"{re.escape(stem)}(-[0-9]{{5}}-of-[0-9]{{5}})?\.safetensors")
    for name in names:
        if not isinstance(name, str) or not pattern.fullmatch(name):
            raise refused(path, f"the field 'files.{part}' lists {shown(name)}, not one of this "
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
        for key, tensor in load_tensors(path).items():
            if key in where:
                raise refused(path, f"the tensor {key!r} is also in {where[key].name}")
            if key not in targets:
                raise refused(path, f"it holds {key!r}, which this run's {what} has not: it was "
                                     "saved from another model or with other settings")
            target = targets[key]
            if tensor.shape != target.shape or tensor.dtype != target.dtype:
                raise refused(path, f"{key!r} is {tensor.dtype} {tuple(tensor.shape)}, but this "
                                     f"rank's shard of it is {target.dtype} {tuple(target.shape)}: "
                                     "it was saved from another model or with other settings")
            found[key], where[key] = tensor, path
    missing = sorted(set(targets) - set(found))
    if missing:
        named = paths[0] if len(paths) == 1 else f"{paths[0].parent} ({', '.join(p.name for p in paths)})"
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise refused(named, f"the {what} tensor {missing[0]!r}{more} is missing")
    return found


def _like(template, value, path, label: str):
    """``value`` (from JSON) if it is what this run's optimizer holds at ``label``; a list
    becomes a tuple where the optimizer holds a tuple."""
    if isinstance(template, (tuple, list)):
        if not isinstance(value, list) or len(value) != len(template):
            raise refused(path, f"the field {label!r} is {shown(value)}, but this run's optimizer "
                                 f"holds {shown(template)} there")
        return type(template)(_like(t, v, path, f"{label}[{i}]")
                              for i, (t, v) in enumerate(zip(template, value)))
    if is_number(template):
        ok = is_number(value)
    elif template is None or isinstance(template, (bool, str)):
        ok = type(value) is type(template)
    else:  # a value JSON does not hold
        ok = False
    if not ok:
        raise refused(path, f"the field {label!r} is {shown(value)}, but this run's optimizer "
                             f"holds {shown(template)} there")
    return value


def _optimizer_values(optim_sd: dict, saved: dict, path) -> list[tuple[dict, str, object]]:
    """(record, key, value): the JSON values of ``saved`` where get_state_dict's optimizer
    state dict holds them, checked (the same parameters, names and kinds of value)."""
    state = state_field(saved, "state", "an object", path, "optimizer.")
    groups = state_field(saved, "param_groups", "a list", path, "optimizer.")
    out = []
    missing = sorted(set(optim_sd["state"]) - set(state))
    extra = sorted(set(state) - set(optim_sd["state"]))
    if missing or extra:
        raise refused(path, f"the optimizer state is for other weights (missing {missing[:3]}, "
                             f"unknown {extra[:3]})")
    for fqn, entry in optim_sd["state"].items():
        values = state_field(state, fqn, "an object", path, "optimizer.state.")
        wanted = {name: v for name, v in entry.items() if not isinstance(v, torch.Tensor)}
        if set(values) != set(wanted):
            raise refused(path, f"the field 'optimizer.state.{fqn}' holds {sorted(values)}, but this "
                                 f"run's optimizer keeps {sorted(wanted)} there besides tensors")
        out += [(entry, name, _like(wanted[name], value, path, f"optimizer.state.{fqn}.{name}"))
                for name, value in values.items()]
    if len(groups) != len(optim_sd["param_groups"]):
        raise refused(path, f"the field 'optimizer.param_groups' has {len(groups)} groups, but this "
                             f"run's optimizer has {len(optim_sd['param_groups'])}")
    for i, (group, values) in enumerate(zip(optim_sd["param_groups"], groups)):
        label = f"optimizer.param_groups[{i}]"
        if not isinstance(values, dict) or set(values) != set(group):
            raise refused(path, f"the field {label!r} is {shown(values)}, but this run's optimizer "
                                 f"holds the settings {sorted(group)} there")
        if values["params"] != list(group["params"]):
            raise refused(path, f"the field '{label}.params' lists other weights than this run's")
        out += [(group, key, _like(group[key], value, path, f"{label}.{key}"))
                for key, value in values.items() if key != "params"]
    return out


def _read_rank_files(folder: Path, rank: int, model_sd: dict, optim_sd: dict) -> dict:
    """This rank's files read whole and checked against its shards of the run's state dicts
    (get_state_dict's, which are the live tensors): what to copy where, nothing copied yet."""
    path = folder / f"rank{rank}.json"
    if not path.is_file():
        raise FileNotFoundError(f"The checkpoint {folder} is incomplete: {path.name} missing. {AGAIN}")
    listing = read_state_json(path, "checkpoint's list of one rank's files")
    files = state_field(listing, "files", "an object", path)
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
    values = _optimizer_values(optim_sd, state_field(listing, "optimizer", "an object", path), path)
    rng = check_rng(load_tensors(inside(folder, rng_path.name, "checkpoint file")), rng_path)
    copies = [(model_targets[k], v) for k, v in model.items()]
    copies += [(optimizer_targets[k], v) for k, v in optimizer.items()]
    return {"copies": copies, "values": values, "rng": rng}


@torch.no_grad()
def _apply(read: dict) -> None:
    for target, value in read["copies"]:
        target.copy_(value)
    for record, key, value in read["values"]:
        record[key] = value


def load_sharded_checkpoint(trainer, folder, parallel) -> None:
    """Continue from ``save_sharded_checkpoint``'s folder: same run file, same number of
    ranks. Every rank reads and checks all its files first; only when every rank's are sound
    does each copy its shards into its model and optimizer (``set_state_dict``); the rest
    goes through the trainer's ``load_state_dict(placed=True)``."""
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
        "base_changed": about["base_changed"], "base_fingerprint": about["base_fingerprint"],
        "reference_logps": about["reference_logps"]}, placed=True)
