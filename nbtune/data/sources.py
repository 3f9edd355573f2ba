"""Where rows live: JSONL and JSON-list files (``rows.load_examples``), Parquet and CSV files,
a ``datasets.Dataset`` or ``DatasetDict``, a ``save_to_disk`` folder and a Hub dataset, each
read as plain row dicts under the trust boundary's budgets, and a column mapping that puts a
dataset's own column names on nbtune's fields.

Parquet, ``save_to_disk`` folders and Hub datasets need the ``data`` extra (``datasets``, which
brings ``pyarrow``); no dataset script is ever run (``datasets`` no longer runs them, and a
folder that holds one is refused before ``datasets`` sees it)."""

from __future__ import annotations

import csv
import io
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from .. import files
from ..hub import DATASETS_URL, check_repo_id

# nbtune's fields a column mapping may fill (rows.py: the forms they make)
FIELDS = ("instruction", "input", "output", "messages", "conversations", "prompt", "completion",
          "chosen", "rejected", "text")
TABLES = (".parquet", ".csv", ".tsv")  # besides .jsonl and .json
DATA_EXTRA = "pip install 'nbtune[data]' (datasets and pyarrow)"
_DISK_MARKERS = ("dataset_dict.json", "state.json")  # what datasets.save_to_disk writes


class DataError(ValueError):
    """A data file or row that cannot be used, with where and why."""


@dataclass(frozen=True)
class Data:
    """Rows and how to read them.

    Args:
        path: A .jsonl/.json/.parquet/.csv/.tsv file, a ``save_to_disk`` folder, a
            ``datasets.Dataset`` or ``DatasetDict``, ``hf://datasets/owner/name[@revision]``
            (the whole dataset, through ``datasets``) or ``hf://datasets/owner/name/file``.
        split: The split of a DatasetDict, folder or Hub dataset (default ``"train"``).
        revision: The Hub revision (branch, tag or commit) of a Hub dataset.
        columns: nbtune's field -> the data's column, e.g. ``{"instruction": "question",
            "output": "answer"}``; columns not named keep their names.
        streaming: Read a .parquet or .jsonl file as training goes, never whole (a file
            larger than memory; ``data/streaming.py``): instruction, chat and raw-text rows.
        buffer: The samples a streamed file is shuffled through (default 1000).
    """

    path: object
    split: str | None = None
    revision: str | None = None
    columns: Mapping[str, str] | None = None
    streaming: bool = False
    buffer: int = 1000

    def __post_init__(self) -> None:
        check_columns(self.columns)
        if not isinstance(self.streaming, bool):
            raise DataError(f"streaming={self.streaming!r}: True or False.")
        if isinstance(self.buffer, bool) or not isinstance(self.buffer, int) or self.buffer < 1:
            raise DataError(f"buffer={self.buffer!r}: the shuffle buffer holds a positive number of "
                            "samples, e.g. 1000.")
        if self.split is not None and (not isinstance(self.split, str) or not self.split):
            raise DataError(f"split={self.split!r}: a split is a name such as 'train' or 'test'.")

    def __hash__(self) -> int:
        return hash((str(self.path), self.split, self.revision, self.streaming))


def check_columns(columns) -> None:
    """Refuse a mapping onto a field nbtune does not have, or from a column that is not a name."""
    if columns is None:
        return
    if not isinstance(columns, Mapping):
        raise DataError(f"columns={columns!r}: give a dict of nbtune's field -> your column, e.g. "
                        "{'instruction': 'question', 'output': 'answer'}.")
    for field, column in columns.items():
        if field not in FIELDS:
            raise DataError(f"columns= maps {field!r}, which is not one of nbtune's fields "
                            f"({', '.join(FIELDS)}): the keys are nbtune's fields, the values your "
                            f"columns, e.g. {{'instruction': {field!r}}}.")
        if not isinstance(column, str) or not column:
            raise DataError(f"columns= maps {field!r} to {column!r}: a column is a name.")
    if len(set(columns.values())) != len(columns):
        raise DataError(f"columns={dict(columns)!r} names one column for two fields: each field "
                        "needs its own column.")


def missing_columns(columns: Mapping[str, str] | None, present, source: str) -> None:
    """Refuse a mapping that names a column the data does not have, with the data's columns."""
    if not columns:
        return
    present = list(present)
    for field, column in columns.items():
        if column not in present:
            raise DataError(f"{source}: columns= maps {field!r} to the column {column!r}, which "
                            f"the data does not have; its columns are "
                            f"{', '.join(map(repr, present)) or 'none'}.")


def mapped(row: dict, columns: Mapping[str, str] | None) -> dict:
    """``row`` with its mapped columns under nbtune's field names (the rest as they are)."""
    if not columns:
        return row
    out = {key: value for key, value in row.items() if key not in columns.values()}
    out.update({field: row[column] for field, column in columns.items() if column in row})
    return out


def hub_dataset(spec) -> tuple[str, str | None] | None:
    """``hf://datasets/owner/name[@revision]`` (no file in it) -> (repo id, revision); else None."""
    if not (isinstance(spec, str) and spec.startswith(DATASETS_URL)):
        return None
    parts = spec[len(DATASETS_URL):].rstrip("/").split("/")
    if len(parts) != 2 or not all(parts):
        return None
    name, _, revision = parts[1].partition("@")
    return check_repo_id(f"{parts[0]}/{name}", "Hub dataset id"), revision or None


def is_disk_dataset(path: Path) -> bool:
    return path.is_dir() and any((path / marker).is_file() for marker in _DISK_MARKERS)


def _datasets(what: str):
    try:
        import datasets
    except ImportError:
        raise DataError(f"{what} is read through Hugging Face datasets, which is not installed: "
                        f"{DATA_EXTRA}.") from None
    return datasets


def pick_split(data, split: str | None, source: str):
    """One split of a DatasetDict (``split``, default train), or the Dataset itself."""
    if not isinstance(data, Mapping):
        if split is not None and getattr(data, "split", None) not in (None, split):
            raise DataError(f"{source} is the {data.split!r} split, but split={split!r} was asked "
                            "for: pass that split's Dataset, or leave split out.")
        return data
    name = split or "train"
    if name not in data:
        splits = ", ".join(map(repr, data))
        raise DataError(f"{source[:1].upper() + source[1:]} has no split {name!r}; its splits are {splits}: pass "
                        f"split=<one of them>.")
    return data[name]


def _no_script(folder: Path) -> None:
    scripts = sorted(p.name for p in folder.glob("*.py"))
    if scripts:
        raise DataError(f"{folder} holds a dataset script ({', '.join(scripts)}): nbtune never "
                        "runs code that comes with data. Use its data files (Parquet, JSONL, CSV) "
                        "or a save_to_disk folder instead.")


def load_disk(folder: Path, split: str | None, source: str):
    """A ``save_to_disk`` folder's Dataset (its JSON bounded before datasets parses it)."""
    _no_script(folder)
    for marker in (*_DISK_MARKERS, "dataset_info.json"):
        if (folder / marker).exists():
            files.read_json(folder / marker, "dataset description")
    datasets = _datasets(f"{folder} (a save_to_disk folder)")
    try:
        loaded = datasets.load_from_disk(str(folder))
    except (OSError, ValueError, KeyError, TypeError) as err:  # a damaged or partial folder
        raise DataError(f"{folder}: not a readable save_to_disk folder ({type(err).__name__}: "
                        f"{str(err)[:200]}). Save it again with ds.save_to_disk(folder).") from None
    return pick_split(loaded, split, source)


def load_hub(repo_id: str, revision: str | None, split: str | None, source: str):
    """A Hub dataset's split through datasets (its cache offline); never a dataset script."""
    datasets = _datasets(f"The Hub dataset {repo_id!r}")
    try:
        loaded = datasets.load_dataset(repo_id, split=split or "train", revision=revision)
    except (FileNotFoundError, ConnectionError) as err:
        offline = " (HF_HUB_OFFLINE is set: only a dataset already in datasets' cache loads)" \
            if os.environ.get("HF_HUB_OFFLINE") else ""
        raise DataError(f"{source}: the Hub dataset {repo_id!r} cannot be read{offline}: "
                        f"{str(err)[:200]}") from None
    except ValueError as err:  # an unknown split, or datasets refusing a script
        raise DataError(f"{source}: the Hub dataset {repo_id!r}: {str(err)[:300]}") from None
    return loaded


def _text_size(value) -> int:
    """The characters of the text in ``value``, nested lists and dicts (messages) included."""
    if isinstance(value, (str, bytes)):
        return len(value)
    if isinstance(value, Mapping):
        return sum(_text_size(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_text_size(v) for v in value)
    return 0


def row_size(row: Mapping, where: str) -> int:
    """The characters of ``row``'s text, refused past what any training row can use."""
    size = _text_size(row)
    cap = files.limit("row_bytes")
    if size > cap:
        raise DataError(f"{where} holds {size:,} characters, more than any training row can use "
                        f"(limit {cap:,}: {files.LIMITS['row_bytes'][1]}). Split or shorten it.")
    return size


def check_table(data, source: str) -> None:
    """A Dataset read from files (a folder, the Hub) bounded as a data file is: its Arrow data."""
    size = getattr(getattr(data, "data", None), "nbytes", None)
    cap, why = files.LIMITS["data_bytes"]
    if isinstance(size, int) and size > cap:
        raise DataError(f"{source} holds {size / files.GiB:.1f} GiB of data, more than nbtune reads as "
                        f"data (limit {cap / files.GiB:.0f} GiB: {why}).")


def parquet_rows(path: Path, whole: bool = True) -> tuple[list[str], Iterator[tuple[str, dict]]]:
    """A Parquet file's column names and its rows, read a batch at a time; refused before any
    row is read when its data uncompressed is more than a data file may be. ``whole=False``:
    the rows are streamed (``streaming.py``), never all held: each row is bounded, not the file."""
    try:
        files.regular_file(path, "data", "data_bytes" if whole else None)
    except files.FileRefused as err:
        raise DataError(str(err)) from None
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{path} is a Parquet file; reading it needs pyarrow: {DATA_EXTRA}.") from None
    try:
        table = pq.ParquetFile(path)
    except Exception as err:  # pyarrow's ArrowInvalid and kin: a damaged or crafted footer
        raise DataError(f"{path}: not a readable Parquet file ({str(err)[:200]}).") from None
    meta = table.metadata
    unpacked = sum(meta.row_group(i).total_byte_size for i in range(meta.num_row_groups))
    cap, why = files.LIMITS["data_bytes"]
    cap = cap if whole else float("inf")
    if unpacked > cap:
        raise DataError(f"{path} holds {unpacked / files.GiB:.1f} GiB once uncompressed, more "
                        f"than nbtune reads as data (limit {cap / files.GiB:.0f} GiB: {why}).")

    def rows():
        number = read = 0
        try:
            for batch in table.iter_batches(batch_size=64):  # decoded, then measured: a few rows
                for row in batch.to_pylist():
                    number += 1
                    where = f"{path}: row {number}"
                    read += row_size(row, where)
                    if read > cap:  # a dictionary-encoded page can repeat one value without end
                        raise DataError(f"{path}: the rows up to row {number} hold more text than "
                                        f"nbtune reads as data (limit {cap / files.GiB:.0f} GiB: {why}).")
                    yield where, row
        except OSError as err:  # pyarrow's damaged pages
            raise DataError(f"{path}: row {number + 1} cannot be read ({str(err)[:200]}).") from None
    return list(table.schema_arrow.names), rows()


def csv_rows(path: Path, text: str) -> tuple[list[str], Iterator[tuple[str, dict]]]:
    """A CSV (or, by its suffix, TSV) file's header and rows: every value a string."""
    delimiter = "\t" if path.suffix.lower() == ".tsv" else ","
    old = csv.field_size_limit(files.limit("row_bytes"))
    try:  # csv's own line ends (str.splitlines would also cut at form feeds and U+2028)
        reader = csv.DictReader(io.StringIO(text, newline=""), delimiter=delimiter)
        try:
            header = list(reader.fieldnames or [])
            parsed = [(f"{path}: line {reader.line_num}", row) for row in reader]
        except csv.Error as err:
            raise DataError(f"{path}: line {reader.line_num}: not valid CSV ({err}).") from None
    finally:
        csv.field_size_limit(old)
    if not header:
        raise DataError(f"{path}: the file has no header line; the first line names the columns "
                        "(e.g. instruction,output).")
    rows = []
    for where, row in parsed:
        if None in row:  # more values than the header has names
            raise DataError(f"{where}: more values than the header's {len(header)} columns "
                            "(a comma inside a value must be quoted).")
        rows.append((where, {k: v for k, v in row.items() if v is not None}))
    return header, iter(rows)
