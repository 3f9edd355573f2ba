"""How long the panel's "will it fit?" badge takes to answer after a slider move, on a
Llama-3.1-8B preset (nothing allocated: the estimator runs on fake tensors).

The panel's own ``FitCheck`` is driven as a slider would drive it: a request for new
techniques, then the time until the badge is shown (debounce delay included). A second
request for techniques already seen measures the cache.

    python benchmarks/fit_refresh.py
"""

from __future__ import annotations

import json
import platform
import sys
import time
from pathlib import Path

import torch

import nbtune as nt
from nbtune.models.presets import preset_config
from nbtune.ui.fitcheck import FitCheck


def main() -> int:
    config = preset_config("llama-3.1-8b")
    shown = []
    check = FitCheck(config, lambda *a: shown.append(a), device="cuda")
    start = nt.Techniques(method="qlora", dtype="bf16", batch_size=2, seq_len=2048)
    results = {}
    for label, t in (("QLoRA bf16 2x2048", start),
                     ("slider: batch_size 2 -> 1", start.replace(batch_size=1)),
                     ("slider back: batch_size 1 -> 2 (cached)", start)):
        began = time.perf_counter()
        check.request(t, "RTX 3090")
        check.wait(600)
        _, _, badge, seconds, error = shown[-1]
        results[label] = {"seconds": round(seconds, 2), "badge": badge.text if badge else error,
                          "wall": round(time.perf_counter() - began, 2)}
        print(f"{label}: {seconds:.2f} s -> {results[label]['badge']}", flush=True)
    out = Path("benchmarks/results/fit-refresh/fit_refresh.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "command": "python " + " ".join(sys.argv),
        "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
                   f"torch {torch.__version__}",
        "debounce_seconds": check.delay, "results": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
