"""The newer families (Gemma 3, Phi-3 / Phi-4) with the toggles: a tiny random checkpoint
made by transformers, trained by a session. The techniques that keep the maths give the plain
run's losses; the estimate equals the measured step; packed rows give the unpacked loss.

``test_families.py`` proves their logits (fp32 and bf16), gradients and cached generation
against transformers; ``test_family_paths.py`` their LoRA merge, merged save, PEFT export and
QLoRA; ``test_estimate_depth.py`` Gemma's extrapolated estimate over a pattern of sliding and
global layers; ``test_gemma3.py`` and ``test_phi3.py`` what is each family's own."""

from __future__ import annotations

import json

import pytest
import torch

import nbtune as nt
from nbtune.models.config import ConfigError, ModelConfig
from nbtune.models.tiny import byte_tokenizer

from test_families import build

ROWS = [{"instruction": f"Spell {w}.", "output": " ".join(w)} for w in
        ("gemma", "window", "global", "sliding", "norm", "scale", "query", "tanh")]
SAME = 1e-5  # fp32, the same maths regrouped


def session(folder, **changes) -> nt.Session:
    t = nt.Techniques(**{"batch_size": 4, "seq_len": 128, "lr": 1e-3, "optimizer": "sgd", **changes})
    s = nt.Session(nt.load_model(folder), byte_tokenizer(), ROWS, techniques=t, device="cpu")
    s.echo = False
    return s


@pytest.fixture(scope="module", params=["gemma3", "phi3", "qwen3_moe"])
def folder(tmp_path_factory, request):
    path = tmp_path_factory.mktemp(request.param)
    build(path, request.param, tie=True)
    return path


def losses(folder, steps=3, **changes) -> list[float]:
    torch.manual_seed(0)
    s = session(folder, **changes)
    return [s.step().loss for _ in range(steps)]


@pytest.mark.parametrize("changes", [
    dict(activation_checkpointing=True),
    dict(activation_offloading=True),
    dict(chunked_loss=4),
    dict(tile_tokens=8),
    dict(batch_size=2, grad_accum=2),
    dict(optimizer_in_backward=True),
], ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_each_exact_technique_gives_the_plain_runs_losses(folder, changes):
    plain = losses(folder)
    assert plain[-1] < plain[0]  # it trains
    got = losses(folder, **changes)
    assert max(abs(a - b) for a, b in zip(got, plain)) < SAME, (got, plain)


def test_lora_trains_and_the_estimate_equals_the_measured_step(folder):
    s = session(folder, method="lora", activation_checkpointing=True, chunked_loss=2)
    s.memory_tracking = "every_step"
    reports = [s.step() for _ in range(3)]
    assert reports[-1].loss < reports[0].loss
    shape = reports[-1].shape
    predicted = s.estimate(batch_size=shape[0], seq_len=shape[1])
    assert abs(predicted.peak - reports[-1].memory.peak) <= 0.02 * reports[-1].memory.peak


def test_packed_rows_give_the_unpacked_loss_with_the_window_and_the_document_mask(folder):
    """Packing: the sliding layers' window (Gemma 3's, Phi-3's) and the document mask together,
    each example restarting its positions, give each example's own loss."""
    from nbtune.data import collate, pack, tokenize_all

    from test_packing import loss_of

    s = session(folder)
    samples, _ = tokenize_all(s.train_examples, s.tokenizer, 128)
    packed = pack(samples, seq_len=256)
    assert len(packed) < len(samples) // 2 and max(len(r.input_ids) for r in packed) > 24  # past the window
    model = s.model.eval()
    with torch.no_grad():
        plain = loss_of(model, collate(samples, s.tokenizer.pad_id))
        together = loss_of(model, collate(packed, s.tokenizer.pad_id))
    torch.testing.assert_close(together, plain, atol=1e-5, rtol=0)


def test_the_config_counts_the_parameters_the_model_has(folder):
    """Four norms a layer, q/k norms, fused projections and a tied head: what ``num_parameters`` (the host
    estimate's and the CLI's count) says is what the model holds."""
    model = nt.load_model(folder)
    assert model.config.num_parameters == sum(p.numel() for p in model.parameters())


@pytest.mark.slow
def test_two_gloo_ranks_train_as_one_process_does(folder, tmp_path):
    """The user's way: a folder they did not make (transformers wrote it, a tokenizer beside
    it), one JSONL, no held-out split, a run file from the session; then nbtune train in one
    process and on 2 ranks (each building only its share of the layers and fused weights):
    the same losses, adapters and merged weights."""
    import shutil

    from safetensors.torch import load_file

    import nbtune.cli.main as cli
    from nbtune.models import demo_model_dir

    from helpers import torchrun

    model = tmp_path / "model"
    shutil.copytree(folder, model)
    if "moe" in folder.name:  # each rank's balancing loss is its own rows' (as under DDP or FSDP
        config = json.loads((model / "config.json").read_text())  # elsewhere): off, to compare
        (model / "config.json").write_text(json.dumps({**config, "router_aux_loss_coef": 0.0}))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(demo_model_dir() / name, model / name)
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    # a mixture of experts' adapter for PEFT: attention and the experts (in PEFT's fused form,
    # made from every rank's shards), not the dense layer's MLP (test_qwen3_moe.py)
    targets = {"lora_targets": ("q_proj", "k_proj", "v_proj", "o_proj", "experts")} if "moe" in folder.name else {}
    s = nt.Session.from_pretrained(model, str(data), techniques=nt.Techniques(
        method="lora", batch_size=4, seq_len=128, lr=1e-3, activation_checkpointing=True, **targets))
    path = s.save_config(tmp_path / "run.yaml", steps=3, save=["hf", "merged"])
    assert cli.main(["train", str(path), "--out", str(tmp_path / "one")]) == 0
    torchrun(path, tmp_path / "two")
    one, two = ([json.loads(line) for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
                for run in ("one", "two"))
    assert (tmp_path / "two" / "metrics.rank1.jsonl").exists()  # two ranks really ran
    assert len(one) == len(two) == 3 and one[-1]["loss"] < one[0]["loss"]
    assert all(abs(a["loss"] - b["loss"]) <= 1e-5 for a, b in zip(one, two)), (one, two)
    for folder_name, file in (("final", "adapter_model.safetensors"), ("merged", "model.safetensors")):
        a, b = (load_file(str(tmp_path / run / folder_name / file)) for run in ("one", "two"))
        assert a.keys() == b.keys() and max((a[k] - b[k]).abs().max().item() for k in a) <= 1e-5
