"""tokenizer.json through the `tokenizers` library, with the special tokens a trainer needs."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer


def _token_text(value) -> str | None:
    # tokenizer_config.json stores special tokens as strings or {"content": ...} dicts.
    return value.get("content") if isinstance(value, dict) else value


class Tokenizer:
    """Encode/decode plus the BOS / EOS / padding ids of one model."""

    def __init__(self, backend: _HFTokenizer, bos_id: int | None, eos_id: int | None,
                 pad_id: int | None = None, config: dict | None = None) -> None:
        if eos_id is None:
            raise ValueError("The tokenizer has no end-of-sequence token: set eos_token in "
                             "tokenizer_config.json so generation knows where to stop.")
        self.backend = backend
        self.bos_id, self.eos_id = bos_id, eos_id
        self.pad_id = pad_id if pad_id is not None else eos_id
        self.config = dict(config or {})

    @classmethod
    def from_folder(cls, folder: str | Path) -> "Tokenizer":
        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.exists():
            raise FileNotFoundError(f"No tokenizer.json in {folder}; nbtune reads the fast "
                                    "tokenizer format only.")
        backend = _HFTokenizer.from_file(str(path))
        cfg_path = folder / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
        model_cfg_path = folder / "config.json"
        model_cfg = json.loads(model_cfg_path.read_text()) if model_cfg_path.exists() else {}

        def token_id(name: str) -> int | None:
            text = _token_text(cfg.get(f"{name}_token"))
            if text is not None and backend.token_to_id(text) is not None:
                return backend.token_to_id(text)
            value = model_cfg.get(f"{name}_token_id")
            return value[0] if isinstance(value, list) else value

        bos = token_id("bos") if cfg.get("add_bos_token", True) else None
        return cls(backend, bos, token_id("eos"), token_id("pad"), cfg)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` with no special tokens added."""
        return self.backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=True)

    def save(self, folder: str | Path) -> None:
        folder = Path(folder)
        self.backend.save(str(folder / "tokenizer.json"))
        cfg = dict(self.config)
        for name, idx in (("bos", self.bos_id), ("eos", self.eos_id), ("pad", self.pad_id)):
            if idx is not None:
                cfg[f"{name}_token"] = self.backend.id_to_token(idx)
        cfg.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
        (folder / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))
