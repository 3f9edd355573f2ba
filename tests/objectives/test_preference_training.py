"""Preference objectives trained: pairs read and tokenized (only the completions scored), a
step's loss and update against TRL's DPO loss on the same model, the reference as the base
with the adapters off, the estimate against the measured step, and what is refused."""

import json
import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

import nbtune as nt
from nbtune.data import IGNORE, DataError, Pair, TrainingData, collate_pairs, examples_from, tokenize_pairs
from nbtune.distributed import Parallel
from nbtune.models import ModelConfig, Tokenizer, demo_model_dir
from nbtune.models.decoder import CausalLM
from nbtune.models.tiny import byte_tokenizer
from nbtune.step import StepContext, StepOptions, train_step

from helpers import demo_pairs, slow_after, small_session

TEMPLATE = ("{% for m in messages %}<|begin|>{{ m.role }}\n{{ m.content }}<|end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|begin|>assistant\n{% endif %}")


# ---- rows ------------------------------------------------------------------------------

def test_a_text_pair_and_a_message_pair_score_only_their_completions():
    tok = byte_tokenizer()
    tok.chat_template = TEMPLATE
    rows = [{"prompt": "2+2?", "chosen": "4", "rejected": "5"},
            {"prompt": [{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "2"},
                        {"role": "user", "content": "3+3?"}],
             "chosen": [{"role": "assistant", "content": "6"}],
             "rejected": [{"role": "assistant", "content": "seven"}]}]
    pairs = examples_from(rows)
    assert all(isinstance(p, Pair) for p in pairs)
    tokenized, dropped = tokenize_pairs(pairs, tok, 256)
    assert dropped == 0
    trained = [[s.labels[s.labels != IGNORE].tolist() for s in sides] for sides in tokenized]
    assert trained[0] == [tok.encode("4<|end|>\n"), tok.encode("5<|end|>\n")]
    # the prompt's own assistant turn ("2") is not scored: only the completion
    assert trained[1] == [tok.encode("6<|end|>\n"), tok.encode("seven<|end|>\n")]
    batch = collate_pairs(tokenized, tok.pad_id)
    assert batch["input_ids"].shape[0] == 4  # chosen rows, then rejected
    assert batch["labels"][0][batch["labels"][0] != IGNORE].tolist() == tok.encode("4<|end|>\n")
    assert batch["labels"][2][batch["labels"][2] != IGNORE].tolist() == tok.encode("5<|end|>\n")


@pytest.mark.parametrize("row, message", [
    ({"prompt": "a", "chosen": "b"}, "'rejected' missing"),
    ({"prompt": "a", "chosen": "b", "rejected": "b"}, "the same text"),
    ({"prompt": [{"role": "assistant", "content": "a"}], "chosen": "b", "rejected": "c"},
     "must end with a user message"),
    ({"prompt": "a", "chosen": [{"role": "user", "content": "b"}], "rejected": "c"},
     "'chosen' message 0 must be"),
    ({"prompt": "a", "chosen": "", "rejected": "c"}, "'chosen' is empty"),
    ({"prompt": "a", "chosen": [{"role": "assistant", "content": "b"}] * 2, "rejected": "c"},
     "one non-empty assistant message"),
])
def test_a_bad_pair_is_refused_naming_the_row(row, message):
    with pytest.raises(DataError, match=message) as err:
        examples_from([{"prompt": "ok", "chosen": "x", "rejected": "y"}, row])
    assert "row 2" in str(err.value)


def test_pairs_and_instruction_rows_do_not_mix():
    with pytest.raises(DataError, match="mixes preference pairs"):
        examples_from([{"prompt": "a", "chosen": "b", "rejected": "c"},
                       {"instruction": "a", "output": "b"}])


def test_an_objective_needs_pairs_and_sft_on_pairs_trains_the_chosen_completions():
    tok = byte_tokenizer()
    rows = TrainingData([{"instruction": "a", "output": "b"}], tok)
    assert "trains on preference pairs" in " ".join(rows.problems(nt.Techniques(method="lora", objective="dpo")))
    pairs = TrainingData([{"prompt": "a", "chosen": "yes", "rejected": "no"}], tok)
    assert pairs.problems(nt.Techniques(objective="sft")) == []
    stream, _ = pairs.stream(nt.Techniques(objective="sft", batch_size=1))
    labels = stream.next()["labels"][0]
    assert labels[labels != IGNORE].tolist() == tok.encode("yes") + [tok.eos_id]


def test_each_rank_takes_its_chosen_rows_and_the_rejected_rows_of_the_same_pairs():
    batch = {"input_ids": torch.arange(8).unsqueeze(1)}  # pairs 0-3: chosen 0-3, rejected 4-7
    mine = [Parallel(rank, 2, rank, None).rows(batch, pairs=True)["input_ids"].flatten().tolist()
            for rank in (0, 1)]
    assert mine == [[0, 1, 4, 5], [2, 3, 6, 7]]


# ---- training --------------------------------------------------------------------------

def test_dpo_with_lora_starts_at_ln_2_and_learns_to_prefer_the_chosen():
    """The reference is the base with the adapters off: at the first step (B = 0) the policy
    is the reference, so the loss is ln 2 and the rewards 0; then the margin grows."""
    session = small_session(method="lora", objective="dpo", lr=3e-3)
    first = session.step()
    assert first.loss == pytest.approx(math.log(2), abs=1e-6)
    assert first.preference.margin == 0 and first.preference.chosen_reward == 0
    later = [session.step() for _ in range(9)][-3:]
    assert all(r.preference.margin > 0.2 and r.preference.accuracy > 0.5 and r.loss < 0.6 for r in later)


def _trl_dpo_loss(beta, per_token, ref, ids, mask):
    """TRL 1.16's own DPO loss code on the given per-token log-probs (its fused head's output:
    zero off the completion) and precomputed reference sums."""
    from trl.trainer.dpo_trainer import DPOTrainer

    rows, seq = per_token.shape
    identity = lambda x: x  # noqa: E731
    outputs = SimpleNamespace(log_probs=per_token, entropy=torch.zeros(rows, seq),
                              mean_logits=torch.zeros(rows, seq), is_top1=torch.zeros(rows, seq, dtype=torch.bool))
    me = SimpleNamespace(model=SimpleNamespace(training=True),
                         accelerator=SimpleNamespace(device="cpu", gather=identity, gather_for_metrics=identity),
                         aux_loss_enabled=False, ld_alpha=None, precompute_ref_logps=True,
                         f_divergence_type="reverse_kl", loss_types=["sigmoid"], loss_weights=[1.0], beta=beta,
                         use_weighting=False, _metrics={"train": defaultdict(list)}, _total_train_tokens=0, _tp_size=1)
    half = rows // 2
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "completion_mask": mask,
              "ref_chosen_logps": ref[:half], "ref_rejected_logps": ref[half:]}
    return DPOTrainer._compute_loss(me, lambda **kw: outputs, inputs, return_outputs=False)


@pytest.mark.parametrize("chunks", [0, 3])
def test_a_dpo_step_updates_the_adapters_as_trls_loss_does(chunks):
    """Two steps in: the adapters have moved, so the policy is not the reference. The next
    step's update (SGD, so the change is lr times the gradient) equals the gradient of TRL's
    DPO loss on the same model's log-probs, with the reference computed here by zeroing every
    adapter's B on a copy (the base alone), not by nbtune's switch."""
    import copy

    from nbtune.peft import LoRALinear

    session = small_session(method="lora", objective="dpo", optimizer="sgd", lr=0.5, beta=0.3,
                            chunked_loss=chunks)
    session.step(), session.step()
    batch = copy.deepcopy(session.trainer.stream).next()
    ids, labels = batch["input_ids"], batch["labels"]
    # TRL reads the whole sequence (its last label, the EOS, included) with a completion_mask
    # over it: rebuilt here from nbtune's inputs and shifted labels
    trained = labels != IGNORE
    full = torch.cat([ids[:, :1], torch.where(trained, labels, torch.roll(ids, -1, 1))], 1)
    mask = torch.cat([torch.zeros_like(ids[:, :1]), trained.long()], 1)
    model = copy.deepcopy(session.model)
    base = copy.deepcopy(model)
    for m in base.modules():
        if isinstance(m, LoRALinear):
            torch.nn.init.zeros_(m.lora_B.weight)

    def per_token(net):
        logps = torch.log_softmax(net(full).float()[:, :-1], -1).gather(-1, full[:, 1:, None]).squeeze(-1)
        return logps * mask[:, 1:]

    with torch.no_grad():
        ref = per_token(base).sum(1)
    loss = _trl_dpo_loss(0.3, per_token(model), ref, full, mask)
    loss.backward()
    before = {n: p.detach().clone() for n, p in session.model.named_parameters() if p.requires_grad}
    report = session.step()
    assert report.loss == pytest.approx(loss.item(), abs=1e-5)
    grads = dict(model.named_parameters())
    for name, old in before.items():
        moved = dict(session.model.named_parameters())[name].detach() - old
        torch.testing.assert_close(moved, -0.5 * grads[name].grad, atol=2e-6, rtol=1e-4)


@pytest.mark.parametrize("objective", ["orpo", "dpo"])
def test_two_accumulated_micro_batches_of_pairs_equal_one_batch_of_them(objective):
    """The same four pairs as one batch or two micro-batches of two: the same loss and the
    same update (each pair's loss over the step's pairs, ORPO's cross-entropy over the step's
    chosen tokens), as one batch gives."""
    method = "lora" if objective == "dpo" else "full"
    one = small_session(method=method, objective=objective, optimizer="sgd", lr=0.5, batch_size=4)
    two = small_session(method=method, objective=objective, optimizer="sgd", lr=0.5, batch_size=2,
                        grad_accum=2)
    for _ in range(2):
        a, b = one.step(), two.step()
        assert a.loss == pytest.approx(b.loss, abs=1e-6)
        assert a.preference.margin == pytest.approx(b.preference.margin, abs=1e-6)
    for (name, p), q in zip(one.model.named_parameters(), two.model.parameters()):
        torch.testing.assert_close(p, q, atol=2e-6, rtol=1e-5, msg=name)


@pytest.mark.parametrize("changes", slow_after(4, [
    dict(method="lora", objective="dpo"),
    dict(method="lora", objective="ipo", chunked_loss=4, activation_checkpointing=True),
    dict(objective="dpo", reference="copy"),  # the weights twice
    dict(method="lora", objective="dpo", split_pairs=True),
    dict(objective="simpo"),
    dict(objective="orpo", grad_accum=2),
    dict(method="qlora", dtype="bf16", objective="dpo", activation_checkpointing=True),
    dict(objective="dpo"),  # full finetuning: the reference precomputed, no reference forward
    dict(method="lora", objective="ipo", reference="precomputed"),
    dict(objective="ipo", reference="copy_host", chunked_loss=2),  # (on a CPU the host is the device)
    dict(objective="orpo", split_pairs=True, chunked_loss=4, activation_checkpointing=True),
]), ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_the_estimate_equals_the_measured_step_of_pairs(changes):
    """Full-length pair rows of the demo's shape: the estimate (fake tensors, the same step)
    against the second measured step of a real session, within 2 %."""
    config = ModelConfig(vocab_size=259, hidden_size=128, intermediate_size=384, num_layers=4,
                         num_heads=4, num_kv_heads=2, head_dim=32)
    t = nt.Techniques(batch_size=2, seq_len=96, **changes)
    torch.manual_seed(0)
    session = nt.Session(CausalLM(config), Tokenizer.from_folder(demo_model_dir()), demo_pairs(8),
                         techniques=t, device="cpu")
    ids = torch.randint(0, config.vocab_size, (4, 96))
    batch = {"input_ids": ids, "labels": ids.clone()}
    if t.reference_kind == "precomputed":
        batch["reference_logps"] = torch.zeros(4)
    context = StepContext(copy=session.trainer.reference_copy)
    for _ in range(2):
        report = train_step(session.model, session.optimizer, [batch] * t.grad_accum,
                            StepOptions.of(t), context, pad_id=-1, step=1)
    guess = nt.estimate(config, t)
    assert abs(guess.peak - report.memory.peak) <= 0.02 * report.memory.peak, (guess.peak, report.memory.peak)
    assert guess.parameters == report.memory.parameters


def test_what_is_not_built_yet_is_refused_by_name_and_changes_nothing():
    session = small_session(method="lora", objective="sft")
    before = session.techniques
    for change, words in [({"objective": "dpo", "method": "full", "reference": "adapters_off"},
                           "full finetuning has no adapters"),
                          ({"objective": "dpo", "packing": True}, "turn packing off"),
                          ({"objective": "simpo", "tile_tokens": 16}, "tile_tokens=0")]:
        with pytest.raises(ValueError, match=words):
            session.set(**change)
        assert session.techniques is before


def test_a_dpo_run_resumed_from_a_checkpoint_equals_one_never_stopped(tmp_path):
    """Stopped after 3 steps and resumed in a new session (another RNG state, dropout on):
    the next 3 losses, the rewards and the weights are those of the run that never stopped."""
    changes = dict(method="lora", objective="dpo", lora_dropout=0.2, lr=3e-3)
    straight = small_session(**changes)
    expected = [straight.step() for _ in range(6)]
    first = small_session(**changes)
    got = [first.step() for _ in range(3)]
    first.save_checkpoint(tmp_path / "ckpt")
    torch.manual_seed(1234)
    second = small_session(**changes)
    second.load_checkpoint(tmp_path / "ckpt")
    assert second.techniques.objective == "dpo" and [r.preference for r in second.history] == \
        [r.preference for r in got]
    got += [second.step() for _ in range(3)]
    assert [(r.loss, r.preference) for r in got] == [(r.loss, r.preference) for r in expected]
    for (name, a), (_, b) in zip(straight.model.named_parameters(), second.model.named_parameters()):
        assert torch.equal(a, b), name


def test_a_dpo_session_saved_as_a_run_file_trains_the_same_under_nbtune_train(tmp_path):
    """The pairs written beside the run file as they were given (TRL's form), the objective in
    the techniques; nbtune train's metrics carry the rewards under TRL's names and equal the
    notebook's steps."""
    import nbtune.cli.main as cli

    from nbtune.demos import demo_named

    torch.manual_seed(0)
    session = nt.Session.from_pretrained(demo_named("tiny").model(), demo_pairs(16), device="cpu",
                                         techniques=dict(method="lora", objective="dpo", lr=3e-3,
                                                         batch_size=4, seq_len=96))
    path = session.save_config(tmp_path / "run.yaml", steps=3)
    rows = [json.loads(line) for line in (tmp_path / "run.train.jsonl").read_text().splitlines()]
    assert set(rows[0]) == {"prompt", "chosen", "rejected"} and isinstance(rows[0]["prompt"], str)
    assert examples_from(rows) == session.data.train
    expected = [session.step() for _ in range(3)]
    assert cli.main(["train", str(path), "--out", str(tmp_path / "out"), "--no-progress"]) == 0
    metrics = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [m["loss"] for m in metrics] == [r.loss for r in expected]
    assert [m["rewards/margins"] for m in metrics] == [r.preference.margin for r in expected]
    assert {"rewards/chosen", "rewards/rejected", "rewards/accuracies"} <= set(metrics[0])


def test_held_out_pairs_are_scored_every_n_steps_and_by_evaluate():
    """eval_every under dpo: the objective's loss and the rewards over the held-out pairs,
    computed here from the model's log-probs with the adapters off as the reference; evaluate
    says the share of held-out pairs ranked right, the same accuracy."""
    import torch.nn.functional as F

    from nbtune.objectives.preference import completion_logps
    from nbtune.peft import adapters_off

    session = small_session(method="lora", objective="dpo", lr=3e-3, eval_every=2)
    reports = [session.step() for _ in range(4)]
    assert [r.eval_preference is not None for r in reports] == [False, True, False, True]
    batches = session.data.eval_batches(session.techniques)
    assert sum(b["input_ids"].shape[0] for b in batches) == 2 * 16
    ratios = []
    session.model.eval()
    with torch.no_grad():
        for batch in batches:
            policy = completion_logps(session.model(batch["input_ids"]), batch["labels"])
            with adapters_off(session.model):
                reference = completion_logps(session.model(batch["input_ids"]), batch["labels"])
            ratios.append(policy.logps - reference.logps)
    session.model.train()
    chosen, rejected = zip(*(r.chunk(2) for r in ratios))
    chosen, rejected = torch.cat(chosen), torch.cat(rejected)
    beta = session.techniques.beta
    expected = -F.logsigmoid(beta * (chosen - rejected)).mean()
    assert reports[-1].eval_loss == pytest.approx(float(expected), abs=1e-5)
    accuracy = float((chosen > rejected).float().mean())
    assert reports[-1].eval_preference.accuracy == pytest.approx(accuracy)
    assert reports[-1].eval_preference.margin == pytest.approx(float(beta * (chosen - rejected).mean()), abs=1e-6)
    assert session.evaluate() == pytest.approx(accuracy)


def test_full_finetuning_dpo_scores_against_the_weights_it_started_from_computed_once(capsys):
    """Full finetuning: the reference is every pair's log-probs under the weights when dpo
    was switched on (here after two sft steps), computed once: the first dpo step's loss is
    ln 2, no step runs a reference forward, and a change that would need those weights again
    (seq_len) is refused by name, nothing changed."""
    session = small_session(objective="sft", lr=1e-3)
    session.step(), session.step()
    capsys.readouterr()
    session.set(objective="dpo")
    assert session.techniques.reference_kind == "precomputed"
    assert "Reference log-probs of 64 pairs computed in" in capsys.readouterr().out
    forwards = []
    original = session.model.hidden_states
    session.model.hidden_states = lambda *a, **k: forwards.append(1) or original(*a, **k)
    first = session.step()
    assert first.loss == pytest.approx(math.log(2), abs=1e-6) and len(forwards) == 1
    del session.model.hidden_states
    later = [session.step() for _ in range(4)][-1]
    assert later.preference.margin > 0
    before = session.techniques
    with pytest.raises(ValueError, match="the reference was the weights when the preference"):
        session.set(seq_len=80)
    assert session.techniques is before
    with pytest.raises(ValueError, match="not yet scored against a precomputed reference"):
        session.set(eval_every=1)
    with pytest.raises(ValueError, match="not yet scored against a precomputed reference"):
        session.evaluate()
    assert session.techniques is before


def test_a_precomputed_reference_is_saved_with_the_checkpoint_and_resumes_exactly(tmp_path):
    """sft, then dpo against the sft'd weights: a fresh session on the base resumes from the
    checkpoint with the saved reference (the base's own would differ) and goes on as the run
    that never stopped; a reference file of another shape is refused naming it."""
    from safetensors.torch import save_file

    from nbtune.checkpoint import CheckpointRefused

    def run(session, steps):
        return [(r.loss, r.preference) for r in (session.step() for _ in range(steps))]

    straight = small_session(objective="sft")
    run(straight, 2)
    straight.set(objective="dpo")
    expected = run(straight, 5)
    first = small_session(objective="sft")
    run(first, 2)
    first.set(objective="dpo")
    got = run(first, 2)
    first.save_checkpoint(tmp_path / "ckpt")
    torch.manual_seed(1234)
    second = small_session(objective="dpo")  # its own reference: the base's
    second.load_checkpoint(tmp_path / "ckpt")
    assert got + run(second, 3) == expected
    save_file({"reference_logps": torch.zeros(3, 2)}, str(tmp_path / "ckpt" / "reference_logps.safetensors"))
    with pytest.raises(CheckpointRefused, match="reference_logps.safetensors"):
        small_session(objective="dpo").load_checkpoint(tmp_path / "ckpt")


@pytest.mark.slow
@pytest.mark.parametrize("techniques", [
    dict(method="lora", objective="dpo", grad_accum=2),
    dict(objective="dpo"),  # full finetuning, the reference precomputed on every rank
    dict(objective="orpo"),
], ids=["dpo-lora-accumulated", "dpo-full-precomputed", "orpo-full"])
def test_two_ranks_train_pairs_as_one_process_does(tmp_path, techniques):
    """Under torchrun (2 gloo ranks, FSDP2) each rank takes its half of every batch's pairs,
    chosen with rejected: the global loss and rewards of every step equal one process's."""
    import nbtune.cli.main as cli
    from nbtune.demos import demo_named

    from helpers import torchrun

    torch.manual_seed(0)
    session = nt.Session.from_pretrained(demo_named("tiny").model(), demo_pairs(32), device="cpu",
                                         techniques=dict(batch_size=4, seq_len=96, lr=3e-3, **techniques))
    path = session.save_config(tmp_path / "run.yaml", steps=3)
    assert cli.main(["train", str(path), "--out", str(tmp_path / "one"), "--no-progress"]) == 0
    torchrun(path, tmp_path / "two", ranks=2)
    one, two = ([json.loads(line) for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
                for run in ("one", "two"))
    assert len(one) == len(two) == 3
    for a, b in zip(one, two):
        assert abs(a["loss"] - b["loss"]) <= 1e-5
        for key in ("rewards/margins", "rewards/accuracies", "rewards/chosen"):
            assert abs(a[key] - b[key]) <= 1e-5, key


def test_after_sft_the_reference_is_the_model_as_dpo_starts_not_the_base():
    """LoRA trained with sft on the chosen completions, then dpo: the base with the adapters
    off is not the model dpo starts from, so that choice is refused by name (nothing changed);
    precomputed scores every pair with the model as it is, so the first dpo step is ln 2."""
    session = small_session(method="lora", objective="sft", lr=1e-2)
    for _ in range(3):
        session.step()
    before = session.techniques
    with pytest.raises(ValueError, match="reference='precomputed'"):
        session.set(objective="dpo")
    assert session.techniques is before
    session.set(objective="dpo", reference="precomputed")
    assert session.step().loss == pytest.approx(math.log(2), abs=1e-6)


def test_sft_on_pairs_trains_the_completion_not_the_prompts_own_assistant_turns():
    tok = byte_tokenizer()
    tok.chat_template = TEMPLATE
    row = {"prompt": [{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "2"},
                      {"role": "user", "content": "3+3?"}], "chosen": "6", "rejected": "7"}
    stream, _ = TrainingData([row], tok).stream(nt.Techniques(objective="sft", batch_size=1))
    labels = stream.next()["labels"][0]
    assert labels[labels != IGNORE].tolist() == tok.encode("6<|end|>\n")


@pytest.mark.slow  # (5 s or more here; the fast tier has this module's others)
def test_out_of_memory_advice_and_per_rank_estimates_take_pairs_as_batch_size(monkeypatch):
    """A pair batch is 2 x batch_size rows: the advice after an out-of-memory error is asked
    for batch_size pairs (not twice as many), and a rank's estimate of a preference step runs
    (its rewards are gathered by the real step, never on fake tensors)."""
    import nbtune.oom

    from nbtune.predict.advice import suggest

    asked = []
    monkeypatch.setattr(nbtune.oom, "suggest",
                        lambda config, t, device, shape, *a, **k: asked.append(shape) or (None, []))
    session = small_session(method="lora", objective="dpo")
    original = session.model.hidden_states

    def full(*args, **kwargs):
        session.model.hidden_states = original
        raise torch.OutOfMemoryError("CUDA out of memory (injected)")

    session.model.hidden_states = full
    with pytest.raises(nt.OutOfMemory):
        session.step()
    assert asked and asked[0][0] == session.techniques.batch_size
    t = nt.Techniques(objective="simpo", batch_size=4, seq_len=64)
    config = session.model.config
    one, two = nt.estimate(config, t), nt.estimate(config, t, ranks=2)
    assert 0 < two.peak < one.peak
    monkeypatch.undo()
    assert suggest(config, t, torch.device("cpu"), (4, 64), None)[0].peak == one.peak


@pytest.mark.slow
def test_fit_and_the_longest_context_search_for_the_preference_objective():
    """fit keeps the objective and its pairs (a batch twice the rows), predicting a dpo step
    to fit where the same settings' step does not; the longest context of dpo is shorter than
    sft's on the same budget."""
    config = ModelConfig(vocab_size=259, hidden_size=128, intermediate_size=384, num_layers=4,
                         num_heads=4, num_kv_heads=2, head_dim=32)
    t = nt.Techniques(method="lora", objective="dpo", batch_size=8, seq_len=256)
    whole = nt.estimate(config, t, device="cpu").peak
    found = nt.fit(config, int(whole * 0.8), t, device="cpu", margin=0.0, reserve=0)
    assert found.techniques is not None and found.techniques.objective == "dpo"
    assert found.peak <= int(whole * 0.8) and found.peak == nt.estimate(config, found.techniques, device="cpu").peak
    budget = f"{3 * whole / 2**30:.6f} GiB"
    dpo = nt.longest_context(config, budget, t, device="cpu")
    sft = nt.longest_context(config, budget, t.replace(objective="sft"), device="cpu")
    assert 0 < dpo.tokens < sft.tokens


# ---- split_pairs: the chosen rows and the rejected rows in two passes -----------------------

def test_a_split_pair_step_updates_the_adapters_as_the_dpo_loss_computed_here_does():
    """split_pairs, two steps in (the policy is no longer the reference): the next step's SGD
    update is lr times the gradient of DPO's loss computed here on full logits, the reference
    by zeroing every adapter's B on a copy."""
    import copy

    from nbtune.peft import LoRALinear

    session = small_session(method="lora", objective="dpo", optimizer="sgd", lr=0.5, beta=0.3,
                            split_pairs=True, chunked_loss=2)
    session.step(), session.step()
    batch = copy.deepcopy(session.trainer.stream).next()
    model, base = copy.deepcopy(session.model), copy.deepcopy(session.model)
    for m in base.modules():
        if isinstance(m, LoRALinear):
            torch.nn.init.zeros_(m.lora_B.weight)

    def logps(net):
        labels = batch["labels"]
        taken = torch.log_softmax(net(batch["input_ids"]).float(), -1).gather(-1, labels.clamp(min=0)[..., None])
        return (taken.squeeze(-1) * (labels != IGNORE)).sum(-1)

    with torch.no_grad():
        ref = logps(base)
    chosen, rejected = (logps(model) - ref).chunk(2)
    loss = -torch.nn.functional.logsigmoid(0.3 * (chosen - rejected)).mean()
    loss.backward()
    before = {n: p.detach().clone() for n, p in session.model.named_parameters() if p.requires_grad}
    report = session.step()
    assert report.loss == pytest.approx(loss.item(), abs=1e-6)
    grads = dict(model.named_parameters())
    for name, old in before.items():
        moved = dict(session.model.named_parameters())[name].detach() - old
        torch.testing.assert_close(moved, -0.5 * grads[name].grad, atol=2e-6, rtol=1e-4)


@pytest.mark.parametrize("changes", slow_after(2, [
    dict(objective="dpo", method="lora"),
    dict(objective="orpo", grad_accum=2),
    dict(objective="simpo", chunked_loss=3, activation_checkpointing=True),
    dict(objective="ipo", reference="copy"),
    dict(objective="dpo", activation_offloading=True),
]), ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_split_pairs_trains_as_one_batch_does_holding_less(changes):
    """Three SGD steps apart and together: the same losses, rewards and weights (to float
    noise), and the split step's measured peak is lower."""
    runs = {}
    for split in (False, True):
        session = small_session(optimizer="sgd", lr=0.05, split_pairs=split, **changes)
        reports = [session.step() for _ in range(3)]
        weights = torch.cat([p.detach().flatten() for p in session.model.parameters() if p.requires_grad])
        runs[split] = reports, weights
    (whole, w1), (split, w2) = runs[False], runs[True]
    for a, b in zip(whole, split):
        # ipo's loss is ~6 and squares a difference: after three steps float32's last bits
        # differ by up to ~2e-6 of it (a CI machine's BLAS); a split that dropped or doubled a
        # pair moves it by far more
        assert b.loss == pytest.approx(a.loss, rel=1e-5, abs=1e-6)
        assert b.preference.margin == pytest.approx(a.preference.margin, rel=1e-5, abs=1e-6)
        assert b.preference.accuracy == a.preference.accuracy
    torch.testing.assert_close(w2, w1, atol=1e-6, rtol=0)
    assert split[-1].memory.peak < whole[-1].memory.peak


def test_split_pairs_with_the_optimizer_in_backward_is_refused_by_name():
    session = small_session(objective="dpo", method="lora", optimizer_in_backward=True, optimizer="sgd")
    before = session.techniques
    with pytest.raises(ValueError, match="split_pairs runs two backward passes"):
        session.set(split_pairs=True)
    assert session.techniques is before
