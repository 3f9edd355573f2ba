"""What is Phi-3 / Phi-4's own: LongRoPE's short and long factors (against transformers,
also through the KV cache across the original context), its config's older keys, and the
refusals of a config the decoder cannot run. The toggles, estimate and packing on it are in
``test_family_toggles.py``; its logits, gradients and LoRA paths in ``test_families.py`` and
``test_family_paths.py``."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

import nbtune as nt
from nbtune.models.config import ConfigError, ModelConfig

from test_families import PHI3, build


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("phi3")
    build(path, "phi3", tie=True)
    return path


def test_short_factors_within_the_original_context_and_long_ones_past_it(folder):
    """32 tokens (the original context here) use the short factors, 33 the long ones, as
    transformers chooses; both equal its logits, and the choice really moves them."""
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    ours = nt.load_model(folder).eval()
    ids = torch.randint(3, 101, (1, 33), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        for length in (32, 33):
            torch.testing.assert_close(ours(ids[:, :length]), ref(ids[:, :length]).logits, atol=1e-5, rtol=0)
        assert (ours(ids)[:, :32] - ours(ids[:, :32])).abs().max() > 1e-3


def test_cached_generation_across_the_original_context_follows_transformers(folder):
    """Token by token through the KV cache from 20 to 60 tokens: the factors switch once the
    positions pass 32 (keys cached before keep their short rotation, as in transformers'
    cache), and past the 40-token window the cache keeps only the keys the window reaches:
    each step's logits equal transformers' cached step."""
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    ours = nt.load_model(folder).eval()
    ids = torch.randint(3, 101, (1, 60), generator=torch.Generator().manual_seed(2))
    cache, theirs = ours.new_cache(), transformers.DynamicCache(config=ref.config)
    with torch.no_grad():
        mine = [ours(ids[:, :20], cache=cache)]
        expected = [ref(ids[:, :20], cache=theirs, use_cache=True).logits]
        for i in range(20, 60):
            mine.append(ours(ids[:, i:i + 1], cache=cache))
            expected.append(ref(ids[:, i:i + 1], cache=theirs, use_cache=True).logits)
    torch.testing.assert_close(torch.cat(mine, 1), torch.cat(expected, 1), atol=1e-5, rtol=0)
    assert all(keys.shape[-2] == 39 for keys in cache.keys)  # every Phi layer slides


def test_an_older_phi3_config_reads_as_the_new_one(folder):
    """Hub checkpoints written before transformers 5 (Phi-3.5, Phi-4-mini) give
    rope_scaling with "type" ("su" on the oldest), original_max_position_embeddings and
    partial_rotary_factor at the top; they read as transformers 5's rope_parameters."""
    hf = json.loads((folder / "config.json").read_text())
    new = ModelConfig.from_hf(hf)
    assert new.rope_scaling["rope_type"] == "longrope" and new.partial_rotary_factor == 0.75
    old = {k: v for k, v in hf.items() if k != "rope_parameters"}
    for kind in ("longrope", "su"):
        old.update(rope_theta=10000.0, rope_scaling={**PHI3["rope_scaling"], "type": kind})
        assert ModelConfig.from_hf(old) == new
    assert ModelConfig.from_hf(new.to_hf()) == new  # what nbtune writes reads back the same
    plain = {k: v for k, v in old.items() if k not in ("rope_scaling", "partial_rotary_factor")}
    phi4 = ModelConfig.from_hf({**plain, "rope_theta": 250000.0})  # Phi-4: no scaling, all rotated
    assert phi4.rope_scaling is None and phi4.rotary_dim == phi4.head_dim and phi4.fused_projections


@pytest.mark.parametrize("change, named", [
    ({"short_factor": [1.0] * 5}, "short_factor as a list of 6"),
    ({"long_factor": [1.0] * 5 + [-1.0]}, "long_factor as a list of 6"),
    ({"long_factor": "1.0"}, "long_factor"),
    ({"attention_factor": 0}, "attention_factor"),
])
def test_longrope_factors_that_do_not_fit_the_heads_are_refused(folder, change, named):
    hf = json.loads((folder / "config.json").read_text())
    hf["rope_parameters"] = {**hf["rope_parameters"], **change}
    with pytest.raises(ConfigError, match=named):
        ModelConfig.from_hf(hf, source="config.json")


def test_a_partial_rotary_factor_the_heads_cannot_take_is_refused(folder):
    hf = {k: v for k, v in json.loads((folder / "config.json").read_text()).items()
          if k != "rope_parameters"}
    for value in (0, 1.5, "0.75", 0.7):  # 0.7 of 16 dimensions is 11, odd
        with pytest.raises(ConfigError, match="partial_rotary_factor"):
            ModelConfig.from_hf({**hf, "partial_rotary_factor": value}, source="config.json")
    with pytest.raises(ConfigError, match="original_max_position_embeddings"):
        ModelConfig.from_hf({**hf, "original_max_position_embeddings": None,
                             "rope_scaling": PHI3["rope_scaling"]}, source="config.json")


def test_lora_targets_name_the_fused_projections(folder):
    """On Phi the default targets adapt qkv_proj and gate_up_proj (PEFT's names); naming only
    the separate ones, which Phi has not, is refused with what it has."""
    s = nt.Session(nt.load_model(folder), nt.models.tiny.byte_tokenizer(),
                   [{"instruction": "a", "output": "b"}] * 4,
                   techniques=nt.Techniques(method="lora", seq_len=128, batch_size=2), device="cpu")
    s.echo = False
    adapted = {n.split(".lora_A")[0].rpartition(".")[2] for n, _ in s.model.named_parameters() if "lora_A" in n}
    assert adapted == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}
    with pytest.raises(ValueError, match="qkv_proj"):
        s.set(lora_targets=("q_proj", "v_proj"))
    assert s.techniques.lora_targets == nt.Techniques().lora_targets  # nothing changed


def test_the_panel_offers_the_projections_phi_has(folder):
    """The targets list shows qkv_proj and gate_up_proj (not the q/k/v and gate/up Phi lacks),
    all selected as the default adapts them; choosing some sets exactly those."""
    from nbtune.ui.panel import Panel

    s = nt.Session(nt.load_model(folder), nt.models.tiny.byte_tokenizer(),
                   [{"instruction": "a", "output": "b"}] * 4,
                   techniques=nt.Techniques(method="lora", seq_len=128, batch_size=2), device="cpu")
    s.echo = False
    control = Panel(s).controls["lora_targets"]
    assert control.options == ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
    assert control.value == control.options
    control.value = ("qkv_proj", "down_proj")
    assert s.techniques.lora_targets == ("qkv_proj", "down_proj")


def test_a_longrope_original_context_its_logarithm_cannot_divide_by_is_refused(folder):
    hf = json.loads((folder / "config.json").read_text())
    for value in (1, 0.5, "4096", None):
        broken = {**hf, "rope_parameters": {**hf["rope_parameters"], "original_max_position_embeddings": value}}
        with pytest.raises(ConfigError, match="original_max_position_embeddings"):
            ModelConfig.from_hf(broken, source="config.json")
