"""Several processes driven from the notebook: N ranks started and driven by ipyparallel.

ipyparallel is the Jupyter ecosystem's own engine for driving processes from cells: a
controller and N engines, started locally by its ``Cluster``, each engine a Python process
that keeps its state between calls, reached over ipyparallel's authenticated local channel.
Each engine here is one rank: it joins a torch process group (gloo on CPU; NCCL for CUDA
tensors with gloo for host scalars on GPUs) and builds its run from the same run file
``nbtune train`` runs under torchrun (FSDP2 over the ranks, ``batch_size`` the global batch),
so N engines train exactly as a torchrun job of that file does. The kernel is no rank: it
sends each command to every engine at once and gathers plain values back (numbers, text,
dicts), so a rank that dies leaves the kernel alive.

Lifetime: ``close()`` ends the ranks and the cluster; every engine also watches the process
that started it (the kernel) and ends itself, and the controller, when that process is gone
(a killed kernel leaves no rank behind). The cluster's files go to a temporary folder, not
the user's IPython profile.
"""

from __future__ import annotations

import os
import socket
import tempfile
from pathlib import Path

ENGINE_STATE: dict = {}  # on an engine: its run, its rank and its process group


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Processes:
    """N ranks of one run file, each an ipyparallel engine; see the module docstring.

    ``run_file``: a run file path (what ``nbtune train`` takes); ``overrides``: dotted fields
    that win over it, as ``nbtune train`` takes them. ``timeout``: seconds a command may take
    on any rank before the ranks are taken as hung.
    """

    def __init__(self, run_file, processes: int = 2, *, overrides: dict | None = None,
                 timeout: float = 600.0) -> None:
        import ipyparallel as ipp

        from . import runfile

        if not isinstance(processes, int) or isinstance(processes, bool) or processes < 2:
            raise ValueError(f"processes={processes!r}: give 2 or more (one process needs none of this).")
        path = Path(run_file).resolve()
        runfile.load(path, overrides)  # refused here, with the line, before any process starts
        self.world, self.timeout = processes, timeout
        self._profile = tempfile.TemporaryDirectory(prefix="nbtune-ranks-")
        self.cluster = ipp.Cluster(n=processes, profile_dir=self._profile.name, log_level=40,
                                   shutdown_atexit=True)
        self.client = self.cluster.start_and_connect_sync(activate=False)
        self.client.wait_for_engines(processes, timeout=timeout)
        self._engines = [self.client[i] for i in sorted(self.client.ids)[:processes]]
        controller = self.cluster.controller.process.pid if self.cluster.controller else None
        port, parent = _free_port(), os.getpid()
        self._all(_join, lambda rank: (rank, processes, port, str(path), overrides or {},
                                       parent, controller))
        self.history: list[dict] = []  # rank 0's step reports, as plain values

    def _all(self, function, args_of) -> list:
        """``function(*args_of(rank))`` on every rank at once; each rank's answer, in rank order."""
        pending = [engine.apply_async(function, *args_of(rank))
                   for rank, engine in enumerate(self._engines)]
        return [p.get(timeout=self.timeout) for p in pending]

    def step(self) -> dict:
        """One step on every rank; rank 0's report (the global step's loss and tokens)."""
        return self.run(1)[-1]

    def run(self, steps: int) -> list[dict]:
        """``steps`` steps on every rank; rank 0's reports, each with every rank's memory."""
        answers = self._all(_run, lambda rank: (steps,))
        reports = []
        for i, report in enumerate(answers[0]):
            reports.append({**report, "ranks": [answer[i]["memory"] for answer in answers]})
        self.history += reports
        return reports

    def close(self) -> None:
        """End every rank and the cluster (no process is left)."""
        try:
            if self._engines:
                self._all(_leave, lambda rank: ())
        finally:
            self._engines = []
            self.client.close()
            self.cluster.stop_cluster_sync()
            self._profile.cleanup()


# ---- on each engine (ipyparallel pickles these by name: they run as nbtune code) ----------

def _join(rank: int, world: int, port: int, path: str, overrides: dict, parent: int,
          controller: int | None) -> int:
    """Become rank ``rank``: the process group, then the run, as ``nbtune train`` builds it."""
    import threading

    from . import runs, runfile
    from .distributed import Parallel

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    threading.Thread(target=_watch, args=(parent, controller), daemon=True,
                     name="nbtune-parent-watch").start()
    import torch

    if not torch.cuda.is_available():  # the cores shared out, as torchrun does (OMP_NUM_THREADS)
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    config = runfile.load(path, overrides)
    parallel = Parallel.from_env(config.to_sharding())
    ENGINE_STATE.update(rank=rank, parallel=parallel,
                        run=runs.from_config(config, parallel=parallel))
    return rank


def _watch(parent: int, controller: int | None) -> None:
    """End this rank (and the controller) once the kernel that started it is gone."""
    import signal
    import time

    while os.getppid() == parent:
        time.sleep(1.0)
    if controller is not None:
        try:
            os.kill(controller, signal.SIGTERM)
        except OSError:
            pass
    os._exit(1)


def _run(steps: int) -> list[dict]:
    run = ENGINE_STATE["run"]
    out = []
    for report in run.runner.run(steps):
        memory = report.memory
        out.append({"step": report.step, "loss": report.loss, "tokens": report.tokens,
                    "memory": {"peak": memory.peak, **memory.categories}})
    return out


def _leave() -> None:
    parallel = ENGINE_STATE.pop("parallel", None)
    ENGINE_STATE.clear()
    if parallel is not None:
        parallel.close()
