"""Each rank's step under FSDP2, predicted: the real sharding on the estimator's fake tensors.

As torchtitan's memory estimation does, the estimator runs ``shard_model`` (PyTorch's own
``fully_shard``) and the real step over a fake process group of N ranks (torch's
``FakeProcessGroup``: collectives that move nothing and return tensors of the right shapes)
in this one process. Rank 0 is traced: every rank holds the same shapes (FSDP2 pads dim 0
evenly), so its step is every rank's. What that measures is FSDP2's own: the sharded
weights, gradients and optimizer state, the gather buffers of the units running (filed as
other), the unsharded gradients before their reduce-scatter, and ``reshard_after_forward``.

FSDP2's CPU offload on a CUDA card (the sharded weights, their gradients and the optimizer
state in host memory) is taken out of the traced device bytes segment by segment (each
segment at its own most-held moment: one layer's forward or backward) and counted on the
host, where every rank on the machine holds its own.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from dataclasses import dataclass, field, replace

from ..distributed import Sharding, device_mesh
from ..memory.tracker import TOTAL_KEY, Segment, host_refs

# torchao's NF4 all-gather checks its output's storage pointers, which a fake tensor warns of
# (it has none): harmless here, and the estimate is the only place NF4 meets fake tensors.
warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
_GROUP_LOCK = threading.Lock()  # one fake process group at a time (it is the process's default)


@dataclass(frozen=True)
class Ranks:
    """How many ranks the step is spread over, FSDP2's settings (``distributed.Sharding``) and
    how many machines the ranks are on (each holding ``per_machine`` of them)."""

    world: int
    sharding: Sharding = field(default_factory=Sharding)
    machines: int = 1

    @property
    def per_machine(self) -> int:
        return self.world // self.machines

    @classmethod
    def of(cls, ranks, sharding=None, machines: int = 1) -> "Ranks | None":
        """None for one process; the checked triple otherwise (``sharding`` a dict too)."""
        if not isinstance(ranks, int) or isinstance(ranks, bool) or ranks < 1:
            raise ValueError(f"ranks={ranks!r}: give the number of processes (GPUs), 1 or more.")
        if (not isinstance(machines, int) or isinstance(machines, bool) or machines < 1
                or ranks % machines):
            raise ValueError(f"machines={machines!r}: give how many machines the {ranks} ranks are "
                             "on, each with as many ranks (a divisor of ranks).")
        if isinstance(sharding, dict):
            known = set(Sharding.__dataclass_fields__)
            unknown = sorted(set(sharding) - known)
            if unknown:
                raise ValueError(f"sharding has no setting {unknown[0]!r}; it has {', '.join(sorted(known))}.")
            sharding = Sharding(**sharding)
        if sharding is not None and not isinstance(sharding, Sharding):
            raise ValueError(f"sharding={sharding!r}: give a dict of FSDP2 settings or a Sharding.")
        if ranks == 1:
            if sharding is not None and sharding != Sharding():
                raise ValueError("sharding settings need ranks=2 or more (FSDP2 shards over processes).")
            return None
        return cls(ranks, sharding or Sharding(), machines)

    def traced(self) -> Sharding:
        """The settings the fake step shards with: CPU offload is counted afterwards
        (``offload``), since the fake step runs on CPU tensors."""
        return replace(self.sharding, cpu_offload=False)


@contextlib.contextmanager
def fake_group(world: int, sharding: Sharding | None = None):
    """A fake process group of ``world`` ranks as the process's default, with its device mesh
    (``distributed.device_mesh``: 2-D for HSDP; made before any fake tensor: a mesh reads real
    values). Refused inside a real job."""
    import torch.distributed as dist
    # torch internal: importing it registers the "fake" backend (torchtitan's estimation
    # uses it too). If it moves, every per-rank estimate fails (tests/predict/test_ranks.py).
    from torch.testing._internal.distributed.fake_pg import FakeStore

    with _GROUP_LOCK:
        if dist.is_initialized():
            raise RuntimeError("A per-rank estimate runs FSDP2 over a fake process group, and this "
                               "process already belongs to a job's: estimate in the notebook or "
                               "before torchrun starts, or with ranks=1.")
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
        try:
            yield device_mesh(sharding or Sharding(), world, "cpu")
        finally:
            dist.destroy_process_group()


def offload(segments: dict) -> tuple[dict, dict]:
    """``segments`` with the sharded weights, gradients and optimizer state taken off the
    device (FSDP2's CPU offload), and the most of each that was held (for the host)."""
    out, held = {}, {}
    for key, segment in segments.items():
        moved = {ref: n for ref, n in segment.peak.items() if ref in host_refs()}
        peak = {ref: n for ref, n in segment.peak.items() if ref not in moved}
        peak[TOTAL_KEY] = segment.peak.get(TOTAL_KEY, 0) - sum(moved.values())
        highs = {}
        for ref, n in segment.highs.items():
            if ref in host_refs():
                held[ref] = max(held.get(ref, 0), n)
            else:
                highs[ref] = n
        out[key] = Segment(peak=peak, highs=highs)
    return out, held
