"""tokenizer.json through the `tokenizers` library, with the special tokens a trainer needs
and the model's chat template, rendered with jinja2 the way transformers renders it."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Iterable

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _HFTokenizer

CHAT_TEMPLATE_FILE = "chat_template.jinja"  # where transformers 5 saves (and first looks for) it
# The named special tokens transformers hands to a chat template (its SPECIAL_TOKENS_ATTRIBUTES).
TEMPLATE_TOKENS = ("bos", "eos", "unk", "sep", "pad", "cls", "mask")


def _token_text(value) -> str | None:
    # tokenizer_config.json stores special tokens as strings or {"content": ...} dicts.
    return value.get("content") if isinstance(value, dict) else value


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def _config_template(cfg: dict) -> str | None:
    """tokenizer_config.json's ``chat_template``: a string, or a list of named ones (take "default")."""
    value = cfg.get("chat_template")
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        return named.get("default")
    return value


def _ids(value) -> list[int]:
    # config.json / generation_config.json write eos_token_id as an int or a list of ints.
    if value is None:
        return []
    return list(value) if isinstance(value, list) else [value]


def compile_chat_template(source: str) -> jinja2.Template:
    """Compile like transformers' ``_compile_jinja_template`` so templates render identically.

    The sandbox matters: templates come from the Hub and are untrusted code. ``tojson`` is
    replaced because jinja's own escapes HTML characters, which transformers' does not.
    """

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(format):
        return datetime.now().strftime(format)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as err:
        raise ValueError(f"The chat template is not valid Jinja (line {err.lineno}: {err.message}); "
                         "fix chat_template in tokenizer_config.json or chat_template.jinja.") from err


class Tokenizer:
    """Encode/decode, the BOS / EOS / padding / stop ids and the chat template of one model.

    ``bos_id`` is None when the model takes no BOS (no bos token, or ``add_bos_token`` false).
    ``stop_ids`` holds every id that ends a reply: chat models end a turn with a token other
    than eos (Llama 3's <|eot_id|>, Qwen's <|im_end|>) and list it in config.json or
    generation_config.json.
    """

    def __init__(self, backend: _HFTokenizer, bos_id: int | None, eos_id: int | None,
                 pad_id: int | None = None, config: dict | None = None, *,
                 chat_template: str | None = None, stop_ids: Iterable[int] = ()) -> None:
        if eos_id is None:
            raise ValueError("The tokenizer has no end-of-sequence token: set eos_token in "
                             "tokenizer_config.json so generation knows where to stop.")
        self.backend = backend
        self.bos_id, self.eos_id = bos_id, eos_id
        self.pad_id = pad_id if pad_id is not None else eos_id
        self.config = dict(config or {})
        self.stop_ids = frozenset([eos_id, *stop_ids])
        self.chat_template = chat_template if chat_template is not None else _config_template(self.config)

    @property
    def chat_template(self) -> str | None:
        """The Jinja source of the chat template, or None when the model has none."""
        return self._chat_template

    @chat_template.setter
    def chat_template(self, source: str | None) -> None:
        # Compiled once here, not per row: compiling costs far more than rendering.
        self._compiled = compile_chat_template(source) if source is not None else None
        self._chat_template = source

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        """The conversation as text, exactly as transformers' ``apply_chat_template(tokenize=False)``."""
        if self._compiled is None:
            raise ValueError("This tokenizer has no chat template: add chat_template to "
                             "tokenizer_config.json (or a chat_template.jinja file) in the model folder.")
        return self._compiled.render(messages=messages, tools=None, documents=None,
                                     add_generation_prompt=add_generation_prompt,
                                     **self.template_tokens())

    def template_tokens(self) -> dict[str, str]:
        """``bos_token``, ``eos_token``, ... as transformers passes them to a chat template."""
        tokens = {f"{name}_token": _token_text(self.config.get(f"{name}_token"))
                  for name in TEMPLATE_TOKENS}
        for name, idx in (("bos", self.bos_id), ("eos", self.eos_id)):
            if tokens[f"{name}_token"] is None and idx is not None:
                tokens[f"{name}_token"] = self.backend.id_to_token(idx)
        return {key: text for key, text in tokens.items() if text is not None}

    @classmethod
    def from_folder(cls, folder: str | Path) -> "Tokenizer":
        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.exists():
            raise FileNotFoundError(f"No tokenizer.json in {folder}; nbtune reads the fast "
                                    "tokenizer format only.")
        backend = _HFTokenizer.from_file(str(path))
        cfg = _read_json(folder / "tokenizer_config.json")
        model_cfg = _read_json(folder / "config.json")
        gen_cfg = _read_json(folder / "generation_config.json")
        template_file = folder / CHAT_TEMPLATE_FILE  # takes priority, as in transformers 5
        template = (template_file.read_text(encoding="utf-8") if template_file.exists()
                    else _config_template(cfg))

        def token_id(name: str) -> int | None:
            text = _token_text(cfg.get(f"{name}_token"))
            if text is not None and backend.token_to_id(text) is not None:
                return backend.token_to_id(text)
            value = model_cfg.get(f"{name}_token_id")
            return value[0] if isinstance(value, list) else value

        bos = token_id("bos") if cfg.get("add_bos_token", True) else None
        stops = _ids(model_cfg.get("eos_token_id")) + _ids(gen_cfg.get("eos_token_id"))
        return cls(backend, bos, token_id("eos"), token_id("pad"), cfg, chat_template=template,
                   stop_ids=stops)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` with no special tokens added."""
        return self.backend.encode(text, add_special_tokens=False).ids

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Ids of ``text`` (no special tokens added) and the character span each one covers.

        Whole texts are encoded once, as transformers does: encoding pieces separately can
        give other ids at the seams (SentencePiece-style tokenizers prepend a space to each).
        """
        encoding = self.backend.encode(text, add_special_tokens=False)
        return encoding.ids, encoding.offsets

    def decode(self, ids: list[int]) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=True)

    def save(self, folder: str | Path) -> None:
        """tokenizer.json, tokenizer_config.json and chat_template.jinja, as transformers 5 writes them."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        self.backend.save(str(folder / "tokenizer.json"))
        cfg = dict(self.config)
        for name, idx in (("bos", self.bos_id), ("eos", self.eos_id), ("pad", self.pad_id)):
            if idx is not None:
                cfg[f"{name}_token"] = self.backend.id_to_token(idx)
        cfg.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
        cfg.pop("chat_template", None)  # one place for it: the file transformers 5 writes and reads first
        if self.chat_template is not None:
            (folder / CHAT_TEMPLATE_FILE).write_text(self.chat_template, encoding="utf-8")
        (folder / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))
