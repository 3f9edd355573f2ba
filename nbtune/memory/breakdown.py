"""MemoryBreakdown: where one training step's memory went, in bytes."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

CATEGORIES = ("parameters", "gradients", "optimizer_state", "activations", "other")


@dataclass(frozen=True)
class MemoryBreakdown:
    """Memory of one step by category, in bytes.

    Each category is the most it held at any moment of the step (gradients are counted
    once all exist, activations at the end of forward). ``peak`` is the highest total
    held at one moment, usually below the sum of the categories because gradients
    appear while activations are freed; ``at_peak`` says what made up that moment.
    ``reserved`` (CUDA only) is what the caching allocator held from the device.
    """

    parameters: int = 0
    gradients: int = 0
    optimizer_state: int = 0
    activations: int = 0
    other: int = 0
    peak: int = 0
    reserved: int = 0
    device: str = "cpu"
    at_peak: dict = field(default_factory=dict, compare=False)

    @property
    def categories(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in CATEGORIES}

    @property
    def largest_at_peak(self) -> str:
        """The category holding the most memory at the peak moment."""
        source = self.at_peak or self.categories
        return max(source, key=source.get)

    def as_dict(self) -> dict:
        return asdict(self)
