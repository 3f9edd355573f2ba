"""Per-rank predictions against published FSDP measurements (no GPU: the estimator runs the
real FSDP2 sharding on fake tensors over a fake process group).

1. Seed 001's FSDP2 ladder (Llama-3.1-8B, bf16 weights, AdamW, batch 1 per GPU, 1,024
   tokens; "peak memory active" per GPU, transformers + accelerate): FSDP2 23.07 GiB ->
   + activation checkpointing 19.68 -> + CPU offload 13.67 -> + sharded embedding layer
   10.88 -> + chunked loss 9.93. The table does not say how many GPUs: each row is predicted
   at 2, 4 and 8 ranks, and the world size is the one whose two rows that do not offload
   (the only ones where the sharded state stays on the GPU, so the only ones that depend on
   it) are closest to the table.
2. Answer.AI's fsdp_qlora, Llama-2-70B QLoRA on two RTX 3090s (benchmarks_03_2024.md,
   "A Dual 3090 Basement Rig": batch size 2 per GPU, context 2,048, QLoRA with CPU offload,
   gradient checkpointing, train.py's defaults: bf16, LoRA rank 64 on every projection;
   measured peak 14.92 GiB per GPU, 128 GB of host RAM plus a 10 GB swap file), and the same
   run for Llama-3.1-70B: predicted per GPU and for the host.

    python benchmarks/fsdp_predictions.py        # writes benchmarks/results/fsdp/predictions.json
"""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GiB = 2 ** 30
SEED_001 = [  # label, techniques, sharding, published GiB
    ("FSDP2", {}, {}, 23.07),
    ("+ activation checkpointing", {"activation_checkpointing": True}, {}, 19.68),
    ("+ CPU offload", {"activation_checkpointing": True}, {"cpu_offload": True}, 13.67),
    ("+ shard embedding layer", {"activation_checkpointing": True},
     {"cpu_offload": True, "shard_embeddings": True}, 10.88),
    ("+ chunked loss", {"activation_checkpointing": True, "chunked_loss": 8},
     {"cpu_offload": True, "shard_embeddings": True}, 9.93),
]
ANSWER_AI = dict(method="qlora", dtype="bf16", seq_len=2048, lora_rank=64, lora_alpha=16,
                 lora_targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                               "down_proj"), activation_checkpointing=True)


def gib(n: int) -> float:
    return round(n / GiB, 2)


def seed_001() -> dict:
    import nbtune as nt

    worlds = {}
    for world in (2, 4, 8):
        rows, state = [], 0
        for label, changes, sharding, published in SEED_001:
            t = nt.Techniques(dtype="bf16", batch_size=world, seq_len=1024, **changes)
            guess = nt.estimate("llama-3.1-8b", t, device="cuda", ranks=world, sharding=sharding)
            row = {"label": label, "published_gib": published, "predicted_gib": gib(guess.peak),
                   "error": round(guess.peak / GiB / published - 1, 4),
                   "at_peak_gib": {k: gib(v) for k, v in guess.at_peak.items()},
                   "host_sharded_gib": gib(guess.host.sharded)}
            if sharding.get("cpu_offload"):
                # the arithmetic of the offloaded rows' gap: this rank's AdamW state, which
                # FSDP2's CPU offload moves to the host (the optimizer steps there)
                kept = guess.peak + state
                row["with_optimizer_state_on_gpu_gib"] = gib(kept)
                row["error_with_optimizer_state_on_gpu"] = round(kept / GiB / published - 1, 4)
            else:
                state = guess.optimizer_state
            rows.append(row)
        worlds[world] = rows
    # the world size: the rows where the sharded state stays on the GPU decide it
    chosen = min(worlds, key=lambda w: sum(abs(r["error"]) for r in worlds[w][:2]))
    return {"worlds": worlds, "world": chosen}


def seventy_b() -> list[dict]:
    import nbtune as nt

    out = []
    for model in ("llama-2-70b", "llama-3.1-70b"):
        t = nt.Techniques(batch_size=4, **ANSWER_AI)  # 2 per GPU, global 4
        guess = nt.estimate(model, t, device="cuda", ranks=2, sharding={"cpu_offload": True})
        host = guess.host
        out.append({"model": model, "ranks": 2, "card_gib": 24, "predicted_gib": gib(guess.peak),
                    "fits_24gb_card": guess.peak < 24e9,
                    "published_gib": 14.92 if model == "llama-2-70b" else None,
                    "at_peak_gib": {k: gib(v) for k, v in guess.at_peak.items()},
                    "host_training_gib": gib(host.training), "host_peak_gib": gib(host.peak),
                    "host_sharded_gib": gib(host.sharded)})
    return out


def main() -> None:
    import torch

    started = time.perf_counter()
    result = {"command": "python benchmarks/fsdp_predictions.py", "torch": torch.__version__,
              "machine": platform.machine(), "seed_001": seed_001(), "seventy_b": seventy_b()}
    result["seconds"] = round(time.perf_counter() - started, 1)
    out = ROOT / "benchmarks" / "results" / "fsdp" / "predictions.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    seed = result["seed_001"]
    print(f"seed 001 (Llama-3.1-8B, bf16, batch 1 per GPU, 1,024 tokens): world size {seed['world']}")
    for world, rows in seed["worlds"].items():
        for row in rows:
            kept = (f"; AdamW state on the GPU: {row['with_optimizer_state_on_gpu_gib']:6.2f} "
                    f"({row['error_with_optimizer_state_on_gpu']:+.1%})"
                    if "with_optimizer_state_on_gpu_gib" in row else "")
            print(f"  {world} ranks  {row['label']:28} published {row['published_gib']:6.2f} GiB  "
                  f"predicted {row['predicted_gib']:6.2f}  ({row['error']:+.1%}){kept}")
    for row in result["seventy_b"]:
        print(f"{row['model']} QLoRA on 2x 24 GB, CPU offload: {row['predicted_gib']} GiB per GPU "
              f"(fits: {row['fits_24gb_card']}), host {row['host_peak_gib']} GiB")
    print(f"{result['seconds']} s; written to {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
