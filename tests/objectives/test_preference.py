"""Preference losses (``nbtune/objectives/preference.py``) against TRL's own code: its
``DPOTrainer._compute_loss`` for ``dpo`` and ``ipo`` (run on a stand-in model that hands it
the same per-token log-probs), ``CPOTrainer.cpo_loss`` for ``simpo``, ``ORPOTrainer`` for
``orpo`` and its ``get_batch_logps`` for the completions' log-probs."""

import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from nbtune.data import IGNORE
from nbtune.objectives.preference import Completions, completion_logps, preference_loss

trl = pytest.importorskip("trl")

ROWS, T, VOCAB = 3, 12, 17


def _batch(seed: int = 0):
    """[chosen; rejected] rows: a prompt of 3-5 tokens, a completion, padding at the end."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (2 * ROWS, T), generator=g)
    mask = torch.zeros(2 * ROWS, T, dtype=torch.long)
    for row in range(2 * ROWS):
        start, end = 3 + row % 3, T - (row * 2) % 5
        mask[row, start:end] = 1
    logits = torch.randn(2 * ROWS, T, VOCAB, generator=g, dtype=torch.float64).float()
    return ids, mask, logits


def _ours(logits, ids, mask) -> tuple[Completions, Completions]:
    labels = ids.masked_fill(mask == 0, IGNORE)[:, 1:]
    both = completion_logps(logits[:, :-1], labels)
    half = lambda x: x.chunk(2)  # noqa: E731
    (c, r), (ct, rt) = half(both.logps), half(both.tokens)
    return Completions(c, ct), Completions(r, rt)


def test_completion_log_probs_equal_trls_batch_log_probs():
    from trl.experimental.orpo import ORPOTrainer

    ids, mask, logits = _batch()
    labels = ids.masked_fill(mask == 0, IGNORE)
    chosen, rejected = _ours(logits, ids, mask)
    theirs = ORPOTrainer.get_batch_logps(logits, labels)
    assert torch.allclose(torch.cat([chosen.logps, rejected.logps]), theirs, atol=1e-5)
    mean = ORPOTrainer.get_batch_logps(logits, labels, average_log_prob=True)
    assert torch.allclose(torch.cat([chosen.mean, rejected.mean]), mean, atol=1e-6)


def _trl_dpo(loss_type: str, beta: float, policy_logits, ref_logits, ids, mask):
    """TRL's DPO loss and metrics, its own ``_compute_loss`` run with precomputed reference
    log-probs and a stand-in model giving the per-token log-probs (zero off the completion,
    as its fused head does)."""
    from trl.trainer.dpo_trainer import DPOTrainer

    def per_token(logits):
        logps = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        return logps * mask[:, 1:]

    ref = per_token(ref_logits).sum(1)
    outputs = SimpleNamespace(log_probs=per_token(policy_logits),
                              entropy=torch.zeros(2 * ROWS, T - 1), mean_logits=torch.zeros(2 * ROWS, T - 1),
                              is_top1=torch.zeros(2 * ROWS, T - 1, dtype=torch.bool))
    identity = lambda x: x  # noqa: E731
    me = SimpleNamespace(model=SimpleNamespace(training=True),
                         accelerator=SimpleNamespace(device="cpu", gather=identity, gather_for_metrics=identity),
                         aux_loss_enabled=False, ld_alpha=None, precompute_ref_logps=True,
                         f_divergence_type="reverse_kl", loss_types=[loss_type], loss_weights=[1.0],
                         beta=beta, use_weighting=False, _metrics={"train": defaultdict(list)},
                         _total_train_tokens=0, _tp_size=1)
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "completion_mask": mask,
              "ref_chosen_logps": ref[:ROWS], "ref_rejected_logps": ref[ROWS:]}
    loss = DPOTrainer._compute_loss(me, lambda **kw: outputs, inputs, return_outputs=False)
    return loss, {k: v[-1] for k, v in me._metrics["train"].items()}


@pytest.mark.parametrize("objective", ["dpo", "ipo"])
def test_dpo_and_ipo_equal_trls_loss_and_rewards(objective):
    ids, mask, logits = _batch(1)
    ref_logits = logits + 0.3 * torch.randn(logits.shape, generator=torch.Generator().manual_seed(2))
    beta = 0.2
    chosen, rejected = _ours(logits, ids, mask)
    loss, metrics = preference_loss(objective, chosen, rejected, reference=_ours(ref_logits, ids, mask),
                                    beta=beta)
    theirs, their_metrics = _trl_dpo({"dpo": "sigmoid", "ipo": "ipo"}[objective], beta, logits, ref_logits, ids, mask)
    assert loss.item() == pytest.approx(theirs.item(), abs=1e-5)
    assert metrics.chosen_reward == pytest.approx(their_metrics["rewards/chosen"], abs=1e-5)
    assert metrics.rejected_reward == pytest.approx(their_metrics["rewards/rejected"], abs=1e-5)
    assert metrics.margin == pytest.approx(their_metrics["rewards/margins"], abs=1e-5)
    assert metrics.accuracy == pytest.approx(their_metrics["rewards/accuracies"], abs=1e-6)


def test_dpo_starts_at_ln_2_when_the_reference_is_the_policy():
    ids, mask, logits = _batch(3)
    chosen, rejected = _ours(logits, ids, mask)
    loss, metrics = preference_loss("dpo", chosen, rejected, reference=(chosen, rejected), beta=0.1)
    assert loss.item() == pytest.approx(math.log(2), abs=1e-7)
    assert metrics.margin == 0 and metrics.accuracy == 0


def test_simpo_equals_trls_cpo_loss_with_its_simpo_type():
    from trl.experimental.cpo import CPOTrainer

    ids, mask, logits = _batch(4)
    chosen, rejected = _ours(logits, ids, mask)
    beta, gamma = 2.0, 0.5
    loss, metrics = preference_loss("simpo", chosen, rejected, beta=beta, gamma=gamma)
    me = SimpleNamespace(alpha=0.0, loss_type="simpo", simpo_gamma=gamma, beta=beta, label_smoothing=0.0,
                         accelerator=SimpleNamespace(device="cpu"))
    losses, chosen_rewards, rejected_rewards = CPOTrainer.cpo_loss(me, chosen.mean, rejected.mean)
    assert loss.item() == pytest.approx(losses.mean().item(), abs=1e-6)
    assert metrics.chosen_reward == pytest.approx(chosen_rewards.mean().item(), abs=1e-6)
    assert metrics.margin == pytest.approx((chosen_rewards - rejected_rewards).mean().item(), abs=1e-6)


def test_orpo_equals_trls_odds_ratio_loss_with_its_sft_term():
    from trl.experimental.orpo import ORPOTrainer

    ids, mask, logits = _batch(5)
    chosen, rejected = _ours(logits, ids, mask)
    nll = -(chosen.logps.sum() / chosen.tokens.sum())  # the chosen completions' token cross-entropy
    beta = 0.1
    loss, metrics = preference_loss("orpo", chosen, rejected, beta=beta, chosen_nll=nll)
    me = SimpleNamespace(beta=beta, accelerator=SimpleNamespace(device="cpu"))
    losses, chosen_rewards, rejected_rewards, _, _ = ORPOTrainer.odds_ratio_loss(me, chosen.mean, rejected.mean)
    assert loss.item() == pytest.approx((nll - losses.mean()).item(), abs=1e-6)
    assert metrics.rejected_reward == pytest.approx(rejected_rewards.mean().item(), abs=1e-6)


def test_each_objective_is_refused_without_what_it_needs_and_with_what_it_does_not_use():
    ids, mask, logits = _batch()
    chosen, rejected = _ours(logits, ids, mask)
    with pytest.raises(ValueError, match="reference log-probs are needed"):
        preference_loss("dpo", chosen, rejected)
    with pytest.raises(ValueError, match="not used"):
        preference_loss("simpo", chosen, rejected, reference=(chosen, rejected))
    with pytest.raises(ValueError, match="chosen_nll"):
        preference_loss("orpo", chosen, rejected)
    with pytest.raises(ValueError, match="one of dpo, ipo, simpo, orpo"):
        preference_loss("kto", chosen, rejected)
