"""Data where it lives: each form (Parquet, CSV, a JSON list, a Dataset, a DatasetDict, a
save_to_disk folder, a Hub dataset from datasets' own cache, ShareGPT rows) gives the rows its
JSONL equivalent gives, on the demo task; a column mapping puts other names on nbtune's
fields; raw text trains every token, checked token for token."""

import glob
import json
import os
import shutil

import pytest
import torch

import nbtune as nt
from nbtune import files
from nbtune.data import (IGNORE, Data, DataError, TextRow, TrainingData, examples_from, pack,
                         tokenize_text)
from nbtune.models.tiny import byte_tokenizer
from nbtune.run.factory import demo_data_file

datasets = pytest.importorskip("datasets")
pd = pytest.importorskip("pandas")

TOK = byte_tokenizer()
# the demo's rows with their columns named as a user's dataset might name them
MAPPING = {"instruction": "question", "input": "context", "output": "answer"}


def demo_rows() -> list[dict]:
    lines = demo_data_file("train").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()][:40]


def renamed(rows) -> list[dict]:
    return [{MAPPING.get(k, k): v for k, v in row.items()} for row in rows]


@pytest.fixture
def jsonl_rows(tmp_path):
    path = tmp_path / "demo.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in demo_rows()))
    return examples_from(path)


def test_parquet_csv_and_json_list_give_the_jsonl_rows(tmp_path, jsonl_rows):
    frame = pd.DataFrame(renamed(demo_rows()))
    frame.to_parquet(tmp_path / "demo.parquet")
    frame.to_csv(tmp_path / "demo.csv", index=False)
    frame.to_csv(tmp_path / "demo.tsv", index=False, sep="\t")
    (tmp_path / "demo.json").write_text(json.dumps(renamed(demo_rows())))
    for name in ("demo.parquet", "demo.csv", "demo.tsv", "demo.json"):
        rows = examples_from(Data(str(tmp_path / name), columns=MAPPING))
        assert rows == jsonl_rows, name
        assert rows[3].where == (f"{tmp_path / name}: line 5" if name.endswith("sv") else
                                 f"{tmp_path / name}: row 4")


def test_datasets_dataset_dict_and_save_to_disk_folder(tmp_path, jsonl_rows):
    ds = datasets.Dataset.from_list(renamed(demo_rows()))
    held = datasets.Dataset.from_list(renamed(demo_rows()[:3]))
    both = datasets.DatasetDict(train=ds, test=held)
    assert examples_from(Data(ds, columns=MAPPING)) == jsonl_rows
    assert examples_from(Data(both, columns=MAPPING)) == jsonl_rows  # train by default
    assert examples_from(Data(both, split="test", columns=MAPPING)) == jsonl_rows[:3]
    both.save_to_disk(str(tmp_path / "saved"))
    assert examples_from(Data(str(tmp_path / "saved"), columns=MAPPING)) == jsonl_rows
    assert examples_from(Data(tmp_path / "saved", split="test", columns=MAPPING)) == jsonl_rows[:3]
    ds.save_to_disk(str(tmp_path / "one"))  # a Dataset's folder: its one split
    assert examples_from(Data(str(tmp_path / "one"), columns=MAPPING)) == jsonl_rows


def cache_hub_dataset(monkeypatch, tmp_path, repo_id: str, splits: dict) -> None:
    """Put a dataset in datasets' own cache as a download of ``repo_id`` leaves it (the layout
    ``load_dataset`` reads offline: <owner>___<name>/<config>/<version>/<hash>/<name>-<split>.arrow)."""
    cache = tmp_path / "hf-datasets"
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    source = {}
    for split, rows in splits.items():
        source[split] = str(tmp_path / f"{split}.jsonl")
        (tmp_path / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    builder = datasets.load_dataset_builder("json", data_files=source, cache_dir=str(tmp_path / "build"))
    builder.download_and_prepare()
    owner, name = repo_id.split("/")
    target = cache / f"{owner}___{name}" / "default" / "0.0.0" / ("0" * 16)
    shutil.copytree(builder.cache_dir, target)
    for arrow in glob.glob(str(target / "json-*.arrow")):
        os.rename(arrow, arrow.replace(f"{os.sep}json-", f"{os.sep}{name}-"))


def test_hub_dataset_comes_through_datasets_cache_with_split_and_revision(tmp_path, monkeypatch,
                                                                           jsonl_rows):
    cache_hub_dataset(monkeypatch, tmp_path, "someone/demo-qa",
                      {"train": renamed(demo_rows()), "test": renamed(demo_rows()[:5])})
    url = "hf://datasets/someone/demo-qa"
    assert examples_from(Data(url, columns=MAPPING)) == jsonl_rows
    assert examples_from(Data(url + "@main", split="test", columns=MAPPING)) == jsonl_rows[:5]
    with pytest.raises(DataError, match="names revision 'v1' but revision='v2'"):
        examples_from(Data(url + "@v1", revision="v2", columns=MAPPING))
    with pytest.raises(DataError, match="someone/nothing.*cannot be read.*HF_HUB_OFFLINE"):
        examples_from("hf://datasets/someone/nothing")


def test_a_folder_with_a_dataset_script_is_refused_and_the_script_never_runs(tmp_path):
    folder = tmp_path / "repo"
    folder.mkdir()
    ran = tmp_path / "ran"
    (folder / "repo.py").write_text(f"open({str(ran)!r}, 'w').write('ran')\n")
    (folder / "train.jsonl").write_text(json.dumps(demo_rows()[0]) + "\n")
    (folder / "state.json").write_text("{}")  # looks like a save_to_disk folder too
    with pytest.raises(DataError, match=r"holds a dataset script \(repo\.py\): nbtune never runs code"):
        examples_from(str(folder))
    assert not ran.exists()


def test_sharegpt_conversations_are_chat_rows():
    turns = [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "2+3?"},
             {"from": "gpt", "value": "5"}, {"from": "human", "value": "and 4+4?"}]
    messages = [{"role": r, "content": c} for r, c in
                (("system", "Be brief."), ("user", "2+3?"), ("assistant", "5"))]
    assert examples_from([{"conversations": turns}]) == examples_from([{"messages": messages}])
    roles = [{"role": t["from"].replace("human", "user").replace("gpt", "assistant"),
              "content": t["value"]} for t in turns]  # role/content inside conversations too
    assert examples_from([{"conversations": roles}]) == examples_from([{"messages": messages}])
    mapped = examples_from(Data([{"dialog": turns}], columns={"conversations": "dialog"}))
    assert mapped == examples_from([{"messages": messages}])
    with pytest.raises(DataError, match="row 1: conversations turn 1 must be an object with 'from' in"):
        examples_from([{"conversations": [turns[0], {"from": "bot", "value": "x"}]}])


def test_column_mapping_refusals_name_the_column_and_the_data_columns(tmp_path):
    rows = renamed(demo_rows()[:3])
    with pytest.raises(DataError, match=r"maps 'instruction' to the column 'prompt_text', which the data "
                                        r"does not have; its columns are 'task', 'question', 'context', 'answer'"):
        examples_from(Data(datasets.Dataset.from_list(rows), columns={**MAPPING, "instruction": "prompt_text"}))
    pd.DataFrame(rows).to_parquet(tmp_path / "rows.parquet")
    with pytest.raises(DataError, match=r"rows\.parquet: columns= maps 'output' to the column 'reply'"):
        examples_from(Data(str(tmp_path / "rows.parquet"), columns={**MAPPING, "output": "reply"}))
    with pytest.raises(DataError, match=r"row 2: columns= maps 'output' to the column 'answer'.*its "
                                        r"columns are 'question'"):
        examples_from(Data([rows[0], {"question": "x"}], columns=MAPPING))
    with pytest.raises(DataError, match="maps 'answer', which is not one of nbtune's fields"):
        Data(rows, columns={"answer": "output"})
    with pytest.raises(DataError, match="names one column for two fields"):
        Data(rows, columns={"instruction": "q", "output": "q"})
    with pytest.raises(DataError, match="has columns 'question', 'answer'.*Name yours with columns="):
        examples_from(datasets.Dataset.from_list([{"question": "a", "answer": "b"}]))


def test_parquet_and_csv_are_bounded_before_rows_are_read(tmp_path, monkeypatch):
    # small on disk (compressed), large once read: refused from the file's own figures
    pd.DataFrame([{"text": f"{i:04d}" + "x" * 4996} for i in range(50)]).to_parquet(
        tmp_path / "big.parquet", compression="gzip")
    assert os.path.getsize(tmp_path / "big.parquet") < 50_000
    monkeypatch.setitem(files.LIMITS, "data_bytes", (200_000, "test"))
    with pytest.raises(DataError, match="once uncompressed, more than nbtune reads"):
        examples_from(str(tmp_path / "big.parquet"))
    monkeypatch.setitem(files.LIMITS, "data_bytes", (1 << 30, "test"))
    monkeypatch.setitem(files.LIMITS, "row_bytes", (4000, "test"))
    with pytest.raises(DataError, match=r"big\.parquet: row 1 holds 5,000 characters"):
        examples_from(str(tmp_path / "big.parquet"))
    # one value repeated through a dictionary: small on disk and in its figures, large once read
    pd.DataFrame([{"text": "y" * 3000}] * 100).to_parquet(tmp_path / "bomb.parquet")
    monkeypatch.setitem(files.LIMITS, "data_bytes", (100_000, "test"))
    with pytest.raises(DataError, match=r"bomb\.parquet: the rows up to row 34 hold more text"):
        examples_from(str(tmp_path / "bomb.parquet"))
    (tmp_path / "bad.csv").write_text("instruction,output\n\"a\",\"b\"\n\"c\",\"d\",\"e\"\n")
    with pytest.raises(DataError, match=r"bad\.csv: line 3: more values than the header's 2 columns"):
        examples_from(str(tmp_path / "bad.csv"))
    (tmp_path / "junk.parquet").write_bytes(b"PAR1" + os.urandom(64))
    with pytest.raises(DataError, match=r"junk\.parquet: not a readable Parquet file"):
        examples_from(str(tmp_path / "junk.parquet"))


# ---- raw text: continued pretraining --------------------------------------------------

def test_raw_text_trains_every_token_once_in_seq_len_pieces():
    text = "The quick brown fox jumps over the lazy dog. " * 3
    whole = [TOK.bos_id] + TOK.encode(text) + [TOK.eos_id]  # independent of nbtune's splitting
    pieces = tokenize_text(TextRow(text), TOK, seq_len=16)
    assert [len(p.input_ids) for p in pieces] == [16] * (len(whole) // 16) + [(len(whole) - 1) % 16] * \
        bool((len(whole) - 1) % 16)
    inputs = torch.cat([p.input_ids for p in pieces]).tolist()
    labels = torch.cat([p.labels for p in pieces]).tolist()
    assert inputs == whole[:-1] and labels == whole[1:]  # each token predicted once, none masked
    assert IGNORE not in labels


def test_raw_text_stream_is_packed_and_trains_every_token():
    texts = ["Alpha beta gamma delta.", "A much longer document " * 6, "Short."]
    data = TrainingData([{"text": t} for t in texts], TOK)
    assert data.text and data.problems(nt.Techniques()) == []
    stream, notes = data.stream(nt.Techniques(seq_len=32, packing=True, batch_size=1))
    assert notes == []
    trained = sum(int((s.labels != IGNORE).sum()) for s in stream.samples)
    assert trained == sum(len(TOK.encode(t)) + 1 for t in texts)  # every token and each EOS
    assert all(len(s.input_ids) <= 32 for s in stream.samples)
    assert len(stream.samples) == len(pack(sum((tokenize_text(TextRow(t), TOK, 32) for t in texts), []), 32))
    assert all(s.document_ids is not None for s in stream.samples)
    refused = data.problems(nt.Techniques(objective="dpo"))
    assert len(refused) == 1 and "raw text" in refused[0] and "objective='sft'" in refused[0]


def test_raw_text_session_packs_by_default_and_continues_text(tmp_path):
    path = tmp_path / "notes.jsonl"
    path.write_text("".join(json.dumps({"text": f"Note {i}: the sky is blue and grass is green."}) + "\n"
                            for i in range(12)))
    session = nt.Session.from_pretrained(nt.models.demo_model_dir(), str(path))
    assert session.techniques.packing
    first = session.step().loss
    for _ in range(5):
        last = session.step().loss
    assert last < first
    with pytest.raises(DataError, match="raw text, with no question and answer"):
        session.evaluate(session.train_examples[:2])


def test_run_file_reads_a_mapped_parquet_and_save_config_writes_the_mapping_back(tmp_path, jsonl_rows):
    import yaml

    from nbtune.runfile import RunFileError

    pd.DataFrame(renamed(demo_rows())).to_parquet(tmp_path / "demo.parquet")
    entry = {"path": "demo.parquet", "columns": MAPPING}
    config = {"model": str(nt.models.demo_model_dir()), "data": {"train": entry},
              "run": {"steps": 1}}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    session = nt.Session.from_config(tmp_path / "run.yaml")
    assert session.train_examples == jsonl_rows
    written = yaml.safe_load(session.save_config(tmp_path / "again.yaml").read_text())
    assert {k: v for k, v in written["data"]["train"].items() if v is not None} == {
        **entry, "streaming": False, "buffer": 1000}  # (a run file says every field)
    assert nt.Session.from_config(tmp_path / "again.yaml").train_examples == jsonl_rows
    config["data"]["train"] = {"path": "demo.parquet", "columns": {"answer": "output"}}
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(config))
    with pytest.raises(RunFileError, match=r"line \d+.*maps 'answer', which is not one of nbtune's fields"):
        nt.Session.from_config(tmp_path / "bad.yaml")


def test_tables_bound_nested_rows_read_csv_line_ends_as_csv_does_and_name_a_wrong_split(tmp_path, monkeypatch):
    chat = [{"messages": [{"role": "user", "content": "hi " * 1000}, {"role": "assistant", "content": "yo"}]}]
    pd.DataFrame(chat).to_parquet(tmp_path / "chat.parquet")
    monkeypatch.setitem(files.LIMITS, "row_bytes", (2000, "test"))
    with pytest.raises(DataError, match=r"chat\.parquet: row 1 holds 3,015 characters"):
        examples_from(str(tmp_path / "chat.parquet"))  # the text inside the messages counts
    with pytest.raises(DataError, match=r"row 1 holds 3,015 characters"):
        examples_from(datasets.Dataset.from_list(chat))
    monkeypatch.setitem(files.LIMITS, "row_bytes", (1 << 20, "test"))
    monkeypatch.setitem(files.LIMITS, "data_bytes", (1000, "test"))
    with pytest.raises(DataError, match="holds 0.0 GiB of data, more than nbtune reads"):
        examples_from(datasets.Dataset.from_list(chat))
    monkeypatch.setitem(files.LIMITS, "data_bytes", (1 << 30, "test"))
    # a form feed inside a value is text to csv, not a new line
    (tmp_path / "ff.csv").write_text("text\nfirst page\x0csecond page\n")
    assert examples_from(str(tmp_path / "ff.csv")) == [TextRow("first page\x0csecond page")]
    # a table's empty optional cell (None, NaN) is no input
    frame = pd.DataFrame([{"instruction": "a", "input": None, "output": "b"},
                          {"instruction": "c", "input": "d", "output": "e"}])
    frame.to_parquet(tmp_path / "gaps.parquet")
    assert examples_from(str(tmp_path / "gaps.parquet")) == examples_from(
        [{"instruction": "a", "output": "b"}, {"instruction": "c", "input": "d", "output": "e"}])
    test_split = datasets.Dataset.from_list(renamed(demo_rows()[:2]), split="test")
    with pytest.raises(DataError, match="is the 'test' split, but split='train' was asked for"):
        examples_from(Data(test_split, split="train", columns=MAPPING))
