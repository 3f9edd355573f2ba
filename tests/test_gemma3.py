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


def test_a_multimodal_gemma3_checkpoint_is_refused_with_what_is_read_instead():
    hf = {"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"],
          "text_config": {"hidden_size": 64}}
    with pytest.raises(ConfigError, match="gemma3_text checkpoints"):
        ModelConfig.from_hf(hf, source="config.json")
