"""Run under torchrun by test_shards.py: each rank builds its share (``shards.build_sharded``)
and compares it with FSDP2's shards of the model built whole (loaded, transformed, sharded).
Writes {case: {compared, nf4, read, held, fingerprint_equal}} from rank 0 to argv[1]."""

import json
import sys

import torch

import nbtune.models.hf as hf
from nbtune import shards
from nbtune.distributed import Parallel, Sharding, shard_model
from nbtune.models import demo_model_dir, load_model
from nbtune.models.loading import read_config
from nbtune.peft import is_nf4
from nbtune.plan import transform_model
from nbtune.state import base_fingerprint
from nbtune.techniques import Techniques

T = dict(seq_len=96)
CASES = {"full": Techniques(**T), "lora": Techniques(method="lora", lora_rank=4, **T),
         "qlora": Techniques(method="qlora", lora_rank=4, **T),
         "in memory": Techniques(method="lora", lora_rank=4, **T)}


def same(a, b) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(
        a.new_empty(a.shape).copy_(a).reshape(-1).view(torch.uint8),
        b.new_empty(b.shape).copy_(b).reshape(-1).view(torch.uint8))


def main(out: str) -> None:
    parallel = Parallel.from_env(Sharding())
    folder = demo_model_dir()
    config = read_config(folder)
    read = [0]
    real = hf._read_tensor

    def counted(f, offset, src, shape, *args, **kwargs):
        read[0] += int(torch.Size(shape).numel())
        return real(f, offset, src, shape, *args, **kwargs)

    hf._read_tensor = counted
    report = {}
    for case, t in CASES.items():
        quantize = t.lora_targets if t.method == "qlora" else ()
        torch.manual_seed(0)
        whole = load_model(folder, quantize=quantize)
        fingerprint = base_fingerprint(whole)
        transform_model(whole, t, previous=None)
        shard_model(whole, Sharding())
        source = load_model(folder) if case == "in memory" else folder
        read[0] = 0
        torch.manual_seed(0)
        model = shards.build_sharded(source, config, t, parallel)
        mine, theirs = dict(model.named_parameters()), dict(whole.named_parameters())
        assert mine.keys() == theirs.keys(), (sorted(mine.keys() ^ theirs.keys()))[:4]
        compared = nf4 = held = 0
        for name, param in mine.items():
            a, b = param.to_local(), theirs[name].to_local()
            if is_nf4(a):
                nf4 += 1
                for part in ("quantized_scalers", "quantization_factor", "quantized_data",
                             "scaler_mean", "nf4"):
                    assert same(getattr(a, part), getattr(b, part)), (case, name, part)
            else:
                assert same(a, b), (case, name)
            if "lora_" not in name and not (name == "lm_head.weight" and config.tie_word_embeddings):
                held += a.numel()
            compared += 1
        report[case] = {"compared": compared, "nf4": nf4, "held": held,
                        "read": read[0] if case != "in memory" else held,
                        "fingerprint_equal": base_fingerprint(model) == fingerprint}
    report["damaged"] = parallel.gather(damaged(folder, config, parallel, out))
    if parallel.rank == 0:
        with open(out, "w") as f:
            json.dump(report, f)
    parallel.close()


def damaged(folder, config, parallel, out: str) -> str:
    """A NaN in the embedding's last row (the last rank's rows): every rank stops, that one
    naming the weight, the others saying another rank failed; none waits for ever."""
    import shutil

    from safetensors.torch import load_file, save_file

    copy = f"{out}.damaged"
    if parallel.rank == 0:
        shutil.copytree(folder, copy, dirs_exist_ok=True)
        weights = load_file(f"{copy}/model.safetensors")
        weights["model.embed_tokens.weight"][-1, 3] = float("nan")
        save_file(weights, f"{copy}/model.safetensors", metadata={"format": "pt"})
    parallel.barrier()
    try:
        shards.build_sharded(copy, config, CASES["lora"], parallel)
    except (ValueError, shards.ShardError) as err:
        return f"{type(err).__name__}: {err}"
    return "built"


if __name__ == "__main__":
    main(sys.argv[1])
