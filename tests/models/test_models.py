"""The decoder matches transformers, and HF folders round-trip through nbtune."""

import json

import pytest
import torch
import transformers

import nbtune as nt
from nbtune.models import ModelConfig, Tokenizer, demo_model_dir
from nbtune.models.tiny import byte_tokenizer

from helpers import tiny_llama


@pytest.mark.parametrize("tie", [True, False])
def test_llama_logits_match_transformers(tmp_path, tie):
    ref = tiny_llama(tmp_path, tie)
    ours = nt.load_model(tmp_path).eval()
    ids = torch.randint(0, 97, (2, 23))
    with torch.no_grad():
        expected = ref(ids).logits
        got = ours(ids)
    assert got.shape == (2, 23, 97)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


def test_saved_folder_loads_in_transformers_with_equal_logits(tmp_path):
    tiny_llama(tmp_path / "src", tie=False)
    ours = nt.load_model(tmp_path / "src")
    with torch.no_grad():
        ours.model.layers[0].mlp.up_proj.weight.add_(0.01)  # differ from the source
    nt.save_model(ours, tmp_path / "out")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    ids = torch.randint(0, 97, (1, 17))
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, ours.eval()(ids), atol=1e-4, rtol=0)


def test_parameter_count_matches_config():
    config = ModelConfig.from_file(demo_model_dir() / "config.json")
    model = nt.load_model(demo_model_dir())
    assert sum(p.numel() for p in model.parameters()) == config.num_parameters
    assert config.num_parameters < 3_000_000  # "a few million at most"


def test_demo_model_is_deterministic(tmp_path):
    a = nt.load_model(demo_model_dir(tmp_path / "a"))
    b = nt.load_model(demo_model_dir(tmp_path / "b"))
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(pa, pb), name


def test_byte_tokenizer_round_trips_text():
    tok = byte_tokenizer()
    text = "Reverse: héllo, 12+7 = 19!\n"
    assert tok.decode(tok.encode(text)) == text
    assert len({tok.bos_id, tok.eos_id, tok.pad_id}) == 3


def test_tokenizer_reads_saved_folder(tmp_path):
    tok = byte_tokenizer()
    tok.save(tmp_path)
    back = Tokenizer.from_folder(tmp_path)
    assert (back.bos_id, back.eos_id, back.pad_id) == (tok.bos_id, tok.eos_id, tok.pad_id)
    assert back.encode("abc") == tok.encode("abc")


def test_shape_disagreement_is_named(tmp_path):
    tiny_llama(tmp_path, tie=True)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["intermediate_size"] = 128
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="mlp.*shape .* config and weights disagree"):
        nt.load_model(tmp_path)


def test_pickle_only_folder_is_refused(tmp_path):
    (tmp_path / "config.json").write_text((demo_model_dir() / "config.json").read_text())
    (tmp_path / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(FileNotFoundError, match="never loads pickle"):
        nt.load_model(tmp_path)


def test_unknown_model_type_is_named(tmp_path):
    cfg = json.loads((demo_model_dir() / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="'gpt2' is not supported"):
        nt.load_model(tmp_path)


def test_uncached_repo_id_offline_says_so():
    with pytest.raises(FileNotFoundError, match="not in the local Hugging Face cache"):
        nt.load_model("nobody-here/no-such-model")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_mlp_keeps_one_tensor_less_for_backward_with_the_same_gradients(dtype):
    """SiluMul against plain autograd written here: equal outputs and gradients to the bit,
    and one [tokens, intermediate] tensor fewer saved for backward (silu(gate) is recomputed)."""
    from torch.nn import functional as F

    from nbtune.models.decoder import MLP

    torch.manual_seed(0)
    config = ModelConfig(vocab_size=32, hidden_size=32, intermediate_size=96, num_layers=1,
                         num_heads=4, num_kv_heads=2, head_dim=8)
    mlp = MLP(config).to(dtype)
    x = torch.randn(2, 16, 32, dtype=dtype, requires_grad=True)

    def run(forward):
        mlp.zero_grad(set_to_none=True)
        x.grad = None
        saved = {}

        def pack(t):
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = forward(x)
        (out.float() ** 2).mean().backward()
        grads = [x.grad.clone()] + [p.grad.clone() for p in mlp.parameters()]
        return out.detach(), grads, sum(saved.values())

    ours = run(mlp)
    plain = run(lambda t: mlp.down_proj(F.silu(mlp.gate_proj(t)) * mlp.up_proj(t)))
    assert torch.equal(ours[0], plain[0])
    assert all(torch.equal(a, b) for a, b in zip(ours[1], plain[1]))
    assert plain[2] - ours[2] == 2 * 16 * 96 * x.element_size()
