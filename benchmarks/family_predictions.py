"""What the newer families need on one 24 GB card, predicted (no GPU: the estimator runs the
real step on fake tensors): QLoRA in bf16, batch 1 of 2,048 tokens, activation checkpointing
and an 8-piece loss (the README's and notebook 04's settings), then the longest context the
same settings fit on an RTX 3090 (``nt.longest_context``).

    python benchmarks/family_predictions.py     # writes benchmarks/results/families/predictions.json
"""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GiB = 2 ** 30
MODELS = ("gemma-3-1b", "gemma-3-4b", "gemma-3-12b", "gemma-3-27b", "phi-4-mini", "phi-4")
SETTINGS = dict(method="qlora", dtype="bf16", activation_checkpointing=True, chunked_loss=8,
                batch_size=1, seq_len=2048)


def gib(n: int) -> float:
    return round(n / GiB, 2)


def main() -> None:
    import torch

    import nbtune as nt
    from nbtune.models.presets import preset_config

    started = time.perf_counter()
    t = nt.Techniques(**SETTINGS)
    rows = []
    for name in MODELS:
        clock = time.perf_counter()
        guess = nt.estimate(name, t, device="cuda")
        seconds = round(time.perf_counter() - clock, 1)
        longest = nt.longest_context(name, "RTX 3090", t)
        rows.append({"model": name, "parameters": preset_config(name).num_parameters,
                     "predicted_gib": gib(guess.peak), "host_gib": gib(guess.host.peak),
                     "fits_24gb_card": guess.peak <= 24 * 10**9, "estimate_seconds": seconds,
                     "longest_context_rtx3090": longest.tokens, "longest_limit": longest.limit})
        print(f"{name:12} {rows[-1]['predicted_gib']:6.2f} GiB on the card, host "
              f"{rows[-1]['host_gib']:5.2f} GiB ({seconds} s); longest on an RTX 3090: "
              f"{longest.tokens:,} tokens ({longest.limit})", flush=True)
    result = {"command": "python benchmarks/family_predictions.py", "torch": torch.__version__,
              "machine": platform.machine(), "settings": SETTINGS, "models": rows,
              "seconds": round(time.perf_counter() - started, 1)}
    out = ROOT / "benchmarks" / "results" / "families" / "predictions.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"{result['seconds']} s; written to {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
