"""Third-party imports that would print harmless noise into a notebook, made quietly.

torchao logs at import that it skips its compiled extensions (nbtune asks it to, as they
fail to load on CPU-only machines), and torch logs that torchao registers an Enum the old
way; bitsandbytes, on a CPU with AVX512-BF16, logs that the optional ``kernels`` package is
missing (it falls back to its own kernel). All are warnings about the libraries, not about
the user's work, and show as red stderr in every notebook that uses NF4, torchao's or
bitsandbytes' optimizers. Only those loggers are raised to ERROR, and only while the import
runs: the user's own warnings are untouched.
"""

from __future__ import annotations

import importlib
import logging
import sys
from types import ModuleType

_NOISY_LOGGERS = ("torchao", "torch.utils._pytree", "bitsandbytes.backends.cpu.ops")


def import_quietly(name: str) -> ModuleType:
    """``importlib.import_module(name)`` for a torchao or bitsandbytes module, without their
    import-time logs."""
    if name in sys.modules:
        return sys.modules[name]
    loggers = [logging.getLogger(n) for n in _NOISY_LOGGERS]
    levels = [log.level for log in loggers]
    for log in loggers:
        log.setLevel(logging.ERROR)
    try:
        return importlib.import_module(name)
    finally:
        for log, level in zip(loggers, levels):
            log.setLevel(level)

