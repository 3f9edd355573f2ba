"""Where memory goes: the per-step breakdown and the trackers that measure it."""

from .breakdown import CATEGORIES, MemoryBreakdown
from .tracker import track_step

__all__ = ["CATEGORIES", "MemoryBreakdown", "track_step"]
