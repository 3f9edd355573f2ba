"""Saved folders load in transformers / peft with equal logits; checkpoints resume exactly."""

import json

import peft
import pytest
import torch
import transformers

import nbtune as nt
import nbtune.hub
import nbtune.peft
from nbtune.models import demo_model_dir

from helpers import small_session

IDS = torch.randint(0, 250, (2, 37), generator=torch.Generator().manual_seed(5))


def our_logits(session):
    session.model.eval()
    with torch.no_grad():
        out = session.model(IDS)
    session.model.train()
    return out


def trained(**changes):
    session = small_session(lr=1e-2, **changes)
    for _ in range(3):
        session.step()
    return session


def test_full_finetune_saves_an_hf_folder(tmp_path):
    session = trained(method="full")
    session.save(tmp_path / "out")
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in (tmp_path / "out").iterdir()}
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        torch.testing.assert_close(back(IDS).logits, our_logits(session), atol=1e-4, rtol=0)


def test_lora_saves_a_peft_adapter(tmp_path):
    session = trained(method="lora", lora_rank=4, lora_targets=("q_proj", "v_proj", "down_proj"))
    session.save(tmp_path / "adapter")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 4 and sorted(config["target_modules"]) == ["down_proj", "q_proj", "v_proj"]
    base = transformers.AutoModelForCausalLM.from_pretrained(demo_model_dir())
    adapted = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    with torch.no_grad():
        expected = adapted(IDS).logits
    plain = base.eval()
    assert (expected - our_logits(session)).abs().max() < 1e-4
    with adapted.disable_adapter(), torch.no_grad():  # the adapter really changes the output
        assert (plain(IDS).logits - expected).abs().max() > 1e-3


def test_a_merged_save_is_written_a_part_at_a_time(tmp_path, monkeypatch):
    """Past PART_BYTES the merged weights go into several files, as huggingface_hub cuts them
    (with the index transformers reads), each made and written before the next is made: the
    host holds one part, not the model. transformers and nbtune both load the parts."""
    import nbtune.models.hf as hf

    session = trained(method="qlora", lora_rank=4)
    made, saved, real = [], [], hf.save_file
    monkeypatch.setattr(hf, "PART_BYTES", 64 << 10)

    def save_file(tensors, path, metadata=None):
        saved.append((len(made), sum(t.numel() * t.element_size() for t in tensors.values())))
        return real(tensors, path, metadata=metadata)

    real_make = nbtune.peft.DenseWeights.make
    monkeypatch.setattr(hf, "save_file", save_file)
    monkeypatch.setattr(nbtune.peft.DenseWeights, "make",
                        lambda self, key: made.append(key) or real_make(self, key))
    folder = session.save(tmp_path / "merged", merge=True)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) == len(saved) > 3 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    largest = max(w.numel() * w.element_size() for w in nbtune.peft.merged_state_dict(session.model).values())
    assert all(size <= max(64 << 10, largest) for _, size in saved)
    # each file's weights were made just before it was written, not all up front
    assert [count for count, _ in saved] == sorted({count for count, _ in saved}) and saved[0][0] < len(made) / 3
    back = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        torch.testing.assert_close(back(IDS).logits, our_logits(session), atol=1e-4, rtol=0)
    again = nt.Session.from_pretrained(folder, device="cpu")
    with torch.no_grad():
        torch.testing.assert_close(again.model(IDS), our_logits(session), atol=1e-4, rtol=0)


@pytest.mark.slow
def test_lora_merge_saves_full_weights(tmp_path):
    session = trained(method="lora")
    session.save(tmp_path / "merged", merge=True)
    assert not (tmp_path / "merged" / "adapter_config.json").exists()
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    with torch.no_grad():
        torch.testing.assert_close(back(IDS).logits, our_logits(session), atol=1e-4, rtol=0)
    assert any("lora_A" in n for n, _ in session.model.named_parameters())  # session untouched


@pytest.mark.slow
def test_adapter_alone_is_refused_when_the_base_changed(tmp_path):
    session = trained(method="full")
    session.set(method="lora")
    session.step()
    with pytest.raises(ValueError, match="Save with merge=True"):
        session.save(tmp_path / "a")
    assert not (tmp_path / "a").exists()
    session.save(tmp_path / "a", merge=True)


@pytest.mark.slow
def test_interrupted_save_leaves_the_previous_one(tmp_path, monkeypatch):
    import nbtune.models.hf as hf

    session = trained(method="full")
    session.save(tmp_path / "out")
    before = (tmp_path / "out" / "model.safetensors").read_bytes()
    session.step()

    def crash(*args, **kwargs):
        raise KeyboardInterrupt("interrupted mid-write")

    monkeypatch.setattr(hf, "save_file", crash)
    with pytest.raises(KeyboardInterrupt):
        session.save(tmp_path / "out")
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temporary left behind


def run_split(tmp_path, steps, split, **changes):
    """Losses of `steps` steps, stopping at `split` to checkpoint and resume in a new session."""
    first = small_session(**changes)
    losses = [first.step().loss for _ in range(split)]
    first.save_checkpoint(tmp_path / "ckpt")
    torch.manual_seed(1234)  # a different RNG state: the checkpoint must restore it
    second = small_session(**changes)
    second.load_checkpoint(tmp_path / "ckpt")
    assert len(second.history) == split
    losses += [second.step().loss for _ in range(steps - split)]
    return losses, second


@pytest.mark.parametrize("changes", [
    dict(method="full", warmup_steps=3),
    dict(method="lora", lora_dropout=0.2, lora_rank=4),  # dropout exercises the RNG
])
@pytest.mark.slow
def test_resume_continues_exactly(tmp_path, changes):
    straight = small_session(**changes)
    expected = [straight.step().loss for _ in range(10)]
    resumed, session = run_split(tmp_path, 10, 5, **changes)
    assert resumed == expected
    for (name, a), (_, b) in zip(straight.model.named_parameters(), session.model.named_parameters()):
        assert torch.equal(a, b), name
    assert [r.step for r in session.history] == list(range(1, 11))


@pytest.mark.slow
def test_a_checkpoint_in_parts_resumes_exactly_and_writes_one_part_at_a_time(tmp_path, monkeypatch):
    """Written in files of at most PART_BYTES (here 64 KiB: the tiny model's weights and
    AdamW state take dozens), each passed to safetensors alone: on CUDA that is all the host
    holds at once. Resuming from the parts is exact."""
    import nbtune.checkpoint

    monkeypatch.setattr(nbtune.checkpoint, "PART_BYTES", 64 << 10)
    calls, real = [], nbtune.checkpoint.save_file
    monkeypatch.setattr(nbtune.checkpoint, "save_file",
                        lambda tensors, *a, **k: (calls.append(sum(t.numel() * t.element_size()
                                                                  for t in tensors.values())),
                                                  real(tensors, *a, **k))[1])
    straight = small_session()
    expected = [straight.step().loss for _ in range(6)]
    resumed, _ = run_split(tmp_path, 6, 3)
    assert resumed == expected
    names = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    weights = [n for n in names if n.startswith("weights-")]
    assert len(weights) > 3 and weights[0] == f"weights-00001-of-{len(weights):05d}.safetensors"
    largest = max(p.numel() * p.element_size() for p in straight.model.parameters())
    assert max(calls) <= max(64 << 10, largest) and sum(calls) > 10 * (64 << 10)
    (tmp_path / "ckpt" / weights[1]).unlink()  # a part gone: refused, nothing loaded
    with pytest.raises(FileNotFoundError, match=f"{weights[1]} missing"):
        small_session().load_checkpoint(tmp_path / "ckpt")


def test_resume_with_other_data_is_refused_and_changes_nothing(tmp_path):
    session = small_session()
    session.step()
    session.save_checkpoint(tmp_path / "ckpt")
    other = small_session(batch_size=2)
    other.data.train = other.train_examples[:10]
    with pytest.raises(ValueError, match="same data"):
        other.load_checkpoint(tmp_path / "ckpt")
    assert other.techniques.batch_size == 2 and other.history == []
    with pytest.raises(FileNotFoundError, match="not an nbtune training checkpoint"):
        other.load_checkpoint(tmp_path)


@pytest.mark.slow
def test_push_to_hub_uploads_the_saved_folder(tmp_path, monkeypatch):
    import huggingface_hub

    calls = []

    class FakeApi:
        def __init__(self, token=None):
            calls.append(("token", token))

        def create_repo(self, repo_id, private=None, exist_ok=False):
            calls.append(("create", repo_id, private, exist_ok))

        def upload_folder(self, folder_path, repo_id, revision=None, commit_message="",
                          allow_patterns=None):
            from pathlib import Path

            calls.append(("upload", repo_id, sorted(p.name for p in Path(folder_path).iterdir()),
                          allow_patterns))
            return "https://hub.example/commit/1"

    monkeypatch.setattr(huggingface_hub, "HfApi", FakeApi)
    session = trained(method="lora")
    assert session.push_to_hub("me/demo-adapter", private=True) == "https://hub.example/commit/1"
    assert calls[1] == ("create", "me/demo-adapter", True, True)
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(calls[2][2])
    assert calls[2][3] is None  # a saved folder as it is
    # a GGUF export: the file and its Modelfile, nothing else that lies in the folder
    assert session.push_to_hub("me/demo-gguf", format="gguf", quantization="q8_0").endswith("/1")
    assert calls[-1][2] == ["Modelfile", "model.gguf"] and calls[-1][3] == ["model.gguf", "Modelfile"]
    with pytest.raises(FileNotFoundError, match="not a saved model, adapter or GGUF export"):
        nt.hub.push_to_hub(tmp_path, "me/x")
