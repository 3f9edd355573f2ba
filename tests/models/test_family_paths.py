"""Every LoRA path on every model family: merging, saving, exporting and QLoRA.

``test_families.py`` proves the dense forward of each family against transformers; the
LoRA, merge, export and QLoRA tests elsewhere run on the embedded default only (a tied
Llama without biases). Here, on tiny random checkpoints of each family (Llama 3.1 rope,
Qwen2 with q/k/v biases, Qwen3 with q/k norms, Mistral with a sliding window; tied and
untied embeddings), with non-zero adapters (random ``lora_B``):

* LoRA: the merged model (``session.set(method="full")``, the package's merge) gives the
  unmerged logits; ``session.save(merge=True)`` reloads in ``nbtune.load_model`` and in
  transformers with the same logits; the adapter folder loads in PEFT on the dense base
  with the same logits.
* QLoRA: the logits equal transformers' dense model whose weights are the NF4 weights
  dequantized by hand in this file (from the stored 4-bit codes and double-quantized
  scales, not through torchao) plus the adapters' update; merged and saved, it reloads
  with the same logits.
"""

from __future__ import annotations

import peft
import pytest
import torch
import transformers

import nbtune as nt
from nbtune.models.tiny import byte_tokenizer
from nbtune.peft import LoRALinear, is_nf4
from nbtune.techniques import DEFAULT_LORA_TARGETS, LORA_TARGETS

from test_families import SEQ, build

# llama 3, bias, q/k norm, window, Gemma, fused projections
FAMILIES = ["llama3.1-rope", "qwen2", "qwen3", "mistral", "gemma3", "phi3"]
FP32_ATOL = 1e-4  # as test_families: two implementations of the same fp32 maths
SAME_ATOL = 1e-5  # one implementation, the same weights regrouped (merged or not)
ADAPTER_EFFECT = 1e-2  # the adapters must move the logits far beyond both tolerances
RANK, ALPHA = 4, 8.0  # scaling 2: a scaling bug (alpha alone, sqrt(rank)) shows
# The 16 NormalFloat4 levels as torchao stores them (QLoRA, Dettmers et al. 2023, rounded).
NF4_LEVELS = torch.tensor([-1.0, -0.6962, -0.5251, -0.3949, -0.2844, -0.1848, -0.0911, 0.0,
                           0.0796, 0.1609, 0.2461, 0.3379, 0.4407, 0.5626, 0.7230, 1.0])

pytestmark = pytest.mark.usefixtures("one_thread")

CASES = [pytest.param(family, tie, id=f"{family}-{'tied' if tie else 'untied'}")
         for family in FAMILIES for tie in (False, True)]


def ids() -> torch.Tensor:
    return torch.randint(0, 101, (2, SEQ), generator=torch.Generator().manual_seed(7))


def logits(model) -> torch.Tensor:
    was_training = model.training
    model.eval()
    with torch.no_grad():
        out = model(ids())
        out = out.logits if hasattr(out, "logits") else out
    model.train(was_training)
    return out


def session_on(folder, method: str) -> nt.Session:
    """A session on a family checkpoint (no step is taken: the data only has to tokenize)."""
    rows = [{"instruction": "Say hi.", "output": "hi"}] * 4
    techniques = nt.Techniques(method=method, seq_len=64, lora_rank=RANK, lora_alpha=ALPHA,
                               lr=1e-3)
    quantize = LORA_TARGETS if method == "qlora" else ()
    model = nt.load_model(folder, quantize=quantize)
    session = nt.Session(model, byte_tokenizer(), rows, techniques=techniques, device="cpu")
    session.echo = False
    return session


def randomize_adapters(model) -> dict[str, LoRALinear]:
    """Random lora_B (fresh adapters add zero), so the adapters change the output."""
    generator = torch.Generator().manual_seed(2)
    found = {name: m for name, m in model.named_modules() if isinstance(m, LoRALinear)}
    fused = model.config.fused_projections  # Phi-3: qkv_proj and gate_up_proj, PEFT's names
    assert {name.rpartition(".")[2] for name in found} == set(DEFAULT_LORA_TARGETS) - (
        {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"} if fused else {"qkv_proj", "gate_up_proj"})
    with torch.no_grad():
        for m in found.values():
            m.lora_B.weight.copy_(torch.randn(m.lora_B.weight.shape, generator=generator) * 0.05)
    return found


def nf4_by_hand(weight) -> torch.Tensor:
    """An NF4 weight made dense from its stored parts, without torchao's dequantization.

    Two 4-bit codes per byte (high nibble first) index the NF4 levels; each block of
    ``block_size`` weights is scaled by its absmax, stored as int8 codes in blocks of
    ``scaler_block_size``, each block with its own factor, around one mean.
    """
    assert is_nf4(weight)
    assert torch.equal(weight.nf4.float(), NF4_LEVELS)
    codes = weight.quantized_data
    index = torch.stack([(codes >> 4).long(), (codes & 0xF).long()], dim=1).flatten()
    values = NF4_LEVELS[index].view(-1, weight.block_size)  # [blocks, block_size]
    scalers = weight.quantized_scalers.float().view(-1, weight.scaler_block_size)
    scales = (scalers / weight.quantization_factor.float()[:, None]).flatten() + weight.scaler_mean.float()
    assert scales.numel() == values.shape[0]
    return (values * scales[:, None]).reshape(weight.shape)


@pytest.mark.parametrize("family, tie", CASES)
def test_lora_merge_save_and_export_give_the_unmerged_logits(tmp_path, family, tie):
    ref = build(tmp_path / "base", family, tie)
    dense = logits(ref)
    session = session_on(tmp_path / "base", "lora")
    randomize_adapters(session.model)
    unmerged = logits(session.model)
    assert (unmerged - dense).abs().max() > ADAPTER_EFFECT

    # Saved merged: the package's save path, reloaded by nbtune and by transformers.
    session.save(tmp_path / "merged", merge=True)
    assert not (tmp_path / "merged" / "adapter_config.json").exists()
    ours = nt.load_model(tmp_path / "merged")
    assert ours.config.tie_word_embeddings == tie
    if tie:
        assert ours.lm_head.weight is ours.model.embed_tokens.weight
    torch.testing.assert_close(logits(ours), unmerged, atol=SAME_ATOL, rtol=0)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert type(theirs) is type(ref)
    torch.testing.assert_close(logits(theirs), unmerged, atol=FP32_ATOL, rtol=0)

    # Exported as a PEFT adapter: on the dense base, the same logits.
    session.save(tmp_path / "adapter")
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    adapted = peft.PeftModel.from_pretrained(base, tmp_path / "adapter")
    torch.testing.assert_close(logits(adapted), unmerged, atol=FP32_ATOL, rtol=0)

    # Merged in the live session (what set(method="full") does): the same logits.
    biases = {n: p.detach().clone() for n, p in session.model.named_parameters() if n.endswith(".bias")}
    session.set(method="full")
    assert not any("lora_" in n for n, _ in session.model.named_parameters())
    torch.testing.assert_close(logits(session.model), unmerged, atol=SAME_ATOL, rtol=0)
    merged_biases = {n: p for n, p in session.model.named_parameters() if n.endswith(".bias")}
    assert len(merged_biases) == len(biases) == (3 * 2 if family == "qwen2" else 0)
    for name, value in biases.items():
        assert torch.equal(merged_biases[name.replace(".base_layer", "")], value), name


@pytest.mark.parametrize("family, tie", CASES)
def test_qlora_equals_the_dense_model_on_the_dequantized_weights(tmp_path, family, tie):
    ref = build(tmp_path / "base", family, tie)
    dense = logits(ref)
    session = session_on(tmp_path / "base", "qlora")
    adapters = randomize_adapters(session.model)
    quantized = logits(session.model)
    assert (quantized - dense).abs().max() > ADAPTER_EFFECT

    # The reference: transformers' model with each adapted weight replaced by its NF4
    # codes dequantized here, plus scaling * B @ A; biases and everything else as saved.
    with torch.no_grad():
        for name, module in adapters.items():
            weight = module.base_layer.weight
            target = ref.get_submodule(name)
            by_hand = nf4_by_hand(weight)
            # NF4 is a 4-bit rounding of the original: close to it, but not equal.
            error = (by_hand - target.weight).abs().max() / target.weight.abs().max()
            assert 0 < error < 0.2, (name, float(error))
            update = module.lora_B.weight @ module.lora_A.weight * (ALPHA / RANK)
            target.weight.copy_(by_hand + update)
            if target.bias is not None:
                assert torch.equal(module.base_layer.bias, target.bias), name
    torch.testing.assert_close(quantized, logits(ref), atol=FP32_ATOL, rtol=0)

    # Saved merged (the NF4 base dequantized, the update folded in): the same logits.
    session.save(tmp_path / "merged", merge=True)
    ours = nt.load_model(tmp_path / "merged")
    assert not any(is_nf4(p) for p in ours.parameters())
    torch.testing.assert_close(logits(ours), quantized, atol=SAME_ATOL, rtol=0)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    torch.testing.assert_close(logits(theirs), quantized, atol=FP32_ATOL, rtol=0)
