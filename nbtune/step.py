"""One optimizer step: the loop the notebook, the CLI and (later) torchrun all share."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field, fields, replace
from typing import Callable

import torch
from torch import nn

from .activations import OffloadActivations
from .data import IGNORE
from .loss import cross_entropy_sum, loss_pieces
from .memory import MemoryBreakdown, track_step
from .memory.usage import Usage, UsageMeter
from .objectives.grpo import RolloutMetrics, grpo_batch_loss
from .objectives.preference import PREFERENCE, PreferenceMetrics, half_pair_loss, pair_batch_loss, pair_weights
from .optim import OptimizerInBackward


@dataclass(frozen=True)
class StepOptions:
    """What a step reads of ``Techniques``, by the same names, built once per configuration
    (``StepOptions.of(t)``): a new toggle the step uses is one field here, picked up by name.
    ``offload_to`` is the estimator's: where offloaded activations go ("meta" leaves the
    device it counts). ``recompute_loss`` is the trainer's (``Predictor.keeps_loss_pieces``);
    tiles are always recomputed."""

    chunked_loss: int = 0  # loss in this many pieces (0 or 1: whole)
    recompute_loss: bool = True  # the pieces recomputed in backward (else gradients in forward)
    tile_tokens: int = 0  # each layer's norm + MLP, and the loss, this many tokens at a time
    activation_offloading: bool = False
    max_grad_norm: float = 0.0
    compile: bool = False  # the loss compiled (the layers are compiled by the planner)
    offload_to: str | None = None
    objective: str = "sft"  # a preference objective's batches are pairs (objectives/preference.py)
    beta: float = 0.1
    gamma: float = 0.5
    split_pairs: bool = False  # a pair batch's chosen and rejected rows in two passes
    # GRPO's (objectives/grpo.py): the rollout's and the loss's settings
    generations: int = 4
    max_completion: int = 64
    rollout_temperature: float = 1.0
    rollout_top_p: float = 1.0
    kl: float = 0.0
    grpo_loss: str = "dapo"
    scale_rewards: bool = True
    generation_batch: int = 0
    kv_cache: str = "model"

    @property
    def paired(self) -> bool:
        return self.objective in PREFERENCE

    @classmethod
    def of(cls, techniques, **extra) -> "StepOptions":
        return cls(**{**{f.name: getattr(techniques, f.name) for f in fields(cls)
                          if hasattr(techniques, f.name)}, **extra})


@dataclass(frozen=True)
class StepContext:
    """What the caller lends a step besides the maths: ``phase`` (a one-item list kept at the
    phase running, for errors to name it), ``writing()`` (called as the update is about
    to be written where it can no longer be undone, perhaps again later) and ``stop_point()``
    (called where the step may end, rolled back: it raises KeyboardInterrupt if Ctrl-C came;
    an ``interrupts.StepHold``'s), ``undo`` (an ``undo.UndoCopy`` that copies what the update writes just
    before it is written), ``parallel`` (a ``distributed.Parallel``: the micro-batches are
    this rank's rows, counts and loss are summed over ranks) and ``guard(loss, grad_norm)``,
    which may refuse the update before anything is written."""

    phase: list = field(default_factory=lambda: [None])
    writing: Callable = lambda: None
    stop_point: Callable = lambda: None
    undo: object = None
    parallel: object = None
    guard: Callable | None = None
    copy: object = None  # a full finetune's reference (``objectives.reference.FrozenCopy``)


NO_CONTEXT = StepContext()


@dataclass(frozen=True)
class StepReport:
    """What one step did: its loss, the tokens it read, its time and its memory.

    Attributes:
        step: The step's number, from 1.
        loss: The mean token loss over every trained token of the step.
        tokens: Non-padding tokens read (throughput = tokens / seconds).
        trained_tokens: Tokens counted in the loss.
        seconds: The step's wall time.
        lr: The learning rate it used.
        memory: Its ``MemoryBreakdown`` (``measured=False``: carried over from the last measured
            step).
        shape: [batch, sequence] of the longest micro-batch, padding included.
        eval_loss: The held-out loss after this step (``eval_every``), else None.
        usage: The cheap figure metered on every step (``memory.usage``).
        router_loss: A mixture-of-experts model's load-balancing loss (top_k when balanced; its
            ``router_aux_loss_coef`` times it is added to ``loss`` in training, not in
            ``loss`` as reported), the mean over micro-batches; None for a dense model.
        preference: A preference objective's rewards, margin and accuracy over the step's
            pairs (``PreferenceMetrics``); None for ``sft``. ``loss`` is then the objective's.
        eval_preference: The same over the held-out pairs after this step (``eval_every``;
            ``eval_loss`` is then the objective's loss on them), else None.
        rollouts: GRPO's rewards and completions over the step (``RolloutMetrics``), else None;
            ``seconds`` then includes writing the completions.
        mean_kl: GRPO's mean KL estimate per completion token to the reference (``kl`` > 0),
            else None.
    """

    step: int
    loss: float  # mean token loss over every trained token of the step
    tokens: int  # non-padding tokens read (throughput = tokens / seconds)
    trained_tokens: int  # tokens counted in the loss
    seconds: float
    lr: float
    memory: MemoryBreakdown  # measured=False: carried over from the last measured step
    shape: tuple[int, int] = (0, 0)  # [batch, sequence] of the longest micro-batch, padding included
    eval_loss: float | None = None  # held-out loss after this step (``eval_every``), else None
    usage: Usage | None = None  # the cheap figure metered on every step (``memory.usage``)
    router_loss: float | None = None  # mixture of experts: the load-balancing loss (top_k: balanced)
    preference: PreferenceMetrics | None = None  # a preference objective's rewards and accuracy
    eval_preference: PreferenceMetrics | None = None  # the same over the held-out pairs
    rollouts: RolloutMetrics | None = None  # GRPO's rewards and completion lengths
    mean_kl: float | None = None  # GRPO's mean KL per completion token to the reference

    @property
    def watched(self) -> dict[str, str]:
        """What a progress bar shows after the step: the loss, and the objective's own figure
        (a preference objective's margin; GRPO's mean reward, its loss hovering near 0)."""
        out = {"loss": f"{self.loss:.3f}"}
        if self.preference is not None:
            out["margin"] = f"{self.preference.margin:.3f}"
        if self.rollouts is not None:
            out["reward"] = f"{self.rollouts.reward:.3f}"
        return out

    @property
    def tokens_per_second(self) -> float:
        """Tokens read per second of the step."""
        return self.tokens / self.seconds if self.seconds else 0.0

    def __repr__(self) -> str:
        """One line (the memory's categories: ``report.memory``)."""
        from .units import format_bytes

        held_out = f", held-out loss {self.eval_loss:.4f}" if self.eval_loss is not None else ""
        held_out += f", router balance {self.router_loss:.3f}" if self.router_loss is not None else ""
        if self.preference is not None:
            held_out += (f", margin {self.preference.margin:.3f}, "
                         f"accuracy {self.preference.accuracy:.0%}")
        if self.rollouts is not None:
            held_out += (f", reward {self.rollouts.reward:.3f}, "
                         f"{self.rollouts.completion_length:.0f} tokens a completion")
        return (f"StepReport(step {self.step}: loss {self.loss:.4f}{held_out}, {self.tokens:,} tokens "
                f"in {self.seconds:.2f} s, lr {self.lr:.3g}, peak {format_bytes(self.memory.peak)}"
                f"{'' if self.memory.measured else ' (carried)'})")


@dataclass(frozen=True)
class EvalReport:
    """A held-out evaluation: mean token loss (a preference objective's: its loss over the
    held-out pairs, and their rewards and accuracy), tokens, time and (when tracked) memory."""

    loss: float
    tokens: int
    seconds: float
    memory: MemoryBreakdown | None
    preference: PreferenceMetrics | None = None


def held_out_loss(model: nn.Module, batches: list[dict[str, torch.Tensor]], options: StepOptions, *,
                  optimizer: torch.optim.Optimizer | None = None,
                  device: torch.device | None = None, track: bool = True, copy=None) -> EvalReport:
    """Mean token loss over ``batches`` without gradients (eval mode: no dropout); ``copy``:
    a full finetune's reference copy (``objectives.reference.FrozenCopy``).

    Its memory is measured like a step's (the optimizer state it sits beside included):
    a run that fits in training can still run out of memory at its first evaluation,
    because the logits of a whole batch are made at once unless the loss is chunked.
    """
    started = time.perf_counter()
    trained = int(sum((b["labels"] != IGNORE).sum() for b in batches))
    pairs = ((sum(b["input_ids"].shape[0] // 2 for b in batches),  # a preference objective's divisors
              int(sum((b["labels"].chunk(2)[0] != IGNORE).sum() for b in batches)))
             if options.paired else (1, 1))
    inputs = [t for b in batches for t in b.values()]
    tracker = track_step(model, optimizer, *inputs, copy=copy) if track else _Untracked()
    was_training = model.training
    model.eval()
    try:
        with tracker as memory:
            total, rewards = evaluate_sum(model, batches, memory, options, device=device, pairs=pairs,
                                          copy=copy)
    finally:
        model.train(was_training)
    preference = None if rewards is None else PreferenceMetrics.of(*rewards)
    return EvalReport(loss=float(total) / (max(trained, 1) if preference is None else 1), tokens=trained,
                      seconds=time.perf_counter() - started, memory=memory.result(),
                      preference=preference)


@torch.no_grad()
def evaluate_sum(model: nn.Module, batches: list[dict[str, torch.Tensor]], memory,
                 options: StepOptions, *, device: torch.device | None = None,
                 pairs: tuple[int, int] = (1, 1), copy=None) -> tuple[torch.Tensor, list | None]:
    """Summed token loss of ``batches``, moved to ``device`` one at a time (a tensor: the
    estimator runs it on fake ones), and None; a preference objective's batches of pairs:
    its loss over ``pairs`` (the pairs and the chosen tokens of them all), and every pair's
    (chosen, rejected) rewards."""
    total = torch.zeros((), dtype=torch.float32)
    rewards = [] if options.paired else None
    memory.before_forward()
    for batch in batches:
        if device is not None:
            batch = {k: v.to(device) for k, v in batch.items()}
        if rewards is not None:
            loss, chosen, rejected = pair_batch_loss(model, batch, options, *pairs, copy=copy)
            total += loss.float().cpu()
            rewards.append((chosen.float().cpu(), rejected.float().cpu()))
            continue
        hidden = model.hidden_states(batch["input_ids"], positions=batch.get("positions"),
                                     document_ids=batch.get("document_ids"))
        total += cross_entropy_sum(model.lm_head, hidden, batch["labels"], options.chunked_loss,
                                   tile_tokens=options.tile_tokens).float().cpu()
        del hidden
    if rewards is not None:
        rewards = [torch.cat(side) for side in zip(*rewards)]
    return total, rewards


class NonFiniteError(FloatingPointError):
    """A step whose loss or gradients are not finite: it was not applied."""


def finite_guard(step: int, lr: float):
    """The check ``update`` runs before the optimizer changes anything (one sync per step;
    with the optimizer in backward, one per weight as well: ``tensor`` names the weight
    whose gradient is checked, ``grad_norm`` then that gradient's largest magnitude)."""
    def check(loss: torch.Tensor, grad_norm: torch.Tensor | None, tensor: str | None = None) -> None:
        if hasattr(grad_norm, "full_tensor"):  # FSDP2: a DTensor of the ranks' partial norms
            grad_norm = grad_norm.full_tensor()
        both = loss if grad_norm is None else loss + grad_norm.float().cpu()  # one read-back
        if not both.isfinite():
            what = "loss" if not loss.isfinite() else "gradient norm"
            if tensor is not None and what != "loss":
                what = f"gradient of {tensor} (its largest magnitude)"
            value = float(loss if what == "loss" else grad_norm)
            err = NonFiniteError(
                f"Step {step} was not applied: its {what} is {value} (lr={lr:g}). Weights and "
                "optimizer state are unchanged. Likely causes: a learning rate too high for this "
                "model (lower lr, add warmup_steps), no gradient clipping (set max_grad_norm=1.0), "
                "or bf16 overflow (try dtype='fp32').")
            err.tensor, err.step = tensor, step
            raise err
    return check


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer,
               micro_batches: list[dict[str, torch.Tensor]], options: StepOptions,
               context: StepContext = NO_CONTEXT, *, pad_id: int, step: int,
               track: bool = True, usage: bool = False) -> StepReport:
    """Forward and backward over the micro-batches, then one optimizer step.

    The loss of every micro-batch is divided by the number of trained tokens in *all*
    of them, so accumulating k micro-batches gives the gradient of one k-times batch.
    Without ``track`` the report's memory is None (the caller says what to show instead).
    ``usage``: meter the step's cheap figure (``UsageMeter``) into ``report.usage``.
    A non-finite loss or gradient raises ``NonFiniteError`` before the optimizer runs (the
    step's own guard, added to ``context``). With ``context.parallel`` the report is the
    global step's.
    """
    started = time.perf_counter()
    pairs = options.paired  # each micro-batch's chosen rows, then its rejected ones
    counts = torch.tensor([int(sum((b["labels"] != IGNORE).sum() for b in micro_batches)),
                           int(sum((b["input_ids"] != pad_id).sum() for b in micro_batches)),
                           int(sum((b["labels"].chunk(2)[0] != IGNORE).sum() for b in micro_batches))
                           if pairs else 0])
    if context.parallel is not None:
        context.parallel.sum_(counts)
    trained, read = int(counts[0]), int(counts[1])
    inputs = [t for b in micro_batches for t in b.values()]
    lr = optimizer.param_groups[0]["lr"]
    tracker = track_step(model, optimizer, *inputs, copy=context.copy) if track else _Untracked()
    meter = UsageMeter(next(model.parameters()).device) if usage else None
    with meter or contextlib.nullcontext(), _Phases(tracker, context.phase, context.stop_point) as memory:
        total, balance, rewards = update(model, optimizer, micro_batches,
                                         int(counts[2]) if pairs else trained, memory, options,
                                         replace(context, guard=finite_guard(step, lr)))
    mean_kl = None
    if options.objective == "grpo" and options.kl:  # the tokens' summed KL, over every rank's
        summed = torch.stack(rewards).sum()
        mean_kl = float(summed if context.parallel is None else context.parallel.sum_(summed)) / max(trained, 1)
    shape = max((tuple(b["input_ids"].shape) for b in micro_batches), key=lambda s: s[0] * s[1])
    measured = memory.result()
    return StepReport(step=step, loss=float(total), tokens=read, trained_tokens=trained, shape=shape,
                      seconds=time.perf_counter() - started,
                      lr=lr, memory=measured, usage=meter.settle(measured) if meter else None,
                      router_loss=None if balance is None else float(balance),
                      preference=PreferenceMetrics.of(*_every_rank(rewards, context.parallel)) if pairs else None,
                      mean_kl=mean_kl)


def _every_rank(rewards: list[torch.Tensor], parallel) -> list[torch.Tensor]:
    """The step's pairs' (chosen, rejected) rewards from every rank (each holds its own)."""
    if parallel is None:
        return rewards
    return [torch.cat(parallel.gather(side)) for side in rewards]


class _Phases:
    """Forwards the step's phase calls to the tracker and notes the phase running; a phase's
    start is a stop point (``StepContext.stop_point``)."""

    def __init__(self, tracker, phase: list, stop_point: Callable[[], None] = lambda: None) -> None:
        self.tracker, self.phase, self.stop_point = tracker, phase, stop_point

    def __enter__(self) -> "_Phases":
        self.phase[0] = "forward"
        self.tracker.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.tracker.__exit__(*exc)

    def before_forward(self) -> None:
        self.stop_point()
        self.phase[0] = "forward"
        self.tracker.before_forward()

    def after_forward(self) -> None:
        self.phase[0] = "backward"
        self.tracker.after_forward()
        self.stop_point()

    def after_backward(self) -> None:
        self.tracker.after_backward()

    def before_optimizer(self) -> None:
        self.stop_point()
        self.phase[0] = "optimizer"
        self.tracker.before_optimizer()

    def result(self):
        return self.tracker.result()


class _Untracked(contextlib.nullcontext):
    """The tracker interface doing nothing: a step that is not measured."""

    def __enter__(self) -> "_Untracked":
        return self

    def before_forward(self) -> None:
        pass

    after_forward = after_backward = before_optimizer = before_forward

    def result(self) -> None:
        return None


def update(model: nn.Module, optimizer: torch.optim.Optimizer,
           micro_batches: list[dict[str, torch.Tensor]], trained: int, memory,
           options: StepOptions, context: StepContext = NO_CONTEXT):
    """The step's tensor work, telling ``memory`` its phases; returns the loss (a tensor), a
    mixture-of-experts model's mean load-balancing loss (``CausalLM.router_loss``; None for
    a dense one), whose ``router_aux_loss_coef`` share of each micro-batch's backward is added,
    and a preference objective's (chosen, rejected) rewards of every pair (GRPO: each
    micro-batch's summed KL estimate; else None). ``trained``: the step's trained tokens over
    every rank (a preference objective's: its chosen completions' tokens, ORPO's
    cross-entropy's divisor; GRPO's: its completion tokens).

    ``context.guard(loss, grad_norm)`` runs before the optimizer changes anything (after
    backward; with the optimizer stepped in backward, on the loss alone before backward); it
    may raise to refuse the update. Without it the function reads no Python number back from
    a tensor, so the estimator runs it on fake ones (with ``options.offload_to="meta"``). The
    update is what ``context.undo`` copies, weight by weight, first; ``context.writing()`` is
    called before the optimizer's step, or (when the optimizer steps in backward) before the
    first backward without an undo copy, after the last one with it; ``context.stop_point()``
    at each phase's start (``_Phases``).
    """
    guard, parallel, undo, writing = context.guard, context.parallel, context.undo, context.writing
    in_backward = isinstance(optimizer, OptimizerInBackward)
    total = torch.zeros((), dtype=torch.float32)
    balances = []  # each micro-batch's load-balancing loss (mixture of experts)
    rewards = []  # a preference objective's (chosen, rejected) rewards, each micro-batch's
    coef = getattr(getattr(model, "config", None), "router_aux_loss_coef", 0.0)
    rows_total = sum(b["input_ids"].shape[0] for b in micro_batches) * (1 if parallel is None else parallel.world)
    split = options.paired and options.split_pairs  # each pair batch's chosen rows, then its rejected
    passes = [(b, half) for b in micro_batches for half in ((0, 1) if split else (None,))]
    for batch, half in passes:
        memory.before_forward()
        offload = (OffloadActivations(model, to=options.offload_to)
                   if options.activation_offloading else None)
        if half is not None:  # (split_pairs) the loss and each row's weight first, no gradients
            if half == 0:
                scored = pair_weights(model, batch, options, rows_total // 2, trained, context.copy)
                rewards.append([scored.chosen_reward.float().cpu(), scored.rejected_reward.float().cpu()])
            loss = half_pair_loss(model, batch, half, scored, options, offload)
        elif options.paired:  # pairs: the objective's loss from each row's score
            loss, *pair_rewards = pair_batch_loss(model, batch, options, rows_total // 2, trained, offload,
                                                  context.copy)
            rewards.append([r.float().cpu() for r in pair_rewards])
        elif options.objective == "grpo":  # completions written by the rollout, with advantages
            loss, kl_sum = grpo_batch_loss(model, batch, options, rows_total, trained, offload)
            rewards.append(kl_sum.float().cpu())
        else:
            loss = _token_loss(model, batch, options, trained, offload)
        balance = model.router_loss() if coef else None
        reported = None  # (none for a dense model: the loss's lifetime is the tracker's to see)
        if balance is not None:  # trained on, reported apart (the mean over micro-batches)
            balances.append(balance.detach().float().cpu())
            reported = loss.detach()
            # (divided by the ranks: backward scales the loss by them for the cross-entropy,
            # summed over ranks, while this is each rank's own, averaged)
            loss = loss + balance * (coef / len(passes) / (1 if parallel is None else parallel.world))
        memory.after_forward()
        if undo is not None:
            undo.stage()
        if in_backward and guard is not None:  # backward writes the weights: check first
            seen = total + loss.detach().float().cpu()
            # every rank checks the same sum: one refusing alone would leave the others
            # waiting in backward's reduce-scatter
            guard(seen if parallel is None else parallel.sum_(seen), None)
        checked = _finite_gradients(model, guard, parallel, total + loss.detach().float().cpu()) \
            if in_backward and guard is not None else None
        if in_backward and undo is None:  # backward writes, uncopied
            writing()
        with _writing(optimizer, undo, checked) if in_backward else contextlib.nullcontext():
            # FSDP averages gradients over ranks; scaled by N, the average is the ranks' sum.
            (loss if parallel is None else loss * parallel.world).backward()
        memory.after_backward()
        total += (loss if reported is None else reported).detach().cpu()
        del loss, balance, reported
    if parallel is not None:  # every rank checks and reports the global loss
        parallel.sum_(total)
    grads = [p for p in model.parameters() if p.grad is not None]
    norm = None
    if options.max_grad_norm > 0:
        norm = torch.nn.utils.clip_grad_norm_(grads, options.max_grad_norm)
    elif guard is not None and grads:
        norm = torch.nn.utils.get_total_norm([p.grad for p in grads])
    if guard is not None and not in_backward:
        guard(total, norm)
    memory.before_optimizer()
    if undo is not None and not in_backward:
        undo.before_update()
    writing()  # (again, with the optimizer in backward: the update is written)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    # this rank's pairs (gathered by the caller: fake tensors, as the estimator's, do not travel)
    pair_rewards = [torch.cat(side) for side in zip(*rewards)] if options.paired else \
        rewards if options.objective == "grpo" else None
    if not balances:
        return total, None, pair_rewards
    balance = torch.stack(balances).mean()
    return total, (balance if parallel is None else parallel.sum_(balance) / parallel.world), pair_rewards


def _token_loss(model: nn.Module, batch: dict[str, torch.Tensor], options: StepOptions, trained: int,
                offload) -> torch.Tensor:
    """A micro-batch's token cross-entropy, summed and divided by the step's ``trained``."""
    pieces = loss_pieces(batch["input_ids"].shape[1], options.chunked_loss, options.tile_tokens)
    with offload or contextlib.nullcontext():
        hidden = model.hidden_states(batch["input_ids"], positions=batch.get("positions"),
                                     document_ids=batch.get("document_ids"),
                                     normed=pieces <= 1)
        if pieces <= 1:  # the whole batch's logits are saved: offloaded too
            return cross_entropy_sum(model.lm_head, hidden, batch["labels"], 0,
                                     options.compile) / trained
    # Recomputed (checkpointed), pieces save only their slice of ``hidden`` (taken before the
    # final norm, which each piece applies), already held; otherwise each piece's gradients
    # are made in forward and only they are kept; what backward needs of ``hidden``, the loss
    # holds. (Under the offload hooks, recomputing a chunk on a LoRA model failed torch's
    # checkpoint metadata check: they run outside.)
    return cross_entropy_sum(model.lm_head, hidden, batch["labels"], pieces,
                             options.compile, norm=model.model.norm,
                             recompute=options.recompute_loss or bool(options.tile_tokens),
                             divisor=trained)


@contextlib.contextmanager
def _writing(optimizer: OptimizerInBackward, undo, checked):
    """Backward while the optimizer steps in it: each weight's gradient is checked first
    (``checked``), then its update copied by ``undo``."""
    before = [f for f in (checked, undo.before_update if undo is not None else None) if f]
    if before:
        optimizer.before_step = before[0] if len(before) == 1 else (
            lambda param: [f(param) for f in before])
    try:
        yield
    finally:
        optimizer.before_step = None


def _finite_gradients(model: nn.Module, guard, parallel, loss: torch.Tensor):
    """With the optimizer in backward a weight is written as soon as its gradient exists, so
    the step's guard sees no gradient norm before the first write: each gradient is checked
    before its own weight is written (a NaN there is refused, not applied). One read-back per
    weight; under FSDP2 each rank holds a shard, so the ranks sum their verdicts and agree."""
    def check(param: nn.Parameter) -> None:
        grad = param.grad
        local = grad.to_local() if hasattr(grad, "to_local") else grad
        # max |g| from one min-and-max pass: no gradient-sized temporary (memory is what is
        # measured), NaN and infinities carried through, and vectorised, where the inf-norm is
        # not: 25x faster on a bf16 head, 7 % of a 125M CPU step (benchmarks/peers.py)
        largest = (torch.stack(torch.aminmax(local.detach())).float().cpu().abs().max().reshape(1)
                   if local.numel() else torch.zeros(1))
        if parallel is not None:  # NaN + anything is NaN: every rank sees the same verdict
            parallel.sum_(largest)
        if not largest.isfinite().all():
            name = next((n for n, p in model.named_parameters() if p is param), "a weight")
            guard(loss, largest[0], tensor=name)
    return check
