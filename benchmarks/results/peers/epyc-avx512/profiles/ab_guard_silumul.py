"""What nbtune's fp32 peers step spends on two things torchtune does not do: the finite guard
(a norm of every gradient before the update) and SiluMul's recompute of silu(gate) in
backward (one [tokens, intermediate] tensor less per layer: 96 MiB by its size on the fp32 rung).

    MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=1099511627776 \
        python benchmarks/results/peers/epyc-avx512/profiles/ab_guard_silumul.py '{}' 12

One trainer (peers.py's nbtune worker, the rung's config as JSON), its steps alternating
between the four variants, the order rotating each cycle; a diagnostic that patches nbtune's
internals, not a benchmark of the shipped code."""
import json, sys, time, statistics
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[4] / "benchmarks"))
import peers
import torch, torch.nn.functional as F
import nbtune.step as st
from nbtune.models import decoder

holder = {}
def measure(step, model, optimizer, batches, steps, device, batch_made_in_step=False):
    holder["step"] = step; return {}
peers.measure = measure
shape = peers.SHAPES["125m"]; torch.manual_seed(0)
peers.WORKERS["nbtune"](shape, json.loads(sys.argv[1] if len(sys.argv) > 1 else "{}"),
                        peers.INPUTS / "125m-2x512", 6, "cpu")
step = holder["step"]
guard, fwd = st.finite_guard, decoder.MLP.forward
def plain(self, x): return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
def variant(kind):
    st.finite_guard = guard if kind in ("ship", "silu") else (lambda s, l: None)
    decoder.MLP.forward = fwd if kind in ("ship", "noguard") else plain
kinds = ["ship", "noguard", "silu", "neither"]
times = {k: [] for k in kinds}
variant("ship")
for i in range(2): step(None)
for cycle in range(int(sys.argv[2]) if len(sys.argv) > 2 else 6):
    order = kinds[cycle % 4:] + kinds[:cycle % 4]
    for k in order:
        variant(k); t0 = time.perf_counter(); step(None); times[k].append(time.perf_counter() - t0)
for k, v in times.items(): print(k, round(statistics.median(v), 4), [round(x, 3) for x in v])
s = times["ship"]
for k in ("noguard", "silu", "neither"):
    print("ship/", k, round(statistics.median([b / a for a, b in zip(times[k], s)]), 4))
