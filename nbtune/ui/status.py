"""The one-line status of a run: where it is, how fast, what is left and what it costs.

Pure text from numbers, so the panel, the background run's progress bar and the tests
share it. Time left assumes the steps to come take as long as this run's steps so far.
"""

from __future__ import annotations


def objective_words(report) -> str:
    """What an objective's users watch beside the loss, in words ("" under sft): a
    preference objective's margin and accuracy, GRPO's reward (its loss hovers near 0)."""
    if report.preference is not None:
        return (f"margin {report.preference.margin:.3f}, "
                f"{report.preference.accuracy:.0%} of pairs ranked right")
    if report.rollouts is not None:
        return f"reward {report.rollouts.reward:.3f}, {report.rollouts.completion_length:.0f} tokens a completion"
    return ""


def format_duration(seconds: float) -> str:
    """``42 s``, ``3 min 05 s``, ``2 h 07 min``."""
    seconds = max(0.0, seconds)
    if seconds < 60:
        return f"{seconds:.0f} s"
    minutes, secs = divmod(int(round(seconds)), 60)
    if minutes < 60:
        return f"{minutes} min {secs:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"


def step_count(done: int, total: int, before: int = 0) -> str:
    """The session's step, the one the chart and the replies count, with this run's share
    where the session had steps before it: ``step 12 of 100``, ``step 30 (24 of this run's
    300)``."""
    now = before + done
    return f"step {now} of {total}" if not before else f"step {now} ({done} of this run's {total})"


def run_status(reports: list, total: int, elapsed: float,
               price_per_hour: float | None = None, finished: bool = False,
               before: int = 0, busy: float | None = None) -> str:
    """``step 12 of 100 · loss 1.234 · 2,345 tokens/s · 0 min 12 s elapsed, 1 min 28 s
    left · $0.01 so far, $0.02 to finish at $0.44/h`` for ``reports`` of one run.

    ``before``: the session's steps before this run (the step shown is the session's, as
    the chart counts). ``elapsed`` is the run's wall time so far (its steps plus what
    happened between them); tokens/s is over the run's own steps. A ``finished`` run
    (stopped early too) has nothing left, so no time left or cost to finish is shown.
    ``busy``: cores other processes kept busy meanwhile; said where it slows the run
    (``hardware.BUSY_CORES``) once the run has gone on long enough to tell.
    """
    from ..hardware import BUSY_SECONDS, busy_words

    done = len(reports)
    parts = [step_count(done, total, before)]
    if reports:
        parts.append(f"loss {reports[-1].loss:.3f}")
        if objective_words(reports[-1]):
            parts.append(objective_words(reports[-1]))
        seconds = sum(r.seconds for r in reports)
        if seconds > 0:
            parts.append(f"{sum(r.tokens for r in reports) / seconds:,.0f} tokens/s")
    # the first step pays for what later ones do not (the optimizer's state, a warm-up): the
    # pace is read from the steps after it once there are some
    first = reports[0].seconds if done > 1 else 0.0
    pace = (elapsed - first) / (done - 1) if done > 1 and elapsed > first else (elapsed / done if done else 0)
    left = pace * (total - done) if done and not finished else None
    timing = f"{format_duration(elapsed)} elapsed"
    if left is not None and done < total:
        timing += f", {format_duration(left)} left"
    parts.append(timing)
    if elapsed >= BUSY_SECONDS and busy_words(busy):
        parts.append(busy_words(busy))
    if price_per_hour:
        cost = f"${price_per_hour * elapsed / 3600:.2f} so far"
        if left is not None and done < total:
            cost += f", ${price_per_hour * (elapsed + left) / 3600:.2f} to finish"
        parts.append(f"{cost} at ${price_per_hour:g}/h")
    return " · ".join(parts)
