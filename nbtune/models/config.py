"""Model configuration as plain data: one dataclass, family differences as fields."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path

from .. import files

# HF `model_type` values this decoder implements, and what each one switches on.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text", "phi3", "qwen3_moe")
ROPE_TYPES = ("default", "linear", "llama3", "longrope", None)
# The transformers class each model_type is saved as (config.json's "architectures").
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                 "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "gemma3_text": "Gemma3ForCausalLM", "phi3": "Phi3ForCausalLM",
                 "qwen3_moe": "Qwen3MoeForCausalLM"}
LAYER_TYPES = ("full_attention", "sliding_attention")
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
# What each rope_scaling type needs (transformers' rope initialisers read these).
ROPE_FACTORS = {"linear": ("factor",),
                "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                           "original_max_position_embeddings"),
                "longrope": ("original_max_position_embeddings",)}
# Experts over all sparse layers (DeepSeek-V3: 256 on 58, Qwen3-235B-A22B: 128 on 94).
MAX_EXPERT_LAYERS = 1 << 15
# Field -> the limit in files.LIMITS that bounds it (no real model is larger).
DIMENSION_LIMITS = {"vocab_size": "vocab_size", "hidden_size": "hidden_size",
                    "intermediate_size": "intermediate_size", "num_layers": "num_hidden_layers",
                    "num_heads": "num_attention_heads", "num_kv_heads": "num_key_value_heads",
                    "head_dim": "head_dim", "max_position_embeddings": "max_position_embeddings"}
# config.json keys without which the shapes are unknown (no sensible default exists).
REQUIRED_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                 "num_attention_heads")


class ConfigError(ValueError):
    """A config.json nbtune cannot build a model from, with which file and what to do."""


def _supported() -> str:
    return ", ".join(f"{t} ({ARCHITECTURES[t]})" for t in SUPPORTED_MODEL_TYPES)


def _model_type(hf: dict, source: str) -> str:
    """The model_type, read or (when absent) told by "architectures"; refuses other families."""
    archs = hf.get("architectures")
    archs = [a for a in archs if isinstance(a, str)] if isinstance(archs, list) else []
    model_type = hf.get("model_type")
    if model_type is None:
        by_class = {cls: t for t, cls in ARCHITECTURES.items()}
        known = [by_class[a] for a in archs if a in by_class]
        if archs and not known:
            raise ConfigError(
                f"{source}: architecture {', '.join(map(repr, archs))} is not supported; nbtune "
                f"implements {_supported()}. Pick a checkpoint of one of these families.")
        model_type = known[0] if known else "llama"  # older Llama conversions wrote neither
    if model_type not in SUPPORTED_MODEL_TYPES:
        named = f" (architecture {', '.join(map(repr, archs))})" if archs else ""
        raise ConfigError(
            f"{source}: model_type {model_type!r} is not supported{named}; nbtune implements "
            f"{_supported()}. Pick a checkpoint of one of these families.")
    heads = [a for a in archs if not a.endswith("ForCausalLM")]
    if archs and len(heads) == len(archs):
        raise ConfigError(
            f"{source}: architecture {', '.join(map(repr, heads))} is not a causal language model "
            f"head; nbtune finetunes {ARCHITECTURES[model_type]} checkpoints. Pick the base or "
            "instruct checkpoint of the model rather than a classification or other head.")
    return model_type


# Gemma3TextConfig's defaults: a multimodal checkpoint's text_config gives only what differs
# (gemma-3-4b's: its width, depth, window and RoPE scaling).
GEMMA3_TEXT_DEFAULTS = {"vocab_size": 262208, "num_attention_heads": 8, "num_key_value_heads": 4,
                        "head_dim": 256, "max_position_embeddings": 131072, "rms_norm_eps": 1e-6,
                        "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
                        "query_pre_attn_scalar": 256, "sliding_window": 4096,
                        "tie_word_embeddings": True, "bos_token_id": 2, "eos_token_id": 1,
                        "pad_token_id": 0}


def _language_model(hf: dict, source: str) -> dict:
    """The text_config of a multimodal Gemma 3 checkpoint (Gemma3ForConditionalGeneration),
    completed with transformers' defaults and the token ids given beside it, as a
    ``gemma3_text`` config.json: the language model nbtune trains."""
    text = hf.get("text_config")
    if not isinstance(text, dict) or text.get("model_type", "gemma3_text") != "gemma3_text":
        raise ConfigError(f"{source}: a multimodal Gemma 3 config needs a text_config object of "
                          f"model_type gemma3_text, but it holds {files.shown(text)}. Download "
                          "config.json again.")
    ids = {k: hf[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if hf.get(k) is not None}
    if hf.get("tie_word_embeddings") is False:
        ids["tie_word_embeddings"] = False
    return {**GEMMA3_TEXT_DEFAULTS, **ids, **text, "model_type": "gemma3_text",
            "architectures": ["Gemma3ForCausalLM"]}


def _gemma3(hf: dict, source: str) -> dict:
    """Gemma 3's switches from its config.json (transformers 5's per-layer-type
    ``rope_parameters``, or the older ``rope_theta`` / ``rope_local_base_freq`` /
    ``sliding_window_pattern``)."""
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if hf.get(key) is not None:
            raise ConfigError(f"{source} sets {key}={hf[key]!r}, which nbtune's decoder does not "
                              "implement (released Gemma 3 checkpoints leave it null).")
    if hf.get("use_bidirectional_attention") or hf.get("attention_bias"):
        raise ConfigError(f"{source}: Gemma 3 with bidirectional attention or attention biases is "
                          "not implemented; the released causal checkpoints use neither.")
    rope = hf.get("rope_parameters") or {}
    if isinstance(rope, dict) and "full_attention" in rope:
        full = dict(rope.get("full_attention") or {})
        local = dict(rope.get("sliding_attention") or {})
        theta, local_theta = full.pop("rope_theta", 1e6), local.get("rope_theta", 10000.0)
        scaling = full if full.get("rope_type", "default") != "default" else None
        if local.get("rope_type", "default") != "default":
            raise ConfigError(f"{source}: the sliding layers' RoPE is {local.get('rope_type')!r}; "
                              "nbtune implements Gemma 3's default RoPE there.")
    else:
        theta, local_theta = hf.get("rope_theta", 1e6), hf.get("rope_local_base_freq", 10000.0)
        scaling = hf.get("rope_scaling")
    layers, (cap, why) = hf["num_hidden_layers"], files.LIMITS["num_hidden_layers"]
    if layers > cap:  # before a list of that length is made
        raise ConfigError(f"{source}: num_hidden_layers is {layers}, larger than any real model's "
                          f"(limit {cap}: {why}); the config is damaged or crafted.")
    pattern = hf.get("sliding_window_pattern") or hf.get("_sliding_window_pattern") or 6
    if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern <= 0:
        raise ConfigError(f"{source}: sliding_window_pattern is {pattern!r}, but it must be a "
                          "positive whole number of layers.")
    types = hf.get("layer_types") or ["full_attention" if (i + 1) % pattern == 0 else
                                      "sliding_attention" for i in range(layers)]
    if not isinstance(types, list) or not all(isinstance(t, str) for t in types):
        raise ConfigError(f"{source}: layer_types must be a list of layer kinds.")
    return {"layer_types": tuple(types), "sliding_window": hf.get("sliding_window", 4096),
            "rope_theta": theta, "rope_scaling": scaling, "rope_local_theta": local_theta,
            "norm_plus_one": True, "embed_scale": True, "sandwich_norms": True, "qk_norm": True,
            "attention_bias": False, "query_pre_attn_scalar": hf.get("query_pre_attn_scalar", 256),
            "hidden_act": hf.get("hidden_activation") or "gelu_pytorch_tanh",
            "rms_norm_eps": hf.get("rms_norm_eps", 1e-6),
            "tie_word_embeddings": hf.get("tie_word_embeddings", True)}


def _phi3(hf: dict, source: str, scaling: dict | None) -> dict:
    """Phi-3 / Phi-4's switches: fused projections, partial rotary, LongRoPE (named "su" or
    "yarn" by older Phi-3 configs, read as transformers reads them)."""
    rope = hf.get("rope_parameters") if isinstance(hf.get("rope_parameters"), dict) else {}
    partial = hf.get("partial_rotary_factor", rope.get("partial_rotary_factor", 1.0))
    if isinstance(scaling, dict):
        kind = scaling.get("rope_type", scaling.get("type"))
        scaling = {k: v for k, v in scaling.items() if k not in ("type", "rope_theta", "partial_rotary_factor")}
        scaling["rope_type"] = "longrope" if kind in ("su", "yarn") else kind
        if scaling["rope_type"] == "longrope":
            scaling.setdefault("original_max_position_embeddings", hf.get("original_max_position_embeddings"))
    return {"fused_projections": True, "partial_rotary_factor": partial, "rope_scaling": scaling,
            "sliding_window": hf.get("sliding_window"), "hidden_act": hf.get("hidden_act", "silu"),
            "attention_bias": False}


def _qwen3_moe(hf: dict, source: str) -> dict:
    """Qwen3-MoE's switches: the experts (``num_experts``, or transformers 5's
    ``num_local_experts``), how many each token takes, their width, which layers have them."""
    experts = hf.get("num_experts", hf.get("num_local_experts"))
    for key, value in (("num_experts", experts), ("num_experts_per_tok", hf.get("num_experts_per_tok")),
                       ("moe_intermediate_size", hf.get("moe_intermediate_size"))):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ConfigError(f"{source}: a qwen3_moe config needs {key} as a positive whole number, "
                              f"but it is {files.shown(value)}. Download config.json again.")
    only = hf.get("mlp_only_layers") or []
    if not isinstance(only, list) or len(only) > files.LIMITS["num_hidden_layers"][0] or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in only):
        raise ConfigError(f"{source}: mlp_only_layers is {files.shown(only)}, not a list of layer numbers.")
    if hf.get("use_sliding_window"):
        raise ConfigError(f"{source}: qwen3_moe with use_sliding_window=true is not supported; the "
                          "released Qwen checkpoints leave it off.")
    return {"num_experts": experts, "num_experts_per_tok": hf.get("num_experts_per_tok"),
            "moe_intermediate_size": hf.get("moe_intermediate_size"),
            "norm_topk_prob": bool(hf.get("norm_topk_prob", False)),
            "decoder_sparse_step": hf.get("decoder_sparse_step", 1), "mlp_only_layers": tuple(only),
            "router_aux_loss_coef": hf.get("router_aux_loss_coef", 0.001), "qk_norm": True,
            "attention_bias": bool(hf.get("attention_bias", False))}


def _check_fields(hf: dict, source: str) -> None:
    missing = [k for k in REQUIRED_KEYS if hf.get(k) is None]
    if missing:
        raise ConfigError(
            f"{source} is incomplete: it lacks {', '.join(missing)}, which nbtune needs to know "
            "the model's shape. Download the checkpoint's config.json again (or copy it whole "
            "from the model's Hub page).")
    for key in (*REQUIRED_KEYS, "max_position_embeddings", "num_key_value_heads", "head_dim"):
        value = hf.get(key)
        if value is None or (value == 0 and key in ("num_key_value_heads", "head_dim")):
            continue  # absent (or 0, which transformers reads as absent): the default applies
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ConfigError(f"{source}: {key} is {value!r}, but it must be a positive whole "
                              "number. Fix it in config.json or download the file again.")


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a decoder-only transformer (Llama, Qwen2, Qwen3, Mistral, Gemma 3, Phi-3 families).

    Made from a transformers ``config.json`` (``from_file``, ``from_hf``) and checked whole: a
    family nbtune does not implement, a size no real model has or heads that do not divide are
    refused (``ValueError``) before anything is allocated.

    Attributes:
        vocab_size: Tokens in the vocabulary (rows of the embedding and the head).
        hidden_size: The width of the residual stream.
        intermediate_size: The width of the MLP's gate and up projections.
        num_layers: Decoder layers.
        num_heads: Query heads.
        num_kv_heads: Key and value heads (grouped-query attention when fewer).
        head_dim: Each head's width.
        model_type: The family: "llama", "mistral", "qwen2", "qwen3", "gemma3_text", "phi3" or
            "qwen3_moe".
        rms_norm_eps: RMSNorm's epsilon.
        rope_theta: The rotary embedding's base.
        rope_scaling: Llama 3.1's, linear or LongRoPE (Phi-3.5, Phi-4-mini) scaling, as
            config.json gives it.
        max_position_embeddings: The model's context length.
        tie_word_embeddings: The head shares the embedding's weight.
        attention_bias: q/k/v projections carry a bias (Qwen2).
        qk_norm: RMSNorm on queries and keys per head (Qwen3).
        sliding_window: Attend to the last N tokens only (Mistral v0.1; Gemma 3's sliding
            layers).
        layer_types: Each layer's "sliding_attention" or "full_attention" (Gemma 3); None:
            every layer slides when ``sliding_window`` is set.
        rope_local_theta: The RoPE base of the sliding layers (Gemma 3), without scaling.
        norm_plus_one: RMSNorm scales by 1 + weight, after normalising in fp32 (Gemma).
        embed_scale: The embedding is multiplied by sqrt(hidden_size) (Gemma).
        sandwich_norms: Norms before and after attention and the MLP, four a layer (Gemma 3).
        query_pre_attn_scalar: Attention scores scaled by its inverse square root rather than
            the head size's (Gemma 3).
        hidden_act: The MLP's gate activation: "silu" or "gelu_pytorch_tanh" (Gemma).
        fused_projections: Queries, keys and values come from one ``qkv_proj``, the MLP's gate
            and up from one ``gate_up_proj`` (Phi-3); LoRA adapts each fused weight whole.
        partial_rotary_factor: The share of each head's width RoPE rotates (Phi-4-mini: 0.75).
        num_experts: Experts in each sparse layer (Qwen3-MoE); 0: a dense model.
        num_experts_per_tok: The experts each token is routed to (top-k of the router).
        moe_intermediate_size: Each expert's MLP width.
        norm_topk_prob: The chosen experts' router probabilities are renormalised to sum to 1.
        decoder_sparse_step: Every this-many-th layer has experts (1: all of them).
        mlp_only_layers: Layers with a dense MLP whatever ``decoder_sparse_step`` says.
        router_aux_loss_coef: The weight of the load-balancing loss added in training.
        multimodal: The language model of a multimodal checkpoint (Gemma 3 4B, 12B, 27B), read
            from under its prefix; the vision tower is left unread, and a merged save writes
            the language model as a text-only checkpoint.
        bos_token_id: The beginning-of-sequence token.
        eos_token_id: The end-of-sequence token or tokens.
        pad_token_id: The padding token.
        extra: The config.json's other keys, kept for writing it back.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    model_type: str = "llama"
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    qk_norm: bool = False  # RMSNorm on queries and keys per head (Qwen3)
    sliding_window: int | None = None  # attend to the last N tokens only (Mistral v0.1)
    # Gemma 3's switches: which layers attend within the window (None: all of them when
    # sliding_window is set), their RoPE base, RMSNorm scaled by 1 + weight, the embedding
    # scaled by sqrt(hidden), norms before and after attention and the MLP, the query scale,
    # and the MLP's activation.
    layer_types: tuple[str, ...] | None = None
    rope_local_theta: float | None = None
    norm_plus_one: bool = False
    embed_scale: bool = False
    sandwich_norms: bool = False
    query_pre_attn_scalar: float | None = None
    hidden_act: str = "silu"
    # Phi-3's switches: q/k/v in one qkv_proj and gate/up in one gate_up_proj (PEFT's names
    # for its adapters), and RoPE on the first part of each head only.
    fused_projections: bool = False
    partial_rotary_factor: float = 1.0
    # The language model of a multimodal checkpoint (Gemma 3 4B-27B): its weights are read
    # from under language_model prefixes and written back there by adapters; the vision tower
    # is not read. A merged save writes the language model alone.
    multimodal: bool = False
    # Qwen3-MoE's switches: each token's feed-forward is the weighted sum of the
    # num_experts_per_tok experts (of num_experts, each a SwiGLU MLP moe_intermediate_size
    # wide) its router scores highest, on every decoder_sparse_step-th layer but mlp_only_layers.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    router_aux_loss_coef: float = 0.0
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    extra: dict = field(default_factory=dict, compare=False)  # HF keys kept for round trips

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type {self.model_type!r} is not supported; nbtune implements "
                f"{', '.join(SUPPORTED_MODEL_TYPES)}. Pick a checkpoint of one of these families."
            )
        for name, limit in DIMENSION_LIMITS.items():  # before any size is computed from them
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:  # config.json's names
                raise ValueError(f"{limit} is {value!r}, but it must be a positive whole number.")
            cap, why = files.LIMITS[limit]
            if value > cap:
                raise ValueError(f"{limit} is {value}, larger than any real model's (limit {cap}: "
                                 f"{why}); the config is damaged or crafted.")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads}) for grouped-query attention."
            )
        for name in ("rope_theta", "rms_norm_eps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not math.isfinite(value) or value <= 0:
                raise ValueError(f"{name} is {value!r}, but it must be a positive finite number.")
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_layers or set(self.layer_types) - set(LAYER_TYPES):
                raise ValueError(f"layer_types must give each of the {self.num_layers} layers one of "
                                 f"{', '.join(LAYER_TYPES)}; got {list(self.layer_types)!r}.")
            if "sliding_attention" in self.layer_types and not self.sliding_window:
                raise ValueError("layer_types has sliding layers but sliding_window is not set.")
        if self.sliding_window is not None and (isinstance(self.sliding_window, bool)
                                                or not isinstance(self.sliding_window, int)
                                                or self.sliding_window <= 0):
            raise ValueError(f"sliding_window is {self.sliding_window!r}, but it must be a positive "
                             "whole number of tokens.")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"hidden_act {self.hidden_act!r} is not supported; nbtune implements "
                             f"{', '.join(ACTIVATIONS)}.")
        for name in ("rope_local_theta", "query_pre_attn_scalar"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not math.isfinite(value) or value <= 0):
                raise ValueError(f"{name} is {value!r}, but it must be a positive finite number.")
        if self.num_experts:
            self._check_experts()
        value = self.partial_rotary_factor
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1 \
                or self.rotary_dim < 2 or self.rotary_dim % 2:
            raise ValueError(f"partial_rotary_factor is {value!r}, but it must be in (0, 1] and "
                             f"rotate an even number of the head's {self.head_dim} dimensions.")
        if self.rope_scaling is not None:
            if not isinstance(self.rope_scaling, dict):
                raise ValueError(f"rope_scaling is {self.rope_scaling!r}, not a mapping of settings.")
            kind = self.rope_scaling.get("rope_type", self.rope_scaling.get("type"))
            if kind not in ROPE_TYPES:
                raise ValueError(
                    f"rope_scaling type {kind!r} is not supported; nbtune implements "
                    f"{', '.join(t for t in ROPE_TYPES if t)}.")
            for name in ROPE_FACTORS.get(kind, ()):  # refused now, not at the first step
                value = self.rope_scaling.get(name)
                if isinstance(value, bool) or not isinstance(value, (int, float)) \
                        or not math.isfinite(value) or value <= 0:
                    raise ValueError(f"rope_scaling ({kind}) needs {name} as a positive number, "
                                     f"but it is {value!r}.")
            if kind == "longrope":
                self._check_longrope()

    def _check_experts(self) -> None:
        """The experts' counts and width: whole numbers a real model could have, top-k of them."""
        cap, why = files.LIMITS["num_experts"]
        for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} is {value!r}, but it must be a positive whole number.")
        if self.num_experts > cap:
            raise ValueError(f"num_experts is {self.num_experts}, more than any real model's (limit "
                             f"{cap}: {why}); the config is damaged or crafted.")
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(f"num_experts_per_tok ({self.num_experts_per_tok}) is more than the "
                             f"{self.num_experts} experts.")
        sparse = sum(self.sparse(i) for i in range(self.num_layers))
        if self.num_experts * sparse > MAX_EXPERT_LAYERS:  # each one a module to build
            raise ValueError(f"{self.num_experts} experts on each of {sparse} layers is more than any "
                             f"real model has (limit {MAX_EXPERT_LAYERS}: Qwen3-235B-A22B has 128 on 94); "
                             "the config is damaged or crafted.")
        if self.moe_intermediate_size > files.LIMITS["intermediate_size"][0]:
            raise ValueError(f"moe_intermediate_size is {self.moe_intermediate_size}, larger than any "
                             "real model's; the config is damaged or crafted.")
        value = self.router_aux_loss_coef
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                or value < 0:
            raise ValueError(f"router_aux_loss_coef is {value!r}, but it must be a number >= 0.")

    def sparse(self, layer: int) -> bool:
        """Whether a decoder layer routes to experts (else it has a dense MLP).

        Args:
            layer: The layer's index, from 0.

        Returns:
            True for a mixture-of-experts layer.
        """
        return bool(self.num_experts) and layer not in self.mlp_only_layers \
            and (layer + 1) % self.decoder_sparse_step == 0

    def _check_longrope(self) -> None:
        """LongRoPE's short and long factors: one positive number per rotated frequency; its
        original context a whole number of at least 2 (its logarithm divides)."""
        original = self.rope_scaling.get("original_max_position_embeddings")
        if isinstance(original, bool) or not isinstance(original, int) or original < 2:
            raise ValueError(f"rope_scaling (longrope) needs original_max_position_embeddings as a "
                             f"whole number of tokens, at least 2; got {files.shown(original)}.")
        half = self.rotary_dim // 2
        for name in ("short_factor", "long_factor"):
            value = self.rope_scaling.get(name)
            if not isinstance(value, list) or len(value) != half or not all(
                    not isinstance(x, bool) and isinstance(x, (int, float)) and math.isfinite(x) and x > 0
                    for x in value):
                raise ValueError(f"rope_scaling (longrope) needs {name} as a list of {half} positive "
                                 f"numbers (one per rotated frequency); got {files.shown(value)}.")
        for name in ("factor", "attention_factor"):
            value = self.rope_scaling.get(name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not math.isfinite(value) or value <= 0):
                raise ValueError(f"rope_scaling (longrope) {name} is {value!r}, but it must be a "
                                 "positive number.")

    @property
    def rotary_dim(self) -> int:
        """The dimensions of each head RoPE rotates (all of them unless ``partial_rotary_factor``)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def num_parameters(self) -> int:
        """Parameter count implied by the shapes (tied embeddings counted once)."""
        d, kv = self.hidden_size, self.num_kv_heads * self.head_dim
        q = self.num_heads * self.head_dim
        attn = d * q + 2 * d * kv + q * d
        if self.attention_bias:
            attn += q + 2 * kv
        if self.qk_norm:
            attn += 2 * self.head_dim
        layer = attn + (4 if self.sandwich_norms else 2) * d
        experts = self.num_experts * (3 * d * self.moe_intermediate_size + d)  # and the router's row
        feed_forward = sum(experts if self.sparse(i) else 3 * d * self.intermediate_size
                           for i in range(self.num_layers))
        head = 0 if self.tie_word_embeddings else self.vocab_size * d
        return self.vocab_size * d + self.num_layers * layer + feed_forward + d + head

    @classmethod
    def from_hf(cls, hf: dict, source: str = "config.json") -> "ModelConfig":
        """Read a transformers `config.json` dict; ``source`` names it in errors.

        Args:
            hf: The parsed config.json.
            source: Its name in errors.

        Returns:
            The ``ModelConfig``.

        Raises:
            ConfigError: A field is missing, malformed, or of a family nbtune does not implement.
        """
        if not isinstance(hf, dict):
            raise ConfigError(f"{source} must hold a JSON object of model settings, not a "
                              f"{type(hf).__name__}. Download the checkpoint's config.json again.")
        if hf.get("model_type") == "gemma3":  # multimodal: its language model, whose weights
            text = cls.from_hf(_language_model(hf, source), source)  # sit under a prefix
            return dataclasses.replace(text, multimodal=True)
        model_type = _model_type(hf, source)
        _check_fields(hf, source)
        heads = hf["num_attention_heads"]
        if hf.get("mlp_bias"):
            raise ConfigError(f"{source} sets mlp_bias=true, which nbtune's decoder does not "
                              "implement. Pick a checkpoint of a supported family without it.")
        if not hf.get("head_dim") and hf["hidden_size"] % heads:
            raise ConfigError(f"{source}: hidden_size ({hf['hidden_size']}) is not a multiple of "
                              f"num_attention_heads ({heads}) and no head_dim is given, so the "
                              "head size is unknown. Add head_dim, or download config.json again.")
        # transformers >= 5 writes `rope_parameters`; older checkpoints write rope_theta / rope_scaling.
        rope = dict(hf.get("rope_parameters") or {})
        rope_theta = rope.pop("rope_theta", hf.get("rope_theta", 10000.0))
        rope_scaling = rope if rope.get("rope_type", "default") != "default" else hf.get("rope_scaling")
        known = {
            "vocab_size": hf["vocab_size"],
            "hidden_size": hf["hidden_size"],
            "intermediate_size": hf["intermediate_size"],
            "num_layers": hf["num_hidden_layers"],
            "num_heads": heads,
            "num_kv_heads": hf.get("num_key_value_heads") or heads,
            "head_dim": hf.get("head_dim") or hf["hidden_size"] // heads,
            "model_type": model_type,
            "rms_norm_eps": hf.get("rms_norm_eps", 1e-5),
            "rope_theta": rope_theta,
            "rope_scaling": rope_scaling,
            "max_position_embeddings": hf.get("max_position_embeddings", 2048),
            "tie_word_embeddings": hf.get("tie_word_embeddings", False),
            "attention_bias": hf.get("attention_bias", model_type == "qwen2"),
            "qk_norm": model_type == "qwen3",
            "bos_token_id": hf.get("bos_token_id"),
            "eos_token_id": hf.get("eos_token_id"),
            "pad_token_id": hf.get("pad_token_id"),
        }
        if model_type in ("qwen2", "qwen3") and hf.get("use_sliding_window"):
            raise ConfigError(f"{source}: {model_type} with use_sliding_window=true is not "
                              "supported; the released Qwen checkpoints leave it off.")
        if model_type == "mistral":
            known["sliding_window"] = hf.get("sliding_window")
        if model_type == "gemma3_text":
            known.update(_gemma3(hf, source))
        if model_type == "phi3":
            known.update(_phi3(hf, source, rope_scaling))
        if model_type == "qwen3_moe":
            known.update(_qwen3_moe(hf, source))
        try:
            return cls(**known, extra=dict(hf))
        except ValueError as err:  # the checks of __post_init__, told which file they are about
            raise ConfigError(f"{source}: {err}") from err

    @classmethod
    def from_file(cls, path: str | Path) -> "ModelConfig":
        """Read a transformers `config.json` file; errors name the file.

        Args:
            path: A config.json or the folder holding one.

        Returns:
            The ``ModelConfig``.

        Raises:
            ConfigError: The file is missing, too large, not JSON, or its fields are refused.
        """
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.exists():
            raise FileNotFoundError(f"{path}: no such file. A model folder needs its config.json "
                                    "beside the *.safetensors weights; copy or download it too.")
        try:
            hf = files.read_json(path, "config.json", "config_bytes", kind=None,
                                 fix="download the checkpoint's config.json again")
        except files.FileRefused as err:
            raise ConfigError(str(err)) from None
        return cls.from_hf(hf, source=str(path))

    def to_hf(self) -> dict:
        """A transformers `config.json` dict; unknown keys read from the original are kept.

        Returns:
            The dict, as config.json holds it.
        """
        out = dict(self.extra)
        out.update({
            "architectures": [ARCHITECTURES[self.model_type]],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
        })
        if self.model_type == "mistral":
            out["sliding_window"] = self.sliding_window
        if self.model_type == "gemma3_text":
            return self._gemma3_hf(out)
        out["hidden_act"] = self.hidden_act
        if "rope_parameters" in out:
            out["rope_parameters"] = {**out["rope_parameters"], "rope_theta": self.rope_theta}
        else:
            out["rope_theta"] = self.rope_theta
            out["rope_scaling"] = self.rope_scaling
        if self.model_type in ("llama", "qwen3"):
            out["attention_bias"] = self.attention_bias
        if self.model_type == "phi3":
            out.update(sliding_window=self.sliding_window, partial_rotary_factor=self.partial_rotary_factor)
        if self.model_type == "qwen3_moe":  # the Hub's key for the experts, as transformers 4 wrote it
            out.pop("num_local_experts", None)
            out.update(num_experts=self.num_experts, num_experts_per_tok=self.num_experts_per_tok,
                       moe_intermediate_size=self.moe_intermediate_size, norm_topk_prob=self.norm_topk_prob,
                       decoder_sparse_step=self.decoder_sparse_step,
                       mlp_only_layers=list(self.mlp_only_layers),
                       router_aux_loss_coef=self.router_aux_loss_coef, attention_bias=self.attention_bias)
        return out

    @property
    def layer_pattern(self) -> int:
        """How many layers repeat as one unit of ``layer_types`` (Gemma 3: 5 sliding, 1 global
        makes 6); 1 where every layer is alike."""
        if self.mlp_only_layers and self.num_experts:  # dense layers anywhere: no repeating unit
            return self.num_layers
        types = self.layer_types or ()
        pattern = next((p for p in range(1, len(types))
                        if all(kind == types[i % p] for i, kind in enumerate(types))), max(1, len(types)))
        step = self.decoder_sparse_step if self.num_experts else 1  # a sparse layer every step-th
        return pattern * step // math.gcd(pattern, step)

    def with_layers(self, n: int) -> "ModelConfig":
        """The same model ``n`` layers deep, its layer kinds following the same pattern (the
        estimator's shallow runs).

        Args:
            n: Layers.

        Returns:
            The new ``ModelConfig``.
        """
        types, period = self.layer_types, self.layer_pattern
        if types is not None:
            types = tuple(types[i % period] for i in range(n))
        return dataclasses.replace(self, num_layers=n, layer_types=types)

    def _gemma3_hf(self, out: dict) -> dict:
        """Gemma 3's keys as transformers 5 writes them (per-layer-type ``rope_parameters``)."""
        for old in ("rope_theta", "rope_scaling", "rope_local_base_freq", "sliding_window_pattern",
                    "_sliding_window_pattern", "hidden_act"):
            out.pop(old, None)
        scaling = {k: v for k, v in (self.rope_scaling or {}).items() if k not in ("type", "rope_type")}
        kind = (self.rope_scaling or {}).get("rope_type", (self.rope_scaling or {}).get("type", "default"))
        full = {"rope_type": kind, **scaling, "rope_theta": self.rope_theta}
        out.update({
            "layer_types": list(self.layer_types or ()), "sliding_window": self.sliding_window,
            "query_pre_attn_scalar": self.query_pre_attn_scalar, "hidden_activation": self.hidden_act,
            "attention_bias": False, "final_logit_softcapping": None, "attn_logit_softcapping": None,
            "rope_parameters": {"full_attention": full,
                                "sliding_attention": {"rope_type": "default",
                                                      "rope_theta": self.rope_local_theta}}})
        return out

    def replace(self, **changes) -> "ModelConfig":
        """A copy with ``changes``, checked as a new config is.

        Args:
            **changes: Fields and their new values.

        Returns:
            The new ``ModelConfig``.
        """
        return dataclasses.replace(self, **changes)
