"""The training step against independent references, not another nbtune path.

* A hand-written loop (logits -> summed cross-entropy / trained tokens -> backward ->
  clip -> torch AdamW) on a deep copy of the model, fed the same batches, must give the
  session's losses and weights step for step: plain, accumulated and LoRA.
* The step report's counts, learning rate and memory categories against figures worked
  out in the test from the samples, the schedule's definition and the tensors' sizes.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from helpers import small_session

IGNORE = -100
ATOL = 1e-5


pytestmark = pytest.mark.usefixtures("one_thread")


# ---- the reference loop ----------------------------------------------------------------

def reference_run(model, batches_per_step, *, lr, max_grad_norm, trainable=None):
    """Plain PyTorch: yields (loss, grad norm before clipping) after each optimizer step."""
    params = [p for p in model.parameters() if p.requires_grad] if trainable is None else trainable
    # torch's fused AdamW kernel, as the session uses: at lr 1e-2 the for-loop kernel's rounding
    # alone moves a near-zero adapter weight by 5e-5, which would hide a real 1e-5 difference.
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0, fused=True)
    model.train()
    for micro_batches in batches_per_step:
        n_trained = sum(int((b["labels"] != IGNORE).sum()) for b in micro_batches)
        total = 0.0
        for b in micro_batches:
            logits = model(b["input_ids"])  # [B, T, V]
            assert logits.shape == (*b["input_ids"].shape, model.config.vocab_size)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), b["labels"].flatten(),
                                   ignore_index=IGNORE, reduction="sum") / n_trained
            loss.backward()
            total += loss.item()
        norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        yield total, float(norm)


def assert_same_weights(session_model, reference_model, atol=ATOL):
    ours = dict(session_model.named_parameters())
    theirs = dict(reference_model.named_parameters())
    assert ours.keys() == theirs.keys()
    for name, p in ours.items():
        torch.testing.assert_close(p.detach(), theirs[name].detach(), atol=atol, rtol=0, msg=name)


def check_against_reference(steps=3, lora=False, **changes):
    """Run the session and the reference side by side; returns the reference's grad norms."""
    session = small_session(**changes)
    twin = small_session(**changes)  # only its stream is used: the same batches, in order
    reference = copy.deepcopy(session.model)  # before any step
    start = {n: p.detach().clone() for n, p in session.model.named_parameters()}
    accum = session.techniques.grad_accum
    batches = [[twin.trainer.stream.next() for _ in range(accum)] for _ in range(steps)]
    trainable = None
    if lora:
        trainable = [p for n, p in reference.named_parameters() if ".lora_A." in n or ".lora_B." in n]
        reference.requires_grad_(False)
        for p in trainable:
            p.requires_grad_(True)
    norms = []
    for i, (loss, norm) in enumerate(reference_run(reference, batches, lr=session.techniques.lr,
                                                   max_grad_norm=session.techniques.max_grad_norm,
                                                   trainable=trainable)):
        report = session.step()
        assert report.loss == pytest.approx(loss, abs=ATOL), f"step {i + 1}"
        assert_same_weights(session.model, reference)
        norms.append(norm)
    moved = {n for n, p in session.model.named_parameters() if not torch.equal(p, start[n])}
    return norms, moved, session


def test_plain_step_equals_hand_written_loop():
    norms, moved, session = check_against_reference(lr=1e-3, max_grad_norm=1.0)
    assert max(norms) > 1.0  # the clip really scaled the gradient: skipping it would show
    assert moved == {n for n, _ in session.model.named_parameters()}


def test_accumulated_step_divides_by_the_trained_tokens_of_all_micro_batches():
    norms, moved, session = check_against_reference(lr=1e-3, max_grad_norm=1.0, grad_accum=2)
    assert max(norms) > 1.0
    assert moved == {n for n, _ in session.model.named_parameters()}


@pytest.mark.slow
def test_lora_step_equals_hand_written_loop_over_the_adapters_only():
    norms, moved, session = check_against_reference(method="lora", lr=1e-2, max_grad_norm=0.5,
                                                    lora=True)
    assert max(norms) > 0.5
    assert moved and all(".lora_A." in n or ".lora_B." in n for n in moved)
    # Both adapter halves trained (B starts at zero, A gets a gradient once B is non-zero).
    assert any(".lora_A." in n for n in moved) and any(".lora_B." in n for n in moved)


# ---- counts and schedule from first principles -----------------------------------------

def rebuild_first_batch(session):
    """The first batch from the samples: the stream's documented order (a permutation
    seeded with ``seed + epoch``), right-padded with pad_id / IGNORE by hand."""
    samples = session.trainer.stream.samples
    size = session.trainer.stream.batch_size
    generator = torch.Generator().manual_seed(session.techniques.seed + 0)
    chosen = [samples[i] for i in torch.randperm(len(samples), generator=generator).tolist()[:size]]
    longest = max(len(s.input_ids) for s in chosen)
    input_ids = torch.full((size, longest), session.tokenizer.pad_id, dtype=torch.long)
    labels = torch.full((size, longest), IGNORE, dtype=torch.long)
    for row, s in enumerate(chosen):
        input_ids[row, : len(s.input_ids)] = s.input_ids
        labels[row, : len(s.labels)] = s.labels
    return chosen, input_ids, labels


@pytest.mark.parametrize("changes", [{}, {"packing": True, "seq_len": 192}],
                         ids=["unpacked", "packed"])
def test_token_counts_from_the_samples(changes):
    session = small_session(**changes)
    chosen, input_ids, labels = rebuild_first_batch(session)
    # The rebuilt batch is the one the session will read (else the counts below prove nothing).
    twin_batch = small_session(**changes).trainer.stream.next()
    assert torch.equal(twin_batch["input_ids"], input_ids)
    assert torch.equal(twin_batch["labels"], labels)
    pad_id = session.tokenizer.pad_id
    tokens = int((input_ids != pad_id).sum())
    trained = int((labels != IGNORE).sum())
    # Samples carry no padding: their lengths are the tokens read.
    assert tokens == sum(len(s.input_ids) for s in chosen)
    assert tokens < input_ids.numel()  # the batch is padded: counting padding would show
    assert trained == sum(int((s.labels != IGNORE).sum()) for s in chosen)
    if changes.get("packing"):
        assert all(int(s.document_ids.max()) >= 1 for s in chosen)  # several examples per row
    report = session.step()
    assert report.tokens == tokens
    assert report.trained_tokens == trained
    assert report.shape == tuple(input_ids.shape)


def test_learning_rate_follows_the_warmup_schedule():
    session = small_session(warmup_steps=3, lr=1e-3)
    expected = [1e-3 * 1 / 3, 1e-3 * 2 / 3, 1e-3, 1e-3]  # linear to step 3, then constant
    for step, lr in enumerate(expected, start=1):
        report = session.step()
        assert report.step == step
        assert report.lr == pytest.approx(lr, rel=1e-12), f"step {step}"
        assert [g["lr"] for g in session.optimizer.param_groups] == [report.lr] * len(
            session.optimizer.param_groups)


# ---- memory categories from the tensors' sizes -----------------------------------------

def test_memory_categories_of_full_fp32_adamw():
    session = small_session()
    model = session.model
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # tied
    weights = {}
    for p in model.parameters():
        weights[p.data_ptr()] = p.numel() * p.element_size()
    buffers = list(model.buffers())
    assert not buffers  # none in this model; the breakdown would count them as parameters
    param_bytes = sum(weights.values())
    assert all(p.dtype == torch.float32 and p.requires_grad for p in model.parameters())
    trainable_bytes = param_bytes  # full training: every weight trains, one fp32 grad each

    first = session.step().memory
    assert first.parameters == param_bytes
    assert first.trainable == param_bytes and first.frozen == 0 and first.quantized == 0
    assert first.gradients == trainable_bytes

    second = session.step().memory
    # torch AdamW (fused, not capturable) keeps per parameter exp_avg and
    # exp_avg_sq like the weight, and `step` as a 0-dim fp32 tensor: 4 bytes each.
    tensors = len(weights)
    for state in session.optimizer.state.values():
        assert set(state) == {"step", "exp_avg", "exp_avg_sq"}
        assert state["step"].dim() == 0 and state["step"].dtype == torch.float32
    assert len(session.optimizer.state) == tensors
    assert second.optimizer_state == 2 * trainable_bytes + 4 * tensors
    assert second.parameters == param_bytes and second.gradients == trainable_bytes
