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

Commands: every call goes to every rank at once, one step per command, so that ``set``, Stop
and Ctrl-C take effect at a step boundary on every rank alike. ``set`` is two-phase: each
rank builds what the change needs beside what it uses (``Trainer.prepare``), and only when
every rank could does every rank swap it in; if one refuses, all drop it and the refusal
names the rank. Models are sharded, so ``save`` and ``generate`` run on every rank (each
gathers one layer at a time) and rank 0 answers.

Faults: the kernel waits on every rank at once. A rank that dies (killed, out of memory, an
exception) or does not answer within ``timeout`` raises ``RankFailed`` naming it and why; the
other ranks, which would wait for it in a collective, are ended with the cluster, and the
kernel goes on. ``recover()`` starts the ranks again from the last checkpoint saved or
loaded. Ctrl-C in the kernel lets the step under way finish on every rank, then stops.
"""

from __future__ import annotations

import os
import socket
import tempfile
import threading
import time
from concurrent import futures
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
    that win over it, as ``nbtune train`` takes them. ``timeout``: seconds a command (one
    step, a save) may take on any rank before the ranks are taken as hung and ended.
    ``resume``: a checkpoint folder to start from.
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
        self.current_run: RanksRun | None = None  # the background run, while it trains
        self._pending: list[dict] = []  # set() during a background run, for its next boundary
        self._lock = threading.Lock()
        self._interrupted = False
        self._start()

    def _start(self) -> None:
        import ipyparallel as ipp

        path, overrides = self._args
        if self.checkpoint is not None and hasattr(self, "_file_techniques"):
            overrides = {**(overrides or {}), **self._changed_since_file()}
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
        answers = self._all(_join, lambda rank: (rank, processes, port, str(path), overrides or {},
                                                 parent, controller, resume))
        self.step_number, self.techniques = answers[0][:2]
        if self.checkpoint is None:  # the run file's, before any set(): what a resume starts from
            self._file_techniques = self.techniques
        self.pids = [answer[2] for answer in answers]  # each rank's process id, in rank order
        self.history = self.history[:self.step_number]  # a restart forgets the steps after it

    # ---- talking to the ranks ----------------------------------------------------------------

    def _all(self, function, args_of) -> list:
        """``function(*args_of(rank))`` on every rank at once; each rank's answer, in rank
        order. Every rank is waited on together: the first that fails ends them all. Ctrl-C
        meanwhile lets the command finish on every rank (a step stops at its boundary) and is
        remembered in ``_interrupted``."""
        if not self._engines:
            raise RankFailed("These ranks were ended; recover() starts them again from the last "
                             "checkpoint, or make new ones.", None)
        pending = [engine.apply_async(function, *args_of(rank))
                   for rank, engine in enumerate(self._engines)]
        deadline = time.monotonic() + self.timeout
        while True:
            left = min(1.0, max(0.0, deadline - time.monotonic()))
            try:  # (each AsyncResult is a Future: wait for them without polling the cores)
                done, waiting = futures.wait(pending, left, return_when=futures.FIRST_EXCEPTION)
            except KeyboardInterrupt:
                self._interrupted = True  # the command finishes on every rank first
                continue
            failed = next((rank for rank, p in enumerate(pending) if p in done and not p.successful()), None)
            if failed is not None:
                self._fail(failed, _reason(pending[failed]))
            if not waiting:
                break
            if time.monotonic() > deadline:
                late = [rank for rank, p in enumerate(pending) if p in waiting]
                self._fail(late[0] if len(late) == 1 else None,
                           f"no answer within {self.timeout:.0f} s from rank {', '.join(map(str, late))}")
        failed = next((rank for rank, p in enumerate(pending) if not p.successful()), None)
        if failed is not None:
            self._fail(failed, _reason(pending[failed]))
        return [p.get() for p in pending]

    def _fail(self, rank: int | None, why: str):
        """End every rank and the cluster, then raise ``RankFailed``."""
        self._end()
        back = (f"recover() starts them again from {self.checkpoint}" if self.checkpoint is not None
                else "no checkpoint was saved through save_checkpoint(), so recover() starts "
                     "from the beginning")
        who = f"Rank {rank}" if rank is not None else "The ranks"
        raise RankFailed(f"{who} failed: {why}. The other ranks were ended (they would have "
                         f"waited for it); the kernel goes on, and {back}.", rank)

    def _command(self, name: str) -> None:
        """Refuse a command that would race with the background run (``BusyError``)."""
        from .runner import BusyError

        run = self.current_run
        if run is not None and run.running and threading.current_thread() is not run.thread:
            raise BusyError(f"{name}: a background run is training on the ranks; stop() it or "
                            "wait() for it first.")

    # ---- training ------------------------------------------------------------------------------

    def step(self) -> dict:
        """One step on every rank; rank 0's report (the global step's loss and tokens)."""
        return self.run(1, progress=False)[-1]

    def run(self, steps: int, *, progress: bool = True) -> list[dict]:
        """``steps`` steps on every rank, one command each; rank 0's reports, each with every
        rank's memory (``ranks``). Ctrl-C ends the run once the step under way has finished on
        every rank."""
        from tqdm.auto import tqdm

        self._command("run")
        reports, self._interrupted = [], False
        with tqdm(total=steps, desc=f"training on {self.world} ranks", unit="step",
                  disable=not progress) as bar:
            for _ in range(steps):
                reports.append(self._step())
                bar.update()
                bar.set_postfix(loss=f"{reports[-1]['loss']:.3f}")
                if self._interrupted:
                    print(f"Stopped by Ctrl-C after step {self.step_number} on every rank.")
                    break
        return reports

    def _step(self) -> dict:
        answers = self._all(_step, lambda rank: ())
        report = {**answers[0], "ranks": [answer["memory"] for answer in answers]}
        self.step_number = report["step"]
        self.history.append(report)
        return report

    def start(self, steps: int) -> "RanksRun":
        """Train ``steps`` steps in a background thread and return at once: other cells run
        meanwhile, ``set`` queues a change for the next step boundary, ``stop()`` ends the
        run at the next one; commands that use the ranks wait for it (``BusyError``)."""
        self._command("start")
        self.current_run = RanksRun(steps, self._train)
        return self.current_run

    def _train(self, run: "RanksRun") -> None:
        """The background run's loop: queued changes, then a step, until done or stopped."""
        for _ in range(run.steps):
            self._apply_pending()
            if run.stopping.is_set():
                break
            run.reports.append(self._step())
        self._apply_pending()

    @property
    def rank_steps(self) -> list[int]:
        """The step each rank stands at (they agree: every command reaches every rank)."""
        return [where[0] for where in self._all(_where, lambda rank: ())]

    def stop(self, wait: bool = True) -> "RanksRun | None":
        """Stop the background run at the next step boundary (on every rank); with ``wait``,
        return once it stopped, re-raising what ended it early."""
        run = self.current_run
        if run is None:
            return None
        run.stopping.set()
        if wait:
            run.wait()
        return run

    def wait(self, timeout: float | None = None) -> list[dict]:
        """Wait for the background run to end; its reports (re-raising what ended it early)."""
        return self.current_run.wait(timeout) if self.current_run is not None else []

    # ---- techniques ----------------------------------------------------------------------------

    @property
    def planned(self):
        """The techniques once the changes queued during a background run are applied."""
        planned = self.techniques
        for changes in self._pending:
            planned = planned.replace(**changes)
        return planned

    def set(self, **changes):
        """Change toggles on every rank at a step boundary, all or nothing across the ranks
        (a refusal names the rank). During a background run the change is queued for the
        next boundary. Returns the techniques it leads to. Sharded-model fields (method,
        dtype, LoRA shape, checkpointing, compile) are fixed while the ranks run."""
        planned = self.planned.replace(**changes)  # a bad value is refused in the kernel
        with self._lock:
            run = self.current_run
            if run is not None and run.running and threading.current_thread() is not run.thread:
                self._pending.append(dict(changes))
                return planned
        return self._apply(changes)

    def _apply(self, changes: dict):
        answers = self._all(_propose, lambda rank: (changes,))
        refused = next(((rank, why) for rank, why in enumerate(answers) if why is not None), None)
        commit = refused is None
        notes = self._all(_settle, lambda rank: (commit,))[0]
        if not commit:
            rank, why = refused
            raise ValueError(f"Rank {rank} refused the change, so no rank made it: {why}")
        self.techniques = self.techniques.replace(**changes)
        for note in notes:
            print(note)
        return self.techniques

    def _apply_pending(self) -> None:
        with self._lock:
            queued, self._pending = self._pending, []
        for changes in queued:
            try:
                self._apply(changes)
            except ValueError as refused:  # said, and the run goes on as it was
                print(refused)

    # ---- the state on disk -----------------------------------------------------------------------

    def save_checkpoint(self, folder) -> Path:
        """A sharded checkpoint of every rank (as under torchrun); ``recover()`` comes back to it."""
        self._command("save_checkpoint")
        folder = Path(folder).resolve()
        self._all(_call, lambda rank: ("save_checkpoint", (str(folder),), {}))
        self.checkpoint, self._checkpoint_techniques = folder, self.techniques
        return folder

    def _changed_since_file(self) -> dict:
        """The run file's fields changed by ``set`` before the checkpoint, as overrides: the
        ranks start again from the file with the techniques the checkpoint was saved with."""
        saved = getattr(self, "_checkpoint_techniques", self._file_techniques)
        return {f"techniques.{name}": getattr(saved, name)
                for name in sorted(saved.changed(self._file_techniques))}

    def load_checkpoint(self, folder) -> None:
        """Every rank continues from ``save_checkpoint``'s folder (its own shard)."""
        self._command("load_checkpoint")
        folder = Path(folder).resolve()
        self._all(_call, lambda rank: ("load_checkpoint", (str(folder),), {}))
        self.step_number, self.techniques = self._all(_where, lambda rank: ())[0]
        self.history = self.history[:self.step_number]
        self.checkpoint, self._checkpoint_techniques = folder, self.techniques

    def recover(self) -> None:
        """Start the ranks again, from the last checkpoint saved or loaded (else step 0)."""
        self._end()
        self._start()

    def save(self, folder, merge: bool = False, format: str = "hf",
             quantization: str | None = None) -> Path:
        """The trained model, gathered one layer at a time and written by rank 0
        (``Session.save``'s formats)."""
        self._command("save")
        folder = Path(folder).resolve()
        out = self._all(_call, lambda rank: ("save", (str(folder),),
                                             dict(merge=merge, format=format, quantization=quantization)))
        return Path(out[0])

    # ---- using the model -------------------------------------------------------------------------

    def generate(self, prompt: str, **settings):
        """``Session.generate`` on the sharded model: every rank takes part, rank 0 answers.
        Sampling (``temperature`` > 0) uses one seed on every rank, so they agree."""
        from .generate import Reply

        self._command("generate")
        if settings.get("temperature", 0) and settings.get("seed") is None:
            settings["seed"] = int.from_bytes(os.urandom(4), "little")
        if settings.pop("stream", None) is not None:
            raise ValueError("generate: stream is not available across processes; the reply "
                             "comes back whole.")
        return Reply(self._all(_call, lambda rank: ("generate", (prompt,), settings))[0])

    def evaluate(self, examples=None, match: str | None = None) -> float:
        """``Session.evaluate`` on the sharded model; ``match``: "exact" or "json_keys"."""
        self._command("evaluate")
        if match is not None and not isinstance(match, str):
            raise ValueError("evaluate: across processes match is \"exact\" or \"json_keys\" "
                             "(a function cannot be sent to the ranks).")
        rows = list(examples) if examples is not None else None
        return self._all(_call, lambda rank: ("evaluate", (rows,), {"match": match}))[0]

    def chart(self):
        """Each rank's memory at its peak in the last measured step, split by kind."""
        from .ui.charts import breakdown_figure

        last = self.history[-1]["ranks"] if self.history else []
        bars = {f"rank {rank}": {k: v for k, v in memory.items() if k != "peak"}
                for rank, memory in enumerate(last)}
        return breakdown_figure(bars, f"step {self.step_number}: each rank's peak, by kind of memory",
                                totals=[memory["peak"] for memory in last])

    def close(self) -> None:
        """End every rank and the cluster (no process is left)."""
        try:
            if self._engines:
                self.stop()
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

    def __repr__(self) -> str:
        state = "ended" if not self._engines else f"step {self.step_number}"
        return f"<Processes: {self.world} ranks, {state}, {self.techniques.method}>"


class RanksRun:
    """A background run over the ranks: ``stop()``, ``wait()``, ``running``, ``reports``."""

    def __init__(self, steps: int, loop) -> None:
        self.steps, self._loop = steps, loop
        self.reports: list[dict] = []
        self.error: BaseException | None = None
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._train, name="nbtune-ranks-run", daemon=True)
        self.thread.start()

    running = property(lambda self: self.thread.is_alive())

    def _train(self) -> None:
        try:
            self._loop(self)
        except BaseException as err:  # noqa: BLE001 - kept for wait() to raise in the cell
            self.error = err

    def stop(self, wait: bool = True) -> "RanksRun":
        self.stopping.set()
        if wait:
            self.wait()
        return self

    def wait(self, timeout: float | None = None) -> list[dict]:
        self.thread.join(timeout)
        if self.error is not None:
            error, self.error = self.error, None
            raise error
        return self.reports

    def __repr__(self) -> str:
        state = ("training" if self.running else "ended" if self.error is None
                 else f"failed: {self.error}")
        return f"<RanksRun: {len(self.reports)} of {self.steps} steps, {state}>"


def _reason(result) -> str:
    """Why a rank's call failed, in a line: the engine's death, or its exception."""
    try:
        result.get(0)
    except Exception as err:  # noqa: BLE001 - described, not raised
        text = str(err).strip().splitlines()
        return f"{type(err).__name__}: {text[-1] if text else ''}"[:400].rstrip(".")
    return "unknown"


# ---- on each engine (ipyparallel pickles these by name: they run as nbtune code) ----------

def _join(rank: int, world: int, port: int, path: str, overrides: dict, parent: int,
          controller: int | None, resume: str | None) -> tuple:
    """Become rank ``rank``: the process group, then the run, as ``nbtune train`` builds it
    (from ``resume``'s checkpoint where given); returns the step it stands at and its
    techniques."""
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
    return (*_where(), os.getpid())


def _where() -> tuple:
    run = ENGINE_STATE["run"]
    return len(run.trainer.history), run.trainer.techniques


def _call(method: str, args: tuple, kwargs: dict):
    """``run.<method>(*args, **kwargs)`` on this rank's run; the answer as a plain value."""
    answer = getattr(ENGINE_STATE["run"], method)(*args, **kwargs)
    return str(answer) if answer is not None and not isinstance(answer, (int, float)) else answer


def _propose(changes: dict) -> str | None:
    """The first half of ``set`` on this rank: None when it could build the change, else why not."""
    trainer = ENGINE_STATE["run"].trainer
    try:
        ENGINE_STATE["proposal"] = trainer.prepare(trainer.techniques.replace(**changes))
    except Exception as refused:  # noqa: BLE001 - told to the kernel, which tells every rank
        return str(refused)
    return None


def _settle(commit: bool) -> list[str]:
    """The second half: swap the prepared change in (``commit``) or drop it; what it noted."""
    run = ENGINE_STATE["run"]
    prepared = ENGINE_STATE.pop("proposal", None)
    if prepared is None:
        return []
    if not commit:
        run.trainer.abort(prepared)
        return []
    run.trainer.commit(prepared)
    notes = run.trainer.take_notes()
    run.runner.changed()  # the next step is measured: it shows what the change did
    return notes


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


def _step() -> dict:
    # run(1), not step(): memory is measured as sampled, not on every step called alone
    report = ENGINE_STATE["run"].runner.run(1)[0]
    memory = report.memory
    return {"step": report.step, "loss": report.loss, "tokens": report.tokens,
            "seconds": report.seconds, "measured": memory.measured,
            "memory": {"peak": memory.peak, **memory.categories}}


def _leave() -> None:
    parallel = ENGINE_STATE.pop("parallel", None)
    ENGINE_STATE.clear()
    if parallel is not None:
        parallel.close()
