"""What to change after running out of memory: single moves from ``fit``'s search space
(``space.single_moves``), each estimated by the model's ``Predictor``, kept where the
estimator predicts a peak at least 5 % lower."""

from __future__ import annotations

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
            limit: int | None) -> tuple[int | None, list[Suggestion]]:
    """The predicted peak of ``t`` and the changes predicted to lower it, best first."""
    batch, seq = shape if shape else (t.batch_size, t.seq_len)
    forecaster = Predictor.of(config, device.type)

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
