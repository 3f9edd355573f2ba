"""What driving the ranks from the kernel costs per step: ``session.run(N)`` of a session on two
processes (``Session.from_config(path, processes=2)``: commands of as many steps as take about
a second sent to every engine and the answers back, through the session's own runner), against the same run file's steps
under ``torchrun -m nbtune train``. Both sides are one run of N steps in one loop: a torchrun
step's wall time is the difference of two jobs' training time (summary.json's ``seconds``:
1 step and N + 1 steps) over N; the kernel's is ``run(N)``'s wall time over N, on ranks that
already took three steps. Memory tracking is off on both sides (the run file's
``memory_tracking``), so neither measures a step the other does not. On 2 cores the two ranks
fill the machine, so the rounds alternate the two sides and the median round is reported.

    python benchmarks/processes_overhead.py            # writes results/processes/overhead.json

Issue 36's goal: a ratio of at most 1.05.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
STEPS = 30
ROUNDS = 5
RUN = ("demo: tiny\nmemory_tracking: 'off'\n"
       "techniques: {{batch_size: {batch}, seq_len: 96, lr: 1e-3}}\n"
       "run: {{steps: 1, checkpoint_every: 0, save: []}}\n")
BATCHES = (8, 64)  # a 70 ms step and a longer one


def under_torchrun(path: Path, out: Path) -> float:
    """Seconds a step takes under torchrun, the loop around it included (see the docstring)."""
    def job(steps: int) -> float:
        folder = out / str(steps)
        done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        "--nproc_per_node", "2", "-m", "nbtune", "train", str(path), "--out",
                        str(folder), "--no-progress", "--steps", str(steps)],
                       check=False, capture_output=True, timeout=600)
        if done.returncode:
            raise SystemExit(f"torchrun failed:\n{done.stderr.decode()[-3000:]}")
        return json.loads((folder / "summary.json").read_text())["seconds"]

    return (job(STEPS + 1) - job(1)) / STEPS


def rounds(path: Path, out: Path) -> tuple[list[float], list[float], float]:
    """ROUNDS alternations of a torchrun measurement and a kernel one (a step's seconds each),
    and how long starting the two engines took."""
    from nbtune import Session

    began = time.perf_counter()
    ranks = Session.from_config(path, processes=2)
    started = time.perf_counter() - began
    torchrun, kernel = [], []
    try:
        ranks.run(3, progress=False, live=False)  # warm-up: imports, the optimizer's state, pace
        for i in range(ROUNDS):
            torchrun.append(under_torchrun(path, out / str(i)))
            before = time.perf_counter()
            ranks.run(STEPS, progress=False, live=False)
            kernel.append((time.perf_counter() - before) / STEPS)
    finally:
        ranks.close()
    return torchrun, kernel, started


def main() -> None:
    import torch

    rows = []
    for batch in BATCHES:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "run.yaml"
            path.write_text(RUN.format(batch=batch))
            torchrun, kernel, started = rounds(path, Path(tmp))
        ratios = [k / t for k, t in zip(kernel, torchrun)]
        rows.append({"batch_size": batch, "torchrun_step_s": [round(t, 4) for t in torchrun],
                     "kernel_step_s": [round(k, 4) for k in kernel],
                     "ratios": [round(r, 3) for r in ratios],
                     "ratio": round(statistics.median(ratios), 3),
                     "cluster_start_s": round(started, 1)})
    result = {"command": "python benchmarks/processes_overhead.py", "torch": torch.__version__,
              "machine": platform.machine(), "cores": os.cpu_count(), "steps": STEPS,
              "rounds": ROUNDS, "rows": rows, "goal": 1.05}
    out = HERE / "results" / "processes" / "overhead.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
