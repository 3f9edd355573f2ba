"""What driving the ranks from the kernel costs per step: ``session.run(1)`` of a session on two
processes (``Session.from_config(path, processes=2)``) called N times from this process (each
a command to every engine and the answers back, through the session's own runner), against the same
run file's steps under ``torchrun -m nbtune train``, one after the other on this machine.
A torchrun step's wall time is the difference of two jobs' training time (summary.json's
``seconds``: 1 step and N + 1 steps) over N, so the loop around each step counts on both
sides; the kernel's side skips one warm-up step too.

    python benchmarks/processes_overhead.py            # writes results/processes/overhead.json

Issue 36's goal: a ratio of at most 1.05.
"""

from __future__ import annotations

import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
STEPS = 30
RUN = ("demo: tiny\ntechniques: {{batch_size: {batch}, seq_len: 96, lr: 1e-3}}\n"
       "run: {{steps: 1, checkpoint_every: 0, save: []}}\n")
BATCHES = (8, 64)  # a 70 ms step and a longer one


def under_torchrun(path: Path, out: Path) -> float:
    """Seconds a step takes under torchrun, the loop around it included (see the docstring)."""
    def job(steps: int) -> float:
        folder = out / str(steps)
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        "--nproc_per_node", "2", "-m", "nbtune", "train", str(path), "--out",
                        str(folder), "--no-progress", "--steps", str(steps)],
                       check=True, capture_output=True, timeout=600)
        return json.loads((folder / "summary.json").read_text())["seconds"]

    return (job(STEPS + 1) - job(1)) / STEPS


def from_the_kernel(path: Path) -> tuple[list[float], float]:
    from nbtune import Session

    began = time.perf_counter()
    ranks = Session.from_config(path, processes=2)
    started = time.perf_counter() - began
    try:
        ranks.step()  # warm-up: the first step, and the first run (its imports)
        ranks.run(1, progress=False, live=False)
        walls = []
        for _ in range(STEPS):
            before = time.perf_counter()
            ranks.run(1, progress=False, live=False)  # memory sampled, as nbtune train does
            walls.append(time.perf_counter() - before)
    finally:
        ranks.close()
    return walls, started


def main() -> None:
    import torch

    rows = []
    for batch in BATCHES:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "run.yaml"
            path.write_text(RUN.format(batch=batch))
            torchrun = under_torchrun(path, Path(tmp) / "torchrun")
            kernel, started = from_the_kernel(path)
        rows.append({"batch_size": batch, "torchrun_step_s": round(torchrun, 4),
                     "kernel_step_s_mean": round(statistics.mean(kernel), 4),
                     "ratio": round(statistics.mean(kernel) / torchrun, 3),
                     "cluster_start_s": round(started, 1)})
    result = {"command": "python benchmarks/processes_overhead.py", "torch": torch.__version__,
              "machine": platform.machine(), "steps": STEPS, "rows": rows, "goal": 1.05}
    out = HERE / "results" / "processes" / "overhead.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
