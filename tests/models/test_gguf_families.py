"""Gemma 3, Phi-3 / Phi-4 and Qwen3-MoE out to GGUF under llama.cpp's names and back.

Each tiny model is made by transformers' own classes, shaped as llama.cpp assumes each family
is (Gemma 3: every sixth layer global, the sliding layers' RoPE base 10,000, the query scaled
by head_dim; Qwen3-MoE: every layer sparse, top-k renormalized). The file's tensor names must
be ones llama.cpp's tables (the ``gguf`` package's ``MODEL_TENSORS``) list for the
architecture; nbtune reads it back with transformers' logits; where the ``kquants`` extra is
installed, llama.cpp itself runs the file and gives the same logits.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

import nbtune as nt
from nbtune.models.gguf import GGUFError, GGUFFile, config_from_gguf, load_gguf_model
from nbtune.models.tiny import byte_tokenizer

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

COMMON = dict(vocab_size=259, hidden_size=64, intermediate_size=144, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6)
FAMILIES = {
    # six layers: five sliding (window 8) and the sixth global, its RoPE scaled
    "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM, "gemma3", dict(
        num_hidden_layers=6, head_dim=16, query_pre_attn_scalar=16, sliding_window=8,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 4.0,
                                            "rope_theta": 1000000.0}})),
    # LongRoPE (the long factors past 32 tokens), a quarter of each head unrotated, a window
    "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM, "phi3", dict(
        num_hidden_layers=2, partial_rotary_factor=0.75, original_max_position_embeddings=32,
        sliding_window=40, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        rope_scaling={"type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(6)],
                      "long_factor": [2.0 + i for i in range(6)]})),
    # four experts, each token to two (renormalized), both layers sparse
    "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM, "qwen3moe", dict(
        num_hidden_layers=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, norm_topk_prob=True)),
}
SEQ = 40  # past Gemma's window and Phi's original context, within Phi's window (see below)


def build(folder, family, **changes):
    config_cls, model_cls, _, extra = FAMILIES[family]
    torch.manual_seed(3)
    ref = model_cls(config_cls(**{**COMMON, **copy.deepcopy(extra), **changes},
                               tie_word_embeddings=family == "gemma3")).eval()
    with torch.no_grad():  # norm weights away from their start, so a missed +1 shows
        for name, p in ref.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 0.2).add_(1.0)
    ref.save_pretrained(folder)
    return ref


def session_on(folder, tokenizer=None):
    s = nt.Session(nt.load_model(folder), tokenizer or byte_tokenizer(),
                   [{"instruction": "a", "output": "b"}] * 4,
                   techniques=nt.Techniques(seq_len=64), device="cpu")
    s.echo = False
    return s


def llama_cpp_names(arch: str, layers: int) -> set[str]:
    """Every tensor name llama.cpp's table lists for ``arch`` (gguf-py's constants)."""
    kind = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    names = set()
    for tensor in gguf.MODEL_TENSORS[kind]:
        template = gguf.TENSOR_NAMES[tensor]
        names |= {template.format(bid=i) + ".weight" for i in range(layers)}
        names.add(template + ".weight")
    return names


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_each_family_exports_under_llama_cpps_names_and_reads_back(tmp_path, family):
    ref = build(tmp_path / "hf", family)
    arch = FAMILIES[family][2]
    session = session_on(tmp_path / "hf")
    folder = session.save(tmp_path / "out", format="gguf", quantization="f32")
    file = GGUFFile(folder / "model.gguf")
    names = {t.name for t in file.tensors}
    assert file.meta["general.architecture"] == arch
    assert names <= llama_cpp_names(arch, ref.config.num_hidden_layers), names - llama_cpp_names(arch, 8)
    want = {"gemma3": {"blk.5.post_attention_norm.weight", "blk.5.post_ffw_norm.weight",
                       "blk.5.ffn_norm.weight", "blk.5.attn_q_norm.weight"},
            "phi3": {"blk.1.attn_qkv.weight", "blk.1.ffn_up.weight", "rope_factors_long.weight",
                     "rope_factors_short.weight"},
            "qwen3_moe": {"blk.1.ffn_gate_inp.weight", "blk.1.ffn_gate_exps.weight",
                          "blk.1.ffn_up_exps.weight", "blk.1.ffn_down_exps.weight"}}[family]
    assert want <= names
    ids = torch.randint(0, 259, (2, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = ref(ids).logits
        got = load_gguf_model(file).eval()(ids)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
    config, ours = config_from_gguf(file), session.model.config
    for field in ("layer_types", "sliding_window", "rope_local_theta", "query_pre_attn_scalar",
                  "partial_rotary_factor", "num_experts", "num_experts_per_tok",
                  "moe_intermediate_size", "norm_topk_prob"):
        assert getattr(config, field) == getattr(ours, field), field
    if family == "phi3":  # the LongRoPE factors come back from their tensors
        scaling = config.rope_scaling
        assert scaling["long_factor"] == ours.rope_scaling["long_factor"]
        assert scaling["original_max_position_embeddings"] == 32


def test_gemma3_norms_are_stored_as_llama_cpp_multiplies_by_them(tmp_path):
    """llama.cpp's RMSNorm multiplies by the stored weight; Gemma's by 1 + weight: the file
    holds 1 + the model's weight (as convert_hf_to_gguf.py writes it), the rest unchanged."""
    ref = build(tmp_path / "hf", "gemma3")
    folder = session_on(tmp_path / "hf").save(tmp_path / "out", format="gguf", quantization="f32")
    stored = {t.name: np.asarray(t.data) for t in GGUFFile(folder / "model.gguf").tensors}
    state = ref.state_dict()
    for gg, hf in (("blk.0.attn_norm.weight", "model.layers.0.input_layernorm.weight"),
                   ("blk.0.attn_k_norm.weight", "model.layers.0.self_attn.k_norm.weight"),
                   ("output_norm.weight", "model.norm.weight")):
        np.testing.assert_allclose(stored[gg], state[hf].numpy() + 1.0, rtol=0, atol=1e-6)
    np.testing.assert_array_equal(stored["blk.0.attn_q.weight"],
                                  state["model.layers.0.self_attn.q_proj.weight"].numpy())  # no permute


def test_moe_experts_are_stacked_in_expert_order_and_quantized_as_one(tmp_path):
    """ffn_*_exps holds [experts, rows, columns] (GGUF lists it innermost first), expert e's
    rows being experts.e's weight: checked by hand; q8_0 blocks the stack and nbtune reads it
    back within q8_0's rounding."""
    ref = build(tmp_path / "hf", "qwen3_moe")
    session = session_on(tmp_path / "hf")
    f32 = session.save(tmp_path / "f32", format="gguf", quantization="f32")
    tensor = next(t for t in GGUFFile(f32 / "model.gguf").tensors if t.name == "blk.1.ffn_down_exps.weight")
    assert tuple(int(n) for n in tensor.shape) == (32, 64, 4)
    experts = ref.model.layers[1].mlp.experts
    for e in range(4):
        theirs = experts.down_proj[e] if hasattr(experts, "down_proj") else experts[e].down_proj.weight
        np.testing.assert_array_equal(np.asarray(tensor.data)[e], theirs.detach().numpy())
    q8 = session.save(tmp_path / "q8", format="gguf", quantization="q8_0")
    types = {t.name: t.tensor_type.name for t in GGUFFile(q8 / "model.gguf").tensors}
    assert types["blk.0.ffn_up_exps.weight"] == types["blk.0.attn_q.weight"] == "Q8_0"
    ids = torch.randint(0, 259, (1, SEQ), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        err = (load_gguf_model(q8 / "model.gguf").eval()(ids) - ref(ids).logits).abs().max().item()
    assert 1e-6 < err < 5e-2


@pytest.mark.parametrize("family, changes, says", [
    ("gemma3", {"num_hidden_layers": 2, "layer_types": ["sliding_attention", "full_attention"]},
     "every sixth layer global"),
    ("gemma3", {"query_pre_attn_scalar": 24}, "head_dim"),
    ("qwen3_moe", {"mlp_only_layers": [1]}, "every layer sparse"),
    ("qwen3_moe", {"norm_topk_prob": False}, "renormalized"),
])
def test_a_model_llama_cpp_would_run_differently_is_refused_before_any_file(tmp_path, family, changes, says):
    build(tmp_path / "hf", family, **changes)
    with pytest.raises(GGUFError, match=f"llama.cpp.s .* assumes .*{says}.*Hugging Face save"):
        session_on(tmp_path / "hf").save(tmp_path / "out", format="gguf", quantization="f32")
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


class GgmlGelu(torch.nn.Module):
    """GELU (tanh) as ggml computes it on CPU: from a table indexed by the f16 input, giving f16."""

    def forward(self, x):
        y = torch.nn.functional.gelu(x.half().float(), approximate="tanh").half().float()
        return torch.where(x <= -10, 0.0, torch.where(x >= 10, x, y))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_llama_cpp_runs_each_familys_export_with_nbtunes_logits(tmp_path, family):
    """llama.cpp's own implementation of each architecture, on the file nbtune wrote: the
    same logits over 40 tokens (past Gemma's window of 8 and Phi's LongRoPE original context
    of 32: llama.cpp takes the long factors when its context exceeds it, as transformers does
    past it; within Phi's window, which llama.cpp switches off for phi3). The tokenizer is
    SmolLM2's: llama.cpp refuses a byte-level vocabulary without merges. llama.cpp's KV cache
    is made f32 (its f16 default rounds keys and values), and Gemma's reference GELU rounds
    its input and output to f16 as ggml's CPU GELU does (a lookup table): measured 9e-3
    without either, 6e-4 with both; a norm stored without its +1 gives errors over 1."""
    llama_cpp = pytest.importorskip("llama_cpp", reason="the kquants extra is not installed")
    from nbtune.models.gguf import gguf_tokenizer, smollm2_path

    try:
        tokenizer = gguf_tokenizer(smollm2_path())
    except FileNotFoundError as err:
        pytest.skip(str(err))
    ref = build(tmp_path / "hf", family, vocab_size=49152)
    folder = session_on(tmp_path / "hf", tokenizer).save(tmp_path / "out", format="gguf",
                                                         quantization="f32")
    ids = torch.randint(0, 49152, (SEQ,), generator=torch.Generator().manual_seed(4))
    model = llama_cpp.Llama(model_path=str(folder / "model.gguf"), n_ctx=64, logits_all=True,
                            verbose=False, seed=0, n_threads=2, type_k=0, type_v=0)  # 0: f32
    model.eval(ids.tolist())
    theirs = torch.tensor(np.asarray(model.scores[:SEQ]))
    del model
    if family == "gemma3":
        for layer in ref.model.layers:
            layer.mlp.act_fn = GgmlGelu()
    with torch.no_grad():
        ours = ref(ids[None]).logits[0]
    err = (ours - theirs).abs().max().item()
    print(f"{family}: max |logit difference| against llama.cpp {err:.1e}")
    assert err < 1e-3


def test_a_one_expert_moe_is_written_stacked_and_reads_back(tmp_path):
    """One expert is still a stack of one ([1, rows, columns]), as llama.cpp reads it."""
    ref = build(tmp_path / "hf", "qwen3_moe", num_experts=1, num_experts_per_tok=1)
    folder = session_on(tmp_path / "hf").save(tmp_path / "out", format="gguf", quantization="f32")
    tensor = next(t for t in GGUFFile(folder / "model.gguf").tensors if t.name == "blk.0.ffn_up_exps.weight")
    assert tuple(int(n) for n in tensor.shape) == (64, 32, 1)
    ids = torch.randint(0, 259, (1, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(load_gguf_model(folder / "model.gguf").eval()(ids), ref(ids).logits,
                                   atol=1e-4, rtol=0)
