"""nbtune: finetune LLMs cell by cell on one GPU, and see where the memory goes.

The names below are imported on first use (PEP 562), so ``nbtune --help`` and a refused
command line answer before torch is imported."""
import importlib as _importlib
import os as _os

# torchao prints CUDA library load failures on CPU-only machines; they are harmless.
_os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")

__version__ = "0.1.0"

# public name -> the module that defines it
_EXPORTS = {
    "Data": "data", "DataError": "data", "MemoryBreakdown": "memory", "HostMemory": "memory.breakdown",
    "ModelConfig": "models", "load_model": "models", "save_model": "models",
    "smollm2_path": "models.gguf", "BackgroundRun": "run.runner", "BusyError": "run.runner",
    "Session": "session", "Ladder": "run.ladder", "OutOfMemory": "oom", "SimulatedCard": "oom",
    "NonFiniteError": "step", "StepReport": "step", "DamagedStateError": "run.trainer",
    "HostMemoryError": "run.trainer", "Techniques": "techniques",
    "RankFailed": "run.processes",
    **{name: "predict" for name in ("CARDS", "HOST_RAM", "FitResult", "LongestContext", "Predictor",
                                    "estimate", "fit", "fit_badge", "longest_context", "parse_budget",
                                    "parse_machine", "relative_cost")},
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:  # a submodule (``nbtune.checkpoint``) reached as an attribute
        try:
            return _importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as err:
            if err.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module 'nbtune' has no attribute {name!r}") from None
    value = getattr(_importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # once: later lookups do not come here
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
