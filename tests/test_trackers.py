"""Trackers, each read back with its own library's reader (TensorBoard's event reader, trackio's
local store, W&B's offline run file through W&B's own record format, MLflow's client on its
local store): every step's loss and memory figure, the techniques as the configuration, a
toggle changed mid-run at its step, the estimate and the held-out result; a tracker that fails
is said once and the run goes on, bit for bit as without it."""

import glob
import json
import math
import struct
import time

import pytest

import nbtune as nt
from nbtune import trackers as tk

ALL = ("tensorboard", "trackio", "wandb", "mlflow")


@pytest.fixture
def offline(tmp_path, monkeypatch):
    """Every tracker kept in tmp_path and off the network."""
    for name in ALL:
        pytest.importorskip(tk.MODULES[name])
    import trackio.sqlite_storage

    monkeypatch.setattr(trackio.sqlite_storage, "TRACKIO_DIR", tmp_path / "trackio")
    monkeypatch.setenv("TRACKIO_DIR", str(tmp_path / "trackio"))
    for var in ("WANDB_API_KEY", "MLFLOW_TRACKING_URI", "WANDB_MODE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))  # no W&B login: offline
    monkeypatch.setenv("WANDB_SILENT", "true")
    return tmp_path


def wandb_records(folder, wait: float = 30.0):
    """The records of W&B's offline run file, once W&B's service has written its exit record
    (``run.finish()`` returns before that: on a loaded machine the last steps' history came
    30 ms after it; at most ``wait`` seconds, then what is there)."""
    (path,) = glob.glob(str(folder / "wandb" / "offline-run-*" / "run-*.wandb"))
    deadline = time.monotonic() + wait
    while True:
        records = _wandb_file_records(path)
        if (records and records[-1].WhichOneof("record_type") == "exit") or time.monotonic() > deadline:
            return records
        time.sleep(0.05)


def _wandb_file_records(path):
    """A W&B run file's LevelDB-log framing (a 7-byte file header, then 32 KiB blocks of
    [crc 4, length 2, type 1] chunks) around W&B's own protobuf Records."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = open(path, "rb").read()
    assert data[:4] == b":W&B"
    records, pending, pos, block = [], b"", 7, 32768
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # the block's tail is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if (kind == 0 and length == 0) or pos + 7 + length > len(data):  # (the end, or being written)
            break
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST
            record = pb.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def wandb_history(folder) -> tuple[list[dict], dict]:
    rows, config = [], {}
    for record in wandb_records(folder):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item})
        elif kind in ("run", "config"):  # the configuration comes with the run record
            updates = record.run.config.update if kind == "run" else record.config.update
            config.update({item.key: json.loads(item.value_json) for item in updates})
    return rows, config


def test_every_tracker_holds_every_step_the_config_a_change_and_the_estimate(offline):
    session = nt.Session.demo(eval_every=0)
    logs = session.log_to(*ALL, folder=offline / "logs", project="demo", name="first")
    assert sorted(logs.open) == sorted(ALL)
    session.run(2, progress=False)
    session.set(lr=5e-4)
    session.run(1, progress=False)
    score = session.evaluate(session.heldout_examples[:2])
    session.log_to()  # stops logging: every tracker closed, its files complete
    assert session.trackers is None
    losses = [r.loss for r in session.history]
    peaks = [r.memory.peak for r in session.history]
    estimate = session.estimate().peak  # after the change: what the trackers logged at step 3

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(offline / "logs" / "tensorboard" / "first"))
    events.Reload()
    assert [(e.step, pytest.approx(e.value, rel=1e-6)) for e in events.Scalars("train/loss")] == \
        list(zip([1, 2, 3], losses))
    assert [e.value for e in events.Scalars("memory/peak_bytes")] == pytest.approx(peaks, rel=1e-6)
    assert [e.step for e in events.Scalars("memory/estimate_bytes")] == [1, 3]
    assert events.Scalars("memory/estimate_bytes")[-1].value == pytest.approx(estimate, rel=1e-6)
    assert [(e.step, e.value) for e in events.Scalars("techniques/lr")] == [(3, pytest.approx(5e-4))]
    assert events.Scalars("eval/score")[0].value == pytest.approx(score)

    from trackio.sqlite_storage import SQLiteStorage

    rows = SQLiteStorage.get_logs("demo", "first")
    stepped = [r for r in rows if "train/loss" in r]
    assert [(r["step"], r["train/loss"]) for r in stepped] == list(zip([1, 2, 3], losses))
    assert [r["memory/peak_bytes"] for r in stepped] == peaks
    assert SQLiteStorage.get_run_config("demo", "first")["lr"] == session.history[0].lr

    history, config = wandb_history(offline / "logs")
    stepped = [r for r in history if "train/loss" in r]
    assert [(r["_step"], r["train/loss"]) for r in stepped] == list(zip([1, 2, 3], losses))
    assert [r["memory/peak_bytes"] for r in stepped] == peaks
    assert any("lr" in str(r.get("changes", "")) for r in history if r.get("_step") == 3)
    assert config["lr"] == session.history[0].lr

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=(offline / "logs" / "mlruns").resolve().as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("demo").experiment_id])
    history = client.get_metric_history(run.info.run_id, "train/loss")
    assert sorted((m.step, m.value) for m in history) == list(zip([1, 2, 3], losses))
    assert sorted(m.value for m in client.get_metric_history(run.info.run_id, "memory/peak_bytes")) == \
        sorted(float(p) for p in peaks)
    assert float(run.data.params["lr"]) == session.history[0].lr
    assert "lr" in run.data.tags["changed at step 3"]
    assert math.isclose(client.get_metric_history(run.info.run_id, "eval/score")[0].value, score)


def test_a_failing_tracker_is_said_once_and_the_run_goes_on_bit_for_bit(offline, monkeypatch):
    twin = nt.Session.demo(eval_every=0)
    twin.run(3, progress=False)
    session = nt.Session.demo(eval_every=0)
    said = []
    session.subscribe(lambda e: said.append(e.text) if e.kind == "message" else None)

    def full_disk(self, metrics, step):
        if step >= 2:
            raise OSError(28, "No space left on device")
    monkeypatch.setattr(tk._TensorBoard, "log", full_disk)
    logs = session.log_to("tensorboard", "mlflow", folder=offline / "logs", name="disk")
    session.run(3, progress=False)
    assert [r.loss for r in session.history] == [r.loss for r in twin.history]
    failed = [text for text in said if "tensorboard failed" in text]
    assert len(failed) == 1 and "No space left on device" in failed[0] and "goes on without it" in failed[0]
    assert list(logs.open) == ["mlflow"]  # the other tracker keeps every step
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=(offline / "logs" / "mlruns").resolve().as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("nbtune").experiment_id])
    assert len(client.get_metric_history(run.info.run_id, "train/loss")) == 3
    session.close()


def test_unknown_or_missing_trackers_are_refused_before_anything_changes(monkeypatch):
    session = nt.Session.demo()
    with pytest.raises(tk.TrackerError, match="'comet' is not a tracker nbtune logs to; it knows "
                                              "tensorboard, trackio, wandb, mlflow"):
        session.log_to("comet")
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(tk.TrackerError, match=r"wandb is not installed: pip install wandb"):
        session.log_to("tensorboard", "wandb")
    assert session.trackers is None


def test_run_file_logs_to_trackers(offline, monkeypatch):
    import yaml

    from nbtune.cli import main as cli
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    nt.Session.demo().save_config(offline / "run.yaml", steps=2)
    text = yaml.safe_load((offline / "run.yaml").read_text())
    text["run"]["log"] = ["tensorboard", "mlflow"]
    (offline / "run.yaml").write_text(yaml.safe_dump(text))
    assert cli.main(["train", str(offline / "run.yaml"), "--out", str(offline / "o")]) == 0
    metrics = [json.loads(line) for line in (offline / "o" / "metrics.jsonl").read_text().splitlines()]
    events = EventAccumulator(str(offline / "o" / "tensorboard"))
    events.Reload()
    assert [e.value for e in events.Scalars("train/loss")] == pytest.approx([m["loss"] for m in metrics], rel=1e-6)
    assert [e.step for e in events.Scalars("memory/estimate_bytes")] == [1]
    # an estimate that fails is said and left out: the run and the other figures go on
    import nbtune.predict

    def broken(*args, **kwargs):
        raise RuntimeError("no estimate for this model")
    monkeypatch.setattr(nbtune.predict.Predictor, "of", broken)
    assert cli.main(["train", str(offline / "run.yaml"), "--out", str(offline / "o3")]) == 0
    events = EventAccumulator(str(offline / "o3" / "tensorboard"))
    events.Reload()
    assert len(events.Scalars("train/loss")) == 2 and "memory/estimate_bytes" not in events.Tags()["scalars"]
    text["run"]["log"] = ["comet"]
    (offline / "bad.yaml").write_text(yaml.safe_dump(text))
    assert cli.main(["train", str(offline / "bad.yaml"), "--out", str(offline / "o2")]) == 2


@pytest.mark.slow  # (5 s or more here; the fast tier has this module's others)
def test_logging_starts_and_stops_during_a_background_run(offline):
    session = nt.Session.demo(eval_every=0)
    run = session.start(40)
    session.log_to("tensorboard", folder=offline / "logs", name="mid")
    while len(session.history) < 5:
        run.wait(0.05)
    session.log_to()  # closed while the run's thread keeps stepping: nothing written after
    run.wait()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(offline / "logs" / "tensorboard" / "mid"))
    events.Reload()
    steps = [e.step for e in events.Scalars("train/loss")]
    assert steps and steps == sorted(set(steps)) and steps[-1] < 40
    assert len(session.history) == 40
