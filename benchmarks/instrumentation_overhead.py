"""Training time with the memory breakdown and live chart on vs off, in the same run.

    python benchmarks/instrumentation_overhead.py [--steps 300] [--rounds 2]
    # writes benchmarks/results/instrumentation-overhead/

"on" is what a notebook user gets: memory tracking as the session does it by default
("sampled") and the live chart drawn through IPython's display machinery (its output
discarded here). "off" tracks nothing and draws nothing. Each arm trains a fresh demo
session for the same steps; arms alternate in ABBA order so a machine that drifts (this
2-core box runs the same arm 5 % slower or faster from one minute to the next) biases
neither. The ratio is total "on" time over total "off" time. The target is at
most 3 % overhead: tracking and redraws share one budget of 2 % of training time
(``nbtune.overhead.OverheadBudget``), the first step after a change is always measured and
the last chart always drawn.
"""

import argparse
import contextlib
import io
import json
import platform
import sys
import time
from pathlib import Path

import torch

import nbtune as nt


def timed_run(steps: int, on: bool) -> dict:
    session = nt.Session.demo(device="cpu")
    session.memory_tracking = "sampled" if on else "off"
    with contextlib.redirect_stdout(io.StringIO()):
        started = time.perf_counter()
        session.run(steps, progress=False, live=on)
        seconds = time.perf_counter() - started
    return {"seconds": seconds, "measured_steps": sum(r.memory.measured for r in session.history),
            "instrumentation_share": session.overhead.overhead,
            "final_loss": session.history[-1].loss}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    timed_run(10, on=True)  # warm up: imports, first allocations
    rounds = []
    for i in range(args.rounds):
        order = (False, True) if i % 2 == 0 else (True, False)
        runs = {on: timed_run(args.steps, on=on) for on in order}
        rounds.append({"first": "off" if order[0] is False else "on",
                       "off": runs[False], "on": runs[True],
                       "ratio": runs[True]["seconds"] / runs[False]["seconds"]})
    off = sum(r["off"]["seconds"] for r in rounds)
    on = sum(r["on"]["seconds"] for r in rounds)
    result = {
        "benchmark": "instrumentation_overhead",
        "command": f"python benchmarks/instrumentation_overhead.py --steps {args.steps} --rounds {args.rounds}",
        "steps_per_arm": args.steps, "rounds": rounds, "ratio_on_over_off": on / off,
        "target_ratio": 1.03, "python": sys.version.split()[0], "torch": torch.__version__,
        "threads": torch.get_num_threads(), "platform": platform.platform(),
    }
    out = Path(__file__).parent / "results" / "instrumentation-overhead"
    out.mkdir(parents=True, exist_ok=True)
    (out / "instrumentation_overhead.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
