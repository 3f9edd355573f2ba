"""Full finetuning's frozen reference copy (``reference="copy"`` on the device,
``"copy_host"`` in host memory, a layer at a time on the device): the losses it gives equal the
precomputed reference's and a DPO loss computed here from the weights the objective started
with; held-out pairs are scored against it; a checkpoint carries it; the estimate counts it
where it lives."""

import math

import pytest
import torch
import torch.nn.functional as F

import nbtune as nt
from nbtune.data import IGNORE

from helpers import small_session


def _sequence_logps(model, batch):
    """Each row's summed log-probability of its labelled tokens, from full logits (here)."""
    with torch.no_grad():
        logps = F.log_softmax(model(batch["input_ids"]).float(), -1)
    labels = batch["labels"]
    taken = logps.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return (taken * (labels != IGNORE)).sum(-1)


@pytest.mark.parametrize("reference", ["copy", "copy_host"])
def test_the_copy_is_the_weights_dpo_started_from_and_gives_the_precomputed_losses(reference):
    """After two sft steps, dpo against a frozen copy: its first loss is ln 2 (the copy is the
    model as dpo starts, not the base), every loss equals the precomputed reference's to 1e-6,
    and the third step's loss equals DPO's computed here from the copy's weights saved when
    dpo started and the policy's now."""
    runs = {}
    for kind in ("precomputed", reference):
        session = small_session(objective="sft", method="full", lr=1e-3)
        session.step(), session.step()
        session.set(objective="dpo", reference=kind)
        started = {k: v.clone() for k, v in session.model.state_dict().items()}
        losses = [session.step().loss for _ in range(2)]
        batch = session.trainer.stream.copy().next()
        policy = _sequence_logps(session.model, batch)
        now = {k: v.clone() for k, v in session.model.state_dict().items()}
        session.model.load_state_dict(started)
        ref = _sequence_logps(session.model, batch)
        session.model.load_state_dict(now)
        chosen, rejected = (policy - ref).chunk(2)
        expected = -F.logsigmoid(session.techniques.beta * (chosen - rejected)).mean()
        losses.append(session.step().loss)
        assert losses[2] == pytest.approx(float(expected), abs=1e-6)
        runs[kind] = losses
    assert runs[reference][0] == pytest.approx(math.log(2), abs=1e-6)
    assert runs[reference] == pytest.approx(runs["precomputed"], abs=1e-6)


def test_the_adapters_off_reference_equals_the_precomputed_one_with_lora():
    losses = {}
    for kind in ("adapters_off", "precomputed"):
        session = small_session(objective="dpo", method="lora", reference=kind, lr=1e-2)
        losses[kind] = [session.step().loss for _ in range(3)]
    assert losses["adapters_off"] == pytest.approx(losses["precomputed"], abs=1e-6)
    assert losses["adapters_off"][-1] != pytest.approx(math.log(2), abs=1e-4)  # (it learned)


def test_held_out_pairs_are_scored_against_the_copy_every_n_steps_and_by_evaluate():
    session = small_session(objective="dpo", method="full", reference="copy", eval_every=2, lr=1e-3)
    first = session.evaluate()
    reports = [session.step() for _ in range(4)]
    assert reports[1].eval_preference is not None and reports[3].eval_preference is not None
    assert reports[3].eval_preference.margin > reports[1].eval_preference.margin > 0
    assert first == 0.0 and session.evaluate() > 0.5  # (at the start the policy is the copy: no pair ranked)


def test_a_copy_is_saved_with_the_checkpoint_and_resumes_exactly(tmp_path):
    """sft, then dpo against a copy of the sft'd weights: a fresh session on the base resumes
    from the checkpoint with the saved copy (its own would be the base) and goes on as the run
    that never stopped; moving the copy to the host changes no loss."""
    def run(session, steps):
        return [(r.loss, r.preference) for r in (session.step() for _ in range(steps))]

    def started():
        session = small_session(objective="sft", method="full", lr=1e-3)
        run(session, 2)
        session.set(objective="dpo", reference="copy")
        return session

    straight = started()
    expected = run(straight, 5)
    first = started()
    got = run(first, 2)
    first.save_checkpoint(tmp_path / "ckpt")
    torch.manual_seed(1234)
    second = small_session(objective="dpo", method="full", reference="copy")  # its copy: the base's
    second.load_checkpoint(tmp_path / "ckpt")
    assert got + run(second, 1) == expected[:3]
    second.set(reference="copy_host")
    assert run(second, 2) == expected[3:]


def test_a_copy_is_refused_where_it_is_not_full_finetunings_and_dropped_with_its_objective():
    session = small_session(objective="dpo", method="lora")
    before = session.techniques
    with pytest.raises(ValueError, match="reference='copy' is full finetuning's reference"):
        session.set(reference="copy")
    assert session.techniques is before
    full = small_session(objective="dpo", method="full", reference="copy")
    assert full.trainer.reference_copy is not None
    full.set(objective="sft")
    assert full.trainer.reference_copy is None


def test_the_estimate_counts_the_copy_on_the_device_or_on_the_host():
    """At 1B on CUDA: the copy on the device adds the weights to the step's frozen weights and
    peak; in host memory it adds them to the host (pinned) and the device holds what the
    precomputed reference's step holds (a layer's weights come and go before the policy's
    forward keeps anything)."""
    t = nt.Techniques(method="full", objective="dpo", dtype="bf16", seq_len=512, batch_size=1,
                      activation_checkpointing=True, chunked_loss=4)
    pre, on, off = (nt.estimate("llama-3.2-1b", t.replace(reference=kind), device="cuda")
                    for kind in ("precomputed", "copy", "copy_host"))
    assert on.frozen == on.trainable == pre.parameters
    assert on.peak == pytest.approx(pre.peak + pre.parameters, abs=64)
    assert off.peak == pytest.approx(pre.peak, abs=64) and off.frozen == 0
    # pinned: each weight a block of the next power of two bytes (torch's caching host allocator)
    assert pre.parameters <= off.host.reference_copy < 2 * pre.parameters
    assert on.host.reference_copy == pre.host.reference_copy == 0
    assert off.host.training == pre.host.training + off.host.reference_copy


def test_a_reference_changes_form_mid_run_only_where_the_weights_it_started_from_are_kept():
    """dpo against a copy, then the same reference precomputed (scored by the copy, not the
    trained model): the losses go on as if nothing changed; from precomputed log-probs no copy
    can be made once the model has trained, refused by name, nothing changed."""
    def started(kind):
        session = small_session(objective="sft", method="full", lr=1e-3)
        session.step(), session.step()
        session.set(objective="dpo", reference=kind)
        return session

    straight = started("copy")
    expected = [straight.step().loss for _ in range(4)]
    moved = started("copy")
    got = [moved.step().loss for _ in range(2)]
    moved.set(reference="precomputed")
    assert moved.trainer.reference_copy is None
    assert got + [moved.step().loss for _ in range(2)] == pytest.approx(expected, abs=1e-6)
    before = moved.techniques
    with pytest.raises(ValueError, match="they were trained since"):
        moved.set(reference="copy")
    assert moved.techniques is before and moved.trainer.reference_copy is None


def test_a_host_copy_brings_each_part_to_the_device_for_its_forward_alone():
    """The streaming of ``copy_host``, on the meta device standing for a card: during a part's
    forward its weights are on the device, after it (even one that raised) only in host
    memory; while a batch is scored the head stays on the device (taken once, not once a loss
    piece)."""
    from nbtune.objectives.preference import completion_sums
    from nbtune.objectives.reference import FrozenCopy
    from nbtune.state import full_weights

    session = small_session(objective="dpo", method="full")
    copy = FrozenCopy.of(full_weights(session.model), session.model.config, "meta", host=True)
    seen = []
    layer = copy.model.model.layers[1]
    layer.register_forward_pre_hook(lambda m, a: seen.append(next(m.parameters()).device.type))
    ids = torch.zeros(2, 8, dtype=torch.long, device="meta")
    hidden = copy.model.hidden_states(ids)
    assert hidden.device.type == "meta" and seen == ["meta"]
    assert {p.device.type for p in copy.model.parameters()} == {"cpu"}
    heads = []
    copy.model.lm_head.register_forward_pre_hook(lambda m, a: heads.append(m.weight.device.type))
    with copy.scoring():
        completion_sums(copy.model.lm_head, hidden, torch.zeros(2, 8, dtype=torch.long, device="meta"), 4)
        assert copy.model.lm_head.weight.device.type == "meta"
    assert heads == ["meta"] * 4 and copy.model.lm_head.weight.device.type == "cpu"
    original = layer.mlp.forward
    layer.mlp.forward = lambda *a: (_ for _ in ()).throw(RuntimeError("out of memory"))
    with pytest.raises(RuntimeError):
        copy.model.hidden_states(ids)
    layer.mlp.forward = original
    assert {p.device.type for p in copy.model.parameters()} == {"cpu"} and not hasattr(layer, "_stored")


def test_a_copy_follows_the_models_dtype_and_a_saved_copy_of_another_dtype_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    session = small_session(objective="dpo", method="full", reference="copy")
    held = session.trainer.reference_copy
    assert held.placed(False, torch.float32) is held
    assert held.placed(False, torch.bfloat16).model.model.embed_tokens.weight.dtype == torch.bfloat16
    session.step()
    session.save_checkpoint(tmp_path / "ckpt")
    path = tmp_path / "ckpt" / "reference_copy.safetensors"
    save_file({k: v.double() for k, v in load_file(str(path)).items()}, str(path))
    fresh = small_session(objective="dpo", method="full", reference="copy")
    with pytest.raises(ValueError, match="is torch.float64, but the model's is torch.float32"):
        fresh.load_checkpoint(tmp_path / "ckpt")
    assert not fresh.history


@pytest.mark.parametrize("kind", ["precomputed", "copy"])
def test_recovering_to_step_0_scores_against_the_base_again(kind):
    """sft, then dpo, then recover() to step 0 (the base read again): the reference is the
    base again, not the weights dpo had started from, so the first loss is ln 2."""
    session = small_session(objective="sft", method="full", lr=1e-3)
    session.step(), session.step()
    session.set(objective="dpo", reference=kind)
    session.step(), session.step()
    session.recover()
    assert not session.history
    assert session.step().loss == pytest.approx(math.log(2), abs=1e-6)


def test_a_loaded_precomputed_reference_is_the_one_kept_when_the_batches_change(tmp_path):
    """A checkpoint's precomputed reference (of sft'd weights) loaded into a session on the
    base: a later batch_size change keeps it (not the session's own, the base's)."""
    def started():
        session = small_session(objective="sft", method="full", lr=1e-3)
        session.step(), session.step()
        session.set(objective="dpo", reference="precomputed")
        return session

    straight = started()
    straight.step()
    straight.set(batch_size=2)
    expected = [straight.step().loss for _ in range(2)]
    first = started()
    first.step()
    first.save_checkpoint(tmp_path / "ckpt")
    second = small_session(objective="dpo", method="full", reference="precomputed", lr=1e-3)
    second.load_checkpoint(tmp_path / "ckpt")
    second.set(batch_size=2)
    assert [second.step().loss for _ in range(2)] == pytest.approx(expected, abs=1e-6)
