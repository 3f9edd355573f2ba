"""What to change after running out of memory: single moves from ``fit``'s search space
(``space.single_moves``), each estimated by the model's ``Predictor``, kept where the
estimator predicts a peak at least 5 % lower.

Under torchrun (a job's process group up) a rank's estimate needs a fake process group of its
own, which a process in a job cannot start: the rank asks a fresh Python process
(``python -m nbtune.predict.advice``, JSON in and out, nothing pickled) instead.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from dataclasses import dataclass

import torch

from ..techniques import Techniques
from .predictor import Predictor
from .space import single_moves

MAX_SUGGESTIONS = 3


@dataclass(frozen=True)
class Suggestion:
    changes: dict  # toggle changes, for session.set(**changes)
    peak: int  # the step's peak the estimator predicts with them, bytes
    exact: bool  # keeps the maths exactly as before
    fits: bool | None  # within the device's memory (None: not known, on CPU)

    @property
    def label(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in self.changes.items())


def suggest(config, t: Techniques, device: torch.device, shape: tuple[int, int] | None,
            limit: int | None, ranks: int = 1, sharding=None) -> tuple[object, list[Suggestion]]:
    """The predicted step of ``t`` (a ``MemoryBreakdown``, None where it cannot be
    estimated) and the changes predicted to lower it, best first. ``ranks``/``sharding``: a
    rank's step under FSDP2 (``shape`` is then this rank's rows)."""
    import torch.distributed as dist

    if ranks > 1 and dist.is_available() and dist.is_initialized():
        return _suggest_elsewhere(config, t, device, shape, limit, ranks, sharding)
    batch, seq = shape if shape else (t.batch_size // ranks, t.seq_len)
    batch *= ranks  # the estimate takes the global batch
    forecaster = Predictor.of(config, device.type, ranks, sharding)

    def predict(new: Techniques):
        # Identity hooks shield the fake step from any saved-tensor hooks around the failed
        # one (offloading, a SimulatedCard); a shape the estimator cannot run is left out.
        try:
            with torch.autograd.graph.saved_tensors_hooks(lambda x: x, lambda x: x):
                return forecaster.estimate(
                    new, batch_size=max(1, batch * new.batch_size // t.batch_size), seq_len=seq)
        except Exception:  # noqa: BLE001
            return None

    now = predict(t)
    current = None if now is None else now.highest
    found = []
    for changes, exact in single_moves(t, device.type):
        predicted = predict(t.replace(**changes))
        if predicted is None or (current is not None and predicted.highest >= 0.95 * current):
            continue
        peak = predicted.highest
        found.append(Suggestion(changes, peak, exact, None if limit is None else peak <= limit))
    # Fitting first, then exact, then in the cheapest-first order of ``single_moves``.
    found.sort(key=lambda s: (s.fits is False, not s.exact))
    return now, found[:MAX_SUGGESTIONS]


def _suggest_elsewhere(config, t, device, shape, limit, ranks, sharding):
    """``suggest`` run by a fresh Python process (this one is in a job's process group)."""
    ask = {"config": dataclasses.asdict(config), "techniques": t.as_dict(), "device": device.type,
           "shape": shape, "limit": limit, "ranks": ranks,
           "sharding": dataclasses.asdict(sharding) if sharding is not None else None}
    done = subprocess.run([sys.executable, "-m", "nbtune.predict.advice"], input=json.dumps(ask),
                          capture_output=True, text=True, timeout=600,
                          env=_without_job(), check=False)
    if done.returncode:
        raise RuntimeError(f"the estimate for this rank failed: {done.stderr.strip()[-300:]}")
    answer = json.loads(done.stdout.strip().splitlines()[-1])
    from ..memory.breakdown import MemoryBreakdown

    now = None if answer["now"] is None else MemoryBreakdown(**answer["now"])
    return now, [Suggestion(**s) for s in answer["suggestions"]]


def _without_job() -> dict:
    """This process's environment without torchrun's variables (the child is no rank)."""
    import os

    job = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
           "GROUP_RANK", "ROLE_RANK", "TORCHELASTIC_RUN_ID"}
    return {k: v for k, v in os.environ.items() if k not in job}


def _main() -> None:
    from ..distributed import Sharding
    from ..models.config import ModelConfig

    ask = json.loads(sys.stdin.read(1 << 20))
    config = ModelConfig(**ask["config"])
    sharding = Sharding(**ask["sharding"]) if ask["sharding"] is not None else None
    shape = tuple(ask["shape"]) if ask["shape"] is not None else None
    now, found = suggest(config, Techniques(**ask["techniques"]), torch.device(ask["device"]),
                         shape, ask["limit"], ask["ranks"], sharding)
    brief = None if now is None else {k: getattr(now, k) for k in (
        "parameters", "gradients", "optimizer_state", "activations", "other", "peak", "eval_peak",
        "outside", "at_peak", "device")}
    print(json.dumps({"now": brief, "suggestions": [dataclasses.asdict(s) for s in found]}))


if __name__ == "__main__":
    _main()
