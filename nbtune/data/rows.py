"""Rows: instruction and chat rows, preference pairs and prompts, read from files, lists and Datasets.

Row formats (JSONL, one object per line, or a .json file holding a list):

* instruction: ``{"instruction": ..., "input": ... (optional), "output": ...}``
* chat: ``{"messages": [{"role": "system"|"user"|"assistant", "content": ...}, ...]}``
* preference (TRL's form): ``{"prompt": ..., "chosen": ..., "rejected": ...}``, each a string
  or a list of messages (the prompt's ending with a user turn, each completion one assistant
  message); a text prompt is one user message, as an instruction row's is. Only the
  completions are scored.
* prompt-completion (TRL's form): ``{"prompt": ..., "completion": ...}``, imitated as an
  instruction (text) or chat (messages) row is;
* raw text (continued pretraining): ``{"text": ...}``, every token trained, a text longer
  than ``seq_len`` cut into pieces that together train on all of it (packed when packing is on);
* ShareGPT: ``{"conversations": [{"from": "human"|"gpt"|"system", "value": ...}, ...]}``, read
  as chat rows (``from``/``value`` or ``role``/``content``);
* prompt (TRL's form, for GRPO): ``{"prompt": ..., ...}``, a string or messages ending with a
  user turn; the row's other fields go to the reward functions. GRPO takes the prompt of
  any row: an instruction or chat row's (its answer as the field ``output``), a pair's
  (``chosen`` and ``rejected`` as fields).

Besides JSONL and JSON lists, rows come from Parquet and CSV files, Datasets, ``save_to_disk``
folders and Hub datasets (``sources.py``), with a column mapping onto these fields.

Rows are read without a tokenizer and become text only when tokenized, because the model
decides how a conversation is written:

* If its tokenizer has a chat template, every row is rendered through it exactly as
  transformers' ``apply_chat_template`` renders it. An instruction row is one user message
  (``instruction``, plus a blank line and ``input`` when there is one) and one assistant
  message (``output``). Each assistant turn as the template writes it is trained, its
  end-of-turn token included (Llama 3's <|eot_id|>, Qwen's <|im_end|>, Mistral's </s>);
  no other EOS is added.
* Without a template, instruction rows use the Alpaca prompt below and the ``output`` plus
  an EOS after it are trained. Chat rows need a template: they raise ``DataError``.

Everything else gets the label ``IGNORE``. BOS is put first when the tokenizer has one and
the text does not already start with it (templates such as Llama 3's write it themselves).
Truncation policy: sequences longer than ``seq_len`` are cut on the right; a row left with
no response tokens is dropped and counted.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import jinja2

from .. import files
from ..hub import resolve_data_file
from ..models.tokenizer import Tokenizer
from . import sources
from .sources import Data, DataError

IGNORE = -100  # label of positions that do not count in the loss
PROMPT = "### Instruction:\n{instruction}\n\n### Response:\n"
PROMPT_WITH_INPUT = "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class Example:
    """One row as messages; the tokenizer's chat template (or its absence) turns it into text.

    Instruction rows also keep ``(instruction, input)`` so that a tokenizer without a chat
    template can still format them with the Alpaca prompt.
    """

    messages: tuple[tuple[str, str], ...]  # (role, content) pairs, the last one an assistant's
    instruction: tuple[str, str] | None = None  # (instruction, input) of an instruction row
    where: str = field(default="", compare=False)  # file and line, for errors found later


def format_prompt(instruction: str, input: str = "") -> str:
    """The Alpaca prompt of an instruction row, for tokenizers without a chat template."""
    if input:
        return PROMPT_WITH_INPUT.format(instruction=instruction, input=input)
    return PROMPT.format(instruction=instruction)


def _user_text(instruction: str, input: str) -> str:
    return f"{instruction}\n\n{input}" if input else instruction


def prompt_text(tokenizer: Tokenizer, instruction: str, input: str = "") -> str:
    """What generation is given for an instruction: the text its training row starts with."""
    if tokenizer.chat_template is None:
        return format_prompt(instruction, input)
    return tokenizer.render_chat([{"role": "user", "content": _user_text(instruction, input)}],
                                 add_generation_prompt=True)


def prompt_ids(tokenizer: Tokenizer, text: str) -> list[int]:
    """The ids generation starts from: ``text`` with BOS put first exactly as in training."""
    return with_bos(tokenizer, tokenizer.encode(text))


def with_bos(tokenizer: Tokenizer, ids: list[int]) -> list[int]:
    # One BOS, never two: templates such as Llama 3's and Mistral's already write it.
    if tokenizer.bos_id is not None and ids[:1] != [tokenizer.bos_id]:
        return [tokenizer.bos_id] + ids
    return ids


def prompt_and_reference(example: Example, tokenizer: Tokenizer) -> tuple[str, str]:
    """The rendered text before the last assistant answer, and that answer's content."""
    last = max(i for i, (role, _) in enumerate(example.messages) if role == "assistant")
    if tokenizer.chat_template is None:
        return format_prompt(*alpaca_fields(example)), example.messages[last][1]
    return _render(example, tokenizer, last, add_generation_prompt=True), example.messages[last][1]


def alpaca_fields(example: Example) -> tuple[str, str]:
    if example.instruction is None:
        raise DataError(f"{example.where or 'a chat row'}: this is a chat row ('messages') but the "
                        "tokenizer has no chat template, so nbtune cannot know how the model expects a "
                        "conversation to be written. Use instruction rows ('instruction', 'input', "
                        "'output') instead, or add a chat_template to the model's "
                        "tokenizer_config.json (or a chat_template.jinja file beside it).")
    return example.instruction


@dataclass(frozen=True)
class Pair:
    """A preference row: the same prompt with a chosen and a rejected completion, each an
    ``Example`` ending with its completion as the assistant's turn."""

    chosen: Example
    rejected: Example

    @property
    def where(self) -> str:
        return self.chosen.where


@dataclass(frozen=True)
class PromptRow:
    """A prompt to complete (GRPO), with the row's other fields for the reward functions:
    ``prompt`` as the row gave it (text or messages: the rewards get it so), ``fields`` its
    other JSON values, by name."""

    example: Example  # the prompt's messages and a placeholder answer, to render it
    prompt: object  # the row's "prompt" (a string or a list of message dicts)
    fields: tuple[tuple[str, object], ...] = ()
    where: str = field(default="", compare=False)

    @property
    def conversational(self) -> bool:
        return not isinstance(self.prompt, str)


@dataclass(frozen=True)
class TextRow:
    """Raw text to continue pretraining on: every token of it trained."""

    text: str
    where: str = field(default="", compare=False)


def as_prompt(row) -> PromptRow:
    """Any row as a prompt for GRPO: a prompt row itself; an instruction or chat row's turns
    before its last answer (the answer a field, ``output``, for a reward to compare with);
    a pair's prompt (``chosen`` and ``rejected`` fields)."""
    if isinstance(row, PromptRow):
        return row
    if isinstance(row, TextRow):
        raise DataError(f"{row.where or 'a text row'}: raw text has no prompt to complete; GRPO "
                        "needs prompts (rows with 'prompt', or instruction or chat rows).")
    if isinstance(row, Pair):
        messages = row.chosen.messages[:-1]
        fields = (("chosen", row.chosen.messages[-1][1]), ("rejected", row.rejected.messages[-1][1]))
        example = row.chosen
    else:
        last = max(i for i, (role, _) in enumerate(row.messages) if role == "assistant")
        messages, fields, example = row.messages[:last], (("output", row.messages[last][1]),), row
    plain = example.instruction is not None
    prompt = (example.instruction[0] if plain and not example.instruction[1] else
              messages[-1][1] if plain else [{"role": r, "content": c} for r, c in messages])
    if plain and example.instruction[1]:
        fields = (("instruction", example.instruction[0]), ("input", example.instruction[1])) + fields
    return PromptRow(Example(messages + (("assistant", ""),), instruction=example.instruction,
                             where=example.where), prompt, fields, example.where)


def check_renderable(examples: list, tokenizer: Tokenizer) -> None:
    """Fail now, before weights are loaded, if chat rows meet a tokenizer with no template."""
    if tokenizer.chat_template is None:
        for example in examples:
            if isinstance(example, TextRow):
                continue  # raw text is read as it is, with no template
            for one in ((example.chosen, example.rejected) if isinstance(example, Pair) else
                        (example.example,) if isinstance(example, PromptRow) else (example,)):
                alpaca_fields(one)


def _messages(value, where: str, name: str, roles: tuple[str, ...],
              text_role: str) -> tuple[tuple[str, str], ...]:
    """A pair's prompt or completion as (role, content) pairs: a string (one ``text_role``
    message), or messages."""
    if isinstance(value, str):
        if not value:
            raise DataError(f"{where}: {name!r} is empty.")
        return ((text_role, value),)
    if not isinstance(value, list) or not value:
        raise DataError(f"{where}: {name!r} must be a string or a non-empty list of "
                        "{'role': ..., 'content': ...} messages.")
    for i, msg in enumerate(value):
        if not isinstance(msg, dict) or msg.get("role") not in roles \
                or not isinstance(msg.get("content"), str):
            raise DataError(f"{where}: {name!r} message {i} must be an object with 'role' in "
                            f"{roles} and a string 'content'; got {msg!r:.80}.")
    return tuple((msg["role"], msg["content"]) for msg in value)


def _row_to_pair(row: dict, where: str) -> Pair:
    missing = [k for k in ("prompt", "chosen", "rejected") if k not in row]
    if missing:
        raise DataError(f"{where}: a preference row needs 'prompt', 'chosen' and 'rejected'; "
                        f"{' and '.join(repr(k) for k in missing)} missing.")
    prompt = _messages(row["prompt"], where, "prompt", ROLES, "user")
    if prompt[-1][0] != "user":
        raise DataError(f"{where}: the prompt must end with a user message (the completions "
                        f"answer it); it ends with a {prompt[-1][0]} message.")
    sides = []
    for name in ("chosen", "rejected"):
        completion = _messages(row[name], where, name, ("assistant",), "assistant")
        if len(completion) != 1 or not completion[0][1]:
            raise DataError(f"{where}: {name!r} must be one non-empty assistant message "
                            f"(or a string); got {len(completion)} messages.")
        sides.append(completion[0])
    if sides[0] == sides[1]:
        raise DataError(f"{where}: 'chosen' and 'rejected' are the same text, so there is "
                        "nothing to prefer. Fix or drop the row.")
    _check_text([content for _, content in prompt + tuple(sides)], where)
    plain = isinstance(row["prompt"], str)
    instruction = (row["prompt"], "") if plain else None
    chosen, rejected = (Example(prompt + (side,), instruction=instruction, where=where) for side in sides)
    return Pair(chosen, rejected)


def _render(example: Example, tokenizer: Tokenizer, upto: int | None,
            add_generation_prompt: bool = False) -> str:
    messages = [{"role": role, "content": content} for role, content in example.messages[:upto]]
    try:
        return tokenizer.render_chat(messages, add_generation_prompt)
    except jinja2.TemplateError as err:
        raise DataError(f"{example.where or 'a row'}: the model's chat template rejects this "
                        f"conversation: {err}. Change the row to the roles and order the template "
                        "accepts.") from err


def chat_spans(example: Example, tokenizer: Tokenizer) -> tuple[str, list[tuple[int, int]]]:
    """The conversation through the template, and the character span of each assistant turn.

    A turn is what rendering through its message adds to the text rendered before it with
    ``add_generation_prompt=True``: the content and the end-of-turn text the template writes.
    That works only if the template renders a conversation's start the same whatever follows.
    """
    full = _render(example, tokenizer, None)
    spans: list[tuple[int, int]] = []
    for i, (role, _) in enumerate(example.messages):
        if role != "assistant":
            continue
        before = _render(example, tokenizer, i, add_generation_prompt=True)
        through = _render(example, tokenizer, i + 1)
        done = spans[-1][1] if spans else 0
        if not (done <= len(before) < len(through) and full.startswith(through)
                and through.startswith(before)):
            raise DataError(
                f"{example.where or 'a row'}: the chat template is not prefix-stable: rendered up to "
                f"message {i} (an assistant turn) it is not the start of the whole conversation, so "
                "nbtune cannot tell which tokens are the answers. Use a template that renders each "
                "turn the same whatever follows it, or split the conversation into rows that end "
                "at each answer.")
        spans.append((len(before), len(through)))
    return full, spans


def _check_text(texts: list[str], where: str) -> None:
    """Refuse text no tokenizer can take: a lone surrogate (JSON's "\\ud800" escapes allow
    one) is not Unicode text and fails deep inside the tokenizer."""
    for text in texts:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as err:
            raise DataError(f"{where}: character {err.start} is a lone surrogate "
                            f"(U+{ord(text[err.start]):04X}), which is not text; the row was "
                            "written by a broken encoder. Fix or drop the row.") from None


def _row_to_prompt(row: dict, where: str) -> PromptRow:
    prompt = _messages(row["prompt"], where, "prompt", ROLES, "user")
    if prompt[-1][0] != "user":
        raise DataError(f"{where}: the prompt must end with a user message (the completions "
                        f"answer it); it ends with a {prompt[-1][0]} message.")
    _check_text([content for _, content in prompt], where)
    plain = isinstance(row["prompt"], str)
    fields = tuple((k, v) for k, v in row.items() if k != "prompt")
    example = Example(prompt + (("assistant", ""),), instruction=(row["prompt"], "") if plain else None,
                      where=where)
    return PromptRow(example, row["prompt"], fields, where)


# ShareGPT's speakers as chat roles (Unsloth's standardize_sharegpt reads the same)
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "system": "system"}
_FORM_FIELDS = ("messages", "conversations", "instruction", "output", "prompt", "completion",
                "chosen", "rejected")


def _sharegpt(turns, where: str) -> list:
    """ShareGPT's ``conversations`` as messages: ``from``/``value`` (or ``role``/``content``)."""
    if not isinstance(turns, list) or not turns:
        raise DataError(f"{where}: 'conversations' must be a non-empty list of "
                        "{'from': ..., 'value': ...} turns.")
    messages = []
    for i, turn in enumerate(turns):
        speaker = turn.get("from", turn.get("role")) if isinstance(turn, dict) else None
        text = turn.get("value", turn.get("content")) if isinstance(turn, dict) else None
        if speaker not in SHAREGPT_ROLES or not isinstance(text, str):
            raise DataError(f"{where}: conversations turn {i} must be an object with 'from' in "
                            f"{tuple(SHAREGPT_ROLES)} and a string 'value'; got {turn!r:.80}.")
        messages.append({"role": SHAREGPT_ROLES[speaker], "content": text})
    return messages


def _row_to_example(row, where: str) -> Example | Pair | PromptRow | TextRow:
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(row).__name__}.")
    if "text" in row and not any(k in row for k in _FORM_FIELDS):  # raw text, to continue pretraining
        if not isinstance(row["text"], str) or not row["text"]:
            raise DataError(f"{where}: 'text' must be a non-empty string (raw text to train on).")
        _check_text([row["text"]], where)
        return TextRow(row["text"], where)
    if row.get("input", "") is None or (isinstance(row.get("input"), float) and row["input"] != row["input"]):
        row = {k: v for k, v in row.items() if k != "input"}  # a table's empty cell: no input
    if "conversations" in row and "messages" not in row:
        row = {**row, "messages": _sharegpt(row["conversations"], where)}
    if "chosen" in row or "rejected" in row:
        return _row_to_pair(row, where)
    if "prompt" in row and "completion" in row:  # TRL's prompt-completion form: a row to imitate
        prompt = _row_to_prompt({"prompt": row["prompt"]}, where).example
        completion = _messages(row["completion"], where, "completion", ("assistant",), "assistant")
        if len(completion) != 1 or not completion[0][1]:
            raise DataError(f"{where}: 'completion' must be one non-empty assistant message (or a "
                            f"string); got {len(completion)} messages.")
        _check_text([completion[0][1]], where)
        return Example(prompt.messages[:-1] + completion, instruction=prompt.instruction, where=where)
    if "prompt" in row and not any(k in row for k in ("messages", "instruction", "output")):
        return _row_to_prompt(row, where)
    if "messages" in row:
        messages = row["messages"]
        if not isinstance(messages, list) or not messages:
            raise DataError(f"{where}: 'messages' must be a non-empty list of "
                            "{{'role': ..., 'content': ...}} objects.")
        for i, msg in enumerate(messages):
            if not isinstance(msg, dict) or msg.get("role") not in ROLES \
                    or not isinstance(msg.get("content"), str):
                raise DataError(f"{where}: message {i} must be an object with 'role' in "
                                f"{ROLES} and a string 'content'; got {msg!r:.80}.")
        pairs = [(msg["role"], msg["content"]) for msg in messages]
        if not any(role == "assistant" for role, _ in pairs):
            raise DataError(f"{where}: the conversation has no assistant message, so there is "
                            "nothing to learn from it. Add one or drop the row.")
        while pairs[-1][0] != "assistant":  # nothing to learn after the last answer
            pairs.pop()
        _check_text([content for _, content in pairs], where)
        return Example(tuple(pairs), where=where)
    missing = [k for k in ("instruction", "output") if k not in row]
    if missing:
        raise DataError(f"{where}: missing {' and '.join(repr(k) for k in missing)}. Rows need "
                        "'instruction' and 'output' (and optionally 'input'), 'messages', "
                        "'conversations', 'prompt' and 'completion', or 'text'; columns={...} "
                        "maps your column names onto these.")
    for key in ("instruction", "input", "output"):
        if key in row and not isinstance(row[key], str):
            hint = " Use \"\" (or leave it out) for no input." if key == "input" else ""
            raise DataError(f"{where}: {key!r} must be a string, got "
                            f"{type(row[key]).__name__}.{hint}")
    if not row["output"]:
        raise DataError(f"{where}: 'output' is empty, so there is nothing to learn from the row.")
    instruction, input = row["instruction"], row.get("input", "")
    _check_text([instruction, input, row["output"]], where)
    messages = (("user", _user_text(instruction, input)), ("assistant", row["output"]))
    return Example(messages, instruction=(instruction, input), where=where)


# Formats people reach for that are not JSON rows: named, with how to convert them.
_OTHER_FORMATS = {".arrow": "Arrow", ".xlsx": "Excel", ".xls": "Excel", ".pkl": "pickle",
                  ".pickle": "pickle"}
ACCEPTED = ("a .jsonl/.json/.parquet/.csv/.tsv file path, a save_to_disk folder, an "
            "hf://datasets/owner/name URL (a Hub dataset, or /file in it), a list of row dicts, a "
            "datasets.Dataset or DatasetDict, or nt.Data(path, split=, revision=, columns=)")
_SUFFIXES = (".jsonl", ".json", *sources.TABLES)


def _data_files(folder: Path) -> list[str]:
    return sorted(str(p) for p in folder.iterdir() if p.suffix.lower() in _SUFFIXES and p.is_file())


def _decode(path: Path, raw: bytes) -> str:
    """The file as text; where it is not UTF-8, which line and byte, and how to fix it."""
    try:
        return raw.decode("utf-8-sig")  # a UTF-8 byte-order mark, as some editors write, is fine
    except UnicodeDecodeError as err:
        if raw[:2] in (b"\xff\xfe", b"\xfe\xff"):
            found = " It starts with a UTF-16 byte-order mark: it was saved as UTF-16 ('Unicode')."
            line, column = 1, 1
        else:
            found = ""
            line = raw.count(b"\n", 0, err.start) + 1
            column = err.start - (raw.rfind(b"\n", 0, err.start) + 1) + 1
        raise DataError(
            f"{path}: line {line}, byte {column} of the line (offset {err.start} in the file): "
            f"byte 0x{raw[err.start]:02x} is not valid UTF-8, so the file is not UTF-8 text.{found} "
            "Save it as UTF-8 (in an editor: 'Save with encoding' > UTF-8; in Python: "
            "open(path, 'w', encoding='utf-8')), or convert it, e.g. "
            f"iconv -f latin1 -t utf-8 {path.name} > fixed.jsonl.") from err


def _check_lines(path: Path, raw: bytes) -> None:
    """Refuse a line longer than any row can use, before it is decoded or tokenized (one
    huge line is encoded whole by the tokenizer, whose memory grows with it)."""
    cap = files.limit("row_bytes")
    if len(raw) <= cap:
        return
    start, line = 0, 1
    while start < len(raw):
        end = raw.find(b"\n", start)
        end = len(raw) if end < 0 else end
        if end - start > cap:
            raise DataError(f"{path}: line {line} is {end - start:,} bytes, longer than any "
                            f"training row can use (limit {cap:,}: {files.LIMITS['row_bytes'][1]}). "
                            "Split or shorten it.")
        start, line = end + 1, line + 1


def _missing_file_hint(name: str) -> str:
    hint = (" Check the path." if Path(name).expanduser().is_absolute() else
            f" Check the path (a relative path starts from the current folder, {Path.cwd()}).")
    parts = name.split("/")
    if len(parts) == 2 and all(parts) and not Path(name).suffix and not name.startswith((".", "~")):
        hint += (f" If {name!r} is a Hub dataset id, pass 'hf://datasets/{name}' (its train split; "
                 f"nt.Data('hf://datasets/{name}', split='test') for another) or "
                 f"'hf://datasets/{name}/<file>.jsonl' for one file.")
    return hint


def _json_lines(path: Path, text: str):
    """(where, row) for each line of a JSON Lines text, parsed as it is reached."""
    # JSON Lines ends a line at \n only (str.splitlines would also cut at U+2028, which
    # JSON allows inside strings).
    for lineno, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise DataError(f"{path}: line {lineno}: not valid JSON ({err.msg} at column "
                            f"{err.colno}). Each line must be one JSON object.") from err
        except RecursionError:
            raise DataError(f"{path}: line {lineno}: nested deeper than any data row is; "
                            "the line is damaged.") from None
        yield f"{path}: line {lineno}", row


def load_examples(path: str | Path, columns=None, split: str | None = None) -> list:
    """Read a .jsonl (one row per line), .json (a list of rows), .parquet, .csv or .tsv file, or
    a ``save_to_disk`` folder (its ``split``); ``columns`` maps nbtune's fields to its columns."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"{path}: no such data file.{_missing_file_hint(str(path))}")
    if sources.is_disk_dataset(path):
        return _from_rows(sources.load_disk(path, split, str(path)), columns, str(path))
    if path.is_dir():
        inside = _data_files(path)
        hint = (f" It holds {', '.join(repr(p) for p in inside[:5])}"
                f"{' ...' if len(inside) > 5 else ''}: pass one of them." if inside else
                " It holds no data file (.jsonl, .json, .parquet, .csv).")
        raise DataError(f"{path} is a folder, not a data file or a save_to_disk folder: give a "
                        f".jsonl, .json, .parquet or .csv file.{hint}")
    if path.suffix.lower() in _OTHER_FORMATS:
        kind = _OTHER_FORMATS[path.suffix.lower()]
        raise DataError(f"{path}: a {kind} file, but nbtune reads .jsonl, .json, .parquet or .csv "
                        "rows. Convert it (pandas: df.to_parquet('data.parquet')), or load it with "
                        "datasets.load_dataset and pass the Dataset (ds['train']).")
    if path.suffix.lower() == ".parquet":
        names, rows = sources.parquet_rows(path)
        sources.missing_columns(columns, names, str(path))
        return _converted(rows, columns, str(path))
    try:
        raw = files.read_bytes(path, "data", "data_bytes")  # a pipe or device is refused, not read
    except files.FileRefused as err:
        raise DataError(str(err)) from None
    except OSError as err:
        raise DataError(f"{path}: cannot read the data file ({err.strerror or err}). Check that "
                        "it is a readable file.") from err
    listed = path.suffix.lower() == ".json"  # rows.JSON too: suffixes match without case
    if not listed:  # JSON Lines (and CSV): one row a line (a .json list may be one line)
        _check_lines(path, raw)
    text = _decode(path, raw)
    if path.suffix.lower() in (".csv", ".tsv"):
        names, rows = sources.csv_rows(path, text)
        sources.missing_columns(columns, names, str(path))
        return _converted(rows, columns, str(path))
    if listed:
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as err:
            raise DataError(f"{path}: line {err.lineno}: not valid JSON ({err.msg}).") from err
        except RecursionError:
            raise DataError(f"{path}: nested deeper than any data row is; the file is damaged.") from None
        if not isinstance(rows, list):
            lists = [k for k, v in rows.items() if isinstance(v, list)] if isinstance(rows, dict) else []
            hint = (f" It holds an object whose {', '.join(map(repr, lists))} "
                    f"{'is a list' if len(lists) == 1 else 'are lists'}: write that list alone to "
                    "the file, or pass it as the data." if lists else "")
            raise DataError(f"{path}: a .json data file must hold a list of rows.{hint}")
        examples = _converted(((f"{path}: row {i + 1}", row) for i, row in enumerate(rows)), columns,
                              str(path), from_file=True)
    else:
        examples = _converted(_json_lines(path, text), columns, str(path), from_file=True)
    if not examples:
        raise DataError(f"{path}: the file holds no rows.")
    return _one_kind(examples, str(path))


def _cap(text: str) -> str:
    """``text`` to start a sentence ("the data" -> "The data")."""
    return text[:1].upper() + text[1:]


def _refuse(data, source: str) -> DataError:
    """The error for data of a kind nbtune does not read, with what to pass instead."""
    kind = type(data).__name__
    module = type(data).__module__.split(".")[0]
    if module == "pandas" or (hasattr(data, "columns") and hasattr(data, "iloc")):
        fix = " Pass df.to_dict('records') (a list of row dicts), or save it as JSONL first."
    elif isinstance(data, Mapping):
        looks_like_row = "messages" in data or "instruction" in data or "chosen" in data
        fix = (" It looks like one row: wrap it in a list, [row]." if looks_like_row else
               " Give its list of rows instead of the dict itself.")
    elif isinstance(data, Example):
        fix = " It is a single Example: wrap it in a list, [example]."
    elif isinstance(data, (bytes, bytearray)):
        fix = " Decode it and write it to a .jsonl file, or pass the rows as a list of dicts."
    elif data is None:
        return DataError(f"{_cap(source)}: no data was given (None). Pass {ACCEPTED}.")
    else:
        fix = ""
    name = kind if module in ("builtins", "nbtune") else f"{module}.{kind}"
    return DataError(f"{_cap(source)} has type {name}, which nbtune cannot read rows from.{fix} "
                     f"Pass {ACCEPTED}.")


_FORMS = ("'instruction' and 'output' (and optionally 'input'), 'messages', 'conversations' "
          "(ShareGPT), 'prompt' with 'completion' or 'chosen' and 'rejected', or 'text' (raw text)")


def _dataset_columns(columns: list, mapping, source: str) -> None:
    """A table whose columns, once mapped, make no row form: its columns and the fix, up front."""
    if not isinstance(columns, (list, tuple)) or not columns:
        return  # not a plain Dataset, or empty: the rows themselves tell
    sources.missing_columns(mapping, columns, source)
    named = set(columns) - set((mapping or {}).values()) | set(mapping or {})
    if named & {"messages", "conversations", "prompt", "text"} or {"instruction", "output"} <= named:
        return
    raise DataError(f"{_cap(source)} has columns {', '.join(map(repr, columns))}, but nbtune needs "
                    f"{_FORMS}. Name yours with columns=, e.g. "
                    "nt.Data(ds, columns={'instruction': 'question', 'output': 'answer'}).")


def _converted(rows, columns, source: str, from_file: bool = False) -> list:
    """(where, row) pairs as nbtune's rows, each row's columns mapped first. ``from_file``: a
    JSON file's rows, where a row that is not an object is said in JSON's words and no rows
    at all is the caller's to say."""
    examples = []
    for where, row in rows:
        if isinstance(row, (Example, Pair, PromptRow, TextRow)):
            examples.append(row)
        elif from_file and not isinstance(row, Mapping):
            examples.append(_row_to_example(row, where))  # "expected a JSON object"
        elif isinstance(row, Mapping):
            examples.append(converted_row(row, columns, where))
        else:
            raise DataError(f"{_cap(where)} has type {type(row).__name__} ({row!r:.60}); each row "
                            "must be a dict ('instruction' and 'output', or 'messages') or an "
                            "nbtune Example.")
    if not from_file and not examples:
        raise DataError(f"{_cap(source)} holds no rows: give at least one.")
    return _one_kind(examples, source) if examples else examples


def converted_row(row: Mapping, columns, where: str):
    """One row dict as nbtune's row, its columns mapped first."""
    if not isinstance(row, Mapping):
        return _row_to_example(row, where)  # "expected a JSON object"
    row = dict(row)
    if columns:  # a row may leave its optional input out, as unmapped rows may
        sources.missing_columns({f: c for f, c in columns.items() if f != "input"}, row, where)
    return _row_to_example(sources.mapped(row, columns), where)


def _from_rows(data, columns, source: str) -> list:
    """Rows from a list or a Dataset (its columns and size checked first, each row's too)."""
    table = hasattr(data, "column_names")
    if table:
        _dataset_columns(data.column_names, columns, source)
        sources.check_table(data, source)

    def rows():
        for i, row in enumerate(data):
            where = f"{source}: row {i + 1}"
            if table and isinstance(row, Mapping):
                sources.row_size(row, where)
            yield where, row
    return _converted(rows(), columns, source)


def examples_from(data, source: str = "the data") -> list:
    """Rows from a path, an ``hf://datasets/...`` URL, row dicts, Examples, a datasets.Dataset
    or DatasetDict, or an ``nt.Data`` saying where and how (split, revision, columns).

    ``source`` names the data in errors (``"the held-out data"``). Anything else, and no
    rows at all, raise ``DataError`` saying what to pass instead.
    """
    spec = data if isinstance(data, Data) else Data(data)
    if spec.streaming:
        raise DataError(f"{_cap(source)}: streaming=True is for the training rows (read as training "
                        "goes); these are read whole: leave streaming out.")
    data, columns, split = spec.path, spec.columns, spec.split
    if isinstance(data, str):
        text = data.strip()
        if "\n" in text or text.startswith(("{", "[")):
            shown = f"{text[:40]!r}{'...' if len(text) > 40 else ''}"
            raise DataError(f"{_cap(source)} is a string that holds text ({shown}), not a file "
                            f"path. Write the rows to a .jsonl file and pass its path, or pass the "
                            "rows as a list of dicts.")
        hub = sources.hub_dataset(text)
        if hub is not None:
            repo_id, revision = hub
            if revision and spec.revision and revision != spec.revision:
                raise DataError(f"{data!r} names revision {revision!r} but revision={spec.revision!r} "
                                "was given too: give one.")
            loaded = sources.load_hub(repo_id, revision or spec.revision, split, source)
            return _from_rows(loaded, columns, f"{source} ({repo_id})")
        return load_examples(resolve_data_file(data, spec.revision), columns, split)
    if isinstance(data, os.PathLike):
        return load_examples(resolve_data_file(data), columns, split)
    if isinstance(data, Mapping) and data and all(hasattr(v, "column_names") for v in data.values()):
        data = sources.pick_split(data, split, source)  # a DatasetDict
    elif hasattr(data, "column_names"):
        data = sources.pick_split(data, split, source)  # a Dataset: the split asked for, if it knows its own
    if isinstance(data, (Mapping, bytes, bytearray, Example)) or data is None \
            or not isinstance(data, Iterable) or hasattr(data, "iloc"):
        raise _refuse(data, source)
    return _from_rows(data, columns, source)


_KINDS = {Example: "instruction or chat rows", TextRow: "raw text ('text')", Pair: "preference pairs ('prompt', 'chosen', 'rejected')",
          PromptRow: "prompts (rows with a 'prompt' alone)"}


def _one_kind(examples: list, source: str) -> list:
    """Preference pairs, prompts and rows to imitate do not mix: a run trains for one objective."""
    kinds = [type(e) for e in examples]
    if any(kind is not kinds[0] for kind in kinds):
        first = next(e for e in examples if type(e) is not kinds[0])
        raise DataError(f"{_cap(source)} mixes {_KINDS[kinds[0]]} with {_KINDS[type(first)]} "
                        f"({first.where or 'a row'} is the first that differs from row 1): a run "
                        f"trains for one objective. Keep one kind.")
    return examples
