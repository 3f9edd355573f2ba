"""Training data: rows (``rows.py``: the formats; ``sources.py``: Parquet, CSV, Datasets and the
Hub, with a column mapping) turned into
token ids with the prompt masked out of the loss (``batches.py``), and ``TrainingData``, which
holds a run's rows, held-out rows and tokenizer and makes its batch stream."""

from __future__ import annotations

from ..models.tokenizer import Tokenizer
from .batches import (NO_TRAINING_DATA, BatchStream, PromptSample, Sample, collate, collate_pairs,
                      collate_prompts, pack, tokenize, tokenize_all, tokenize_pairs, tokenize_prompts,
                      tokenize_text)
from .streaming import StreamedBatches, StreamedRows, read_rows
from .rows import (ACCEPTED, IGNORE, PROMPT, PROMPT_WITH_INPUT, ROLES, Data, DataError, Example, Pair,
                   PromptRow, TextRow, as_prompt, check_renderable, examples_from, format_prompt, load_examples,
                   prompt_and_reference, prompt_ids, prompt_text)

__all__ = ["ACCEPTED", "IGNORE", "NO_TRAINING_DATA", "PROMPT", "PROMPT_WITH_INPUT", "ROLES", "BatchStream",
           "Data", "DataError", "Example", "Pair", "PromptRow", "PromptSample", "Sample", "StreamedBatches", "StreamedRows", "TextRow", "read_rows",
           "TrainingData", "as_prompt",
           "check_renderable", "collate", "collate_pairs", "collate_prompts", "examples_from", "format_prompt",
           "load_examples", "pack", "prompt_and_reference", "prompt_ids", "prompt_text", "tokenize",
           "tokenize_all", "tokenize_pairs", "tokenize_prompts", "tokenize_text"]


class TrainingData:
    """A run's data in one place: the training rows, the held-out rows and the tokenizer that
    turns them into batches. The trainer holds it and asks it for a stream or the evaluation
    batches of a batch shape; what it has to say (rows skipped) comes back with the stream."""

    def __init__(self, train, tokenizer: Tokenizer, heldout=None) -> None:
        # None: chat, save only; nt.Data(..., streaming=True): read as training goes
        self.train = read_rows(train) if train is not None else []
        self.heldout = examples_from(heldout, "the held-out data") if heldout is not None else []
        self.tokenizer = tokenizer
        self.rewards: tuple = ()  # GRPO's reward functions (``objectives.grpo.Reward``), set by the user
        self._eval: tuple | None = None  # (seq_len, batch_size), batches: the last made
        self._samples: tuple | None = None  # (key, rows, tokenizer, samples, dropped): the last (``_made``)

    @property
    def pad_id(self) -> int:
        return self.tokenizer.pad_id

    @property
    def text(self) -> bool:
        """Whether the rows are raw text (continued pretraining: every token trained)."""
        return bool(self.train) and isinstance(self.train[0], TextRow)

    @property
    def streamed(self) -> bool:
        """Whether the training rows are read as training goes (``nt.Data(streaming=True)``)."""
        return isinstance(self.train, StreamedRows)

    @property
    def pairs(self) -> bool:
        """Whether the rows are preference pairs (for a preference objective)."""
        return bool(self.train) and isinstance(self.train[0], Pair)

    def prompt_row(self, index: int) -> PromptRow:
        """Training row ``index`` as a prompt, its fields for GRPO's reward functions."""
        return as_prompt(self.train[index])

    def check_rows(self) -> None:
        """Refuse to train a session made without training rows (``DataError``)."""
        if not self.train:
            raise DataError(NO_TRAINING_DATA)

    def problems(self, t) -> list[str]:
        """What this data cannot do for techniques ``t``, in words (nothing: [])."""
        out = []
        if t.eval_every and not self.heldout:
            out.append("eval_every needs held-out rows: create the session with heldout=... "
                       "(a JSONL path or rows), or leave eval_every=0.")
        if t.paired and t.eval_every and self.heldout and not isinstance(self.heldout[0], Pair):
            out.append(f"eval_every under objective={t.objective!r} scores held-out pairs, but the "
                       "held-out rows are instruction or chat rows: give held-out pairs (prompt, "
                       "chosen, rejected), or set eval_every=0.")
        prompts = bool(self.train) and isinstance(self.train[0], PromptRow)
        if self.streamed and t.objective != "sft":
            out.append(f"Streamed rows train with objective='sft'; objective={t.objective!r} needs "
                       "every row at hand: read the data whole (leave streaming out).")
        elif self.text and t.objective != "sft":
            out.append(f"These rows are raw text ('text'), which trains every token (objective='sft'); "
                       f"objective={t.objective!r} needs {'prompts' if t.objective == 'grpo' else 'pairs'}: "
                       "set objective='sft', or give rows of that form.")
        elif prompts and t.objective != "grpo":
            out.append(f"These rows are prompts alone (no answer to imitate or compare), which only "
                       f"objective='grpo' trains on (its completions are generated and rewarded): "
                       f"set objective='grpo', or give rows with answers for {t.objective!r}.")
        elif self.train and not self.pairs and t.paired:
            out.append(f"objective={t.objective!r} trains on preference pairs (rows with 'prompt', "
                       "'chosen' and 'rejected'), but these rows are instruction or chat rows: give "
                       "pairs, or set objective='sft'.")
        return out

    def stream(self, t) -> tuple[BatchStream, list[str]]:
        """The training batches for ``t``'s seq_len, packing, batch size and seed, and the
        notes the user should read (rows skipped for want of room). Pairs: ``batch_size``
        pairs a batch, chosen rows then rejected; under ``sft`` the chosen completions alone
        (supervised finetuning on the preferred answers, the usual start before DPO)."""
        if t.objective == "grpo":
            prompts, dropped = self._made(("prompts", t.seq_len, t.max_completion), lambda: tokenize_prompts(
                [as_prompt(row) for row in self.train], self.tokenizer, t.seq_len, t.max_completion,
                "the training data"))
            notes = [f"{dropped} of {len(self.train)} prompts leave less than max_completion="
                     f"{t.max_completion} tokens within seq_len={t.seq_len} and are skipped; raise "
                     "seq_len to keep them."] if dropped else []
            return BatchStream(prompts, t.batch_size, self.pad_id, seed=t.seed, collate=collate_prompts), notes
        if self.pairs and t.paired:
            pairs, dropped = self._made(("pairs", t.seq_len), lambda: tokenize_pairs(
                self.train, self.tokenizer, t.seq_len, "the training data"))
            notes = [f"{dropped} of {len(self.train)} pairs have a completion with no token within "
                     f"seq_len={t.seq_len} and are skipped; raise seq_len to keep them."] if dropped else []
            return BatchStream(pairs, t.batch_size, self.pad_id, seed=t.seed, collate=collate_pairs), notes
        if self.streamed:  # (rows too long for seq_len are passed over as they come)
            return StreamedBatches(self.train, self.tokenizer, t.seq_len, t.packing, t.batch_size,
                                   self.pad_id, seed=t.seed), []
        def rows():
            rows = [pair.chosen for pair in self.train] if self.pairs else self.train
            samples, dropped = tokenize_all(rows, self.tokenizer, t.seq_len, source="the training data",
                                            last_only=self.pairs)  # a pair's completion, not its prompt's turns
            return (pack(samples, t.seq_len) if t.packing else samples), dropped

        samples, dropped = self._made(("rows", t.seq_len, t.packing), rows)
        notes = []
        if dropped:
            notes.append(f"{dropped} of {len(self.train)} rows have no response within "
                         f"seq_len={t.seq_len} and are skipped; raise seq_len to keep them.")
        return BatchStream(samples, t.batch_size, self.pad_id, seed=t.seed), notes

    def _made(self, key: tuple, make) -> tuple[list, int]:
        """``make()``'s samples and dropped count, kept for the next stream of the same ``key``,
        rows, tokenizer and chat template: a change of batch size, seed or learning rate does
        not tokenize the rows again (the stream holds the same list: keeping it costs nothing)."""
        key = (key, self.tokenizer.chat_template, len(self.train))  # (set or grown meanwhile)
        last = self._samples
        if last is None or last[0] != key or last[1] is not self.train or last[2] is not self.tokenizer:
            self._samples = (key, self.train, self.tokenizer, *make())  # (a refusal raises here)
        return self._samples[3], self._samples[4]

    def eval_batches(self, t) -> list[dict]:
        """Every held-out row as batches of ``t``'s shape (no packing), made once per shape;
        held-out pairs under a preference objective as pair batches."""
        if not self.heldout:
            return []
        key = (t.seq_len, t.batch_size, t.paired)
        if self._eval is None or self._eval[0] != key:
            if isinstance(self.heldout[0], Pair) and t.paired:
                pairs, _ = tokenize_pairs(self.heldout, self.tokenizer, t.seq_len, "the held-out data")
                self._eval = (key, [collate_pairs(pairs[i:i + t.batch_size], self.pad_id)
                                    for i in range(0, len(pairs), t.batch_size)])
                return self._eval[1]
            pairs = isinstance(self.heldout[0], Pair)
            rows = [row.chosen for row in self.heldout] if pairs else self.heldout
            samples, _ = tokenize_all(rows, self.tokenizer, t.seq_len, source="the held-out data",
                                      last_only=pairs)
            self._eval = (key, [collate(samples[i:i + t.batch_size], self.pad_id)
                                for i in range(0, len(samples), t.batch_size)])
        return self._eval[1]
