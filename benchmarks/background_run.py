"""What training in the background costs, and how fast Stop lands.

* Overhead: steps/s of ``session.start(n).wait()`` (a background thread; the caller's
  thread polls ``wait`` ten times a second, as a notebook kernel would sit idle) against
  ``session.run(n)`` on the same session shape, alternating arms in ABBA rounds, memory
  tracking off so only the thread differs. Ratio = background time / synchronous time.
* Stop latency: ``stop()`` asked at a random moment of a step; the time until the run has
  ended, against that run's median step time (the promise: within one step).

    python benchmarks/background_run.py --steps 40 --rounds 4 --stops 10
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import torch

import nbtune as nt


def session() -> "nt.Session":
    torch.manual_seed(0)
    s = nt.Session.demo(device="cpu")
    s.memory_tracking = "off"
    s.step()  # optimizer state exists from here on
    return s


def timed(arm: str, steps: int) -> float:
    s = session()
    started = time.perf_counter()
    if arm == "run":
        s.run(steps, progress=False, live=False)
    else:
        s.start(steps).wait()
    return (time.perf_counter() - started) / steps


def stop_latency(rng: random.Random) -> tuple[float, float]:
    s = session()
    run = s.start(100_000)
    while len(run.reports) < 3:
        time.sleep(0.001)
    step = statistics.median(r.seconds for r in run.reports)
    time.sleep(rng.uniform(0, step))  # somewhere inside a step
    asked = time.perf_counter()
    s.stop()
    return time.perf_counter() - asked, step


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--stops", type=int, default=10)
    parser.add_argument("--out", default="benchmarks/results/background/background_run.json")
    args = parser.parse_args()

    times = {"run": [], "start": []}
    for i in range(args.rounds):
        for arm in (("run", "start") if i % 2 == 0 else ("start", "run")):
            times[arm].append(timed(arm, args.steps))
            print(f"round {i + 1} {arm:5s}: {times[arm][-1] * 1000:.1f} ms/step", flush=True)
    ratio = statistics.median(times["start"]) / statistics.median(times["run"])
    rng = random.Random(0)
    stops = [stop_latency(rng) for _ in range(args.stops)]
    result = {
        "command": "python " + " ".join(sys.argv),
        "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
                   f"torch {torch.__version__}",
        "seconds_per_step": {arm: statistics.median(v) for arm, v in times.items()},
        "background_over_run": ratio,
        "stop_latency_seconds": [round(a, 4) for a, _ in stops],
        "stop_latency_over_step": [round(a / b, 3) for a, b in stops],
        "worst_stop_latency_over_step": max(a / b for a, b in stops),
    }
    print(f"background / run step time: {ratio:.3f}")
    print(f"stop latency: median {statistics.median(a for a, _ in stops) * 1000:.0f} ms, "
          f"worst {result['worst_stop_latency_over_step']:.2f} step(s)")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
