"""Fit a configuration to a memory budget: the fastest toggles the estimator says fit.

``fit(model, "24GiB", techniques)`` searches combinations of the memory toggles, asks the
estimator (``nbtune.estimate``: fake tensors, no weights) for each one's peak, and returns
the cheapest one predicted to fit, by the speed cost model below (``relative_cost``).

What it may change, and in what order:

* Toggles that keep the maths (``PLACEMENT_FIELDS``): activation checkpointing (every N
  layers), chunked loss, a micro-batch split that keeps ``batch_size * grad_accum``, the
  optimizer step in backward, activation offloading and CPU optimizer offload (CUDA).
  These move, drop or recompute memory; the updates are the same. They are searched in
  both directions: a technique the start has but does not need is turned off if that is
  faster.
* Only if none of those fits: the choices that change the maths, fewest steps first
  (8-bit then 4-bit optimizer state, bf16, LoRA then QLoRA; ``maths_steps``), each again
  with the toggles above. The result says so.
* Never: seq_len, the effective batch, learning rate, LoRA rank and targets, packing,
  clipping, compile (the estimator cannot see its memory; it only changes speed).

The search keeps estimator calls few (each is seconds to a minute on an 8B model):

* candidates are tried cheapest first and the first that fits is the answer;
* one that saves no more memory than a combination already seen not to fit, on every
  toggle, is skipped: memory is taken to fall monotonically along each toggle (the tests
  check the answer is then the cheapest that fits, against an exhaustive search);
* the start is estimated first; then the most-saving combinations that keep the maths,
  so a search where nothing exact fits learns it in one or two estimates (then the same
  for the whole space, and for each tier of maths changes);
* before a candidate, a near-free stronger one (within ``NEAR_FREE``: chunked loss, the
  optimizer step in backward) is tried: if that does not fit, neither does the candidate;
* a combination the estimator cannot run (an error: e.g. one the library cannot train)
  is reported in ``tried`` and set aside, with the combinations holding the toggles that
  failures share (``_Unrunnable``);
* estimates (and such errors) are cached by (model shape, memory-relevant toggles,
  device) across calls: ``grad_accum`` above 2, ``lr`` and ``seed`` do not change memory.
"""

from __future__ import annotations

import html
import itertools
import math
import numbers
import re
from collections import OrderedDict
from dataclasses import dataclass, field, fields
from types import SimpleNamespace

from .memory.breakdown import MemoryBreakdown
from .memory.estimate import estimate, resolve_config
from .techniques import RULES, Techniques, label_of
from .units import format_bytes

MiB, GiB = 2**20, 2**30

# ---- budgets --------------------------------------------------------------------------

# Memory of each card as the driver reports it (nvidia-smi's total, which is also
# torch.cuda.get_device_properties().total_memory), not the number on the box: ECC takes
# about 1/16 on T4 and L4 (on by default in clouds). Where drivers differ, the smaller.
CARDS: dict[str, int] = {
    "RTX 3090": 24576 * MiB,  # 24 GiB
    "RTX 4090": 24564 * MiB,  # 24 GiB less 12 MiB the driver keeps
    "A100 40GB": 40536 * MiB,  # newer drivers say 40960 MiB
    "A100 80GB": 81920 * MiB,
    "T4": 15360 * MiB,  # 16 GiB, 15 with ECC
    "L4": 23034 * MiB,  # 24 GiB, 22.5 with ECC
}

# Host memory the machines renting each card usually come with: a starting guess for the host
# check of ``fit`` and the panel's badge (say yours with ``host=`` or "RTX 3090 + 64 GB RAM").
HOST_RAM: dict[str, int] = {
    "RTX 3090": 32 * GiB,  # rough: common on RunPod / vast.ai listings (32 GB and up)
    "RTX 4090": 32 * GiB,  # rough: as for the 3090
    "A100 40GB": 79 * GiB,  # Google Cloud a2-highgpu-1g: 85 GB
    "A100 80GB": 158 * GiB,  # Google Cloud a2-ultragpu-1g: 170 GB
    "T4": 12 * GiB,  # Google Colab's free T4: 12.7 GB
    "L4": 15 * GiB,  # Google Cloud g2-standard-4: 16 GB
}

# Not all of a card holds tensors. The CUDA context (driver state, the module images of
# torch's kernels, cuBLAS workspaces) takes about 0.3-0.5 GiB before the first tensor and
# is outside what the estimate predicts: ``usable`` takes off the upper end of that. The
# caching allocator then holds more than the live tensors (rounding to blocks,
# fragmentation); the estimate predicts live tensors only, so a further share is kept
# free (rough: reserved is typically a few percent above the peak of live tensors).
CUDA_CONTEXT = 512 * MiB
ALLOCATOR_MARGIN = 0.05

# How a result is applied from code; the panel, which has an Apply button, says so instead.
APPLY_IN_CODE = "Apply with session.set(**result.changes)."

_UNITS = {"": 1, "b": 1,
          "k": 2**10, "kib": 2**10, "kb": 10**3,
          "m": 2**20, "mib": 2**20, "mb": 10**6,
          "g": 2**30, "gib": 2**30, "gb": 10**9,
          "t": 2**40, "tib": 2**40, "tb": 10**12}
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*", re.IGNORECASE)


def _card_key(name: str) -> str:
    return re.sub(r"[\s_\-]", "", name).lower()


_CARD_KEYS = {_card_key(name): name for name in CARDS}


def parse_budget(value) -> int:
    """Bytes from an int (bytes), a size ("24GiB", "24 GB", "512MiB", "1.5 GiB") or a card
    name from ``CARDS`` (any case, spaces optional: "rtx 4090", "A100-80GB").

    GiB/MiB/KiB (and bare G/M/K) are powers of 2, GB/MB/KB powers of 10: "24 GB" is 24e9
    bytes, about 22.4 GiB. A card's name gives its whole memory; ``fit`` keeps back the CUDA
    context and an allocator margin from it (``usable``).
    """
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        if value > 0:
            return int(value)
    elif isinstance(value, float) and math.isfinite(value) and value >= 1:
        return int(value)
    elif isinstance(value, str):
        card = _CARD_KEYS.get(_card_key(value))
        if card is not None:
            return CARDS[card]
        match = _SIZE.fullmatch(value)
        if match and match.group(2).lower() in _UNITS:
            size = int(float(match.group(1)) * _UNITS[match.group(2).lower()])
            if size > 0:
                return size
    raise ValueError(
        f"budget={value!r} is not a memory size. Give bytes as an int (e.g. {24 * GiB}), a "
        "size with a unit ('24GiB', '16 GiB', '512MiB', '24 GB'; GiB/MiB/KiB and bare G/M/K "
        "are powers of 2, GB/MB/KB powers of 10) or a card: " + ", ".join(CARDS) + ".")


_MACHINE = re.compile(r"(.+?)\s*\+\s*(.+?)\s*(?:of\s+)?(?:ram|host)?\s*", re.IGNORECASE)


def parse_machine(value) -> tuple[int, int | None]:
    """(device bytes, host bytes or None) from what ``parse_budget`` takes (a card name
    brings its usual host memory, ``HOST_RAM``; a size alone leaves the host unknown), from
    "<card or size> + <size> RAM" ("RTX 3090 + 64 GB RAM", "24GiB + 32GiB") or from a
    (device, host) pair."""
    if isinstance(value, tuple) and len(value) == 2:
        device, machine_host = value
        return parse_budget(device), None if machine_host is None else parse_budget(machine_host)
    if isinstance(value, str):
        both = _MACHINE.fullmatch(value)
        if both:
            return parse_budget(both.group(1)), parse_budget(both.group(2))
        card = _CARD_KEYS.get(_card_key(value))
        if card is not None:
            return CARDS[card], HOST_RAM[card]
    return parse_budget(value), None


def host_usable(budget: int) -> int:
    """Bytes of a host of ``budget`` that a run may hold: less the margin ``nbtune.host``
    keeps free (the notebook server, the page cache weights stream through)."""
    from .host import margin

    return max(0, budget - margin(budget))


def usable(budget: int, device: str = "cuda", reserve: int | None = None,
           margin: float | None = None) -> int:
    """Bytes of ``budget`` that a step's tensors may hold on ``device``.

    CUDA: less ``reserve`` (default ``CUDA_CONTEXT``) and then ``margin`` of the rest
    (default ``ALLOCATOR_MARGIN``). Pass ``reserve=0`` for a budget measured with the
    context already made (free memory plus what this process's allocator holds). CPU: all.
    """
    cuda = str(device).startswith("cuda")
    reserve = (CUDA_CONTEXT if cuda else 0) if reserve is None else reserve
    margin = (ALLOCATOR_MARGIN if cuda else 0.0) if margin is None else margin
    return max(0, int((budget - reserve) * (1.0 - margin)))


def required(memory: MemoryBreakdown) -> int:
    """Device bytes a step needs: its highest moment (training step, or held-out evaluation
    where the breakdown has one) plus memory outside the allocator (paged optimizer state:
    it sits on the card until memory runs short)."""
    highest = getattr(memory, "highest", memory.peak)
    return highest + memory.outside


# ---- the speed cost model -------------------------------------------------------------

# What each technique costs in speed, as a fraction of a plain step (one micro-batch,
# nothing recomputed or moved), with where the number comes from. "measured" values are
# the torchtune README's rows quoted in DESIGN.md (Llama 3.2 3B, A100, each row adding one
# flag: packed 7075 tokens/s, +compile 8998, +chunked CE 9174, +checkpointing 7210,
# +optimizer in backward 7309, +activation offloading 7301, +8-bit AdamW 6960; LoRA 8210;
# Llama 3.1 8B on a 4090: LoRA 3083, QLoRA 2413). "rough" values are reasoned, not measured.
COSTS: dict[str, tuple[float, str]] = {
    "checkpointing": (0.27, "measured +27% with every layer (9174 -> 7210 tokens/s); forward is about "
                            "1/3 of forward+backward, and the CPU peers' FLOP count gives +25%; scaled "
                            "by the fraction of layers checkpointed"),
    "offload_checkpointed": (0.01, "measured ~0.1% on top of checkpointing (7309 -> 7301): only layer "
                                   "inputs move, on a side stream"),
    "offload_saved": (0.30, "rough: without checkpointing every saved activation crosses PCIe and back, "
                            "more than compute can hide (DESIGN.md: pays off with checkpointing on)"),
    "cpu_offload_full": (0.50, "rough: every gradient to the CPU and every weight back each step, and "
                               "AdamW on CPU cores"),
    "cpu_offload_adapters": (0.03, "rough: LoRA adapters are about 1% of the weights, little to move"),
    "chunked_loss": (0.01, "measured 2% faster compiled (8998 -> 9174); eager it adds a few launches: "
                           "nearly free"),
    "tiling": (0.1, "rough: each tile's norm + MLP runs its forward once more in backward; the MLP is "
                    "about 2/3 of a layer's forward at short sequences and less as attention grows "
                    "with the sequence (measured by benchmarks/long_context.py)"),
    "optimizer_in_backward": (0.0, "measured 1% faster (7210 -> 7309): the same updates, made earlier"),
    "optimizer_8bit": (0.05, "measured +5% (7301 -> 6960 with 8-bit AdamW)"),
    "optimizer_4bit": (0.07, "rough: as 8-bit, with more unpacking"),
    "paged_optimizer": (0.02, "rough: free until memory runs short, then pages cross PCIe"),
    "micro_batch": (256.0, "rough: each micro-batch pays fixed work worth this many tokens "
                           "(launches, small matmuls under-using the GPU): micro-batches of T tokens "
                           "in an effective batch of E add 256/T - 256/E"),
    "compile": (-0.21, "measured 21% less time per step (7075 -> 8998); the first step compiles"),
}

# Factors of the maths-changing choices, for ranking fallbacks against the start.
METHOD_FACTOR = {"full": 1.0, "lora": 0.85, "qlora": 0.85 * 1.28}
METHOD_WHY = ("LoRA: measured 0.85 of full's step time (6960 vs 8210 tokens/s, 3B; base weights get "
              "no gradients); QLoRA: measured 1.28 of LoRA's (3083 vs 2413, 8B on a 4090; NF4 is "
              "dequantized at every matmul)")
BF16_FACTOR_CUDA = 0.5
BF16_WHY = ("rough: bf16 matmuls run on tensor cores at several times fp32's rate; on CPU not "
            "modelled (1.0): from 250x slower (AVX2 only) to faster (AMX), see DESIGN.md")

_EIGHT_BIT = ("adamw8bit", "paged_adamw8bit", "ao_adamw8bit")
_PAGED = ("paged_adamw8bit", "paged_adamw")


def checkpointed_fraction(t: Techniques, num_layers: int | None = None) -> float:
    """Share of decoder layers checkpointed: every N-th, counting from the first."""
    every = t.checkpoint_every
    if not every:
        return 0.0
    if num_layers:
        return math.ceil(num_layers / every) / num_layers
    return 1.0 / every


def cost_terms(t: Techniques, device: str = "cuda", *, num_layers: int | None = None,
               baseline: Techniques | None = None) -> dict[str, float]:
    """``relative_cost``'s parts: additive overheads (fractions of a plain step) by name, and
    the factors "method", "dtype" (against ``baseline``) and "compile"; zeros left out."""
    cuda = str(device).startswith("cuda")
    base = baseline or t
    out: dict[str, float] = {}
    f = checkpointed_fraction(t, num_layers)
    out["checkpointing"] = COSTS["checkpointing"][0] * f
    if t.activation_offloading:
        out["activation_offloading"] = (f * COSTS["offload_checkpointed"][0]
                                        + (1 - f) * COSTS["offload_saved"][0])
    if t.cpu_offload_optimizer:
        key = "cpu_offload_full" if t.method == "full" else "cpu_offload_adapters"
        out["cpu_offload_optimizer"] = COSTS[key][0]
    if t.chunked_loss > 1:
        out["chunked_loss"] = COSTS["chunked_loss"][0]
    if t.tile_tokens and t.tile_tokens < t.seq_len:
        out["tiling"] = COSTS["tiling"][0]
    if t.optimizer_in_backward:
        out["optimizer_in_backward"] = COSTS["optimizer_in_backward"][0]
    if t.optimizer in _EIGHT_BIT:
        out["optimizer"] = COSTS["optimizer_8bit"][0]
    elif t.optimizer == "ao_adamw4bit":
        out["optimizer"] = COSTS["optimizer_4bit"][0]
    if t.optimizer in _PAGED:
        out["paged_optimizer"] = COSTS["paged_optimizer"][0]
    if t.grad_accum > 1:
        tokens = t.batch_size * t.seq_len
        fixed = COSTS["micro_batch"][0]
        out["micro_batch"] = fixed / tokens - fixed / (tokens * t.grad_accum)
    out["method"] = METHOD_FACTOR[t.method] / METHOD_FACTOR[base.method]
    bf16 = BF16_FACTOR_CUDA if cuda else 1.0
    out["dtype"] = (bf16 if t.dtype == "bf16" else 1.0) / (bf16 if base.dtype == "bf16" else 1.0)
    if t.compile:
        out["compile"] = 1.0 + COSTS["compile"][0]
    return {k: v for k, v in out.items() if v != 0.0 and not (k in _FACTORS and v == 1.0)}


_FACTORS = ("method", "dtype", "compile")


def relative_cost(t: Techniques, device: str = "cuda", *, num_layers: int | None = None,
                  baseline: Techniques | None = None) -> float:
    """Time of one optimizer step with ``t``, relative to a plain step (1.0): the same
    effective batch in one micro-batch, no memory technique, and ``baseline``'s method and
    dtype (default: ``t``'s own). The model: (1 + the overheads of ``COSTS``) times the
    method, dtype and compile factors. ``num_layers`` makes every-N checkpointing exact
    (else 1/N of the layers). Rough by design: it ranks choices, it does not time them."""
    terms = cost_terms(t, device, num_layers=num_layers, baseline=baseline)
    cost = 1.0 + sum(v for k, v in terms.items() if k not in _FACTORS)
    for name in _FACTORS:
        cost *= terms.get(name, 1.0)
    return cost


# ---- what keeps the maths (shared with nbtune.oom) ---------------------------------------

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

# Axes fit may move, in display order; the first six keep the maths.
AXES = ("activation_checkpointing", "chunked_loss", "batch_size", "optimizer_in_backward",
        "activation_offloading", "cpu_offload_optimizer", "optimizer", "dtype", "method")
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
    saving: tuple  # memory saved along each axis; larger saves more

    @property
    def label(self) -> str:
        return label_of(self.changes) if self.changes else "start (no change)"


def _saving(t: Techniques, num_layers: int | None) -> tuple:
    return (checkpointed_fraction(t, num_layers), t.chunked_loss > 1, -t.batch_size,
            t.optimizer_in_backward, t.activation_offloading, t.cpu_offload_optimizer,
            _OPTIMIZER_SAVING.get(t.optimizer, 0), t.dtype == "bf16",
            _METHOD_LEVEL.get(t.method, 0))


_TOGGLES_ON = {"activation_checkpointing": lambda t: t.checkpoint_every > 0,
               "chunked_loss": lambda t: t.chunked_loss > 1,
               "optimizer_in_backward": lambda t: t.optimizer_in_backward,
               "activation_offloading": lambda t: t.activation_offloading,
               "cpu_offload_optimizer": lambda t: t.cpu_offload_optimizer}


def _toggles_on(t: Techniques) -> frozenset:
    return frozenset(name for name, on in _TOGGLES_ON.items() if on(t))


class _Unrunnable:
    """Which combinations the estimator is taken to be unable to run, from those it could
    not: per method and dtype, sets of toggles that fail together. A failure's toggles are
    suspect, and so is what two failures share (a heuristic: the failures seen come from a
    method, or from toggles that do not work together, and each pair of failures points
    closer to the toggles at fault). A combination holding a suspect set is not tried."""

    def __init__(self) -> None:
        self.suspects: dict[tuple, set[frozenset]] = {}
        self.ran: dict[tuple, set[frozenset]] = {}  # toggles seen to run: never suspect

    def add(self, t: Techniques) -> None:
        sets = self.suspects.setdefault((t.method, t.dtype), set())
        failing = _toggles_on(t)
        sets |= {failing & other for other in sets if failing & other} | {failing}

    def runs(self, t: Techniques) -> None:
        self.ran.setdefault((t.method, t.dtype), set()).add(_toggles_on(t))

    def __contains__(self, t: Techniques) -> bool:
        on, group = _toggles_on(t), (t.method, t.dtype)
        return any(s <= on and not any(s <= r for r in self.ran.get(group, ()))
                   for s in self.suspects.get(group, ()))


def _dominated(saving: tuple, by: tuple) -> bool:
    """``by`` saves at least as much memory as ``saving`` along every axis."""
    return all(b >= s for s, b in zip(saving, by))


def _options(start: Techniques, device: str, axes, num_layers: int | None) -> dict[str, list]:
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
            (d, total // d) for d in range(total, 0, -1) if total % d == 0 and d != start.batch_size]
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


def search_space(start: Techniques, device: str = "cuda", *, num_layers: int | None = None,
                 toggles=None) -> list[Candidate]:
    """Every combination ``fit`` may try, in the order it prefers them: fewest maths steps
    first, then cheapest, then fewest changes. Only combinations valid on ``device``.

    ``toggles`` limits the axes searched (names from ``AXES``; "batch_size" stands for the
    split of the effective batch into batch_size x grad_accum); default all.
    """
    axes = AXES if toggles is None else tuple(toggles)
    unknown = [a for a in axes if a not in AXES]
    if unknown:
        raise ValueError(f"toggles {unknown} are not searched by fit; choose from {', '.join(AXES)}.")
    opts = _options(start, device, axes, num_layers)
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
        cost = relative_cost(new, device, num_layers=num_layers, baseline=start)
        out.append(Candidate(new, changes, cost, exact, maths_steps(start, new, exact),
                             _saving(new, num_layers)))
    out.sort(key=lambda c: (c.steps, round(c.cost, 9), len(c.changes), c.label))
    return out


# ---- estimates, cached ----------------------------------------------------------------

_CACHE: "OrderedDict[tuple, MemoryBreakdown]" = OrderedDict()
CACHE_SIZE = 512


def cache_clear() -> None:
    """Forget every cached estimate."""
    _CACHE.clear()


def _config_key(config) -> tuple:
    return tuple((f.name, repr(getattr(config, f.name))) for f in fields(config) if f.compare)


def _memory_twin(t: Techniques) -> Techniques:
    """``t`` with what does not change a step's memory set to one value, so equal-memory
    configurations share a cache entry: the peak is reached by the second micro-batch (the
    gradients of the first are then held), so grad_accum 2 stands for any more."""
    return t.replace(grad_accum=min(t.grad_accum, 2), lr=Techniques.lr, warmup_steps=0, seed=0)


class EstimateFailed(RuntimeError):
    """The estimator could not run a combination: "ErrorType: message"."""


def _estimate(config, t: Techniques, device: str, counter: list) -> MemoryBreakdown:
    twin = _memory_twin(t)
    key = (_config_key(config), twin, device)
    if key in _CACHE:
        _CACHE.move_to_end(key)
        if isinstance(_CACHE[key], EstimateFailed):
            raise EstimateFailed(*_CACHE[key].args)
        return _CACHE[key]
    counter[0] += 1
    try:
        result = estimate(config, twin, device=device)
    except (ValueError, RuntimeError, NotImplementedError) as err:
        # kept as text: a combination the estimator cannot run stays that way, and no
        # traceback (whose frames hold the fake step) outlives this call
        result = EstimateFailed(f"{type(err).__name__}: {' '.join(str(err).split())}")
    _CACHE[key] = result
    while len(_CACHE) > CACHE_SIZE:
        _CACHE.popitem(last=False)
    if isinstance(result, EstimateFailed):
        raise EstimateFailed(*result.args)
    return result


NEAR_FREE = 0.02  # cost within which toggles are bundled (chunked loss, optimizer in backward)


class _OutOfTries(Exception):
    pass


def _most_saving(cands: list[Candidate]) -> list[Candidate]:
    """The candidates no other one beats on every axis of memory saved, in the given order."""
    front: list[int] = []
    for i in sorted(range(len(cands)), key=lambda i: (tuple(-x for x in cands[i].saving), i)):
        # a vector is beaten only by one at least as large lexicographically: seen already
        if not any(_dominated(cands[i].saving, cands[j].saving) for j in front):
            front.append(i)
    return [cands[i] for i in sorted(front)]


def _bundle(group: list[Candidate], i: int, estimated) -> Candidate | None:
    """A not yet estimated candidate after ``group[i]`` that saves at least as much on every
    axis for at most NEAR_FREE more cost: the most-saving such one."""
    c, near = group[i], []
    for d in group[i + 1:]:
        if d.cost > c.cost + NEAR_FREE:
            break
        if d.techniques not in estimated and _dominated(c.saving, d.saving):
            near.append(d)
    tops = _most_saving(near)
    return tops[-1] if tops else None


# ---- the result ------------------------------------------------------------------------

@dataclass(frozen=True)
class FitRow:
    """One combination the search estimated."""

    label: str
    changes: dict
    peak: int | None  # bytes the step needs (``required``); None when the estimate failed
    fits: bool  # on the card and (where checked) on the host
    cost: float
    exact: bool
    error: str | None = None
    host: int | None = None  # host bytes the run needs (``HostMemory.without_undo``)


@dataclass(frozen=True)
class FitResult:
    """What ``fit`` found. ``techniques`` is the fastest combination predicted to fit (None
    if nothing does); ``changes`` the fields it changes from the start (for
    ``session.set(**changes)``); ``peak`` its predicted need in bytes; ``tried`` every
    combination estimated, in order."""

    techniques: Techniques | None
    changes: dict
    peak: int | None
    budget: int
    usable: int
    start: Techniques
    device: str
    tried: list[FitRow]
    exact: bool | None  # the result keeps the start's maths
    cost: float | None  # relative_cost of the result against the start's method and dtype
    message: str
    breakdown: MemoryBreakdown | None = None
    estimates: int = 0  # estimator calls made (cache hits not counted)
    skipped: int = 0  # combinations ruled out without an estimate
    candidates: int = 0  # size of the search space
    host_budget: int | None = None  # the host's memory checked against (None: not checked)
    host_usable: int | None = None

    @property
    def fits(self) -> bool:
        return self.techniques is not None

    def as_dicts(self) -> list[dict]:
        return [{"configuration": r.label, "changes": r.changes, "peak_bytes": r.peak,
                 "host_bytes": r.host, "fits": r.fits, "cost": r.cost, "exact": r.exact,
                 "error": r.error} for r in self.tried]

    HEADER = ["configuration", "predicted peak", "host", "fits", "cost", "maths"]

    def _cells(self) -> list[list[str]]:
        out = []
        for r in self.tried:
            peak = r.error[:60] if r.error else format_bytes(r.peak)
            held = format_bytes(r.host) if r.host is not None else "-"
            out.append([r.label, peak, held, "yes" if r.fits else "no", f"{r.cost:.2f}x",
                        "same" if r.exact else "changed"])
        return out

    def _chosen(self) -> int | None:
        if self.techniques is None:
            return None
        for i, r in enumerate(self.tried):
            if r.fits and r.changes == self.changes:
                return i
        return None

    def __repr__(self) -> str:
        cells = [self.HEADER] + self._cells()
        widths = [max(len(row[i]) for row in cells) for i in range(len(self.HEADER))]
        chosen = self._chosen()
        lines = []
        for j, row in enumerate(cells):
            mark = "->" if chosen is not None and j == chosen + 1 else "  "
            lines.append(mark + " " + "  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                                                for i, (c, w) in enumerate(zip(row, widths))))
        lines.insert(1, "   " + "  ".join("-" * w for w in widths))
        return self.message + "\n\n" + "\n".join(lines)

    def _repr_html_(self) -> str:
        head = "".join(f"<th>{h}</th>" for h in self.HEADER)
        chosen = self._chosen()
        body = "".join(
            ("<tr style='font-weight:bold'>" if i == chosen else "<tr>")
            + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>"
            for i, row in enumerate(self._cells()))
        return (f"<p>{html.escape(self.message)}</p>"
                f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"
                "<p style='font-size:smaller'>cost: step time relative to a plain step of the "
                "start's method and dtype (nbtune.fitting.COSTS); maths: same updates as the start, "
                "or changed.</p>")


def _describe(budget: int, room: int, device: str) -> str:
    if room == budget:
        return f"{format_bytes(budget)}"
    return (f"{format_bytes(room)} usable of {format_bytes(budget)} ({device}: less the context "
            "and allocator margin)")


class _Search:
    """One ``fit`` search: what was estimated, what did not fit, what the estimator could not
    run and what was ruled out without an estimate, over ``space`` (cheapest first)."""

    def __init__(self, config, target: str, space: list[Candidate], room: int,
                 host_room: int | None, max_tries: int) -> None:
        self.config, self.target, self.space = config, target, space
        self.room, self.host_room, self.max_tries = room, host_room, max_tries
        self.rows: list[FitRow] = []  # every combination looked at, in order
        self.estimated: dict[Techniques, FitRow] = {}
        self.memories: dict[Techniques, MemoryBreakdown] = {}
        self.failed: list[tuple] = []  # saving vectors of combinations predicted not to fit
        self.broken = _Unrunnable()  # combinations the estimator could not run, and their like
        self.pruned: set[Techniques] = set()  # ruled out without an estimate
        self.estimates = 0  # estimator calls made (cache hits not counted)

    def _estimate(self, t: Techniques) -> MemoryBreakdown:
        counter = [self.estimates]
        try:
            return _estimate(self.config, t, self.target, counter)
        finally:
            self.estimates = counter[0]

    def dominated(self, c: Candidate) -> bool:
        """Ruled out without an estimate: a combination saving at least as much memory on
        every axis did not fit, or one with a subset of its toggles could not be run."""
        if (any(_dominated(c.saving, by) for by in self.failed)
                or c.techniques in self.broken):
            self.pruned.add(c.techniques)
            return True
        return False

    def predict(self, c: Candidate) -> FitRow | None:
        """Estimate ``c`` (or recall it) and note its row; None when out of tries."""
        if c.techniques in self.estimated:
            return self.estimated[c.techniques]
        cached = (_config_key(self.config), _memory_twin(c.techniques), self.target) in _CACHE
        if self.estimates >= self.max_tries and not cached:
            return None
        try:
            memory = self._estimate(c.techniques)
        except EstimateFailed as err:
            row = FitRow(c.label, c.changes, None, False, c.cost, c.exact, str(err))
            self.broken.add(c.techniques)
        else:
            need = required(memory)
            held = memory.host.without_undo if self.host_room is not None and memory.host else None
            on_host = held is None or held <= self.host_room
            row = FitRow(c.label, c.changes, need, need <= self.room and on_host, c.cost, c.exact,
                         host=held)
            self.memories[c.techniques] = memory
            self.broken.runs(c.techniques)
            if need > self.room:  # (host memory does not fall along the toggles: no pruning by it)
                self.failed.append(c.saving)
        self.rows.append(row)
        self.estimated[c.techniques] = row
        return row

    def probe(self, cands: list[Candidate]) -> bool:
        """Whether any of ``cands`` fits, from its most-saving ones, cheapest first: if none
        of those fits, nothing weaker does. One the estimator cannot run is set aside (with
        those including its toggles) and the most-saving of the rest are tried instead."""
        while True:
            live = [c for c in cands if c.techniques not in self.broken]
            for c in _most_saving(live):
                if c.techniques not in self.estimated and self.dominated(c):
                    continue  # a failure saves at least as much: it does not fit
                row = self.predict(c)
                if row is None:
                    raise _OutOfTries
                if row.peak is not None and row.peak <= self.room:
                    # fits the card: something may fit (the host's need does not fall along
                    # the toggles, so a host refusal proves nothing about weaker ones)
                    return True
                if row.error:
                    break  # the most-saving of the rest, again
            else:
                return False

    def walk(self, group: list[Candidate]) -> Candidate | None:
        """The first of ``group`` (cheapest first) predicted to fit. Before estimating a
        candidate, a combination that saves more at almost no cost (within NEAR_FREE) is
        estimated first: if it does not fit, the candidate is ruled out with it."""
        for i, c in enumerate(group):
            row = self.estimated.get(c.techniques)
            if row is None:
                if self.dominated(c):
                    continue
                bundle = _bundle(group, i, self.estimated)
                if bundle is not None and not self.dominated(bundle):
                    if self.predict(bundle) is None:
                        raise _OutOfTries
                    if self.dominated(c):
                        continue
                row = self.predict(c)
                if row is None:
                    raise _OutOfTries
            if row.fits:
                return c
        return None

    def run(self) -> Candidate | None:
        """The fastest candidate predicted to fit (exact maths first), or None; raises
        ``_OutOfTries`` when ``max_tries`` estimates were spent first."""
        steps = sorted({c.steps for c in self.space})
        tiers = [[c for c in self.space if c.steps == tier] for tier in steps]
        row = self.predict(self.space[0])  # the start, or the cheapest change of it
        if row is None:
            raise _OutOfTries
        if row.fits:
            return self.space[0]
        exact_fits = self.probe(tiers[0])
        if not exact_fits and not self.probe(self.space):  # is anything at all possible?
            return None
        for i, group in enumerate(tiers):
            if (i or not exact_fits) and not self.probe(group):
                continue
            found = self.walk(group)
            if found is not None:
                return found
        return None


def fit(model, budget, techniques: Techniques | None = None, *, device: str = "cuda",
        max_tries: int = 16, toggles=None, reserve: int | None = None,
        margin: float | None = None, host=None) -> FitResult:
    """The fastest combination of memory toggles predicted to fit ``budget``.

    ``model``: what ``estimate`` accepts (preset name, ModelConfig, config.json or model
    folder, Hub id) or an nn.Module with a ``ModelConfig`` as ``.config``. ``budget``: see
    ``parse_machine`` (a card, a size, or "RTX 3090 + 64 GB RAM"). ``techniques``: the start
    (default ``Techniques()``); its method, dtype, optimizer, LoRA settings, seq_len and
    effective batch are kept unless nothing else fits. ``max_tries``: most estimator calls
    (cached ones are free). ``toggles``: limit the axes searched (``AXES``).
    ``reserve``/``margin``: see ``usable``. ``host``: the host's memory (a size; default: the
    card's usual ``HOST_RAM``, or unchecked for a bare size): on CUDA a combination must fit
    there too (``HostMemory.without_undo``: offloaded activations, paged and CPU-offloaded
    optimizer state, a checkpoint being saved; the undo copy is dropped where it does not
    fit, and the result says so).
    """
    config = resolve_config(model)
    start = techniques if techniques is not None else Techniques()
    device = str(device)
    target = "cuda" if device.startswith("cuda") else device
    if target not in ("cpu", "cuda"):
        raise ValueError(f"device={device!r}: nbtune fits budgets for 'cpu' or 'cuda'.")
    refused = start.conflicts(target)
    if refused:
        raise ValueError("fit: the starting techniques cannot run on "
                         f"{device}: " + " ".join(r.reason for r in refused))
    if not isinstance(max_tries, int) or max_tries < 1:
        raise ValueError(f"max_tries must be a positive int, got {max_tries!r}.")
    limit, card_host = parse_machine(budget)
    host_limit = parse_budget(host) if host is not None else card_host
    if target != "cuda":
        host_limit = None  # on a CPU the budget is the host
    host_room = host_usable(host_limit) if host_limit is not None else None
    room = usable(limit, target, reserve, margin)
    layers = config.num_layers
    space = search_space(start, target, num_layers=layers, toggles=toggles)

    search = _Search(config, target, space, room, host_room, max_tries)
    try:
        chosen, out_of_tries = search.run(), False
    except _OutOfTries:  # the cheapest of those seen to fit, if any
        out_of_tries = True
        fitting = [c for c in space if c.techniques in search.estimated
                   and search.estimated[c.techniques].fits]
        chosen = fitting[0] if fitting else None
    skipped = len(search.pruned - set(search.estimated))
    tried_text = (f"{search.estimates} estimate{'s' if search.estimates != 1 else ''} run, "
                  f"{len(search.rows) - search.estimates} from the cache, {skipped} combination"
                  f"{'s' if skipped != 1 else ''} ruled out without one, of {len(space)}")
    card = _describe(limit, room, target)
    where = card
    if host_limit is not None:
        where += f" and {format_bytes(host_room)} usable of {format_bytes(host_limit)} host memory"
    errors = [r for r in search.rows if r.error]
    if errors:
        tried_text += (f"; {len(errors)} could not be estimated, and combinations including "
                       f"their toggles were skipped (first: {errors[0].label}: {errors[0].error[:160]})")
    if chosen is not None:
        c, memory = chosen, search.memories[chosen.techniques]
        need = required(memory)
        on_host = ""
        if host_room is not None and memory.host is not None:
            on_host = (f" Host memory: {format_bytes(memory.host.without_undo)} of "
                       f"{format_bytes(host_room)} usable of {format_bytes(host_limit)}")
            if memory.host.undo and memory.host.peak > host_room:
                on_host += (f", with no undo copy (it would need {format_bytes(memory.host.undo)} "
                            "more: a failure half-way through an update is then recovered with "
                            "session.recover())")
            elif memory.host.undo:
                on_host += f", {format_bytes(memory.host.undo)} more for the undo copy"
            on_host += "."
        if not c.changes:
            message = (f"The start fits: predicted peak {format_bytes(need)} of {card}.{on_host} "
                       f"({tried_text}.)")
        else:
            what = ("The cheapest predicted to fit before max_tries ran out (raise it to look "
                    "for a faster one)" if out_of_tries else "Fastest predicted to fit")
            message = (f"{what}: {c.label}; predicted peak {format_bytes(need)} of "
                       f"{card}; step time about {c.cost:.2f}x a plain step.{on_host}")
            if c.exact:
                message += " Same maths as the start."
            else:
                maths = {k: v for k, v in c.changes.items() if k not in PLACEMENT_FIELDS}
                message += (" No combination that keeps the maths fits, so this one changes it: "
                            + ", ".join(f"{k}={v!r}" for k, v in maths.items()) + ".")
            message += f" {APPLY_IN_CODE} ({tried_text}.)"
        return FitResult(c.techniques, dict(c.changes), need, limit, room, start, device, search.rows,
                         c.exact, c.cost, message, memory, search.estimates, skipped, len(space),
                         host_limit, host_room)
    sized = [r for r in search.rows if r.peak is not None]
    message = f"Nothing tried fits in {where}."
    if sized:
        best = min(sized, key=lambda r: r.peak)
        message += f" The smallest predicted peak was {format_bytes(best.peak)} ({best.label})."
        on_card = [r for r in sized if r.peak <= room]
        if on_card:
            lightest = min(on_card, key=lambda r: r.host)
            message += (f" {len(on_card)} fit on the card but not on the host: the lightest needs "
                        f"{format_bytes(lightest.host)} of host memory ({lightest.label}).")
    if out_of_tries:
        message += (f" The search stopped after max_tries={max_tries} estimates with combinations "
                    "left: raise max_tries to go on.")
    else:
        message += (" Shorten seq_len, lower the effective batch (batch_size x grad_accum), "
                    "train fewer weights, or use a card with more memory.")
    message += f" ({tried_text}.)"
    return FitResult(None, {}, None, limit, room, start, device, search.rows, None, None, message,
                     None, search.estimates, skipped, len(space), host_limit, host_room)


# ---- a badge for the panel ---------------------------------------------------------------

@dataclass(frozen=True)
class FitBadge:
    """Whether a step's memory fits a budget, on the card and (where known) on the host: for
    the panel's badge (no widgets here)."""

    need: int  # bytes the step needs
    budget: int
    usable: int
    largest: str | None = None  # the category holding most at the peak
    at_peak: dict = field(default_factory=dict)
    host_need: int | None = None  # host bytes the run needs without the undo copy
    host_budget: int | None = None
    host_usable: int | None = None
    undo: int = 0  # host bytes of the undo copy "auto" would keep (dropped where it does not fit)

    @property
    def fits_card(self) -> bool:
        return self.need <= self.usable

    @property
    def fits_host(self) -> bool:
        return self.host_need is None or self.host_usable is None or self.host_need <= self.host_usable

    @property
    def fits(self) -> bool:
        return self.fits_card and self.fits_host

    @property
    def headroom(self) -> int:
        """Bytes to spare on the card (negative: bytes over)."""
        return self.usable - self.need

    @property
    def binds(self) -> str:
        """"card" or "host": which of the two has the smaller share left (the card alone
        where the host is not checked)."""
        if self.host_need is None or self.host_usable is None:
            return "card"
        card = self.headroom / max(self.usable, 1)
        machine = (self.host_usable - self.host_need) / max(self.host_usable, 1)
        return "host" if machine < card else "card"

    @property
    def text(self) -> str:
        room = format_bytes(self.usable)
        if self.usable != self.budget:
            room += f" usable of {format_bytes(self.budget)}"
        most = f"; most held by {self.largest.replace('_', ' ')}" if self.largest else ""
        if self.fits_card:
            card = f"{format_bytes(self.headroom)} to spare of {room}"
        else:
            card = f"{format_bytes(-self.headroom)} over {room}"
        if self.host_need is None or self.host_usable is None:
            return f"{'fits' if self.fits_card else 'does not fit'}: {card}{most}"
        spare = self.host_usable - self.host_need
        host = (f"host {format_bytes(self.host_need)} of {format_bytes(self.host_usable)} usable"
                if spare >= 0 else
                f"host {format_bytes(-spare)} over its {format_bytes(self.host_usable)} usable")
        if spare >= 0 and self.undo and self.undo > spare:
            host += f", no undo copy ({format_bytes(self.undo)} would not fit)"
        if self.fits_card and not self.fits_host:
            return f"does not fit on the host: {host} (the card has {card}){most}"
        used = max(self.need / max(self.usable, 1), self.host_need / max(self.host_usable, 1))
        binding = f"; the {self.binds} is the limit" if self.fits and used >= 0.5 else ""
        return f"{'fits' if self.fits else 'does not fit'}: {card}; {host}{binding}{most}"

    def __str__(self) -> str:
        return self.text


def fit_badge(memory, budget, *, device: str | None = None, reserve: int | None = None,
              margin: float | None = None, host=None) -> FitBadge:
    """Fits or not, headroom and the dominating category, for a ``MemoryBreakdown`` (measured
    or estimated) or a peak in bytes, against ``budget`` (anything ``parse_machine`` takes).

    An estimate (or a bare peak) on CUDA is held against ``usable`` (context and allocator
    margin kept back). A measured CUDA step already shows both: what its allocator reserved
    and what is in use outside it (context included), so nothing is kept back for them.
    An estimate carries its host memory (``HostMemory``): on CUDA it is held against ``host``
    (a size; default: the card's usual ``HOST_RAM``) where that is known.
    """
    limit, card_host = parse_machine(budget)
    host_limit = parse_budget(host) if host is not None else card_host
    if isinstance(memory, MemoryBreakdown):
        target = device or memory.device
        measured_cuda = memory.measured and str(memory.device).startswith("cuda")
        if measured_cuda:
            need = max(memory.reserved, getattr(memory, "highest", memory.peak)) + memory.outside
            reserve = 0 if reserve is None else reserve
            margin = 0.0 if margin is None else margin
        else:
            need = required(memory)
        largest = memory.largest_at_peak if (memory.at_peak or memory.peak) else None
        on_host = {}
        if memory.host is not None and host_limit is not None and str(target).startswith("cuda"):
            on_host = dict(host_need=memory.host.without_undo, host_budget=host_limit,
                           host_usable=host_usable(host_limit), undo=memory.host.undo)
        return FitBadge(need, limit, usable(limit, target, reserve, margin), largest,
                        dict(memory.at_peak), **on_host)
    if isinstance(memory, bool) or not isinstance(memory, numbers.Integral) or memory < 0:
        raise TypeError(f"fit_badge: give a MemoryBreakdown or a peak in bytes, got {memory!r}.")
    return FitBadge(int(memory), limit, usable(limit, device or "cuda", reserve, margin))
