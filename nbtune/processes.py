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

Faults: the kernel waits on every rank at once. A rank that dies (killed, out of memory, an
exception) or does not answer within ``timeout`` raises ``RankFailed`` naming it and why; the
other ranks, which would wait for it in a collective, are ended with the cluster, and the
kernel goes on. ``restart()`` starts the ranks again from the last checkpoint saved through
``save_checkpoint``.
"""

from __future__ import annotations

import os
import socket
import tempfile
from pathlib import Path

ENGINE_STATE: dict = {}  # on an engine: its run, its rank and its process group


class RankFailed(RuntimeError):
    """A rank died or hung; ``rank`` is which (None: several), the others were ended."""

    def __init__(self, message: str, rank: int | None) -> None:
        super().__init__(message)
        self.rank = rank


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
                 timeout: float = 600.0, resume: str | os.PathLike | None = None) -> None:
        from . import runfile

        if not isinstance(processes, int) or isinstance(processes, bool) or processes < 2:
            raise ValueError(f"processes={processes!r}: give 2 or more (one process needs none of this).")
        path = Path(run_file).resolve()
        runfile.load(path, overrides)  # refused here, with the line, before any process starts
        self.world, self.timeout = processes, timeout
        self._args = (path, overrides)
        self.checkpoint: Path | None = Path(resume).resolve() if resume is not None else None
        self.history: list[dict] = []  # rank 0's step reports, as plain values
        self._start()

    def _start(self) -> None:
        import ipyparallel as ipp

        path, overrides = self._args
        processes = self.world
        self._profile = tempfile.TemporaryDirectory(prefix="nbtune-ranks-")
        self.cluster = ipp.Cluster(n=processes, profile_dir=self._profile.name, log_level=40,
                                   shutdown_atexit=True)
        self.client = self._engines = None
        try:
            self.client = self.cluster.start_and_connect_sync(activate=False)
            self.client.wait_for_engines(processes, timeout=self.timeout)
        except BaseException:  # (Ctrl-C, a timeout) whatever was started is ended
            self._end()
            raise
        self._engines = [self.client[i] for i in sorted(self.client.ids)[:processes]]
        controller = self.cluster.controller.process.pid if self.cluster.controller else None
        port, parent = _free_port(), os.getpid()
        resume = str(self.checkpoint) if self.checkpoint is not None else None
        steps = self._all(_join, lambda rank: (rank, processes, port, str(path), overrides or {},
                                               parent, controller, resume))
        self.step_number = steps[0]
        self.history = self.history[:self.step_number]  # a restart forgets the steps after it

    def _all(self, function, args_of) -> list:
        """``function(*args_of(rank))`` on every rank at once; each rank's answer, in rank
        order. Every rank is waited on together: the first that fails ends them all."""
        import time

        if not self._engines:
            raise RankFailed("These ranks were ended; restart() starts them again from the last "
                             "checkpoint, or make new ones.", None)
        pending = [engine.apply_async(function, *args_of(rank))
                   for rank, engine in enumerate(self._engines)]
        deadline = time.monotonic() + self.timeout
        while not all(p.ready() for p in pending):
            failed = next((rank for rank, p in enumerate(pending) if p.ready() and not p.successful()), None)
            if failed is not None:
                self._fail(failed, _reason(pending[failed]))
            if time.monotonic() > deadline:
                late = [rank for rank, p in enumerate(pending) if not p.ready()]
                self._fail(late[0] if len(late) == 1 else None,
                           f"no answer within {self.timeout:.0f} s from rank {', '.join(map(str, late))}")
            time.sleep(0.02)
        failed = next((rank for rank, p in enumerate(pending) if not p.successful()), None)
        if failed is not None:
            self._fail(failed, _reason(pending[failed]))
        return [p.get() for p in pending]

    def _fail(self, rank: int | None, why: str):
        """End every rank and the cluster, then raise ``RankFailed``."""
        self._end()
        back = (f"restart() starts them again from {self.checkpoint}" if self.checkpoint is not None
                else "no checkpoint was saved through save_checkpoint(), so restart() starts "
                     "from the beginning")
        who = f"Rank {rank}" if rank is not None else "The ranks"
        raise RankFailed(f"{who} failed: {why}. The other ranks were ended (they would have "
                         f"waited for it); the kernel goes on, and {back}.", rank)

    def save_checkpoint(self, folder) -> Path:
        """A sharded checkpoint of every rank (as under torchrun); ``restart()`` comes back to it."""
        folder = Path(folder).resolve()
        self._all(_save_checkpoint, lambda rank: (str(folder),))
        self.checkpoint = folder
        return folder

    def restart(self) -> None:
        """Start the ranks again, from the last checkpoint saved through ``save_checkpoint``."""
        self._end()
        self._start()

    def step(self) -> dict:
        """One step on every rank; rank 0's report (the global step's loss and tokens)."""
        return self.run(1)[-1]

    def run(self, steps: int) -> list[dict]:
        """``steps`` steps on every rank; rank 0's reports, each with every rank's memory."""
        answers = self._all(_run, lambda rank: (steps,))
        self.step_number = answers[0][-1]["step"] if answers[0] else self.step_number
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
            self._end()

    def _end(self) -> None:
        """End the engines and the controller (idempotent)."""
        if getattr(self, "cluster", None) is None:
            return
        self._engines = []
        try:
            if self.client is not None:
                self.client.close()
            self.cluster.stop_cluster_sync()
        finally:
            self.client = self.cluster = None
            self._profile.cleanup()


def _reason(result) -> str:
    """Why a rank's call failed, in a line: the engine's death, or its exception."""
    try:
        result.get(0)
    except Exception as err:  # noqa: BLE001 - described, not raised
        text = str(err).strip().splitlines()
        return f"{type(err).__name__}: {text[-1] if text else ''}"[:400]
    return "unknown"


# ---- on each engine (ipyparallel pickles these by name: they run as nbtune code) ----------

def _join(rank: int, world: int, port: int, path: str, overrides: dict, parent: int,
          controller: int | None, resume: str | None) -> int:
    """Become rank ``rank``: the process group, then the run, as ``nbtune train`` builds it
    (from ``resume``'s checkpoint where given); returns the step it stands at."""
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
    run = runs.from_config(config, parallel=parallel)
    if resume is not None:
        run.load_checkpoint(resume)
    ENGINE_STATE.update(rank=rank, parallel=parallel, run=run)
    return len(run.trainer.history)


def _save_checkpoint(folder: str) -> str:
    return str(ENGINE_STATE["run"].save_checkpoint(folder))


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
