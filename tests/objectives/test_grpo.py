"""GRPO (``nbtune/objectives/grpo.py``): its loss against TRL's own ``GRPOTrainer._compute_loss``,
its advantages against TRL's ``nanstd``, the group written with a KV cache against one token
at a time, prompts from every kind of row, reward functions given TRL's arguments and
refused by name when they misbehave (then the session gives what a never-failed twin gives),
a step recomputed here from the model's logits, accumulation, resuming, and the estimate of
both phases against the measured ones."""

from pathlib import Path
from unittest import mock

import pytest
import torch

import nbtune as nt
from nbtune.data import IGNORE, DataError, PromptRow, TrainingData, as_prompt, examples_from
from nbtune.generate import generate_ids
from nbtune.models.tiny import byte_tokenizer
from nbtune.objectives.grpo import (RewardError, advantages, aggregate, as_rewards, generate_group,
                                    score, token_losses)

import helpers
from helpers import TEST_STOPS, slow_after, small_session

trl = pytest.importorskip("trl")

pytestmark = pytest.mark.usefixtures("one_thread")


# ---- the loss, against TRL's code --------------------------------------------------------

def _trl_loss(kind, logps, old, ref, adv, mask, beta, epsilon, max_len, accumulation=1):
    """TRL 1.16's ``GRPOTrainer._compute_loss`` run on a stand-in trainer that hands it these
    per-token log-probs (its model call is the only part replaced)."""
    from trl.trainer.grpo_trainer import GRPOTrainer

    rows, T = logps.shape
    fake = mock.MagicMock()
    fake.loss_type, fake.beta, fake.epsilon_low, fake.epsilon_high = kind, beta, epsilon, epsilon
    fake.top_entropy_quantile, fake.off_policy_mask_threshold, fake.use_vllm = 1.0, None, False
    fake.importance_sampling_level = "token"
    fake.args.use_bias_correction_kl, fake.args.delta, fake.args.steps_per_generation = False, None, accumulation
    fake._entropy_bonus_enabled, fake.aux_loss_enabled = False, False
    fake.max_completion_length, fake.current_gradient_accumulation_steps = max_len, accumulation
    fake.accelerator.num_processes, fake.model.training = 1, True
    fake.accelerator.gather = fake.accelerator.gather_for_metrics = lambda x: x
    fake._get_per_token_logps_and_entropies = lambda *a, **k: (logps, torch.zeros(rows, T), None)
    inputs = {"prompt_ids": torch.zeros(rows, 2, dtype=torch.long), "prompt_mask": torch.ones(rows, 2),
              "completion_ids": torch.zeros(rows, T, dtype=torch.long), "completion_mask": mask.float(),
              "advantages": adv, "old_per_token_logps": old, "num_items_in_batch": mask.sum().float()}
    if beta:
        inputs["ref_per_token_logps"] = ref
    return GRPOTrainer._compute_loss(fake, None, inputs)


@pytest.mark.parametrize("kl", [0.0, 0.04])
@pytest.mark.parametrize("kind", ["dapo", "grpo", "dr_grpo"])
def test_the_loss_and_its_gradient_are_trls(kind, kl):
    g = torch.Generator().manual_seed(0)
    rows, T = 6, 9
    base = torch.randn(rows, T, generator=g) - 2
    mask = torch.rand(rows, T, generator=g) > 0.25
    mask[:, 0] = True
    old = base + 0.3 * torch.randn(rows, T, generator=g)  # off policy: the clip acts on some tokens
    ref = base + 0.2 * torch.randn(rows, T, generator=g)
    adv = torch.randn(rows, generator=g)
    ours_logps, theirs_logps = base.clone().requires_grad_(), base.clone().requires_grad_()
    losses, _ = token_losses(ours_logps, old, adv, ref if kl else None, 0.2, kl)
    ours = aggregate(losses, mask, kind, rows, int(mask.sum()), T)
    theirs = _trl_loss(kind, theirs_logps, old, ref, adv, mask, kl, 0.2, T)
    ratio = (base - old).exp()
    assert ((ratio < 0.8) | (ratio > 1.2))[mask].any()  # the clip was reached
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-7)
    ours.backward()
    theirs.backward()
    torch.testing.assert_close(ours_logps.grad, theirs_logps.grad, rtol=1e-5, atol=1e-8)


def test_advantages_are_trls_group_normalisation():
    from trl.trainer.utils import nanstd

    rewards = torch.tensor([1.0, 0.0, 0.5, 0.5, 2.0, 2.0, 2.0, 2.0, -1.0, 3.0, 0.0, 1.0])
    grouped = rewards.view(-1, 4)
    mean = grouped.mean(1).repeat_interleave(4)
    std = torch.stack([nanstd(row) for row in grouped]).repeat_interleave(4)
    torch.testing.assert_close(advantages(rewards, 4, True), (rewards - mean) / (std + 1e-4))
    torch.testing.assert_close(advantages(rewards, 4, False), rewards - mean)
    assert advantages(rewards, 4, True)[4:8].eq(0).all()  # a group all alike teaches nothing


# ---- writing the completions -------------------------------------------------------------

def test_a_group_written_together_equals_each_written_alone():
    """Greedy, the lockstep batch with its shared prompt cache writes what one-at-a-time
    generation writes; sampled, how many are written at once changes no completion."""
    session = small_session()
    model, prompt = session.model.eval(), [5, 70, 71, 72, 73, 9]
    stops = frozenset({0})
    alone = generate_ids(model, prompt, max_new_tokens=12, stop_ids=stops)
    together = generate_group(model, prompt, [None] * 3, max_new=12, stop_ids=stops, temperature=0.0,
                              top_p=1.0, at_once=3)
    assert together == [alone] * 3

    def sampled(at_once):
        draws = [torch.Generator().manual_seed(i) for i in range(4)]
        return generate_group(model, prompt, draws, max_new=12, stop_ids=frozenset(TEST_STOPS),
                              temperature=1.0, top_p=0.9, at_once=at_once)

    first = sampled(4)
    assert first == sampled(1) == sampled(3)
    assert len({tuple(c) for c in first}) > 1  # sampled: the completions differ
    assert any(len(c) < 12 for c in first)  # (some end early, at a stop token)
    # on ranks: while another rank still writes, this one runs every token's forward too, and
    # its completions are what they were
    forwards, asked = [], []
    original = model.forward
    model.forward = lambda *a, **k: forwards.append(1) or original(*a, **k)
    try:
        draws = [torch.Generator().manual_seed(i) for i in range(4)]
        lockstep = generate_group(model, prompt, draws, max_new=12, stop_ids=frozenset(TEST_STOPS),
                                  temperature=1.0, top_p=0.9, at_once=4,
                                  more=lambda going: asked.append(going) or True)
    finally:
        del model.forward
    assert lockstep == first and len(forwards) == 11 and asked[-1] is (max(map(len, first)) == 12)
    for completion in first:  # a stop token ends a completion and is kept (its probability trained)
        assert len(completion) == 12 or (completion[-1] in TEST_STOPS
                                          and not set(completion[:-1]) & TEST_STOPS)


# ---- prompts and rewards -----------------------------------------------------------------

def test_every_kind_of_row_gives_grpo_a_prompt_and_its_fields():
    rows = examples_from([{"prompt": "2+2?", "answer": "4", "level": 1},
                          {"prompt": [{"role": "system", "content": "Be brief."},
                                      {"role": "user", "content": "3+3?"}], "answer": "6"}])
    assert all(isinstance(r, PromptRow) for r in rows)
    assert rows[0].prompt == "2+2?" and dict(rows[0].fields) == {"answer": "4", "level": 1}
    assert rows[1].conversational and rows[1].prompt[1]["content"] == "3+3?"
    instruction, = examples_from([{"instruction": "Add", "input": "2 and 2", "output": "4"}])
    assert dict(as_prompt(instruction).fields) == {"instruction": "Add", "input": "2 and 2", "output": "4"}
    pair, = examples_from([{"prompt": "Hi", "chosen": "Hello", "rejected": "Go away"}])
    assert as_prompt(pair).prompt == "Hi"
    assert dict(as_prompt(pair).fields) == {"chosen": "Hello", "rejected": "Go away"}
    with pytest.raises(DataError, match="mixes prompts"):
        examples_from([{"prompt": "a"}, {"instruction": "a", "output": "b"}])
    with pytest.raises(DataError, match="must end with a user message"):
        examples_from([{"prompt": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}])
    data = TrainingData([{"prompt": "2+2?"}], byte_tokenizer())
    assert "only objective='grpo' trains on" in " ".join(data.problems(nt.Techniques(objective="sft")))
    assert data.problems(nt.Techniques(objective="grpo", seq_len=128)) == []


def test_a_prompt_that_leaves_no_room_for_max_completion_is_skipped_and_said():
    """seq_len holds the prompt and its completion: a prompt of more than seq_len + 1 -
    max_completion tokens (its row reads all but the completion's last token) is skipped."""
    from nbtune.data import prompt_and_reference, prompt_ids

    tok = byte_tokenizer()
    rows = examples_from([{"prompt": "x" * 10}, {"prompt": "y" * 11}])
    short, longer = (len(prompt_ids(tok, prompt_and_reference(as_prompt(r).example, tok)[0])) for r in rows)
    assert longer == short + 1
    t = nt.Techniques(objective="grpo", seq_len=short + 15, max_completion=16)  # room: short tokens
    stream, notes = TrainingData(rows, tok).stream(t)
    assert [len(s.input_ids) for s in stream.samples] == [short]
    assert "1 of 2 prompts leave less than max_completion=16" in notes[0]
    with pytest.raises(DataError, match=f"leaves room for {short - 1} prompt tokens"):
        TrainingData(rows, tok).stream(t.replace(seq_len=short + 14))


def test_rewards_get_trls_arguments_and_are_summed_with_their_weights():
    seen = {}

    def record(prompts, completions, **columns):
        seen.update(prompts=prompts, completions=completions, **columns)
        return [len(c) if isinstance(c, str) else len(c[0]["content"]) for c in completions]

    rows = examples_from([{"prompt": "2+2?", "answer": "4"},
                          {"prompt": [{"role": "user", "content": "3+3?"}], "answer": "6", "hard": True}])
    group = [rows[0], rows[0], rows[1], rows[1]]
    values = score(as_rewards([record, (lambda prompts, completions, **_: [1.0] * 4, -2.0)]),
                   group, ["4", "five", "6", "six!"], group=2)
    assert values.tolist() == [[1, 1], [4, 1], [1, 1], [4, 1]]
    assert seen["prompts"][0] == "2+2?" and seen["prompts"][2] == [{"role": "user", "content": "3+3?"}]
    assert seen["completions"][:2] == ["4", "five"]  # text prompt: text; chat prompt: one message
    assert seen["completions"][3] == [{"role": "assistant", "content": "six!"}]
    assert seen["answer"] == ["4", "4", "6", "6"] and seen["hard"] == [None, None, True, True]


@pytest.mark.parametrize("reward, message", slow_after(2, [
    (lambda prompts, completions, **_: 1 / 0, "'bad' raised ZeroDivisionError"),
    (lambda prompts, completions, **_: [float("nan")] * len(completions), "gave nan for completion 1"),
    (lambda prompts, completions, **_: [None] * len(completions), "gave None"),
    (lambda prompts, completions, **_: ["1"] * len(completions), "gave '1'"),
    (lambda prompts, completions, **_: [1.0], "one number per completion"),
    (lambda prompts, completions, **_: "good", "one number per completion"),
]))
def test_a_misbehaving_reward_is_named_and_the_session_goes_on_as_its_twin(reward, message):
    reward.__name__ = "bad"
    twin, session = small_session(objective="grpo"), small_session(objective="grpo")
    for s in (twin, session):
        s.step()
    good = session.rewards
    session.rewards = [*good, reward]
    with pytest.raises(RewardError, match=message) as err:
        session.step()
    assert "Nothing" in str(err.value) and ("row" in str(err.value) or "prompt" in str(err.value))
    assert len(session.history) == 1
    session.rewards = good
    for _ in range(2):
        ours, theirs = session.step(), twin.step()
        assert (ours.loss, ours.rollouts) == (theirs.loss, theirs.rollouts)
    for (name, a), (_, b) in zip(session.model.state_dict().items(), twin.model.state_dict().items()):
        assert torch.equal(a, b), name


def test_bad_reward_settings_and_missing_rewards_are_refused_by_name():
    with pytest.raises(TypeError, match="is not a function"):
        as_rewards(["len"])
    with pytest.raises(TypeError, match="weight of 'len' is nan"):
        as_rewards([(len, float("nan"))])
    session = small_session(objective="grpo")
    session.data.rewards = ()
    with pytest.raises(ValueError, match=r"session.rewards = \[my_reward"):
        session.step()
    assert session.history == []
    with pytest.raises(ValueError, match="set kl=0"):
        session.set(kl=0.1)  # full finetuning has no adapters to switch off
    with pytest.raises(ValueError, match="generations must be 2 or more"):
        session.set(generations=1)


# ---- the step ------------------------------------------------------------------------------

def _captured(session, monkeypatch):
    """The rollouts the next step makes (its update's batches and the rewards)."""
    import nbtune.objectives.grpo as grpo

    made, original = [], grpo.rollout

    def keeping(*args, **kwargs):
        made.append(original(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(grpo, "rollout", keeping)
    return made


@pytest.mark.parametrize("kind", ["dapo", "grpo", "dr_grpo"])
def test_a_step_is_the_loss_computed_here_from_the_models_logits(kind, monkeypatch):
    """The reported loss and the SGD update equal the GRPO loss computed in this test from
    log_softmax of the model's logits over the temperature, the rewards' weighted sum and
    the group statistics (on policy: the ratio is 1, its gradient the log-prob's)."""
    session = small_session(objective="grpo", optimizer="sgd", lr=0.5, grpo_loss=kind, rollout_temperature=0.7)
    made = _captured(session, monkeypatch)
    before = {n: p.detach().clone() for n, p in session.model.named_parameters()}
    report = session.step()
    batch, = [r.batch for r in made]
    rewards = made[0].rewards @ torch.tensor([1.0, 1.0, 0.5])
    grouped = rewards.view(-1, 4)
    adv = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-4)).flatten()
    torch.testing.assert_close(batch["advantages"], adv)
    model = session.model
    after = {n: p.detach().clone() for n, p in model.named_parameters()}
    for n, p in model.named_parameters():  # back to the weights the step started from
        p.data.copy_(before[n])
    model.zero_grad()
    labels = batch["labels"]
    mask = labels != IGNORE
    logps = torch.log_softmax(model(batch["input_ids"]).float() / 0.7, -1).gather(
        -1, labels.clamp(min=0)[..., None])[..., 0]
    per_token = -(adv[:, None] * torch.exp(logps - logps.detach())) * mask
    loss = {"dapo": per_token.sum() / mask.sum(), "grpo": (per_token.sum(1) / mask.sum(1)).mean(),
            "dr_grpo": per_token.sum() / (len(mask) * 16)}[kind]
    assert report.loss == pytest.approx(float(loss), abs=1e-6)
    loss.backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(after[n], before[n] - 0.5 * p.grad, rtol=1e-5, atol=1e-6, msg=n)


@pytest.mark.parametrize("kind", ["dapo", "grpo", "dr_grpo"])
def test_two_accumulated_micro_batches_equal_one_batch_of_their_prompts(kind):
    """The same prompts write the same completions however they are batched (each
    completion's sampling is seeded by its place in the step), and the loss is over the step."""
    one = small_session(objective="grpo", grpo_loss=kind, optimizer="sgd", lr=0.5)
    two = small_session(objective="grpo", grpo_loss=kind, optimizer="sgd", lr=0.5, batch_size=1, grad_accum=2)
    for _ in range(2):
        a, b = one.step(), two.step()
        assert a.rollouts == b.rollouts
        assert a.loss == pytest.approx(b.loss, abs=1e-6)
    for (n, p), q in zip(one.model.named_parameters(), two.model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=n)


def test_a_run_shows_the_mean_reward_beside_the_loss(capsys):
    session = small_session(objective="grpo")
    reports = session.run(2, live=False)
    shown = capsys.readouterr().err
    assert f"reward={reports[-1].rollouts.reward:.3f}" in shown and "loss=" in shown
    assert small_session().step().watched.keys() == {"loss"}


def test_the_kl_term_runs_the_base_with_the_adapters_off_and_reports_its_mean():
    session = small_session(objective="grpo", method="lora", kl=0.5, lr=5e-2)
    first = session.step()
    assert first.mean_kl == pytest.approx(0.0, abs=1e-7)  # the adapters start at zero: policy = base
    later = [session.step() for _ in range(3)]
    assert later[-1].mean_kl > 1e-5  # trained adapters: the policy left the base
    none = small_session(objective="grpo", method="lora", lr=5e-2)
    assert none.step().mean_kl is None


def test_a_grpo_run_resumed_from_a_checkpoint_equals_one_never_stopped(tmp_path):
    twin, session = small_session(objective="grpo"), small_session(objective="grpo")
    for s in (twin, session, twin, session):
        s.step()
    session.save_checkpoint(tmp_path / "ckpt")
    resumed = small_session(objective="grpo")
    resumed.load_checkpoint(tmp_path / "ckpt")
    assert [r.rollouts for r in resumed.history] == [r.rollouts for r in twin.history]
    for _ in range(2):
        ours, theirs = resumed.step(), twin.step()
        assert (ours.loss, ours.rollouts) == (theirs.loss, theirs.rollouts)


# ---- memory ------------------------------------------------------------------------------

@pytest.mark.parametrize("changes", slow_after(3, [
    {}, {"method": "lora", "kl": 0.04},
    {"kv_cache": "int8", "generation_batch": 2, "dtype": "bf16", "method": "lora"},
    {"generation_batch": 1}, {"chunked_loss": 4}, {"activation_checkpointing": True, "generations": 6},
    {"dtype": "bf16", "method": "qlora"}, {"kv_cache": "int8"},
]))
def test_the_estimate_of_both_phases_equals_the_measured_ones(changes):
    """Completions written to max_completion (no stop token): the rows are full length, as
    the estimate takes them; the writing's peak and the update's are each predicted."""
    session = small_session(objective="grpo", **changes)
    session.data.tokenizer.stop_ids = frozenset()
    session.step()
    report = session.step()
    predicted = nt.estimate(session.model.config, session.techniques, seq_len=report.shape[1], device="cpu")
    measured = report.memory
    assert measured.generation_peak > 0
    assert predicted.peak == pytest.approx(measured.peak, rel=1e-3)  # (exact to 3e-5 when written)
    assert predicted.generation_peak == pytest.approx(measured.generation_peak, rel=1e-3)
    assert predicted.highest_phase == measured.highest_phase == "update"


def test_writing_fewer_completions_at_once_holds_less_and_writes_the_same():
    whole, apart = (small_session(objective="grpo", generation_batch=n) for n in (0, 1))
    a, b = whole.step(), apart.step()
    assert a.rollouts == b.rollouts and a.loss == b.loss
    assert b.memory.generation_peak < a.memory.generation_peak


@pytest.mark.slow  # (5 s or more here; the fast tier has this module's others)
def test_an_int8_kv_cache_holds_about_a_quarter_of_fp32s_and_attends_as_the_model_does_within_its_rounding():
    """The writing's cache in 8 bits: each cached vector within 1/254 of its largest entry of
    the model's own (checked here against a cache of the model's dtype), the next token's
    logits close, the writing's measured peak lower by most of the cache."""
    from nbtune.models.decoder import Int8KVCache

    session = small_session(objective="grpo", max_completion=64, generations=8, seq_len=160)
    model = session.model.eval()
    ids = torch.randint(3, 200, (1, 48))
    caches = [model.new_cache(), model.new_cache(int8=True)]
    assert isinstance(caches[1], Int8KVCache)
    with torch.no_grad():
        logits = [model(ids, cache=c)[:, -1] for c in caches]
        logits = [model(ids[:, :1], cache=c)[:, -1] for c in caches]
    # the first layer's keys and values are the model's own (later layers read rounded ones)
    for exact, codes, scales in ((caches[0].keys[0], caches[1].keys[0], caches[1].key_scales[0]),
                                 (caches[0].values[0], caches[1].values[0], caches[1].value_scales[0])):
        error = (codes.float() * scales - exact).abs() / exact.abs().amax(-1, keepdim=True)
        assert codes.dtype == torch.int8 and 1 / 1000 < error.max() <= 1 / 254 + 1e-6
    assert (logits[1] - logits[0]).abs().max() < 0.05 * logits[0].abs().max()
    model.train()
    plain = small_session(objective="grpo", max_completion=64, generations=8, seq_len=160)
    for s in (plain, session):
        s.data.tokenizer.stop_ids = frozenset()  # every completion to max_completion
    session.set(kv_cache="int8")
    eight = session.step()
    full = plain.step()
    # the cache of 8 completions at the last token (fp32: 4 bytes a number; int8: 1, and a scale)
    tokens = eight.shape[1] - 1
    cache_bytes = 2 * 8 * len(model.model.layers) * model.config.num_kv_heads * tokens * model.config.head_dim * 4
    # (on this 4-layer model a layer's cache read back and the growing copy take part of it back)
    assert full.memory.generation_peak - eight.memory.generation_peak > 0.5 * cache_bytes


@pytest.mark.parametrize("where", ["generation", "update"])
def test_out_of_memory_names_the_phase_and_asks_advice_for_batch_size_prompts(where, monkeypatch):
    """Out of memory while writing the completions or while training on them: the error
    names the phase, the advice is asked for batch_size prompts (not their completions'
    rows), and the session goes on as its never-failed twin."""
    import nbtune.objectives.grpo as grpo
    import nbtune.oom

    asked = []
    monkeypatch.setattr(nbtune.oom, "suggest",
                        lambda config, t, device, shape, *a, **k: asked.append(shape) or (None, []))
    twin, session = small_session(objective="grpo"), small_session(objective="grpo")
    target = (grpo, "generate_group") if where == "generation" else (session.model, "hidden_states")
    original = getattr(*target)

    def full(*args, **kwargs):
        if where == "update" and torch.is_grad_enabled() or where == "generation":
            monkeypatch.setattr(*target, original)
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return original(*args, **kwargs)

    monkeypatch.setattr(*target, full)
    with pytest.raises(nt.OutOfMemory, match=f"in the {'generation' if where == 'generation' else 'forward'} phase") as err:
        session.step()
    assert ("a lower generation_batch" in str(err.value)) == (where == "generation")
    assert asked == [None] if where == "generation" else asked[0][0] == session.techniques.batch_size
    assert session.history == []
    ours, theirs = session.step(), twin.step()
    assert (ours.loss, ours.rollouts) == (theirs.loss, theirs.rollouts)


def test_what_grpo_does_not_do_yet_is_refused_by_name(tmp_path):
    """Ranks driven from a notebook, held-out prompts: each refused naming why; and a reward
    given as one bare (function, weight) pair, or under a name already taken, is kept apart."""
    from nbtune.run.ranked import _RanksData
    from nbtune.runfile import write_rows

    t = nt.Techniques(objective="grpo")
    assert "does not yet run on ranks driven from a notebook" in " ".join(_RanksData.problems(t))
    with pytest.raises(ValueError, match="nbtune train under torchrun"):
        _RanksData().rewards = [len]
    session = small_session(objective="grpo")
    rows = examples_from([{"prompt": "2+2?", "answer": 4}, {"prompt": [{"role": "user", "content": "hi"}]}])
    write_rows(rows, tmp_path / "rows.jsonl")
    assert examples_from(str(tmp_path / "rows.jsonl")) == rows  # prompt rows written as read
    with pytest.raises(DataError, match="prompts alone"):
        small_session().evaluate(rows)  # (sft: no answer to compare with)
    with pytest.raises(RewardError, match="'overlap' raised TypeError"):
        session.evaluate(rows[:1])  # (grpo: rewarded, and this row has no `chosen`)
    assert as_rewards((len, 0.5)) == as_rewards([(len, 0.5)])
    twice = small_session(objective="grpo")
    twice.rewards = [lambda prompts, completions, **_: [1.0] * len(completions),
                     lambda prompts, completions, **_: [0.0] * len(completions)]
    assert twice.step().rollouts.rewards == {"<lambda>": 1.0, "<lambda>_2": 0.0}


def _rewards_module(tmp_path, name: str, text: str | None = None):
    """``text`` as the module of rewards.py (a run file can name its functions)."""
    import importlib.util
    import sys

    (tmp_path / "rewards.py").write_text(text or REWARDS_PY)
    spec = importlib.util.spec_from_file_location(name, tmp_path / "rewards.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[name] = module
    return module


@pytest.mark.slow
@pytest.mark.parametrize("techniques", [dict(method="lora", kl=0.1, grad_accum=2), dict()],
                         ids=["lora-kl-accumulated", "full"])
def test_two_ranks_write_and_train_as_one_process_does(tmp_path, techniques):
    """Under torchrun (2 gloo ranks, FSDP2) each rank writes its half of the prompts' groups,
    every rank running each token's forward until all have ended; each completion seeded by its
    place in the global batch: the loss and rewards of every step equal one process's."""
    import json
    import sys

    import nbtune.cli.main as cli
    from nbtune.demos import demo_named

    from helpers import torchrun

    module = _rewards_module(tmp_path, "test_grpo_rewards_ranks")
    try:
        torch.manual_seed(0)
        rows = [{"prompt": f"Spell {w}.", "answer": w} for w in ("cat", "dog", "owl", "bee", "ant", "elk", "yak", "emu")]
        session = nt.Session.from_pretrained(
            demo_named("tiny").model(), rows, device="cpu",
            techniques=dict(objective="grpo", lr=3e-3, batch_size=4, seq_len=64, max_completion=8,
                            generations=3, **techniques))
        session.rewards = [module.letters, (module.brevity, 0.5)]
        path = session.save_config(tmp_path / "run.yaml", steps=2)
    finally:
        del sys.modules["test_grpo_rewards_ranks"]
    assert cli.main(["train", str(path), "--out", str(tmp_path / "one"), "--no-progress"]) == 0
    torchrun(path, tmp_path / "two", ranks=2)
    one, two = ([json.loads(line) for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
                for run in ("one", "two"))
    assert len(one) == len(two) == 2
    for a, b in zip(one, two):
        for key in ("loss", "reward", "reward_std", "completions/mean_length", "rewards/letters/mean"):
            assert abs(a[key] - b[key]) <= 1e-5, key


@pytest.mark.slow
def test_a_reward_failing_on_one_rank_is_said_by_every_rank_and_none_waits(tmp_path):
    """A reward function that raises on rank 1 alone: every rank ends the step with the same
    error naming rank 1 (none waits in a collective for it), before anything is trained."""
    import os
    import subprocess
    import sys

    from nbtune.demos import demo_named

    module = _rewards_module(tmp_path, "test_grpo_rewards_picky", REWARDS_PY + """
import os


def picky(prompts, completions, **columns):
    if os.environ.get("RANK") == "1":
        raise ZeroDivisionError("rank 1's reward")
    return [0.0] * len(completions)
""")
    try:
        rows = [{"prompt": f"Spell {w}.", "answer": w} for w in ("cat", "dog", "owl", "bee")]
        session = nt.Session.from_pretrained(
            demo_named("tiny").model(), rows, device="cpu",
            techniques=dict(method="lora", objective="grpo", batch_size=2, seq_len=64, max_completion=8,
                            generations=2))
        session.rewards = [module.picky]
        path = session.save_config(tmp_path / "run.yaml", steps=2)
    finally:
        del sys.modules["test_grpo_rewards_picky"]
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                           "2", "-m", "nbtune", "train", str(path), "--out", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=600, env={**os.environ})
    assert done.returncode != 0
    said = done.stdout + done.stderr
    assert said.count("Rank 1: The reward function 'picky' raised ZeroDivisionError") >= 2, said[-3000:]
    assert "Pydantic" not in said  # (each rank says it, and only it)
    assert not (tmp_path / "out" / "metrics.jsonl").exists() or \
        not (tmp_path / "out" / "metrics.jsonl").read_text().strip()


def test_trl_prompt_completion_rows_are_imitated():
    rows = examples_from([{"prompt": "2+2?", "completion": "4"},
                          {"prompt": [{"role": "user", "content": "hi"}],
                           "completion": [{"role": "assistant", "content": "hello"}]}])
    assert rows[0].messages == (("user", "2+2?"), ("assistant", "4")) and rows[0].instruction == ("2+2?", "")
    assert rows[1].messages == (("user", "hi"), ("assistant", "hello")) and rows[1].instruction is None
    with pytest.raises(DataError, match="'completion' is empty"):
        examples_from([{"prompt": "a", "completion": ""}])
    with pytest.raises(DataError, match="'completion' must be one non-empty assistant message"):
        examples_from([{"prompt": "a", "completion": [{"role": "assistant", "content": "x"}] * 2}])


def test_dpo_after_grpo_trained_adapters_does_not_take_the_base_as_its_reference():
    session = small_session(objective="grpo", method="lora", kl=0.1, lr=5e-2)
    session.step()
    with pytest.raises(ValueError, match="reference='precomputed'"):
        session.set(objective="dpo")
    assert session.techniques.objective == "grpo"
    fresh = small_session(objective="simpo", method="lora", lr=5e-2)
    fresh.step()  # simpo trains the adapters, so grpo's kl could not compare with the base
    with pytest.raises(ValueError, match="keep kl=0"):
        fresh.set(objective="grpo", kl=0.1, max_completion=16)


REWARDS_PY = '''
def letters(prompts, completions, **columns):
    return [sum(ch.isascii() and ch.isalpha() for ch in c) / max(len(c), 1) for c in completions]


def brevity(prompts, completions, **columns):
    return [-len(c) / 16 for c in completions]
'''


def test_a_grpo_session_saved_as_a_run_file_trains_the_same_under_nbtune_train(tmp_path, monkeypatch):
    """The rewards, functions of a .py file, are named in the run file (file and weight) and
    read back from it; nbtune train's metrics carry the rewards under TRL's names and equal
    the notebook's steps. A function written in a cell, a bad name or a file that raises is
    refused by name."""
    import importlib.util
    import json

    import nbtune.cli.main as cli
    from nbtune.demos import demo_named
    from nbtune.runfile import RunFileError

    (tmp_path / "rewards.py").write_text(REWARDS_PY)
    spec = importlib.util.spec_from_file_location("test_grpo_rewards", tmp_path / "rewards.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    import sys

    sys.modules["test_grpo_rewards"] = module
    try:
        torch.manual_seed(0)
        rows = [{"prompt": f"Spell {w}.", "answer": w} for w in ("cat", "dog", "owl", "bee", "ant", "elk")]
        session = nt.Session.from_pretrained(
            demo_named("tiny").model(), rows, device="cpu",
            techniques=dict(method="lora", objective="grpo", lr=3e-3, batch_size=2, seq_len=64,
                            max_completion=8, generations=3))
        session.rewards = [module.letters, (module.brevity, 0.5)]
        path = session.save_config(tmp_path / "run.yaml", steps=2)
        text = path.read_text()
        assert "rewards.py:letters" in text and "rewards.py:brevity" in text
        expected = [session.step() for _ in range(2)]
        assert cli.main(["train", str(path), "--out", str(tmp_path / "out"), "--no-progress"]) == 0
        metrics = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
        assert [m["loss"] for m in metrics] == [r.loss for r in expected]
        assert [m["reward"] for m in metrics] == [r.rollouts.reward for r in expected]
        assert {"rewards/letters/mean", "rewards/brevity/mean", "completions/mean_length"} <= set(metrics[0])
    finally:
        del sys.modules["test_grpo_rewards"]
    session.rewards = [lambda prompts, completions, **_: [0.0] * len(completions)]
    with pytest.raises(RunFileError, match="written in a notebook cell"):
        session.save_config(tmp_path / "again.yaml", steps=2)
    for entry, message in (("rewards.py", "must name a function as file.py:function"),
                           ("rewards.py:nothing", "has no function 'nothing'"),
                           ("broken.py:f", "raised ZeroDivisionError")):
        (tmp_path / "broken.py").write_text("1 / 0\n")
        bad = text.replace("rewards.py:letters", entry)
        (tmp_path / "bad.yaml").write_text(bad)
        with pytest.raises(RunFileError, match=message):
            nt.Session.from_config(tmp_path / "bad.yaml")
    import yaml

    (tmp_path / "none.yaml").write_text(yaml.safe_dump({k: v for k, v in yaml.safe_load(text).items()
                                                        if k != "rewards"}))
    with pytest.raises(RunFileError, match="name them under rewards:"):
        nt.Session.from_config(tmp_path / "none.yaml")
    # the copy nbtune train keeps names the files absolutely; read back, it saves again
    kept = yaml.safe_load((tmp_path / "out" / "run.yaml").read_text())["rewards"]
    assert all(Path(e["function"].rpartition(":")[0]).is_absolute() for e in kept)
    again = nt.Session.from_config(tmp_path / "out" / "run.yaml")
    assert [r.weight for r in again.rewards] == [1.0, 0.5]
    again.save_config(tmp_path / "again" / "run.yaml", steps=2)
    assert "rewards.py:brevity" in (tmp_path / "again" / "run.yaml").read_text()
    # one module a file, run once, read again once edited
    assert nt.Session.from_config(tmp_path / "out" / "run.yaml").rewards[0].fn is again.rewards[0].fn
    (tmp_path / "rewards.py").write_text(REWARDS_PY.replace("/ 16", "/ 8") + "\n")
    edited = nt.Session.from_config(tmp_path / "out" / "run.yaml").rewards[1].fn
    assert edited([""], ["abcdefgh"]) == [-1.0]
    # a weight that is not a number is refused at its line; a file is found beside the run
    # file, never in the working directory
    (tmp_path / "nan.yaml").write_text(text.replace("weight: 0.5", "weight: .nan"))
    with pytest.raises(RunFileError, match=r"nan.yaml, line \d+, rewards"):
        nt.Session.from_config(tmp_path / "nan.yaml")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "run.yaml").write_text(text.replace("run.train.jsonl", "../run.train.jsonl"))
    monkeypatch.chdir(tmp_path)  # rewards.py is here, not beside sub/run.yaml
    with pytest.raises(RunFileError, match="sub/rewards.py cannot be read"):
        nt.Session.from_config(tmp_path / "sub" / "run.yaml")


def test_evaluate_under_grpo_is_the_mean_reward_of_greedy_completions_of_the_held_out_prompts(monkeypatch):
    """Written as many at once as the writing writes (generations=4 here, then
    generation_batch=2), each completion the one its prompt gets alone."""
    from nbtune.run import factory

    session = small_session(objective="grpo")
    tokenizer, model = session.data.tokenizer, session.model
    rows = [as_prompt(p) for p in session.data.heldout[:5]]

    def greedy(ids):  # full forwards, no cache: an independent writer
        out = []
        for _ in range(session.techniques.max_completion):
            with torch.no_grad():
                token = int(model(torch.tensor([ids + out]))[0, -1].argmax())
            if token in tokenizer.stop_ids:
                break
            out.append(token)
        return tokenizer.decode(out)

    from nbtune.data import prompt_and_reference, prompt_ids
    texts = [greedy(prompt_ids(tokenizer, prompt_and_reference(r.example, tokenizer)[0])) for r in rows]
    fields = {"chosen": [dict(r.fields)["chosen"] for r in rows]}
    prompts = [r.prompt for r in rows]
    expected = [a + b + 0.5 * c for a, b, c in zip(helpers.letters(prompts, texts, **fields),
                                                    helpers.overlap(prompts, texts, **fields),
                                                    helpers.brevity(prompts, texts, **fields))]
    batches, caches = helpers.returns_of(monkeypatch, factory, "greedy_replies"), []
    real = factory.greedy_replies
    monkeypatch.setattr(factory, "greedy_replies", lambda *a, **k: caches.append(k["int8"]) or real(*a, **k))
    first = session.evaluate(session.data.heldout[:5])
    assert first == pytest.approx(sum(expected) / 5, abs=1e-6)
    session.set(generation_batch=2)
    assert session.evaluate(session.data.heldout[:5]) == first
    assert [len(batch) for batch in batches] == [4, 1, 2, 2, 1]
    session.set(kv_cache="int8")  # in the writing's cache
    session.evaluate(session.data.heldout[:2])
    assert caches == [False] * 5 + [True]
    session.set(max_completion=6)  # the budget reaches the completions (brevity)
    assert session.evaluate(session.data.heldout[:5]) > first + 0.1
