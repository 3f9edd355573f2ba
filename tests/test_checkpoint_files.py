"""Training checkpoints as files nbtune did not write: sharded (torchrun/FSDP2) checkpoints are
safetensors and JSON only, so nothing in a folder is ever unpickled, and a damaged checkpoint,
sharded or not, is refused naming the file before any of it is applied."""

import json
import os
import pickle
import shutil

import pytest
import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import nbtune.checkpoint
from nbtune.checkpoint import CheckpointRefused
from nbtune.distributed import Parallel, Sharding

from helpers import small_session, torchrun

RUN = ("demo: tiny\ntechniques: {batch_size: 4, seq_len: 96, lr: 1e-3}\n"
       "run: {steps: 4, checkpoint_every: 2, save: [hf]}\n")


class Planted:
    """A pickle that creates ``marker`` when it is unpickled: what a crafted file would do."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def local(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (tensor.to_local() if isinstance(tensor, DTensor) else tensor).detach().clone()


def snapshot(session) -> dict:
    """What a load could change: weights, optimizer state, history, data position."""
    names = {id(p): n for n, p in session.model.named_parameters()}
    optimizer = {(names[id(p)], key): local(value) if isinstance(value, torch.Tensor) else value
                 for p, entry in session.trainer.optimizer.state.items() for key, value in entry.items()}
    return {"weights": {n: local(p) for n, p in session.model.named_parameters()},
            "optimizer": optimizer, "history": [(r.step, r.loss) for r in session.history],
            "data": session.trainer.stream.state_dict()}


def assert_same(a: dict, b: dict) -> None:
    assert a["weights"].keys() == b["weights"].keys()
    for name in a["weights"]:
        assert torch.equal(a["weights"][name], b["weights"][name]), name
    assert a["optimizer"].keys() == b["optimizer"].keys()
    for key, value in a["optimizer"].items():
        other = b["optimizer"][key]
        assert torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other, key
    assert a["history"] == b["history"] and a["data"] == b["data"]


def no_pickle_in(folder) -> list[str]:
    """Every file of ``folder``: JSON or safetensors (read here without unpickling), never a
    pickle or a torch.save zip."""
    names = []
    for path in sorted(folder.iterdir()):
        assert path.is_file() and not path.is_symlink(), path
        head = path.read_bytes()[:4]
        assert not head.startswith(b"\x80") and head != b"PK\x03\x04", path  # pickle, torch.save
        if path.suffix == ".json":
            json.loads(path.read_text())
        else:
            assert path.suffix == ".safetensors", path
            with safe_open(str(path), "pt") as f:
                assert all(f.get_tensor(k) is not None for k in f.keys())
        names.append(path.name)
    return names


# ---- sharded, under torchrun: nothing is unpickled ------------------------------------------

@pytest.mark.slow
def test_a_sharded_checkpoint_holds_no_pickle_and_a_planted_one_never_runs_on_resume(tmp_path):
    run_file = tmp_path / "run.yaml"
    run_file.write_text(RUN)
    torchrun(run_file, tmp_path / "out", "--steps", "2")
    folder = tmp_path / "out" / "checkpoints" / "step-00000002"
    assert no_pickle_in(folder) == sorted(
        ["trainer_state.json", "rank0.json", "rank1.json"]
        + [f"{kind}.rank{rank}.safetensors" for kind in ("model", "optimizer", "rng") for rank in (0, 1)])
    # the payload is live: unpickling it does create its marker
    pickle.loads(pickle.dumps(Planted(tmp_path / "proof")))
    assert (tmp_path / "proof").exists()
    # planted where torch.distributed.checkpoint's format was read (its pickled metadata and
    # each rank's data file) and beside the new files
    marker = tmp_path / "ran"
    payload = pickle.dumps(Planted(marker))
    (folder / "shards").mkdir()
    for name in ("shards/.metadata", "shards/__0_0.distcp", "shards/__1_0.distcp", ".metadata"):
        (folder / name).write_bytes(payload)
    done = torchrun(run_file, tmp_path / "out", "--resume")
    assert "resumed from" in done.stdout and "(step 2)" in done.stdout
    assert not marker.exists()
    assert no_pickle_in(tmp_path / "out" / "checkpoints" / "step-00000004")


# ---- sharded, one rank in this process: damaged files refused, nothing applied ---------------

@pytest.fixture(scope="module")
def one_rank():
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    yield Parallel(0, 1, 0, Sharding())
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def sharded(one_rank, tmp_path_factory):
    """A sharded checkpoint after two steps, and that session's state."""
    session = small_session(parallel=one_rank)
    session.step()
    session.step()
    folder = session.save_checkpoint(tmp_path_factory.mktemp("sharded") / "ckpt")
    return folder, snapshot(session)


KEY = "model.layers.1.self_attn.k_proj.weight"


def _edit(name, change):
    def damage(folder):
        tensors = load_file(str(folder / name))
        change(tensors)
        save_file(tensors, str(folder / name))
    return damage


def _truncated(name):
    def damage(folder):
        data = (folder / name).read_bytes()
        (folder / name).write_bytes(data[: len(data) // 2])
    return damage


def _json(name, change):
    def damage(folder):
        record = json.loads((folder / name).read_text())
        change(record)
        (folder / name).write_text(json.dumps(record))
    return damage


def _drop_exp_avg(tensors):
    del tensors[next(k for k in tensors if k.endswith(".exp_avg"))]


SHARDED_DAMAGE = {
    "truncated": (_truncated("model.rank0.safetensors"), CheckpointRefused,
                  r"model\.rank0\.safetensors is damaged"),
    "missing-key": (_edit("model.rank0.safetensors", lambda t: t.pop(KEY)), CheckpointRefused,
                    rf"model\.rank0\.safetensors: the model tensor '{KEY}' is missing"),
    "wrong-shape": (_edit("model.rank0.safetensors", lambda t: t.update({KEY: t[KEY][:-1].clone()})),
                    CheckpointRefused, rf"model\.rank0\.safetensors: '{KEY}' is torch.float32 \(63, 128\)"),
    "wrong-dtype": (_edit("model.rank0.safetensors", lambda t: t.update({KEY: t[KEY].double()})),
                    CheckpointRefused, rf"model\.rank0\.safetensors: '{KEY}' is torch.float64"),
    "extra-key": (_edit("model.rank0.safetensors", lambda t: t.update({"planted": torch.zeros(2)})),
                  CheckpointRefused, r"model\.rank0\.safetensors: it holds 'planted'"),
    "optimizer-key": (_edit("optimizer.rank0.safetensors", _drop_exp_avg), CheckpointRefused,
                      r"optimizer\.rank0\.safetensors: the optimizer state tensor 'state\..*\.exp_avg'"),
    "optimizer-truncated": (_truncated("optimizer.rank0.safetensors"), CheckpointRefused,
                            r"optimizer\.rank0\.safetensors is damaged"),
    "rng-dtype": (_edit("rng.rank0.safetensors", lambda t: t.update(cpu=t["cpu"].long())),
                  CheckpointRefused, r"rng\.rank0\.safetensors: the RNG state 'cpu' is torch.int64"),
    "no-rng": (lambda folder: (folder / "rng.rank0.safetensors").unlink(), FileNotFoundError,
               r"rng\.rank0\.safetensors missing"),
    "listing-field": (_json("rank0.json", lambda r: r["optimizer"]["param_groups"][0].update(eps="small")),
                      CheckpointRefused, r"rank0\.json: the field 'optimizer\.param_groups\[0\]\.eps'"),
    "listing-garbage": (lambda folder: (folder / "rank0.json").write_text('{"files": {"mod'),
                        CheckpointRefused, r"rank0\.json is damaged"),
    "state-field": (_json("trainer_state.json", lambda r: r["history"][0].update(loss="low")),
                    CheckpointRefused, r"trainer_state\.json: the field 'history\[0\]\.loss'"),
    "nan-weight": (_edit("model.rank0.safetensors", lambda t: t[KEY].view(-1).__setitem__(5, float("nan"))),
                   CheckpointRefused, rf"{KEY} in .*model\.rank0\.safetensors holds NaN or infinite"),
}


@pytest.mark.parametrize("damage,error,match", SHARDED_DAMAGE.values(), ids=SHARDED_DAMAGE.keys())
def test_a_damaged_sharded_checkpoint_is_refused_naming_the_file_and_nothing_applied(
        one_rank, sharded, tmp_path, damage, error, match):
    original, saved = sharded
    folder = shutil.copytree(original, tmp_path / "ckpt")
    damage(folder)
    session = small_session(parallel=one_rank)  # fresh: its optimizer holds no state yet
    before = snapshot(session)
    with pytest.raises(error, match=match) as refused:
        session.load_checkpoint(folder)
    assert "Nothing was loaded" in str(refused.value)
    assert_same(snapshot(session), before)
    assert not session.trainer.optimizer.state
    session.load_checkpoint(original)  # and the sound checkpoint still loads, exactly
    assert_same(snapshot(session), saved)


def test_a_sharded_lora_checkpoint_resumes_exactly(one_rank, tmp_path):
    """Only the adapters are saved (the frozen base is the run file's), and they load back."""
    changes = dict(method="lora", lora_rank=4, lora_dropout=0.1, parallel=one_rank)
    first = small_session(**changes)
    first.step()
    folder = first.save_checkpoint(tmp_path / "ckpt")
    assert not any("base_layer" in k for k in load_file(str(folder / "model.rank0.safetensors")))
    expected = [first.step().loss for _ in range(2)]
    second = small_session(**changes)
    second.load_checkpoint(folder)
    assert [second.step().loss for _ in range(2)] == expected
    assert_same(snapshot(second), snapshot(first))


def test_an_old_sharded_checkpoint_is_refused_without_reading_its_pickle(one_rank, sharded, tmp_path):
    folder = tmp_path / "old"
    (folder / "shards").mkdir(parents=True)
    (folder / "shards" / ".metadata").write_bytes(pickle.dumps(Planted(tmp_path / "ran")))
    state = json.loads((sharded[0] / "trainer_state.json").read_text())
    del state["format"]  # as torch.distributed.checkpoint's layout was recorded
    (folder / "trainer_state.json").write_text(json.dumps(state))
    session = small_session(parallel=one_rank)
    with pytest.raises(CheckpointRefused, match="another version of nbtune.*no longer reads"):
        session.load_checkpoint(folder)
    assert not (tmp_path / "ran").exists() and session.history == []


def test_a_sharded_save_that_fails_keeps_the_previous_checkpoint_whole(one_rank, tmp_path, monkeypatch):
    session = small_session(parallel=one_rank)
    session.step()
    folder = session.save_checkpoint(tmp_path / "ckpt")
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    session.step()
    real = nbtune.checkpoint.save_file

    def failing(tensors, path, *args, **kwargs):
        if "optimizer" in os.path.basename(path):
            raise OSError("disk full (injected)")
        return real(tensors, path, *args, **kwargs)

    monkeypatch.setattr(nbtune.checkpoint, "save_file", failing)
    with pytest.raises(OSError, match="injected"):
        session.save_checkpoint(folder)
    monkeypatch.undo()
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]  # no temporary left behind
    session.save_checkpoint(folder)  # replaced whole
    assert len(json.loads((folder / "trainer_state.json").read_text())["history"]) == 2
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(ValueError, match="symbolic link"):  # never followed, never replaced
        session.save_checkpoint(tmp_path / "link")
    assert list((tmp_path / "elsewhere").iterdir()) == []


# ---- single process: the RNG and every field checked before anything is applied -------------

@pytest.fixture(scope="module")
def single(tmp_path_factory):
    session = small_session()
    session.step()
    session.step()
    return session.save_checkpoint(tmp_path_factory.mktemp("single") / "ckpt")


@pytest.fixture(scope="module")
def twin():
    session = small_session()
    session.step()
    return snapshot(session)


def _rng(change):
    return _edit("rng.safetensors", change)


RNG_DAMAGE = {
    "renamed": (_rng(lambda t: t.update(state=t.pop("cpu"))), r"rng\.safetensors: it holds \['state'\]"),
    "extra-name": (_rng(lambda t: t.update(gpu0=t["cpu"].clone())), r"rng\.safetensors: it holds \['cpu', 'gpu0'\]"),
    "dtype": (_rng(lambda t: t.update(cpu=t["cpu"].long())), r"rng\.safetensors: the RNG state 'cpu' is torch.int64"),
    "size": (_rng(lambda t: t.update(cpu=t["cpu"][:100].clone())), r"rng\.safetensors: the CPU RNG state has 100 bytes"),
    "truncated": (_truncated("rng.safetensors"), r"rng\.safetensors is damaged"),
}


@pytest.mark.parametrize("damage,match", RNG_DAMAGE.values(), ids=RNG_DAMAGE.keys())
def test_a_damaged_rng_file_is_refused_before_weights_or_history_are_applied(single, twin, tmp_path,
                                                                             damage, match):
    folder = shutil.copytree(single, tmp_path / "ckpt")
    damage(folder)
    session = small_session()
    session.step()
    rng = torch.get_rng_state()
    with pytest.raises(CheckpointRefused, match=match) as refused:
        session.load_checkpoint(folder)
    assert "Nothing was loaded" in str(refused.value)
    assert_same(snapshot(session), twin)
    assert torch.equal(torch.get_rng_state(), rng)


def _set(*path_and_value):
    *path, value = path_and_value

    def change(record):
        for key in path[:-1]:
            record = record[key]
        record[path[-1]] = value
    return _json("trainer_state.json", change)


FIELD_DAMAGE = {
    "full_weights": (_set("full_weights", "yes"), r"the field 'full_weights' is str 'yes', but it must be true or false"),
    "base_changed": (_set("base_changed", 0), r"the field 'base_changed' is int 0"),
    "data.position": (_set("data", "position", "3"), r"the field 'data\.position' is str '3', but it must be an integer"),
    "history.loss": (_set("history", 1, "loss", "low"), r"the field 'history\[1\]\.loss' is str 'low'"),
    "history.memory": (_set("history", 0, "memory", "peak", "big"), r"the field 'history\[0\]\.memory\.peak' is str"),
    "history": (_set("history", {}), r"the field 'history' is dict"),
    "history.usage.source": (_set("history", 0, "usage", "source", "gpu"),
                             r"the field 'history\[0\]\.usage\.source' must be one of allocator, resident"),
    "history.usage.peak": (_set("history", 1, "usage", "peak", -1),
                           r"the field 'history\[1\]\.usage\.peak' is negative"),
    "history.preference": (_set("history", 0, "preference", {"margin": "wide"}),
                           r"the field 'history\[0\]\.preference\.chosen_reward' is missing"),
    "history.preference.extra": (_set("history", 0, "preference", {"chosen_reward": 0, "rejected_reward": 0,
                                                                  "margin": 0, "accuracy": 0, "planted": 1}),
                                 r"the field 'history\[0\]\.preference' must hold exactly"),
    "techniques": (_set("techniques", "lr", "fast"), r"the field 'techniques' does not hold valid techniques \(lr"),
    "params": (_set("optimizer", "param_groups", 0, "params", ["a"]), r"the field 'optimizer\.param_groups\[0\]\.params'"),
    # torch's load_state_dict would copy these over the run's own settings
    "betas": (_set("optimizer", "param_groups", 0, "betas", [0.9]), r"the field 'optimizer\.param_groups\[0\]\.betas' is \[0\.9\]"),
    "eps": (_set("optimizer", "param_groups", 0, "eps", "tiny"), r"the field 'optimizer\.param_groups\[0\]\.eps' is 'tiny'"),
    "planted-setting": (_set("optimizer", "param_groups", 0, "planted", 1), r"the field 'optimizer\.param_groups\[0\]' holds \["),
    "groups": (_set("optimizer", "param_groups", []), r"param_groups are 0 groups, but this run's optimizer has 1"),
    "files": (_set("files", "weights", "weights.safetensors"), r"the field 'files\.weights' is str"),
    "fingerprint": (_set("base_fingerprint", None), r"the field 'base_fingerprint' is NoneType None"),
}


@pytest.mark.parametrize("damage,match", FIELD_DAMAGE.values(), ids=FIELD_DAMAGE.keys())
def test_a_wrong_typed_field_is_refused_naming_it_before_anything_is_applied(single, twin, tmp_path,
                                                                             damage, match):
    folder = shutil.copytree(single, tmp_path / "ckpt")
    damage(folder)
    session = small_session()
    session.step()
    with pytest.raises(CheckpointRefused, match=match) as refused:
        session.load_checkpoint(folder)
    assert str(folder / "trainer_state.json") in str(refused.value)
    assert "Nothing was loaded" in str(refused.value)
    assert_same(snapshot(session), twin)


@pytest.mark.parametrize("name,value", [("weights.safetensors", float("nan")),
                                        ("optimizer.safetensors", float("-inf"))])
def test_a_checkpoint_holding_nan_or_infinity_is_refused_naming_file_and_tensor(single, twin, tmp_path,
                                                                                name, value):
    """A diverged run's checkpoint would train on silently: refused like a damaged one."""
    folder = shutil.copytree(single, tmp_path / "ckpt")
    tensors = load_file(str(folder / name))
    key = sorted(k for k, t in tensors.items() if t.is_floating_point() and t.numel() > 1)[-1]
    tensors[key].view(-1)[1] = value
    save_file(tensors, str(folder / name))
    session = small_session()
    session.step()
    with pytest.raises(CheckpointRefused, match=rf"{key} in .*{name} holds NaN or infinite") as refused:
        session.load_checkpoint(folder)
    assert str(folder / name) in str(refused.value) and "Nothing was loaded" in str(refused.value)
    assert_same(snapshot(session), twin)


def test_each_steps_metered_figure_comes_back_with_the_history(single):
    saved = json.loads((single / "trainer_state.json").read_text())["history"]
    assert [row["usage"]["source"] for row in saved] == ["resident", "resident"]  # Linux
    session = small_session()
    session.load_checkpoint(single)
    assert [r.usage.as_dict() for r in session.history] == [row["usage"] for row in saved]


def test_a_sharded_checkpoint_in_one_process_says_to_use_torchrun(sharded):
    session = small_session()
    with pytest.raises(CheckpointRefused, match="sharded checkpoint.*under torchrun"):
        session.load_checkpoint(sharded[0])
    assert session.history == []


def test_the_trainer_checks_a_given_states_rng_before_applying_any_of_it(single, twin):
    """The trainer's own load_state_dict (not only the checkpoint reader): a state whose RNG
    cannot be set is refused before its weights, optimizer state and history are written."""
    state = nbtune.checkpoint.read_training_checkpoint(single)
    state["rng"] = {"cpu": state["rng"]["cpu"][:10].clone()}
    session = small_session()
    session.step()
    with pytest.raises(ValueError, match="RNG cannot be restored.*10 bytes.*Nothing was loaded"):
        session.trainer.load_state_dict(state)
    assert_same(snapshot(session), twin)
    assert session.trainer.damaged is None
