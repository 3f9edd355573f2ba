"""Techniques that interact, each pair against the plain combination it must equal.

One field at a time is ``test_every_field.py``; single memory techniques against the plain
step are ``test_techniques.py`` and ``test_session.py``. Here the pairs whose code paths
meet:

* gradient clipping x accumulation: 2 micro-batches of 4 clip the *accumulated* gradient,
  exactly as one batch of 8 (clipping each micro-batch's part would differ);
* chunked loss x accumulation: the chunked, accumulated loss and update equal one plain
  batch of 8 (a chunk lost, or a normaliser per micro-batch, would differ);
* optimizer in backward x activation checkpointing: each weight stepped from its hook
  while layers are recomputed equals the plain step;
* resume x each of those: a run stopped after 2 steps, saved (``save_checkpoint`` or
  ``state_dict``) and continued in a fresh session equals the uninterrupted run bit for
  bit, across the end of warm-up; the learning rate is pinned at the first, the boundary
  and the last step.

SGD where weights are compared: its update is linear in the gradient, so float
reordering stays at ~1e-7 (AdamW's first steps turn rounding noise on near-zero gradients
into ~lr, see test_session.py).
"""

from __future__ import annotations

import copy

import pytest
import torch

import nbtune as nt
import nbtune.loss

from helpers import small_session

STEPS = 3
ATOL = 1e-5
SGD = dict(optimizer="sgd", lr=0.1)
CLIP = 0.5  # far below every step's gradient norm here (measured 9.5-12.9): the clip always acts

pytestmark = pytest.mark.usefixtures("one_thread")


def session(**changes) -> nt.Session:
    s = small_session(**changes)
    s.memory_tracking = "off"  # the same maths, 3x faster on CPU
    return s


def run(steps: int = STEPS, **changes) -> tuple[nt.Session, list[float]]:
    s = session(**changes)
    return s, [s.step().loss for _ in range(steps)]


def assert_same_run(a, b, atol: float = ATOL) -> None:
    (sa, la), (sb, lb) = a, b
    torch.testing.assert_close(la, lb, atol=atol, rtol=0)
    pa, pb = dict(sa.model.named_parameters()), dict(sb.model.named_parameters())
    assert pa.keys() == pb.keys()
    for name in pa:
        torch.testing.assert_close(pa[name], pb[name], atol=atol, rtol=0, msg=name)


def moved(s: nt.Session) -> float:
    """How far the weights moved from the checkpoint they were loaded from."""
    start = nt.load_model(s.source or nt.models.demo_model_dir())
    return max((p - start.get_parameter(n)).abs().max().item() for n, p in s.model.named_parameters())


@pytest.fixture
def clip_norms(monkeypatch):
    """The total gradient norm of every clip_grad_norm_ call (as the step looks it up)."""
    norms = []
    utils = torch.nn.utils
    real = utils.clip_grad_norm_

    def spy(parameters, max_norm, *args, **kwargs):
        norm = real(parameters, max_norm, *args, **kwargs)
        norms.append((float(norm), max_norm))
        return norm

    monkeypatch.setattr(utils, "clip_grad_norm_", spy)
    return norms


# ---- pairs against the plain combination --------------------------------------------------

def test_clipped_accumulation_equals_one_clipped_batch(clip_norms):
    big = run(batch_size=8, max_grad_norm=CLIP, **SGD)
    accumulated = run(batch_size=4, grad_accum=2, max_grad_norm=CLIP, **SGD)
    assert_same_run(accumulated, big)
    assert moved(big[0]) > 100 * ATOL
    # One clip per step, of the whole step's gradient: the same norm in both runs, above
    # the limit every time (so the clip scaled every update).
    assert [limit for _, limit in clip_norms] == [CLIP] * 2 * STEPS
    norms = [n for n, _ in clip_norms]
    assert min(norms) > 2 * CLIP
    torch.testing.assert_close(norms[STEPS:], norms[:STEPS], atol=0, rtol=1e-5)


@pytest.mark.parametrize("chunks", [3, 4])
def test_chunked_accumulated_loss_equals_one_plain_batch(chunks, monkeypatch):
    widths = []
    real = nbtune.loss._piece_loss

    def spy(logits, labels):  # each piece's loss, kept or recomputed
        widths.append(logits.shape[1])
        return real(logits, labels)

    big = run(batch_size=8, **SGD)
    monkeypatch.setattr(nbtune.loss, "_piece_loss", spy)
    chunked = run(batch_size=4, grad_accum=2, chunked_loss=chunks, **SGD)
    assert len(set(widths)) > 1  # some sequence did not divide evenly: a shorter last chunk
    assert_same_run(chunked, big)
    assert moved(big[0]) > 100 * ATOL


@pytest.mark.parametrize("optimizer, lr", [("sgd", 0.1), ("adamw", 1e-3)])
def test_optimizer_in_backward_with_checkpointing_equals_the_plain_step(optimizer, lr):
    plain = run(optimizer=optimizer, lr=lr)
    paired = run(optimizer=optimizer, lr=lr, optimizer_in_backward=True, activation_checkpointing=True)
    assert all(layer.checkpointed for layer in paired[0].model.model.layers)
    assert isinstance(paired[0].optimizer, nt.optim.OptimizerInBackward)
    assert_same_run(paired, plain)
    assert moved(plain[0]) > 100 * ATOL


# ---- resume x each pair -------------------------------------------------------------------

WARMUP = 3
PAIRS = {
    "clip-x-accum": dict(batch_size=4, grad_accum=2, max_grad_norm=CLIP, **SGD),
    "chunked-x-accum": dict(batch_size=4, grad_accum=2, chunked_loss=3, lr=1e-3),  # AdamW state
    "in-backward-x-checkpointing": dict(optimizer_in_backward=True, activation_checkpointing=True,
                                        lr=1e-3),
}
RESUME_STEPS, SPLIT = 4, 2  # warm-up ends at step 3, after the resume

_straight: dict = {}


def straight(name: str):
    """The uninterrupted run of a pair: (session, losses), made once per module."""
    if name not in _straight:
        _straight[name] = run(RESUME_STEPS, warmup_steps=WARMUP, **PAIRS[name])
    return _straight[name]


def optimizer_tensors(s: nt.Session) -> dict:
    return {f"{i}.{k}": v for i, entry in s.optimizer.state_dict()["state"].items()
            for k, v in entry.items() if isinstance(v, torch.Tensor)}


@pytest.mark.slow
@pytest.mark.parametrize("how", ["checkpoint", "state_dict"])
@pytest.mark.parametrize("name", list(PAIRS))
def test_resumed_pair_equals_the_uninterrupted_run_bit_for_bit(tmp_path, name, how):
    changes = dict(warmup_steps=WARMUP, **PAIRS[name])
    expected_session, expected = straight(name)

    first, losses = run(SPLIT, **changes)
    if how == "checkpoint":
        first.save_checkpoint(tmp_path / "ckpt")
    else:
        state = copy.deepcopy(first.state_dict())
    del first
    second = session(**changes)
    second.step()  # a fresh session that has moved on its own: loading must undo that
    torch.manual_seed(1234)  # and another RNG state
    if how == "checkpoint":
        second.load_checkpoint(tmp_path / "ckpt")
    else:
        second.load_state_dict(state)
    assert len(second.history) == SPLIT
    losses += [second.step().loss for _ in range(RESUME_STEPS - SPLIT)]

    assert losses == expected
    ours, theirs = dict(second.model.named_parameters()), dict(expected_session.model.named_parameters())
    for n in ours:
        assert torch.equal(ours[n], theirs[n]), n
    a, b = optimizer_tensors(second), optimizer_tensors(expected_session)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # SGD: none
    assert second.trainer.stream.state_dict() == expected_session.trainer.stream.state_dict()
    # The schedule across the resume: first step, the last of warm-up, the boundary, after.
    lr = second.techniques.lr
    assert [r.step for r in second.history] == [1, 2, 3, 4]
    assert [r.lr for r in second.history] == pytest.approx([lr / 3, 2 * lr / 3, lr, lr], rel=1e-12)
    assert {g["lr"] for g in second.optimizer.param_groups} == {lr}


# ---- the schedule itself ------------------------------------------------------------------

@pytest.mark.parametrize("warmup", [0, 1, 2, 5])
def test_schedule_at_first_boundary_and_last_steps(warmup):
    lr = 3e-4
    t = nt.Techniques(lr=lr, warmup_steps=warmup)
    expected = {1: lr / warmup if warmup else lr}  # the first step is never at lr 0
    if warmup >= 2:
        expected[warmup - 1] = lr * (warmup - 1) / warmup  # the last step of warm-up
    expected.update({max(warmup, 1): lr, warmup + 1: lr, 10_000: lr})  # the boundary, after, last
    for step, value in expected.items():
        assert t.lr_at(step) == pytest.approx(value, rel=1e-12), step
    trace = [t.lr_at(s) for s in range(1, warmup + 3)]
    assert trace == sorted(trace) and max(trace) == lr  # rises to lr, never above


def test_lora_with_offloading_and_chunked_loss_equals_plain_lora():
    """Found by the fit search: on a LoRA model, recomputing a loss chunk under the offload
    hooks failed torch's checkpoint metadata check. Now the same maths as plain LoRA."""
    from helpers import small_session

    plain = small_session(method="lora", lr=1e-2)
    mixed = small_session(method="lora", lr=1e-2, activation_checkpointing=True,
                          activation_offloading=True, chunked_loss=8)
    a = [plain.step().loss for _ in range(3)]
    b = [mixed.step().loss for _ in range(3)]
    torch.testing.assert_close(b, a, atol=1e-5, rtol=0)
