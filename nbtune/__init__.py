"""nbtune: finetune LLMs cell by cell on one GPU, and see where the memory goes."""
import os as _os

# torchao prints CUDA library load failures on CPU-only machines; they are harmless.
_os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")

from .data import DataError  # noqa: E402
from .memory import MemoryBreakdown  # noqa: E402
from .memory.breakdown import HostMemory  # noqa: E402
from .models import ModelConfig, load_model, save_model  # noqa: E402
from .models.gguf import smollm2_path  # noqa: E402
from .runner import BackgroundRun, BusyError  # noqa: E402
from .session import Session  # noqa: E402
from .ladder import Ladder  # noqa: E402
from .predict import (CARDS, HOST_RAM, FitResult, LongestContext, Predictor, estimate,  # noqa: E402
                      fit, fit_badge, longest_context, parse_budget, parse_machine, relative_cost)
from .oom import OutOfMemory, SimulatedCard  # noqa: E402
from .step import NonFiniteError, StepReport  # noqa: E402
from .trainer import DamagedStateError, HostMemoryError  # noqa: E402
from .techniques import Techniques  # noqa: E402

__version__ = "0.1.0"
__all__ = ["BackgroundRun", "BusyError", "CARDS", "DamagedStateError", "DataError", "FitResult",
           "HOST_RAM", "HostMemory", "HostMemoryError", "Ladder", "LongestContext", "MemoryBreakdown", "ModelConfig",
           "NonFiniteError", "OutOfMemory", "Predictor", "Session", "SimulatedCard", "StepReport", "Techniques",
           "estimate", "fit", "fit_badge", "load_model", "longest_context", "parse_budget", "parse_machine",
           "relative_cost", "save_model", "smollm2_path"]
