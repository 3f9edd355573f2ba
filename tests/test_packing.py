"""Packing: several examples per sequence, with a document mask, give the unpacked loss."""

import pytest
import torch

from nbtune.data import IGNORE, collate, pack, tokenize_all
from nbtune.loss import cross_entropy_sum

from helpers import small_session


def loss_of(model, batch):
    hidden = model.hidden_states(batch["input_ids"], positions=batch.get("positions"),
                                 document_ids=batch.get("document_ids"))
    trained = (batch["labels"] != IGNORE).sum()
    return cross_entropy_sum(model.lm_head, hidden, batch["labels"]) / trained


@pytest.mark.slow
def test_packed_loss_equals_unpacked_loss():
    session = small_session()
    samples, _ = tokenize_all(session.train_examples[:12], session.tokenizer, 96)
    packed = pack(samples, seq_len=256)
    assert len(packed) < len(samples) // 2  # several examples really share a row
    model = session.model.eval()
    with torch.no_grad():
        plain = loss_of(model, collate(samples, session.tokenizer.pad_id))
        together = loss_of(model, collate(packed, session.tokenizer.pad_id))
    torch.testing.assert_close(together, plain, atol=1e-5, rtol=0)


def test_without_the_document_mask_examples_would_see_each_other():
    session = small_session()
    samples, _ = tokenize_all(session.train_examples[:12], session.tokenizer, 96)
    batch = collate(pack(samples, seq_len=256), session.tokenizer.pad_id)
    model = session.model.eval()
    with torch.no_grad():
        masked = loss_of(model, batch)
        leaky = loss_of(model, {"input_ids": batch["input_ids"], "labels": batch["labels"]})
    assert (masked - leaky).abs() > 1e-3


def test_pack_keeps_every_token_and_restarts_positions():
    session = small_session()
    samples, _ = tokenize_all(session.train_examples[:20], session.tokenizer, 96)
    packed = pack(samples, seq_len=200)
    assert all(len(row.input_ids) <= 200 for row in packed)
    assert sum(len(r.input_ids) for r in packed) == sum(len(s.input_ids) for s in samples)
    row = packed[0]
    starts = (row.positions == 0).nonzero().flatten().tolist()
    assert starts[0] == 0 and len(starts) == len(set(row.document_ids.tolist())) >= 2
    assert torch.equal(torch.cat([row.labels for row in packed]),
                       torch.cat([s.labels for s in samples]))


@pytest.mark.slow
def test_packing_toggle_trains_with_fewer_padding_tokens():
    plain = small_session(batch_size=4)
    packed = small_session(batch_size=2, packing=True, seq_len=256)
    a, b = plain.step(), packed.step()
    assert b.loss > 0 and b.tokens > a.tokens  # two packed rows carry more than four examples
    assert "document_ids" in packed.trainer.stream.next()


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_packed_training_matches_unpacked_over_five_steps(optimizer):
    from nbtune.step import StepOptions, train_step

    lr = 1e-3 if optimizer == "adamw" else 0.1
    plain = small_session(optimizer=optimizer, lr=lr)
    packed = small_session(optimizer=optimizer, lr=lr)
    samples, _ = tokenize_all(plain.train_examples[:20], plain.tokenizer, 96)
    pad = plain.tokenizer.pad_id
    losses = {"plain": [], "packed": []}
    for i in range(5):
        group = samples[4 * i: 4 * i + 4]  # the same four examples in both runs
        losses["plain"].append(train_step(plain.model, plain.optimizer, [collate(group, pad)],
                                          StepOptions(), pad_id=pad, step=i + 1).loss)
        losses["packed"].append(train_step(packed.model, packed.optimizer,
                                           [collate(pack(group, 400), pad)], StepOptions(),
                                           pad_id=pad, step=i + 1).loss)
    torch.testing.assert_close(losses["packed"], losses["plain"], atol=1e-5, rtol=0)
    if optimizer == "sgd":  # AdamW turns rounding noise on near-zero gradients into ~lr
        for (name, a), (_, b) in zip(plain.model.named_parameters(), packed.model.named_parameters()):
            torch.testing.assert_close(b, a, atol=1e-5, rtol=0, msg=name)
