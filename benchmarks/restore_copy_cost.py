"""What the LoRA restore copy costs: step time of a LoRA session that keeps its training state in
host memory after a recent step (``undo.RestoreCopy``, what ``recover()`` returns to), against
the same session with the keeping switched off. Its pace is meant to hold it under 2 % of the
training time, all of its work counted (the state dict, the host's free memory, the copy).

The tiny demo's LoRA step (about 20 ms on this CPU: the worst case, where the copy weighs most
against the step), memory tracking off, alternating arms in ABBA rounds, median ratio.

    python benchmarks/restore_copy_cost.py --steps 40 --rounds 4
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))


def seconds_per_step(keep: bool, steps: int) -> tuple[float, int]:
    from helpers import small_session

    from nbtune.run.trainer import Trainer

    real = Trainer._keep
    if not keep:
        Trainer._keep = lambda self, report: None
    try:
        session = small_session(method="lora")
        session.memory_tracking = "off"
        session.step()
        began = time.perf_counter()
        for _ in range(steps):
            session.step()
        return (time.perf_counter() - began) / steps, session.trainer._kept.every
    finally:
        Trainer._keep = real


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    rounds = []
    for index in range(args.rounds):
        order = (True, False) if index % 2 == 0 else (False, True)
        times = {keep: seconds_per_step(keep, args.steps) for keep in order}
        rounds.append({"with_copy_ms": 1000 * times[True][0], "without_ms": 1000 * times[False][0],
                       "ratio": times[True][0] / times[False][0], "every": times[True][1]})
        print(rounds[-1], flush=True)
    result = {"command": "python benchmarks/restore_copy_cost.py " + " ".join(sys.argv[1:]),
              "machine": platform.processor() or platform.machine(), "rounds": rounds,
              "median_ratio": statistics.median(r["ratio"] for r in rounds), "goal": 1.02}
    out = HERE / "results" / "restore-copy" / "cost.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"median ratio {result['median_ratio']:.3f} (goal <= 1.02) -> {out}")


if __name__ == "__main__":
    main()
