"""Preference objectives: a loss over the log-probabilities of a chosen and a rejected
completion of the same prompt, as TRL defines them (its ``DPOTrainer`` for ``dpo`` and
``ipo``, ``CPOTrainer``'s ``simpo`` and ``ORPOTrainer``), so a run here and there agree.

The model's side is ``completion_logps``: each row's summed log-probability of its completion
tokens (labels other than ``IGNORE``) and their count. The loss sees only those sums: a
sequence's tokens enter once, whatever the objective.

* ``dpo``: ``-log sigmoid(beta * (chosen log-ratio - rejected log-ratio))``, log-ratios
  against the reference (summed over the completion);
* ``ipo``: ``(delta - 1 / (2 * beta)) ** 2`` with each log-ratio averaged over its
  completion's tokens (TRL's length normalisation, confirmed with IPO's authors);
* ``simpo`` (reference-free): ``-log sigmoid(beta * (avg chosen - avg rejected) - gamma)``
  over average log-probs;
* ``orpo`` (reference-free): the chosen completion's token cross-entropy minus
  ``beta * log sigmoid(log odds ratio)`` of the average log-probs.

Rewards, as TRL reports them: ``beta`` times each completion's log-ratio (``dpo``, ``ipo``)
or average log-prob (``simpo``, ``orpo``); the margin is chosen minus rejected, the accuracy
the share of rows whose chosen reward is higher.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..data import IGNORE

PREFERENCE = ("dpo", "ipo", "simpo", "orpo")
REFERENCE_FREE = ("simpo", "orpo")  # no reference model, no reference log-probs


@dataclass(frozen=True)
class Completions:
    """Per row: the summed log-probability of its completion and how many tokens it has."""

    logps: torch.Tensor  # [rows]
    tokens: torch.Tensor  # [rows]

    @property
    def mean(self) -> torch.Tensor:
        return self.logps / self.tokens.clamp(min=1)


@dataclass(frozen=True)
class PreferenceMetrics:
    """What preference users watch, averaged over the batch's pairs."""

    chosen_reward: float
    rejected_reward: float
    margin: float
    accuracy: float


def completion_logps(logits: torch.Tensor, labels: torch.Tensor) -> Completions:
    """Each row's summed log-probability of its labelled tokens (``labels`` already shifted to
    the logits' positions; ``IGNORE`` elsewhere), in float32, one row at a time so the float32
    log-softmax of the whole batch is never held."""
    sums, counts = [], []
    for row_logits, row_labels in zip(logits, labels):
        keep = row_labels != IGNORE
        picked = row_logits[keep].float()
        taken = picked.gather(-1, row_labels[keep].unsqueeze(-1)).squeeze(-1)
        sums.append((taken - torch.logsumexp(picked, dim=-1)).sum())
        counts.append(keep.sum())
    return Completions(torch.stack(sums), torch.stack(counts))


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, stable at both ends (Mächler's two branches)."""
    return torch.where(x > -0.6931471805599453, torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def preference_loss(objective: str, chosen: Completions, rejected: Completions, *,
                    reference: tuple[Completions, Completions] | None = None, beta: float = 0.1,
                    gamma: float = 0.5, chosen_nll: torch.Tensor | None = None,
                    ) -> tuple[torch.Tensor, PreferenceMetrics]:
    """The batch's loss (mean over pairs) and its metrics. ``reference``: the reference
    model's (chosen, rejected) for ``dpo`` and ``ipo``; ``chosen_nll``: the chosen
    completions' mean token cross-entropy, ORPO's SFT term."""
    if objective not in PREFERENCE:
        raise ValueError(f"objective must be one of {', '.join(PREFERENCE)}, got {objective!r}.")
    if (reference is None) != (objective in REFERENCE_FREE):
        raise ValueError(f"{objective}: reference log-probs are "
                         f"{'not used' if objective in REFERENCE_FREE else 'needed'}.")
    if objective == "orpo" and chosen_nll is None:
        raise ValueError("orpo: the chosen completions' cross-entropy (chosen_nll) is needed.")
    if objective in ("dpo", "ipo"):
        ref_chosen, ref_rejected = reference
        chosen_ratio = chosen.logps - ref_chosen.logps
        rejected_ratio = rejected.logps - ref_rejected.logps
        chosen_reward, rejected_reward = beta * chosen_ratio, beta * rejected_ratio
        if objective == "dpo":
            losses = -F.logsigmoid(beta * (chosen_ratio - rejected_ratio))
        else:
            delta = (chosen_ratio / chosen.tokens.clamp(min=1)
                     - rejected_ratio / rejected.tokens.clamp(min=1))
            losses = (delta - 1 / (2 * beta)) ** 2
        loss = losses.mean()
    else:
        chosen_mean, rejected_mean = chosen.mean.float(), rejected.mean.float()
        chosen_reward, rejected_reward = beta * chosen_mean, beta * rejected_mean
        if objective == "simpo":
            loss = -F.logsigmoid(beta * (chosen_mean - rejected_mean) - gamma).mean()
        else:
            log_odds = (chosen_mean - rejected_mean) - (_log1mexp(chosen_mean) - _log1mexp(rejected_mean))
            loss = chosen_nll - beta * F.logsigmoid(log_odds).mean()
    chosen_reward, rejected_reward = chosen_reward.detach(), rejected_reward.detach()
    return loss, PreferenceMetrics(
        chosen_reward=chosen_reward.mean().item(), rejected_reward=rejected_reward.mean().item(),
        margin=(chosen_reward - rejected_reward).mean().item(),
        accuracy=(chosen_reward > rejected_reward).float().mean().item())
