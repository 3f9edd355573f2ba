"""What exact rollback costs: step time with the undo copy ("copy") against without ("none"),
and what the finite guard (a gradient-norm pass and one read-back per step) costs.

The undo copy is a host copy of the trainable weights and optimizer state taken before each
update, so a step that fails half-way (optimizer in backward, an optimizer failing mid-way)
is undone bit for bit. Same session shape, same data, alternating arms in ABBA rounds;
memory tracking off so only the copy differs. Prints and writes JSON with the ratio per
configuration and the bytes the copy holds.

    python benchmarks/rollback_cost.py --steps 40 --rounds 4
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

import nbtune as nt

CONFIGS = {
    "full fp32 AdamW": {},
    "full, optimizer in backward": {"optimizer_in_backward": True},
    "LoRA r8": {"method": "lora", "lr": 1e-3},
}


def timed(changes: dict, mode: str, steps: int, guard: bool = True) -> tuple[float, int]:
    import nbtune.step

    real = nbtune.step.finite_guard
    if not guard:  # the update then computes no norm and reads nothing back
        nbtune.step.finite_guard = lambda step, lr: None
    try:
        return _timed(changes, mode, steps)
    finally:
        nbtune.step.finite_guard = real


def _timed(changes: dict, mode: str, steps: int) -> tuple[float, int]:
    torch.manual_seed(0)
    session = nt.Session.demo(device="cpu", **changes)
    session.memory_tracking = "off"
    session.rollback = mode
    session.step()  # optimizer state exists from here on
    started = time.perf_counter()
    for _ in range(steps):
        session.step()
    return (time.perf_counter() - started) / steps, session.trainer.last_undo_bytes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "rollback-cost"))
    args = parser.parse_args()
    results = {}
    for name, changes in CONFIGS.items():
        ratios, copy_bytes = [], 0
        for round_ in range(args.rounds):
            order = ("copy", "none") if round_ % 2 == 0 else ("none", "copy")  # ABBA
            seconds = {}
            for mode in order:
                seconds[mode], nbytes = timed(changes, mode, args.steps)
                if mode == "copy":
                    copy_bytes = nbytes
            ratios.append(seconds["copy"] / seconds["none"])
            print(f"{name:30s} round {round_ + 1}: copy {seconds['copy'] * 1000:6.1f} ms/step, "
                  f"none {seconds['none'] * 1000:6.1f} ms/step, ratio {ratios[-1]:.3f}", flush=True)
        results[name] = {"ratio_median": statistics.median(ratios), "ratios": ratios,
                         "undo_copy_bytes": copy_bytes}
        print(f"{name:30s} median ratio {statistics.median(ratios):.3f}, undo copy "
              f"{copy_bytes / 2**20:.1f} MiB", flush=True)
    ratios = []
    for round_ in range(args.rounds):  # the finite guard, on against off, both without a copy
        order = (True, False) if round_ % 2 == 0 else (False, True)
        seconds = {guard: timed({}, "none", args.steps, guard)[0] for guard in order}
        ratios.append(seconds[True] / seconds[False])
        print(f"{'finite guard, full AdamW':30s} round {round_ + 1}: on {seconds[True] * 1000:6.1f} "
              f"ms/step, off {seconds[False] * 1000:6.1f} ms/step, ratio {ratios[-1]:.3f}", flush=True)
    results["finite guard (on/off)"] = {"ratio_median": statistics.median(ratios), "ratios": ratios}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    record = {"command": " ".join([Path(sys.executable).name, *sys.argv]),
              "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads",
              "torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
              "steps_per_arm": args.steps, "rounds": args.rounds, "results": results}
    (out / "rollback_cost.json").write_text(json.dumps(record, indent=2))
    print(f"wrote {out / 'rollback_cost.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
