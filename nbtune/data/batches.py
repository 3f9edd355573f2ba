"""Token ids: rows tokenized with the prompt masked out of the loss, packed, collated and
streamed in shuffled batches (a preference pair as two rows, chosen then rejected; GRPO's
prompts as their ids alone, the completions made in the step)."""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass

import torch

from ..models.tokenizer import Tokenizer
from .rows import (IGNORE, DataError, Example, Pair, PromptRow, TextRow, alpaca_fields, chat_spans,
                   format_prompt, prompt_and_reference, prompt_ids, with_bos)


@dataclass(frozen=True)
class Sample:
    input_ids: torch.Tensor  # [T] tokens the model reads
    labels: torch.Tensor  # [T] next token to predict, IGNORE where not trained
    document_ids: torch.Tensor | None = None  # [T] which example each token is from (packed)
    positions: torch.Tensor | None = None  # [T] position within its own example (packed)


def tokenize(example: Example, tokenizer: Tokenizer, seq_len: int,
             last_only: bool = False) -> Sample | None:
    """Token ids and shifted labels, cut to ``seq_len``; None if no trained token survives.
    ``last_only``: only the last assistant turn is trained (a preference pair's completion,
    not the assistant turns of its prompt)."""
    if tokenizer.chat_template is not None:
        text, spans = chat_spans(example, tokenizer)
        spans = spans[-1:] if last_only else spans
        eos = []  # the template writes each turn's end itself
    else:
        prompt = format_prompt(*alpaca_fields(example))
        text = prompt + example.messages[-1][1]
        spans, eos = [(len(prompt), len(text))], [tokenizer.eos_id]
    # The whole text is encoded at once, as transformers does; a token is trained when it
    # starts inside an assistant span. A text far longer than seq_len tokens can hold is cut
    # first (no token is longer than the longest in the vocabulary), so one huge row is not
    # encoded whole: the tokenizer's memory grows with it and can abort the process.
    text = text[:(seq_len + 2) * tokenizer.longest_token + 4096]
    ids, offsets = tokenizer.encode_with_offsets(text)
    trained = _starts_within([start for start, _ in offsets], spans)
    trained += [True] * len(eos)
    ids = with_bos(tokenizer, ids + eos)
    trained = [False] * (len(ids) - len(trained)) + trained
    ids, trained = ids[: seq_len + 1], trained[: seq_len + 1]
    # Position t predicts token t + 1.
    labels = [tok if keep else IGNORE for tok, keep in zip(ids[1:], trained[1:])]
    if all(label == IGNORE for label in labels):
        return None
    return Sample(torch.tensor(ids[:-1]), torch.tensor(labels))


def _starts_within(starts: list[int], spans: list[tuple[int, int]]) -> list[bool]:
    """Whether each token (by the character it starts at) starts inside one of ``spans``.
    A tokenizer's starts never go back, so each span is a run of tokens found by bisection
    (a per-token test of every span was a fifth of a dataset's tokenizing time)."""
    if starts != sorted(starts):  # (never seen; the plain test then)
        return [any(lo <= start < hi for lo, hi in spans) for start in starts]
    trained = [False] * len(starts)
    for lo, hi in spans:
        first, end = bisect_left(starts, lo), bisect_left(starts, hi)
        trained[first:end] = [True] * (end - first)
    return trained


def tokenize_text(row: TextRow, tokenizer: Tokenizer, seq_len: int) -> list[Sample]:
    """Raw text as pieces of at most ``seq_len`` tokens that train on every token of it once:
    BOS first, EOS last, each piece predicting the token after its last from the next piece's
    first (continued pretraining, as a base model was trained)."""
    ids = with_bos(tokenizer, tokenizer.encode(row.text))
    ids += [tokenizer.eos_id] if tokenizer.eos_id is not None else []
    ends = [(start, min(start + seq_len, len(ids) - 1)) for start in range(0, len(ids) - 1, seq_len)]
    return [Sample(torch.tensor(ids[start:end]), torch.tensor(ids[start + 1:end + 1])) for start, end in ends]


def tokenize_all(examples: list, tokenizer: Tokenizer, seq_len: int,
                 source: str = "the data", last_only: bool = False) -> tuple[list[Sample], int]:
    """Tokenize every example; returns the samples and how many were dropped as too long.
    ``last_only``: only each example's last assistant turn trained (``tokenize``); raw text
    becomes as many pieces as its tokens need (``tokenize_text``), none dropped."""
    samples = []
    for ex in examples:
        if isinstance(ex, TextRow):
            samples.extend(tokenize_text(ex, tokenizer, seq_len))
        else:
            samples.append(tokenize(ex, tokenizer, seq_len, last_only))
    kept = [s for s in samples if s is not None]
    if examples and not kept:
        raise DataError(f"Every row of {source} is longer than seq_len={seq_len} before its "
                        "response starts, so nothing is left to train on. Raise seq_len.")
    return kept, len(samples) - len(kept)


def tokenize_pairs(pairs: list[Pair], tokenizer: Tokenizer, seq_len: int,
                   source: str = "the data") -> tuple[list[tuple[Sample, Sample]], int]:
    """Each pair as (chosen, rejected) samples with only the completion trained; returns them
    and how many pairs were dropped (a completion with no token within ``seq_len``)."""
    kept = []
    for pair in pairs:
        sides = (tokenize(pair.chosen, tokenizer, seq_len, last_only=True),
                 tokenize(pair.rejected, tokenizer, seq_len, last_only=True))
        if None not in sides:
            kept.append(sides)
    if pairs and not kept:
        raise DataError(f"Every pair of {source} has a prompt longer than seq_len={seq_len}, so "
                        "no completion is left to compare. Raise seq_len.")
    return kept, len(pairs) - len(kept)


@dataclass(frozen=True)
class PromptSample:
    """GRPO's sample: a prompt's ids and which training row it is (the rewards read its fields)."""

    input_ids: torch.Tensor  # [P]
    row: int


def tokenize_prompts(rows: list[PromptRow], tokenizer: Tokenizer, seq_len: int, completion: int,
                     source: str = "the data") -> tuple[list[PromptSample], int]:
    """Each prompt's ids as generation starts from them (the chat template's generation prompt
    included), kept when ``completion`` more tokens fit within ``seq_len``; returns them and
    how many were dropped as too long."""
    kept = []
    room = seq_len + 1 - completion  # a row of prompt + completion reads all but its last token
    for i, row in enumerate(rows):
        text, _ = prompt_and_reference(row.example, tokenizer)
        ids = prompt_ids(tokenizer, text[:(room + 2) * tokenizer.longest_token + 4096])
        if len(ids) <= room:
            kept.append(PromptSample(torch.tensor(ids), i))
    if rows and not kept:
        raise DataError(f"Every prompt of {source} is too long: seq_len={seq_len} leaves room for "
                        f"{max(room, 0)} prompt tokens once max_completion={completion} are kept for the "
                        "completion. Raise seq_len or lower max_completion.")
    return kept, len(rows) - len(kept)


def collate_prompts(samples: list[PromptSample], pad_id: int) -> dict[str, torch.Tensor]:
    """B prompts: their ids padded on the right [B, P], their lengths [B] and rows [B]."""
    longest = max(len(s.input_ids) for s in samples)
    ids = torch.full((len(samples), longest), pad_id, dtype=torch.long)
    for i, s in enumerate(samples):
        ids[i, :len(s.input_ids)] = s.input_ids
    return {"prompt_ids": ids, "prompt_lengths": torch.tensor([len(s.input_ids) for s in samples]),
            "rows": torch.tensor([s.row for s in samples])}


def collate_pairs(pairs: list[tuple[Sample, Sample]], pad_id: int) -> dict[str, torch.Tensor]:
    """B pairs as one batch of 2B rows: the chosen completions, then the rejected ones."""
    return collate([c for c, _ in pairs] + [r for _, r in pairs], pad_id)


def pack(samples: list[Sample], seq_len: int) -> list[Sample]:
    """Concatenate consecutive samples into rows of at most ``seq_len`` tokens.

    Each row records which example every token came from and its position inside that
    example, so attention can be limited to the example and rotary positions restart:
    the loss is the same as unpacked, with no compute spent on padding.
    """
    return list(packed(samples, seq_len))


def packed(samples, seq_len: int):
    """``pack`` as it goes: each row once it is full (a stream's samples, ``streaming.py``)."""
    group: list[Sample] = []
    used = 0
    for sample in samples:
        if group and used + len(sample.input_ids) > seq_len:
            yield _packed_row(group)
            group, used = [], 0
        group.append(sample)
        used += len(sample.input_ids)
    if group:
        yield _packed_row(group)


def _packed_row(group: list[Sample]) -> Sample:
    return Sample(torch.cat([s.input_ids for s in group]), torch.cat([s.labels for s in group]),
                  document_ids=torch.cat([torch.full_like(s.input_ids, i) for i, s in enumerate(group)]),
                  positions=torch.cat([torch.arange(len(s.input_ids)) for s in group]))


def collate(samples: list[Sample], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad to the longest sample: input_ids and labels [B, T] (and, packed, the
    document ids and positions; padding is its own document -1)."""
    longest = max(len(s.input_ids) for s in samples)
    fill = {"input_ids": pad_id, "labels": IGNORE}
    if samples[0].document_ids is not None:
        fill.update(document_ids=-1, positions=0)
    batch = {name: torch.full((len(samples), longest), value, dtype=torch.long)
             for name, value in fill.items()}
    for row, sample in enumerate(samples):
        for name, tensor in batch.items():
            values = getattr(sample, name)
            tensor[row, : len(values)] = values
    return batch


NO_TRAINING_DATA = ("This session has no training rows: it was made without data (to chat, "
                    "evaluate or save). To train, make it with data: nt.Session.from_pretrained("
                    "model, 'train.jsonl') (a JSONL path, rows or a datasets.Dataset).")


class BatchStream:
    """Endless shuffled batches, reshuffled each epoch from a seed; position is plain data."""

    def __init__(self, samples: list, batch_size: int, pad_id: int, seed: int = 0,
                 collate=collate) -> None:
        """``samples``: ``Sample``s, or (chosen, rejected) pairs with ``collate_pairs``."""
        self.samples, self.batch_size, self.pad_id, self.seed = samples, batch_size, pad_id, seed
        self.collate = collate
        # pairs with a precomputed reference: [samples, 2] log-probs (chosen, rejected), each
        # batch's as "reference_logps" [2B] in its rows' order (set by the trainer, which has the model)
        self.reference_logps: torch.Tensor | None = None
        self.epoch, self.position = 0, 0
        self._order = self._shuffle()

    def _shuffle(self) -> list[int]:
        gen = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(len(self.samples), generator=gen).tolist()

    def continue_from(self, previous: "BatchStream") -> None:
        """Carry on where ``previous`` stopped, if both walk the same rows in the same order."""
        if previous.seed == self.seed and len(previous.samples) == len(self.samples):
            self.epoch, self.position, self._order = previous.epoch, previous.position, previous._order

    def state_dict(self) -> dict:
        """Where the stream stands: the order is remade from ``seed`` and ``epoch``."""
        return {"seed": self.seed, "epoch": self.epoch, "position": self.position,
                "samples": len(self.samples)}

    def check_state(self, state: dict) -> None:
        """Refuse a position taken on other data or another seed, before anything changes."""
        if "streamed" in state:
            raise DataError(f"The saved data position is in a streamed file ({state['streamed'][0]}); "
                            "this session reads its rows whole: resume with the same data, "
                            "nt.Data(path, streaming=True).")
        if (state.get("seed"), state.get("samples")) != (self.seed, len(self.samples)):
            raise DataError(
                f"The saved data position is for {state.get('samples')} samples with seed "
                f"{state.get('seed')}; this session has {len(self.samples)} with seed {self.seed}: "
                "resume with the same data (the same rows, seq_len, packing and seed).")
        if not 0 <= state.get("position", -1) <= len(self.samples) or state.get("epoch", -1) < 0:
            raise DataError(f"The saved data position {state} is outside the data.")

    def load_state_dict(self, state: dict) -> None:
        self.check_state(state)
        moved = state["epoch"] != self.epoch
        self.epoch, self.position = state["epoch"], state["position"]
        if moved:
            self._order = self._shuffle()

    def copy(self) -> "BatchStream":
        """The same samples and shape at the same position, to move independently."""
        other = BatchStream.__new__(BatchStream)
        other.__dict__.update(self.__dict__)
        return other

    def next(self) -> dict[str, torch.Tensor]:
        if not self.samples:
            raise DataError(NO_TRAINING_DATA)
        picked = []
        while len(picked) < self.batch_size:
            if self.position == len(self._order):
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._shuffle()
            picked.append(self._order[self.position])
            self.position += 1
        batch = self.collate([self.samples[i] for i in picked], self.pad_id)
        if self.reference_logps is not None:
            chosen_rejected = self.reference_logps[picked]
            batch["reference_logps"] = torch.cat([chosen_rejected[:, 0], chosen_rejected[:, 1]])
        return batch
