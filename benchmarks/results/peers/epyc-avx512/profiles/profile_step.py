"""Per-op profile of one framework's peers step (torch.profiler, CPU), made for issue 38:

    python benchmarks/results/peers/epyc-avx512/profiles/profile_step.py nbtune '{}' 30
    .venv-torchtune/bin/python ...profile_step.py torchtune '{...rung config...}' 40

Run from the repository root after `benchmarks/peers.py` made its inputs (6 timed steps); the
*.txt beside it are its output for the fp32 rung and the 8-bit AdamW rung."""
import json, sys, os, time
sys.path.insert(0, "benchmarks")
import peers, torch
from pathlib import Path
fw, cfg = sys.argv[1], json.loads(sys.argv[2])
rows = int(sys.argv[3]) if len(sys.argv) > 3 else 30
folder = Path(os.path.expanduser("~/.cache/nbtune/peers-inputs/125m-2x512"))

def measure(step, model, optimizer, batches, steps, device, **kwargs):
    step(batches[0]); step(batches[1])
    t = time.perf_counter()
    for b in batches[2:4]: step(b)
    print("plain seconds/step", (time.perf_counter() - t) / 2)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for b in batches[2:4]: step(b)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=60))
    return {}
peers.measure = measure
getattr(peers, "worker_" + fw)({**peers.SHAPES["125m"], "batch": 2, "seq": 512}, cfg, folder, 6, "cpu")
