"""One optimizer step: the loop the notebook, the CLI and (later) torchrun all share."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch
from torch import nn

from .activations import OffloadActivations
from .data import IGNORE
from .loss import cross_entropy_sum
from .memory import MemoryBreakdown, track_step


@dataclass(frozen=True)
class StepReport:
    """What one step did: its loss, the tokens it read, its time and its memory."""

    step: int
    loss: float  # mean token loss over every trained token of the step
    tokens: int  # non-padding tokens read (throughput = tokens / seconds)
    trained_tokens: int  # tokens counted in the loss
    seconds: float
    lr: float
    memory: MemoryBreakdown

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer,
               micro_batches: list[dict[str, torch.Tensor]], pad_id: int, step: int, *,
               loss_chunks: int = 0, offload_activations: bool = False,
               max_grad_norm: float = 0.0, compiled_loss: bool = False) -> StepReport:
    """Forward and backward over the micro-batches, then one optimizer step.

    The loss of every micro-batch is divided by the number of trained tokens in *all*
    of them, so accumulating k micro-batches gives the gradient of one k-times batch.
    """
    started = time.perf_counter()
    trained = int(sum((b["labels"] != IGNORE).sum() for b in micro_batches))
    read = int(sum((b["input_ids"] != pad_id).sum() for b in micro_batches))
    inputs = [t for b in micro_batches for t in b.values()]
    total = torch.zeros((), dtype=torch.float32)
    with track_step(model, optimizer, *inputs) as memory:
        for batch in micro_batches:
            memory.before_forward()
            with OffloadActivations(model) if offload_activations else contextlib.nullcontext():
                hidden = model.hidden_states(batch["input_ids"], positions=batch.get("positions"),
                                             document_ids=batch.get("document_ids"))
                loss = cross_entropy_sum(model.lm_head, hidden, batch["labels"], loss_chunks,
                                         compiled_loss) / trained
            memory.after_forward()
            loss.backward()
            memory.after_backward()
            total += loss.detach().cpu()
            del hidden, loss
        if max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(
                [p for p in model.parameters() if p.grad is not None], max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return StepReport(step=step, loss=float(total), tokens=read, trained_tokens=trained,
                      seconds=time.perf_counter() - started,
                      lr=optimizer.param_groups[0]["lr"], memory=memory.result())
