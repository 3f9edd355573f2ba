"""Run under torchrun by test_shards.py: each rank builds its share (``shards.build_sharded``)
and compares it with FSDP2's shards of the model built whole (loaded, transformed, sharded).
Writes {case: {compared, nf4, read, held, fingerprint_equal}} from rank 0 to argv[1]."""

import json
import sys

import torch

import nbtune as nt
import nbtune.models.hf as hf
from nbtune import shards
from nbtune.distributed import Parallel, Sharding, shard_model
from nbtune.models import demo_model_dir, load_model
from nbtune.models.loading import read_config
from nbtune.peft import is_nf4
from nbtune.plan import transform_model
from nbtune.state import base_fingerprint
from nbtune.memory.accounting import parameter_bytes
from nbtune.predict.estimator import loading_peak
from nbtune.predict.ranks import Ranks
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
        built = []
        loading = tracked_peak(lambda: built.append(shards.build_sharded(source, config, t, parallel)))
        model = built.pop()
        predicted = loading_peak(config, t, "cpu", sum(parameter_bytes(model).values()),
                                 Ranks(parallel.world))
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
                        "loading": [loading, predicted] if case != "in memory" else None,
                        "read": read[0] if case != "in memory" else held,
                        "fingerprint_equal": base_fingerprint(model) == fingerprint}
        if case in ("lora", "qlora"):
            torch.manual_seed(0)
            plain = load_model(folder, quantize=quantize)
            transform_model(plain, t, previous=None)
            report[case]["saves"] = saves(model, plain, parallel, f"{out}.{case}")
    report["damaged"] = parallel.gather(damaged(folder, config, parallel, out))
    if parallel.rank == 0:
        with open(out, "w") as f:
            json.dump(report, f)
    parallel.close()


def tracked_peak(run) -> int:
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    with tracker:
        run()
    return sum(v["Total"] for k, v in tracker.get_tracker_snapshot("peak").items() if str(k) == "cpu")


def saves(model, plain, parallel, where: str) -> dict:
    """Each save (adapter, merged, GGUF) from the ranks against one process's of the same
    weights, file by file; and how often each FSDP2 unit was gathered for it."""
    import filecmp
    import os
    import types

    from nbtune.checkpoint import save_session
    from nbtune.models import Tokenizer
    from nbtune.sharded_checkpoint import save_sharded_session

    tokenizer = Tokenizer.from_folder(demo_model_dir())
    gathered, real = [], shards.UnitGatherer._hold

    def hold(self, unit):
        if unit is not None and unit != self._held:
            gathered.append(unit)
        return real(self, unit)

    shards.UnitGatherer._hold = hold
    out = {}
    for name, kwargs in (("adapter", {}), ("merged", {"merge": True}),
                         ("gguf", {"format": "gguf", "quantization": "q8_0"})):
        gathered.clear()
        ranks = types.SimpleNamespace(model=model, tokenizer=tokenizer, source=None, base_changed=False, techniques=nt.Techniques(),
                                      parallel=parallel)
        save_sharded_session(ranks, f"{where}.{name}.ranks", **kwargs)
        if parallel.rank == 0:
            one = types.SimpleNamespace(model=plain, tokenizer=tokenizer, source=None, base_changed=False, techniques=nt.Techniques())
            save_session(one, f"{where}.{name}.one", **kwargs)
            files = sorted(os.listdir(f"{where}.{name}.one"))
            same = files == sorted(os.listdir(f"{where}.{name}.ranks")) and all(
                filecmp.cmp(f"{where}.{name}.one/{f}", f"{where}.{name}.ranks/{f}", shallow=False)
                for f in files)
            out[name] = {"same": same, "most_gathers": max(gathered.count(u) for u in set(gathered)),
                         "units": len(set(gathered))}
    # rank 0 cannot write (a file stands where the folder's parent should be): every rank raises
    open(f"{where}.blocked.{parallel.rank}", "w").close()
    try:
        save_sharded_session(types.SimpleNamespace(model=model, tokenizer=tokenizer, source=None,
                                                   base_changed=False, techniques=nt.Techniques(), parallel=parallel),
                             f"{where}.blocked.0/inside", merge=True)
        out["blocked"] = "saved"
    except Exception as err:  # noqa: BLE001
        out["blocked"] = type(err).__name__
    out["blocked"] = parallel.gather(out["blocked"])
    shards.UnitGatherer._hold = real
    return out


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
