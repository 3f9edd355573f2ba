"""Run files: a session's whole configuration as YAML, to repeat it unattended.

``session.save_config("run.yaml")`` writes one, ``Session.from_config("run.yaml")`` and
``nbtune train run.yaml`` read it. The text is parsed with PyYAML, which keeps the line of
every key, and validated with pydantic, which names every bad field with its path: together
an error says "run.yaml, line 12, techniques.lr: ...". pydantic rather than jsonargparse or
tyro because the command line stays a few flags (``--steps``, ``--out``, ``--set key=value``)
while the file is the configuration, and because the fields it checks are generated from the
``Techniques`` dataclass itself (one list of toggles, no copy to drift). The combination rules
stay in ``Techniques`` (``RULES``): the same reasons as in the notebook.

Relative paths in a run file are relative to the file's folder.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import re
import stat
import typing
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, field_validator

from . import files
from .atomic import write_file_atomically
from .techniques import Techniques

HEADER = "# nbtune run file:"  # the first line of every run file nbtune writes

SAVE_CHOICES = ("hf", "merged", "gguf")  # hf: full weights or the PEFT adapter; merged: LoRA folded in
TRACKING = ("sampled", "every_step", "off")


class RunFileError(ValueError):
    """A run file that cannot be used: each problem names its line and field."""


GRPO_NEEDS_REWARDS = ("techniques.objective: grpo scores its completions with reward functions: name "
                      "them under rewards: (- rewards.py:correct, or - {function: rewards.py:brief, "
                      "weight: 0.2}), functions in Python files beside the run file.")
REWARD_FILE_BYTES = 1 << 20  # a reward file is a short Python module


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader with YAML 1.2's booleans (true and false only): under YAML 1.1's,
    ``yes``, ``no``, ``on`` and ``off`` are booleans too, so ``memory_tracking: off`` read
    as False and ``steps: yes`` as 1."""


_BOOL = "tag:yaml.org,2002:bool"
_Loader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != _BOOL]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_Loader.add_implicit_resolver(_BOOL, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RewardEntry(_Strict):
    """A GRPO reward function in a run file: ``file.py:name`` (the file relative to the run
    file's folder) and its weight."""

    function: str
    weight: float = Field(default=1.0, allow_inf_nan=False)


def _techniques_model() -> type[BaseModel]:
    """A pydantic model with exactly the fields, types and defaults of ``Techniques``."""
    hints = typing.get_type_hints(Techniques)
    return create_model("TechniquesFields", __base__=_Strict,
                        **{f.name: (hints[f.name], f.default) for f in dataclasses.fields(Techniques)})


TechniquesFields = _techniques_model()


def _sharding_model() -> type[BaseModel]:
    from .distributed import Sharding

    hints = typing.get_type_hints(Sharding)
    hints["mixed_precision"] = Literal["bf16"] | None
    return create_model("ShardingFields", __base__=_Strict,
                        **{f.name: (hints[f.name], f.default) for f in dataclasses.fields(Sharding)})


# FSDP2 settings, used when the file runs under torchrun with several processes.
ShardingFields = _sharding_model()


class DataSource(_Strict):
    """Rows that need more than a path: a split, a revision, a column mapping (``nt.Data``)."""

    path: str  # a file, a save_to_disk folder, hf://datasets/owner/name or hf://datasets/.../file
    split: str | None = None  # of a DatasetDict folder or Hub dataset (default train)
    revision: str | None = None  # of a Hub dataset
    columns: dict[str, str] | None = None  # nbtune's field: your column, e.g. {instruction: question}
    streaming: bool = False  # a .parquet or .jsonl file read as training goes, never whole
    buffer: int = Field(default=1000, ge=1)  # the samples a streamed file is shuffled through

    @field_validator("columns")
    @classmethod
    def _known_fields(cls, columns):
        from .data.sources import DataError, check_columns  # (torch only once a file names columns)

        try:
            check_columns(columns)
        except DataError as err:
            raise ValueError(str(err)) from None
        return columns


class DataSettings(_Strict):
    # a .jsonl/.json/.parquet/.csv file, a save_to_disk folder or an hf://datasets/... URL, or a
    # mapping (path, split, revision, columns); a demo brings its own
    train: str | DataSource | None = None
    heldout: str | DataSource | None = None
    match: str = "exact"  # how held-out replies are scored (nbtune.scoring.MATCHES)


class RunSettings(_Strict):
    steps: int | None = Field(default=None, gt=0)  # optimizer steps in all (resumed runs included)
    epochs: float | None = Field(default=None, gt=0)  # or passes over the training rows
    checkpoint_every: int = Field(default=0, ge=0)  # 0: no checkpoints during the run
    keep_checkpoints: int = Field(default=2, ge=1)  # the newest this many are kept
    out: str = "nbtune-run"  # metrics.jsonl, checkpoints/ and the final save go here
    save: list[Literal["hf", "merged", "gguf"]] = ["hf"]
    # trackers besides metrics.jsonl (always written): nbtune.trackers.TRACKERS
    log: list[Literal["tensorboard", "trackio", "wandb", "mlflow"]] = []
    evaluate: bool = False  # held-out accuracy (generation, scored by data.match) before and after
    # several ranks (torchrun, processes=N): one whose heartbeat is silent this long is named
    # and the job ended
    hang_seconds: float = Field(default=30.0, ge=2)


class BenchmarkSettings(_Strict):
    """lm-evaluation-harness tasks scored before and after the run (``Session.benchmark``)."""

    tasks: list[str] = []  # registry names (mmlu, gsm8k, ...) or tasks in include_path
    limit: float | None = Field(default=None, gt=0)  # documents per task at most (< 1: a share)
    num_fewshot: int | None = Field(default=None, ge=0)
    include_path: str | None = None  # a folder of task YAML files, from the run file's folder
    batch_size: int = Field(default=8, gt=0)


class RunConfig(_Strict):
    """Everything ``nbtune train`` needs to repeat a session."""

    model: str | None = None  # an HF folder, a Hub repo id or a .gguf file
    revision: str | None = None
    demo: Literal["tiny", "smollm2"] | None = None  # or a ready-made demo (its model and data)
    device: str | None = None  # cpu or cuda; default cuda when present
    memory_tracking: Literal["sampled", "every_step", "off"] = "sampled"
    data: DataSettings = DataSettings()
    techniques: TechniquesFields = TechniquesFields()
    benchmark: BenchmarkSettings = BenchmarkSettings()  # lm-eval tasks, before and after
    run: RunSettings = RunSettings()
    distributed: ShardingFields = ShardingFields()  # FSDP2, under torchrun only
    # Ranks a notebook's ``Session.from_config(file)`` starts and drives (``processes=N``);
    # ``nbtune train`` takes them from torchrun (--nproc_per_node N) instead.
    processes: int | None = Field(default=None, ge=2)
    # GRPO's reward functions: Python the file names ("rewards.py:correct"), run as the user's code
    rewards: list[str | RewardEntry] = []

    # Set by ``load`` (not in the file): the file's folder, which relative paths start from.
    base: str = Field(default=".", exclude=True)

    def benchmark_absolute(self) -> BenchmarkSettings:
        """``benchmark:`` with its task folder from the file's folder."""
        folder = self.benchmark.include_path
        return self.benchmark.model_copy(update={"include_path": self.path(folder) if folder else None})

    def data_absolute(self, value: "str | DataSource | None"):
        """A data entry with its path from the file's folder (a run's own run.yaml)."""
        if isinstance(value, DataSource):
            return value.model_copy(update={"path": self.path(value.path)})
        return self.path(value)

    def data_source(self, value: "str | DataSource | None"):
        """A data entry as ``examples_from`` takes it: a path from the file's folder, or an
        ``nt.Data`` (a mapping with a split, revision or columns)."""
        if not isinstance(value, DataSource):
            return self.path(value)
        from .data import Data

        return Data(self.path(value.path), value.split, value.revision, value.columns, value.streaming,
                    value.buffer)

    def path(self, value: str | None) -> str | None:
        """``value`` (a path in the file) from the file's folder; ids and URLs unchanged."""
        if value is None or "://" in value:
            return value
        candidate = Path(value).expanduser()
        if not candidate.is_absolute():
            candidate = Path(self.base) / candidate
        if candidate.exists() or value.lower().endswith((".jsonl", ".json", ".gguf", ".parquet", ".csv", ".tsv")) \
                or value.startswith("."):
            return str(candidate)
        return value  # not a path here: a Hub repo id

    def to_techniques(self) -> Techniques:
        if self.techniques.objective == "grpo" and not self.rewards:
            raise RunFileError(GRPO_NEEDS_REWARDS)
        for i, entry in enumerate(self.rewards):
            _reward_parts(entry if isinstance(entry, str) else entry.function, f"rewards[{i}]")
        return Techniques(**self.techniques.model_dump())

    def to_rewards(self) -> tuple:
        """The reward functions the file names, read from their files (each run as the user's
        own code: a run file naming Python is a script), as ``session.rewards`` takes them."""
        from .objectives.grpo import as_rewards

        loaded = []
        for i, entry in enumerate(self.rewards):
            spec, weight = (entry, 1.0) if isinstance(entry, str) else (entry.function, entry.weight)
            loaded.append((_load_reward(self.reward_file(spec), spec, f"rewards[{i}]"), weight))
        return as_rewards(loaded) if loaded else ()

    def reward_file(self, spec: str) -> Path:
        """The file of a ``file.py:name`` entry: relative to the run file's folder (never the
        working directory's), or absolute."""
        file = Path(spec.rpartition(":")[0]).expanduser()
        return file if file.is_absolute() else Path(self.base) / file

    def rewards_absolute(self) -> list:
        """The entries with their files absolute (a copy of the file written elsewhere)."""
        return [RewardEntry(function=f"{self.reward_file(spec).resolve()}:{spec.rpartition(':')[2]}", weight=w)
                for spec, w in ((e, 1.0) if isinstance(e, str) else (e.function, e.weight)
                                for e in self.rewards)]

    def to_sharding(self):
        from .distributed import Sharding

        return Sharding(**self.distributed.model_dump())


def _reward_parts(spec: str, where: str) -> tuple[str, str]:
    file, sep, name = spec.rpartition(":")
    if not sep or not file.endswith(".py") or not name.isidentifier():
        raise RunFileError(f"{where}: {spec!r} must name a function as file.py:function, e.g. "
                           "rewards.py:correct (the file relative to the run file).")
    return file, name


def _load_reward(path: Path, spec: str, where: str):
    """The function ``spec`` names, its file read (bounded) and run once (again once edited) as
    a module of its own, registered (dataclasses and pickling look a function's module up) with its folder on the
    import path while it runs (it may import its neighbours)."""
    import hashlib
    import importlib.util
    import sys

    _, name = _reward_parts(spec, where)
    try:
        info = path.stat()
    except OSError as err:
        raise RunFileError(f"{where}: {path} cannot be read ({err.strerror}): give a Python file "
                           "beside the run file.") from None
    if not stat.S_ISREG(info.st_mode) or info.st_size > REWARD_FILE_BYTES:
        raise RunFileError(f"{where}: {path} is not a Python file of at most "
                           f"{REWARD_FILE_BYTES >> 20} MiB.")
    module_name = "nbtune_rewards_" + hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:12]
    module = sys.modules.get(module_name)
    stamp = (info.st_mtime_ns, info.st_size)  # a file edited since it was read is read again
    if module is None or getattr(module, "__nbtune_stamp__", None) != stamp:
        module = importlib.util.module_from_spec(importlib.util.spec_from_file_location(module_name, path))
        module.__nbtune_stamp__ = stamp
        sys.modules[module_name] = module
        sys.path.insert(0, str(path.parent))
        try:
            module.__spec__.loader.exec_module(module)
        except Exception as err:  # noqa: BLE001 - the user's code: said with the file, then stopped
            del sys.modules[module_name]
            raise RunFileError(f"{where}: running {path} raised {type(err).__name__}: {err}") from err
        finally:
            sys.path.remove(str(path.parent))
    function = getattr(module, name, None)
    if not callable(function):
        raise RunFileError(f"{where}: {path} has no function {name!r}.")
    return function


def _reward_entry(reward, folder: Path) -> dict:
    """``session.rewards``' function as a run file names it: its module's file and its name."""
    import sys

    fn = reward.fn
    module = sys.modules.get(getattr(fn, "__module__", None) or "")
    file = getattr(module, "__file__", None)
    if file is None or not file.endswith(".py") or module.__name__ == "__main__" \
            or getattr(module, reward.name, None) is not fn:
        raise RunFileError(f"The reward function {reward.name!r} was written in a notebook cell (or "
                           "is not a module's own function), so a run file cannot name it: put it in "
                           "a .py file (e.g. rewards.py beside the run file), import it from there "
                           "and save again.")
    return {"function": f"{relative(file, folder)}:{reward.name}", "weight": reward.weight}


def _line(node, loc: tuple) -> int | None:
    """1-based line of the key at ``loc`` in a composed YAML tree (its parent's if absent)."""
    line = node.start_mark.line + 1 if node is not None else None
    for key in loc:
        if not isinstance(node, yaml.MappingNode):
            break
        for k, v in node.value:
            if k.value == str(key):
                line, node = k.start_mark.line + 1, v
                break
        else:
            break
    return line


def _known(loc: tuple) -> list[str]:
    model: type[BaseModel] = RunConfig
    for key in loc[:-1]:
        field = model.model_fields.get(str(key))
        annotation = field.annotation if field else None
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return []
        model = annotation
    return [name for name, f in model.model_fields.items() if not f.exclude]


def _message(error: dict) -> str:
    loc = error["loc"]
    if error["type"] == "extra_forbidden":
        known = _known(loc)
        close = difflib.get_close_matches(str(loc[-1]), known, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        return f"unknown field {loc[-1]!r}.{hint} Known here: {', '.join(known)}."
    got = error.get("input")
    shown = "" if isinstance(got, dict) else f"; got {got!r}"
    return f"{error['msg']}{shown}."


def _check_events(text: str, path: Path) -> None:
    """Refuse aliases (``*name``: a few lines of them expand to billions of values once
    loaded) and more YAML than any run file holds, before the YAML becomes data."""
    for count, event in enumerate(yaml.parse(text)):
        if isinstance(event, yaml.AliasEvent):
            raise RunFileError(f"{path}, line {event.start_mark.line + 1}: YAML aliases (*name) are "
                               "not allowed in run files; write the value out.")
        if count > files.limit("run_file_nodes"):
            raise RunFileError(f"{path}: more than {files.limit('run_file_nodes')} YAML nodes; a run "
                               "file is a page of settings. It is damaged or crafted.")


def _repeated_keys(node, loc: tuple = ()) -> list[str]:
    """A key given twice in one mapping (YAML keeps the last one silently)."""
    if not isinstance(node, yaml.MappingNode):
        return []
    seen, problems = set(), []
    for key, value in node.value:
        field = ".".join(map(str, (*loc, key.value)))
        if key.value in seen:
            problems.append(f"line {key.start_mark.line + 1}, {field}: given twice in the file; "
                            "keep one.")
        seen.add(key.value)
        problems += _repeated_keys(value, (*loc, key.value))
    return problems


def _numeric(annotation) -> bool:
    """A field that holds a number (an int or a float, maybe None) and not a boolean."""
    kinds = typing.get_args(annotation) if typing.get_origin(annotation) in (typing.Union, _UnionType) \
        else (annotation,)
    return bool({int, float} & set(kinds)) and bool not in kinds


_UnionType = type(int | None)


def _booleans_for_numbers(data: dict, model: type[BaseModel], loc: tuple = ()) -> list[tuple]:
    """Where a true or false stands for a number (pydantic would read it as 1 or 0): each
    field's path and the value."""
    found = []
    for name, value in data.items():
        field = model.model_fields.get(name) if isinstance(name, str) else None
        if field is None:
            continue
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel) and isinstance(value, dict):
            found += _booleans_for_numbers(value, annotation, (*loc, name))
        elif isinstance(value, bool) and _numeric(annotation):
            found.append(((*loc, name), value))
    return found


def parse_value(text: str):
    """A ``--set key=value`` value, read as the run file's YAML reads it."""
    return yaml.load(text, Loader=_Loader)


def load(source: str | Path, overrides: dict | None = None) -> RunConfig:
    """Read and check a run file; ``overrides`` (dotted keys, ``{"run.steps": 5}``) win over it.

    Every problem is reported at once, each with its line, in one ``RunFileError``.
    """
    path = Path(source)
    if not path.exists():
        raise RunFileError(f"{path}: no such run file. Write one with session.save_config({str(path)!r}).")
    try:
        text = files.read_text(path, "run file", "run_file_bytes")
    except files.FileRefused as err:
        raise RunFileError(str(err)) from None
    try:
        _check_events(text, path)
        tree = yaml.compose(text, Loader=_Loader)
        data = yaml.load(text, Loader=_Loader) or {}
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f", line {mark.line + 1}" if mark is not None else ""
        raise RunFileError(f"{path}{where}: not valid YAML ({getattr(err, 'problem', err)}).") from None
    if not isinstance(data, dict):
        raise RunFileError(f"{path}: a run file is a mapping of fields (model:, data:, techniques:, "
                           f"run:), not a {type(data).__name__}.")
    repeated = _repeated_keys(tree)
    if repeated:
        raise RunFileError("\n".join(f"{path}, {problem}" for problem in repeated))
    for dotted, value in (overrides or {}).items():
        parts, target = dotted.split("."), data
        for part in parts[:-1]:
            target = target.setdefault(part, {})
            if not isinstance(target, dict):
                raise RunFileError(f"{path}: cannot set {dotted}: {part} is not a mapping in the file.")
        target[parts[-1]] = value
    def where(loc: tuple) -> str:
        """", line N, field" in the file, or where an override set the field."""
        field = ".".join(map(str, loc)) or "(top)"
        if field in (overrides or {}):
            return f" (overridden: {field}={overrides[field]!r}), {field}"
        line = _line(tree, loc)
        return f"{f', line {line}' if line else ''}, {field}"

    booleans = _booleans_for_numbers(data, RunConfig)
    if booleans:
        raise RunFileError("\n".join(
            f"{path}{where(loc)}: {str(value).lower()} is a boolean, but this field is a number; "
            "write the number." for loc, value in booleans))
    try:
        config = RunConfig.model_validate(data)
    except ValidationError as err:
        raise RunFileError("\n".join(f"{path}{where(e['loc'])}: {_message(e)}"
                                     for e in err.errors())) from None
    try:
        config.to_techniques()
    except ValueError as err:  # a combination rule: point at the first field it names
        named = [name for name in Techniques.__dataclass_fields__ if name in str(err)]
        loc = ("techniques", named[0]) if named else ("techniques",)
        raise RunFileError(f"{path}{where(loc)}: {err}") from None
    if config.model is None and config.demo is None:
        raise RunFileError(f"{path}: no model: set model: (an HF folder, a Hub repo id or a .gguf "
                           "file) or demo: (tiny or smollm2).")
    if config.model is not None and config.demo is not None:
        raise RunFileError(f"{path}, line {_line(tree, ('demo',))}: set model: or demo:, not both.")
    if config.demo is None and config.data.train is None:
        raise RunFileError(f"{path}, line {_line(tree, ('data',))}, data.train: no training data: "
                           "give a .jsonl file (relative to the run file's folder).")
    if config.run.steps is not None and config.run.epochs is not None:
        raise RunFileError(f"{path}, line {_line(tree, ('run', 'epochs'))}, run: set steps or epochs, "
                           "not both.")
    train = config.data.train
    if isinstance(train, DataSource) and train.streaming and config.run.steps is None:
        raise RunFileError(f"{path}, line {_line(tree, ('data', 'train', 'streaming'))}, data.train.streaming: "
                           "a streamed file's epoch has no length known up front: give run.steps "
                           "(the optimizer steps in all).")
    config.base = str(path.resolve().parent)
    return config


def dump(config: RunConfig) -> str:
    """The run file's text: every field, defaults included, so the file says it all."""
    body = config.model_dump(mode="json")
    body["techniques"]["lora_targets"] = list(body["techniques"]["lora_targets"])
    header = (f"{HEADER} nbtune train THIS_FILE [--steps N] [--out DIR] [--resume]\n"
              "# Relative paths are relative to this file's folder.\n")
    return header + yaml.safe_dump(body, sort_keys=False, default_flow_style=None, width=100)


def written_by_nbtune(path: Path) -> bool:
    """Whether ``path`` is a run file nbtune wrote (its first line), so it may be replaced;
    a link, a pipe or anything but a regular file is not."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    except OSError:
        return False
    with os.fdopen(fd, "rb") as f:
        return stat.S_ISREG(os.fstat(fd).st_mode) and f.read(len(HEADER)) == HEADER.encode()


def write_rows(examples, path: Path) -> None:
    """Rows as JSONL in the format they were read from (instruction rows stay instruction rows)."""
    from .data import Pair, PromptRow, TextRow

    lines = []
    for example in examples:
        if isinstance(example, TextRow):
            row = {"text": example.text}
        elif isinstance(example, PromptRow):  # TRL's form: the prompt as given, its other fields
            row = {"prompt": example.prompt, **dict(example.fields)}
        elif isinstance(example, Pair):  # TRL's form: a text prompt stays text, else messages
            chosen, rejected = example.chosen, example.rejected
            prompt = (chosen.instruction[0] if chosen.instruction is not None else
                      [{"role": r, "content": c} for r, c in chosen.messages[:-1]])
            row = {"prompt": prompt, "chosen": [{"role": "assistant", "content": chosen.messages[-1][1]}],
                   "rejected": [{"role": "assistant", "content": rejected.messages[-1][1]}]}
        elif example.instruction is not None:
            instruction, input = example.instruction
            row = {"instruction": instruction, "input": input, "output": example.messages[-1][1]}
        else:
            row = {"messages": [{"role": r, "content": c} for r, c in example.messages]}
        lines.append(json.dumps(row, ensure_ascii=False))
    write_file_atomically(path, "\n".join(lines) + "\n")


def relative(path: str, folder: Path) -> str:
    """``path`` relative to ``folder`` when it lies under it, else absolute."""
    try:
        return str(Path(path).resolve().relative_to(folder.resolve()))
    except ValueError:
        return str(Path(path).resolve())


def save_config(session, path: str | Path, **changes) -> Path:
    """Write a run file that repeats ``session`` unattended (``Session.save_config``): its
    model source, data, techniques and the run settings, with ``changes`` (steps, epochs,
    out, checkpoint_every, save, evaluate; None keeps the session's) applied."""
    path = Path(path)
    folder = path.parent
    rewards = ([_reward_entry(r, folder) for r in session.rewards]
               if session.techniques.objective == "grpo" else [])
    if session.techniques.objective == "grpo" and not rewards:
        raise RunFileError("save_config: objective='grpo' has no reward functions yet: set "
                           "session.rewards = [...] (functions of a .py file) first.")
    if session.source is None and session.demo_name is None:
        raise RunFileError(
            "This session's model was built in code, not loaded, so a run file cannot name it: "
            "save it first (session.save('base/')) and create the session with "
            "nt.Session.from_pretrained('base/', data) before save_config.")
    settings = session.run_settings or RunSettings()
    changes = {k: v for k, v in changes.items() if v is not None}
    if "steps" in changes:
        changes["epochs"] = None
    elif "epochs" in changes:
        changes["steps"] = None
    elif settings.steps is None and settings.epochs is None:
        from .demos import DEMOS

        length = len(session.history) or (DEMOS[session.demo_name].steps if session.demo_name else 0)
        if not length:
            raise ValueError("save_config: this session has not trained yet, so say how long "
                             "the run is: save_config(path, steps=100) or epochs=1.")
        changes["steps"] = length
    try:
        settings = RunSettings.model_validate({**settings.model_dump(), **changes})
    except ValidationError as err:
        raise RunFileError(f"save_config: {err}") from None
    if os.path.lexists(path) and not written_by_nbtune(path):  # before any file is written
        raise FileExistsError(f"{path} exists and is not a run file nbtune wrote (or is a link): "
                              "it is left as it is. Choose another path, or move it away first.")
    folder.mkdir(parents=True, exist_ok=True)
    data = {"match": session.match if isinstance(session.match, str) else "exact"}
    files = session.data_files
    for split, rows in (("train", session.train_examples), ("heldout", session.heldout_examples)):
        if session.demo_name is not None or not rows:
            continue
        if split in files and isinstance(files[split], dict):  # an nt.Data: its path, split, columns
            entry = files[split]
            local = "://" not in entry["path"]
            data[split] = {**entry, "path": relative(entry["path"], folder) if local else entry["path"]}
        elif split in files and "://" not in files[split]:
            data[split] = relative(files[split], folder)
        elif split in files:
            data[split] = files[split]
        else:  # rows given in code: the run file needs them as a file
            rows_file = folder / f"{path.stem}.{split}.jsonl"
            if rows_file.exists() and not (path.exists() and written_by_nbtune(path)):
                raise FileExistsError(f"{rows_file} exists and was not written by save_config "
                                      f"for {path.name}: it is left as it is. Choose another "
                                      "run file name.")
            write_rows(rows, rows_file)
            data[split] = rows_file.name
    if session.demo_name is not None:
        model = {"demo": session.demo_name}
    elif Path(session.source).exists():
        model = {"model": relative(session.source, folder)}
    else:
        model = {"model": session.source}
    config = RunConfig.model_validate({
        **model, "memory_tracking": session.memory_tracking,
        "data": data, "techniques": session.techniques.as_dict(), "run": settings.model_dump(),
        "rewards": rewards})
    write_file_atomically(path, dump(config), may_replace=written_by_nbtune)
    session.run_settings = settings
    return path
