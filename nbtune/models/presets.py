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

# Gemma 3: five sliding layers then a global one; the 4B, 12B and 27B are multimodal
# checkpoints whose language model (text_config) is what nbtune trains and these describe.
_GEMMA_3 = dict(model_type="gemma3_text", rms_norm_eps=1e-6, rope_theta=1000000.0,
                rope_local_base_freq=10000.0, sliding_window_pattern=6, query_pre_attn_scalar=256,
                tie_word_embeddings=True, bos_token_id=2, eos_token_id=1, pad_token_id=0)
_GEMMA_3_LONG = dict(_GEMMA_3, vocab_size=262208, sliding_window=1024, max_position_embeddings=131072,
                     rope_scaling={"rope_type": "linear", "factor": 8.0})
_GEMMA_3_SMALL = dict(_GEMMA_3, vocab_size=262144, sliding_window=512, max_position_embeddings=32768)
# Qwen3's mixtures of experts: 128 experts a layer, each token to 8 of them
_QWEN3_MOE = dict(model_type="qwen3_moe", vocab_size=151936, num_key_value_heads=4, head_dim=128,
                  num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1,
                  mlp_only_layers=[], router_aux_loss_coef=0.001, rms_norm_eps=1e-6,
                  rope_theta=1000000.0, max_position_embeddings=40960, tie_word_embeddings=False,
                  bos_token_id=151643, eos_token_id=151645)
PRESETS.update({
    "gemma-3-270m": (dict(_GEMMA_3_SMALL, hidden_size=640, intermediate_size=2048, num_hidden_layers=18,
                          num_attention_heads=4, num_key_value_heads=1, head_dim=256),
                     "https://huggingface.co/google/gemma-3-270m/blob/main/config.json"),
    "gemma-3-1b": (dict(_GEMMA_3_SMALL, hidden_size=1152, intermediate_size=6912, num_hidden_layers=26,
                        num_attention_heads=4, num_key_value_heads=1, head_dim=256),
                   "https://huggingface.co/google/gemma-3-1b-pt/blob/main/config.json"),
    "gemma-3-4b": (dict(_GEMMA_3_LONG, hidden_size=2560, intermediate_size=10240, num_hidden_layers=34,
                        num_attention_heads=8, num_key_value_heads=4, head_dim=256),
                   "https://huggingface.co/google/gemma-3-4b-pt/blob/main/config.json (text_config)"),
    "gemma-3-12b": (dict(_GEMMA_3_LONG, hidden_size=3840, intermediate_size=15360, num_hidden_layers=48,
                         num_attention_heads=16, num_key_value_heads=8, head_dim=256),
                    "https://huggingface.co/google/gemma-3-12b-pt/blob/main/config.json (text_config)"),
    "gemma-3-27b": (dict(_GEMMA_3_LONG, hidden_size=5376, intermediate_size=21504, num_hidden_layers=62,
                         num_attention_heads=32, num_key_value_heads=16, head_dim=128,
                         query_pre_attn_scalar=168),
                    "https://huggingface.co/google/gemma-3-27b-pt/blob/main/config.json (text_config)"),
    "phi-4": (dict(
        model_type="phi3", vocab_size=100352, hidden_size=5120, intermediate_size=17920,
        num_hidden_layers=40, num_attention_heads=40, num_key_value_heads=10, rms_norm_eps=1e-5,
        rope_theta=250000.0, max_position_embeddings=16384, tie_word_embeddings=False,
        bos_token_id=100257, eos_token_id=100265, pad_token_id=100349),
        "https://huggingface.co/microsoft/phi-4/blob/main/config.json"),
    # Its LongRoPE factors (48 numbers each) are left out: they change no tensor's size, and
    # up to its original 4,096-token context it runs without them.
    "phi-4-mini": (dict(
        model_type="phi3", vocab_size=200064, hidden_size=3072, intermediate_size=8192,
        num_hidden_layers=32, num_attention_heads=24, num_key_value_heads=8, rms_norm_eps=1e-5,
        partial_rotary_factor=0.75, rope_theta=10000.0, max_position_embeddings=131072,
        original_max_position_embeddings=4096, sliding_window=262144, tie_word_embeddings=True,
        bos_token_id=199999, eos_token_id=199999, pad_token_id=199999),
        "https://huggingface.co/microsoft/Phi-4-mini-instruct/blob/main/config.json"),
    "qwen3-30b-a3b": (dict(_QWEN3_MOE, hidden_size=2048, intermediate_size=6144,
                           moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32),
                      "https://huggingface.co/Qwen/Qwen3-30B-A3B/blob/main/config.json"),
    "qwen3-235b-a22b": (dict(_QWEN3_MOE, hidden_size=4096, intermediate_size=12288,
                             moe_intermediate_size=1536, num_hidden_layers=94, num_attention_heads=64),
                        "https://huggingface.co/Qwen/Qwen3-235B-A22B/blob/main/config.json"),
})


def preset_config(name: str) -> ModelConfig:
    """The ``ModelConfig`` of a named preset (case-insensitive)."""
    key = name.lower()
    if key not in PRESETS:
        raise KeyError(f"No preset named {name!r}; presets are {', '.join(PRESETS)}. "
                       "Or give a Hub repo id, a config.json or a ModelConfig.")
    return ModelConfig.from_hf(PRESETS[key][0])
