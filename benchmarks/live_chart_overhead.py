"""Training time with the live memory chart on vs off, in the same run, as a ratio.

    python benchmarks/live_chart_overhead.py   # writes benchmarks/results/live-chart/

The chart is drawn through IPython's display machinery exactly as in a notebook (its
output discarded here); both arms train the same session alternately, so machine noise
hits both. The chart paces itself to 3 % of wall time between draws; a short run also
pays for its first and its last (forced) draw, about 85 ms each on 2 CPU cores, so a
5-second run lands near 1.05 and longer runs approach 1.03.
"""

import contextlib
import io
import json
import platform
import sys
import time
from pathlib import Path

import torch

import nbtune as nt

STEPS, ROUNDS = 60, 3


def main() -> None:
    session = nt.Session.demo(device="cpu")
    session.run(10, progress=False, live=False)  # warm up

    def timed(live: bool) -> float:
        with contextlib.redirect_stdout(io.StringIO()):
            started = time.perf_counter()
            session.run(STEPS, progress=False, live=live)
            return time.perf_counter() - started

    rounds = [{"off_s": timed(False), "on_s": timed(True)} for _ in range(ROUNDS)]
    off = sum(r["off_s"] for r in rounds)
    on = sum(r["on_s"] for r in rounds)
    result = {
        "benchmark": "live_chart_overhead", "command": "python benchmarks/live_chart_overhead.py",
        "steps_per_arm": STEPS, "rounds": rounds, "ratio_on_over_off": on / off,
        "target_ratio": 1.03, "python": sys.version.split()[0], "torch": torch.__version__,
        "cpus": torch.get_num_threads(), "platform": platform.platform(),
    }
    out = Path(__file__).parent / "results" / "live-chart"
    out.mkdir(parents=True, exist_ok=True)
    (out / "live_chart_overhead.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
