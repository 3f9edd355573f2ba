"""Will it fit? The panel's badge, recomputed off the kernel's thread as sliders move.

A request waits ``delay`` seconds for the next one (a slider drag sends many), then one
worker thread estimates the newest techniques only, through the model's ``Predictor``: its
cache (shared with ``fit`` and the longest-context search) makes moving a slider back
instant. No widgets here: the panel passes a
callback. ``close()`` ends the worker; at interpreter exit every open check is closed and its
worker joined, so no thread is inside torch while the interpreter tears down (that aborted
scripts that made a panel: "terminate called without an active exception").
"""

from __future__ import annotations

import atexit
import threading
import time
import weakref
from typing import Callable

from ..predict import Predictor, fit_badge
from ..predict.budgets import parse_cards
from ..techniques import Techniques


class FitCheck:
    """Debounced estimates, by ``predictor`` (a ``Predictor``), of the newest requested techniques.

    ``show(techniques, budget, badge, seconds, error)`` is called from the worker thread (or at
    once on a cache hit) with a ``FitBadge``, or ``badge=None`` and the error text when
    the estimate failed; ``seconds`` is the time from the request to the result.
    """

    def __init__(self, predictor: Predictor, show: Callable, *, delay: float = 0.3,
                 sharding=None) -> None:
        self.predictor, self.device, self.delay = predictor, predictor.device, delay
        self.sharding = sharding  # FSDP2 settings a budget of several cards is predicted with
        self._show = show
        self._closed = False
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._latest: tuple | None = None  # (techniques, budget, asked at)
        self._worker: threading.Thread | None = None
        self._busy = False  # the worker is estimating
        self.estimates = 0  # estimator calls made (cache hits not counted)
        _OPEN.add(self)

    def close(self, timeout: float = 120.0) -> None:
        """No more requests; wait (at most ``timeout``) for an estimate under way to end."""
        with self._lock:
            self._closed, self._latest = True, None
            worker = self._worker
            self._wake.notify_all()
        if worker is not None and worker is not threading.current_thread():
            worker.join(timeout)
        _OPEN.discard(self)

    def _predictor(self, budget) -> Predictor:
        """The predictor for ``budget``'s cards: several ("2x RTX 3090") predict one rank each."""
        cards = parse_cards(budget)[0]
        return (self.predictor if cards == 1 else
                Predictor.of(self.predictor.config, self.device, cards, self.sharding))

    def cached(self, techniques: Techniques, budget) -> bool:
        """Whether ``budget``'s estimate of ``techniques`` is at hand (no estimator run)."""
        return self._predictor(budget).cached(techniques)

    def request(self, techniques: Techniques, budget) -> None:
        asked = time.monotonic()
        with self._lock:
            if self._closed:
                return
            cached = self.cached(techniques, budget)
            if not cached:
                self._latest = (techniques, budget, asked)
                if self._worker is None or not self._worker.is_alive():
                    self._worker = threading.Thread(target=self._work, name="nbtune-fit-check",
                                                    daemon=True)
                    self._worker.start()
                self._wake.notify()
                return
            self._latest = None  # an older request still waiting is superseded
        self._deliver(techniques, budget, self._estimate(techniques, budget), asked)

    def wait(self, timeout: float = 60.0) -> bool:
        """Block until no request is waiting or being estimated (tests, benchmarks)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                idle = self._latest is None and not self._busy
            if idle:
                return True
            time.sleep(0.01)
        return False

    def _work(self) -> None:
        while True:
            with self._lock:
                while self._latest is None:
                    if self._closed or (not self._wake.wait(timeout=30) and self._latest is None):
                        self._worker = None
                        return  # idle: the thread ends, a later request starts another
                asked_last = self._latest[2]
            time.sleep(max(0.0, asked_last + self.delay - time.monotonic()))  # debounce
            with self._lock:
                if self._latest is None or self._latest[2] != asked_last:
                    continue  # a newer request came in meanwhile: wait out its delay
                techniques, budget, asked = self._latest
                self._busy = True
            try:
                if not self.cached(techniques, budget):
                    self.estimates += 1
                self._deliver(techniques, budget, self._estimate(techniques, budget), asked)
            finally:
                with self._lock:
                    if self._latest is not None and self._latest[2] == asked:
                        self._latest = None
                    self._busy = False

    def _estimate(self, techniques: Techniques, budget):
        """The estimate, or the error it raised (as text: no traceback kept)."""
        try:
            return self._predictor(budget).estimate(techniques)
        except Exception as err:  # noqa: BLE001 - shown in the badge
            return ValueError(f"{type(err).__name__}: {err}")

    def _deliver(self, techniques, budget, memory, asked) -> None:
        seconds = time.monotonic() - asked
        if isinstance(memory, Exception):
            self._show(techniques, budget, None, seconds, str(memory))
            return
        try:
            badge = fit_badge(memory, budget, device=self.device)
        except Exception as err:  # noqa: BLE001 - a bad budget is shown, not raised in a thread
            self._show(techniques, budget, None, seconds, str(err))
            return
        self._show(techniques, budget, badge, seconds, None)


_OPEN: "weakref.WeakSet[FitCheck]" = weakref.WeakSet()
_THREADS: "weakref.WeakSet[threading.Thread]" = weakref.WeakSet()


def in_background(target: Callable[[], None], name: str) -> threading.Thread:
    """Start ``target`` in a daemon thread that interpreter exit waits for (a search)."""
    thread = threading.Thread(target=target, name=name, daemon=True)
    _THREADS.add(thread)
    thread.start()
    return thread


@atexit.register
def _close_all() -> None:
    for check in list(_OPEN):
        check.close()
    for thread in list(_THREADS):
        thread.join(120.0)
