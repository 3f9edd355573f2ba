"""The technique ladders: run configurations in turn and tabulate what each one buys.

Each row's changes apply on top of the previous row's, as in torchtune's "optimization
flags" table: start with ``{}`` for the baseline. Each row reports its measured peak (every
step tracked), the change from the row before, tokens per second after the first step, and
the estimate for its shape. Two places a row can run:

* ``compare`` (``Session.compare``): on a trial trainer (a fresh copy of the model: the
  session itself is not trained), which flips its toggles row by row through
  ``Trainer.set``, so what a row replaces is released before the next one runs;
* ``ladder`` (``nbtune ladder``) and ``compare_on_ranks`` (``Session.compare`` on ranks): each
  row built afresh from a run file on FSDP2 ranks (under torchrun, or ranks started here),
  with every rank's peak gathered.
"""

from __future__ import annotations

import base64
import html
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .. import runfile
from ..atomic import write_file_atomically
from ..hardware import BUSY_CORES, Contention
from ..techniques import Techniques, label_of
from ..units import format_bytes
from . import factory


@dataclass(frozen=True)
class LadderRow:
    """One row of a ladder: a configuration, its measured peak and speed, its estimate.

    Attributes:
        label: What this row changed, e.g. "+activation_checkpointing".
        techniques: The row's whole techniques.
        peak: Bytes: the highest step peak over the row's steps.
        change: The peak against the previous row's, in percent.
        tokens_per_second: Over the timed steps after the first (which pays set-up costs).
        estimated_peak: What ``estimate`` predicts for the row's batch shape.
        loss: The last step's loss.
        at_peak: The categories that made up the peak.
        categories: Each category's high point in the step.
        error: Why the row could not run (out of memory, say).
        busy: Cores other processes kept busy while it ran (``Contention``).
    """

    label: str  # what this row changed, e.g. "+activation_checkpointing"
    techniques: Techniques
    peak: int = 0  # bytes: highest step peak over the row's steps
    change: float | None = None  # peak vs the previous row, in percent
    tokens_per_second: float = 0.0  # over the timed steps after the first (which pays set-up costs)
    estimated_peak: int | None = None  # what ``estimate`` predicts for the row's batch shape
    loss: float = float("nan")  # last step's loss
    at_peak: dict = field(default_factory=dict)  # the categories that made up the peak
    categories: dict = field(default_factory=dict)  # each category's high point in the step
    error: str | None = None  # the row could not run (out of memory, say)
    busy: float | None = None  # cores other processes kept busy while it ran (``Contention``)

    @property
    def speed_suspect(self) -> bool:
        """Other processes used the cores while the row was timed: its tokens/s is the
        machine's, not the technique's."""
        return self.busy is not None and self.busy >= BUSY_CORES


def ladder_techniques(start: Techniques, configs, device: str) -> list[tuple[str, Techniques]]:
    """(label, techniques) per row, each row's changes on top of the last; all validated
    (against ``device``'s rules too) before anything runs. A row may also be a whole
    ``Techniques``."""
    rows, current = [], start
    for i, config in enumerate(configs):
        if isinstance(config, Techniques):
            changes = {name: getattr(config, name) for name in config.changed(current)}
            current, label = config, label_of(changes)
        elif isinstance(config, dict):
            try:
                current = current.replace(**config)
            except (TypeError, ValueError) as err:
                raise ValueError(f"compare: row {i} ({config!r}) is not valid: {err}") from None
            label = label_of(config)
        else:
            raise TypeError(f"compare: row {i} is a {type(config).__name__}; give a dict of "
                            "toggle changes (e.g. {'activation_checkpointing': True}) or a Techniques.")
        rows.append((label, current))
    if not rows:
        raise ValueError("compare: give at least one configuration, e.g. [{}, {'dtype': 'bf16'}].")
    for label, t in rows:
        broken = t.conflicts(device)
        if broken:
            raise ValueError(f"compare: row {label!r}: " + " ".join(r.reason for r in broken))
    return rows


class Ladder:
    """The ladder's rows (``len()``, indexing and iteration work), a table and a bar chart.

    Args:
        rows: One ``LadderRow`` per configuration, in order.
        device: Where the rows ran.
        steps: Steps each row ran.
    """

    def __init__(self, rows: list[LadderRow], device: str, steps: int) -> None:
        self.rows, self.device, self.steps = rows, device, steps

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index):
        """A row, or for a slice a ``Ladder`` of those rows (it shows as a table and chart)."""
        if isinstance(index, slice):
            return Ladder(self.rows[index], self.device, self.steps)
        return self.rows[index]

    def __iter__(self):
        return iter(self.rows)

    def as_dicts(self) -> list[dict]:
        """Every row as a dict (for a DataFrame or JSON).

        Returns:
            Dicts of configuration, peak, change, speed, estimate, loss and error.
        """
        return [{"configuration": r.label, "peak_bytes": r.peak, "change_pct": r.change,
                 "tokens_per_second": r.tokens_per_second,
                 "estimated_peak_bytes": r.estimated_peak, "loss": r.loss, "error": r.error,
                 "busy_cores": r.busy}
                for r in self.rows]

    def _cells(self) -> list[list[str]]:
        from ..units import format_bytes

        out = []
        for r in self.rows:
            if r.error:
                out.append([r.label, r.error, "", "", ""])
                continue
            change = "" if r.change is None else f"{r.change:+.1f}%"
            estimate = "" if r.estimated_peak is None else format_bytes(r.estimated_peak)
            speed = f"{r.tokens_per_second:,.0f}" + (" (busy*)" if r.speed_suspect else "")
            out.append([r.label, format_bytes(r.peak), change, speed, estimate])
        if not self._estimated:
            out = [row[:-1] for row in out]
        return out

    HEADER = ["configuration", "peak", "change", "tokens/s", "estimated peak"]

    @property
    def _estimated(self) -> bool:
        """Whether any row has an estimate: without one (``estimate=False``) the column goes."""
        return any(r.estimated_peak is not None for r in self.rows)

    @property
    def header(self) -> list[str]:
        """The table's column names (the estimate's only where rows were estimated)."""
        return self.HEADER if self._estimated else self.HEADER[:-1]

    def __repr__(self) -> str:
        cells = [self.header] + self._cells()
        widths = [max(len(row[i]) for row in cells) for i in range(len(self.header))]
        lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
                 for row in cells]
        lines.insert(1, "  ".join("-" * w for w in widths))
        return "\n".join(lines) + (f"\n{self.busy_note}" if self.busy_note else "")

    @property
    def busy_note(self) -> str:
        """What the "(busy*)" marks mean, where a row has one."""
        busy = [r for r in self.rows if r.speed_suspect]
        if not busy:
            return ""
        most = max(r.busy for r in busy)
        return (f"* busy: other processes kept up to {most:.1f} cores busy while "
                f"{'this row' if len(busy) == 1 else 'these rows'} ran, so the tokens/s is the "
                "machine's, not the technique's: run it again on a quiet machine to compare speeds.")

    def chart(self):
        """Bars of each row's peak, split by what held memory at that moment."""
        from ..charts import ladder_figure

        return ladder_figure(self)

    def _repr_html_(self) -> str:
        from ..charts import figure_png

        head = "".join(f"<th>{h}</th>" for h in self.header)
        body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>"
                       for row in self._cells())
        png = base64.b64encode(figure_png(self.chart(), dpi=90)).decode()
        return (f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"
                f"<p style='font-size:smaller'>{self.steps} steps per row on {self.device}; "
                f"peak = most memory held at one moment.{' ' + html.escape(self.busy_note) if self.busy_note else ''}</p>"
                f"<img src='data:image/png;base64,{png}'/>")


# ---- running a ladder ----------------------------------------------------------------------

def compare(trainer, configs, steps: int = 4, *, estimate: bool = True,
            progress: bool = True) -> Ladder:
    """``Session.compare``: each configuration of ``configs`` run ``steps`` steps on a trial
    trainer over a fresh copy of ``trainer``'s model and data, tabulated.

    On CUDA every step is measured; on CPU the second one is (tracking slows a step down)
    and the untracked steps after it are timed. On CUDA the session's own model stays on the
    device: each row's peak is counted above it, and a row that does not fit beside it
    reports out of memory."""
    import gc

    from tqdm.auto import tqdm

    from ..predict import estimate as estimate_step

    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"compare: steps must be a positive int, got {steps!r}.")
    device = trainer.device
    rows = ladder_techniques(trainer.techniques, configs, device.type)
    cuda = device.type == "cuda"
    baseline = torch.cuda.memory_allocated(device) if cuda else 0
    trial = _trial(trainer, rows[0][1])
    results = []
    try:
        for label, t in tqdm(rows, desc="ladder", unit="row", disable=not progress):
            results.append(_row(trial, trainer.model.config, label, t, steps, baseline,
                                estimate_step if estimate else None,
                                results[-1] if results else None))
    finally:
        del trial
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    return Ladder(results, str(device), steps)


def _trial(trainer, techniques: Techniques):
    """A quiet throw-away trainer on a fresh copy of ``trainer``'s model and the same data."""
    from ..models import load_model
    from ..models.decoder import CausalLM
    from .trainer import Trainer

    if trainer.base is not None:
        quantize = techniques.nf4_targets
        model = load_model(trainer.base, dtype=techniques.dtype, device=trainer.device,
                           quantize=quantize)
    else:  # built in code: the same shapes with fresh weights (memory does not depend on values)
        model = CausalLM(trainer.model.config)
    return Trainer(model, trainer.data, techniques, trainer.device)


def _row(trial, config, label: str, t: Techniques, steps: int, baseline: int, estimate_step,
         previous: LadderRow | None) -> LadderRow:
    # CPU tracking slows a step down, so there one step is measured (the second: the first
    # creates optimizer state) and the untracked ones after it are timed.
    cpu = trial.device.type == "cpu"
    plan = [False, True] + [False] * (steps - 2) if cpu and steps > 1 else [True] * steps
    reports = []
    try:
        trial.set(t)
        with Contention() as others:
            for track in plan:
                reports.append(trial.step(track))
    except torch.OutOfMemoryError:  # the trial rolled the step back; the ladder goes on
        return LadderRow(label, t, error="out of memory")
    top = max((r for r, track in zip(reports, plan) if track), key=lambda r: r.memory.peak)
    timed = [r for r, track in zip(reports, plan) if not track][1:] or reports[1:] or reports
    seconds = sum(r.seconds for r in timed)
    predicted = None
    if estimate_step is not None:
        predicted = estimate_step(config, t, batch_size=top.shape[0], seq_len=top.shape[1],
                                  device=trial.device.type).peak
    peak = top.memory.peak - baseline
    at_peak, left = dict(top.memory.at_peak), baseline
    for residual in ("other", "activations"):  # CUDA: the session's own memory sits in the rest
        taken = min(left, at_peak.get(residual, 0))
        at_peak[residual] = at_peak.get(residual, 0) - taken
        left -= taken
    change = None
    if previous is not None and previous.peak:
        change = 100.0 * (peak - previous.peak) / previous.peak
    return LadderRow(label, t, peak=peak, change=change,
                     tokens_per_second=sum(r.tokens for r in timed) / seconds if seconds else 0.0,
                     estimated_peak=predicted, loss=reports[-1].loss,
                     at_peak=at_peak, categories=dict(top.memory.categories), busy=others.others)


# ---- nbtune ladder: the FSDP2 memory ladder, one row per added technique ----------------

# The FSDP2 ladder: each row adds its change to the rows before it.
FSDP_LADDER = (
    ("FSDP2", {}),
    ("+ activation checkpointing", {"techniques.activation_checkpointing": True}),
    ("+ CPU offload", {"distributed.cpu_offload": True}),
    ("+ sharded embeddings", {"distributed.shard_embeddings": True}),
    ("+ chunked loss", {"techniques.chunked_loss": 8}),
)


def ladder(path: str, *, rows=FSDP_LADDER, steps: int = 2, out: str | None = None,
           device: str | None = None, overrides: dict | None = None,
           processes: int | None = None) -> list[dict]:
    """Each row of ``rows`` (label, dotted changes; cumulative) trained ``steps`` steps with
    every step measured, in this process or under torchrun on every rank; rank 0 prints the
    table (peak of the highest rank, change against the first row, and each row's peak per
    rank as ``estimate`` predicts it for full-length rows) and writes ladder.json.
    A row the rules refuse (CPU offload without CUDA, ...) says why and is not carried on; a
    row that runs out of memory says so and the ladder goes on (under torchrun it ends the
    job: the other ranks wait for it in a collective).
    ``processes=N``: on N ranks started from here (a notebook cell), as under torchrun; a
    row out of memory there names the rank (``rows_on_ranks``)."""
    from ..distributed import Parallel

    if processes is not None:
        return _ladder_on_ranks(path, rows, steps, out, overrides, processes)
    # Rank 0 predicts every row first: an estimate runs its own fake process group, which a
    # process cannot do once it belongs to the job's.
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    predicted = (_predicted_rows(path, rows, overrides, device, world)
                 if os.environ.get("RANK", "0") == "0" else {})
    config = runfile.load(path, overrides)
    parallel = Parallel.from_env(config.to_sharding())
    try:
        results = measure_rows(path, rows, steps, parallel, device, overrides, predicted)
    finally:
        if parallel is not None:
            parallel.close()
    if parallel is None or parallel.rank == 0:
        _ladder_table(path, results, world, steps, out)
    return results


def _ladder_on_ranks(path, rows, steps: int, out, overrides, processes: int) -> list[dict]:
    """The ladder on ranks started from this process, which is no rank: it predicts the rows
    (its fake process group is its own), the ranks measure them."""
    results = rows_on_ranks(path, rows, steps, overrides, processes)
    _ladder_table(path, results, processes, steps, out)
    return results


def rows_on_ranks(path, rows, steps: int, overrides, processes: int, predict: bool = True) -> list[dict]:
    """``measure_rows`` on ``processes`` ranks of their own, started and ended here (beside
    any session's ranks: each row's peak is its own processes'), each row predicted first and
    sent as a command of its own. A row that runs out of memory on a rank is a row ("out of
    memory on rank 1"), as in one process: its ranks, which the others would wait for in a
    collective, are ended, and the next row starts on fresh ones (carrying its changes on,
    as a row that ran would)."""
    from ..run.processes import Processes, RankFailed

    predicted = _predicted_rows(path, rows, overrides, None, processes) if predict else {}
    results, carried, ranks = [], dict(overrides or {}), None
    try:
        for label, changes in rows:
            if ranks is None:
                ranks = Processes(path, processes, overrides=overrides, build=False)
            try:
                row = ranks.each(_measure_on_rank, lambda rank: (str(Path(path).resolve()), [(label, changes)],
                                                                 steps, carried, predicted))[0][0]
            except RankFailed as failed:
                if not failed.out_of_memory:
                    raise
                ranks = None  # (ended with the row)
                row = {"label": label, "error": f"out of memory on rank {failed.rank}",
                       "changes": {**carried, **changes}}
            results.append(row)
            carried = row.get("changes", carried)
    finally:
        if ranks is not None:
            ranks.close()
    return results


def compare_on_ranks(ranks, techniques, configs, steps: int, estimate: bool = True):
    """``Session.compare`` of a session on ranks (``ranks``: its ``Processes``): each row (the
    session's ``techniques`` with that row's changes, carried on) built from the run file on
    as many ranks of its own, started for the rows and ended after them, as ``ladder`` builds
    its rows; the session's ranks are left as they were. A row's peak is its highest rank's."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"compare: steps must be a positive int, got {steps!r}.")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = ladder_techniques(techniques, configs, device)  # every row checked before anything starts
    path, overrides = ranks.run_file, ranks.overrides
    names, dotted = set(), []
    for label, t in rows:  # each row's differences from the run file, carried on
        names |= t.changed(ranks.config.to_techniques())
        dotted.append((label, {f"techniques.{name}": list(value) if isinstance(value, tuple) else value
                               for name in names for value in [getattr(t, name)]}))
    measured = rows_on_ranks(path, dotted, steps, overrides, ranks.world, predict=estimate)
    out, previous = [], None
    for (label, t), row in zip(rows, measured):
        if "refused" in row or "error" in row:
            out.append(LadderRow(label, t, error=row.get("refused") or row["error"]))
            previous = None  # the next row's change has nothing to go by, as in compare
            continue
        top = max(row["per_rank"], key=lambda rank: rank["peak"])
        change = 100.0 * (row["peak"] - previous) / previous if previous else None
        out.append(LadderRow(label, t, peak=row["peak"], change=change,
                             tokens_per_second=row["tokens_per_second"],
                             estimated_peak=row["predicted_peak"], at_peak=top["at_peak"]))
        previous = row["peak"]
    return Ladder(out, f"{ranks.world} ranks ({device})", steps)


def _measure_on_rank(path: str, rows, steps: int, overrides, predicted: dict) -> list[dict]:
    """On each rank of ``_ladder_on_ranks`` (an engine in its process group)."""
    from ..run.processes import ENGINE_STATE

    return measure_rows(path, rows, steps, ENGINE_STATE["parallel"], None, overrides, predicted)


def measure_rows(path: str, rows, steps: int, parallel, device, overrides: dict | None,
                 predicted: dict) -> list[dict]:
    """Each row built afresh on ``parallel``'s ranks (None: this process), trained, measured
    and gathered; every rank returns every row (a collective: all ranks call it)."""
    import gc

    carried: dict = dict(overrides or {})
    results = []
    for label, changes in rows:
        if parallel is None and changes and all(k.startswith("distributed.") for k in changes):
            results.append({"label": label, "refused": "an FSDP2 setting: run the ladder under "
                            "torchrun --nproc_per_node 2 (or more) -m nbtune ladder"})
            continue
        if parallel is None and not changes and label == "FSDP2":
            label = "one process (no FSDP2)"
        trial = {**carried, **changes}
        try:
            row_config = runfile.load(path, trial)
            row_parallel = None if parallel is None else replaced_parallel(parallel, row_config)
            parts = factory.from_config(row_config, device=device, parallel=row_parallel)
        except ValueError as err:
            results.append({"label": label, "refused": str(err).splitlines()[0]})
            continue
        carried = trial
        parts.runner.sampler.mode = "every_step"
        try:
            reports = parts.runner.run(steps)  # no subscriber: the rows say nothing
        except torch.OutOfMemoryError:
            if parallel is not None:  # the other ranks wait in a collective: this row ends the job
                raise
            results.append({"label": label, "error": "out of memory", "changes": dict(trial)})
            parts = None
            gc.collect()
            continue
        top = max(reports, key=lambda r: r.memory.peak)
        peak, categories = top.memory.peak, reports[-1].memory.categories
        seconds = sum(r.seconds for r in reports[1:]) or reports[0].seconds
        tokens = sum(r.tokens for r in reports[1:]) or reports[0].tokens
        mine = {"peak": peak, **categories, "at_peak": dict(top.memory.at_peak)}
        every = parallel.gather(mine) if parallel is not None else [mine]
        results.append({"label": label, "peak": max(m["peak"] for m in every),
                        "predicted_peak": predicted.get(label), "per_rank": every,
                        "tokens_per_second": tokens / seconds,
                        "changes": {k: v for k, v in trial.items()}})
        del parts, reports
        gc.collect()
    return results


def _ladder_table(path: str, results: list[dict], ranks: int, steps: int, out) -> None:
    """The ladder as a table on stdout, and ladder.json in ``out``."""
    base = next((r["peak"] for r in results if "peak" in r), None)
    lines = [f"{'row':<28} {'peak per rank':>14} {'change':>8} {'tokens/s':>9} {'predicted':>11}"]
    for r in results:
        if "refused" in r:
            lines.append(f"{r['label']:<28} refused: {r['refused']}")
        elif "error" in r:
            lines.append(f"{r['label']:<28} {r['error']}")
        else:
            change = f"{(r['peak'] / base - 1) * 100:+.0f} %" if base else ""
            guess = format_bytes(r["predicted_peak"]) if r["predicted_peak"] else "-"
            lines.append(f"{r['label']:<28} {format_bytes(r['peak']):>14} {change:>8} "
                         f"{r['tokens_per_second']:9.0f} {guess:>11}")
    print(f"nbtune ladder {path}: {ranks} rank(s), {steps} steps a row, every step measured")
    print("\n".join(lines))
    if out is not None:
        Path(out).mkdir(parents=True, exist_ok=True)
        write_file_atomically(Path(out) / "ladder.json", json.dumps(
            {"ranks": ranks, "steps": steps, "rows": results}, indent=2))


def _predicted_rows(path: str, rows, overrides: dict | None, device: str | None,
                    world: int) -> dict:
    """Each row's predicted peak per rank (label -> bytes; None where it cannot be
    estimated), carried on as ``ladder`` carries its rows. The prediction is for full-length
    rows of the batch, which the measured steps reach only when the data fills them."""
    from ..demos import demo_named
    from ..predict import estimate

    target = device or ("cuda" if torch.cuda.is_available() else "cpu")
    carried, out = dict(overrides or {}), {}
    for label, changes in rows:
        trial = {**carried, **changes}
        try:
            row = runfile.load(path, trial)
            model = demo_named(row.demo).model() if row.demo is not None else row.path(row.model)
            spread = {"ranks": world, "sharding": row.to_sharding()} if world > 1 else {}
            out[label] = estimate(model, row.to_techniques(), device=str(target).split(":")[0],
                                  **spread).peak
        except (ValueError, RuntimeError, NotImplementedError, FileNotFoundError):
            out[label] = None
            continue
        carried = trial
    if world == 1 and "FSDP2" in out:
        out["one process (no FSDP2)"] = out["FSDP2"]
    return out


def replaced_parallel(parallel, config):
    """The same ranks with the row's FSDP2 settings."""
    return type(parallel)(parallel.rank, parallel.world, parallel.local_rank, config.to_sharding())
