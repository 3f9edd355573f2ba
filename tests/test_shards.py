"""Each rank builds its own share of the model: rows read from the files, NF4 made per shard,
adapters drawn as one process draws them; checked against the whole model read in one
process, and on gloo ranks against FSDP2's own shards of it."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nbtune.models import demo_model_dir, load_model
from nbtune.models.filling import empty_model
from nbtune.models.loading import read_config, weight_stream
from nbtune.peft import nf4_block_absmax, nf4_of_rows, to_nf4

ROOT = Path(__file__).resolve().parent.parent
PARTS = ("quantized_scalers", "quantization_factor", "quantized_data", "scaler_mean", "nf4")


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(
        a.new_empty(a.shape).copy_(a).reshape(-1).view(torch.uint8),
        b.new_empty(b.shape).copy_(b).reshape(-1).view(torch.uint8))


@pytest.mark.parametrize("shape, world, dtype", [
    ((128, 128), 2, torch.float32), ((512, 256), 4, torch.float32), ((384, 128), 8, torch.float32),
    ((256, 128), 2, torch.bfloat16), ((1024, 64), 8, torch.bfloat16)])
def test_nf4_of_a_ranks_rows_is_byte_for_byte_its_shard_of_the_whole_weights_nf4(shape, world, dtype):
    """What FSDP2 cuts out of the whole weight's NF4 (torchao's split) is what each rank makes
    of its own rows, given the whole weight's block scales."""
    weight = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(dtype) * 0.02
    whole = to_nf4(weight)
    absmax = nf4_block_absmax(weight)
    rows = shape[0] // world
    for rank, shard in enumerate(torch.split(whole, rows)):
        mine = nf4_of_rows(weight[rank * rows:(rank + 1) * rows], shape, absmax)
        assert mine.shape == shard.shape and mine.n_blocks == whole.n_blocks
        assert mine.scaler_block_size == whole.scaler_block_size
        for part in PARTS:
            assert same_bits(getattr(mine, part), getattr(shard, part)), (part, rank)


def test_a_ranks_rows_are_what_it_reads_and_all_it_reads(tmp_path):
    """Rows of every weight of a safetensors folder, cast as read (fp32 file to bf16, through
    the 16 MiB chunk), equal the rows of the whole weight; nothing beyond them is read."""
    folder = demo_model_dir()
    config = read_config(folder)
    _, _, expected = empty_model(config, ())
    whole = dict(weight_stream(folder, config, expected, torch.bfloat16, "cpu"))
    for world, rank in ((2, 1), (3, 0), (4, 3)):
        def rows(key, world=world, rank=rank):
            count = expected[key].shape[0]
            chunk = -(-count // world)
            return min(count, rank * chunk), min(count, (rank + 1) * chunk)
        for key, part in weight_stream(folder, config, expected, torch.bfloat16, "cpu", rows):
            first, end = rows(key)
            assert same_bits(part, whole[key][first:end]), key


def test_rows_of_a_gguf_file_equal_the_whole_tensors_rows_q_and_k_reordered(tmp_path):
    """A GGUF tensor's rows are whole blocks: a rank dequantizes only its rows; llama's q and k
    rows, stored reordered within each head, come from the heads they fall in."""
    import nbtune as nt
    from nbtune.models.gguf import GGUFFile

    session = nt.Session.demo()
    session.save(tmp_path / "gguf", format="gguf", quantization="q8_0")
    file = GGUFFile(tmp_path / "gguf" / "model.gguf")
    config = read_config(file)
    _, _, expected = empty_model(config, ())
    whole = dict(weight_stream(file, config, expected, torch.float32, "cpu"))
    for first, end in ((0, 16), (16, 48), (40, 41), (5, 5)):
        got = dict(weight_stream(file, config, expected, torch.float32, "cpu",
                                 lambda key: (min(first, expected[key].shape[0]),
                                              min(end, expected[key].shape[0]))))
        assert got.keys() == whole.keys()
        for key, part in got.items():
            stop = min(end, expected[key].shape[0])
            assert torch.equal(part, whole[key][min(first, stop):stop]), key
    q = "model.layers.0.self_attn.q_proj.weight"
    loaded = load_model(file)  # the one-process reader gives the same weights
    assert torch.equal(loaded.get_parameter(q), whole[q])


@pytest.mark.slow
def test_each_rank_holds_its_shards_of_the_one_process_model_and_reads_no_more(tmp_path):
    """On 2 and 4 gloo ranks (full, LoRA, QLoRA, and a whole model given in memory): every
    shard equals FSDP2's own shard of the one-process model built the old way (loaded whole,
    transformed, then sharded), NF4 parts byte for byte, LoRA adapters too; the base
    fingerprint is the one process's; a rank reads only its rows, and what its live tensors
    hold while building is the estimate's loading peak (at most 10 % over). A NaN in the last
    rank's rows stops every rank, that one naming the weight. Saves from the ranks are one
    process's files byte for byte, made a unit at a time; if rank 0 cannot write, every rank
    raises."""
    for ranks in (2, 4):
        done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                               "--nproc_per_node", str(ranks), str(ROOT / "tests" / "shard_worker.py"),
                               str(tmp_path / f"out{ranks}.json")],
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-4000:]
        report = json.loads((tmp_path / f"out{ranks}.json").read_text())
        said = report.pop("damaged")
        assert "holds NaN" in said[-1] and "model.embed_tokens.weight" in said[-1]
        assert all(line.startswith("ShardError: 1 other rank could not read") for line in said[:-1])
        assert set(report) == {"full", "lora", "qlora", "in memory"}
        for case, found in report.items():
            assert found["compared"] > 10 and found["nf4"] == (28 if case == "qlora" else 0), case
            assert found["read"] == found["held"], case  # elements read from the files
            assert found["fingerprint_equal"], case
            if found["loading"]:  # what building held, against the estimate's loading peak
                measured, predicted = found["loading"]
                assert measured <= predicted <= 1.1 * measured, (case, ranks, measured, predicted)
        for case in ("lora", "qlora"):  # saves from the ranks: the one process's files
            made = report[case]["saves"]
            blocked = made.pop("blocked")  # rank 0 cannot write: each rank raises, none waits
            assert blocked[0] not in ("saved", "ShardError") and blocked[1:] == ["ShardError"] * (ranks - 1), blocked
            for name, found in made.items():
                assert found["same"], (case, name)
                # a unit at a time, each once (the root, holding the embedding and the final
                # norm, at the start and the end); an adapter lives in the 4 layers alone
                assert found["units"] == (4 if name == "adapter" else 5), (case, name, found)
                assert found["most_gathers"] <= 2, (case, name, found)


def test_offloading_parks_activations_only_so_n_ranks_park_n_times_one_ranks_share():
    """Under FSDP2 the weights a layer gathers are saved for backward too; parked, every
    rank's host would hold the whole model (the estimate said 4.6 of 5.3 GiB a rank for
    Llama-3.2-1B). Offloading leaves them, so the whole host parks N times what one process
    parks at the per-rank batch, with and without checkpointing."""
    import nbtune as nt

    for checkpointed in (False, True):
        t = nt.Techniques(batch_size=2, seq_len=96, activation_offloading=True,
                          activation_checkpointing=checkpointed)
        one = nt.estimate("llama-3.2-1b", t, device="cuda").host.offloaded
        assert one > 0
        for ranks in (2, 4):
            many = nt.estimate("llama-3.2-1b", t.replace(batch_size=2 * ranks), device="cuda", ranks=ranks)
            assert many.host.offloaded == ranks * one, (checkpointed, ranks)


@pytest.mark.slow
def test_on_gloo_ranks_the_offloading_hooks_park_what_one_process_parks_at_the_rank_batch(tmp_path):
    """The saved-tensor hooks' own count on 2 gloo ranks: each rank parks exactly what one
    process parks for the same rows (its weights, gathered by FSDP2, stay)."""
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc_per_node", "2", str(ROOT / "tests" / "offload_worker.py"),
                           str(tmp_path / "out.json")], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads((tmp_path / "out.json").read_text())
    for case, found in report.items():
        assert found["one"] > 0 and found["ranks"] == [found["one"]] * 2, (case, found)


# ---- the estimate of loading -----------------------------------------------------------------

def _tracked_peak(run) -> int:
    """The most bytes of live tensors (torch's MemTracker, on the CPU) while ``run()`` runs."""
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    with tracker:
        run()
    return sum(v["Total"] for k, v in tracker.get_tracker_snapshot("peak").items() if str(k) == "cpu")


@pytest.mark.parametrize("size", [1 << 18, 3 << 20, 16 << 20])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_what_quantizing_a_weight_holds_is_predicted_within_2_percent(size, dtype):
    from nbtune.predict.estimator import _quantizing

    weight = torch.randn(size // 256, 256, dtype=dtype)
    measured = _tracked_peak(lambda: to_nf4(weight))
    assert measured <= _quantizing(size, weight.element_size()) <= 1.02 * measured


@pytest.mark.parametrize("method", ["full", "lora", "qlora"])
def test_one_process_loading_peak_is_predicted(method):
    """The most live tensors hold while a run's model is read and made ready (weights, LoRA,
    QLoRA's NF4 as each weight is read, the reader's cast buffer) is what the estimate says
    loading holds, at most 10 % over (it counts every weight as already there)."""
    import nbtune as nt
    from nbtune.plan import transform_model

    folder = demo_model_dir()
    t = nt.Techniques(method=method, lora_rank=4, seq_len=96)

    def load():
        model = load_model(folder, quantize=t.lora_targets if method == "qlora" else ())
        transform_model(model, t, previous=None)

    measured = _tracked_peak(load)
    predicted = nt.estimate(read_config(folder), t).loading
    assert measured <= predicted <= 1.1 * measured, (measured, predicted)


@pytest.mark.slow  # (about 10 s here; the fast tier has this module's others)
def test_a_run_whose_loading_needs_more_than_its_step_is_sized_by_its_loading():
    """QLoRA of Llama-3.1-8B on one token row: the step holds less than quantizing a
    projection while loading does; what must fit (and what fit checks) is the loading."""
    import nbtune as nt
    from nbtune.predict.budgets import required

    t = nt.Techniques(method="qlora", dtype="bf16", batch_size=1, seq_len=16)
    memory = nt.estimate("llama-3.1-8b", t, device="cuda")
    assert memory.loading > max(memory.peak, memory.eval_peak)
    assert required(memory) == memory.loading + memory.outside
    spread = nt.estimate("llama-3.1-8b", t.replace(batch_size=2), device="cuda", ranks=2)
    assert spread.loading < memory.loading  # a rank reads and quantizes its rows alone
    offloaded = nt.estimate("llama-3.1-8b", t.replace(batch_size=2), device="cuda", ranks=2,
                            sharding={"cpu_offload": True})
    assert offloaded.loading == 0 and offloaded.host.peak >= offloaded.host.runtime + \
        offloaded.host.sharded + offloaded.host.loading
