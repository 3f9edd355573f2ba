"""Each family's GGUF form as llama.cpp reads it: its architecture name, its tensor names,
the metadata beyond the common shape, and what llama.cpp assumes instead of reading.

llama.cpp fixes some of a family's switches in code (Gemma 3: every sixth layer global, the
sliding layers' RoPE base 10,000, the query scale; Qwen3-MoE: the top-k weights renormalized,
every layer sparse), so a model that differs there would run differently in llama.cpp than in
nbtune: ``check_writable`` refuses it before a byte is written, and the reader takes the same
values back.
"""

from __future__ import annotations

import math
import re

import numpy as np

from .config import ModelConfig
from .decoder import rope_attention_factor
from .gguf_layout import GGUFError

# nbtune's model_type -> the GGUF general.architecture it is written as, and back.
ARCH_OF = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
           "gemma3_text": "gemma3", "phi3": "phi3", "qwen3_moe": "qwen3moe"}
MODEL_TYPE_OF = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3_text",
                 "phi3": "phi3", "qwen3moe": "qwen3_moe"}
ARCHITECTURES = tuple(MODEL_TYPE_OF)

# llama.cpp's tensor names -> the decoder's (Hugging Face) names; "{}" is the layer.
_DENSE = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight", "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
LAYER_NAMES = {
    "llama": _DENSE, "qwen2": _DENSE, "qwen3": _DENSE,
    "gemma3": {**_DENSE, "post_attention_norm.weight": "post_attention_layernorm.weight",
               "ffn_norm.weight": "pre_feedforward_layernorm.weight",
               "post_ffw_norm.weight": "post_feedforward_layernorm.weight"},
    "phi3": {"attn_norm.weight": "input_layernorm.weight",
             "ffn_norm.weight": "post_attention_layernorm.weight",
             "attn_qkv.weight": "self_attn.qkv_proj.weight",
             "attn_output.weight": "self_attn.o_proj.weight",
             "ffn_up.weight": "mlp.gate_up_proj.weight",  # gate rows first, as llama.cpp splits it
             "ffn_down.weight": "mlp.down_proj.weight"},
    "qwen3moe": {**_DENSE, "ffn_gate_inp.weight": "mlp.gate.weight"},
}
TOP_NAMES = {"token_embd.weight": "model.embed_tokens.weight",
             "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}
# A MoE layer's experts, stacked in one [experts, rows, columns] tensor per projection.
EXPERT_NAMES = {"ffn_gate_exps.weight": "gate_proj", "ffn_up_exps.weight": "up_proj",
                "ffn_down_exps.weight": "down_proj"}
_EXPERT_KEY = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")
# Tensors that are not weights: read into the config (Phi-3's LongRoPE factors).
ROPE_FACTORS = ("rope_factors_long.weight", "rope_factors_short.weight")
# Gemma's RMSNorm scales by 1 + weight; llama.cpp's by the weight: its files hold weight + 1.
NORM_SHIFT = {"gemma3": 1.0}
GEMMA3_PATTERN, GEMMA3_LOCAL_THETA = 6, 10000.0  # llama.cpp's gemma3: fixed in its code
MAX_ROPE_FACTORS = 1 << 12  # LongRoPE factors (one per rotated frequency: head_dim / 2, 48 at Phi-4-mini)


def hf_name(arch: str, name: str) -> str | None:
    """The decoder's name for a GGUF tensor of ``arch`` (None: not a plain weight)."""
    if name in TOP_NAMES:
        return TOP_NAMES[name]
    block, _, rest = name.partition(".")
    layer, _, part = rest.partition(".")
    if block == "blk" and layer.isdigit() and part in LAYER_NAMES[arch]:
        return f"model.layers.{layer}.{LAYER_NAMES[arch][part]}"
    return None


def expert_keys(arch: str, name: str, experts: int) -> list[str] | None:
    """The per-expert weights a stacked GGUF expert tensor holds, in order (None: not one)."""
    block, _, rest = name.partition(".")
    layer, _, part = rest.partition(".")
    if arch != "qwen3moe" or block != "blk" or not layer.isdigit() or part not in EXPERT_NAMES:
        return None
    return [f"model.layers.{layer}.mlp.experts.{e}.{EXPERT_NAMES[part]}.weight" for e in range(experts)]


def gguf_groups(arch: str, keys: list[str]) -> tuple[list[tuple[str, list[str]]], list[str]]:
    """(GGUF name, the decoder weights it is made of) in write order, and the keys with no
    GGUF name; an expert projection's tensor stacks its layer's experts in expert order."""
    back = {hf: gg for gg, hf in TOP_NAMES.items()}
    layers = {hf: gg for gg, hf in LAYER_NAMES[arch].items()}
    stacked = {proj: gg for gg, proj in EXPERT_NAMES.items()}
    groups, stacks, missing = [], {}, []
    for key in keys:
        match = _EXPERT_KEY.fullmatch(key) if arch == "qwen3moe" else None
        if match:
            layer, expert, proj = match.groups()
            name = f"blk.{layer}.{stacked[proj]}"
            if name not in stacks:
                stacks[name] = {}
                groups.append((name, stacks[name]))
            stacks[name][int(expert)] = key
            continue
        parts = key.split(".", 3)
        if key in back:
            groups.append((back[key], [key]))
        elif len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[2].isdigit() \
                and parts[3] in layers:
            groups.append((f"blk.{parts[2]}.{layers[parts[3]]}", [key]))
        else:
            missing.append(key)
    return [(name, [part[e] for e in sorted(part)] if isinstance(part, dict) else part)
            for name, part in groups], missing


def check_writable(config: ModelConfig) -> str:
    """The GGUF architecture ``config`` is written as, or a GGUFError where llama.cpp would
    run the file differently from nbtune (what it fixes in code that this model changes)."""
    arch = ARCH_OF.get(config.model_type)
    if arch is None:
        raise GGUFError(f"{config.model_type} models are not written to GGUF by nbtune; save with "
                        "session.save(folder, merge=True) and convert with llama.cpp's "
                        "convert_hf_to_gguf.py.")

    def refuse(what: str, assumed) -> None:
        raise GGUFError(f"llama.cpp's {arch} assumes {assumed} in its code, but this model has "
                        f"{what}: the GGUF file would run differently there. Keep the "
                        "Hugging Face save (session.save(folder, merge=True)).")

    if arch == "gemma3":
        pattern = tuple("full_attention" if i % GEMMA3_PATTERN == GEMMA3_PATTERN - 1 else
                        "sliding_attention" for i in range(config.num_layers))
        if tuple(config.layer_types or ()) != pattern:
            refuse(f"layer_types {list(config.layer_types or ())}", "every sixth layer global")
        if float(config.rope_local_theta) != GEMMA3_LOCAL_THETA:
            refuse(f"rope_local_theta {config.rope_local_theta}", "10000 for the sliding layers' RoPE")
        if config.query_pre_attn_scalar != gemma3_query_scalar(config.num_layers, config.hidden_size,
                                                               config.num_heads, config.head_dim):
            refuse(f"query_pre_attn_scalar {config.query_pre_attn_scalar}",
                   "head_dim (hidden_size / heads for the 62-layer 27B)")
        if config.hidden_act != "gelu_pytorch_tanh":
            refuse(f"hidden_act {config.hidden_act!r}", "GELU (tanh)")
    if arch == "qwen3moe" and (not config.norm_topk_prob or config.decoder_sparse_step != 1
                               or config.mlp_only_layers):
        refuse(f"norm_topk_prob={config.norm_topk_prob}, decoder_sparse_step="
               f"{config.decoder_sparse_step}, mlp_only_layers={list(config.mlp_only_layers)}",
               "every layer sparse and each token's top-k weights renormalized")
    kind = (config.rope_scaling or {}).get("rope_type", (config.rope_scaling or {}).get("type"))
    allowed = {"llama": ("llama3", "linear"), "gemma3": ("linear",), "phi3": ("longrope",)}.get(arch, ("linear",))
    if kind not in (None, "default", *allowed):
        raise GGUFError(f"RoPE scaling {config.rope_scaling} is not written to GGUF by nbtune; "
                        "save with session.save(folder, merge=True) and convert with llama.cpp's "
                        "convert_hf_to_gguf.py.")
    if config.sliding_window and arch not in ("gemma3", "phi3"):
        raise GGUFError("Sliding-window attention is not written to GGUF by nbtune for "
                        f"{config.model_type}; save with session.save(folder, merge=True) and "
                        "convert with llama.cpp.")
    return arch


def gemma3_query_scalar(layers: int, hidden: int, heads: int, head_dim: int) -> float:
    """What llama.cpp divides Gemma 3's queries by the root of (fixed in its code, as the
    released checkpoints set query_pre_attn_scalar: 27B's 62 layers hidden / heads)."""
    return hidden // heads if layers == 62 and isinstance(hidden, int) else head_dim


def describe(writer, config: ModelConfig, arch: str) -> dict[str, np.ndarray]:
    """The family's metadata beyond the common shape; returns the extra (non-weight)
    tensors to write first (Phi-3's LongRoPE factors)."""
    if arch in ("gemma3", "phi3"):
        writer.add_sliding_window(int(config.sliding_window or 0))  # Phi-4: 0, as convert writes
    if arch == "qwen3moe":
        writer.add_expert_count(config.num_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    scaling = config.rope_scaling or {}
    if scaling.get("rope_type") != "longrope":
        return {}
    writer.add_rope_scaling_orig_ctx_len(int(scaling["original_max_position_embeddings"]))
    writer.add_rope_scaling_attn_factors(float(rope_attention_factor(config)))
    return {"rope_factors_long.weight": np.asarray(scaling["long_factor"], np.float32),
            "rope_factors_short.weight": np.asarray(scaling["short_factor"], np.float32)}


def config_fields(arch: str, get, file, path) -> dict:
    """The family's config.json keys (as a Hugging Face config names them) from a GGUF file's
    metadata; ``get(key, default)`` reads ``{arch}.{key}`` as a number."""
    if arch == "gemma3":
        layers, hidden, heads = get("block_count"), get("embedding_length"), get("attention.head_count")
        return {"sliding_window": get("attention.sliding_window", 4096) or None,
                "sliding_window_pattern": GEMMA3_PATTERN,
                "rope_local_base_freq": get("rope.freq_base_swa", GEMMA3_LOCAL_THETA),
                "query_pre_attn_scalar": gemma3_query_scalar(
                    layers, hidden, heads if isinstance(heads, int) and heads > 0 else 1,
                    get("attention.key_length", 256)),
                "rms_norm_eps": get("attention.layer_norm_rms_epsilon", 1e-6),
                "hidden_activation": "gelu_pytorch_tanh"}
    if arch == "qwen3moe":
        return {"num_experts": get("expert_count"), "num_experts_per_tok": get("expert_used_count"),
                "moe_intermediate_size": get("expert_feed_forward_length"), "norm_topk_prob": True,
                "decoder_sparse_step": 1, "mlp_only_layers": []}
    if arch != "phi3":
        return {}
    out = {"sliding_window": get("attention.sliding_window", 0) or None}
    hidden, heads, rotated = get("embedding_length"), get("attention.head_count"), get("rope.dimension_count")
    if all(isinstance(n, int) and n > 0 for n in (hidden, heads)) and rotated is not None:
        out["partial_rotary_factor"] = rotated / (hidden // heads or 1)  # (the config checks it)
    factors = {t.name: t for t in file.tensors if t.name in ROPE_FACTORS}
    if not factors:
        return out
    if len(factors) != 2 or any(t.tensor_type.name != "F32" or t.data.ndim != 1
                                or t.data.size > MAX_ROPE_FACTORS for t in factors.values()):
        raise GGUFError(f"{path}: Phi-3's LongRoPE needs rope_factors_long and rope_factors_short "
                        f"as one row of at most {MAX_ROPE_FACTORS} float32 each (one per rotated "
                        "frequency); the file is damaged.")
    original = get("rope.scaling.original_context_length")
    scaling = {"rope_type": "longrope", "original_max_position_embeddings": original,
               "long_factor": [float(x) for x in factors["rope_factors_long.weight"].data],
               "short_factor": [float(x) for x in factors["rope_factors_short.weight"].data]}
    stored, context = get("rope.scaling.attn_factor"), get("context_length", 2048)
    if stored is not None and isinstance(original, int) and original >= 2:
        factor = context / original
        default = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        if not math.isclose(stored, default, rel_tol=1e-6):
            scaling["attention_factor"] = float(stored)
    return {**out, "rope_scaling": scaling}


__all__ = ["ARCHITECTURES", "ARCH_OF", "MODEL_TYPE_OF", "check_writable", "config_fields",
           "describe", "expert_keys", "gguf_groups", "hf_name"]
