"""Rows larger than memory: a Parquet or JSON Lines file read a batch at a time, tokenized,
packed and shuffled through a bounded buffer as training goes (``nt.Data(path,
streaming=True)``), as datasets' ``IterableDataset.shuffle(buffer_size=...)`` does.

Only the buffer's samples are held, never the file. The order is a function of the seed, the
epoch and the file alone, so a position is two numbers (epoch, samples taken) and a resumed
run reads the same batches: the stream replays the epoch up to there (read and tokenized
again, nothing trained), or, for a step just undone, takes back the samples it kept.
Instruction, chat and raw-text rows (supervised finetuning and continued pretraining);
pairs and prompts need every row at hand (a precomputed reference, rewards by row) and
are read whole."""

from __future__ import annotations

import collections
import itertools
import json
from pathlib import Path

import torch

from .. import files
from . import sources
from .batches import Sample, collate, packed, tokenize, tokenize_text
from ..hub import resolve_data_file
from .rows import DataError, Example, TextRow, converted_row, examples_from
from .sources import Data

STREAMED = (".parquet", ".jsonl")
_KEPT = 256  # samples kept to take back when a step is undone (a step's batches; more: replayed)


class StreamedRows:
    """A data file's rows, read from its start on each pass (``iter``), one at a time."""

    def __init__(self, path: Path, columns=None, buffer: int = 1000) -> None:
        self.path, self.columns, self.buffer = Path(path), columns, buffer
        if self.path.suffix.lower() not in STREAMED:
            raise DataError(f"{self.path}: streaming reads .parquet and .jsonl files; read this one "
                            "whole (streaming=False), or convert it (pandas: df.to_parquet(...)).")
        try:  # a regular file (not a pipe or device), any size: it is never read whole
            files.regular_file(self.path, "data", None)
        except (files.FileRefused, FileNotFoundError) as err:
            raise DataError(str(err)) from None
        first = next(iter(self), None)
        if first is None:
            raise DataError(f"{self.path}: the file holds no rows.")
        if not isinstance(first, (Example, TextRow)):
            raise DataError(f"{self.path}: streaming trains on instruction, chat or raw-text rows; "
                            "preference pairs and prompts are read whole (streaming=False).")
        self.first = first
        self._rows: int | None = None

    def __iter__(self):
        kind = None
        for where, row in self._raw():
            example = converted_row(row, self.columns, where)
            if kind is None:
                kind = type(example)
            elif type(example) is not kind:
                raise DataError(f"{where}: a {type(example).__name__} among {kind.__name__} rows: a "
                                "run trains on one kind of row.")
            yield example

    def __getitem__(self, index):
        """The first row, or the first rows (``rows[:100]``): a stream is read in order."""
        if index == 0:
            return self.first
        if isinstance(index, slice) and not index.start and index.step is None and index.stop is not None:
            return list(itertools.islice(self, index.stop))
        raise TypeError("Streamed rows are read in order: rows[0] or rows[:n], not by index.")

    def __len__(self) -> int:
        """The rows in the file (Parquet's footer says; JSON Lines' lines are counted once)."""
        if self._rows is None:
            if self.path.suffix.lower() == ".parquet":
                import pyarrow.parquet as pq

                self._rows = pq.ParquetFile(self.path).metadata.num_rows
            else:
                self._rows = sum(1 for _ in self._lines())
        return self._rows

    def __bool__(self) -> bool:
        return True

    def _raw(self):
        if self.path.suffix.lower() == ".parquet":
            names, rows = sources.parquet_rows(self.path, whole=False)
            sources.missing_columns(self.columns, names, str(self.path))
            yield from rows
            return
        for number, line in self._lines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(f"{self.path}: line {number}: not valid JSON ({err.msg}).") from None
            except RecursionError:
                raise DataError(f"{self.path}: line {number}: nested deeper than any data row is; "
                                "the line is damaged.") from None
            yield f"{self.path}: line {number}", row

    def _lines(self):
        """(number, text) of each non-blank line, none longer than a row may be."""
        cap = files.limit("row_bytes")
        with open(self.path, "rb") as f:
            number = 0
            while True:
                line = f.readline(cap + 1)
                if not line:
                    return
                number += 1
                if len(line) > cap and not line.endswith(b"\n"):
                    raise DataError(f"{self.path}: line {number} is longer than any training row can "
                                    f"be (limit {cap:,} bytes: {files.LIMITS['row_bytes'][1]}).")
                try:
                    text = line.decode("utf-8")
                except UnicodeDecodeError:
                    raise DataError(f"{self.path}: line {number} is not UTF-8 text.") from None
                if text.strip():
                    yield number, text


class StreamedBatches:
    """``BatchStream``'s interface over ``StreamedRows``: batches of ``batch_size`` samples
    drawn through a shuffle buffer of ``rows.buffer``, reshuffled each epoch from ``seed``."""

    samples = None  # (no list of every sample: the length of an epoch is unknown up front)
    reference_logps = None

    def __init__(self, rows: StreamedRows, tokenizer, seq_len: int, packing: bool, batch_size: int,
                 pad_id: int, seed: int = 0) -> None:
        self.rows, self.tokenizer, self.seq_len, self.packing = rows, tokenizer, seq_len, packing
        self.batch_size, self.pad_id, self.seed = batch_size, pad_id, seed
        self.epoch, self.position = 0, 0
        self._live = None  # the pipeline at (epoch, position), made when next() needs it
        self._kept: collections.deque = collections.deque(maxlen=_KEPT)  # the last samples taken
        self._back: list[Sample] = []  # samples taken back (a step undone), given again first

    @property
    def key(self) -> tuple:
        """What decides the order: the same key walks the same samples."""
        return (str(self.rows.path), self.rows.buffer, self.seq_len, self.packing, self.seed)

    # ---- the order ------------------------------------------------------------------------

    def _samples(self):
        for row in self.rows:
            if isinstance(row, TextRow):
                yield from tokenize_text(row, self.tokenizer, self.seq_len)
                continue
            sample = tokenize(row, self.tokenizer, self.seq_len)
            if sample is not None:  # (None: no trained token within seq_len)
                yield sample

    def _epoch(self, epoch: int):
        """The epoch's samples in their shuffled order (a reservoir of ``rows.buffer``)."""
        gen = torch.Generator().manual_seed(self.seed + epoch)
        held: list[Sample] = []
        for sample in (packed(self._samples(), self.seq_len) if self.packing else self._samples()):
            if len(held) < self.rows.buffer:
                held.append(sample)
                continue
            i = int(torch.randint(len(held), (1,), generator=gen))
            yield held[i]
            held[i] = sample
        for i in torch.randperm(len(held), generator=gen).tolist():
            yield held[i]

    def _take(self) -> Sample:
        if self._back:
            sample = self._back.pop()
        else:
            if self._live is None:
                self._live = self._epoch(self.epoch)
                for _ in range(self.position):  # a resumed position: the epoch replayed to it
                    next(self._live)
            sample = next(self._live, None)
            if sample is None:
                if self.position == 0:
                    raise DataError(f"Every row of {self.rows.path} is longer than seq_len="
                                    f"{self.seq_len} before its response starts: raise seq_len.")
                self.epoch, self.position, self._live = self.epoch + 1, 0, None
                self._kept.clear()
                return self._take()
        self.position += 1
        self._kept.append(sample)
        return sample

    def next(self) -> dict[str, torch.Tensor]:
        return collate([self._take() for _ in range(self.batch_size)], self.pad_id)

    # ---- the position -----------------------------------------------------------------------

    def state_dict(self) -> dict:
        return {"seed": self.seed, "epoch": self.epoch, "position": self.position,
                "streamed": list(self.key)}

    def check_state(self, state: dict) -> None:
        if state.get("streamed") != list(self.key):
            raise DataError(f"The saved data position is for {state.get('streamed') or 'rows read whole'}; "
                            f"this session streams {list(self.key)} (file, buffer, seq_len, packing, "
                            "seed): resume with the same data and settings.")
        if not isinstance(state.get("position"), int) or state["position"] < 0 \
                or not isinstance(state.get("epoch"), int) or state["epoch"] < 0:
            raise DataError(f"The saved data position {state} is not a position.")

    def load_state_dict(self, state: dict) -> None:
        self.check_state(state)
        epoch, position = state["epoch"], state["position"]
        back = self.position - position
        if epoch == self.epoch and 0 <= back <= len(self._kept):  # a step undone: take its samples back
            for _ in range(back):
                self._back.append(self._kept.pop())
            self.position = position
            return
        self.epoch, self.position, self._live = epoch, position, None
        self._kept.clear()
        self._back.clear()

    def copy(self) -> "StreamedBatches":
        """The same rows and shape at the same position, to move independently (it replays)."""
        other = StreamedBatches(self.rows, self.tokenizer, self.seq_len, self.packing, self.batch_size,
                                self.pad_id, self.seed)
        other.epoch, other.position = self.epoch, self.position
        return other

    def continue_from(self, previous) -> None:
        """Carry on where ``previous`` stopped when both walk the same samples (another batch
        size): its pipeline is taken over, not replayed."""
        if isinstance(previous, StreamedBatches) and previous.key == self.key:
            self.epoch, self.position, self._live = previous.epoch, previous.position, previous._live
            self._kept, self._back = previous._kept, previous._back


def streamed_rows(spec: Data, source: str) -> StreamedRows:
    """``nt.Data(path, streaming=True)``'s rows: a local or ``hf://datasets/.../file`` file."""
    path = spec.path
    if not isinstance(path, (str, Path)) or (isinstance(path, str) and sources.hub_dataset(path)):
        raise DataError(f"{source}: streaming=True reads a .parquet or .jsonl file as training goes; "
                        f"{type(path).__name__ if not isinstance(path, str) else repr(path)} is not one "
                        "(a Dataset or a whole Hub dataset is read whole: leave streaming out).")
    return StreamedRows(resolve_data_file(path, spec.revision), spec.columns, spec.buffer)


def read_rows(data, source: str = "the data"):
    """Rows as a session takes them: a streamed file's ``StreamedRows`` (``nt.Data(...,
    streaming=True)``, or one already made), else every row read (``examples_from``)."""
    if isinstance(data, StreamedRows):
        return data
    if isinstance(data, Data) and data.streaming:
        return streamed_rows(data, source)
    return examples_from(data, source)
