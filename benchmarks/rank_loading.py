"""Each rank's device peak while it builds its share of a model, beside the estimate's
``loading``: run under torchrun.

    torchrun --standalone --nproc_per_node 2 benchmarks/rank_loading.py FOLDER CASES.json OUT.json

FOLDER: a Hugging Face model folder (safetensors). CASES.json: {"cases": [{"name": ...,
"techniques": {...}, "sharding": {...}}, ...]}. For each case every rank builds its share the
way a run does under torchrun (``shards.build_sharded``: the model on the meta device, only
this rank's rows read from FOLDER), measured on CUDA by the allocator's peak (reset just
before) and on a CPU by the live tensors torch's MemTracker sees; rank 0 writes every rank's
peak with ``nt.estimate(..., ranks=N).loading`` for the same case (computed before the
process group starts: an estimate runs its own fake one) to OUT.json.
"""

from __future__ import annotations

import json
import os
import sys

import torch


def estimates(folder: str, spec: dict, world: int, device: str) -> dict:
    import nbtune as nt

    return {case["name"]: nt.estimate(f"{folder}/config.json", nt.Techniques(**case["techniques"]),
                                      ranks=world, sharding=case.get("sharding"), device=device).loading
            for case in spec["cases"]}


def peak_while(build, device: torch.device) -> int:
    """The most the device held while ``build()`` ran (allocator on CUDA, MemTracker on a CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        build()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    with tracker:
        build()
    return sum(v["Total"] for k, v in tracker.get_tracker_snapshot("peak").items() if str(k) == "cpu")


def main(folder: str, cases_file: str, out_file: str) -> None:
    import nbtune as nt
    from nbtune.distributed import Parallel, Sharding
    from nbtune.models.loading import read_config
    from nbtune.shards import build_sharded

    spec = json.loads(open(cases_file).read())
    world = int(os.environ["WORLD_SIZE"])
    device = "cuda" if torch.cuda.is_available() else "cpu"
    guesses = estimates(folder, spec, world, device)  # before the real process group exists
    parallel = Parallel.from_env()
    config = read_config(folder)
    rows = []
    try:
        for case in spec["cases"]:
            t = nt.Techniques(**case["techniques"])
            sharding = Sharding(**case.get("sharding", {}))
            here = Parallel(parallel.rank, parallel.world, parallel.local_rank, sharding)
            built = []
            peak = peak_while(lambda: built.append(build_sharded(folder, config, t, here)), parallel.device)
            built.clear()
            rows.append({"name": case["name"], "estimate": guesses[case["name"]],
                         "ranks": parallel.gather(peak)})
        if parallel.rank == 0:
            with open(out_file, "w") as f:
                json.dump({"device": device, "torch": torch.__version__, "world": world, "rows": rows},
                          f, indent=1)
    finally:
        parallel.close()


if __name__ == "__main__":
    main(*sys.argv[1:4])
