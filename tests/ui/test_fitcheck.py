"""The panel's "will it fit?" badge: debounced, cached by techniques, never on the caller's
thread, and answering for the newest techniques only."""

import threading
import time

import pytest

import nbtune as nt
from nbtune.memory import MemoryBreakdown
from nbtune.predict import Predictor, clear_cache
from nbtune.ui.fitcheck import FitCheck

from helpers import small_session

GiB = 2**30


TINY = nt.ModelConfig(vocab_size=259, hidden_size=64, intermediate_size=128, num_layers=2,
                      num_heads=2, num_kv_heads=1, head_dim=32)


def slow_predictor(calls: list, seconds: float = 0.2) -> Predictor:
    """A Predictor whose estimator is a stand-in: 1 GiB a row, ``seconds`` each."""
    def estimator(config, t, device, **_):
        calls.append((t, threading.current_thread().name))
        time.sleep(seconds)
        need = t.batch_size * GiB  # 1 GiB a row: easy to reason about
        return MemoryBreakdown(activations=need, peak=need, at_peak={"activations": need},
                               measured=False, device=device)
    return Predictor(TINY, "cuda", estimator=estimator)


def test_a_drag_is_estimated_once_for_its_last_value_and_cached():
    calls, shown = [], []
    check = FitCheck(slow_predictor(calls), lambda *a: shown.append(a), delay=0.1)
    start = time.monotonic()
    for size in range(1, 9):  # a slider dragged through eight values
        check.request(nt.Techniques(batch_size=size), "RTX 3090")
    assert time.monotonic() - start < 0.1  # the caller never waits for an estimate
    assert check.wait(10)
    assert [t.batch_size for t, _ in calls] == [8]
    assert all(name == "nbtune-fit-check" for _, name in calls)
    (t, budget, badge, seconds, error), = shown
    assert t.batch_size == 8 and budget == "RTX 3090" and error is None
    assert badge.need == 8 * GiB and badge.fits and badge.largest == "activations"
    check.request(nt.Techniques(batch_size=30), "RTX 3090")
    check.wait(10)
    assert not shown[-1][2].fits and "does not fit" in shown[-1][2].text
    check.request(nt.Techniques(batch_size=8), "T4")  # back to a value seen: from the cache
    assert len(calls) == 2 and shown[-1][1] == "T4" and shown[-1][3] < 0.05


def test_a_failed_estimate_or_bad_budget_is_shown_not_raised():
    shown = []

    def broken(config, t, device, **_):
        raise ValueError("no such model")

    check = FitCheck(Predictor(TINY, "cuda", estimator=broken), lambda *a: shown.append(a), delay=0.0)
    check.request(nt.Techniques(), "24GiB")
    check.wait(10)
    assert shown[-1][2] is None and "no such model" in shown[-1][4]
    check2 = FitCheck(slow_predictor([], 0), lambda *a: shown.append(a), delay=0.0)
    check2.request(nt.Techniques(), "a potato")
    check2.wait(10)
    assert shown[-1][2] is None and "potato" in shown[-1][4]


@pytest.mark.slow
def test_the_panel_badge_follows_the_toggles_and_the_card():
    clear_cache()  # the model's Predictor is shared: count this panel's estimates from none
    s = small_session()
    panel = s.panel()
    assert panel._fitcheck.wait(60)
    assert "fits" in panel.badge.value and "✔" in panel.badge.value
    estimated = nt.estimate(s.model.config, s.techniques, device="cuda")
    panel.budget.value = "T4"
    assert panel._fitcheck.wait(60)
    assert "16.0 GiB" in panel.badge.value or "T4" in panel.budget.label
    panel.controls["batch_size"].value = 2
    assert panel._fitcheck.wait(60) and panel.last_fit_seconds is not None
    assert panel._fitcheck.estimates == 2  # the card change was a cache hit
    assert estimated.peak > 0


def test_session_fit_answers_for_the_queued_techniques():
    s = small_session()
    result = s.fit("1GiB")
    assert result.fits and result.start == s.techniques
    run = s.start(10_000)
    try:
        s.set(batch_size=2)
        assert s.fit("1GiB").start.batch_size == 2
    finally:
        s.stop()
    with pytest.raises(ValueError, match="potato"):
        s.fit("a potato")
