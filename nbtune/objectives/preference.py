"""Preference objectives: a loss over the log-probabilities of a chosen and a rejected
completion of the same prompt, as TRL defines them (its ``DPOTrainer`` for ``dpo`` and
``ipo``, ``CPOTrainer``'s ``simpo`` and ``ORPOTrainer``), so a run here and there agree.

A batch of B pairs is 2B rows, the chosen completions then the rejected ones. The model's
side is each row's summed log-probability of its completion tokens (labels other than
``IGNORE``) and their count (``completion_sums``: the head in pieces, each recomputed in
backward when there are several, so no more than one piece's logits exist). The reference
(``dpo``, ``ipo``) is the same model with its adapters off, run first, without gradients.

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

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..data import IGNORE, collate_pairs
from ..peft import adapters_off

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

    def halves(self) -> tuple["Completions", "Completions"]:
        """(chosen, rejected) of a pair batch's rows."""
        (c, r), (ct, rt) = self.logps.chunk(2), self.tokens.chunk(2)
        return Completions(c, ct), Completions(r, rt)


@dataclass(frozen=True)
class PreferenceMetrics:
    """What preference users watch, averaged over the step's pairs: the rewards of the chosen
    and rejected completions, their margin, and the share of pairs ranked right."""

    chosen_reward: float
    rejected_reward: float
    margin: float
    accuracy: float

    @classmethod
    def of(cls, chosen_reward: torch.Tensor, rejected_reward: torch.Tensor) -> "PreferenceMetrics":
        chosen_reward, rejected_reward = chosen_reward.float(), rejected_reward.float()
        return cls(chosen_reward=chosen_reward.mean().item(), rejected_reward=rejected_reward.mean().item(),
                   margin=(chosen_reward - rejected_reward).mean().item(),
                   accuracy=(chosen_reward > rejected_reward).float().mean().item())


def _token_logps(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Each position's log-probability of its label (0 where ``IGNORE``), in float32."""
    logits = logits.float()
    keep = labels != IGNORE
    taken = logits.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return (taken - torch.logsumexp(logits, dim=-1)) * keep


def completion_logps(logits: torch.Tensor, labels: torch.Tensor) -> Completions:
    """Each row's summed log-probability of its labelled tokens (``labels`` already shifted to
    the logits' positions; ``IGNORE`` elsewhere) and their count."""
    return Completions(_token_logps(logits, labels).sum(-1), (labels != IGNORE).sum(-1))


def completion_sums(lm_head: nn.Module, hidden: torch.Tensor, labels: torch.Tensor,
                    pieces: int = 1) -> Completions:
    """``completion_logps`` from the final hidden states [rows, T, H]: the head and log-probs
    ``pieces`` slices of the sequence at a time; with several (and gradients), each slice is
    recomputed in backward, so its logits are not kept."""
    if pieces <= 1:
        return completion_logps(lm_head(hidden), labels)
    size = -(-hidden.shape[1] // pieces)
    piece = lambda h, lab: _token_logps(lm_head(h), lab).sum(-1)  # noqa: E731
    sums = [checkpoint(piece, h, lab, use_reentrant=False) if torch.is_grad_enabled() else piece(h, lab)
            for h, lab in zip(hidden.split(size, dim=1), labels.split(size, dim=1))]
    return Completions(torch.stack(sums).sum(0), (labels != IGNORE).sum(-1))


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, stable at both ends (Mächler's two branches)."""
    return torch.where(x > -0.6931471805599453, torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def _check(objective: str, reference, chosen_nll) -> None:
    if objective not in PREFERENCE:
        raise ValueError(f"objective must be one of {', '.join(PREFERENCE)}, got {objective!r}.")
    if (reference is None) != (objective in REFERENCE_FREE):
        raise ValueError(f"{objective}: reference log-probs are "
                         f"{'not used' if objective in REFERENCE_FREE else 'needed'}.")


def pair_terms(objective: str, chosen: Completions, rejected: Completions,
               reference: tuple[Completions, Completions] | None, beta: float, gamma: float,
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per pair: the objective's loss (ORPO's odds-ratio term alone, without its SFT term),
    and the chosen and rejected rewards (detached)."""
    _check(objective, reference, None)
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
    else:
        chosen_mean, rejected_mean = chosen.mean.float(), rejected.mean.float()
        chosen_reward, rejected_reward = beta * chosen_mean, beta * rejected_mean
        if objective == "simpo":
            losses = -F.logsigmoid(beta * (chosen_mean - rejected_mean) - gamma)
        else:
            log_odds = (chosen_mean - rejected_mean) - (_log1mexp(chosen_mean) - _log1mexp(rejected_mean))
            losses = -beta * F.logsigmoid(log_odds)
    return losses, chosen_reward.detach(), rejected_reward.detach()


def preference_loss(objective: str, chosen: Completions, rejected: Completions, *,
                    reference: tuple[Completions, Completions] | None = None, beta: float = 0.1,
                    gamma: float = 0.5, chosen_nll: torch.Tensor | None = None,
                    ) -> tuple[torch.Tensor, PreferenceMetrics]:
    """The batch's loss (mean over pairs) and its metrics. ``reference``: the reference
    model's (chosen, rejected) for ``dpo`` and ``ipo``; ``chosen_nll``: the chosen
    completions' mean token cross-entropy, ORPO's SFT term."""
    _check(objective, reference, chosen_nll)
    if objective == "orpo" and chosen_nll is None:
        raise ValueError("orpo: the chosen completions' cross-entropy (chosen_nll) is needed.")
    losses, chosen_reward, rejected_reward = pair_terms(objective, chosen, rejected, reference, beta, gamma)
    loss = losses.mean() + (chosen_nll if objective == "orpo" else 0)
    return loss, PreferenceMetrics.of(chosen_reward, rejected_reward)


def pair_batch_loss(model: nn.Module, batch: dict[str, torch.Tensor], options, pairs_total: int,
                    chosen_tokens_total: int, offload=None, copy=None,
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One micro-batch of pairs: its share of the step's loss (pair losses summed over the
    step's ``pairs_total``; ORPO's cross-entropy over ``chosen_tokens_total`` chosen tokens,
    as one batch would give), and each pair's chosen and rejected rewards. The reference runs
    first, without gradients, so its transient is gone before the policy's forward keeps
    anything: precomputed log-probs in the batch, a frozen copy (``copy``, a
    ``reference.FrozenCopy``) or the model with its adapters off; ``offload`` (activation
    offloading) wraps the policy's forward only."""
    ids, labels = batch["input_ids"], batch["labels"]
    pieces = max(options.chunked_loss, 1)
    reference = _reference(model, batch, options, copy)
    reference = None if reference is None else reference.halves()
    with offload or contextlib.nullcontext():
        hidden = model.hidden_states(ids, positions=batch.get("positions"))
        if pieces <= 1:  # the whole batch's logits are kept for backward: offloaded too
            scores = completion_sums(model.lm_head, hidden, labels)
    if pieces > 1:  # each piece recomputed in backward (outside the offload hooks, as the loss's)
        scores = completion_sums(model.lm_head, hidden, labels, pieces)
    return _share(options, *scores.halves(), reference, pairs_total, chosen_tokens_total)


def _share(options, chosen: Completions, rejected: Completions, reference, pairs_total: int,
           chosen_tokens_total: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A micro-batch's share of the step's loss (its pairs' losses over the step's
    ``pairs_total``; ORPO's cross-entropy over its ``chosen_tokens_total``) and the rewards."""
    losses, chosen_reward, rejected_reward = pair_terms(options.objective, chosen, rejected, reference,
                                                        options.beta, options.gamma)
    loss = losses.sum() / pairs_total
    if options.objective == "orpo":
        loss = loss - chosen.logps.sum() / chosen_tokens_total
    return loss, chosen_reward, rejected_reward


def _reference(model: nn.Module, batch: dict, options, copy, rows: slice = slice(None)):
    """The batch's ``rows``' reference (chosen, rejected) ``Completions`` (None for the
    reference-free objectives): precomputed in the batch, from a frozen copy, or from the
    model with its adapters off, without gradients."""
    labels = batch["labels"][rows]
    if "reference_logps" in batch:  # precomputed before training (``reference_logps``)
        return Completions(batch["reference_logps"][rows], (labels != IGNORE).sum(-1))
    if options.objective in REFERENCE_FREE:
        return None
    scorer = copy.model if copy is not None else model
    with torch.no_grad(), adapters_off(model) if copy is None else contextlib.nullcontext():
        hidden = scorer.hidden_states(batch["input_ids"][rows], positions=_rows(batch.get("positions"), rows))
        with copy.scoring() if copy is not None else contextlib.nullcontext():  # (the head, once)
            return completion_sums(scorer.lm_head, hidden, labels, max(options.chunked_loss, 1))


def _rows(value, rows: slice):
    return None if value is None else value[rows]


@dataclass(frozen=True)
class PairWeights:
    """``split_pairs``' first pass over a batch of pairs: its share of the step's loss, each
    row's weight in the gradient (d loss / d row's log-probability) and the rewards."""

    loss: torch.Tensor
    weights: torch.Tensor  # [2B], the chosen rows' then the rejected rows'
    chosen_reward: torch.Tensor
    rejected_reward: torch.Tensor


def pair_weights(model: nn.Module, batch: dict[str, torch.Tensor], options, pairs_total: int,
                 chosen_tokens_total: int, copy=None) -> PairWeights:
    """The loss ``pair_batch_loss`` would give, from the policy's and the reference's
    log-probabilities made without gradients, the chosen rows then the rejected ones (half the
    batch's transients at a time); and each row's weight, the loss's derivative by its summed
    log-probability: the loss depends on the model through those numbers alone, so each half's
    ``sum(weight * log-prob)`` has the gradient its share of the loss has (``half_pair_loss``)."""
    half = batch["input_ids"].shape[0] // 2
    sides = (slice(0, half), slice(half, None))
    with torch.no_grad():
        scores = [completion_sums(model.lm_head, model.hidden_states(
            batch["input_ids"][rows], positions=_rows(batch.get("positions"), rows)), batch["labels"][rows],
            max(options.chunked_loss, 1)) for rows in sides]
    reference = None if options.objective in REFERENCE_FREE else \
        tuple(_reference(model, batch, options, copy, rows) for rows in sides)
    leaves = [s.logps.detach().float().requires_grad_() for s in scores]
    with torch.enable_grad():
        loss, chosen_reward, rejected_reward = _share(
            options, *(Completions(leaf, s.tokens) for leaf, s in zip(leaves, scores)), reference,
            pairs_total, chosen_tokens_total)
        weights = torch.autograd.grad(loss, leaves)
    return PairWeights(loss.detach(), torch.cat(weights), chosen_reward, rejected_reward)


def half_pair_loss(model: nn.Module, batch: dict[str, torch.Tensor], half: int, scored: PairWeights,
                   options, offload=None) -> torch.Tensor:
    """``split_pairs``' pass over one half of a batch of pairs (0: the chosen rows, 1: the
    rejected): a loss whose gradient is that half's share of the batch's and whose value is
    the batch's loss in the first pass, 0 in the second (so the step's sum is the loss)."""
    size = batch["input_ids"].shape[0] // 2
    rows = slice(half * size, (half + 1) * size)
    labels, pieces = batch["labels"][rows], max(options.chunked_loss, 1)
    with offload or contextlib.nullcontext():
        hidden = model.hidden_states(batch["input_ids"][rows], positions=_rows(batch.get("positions"), rows))
        if pieces <= 1:
            logps = completion_sums(model.lm_head, hidden, labels).logps
    if pieces > 1:
        logps = completion_sums(model.lm_head, hidden, labels, pieces).logps
    weighted = (logps.float() * scored.weights[rows]).sum()
    return weighted - weighted.detach() + (scored.loss if half == 0 else 0)


@torch.no_grad()
def reference_logps(model: nn.Module, pairs: list, pad_id: int, batch_size: int,
                    device: torch.device, pieces: int = 1, base: bool = False) -> torch.Tensor:
    """Every pair's reference log-probabilities, (chosen, rejected) [pairs, 2] in float32 on
    the host: the model as it is now (the weights a preference objective starts from, its
    adapters included: untrained, they change nothing), in eval mode, ``batch_size`` pairs at
    a time; ``base``: with the adapters off (the reference a run had so far). Under FSDP2 every
    rank runs every batch (a collective)."""
    out = []
    was_training = model.training
    model.eval()
    try:
        with adapters_off(model) if base else contextlib.nullcontext():
            for i in range(0, len(pairs), batch_size):
                batch = {k: v.to(device) for k, v in collate_pairs(pairs[i:i + batch_size], pad_id).items()}
                hidden = model.hidden_states(batch["input_ids"])
                chosen, rejected = completion_sums(model.lm_head, hidden, batch["labels"], pieces).halves()
                out.append(torch.stack([chosen.logps, rejected.logps], 1).float().cpu())
                del hidden
    finally:
        model.train(was_training)
    return torch.cat(out) if out else torch.zeros(0, 2)
