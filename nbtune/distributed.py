"""Several processes under torchrun: FSDP2 sharding and the global batch (sharded
checkpoints live with the others, in ``checkpoint``).

Everything here is PyTorch's own distributed engine: ``fully_shard`` per decoder layer and on
the root (``torch.distributed.fsdp``) and ``get_state_dict`` to gather full weights. nbtune adds
only the bookkeeping that keeps N ranks equal to one process on the same run file:

* ``batch_size`` is the global batch: every rank walks the same shuffled order and keeps its
  own ``batch_size / N`` rows of each batch (disjoint, together the whole batch);
* the loss is divided by the trained tokens of all ranks (one all-reduce per step), and each
  rank's backward is scaled by N because FSDP averages gradients over ranks: the sum of the
  ranks' gradients is then the single-process gradient;
* the reported loss and token counts are all-reduced, so every rank reports the global step.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn


def _env_int(name: str, default: str | None, least: int) -> int:
    """A torchrun variable as a number, refused with what to do when it is not one."""
    text = os.environ.get(name, default)
    if text is None:
        raise ValueError(f"WORLD_SIZE is set but {name} is not: start the job with torchrun, "
                         "which sets both.")
    try:
        value = int(text)
    except ValueError:
        value = least - 1
    if value < least:
        raise ValueError(f"{name}={text!r} is not a whole number of at least {least}: start the "
                         f"job with torchrun, or unset {name}.")
    return value


@dataclass(frozen=True)
class Sharding:
    """FSDP2 settings (the run file's ``distributed:`` section)."""

    reshard_after_forward: bool = True  # free gathered layer weights after forward (regather in backward)
    cpu_offload: bool = False  # sharded weights, gradients and optimizer state in CPU memory
    mixed_precision: str | None = None  # "bf16": gather and compute in bf16, reduce in fp32
    shard_embeddings: bool = False  # embedding and output head as their own units (untied only)
    # HSDP: the ranks in this many groups (one a machine, say), each group holding the whole
    # model sharded over its ranks, gradients averaged across the groups; 1: plain FSDP
    replicate: int = 1


class RankLost(RuntimeError):
    """A rank, or the machine it ran on, stopped answering: the job cannot go on."""


# What gloo and the store say when the other end of a connection is gone.
_GONE = ("Connection reset by peer", "Connection closed by peer", "Broken pipe",
         "Connection refused", "Socket Timeout")
ROLL_CALL_SECONDS = 5.0  # how long the ranks still standing wait for each other to answer


class Parallel:
    """This process's place in a torchrun job, or among the ranks a notebook drives
    (``from_kernel``: ipyparallel engines); None-like when alone. ``places``:
    each rank's machine (torchrun's node rank) and host name, in rank order, as the ranks
    told each other when the job started (``from_env``); None where unknown."""

    def __init__(self, rank: int, world: int, local_rank: int, sharding: Sharding) -> None:
        self.rank, self.world, self.local_rank, self.sharding = rank, world, local_rank, sharding
        self.places: list[tuple[int, str]] | None = None
        self.from_kernel = False  # ranks a notebook's kernel drives (engines), not torchrun's

    @classmethod
    def from_env(cls, sharding: Sharding | None = None) -> "Parallel | None":
        """The job torchrun started (``WORLD_SIZE`` > 1), with its process group up; else None."""
        world = _env_int("WORLD_SIZE", "1", 1)
        if world < 2:
            return None
        rank, local = _env_int("RANK", None, 0), _env_int("LOCAL_RANK", "0", 0)
        if rank >= world:
            raise ValueError(f"RANK={rank} but WORLD_SIZE={world}: a rank is below the world "
                             "size. Start the job with torchrun, which sets both.")
        if not dist.is_initialized():
            # NCCL for the CUDA tensors, gloo for the few host scalars the step sums (its loss)
            backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
            if torch.cuda.is_available():
                torch.cuda.set_device(local)
            dist.init_process_group(backend)
        parallel = cls(rank, world, local, sharding or Sharding())
        parallel.places = parallel.gather((_env_int("GROUP_RANK", "0", 0), socket.gethostname()))
        return parallel

    @property
    def machines(self) -> int:
        """How many machines the ranks run on (1 where unknown)."""
        return len({machine for machine, _ in self.places}) if self.places else 1

    def lost(self, err: BaseException) -> RankLost | None:
        """``err`` as a ``RankLost`` naming the ranks (and their machines) that stopped
        answering, where it says a connection to another rank is gone; else None. The ranks
        still standing call the roll in the job's store (``ROLL_CALL_SECONDS``): whoever did
        not answer is named, and if the store itself is gone, rank 0's machine (it holds it)."""
        text = str(err)
        if not any(sign in text for sign in _GONE):
            return None
        said = None
        try:
            absent, heard = self._roll_call()
        except KeyboardInterrupt:  # stopped meanwhile: torchrun ends every rank once one has died
            absent, heard = [], {}
            said = ("a connection to another rank broke, and torchrun stopped this rank (it stops "
                    "every rank once one has ended)")
        where = lambda ranks: ", ".join(  # noqa: E731
            f"rank {r}" + (f" (machine {self.places[r][0]}, {self.places[r][1]})" if self.places else "")
            + (f" (last heard {heard[r]})" if heard.get(r) else "") for r in ranks)
        if said is None:
            said = (f"the job's store on rank 0's machine cannot be reached: {where([0])} is gone"
                    if absent is None else f"{where(absent)} stopped answering" if absent else
                    "a connection between ranks broke, though every rank still answers")
        return RankLost(f"Rank {self.rank} lost a rank during the run: {said}. The job ends here "
                        "on every rank. Start every machine's torchrun again with --resume to go on "
                        f"from the last checkpoint. (The error: {text.splitlines()[0][:200]})")

    def _roll_call(self) -> tuple[list[int] | None, dict[int, str]]:
        """The ranks that did not answer within ``ROLL_CALL_SECONDS`` (None without a store),
        and where each was last heard (its heartbeat: ``liveness.last_heard``)."""
        import datetime

        from .liveness import last_heard

        try:
            store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                  is_master=False, timeout=datetime.timedelta(seconds=ROLL_CALL_SECONDS))
            store.set(f"nbtune/present/{self.rank}", "1")
            time.sleep(ROLL_CALL_SECONDS)
            absent = [r for r in range(self.world) if not store.check([f"nbtune/present/{r}"])]
            return absent, {r: last_heard(store, r) for r in absent}
        except (RuntimeError, KeyError, ValueError):  # (torch's store errors are RuntimeErrors)
            return None, {}

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", self.local_rank) if torch.cuda.is_available() else torch.device("cpu")

    def rows(self, batch: dict[str, torch.Tensor], pairs: bool = False) -> dict[str, torch.Tensor]:
        """This rank's share of a global batch (its rows, contiguous). ``pairs``: the batch is
        preference pairs (chosen rows, then rejected): a rank takes its chosen rows and the
        rejected rows of the same pairs."""
        if pairs:
            halves = [self.rows({k: v.chunk(2)[i] for k, v in batch.items()}) for i in (0, 1)]
            return {k: torch.cat([halves[0][k], halves[1][k]]) for k in batch}
        size = next(iter(batch.values())).shape[0]  # (GRPO's prompts have no input_ids yet)
        if size % self.world:
            raise ValueError(f"batch_size={size} does not split over {self.world} ranks: batch_size "
                             "is the global batch, so make it a multiple of the number of processes.")
        share = size // self.world
        return {k: v[self.rank * share:(self.rank + 1) * share] for k, v in batch.items()}

    def sum_(self, tensor: torch.Tensor) -> torch.Tensor:
        """All-reduce ``tensor`` in place (sum over ranks); returns it."""
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor

    def gather(self, value) -> list:
        """Every rank's ``value`` (any picklable object), in rank order, on every rank."""
        out = [None] * self.world
        dist.all_gather_object(out, value)
        return out

    def barrier(self) -> None:
        dist.barrier()

    def close(self) -> None:
        """Destroy the group, then collect what still held it (a sharded model's cycles):
        its C++ side goes now, not while the interpreter is torn down (the closed
        pytorch PR #179291 names that as a cause of gloo's SIGABRT at exit)."""
        import gc

        if dist.is_initialized():
            dist.destroy_process_group()
        gc.collect()


def shard_model(model: nn.Module, sharding: Sharding, mesh=None, prime: bool = True) -> None:
    """``fully_shard`` each decoder layer, optionally the embedding and head, then the root.

    Run after every model transform (dtype cast, LoRA/QLoRA): FSDP2 shards the parameters the
    modules hold at this moment. ``prime``: gather each unit once now (``prime_units``); a model on
    the meta device (``shards.build_sharded``) is primed once its shards are filled.
    """
    from torch.distributed.fsdp import (CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard,
                                        register_fsdp_forward_method)

    options = {"reshard_after_forward": sharding.reshard_after_forward}
    if mesh is None and sharding.replicate > 1:
        mesh = device_mesh(sharding)
    if mesh is not None:  # HSDP's 2-D mesh, or the estimator's fake ranks
        options["mesh"] = mesh
    if sharding.cpu_offload:
        options["offload_policy"] = CPUOffloadPolicy()
    if sharding.mixed_precision is not None:
        options["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                    reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, **options)
    if sharding.shard_embeddings:
        fully_shard(model.model.embed_tokens, **options)
        fully_shard(model.lm_head, **options)
    # The root (embedding, final norm, tied head) stays gathered after forward: the step calls
    # ``hidden_states`` (registered below as a forward) and then the head outside it.
    fully_shard(model, **{**options, "reshard_after_forward": False})
    register_fsdp_forward_method(model, "hidden_states")
    if prime:
        prime_units(model)


def device_mesh(sharding: Sharding, world: int | None = None, device_type: str | None = None):
    """The ranks as FSDP2 takes them: one dimension (shard over all), or for HSDP
    (``replicate`` > 1) two, ``("replicate", "shard")``: torchrun numbers a machine's ranks
    together, so with one group a machine each group's ranks share its links."""
    from torch.distributed.device_mesh import init_device_mesh

    world = world or dist.get_world_size()
    device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    if sharding.replicate <= 1:
        return init_device_mesh(device_type, (world,))
    return init_device_mesh(device_type, (sharding.replicate, world // sharding.replicate),
                            mesh_dim_names=("replicate", "shard"))


def prime_units(model: nn.Module) -> None:
    """Gather and free each FSDP2 unit once, so that its gather buffers exist before the first
    step: the memory tracker then files them as gathered weights from step 1 on, not
    activations."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.unshard()
            module.reshard()


def check_sharding(sharding: Sharding, model: nn.Module, techniques, device: str,
                   world: int = 2) -> list[str]:
    """Every reason ``sharding`` cannot run here over ``world`` ranks, each naming the fix
    (nothing is built yet)."""
    problems = []
    replicate = sharding.replicate
    if not isinstance(replicate, int) or isinstance(replicate, bool) or replicate < 1 or world % replicate:
        problems.append(f"distributed.replicate={replicate!r} does not split {world} ranks into groups "
                        f"of equal size: give a whole number that divides {world} (the number of "
                        "machines, for one group a machine), or 1 for plain FSDP.")
        replicate = 1
    if techniques.method == "qlora":
        problems += _nf4_splits(model, techniques.nf4_targets, world // replicate)
    if techniques.reference_kind in ("copy", "copy_host"):
        problems.append(f"reference={techniques.reference_kind!r} is not yet made for several ranks (the "
                        "copy would be sharded too): use reference='precomputed'.")
    if sharding.cpu_offload and device != "cuda":
        problems.append("distributed.cpu_offload moves the sharded weights, gradients and optimizer "
                        "state off a CUDA device; on this device they are already in CPU memory: "
                        "set distributed.cpu_offload: false.")
    if sharding.shard_embeddings and model.config.tie_word_embeddings:
        problems.append("shard_embeddings needs separate embedding and output weights, but this "
                        "model ties them (tie_word_embeddings): they are one tensor, sharded with the "
                        "root. Set distributed.shard_embeddings: false.")
    if sharding.mixed_precision not in (None, "bf16"):
        problems.append(f"distributed.mixed_precision={sharding.mixed_precision!r} is not null or 'bf16'.")
    return problems


def _nf4_splits(model: nn.Module, targets, world: int) -> list[str]:
    """FSDP2 gives each rank whole rows of an NF4 weight and equal parts of its 4-bit codes
    and of its two levels of scales (torchao's dim-0 split): each must divide by ``world``."""
    from .peft import NF4_BLOCK, nf4_parts, target_of

    bad = []
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and target_of(name) in targets:
            rows, size = module.weight.shape[0], module.weight.numel()
            if size % NF4_BLOCK == 0 and (rows % world or any(n % world for n in nf4_parts(size))):
                bad.append(f"{name} {tuple(module.weight.shape)}")
    if not bad:
        return []
    return [f"method 'qlora' cannot split {', '.join(bad[:2])}{' ...' if len(bad) > 2 else ''} "
            f"over {world} ranks (FSDP2 gives each rank whole rows and equal parts of its 4-bit "
            "codes and scales): use 2, 4 or 8 processes, or method 'lora'."]

