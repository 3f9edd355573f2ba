"""Each rank builds only its own share of the model: nothing whole on any rank, at any moment.

Under FSDP2 a rank keeps a dim-0 chunk of every weight. ``build_sharded`` makes the model on
the meta device, transforms it there (dtype, LoRA, QLoRA's NF4 layout, checkpointing: the
planner's ``transform_model``), shards it (``distributed.shard_model``), allocates this rank's
shards alone (``to_empty``) and fills them from the weight files, reading only this rank's
rows (``models.loading.weight_stream``). So a rank holds its share plus one weight's rows in
flight, on the device and on the host, however many ranks there are. (The first step then
gathers each unit as every step does: ``Trainer`` primes FSDP2's gather buffers just before
it, ``distributed.prime_units``.) This is torchtitan's
meta-device start; torchtune instead has rank 0 read the whole state dict and send each
parameter's shards out (``distribute_tensor``), which puts the whole model on rank 0's host.
Reading rows beats that here: every rank reads a 1/N of the bytes, in parallel, and nothing
crosses between ranks but the NF4 block scales (below).

* QLoRA's NF4 base: the ranks share each weight's block scales (one all-gather of 1/64 of its
  values) and each quantizes its rows (``peft.nf4_of_rows``): its parts are byte for byte the
  shard of the whole weight's NF4, as one process makes it.
* LoRA adapters: every rank draws each pair whole, as one process does (``peft.new_adapters``:
  the same draws in the same order), and keeps its rows: the same adapters, the same RNG after.
* After each weight the ranks agree (a flag all-reduced): a rank that cannot read its rows (a
  damaged file, a NaN) stops every rank with its message, none is left waiting in a collective.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from .distributed import check_sharding, shard_model
from .models.config import ModelConfig
from .models.decoder import CausalLM
from .models.filling import DTYPES, empty_model, release_freed_heap
from .models.loading import weight_stream
from .peft import LoRALinear, has_lora, is_nf4, new_adapters, nf4_block_absmax, nf4_of_rows
from .plan import check, transform_model


class ShardError(ValueError):
    """Another rank could not build its share (its own error says why)."""


def is_sharded(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def _shard_dim(param) -> int:
    """The mesh dimension a FSDP2 parameter is split over (the other, in HSDP, replicates)."""
    from torch.distributed.tensor import Shard

    dims = [i for i, p in enumerate(param.placements) if isinstance(p, Shard)]
    if len(dims) != 1 or param.placements[dims[0]].dim != 0:
        raise ValueError(f"A parameter split as {param.placements} is not FSDP2's dim-0 shard.")
    return dims[0]


def local_rows(param) -> tuple[int, int]:
    """(first, end) of the rows of dim 0 this rank holds of a FSDP2 parameter: its chunk of
    ``torch.chunk(rows, n)`` (FSDP2 pads the last chunks, which may be short or empty)."""
    dim = _shard_dim(param)
    mesh, rows = param.device_mesh, param.shape[0]
    chunk = math.ceil(rows / mesh.size(dim))
    first = min(rows, mesh.get_local_rank(dim) * chunk)
    return first, min(rows, first + chunk)


def shard_group(param):
    """The process group holding the other rows of ``param`` (its shard dimension's)."""
    return param.device_mesh.get_group(_shard_dim(param))


def _local(param) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return param.to_local() if isinstance(param, DTensor) else param


def _failed(error: BaseException | None, group=None) -> int:
    """How many ranks failed (a collective every rank calls, on the host: gloo)."""
    flag = torch.tensor([0 if error is None else 1], dtype=torch.int32)
    dist.all_reduce(flag, group=group)
    return int(flag.item())


def agreed(step, what: str):
    """``step()`` on every rank, then a show of hands: each rank raises its own error, or
    ``ShardError`` where only others failed, so no rank goes on into a collective alone."""
    error = result = None
    try:
        result = step()
    except Exception as err:  # noqa: BLE001 - raised after every rank has said
        error = err
    failed = _failed(error)
    if error is not None:
        raise error
    if failed:
        raise ShardError(f"{failed} other rank{'s' if failed > 1 else ''} could not {what} "
                         "(its error says why); this rank stopped with it.")
    return result


def file_targets(model: nn.Module, expected: dict) -> dict[str, tuple[nn.Module, str]]:
    """Each weight file name -> (the module holding it, its name there): LoRA's base weights
    sit under ``base_layer``."""
    out = {}
    for name, module in model.named_modules():
        held = module.base_layer if isinstance(module, LoRALinear) else module
        for leaf, _ in held.named_parameters(recurse=False):
            key = f"{name}.{leaf}" if name else leaf
            if key in expected:
                out[key] = (held, leaf)
    missing = sorted(set(expected) - set(out))
    if missing:
        raise RuntimeError(f"The sharded model has no place for {missing[:3]}: it was changed "
                           "before loading.")
    return out


def build_sharded(source, config: ModelConfig, techniques, parallel, mesh=None) -> CausalLM:
    """This rank's share of the model in ``source`` (a resolved model folder, a parsed GGUF
    file, or a whole model in memory, which is read as a file would be), transformed for
    ``techniques`` and sharded over ``parallel``'s ranks: see the module docstring. A
    collective: every rank calls it, and every rank raises if any fails."""
    def plan() -> tuple:
        model, _, expected = empty_model(config, ())
        problems = check(techniques, model, parallel.device.type) + check_sharding(
            parallel.sharding, model, techniques, parallel.device.type, parallel.world)
        if problems:
            raise ValueError(" ".join(problems))
        if isinstance(source, nn.Module) and (has_lora(source) or any(is_nf4(p) for p in source.parameters())):
            raise ValueError("A model with LoRA adapters or NF4 weights cannot be spread over ranks "
                             "as it is: merge its adapters (nbtune.peft.merge_lora) or give the "
                             "folder it was loaded from.")
        transform_model(model, techniques, previous=None)  # on the meta device: nothing made
        return model, expected

    model, expected = agreed(plan, "plan its share of the model")
    shard_model(model, parallel.sharding, mesh, prime=False)
    model.to_empty(device="cpu" if parallel.sharding.cpu_offload else parallel.device)
    with torch.no_grad():
        _fill(model, source, config, expected, DTYPES[techniques.dtype], parallel.device)
        agreed(lambda: _start_adapters(model, parallel.device), "make its LoRA adapters")
    return model


def _fill(model: CausalLM, source, config: ModelConfig, expected: dict, dtype: torch.dtype,
          device: torch.device) -> None:
    """Each weight's rows read into this rank's shard, one weight at a time, the ranks
    agreeing after each (see ``agreed``)."""
    targets = file_targets(model, expected)
    if isinstance(source, nn.Module):
        stream = _module_rows(source, expected, dtype, device, targets)
    else:
        stream = weight_stream(source, config, expected, dtype, device,
                               rows=lambda key: local_rows(getattr(*targets[key])))
    done = set()
    while True:
        item = agreed(lambda: next(stream, None), f"read its rows of {source}")
        if item is None:
            break
        key, rows = item
        agreed(lambda: _check_rows(getattr(*targets[key]), rows), f"read its rows of {key}")
        _place(*targets[key], rows)  # (NF4: a collective)
        done.add(key)
        del item, rows
    missing = sorted(set(expected) - done)
    if missing:
        raise ValueError(f"{source} lacks weights for {missing[:4]}{' ...' if len(missing) > 4 else ''}: "
                         "it does not describe a whole model of this shape.")


def _module_rows(model: nn.Module, expected: dict, dtype, device, targets):
    """A whole model in memory read as a weight file is: this rank's rows of each weight."""
    held = model.state_dict()
    for key in expected:
        first, end = local_rows(getattr(*targets[key]))
        yield key, held[key][first:end].to(device=device, dtype=dtype)


def _check_rows(param, rows: torch.Tensor) -> None:
    local = _local(param)
    if tuple(local.shape) != tuple(rows.shape):
        raise RuntimeError(f"This rank's shard is {tuple(local.shape)} but {tuple(rows.shape)} rows "
                           "were read for it.")


def _place(module: nn.Module, leaf: str, rows: torch.Tensor) -> None:
    """``rows`` (this rank's rows, dense) into the shard of ``module.<leaf>``. An NF4 weight is
    quantized as the whole weight would be (``peft.nf4_of_rows``, after the ranks share the
    block scales) and put in as a new shard through ``load_state_dict(assign=True)``, which
    FSDP2 takes up (``to_empty`` made only its codes and scales, not its two small tensors)."""
    from torch.distributed.tensor import DTensor

    param = getattr(module, leaf)
    local = _local(param)
    if not is_nf4(local):
        local.copy_(rows)
        return
    mine = nf4_block_absmax(rows)
    group = shard_group(param)
    every = mine.new_empty(mine.numel() * dist.get_world_size(group))
    dist.all_gather_into_tensor(every, mine, group=group)  # equal parts: rows split evenly
    shard = DTensor.from_local(nf4_of_rows(rows, tuple(param.shape), every), param.device_mesh,
                               param.placements, run_check=False, shape=param.shape,
                               stride=param.stride())
    module.load_state_dict({leaf: shard}, strict=False, assign=True)
    del rows, shard
    release_freed_heap()  # the dense rows and the quantizing's temporaries, as one process does


def _start_adapters(model: nn.Module, device: torch.device) -> None:
    """Every LoRA pair drawn whole, in the order one process draws them (``peft.new_adapters``),
    and this rank's rows kept."""
    for _, module in model.named_modules():
        if isinstance(module, LoRALinear):
            base = module.base_layer
            lora_A, lora_B = new_adapters(base.in_features, base.out_features, module.rank,
                                          device, module.lora_A.weight.dtype)
            for mine, whole in ((module.lora_A.weight, lora_A.weight), (module.lora_B.weight, lora_B.weight)):
                first, end = local_rows(mine)
                _local(mine).copy_(whole[first:end])


def sampled(param, index: torch.Tensor) -> torch.Tensor:
    """``param.reshape(-1)[index]`` of a sharded parameter, rounded to bf16, on every rank (a
    collective of its shard group): each rank fills in the values in its rows, as bf16 bits
    plus one, and a sum adds them up exactly (a sum of floats would turn -0.0 into 0.0)."""
    first, end = local_rows(param)
    local = _local(param).detach().reshape(-1)
    width = math.prod(param.shape[1:])
    mine = (index >= first * width) & (index < end * width)
    bits = torch.zeros(index.numel(), dtype=torch.int32, device=local.device)
    values = local[(index[mine] - first * width).to(local.device)].to(torch.bfloat16)
    bits[mine.to(local.device)] = values.view(torch.int16).to(torch.int32).bitwise_and(0xFFFF) + 1
    dist.all_reduce(bits, group=shard_group(param))
    raw = (np.asarray(bits.cpu().tolist(), dtype=np.uint32) - 1) << 16  # bf16 -> float32 bits
    return torch.from_numpy(raw.view(np.float32))


# ---- saving from the ranks: one unit gathered at a time ------------------------------------

_DONE, _FAILED = -1, -2  # what rank 0 sends when it has written all, or failed


class UnitGatherer:
    """Holds one FSDP2 unit of a sharded model gathered at a time, on every rank, as rank 0
    asks (``gather``) while the others follow (``serve``): a save made weight by weight on rank
    0 gathers the unit holding each weight, and frees it before the next unit is gathered."""

    def __init__(self, model: nn.Module) -> None:
        from torch.distributed.fsdp import FSDPModule

        units = [(name, module) for name, module in model.named_modules() if isinstance(module, FSDPModule)]
        self._names = [name for name, _ in units]
        self._units = [module for _, module in units]
        self._held: int | None = None

    def unit_of(self, module_name: str) -> int:
        """The unit holding a module's weights: the innermost one whose name leads its name."""
        inside = [i for i, name in enumerate(self._names)
                  if not name or module_name == name or module_name.startswith(name + ".")]
        return max(inside, key=lambda i: len(self._names[i]))

    def gather(self, unit: int) -> None:
        """Rank 0: every rank gathers ``unit`` (freeing the one held before)."""
        self._send(unit)
        self._hold(unit)

    def serve(self) -> None:
        """The other ranks: gather each unit rank 0 asks for, until it is done."""
        while True:
            unit = self._send(None)
            self._hold(unit if unit >= 0 else None)
            if unit == _FAILED:
                raise ShardError("Rank 0 could not save (its error says why): nothing more was "
                                 "gathered, and no folder was put in place.")
            if unit == _DONE:
                return

    def finish(self, ok: bool) -> None:
        """Rank 0: the save is over (``ok``: written); every rank frees what it holds."""
        self._send(_DONE if ok else _FAILED)
        self._hold(None)

    def _send(self, unit: int | None) -> int:
        message = torch.tensor([unit if unit is not None else 0], dtype=torch.int64)
        dist.broadcast(message, src=0)  # on the host (gloo)
        return int(message.item())

    def _hold(self, unit: int | None) -> None:
        if unit == self._held:
            return
        if self._held is not None:
            self._units[self._held].reshard()
            self._held = None
        if unit is not None:
            self._units[unit].unshard()
            self._held = unit


class Gathered:
    """``weights`` (``peft.DenseWeights`` or ``AdapterWeights`` of a sharded model) made on rank 0,
    each while every rank holds the unit it lives in gathered (``UnitGatherer``): the writers
    take it as they take the weights of a model in one process."""

    def __init__(self, weights, gatherer: UnitGatherer) -> None:
        self._weights, self._gatherer = weights, gatherer
        self.described = weights.described
        self._units = {key: gatherer.unit_of(name) for key, name in weights.modules.items()}

    def make(self, key: str) -> torch.Tensor:
        self._gatherer.gather(self._units[key])
        made = self._weights.make(key)
        # On a CPU a weight made as it is (not merged, not dequantized) is the gathered one,
        # whose storage FSDP2 frees when the next unit is gathered: the writer gets its own copy.
        return made.clone() if made.device.type == "cpu" else made
