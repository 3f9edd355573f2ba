"""What every weight reader shares (HF folders, GGUF files): dtype names, the empty model on
the meta device, which weights QLoRA stores as NF4, and the model filled from what was read."""

from __future__ import annotations

import ctypes
import os
from typing import Collection

import torch
from torch import nn

from ..peft import target_of
from .config import ModelConfig
from .decoder import CausalLM

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
          "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


ALLOW_NONFINITE = "NBTUNE_ALLOW_NONFINITE"  # set to 1 to load NaN/inf weights (debugging)
CHECK_BYTES = 64  # host bytes check_finite allocates: two scalars and their flags, rounded up


def check_finite(key: str, tensor: torch.Tensor, source, error: type = ValueError) -> None:
    """Refuse a weight holding NaN or infinity, naming it and its file: trained on, it would
    surface steps later as a NaN loss that looks like a bad learning rate. One min/max
    reduction (NaN propagates into both): no mask the size of the weight, so loading keeps
    its one-tensor-at-a-time memory."""
    if os.environ.get(ALLOW_NONFINITE) == "1" or not tensor.is_floating_point() or not tensor.numel():
        return
    low, high = torch.aminmax(tensor)
    if not (torch.isfinite(low) and torch.isfinite(high)):
        raise error(f"{key} in {source} holds NaN or infinite values: the file is damaged (or "
                    "was saved from a diverged run). Download or save it again; to load it "
                    f"anyway for debugging, set {ALLOW_NONFINITE}=1.")


def release_freed_heap() -> None:
    """Hand the freed pages in the middle of the C heap back to the system (glibc only).

    glibc keeps freed heap memory mapped unless it lies at the top of the heap. A quantized
    weight's dense copy and torchao's temporaries are freed below the NF4 parts that stay,
    so without this the process kept up to the dense size of every weight read (peak 0.70
    to 1.07 of the bf16 bytes measured, with 0.46 held; 0.61 with this).
    """
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass  # another C library: nothing to do


def quantized_keys(model: CausalLM, names: Collection[str]) -> set[str]:
    """State-dict keys of the decoder-layer Linear weights ``names`` target (``peft.target_of``:
    their last name part, or "experts" for every projection of the experts).

    Embeddings, norms and the head are never quantized (QLoRA keeps them in the model dtype).
    """
    keys = {f"{name}.weight" for name, module in model.named_modules()
            if isinstance(module, nn.Linear) and name.startswith("model.layers.")
            and target_of(name) in names}
    if not keys:
        raise ValueError(f"quantize={tuple(names)} names no Linear layer of the decoder layers; "
                         "use projection names such as q_proj, v_proj or down_proj.")
    return keys


def torch_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """``dtype`` as a torch dtype: a name in ``DTYPES``, or a floating torch.dtype of 16+ bits."""
    names = ", ".join(repr(name) for name in DTYPES)
    if isinstance(dtype, str) and dtype in DTYPES:
        return DTYPES[dtype]
    if isinstance(dtype, torch.dtype) and dtype.is_floating_point and dtype.itemsize >= 2:
        return dtype  # float64 too (numerical checks); float8 kinds cannot hold trained weights
    raise ValueError(f"dtype={dtype!r} is not one nbtune loads weights in. Pass one of {names} "
                     "(or a torch dtype such as torch.bfloat16).")


def empty_model(config: ModelConfig, quantize: Collection[str]):
    """(model on the meta device, keys to store as NF4, the state-dict entries to fill).

    No random weights are ever made; a tied head is not expected from the file."""
    with torch.device("meta"):
        model = CausalLM(config)
    quantized = quantized_keys(model, quantize) if quantize else set()
    expected = dict(model.state_dict())
    if config.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    return model, quantized, expected


def fill_model(model: CausalLM, loaded: dict, quantized: set, expected: dict, where: str,
               error: type[ValueError] = ValueError) -> CausalLM:
    """Assign the read tensors (all of ``expected``, else ``error`` naming ``where``), freeze
    the NF4 ones and tie the head."""
    missing = sorted(set(expected) - set(loaded))
    if missing:
        raise error(f"{where} lacks weights for {missing[:4]}{' ...' if len(missing) > 4 else ''}: "
                         "it does not describe a whole model of this shape.")
    model.load_state_dict(loaded, assign=True, strict=False)
    for key in quantized:
        model.get_parameter(key).requires_grad_(False)  # NF4 weights are frozen by nature
    model.tie_weights()
    return model
