"""Run under torchrun by test_shards.py: the bytes activation offloading parks on each rank
(its saved-tensor hooks' own count) and in one process at the per-rank batch, for a full
finetune of the demo with and without checkpointing. Writes {case: {"ranks": [...], "one":
n}} from rank 0 to argv[1]."""

import json
import sys

import torch

import nbtune.step as step_module
from nbtune import activations, shards
from nbtune.distributed import Parallel, Sharding, prime_units
from nbtune.models import demo_model_dir, load_model
from nbtune.models.loading import read_config
from nbtune.optim import build_optimizer
from nbtune.plan import transform_model
from nbtune.step import StepContext, StepOptions, train_step
from nbtune.techniques import Techniques

parked = []


class Counted(activations.OffloadActivations):
    def __exit__(self, *exc):
        parked.append(self.parked_bytes)
        return super().__exit__(*exc)


def parked_in_a_step(model, t, batch, context) -> int:
    parked.clear()
    train_step(model, build_optimizer(model, t), [batch], StepOptions.of(t), context, pad_id=-1, step=1)
    return sum(parked)


def main(out: str) -> None:
    step_module.OffloadActivations = Counted
    parallel = Parallel.from_env(Sharding())
    folder = demo_model_dir()
    ids = torch.randint(0, 250, (2 * parallel.world, 64), generator=torch.Generator().manual_seed(1))
    report = {}
    for checkpointed in (False, True):
        t = Techniques(seq_len=64, batch_size=2 * parallel.world, activation_offloading=True,
                       activation_checkpointing=checkpointed)
        model = shards.build_sharded(folder, read_config(folder), t, parallel)
        prime_units(model)
        batch = parallel.rows({"input_ids": ids, "labels": ids.clone()})
        mine = parked_in_a_step(model, t, batch, StepContext(parallel=parallel))
        whole = load_model(folder)
        transform_model(whole, t, previous=None)
        one = parked_in_a_step(whole, t, batch, StepContext())
        report["checkpointed" if checkpointed else "plain"] = {"ranks": parallel.gather(mine), "one": one}
    if parallel.rank == 0:
        with open(out, "w") as f:
            json.dump(report, f)
    parallel.close()


if __name__ == "__main__":
    main(sys.argv[1])
