"""Model configuration as plain data: one dataclass, family differences as fields."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path

from .. import files

# HF `model_type` values this decoder implements, and what each one switches on.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
ROPE_TYPES = ("default", "linear", "llama3", None)
# The transformers class each model_type is saved as (config.json's "architectures").
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                 "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
# What each rope_scaling type needs (transformers' rope initialisers read these).
ROPE_FACTORS = {"linear": ("factor",),
                "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                           "original_max_position_embeddings")}
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
    """Shape of a decoder-only transformer (Llama / Qwen2 / Qwen3 / Mistral family).

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
        model_type: The family: "llama", "mistral", "qwen2" or "qwen3".
        rms_norm_eps: RMSNorm's epsilon.
        rope_theta: The rotary embedding's base.
        rope_scaling: Llama 3.1's or linear RoPE scaling, as config.json gives it.
        max_position_embeddings: The model's context length.
        tie_word_embeddings: The head shares the embedding's weight.
        attention_bias: q/k/v projections carry a bias (Qwen2).
        qk_norm: RMSNorm on queries and keys per head (Qwen3).
        sliding_window: Attend to the last N tokens only (Mistral v0.1).
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
        layer = attn + 3 * d * self.intermediate_size + 2 * d
        head = 0 if self.tie_word_embeddings else self.vocab_size * d
        return self.vocab_size * d + self.num_layers * layer + d + head

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
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
        })
        if self.model_type == "mistral":
            out["sliding_window"] = self.sliding_window
        if "rope_parameters" in out:
            out["rope_parameters"] = {**out["rope_parameters"], "rope_theta": self.rope_theta}
        else:
            out["rope_theta"] = self.rope_theta
            out["rope_scaling"] = self.rope_scaling
        if self.model_type in ("llama", "qwen3"):
            out["attention_bias"] = self.attention_bias
        return out

    def replace(self, **changes) -> "ModelConfig":
        """A copy with ``changes``, checked as a new config is.

        Args:
            **changes: Fields and their new values.

        Returns:
            The new ``ModelConfig``.
        """
        return dataclasses.replace(self, **changes)
