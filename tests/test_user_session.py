"""The main features on a session built as a user builds one: a model folder and one JSONL
file of their own, no held-out split (the demos all have one, and compare() once needed it)."""

import json
import shutil

import pytest
import torch

import nbtune as nt
from nbtune.data import DataError, load_examples
from nbtune.models import demo_model_dir, load_model
from nbtune.session import demo_data_file


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("user")
    folder = root / "my-model"
    shutil.copytree(demo_model_dir(), folder)  # config.json, model.safetensors, tokenizer.json
    rows = [json.loads(line) for line in demo_data_file("train").read_text().splitlines()[:48]]
    data = root / "train.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return folder, data


def build(files):
    folder, data = files
    torch.manual_seed(0)
    session = nt.Session.from_pretrained(folder, data=str(data), device="cpu",
                                         techniques=nt.Techniques(batch_size=4, seq_len=96, lr=1e-3))
    session.echo = False
    return session


def weights(session):
    return {n: p.detach().clone() for n, p in session.model.named_parameters()}


def test_the_main_features_without_a_held_out_split(files, tmp_path):
    session = build(files)
    assert session.heldout_examples == []
    first = session.step()
    assert first.loss > 0 and first.memory.peak > 0
    assert len(session.run(3, progress=False, live=False)) == 3
    run = session.start(4)
    assert len(run.wait(120)) == 4 and len(session.history) == 8

    before, techniques, history = weights(session), session.techniques, list(session.history)
    ladder = session.compare([{}, {"activation_checkpointing": True}], steps=2, progress=False)
    assert len(ladder) == 2 and all(row.peak > 0 for row in ladder.rows)
    assert ladder.rows[1].peak < ladder.rows[0].peak  # checkpointing holds less
    after = weights(session)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert session.techniques == techniques and session.history == history

    assert session.fit("24GiB").fits and session.estimate().peak > 0

    session.save(tmp_path / "out")
    ids = torch.randint(0, 250, (2, 20))
    session.model.eval()
    with torch.no_grad():
        assert torch.equal(load_model(tmp_path / "out").eval()(ids), session.model(ids))
    session.model.train()

    session.save_checkpoint(tmp_path / "ckpt")
    ahead = [session.step().loss for _ in range(2)]
    other = build(files)
    other.load_checkpoint(tmp_path / "ckpt")
    assert [other.step().loss for _ in range(2)] == ahead
    mine, theirs = weights(session), weights(other)
    assert all(torch.equal(mine[k], theirs[k]) for k in mine)

    assert isinstance(session.generate("Reverse the word.", input="abc", max_new_tokens=5), str)
    with pytest.raises(DataError, match="heldout="):
        session.evaluate()
    score = session.evaluate(examples=load_examples(demo_data_file("heldout"))[:3])
    assert 0.0 <= score <= 1.0
