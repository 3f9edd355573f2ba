"""MemoryBreakdown: where one training step's memory went, in bytes."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

CATEGORIES = ("parameters", "gradients", "optimizer_state", "activations", "other")
PHASES = ("forward", "backward", "optimizer")


@dataclass(frozen=True)
class HostMemory:
    """Host (CPU) memory a configuration needs, predicted by ``estimate``, in bytes.

    Held while it trains (``training``): runtime, step, offloaded, paged, sharded,
    cpu_optimizer, undo and reference_copy; once in a while, on top of that: loading, checkpoint, merged and
    gguf.

    Attributes:
        runtime: The Python process with torch and, on CUDA, its libraries and the Jupyter
            kernel (rough).
        step: On a CPU, the step's own peak (the device is the host).
        offloaded: Activations moved to pinned host memory.
        paged: Paged optimizer state: CUDA managed memory the driver moves to the host when
            the card runs short.
        sharded: FSDP2's CPU offload: every rank's sharded weights, gradients and optimizer
            state.
        cpu_optimizer: CPU optimizer offload: host copies of the trainable weights with their
            gradients and state.
        undo: The undo copy of the trainable weights and optimizer state, where
            ``rollback="auto"`` keeps it.
        reference_copy: A full finetune's frozen reference copy kept in host memory, pinned
            (``reference="copy_host"``).
        loading: Reading the weights, instead of the training part (on ranks each reads its
            rows of one weight at a time).
        checkpoint: ``save_checkpoint`` being written.
        merged: ``save(merge=True)`` or a full save being written.
        gguf: ``save(format="gguf")`` being written (f16).
    """

    runtime: int = 0
    step: int = 0
    offloaded: int = 0
    paged: int = 0
    sharded: int = 0
    cpu_optimizer: int = 0
    undo: int = 0
    reference_copy: int = 0
    loading: int = 0
    checkpoint: int = 0
    merged: int = 0
    gguf: int = 0

    @property
    def training(self) -> int:
        """Held while steps run."""
        return (self.runtime + self.step + self.offloaded + self.paged + self.sharded
                + self.cpu_optimizer + self.undo + self.reference_copy)

    @property
    def peak(self) -> int:
        """The most the run holds: loading (FSDP2's CPU offload makes the ranks' shards in
        host memory first), or training with a checkpoint being saved."""
        return max(self.runtime + self.sharded + self.loading, self.training + self.checkpoint)

    @property
    def without_undo(self) -> int:
        """``peak`` when no undo copy is kept (what "auto" falls back to on a small host)."""
        return max(self.runtime + self.sharded + self.loading,
                   self.training - self.undo + self.checkpoint)

    @property
    def export(self) -> int:
        """The most held while saving the merged weights or a GGUF file after training."""
        return self.training + max(self.merged, self.gguf)


@dataclass(frozen=True)
class MemoryBreakdown:
    """Memory of one step by category, in bytes.

    Each category is the most it held at any moment of the step (gradients once all exist,
    activations at the end of forward), usually summing to more than ``peak`` because
    gradients appear while activations are freed. ``highest`` is what must fit.

    Attributes:
        parameters: Weights and buffers: ``trainable`` + ``frozen`` + ``quantized``.
        gradients: The gradients, at their most.
        optimizer_state: The optimizer's state (moments, 8-bit blocks), at its most.
        activations: What forward saved for backward, at its most.
        other: Temporaries and recomputation, at their most.
        peak: The highest total held at one moment of the step.
        reserved: On CUDA, the most the caching allocator held from the device
            (``reserved - peak`` is its cache and fragmentation).
        outside: On CUDA, device memory in use outside the allocator (the CUDA context, paged
            optimizer state in managed memory, other processes).
        trainable: The weights being trained.
        frozen: Dense weights and buffers not trained.
        quantized: NF4 codes and scales.
        device: "cpu" or "cuda".
        measured: False where carried over from the last measured step (sampled tracking) or
            predicted (``estimate``).
        eval_peak: The peak of the held-out evaluation after the step when ``eval_every`` is
            set (the last one measured), else 0.
        generation_peak: GRPO's: the peak while the completions are written (the weights,
            the optimizer state and the KV cache of ``generation_batch`` sequences), else 0.
        loading: The most the device holds while the weights are read (``estimate`` predicts
            it; 0 where measured: a step does not load).
        at_peak: What made up the peak moment, by category.
        phases: The peak of forward, backward and the optimizer step, and the category that
            held most of each (phase -> {"peak", "largest"}).
        host: The host memory the configuration needs beside it (``HostMemory``), where
            predicted, else None.
    """

    parameters: int = 0
    gradients: int = 0
    optimizer_state: int = 0
    activations: int = 0
    other: int = 0
    peak: int = 0
    reserved: int = 0
    outside: int = 0
    trainable: int = 0
    frozen: int = 0
    quantized: int = 0
    device: str = "cpu"
    measured: bool = True
    eval_peak: int = 0
    generation_peak: int = 0
    loading: int = 0
    at_peak: dict = field(default_factory=dict, compare=False)
    phases: dict = field(default_factory=dict, compare=False)  # phase -> {"peak", "largest"}
    host: HostMemory | None = field(default=None, compare=False)

    @property
    def categories(self) -> dict[str, int]:
        """The five categories by name: parameters, gradients, optimizer state, activations,
        other."""
        return {name: getattr(self, name) for name in CATEGORIES}

    @property
    def highest(self) -> int:
        """The most held at one moment: training step, held-out evaluation, GRPO's generation
        or, where predicted, loading the weights."""
        return max(self.peak, self.eval_peak, self.generation_peak, self.loading)

    @property
    def highest_phase(self) -> str:
        """Which moment holds ``highest``: "update", "evaluation", "generation" or "loading"."""
        moments = {"update": self.peak, "evaluation": self.eval_peak,
                   "generation": self.generation_peak, "loading": self.loading}
        return max(moments, key=moments.get)

    @property
    def largest_at_peak(self) -> str:
        """The category holding the most memory at the peak moment."""
        source = self.at_peak or self.categories
        return max(source, key=source.get)

    @property
    def peak_phase(self) -> str | None:
        """The phase (forward, backward, optimizer) in which the step's peak fell."""
        if not self.phases:
            return None
        return max(self.phases, key=lambda name: self.phases[name]["peak"])

    @property
    def cached(self) -> int:
        """CUDA: reserved by the allocator but not holding tensors at the peak."""
        return max(0, self.reserved - self.peak) if self.reserved else 0

    def __repr__(self) -> str:
        """One line, what a person reads first (``as_dict()`` has every field)."""
        from ..units import format_bytes

        parts = ", ".join(f"{name.replace('_', ' ')} {format_bytes(value)}"
                          for name, value in self.categories.items() if value)
        how = "measured" if self.measured else "carried or predicted"
        if self.generation_peak:
            how += f"; generation peak {format_bytes(self.generation_peak)}"
        return f"MemoryBreakdown(peak {format_bytes(self.peak)} on {self.device}: {parts}; {how})"

    def carried(self) -> "MemoryBreakdown":
        """This breakdown marked as not measured on the step it is reported for.

        Returns:
            A copy with ``measured=False``.
        """
        return replace(self, measured=False)

    def as_dict(self) -> dict:
        """Every field by name (``host`` as a dict too), for JSON.

        Returns:
            The dict.
        """
        return asdict(self)


def phase_summary(snapshots: dict[str, dict[str, int]]) -> dict[str, dict]:
    """{phase: categories at its peak} -> {phase: {"peak": bytes, "largest": category}}."""
    out = {}
    for phase in PHASES:
        snap = snapshots.get(phase)
        if snap:
            out[phase] = {"peak": sum(snap.values()), "largest": max(snap, key=snap.get)}
    return out
