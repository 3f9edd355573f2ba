"""Model side: config, the one decoder, HF folders in and out, tokenizer, tiny default."""

from .config import ModelConfig
from .decoder import CausalLM
from .hf import save_model
from .loading import load_model
from .tokenizer import Tokenizer
from .tiny import demo_model_dir

__all__ = ["ModelConfig", "CausalLM", "load_model", "save_model", "Tokenizer", "demo_model_dir"]
