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
activations and paged optimizer state leave the device, and the cuBLAS workspaces torch keeps
in its allocator are added as other (``budgets.cublas_workspaces``). The allocator's cache
and fragmentation and the CUDA context are not predicted: ``peak`` is what tensors hold.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn

# torch internal: the estimator's fake tensors (documented in torch's fake tensor notes, but
# under torch._subclasses). If it changes, every estimate fails (tests/predict/test_estimate.py).
from torch._subclasses.fake_tensor import FakeTensorMode

from ..distributed import Parallel, Sharding, check_sharding, shard_model
from ..hub import resolve_model_folder
from ..memory.accounting import optimizer_state_bytes
from ..memory.breakdown import HostMemory, MemoryBreakdown
from ..memory.tracker import CpuStepMemory, Segment, breakdown_of, weights_of
from ..models.config import ModelConfig
from ..models.hf import PART_BYTES
from ..generate import sample_rows
from ..models.decoder import CausalLM
from ..models import gguf as _gguf_writer
from ..models.filling import CHECK_BYTES, DTYPES
from ..models.hf import CAST_CHUNK_BYTES
from ..models.presets import PRESETS, preset_config
from ..objectives.reference import COPIES, FrozenCopy
from ..optim import OptimizerInBackward, optimizer_factory, trainable_parameters
from ..peft import cast_model
from ..plan import check, transform_model
from ..state import full_weights
from ..step import NO_CONTEXT, StepContext, StepOptions, evaluate_sum, update
from ..techniques import PAGED_OPTIMIZERS, Techniques, as_techniques
from ..undo import UNDO_AUTO_BYTES
from .budgets import cublas_workspaces
from .carry import BASE, TraceCache, carried_tiles, lines
from .ranks import Ranks, fake_group, offload

_QUANTIZED_OPTIMIZERS = {"adamw8bit", "paged_adamw8bit", "paged_adamw", "ao_adamw8bit",
                         "ao_adamw4bit"}


def resolve_config(model) -> ModelConfig:
    """A ``ModelConfig`` from a ModelConfig, preset name, config.json, model folder or repo id."""
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
        shared_tables = self.name in ("adamw8bit", "paged_adamw8bit") and any(
            t.dtype == torch.uint8 for s in self.state.values() for t in s.values())
        if shared_tables and not any("tables" in s for s in self.state.values()):
            # bitsandbytes' two 256-entry tables, held once per optimizer with 8-bit state
            first = next(iter(self.state))
            self.state[first]["tables"] = torch.empty(512, dtype=torch.float32,
                                                      device=device or first.device)


def _estimate_optimizer(model: nn.Module, t: Techniques, device: str) -> torch.optim.Optimizer:
    params = trainable_parameters(model)
    if t.cpu_offload_optimizer:  # the state and its step live in CPU memory
        return torch.optim.SGD(params, lr=t.lr)
    if t.optimizer in _QUANTIZED_OPTIMIZERS:
        paged = device == "cuda" and t.optimizer in PAGED_OPTIMIZERS

        def make(ps):
            return _StateStandIn(ps, t.optimizer, paged)
    else:
        make = optimizer_factory(t)
    return OptimizerInBackward(params, make) if t.optimizer_in_backward else make(params)


def _make_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer's state, as a first training step would, by stepping on zero
    gradients: the estimate then measures a steady step for half the cost of running two."""
    inner = optimizer.optimizers if isinstance(optimizer, OptimizerInBackward) else [optimizer]
    for opt in inner:
        params = [p for group in opt.param_groups for p in group["params"]]
        for p in params:
            p.grad = torch.zeros_like(p)
        opt.step()
        opt.zero_grad(set_to_none=True)


# ---- the fake step ------------------------------------------------------------------------

def _fake_batch(config: ModelConfig, t: Techniques, batch_size: int, seq_len: int) -> dict:
    """A full-length batch (the worst case: no padding), shaped as the data pipeline makes it
    (a preference objective's ``batch_size`` pairs: twice the rows; GRPO's ``batch_size``
    prompts: ``generations`` completions each, with their advantages)."""
    rows = 2 if t.paired else t.generations if t.objective == "grpo" else 1
    shape = (batch_size * rows, seq_len)
    batch = {"input_ids": torch.zeros(shape, dtype=torch.long),
             "labels": torch.zeros(shape, dtype=torch.long)}
    if t.packing:
        batch["document_ids"] = torch.zeros(shape, dtype=torch.long)
        batch["positions"] = torch.arange(seq_len).expand(shape).contiguous()
    if t.reference_kind == "precomputed":  # each row's reference log-prob, from the host
        batch["reference_logps"] = torch.zeros(shape[0])
    if t.objective == "grpo":
        batch["advantages"] = torch.zeros(shape[0])
    return batch


def _fake_generation(built: CausalLM, t: Techniques, seq_len: int, target: str, last: bool) -> None:
    """GRPO's writing at its fullest, as ``objectives.grpo.generate_group`` runs it: the
    longest prompt room allows read once (``last=False``), or the last token's forward
    (``last=True``), its KV cache of ``generation_batch`` sequences holding every token but
    that one (the tokens between only grow the cache). Each moment is made here whole, so
    that each is tracked alone: which of them holds more changes with the depth, and each is
    affine in it. The sampling runs on the host: on CUDA only the float copy of the logits
    made before they go there is the device's."""
    prompt = seq_len + 1 - t.max_completion
    rows = min(t.generation_batch or t.generations, t.generations)

    def sample(logits):
        return (sample_rows(logits, t.rollout_temperature, t.rollout_top_p, [None] * rows) if target == "cpu"
                else logits.float()[:, 0])

    int8 = t.kv_cache == "int8"
    cache = built.new_cache(int8=int8)
    if not last:
        hidden = built.hidden_states(torch.zeros(1, prompt, dtype=torch.long), cache=cache)
        logits = built.lm_head(hidden[:, -1]).expand(rows, -1)
        del hidden
        cache.expand(rows)
        sample(logits)
        return
    grown = prompt + t.max_completion - 2  # what the cache holds before the last forward
    shape = (rows, built.config.num_kv_heads, grown, built.config.head_dim)
    dtype = built.model.embed_tokens.weight.dtype
    for i, window in enumerate(cache.windows):
        kept = grown if window is None else min(grown, window - 1)
        cache.keys[i] = torch.zeros(*shape[:2], kept, shape[3], dtype=torch.int8 if int8 else dtype)
        cache.values[i] = torch.zeros(*shape[:2], kept, shape[3], dtype=torch.int8 if int8 else dtype)
        if int8:  # (``Int8KVCache``: a float32 scale a token and head)
            cache.key_scales[i] = torch.zeros(*shape[:2], kept, 1)
            cache.value_scales[i] = torch.zeros(*shape[:2], kept, 1)
    cache.length = grown
    tokens = sample(built.lm_head(torch.zeros(rows, built.config.hidden_size, dtype=dtype)))
    logits = built.lm_head(built.hidden_states(torch.zeros(rows, 1, dtype=torch.long), cache=cache)[:, -1])
    del tokens
    sample(logits)


def estimate(model, techniques: Techniques | None = None, *, batch_size: int | None = None,
             seq_len: int | None = None, device: str | torch.device = "cpu",
             extrapolate: bool = True, traces: TraceCache | None = None, ranks: int = 1,
             sharding: Sharding | dict | None = None, machines: int = 1,
             recompute_loss: bool = True, routing: str = "balanced") -> MemoryBreakdown:
    """Predict one training step's memory without allocating the model.

    A deep model's step is extrapolated from two shallow ones (``layer_period``), and a step of
    many tiles from two of a few (``carry``): equal to the byte to running all of its layers and
    tiles, which ``extrapolate=False`` does. Rows are taken full length (no padding): the worst
    case of that shape. Under FSDP2 the step of each rank is predicted by running the real
    sharding over a fake process group (``ranks.py``).

    Args:
        model: A preset name (``nbtune.models.presets.PRESETS``), a Hub repo id (only its
            config.json is read), a config.json or model folder path, or a ``ModelConfig``.
        techniques: The toggles (default ``Techniques()``).
        batch_size: Overrides the techniques' (under FSDP2, the global batch).
        seq_len: Overrides the techniques'.
        device: The device the step will run on, "cpu" or "cuda".
        extrapolate: Carry a deep or long step from shallow and short ones (False runs all).
        traces: Keeps the few-tile runs for the next length (a ``Predictor``'s).
        ranks: Processes under FSDP2: the step of each is predicted.
        sharding: FSDP2's settings, as a run file's ``distributed:`` section.
        machines: Machines the ranks span: the host memory is one machine's (``ranks /
            machines`` ranks, and on rank 0's a save being written).
        recompute_loss: False: a chunked loss's pieces make their gradients in forward instead
            of being recomputed in backward (what ``Predictor.keeps_loss_pieces`` weighs).
        routing: A mixture-of-experts model's routing, which only the data decides: "balanced"
            (each expert an equal share of the tokens) or "worst" (every token of the batch to
            the same experts: the largest expert temporaries).

    Returns:
        The step's ``MemoryBreakdown`` (``.peak``, ``.loading``, ``.highest``; ``.host``).
    """
    config = resolve_config(model)
    t = as_techniques(techniques)  # a dict of fields too, as Session takes
    target = torch.device(device).type
    if target not in ("cpu", "cuda"):
        raise ValueError(f"device={device!r}: nbtune estimates for 'cpu' or 'cuda'.")
    shape = (batch_size or t.batch_size, seq_len or t.seq_len)
    if routing not in ROUTINGS:
        raise ValueError(f"routing={routing!r}: pass one of {', '.join(map(repr, ROUTINGS))}.")
    spread = Ranks.of(ranks, sharding, machines)
    with torch.device("meta"):
        built = CausalLM(config.with_layers(min(config.num_layers, 1)))
    problems = check(t.replace(seq_len=min(t.seq_len, config.max_position_embeddings)), built, target)
    if spread is not None:
        problems += check_sharding(spread.sharding, built, t, target, spread.world)
        if shape[0] % spread.world:
            problems.append(f"batch_size={shape[0]} does not split over {spread.world} ranks: "
                            "batch_size is the global batch, so make it a multiple of ranks.")
    if t.objective == "grpo" and shape[1] <= t.max_completion:
        problems.append(f"seq_len={shape[1]} leaves no room for a prompt beside max_completion="
                        f"{t.max_completion} (each row is a prompt and its completion): estimate a "
                        "longer seq_len or a lower max_completion.")
    if problems:  # (an explicit seq_len may go beyond the context: the estimate says what it costs)
        raise ValueError(" ".join(problems))
    period = layer_period(config, t, spread is not None) if extrapolate else None
    tiles = carried_tiles(config, t, shape[1]) if extrapolate else None
    step = None
    if period is not None:
        shallow, deeper, front, back = shallow_units(t, spread is not None)
        step = _extrapolated(*(_traced(config.with_layers(units * period), t, target,
                                       shape, True, tiles, traces, spread, recompute_loss, routing)
                               for units in (shallow, deeper)),
                             shallow * period, deeper * period, config.num_layers, period,
                             (front, back))
    if step is None:
        step = _traced(config, t, target, shape, False, tiles, traces, spread, recompute_loss, routing)
    offloaded = {}
    if spread is not None and spread.sharding.cpu_offload:
        step, offloaded = _offloaded(step)
    result = breakdown_of(step.segments.items(), step.state, step.weights)
    result = replace(result, device=target, measured=False, outside=step.paged,
                     eval_peak=step.eval_peak, generation_peak=max(step.generation_peaks))
    result = replace(result, loading=loading_peak(config, t, target, result.parameters, spread))
    if target == "cuda":
        result = held_throughout(result, cublas_workspaces())
    host = host_memory(config, t, target, result, step, spread)
    if offloaded:  # the shards of every rank on the machine
        host = replace(host, sharded=sum(offloaded.values()) * spread.per_machine)
    return replace(result, host=host)


def _offloaded(step: "_FakeStep") -> tuple["_FakeStep", dict]:
    """``step`` with FSDP2's CPU offload: the sharded weights, gradients and optimizer state
    (and its step) off the device (``ranks.offload``), and what they held."""
    segments, held = offload(step.segments)
    return replace(step, segments=segments, state=0,
                   weights=dict.fromkeys(step.weights, 0)), held


def held_throughout(result: MemoryBreakdown, nbytes: int) -> MemoryBreakdown:
    """``result`` with ``nbytes`` more held at every moment of the step and of its held-out
    evaluation (the cuBLAS workspaces: made by the first step, kept for the process), filed
    as other."""
    phases = {name: {**phase, "peak": phase["peak"] + nbytes} for name, phase in result.phases.items()}
    at_peak = {**result.at_peak, "other": result.at_peak.get("other", 0) + nbytes}
    return replace(result, other=result.other + nbytes, peak=result.peak + nbytes,
                   eval_peak=result.eval_peak + nbytes if result.eval_peak else 0,
                   generation_peak=result.generation_peak + nbytes if result.generation_peak else 0,
                   at_peak=at_peak, phases=phases)


# The process itself: Python, torch and (CUDA) its kernel libraries mapped in, the CUDA
# context's host side and a Jupyter kernel. Rough: not measured on a CUDA machine yet.
HOST_RUNTIME = {"cuda": 3 << 30, "cpu": 1 << 30}
_BYTES = {"fp32": 4, "bf16": 2}


def host_memory(config: ModelConfig, t: Techniques, target: str, step: MemoryBreakdown,
                fake: "_FakeStep", spread: Ranks | None = None) -> HostMemory:
    """What the run of ``t`` holds on the host beside ``step`` (the device's side), by what
    nbtune's code does: see ``HostMemory``. The undo copy counts where "auto" keeps it on
    every step (CUDA: at most 256 MiB, or the optimizer in backward). Over ``spread``'s
    ranks, each is a process of its own holding its share (no undo copy under torchrun), and
    the figures are for one machine (``spread.per_machine`` ranks): rank 0's, since a save
    is written by rank 0, a unit at a time (``shards.Gathered``)."""
    cuda = target == "cuda"
    dtype = _BYTES[t.dtype]
    dense = config.num_parameters * dtype  # every weight in the model's dtype
    largest = config.hidden_size * max(config.vocab_size, config.intermediate_size,
                                       config.num_heads * config.head_dim) * dtype  # one weight
    if spread is not None:
        one = host_memory(config, t, target, step, fake)
        world = spread.per_machine
        # rank 0 makes each weight on its device while its unit is gathered, and writes it a
        # file part (or a tensor) at a time, as one process on a GPU does; on a CPU each weight
        # made is a copy out of the gathered unit, and a merge's temporaries are on the host
        merging = 0 if cuda else _merging(config, t)
        return replace(one, runtime=one.runtime * world, step=one.step * world,
                       offloaded=one.offloaded * world, paged=one.paged * world,
                       cpu_optimizer=one.cpu_optimizer * world, undo=0,
                       # each rank reads its rows of a weight at a time (``shards``)
                       loading=world * (_rows_in_flight(config, t, spread.world) + CAST_CHUNK_BYTES
                                        + CHECK_BYTES),
                       checkpoint=one.checkpoint * world,
                       merged=_part(dense, largest) + merging,
                       gguf=_gguf_writing(largest, dtype) + (0 if cuda else largest) + merging)
    trainable, state = step.trainable, step.optimizer_state
    copy = trainable + state
    undo = copy if cuda and (t.optimizer_in_backward or copy <= UNDO_AUTO_BYTES) else 0
    offloaded = max((s.offloaded for s in fake.segments.values()), default=0)
    cpu_optimizer = 0
    if t.cpu_offload_optimizer:  # torchao: pinned host copies and gradients, state beside them
        cpu_optimizer = trainable * (4 if t.optimizer == "adamw" else 2)
    full = t.method == "full"
    weights_file = step.parameters if full else trainable
    return HostMemory(
        runtime=HOST_RUNTIME[target],
        step=0 if cuda else step.highest,
        offloaded=offloaded if cuda else 0,
        paged=step.outside if cuda else 0,
        cpu_optimizer=cpu_optimizer,
        undo=undo,
        reference_copy=_pinned_copy(config, t) if cuda and t.reference_kind == "copy_host" else 0,
        # one tensor at a time, in the training dtype (plus the cast's 16 MiB chunk and the
        # finiteness check's scalars); on a CPU the loaded weights stay (they are the step's
        # parameters, counted in ``step``)
        loading=largest + CAST_CHUNK_BYTES + CHECK_BYTES,
        # safetensors moves a file's CUDA tensors to the host together: the largest file
        # (a checkpoint is written in files of at most PART_BYTES, or one larger tensor)
        checkpoint=max(_part(weights_file, largest), _part(state - step.outside, largest * 2))
        if cuda else 0,
        # written a file of at most PART_BYTES (or one larger tensor) at a time: on CUDA each
        # of its weights is moved to the host (``models.hf.write_weights``); on a CPU only the
        # adapted projections are new tensors (base + adapter folded in)
        merged=_part(dense, largest) if cuda
        else (0 if full else min(_adapted_weights(config, t) * dtype, _part(dense, largest))
              + _merging(config, t)),
        # a tensor at a time (``models.gguf.write_gguf``): the largest converted to f16 (the
        # writer takes it whole), a float32 chunk of its rows and that chunk's transient; on a
        # CPU a LoRA run's merged projection is a new tensor too (``_merging``)
        gguf=_gguf_writing(largest, dtype) + (0 if cuda or full else _merging(config, t)),
    )


def _pinned_copy(config: ModelConfig, t: Techniques) -> int:
    """Host bytes of a pinned copy of every weight (``reference="copy_host"``): torch's caching
    host allocator gives each pinned tensor a block of the next power of two bytes."""
    with torch.device("meta"):
        built = CausalLM(config)
    return sum(1 << max(0, (v.numel() * _BYTES[t.dtype] - 1).bit_length())
               for v in full_weights(built).values())


def _gguf_writing(largest: int, dtype: int) -> int:
    """Host bytes ``write_gguf`` holds: the largest weight converted to f16 (the writer takes
    it whole), a float32 chunk of its rows and that chunk's transient."""
    return largest // dtype * 2 + 2 * _gguf_writer.CONVERT_CHUNK_BYTES


def _part(nbytes: int, largest: int) -> int:
    """The largest file ``checkpoint.parts`` cuts ``nbytes`` into, whose largest tensor holds
    at most ``largest``."""
    return min(nbytes, max(PART_BYTES, largest))


def loading_peak(config: ModelConfig, t: Techniques, target: str, parameters: int,
                 spread: Ranks | None = None) -> int:
    """The most the device holds while the weights are read: the weights as they end up
    (``parameters``: one process's, or a rank's share) plus the one weight in flight.

    One process (``models.load_model``) reads each weight straight into its place: only a
    QLoRA projection is in flight, dense while torchao quantizes it (``_quantizing``), then
    its NF4 takes its place. A rank (``shards.build_sharded``) has its shards made first and
    reads each weight's rows beside them before copying them in; a projection becoming NF4
    also needs the whole weight's block scales (1/64 of it) and makes a second NF4 shard
    that replaces the first; the LoRA pairs are drawn whole. With FSDP2's CPU offload on a
    GPU the shards are made in host memory: the device holds nothing while loading. (On a
    CPU, a checkpoint stored in another dtype than the training one is cast through a 16 MiB
    chunk: not counted.)"""
    if spread is not None and spread.sharding.cpu_offload and target == "cuda":
        return 0
    world, dtype = (spread.world if spread is not None else 1), _BYTES[t.dtype]
    quantized = set(t.nf4_targets)
    flight = 0
    for name, (rows, cols) in _weight_shapes(config).items():
        n = -(-rows // world) * cols  # this rank's rows
        if name in quantized:
            made = n * 33 // 64  # NF4: codes, int8 scales and their factors (~4.1 bits a value)
            need = n * dtype + _quantizing(n, dtype) + (rows * cols // 64 * dtype + made
                                                         if spread is not None else -made)
        else:
            need = n * dtype if spread is not None else 0
        flight = max(flight, need)
    if spread is not None and t.method in ("lora", "qlora"):
        adapted = [rows + cols for name, (rows, cols) in _weight_shapes(config).items()
                   if name in t.lora_targets]
        flight = max([flight] + [t.lora_rank * size * dtype for size in adapted])
    reader = CHECK_BYTES if target == "cpu" else 0  # the finiteness check's scalars
    # a rank's show of hands after each weight (``shards.agreed``): a flag and its sum
    return parameters + flight + reader + (CHECK_BYTES if spread is not None else 0)


def _rows_in_flight(config: ModelConfig, t: Techniques, world: int) -> int:
    """The most bytes of one weight a rank reads at once: its rows of the largest."""
    return max(-(-rows // world) * cols for rows, cols in _weight_shapes(config).values()) * _BYTES[t.dtype]


ROUTINGS = ("balanced", "worst")  # a mixture of experts' routing, as the estimate assumes it

# torchao compares this many values with the 16 NF4 levels at once (its CHUNK_SIZE)
_NF4_CHUNK = 1 << 20


def _quantizing(n: int, dtype: int) -> int:
    """torchao's temporaries at their most while it quantizes ``n`` values of ``dtype`` bytes
    to NF4: the scaled blocks and their magnitudes (a value each), the codes before they are
    paired (a byte each), the block scales (a value per 32), and a chunk's distances to the
    16 levels with their magnitudes (32 values per value of a chunk). Measured with torch's
    MemTracker from 1/4 Mi to 58 Mi values in bf16 and fp32: within 1 % over."""
    return n * (2 * dtype + 1) + n * dtype // 32 + 2 * 16 * min(n, _NF4_CHUNK) * dtype


def _weight_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(rows, columns) of each kind of weight: the embedding and head, and each projection a
    layer has under ``lora_targets``' names."""
    d, f, v = config.hidden_size, config.intermediate_size, config.vocab_size
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    if config.fused_projections:
        layer = {"qkv_proj": (q + 2 * kv, d), "gate_up_proj": (2 * f, d)}
    else:
        layer = {"q_proj": (q, d), "k_proj": (kv, d), "v_proj": (kv, d), "gate_proj": (f, d),
                 "up_proj": (f, d)}
    layer.update(o_proj=(d, q), down_proj=(d, f))
    if config.num_experts:  # one expert's projection at a time, all of them under "experts"
        layer["experts"] = (config.moe_intermediate_size, d)
        if all(config.sparse(i) for i in range(config.num_layers)):  # no dense MLP anywhere
            for name in ("gate_proj", "up_proj", "down_proj"):
                layer.pop(name)
    return {"embed_tokens": (v, d), "lm_head": (v, d), **layer}


def _projections(config: ModelConfig) -> dict[str, int]:
    """Weights in each projection a layer has, by ``lora_targets``' names."""
    sizes = {name: rows * cols for name, (rows, cols) in _weight_shapes(config).items()
             if name not in ("embed_tokens", "lm_head")}
    if config.num_experts:  # a layer's experts together
        sizes["experts"] *= 3 * config.num_experts
    return sizes


def _adapted_weights(config: ModelConfig, t: Techniques) -> int:
    """Weights in the projections LoRA adapts (``lora_targets``), all layers."""
    sizes = _projections(config)
    return config.num_layers * sum(sizes.get(name, 0) for name in t.lora_targets)


def _merging(config: ModelConfig, t: Techniques) -> int:
    """Host bytes while one adapted projection is merged on the host (``DenseWeights.make``):
    base and update in float32 and their sum (12 bytes a weight), then the cast result."""
    return 0 if t.method == "full" else _largest_adapted(config, t) * (12 + _BYTES[t.dtype])


def _largest_adapted(config: ModelConfig, t: Techniques) -> int:
    """Weights in the largest projection LoRA adapts."""
    sizes = _projections(config)
    return max((sizes.get(name, 0) for name in t.lora_targets), default=0)


def layer_period(config: ModelConfig, t: Techniques, sharded: bool = False) -> int | None:
    """How many decoder layers repeat as one unit in a step (checkpointing every N-th layer
    makes N; Gemma 3's sliding and global layers their pattern, 6), or None where the depth is not a whole number of units, or too shallow for two
    shallow runs (``shallow_units``) to be cheaper than one whole one."""
    every = t.checkpoint_every or 1
    period = every * config.layer_pattern // math.gcd(every, config.layer_pattern)
    if config.num_layers % period or config.num_layers <= shallow_units(t, sharded)[1] * period:
        return None
    return period


def shallow_units(t: Techniques, sharded: bool = False) -> tuple[int, int, int, int]:
    """The units of the two shallow runs, and how many at the front and at the back of a
    run are kept apart (``_slots``): 2 and 3 units, the first two and the last apart. Where
    offloading parks what each layer saves without checkpointing, backward brings back the
    layer before's tensors while a layer runs: the first layer parks fewer (its input needs
    no gradient when the embedding is frozen), so the second unit differs too, and the
    last brings back its own as it goes, so the one before it differs from it: 5 and 6
    units, the first three and the last two apart. Under FSDP2 (``sharded``) the last unit
    is the first to run backward (its gradients' reduce-scatter and the next gather begin
    there), so no unit may be both at the front and at the back: 3 and 4 units."""
    if t.activation_offloading and not t.activation_checkpointing:
        return 5, 6, 3, 2
    return (3, 4, 2, 1) if sharded else (2, 3, 2, 1)


@dataclass
class _FakeStep:
    """What a fake step measured: its segments (``tracker.Segment``), the optimizer state
    (paged state included, and apart), the weights by kind and the held-out evaluation's
    peak. Every number is affine in the depth once layers repeat (``_extrapolated``)."""
    segments: dict
    state: int
    weights: dict
    paged: int
    eval_peak: int
    recorded: tuple | None = None  # every moment, where recorded (``carry``)
    generation_peaks: tuple[int, int] = (0, 0)  # GRPO's writing: the prompt read, the last token


def _traced(config: ModelConfig, t: Techniques, target: str, shape: tuple[int, int],
            by_layer: bool, tiles: tuple[int, bool] | None, traces: TraceCache | None,
            spread: Ranks | None = None, recompute_loss: bool = True,
            routing: str = "balanced") -> _FakeStep:
    """The fake step of ``shape``: traced, or where ``tiles`` says so (``carried_tiles``)
    carried from recordings at ``BASE`` and ``BASE + 1`` tiles (kept in ``traces``; tiles
    are always recomputed)."""
    if tiles is None:
        return _fake_step(config, t, target, shape, by_layer, spread=spread,
                          recompute_loss=recompute_loss, routing=routing)
    n, loss_per_tile = tiles
    key = (config.num_layers, t.replace(seq_len=t.tile_tokens), target, shape[0], by_layer,
           loss_per_tile, spread, routing)
    found = traces.get(key) if traces is not None else None
    if found is None:
        runs = [_fake_step(config, t.replace(seq_len=k * t.tile_tokens), target,
                           (shape[0], k * t.tile_tokens), by_layer, (True, loss_per_tile), spread,
                           routing=routing)
                for k in (BASE, BASE + 1)]
        recorded = [(run.recorded, run.segments) for run in runs]
        drawn = lines(*recorded) if all(r for r, _ in recorded) else None
        same = all(getattr(runs[0], name) == getattr(runs[1], name)
                   for name in ("state", "weights", "paged"))
        found = (drawn if same else None, replace(runs[1], recorded=None))
        if traces is not None:
            traces.put(key, found)
    drawn, run = found
    if drawn is None:  # a condition failed: traced at this length
        return _fake_step(config, t, target, shape, by_layer, spread=spread, routing=routing)
    return replace(run, segments=drawn.at(n), recorded=None)


def _fake_step(config: ModelConfig, t: Techniques, target: str, shape: tuple[int, int],
               by_layer: bool, tiles: tuple[bool, bool] = (False, False),
               spread: Ranks | None = None, recompute_loss: bool = True,
               routing: str = "balanced") -> _FakeStep:
    """Build ``config`` of fake tensors the way a session would and track a steady step;
    ``tiles``: record every moment, apart per tile of the layers (and per loss piece);
    ``spread``: rank 0's step of several, sharded over a fake process group."""
    world = spread.world if spread is not None else 1
    real = _fake_batch(config, t, shape[0] // world, shape[1])  # this rank's rows
    micro_batches = [real] * t.grad_accum
    trained = real["labels"].numel() * t.grad_accum * world
    with torch.device("meta"):
        built = CausalLM(config)
    for block in built.sparse_blocks:  # fake tensors hold no routing: assume it
        block.routing = routing
    cast_model(built, DTYPES[t.dtype])
    with fake_group(world, spread.sharding) if spread is not None else contextlib.nullcontext() as mesh, \
            FakeTensorMode(allow_non_fake_inputs=True) as mode:
        built.to_empty(device="cpu")
        built.tie_weights()  # to_empty gives tied weights separate tensors
        transform_model(built, t, previous=None, cast=False)  # the session's own planner
        context = NO_CONTEXT
        if spread is not None:  # as the trainer does under torchrun: shard, then the optimizer
            shard_model(built, spread.traced(), mesh)
            context = StepContext(parallel=Parallel(0, world, 0, spread.sharding))
        copy = None
        if t.reference_kind in COPIES:  # a full finetune's frozen reference (on CUDA "host": off the device)
            host = t.reference_kind == "copy_host"
            copy = FrozenCopy.of(full_weights(built), config, "cpu", host,
                                 store="meta" if host and target == "cuda" else "cpu")
            context = replace(context, copy=copy)
        optimizer = _estimate_optimizer(built, t, target)
        batches = [{k: mode.from_tensor(v) for k, v in b.items()} for b in micro_batches]
        inputs = [v for b in batches for v in b.values()]
        # the step's own options, the loss eager (compile is estimated eager); on CUDA what
        # is offloaded leaves the device counted
        options = StepOptions.of(t, compile=False, offload_to="meta" if target == "cuda" else None,
                                 recompute_loss=recompute_loss)
        _make_state(optimizer)  # as after a first step, without running one
        marks = [layer.ffn_norm for layer in built.model.layers] if tiles[0] else []
        marks += [built.model.norm] if tiles[1] else []
        memory = CpuStepMemory(built, optimizer, *inputs, by_layer=by_layer, tiles=tuple(marks), copy=copy)
        with memory:
            update(built, optimizer, batches, trained, memory, options, context)
        eval_peak = 0
        if t.eval_every:  # one held-out batch at a time, beside the optimizer state
            evaluation = CpuStepMemory(built, optimizer, *inputs, copy=copy)
            built.eval()
            with evaluation:
                evaluate_sum(built, batches[:1], evaluation, options, copy=copy)
            eval_peak = evaluation.result().peak
        generation_peaks = (0, 0)
        if t.objective == "grpo":  # written before the update, no gradients
            built.eval()
            lasts = (False, True) if t.max_completion > 1 else (False,)  # (one token: no forward after)
            moments = [CpuStepMemory(built, optimizer) for _ in lasts]
            for moment, last in zip(moments, lasts):
                with moment, torch.no_grad():
                    _fake_generation(built, t, shape[1], target, last)
            generation_peaks = (*(moment.result().peak for moment in moments), 0)[:2]
            built.train()
    return _FakeStep(dict(memory.segments), optimizer_state_bytes(optimizer),
                     weights_of(built, copy), optimizer_state_bytes(optimizer, torch.device("meta")),
                     eval_peak, memory.recorded, generation_peaks)


def _slots(step: _FakeStep, depth: int, period: int, apart: tuple[int, int]) -> dict:
    """A step's segments keyed by where they sit rather than by layer: a layer's segment
    becomes that of one of the first units, or of the last ones (``apart``: how many at
    the front and at the back, ``shallow_units``), at position ``index % period`` in it (in
    the shallow run one unit may be both: with two units, the second is also the last).

    The first unit differs from the others (its input needs no gradient when the embedding
    is frozen; the embedding's own backward follows it); from the second on (where the ones
    at either end differ too: the ones kept apart), each unit holds what the one before it
    held plus one unit's share, so the units between the front and the back lie on the line
    between those two and never hold the most: they are left out.
    """
    units, out = depth // period, {}
    front, back = apart
    for (phase, micro, part, index), segment in step.segments.items():
        if index is None:
            out[(phase, micro, part, None, None)] = segment
            continue
        unit, position = divmod(index, period)
        if unit < front:
            out[(phase, micro, part, position, ("front", unit))] = segment
        if units - 1 - unit < back:
            out[(phase, micro, part, position, ("back", units - 1 - unit))] = segment
    return out


def _extrapolated(a: _FakeStep, b: _FakeStep, depth_a: int, depth_b: int, depth: int,
                  period: int, apart: tuple[int, int] = (2, 1)) -> _FakeStep | None:
    """The step of a ``depth``-layer model from those of ``depth_a`` and ``depth_b`` layers.

    With identical layers every byte count of a segment (and the weights, the state, the
    evaluation's peak) is affine in the depth: the segment's most-held moment is the same
    moment at any depth, and what is held beside it grows by one unit's share per unit. So
    each number is carried along the line through its two values, to the byte. None where
    the two runs do not have the same segments (then the whole model is run instead).
    """
    slots_a, slots_b = _slots(a, depth_a, period, apart), _slots(b, depth_b, period, apart)
    if any(key not in slots_a for key in slots_b) or any(
            key[3] is None for key in slots_a.keys() - slots_b.keys()):
        return None
    units = (depth - depth_a) // (depth_b - depth_a)

    def line(x: int, y: int) -> int:
        return x + (y - x) * units

    def carried(x: dict, y: dict) -> dict:
        return {k: line(x.get(k, 0), y.get(k, 0)) for k in {**x, **y}}

    segments = {key: Segment(peak=carried(slots_a[key].peak, segment.peak),
                             highs=carried(slots_a[key].highs, segment.highs))
                for key, segment in slots_b.items()}  # in the deeper run's order
    return _FakeStep(segments, line(a.state, b.state), carried(a.weights, b.weights),
                     line(a.paged, b.paged), line(a.eval_peak, b.eval_peak),
                     generation_peaks=tuple(map(line, a.generation_peaks, b.generation_peaks)))
