"""Whether a checkpoint fits between SIGTERM and SIGKILL: its size and the time to write it.

A rented GPU that is stopped gets SIGTERM and, 10-30 s later, SIGKILL; ``nbtune train``
answers SIGTERM by saving a checkpoint of the last completed step. Measured here: the time
``session.save_checkpoint`` takes for SmolLM2-135M with LoRA (best of three, this machine's
disk). Predicted: the checkpoint of Llama-3.1-8B with QLoRA, LoRA and full finetuning (trainable
weights and optimizer state, from ``nt.estimate``), and its time at the measured rate and at
100 MiB/s (a slow cloud volume).

    python benchmarks/checkpoint_save.py      # writes results/checkpoint-save/checkpoint_save.json
"""

from __future__ import annotations

import json
import platform
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
MiB = 2**20
SLOW_DISK = 100 * MiB  # bytes/s
GRACE_S = 10  # the shortest SIGTERM-to-SIGKILL window people meet


def measure_smollm2() -> dict:
    import nbtune as nt

    session = nt.Session.demo("smollm2", techniques=dict(method="lora", lora_rank=64, batch_size=2,
                                                         seq_len=64))
    session.echo = False
    session.step()  # optimizer state exists
    times, size = [], 0
    for _ in range(3):
        with tempfile.TemporaryDirectory() as tmp:
            started = time.perf_counter()
            session.save_checkpoint(Path(tmp) / "checkpoint")
            times.append(time.perf_counter() - started)
            size = sum(f.stat().st_size for f in Path(tmp).rglob("*") if f.is_file())
    return {"bytes": size, "seconds": min(times), "bytes_per_second": size / min(times)}


def predict_8b(rate: float) -> dict:
    import nbtune as nt

    rows = {}
    for method in ("qlora", "lora", "full"):
        memory = nt.estimate("llama-3.1-8b", nt.Techniques(method=method, dtype="bf16"), device="cuda")
        size = memory.trainable + memory.optimizer_state
        rows[method] = {"bytes": size, "seconds_here": size / rate, "seconds_at_100_MiB_s": size / SLOW_DISK,
                        "fits_10_s_at_100_MiB_s": size / SLOW_DISK < GRACE_S}
    return rows


def main() -> int:
    measured = measure_smollm2()
    predicted = predict_8b(measured["bytes_per_second"])
    record = {"command": "python benchmarks/checkpoint_save.py", "machine": platform.machine(),
              "measured_smollm2_lora_r64": measured, "predicted_llama_3_1_8b": predicted}
    print(f"SmolLM2 LoRA checkpoint: {measured['bytes'] / MiB:.1f} MiB in {measured['seconds']:.2f} s "
          f"({measured['bytes_per_second'] / MiB:.0f} MiB/s)")
    for method, row in predicted.items():
        print(f"Llama-3.1-8B {method}: {row['bytes'] / MiB:,.0f} MiB, {row['seconds_here']:.1f} s here, "
              f"{row['seconds_at_100_MiB_s']:.0f} s at 100 MiB/s"
              + ("" if row["fits_10_s_at_100_MiB_s"] else " (does not fit 10 s)"))
    out = HERE / "results" / "checkpoint-save" / "checkpoint_save.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
