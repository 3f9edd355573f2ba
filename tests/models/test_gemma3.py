"""What is Gemma 3's own: sliding and global layers, its config's refusals and older keys.
The toggles, estimate and packing on it are in ``test_family_toggles.py``."""

from __future__ import annotations

import json

import pytest
import torch

import nbtune as nt
from nbtune.models.config import ConfigError, ModelConfig

from test_families import build


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("gemma3")
    build(path, "gemma3", tie=True)
    return path


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


# ---- a multimodal checkpoint's language model (Gemma 3 4B, 12B, 27B) ---------------------

TEXT = dict(vocab_size=259, hidden_size=64, intermediate_size=144, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
            sliding_window=24, query_pre_attn_scalar=24, rms_norm_eps=1e-6,
            layer_types=["sliding_attention", "full_attention"],
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                             "full_attention": {"rope_type": "linear", "factor": 4.0,
                                                "rope_theta": 1000000.0}})
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
              image_size=28, patch_size=14)


@pytest.fixture(scope="module")
def multimodal(tmp_path_factory):
    """A tiny Gemma3ForConditionalGeneration as transformers saves it (the Hub's names:
    language_model.model.*, vision_tower.*), and the same weights under transformers' module
    names (model.language_model.*), as other tools write them."""
    import transformers
    from safetensors.torch import load_file, save_file

    from nbtune.models.tiny import byte_tokenizer

    config = transformers.Gemma3Config(text_config=dict(TEXT), vision_config=VISION, mm_tokens_per_image=4,
                                       boi_token_index=256, eoi_token_index=257, image_token_index=258)
    torch.manual_seed(4)
    ref = transformers.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():  # norms away from their initial values, so a missed one shows
        for name, p in ref.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 0.2)
    hub = tmp_path_factory.mktemp("gemma3-mm")
    ref.save_pretrained(hub)
    byte_tokenizer().save(hub)  # a tokenizer beside it, as a downloaded folder has
    weights = load_file(str(hub / "model.safetensors"))
    assert any(k.startswith("language_model.model.") for k in weights)
    assert any(k.startswith("vision_tower.") for k in weights)
    renamed = tmp_path_factory.mktemp("gemma3-mm-renamed")
    (renamed / "config.json").write_text((hub / "config.json").read_text())
    save_file({k.replace("language_model.model.", "model.language_model.")
               .replace("vision_tower.", "model.vision_tower."): v for k, v in weights.items()},
              str(renamed / "model.safetensors"))
    return ref, hub, renamed


def text_logits(model, ids):
    with torch.no_grad():
        out = model(input_ids=ids) if not isinstance(model, nt.models.decoder.CausalLM) else model(ids)
    return out.logits if hasattr(out, "logits") else out


def test_a_multimodal_checkpoints_language_model_loads_under_either_naming(multimodal):
    """Its text_config read as a gemma3_text model, its weights from under the language-model
    prefix (the vision tower and projector left unread): the logits of transformers'
    multimodal model on text."""
    ref, hub, renamed = multimodal
    ids = torch.randint(3, 250, (2, 48), generator=torch.Generator().manual_seed(1))
    expected = text_logits(ref, ids)
    for folder in (hub, renamed):
        ours = nt.load_model(folder).eval()
        assert ours.config.multimodal and ours.config.model_type == "gemma3_text"
        torch.testing.assert_close(text_logits(ours, ids), expected, atol=1e-5, rtol=0)


def test_a_multimodal_lora_run_exports_what_transformers_and_peft_load(multimodal, tmp_path):
    """LoRA on the language model: the adapter loads in PEFT on the multimodal model (its
    vision tower left without adapters) and back in nbtune; the merged save is the language
    model alone, which transformers loads as Gemma3ForCausalLM: the same logits each time."""
    import peft
    import transformers

    from nbtune.models.tiny import byte_tokenizer
    from nbtune.peft import LoRALinear

    _, hub, _ = multimodal
    s = nt.Session(nt.load_model(hub), byte_tokenizer(), [{"instruction": "a", "output": "b"}] * 4,
                   techniques=nt.Techniques(method="lora", seq_len=128, batch_size=2, lora_rank=4),
                   device="cpu")
    s.echo = False
    with torch.no_grad():
        for m in s.model.modules():
            if isinstance(m, LoRALinear):
                m.lora_B.weight.normal_(0.0, 0.05, generator=torch.Generator().manual_seed(3))
    ids = torch.randint(3, 250, (1, 40), generator=torch.Generator().manual_seed(2))
    s.model.eval()
    adapted = text_logits(s.model, ids)

    s.save(tmp_path / "adapter")
    base = transformers.Gemma3ForConditionalGeneration.from_pretrained(hub).eval()
    theirs = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    wrapped = [n for n, _ in theirs.named_modules() if n.endswith("q_proj.lora_A")]
    assert wrapped and not any("vision" in n for n in wrapped)
    torch.testing.assert_close(text_logits(theirs, ids), adapted, atol=1e-5, rtol=0)
    back = nt.Session.from_pretrained(tmp_path / "adapter", base=hub)
    torch.testing.assert_close(text_logits(back.model.eval(), ids), adapted, atol=1e-6, rtol=0)

    s.save(tmp_path / "merged", merge=True)
    saved = json.loads((tmp_path / "merged" / "config.json").read_text())
    assert saved["model_type"] == "gemma3_text" and "vision_config" not in saved
    text_only = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    assert type(text_only).__name__ == "Gemma3ForCausalLM"
    torch.testing.assert_close(text_logits(text_only, ids), adapted, atol=1e-5, rtol=0)


def test_the_published_gemma_3_4b_config_is_the_preset():
    """gemma-3-4b-pt's config.json gives only what differs from Gemma3TextConfig's defaults
    in its text_config, and its end-of-turn id beside it: read whole, it is the preset."""
    from nbtune.models.presets import preset_config

    published = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
                 "boi_token_index": 255999, "eoi_token_index": 256000, "eos_token_id": [1, 106],
                 "image_token_index": 262144, "mm_tokens_per_image": 256,
                 "text_config": {"hidden_size": 2560, "intermediate_size": 10240,
                                 "model_type": "gemma3_text", "num_hidden_layers": 34,
                                 "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                                 "sliding_window": 1024},
                 "vision_config": {"hidden_size": 1152, "model_type": "siglip_vision_model"}}
    config = ModelConfig.from_hf(published)
    assert config.multimodal and config.eos_token_id == [1, 106]
    assert config.replace(multimodal=False, eos_token_id=1) == preset_config("gemma-3-4b")
    for text in (None, {"model_type": "siglip_vision_model"}):
        with pytest.raises(ConfigError, match="text_config"):
            ModelConfig.from_hf({**published, "text_config": text})
