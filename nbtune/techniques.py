"""Techniques: every training toggle as one field, validated in one place.

A ``Techniques`` value is immutable; change it with ``session.set(field=value)`` (or
``techniques.replace(...)``), which validates the whole combination before anything is
applied. Combinations that cannot work together are the ``RULES`` table below, each with
its reason: the same reason is the error message and the panel's tooltip.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import math
import re
from dataclasses import dataclass, fields
from typing import Callable

METHODS = ("full", "lora", "qlora")
# What a run trains for: next-token cross-entropy on the rows, a preference between two
# completions of a prompt (``objectives/preference.py``; dpo and ipo against a reference), or
# rewards of completions the model writes in the step (``objectives/grpo.py``).
OBJECTIVES = ("sft", "dpo", "ipo", "simpo", "orpo", "grpo")
PAIRED = ("dpo", "ipo", "simpo", "orpo")  # batches of pairs
REFERENCE_FREE = ("simpo", "orpo")
GRPO_LOSSES = ("dapo", "grpo", "dr_grpo")
KV_CACHES = ("model", "int8")  # GRPO's writing: the KV cache in the model's dtype, or in 8 bits
REFERENCES = ("auto", "adapters_off", "precomputed", "copy", "copy_host")
DTYPES = ("fp32", "bf16")
OPTIMIZERS = ("adamw", "sgd", "adamw8bit", "paged_adamw8bit", "paged_adamw", "ao_adamw8bit",
              "ao_adamw4bit")
PAGED_OPTIMIZERS = ("paged_adamw8bit", "paged_adamw")
# Every projection name a family has; a model adapts those of them it has (Phi-3's fused
# qkv_proj and gate_up_proj in place of q/k/v and gate/up). "experts": every projection of a
# mixture-of-experts layer's experts, left out by default (attention and dense MLPs only).
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "qkv_proj", "o_proj", "gate_proj", "up_proj",
                "gate_up_proj", "down_proj", "experts")
DEFAULT_LORA_TARGETS = LORA_TARGETS[:-1]

# One sentence per dropdown choice: what it does and what it costs. The panel shows the
# current choice's sentence under its dropdown and in the dropdown's hover text.
CHOICE_HELP = {
    "objective": {
        "sft": "Imitate the rows: next-token cross-entropy on each response (instruction or chat rows).",
        "dpo": "Direct preference optimisation on pairs: raise the chosen completion's likelihood over "
               "the rejected one's, relative to a reference (the base with the adapters off).",
        "ipo": "IPO on pairs: DPO's comparison with a squared loss towards a fixed margin 1/(2·beta), "
               "per token; against the reference too.",
        "simpo": "SimPO on pairs: no reference model; the average log-probabilities of the two "
                 "completions, apart by at least gamma.",
        "orpo": "ORPO on pairs: no reference model; cross-entropy on the chosen completion plus beta "
                "times an odds-ratio term against the rejected one.",
        "grpo": "GRPO on prompts: the model writes several completions of each, your reward "
                "functions score them, and each is pushed up or down by how it beat its group.",
    },
    "kv_cache": {
        "model": "The KV cache of the completions being written in the model's dtype.",
        "int8": "The KV cache in 8 bits (a scale a token and head): about half of bf16's, a quarter "
                "of fp32's, for a rounding of at most 1/254 of each vector's largest entry "
                "(sampling may then draw other tokens).",
    },
    "grpo_loss": {
        "dapo": "DAPO's (TRL's default): every completion token of the step weighs the same, long "
                "completions count by their length.",
        "grpo": "The GRPO paper's: each completion's tokens averaged first, so every completion "
                "weighs the same whatever its length.",
        "dr_grpo": "Dr. GRPO's: token losses summed and divided by completions × max_completion, a "
                   "constant, so length biases neither way (pair it with scale_rewards=False).",
    },
    "reference": {
        "auto": "LoRA and QLoRA: the base with the adapters off; full finetuning: precomputed.",
        "adapters_off": "The same model with its adapters switched off, run each step without "
                        "gradients: no second copy of the weights, one more forward a step.",
        "precomputed": "Each pair's reference log-probabilities computed once, before training, and "
                       "kept on the host (8 bytes a pair): no reference forward in the step.",
        "copy": "Full finetuning: a frozen copy of the weights as the objective starts, on the device "
                "(the weights twice there), run each step without gradients; scores held-out pairs too.",
        "copy_host": "Full finetuning: the frozen copy kept in host memory, each layer brought to the "
                     "device as the reference forward reaches it (one layer there at a time, the "
                     "whole copy crossing to the device each step).",
    },
    "method": {
        "full": "Trains every weight: gradients and optimizer state for all of them, the most memory.",
        "lora": "Freezes the model and trains small adapters beside each projection: gradients and "
                "optimizer state for a few percent of the weights at most.",
        "qlora": "LoRA over a base stored in 4-bit NF4 (a quarter of bf16, an eighth of fp32), "
                 "dequantized as each layer runs: the least memory, slower steps (0.87x LoRA's "
                 "tokens/s on the 125M peers' CPU benchmark).",
    },
    "dtype": {
        "fp32": "4 bytes per weight, gradient and activation: exact, twice bf16's memory.",
        "bf16": "2 bytes per value: half the memory and fast on GPUs; on CPUs without native bf16 "
                "it can be many times slower than fp32.",
    },
    "optimizer": {
        "adamw": "AdamW (torch's fused kernel): two states per trained weight, 8 bytes each in fp32.",
        "sgd": "Plain SGD: no optimizer state at all, but usually needs more steps to train as well.",
        "adamw8bit": "bitsandbytes AdamW with 8-bit states: 2 bytes per weight instead of 8, "
                     "trains about as well.",
        "paged_adamw8bit": "adamw8bit whose state CUDA can page out to CPU memory when the card "
                           "fills: changes what happens at the limit, not the peak (CUDA only).",
        "paged_adamw": "AdamW with 32-bit state in CUDA unified memory, paged out under pressure "
                       "(CUDA only).",
        "ao_adamw8bit": "torchao's pure-PyTorch 8-bit AdamW: 2 bytes per weight of state.",
        "ao_adamw4bit": "torchao's 4-bit AdamW: 1 byte per weight of state, a little less exact.",
    },
}


@dataclass(frozen=True)
class Techniques:
    """What to train and how: method, precision, memory techniques, batch shape, optimizer.

    Immutable and checked whole when made: a value outside its range or a combination that
    cannot run (``RULES``) raises ``ValueError`` with every reason. Each field's line below is
    also the panel's tooltip (``HELP``, read from here).

    Attributes:
        method: full: train every weight (most memory); lora: train small adapters, base frozen;
            qlora: lora over a base stored in 4-bit NF4 (about a quarter of bf16).
        dtype: bf16 halves weights, grads and optimizer state; fp32 is exact but twice the memory.
        activation_checkpointing: Recompute layers in backward instead of keeping activations: less
            memory, about a third more compute. N = every Nth layer.
        batch_size: Sequences per micro-batch: activations grow linearly with it.
        seq_len: Tokens per sequence (longer rows are cut): activations grow with it.
        packing: Fill each sequence with several examples (a document mask keeps them apart): no
            compute wasted on padding.
        grad_accum: Micro-batches per optimizer step: a larger effective batch at the memory of one
            micro-batch.
        lr: Learning rate of the optimizer.
        warmup_steps: Steps of linear learning-rate warm-up: steadier start of training.
        optimizer: adamw keeps two fp32/bf16 states per weight; the 8-bit (bitsandbytes adamw8bit,
            torchao ao_adamw8bit) and 4-bit (ao_adamw4bit) ones quantize them; paged ones spill
            state to CPU under pressure (CUDA); sgd keeps none.
        optimizer_in_backward: Update each weight as soon as its gradient is ready and free it: at
            most one gradient alive at a time. No accumulation or clipping.
        cpu_offload_optimizer: Keep optimizer state (and its step) on the CPU (torchao, CUDA only):
            frees GPU memory, costs transfer time.
        activation_offloading: Move activations saved for backward to CPU memory and back: less GPU
            memory, pays off with checkpointing on.
        chunked_loss: Project to the vocabulary and take the loss N chunks at a time: the full
            logits and their float32 copy are never made at once (0 = off). Each chunk makes its
            gradients in forward and frees its logits before the next, so it holds no
            log-probabilities for backward; where the estimate says that raises the peak, or cannot
            say (tiling and several processes always), it is recomputed in backward instead: a
            forward of the head again (7-9 % of a 125M model's CPU step).
        tile_tokens: Sequence tiling: run each layer's norm + MLP, and the final norm, head and
            loss, N tokens at a time, recomputing each tile in backward: no [tokens, intermediate]
            tensor is ever whole, for long contexts (0 = off).
        compile: torch.compile each layer and the loss: faster steps after a slow first one.
        max_grad_norm: Clip the global gradient norm to this value (0 = no clipping).
        weight_decay: Decoupled weight decay of AdamW.
        lora_rank: Rank of the LoRA adapters: more capacity, more trainable weights.
        lora_alpha: LoRA scaling numerator (updates are scaled by alpha / rank).
        lora_dropout: Dropout on the LoRA input path.
        lora_targets: Which projections get LoRA adapters (each model adapts those it has;
            "experts": a mixture of experts' experts too, off by default).
        seed: Seed of the data order and dropout.
        eval_every: Held-out loss every N steps (0 = off), plotted beside the training loss; its
            memory (a whole batch of logits) is measured and estimated too.
        objective: What the run trains for: sft imitates the rows; dpo, ipo, simpo and orpo learn
            from preference pairs (prompt, chosen, rejected), each pair two rows of a batch.
        beta: Preference objectives: how strongly the log-probability gap is scored (dpo, ipo:
            against the reference; simpo: its scale; orpo: the odds-ratio term's weight).
        gamma: SimPO's target margin between the chosen and rejected average log-probabilities.
        reference: dpo and ipo's reference: adapters_off runs the base (adapters switched off)
            each step; precomputed scores every pair once before training and keeps the
            numbers on the host; copy (full finetuning) keeps a frozen copy of the weights on the
            device, copy_host in host memory (a layer at a time on the device); auto picks
            adapters_off for LoRA / QLoRA, precomputed for full.
        split_pairs: Preference objectives: the chosen rows and the rejected rows of a batch run
            forward and backward apart, so half the activations are kept at once, for one more
            forward of both without gradients (the gradient unchanged).
        generations: GRPO: completions written per prompt, the group each is compared with
            (batch_size counts prompts: a micro-batch trains batch_size × generations rows).
        max_completion: GRPO: the most tokens a completion may have (generation stops there).
        rollout_temperature: GRPO: the sampling temperature of the completions (the update scores
            them at the same temperature, as TRL does).
        rollout_top_p: GRPO: nucleus sampling, the share of probability mass sampled from (1 = all).
        kl: GRPO: weight of the KL term to the reference, the base with the adapters off
            (TRL's beta; 0, TRL's default, runs no reference).
        grpo_loss: GRPO: how token losses are averaged: dapo (over the step's tokens), grpo
            (per completion, then over completions) or dr_grpo (over a constant).
        scale_rewards: GRPO: divide each advantage by its group's reward standard deviation.
        generation_batch: GRPO: completions generated at once, each with its own KV cache
            (0 = a prompt's whole group): less memory, more time.
        kv_cache: GRPO: the writing's KV cache in the model's dtype ("model") or in 8 bits
            ("int8": about half of bf16's, its rounding may change what is sampled).
    """

    method: str = "full"
    dtype: str = "fp32"
    activation_checkpointing: bool | int = False  # False/0 off, True/1 every layer, N every Nth
    batch_size: int = 8
    seq_len: int = 512
    packing: bool = False  # several examples per sequence, each attending only to itself
    grad_accum: int = 1
    lr: float = 2e-5
    warmup_steps: int = 0  # linear warm-up from lr / warmup_steps to lr, then constant
    optimizer: str = "adamw"
    optimizer_in_backward: bool = False
    cpu_offload_optimizer: bool = False
    activation_offloading: bool = False
    chunked_loss: int = 0  # number of chunks the loss is taken in; 0 or 1 = in one go
    tile_tokens: int = 0  # sequence tiling: MLP and loss this many tokens at a time; 0 = off
    compile: bool = False
    max_grad_norm: float = 0.0  # 0 = no clipping
    weight_decay: float = 0.0
    lora_rank: int = 8
    lora_alpha: float = 16.0
    lora_dropout: float = 0.0
    lora_targets: tuple[str, ...] = DEFAULT_LORA_TARGETS
    seed: int = 0
    eval_every: int = 0  # held-out loss every N steps; 0 = off
    objective: str = "sft"
    beta: float = 0.1
    gamma: float = 0.5
    reference: str = "auto"
    split_pairs: bool = False  # chosen and rejected rows in two passes: half the activations
    generations: int = 4
    max_completion: int = 64
    rollout_temperature: float = 1.0
    rollout_top_p: float = 1.0
    kl: float = 0.0
    grpo_loss: str = "dapo"
    scale_rewards: bool = True
    generation_batch: int = 0  # 0 = a prompt's whole group at once
    kv_cache: str = "model"

    def __new__(cls, *args, **kwargs):
        _refuse_unknown("Techniques", kwargs)
        return super().__new__(cls)

    def __post_init__(self) -> None:
        if isinstance(self.lora_targets, str):
            object.__setattr__(self, "lora_targets", (self.lora_targets,))
        elif isinstance(self.lora_targets, (list, set, frozenset)):
            object.__setattr__(self, "lora_targets", tuple(self.lora_targets))
        problems = self.problems()
        if problems:
            raise ValueError(" ".join(problems))

    def problems(self) -> list[str]:
        """Every reason this combination cannot run, each naming the fix.

        Returns:
            The reasons, empty when it can run.
        """
        out = []

        def choice(name, allowed):
            if getattr(self, name) not in allowed:
                out.append(f"{name}={getattr(self, name)!r} is not one of {', '.join(map(repr, allowed))}.")

        def positive(name, kind=int):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (kind, int)) or not value > 0:
                out.append(f"{name} must be a positive {kind.__name__}, got {value!r}.")
            elif kind is float and not math.isfinite(value):
                out.append(f"{name} must be finite, got {value!r}: pick a value such as "
                           f"{getattr(Techniques, name)!r}.")

        choice("method", METHODS)
        choice("objective", OBJECTIVES)
        choice("reference", REFERENCES)
        choice("grpo_loss", GRPO_LOSSES)
        choice("kv_cache", KV_CACHES)
        choice("dtype", DTYPES)
        choice("optimizer", OPTIMIZERS)
        for name in ("batch_size", "seq_len", "grad_accum", "lora_rank", "max_completion", "generations"):
            positive(name)
        for name in ("lr", "lora_alpha", "rollout_temperature"):
            positive(name, float)
        if isinstance(self.generations, int) and self.generations == 1:
            out.append("generations must be 2 or more: GRPO compares each completion with the others "
                       "of its group (one alone has nothing to beat).")
        if not _number(self.rollout_top_p) or not 0 < self.rollout_top_p <= 1:
            out.append(f"rollout_top_p must be in (0, 1], the share of probability mass sampled "
                       f"from; got {self.rollout_top_p!r}. Use 1.0 to keep every token.")
        ac = self.activation_checkpointing
        if not isinstance(ac, (bool, int)) or ac < 0:
            out.append("activation_checkpointing must be True/False or a layer interval N >= 0, "
                       f"got {ac!r}.")
        if not isinstance(self.lora_dropout, (int, float)) or not 0.0 <= self.lora_dropout < 1.0:
            out.append(f"lora_dropout must be in [0, 1), got {self.lora_dropout!r}.")
        for name in ("warmup_steps", "chunked_loss", "tile_tokens", "eval_every", "generation_batch"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                out.append(f"{name} must be an int >= 0, got {value!r}.")
        for name in ("packing", "optimizer_in_backward", "cpu_offload_optimizer",
                     "activation_offloading", "compile", "scale_rewards", "split_pairs"):
            if not isinstance(getattr(self, name), bool):
                out.append(f"{name} must be True or False, got {getattr(self, name)!r}.")
        for name, what in (("max_grad_norm", "a finite number >= 0 (0 = off), e.g. 1.0"),
                           ("weight_decay", "a finite number >= 0, e.g. 0.01"),
                           ("gamma", "a finite number >= 0, e.g. 0.5"),
                           ("beta", "a finite number >= 0, e.g. 0.1"),
                           ("kl", "a finite number >= 0 (0 = no KL term), e.g. 0.04")):
            value = getattr(self, name)
            if (isinstance(value, bool) or not isinstance(value, (int, float))
                    or not math.isfinite(value) or value < 0):
                out.append(f"{name} must be {what}; got {value!r}.")
        targets = self.lora_targets if isinstance(self.lora_targets, tuple) else ()
        unknown = [t for t in targets if t not in LORA_TARGETS]
        if unknown or not targets:
            out.append(f"lora_targets {unknown or '()'} must be a non-empty subset of {LORA_TARGETS}.")
        if not out:  # the combination rules assume each field is valid on its own
            out += [rule.reason for rule in RULES if rule.device is None and rule.broken(self)]
        return out

    def summary(self) -> str:
        """The techniques in words, the panel's summary line, e.g. "QLoRA r16 · bf16 ·
        checkpointing every layer · AdamW 8-bit · 2 × 2048 tokens".

        Returns:
            One line of words.
        """
        method = {"full": "full finetuning", "lora": "LoRA", "qlora": "QLoRA"}[self.method]
        if self.method != "full":
            method += f" r{self.lora_rank}"
        parts = [method, self.dtype]
        every = self.checkpoint_every
        if every:
            parts.append("checkpointing every layer" if every == 1 else f"checkpointing every {every} layers")
        if self.activation_offloading:
            parts.append("activations offloaded")
        if self.chunked_loss > 1:
            parts.append(f"loss in {self.chunked_loss} chunks")
        if self.tile_tokens:
            parts.append(f"tiles of {self.tile_tokens} tokens")
        optimizer = {"adamw": "AdamW", "sgd": "SGD", "adamw8bit": "AdamW 8-bit",
                     "paged_adamw8bit": "paged AdamW 8-bit", "paged_adamw": "paged AdamW",
                     "ao_adamw8bit": "torchao AdamW 8-bit", "ao_adamw4bit": "torchao AdamW 4-bit"}
        parts.append(optimizer[self.optimizer]
                     + (" in backward" if self.optimizer_in_backward else "")
                     + (" on CPU" if self.cpu_offload_optimizer else ""))
        batch = f"{self.batch_size} × {self.seq_len} tokens" + (" packed" if self.packing else "")
        if self.grad_accum > 1:
            batch += f" × {self.grad_accum} accumulated"
        parts.append(batch)
        if self.compile:
            parts.append("compiled")
        if self.objective != "sft":
            parts.insert(0, self.objective.upper())
        return " · ".join(parts)

    def conflicts(self, device: str) -> list["Rule"]:
        """The rules this combination breaks on ``device`` ("cpu" or "cuda").

        Args:
            device: "cpu" or "cuda".

        Returns:
            The broken ``Rule``s, each with its ``reason``.
        """
        return [rule for rule in RULES
                if (rule.device is None or rule.device != device) and rule.broken(self)]

    @property
    def paired(self) -> bool:
        """Whether batches are preference pairs (dpo, ipo, simpo, orpo)."""
        return self.objective in PAIRED

    @property
    def reference_kind(self) -> str:
        """The reference this run uses: "none" (sft and the reference-free objectives),
        "adapters_off", "precomputed", "copy" or "copy_host" (``reference="auto"`` resolved
        by the method)."""
        if self.objective == "grpo":  # its KL term's: completions are new each step
            return "adapters_off" if self.kl and self.method != "full" else "none"
        if self.objective not in ("dpo", "ipo"):
            return "none"
        if self.reference == "auto":
            return "precomputed" if self.method == "full" else "adapters_off"
        return self.reference

    @property
    def checkpoint_every(self) -> int:
        """0 when activation checkpointing is off, else the layer interval."""
        return int(self.activation_checkpointing)

    @property
    def nf4_targets(self) -> tuple[str, ...]:
        """What QLoRA stores as NF4: the adapted projections, and a mixture of experts' experts
        whether adapted or not (they are most of its weights); nothing for other methods."""
        if self.method != "qlora":
            return ()
        return self.lora_targets + (() if "experts" in self.lora_targets else ("experts",))

    @property
    def loss_always_recomputed(self) -> bool:
        """Whether the loss's pieces are recomputed in backward whatever the memory: sequence
        tiling's are (each tile's, by design); a chunked loss's only where the estimate says
        making their gradients in forward raises the peak (``Predictor.keeps_loss_pieces``)."""
        return bool(self.tile_tokens)

    def lr_at(self, step: int) -> float:
        """Learning rate of optimizer step ``step`` (1-based): the schedule is this function.

        Args:
            step: The optimizer step, from 1.

        Returns:
            Its learning rate.
        """
        if self.warmup_steps and step < self.warmup_steps:
            return self.lr * step / self.warmup_steps
        return self.lr

    def replace(self, **changes) -> "Techniques":
        """A copy with ``changes``, checked as a new value is (an unknown name is refused).

        Args:
            **changes: Fields and their new values.

        Returns:
            The new ``Techniques``.

        Raises:
            TypeError: A name is not a field (the nearest one suggested).
            ValueError: The result cannot run, with every reason.
        """
        _refuse_unknown("", changes)
        return dataclasses.replace(self, **changes)

    def changed(self, other: "Techniques") -> set[str]:
        """Names of the fields that differ from ``other``.

        Args:
            other: The techniques to compare with.

        Returns:
            The names of the fields that differ.
        """
        return {f.name for f in fields(self) if getattr(self, f.name) != getattr(other, f.name)}

    def as_dict(self) -> dict:
        """Every field by name (what a run file's ``techniques:`` holds).

        Returns:
            A dict of field name to value.
        """
        return dataclasses.asdict(self)


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _refuse_assignment(self, name, value):
    raise AttributeError(
        f"Techniques is immutable: use session.set({name}=...) to change a live session, "
        f"or techniques.replace({name}=...) for a new value.")


# Replaces the frozen dataclass's FrozenInstanceError with a message that names the fix.
Techniques.__setattr__ = _refuse_assignment


@dataclass(frozen=True)
class Rule:
    """A combination that cannot run, and why (the error message and the panel's tooltip).

    ``device`` set means the rule holds everywhere except on that device type.
    ``fields`` are the controls involved, disabled in the panel while the rule would break.
    """

    broken: Callable[[Techniques], bool]
    reason: str
    fields: tuple[str, ...]
    device: str | None = None


RULES = (
    Rule(lambda t: t.optimizer_in_backward and t.grad_accum > 1,
         "optimizer_in_backward updates each weight as soon as its gradient exists, so gradients "
         "cannot accumulate over micro-batches: set grad_accum=1 or turn optimizer_in_backward off.",
         ("optimizer_in_backward", "grad_accum")),
    Rule(lambda t: t.optimizer_in_backward and t.max_grad_norm > 0,
         "optimizer_in_backward frees each gradient right after its update, so the global gradient "
         "norm is never known: set max_grad_norm=0 or turn optimizer_in_backward off.",
         ("optimizer_in_backward", "max_grad_norm")),
    Rule(lambda t: t.optimizer_in_backward and t.cpu_offload_optimizer,
         "cpu_offload_optimizer steps all weights at once on the CPU, which optimizer_in_backward "
         "cannot do: pick one of them.", ("optimizer_in_backward", "cpu_offload_optimizer")),
    Rule(lambda t: t.cpu_offload_optimizer and t.optimizer not in ("adamw", "sgd"),
         "cpu_offload_optimizer wraps a torch optimizer (adamw or sgd) and keeps its state in CPU "
         "memory, so it cannot also quantize or page it: choose optimizer='adamw'.",
         ("cpu_offload_optimizer", "optimizer")),
    Rule(lambda t: t.cpu_offload_optimizer,
         "cpu_offload_optimizer (torchao's CPUOffloadOptimizer) moves optimizer state off a CUDA "
         "device; on this device the state is already in CPU memory, so it is for CUDA only (keep "
         "cpu_offload_optimizer off here).",
         ("cpu_offload_optimizer",), device="cuda"),
    Rule(lambda t: t.compile,
         "On CPU nbtune measures a step's memory by watching each operator, which makes torch "
         "run the model eagerly, so compile would change nothing here; it is available on CUDA.",
         ("compile",), device="cuda"),
    Rule(lambda t: t.optimizer in PAGED_OPTIMIZERS,
         "Paged optimizers keep their state in CUDA unified memory and page only on CUDA; on this "
         "device use adamw8bit (same 8-bit state, no paging) or adamw.",
         ("optimizer",), device="cuda"),
)

PREFERENCE_RULES = (
    Rule(lambda t: t.objective in PAIRED and t.packing,
         "A preference objective compares the chosen and the rejected completion of one prompt, "
         "each its own row of the batch: turn packing off.", ("objective", "packing")),
    Rule(lambda t: t.objective in ("dpo", "ipo") and t.reference == "adapters_off" and t.method == "full",
         "reference='adapters_off' runs the base with the adapters switched off, but full finetuning "
         "has no adapters: use reference='precomputed' (or 'auto'), or method='lora'.",
         ("reference", "method", "objective")),
    Rule(lambda t: t.objective in PAIRED and t.split_pairs and t.optimizer_in_backward,
         "split_pairs runs two backward passes a batch of pairs, but the optimizer in backward "
         "would step on the first half's gradients: turn one of them off.",
         ("split_pairs", "optimizer_in_backward", "objective")),
    Rule(lambda t: t.objective in PAIRED and t.split_pairs and t.lora_dropout and t.method != "full",
         "split_pairs runs each row twice (once for its weight in the gradient, once for the "
         "gradient), and LoRA dropout would draw another mask each time: set lora_dropout=0, or "
         "split_pairs=False.", ("split_pairs", "lora_dropout", "objective", "method")),
    Rule(lambda t: t.objective in ("dpo", "ipo") and t.reference in ("copy", "copy_host") and t.method != "full",
         "reference='copy' is full finetuning's reference (a frozen copy of every weight); with "
         "LoRA the base with the adapters off is that copy already: use reference='auto', or "
         "'precomputed' after sft steps.", ("reference", "method", "objective")),
    Rule(lambda t: t.objective in ("dpo", "ipo") and t.eval_every and (
            t.reference == "precomputed" or (t.reference == "auto" and t.method == "full")),
         "Held-out pairs are not yet scored against a precomputed reference (only the training "
         "pairs are precomputed): set eval_every=0, or reference='copy' (full finetuning) or "
         "'adapters_off' (LoRA).",
         ("eval_every", "objective", "method")),
    Rule(lambda t: t.objective in PAIRED and not t.beta,
         "beta=0 leaves a preference objective nothing to score (dpo's and simpo's loss would be a "
         "constant, ipo's margin infinite): give beta > 0, e.g. 0.1.", ("beta", "objective")),
    Rule(lambda t: t.objective == "grpo" and t.kl and t.method == "full",
         "GRPO's KL term (kl > 0) needs a reference model: the base with the adapters off, and "
         "full finetuning has none (its completions are new each step, so nothing can be "
         "precomputed): set kl=0 (TRL's default), or method='lora'.", ("kl", "method", "objective")),
    Rule(lambda t: t.objective == "grpo" and t.reference == "precomputed",
         "GRPO's completions are written in each step, so their reference log-probs cannot be "
         "computed before training: use reference='auto' (the base with the adapters off).",
         ("reference", "objective")),
    Rule(lambda t: t.objective == "grpo" and t.packing,
         "GRPO trains on the completions it writes, each its own row of the batch: turn packing off.",
         ("objective", "packing")),
    Rule(lambda t: t.objective == "grpo" and t.tile_tokens,
         "Sequence tiling is not yet made for GRPO's per-token ratios: set tile_tokens=0 "
         "(chunked_loss splits its head instead).", ("objective", "tile_tokens")),
    Rule(lambda t: t.objective == "grpo" and t.eval_every,
         "Held-out evaluation every eval_every steps is not yet made for GRPO: set eval_every=0 "
         "and call session.evaluate() (the held-out prompts' mean reward) between runs.",
         ("eval_every", "objective")),
    Rule(lambda t: t.objective == "grpo" and t.max_completion >= t.seq_len,
         "max_completion must leave room for the prompt within seq_len (each row is the prompt and "
         "its completion): raise seq_len or lower max_completion.",
         ("max_completion", "seq_len", "objective")),
    Rule(lambda t: t.objective in PAIRED and t.tile_tokens,
         "Sequence tiling is not yet made for the preference objectives' per-row scores: set "
         "tile_tokens=0 (chunked_loss splits their head instead).", ("objective", "tile_tokens")),
)
RULES = RULES + PREFERENCE_RULES

# Settings the rules allow but that change nothing on a device: the panel disables their control
# there with this reason (code may still set them: the mechanism runs, and is tested, on CPU).
NO_EFFECT = (
    Rule(lambda t: not t.activation_offloading,
         "Activation offloading moves the activations saved for backward from the GPU to CPU "
         "memory; on this device they are in CPU memory already, so it would save nothing "
         "(available on CUDA).", ("activation_offloading",), device="cuda"),
)


def label_of(changes: dict) -> str:
    """Toggle changes in a few words: ``{"activation_checkpointing": True, "lr": 1e-4}`` ->
    "+activation_checkpointing, lr=0.0001" (what tables and messages call a change)."""
    if not changes:
        return "baseline"
    parts = []
    for name, value in changes.items():
        if value is True:
            parts.append(f"+{name}")
        elif value is False or value == 0:
            parts.append(f"-{name}")
        else:
            parts.append(f"{name}={value}")
    return ", ".join(parts)


def _refuse_unknown(where: str, given: dict) -> None:
    """A misspelt field gets the command line's "did you mean", not Python's bare TypeError."""
    known = [f.name for f in fields(Techniques)]
    unknown = [name for name in given if name not in known]
    if unknown:
        hints = [f"{name!r} (did you mean {close[0]!r}?)" if close else repr(name)
                 for name in unknown for close in [difflib.get_close_matches(name, known, n=1)]]
        raise TypeError(f"{where + ': ' if where else ''}unknown technique {', '.join(hints)}. "
                        f"Known: {', '.join(known)}.")


def as_techniques(value, base: "Techniques | None" = None) -> Techniques:
    """``Techniques`` from a Techniques, a dict of fields (on top of ``base``, default the
    defaults) or None (``base``)."""
    base = base if base is not None else Techniques()
    if value is None:
        return base
    if isinstance(value, Techniques):
        return value
    if isinstance(value, dict):
        return base.replace(**value)
    raise TypeError(f"techniques must be an nt.Techniques (or a dict of its fields), got "
                    f"{type(value).__name__}: write techniques=nt.Techniques(method='lora', ...).")


def _attributes(doc: str | None) -> dict[str, str]:
    """A Google-style docstring's Attributes section: name -> its text on one line. Read
    from the cleaned docstring (Python 3.13 dedents docstrings itself); none under -OO."""
    lines = inspect.cleandoc(doc or "").splitlines()
    start = next((i for i, line in enumerate(lines) if line.strip() == "Attributes:"), len(lines))
    found, name = {}, None
    for line in lines[start + 1:]:
        entry = re.match(r"^ {4}(\w+): (.*)$", line)
        if entry:
            name = entry.group(1)
            found[name] = entry.group(2)
        elif line.startswith(" " * 8) and name:
            found[name] += " " + line.strip()
        elif line.strip():
            break
    return found


# One line per toggle, what it trades: the panel's tooltips, written once in the docstring
# above, which help() and the API reference show.
_FIELD_LINES = _attributes(Techniques.__doc__)
HELP = {f.name: _FIELD_LINES.get(f.name, "") for f in fields(Techniques)}
