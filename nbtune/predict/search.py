"""Fit a configuration to a memory budget: the fastest toggles the estimator says fit.

``fit(model, "24GiB", techniques)`` searches combinations of the memory toggles, asks the
estimator (``nbtune.estimate``: fake tensors, no weights) for each one's peak, and returns
the cheapest one predicted to fit, by the speed cost model (``costs.relative_cost``).

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
* one that differs from a combination that did not fit only by checkpointing more layers or
  by the optimizer toggles is skipped when it missed by more than those can save at its
  peak (``reach``: a layer's share of the activations, the gradients and state held then);
* before a candidate, a near-free stronger one (within ``NEAR_FREE``: chunked loss, the
  optimizer step in backward) is tried: if that does not fit, neither does the candidate;
* a combination the estimator cannot run (an error: e.g. one the library cannot train)
  is reported in ``tried`` and set aside, with the combinations holding the toggles that
  failures share (``_Unrunnable``);
* estimates (and such errors) come from the model's ``Predictor``, which keeps them across
  calls and shares them with the badge and the longest-context search (``grad_accum``
  above 2, ``lr`` and ``seed`` do not change memory: ``memory_twin``).
"""

from __future__ import annotations

import html
from dataclasses import dataclass, field, replace

from ..distributed import Sharding
from ..memory.breakdown import MemoryBreakdown
from ..techniques import Techniques
from ..units import format_bytes
from .budgets import host_usable, parse_budget, parse_cards, parse_machine, required, usable
from .estimator import resolve_config
from .predictor import ESTIMATE_ERRORS, Predictor
from .ranks import Ranks
from .space import AXES, PLACEMENT_FIELDS, SAVING_AXES, SHARDING_AXES, Candidate, search_space, toggles_on

# How a result is applied from code; the panel, which has an Apply button, says so instead.
APPLY_IN_CODE = "Apply with session.set(**result.changes)."


class _Unrunnable:
    """Which combinations the estimator is taken to be unable to run, from those it could
    not: per method and dtype, sets of toggles that fail together. A failure's toggles are
    suspect, and so is what two failures share (a heuristic: the failures seen come from a
    method, or from toggles that do not work together, and each pair of failures points
    closer to the toggles at fault). A combination holding a suspect set is not tried."""

    def __init__(self) -> None:
        self.suspects: dict[tuple, set[frozenset]] = {}
        self.ran: dict[tuple, set[frozenset]] = {}  # toggles seen to run: never suspect

    @staticmethod
    def _on(c: Candidate) -> frozenset:
        sharded = {f"distributed.{k}" for k in SHARDING_AXES if c.sharding and getattr(c.sharding, k)}
        return toggles_on(c.techniques) | sharded

    def add(self, c: Candidate) -> None:
        sets = self.suspects.setdefault((c.techniques.method, c.techniques.dtype), set())
        failing = self._on(c)
        sets |= {failing & other for other in sets if failing & other} | {failing}

    def runs(self, c: Candidate) -> None:
        self.ran.setdefault((c.techniques.method, c.techniques.dtype), set()).add(self._on(c))

    def __contains__(self, c: Candidate) -> bool:
        on, group = self._on(c), (c.techniques.method, c.techniques.dtype)
        return any(s <= on and not any(s <= r for r in self.ran.get(group, ()))
                   for s in self.suspects.get(group, ()))


def _dominated(saving: tuple, by: tuple) -> bool:
    """``by`` saves at least as much memory as ``saving`` along every axis."""
    return all(b >= s for s, b in zip(saving, by))


NEAR_FREE = 0.02  # cost within which toggles are bundled (chunked loss, optimizer in backward)

# Positions in ``Candidate.saving`` (``SAVING_AXES``) of what a failed estimate bounds: checkpointing
# (by the activations a layer holds), the toggles that move only the optimizer's memory, and
# the maths (the optimizer, the dtype, the method), which must be the same for a bound.
_CHECKPOINTING = AXES.index("activation_checkpointing")
_OFFLOADING = AXES.index("activation_offloading")
_OPTIMIZER_AXES = frozenset(AXES.index(a) for a in ("optimizer_in_backward", "cpu_offload_optimizer"))
_MATHS_AXES = frozenset([*(AXES.index(a) for a in ("optimizer", "dtype", "method")),
                         SAVING_AXES.index("sharding.mixed_precision")])
# FSDP2's settings that move or free weights, their gradients and optimizer state, not activations
_SHARDING_AXES = frozenset(SAVING_AXES.index(f"sharding.{a}")
                           for a in ("cpu_offload", "reshard_after_forward", "shard_embeddings"))


def reach(failed: Candidate, memory: MemoryBreakdown, c: Candidate, num_layers: int) -> int | None:
    """The most ``c`` can hold less than ``failed`` (estimated: ``memory``) at the moment of
    its peak, or None where that is not bounded: ``c`` must have the same maths and save no
    more on any axis but the optimizer toggles and checkpointing. At that moment the
    optimizer toggles can remove the gradients and the state held then (and paged state
    outside the allocator); checkpointing k more layers removes at most k layers' saved
    tensors, and a layer holds no more than the activations over the layers that hold theirs
    whole (not checkpointed, not the first, whose input needs no gradient): identical
    layers. Where either offloads, checkpointing is not bounded (a layer's tensors are then
    mostly on the host). FSDP2's settings (CPU offload, resharding, sharded embeddings) can
    remove at most all but the activations held then (the gathered weights are "other")."""
    extra, optimizer, sharding = 0, False, False
    for i, (saves, saved) in enumerate(zip(c.saving, failed.saving)):
        if i in _MATHS_AXES:
            if saves != saved:
                return None
        elif saves > saved:
            if i in _OPTIMIZER_AXES:
                optimizer = True
            elif i in _SHARDING_AXES:
                sharding = True
            elif i == _CHECKPOINTING and not (c.saving[_OFFLOADING] or failed.saving[_OFFLOADING]):
                held_whole = num_layers - round(saved * num_layers) - 1
                if held_whole < 1:
                    return None
                more = round((saves - saved) * num_layers)
                extra += -(-more * memory.activations // held_whole)  # rounded up
            else:
                return None
    held = memory.at_peak
    if sharding:
        extra += sum(v for k, v in held.items() if k != "activations") + memory.outside
    elif optimizer:
        extra += held.get("gradients", 0) + held.get("optimizer_state", 0) + memory.outside
    return extra


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
        if d.key not in estimated and _dominated(c.saving, d.saving):
            near.append(d)
    tops = _most_saving(near)
    return tops[-1] if tops else None


# ---- the result ------------------------------------------------------------------------

@dataclass(frozen=True)
class FitRow:
    """One combination the search estimated.

    Attributes:
        label: The changes in words.
        changes: The toggle changes from the start.
        peak: Bytes the step needs; None when the estimate failed.
        fits: On the card and (where checked) on the host.
        cost: Time per step relative to the start's method and dtype.
        exact: It keeps the start's maths.
        error: Why the estimate failed, if it did.
        host: Host bytes the run needs (``HostMemory.without_undo``).
        sharding_changes: FSDP2 settings changed from the start's, on several cards.
    """

    label: str
    changes: dict
    peak: int | None  # bytes the step needs (``required``); None when the estimate failed
    fits: bool  # on the card and (where checked) on the host
    cost: float
    exact: bool
    error: str | None = None
    host: int | None = None  # host bytes the run needs (``HostMemory.without_undo``)
    sharding_changes: dict = field(default_factory=dict)


@dataclass(frozen=True)
class FitResult:
    """What ``fit`` found. ``techniques`` is the fastest combination predicted to fit (None
    if nothing does); ``changes`` the fields it changes from the start (for
    ``session.set(**changes)``); ``peak`` its predicted need in bytes; ``tried`` every
    combination estimated, in order.

    Attributes:
        techniques: The fastest combination predicted to fit, or None.
        changes: Its fields that differ from the start, for ``session.set(**changes)``.
        peak: Its predicted peak in bytes, or None.
        budget: The budget asked for, in bytes.
        usable: What of the budget a step may use (less the CUDA context and a margin).
        start: The techniques the search started from.
        device: "cuda" or "cpu".
        tried: Every combination estimated, in order (``FitRow``s).
        exact: Whether the result keeps the start's maths (None when nothing fits).
        cost: Its time per step relative to the start's method and dtype.
        message: The answer in words.
        breakdown: The result's predicted ``MemoryBreakdown``.
        estimates: Estimator calls made (cache hits not counted).
        skipped: Combinations ruled out without an estimate.
        candidates: The size of the search space.
        host_budget: The host memory checked against, in bytes (None: not checked).
        host_usable: What of it the run may use.
        search: What the search cost, in words.
        cards: The cards fitted to, one process each under FSDP2 (peaks are per card).
        needs_cards: Where nothing fits, the fewest cards the lightest combination fits.
        sharding: On several cards, FSDP2's settings of the answer (``distributed.Sharding``;
            the run file's ``distributed:`` section).
        sharding_changes: Those that differ from the start's sharding.
    """

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
    search: str = ""  # what the search cost (estimates run, cache hits, ruled out): the details
    cards: int = 1  # the cards it was fitted to, one process each under FSDP2 (peaks are per card)
    needs_cards: int | None = None  # where nothing fits: the fewest cards the lightest tried fits
    sharding: Sharding | None = None  # the answer's FSDP2 settings, on several cards
    sharding_changes: dict = field(default_factory=dict)  # those changed from the start's

    @property
    def fits(self) -> bool:
        """True when a combination fits."""
        return self.techniques is not None

    def as_dicts(self) -> list[dict]:
        """Every combination tried, a dict each (for a DataFrame or JSON).

        Returns:
            Dicts of configuration, changes, peak and host bytes, fits, cost, exact, error.
        """
        return [{"configuration": r.label, "changes": r.changes,
                 "sharding_changes": r.sharding_changes, "peak_bytes": r.peak,
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
            if r.fits and r.changes == self.changes and r.sharding_changes == self.sharding_changes:
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
        return self.message + "\n\n" + "\n".join(lines) + (f"\n\n({self.search}.)" if self.search else "")

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
                "start's method and dtype (nbtune.predict.tables.COSTS); maths: same updates as the start, "
                "or changed.</p>"
                + (f"<details><summary>The search</summary>{html.escape(self.search)}.</details>"
                   if self.search else ""))


def _describe(budget: int, room: int, device: str, cards: int = 1) -> str:
    each = f" on each of {cards} cards" if cards > 1 else ""
    if room == budget:
        return f"{format_bytes(budget)}{each}"
    return (f"{format_bytes(room)} usable of {format_bytes(budget)}{each} ({device}: less the "
            "context and allocator margin)")


class _Search:
    """One ``fit`` search: what was estimated, what did not fit, what the estimator could not
    run and what was ruled out without an estimate, over ``space`` (cheapest first)."""

    def __init__(self, predictor_for, space: list[Candidate], room: int,
                 host_room: int | None, max_tries: int, num_layers: int) -> None:
        self.predictor_for, self.space = predictor_for, space  # a sharding's Predictor
        self.room, self.host_room, self.max_tries = room, host_room, max_tries
        self.num_layers = num_layers
        self.rows: list[FitRow] = []  # every combination looked at, in order
        self.estimated: dict[tuple, FitRow] = {}  # by ``Candidate.key``
        self.memories: dict[tuple, MemoryBreakdown] = {}
        self.missed: list[tuple] = []  # (candidate, breakdown) of those predicted not to fit
        self.broken = _Unrunnable()  # combinations the estimator could not run, and their like
        self.pruned: set[Techniques] = set()  # ruled out without an estimate
        self.estimates = 0  # estimator calls made (cache hits not counted)

    def dominated(self, c: Candidate) -> bool:
        """Ruled out without an estimate: a combination saving at least as much memory on
        every axis did not fit, or one missed by more than ``c`` can save against it
        (``reach``), or one with a subset of its toggles could not be run."""
        if (any(_dominated(c.saving, failed.saving) for failed, _ in self.missed)
                or any(self._beyond_reach(c, *missed) for missed in self.missed)
                or c in self.broken):
            self.pruned.add(c.key)
            return True
        return False

    def _beyond_reach(self, c: Candidate, failed: Candidate, memory: MemoryBreakdown) -> bool:
        """``c`` needs more than the room: at ``failed``'s peak it holds at least that peak
        less ``reach`` (and it needs at least what it holds then)."""
        saves = reach(failed, memory, c, self.num_layers)
        return saves is not None and memory.peak - saves > self.room

    def predict(self, c: Candidate) -> FitRow | None:
        """Estimate ``c`` (or recall it) and note its row; None when out of tries."""
        if c.key in self.estimated:
            return self.estimated[c.key]
        predictor = self.predictor_for(c.sharding)
        cached = predictor.cached(c.techniques)
        if self.estimates >= self.max_tries and not cached:
            return None
        moved = dict(c.sharding_changes or {})
        try:
            if not cached:
                self.estimates += 1
            memory = predictor.estimate(c.techniques)
        except ESTIMATE_ERRORS as err:
            row = FitRow(c.label, c.changes, None, False, c.cost, c.exact,
                         f"{type(err).__name__}: {err}", sharding_changes=moved)
            self.broken.add(c)
        else:
            need = required(memory)
            held = memory.host.without_undo if self.host_room is not None and memory.host else None
            on_host = held is None or held <= self.host_room
            row = FitRow(c.label, c.changes, need, need <= self.room and on_host, c.cost, c.exact,
                         host=held, sharding_changes=moved)
            self.memories[c.key] = memory
            self.broken.runs(c)
            if need > self.room:  # (host memory does not fall along the toggles: no pruning by it)
                self.missed.append((c, memory))
        self.rows.append(row)
        self.estimated[c.key] = row
        return row

    def probe(self, cands: list[Candidate]) -> bool:
        """Whether any of ``cands`` fits, from its most-saving ones, cheapest first: if none
        of those fits, nothing weaker does. One the estimator cannot run is set aside (with
        those including its toggles) and the most-saving of the rest are tried instead."""
        while True:
            live = [c for c in cands if c not in self.broken and not (
                c.key in self.estimated and self.estimated[c.key].error)]
            for c in _most_saving(live):
                if c.key not in self.estimated and self.dominated(c):
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
            row = self.estimated.get(c.key)
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
        margin: float | None = None, host=None, sharding=None) -> FitResult:
    """The fastest combination of memory toggles predicted to fit ``budget``.

    The start's method, dtype, optimizer, LoRA settings, seq_len and effective batch are kept
    unless nothing else fits. On CUDA a combination must fit the host too
    (``HostMemory.without_undo``: offloaded activations, paged and CPU-offloaded optimizer
    state, a checkpoint being saved; the undo copy is dropped where it does not fit, and the
    result says so). Where nothing fits, the answer says how many such cards the lightest
    combination tried needs (up to 8).

    Args:
        model: What ``estimate`` takes (preset name, ModelConfig, config.json or model folder,
            Hub id), an nn.Module with a ``ModelConfig`` as ``.config``, or a ``Predictor``.
        budget: A card, a size or "RTX 3090 + 64 GB RAM" (see ``parse_machine``), or several
            cards ("2x RTX 3090 + 64 GB RAM": one process each under FSDP2, every peak per card,
            the host shared; ``batch_size`` is then the global batch).
        techniques: The start (default ``Techniques()``).
        device: "cuda" or "cpu".
        max_tries: The most estimator calls (cached ones are free).
        toggles: Limit the axes searched (``AXES``, and "sharding" for FSDP2's settings).
        reserve: Bytes kept back for the CUDA context (see ``usable``).
        margin: The allocator's share kept back (see ``usable``).
        host: The host's memory, a size (default: the card's usual ``HOST_RAM``; unchecked for a
            bare size).
        sharding: FSDP2's settings to start from, for several cards (a dict or
            ``distributed.Sharding``; default FSDP2's own). On several cards ``fit`` searches
            them with the rest (CPU offload, resharding after forward, the embedding and head
            as their own units, bf16 mixed precision on an fp32 model) unless ``toggles``
            leaves "sharding" out; the answer's are ``result.sharding``.

    Returns:
        A ``FitResult``.

    Raises:
        ValueError: The start cannot run on ``device``, or the budget is not understood.
    """
    config = model.config if isinstance(model, Predictor) else resolve_config(model)
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
    cards, machine = parse_cards(budget)
    limit, card_host = parse_machine(machine)
    host_limit = parse_budget(host) if host is not None else card_host
    if cards > 1 and start.batch_size % cards:
        raise ValueError(f"fit on {cards} cards: batch_size={start.batch_size} is the global batch, "
                         f"split over the cards' processes: make it a multiple of {cards}.")
    if isinstance(model, Predictor) and model.ranks != cards:
        raise ValueError(f"budget={budget!r} names {cards} card(s), but this Predictor estimates "
                         f"for {model.ranks}: give the model instead.")
    if target != "cuda":
        host_limit = None  # on a CPU the budget is the host
    host_room = host_usable(host_limit) if host_limit is not None else None
    room = usable(limit, target, reserve, margin)
    given = Predictor.of(model, target) if isinstance(model, Predictor) else None  # (its device checked)
    if given is not None and cards > 1:
        sharding = given.sharding if sharding is None else sharding
    spread = Ranks.of(cards, sharding)  # (refuses settings for one card, and unknown ones)
    first = spread.sharding if spread is not None else None

    def predictor_for(sh):
        if given is not None and (cards == 1 or sh == given.sharding):
            return given
        return Predictor.of(config, target, cards, sh)

    space = search_space(start, target, num_layers=config.num_layers, toggles=toggles, ranks=cards,
                         sharding=first, tied=config.tie_word_embeddings)
    search = _Search(predictor_for, space, room, host_room, max_tries, config.num_layers)
    try:
        chosen, out_of_tries = search.run(), False
    except _OutOfTries:  # the cheapest of those seen to fit, if any
        out_of_tries = True
        fitting = [c for c in space if c.key in search.estimated and search.estimated[c.key].fits]
        chosen = fitting[0] if fitting else None
    skipped = len(search.pruned - set(search.estimated))
    tried_text, searched = _failures(search), _searched(search, skipped, len(space))
    card = _describe(limit, room, target, cards)
    if chosen is not None:
        c, memory = chosen, search.memories[chosen.key]
        need = required(memory)
        message = _found(c, need, card, _on_host(memory, host_room, host_limit), tried_text,
                         out_of_tries)
        return FitResult(c.techniques, dict(c.changes), need, limit, room, start, device, search.rows,
                         c.exact, c.cost, message, memory, search.estimates, skipped, len(space),
                         host_limit, host_room, searched, cards, None, c.sharding,
                         dict(c.sharding_changes or {}))
    where = card
    if host_limit is not None:
        where += f" and {format_bytes(host_room)} usable of {format_bytes(host_limit)} host memory"
    message = _nothing(search.rows, where, room, max_tries if out_of_tries else None, tried_text)
    needs = _more_cards(config, start, search.rows, cards, target, first, room, host_room) \
        if target == "cuda" else None
    if needs is not None:
        count, row, need, sh = needs
        with_fsdp = "" if sh == (first or Sharding()) else f" with FSDP2's distributed: {_settings(sh)}"
        message += (f" It needs {count} cards of {format_bytes(limit)}: {row.label} is predicted "
                    f"at {format_bytes(need)} per card{with_fsdp} (budget \"{count}x ...\" to fit there).")
    return FitResult(None, {}, None, limit, room, start, device, search.rows, None, None, message,
                     None, search.estimates, skipped, len(space), host_limit, host_room, searched,
                     cards, needs[0] if needs else None, first)


def _more_cards(config, start: Techniques, rows: list[FitRow], cards: int, target: str, sharding,
                room: int, host_room: int | None):
    """(cards, row, per-card need, sharding): the fewest cards, up to 8 and doubling from
    ``cards``, on which the lightest combination tried fits, keeping the global batch (with
    FSDP2's settings as they were, or on CUDA its most saving ones); None if none."""
    sized = [r for r in rows if r.peak is not None]
    if not sized:
        return None
    lightest = min(sized, key=lambda r: r.peak)
    t = start.replace(**lightest.changes)
    sharding = replace(sharding or Sharding(), **lightest.sharding_changes)
    # FSDP2's settings as the lightest row had them, then (CUDA) the most saving ones too
    saving = replace(sharding, cpu_offload=True, shard_embeddings=not config.tie_word_embeddings)
    for count in (n for n in (cards * 2, cards * 4, cards * 8) if n <= 8 and t.batch_size % n == 0):
        for sh in (sharding, saving) if target == "cuda" and saving != sharding else (sharding,):
            try:
                memory = Predictor.of(config, target, count, sh).estimate(t)
            except ESTIMATE_ERRORS:  # (an NF4 weight that does not split over so many ranks)
                continue
            need = required(memory)
            on_host = host_room is None or memory.host is None or memory.host.without_undo <= host_room
            if need <= room and on_host:
                return count, lightest, need, sh
    return None


def _searched(search: _Search, skipped: int, size: int) -> str:
    """What the search cost: estimates run, cache hits, what was ruled out (the details)."""
    return (f"{search.estimates} estimate{'s' if search.estimates != 1 else ''} run, "
            f"{len(search.rows) - search.estimates} from the cache, {skipped} combination"
            f"{'s' if skipped != 1 else ''} ruled out without one, of {size}")


def _failures(search: _Search) -> str:
    """The estimates that failed (the message says so: its answer left them out)."""
    errors = [r for r in search.rows if r.error]
    if not errors:
        return ""
    return (f" {len(errors)} could not be estimated, and combinations including their toggles "
            f"were skipped (first: {errors[0].label}: {errors[0].error[:160]}).")


def _on_host(memory: MemoryBreakdown, host_room: int | None, host_limit: int | None) -> str:
    """The answer's host sentence (empty where the host is not checked)."""
    if host_room is None or memory.host is None:
        return ""
    text = (f" Host memory: {format_bytes(memory.host.without_undo)} of "
            f"{format_bytes(host_room)} usable of {format_bytes(host_limit)}")
    if memory.host.undo and memory.host.peak > host_room:
        text += (f", with no undo copy (it would need {format_bytes(memory.host.undo)} "
                 "more: a failure half-way through an update is then recovered with "
                 "session.recover())")
    elif memory.host.undo:
        text += f", {format_bytes(memory.host.undo)} more for the undo copy"
    return text + "."


def _found(c: Candidate, need: int, card: str, on_host: str, tried_text: str,
           out_of_tries: bool) -> str:
    """The message of a search that found a combination."""
    if not c.changes and not c.sharding_changes:
        return f"The start fits: predicted peak {format_bytes(need)} of {card}.{on_host}{tried_text}"
    what = ("The cheapest predicted to fit before max_tries ran out (raise it to look "
            "for a faster one)" if out_of_tries else "Fastest predicted to fit")
    message = (f"{what}: {c.label}; predicted peak {format_bytes(need)} of "
               f"{card}; step time about {c.cost:.2f}x a plain step.{on_host}")
    if c.sharding_changes:
        message += (f" FSDP2 with distributed: {_settings(c.sharding)} in the run file "
                    "(nbtune train, Session.from_config(..., processes=N)).")
    if c.exact:
        message += " Same maths as the start."
    else:
        maths = {k: v for k, v in c.changes.items() if k not in PLACEMENT_FIELDS}
        if c.sharding_changes and "mixed_precision" in c.sharding_changes:
            maths["distributed.mixed_precision"] = c.sharding.mixed_precision
        message += (" No combination that keeps the maths fits, so this one changes it: "
                    + ", ".join(f"{k}={v!r}" for k, v in maths.items()) + ".")
    apply = APPLY_IN_CODE if c.changes else ""
    return message + (f" {apply}" if apply else "") + tried_text


def _settings(sharding: Sharding) -> str:
    """FSDP2's settings as the run file writes them."""
    def yaml(value) -> str:
        return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)

    names = SHARDING_AXES + (("replicate",) if sharding.replicate != 1 else ())
    return "{" + ", ".join(f"{k}: {yaml(getattr(sharding, k))}" for k in names) + "}"


def _nothing(rows: list[FitRow], where: str, room: int, max_tries: int | None,
             tried_text: str) -> str:
    """The message of a search that found nothing (``max_tries``: it ran out of tries)."""
    sized = [r for r in rows if r.peak is not None]
    message = f"Nothing tried fits in {where}."
    if sized:
        best = min(sized, key=lambda r: r.peak)
        message += f" The smallest predicted peak was {format_bytes(best.peak)} ({best.label})."
        on_card = [r for r in sized if r.peak <= room]
        if on_card:
            lightest = min(on_card, key=lambda r: r.host)
            message += (f" {len(on_card)} fit on the card but not on the host: the lightest needs "
                        f"{format_bytes(lightest.host)} of host memory ({lightest.label}).")
    if max_tries is not None:
        message += (f" The search stopped after max_tries={max_tries} estimates with combinations "
                    "left: raise max_tries to go on.")
    else:
        message += (" Shorten seq_len, lower the effective batch (batch_size x grad_accum), "
                    "train fewer weights, or use a card with more memory.")
    return message + tried_text

