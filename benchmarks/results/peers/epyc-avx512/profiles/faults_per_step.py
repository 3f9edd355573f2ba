"""Each step's wall time, user and kernel CPU time and minor page faults for one framework on
a peers rung (``getrusage`` around the step), in this process: the untimed and counted steps
first, then the 6 that peers.py times.

    python benchmarks/results/peers/epyc-avx512/profiles/faults_per_step.py nbtune '{}'
    MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=1099511627776 python ... nbtune '{}'
    .venv-torchtune/bin/python ... torchtune '{}'

The inputs are peers.py's (run it once first); a diagnostic, not a benchmark."""
import json
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[4] / "benchmarks"))
import peers  # noqa: E402


def measure(step, model, optimizer, batches, steps, device, batch_made_in_step=False):
    out = []
    for batch in batches[:2 + steps]:
        r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        step(batch)
        t1, r1 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
        out.append(dict(wall=round(t1 - t0, 3), user=round(r1.ru_utime - r0.ru_utime, 3),
                        sys=round(r1.ru_stime - r0.ru_stime, 3), minflt=r1.ru_minflt - r0.ru_minflt))
    return out


peers.measure = measure
framework, config = sys.argv[1], json.loads(sys.argv[2] if len(sys.argv) > 2 else "{}")
shape = peers.SHAPES["125m"]
import torch  # noqa: E402

torch.manual_seed(0)
for row in peers.WORKERS[framework](shape, config, peers.INPUTS / "125m-2x512", 6, "cpu"):
    print(framework, row)
print(framework, "maxrss MB", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024)
