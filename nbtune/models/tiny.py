"""The embedded default model: made deterministically on first use, then loaded like any other.

It is written as a Hugging Face folder (config.json, model.safetensors, tokenizer.json) in
a cache folder, so the demo exercises exactly the loading code a real checkpoint uses.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from tokenizers import Tokenizer as _HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

from .config import ModelConfig
from .decoder import CausalLM
from .hf import save_model
from .tokenizer import Tokenizer

DEMO_VERSION = "demo-v1"  # bump when the recipe below changes, so caches are rebuilt
SPECIAL_TOKENS = ("<|begin|>", "<|end|>", "<|pad|>")


def byte_tokenizer() -> Tokenizer:
    """One token per byte (a byte-level BPE with no merges) plus three special tokens.

    Byte tokens let a tiny model learn character tasks such as reversing a word.
    """
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    for token in SPECIAL_TOKENS:
        vocab[token] = len(vocab)
    backend = _HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(list(SPECIAL_TOKENS))
    bos, eos, pad = (vocab[t] for t in SPECIAL_TOKENS)
    return Tokenizer(backend, bos, eos, pad, {"model_max_length": 256})


def demo_config(tokenizer: Tokenizer) -> ModelConfig:
    """A Llama-shaped model of about 0.8 M parameters: 4 layers, GQA, tied embeddings."""
    return ModelConfig(
        vocab_size=tokenizer.vocab_size, hidden_size=128, intermediate_size=384,
        num_layers=4, num_heads=4, num_kv_heads=2, head_dim=32, model_type="llama",
        rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=256,
        tie_word_embeddings=True, bos_token_id=tokenizer.bos_id,
        eos_token_id=tokenizer.eos_id, pad_token_id=tokenizer.pad_id)


def cache_root() -> Path:
    """$NBTUNE_CACHE, else $XDG_CACHE_HOME/nbtune, else ~/.cache/nbtune."""
    if os.environ.get("NBTUNE_CACHE"):
        return Path(os.environ["NBTUNE_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "nbtune"


def demo_model_dir(cache: str | os.PathLike | None = None) -> Path:
    """Folder of the embedded default model, created (seed 0) the first time it is asked for."""
    folder = Path(cache) if cache is not None else cache_root() / DEMO_VERSION
    if all((folder / f).exists() for f in ("config.json", "model.safetensors", "tokenizer.json")):
        return folder
    tokenizer = byte_tokenizer()
    generator_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(0)
        model = CausalLM(demo_config(tokenizer))
        model.reset_parameters()
    finally:
        torch.random.set_rng_state(generator_state)  # do not disturb the caller's RNG
    return save_model(model, folder, tokenizer)
