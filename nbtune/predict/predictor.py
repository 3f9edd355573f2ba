"""One ``Predictor`` per model shape and device: the estimates behind the panel's badge, ``fit``,
``longest_context``, the out-of-memory advice and the trainer's host reserve, each made once.

An estimate of an 8B model takes seconds, and the same question comes from several places,
sometimes at once (the panel's badge worker beside a fit search and a longest-context search
on their own threads). So every caller asks the model's one ``Predictor``: its cache is
locked, and a question being answered on one thread is waited for, not asked again, on
another. A combination the estimator cannot run is remembered too (as its error's type and
text: no traceback, whose frames hold the fake step, outlives the call).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import fields
from typing import NamedTuple

from ..memory.breakdown import MemoryBreakdown
from ..techniques import Techniques, as_techniques
from .carry import TraceCache
from .estimator import estimate, resolve_config
from .ranks import Ranks

# What an estimate may raise for a combination it cannot run (remembered, raised again as is).
ESTIMATE_ERRORS = (ValueError, RuntimeError, NotImplementedError)


class EstimateFailed(RuntimeError):
    """The estimator could not run a combination: "ErrorType: message"."""


def memory_twin(t: Techniques) -> Techniques:
    """``t`` with what does not change a step's memory set to one value, so equal-memory
    configurations share a cache entry: the peak is reached by the second micro-batch (the
    gradients of the first are then held), so grad_accum 2 stands for any more."""
    return t.replace(grad_accum=min(t.grad_accum, 2), lr=Techniques.lr, warmup_steps=0, seed=0,
                     beta=Techniques.beta, gamma=Techniques.gamma)


def config_key(config) -> tuple:
    """A ``ModelConfig``'s identity for caching: every compared field, by value."""
    return tuple((f.name, repr(getattr(config, f.name))) for f in fields(config) if f.compare)


_PREDICTORS: "OrderedDict[tuple, Predictor]" = OrderedDict()  # Predictor.of's, by model and device
_REGISTRY_LOCK = threading.Lock()
# Gradients made in forward hold what a recomputing backward holds at the same point, and
# the pieces' loss scalars and their gradient's scale a moment longer: 12 bytes measured.
LOSS_PIECES_SLACK = 1024
# model shapes kept, each per device and sharding (an 8B's cache is a few MiB of breakdowns at
# most): one fit over several cards makes up to 16 (FSDP2's settings), and keeps the others
MAX_PREDICTORS = 32


class Predictor:
    """Estimates of one model ``config`` on one ``device`` ("cpu" or "cuda"), cached.

    ``estimate(t)`` is ``nbtune.estimate(config, t, device=device)`` asked once per memory
    twin (``memory_twin``) and shape; ``estimates`` counts the estimator's runs. A tiled
    step's two recorded runs are kept beside (``carry.TraceCache``), so every other length
    of it is read from them.

    Args:
        config: The model's ``ModelConfig`` (``Predictor.of`` takes anything ``estimate`` does).
        device: "cpu" or "cuda".
        estimator: A stand-in with ``estimate``'s signature (tests).
        ranks: Processes under FSDP2: each one's step is predicted.
        sharding: FSDP2's settings.
    """

    CACHE_SIZE = 512

    def __init__(self, config, device: str = "cuda", *, estimator=None, ranks: int = 1,
                 sharding=None) -> None:
        self.config, self.device = resolve_config(config), str(device)
        spread = Ranks.of(ranks, sharding)  # checked once; estimates run per rank under FSDP2
        self.ranks, self.sharding = (1, None) if spread is None else (spread.world, spread.sharding)
        self._estimator = estimator
        self._cache: OrderedDict[tuple, object] = OrderedDict()
        self._traces = TraceCache()  # few-tile recordings of tiled steps (``carry``)
        self._lock = threading.Lock()
        self._running: dict[tuple, threading.Event] = {}  # questions being answered now
        self.estimates = 0

    def _key(self, t: Techniques, batch_size: int | None, seq_len: int | None) -> tuple:
        return (memory_twin(t), batch_size or t.batch_size, seq_len or t.seq_len)

    def cached(self, techniques, *, batch_size: int | None = None,
               seq_len: int | None = None) -> bool:
        """Whether ``estimate`` would answer without running the estimator.

        Args:
            techniques: A ``Techniques`` or a dict of its fields.
            batch_size: Overrides the techniques'.
            seq_len: Overrides the techniques'.

        Returns:
            True when the answer is in the cache.
        """
        with self._lock:
            return self._key(as_techniques(techniques), batch_size, seq_len) in self._cache

    def estimate(self, techniques, *, batch_size: int | None = None,
                 seq_len: int | None = None, recompute_loss: bool = True) -> MemoryBreakdown:
        """The step's predicted memory; raises the estimator's error (``ESTIMATE_ERRORS``)
        for a combination it cannot run, every time it is asked. ``recompute_loss=False``:
        with a chunked loss's gradients made in forward (``keeps_loss_pieces``).

        Args:
            techniques: A ``Techniques`` or a dict of its fields.
            batch_size: Overrides the techniques'.
            seq_len: Overrides the techniques'.
            recompute_loss: As ``nbtune.estimate`` takes it.

        Returns:
            The step's ``MemoryBreakdown``.
        """
        t = as_techniques(techniques)
        key = self._key(t, batch_size, seq_len) + (() if recompute_loss else ("kept",))
        kept = {} if recompute_loss else {"recompute_loss": False}
        while True:
            with self._lock:
                if key in self._cache:
                    self._cache.move_to_end(key)
                    return _answer(self._cache[key])
                running = self._running.get(key)
                if running is None:
                    self._running[key] = threading.Event()
                    break
            running.wait()  # another thread is answering it: take its answer
        try:
            try:
                if self._estimator is not None:
                    result = self._estimator(self.config, key[0], batch_size=key[1],
                                             seq_len=key[2], device=self.device, **self._spread,
                                             **kept)
                else:
                    result = estimate(self.config, key[0], batch_size=key[1], seq_len=key[2],
                                      device=self.device, traces=self._traces, **self._spread,
                                      **kept)
            except ESTIMATE_ERRORS as err:
                result = _Failed(type(err), " ".join(str(err).split()))
            with self._lock:
                self.estimates += 1
                self._cache[key] = result
                while len(self._cache) > self.CACHE_SIZE:
                    self._cache.popitem(last=False)
        finally:
            with self._lock:
                self._running.pop(key).set()
        return _answer(result)

    def keeps_loss_pieces(self, techniques) -> bool:
        """Whether a chunked loss's pieces make their gradients in forward rather than be
        recomputed in backward (the recompute costs a forward of the head: 7-9 % of a 125M
        model's step on a CPU, ``benchmarks/head_profile.py``): where that does not raise the
        step's predicted peak by more than ``LOSS_PIECES_SLACK``. Not with sequence tiling (it
        recomputes every tile by design), not where either estimate fails.

        Args:
            techniques: A ``Techniques`` or a dict of its fields.

        Returns:
            True where the pieces' gradients are best made in forward.
        """
        t = as_techniques(techniques)
        if t.chunked_loss <= 1 or t.loss_always_recomputed:
            return False
        try:
            return (self.estimate(t, recompute_loss=False).peak
                    <= self.estimate(t).peak + LOSS_PIECES_SLACK)
        except ESTIMATE_ERRORS:
            return False

    @property
    def _spread(self) -> dict:
        """``estimate``'s ranks and sharding, where there are several ranks."""
        return {"ranks": self.ranks, "sharding": self.sharding} if self.ranks > 1 else {}

    def clear(self) -> None:
        """Forget every estimate."""
        with self._lock:
            self._cache.clear()
        self._traces.clear()

    @classmethod
    def of(cls, model, device: str = "cuda", ranks: int = 1, sharding=None) -> "Predictor":
        """The one ``Predictor`` of ``model`` (anything ``estimate`` takes) on ``device``, for
        each of ``ranks`` processes under FSDP2 (``sharding``: its settings); a ``Predictor``
        given as ``model`` is used as it is.

        Args:
            model: Anything ``estimate`` takes, or a ``Predictor``.
            device: "cpu" or "cuda".
            ranks: Processes under FSDP2.
            sharding: FSDP2's settings.

        Returns:
            The shared ``Predictor``.
        """
        target = "cuda" if str(device).startswith("cuda") else str(device)
        if isinstance(model, Predictor):
            if model.device != target:
                raise ValueError(f"device={device!r}: this Predictor estimates for {model.device!r}.")
            return model
        config = resolve_config(model)
        spread = Ranks.of(ranks, sharding)
        key = (config_key(config), target, spread)
        with _REGISTRY_LOCK:
            found = _PREDICTORS.get(key)
            if found is None:
                found = _PREDICTORS[key] = cls(config, target, ranks=ranks, sharding=sharding)
            _PREDICTORS.move_to_end(key)
            while len(_PREDICTORS) > MAX_PREDICTORS:
                _PREDICTORS.popitem(last=False)
        return found


class _Failed(NamedTuple):
    kind: type
    text: str


def _answer(result):
    if isinstance(result, _Failed):
        raise result.kind(result.text)
    return result


def clear_cache() -> None:
    """Forget every model's estimates."""
    with _REGISTRY_LOCK:
        for one in _PREDICTORS.values():
            one.clear()
        _PREDICTORS.clear()
