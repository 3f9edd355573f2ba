"""Training data: instruction and chat rows -> token ids with the prompt masked out of the loss.

Row formats (JSONL, one object per line, or a .json file holding a list):

* instruction: ``{"instruction": ..., "input": ... (optional), "output": ...}``
* chat: ``{"messages": [{"role": "system"|"user"|"assistant", "content": ...}, ...]}``

Only response tokens (the ``output``, or the assistant messages) and the end-of-sequence
token after each are trained on; everything else gets the label ``IGNORE``.
Truncation policy: sequences longer than ``seq_len`` are cut on the right; a row left with
no response tokens is dropped and counted.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from .models.tokenizer import Tokenizer

IGNORE = -100  # label of positions that do not count in the loss
PROMPT = "### Instruction:\n{instruction}\n\n### Response:\n"
PROMPT_WITH_INPUT = "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
ROLES = ("system", "user", "assistant")


class DataError(ValueError):
    """A data file or row that cannot be used, with where and why."""


@dataclass(frozen=True)
class Example:
    """One training row as text pieces; ``trained`` pieces are the ones the loss sees.

    A trained piece is followed by the end-of-sequence token, also trained, so the model
    learns to stop.
    """

    pieces: tuple[tuple[str, bool], ...]

    @property
    def prompt(self) -> str:
        """Everything before the last response: what generation is given."""
        last = max(i for i, (_, trained) in enumerate(self.pieces) if trained)
        return "".join(text for text, _ in self.pieces[:last])

    @property
    def reference(self) -> str:
        """The last response: what generation should produce."""
        return [text for text, trained in self.pieces if trained][-1]


def format_prompt(instruction: str, input: str = "") -> str:
    """The prompt an instruction row is trained with (and generation is given)."""
    if input:
        return PROMPT_WITH_INPUT.format(instruction=instruction, input=input)
    return PROMPT.format(instruction=instruction)


def _row_to_example(row, where: str) -> Example:
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(row).__name__}.")
    if "messages" in row:
        messages = row["messages"]
        if not isinstance(messages, list) or not messages:
            raise DataError(f"{where}: 'messages' must be a non-empty list of "
                            "{{'role': ..., 'content': ...}} objects.")
        pieces = []
        for i, msg in enumerate(messages):
            if not isinstance(msg, dict) or msg.get("role") not in ROLES \
                    or not isinstance(msg.get("content"), str):
                raise DataError(f"{where}: message {i} must be an object with 'role' in "
                                f"{ROLES} and a string 'content'; got {msg!r:.80}.")
            header = f"### {msg['role'].capitalize()}:\n"
            if msg["role"] == "assistant":
                pieces += [(header, False), (msg["content"], True), ("\n\n", False)]
            else:
                pieces.append((header + msg["content"] + "\n\n", False))
        if not any(trained for _, trained in pieces):
            raise DataError(f"{where}: the conversation has no assistant message, so there is "
                            "nothing to learn from it. Add one or drop the row.")
        while pieces and not pieces[-1][1]:  # nothing to learn after the last answer
            pieces.pop()
        return Example(tuple(pieces))
    missing = [k for k in ("instruction", "output") if k not in row]
    if missing:
        raise DataError(f"{where}: missing {' and '.join(repr(k) for k in missing)}. Rows need "
                        "'instruction' and 'output' (and optionally 'input'), or 'messages'.")
    for key in ("instruction", "input", "output"):
        if key in row and not isinstance(row[key], str):
            raise DataError(f"{where}: {key!r} must be a string, got {type(row[key]).__name__}.")
    if not row["output"]:
        raise DataError(f"{where}: 'output' is empty, so there is nothing to learn from the row.")
    prompt = format_prompt(row["instruction"], row.get("input", ""))
    return Example(((prompt, False), (row["output"], True)))


def load_examples(path: str | Path) -> list[Example]:
    """Read a .jsonl (one row per line) or .json (a list of rows) file."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"{path}: no such data file.")
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json":
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as err:
            raise DataError(f"{path}: line {err.lineno}: not valid JSON ({err.msg}).") from err
        if not isinstance(rows, list):
            raise DataError(f"{path}: a .json data file must hold a list of rows.")
        examples = [_row_to_example(row, f"{path}: row {i + 1}") for i, row in enumerate(rows)]
    else:
        examples = []
        for lineno, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(f"{path}: line {lineno}: not valid JSON ({err.msg} at column "
                                f"{err.colno}). Each line must be one JSON object.") from err
            examples.append(_row_to_example(row, f"{path}: line {lineno}"))
    if not examples:
        raise DataError(f"{path}: the file holds no rows.")
    return examples


@dataclass(frozen=True)
class Sample:
    input_ids: torch.Tensor  # [T] tokens the model reads
    labels: torch.Tensor  # [T] next token to predict, IGNORE where not trained


def tokenize(example: Example, tokenizer: Tokenizer, seq_len: int) -> Sample | None:
    """Token ids and shifted labels, cut to ``seq_len``; None if no trained token survives."""
    ids: list[int] = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
    trained: list[bool] = [False] * len(ids)
    for text, is_response in example.pieces:
        piece = tokenizer.encode(text)
        if is_response:
            piece = piece + [tokenizer.eos_id]
        ids += piece
        trained += [is_response] * len(piece)
    ids, trained = ids[: seq_len + 1], trained[: seq_len + 1]
    # Position t predicts token t + 1.
    labels = [tok if keep else IGNORE for tok, keep in zip(ids[1:], trained[1:])]
    if all(label == IGNORE for label in labels):
        return None
    return Sample(torch.tensor(ids[:-1]), torch.tensor(labels))


def tokenize_all(examples: list[Example], tokenizer: Tokenizer, seq_len: int,
                 source: str = "the data") -> tuple[list[Sample], int]:
    """Tokenize every example; returns the samples and how many were dropped as too long."""
    samples = [tokenize(ex, tokenizer, seq_len) for ex in examples]
    kept = [s for s in samples if s is not None]
    if not kept:
        raise DataError(f"Every row of {source} is longer than seq_len={seq_len} before its "
                        "response starts, so nothing is left to train on. Raise seq_len.")
    return kept, len(samples) - len(kept)


def collate(samples: list[Sample], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad to the longest sample: input_ids and labels [B, T]."""
    longest = max(len(s.input_ids) for s in samples)
    input_ids = torch.full((len(samples), longest), pad_id, dtype=torch.long)
    labels = torch.full((len(samples), longest), IGNORE, dtype=torch.long)
    for row, sample in enumerate(samples):
        input_ids[row, : len(sample.input_ids)] = sample.input_ids
        labels[row, : len(sample.labels)] = sample.labels
    return {"input_ids": input_ids, "labels": labels}


class BatchStream:
    """Endless shuffled batches, reshuffled each epoch from a seed; position is plain data."""

    def __init__(self, samples: list[Sample], batch_size: int, pad_id: int, seed: int = 0) -> None:
        self.samples, self.batch_size, self.pad_id, self.seed = samples, batch_size, pad_id, seed
        self.epoch, self.position = 0, 0
        self._order = self._shuffle()

    def _shuffle(self) -> list[int]:
        gen = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(len(self.samples), generator=gen).tolist()

    def continue_from(self, previous: "BatchStream") -> None:
        """Carry on where ``previous`` stopped, if both walk the same rows in the same order."""
        if previous.seed == self.seed and len(previous.samples) == len(self.samples):
            self.epoch, self.position, self._order = previous.epoch, previous.position, previous._order

    def next(self) -> dict[str, torch.Tensor]:
        picked = []
        while len(picked) < self.batch_size:
            if self.position == len(self._order):
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._shuffle()
            picked.append(self.samples[self._order[self.position]])
            self.position += 1
        return collate(picked, self.pad_id)
