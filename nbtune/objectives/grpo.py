"""GRPO: the model writes ``generations`` completions of each prompt, the user's reward
functions score them, and each completion's tokens are pushed up or down by how its reward
beat its group's mean, as TRL's ``GRPOTrainer`` (1.16) computes it on policy: one update per
generation, so the old policy is the current one detached and the ratio is 1 in value (its
gradient is the log-probability's). The ratio's clip to ``1 ± CLIP`` (PPO's, TRL's epsilon)
is kept so the loss is TRL's formula, but on policy it never binds: it is not a setting
(several updates per generation, where it would, are not built).

* rollout: each prompt's group generated with a KV cache, ``generation_batch`` sequences at a
  time (the prompt read once, its keys and values shared); a completion ends at a stop token,
  which it keeps (its probability is trained, as TRL's), or at ``max_completion`` tokens;
* rewards: plain functions in TRL's form, ``fn(prompts, completions, **columns) -> list``, a
  number per completion (``columns``: the rows' other fields, one list each), summed with
  their weights; a function that raises or gives anything but a finite number per completion
  stops the step with the function's name and the row, before anything is trained;
* advantages: reward minus its group's mean, divided by the group's standard deviation
  (+1e-4) when ``scale_rewards``;
* loss per token: ``-min(ratio * A, clip(ratio) * A) + kl * KL``, KL the k3 estimator
  ``exp(ref - logp) - (ref - logp) - 1`` against the base with the adapters off; log-probs
  of the logits divided by ``rollout_temperature``; averaged per ``grpo_loss``: ``dapo`` over the
  step's completion tokens, ``grpo`` per completion then over completions, ``dr_grpo`` over
  completions × ``max_completion`` (each over the whole step: accumulating equals one batch).
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import numbers
import time
from dataclasses import dataclass, replace
from typing import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..data import IGNORE, PromptRow, Sample, collate
from ..generate import sample_rows
from ..peft import adapters_off

CLIP = 0.2  # TRL's epsilon; binds only off policy (see above)


class RewardError(ValueError):
    """A reward function that raised, or gave something other than a finite number for
    each completion: named with the row, nothing trained."""


@dataclass(frozen=True)
class Reward:
    """A reward function and its weight in the sum."""

    fn: Callable
    weight: float = 1.0

    @property
    def name(self) -> str:
        return getattr(self.fn, "__name__", type(self.fn).__name__)


def as_rewards(value) -> tuple[Reward, ...]:
    """Reward functions as a user gives them: one function, a list of functions, or
    ``(function, weight)`` pairs (or ``Reward``s) among them; anything else refused naming
    what to pass."""
    single = isinstance(value, tuple) and len(value) == 2 and callable(value[0]) and not callable(value[1])
    items = [value] if callable(value) or single else value
    if not isinstance(items, (list, tuple)) or not items:
        raise TypeError(f"rewards={value!r:.60}: give a function, or a list of functions (each "
                        "def reward(prompts, completions, **columns) -> a number per completion), "
                        "or (function, weight) pairs.")
    out = []
    for item in items:
        if isinstance(item, Reward):  # as ``session.rewards`` gives them back
            item = (item.fn, item.weight)
        fn, weight = item if isinstance(item, tuple) and len(item) == 2 else (item, 1.0)
        if not callable(fn):
            raise TypeError(f"rewards: {fn!r:.60} is not a function: each reward is a function "
                            "(prompts, completions, **columns) -> a number per completion.")
        if isinstance(weight, bool) or not isinstance(weight, numbers.Real) or not math.isfinite(weight):
            raise TypeError(f"rewards: the weight of {getattr(fn, '__name__', fn)!r} is {weight!r}; "
                            "give a finite number, e.g. (reward, 0.5).")
        out.append(Reward(fn, float(weight)))
    return tuple(out)


def score(rewards: tuple[Reward, ...], rows: list[PromptRow], completions: list[str],
          group: int = 1) -> torch.Tensor:
    """Each completion's reward from each function, [completions, functions] in float32.
    ``rows[i]`` is completion i's prompt row (``group`` completions a prompt); a conversational
    prompt's completions are given as one assistant message each (TRL's form), a text
    prompt's as text."""
    prompts = [row.prompt for row in rows]
    given = [[{"role": "assistant", "content": text}] if row.conversational else text
             for row, text in zip(rows, completions)]
    names = sorted({name for row in rows for name, _ in row.fields} - {"prompts", "completions"})
    columns = {name: [dict(row.fields).get(name) for row in rows] for name in names}
    out = torch.zeros(len(rows), len(rewards))
    batch = (f"the completions of {rows[0].where or 'the batch'}"
             f"{' and others' if len({r.where for r in rows}) > 1 else ''}")
    for j, reward in enumerate(rewards):
        try:
            values = reward.fn(prompts=prompts, completions=given, **columns)
        except Exception as err:  # noqa: BLE001 - the user's code: said with its name, then stopped
            raise RewardError(f"The reward function {reward.name!r} raised {type(err).__name__}: "
                              f"{err} (scoring {batch}). Nothing was trained: fix the function and "
                              "step again.") from err
        if isinstance(values, torch.Tensor):
            values = values.tolist()
        if isinstance(values, (str, bytes)) or not hasattr(values, "__len__") or len(values) != len(rows):
            raise RewardError(f"The reward function {reward.name!r} returned {values!r:.80} scoring "
                              f"{batch}; it must return one number per completion ({len(rows)} here, "
                              "a list). Nothing was trained.")
        for i, v in enumerate(values):
            number = (isinstance(v, numbers.Real) or str(getattr(v, "dtype", "")) == "bool") \
                and math.isfinite(float(v))
            if not number:
                raise RewardError(f"The reward function {reward.name!r} gave {v!r:.60} for completion "
                                  f"{i % group + 1} of {rows[i].where or f'prompt {i // group + 1}'}: each "
                                  "reward must be a finite number (not None, NaN or text). Nothing was "
                                  "trained.")
            out[i, j] = float(v)
    return out


def advantages(total: torch.Tensor, group: int, scale: bool) -> torch.Tensor:
    """Each completion's reward against its group's: minus the mean, over the standard
    deviation (+1e-4, TRL's) when ``scale``. ``total`` [B * group], groups contiguous."""
    grouped = total.float().view(-1, group)
    centred = grouped - grouped.mean(1, keepdim=True)
    if scale:
        centred = centred / (grouped.std(1, keepdim=True) + 1e-4)
    return centred.flatten()


@torch.no_grad()
def generate_group(model: nn.Module, prompt: list[int], generators: list[torch.Generator], *,
                   max_new: int, stop_ids, temperature: float, top_p: float, at_once: int,
                   more: Callable[[bool], bool] | None = None, int8: bool = False) -> list[list[int]]:
    """A completion of ``prompt`` for each of ``generators`` (each draws its completion's
    samples, so how many are written at once changes no completion on a CPU; on a GPU, matrix
    products of another batch size may differ in the last bits), ``at_once`` at a time in
    lockstep: the prompt read once and its KV cache shared, then one forward of the batch per
    token until every completion has ended (``more(going)``: whether any rank still writes; on
    several ranks each runs every forward, its gathers being collectives; ``int8``: the cache in
    8 bits, ``Int8KVCache``). A completion keeps
    the stop token that ends it. Each token's logits are dropped once sampled, before the next
    forward."""
    device = next(model.parameters()).device
    out: list[list[int]] = []
    for start in range(0, len(generators), at_once):
        draws = generators[start:start + at_once]
        n = len(draws)
        cache = model.new_cache(int8=int8)
        hidden = model.hidden_states(torch.tensor([prompt], device=device), cache=cache)
        logits = model.lm_head(hidden[:, -1]).expand(n, -1)  # the last position's alone
        del hidden
        cache.expand(n)
        seqs: list[list[int]] = [[] for _ in range(n)]
        done = [False] * n
        for written in range(1, max_new + 1):
            tokens = sample_rows(logits, temperature, top_p, draws)
            del logits
            for i, token in enumerate(tokens.tolist()):
                if not done[i]:
                    seqs[i].append(token)
                    done[i] = token in stop_ids
            going = not all(done)
            if written == max_new or not (more(going) if more is not None else going):
                break
            logits = model(tokens[:, None].to(device), cache=cache)[:, -1]
        out += seqs
        del tokens, cache  # before the next sequences' prompt is read
    return out


def completion_seed(seed: int, step: int, prompt: int, completion: int) -> int:
    """The seed of one completion's sampling: from the run's ``seed``, the step, the prompt's
    place in the step's batch and the completion's in its group (the same on every machine)."""
    key = f"{seed},{step},{prompt},{completion}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1


@dataclass(frozen=True)
class Rollout:
    """One micro-batch of prompts, written and scored: the update's rows and what users watch."""

    batch: dict[str, torch.Tensor]  # input_ids, labels (completion tokens), advantages
    rewards: torch.Tensor  # [completions, functions], unweighted
    lengths: torch.Tensor  # [completions] tokens written
    ended: torch.Tensor  # [completions] True where a stop token ended it (not max_completion)


def write(model: nn.Module, prompts: dict[str, torch.Tensor], options, *, stop_ids,
          generators: list[list[torch.Generator]], more=None) -> list[tuple[list[int], list[list[int]]]]:
    """``options.generations`` completions of each prompt of a collated prompt batch
    (``collate_prompts``; ``generators`` one per completion, a list per prompt), in eval mode:
    (the prompt's ids, its completions) each. Nothing here runs the user's code: on several
    ranks every rank writes all its micro-batches before any reward is asked for."""
    group = options.generations
    was_training = model.training
    model.eval()
    try:
        written = []
        for ids, length, draws in zip(prompts["prompt_ids"].tolist(), prompts["prompt_lengths"].tolist(),
                                      generators):
            written.append((ids[:length], generate_group(
                model, ids[:length], draws, max_new=options.max_completion, stop_ids=stop_ids,
                temperature=options.rollout_temperature, top_p=options.rollout_top_p,
                at_once=min(options.generation_batch or group, group), more=more,
                int8=options.kv_cache == "int8")))
    finally:
        model.train(was_training)
    return written


def rollout(written: list, rows: list[PromptRow], decode, rewards: tuple[Reward, ...], options, *,
            stop_ids, pad_id: int) -> Rollout:
    """The completions ``write`` made of a micro-batch's prompts (``rows`` their rows) scored,
    and the update's batch made of them."""
    group = options.generations
    samples, texts, completion_rows, ended, lengths = [], [], [], [], []
    for (prompt, completions), row in zip(written, rows):
        for completion in completions:
            stopped = completion[-1] in stop_ids
            texts.append(decode(completion[:-1] if stopped else completion))
            ended.append(stopped)
            lengths.append(len(completion))
            completion_rows.append(row)
            ids = prompt + completion
            samples.append(Sample(torch.tensor(ids[:-1]),
                                  torch.tensor([IGNORE] * (len(prompt) - 1) + completion)))
    values = score(rewards, completion_rows, texts, group)
    weights = torch.tensor([r.weight for r in rewards])
    batch = collate(samples, pad_id)
    batch["advantages"] = advantages(values @ weights, group, options.scale_rewards)
    return Rollout(batch, values, torch.tensor(lengths), torch.tensor(ended))


def token_logps(lm_head: nn.Module, hidden: torch.Tensor, labels: torch.Tensor, pieces: int = 1,
                temperature: float = 1.0) -> torch.Tensor:
    """Each position's log-probability of its label [rows, T] (0 where ``IGNORE``), of the
    logits over ``temperature``: the head ``pieces`` slices of the sequence at a time, each
    recomputed in backward when there are several, so one piece's logits exist at a time."""
    def piece(h, lab):
        logits = lm_head(h).float() / temperature
        taken = logits.gather(-1, lab.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        return (taken - torch.logsumexp(logits, dim=-1)) * (lab != IGNORE)

    if pieces <= 1:
        return piece(hidden, labels)
    size = -(-hidden.shape[1] // pieces)
    return torch.cat([checkpoint(piece, h, lab, use_reentrant=False) if torch.is_grad_enabled() else piece(h, lab)
                      for h, lab in zip(hidden.split(size, dim=1), labels.split(size, dim=1))], dim=1)


def token_losses(logps: torch.Tensor, old: torch.Tensor, advantages: torch.Tensor,
                 reference: torch.Tensor | None, clip: float, kl: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """GRPO's loss at each token [rows, T] and the KL estimate there (None without a reference)."""
    ratio = torch.exp(logps - old)
    gain = advantages.unsqueeze(1)
    losses = -torch.min(ratio * gain, torch.clamp(ratio, 1 - clip, 1 + clip) * gain)
    if reference is None:
        return losses, None
    divergence = torch.exp(reference - logps) - (reference - logps) - 1
    return losses + kl * divergence, divergence


def aggregate(losses: torch.Tensor, mask: torch.Tensor, kind: str, completions: int, tokens: int,
              max_completion: int) -> torch.Tensor:
    """This micro-batch's share of the step's loss under ``grpo_loss`` ``kind``: ``completions``
    and ``tokens`` count the whole step's (every micro-batch's, every rank's)."""
    masked = losses * mask
    if kind == "grpo":
        return (masked.sum(-1) / mask.sum(-1).clamp(min=1)).sum() / completions
    if kind == "dr_grpo":
        return masked.sum() / (completions * max_completion)
    if kind == "dapo":
        return masked.sum() / max(tokens, 1)
    raise ValueError(f"grpo_loss={kind!r} is not one of 'dapo', 'grpo', 'dr_grpo'.")


def grpo_batch_loss(model: nn.Module, batch: dict[str, torch.Tensor], options, completions: int,
                    tokens: int, offload=None) -> tuple[torch.Tensor, torch.Tensor]:
    """One micro-batch of completions: its share of the step's loss, and its tokens' summed KL
    estimate (0 without a reference). The reference (``kl`` > 0: the base with the adapters
    off) runs first, without gradients; ``offload`` wraps the policy's forward only."""
    ids, labels = batch["input_ids"], batch["labels"]
    pieces = max(options.chunked_loss, 1)
    reference = None
    if options.kl:
        with torch.no_grad(), adapters_off(model):
            hidden = model.hidden_states(ids)
            reference = token_logps(model.lm_head, hidden, labels, pieces, options.rollout_temperature)
            del hidden
    with offload or contextlib.nullcontext():
        hidden = model.hidden_states(ids)
        if pieces <= 1:  # the whole batch's logits are kept for backward: offloaded too
            logps = token_logps(model.lm_head, hidden, labels, 1, options.rollout_temperature)
    if pieces > 1:
        logps = token_logps(model.lm_head, hidden, labels, pieces, options.rollout_temperature)
    mask = labels != IGNORE
    losses, divergence = token_losses(logps, logps.detach(), batch["advantages"], reference,
                                      CLIP, options.kl)
    loss = aggregate(losses, mask, options.grpo_loss, completions, tokens, options.max_completion)
    kl_sum = (divergence * mask).sum().detach() if divergence is not None else torch.zeros(())
    return loss, kl_sum


@dataclass(frozen=True)
class RolloutMetrics:
    """What GRPO users watch, over the step's completions: the mean reward (weighted sum),
    the mean of the groups' standard deviations, each function's mean, the completions'
    mean length and the share cut at ``max_completion`` (TRL's ``completions/clipped_ratio``)."""

    reward: float
    reward_std: float
    rewards: dict[str, float]
    completion_length: float
    clipped: float

    @classmethod
    def of(cls, rollouts: list[Rollout], rewards: tuple[Reward, ...], group: int) -> "RolloutMetrics":
        values = torch.cat([r.rewards for r in rollouts])
        total = values @ torch.tensor([r.weight for r in rewards])
        lengths = torch.cat([r.lengths for r in rollouts]).float()
        ended = torch.cat([r.ended for r in rollouts])
        seen = [sum(q.name == r.name for q in rewards[:j]) for j, r in enumerate(rewards)]
        names = [r.name if not n else f"{r.name}_{n + 1}" for r, n in zip(rewards, seen)]  # two lambdas apart
        return cls(reward=total.mean().item(), reward_std=total.view(-1, group).std(1).mean().item(),
                   rewards={name: values[:, j].mean().item() for j, name in enumerate(names)},
                   completion_length=lengths.mean().item(), clipped=(~ended).float().mean().item())


def rollouts(model: nn.Module, optimizer, data, batches: list[dict], t, options, number: int, parallel,
             track: bool, stop_point: Callable[[], None]):
    """Each micro-batch of prompts written and rewarded, as the update's micro-batches: (their
    batches, (seconds taken, ``RolloutMetrics``), the writing's peak where ``track``). Each
    prompt's completion draws from ``seed``, the step, its prompt's place in the step's batch
    and its own place in the group, so a resumed or retried step writes what the run that
    never stopped wrote, however the batch is accumulated or the group written.
    ``stop_point()`` at each token and reward: where a Ctrl-C may end the step."""
    from ..memory import track_step

    rewards = data.rewards
    if not rewards:
        raise ValueError("objective='grpo' needs reward functions to score its completions: "
                         "session.rewards = [my_reward, ...] (each def my_reward(prompts, "
                         "completions, **columns) -> a number per completion).")
    started, tokenizer, out, peak = time.perf_counter(), data.tokenizer, [], 0
    world, rank = (1, 0) if parallel is None else (parallel.world, parallel.rank)

    def more(going: bool) -> bool:  # under FSDP2 every rank runs each token's forward (its
        stop_point()               # gathers are collectives) until all have ended
        return going if parallel is None else bool(parallel.sum_(torch.tensor([int(going)])).item())
    written = []
    for i, prompts in enumerate(batches):  # (each rank its share of the global batch: its place in it)
        first = (i * world + rank) * len(prompts["rows"])
        generators = [[torch.Generator().manual_seed(completion_seed(t.seed, number, first + k, j))
                       for j in range(t.generations)] for k in range(len(prompts["rows"]))]
        tracker = track_step(model, optimizer) if track else contextlib.nullcontext()
        with tracker:
            written.append(write(model, prompts, options, stop_ids=tokenizer.stop_ids,
                                 generators=generators, more=more))
        if track:
            peak = max(peak, tracker.result().peak)
    failure = None  # on ranks: a reward's failure said on every rank (none waits for it)
    for prompts, made in zip(batches, written):
        stop_point()
        try:
            out.append(rollout(made, [data.prompt_row(r) for r in prompts["rows"].tolist()],
                               tokenizer.decode, rewards, options, stop_ids=tokenizer.stop_ids,
                               pad_id=data.pad_id))
        except Exception as err:  # noqa: BLE001 - the user's code, on one rank
            if parallel is None:
                raise
            failure = str(err) if isinstance(err, RewardError) else f"{type(err).__name__}: {err}"
            break
    every = out
    if parallel is not None:  # every rank's, micro-batch by micro-batch (the global order)
        gathered = parallel.gather((failure, [replace(r, batch={}) for r in out]))
        failed = [(r, text) for r, (text, _) in enumerate(gathered) if text is not None]
        if failed:
            raise RewardError(f"Rank {failed[0][0]}: {failed[0][1]}")
        every = [ranks[1][m] for m in range(len(out)) for ranks in gathered]
    metrics = RolloutMetrics.of(every, rewards, t.generations)
    return [r.batch for r in out], (time.perf_counter() - started, metrics), peak
