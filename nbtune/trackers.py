"""Trackers: a run's figures sent to the experiment trackers users already have (TensorBoard,
trackio, Weights & Biases, MLflow), each through its own library's API and each working
offline: TensorBoard's event files, trackio's local store, W&B's offline run folder (``wandb
sync`` uploads it later) unless a W&B login is set up, MLflow's local store in the run's
folder unless ``MLFLOW_TRACKING_URI`` names one.

Logged: every step's loss, lr, tokens/s and memory figure (and each breakdown's categories
when a step was broken down), the objective's metrics (TRL's names), the held-out results,
the estimate beside the measured peak; the techniques as the run's configuration and a
toggle changed mid-run at its step. A tracker that fails (no disk, a bad key) is said once
and left out; the run goes on.

The libraries are extras (``pip install 'nbtune[trackers]'``): none is needed until named."""

from __future__ import annotations

import contextlib
import json
import os
import re
import threading
import time
from pathlib import Path
from typing import Callable

TRACKERS = ("tensorboard", "trackio", "wandb", "mlflow")
MODULES = {"tensorboard": "tensorboard", "trackio": "trackio", "wandb": "wandb", "mlflow": "mlflow"}
INSTALL = {"tensorboard": "tensorboard", "trackio": "trackio", "wandb": "wandb", "mlflow": "mlflow-skinny"}


# a preference step's metrics as TRL logs them (``rewards/margins``, ...)
TRL_NAMES = {"chosen_reward": "chosen", "rejected_reward": "rejected", "margin": "margins",
             "accuracy": "accuracies"}


class TrackerError(ValueError):
    """A tracker nbtune does not know, or whose library is not installed."""


def check_trackers(names) -> tuple[str, ...]:
    """``names`` as a tuple, refused before anything runs when one is unknown or missing."""
    import importlib.util

    names = (names,) if isinstance(names, str) else tuple(names)
    for name in names:
        if name not in TRACKERS:
            raise TrackerError(f"{name!r} is not a tracker nbtune logs to; it knows "
                               f"{', '.join(TRACKERS)}.")
        if importlib.util.find_spec(MODULES[name]) is None:
            raise TrackerError(f"{name} is not installed: pip install {INSTALL[name]} (or "
                               f"'nbtune[trackers]' for all four), or leave it out.")
    return names


def step_metrics(report) -> dict[str, float]:
    """A step's figures by name (TRL's names for the objectives' metrics); a broken-down
    step's memory categories under ``memory/``."""
    memory = report.memory
    out = {"train/loss": report.loss, "train/lr": report.lr,
           "train/tokens_per_second": report.tokens_per_second, "train/tokens": report.tokens,
           "memory/peak_bytes": memory.peak}
    if memory.measured:
        out.update({f"memory/{name}_bytes": value for name, value in memory.categories.items()})
    if report.usage is not None:
        out["memory/every_step_bytes"] = report.usage.peak
    if report.eval_loss is not None:
        out["eval/loss"] = report.eval_loss
    if report.router_loss is not None:
        out["train/router_loss"] = report.router_loss
    for prefix, metrics in (("train/rewards/", report.preference), ("eval/rewards/", report.eval_preference)):
        if metrics is not None:
            out.update({prefix + TRL_NAMES[k]: v for k, v in vars(metrics).items()})
    r = report.rollouts
    if r is not None:
        out.update({"train/reward": r.reward, "train/reward_std": r.reward_std,
                    "train/completions/mean_length": r.completion_length,
                    "train/completions/clipped_ratio": r.clipped,
                    **{f"train/rewards/{name}/mean": v for name, v in r.rewards.items()}})
        if report.mean_kl is not None:
            out["train/kl"] = report.mean_kl
    return {k: float(v) for k, v in out.items() if v is not None}


def _flat(config: dict) -> dict[str, object]:
    """Techniques as plain values (tuples as lists), for trackers that take a dict."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in config.items()}


class _TensorBoard:
    def __init__(self, run: "Trackers") -> None:
        config = run.config
        from torch.utils.tensorboard import SummaryWriter

        self.where = run.tensorboard
        # resumed: the steps after the checkpoint are done again, so their old events go
        self.writer = SummaryWriter(str(self.where), purge_step=run.resumed_at + 1 if run.resumed_at else None)
        self.writer.add_text("techniques", f"```\n{json.dumps(_flat(config), indent=1)}\n```", 0)

    def log(self, metrics: dict, step: int) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)

    def note(self, text: str, step: int) -> None:
        self.writer.add_text("changes", text, step)

    def close(self) -> None:
        self.writer.close()


class _RunLog:
    """A tracker whose run object logs a dict at a step and finishes (trackio's and W&B's)."""

    run: object

    def log(self, metrics: dict, step: int) -> None:
        self.run.log(metrics, step=step)

    def note(self, text: str, step: int) -> None:
        self.run.log({"changes": text}, step=step)

    def close(self) -> None:
        self.run.finish()


class _Trackio(_RunLog):
    def __init__(self, run: "Trackers") -> None:
        project, name, config = run.project, run.name, run.config
        import trackio

        self.run = trackio.init(project=project, name=name, config=_flat(config), embed=False,
                                auto_log_gpu=False, auto_log_cpu=False)
        self.where = f"trackio's local store (trackio show --project {project})"


def _wandb_login() -> bool:
    """Whether a W&B key is set up (WANDB_API_KEY, or ``wandb login``'s entry in ~/.netrc)."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    netrc = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    try:
        return "api.wandb.ai" in netrc.read_text(errors="replace")
    except OSError:
        return False


class _WandB(_RunLog):
    def __init__(self, run: "Trackers") -> None:
        folder, project, name, config = run.folder, run.project, run.name, run.config
        import wandb

        mode = os.environ.get("WANDB_MODE") or ("online" if _wandb_login() else "offline")
        self.run = wandb.init(project=project, name=name, config=_flat(config), dir=str(folder),
                              mode=mode, reinit="create_new",
                              settings=wandb.Settings(silent=True, console="off", x_disable_stats=True))
        self.where = (f"W&B ({self.run.url})" if mode == "online" else
                      f"W&B offline in {folder / 'wandb'} (wandb sync uploads it)")


class _MLflow:
    def __init__(self, run: "Trackers") -> None:
        folder, project, name, config = run.folder, run.project, run.name, run.config
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI")
        local = uri is None
        if local:  # a local store in the run's folder
            uri = (folder / "mlruns").resolve().as_uri()
        with _opted_in_to_files(local):  # MLflow 3 asks to opt in to a file store as it is made
            self.client = MlflowClient(tracking_uri=uri)
            experiment = self.client.get_experiment_by_name(project)
            experiment_id = (experiment.experiment_id if experiment is not None else
                             self.client.create_experiment(project))
        self.run_id = self.client.create_run(experiment_id, run_name=name).info.run_id
        self.client.log_batch(self.run_id, params=[Param(k, str(v)[:6000]) for k, v in _flat(config).items()])
        self.where = f"MLflow ({uri}, experiment {project!r})"

    def log(self, metrics: dict, step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        # MLflow takes letters, digits and _-. /: a reward named <lambda> would be refused
        self.client.log_batch(self.run_id, metrics=[Metric(re.sub(r"[^\w./\- ]", "_", k), v, now, step)
                                                    for k, v in metrics.items()])

    def note(self, text: str, step: int) -> None:
        self.client.set_tag(self.run_id, f"changed at step {step}", text[:5000])

    def fail(self) -> None:
        self.client.set_terminated(self.run_id, status="FAILED")

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


@contextlib.contextmanager
def _opted_in_to_files(local: bool):
    """MLFLOW_ALLOW_FILE_STORE while MLflow makes a store in the run's folder, then as it was."""
    before = os.environ.get("MLFLOW_ALLOW_FILE_STORE")
    if local:
        os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
    try:
        yield
    finally:
        if local and before is None:
            os.environ.pop("MLFLOW_ALLOW_FILE_STORE", None)
        elif local:
            os.environ["MLFLOW_ALLOW_FILE_STORE"] = before


_KINDS = {"tensorboard": _TensorBoard, "trackio": _Trackio, "wandb": _WandB, "mlflow": _MLflow}


class Trackers:
    """The trackers of one run: started with the techniques as its configuration, fed every
    step's figures, a changed toggle and held-out results; a tracker that fails is said once
    (``say``) and dropped. Events may come from a background run's thread: one lock, and
    nothing is written once closed."""

    def __init__(self, names, folder, *, project: str = "nbtune", name: str | None = None,
                 config: dict | None = None, say: Callable[[str], None] = print,
                 resumed_at: int = 0) -> None:
        """``folder``: where the local stores go (TensorBoard's under ``tensorboard/<name>``,
        or ``tensorboard/`` itself for a run that has its own folder: ``name=None``);
        ``resumed_at``: the step a resumed run starts after (TensorBoard drops its later events)."""
        self.names, self.folder, self.say = check_trackers(names), Path(folder), say
        self.project, self.name = project, name or self.folder.resolve().name
        self.tensorboard = self.folder / "tensorboard" / (name or "")
        self.resumed_at, self.last_step = resumed_at, resumed_at
        self.open: dict[str, object] = {}
        self.config = _flat(dict(config or {}))
        self.subscription, self._estimate, self._estimate_due = None, None, False
        self._lock = threading.Lock()
        for tracker in self.names:
            self._guard(tracker, "start", lambda t=tracker: self.open.__setitem__(t, _KINDS[t](self)))

    def _guard(self, tracker: str, what: str, call) -> None:
        try:
            call()
        except Exception as err:  # noqa: BLE001 - a tracker never stops the run
            self.open.pop(tracker, None)
            self.say(f"{tracker} failed to {what} ({type(err).__name__}: {str(err)[:200]}); the run "
                     f"goes on without it.")

    @property
    def where(self) -> list[str]:
        """Where each open tracker writes, in words."""
        return [str(getattr(tracker, "where", name)) for name, tracker in self.open.items()]

    def log(self, metrics: dict[str, float], step: int) -> None:
        with self._lock:
            for name, tracker in list(self.open.items()):
                self._guard(name, "log", lambda: tracker.log(metrics, step))

    def step(self, report, estimate=None) -> None:
        """A step's figures; ``estimate`` (bytes, or a function giving them) beside its peak.
        Neither a figure nor the estimate failing stops the run: it is said and left out."""
        try:
            metrics = step_metrics(report)
            if callable(estimate):
                estimate = estimate()
            if estimate is not None:
                metrics["memory/estimate_bytes"] = float(estimate)
        except Exception as err:  # noqa: BLE001 - the trackers are never the reason a run stops
            self.say(f"the trackers' figures for step {report.step} failed ({type(err).__name__}: "
                     f"{str(err)[:120]}); the measured loss and memory go on.")
            metrics = {"train/loss": float(report.loss), "memory/peak_bytes": float(report.memory.peak)}
        self.last_step = report.step
        self.log(metrics, report.step)

    def changed(self, before: dict, after: dict, step: int) -> None:
        """A toggle changed mid-run: its numbers as metrics and the change in words, at ``step``."""
        diff = {k: v for k, v in after.items() if before.get(k) != v}
        if not diff:
            return
        self.config.update(diff)
        numbers = {f"techniques/{k}": float(v) for k, v in diff.items() if isinstance(v, (int, float))}
        if numbers:
            self.log(numbers, step)
        text = ", ".join(f"{k}: {before.get(k)!r} -> {v!r}" for k, v in diff.items())
        with self._lock:
            for name, tracker in list(self.open.items()):
                self._guard(name, "log", lambda: tracker.note(text, step))

    def follow(self, subscribe, estimate: Callable[[], int] | None = None) -> "Trackers":
        """Log each step and each applied change a runner announces (``subscribe``: its
        ``subscribe``); ``estimate()``, the predicted peak, is logged beside the measured one
        at the first step and after each change."""
        self._estimate, self._estimate_due = estimate, estimate is not None
        self.subscription = subscribe(self._on_event)
        return self

    def _on_event(self, event) -> None:
        if not self.open:
            return
        if event.kind == "step":
            estimate = self._estimate if self._estimate_due else None
            self._estimate_due = False
            self.step(event.report, estimate)
        elif event.kind == "techniques":
            self.changed(self.config, _flat(event.techniques.as_dict()), self.last_step + 1)
            self._estimate_due = self._estimate is not None

    def close(self, failed: bool = False) -> None:
        """Stop following the run and close every tracker (their files complete; W&B's
        service process writes its offline file's last records moments after); ``failed``:
        the run ended in an error (MLflow marks its run FAILED)."""
        if self.subscription is not None:
            self.subscription.close()
            self.subscription = None
        with self._lock:
            for name, tracker in list(self.open.items()):
                self._guard(name, "close", tracker.fail if failed and hasattr(tracker, "fail") else tracker.close)
            self.open.clear()
