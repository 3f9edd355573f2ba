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
    fingerprint is the one process's; a rank reads only its rows. A NaN in the last rank's rows
    stops every rank, that one naming the weight."""
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
