"""Streamed rows (``nt.Data(path, streaming=True)``): a Parquet or JSON Lines file read as
training goes. Each epoch gives every sample the whole-read path gives, once, shuffled through
a bounded buffer; a buffer as large as the data gives the whole-read order itself, so the
losses equal a whole-read session's; a resumed or undone position gives the batches the
stream that never stopped gives; a file over the whole-read limit still trains."""

import json

import pytest
import torch
import yaml

import nbtune as nt
from nbtune import files
from nbtune.data import (BatchStream, Data, DataError, StreamedBatches, TrainingData, examples_from,
                         pack, read_rows, tokenize_all)
from nbtune.models.tiny import byte_tokenizer
from nbtune.run.factory import demo_data_file
from nbtune.runfile import RunFileError

pd = pytest.importorskip("pandas")
TOK = byte_tokenizer()
SEQ = 256  # (bytes: the demo's rows fit)
MAPPING = {"instruction": "question", "input": "context", "output": "answer"}


def demo_rows(n: int = 40) -> list[dict]:
    lines = demo_data_file("train").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()][:n]


@pytest.fixture
def files_of_rows(tmp_path):
    """The demo's first 40 rows as JSONL, and as Parquet with the columns renamed."""
    rows = demo_rows()
    (tmp_path / "demo.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    pd.DataFrame([{MAPPING.get(k, k): v for k, v in r.items()} for r in rows]).to_parquet(tmp_path / "demo.parquet")
    return tmp_path / "demo.jsonl", tmp_path / "demo.parquet"


def _ids(sample) -> tuple:
    return tuple(sample.input_ids.tolist()), tuple(sample.labels.tolist())


def _epoch(stream, n: int) -> list:
    return [_ids(stream._take()) for _ in range(n)]


@pytest.mark.parametrize("packing", [False, True], ids=["rows", "packed"])
def test_each_epoch_gives_every_whole_read_sample_once_shuffled_through_the_buffer(files_of_rows, packing):
    jsonl, parquet = files_of_rows
    whole, _ = tokenize_all(examples_from(jsonl), TOK, SEQ)
    whole = pack(whole, SEQ) if packing else whole
    for path, columns in ((jsonl, None), (parquet, MAPPING)):
        rows = read_rows(Data(str(path), columns=columns, streaming=True, buffer=8))
        assert len(rows) == 40 and rows[0] == examples_from(jsonl)[0]
        stream = StreamedBatches(rows, TOK, SEQ, packing, batch_size=4, pad_id=0, seed=3)
        first, second = _epoch(stream, len(whole)), _epoch(stream, len(whole))
        assert sorted(first) == sorted(map(_ids, whole)) == sorted(second), path.suffix
        assert stream.epoch == 1 and first != second  # reshuffled each epoch, from the seed
        assert first != [_ids(s) for s in whole]  # shuffled, not the file's order
        # no sample comes out more than a buffer's width before its place in the file
        place = {key: i for i, key in enumerate(map(_ids, whole))}
        assert all(place[key] <= i + 8 for i, key in enumerate(first))


def test_a_buffer_as_large_as_the_data_trains_as_the_whole_read_session_does(files_of_rows):
    jsonl, parquet = files_of_rows
    losses = []
    for data in (str(jsonl), Data(str(parquet), columns=MAPPING, streaming=True, buffer=10_000)):
        torch.manual_seed(0)
        session = nt.Session.from_pretrained(nt.models.demo_model_dir(), data,
                                             techniques=dict(batch_size=4, seq_len=128, lr=1e-3))
        session.echo = False
        losses.append([session.step().loss for _ in range(12)])  # past an epoch (10 batches)
    assert losses[0] == losses[1]


def test_a_resumed_or_undone_position_gives_the_batches_of_the_stream_that_went_on(files_of_rows):
    rows = read_rows(Data(str(files_of_rows[1]), columns=MAPPING, streaming=True, buffer=6))
    make = lambda: StreamedBatches(rows, TOK, SEQ, False, batch_size=3, pad_id=0, seed=1)  # noqa: E731
    going = make()
    for _ in range(7):
        going.next()
    mark = going.state_dict()
    live = going._live
    ahead = [going.next() for _ in range(4)]  # (40 samples an epoch: within the first)
    going.load_state_dict(mark)  # a step undone: the samples it took are given back
    assert going._live is live  # (taken back, not replayed)
    again = [going.next() for _ in range(4)]
    resumed = make()
    resumed.load_state_dict(json.loads(json.dumps(mark)))  # from a checkpoint: replayed
    replayed = [resumed.next() for _ in range(4)]
    later = [going.next() for _ in range(20)]  # into the third epoch, and the same replayed
    assert going.epoch == 2 and [resumed.next() for _ in range(20)][-1]["labels"].equal(later[-1]["labels"])
    for a, b, c in zip(ahead, again, replayed):
        assert all(torch.equal(a[k], b[k]) and torch.equal(a[k], c[k]) for k in a)
    with pytest.raises(DataError, match="streams"):
        StreamedBatches(rows, TOK, SEQ + 1, True, 3, 0, seed=1).load_state_dict(mark)  # another seq_len
    with pytest.raises(DataError, match="rows read whole"):
        going.load_state_dict(BatchStream([], 3, 0).state_dict())


def test_a_streamed_session_checkpoints_and_resumes_exactly(files_of_rows, tmp_path):
    def session():
        torch.manual_seed(0)
        made = nt.Session.from_pretrained(nt.models.demo_model_dir(), Data(
            str(files_of_rows[0]), streaming=True, buffer=5), techniques=dict(batch_size=4, seq_len=128))
        made.echo = False
        return made

    whole = session()
    losses = [whole.step().loss for _ in range(8)]
    cut = session()
    for _ in range(3):
        cut.step()
    head, calls = cut.model.lm_head.forward, []

    def failing(*args):  # a step that fails after reading its batch: it is undone
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected")
        return head(*args)
    cut.model.lm_head.forward = failing
    with pytest.raises(RuntimeError, match="injected"):
        cut.step()
    assert [cut.step().loss for _ in range(2)] == losses[3:5]
    cut.save_checkpoint(tmp_path / "c")
    back = session()
    back.load_checkpoint(tmp_path / "c")
    assert [back.step().loss for _ in range(3)] == losses[5:]


def test_a_file_over_the_whole_read_limit_streams(files_of_rows, monkeypatch):
    monkeypatch.setitem(files.LIMITS, "data_bytes", (1024, "test"))
    with pytest.raises(DataError, match="more than nbtune reads"):
        examples_from(Data(str(files_of_rows[1]), columns=MAPPING))
    data = TrainingData(Data(str(files_of_rows[1]), columns=MAPPING, streaming=True), TOK)
    stream, notes = data.stream(nt.Techniques(batch_size=2, seq_len=SEQ))
    assert notes == [] and stream.next()["input_ids"].shape[0] == 2


def test_what_streaming_cannot_read_is_refused_with_the_fix(tmp_path, files_of_rows):
    datasets = pytest.importorskip("datasets")
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps({"prompt": "a", "chosen": "b", "rejected": "c"}) + "\n")
    (tmp_path / "rows.csv").write_text("instruction,output\na,b\n")
    cases = [(Data(str(pairs), streaming=True), "preference pairs and prompts are read whole"),
             (Data(str(tmp_path / "rows.csv"), streaming=True), "streaming reads .parquet and .jsonl"),
             (Data(datasets.Dataset.from_list(demo_rows(3)), streaming=True), "is not one"),
             (Data(str(tmp_path / "none.jsonl"), streaming=True), "no such"),
             (Data(str(files_of_rows[1]), columns={"instruction": "nope"}, streaming=True), "nope")]
    for data, match in cases:
        with pytest.raises(DataError, match=match):
            read_rows(data)
    with pytest.raises(DataError, match="buffer=0"):
        Data("x.jsonl", streaming=True, buffer=0)
    with pytest.raises(DataError, match="streaming=True is for the training rows"):
        TrainingData(str(files_of_rows[0]), TOK, heldout=Data(str(files_of_rows[0]), streaming=True))
    streamed = TrainingData(Data(str(files_of_rows[0]), streaming=True), TOK)
    assert "read the data whole" in streamed.problems(nt.Techniques(objective="dpo"))[0]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(demo_rows(1)[0]) + "\n" + "{not json\n")
    stream, _ = TrainingData(Data(str(bad), streaming=True), TOK).stream(nt.Techniques(batch_size=2, seq_len=SEQ))
    with pytest.raises(DataError, match="line 2: not valid JSON"):
        stream.next()


def test_a_run_file_streams_needs_steps_and_save_config_writes_it_back(tmp_path, files_of_rows):
    entry = {"path": str(files_of_rows[1]), "columns": MAPPING, "streaming": True, "buffer": 7}
    config = {"model": str(nt.models.demo_model_dir()), "data": {"train": entry}, "run": {"steps": 2}}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    session = nt.Session.from_config(tmp_path / "run.yaml")
    assert session.data.streamed and session.trainer.stream.rows.buffer == 7
    written = yaml.safe_load(session.save_config(tmp_path / "again.yaml").read_text())
    train = written["data"]["train"]
    assert (train["streaming"], train["buffer"], train["columns"]) == (True, 7, MAPPING)
    assert nt.Session.from_config(tmp_path / "again.yaml").data.streamed
    config["run"] = {"epochs": 1}
    (tmp_path / "epochs.yaml").write_text(yaml.safe_dump(config))
    with pytest.raises(RunFileError, match=r"data.train.streaming: .*give run.steps"):
        nt.Session.from_config(tmp_path / "epochs.yaml")
