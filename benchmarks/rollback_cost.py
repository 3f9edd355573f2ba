"""What each rollback mode costs: step time and peak memory with "copy", "auto" and "none",
measured on this CPU, plus the undo copy predicted for Llama-3.1-8B on a 24 GB card.

"copy" keeps a host copy of each trainable weight and its optimizer state, taken just before
that weight's update, so a step that fails half-way is undone bit for bit; "none" keeps none
(Ctrl-C waits for the update to be written; a failure half-way is damage). On a CPU "auto"
keeps the copy only on a new optimizer's first update, so its steady steps cost what "none"
costs; on CUDA it keeps it where the host has room (see ``Trainer._undo_for``).

Measured: the tiny demo and SmolLM2-135M (full finetuning: a 1.6 GB copy), the same session
shape and data, alternating arms in ABBA rounds (SmolLM2: two rounds of four steps), memory
tracking off for the timed steps; one tracked step per arm gives its peak (the copy lives in
the step's memory on a CPU). Ratios are against "none". Predicted: ``nt.estimate(...).host.undo``
for the 8B configurations people run on a 24 GB card, and the time its device-to-host copy
takes at a PCIe 4.0 x16 card's practical 25 GB/s (pinned), which a side stream overlaps with
backward: no GPU measured it here.

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

CONFIGS = {  # (demo, technique changes): the tiny demo, and SmolLM2-135M (copy: 1.6 GB)
    "tiny: full fp32 AdamW": ("tiny", {}),
    "tiny: full, optimizer in backward": ("tiny", {"optimizer_in_backward": True}),
    "tiny: LoRA r8": ("tiny", {"method": "lora", "lr": 1e-3}),
    "SmolLM2: full fp32 AdamW": ("smollm2", {"method": "full", "batch_size": 4, "lr": 1e-5}),
    "SmolLM2: full, optimizer in backward": ("smollm2", {"method": "full", "batch_size": 4,
                                                         "lr": 1e-5, "optimizer_in_backward": True}),
}
SMOLLM2_STEPS = 4  # its steps take seconds on 2 cores
MODES = ("copy", "auto", "none")
PCIE_BYTES_PER_S = 25e9  # pinned device-to-host on PCIe 4.0 x16, practical (rough)
EIGHT_B = {  # Llama-3.1-8B, bf16, batch 2 x 2048, checkpointing every layer, chunked loss
    "QLoRA r8 (all projections)": dict(method="qlora"),
    "LoRA r8": dict(method="lora"),
    "full, AdamW, optimizer in backward": dict(optimizer_in_backward=True),
    "full, paged 8-bit AdamW, optimizer in backward": dict(optimizer="paged_adamw8bit",
                                                          optimizer_in_backward=True),
}


def timed(demo: str, changes: dict, mode: str, steps: int) -> tuple[float, int, int]:
    """(seconds per steady step, the undo copy's bytes, one tracked step's peak)."""
    torch.manual_seed(0)
    session = nt.Session.demo(demo, device="cpu", techniques=changes)
    session.echo = False
    session.memory_tracking = "off"
    session.rollback = mode
    session.step()  # optimizer state exists from here on: steady steps
    started = time.perf_counter()
    for _ in range(steps):
        session.step()
    seconds = (time.perf_counter() - started) / steps
    session.memory_tracking = "every_step"
    peak = session.step().memory.peak
    return seconds, session.trainer.last_undo_bytes, peak


def predicted_8b() -> dict:
    out = {}
    for name, changes in EIGHT_B.items():
        t = nt.Techniques(dtype="bf16", batch_size=2, seq_len=2048, activation_checkpointing=True,
                          chunked_loss=8, **changes)
        host = nt.estimate("llama-3.1-8b", t, device="cuda").host
        out[name] = {"undo_copy_bytes": host.undo, "host_without_undo_bytes": host.without_undo,
                     "host_with_undo_bytes": host.peak,
                     "copy_seconds_at_25GBps": round(host.undo / PCIE_BYTES_PER_S, 2)}
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "rollback-cost"))
    args = parser.parse_args()
    results = {}
    for name, (demo, changes) in CONFIGS.items():
        seconds = {mode: [] for mode in MODES}
        copy_bytes, peaks = {}, {}
        steps = args.steps if demo == "tiny" else SMOLLM2_STEPS
        for round_ in range(args.rounds if demo == "tiny" else 2):
            order = MODES if round_ % 2 == 0 else tuple(reversed(MODES))  # ABBA
            for mode in order:
                took, nbytes, peak = timed(demo, changes, mode, steps)
                seconds[mode].append(took)
                copy_bytes[mode], peaks[mode] = nbytes, peak
            print(f"{name:38s} round {round_ + 1}: " + ", ".join(
                f"{m} {seconds[m][-1] * 1000:6.1f} ms" for m in MODES), flush=True)
        base = statistics.median(seconds["none"])
        results[name] = {mode: {"ms_per_step": round(statistics.median(seconds[mode]) * 1000, 2),
                                "time_ratio": round(statistics.median(seconds[mode]) / base, 3),
                                "undo_copy_bytes": copy_bytes[mode], "peak_bytes": peaks[mode],
                                "peak_ratio": round(peaks[mode] / peaks["none"], 3)}
                         for mode in MODES}
        print(f"{name:38s} " + "; ".join(
            f"{m}: time {r['time_ratio']:.3f}x, peak {r['peak_ratio']:.3f}x, copy "
            f"{r['undo_copy_bytes'] / 2**20:.1f} MiB" for m, r in results[name].items()), flush=True)
    eight = predicted_8b()
    for name, row in eight.items():
        print(f"8B {name:48s} undo copy {row['undo_copy_bytes'] / 2**30:5.1f} GiB "
              f"({row['copy_seconds_at_25GBps']:.2f} s at 25 GB/s); host "
              f"{row['host_without_undo_bytes'] / 2**30:.1f} GiB without it, "
              f"{row['host_with_undo_bytes'] / 2**30:.1f} GiB with it", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    record = {"command": " ".join([Path(sys.executable).name, *sys.argv]),
              "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads",
              "torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
              "steps_per_arm": args.steps, "rounds": args.rounds, "measured_cpu": results,
              "predicted_llama_3_1_8b_cuda": eight}
    (out / "rollback_cost.json").write_text(json.dumps(record, indent=2))
    print(f"wrote {out / 'rollback_cost.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
