"""Each rank's measured step under FSDP2, beside its prediction: run under torchrun.

    torchrun --standalone --nproc_per_node 2 benchmarks/rank_peaks.py CASES.json OUT.json

CASES.json: {"config": ModelConfig fields, "batch_size": B, "seq_len": T, "cases": [{"name":
..., "techniques": {...}, "sharding": {...}}, ...]}. For every case each rank builds its share of the model
(seed 0) the way a run does under torchrun (``shards.build_sharded``, then the optimizer),
trains six steps on full-length random rows of the global batch (its own share) and keeps
the lowest of the last five (see ``measure``), measured with the same tracker as any step; rank 0 gathers every rank's breakdown and
writes them to OUT.json with ``nt.estimate(..., ranks=N)`` for the same case (computed
before the process group starts: an estimate runs its own fake one). On CUDA it measures
with the allocator (peak active bytes); on CPU (gloo), the live tensors.
"""

from __future__ import annotations

import json
import os
import sys

import torch


def estimates(spec: dict, world: int, device: str) -> dict:
    import nbtune as nt
    from nbtune.models import ModelConfig

    config = ModelConfig(**spec["config"])
    out = {}
    for case in spec["cases"]:
        t = nt.Techniques(batch_size=spec["batch_size"], seq_len=spec["seq_len"], **case["techniques"])
        guess = nt.estimate(config, t, ranks=world, sharding=case.get("sharding"), device=device)
        out[case["name"]] = {"peak": guess.peak, **guess.categories}
    return out


def measure(spec: dict, parallel) -> dict:
    import nbtune as nt
    from nbtune.distributed import Parallel, Sharding, prime_units
    from nbtune.models import CausalLM, ModelConfig
    from nbtune.optim import build_optimizer
    from nbtune.shards import build_sharded
    from nbtune.step import StepContext, StepOptions, train_step

    config = ModelConfig(**spec["config"])
    out = {}
    for case in spec["cases"]:
        t = nt.Techniques(batch_size=spec["batch_size"], seq_len=spec["seq_len"], **case["techniques"])
        torch.manual_seed(0)
        with torch.device(parallel.device):
            whole = CausalLM(config)
        whole.reset_parameters()
        sharding = Sharding(**case.get("sharding", {}))
        model = build_sharded(whole, config, t, Parallel(parallel.rank, parallel.world,
                                                         parallel.local_rank, sharding))
        del whole
        prime_units(model)  # as the trainer does before its first step
        optimizer = build_optimizer(model, t)
        ids = torch.randint(0, config.vocab_size, (spec["batch_size"], spec["seq_len"]),
                            generator=torch.Generator().manual_seed(1)).to(parallel.device)
        batch = parallel.rows({"input_ids": ids, "labels": ids.clone()})
        context = StepContext(parallel=parallel)
        reports = [train_step(model, optimizer, [batch] * t.grad_accum, StepOptions.of(t), context,
                              pad_id=-1, step=step) for step in range(1, 7)]
        # The steady steps' lowest: now and then (about one step in four, on 4 gloo ranks on 2
        # cores) a rank's step also holds a layer's gathered weights a little early, as the
        # ranks' collectives interleave; the lowest is the step's own order (five steady steps:
        # with three, one CI run in a few lost all three on some rank).
        memory = min((r.memory for r in reports[1:]), key=lambda m: m.peak)
        out[case["name"]] = parallel.gather({"peak": memory.peak, **memory.categories})
        del model, optimizer, reports
    return out


def main(cases_file: str, out_file: str) -> None:
    from nbtune.distributed import Parallel

    spec = json.loads(open(cases_file).read())
    world = int(os.environ["WORLD_SIZE"])
    device = "cuda" if torch.cuda.is_available() else "cpu"
    guesses = estimates(spec, world, device)  # before the real process group exists
    parallel = Parallel.from_env()
    try:
        measured = measure(spec, parallel)
        if parallel.rank == 0:
            rows = [{"name": name, "world": world, "estimate": guesses[name], "ranks": measured[name]}
                    for name in measured]
            with open(out_file, "w") as f:
                json.dump({"device": device, "torch": torch.__version__, "rows": rows}, f, indent=1)
    finally:
        parallel.close()


if __name__ == "__main__":
    main(*sys.argv[1:3])
