"""One decoder, every family: logits equal to transformers' reference implementations."""

import copy

import pytest
import torch
import transformers

import nbtune as nt

# vocab_size: the byte tokenizer's 259 tokens (sessions on these models tokenize with it)
COMMON = dict(vocab_size=259, hidden_size=64, intermediate_size=144, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              rms_norm_eps=1e-6)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}

GEMMA3 = {"head_dim": 16, "sliding_window": 24, "query_pre_attn_scalar": 24,
          "layer_types": ["sliding_attention", "full_attention"],
          "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                              "full_attention": {"rope_type": "linear", "factor": 4.0,
                                                 "rope_theta": 1000000.0}}}

# Phi-3.5 / Phi-4-mini: LongRoPE (the long factors past 32 tokens), a quarter of each head
# unrotated, a window; q/k/v and gate/up fused
PHI3 = {"partial_rotary_factor": 0.75, "original_max_position_embeddings": 32, "sliding_window": 40,
        "rope_scaling": {"type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(6)],
                         "long_factor": [2.0 + i for i in range(6)]},
        "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}

# Qwen3-MoE: 4 experts, each token to 2 (renormalised), the second layer dense
QWEN3_MOE = {"head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
             "norm_topk_prob": True, "mlp_only_layers": [1], "router_aux_loss_coef": 0.01}

FAMILIES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
    "llama3.1-rope": (transformers.LlamaConfig, transformers.LlamaForCausalLM,
                      {"rope_parameters": LLAMA3_ROPE}),
    "llama-linear-rope": (transformers.LlamaConfig, transformers.LlamaForCausalLM,
                          {"rope_parameters": {"rope_type": "linear", "factor": 4.0,
                                               "rope_theta": 10000.0}}),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {}),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, {"head_dim": 32}),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, {"sliding_window": 24}),
    # Gemma 3: a sliding and a global layer, each with its own RoPE (the global one scaled),
    # (1 + weight) norms before and after attention and the MLP, q/k norms, the query scale,
    # GELU-tanh, the embedding scaled by sqrt(hidden)
    "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM, GEMMA3),
    "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM, PHI3),
    "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM, QWEN3_MOE),
}
SEQ = 48  # longer than Mistral's window and Llama 3.1's original context above


def build(folder, family, tie, dtype=torch.float32):
    config_cls, model_cls, extra = FAMILIES[family]
    torch.manual_seed(3)
    # a copy: transformers' config classes write into the dicts they are given
    ref = model_cls(config_cls(**COMMON, **copy.deepcopy(extra), tie_word_embeddings=tie)).eval()
    with torch.no_grad():  # random biases / norm weights, so a missed one shows
        for name, p in ref.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.normal_(0.0, 0.5 if name.endswith("bias") else 0.2).add_(0.0 if name.endswith("bias") else 1.0)
    ref.save_pretrained(folder)
    return ref.to(dtype)


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_logits_match_reference_fp32(tmp_path, family, tie):
    ref = build(tmp_path, family, tie)
    ours = nt.load_model(tmp_path).eval()
    assert ours.config.model_type == ref.config.model_type
    ids = torch.randint(0, 101, (2, SEQ))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), ref(ids).logits, atol=1e-4, rtol=0)


BF16_ATOL = 0.05  # both sides round every op to bf16 (8 bits of mantissa); logits are O(1)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_logits_match_reference_bf16(tmp_path, family):
    ref = build(tmp_path, family, tie=False, dtype=torch.bfloat16)
    ours = nt.load_model(tmp_path, dtype="bf16").eval()
    assert all(p.dtype == torch.bfloat16 for p in ours.parameters())
    ids = torch.randint(0, 101, (2, SEQ))
    with torch.no_grad():
        got, expected = ours(ids).float(), ref(ids).logits.float()
    # bf16's error grows with the values: Gemma's doubled norms give logits twice the others'
    torch.testing.assert_close(got, expected, atol=BF16_ATOL * max(1.0, expected.abs().max().item()), rtol=0)


def test_family_features_are_really_exercised(tmp_path):
    for family, check in (("qwen2", lambda m: m.model.layers[0].self_attn.q_proj.bias is not None),
                          ("qwen3", lambda m: m.model.layers[0].self_attn.q_norm is not None),
                          ("mistral", lambda m: m.config.sliding_window == 24 < SEQ),
                          ("llama3.1-rope", lambda m: m.config.rope_scaling["rope_type"] == "llama3"),
                          ("gemma3", lambda m: [layer.sliding for layer in m.model.layers] == [True, False]
                           and m.config.rope_local_theta == 10000.0 and m.config.embed_scale
                           and m.model.layers[0].sandwich and m.model.norm.plus_one
                           and m.model.layers[0].self_attn.scale == 24 ** -0.5
                           and m.model.layers[0].mlp.gelu),
                          ("phi3", lambda m: m.config.rotary_dim == 12 < m.config.head_dim
                           and m.config.rope_scaling["rope_type"] == "longrope"
                           and m.model.layers[0].self_attn.qkv_proj.out_features == 128
                           and m.model.layers[0].mlp.gate_up_proj.out_features == 288
                           and m.model.layers[0].sliding)):
        build(tmp_path / family, family, tie=False)
        assert check(nt.load_model(tmp_path / family)), family


def test_sliding_window_changes_the_output(tmp_path):
    build(tmp_path, "mistral", tie=False)
    windowed = nt.load_model(tmp_path).eval()
    unwindowed = nt.load_model(tmp_path).eval()
    unwindowed.config = unwindowed.config.replace(sliding_window=None)
    ids = torch.randint(0, 101, (1, SEQ))
    with torch.no_grad():
        a, b = windowed(ids), unwindowed(ids)
    torch.testing.assert_close(a[:, :24], b[:, :24])  # inside the window: identical
    assert (a[:, 30:] - b[:, 30:]).abs().max() > 1e-3  # beyond it: not


def test_unsupported_rope_scaling_is_named(tmp_path):
    import json

    build(tmp_path, "llama", tie=False)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="'yarn' is not supported"):
        nt.load_model(tmp_path)


def test_gemma3_generates_with_the_cache_as_it_scores_the_whole_sequence(tmp_path):
    """Token by token through the KV cache, past the sliding window: each new token's logits
    equal those of the whole sequence run at once (the window, both RoPE tables and the
    masks hold for cached keys too)."""
    from nbtune.models.decoder import KVCache

    build(tmp_path, "gemma3", tie=True)
    model = nt.load_model(tmp_path).eval()
    ids = torch.randint(0, 101, (1, SEQ))
    cache = KVCache(model.config.num_layers)
    with torch.no_grad():
        whole = model(ids)
        prefix = model(ids[:, :10], cache=cache)
        steps = [model(ids[:, i:i + 1], cache=cache) for i in range(10, SEQ)]
    torch.testing.assert_close(torch.cat([prefix, *steps], dim=1), whole, atol=1e-5, rtol=0)


def their_grad(theirs: dict, name: str) -> torch.Tensor:
    """transformers' gradient of our weight ``name``: the same name, or for an expert's
    projection its slice of transformers 5's fused [experts, 2 x width, hidden] gate_up_proj
    or [experts, hidden, width] down_proj."""
    if ".experts." not in name:
        return theirs[name].grad
    layer, _, rest = name.partition(".experts.")
    expert, projection, _ = rest.split(".")
    if projection == "down_proj":
        return theirs[f"{layer}.experts.down_proj"].grad[int(expert)]
    fused = theirs[f"{layer}.experts.gate_up_proj"].grad[int(expert)]
    return fused.chunk(2, dim=0)[projection == "up_proj"]


def _loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_gradients_match_reference_full_and_lora(tmp_path, family):
    """Backward too: every weight's gradient (full finetuning) and every adapter's (LoRA on
    every projection the family has, as PEFT wraps them) equal transformers' and PEFT's."""
    import peft

    from nbtune.peft import adapter_config, apply_lora, target_of
    from nbtune.techniques import LORA_TARGETS

    ref = build(tmp_path, family, tie=False)
    ours = nt.load_model(tmp_path)
    # not the pad token (0 here): transformers freezes its embedding row (padding_idx); nbtune
    # trains it, as torchtune does, since Phi's pad is its end-of-text, which rows contain
    ids = torch.randint(3, 101, (2, SEQ), generator=torch.Generator().manual_seed(5))
    _loss(ours(ids), ids).backward()
    _loss(ref(ids).logits, ids).backward()
    theirs = dict(ref.named_parameters())
    for name, p in ours.named_parameters():
        torch.testing.assert_close(p.grad, their_grad(theirs, name), atol=1e-5, rtol=1e-4, msg=name)

    ours, ref = nt.load_model(tmp_path), build(tmp_path / "again", family, tie=False)
    # every projection (a mixture of experts: attention, the projections PEFT adapts as
    # modules; its experts are PEFT's fused parameters, checked in test_qwen3_moe.py)
    targets = sorted({target_of(n) for n, m in ours.named_modules()
                      if isinstance(m, torch.nn.Linear) and target_of(n) in LORA_TARGETS})
    if ours.config.num_experts:
        targets = ["k_proj", "o_proj", "q_proj", "v_proj"]
    apply_lora(ours, tuple(targets), rank=4, alpha=8.0, dropout=0.0)
    ref = peft.get_peft_model(ref, peft.LoraConfig(r=4, lora_alpha=8.0,
                                                   target_modules=adapter_config(ours, None)["target_modules"]))
    adapters = {n: p for n, p in ours.named_parameters() if "lora_" in n}
    with torch.no_grad():  # the same adapters on both sides, B non-zero so A gets a gradient
        for name, p in ref.named_parameters():
            if "lora_" in name:
                mine = adapters[name.removeprefix("base_model.model.").replace(".default", "")]
                mine.normal_(0.0, 0.1, generator=torch.Generator().manual_seed(len(name)))
                p.copy_(mine)
    _loss(ours(ids), ids).backward()
    _loss(ref(ids).logits, ids).backward()
    found = 0
    for name, p in ref.named_parameters():
        if "lora_" in name:
            mine = adapters[name.removeprefix("base_model.model.").replace(".default", "")]
            torch.testing.assert_close(mine.grad, p.grad, atol=1e-5, rtol=1e-4, msg=name)
            found += 1
    assert found == len(adapters) == 2 * len(targets) * COMMON["num_hidden_layers"]


@pytest.mark.parametrize("family", ["gemma3", "mistral"])  # Phi's: test_phi3.py, against transformers
def test_a_sliding_layers_cache_keeps_only_its_window(tmp_path, family):
    """Generation's cache (``new_cache``): each sliding layer holds at most window - 1 keys
    however long the text, the full layers every key, and each step's logits still equal the
    whole sequence's, in one token at a time and in chunks of 5 past the window."""
    build(tmp_path, family, tie=True)
    model = nt.load_model(tmp_path).eval()
    ids = torch.randint(3, 101, (1, SEQ), generator=torch.Generator().manual_seed(6))
    window = model.config.sliding_window
    with torch.no_grad():
        whole = model(ids)
        for step in (1, 5):
            cache = model.new_cache()
            parts = [model(ids[:, :10], cache=cache)]
            parts += [model(ids[:, i:i + step], cache=cache) for i in range(10, SEQ, step)]
            torch.testing.assert_close(torch.cat(parts, dim=1), whole, atol=1e-5, rtol=0)
            for layer, keys in zip(model.model.layers, cache.keys):
                assert keys.shape[-2] == (min(SEQ, window - 1) if layer.sliding else SEQ)
            assert cache.length == SEQ


@pytest.mark.parametrize("checkpointed", [False, True])
def test_a_windows_mask_is_kept_once_for_backward_not_once_a_layer(tmp_path, checkpointed):
    """SDPA turns a boolean mask into a 0 / -inf bias in every layer's call and keeps that for
    backward: Mistral's two sliding layers would keep two [T, T] biases. The decoder makes the
    bias once a forward and shares it (one kept, the logits unchanged); with checkpointed
    layers only the layer inputs are kept, of which the boolean is the smaller form."""
    ref = build(tmp_path, "mistral", tie=False)
    ours = nt.load_model(tmp_path)
    for layer in ours.model.layers:
        layer.checkpointed = checkpointed
    ids = torch.randint(0, 259, (1, SEQ), generator=torch.Generator().manual_seed(0))
    kept = {}

    def pack(t):
        if t.shape[-2:] == (SEQ, SEQ):
            kept[t.untyped_storage().data_ptr()] = t.dtype
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = ours(ids)
    assert list(kept.values()) == [torch.bool if checkpointed else torch.float32]
    torch.testing.assert_close(logits, ref(ids).logits, atol=1e-4, rtol=0)
