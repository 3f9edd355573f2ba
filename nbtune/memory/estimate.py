"""Estimate a step's memory before loading anything: the real step, run on fake tensors.

The model is built on the meta device, made of fake tensors (``FakeTensorMode``: shapes
and dtypes, no storage), transformed by the same code a session uses (dtype, LoRA, NF4,
checkpointing), and two training steps run through the same ``update`` and the same CPU
tracker that measure a real step. The second step (optimizer state present from the
start) is the estimate. An 8B model "runs" in seconds and a few MiB of real memory.

What fake tensors cannot run, the estimate stands in for:

* bitsandbytes and torchao optimizers read tensor values while building their state
  (lookup tables, compiled steps): a stand-in optimizer allocates the state they would
  hold, tensor for tensor (``quantized_state_layout``, checked against the real ones in
  the tests). Their step's own temporaries are not modelled.
* ``compile`` is estimated eager (compiled code usually needs a little less).

For a CUDA target the step is still traced with CPU kernels (fake CUDA tensors cannot
choose an attention kernel on a CPU-only build): AdamW is the fused one, offloaded
activations and paged optimizer state leave the device. The allocator's cache and
fragmentation and the CUDA context are not predicted: ``peak`` is what tensors hold.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from ..models.config import ModelConfig
from ..models.decoder import CausalLM
from ..techniques import PAGED_OPTIMIZERS, Techniques
from .accounting import optimizer_state_bytes
from .breakdown import MemoryBreakdown

_QUANTIZED_OPTIMIZERS = {"adamw8bit", "paged_adamw8bit", "paged_adamw", "ao_adamw8bit",
                         "ao_adamw4bit"}


def resolve_config(model) -> ModelConfig:
    """A ``ModelConfig`` from a ModelConfig, preset name, config.json, model folder or repo id."""
    from ..hub import resolve_model_folder
    from ..models.presets import PRESETS, preset_config

    if isinstance(model, ModelConfig):
        return model
    if isinstance(model, nn.Module) and isinstance(getattr(model, "config", None), ModelConfig):
        return model.config
    name = str(model)
    if name.lower() in PRESETS:
        return preset_config(name)
    path = Path(name).expanduser()
    if path.is_file():
        from ..models.gguf import config_from_gguf, is_gguf

        return config_from_gguf(path) if is_gguf(path) else ModelConfig.from_file(path)
    try:
        folder = resolve_model_folder(name, files=["config.json"])
    except FileNotFoundError as err:
        raise FileNotFoundError(f"{err} Presets work offline: {', '.join(PRESETS)}.") from None
    return ModelConfig.from_file(folder / "config.json")


# ---- optimizer state of the quantizing optimizers ---------------------------------------

def quantized_state_layout(optimizer: str, param: torch.Tensor) -> list[tuple[int, torch.dtype]]:
    """(numel, dtype) of each state tensor ``optimizer`` keeps for ``param``.

    bitsandbytes keeps 32-bit state below 4096 weights, else uint8 codes with one fp32
    absmax per 256; its two 256-entry lookup tables are shared by all parameters (added
    once by the stand-in). torchao quantizes tensors of at least 4096 weights that split
    into whole blocks (256 for 8-bit, 128 for 4-bit, two codes a byte), each state with
    its own lookup table, else keeps them in the weight's dtype; plus an fp32 step count.
    """
    n = param.numel()
    if optimizer == "paged_adamw":
        return [(n, torch.float32)] * 2
    if optimizer in ("adamw8bit", "paged_adamw8bit"):
        if n < 4096:
            return [(n, torch.float32)] * 2
        return [(n, torch.uint8), (math.ceil(n / 256), torch.float32)] * 2
    block, per_byte, table = (256, 1, 256) if optimizer == "ao_adamw8bit" else (128, 2, 16)
    if n >= 4096 and n % block == 0:
        one = [(n // per_byte, torch.uint8), (n // block, torch.float32), (table, torch.float32)]
    else:
        one = [(n, param.dtype)]
    return [(1, torch.float32)] + one * 2


class _StateStandIn(torch.optim.Optimizer):
    """Holds the state a quantizing optimizer would hold; updates nothing.

    Paged state (CUDA managed memory, outside the allocator) is made on the meta device, so
    the tracker does not count it on the step's device.
    """

    def __init__(self, params, name: str, paged: bool) -> None:
        super().__init__(params, {"lr": 0.0})
        self.name, self.paged = name, paged

    @torch.no_grad()
    def step(self, closure=None):
        device = "meta" if self.paged else None
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None or self.state[p]:
                    continue
                layout = quantized_state_layout(self.name, p)
                self.state[p] = {f"state{i}": torch.empty(n, dtype=dtype, device=device or p.device)
                                 for i, (n, dtype) in enumerate(layout)}
        shared_tables = self.name in ("adamw8bit", "paged_adamw8bit")
        if shared_tables and self.state and not any("tables" in s for s in self.state.values()):
            first = next(iter(self.state))  # bitsandbytes' two 256-entry tables, held once
            self.state[first]["tables"] = torch.empty(512, dtype=torch.float32,
                                                      device=device or first.device)


def _estimate_optimizer(model: nn.Module, t: Techniques, device: str) -> torch.optim.Optimizer:
    from ..optim import OptimizerInBackward, _optimizer_factory, trainable_parameters

    params = trainable_parameters(model)
    if t.cpu_offload_optimizer:  # the state and its step live in CPU memory
        return torch.optim.SGD(params, lr=t.lr)
    if t.optimizer in _QUANTIZED_OPTIMIZERS:
        paged = device == "cuda" and t.optimizer in PAGED_OPTIMIZERS

        def make(ps):
            return _StateStandIn(ps, t.optimizer, paged)
    else:
        make = _optimizer_factory(t)
    return OptimizerInBackward(params, make) if t.optimizer_in_backward else make(params)


def _make_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer's state, as a first training step would, by stepping on zero
    gradients: the estimate then measures a steady step for half the cost of running two."""
    from ..optim import OptimizerInBackward

    inner = optimizer.optimizers if isinstance(optimizer, OptimizerInBackward) else [optimizer]
    for opt in inner:
        params = [p for group in opt.param_groups for p in group["params"]]
        for p in params:
            p.grad = torch.zeros_like(p)
        opt.step()
        opt.zero_grad(set_to_none=True)


# ---- the fake step ------------------------------------------------------------------------

def _fake_batch(config: ModelConfig, t: Techniques, batch_size: int, seq_len: int) -> dict:
    """A full-length batch (the worst case: no padding), shaped as the data pipeline makes it."""
    shape = (batch_size, seq_len)
    batch = {"input_ids": torch.zeros(shape, dtype=torch.long),
             "labels": torch.zeros(shape, dtype=torch.long)}
    if t.packing:
        batch["document_ids"] = torch.zeros(shape, dtype=torch.long)
        batch["positions"] = torch.arange(seq_len).expand(shape).contiguous()
    return batch


def estimate(model, techniques: Techniques | None = None, *, batch_size: int | None = None,
             seq_len: int | None = None, device: str | torch.device = "cpu") -> MemoryBreakdown:
    """Predict one training step's memory without allocating the model.

    ``model``: a preset name (``nbtune.models.presets.PRESETS``), a Hub repo id (only its
    config.json is read), a config.json or model folder path, or a ``ModelConfig``.
    ``techniques`` default to ``Techniques()``; ``batch_size`` and ``seq_len`` override
    theirs. Rows are taken full length (no padding): the worst case of that shape.
    ``device`` is the device the step will run on ("cpu" or "cuda").
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    from ..models.hf import DTYPES
    from ..peft import cast_model
    from ..plan import check, transform_model
    from ..step import evaluate_sum, update
    from .tracker import CpuStepMemory

    config = resolve_config(model)
    t = techniques or Techniques()
    target = torch.device(device).type
    if target not in ("cpu", "cuda"):
        raise ValueError(f"device={device!r}: nbtune estimates for 'cpu' or 'cuda'.")
    real = _fake_batch(config, t, batch_size or t.batch_size, seq_len or t.seq_len)
    micro_batches = [real] * t.grad_accum
    trained = real["labels"].numel() * t.grad_accum

    with torch.device("meta"):
        built = CausalLM(config)
    problems = check(t.replace(seq_len=min(t.seq_len, config.max_position_embeddings)), built, target)
    if problems:  # (an explicit seq_len may go beyond the context: the estimate says what it costs)
        raise ValueError(" ".join(problems))
    cast_model(built, DTYPES[t.dtype])
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        built.to_empty(device="cpu")
        built.tie_weights()  # to_empty gives tied weights separate tensors
        transform_model(built, t, previous=None, cast=False)  # the session's own planner
        optimizer = _estimate_optimizer(built, t, target)
        batches = [{k: mode.from_tensor(v) for k, v in b.items()} for b in micro_batches]
        inputs = [v for b in batches for v in b.values()]
        offload = "meta" if target == "cuda" else None
        _make_state(optimizer)  # as after a first step, without running one
        memory = CpuStepMemory(built, optimizer, *inputs)
        with memory:
            update(built, optimizer, batches, trained, memory, loss_chunks=t.chunked_loss,
                   offload_activations=t.activation_offloading,
                   max_grad_norm=t.max_grad_norm, offload_to=offload)
        result = memory.result()
        eval_peak = 0
        if t.eval_every:  # one held-out batch at a time, beside the optimizer state
            evaluation = CpuStepMemory(built, optimizer, *inputs)
            built.eval()
            with evaluation:
                evaluate_sum(built, batches[:1], evaluation, loss_chunks=t.chunked_loss)
            eval_peak = evaluation.result().peak
    paged = optimizer_state_bytes(optimizer, torch.device("meta"))  # the stand-in parks it there
    return replace(result, device=target, measured=False, outside=paged, eval_peak=eval_peak)
