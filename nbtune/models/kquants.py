"""The K-quants people run through Ollama and llama.cpp (q4_k_m, q5_k_m, q6_k), made by
llama.cpp's own quantizer: the ``gguf`` package quantizes the simpler block types only.

llama.cpp's quantizer comes with ``llama-cpp-python`` (the optional extra
``pip install "nbtune[kquants]"``: pip builds it from its source package, a C++ compiler is
all it needs). An export to a K-quant writes the f16 file first (``write_gguf``) and has
llama.cpp quantize it, choosing per tensor as llama-quantize does ("_m": some tensors a type
up; rows not a multiple of 256 wide fall back to a block type).
"""

from __future__ import annotations

import os
from pathlib import Path

# The K-quants nbtune exports, as llama.cpp's file types (``llama_ftype`` in llama.h).
K_QUANTS = {"q4_k_m": "LLAMA_FTYPE_MOSTLY_Q4_K_M", "q5_k_m": "LLAMA_FTYPE_MOSTLY_Q5_K_M",
            "q6_k": "LLAMA_FTYPE_MOSTLY_Q6_K"}
EXTRA = 'pip install "nbtune[kquants]"'
# pip builds llama-cpp-python from source: 13 min on 2 cores (measured by issue 56's filer);
# its project publishes prebuilt wheels, which pip takes instead from this index
PREBUILT = ("pip install --prefer-binary llama-cpp-python "
            "--extra-index-url https://abetlen.github.io/llama-cpp-python/whl/cpu")


def llama_cpp():
    """llama-cpp-python's low-level module, or an ImportError that says how to install it."""
    try:
        import llama_cpp as module
    except ImportError as err:
        raise ImportError(f"The K-quants ({', '.join(K_QUANTS)}) are made by llama.cpp's own "
                          f"quantizer, which comes with llama-cpp-python: {EXTRA} (pip builds "
                          "it from source with a C++ compiler: about 13 min on 2 cores; a "
                          f"prebuilt wheel instead: {PREBUILT}), or export f16, q8_0, q5_1, "
                          "q5_0, q4_1 or q4_0, which need nothing more.") from err
    return module


def quantize(source: str | os.PathLike, target: str | os.PathLike, kind: str,
             threads: int | None = None) -> Path:
    """llama.cpp quantizes the GGUF ``source`` (f16 or f32) to ``target`` as ``kind``."""
    import ctypes
    import logging

    lib = llama_cpp()
    params = lib.llama_model_quantize_default_params()
    params.ftype = getattr(lib, K_QUANTS[kind])
    params.nthread = threads or os.cpu_count() or 1
    # llama-cpp-python passes llama.cpp's log through this logger: a line per tensor, and a
    # warning per fallback, which would fill a notebook cell (its level table predates
    # ggml's current one, so only the highest level silences the warnings). A failure is
    # still reported, below.
    log = logging.getLogger("llama-cpp-python")
    level = log.level
    log.setLevel(logging.CRITICAL + 1)
    try:
        code = lib.llama_model_quantize(str(source).encode(), str(target).encode(),
                                        ctypes.byref(params))
    finally:
        log.setLevel(level)
    if code != 0:
        raise RuntimeError(f"llama.cpp could not quantize {source} to {kind} (code {code}).")
    return Path(target)
