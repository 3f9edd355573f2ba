"""Out of memory, explained: where it ran out, what held the memory, which toggles would fit.

When a step runs out of memory the trainer rolls it back and raises ``OutOfMemory`` (a
``torch.OutOfMemoryError``, so existing ``except`` clauses still catch it). The message
names the phase (forward, backward, optimizer), what held memory at that moment, and the
toggle changes that the estimator (``nbtune.estimate``, fake tensors) predicts lower the
step's peak, with the predicted peaks. ``Session.run(n, on_oom="adapt")`` applies the
first of them and goes on.

The suggestions are the prediction package's (``nbtune.predict.advice``): single moves from
``fit``'s own search space, those that keep the maths exact first (chunked loss,
checkpointing, a split batch, the optimizer step in backward, offloading), then those that
change it a little (8-bit AdamW, bf16, LoRA, QLoRA).
"""

from __future__ import annotations

import torch

from .memory.accounting import gradient_bytes, optimizer_state_bytes, parameter_bytes
from .plan import SHARDED_FIELDS
from .predict.advice import Suggestion, suggest
from .techniques import Techniques
from .units import format_bytes


class OutOfMemory(torch.OutOfMemoryError):
    """A step ran out of memory; it was rolled back, and this says what to do.

    Args:
        message: What ran out, what held memory and the suggested changes, in words.
        phase: "forward", "backward" or "optimizer", where known.
        held: Bytes by category at the failure.
        predicted: The estimate of the failing configuration's peak, in bytes.
        suggestions: Toggle changes predicted to lower the peak, best first.
    """

    def __init__(self, message: str, phase: str | None, held: dict, predicted: int | None,
                 suggestions: list[Suggestion]) -> None:
        super().__init__(message)
        self.phase, self.held, self.predicted, self.suggestions = phase, held, predicted, suggestions


def held_now(model, optimizer, device: torch.device) -> dict[str, int]:
    """What held memory at the failure: weights, gradients, optimizer state, and on CUDA the
    rest of the allocator's memory (activations and temporaries)."""
    held = {"parameters": sum(parameter_bytes(model).values()), "gradients": gradient_bytes(model),
            "optimizer_state": optimizer_state_bytes(optimizer)}
    if device.type == "cuda":
        held["activations and temporaries"] = max(
            0, torch.cuda.memory_allocated(device) - sum(held.values()))
    return held


def budget(device: torch.device) -> int | None:
    """Bytes this process can hold on ``device`` (CUDA: free plus what the allocator holds)."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device)


def explain(err: BaseException, phase: str | None, step: int, held: dict, config, t: Techniques,
            device: torch.device, shape: tuple[int, int] | None, parallel=None,
            damaged: str | None = None) -> OutOfMemory:
    """The ``OutOfMemory`` to raise in place of ``err``; on ranks (``parallel``) it names the
    rank, and its predictions are that rank's (FSDP2 over the job's ranks); its advice is the
    run file under torchrun; on a notebook's ranks (``from_kernel``) ``session.set`` after
    ``recover()``, or the run file for a change to what made the sharding.
    ``damaged``: the trainer's own account when the update had begun writing with no copy
    to undo it (then the step was not rolled back, and the message says so)."""
    limit = budget(device)
    spread = (parallel.world, parallel.sharding) if parallel is not None else (1, None)
    now, suggestions = suggest(config, t, device, shape, limit, *spread)
    predicted = None if now is None else now.highest
    if now is not None and "activations and temporaries" not in held:
        held["activations (estimated)"] = now.activations  # CPU: no allocator to ask
    top = max(held, key=held.get)
    measured = {k: v for k, v in held.items() if k != "activations (estimated)"}
    held_line = "Held at the failure: " + ", ".join(f"{k.replace('_', ' ')} {format_bytes(v)}"
                                                    for k, v in measured.items())
    if len(measured) < len(held):
        held_line += (f"; this step's activations would reach "
                      f"{format_bytes(held['activations (estimated)'])} (estimated)")
    from_kernel = getattr(parallel, "from_kernel", False)
    if damaged:
        rank = f"Rank {parallel.rank} of {parallel.world}: " if parallel is not None else ""
        head = f"{rank}Out of memory in the {phase or 'set-up'} phase of step {step}. {damaged}"
    elif parallel is None:
        head = (f"Out of memory in the {phase or 'set-up'} phase of step {step}; the step was "
                "rolled back and the session is as it was before it.")
    else:  # a notebook's ranks: the kernel says the rest; torchrun's wait in a collective
        head = (f"Rank {parallel.rank} of {parallel.world} ran out of memory in the "
                f"{phase or 'set-up'} phase of step {step}" + ("." if from_kernel else
                "; the job stops (resume from its last checkpoint with --resume once the run "
                "file has a change that fits)."))
    lines = [head,
             f"{held_line}. The largest: {top.replace('_', ' ').replace(' (estimated)', '')}."]
    if suggestions:
        now = format_bytes(predicted) if predicted is not None else "?"
        where = f" of {format_bytes(limit)} available" if limit is not None else ""
        lines.append(f"Predicted peak {'per rank ' if parallel is not None else ''}now {now}{where}; "
                     "these changes lower it:")
        for s in suggestions:
            note = ("fits" if s.fits else "still too big") if s.fits is not None else ""
            kept = "same maths" if s.exact else "changes the maths slightly"
            lines.append(f"  {s.label}: {now} -> {format_bytes(s.peak)} ({kept}{', ' + note if note else ''})")
        if from_kernel:  # (recover() first, whether or not the update had begun writing)
            lines.append(_advice_on_ranks(suggestions))
        elif damaged and parallel is None:
            lines.append(f"Once session.recover() has brought the session back, apply one with "
                         f"session.set({suggestions[0].label}).")
        elif parallel is None:
            lines.append(f"Apply one with session.set({suggestions[0].label}), or run(n, "
                         "on_oom='adapt') to apply the first and go on.")
        else:
            lines.append(f"Put one in the run file ({_in_run_file(suggestions[0])}) and start the "
                         "job again.")
    else:
        lines.append("No single toggle change is predicted to lower the peak: shorten seq_len or "
                     "lower batch_size.")
    if phase == "generation":  # GRPO's writing: its KV cache, which the toggles above do not touch
        at_once = min(t.generation_batch or t.generations, t.generations)
        lines.append(f"The completions were being written, {at_once} at a time, each with a KV cache of "
                     f"up to {t.seq_len} tokens: a lower generation_batch (1 writes one at a time) or "
                     "max_completion shrinks it"
                     + (", and kv_cache='int8' halves a bf16 one." if t.kv_cache != "int8" else "."))
    if err.args:
        lines.append(f"(torch: {str(err.args[0]).splitlines()[0][:200]})")
    return OutOfMemory("\n".join(lines), phase, held, predicted, suggestions)


def _advice_on_ranks(suggestions: list[Suggestion]) -> str:
    """How a notebook driving ranks applies a change: ``session.set`` once ``recover()`` has
    started them again, for what sharded ranks can change; the run file for what made the
    sharding (``plan.SHARDED_FIELDS``), which the ranks refuse to change."""
    settable = [s for s in suggestions if not set(s.changes) & SHARDED_FIELDS]
    said = (f"After session.recover() has started the ranks again, apply one with "
            f"session.set({settable[0].label})." if settable else "")
    first = suggestions[0]
    if first not in settable:
        said += ((" " if said else "") + f"{first.label} is fixed while the ranks hold the model "
                 f"sharded: put it in the run file ({_in_run_file(first)}) and start the ranks "
                 "again (Session.from_config).")
    return said


def _in_run_file(suggestion: Suggestion) -> str:
    """A suggestion's changes as a run file writes them (``techniques.x: y``)."""
    return ", ".join(f"techniques.{k}: {v}" for k, v in suggestion.changes.items())


class SimulatedCard(torch.autograd.graph.saved_tensors_hooks):
    """Within this context, pretend the device holds at most ``limit`` bytes of activations
    saved for backward: past that, raise ``torch.OutOfMemoryError`` as CUDA would.

    For teaching and tests on a CPU, where really running out of memory would get the
    process killed. Activations are counted as they are saved and uncounted as backward
    uses them; weights are not counted. Checkpointed layers save through their own hooks,
    so checkpointing really does lower what this card sees.

    Args:
        limit: The bytes of saved activations the pretend card holds.
    """

    def __init__(self, limit: int) -> None:
        self.limit, self.held = limit, 0

        def pack(t: torch.Tensor):
            if isinstance(t, torch.nn.Parameter):
                return t
            nbytes = t.numel() * t.element_size()
            self.held += nbytes
            if self.held > self.limit:
                self.held = 0  # the failed step's activations are dropped with it
                raise torch.OutOfMemoryError(
                    f"Out of memory on a simulated card holding {format_bytes(self.limit)} of "
                    f"activations (tried to save {format_bytes(nbytes)} more).")
            return (t, nbytes)

        def unpack(packed):
            if isinstance(packed, torch.Tensor):
                return packed
            t, nbytes = packed
            self.held -= nbytes
            return t

        super().__init__(pack, unpack)
