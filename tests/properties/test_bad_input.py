"""Every bad input gets nbtune's own error naming the input and the fix, and changes nothing."""

import json
import re

import pytest
import torch

import nbtune as nt
from nbtune.data import Data, DataError, Example, examples_from, load_examples
from nbtune.models import demo_model_dir
from nbtune.models.config import ConfigError, ModelConfig

from helpers import small_session

ROW = {"instruction": "Add 2 and 3.", "output": "5"}


def write_config(folder, **changes):
    cfg = json.loads((demo_model_dir() / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    path = folder / "config.json"
    path.write_text(json.dumps(cfg))
    return path


# ---- data files ------------------------------------------------------------------------

def test_non_utf8_data_file_names_file_line_and_fix(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_bytes(json.dumps(ROW).encode() + b"\n"
                     + '{"instruction": "Café?", "output": "oui"}'.encode("latin-1") + b"\n")
    with pytest.raises(DataError) as err:
        load_examples(path)
    message = str(err.value)
    assert str(path) in message and "line 2" in message and "byte 21 of the line" in message
    assert "0xe9" in message and "Save it as UTF-8" in message


def test_utf16_data_file_is_named_as_such(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps(ROW) + "\n", encoding="utf-16")  # what Notepad's "Unicode" writes
    with pytest.raises(DataError, match="line 1.*UTF-16.*Save it as UTF-8"):
        load_examples(path)


def test_utf8_byte_order_mark_is_read(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(ROW).encode() + b"\n")
    assert examples_from(path)[0].messages[-1] == ("assistant", "5")


def test_folder_as_data_file_lists_the_data_files_inside(tmp_path):
    (tmp_path / "train.jsonl").write_text(json.dumps(ROW) + "\n")
    (tmp_path / "notes.txt").write_text("not data")
    with pytest.raises(DataError) as err:
        examples_from(tmp_path)
    message = str(err.value)
    assert str(tmp_path) in message and "is a folder" in message
    assert "give a .jsonl, .json, .parquet or .csv file" in message and str(tmp_path / "train.jsonl") in message
    assert "notes.txt" not in message
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DataError, match=r"is a folder.*holds no data file \(\.jsonl, \.json, \.parquet"):
        examples_from(str(empty))


def test_excel_file_is_refused_with_how_to_convert(tmp_path):
    path = tmp_path / "rows.xlsx"
    path.write_bytes(b"PK\x03\x04")
    with pytest.raises(DataError, match=r"rows\.xlsx: a Excel file.*Convert it"):
        examples_from(path)


def test_json_object_file_names_its_list_keys(tmp_path):
    path = tmp_path / "rows.json"
    path.write_text(json.dumps({"train": [ROW], "version": 2}))
    with pytest.raises(DataError, match="must hold a list of rows.*'train' is a list"):
        examples_from(path)


def test_missing_file_that_looks_like_a_hub_id_says_how_to_read_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DataError, match="no such data file.*Check the path.*hf://datasets/owner/set/"):
        examples_from("owner/set")


# ---- examples_from: what it takes and what it refuses ---------------------------------

class FakeDataset:
    """Duck-typed stand-in for datasets.Dataset (not installed here): rows as dicts."""

    def __init__(self, rows):
        self._rows = rows
        self.column_names = list(rows[0]) if rows else []

    def __len__(self):
        return len(self._rows)

    def __iter__(self):
        return iter(dict(row) for row in self._rows)


class FakeDatasetDict(dict):
    """Duck-typed stand-in for datasets.DatasetDict: a dict of split name -> Dataset."""

    @property
    def column_names(self):
        return {split: ds.column_names for split, ds in self.items()}


def test_examples_from_takes_rows_examples_and_datasets(tmp_path):
    chat = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}
    from_rows = examples_from([ROW, chat])
    assert [ex.messages[-1][1] for ex in from_rows] == ["5", "Hello"]
    assert from_rows[1].where == "the data: row 2"
    assert examples_from(from_rows) == from_rows  # Examples as they are
    assert examples_from(row for row in [ROW]) == from_rows[:1]  # any iterable
    assert examples_from(FakeDataset([ROW, ROW])) == [from_rows[0]] * 2
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps(ROW) + "\n")
    assert examples_from(str(path)) == examples_from(path) == from_rows[:1]


def test_dataset_dict_reads_its_train_split_or_the_one_named():
    ds = FakeDatasetDict(train=FakeDataset([ROW]), test=FakeDataset([{**ROW, "output": "6"}]))
    assert [ex.messages[-1][1] for ex in examples_from(ds)] == ["5"]
    assert [ex.messages[-1][1] for ex in examples_from(Data(ds, split="test"))] == ["6"]
    with pytest.raises(DataError, match=r"The data has no split 'train'; its splits are 'test': pass split="):
        examples_from(FakeDatasetDict(test=FakeDataset([ROW])))


def test_dataset_with_other_columns_names_them_and_the_fix():
    ds = FakeDataset([{"question": "2+3?", "answer": "5"}])
    with pytest.raises(DataError, match="has columns 'question', 'answer'.*Name yours with columns="):
        examples_from(ds)


def test_bad_row_in_a_list_names_the_row_and_source():
    with pytest.raises(DataError, match="the held-out data: row 2: missing 'output'.*Rows need"):
        examples_from([ROW, {"instruction": "x"}], source="the held-out data")
    with pytest.raises(DataError, match="The data: row 1 has type str.*must be a dict"):
        examples_from(["Add 2 and 3."])
    with pytest.raises(DataError, match="row 1: 'input' must be a string, got int.*for no input"):
        examples_from(FakeDataset([{**ROW, "input": 5}]))
    # a table's empty cell (None, or pandas' NaN) is no input, as a row without the key is
    assert examples_from(FakeDataset([{**ROW, "input": None}, {**ROW, "input": float("nan")}])) == \
        examples_from([{k: v for k, v in ROW.items() if k != "input"}] * 2)


@pytest.mark.parametrize("data, named, fix", [
    (ROW, "has type dict", r"wrap it in a list, \[row\]"),
    ({"rows": [ROW]}, "has type dict", "Give its list of rows"),
    (42, "has type int", "Pass a .jsonl/.json/.parquet/.csv/.tsv file path"),
    (None, "no data was given", "Pass a .jsonl/.json/.parquet/.csv/.tsv file path"),
    (b'{"instruction": "a"}', "has type bytes", "write it to a .jsonl file"),
    (Example((("user", "a"), ("assistant", "b"))), "has type Example", r"\[example\]"),
    ('{"instruction": "a", "output": "b"}', "is a string that holds text", "pass its path"),
], ids=["one-row-dict", "dict", "int", "None", "bytes", "one-Example", "json-text"])
def test_examples_from_refuses_other_kinds(data, named, fix):
    with pytest.raises(DataError) as err:
        examples_from(data)
    assert named in str(err.value) and re.search(fix, str(err.value))


def test_dataframe_like_is_refused_with_to_dict_records():
    class DataFrame:  # pandas is not installed: what matters is the duck type
        columns = ["instruction", "output"]
        iloc = None

        def __iter__(self):
            return iter(self.columns)  # a real DataFrame iterates its column names
    with pytest.raises(DataError, match=r"has type .*DataFrame.*df\.to_dict\('records'\)"):
        examples_from(DataFrame())


def test_empty_data_is_refused():
    with pytest.raises(DataError, match="The data holds no rows"):
        examples_from([])
    with pytest.raises(DataError, match="The training data holds no rows"):
        examples_from(FakeDataset([]), source="the training data")


# ---- model config.json -----------------------------------------------------------------

def test_unsupported_model_type_names_it_and_the_supported_ones(tmp_path):
    path = write_config(tmp_path, model_type="gpt2", architectures=["GPT2LMHeadModel"])
    with pytest.raises(ConfigError) as err:
        nt.load_model(tmp_path)
    message = str(err.value)
    assert str(path) in message and "'gpt2'" in message and "'GPT2LMHeadModel'" in message
    assert "llama (LlamaForCausalLM)" in message and "qwen3" in message and "Pick a checkpoint" in message


def test_unsupported_architecture_without_model_type_is_named(tmp_path):
    # Before: read as Llama and failed with KeyError('num_attention_heads') on GPT-2's keys.
    (tmp_path / "config.json").write_text(json.dumps(
        {"architectures": ["GPT2LMHeadModel"], "n_embd": 768, "n_head": 12, "n_layer": 12}))
    with pytest.raises(ConfigError, match="architecture 'GPT2LMHeadModel' is not supported.*mistral"):
        ModelConfig.from_file(tmp_path / "config.json")


def test_classification_head_is_refused(tmp_path):
    write_config(tmp_path, architectures=["LlamaForSequenceClassification"])
    with pytest.raises(ConfigError, match="'LlamaForSequenceClassification' is not a causal language"):
        ModelConfig.from_file(tmp_path / "config.json")


def test_config_missing_fields_names_file_fields_and_fix(tmp_path):
    path = write_config(tmp_path, hidden_size=None, num_attention_heads=None)
    with pytest.raises(ConfigError) as err:
        nt.load_model(tmp_path)
    message = str(err.value)
    assert str(path) in message and "is incomplete" in message
    assert "hidden_size, num_attention_heads" in message and "Download the checkpoint's config.json" in message


def test_config_field_of_the_wrong_type_is_named(tmp_path):
    write_config(tmp_path, num_hidden_layers="4")
    with pytest.raises(ConfigError, match="num_hidden_layers is '4'.*positive whole number"):
        ModelConfig.from_file(tmp_path / "config.json")
    write_config(tmp_path, hidden_size=130, head_dim=None)
    with pytest.raises(ConfigError, match=r"hidden_size \(130\) is not a multiple.*Add head_dim"):
        ModelConfig.from_file(tmp_path)  # a folder reads its config.json


def test_config_that_is_not_json_names_the_file(tmp_path):
    path = tmp_path / "config.json"
    path.write_text('{"model_type": "llama", "hidden_size": 64,,}')
    with pytest.raises(ConfigError) as err:
        nt.load_model(tmp_path)
    assert str(path) in str(err.value) and "is not valid JSON (line 1" in str(err.value)
    assert "download the checkpoint's config.json again" in str(err.value)


def test_model_folder_without_config_says_so(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json: no such file.*copy or download it"):
        nt.load_model(tmp_path)


def test_grouped_query_mismatch_names_the_file(tmp_path):
    path = write_config(tmp_path, num_key_value_heads=3)
    with pytest.raises(ConfigError, match=f"{path}: num_attention_heads \\(4\\) must be a multiple"):
        ModelConfig.from_file(path)


# ---- dtype -----------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["fp8", "BF16", "int8", torch.int8, torch.float8_e4m3fn, 16])
def test_unknown_dtype_names_value_and_accepted_names(dtype):
    with pytest.raises(ValueError) as err:
        nt.load_model(demo_model_dir(), dtype=dtype)
    assert f"dtype={dtype!r}" in str(err.value)
    assert "'fp32', 'bf16', 'fp16'" in str(err.value) and "Pass one of" in str(err.value)


def test_unknown_dtype_is_refused_before_the_model_is_looked_up():
    # The dtype is checked first: a typo does not wait for (or trigger) a download.
    with pytest.raises(ValueError, match="dtype='fp8'"):
        nt.load_model("nobody-here/no-such-model", dtype="fp8")


# ---- generation ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def session():
    return small_session()


def _state(session):
    return ({k: v.clone() for k, v in session.model.state_dict().items()}, session.model.training,
            len(session.history), session.techniques, torch.get_rng_state())


def _unchanged(session, before):
    params, training, steps, techniques, rng = _state(session)
    assert training == before[1] and steps == before[2] and techniques == before[3]
    assert torch.equal(rng, before[4])
    assert all(torch.equal(params[k], before[0][k]) for k in params)


@pytest.mark.parametrize("changes, match", [
    (dict(top_p=0.0), r"top_p=0\.0: it must be a number in \(0, 1\].*Use 1\.0"),
    (dict(top_p=1.5, temperature=0.8), r"top_p=1\.5: it must be a number in \(0, 1\]"),
    (dict(top_p=float("nan")), r"top_p=nan"),
    (dict(max_new_tokens=-1), r"max_new_tokens=-1: it must be a whole number.*0 or more"),
    (dict(max_new_tokens=2.5), r"max_new_tokens=2\.5: it must be a whole number"),
    (dict(max_new_tokens=True), r"max_new_tokens=True"),
    (dict(temperature=-0.5), r"temperature=-0\.5: it must be a number, 0 or more.*Use 0 for greedy"),
    (dict(temperature="hot"), r"temperature='hot'"),
], ids=["top_p=0", "top_p>1", "top_p=nan", "max_new_tokens<0", "max_new_tokens=2.5",
        "max_new_tokens=True", "temperature<0", "temperature=str"])
def test_bad_generation_settings_are_refused_and_change_nothing(session, changes, match):
    before = _state(session)
    with pytest.raises(ValueError, match=match):
        session.generate("Add 2 and 3.", **changes)
    _unchanged(session, before)


def test_prompt_longer_than_the_context_names_count_limit_and_fix(session):
    before = _state(session)
    with pytest.raises(ValueError) as err:
        session.generate("x" * 300, raw=True)  # byte tokenizer: BOS + 300 tokens
    assert "The prompt is 301 tokens long but the model reads at most 256" in str(err.value)
    assert "Shorten the prompt" in str(err.value) and "by at least 45 tokens" in str(err.value)
    _unchanged(session, before)


def test_zero_new_tokens_is_an_empty_answer(session):
    assert session.generate("Add 2 and 3.", max_new_tokens=0) == ""
    assert session.generate("x" * 255, raw=True, max_new_tokens=3) is not None  # at the limit: fine
