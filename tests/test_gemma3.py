"""Gemma 3 (``gemma3_text``) with the toggles: a tiny random checkpoint made by transformers,
trained by a session. The techniques that keep the maths give the plain run's losses; the
estimate equals the measured step; a config the decoder cannot run is refused by name.

``test_families.py`` proves its logits (fp32 and bf16) and cached generation against
transformers; ``test_family_paths.py`` its LoRA merge, merged save, PEFT export and QLoRA;
``test_estimate_depth.py`` its extrapolated estimate over a pattern of sliding and global
layers."""

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


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("gemma3")
    build(path, "gemma3", tie=True)
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


def test_the_sliding_layers_see_only_their_window_and_the_global_ones_everything(folder):
    """A token beyond reach of the windows changes the last position only through the global
    layer: with that layer's attention confined to the window too, the output would not move
    (two sliding layers of 24 reach 46 tokens back)."""
    model = nt.load_model(folder).eval()
    ids = torch.randint(0, 101, (1, 60))
    changed = ids.clone()
    changed[0, 0] = (ids[0, 0] + 1) % 101  # 59 tokens before the last
    with torch.no_grad():
        moved = (model(ids)[0, -1] - model(changed)[0, -1]).abs().max()
        for layer in model.model.layers:
            layer.sliding = True
        still = (model(ids)[0, -1] - model(changed)[0, -1]).abs().max()
    assert moved > 1e-4 and still == 0


def test_a_gemma3_config_the_decoder_cannot_run_is_refused_by_name(folder, tmp_path):
    hf = json.loads((folder / "config.json").read_text())
    for key, value in (("final_logit_softcapping", 30.0), ("attn_logit_softcapping", 50.0),
                       ("use_bidirectional_attention", True)):
        with pytest.raises(ConfigError, match=key.split("_")[0]):
            ModelConfig.from_hf({**hf, key: value}, source="config.json")
    bad = {**hf, "layer_types": ["sliding_attention"]}  # one kind for two layers
    with pytest.raises(ConfigError, match="layer_types"):
        ModelConfig.from_hf(bad, source="config.json")
    crafted = {k: v for k, v in hf.items() if k != "layer_types"}  # a layer kind list made from it
    with pytest.raises(ConfigError, match="num_hidden_layers is 10000000000"):
        ModelConfig.from_hf({**crafted, "num_hidden_layers": 10**10}, source="config.json")
    with pytest.raises(ConfigError, match="sliding_window_pattern"):
        ModelConfig.from_hf({**crafted, "sliding_window_pattern": "6"}, source="config.json")


def test_an_older_gemma3_config_reads_as_the_new_one(folder):
    """Checkpoints written before transformers 5 give rope_theta, rope_local_base_freq,
    rope_scaling and sliding_window_pattern instead of per-layer-type rope_parameters."""
    hf = json.loads((folder / "config.json").read_text())
    new = ModelConfig.from_hf(hf)
    old = {k: v for k, v in hf.items() if k not in ("rope_parameters", "layer_types")}
    old.update(rope_theta=1000000.0, rope_local_base_freq=10000.0,
               rope_scaling={"rope_type": "linear", "factor": 4.0}, sliding_window_pattern=2)
    assert ModelConfig.from_hf(old) == new
    again = ModelConfig.from_hf(new.to_hf())  # and what nbtune writes reads back the same
    assert again == new
    legacy = {**old, "rope_scaling": {"type": "linear", "factor": 4.0}}  # the older key name
    written = ModelConfig.from_hf(legacy).to_hf()["rope_parameters"]["full_attention"]
    assert written == {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0}
    assert ModelConfig.from_hf(ModelConfig.from_hf(legacy).to_hf()).rope_scaling["factor"] == 4.0


def test_a_multimodal_gemma3_checkpoint_is_refused_with_what_is_read_instead():
    hf = {"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"],
          "text_config": {"hidden_size": 64}}
    with pytest.raises(ConfigError, match="gemma3_text checkpoints"):
        ModelConfig.from_hf(hf, source="config.json")


def test_packed_rows_give_the_unpacked_loss_with_the_window_and_the_document_mask(folder):
    """Packing on Gemma 3: the sliding layers' window and the document mask together, each
    example restarting its positions, give each example's own loss."""
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
    """Four norms a layer, q/k norms and a tied head: what ``num_parameters`` (the host
    estimate's and the CLI's count) says is what the model holds."""
    model = nt.load_model(folder)
    assert model.config.num_parameters == sum(p.numel() for p in model.parameters())


@pytest.mark.slow
def test_two_gloo_ranks_train_gemma3_as_one_process_does(folder, tmp_path):
    """The user's way: a folder they did not make (transformers wrote it, a tokenizer beside
    it), one JSONL, no held-out split, a run file from the session; then nbtune train in one
    process and on 2 ranks (each building only its share of the sliding and global layers):
    the same losses, adapters and merged weights."""
    import shutil

    from safetensors.torch import load_file

    from nbtune import cli
    from nbtune.models import demo_model_dir

    from helpers import torchrun

    model = tmp_path / "gemma"
    shutil.copytree(folder, model)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(demo_model_dir() / name, model / name)
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    s = nt.Session.from_pretrained(model, str(data), techniques=nt.Techniques(
        method="lora", batch_size=4, seq_len=128, lr=1e-3, activation_checkpointing=True))
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
