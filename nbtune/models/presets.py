"""Named model shapes, as plain data, for estimating memory without a download.

Each entry is the model's Hugging Face ``config.json`` (the keys that shape memory) and
where it comes from. ``ModelConfig.from_hf`` reads them exactly as it reads a real folder.
Parameter counts are checked in the tests against the counts the model cards publish.
"""

from __future__ import annotations

from .config import ModelConfig

_LLAMA_3_ROPE = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                 "original_max_position_embeddings": 8192}

# name -> (config.json keys, source)
PRESETS: dict[str, tuple[dict, str]] = {
    "llama-3.2-1b": (dict(
        model_type="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
        num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
        rms_norm_eps=1e-5, rope_theta=500000.0, rope_scaling={**_LLAMA_3_ROPE, "factor": 32.0},
        max_position_embeddings=131072, tie_word_embeddings=True, bos_token_id=128000,
        eos_token_id=128001), "https://huggingface.co/meta-llama/Llama-3.2-1B/blob/main/config.json"),
    "llama-3.2-3b": (dict(
        model_type="llama", vocab_size=128256, hidden_size=3072, intermediate_size=8192,
        num_hidden_layers=28, num_attention_heads=24, num_key_value_heads=8, head_dim=128,
        rms_norm_eps=1e-5, rope_theta=500000.0, rope_scaling={**_LLAMA_3_ROPE, "factor": 32.0},
        max_position_embeddings=131072, tie_word_embeddings=True, bos_token_id=128000,
        eos_token_id=128001), "https://huggingface.co/meta-llama/Llama-3.2-3B/blob/main/config.json"),
    "llama-3.1-8b": (dict(
        model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        rms_norm_eps=1e-5, rope_theta=500000.0, rope_scaling={**_LLAMA_3_ROPE, "factor": 8.0},
        max_position_embeddings=131072, tie_word_embeddings=False, bos_token_id=128000,
        eos_token_id=128001), "https://huggingface.co/meta-llama/Llama-3.1-8B/blob/main/config.json"),
    "llama-3.1-70b": (dict(
        model_type="llama", vocab_size=128256, hidden_size=8192, intermediate_size=28672,
        num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8, head_dim=128,
        rms_norm_eps=1e-5, rope_theta=500000.0, rope_scaling={**_LLAMA_3_ROPE, "factor": 8.0},
        max_position_embeddings=131072, tie_word_embeddings=False, bos_token_id=128000,
        eos_token_id=128001), "https://huggingface.co/meta-llama/Llama-3.1-70B/blob/main/config.json"),
    "llama-2-70b": (dict(
        model_type="llama", vocab_size=32000, hidden_size=8192, intermediate_size=28672,
        num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8, head_dim=128,
        rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=4096,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2),
        "https://huggingface.co/meta-llama/Llama-2-70b-hf/blob/main/config.json"),
    "qwen2.5-0.5b": (dict(
        model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
        num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
        rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=32768,
        tie_word_embeddings=True, bos_token_id=151643, eos_token_id=151643),
        "https://huggingface.co/Qwen/Qwen2.5-0.5B/blob/main/config.json"),
    "qwen2.5-1.5b": (dict(
        model_type="qwen2", vocab_size=151936, hidden_size=1536, intermediate_size=8960,
        num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
        rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=131072,
        tie_word_embeddings=True, bos_token_id=151643, eos_token_id=151643),
        "https://huggingface.co/Qwen/Qwen2.5-1.5B/blob/main/config.json"),
    "qwen2.5-7b": (dict(
        model_type="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944,
        num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
        rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=131072,
        tie_word_embeddings=False, bos_token_id=151643, eos_token_id=151643),
        "https://huggingface.co/Qwen/Qwen2.5-7B/blob/main/config.json"),
    "mistral-7b": (dict(
        model_type="mistral", vocab_size=32768, hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        rms_norm_eps=1e-5, rope_theta=1000000.0, max_position_embeddings=32768,
        sliding_window=None, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2),
        "https://huggingface.co/mistralai/Mistral-7B-v0.3/blob/main/config.json"),
}


def preset_config(name: str) -> ModelConfig:
    """The ``ModelConfig`` of a named preset (case-insensitive)."""
    key = name.lower()
    if key not in PRESETS:
        raise KeyError(f"No preset named {name!r}; presets are {', '.join(PRESETS)}. "
                       "Or give a Hub repo id, a config.json or a ModelConfig.")
    return ModelConfig.from_hf(PRESETS[key][0])
