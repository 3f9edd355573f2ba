"""The search space: which toggle combinations keep the maths, which a device allows, and
every combination ``fit`` may try, cheapest first. The out-of-memory advice takes its single
moves from the same options (``single_moves``), so the two never disagree."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, fields, replace
from types import SimpleNamespace

from ..distributed import Sharding
from ..techniques import RULES, Techniques, label_of
from .costs import checkpointed_fraction, relative_cost


# Toggles that change where or when memory is held, not the updates: changing them (with
# batch_size * grad_accum kept) leaves the maths as it was, up to float rounding order.
PLACEMENT_FIELDS = frozenset({"activation_checkpointing", "chunked_loss", "batch_size", "grad_accum",
                              "optimizer_in_backward", "activation_offloading",
                              "cpu_offload_optimizer", "compile", "tile_tokens"})
# Same optimizer maths, different placement: paging moves state, it does not change it.
_SAME_OPTIMIZER = {"paged_adamw8bit": "adamw8bit"}


def keeps_maths(start: Techniques, new: Techniques) -> bool:
    """Whether ``new`` makes the same updates as ``start``: only placement toggles differ
    and the effective batch is kept. Any other field changed (including ones added later)
    counts as a change of the maths."""
    for name in new.changed(start) - PLACEMENT_FIELDS:
        if name != "optimizer" or (_SAME_OPTIMIZER.get(new.optimizer, new.optimizer)
                                   != _SAME_OPTIMIZER.get(start.optimizer, start.optimizer)):
            return False
    return new.batch_size * new.grad_accum == start.batch_size * start.grad_accum


def allowed(t: Techniques, changes: dict, device: str) -> Techniques | None:
    """``t`` with ``changes``, or None where the combination is invalid or refused on
    ``device`` (the ``RULES`` table)."""
    try:
        new = t.replace(**changes)
    except (TypeError, ValueError):
        return None
    return None if new.conflicts(device) else new


# ---- the search space --------------------------------------------------------------------

# Axes fit may move, in display order; the first six keep the maths. "sharding" stands for
# FSDP2's settings (``SHARDING_AXES``), searched on several cards.
AXES = ("activation_checkpointing", "chunked_loss", "batch_size", "optimizer_in_backward",
        "activation_offloading", "cpu_offload_optimizer", "optimizer", "dtype", "method")
SHARDING_AXES = ("cpu_offload", "reshard_after_forward", "shard_embeddings", "mixed_precision")
# Positions of ``Candidate.saving``: the axes, then each sharding setting.
SAVING_AXES = AXES + tuple(f"sharding.{name}" for name in SHARDING_AXES)
# Maths-changing fallbacks, fewest steps first. Steps: levels moved on each ladder.
_OPTIMIZER_LEVEL = {"adamw": 0, "paged_adamw": 0, "adamw8bit": 1, "paged_adamw8bit": 1,
                    "ao_adamw8bit": 1, "ao_adamw4bit": 2}
_OPTIMIZER_FALLBACKS = {"adamw": ("adamw8bit", "ao_adamw4bit"), "paged_adamw": ("paged_adamw8bit",),
                        "adamw8bit": ("ao_adamw4bit",), "paged_adamw8bit": ("ao_adamw4bit",),
                        "ao_adamw8bit": ("ao_adamw4bit",)}
_METHOD_LEVEL = {"full": 0, "lora": 2, "qlora": 3}  # LoRA trains other weights: a bigger step
_METHOD_FALLBACKS = {"full": ("lora", "qlora"), "lora": ("qlora",), "qlora": ()}
# Memory saved along each axis, for "saves at least as much on every toggle".
_OPTIMIZER_SAVING = {"adamw": 0, "paged_adamw": 0, "adamw8bit": 1, "paged_adamw8bit": 1,
                     "ao_adamw8bit": 1, "ao_adamw4bit": 2, "sgd": 3}
_CHANGE_ORDER = AXES[:3] + ("grad_accum",) + AXES[3:]
_CHECKPOINT_EVERY = (4, 2, True)  # every 4th layer, every 2nd, all
_CHUNKS = 8


def maths_steps(start: Techniques, t: Techniques, exact: bool | None = None) -> int:
    """How far ``t`` moves from ``start``'s maths: 0 keeps it; 8-bit optimizer state 1,
    4-bit 2, bf16 1, LoRA 2, QLoRA 3 (from full). ``exact``: ``keeps_maths``, if known."""
    if keeps_maths(start, t) if exact is None else exact:
        return 0
    steps = 0
    if t.optimizer != start.optimizer:
        steps += abs(_OPTIMIZER_LEVEL.get(t.optimizer, 0) - _OPTIMIZER_LEVEL.get(start.optimizer, 0)) or 1
    steps += t.dtype != start.dtype
    steps += abs(_METHOD_LEVEL[t.method] - _METHOD_LEVEL[start.method])
    return max(steps, 1)


@dataclass(frozen=True)
class Candidate:
    techniques: Techniques
    changes: dict  # fields that differ from the start
    cost: float  # relative_cost against the start's method and dtype
    exact: bool  # keeps the start's maths
    steps: int  # maths_steps from the start (0 when exact)
    saving: tuple  # memory saved along each of ``SAVING_AXES``; larger saves more
    sharding: Sharding | None = None  # FSDP2's settings, on several cards
    sharding_changes: dict | None = None  # those that differ from the start's sharding

    @property
    def key(self) -> tuple:
        """What a combination is: its techniques and, on several cards, its sharding."""
        return self.techniques, self.sharding

    @property
    def label(self) -> str:
        parts = [label_of(self.changes)] if self.changes else []
        parts += [sharding_label(self.sharding_changes)] if self.sharding_changes else []
        return ", ".join(parts) if parts else "start (no change)"


def sharding_label(changes: dict) -> str:
    """FSDP2 setting changes in a few words, as the run file's ``distributed:`` names them."""
    return label_of({f"distributed.{k}": v for k, v in changes.items()})


def _saving(t: Techniques, num_layers: int | None, sharding: Sharding | None = None) -> tuple:
    sharded = sharding is not None
    return (checkpointed_fraction(t, num_layers), t.chunked_loss > 1, -t.batch_size,
            t.optimizer_in_backward, t.activation_offloading, t.cpu_offload_optimizer,
            _OPTIMIZER_SAVING.get(t.optimizer, 0), t.dtype == "bf16",
            _METHOD_LEVEL.get(t.method, 0),
            sharded and sharding.cpu_offload, sharded and sharding.reshard_after_forward,
            sharded and sharding.shard_embeddings, sharded and sharding.mixed_precision == "bf16")


# Which of the on/off memory toggles a combination has on (``fit`` groups the combinations the
# estimator cannot run by them).
TOGGLES_ON = {"activation_checkpointing": lambda t: t.checkpoint_every > 0,
              "chunked_loss": lambda t: t.chunked_loss > 1,
              "optimizer_in_backward": lambda t: t.optimizer_in_backward,
              "activation_offloading": lambda t: t.activation_offloading,
              "cpu_offload_optimizer": lambda t: t.cpu_offload_optimizer}


def toggles_on(t: Techniques) -> frozenset:
    return frozenset(name for name, on in TOGGLES_ON.items() if on(t))


def _options(start: Techniques, device: str, axes, num_layers: int | None,
             ranks: int = 1) -> dict[str, list]:
    cuda = str(device).startswith("cuda")
    opts: dict[str, list] = {name: [getattr(start, name)] for name in AXES}
    opts["batch_size"] = [(start.batch_size, start.grad_accum)]
    if "activation_checkpointing" in axes:
        # N values that checkpoint as many layers as another are the same candidate
        def layers_checkpointed(value):
            every = int(value)
            return 0 if not every else math.ceil(num_layers / every) if num_layers else 1 / every

        values, counts = [], set()
        for value in (start.activation_checkpointing, False) + _CHECKPOINT_EVERY:
            if layers_checkpointed(value) not in counts:
                counts.add(layers_checkpointed(value))
                values.append(value)
        opts["activation_checkpointing"] = values
    if "chunked_loss" in axes:
        opts["chunked_loss"] = [start.chunked_loss, 0 if start.chunked_loss > 1 else _CHUNKS]
    if "batch_size" in axes:
        total = start.batch_size * start.grad_accum
        opts["batch_size"] = [(start.batch_size, start.grad_accum)] + [
            (d, total // d) for d in range(total, 0, -1)
            if total % d == 0 and d % ranks == 0 and d != start.batch_size]  # the global batch splits
    if "optimizer_in_backward" in axes:
        opts["optimizer_in_backward"] = [start.optimizer_in_backward, not start.optimizer_in_backward]
    for name in ("activation_offloading", "cpu_offload_optimizer"):
        if name in axes and cuda:
            opts[name] = [getattr(start, name), not getattr(start, name)]
    if "optimizer" in axes:
        opts["optimizer"] += list(_OPTIMIZER_FALLBACKS.get(start.optimizer, ()))
    if "dtype" in axes and start.dtype == "fp32":
        opts["dtype"].append("bf16")
    if "method" in axes:
        opts["method"] += list(_METHOD_FALLBACKS[start.method])
    return opts


def _shardings(start: Sharding, device: str, tied: bool) -> list[Sharding]:
    """FSDP2's settings ``fit`` may try from ``start``: CPU offload (CUDA), resharding after
    forward, the embedding and head as units of their own (untied only) and bf16 mixed
    precision, each on and off; the start first."""
    values = {"cpu_offload": [start.cpu_offload] + ([not start.cpu_offload]
                                                    if str(device).startswith("cuda") else []),
              "reshard_after_forward": [start.reshard_after_forward, not start.reshard_after_forward],
              "shard_embeddings": [start.shard_embeddings] + ([] if tied else [not start.shard_embeddings]),
              "mixed_precision": [start.mixed_precision, None if start.mixed_precision else "bf16"]}
    return [replace(start, **dict(zip(SHARDING_AXES, combo)))
            for combo in itertools.product(*(values[name] for name in SHARDING_AXES))]


def search_space(start: Techniques, device: str = "cuda", *, num_layers: int | None = None,
                 toggles=None, ranks: int = 1, sharding: Sharding | None = None,
                 tied: bool = False) -> list[Candidate]:
    """Every combination ``fit`` may try, in the order it prefers them: fewest maths steps
    first, then cheapest, then fewest changes. Only combinations valid on ``device``.

    ``toggles`` limits the axes searched (names from ``AXES``; "batch_size" stands for the
    split of the effective batch into batch_size x grad_accum); default all. Over ``ranks``
    processes (FSDP2) ``batch_size`` is the global batch: it stays a multiple of ``ranks``,
    and "sharding" searches FSDP2's settings from ``sharding`` (``tied``: the model ties its
    embedding and head, which then shard with the root). bf16 mixed precision is tried on an
    fp32 model only (on bf16 weights it computes as before and reduces in fp32): it changes
    the maths as bf16 does.
    """
    axes = AXES + ("sharding",) if toggles is None else tuple(toggles)
    unknown = [a for a in axes if a not in AXES + ("sharding",)]
    if unknown:
        raise ValueError(f"toggles {unknown} are not searched by fit; choose from "
                         f"{', '.join(AXES)}, sharding (FSDP2's settings, on several cards).")
    opts = _options(start, device, axes, num_layers, ranks)
    first = (sharding or Sharding()) if ranks > 1 else None
    shardings = [first] if first is None or "sharding" not in axes else _shardings(first, device, tied)
    base = {f.name: getattr(start, f.name) for f in fields(start)}
    rules = [rule for rule in RULES if rule.device is None or rule.device != device]
    out, seen = [], set()
    for combo in itertools.product(*(opts[name] for name in AXES)):
        values = dict(zip(AXES, combo))
        values["batch_size"], values["grad_accum"] = values["batch_size"]
        # the rules read fields only: check them before building (and validating) anything
        if any(rule.broken(SimpleNamespace(**{**base, **values})) for rule in rules):
            continue
        changes = {k: v for k, v in values.items() if v != getattr(start, k)}
        new = allowed(start, changes, device)
        if new is None or new in seen:
            continue
        seen.add(new)
        changed = new.changed(start)
        changes = {k: getattr(new, k) for k in _CHANGE_ORDER if k in changed}
        exact = keeps_maths(start, new)
        for sh in shardings:
            mixed = sh is not None and sh.mixed_precision != first.mixed_precision
            if mixed and new.dtype != "fp32":
                continue  # bf16 weights already compute in bf16
            moved = {k: getattr(sh, k) for k in SHARDING_AXES if getattr(sh, k) != getattr(first, k)} \
                if sh is not None else {}
            cost = relative_cost(new, device, num_layers=num_layers, baseline=start, sharding=sh)
            steps = maths_steps(start, new, exact) + mixed
            out.append(Candidate(new, changes, cost, exact and not mixed, steps,
                                 _saving(new, num_layers, sh), sh, moved))
    out.sort(key=lambda c: (c.steps, round(c.cost, 9), len(c.changes) + len(c.sharding_changes or ()),
                            c.label))
    return out



# The out-of-memory advice: one move along each axis, offered in this order (the quickest to
# take in first: they keep the maths), each picked from the axis's options in ``_options``.
ADVICE_AXES = ("chunked_loss", "activation_checkpointing", "batch_size", "optimizer_in_backward",
               "activation_offloading", "optimizer", "dtype", "method")


def single_moves(start: Techniques, device: str = "cuda") -> list[tuple[dict, bool]]:
    """Changes of one axis of the search space that save memory, in ``ADVICE_AXES`` order,
    each with whether it keeps the maths: per axis the move with the fewest maths steps,
    then the one that saves most (checkpointing every layer), except the batch, split only
    as far as the next smaller micro-batch. Only what the rules allow on ``device``."""
    opts = _options(start, device, ADVICE_AXES, None)
    base = _saving(start, None)
    out = []
    for i, axis in ((AXES.index(a), a) for a in ADVICE_AXES):
        moves = []
        for value in opts[axis][1:]:  # the first is the start's own
            changes = ({"batch_size": value[0], "grad_accum": value[1]} if axis == "batch_size"
                       else {axis: value})
            new = allowed(start, changes, device)
            if new is None:
                continue
            saving = _saving(new, None)
            if saving[i] <= base[i]:
                continue  # this way along the axis costs memory
            exact = keeps_maths(start, new)
            moves.append((maths_steps(start, new, exact), -saving[i] if axis != "batch_size"
                          else saving[i], changes, exact))
        if moves:
            _, _, changes, exact = min(moves, key=lambda m: m[:2])
            out.append((changes, exact))
    return out
