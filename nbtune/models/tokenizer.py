"""tokenizer.json through the `tokenizers` library, with the special tokens a trainer needs
and the model's chat template, rendered with jinja2 the way transformers renders it.

The files come from strangers: they are read through ``nbtune.files`` (regular files of
bounded size, inside the model folder), and the chat template is compiled and rendered within
the budget of ``nbtune.template`` (beside the trust boundary, ``nbtune.files``).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Iterable

from tokenizers import Tokenizer as _HFTokenizer

from .. import files
from ..template import compile_chat_template

CHAT_TEMPLATE_FILE = "chat_template.jinja"  # where transformers 5 saves (and first looks for) it
# The named special tokens transformers hands to a chat template (its SPECIAL_TOKENS_ATTRIBUTES).
TEMPLATE_TOKENS = ("bos", "eos", "unk", "sep", "pad", "cls", "mask")


def _token_text(value) -> str | None:
    # tokenizer_config.json stores special tokens as strings or {"content": ...} dicts.
    return value.get("content") if isinstance(value, dict) else value


def _read_json(folder: Path, name: str, what: str, limit_name: str) -> dict:
    """A JSON object file of the model folder through the trust boundary; {} when absent."""
    path = files.inside(folder, name, what)
    return files.read_json(path, what, limit_name) if path.exists() else {}


def _backend(path: Path) -> _HFTokenizer:
    """tokenizer.json through ``nbtune.files``; a file the `tokenizers` library cannot read is
    nbtune's error naming the file (the library raises a bare Exception, or a Rust panic)."""
    text = files.read_text(path, "tokenizer file", "json_bytes")
    try:
        return _HFTokenizer.from_str(text)
    except (KeyboardInterrupt, SystemExit, GeneratorExit):
        raise
    except BaseException as err:  # noqa: BLE001 -- pyo3's PanicException is a BaseException
        files.parse_json(text, path, "tokenizer file")  # not JSON at all: says where it breaks
        reason = " ".join(str(err).split())[:300]
        raise files.FileRefused(
            f"{path} is not a tokenizer file the tokenizers library can read ({reason}). It is "
            "damaged or truncated: download it again (or save it again with transformers' "
            "save_pretrained); if a newer transformers wrote it, upgrade tokenizers.") from None


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


class Tokenizer:
    """Encode/decode, the BOS / EOS / padding / stop ids and the chat template of one model.

    ``bos_id`` is None when the model takes no BOS (no bos token, or ``add_bos_token`` false).
    ``stop_ids`` holds every id that ends a reply: chat models end a turn with a token other
    than eos (Llama 3's <|eot_id|>, Qwen's <|im_end|>) and list it in config.json or
    generation_config.json.
    """

    def __init__(self, backend: _HFTokenizer, bos_id: int | None, eos_id: int | None,
                 pad_id: int | None = None, config: dict | None = None, *,
                 chat_template: str | None = None, stop_ids: Iterable[int] = (),
                 template_origin: str | None = None) -> None:
        if eos_id is None:
            raise ValueError("The tokenizer has no end-of-sequence token: set eos_token in "
                             "tokenizer_config.json so generation knows where to stop.")
        size = backend.get_vocab_size(with_added_tokens=True)
        stop_ids = list(stop_ids)
        named = {"bos": bos_id, "eos": eos_id, "pad": pad_id,
                 **{f"stop ({i})": v for i, v in enumerate(stop_ids)}}
        for name, value in named.items():  # an id past the vocabulary indexes past the embedding
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or not 0 <= value < size):
                raise ValueError(f"The tokenizer's {name} token id is {value!r}, which is not a "
                                 f"token of its {size}-token vocabulary: config.json, "
                                 "generation_config.json or tokenizer_config.json is damaged. "
                                 "Download the model's files again.")
        self.backend = backend
        self.bos_id, self.eos_id = bos_id, eos_id
        self.pad_id = pad_id if pad_id is not None else eos_id
        self.config = dict(config or {})
        self.stop_ids = frozenset([eos_id, *stop_ids])
        self.set_chat_template(chat_template if chat_template is not None
                               else _config_template(self.config), template_origin)

    @property
    def chat_template(self) -> str | None:
        """The Jinja source of the chat template, or None when the model has none."""
        return self._chat_template

    @chat_template.setter
    def chat_template(self, source: str | None) -> None:
        self.set_chat_template(source)

    def set_chat_template(self, source: str | None, origin: str | None = None) -> None:
        """Compile ``source`` (once here, not per row: compiling costs far more than rendering);
        ``origin`` names where it came from (a file) in the errors of its budget."""
        if source is not None and not isinstance(source, str):
            kind = {bool: "true/false", int: "number", float: "number", dict: "JSON object",
                    list: "JSON array"}.get(type(source), type(source).__name__)
            raise files.FileRefused(f"{origin or 'chat_template'}: the chat template is a {kind}, "
                                    "not text. Fix chat_template in tokenizer_config.json, or "
                                    "download the file again.")
        self._compiled = compile_chat_template(source, origin) if source is not None else None
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
        path = files.inside(folder, "tokenizer.json", "tokenizer file", links=True)  # parsed, never shown
        if not path.exists():
            raise FileNotFoundError(f"No tokenizer.json in {folder}; nbtune reads the fast "
                                    "tokenizer format only.")
        backend = _backend(path)
        cfg = _read_json(folder, "tokenizer_config.json", "tokenizer config", "json_bytes")
        model_cfg = _read_json(folder, "config.json", "config.json", "config_bytes")
        gen_cfg = _read_json(folder, "generation_config.json", "generation config", "config_bytes")
        template_file = files.inside(folder, CHAT_TEMPLATE_FILE, "chat template")
        if template_file.exists():  # takes priority, as in transformers 5
            data = files.read_bytes(template_file, "chat template", "template_bytes")
            try:  # a byte-order mark is kept, as transformers keeps it
                template = data.decode("utf-8")
            except UnicodeDecodeError:  # nbtune's error, naming the file and the byte
                template = files.read_text(template_file, "chat template", "template_bytes")
            origin = str(template_file)
        else:
            template = _config_template(cfg)
            origin = f"{folder / 'tokenizer_config.json'} (chat_template)"

        def token_id(name: str) -> int | None:
            text = _token_text(cfg.get(f"{name}_token"))
            if isinstance(text, str) and backend.token_to_id(text) is not None:
                return backend.token_to_id(text)
            value = model_cfg.get(f"{name}_token_id")
            return (value[0] if value else None) if isinstance(value, list) else value

        bos = token_id("bos") if cfg.get("add_bos_token", True) else None
        stops = _ids(model_cfg.get("eos_token_id")) + _ids(gen_cfg.get("eos_token_id"))
        return cls(backend, bos, token_id("eos"), token_id("pad"), cfg, chat_template=template,
                   stop_ids=stops, template_origin=origin)

    @functools.cached_property
    def longest_token(self) -> int:
        """Characters in the vocabulary's longest token: how much text ``n`` tokens can cover
        at most (data cuts a huge row to that before encoding it)."""
        return max(map(len, self.backend.get_vocab()), default=1)

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
