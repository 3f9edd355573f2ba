"""Several processes driven from the notebook: N ranks started and driven by ipyparallel.

ipyparallel is the Jupyter ecosystem's own engine for driving processes from cells: a
controller and N engines, started locally by its ``Cluster``, each engine a Python process
that keeps its state between calls, reached over ipyparallel's authenticated local channel.
Each engine here is one rank: it joins a torch process group (gloo on CPU; NCCL for CUDA
tensors with gloo for host scalars on GPUs) and builds its run from the same run file
``nbtune train`` runs under torchrun (FSDP2 over the ranks, ``batch_size`` the global batch),
so N engines train exactly as a torchrun job of that file does. The kernel is no rank: it
sends each command to every engine at once (``each``) and gathers plain values back, so a
rank that dies leaves the kernel alive. ``ranked.py`` puts a ``Session`` in front.

Several machines: ``local=K`` starts K of the N ranks here and waits for the other N - K to
join from other machines, each an ``ipengine`` started there with the controller's connection
file (the kernel prints the file and the commands); ``address`` is this machine's address
the others reach, where the controller listens and rank 0 holds the process group's store.
Ranks are numbered machine by machine (this one first), each machine's ranks its local ranks.

Lifetime: ``close()`` ends the ranks and the cluster; every engine this kernel started also
watches it and ends itself, and the controller, when the kernel is gone (a killed kernel
leaves no rank behind here; engines on other machines end once the controller stops
answering, as ipyparallel's heartbeat has it). The cluster's files go to a temporary folder,
not the user's IPython profile.

Faults: the kernel waits on every rank at once. A rank that dies (killed, out of memory, an
exception) or does not answer within ``timeout`` raises ``RankFailed`` naming it and why; so
does one whose heartbeat (``liveness.Heartbeat``, in a store the kernel holds) is silent for
``run.hang_seconds``, named with where it was last heard, and the controller's death. The
other ranks, which would wait for it in a collective, are ended with the cluster, and the
kernel goes on. ``restart()`` starts the ranks again from the last checkpoint saved or
loaded. Ctrl-C in the kernel lets the command under way (a step) finish on every rank first.
"""

from __future__ import annotations

import contextlib
import os
import socket
import tempfile
import threading
import time
import weakref
from concurrent import futures
from datetime import timedelta
from pathlib import Path

from ..interrupts import ctrl_c_held

ENGINE_STATE: dict = {}  # on an engine: its run, its rank and its process group
# ipyparallel's controller beats every 0.5 s, not 3 s (an engine is taken in a beat or two
# after it answers), and still calls an engine dead after the same 33 s of silence (66
# beats); an engine whose controller stopped answering ends after 50 of its checks, each a
# beat and 0.5 s: 50 s, not 175 s. (nbtune's own heartbeat names a stopped rank first.)
HEARTBEAT = ("--HeartMonitor.period=500", "--HeartMonitor.max_heartmonitor_misses=65")


class RankFailed(RuntimeError):
    """A rank died, hung or ran out of memory; the others were ended.

    Args:
        message: Which rank, how it ended and what it said last (out of memory: nbtune's
            whole account of it, with what to change).
        rank: Which rank (None: several).
        out_of_memory: The rank ran out of memory (a measured row says so and goes on).
    """

    def __init__(self, message: str, rank: int | None, out_of_memory: bool = False) -> None:
        super().__init__(message)
        self.rank, self.out_of_memory = rank, out_of_memory


def _free_port(address: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((address, 0))
        return s.getsockname()[1]


class Processes:
    """N ranks of one run file, each an ipyparallel engine; see the module docstring.

    ``run_file``: a run file path (what ``nbtune train`` takes); ``overrides``: dotted fields
    that win over it, as ``nbtune train`` takes them. ``timeout``: seconds a command (one
    step, a save; several steps get their expected time on top) may take on any rank before
    the ranks are taken as hung and ended.
    ``resume``: a checkpoint folder to start from. ``build=False``: the ranks join their
    process group and build nothing (the ladder builds its own rows on them). ``local``: the
    ranks started on this machine (default all), the rest joining from other machines;
    ``address``: this machine's address they reach (see the module docstring).
    """

    interrupted = False  # Ctrl-C came during the last held command (it finished first)
    pulses = None  # the ranks' heartbeats, as the kernel reads them (liveness.Pulses)
    _holding = False  # inside holding_ctrl_c

    def __init__(self, run_file, processes: int = 2, *, overrides: dict | None = None,
                 timeout: float = 600.0, resume: str | os.PathLike | None = None,
                 build: bool = True, local: int | None = None, address: str | None = None) -> None:
        from .. import runfile

        if not isinstance(processes, int) or isinstance(processes, bool) or processes < 2:
            raise ValueError(f"processes={processes!r}: give 2 or more (one process needs none of this).")
        local = processes if local is None else local
        if not isinstance(local, int) or isinstance(local, bool) or not 1 <= local <= processes:
            raise ValueError(f"local={local!r}: give how many of the {processes} ranks start on this "
                             "machine (1 to all; the others join from other machines).")
        if local < processes and not address:
            raise ValueError(f"{processes - local} ranks are to join from other machines: give "
                             "address=, this machine's address as they reach it (its IP or host "
                             "name), where they find the controller and rank 0.")
        self.local, self.address = local, address
        path = Path(run_file).resolve()
        self.config = runfile.load(path, overrides)  # refused with the line before any process starts
        self.world, self.timeout, self.build = processes, timeout, build
        self.run_file, self.overrides = path, overrides  # what every rank builds its run from
        self.checkpoint: Path | None = Path(resume).resolve() if resume is not None else None
        self._start()

    def _start(self) -> None:
        import ipyparallel as ipp

        path, overrides = self.run_file, self.overrides
        if self.checkpoint is not None and hasattr(self, "_file_techniques"):
            overrides = {**(overrides or {}), **self._changed_since_file()}
        processes = self.world
        self._profile = tempfile.TemporaryDirectory(prefix="nbtune-ranks-")
        # --nodb: the controller keeps no record of each command (a long run's steps would
        # pile up there); the client forgets each answer once read (``each``). Where ranks
        # join from other machines it listens on ``address`` (and only there).
        where = {"controller_ip": self.address, "controller_location": self.address} \
            if self.local < processes else {}
        # --usethreads: the controller's schedulers are threads of its own, not seven processes
        # more (~30 MB of host memory), and fewer to outlive a killed controller.
        # HEARTBEAT: the controller takes an engine in at its second beat after the engine's
        # first answer, so its default beat (3 s) left the ranks 4-5 s idle at every start.
        self.cluster = ipp.Cluster(n=self.local, profile_dir=self._profile.name, log_level=40,
                                   shutdown_atexit=True,
                                   controller_args=["--nodb", "--usethreads", *HEARTBEAT], **where)
        self.client = self._engines = None
        try:
            self.client = self.cluster.start_and_connect_sync(activate=False)
            if self.local < processes:
                print(self.joining(), flush=True)
            self.client.wait_for_engines(processes, timeout=self.timeout)
        except BaseException:  # (Ctrl-C, a timeout) whatever was started is ended
            self._end()
            raise
        engines = [self.client[i] for i in sorted(self.client.ids)[:processes]]
        hosts = [engine.apply_sync(_host) for engine in engines]
        parent, mine = os.getpid(), socket.gethostname()
        # rank order: the ranks started here first (rank 0 holds the store at ``address``),
        # then this machine's others, then machine by machine
        order = sorted(range(processes), key=lambda i: (hosts[i][1] != parent, hosts[i][0] != mine,
                                                        hosts[i][0], i))
        self._engines = [engines[i] for i in order]
        self._here = [hosts[i][1] == parent for i in order]  # started by this kernel: its pid is ours to see
        machines = list(dict.fromkeys(hosts[i][0] for i in order))
        places = [{"machine": machines.index(hosts[i][0]),
                   "local_rank": [j for j in order if hosts[j][0] == hosts[i][0]].index(i),
                   "local_world": sum(host == hosts[i][0] for host, _ in hosts),
                   "watch": hosts[i][1] == parent} for i in order]
        controller = self.cluster.controller.process.pid if self.cluster.controller else None
        # what the controller started: ended with the cluster, even once the controller was
        # killed (init adopts them), and at the kernel's exit
        self._parts_ended = weakref.finalize(self, _kill, _children(controller))
        master = self.address if self.local < processes else "127.0.0.1"
        port = _free_port(master)
        resume = str(self.checkpoint) if self.checkpoint is not None else None
        pulses = _watch(master, processes, self.config.run.hang_seconds)
        answers = self.each(_join, lambda rank: (rank, processes, port, str(path), overrides or {},
                                                 parent, controller, resume, self.build,
                                                 {**places[rank], "master": master, "beats": pulses.store.port}))
        self.pulses = pulses  # watched from here on (loading may hold a rank's GIL for long)
        self.about = answers[0]  # rank 0's run: its model's shape, tokenizer, source, data files
        self.step_number, self.techniques = self.about["step"], self.about["techniques"]
        if self.checkpoint is None:  # the run file's, before any set(): what a resume starts from
            self._file_techniques = self.techniques
        self.pids = [answer["pid"] for answer in answers]  # each rank's process id, in rank order

    @property
    def connection_file(self) -> Path:
        """The controller's connection file for engines (ipyparallel names it by cluster)."""
        return (Path(self._profile.name) / "security"
                / f"ipcontroller-{self.cluster.cluster_id}-engine.json")

    def joining(self) -> str:
        """What to run on the other machines for their ranks to join (printed while waiting)."""
        file = self.connection_file
        return (f"Waiting up to {self.timeout:.0f} s for {self.world - self.local} more rank(s) to join "
                f"from other machines. On each, with nbtune installed and the run file, model and "
                f"data at the same paths as here:\n"
                f"  1. copy {file} there (scp {file} OTHER:ipcontroller-engine.json)\n"
                f"  2. start one rank per process it is to hold (each its own GPU):\n"
                f"       ipengine --file=ipcontroller-engine.json &")

    @property
    def alive(self) -> bool:
        return bool(self._engines)

    @property
    def stop_flag(self) -> Path:
        """A file the kernel makes to end ``rank_steps`` at the next step boundary (in the
        cluster's private folder: engines read it, nothing else does)."""
        return Path(self._profile.name) / "stop"

    @contextlib.contextmanager
    def holding_ctrl_c(self):
        """Ctrl-C sets ``interrupted`` instead of raising, until the block ends: a
        KeyboardInterrupt between a command's end on the ranks and the kernel's record of it
        would lose steps the ranks took. The caller decides what the Ctrl-C does once its
        record is whole. The outer block of nested ones resets ``interrupted`` (in any
        thread: a run in the background starts clean after an interrupted one) and holds."""
        if self._holding:
            yield
            return
        self.interrupted = False

        def came() -> None:
            self.interrupted = True
        with ctrl_c_held(came):
            self._holding = True
            try:
                yield
            finally:
                self._holding = False

    def each(self, function, args_of=lambda rank: (), poll=None, extra: float = 0.0) -> list:
        """``function(*args_of(rank))`` on every rank at once; each rank's answer, in rank
        order. Every rank is waited on together: the first that fails ends them all. Ctrl-C
        meanwhile lets the command finish on every rank (a step stops at its boundary) and
        sets ``interrupted`` (``holding_ctrl_c``). ``poll()``: called every 50 ms while the
        ranks work; ``extra``: seconds the command may take beyond ``timeout`` (several steps)."""
        if not self._engines:
            raise RankFailed("These ranks were ended; recover() starts them again from the last "
                             "checkpoint, or make a new session.", None)
        with self.holding_ctrl_c():
            return self._each(function, args_of, poll, extra)

    def _each(self, function, args_of, poll, extra: float) -> list:
        pending = [engine.apply_async(function, *args_of(rank))
                   for rank, engine in enumerate(self._engines)]
        deadline = time.monotonic() + self.timeout + extra
        tick, listened = (1.0 if poll is None else 0.05), time.monotonic()
        while True:
            left = min(tick, max(0.0, deadline - time.monotonic()))
            # (each AsyncResult is a Future: wait for them without polling the cores)
            done, waiting = futures.wait(pending, left, return_when=futures.FIRST_EXCEPTION)
            if poll is not None:
                poll()
            if self.pulses is not None and waiting and time.monotonic() - listened >= 1.0:
                listened = time.monotonic()
                self._listen()
            failed = next((rank for rank, p in enumerate(pending) if p in done and _error(p) is not None), None)
            if failed is not None:
                why, explained = _reason(pending[failed]), _explained(pending[failed])
                dead = self._dead_peer(why)
                if dead is not None:
                    self._fail(dead, "its process ended (killed, or out of host memory)")
                self._fail(failed, explained or why, named=explained is not None,
                           out_of_memory=_out_of_memory(pending[failed]))
            if not waiting:
                break
            if time.monotonic() > deadline:
                late = [rank for rank, p in enumerate(pending) if p in waiting]
                self._fail(late[0] if len(late) == 1 else None,
                           f"no answer within {self.timeout:.0f} s from rank {', '.join(map(str, late))}")
        answers = [p.get() for p in pending]
        self.client.purge_local_results(pending)  # nothing kept per command in the kernel
        self.client.history.clear()
        for engine in self._engines:
            engine.history.clear()
        return answers

    def _listen(self) -> None:
        """The ranks' heartbeats (``liveness.Pulses``): a rank silent for ``run.hang_seconds``
        is named with where it was last heard (not ipyparallel's "Engine died" 45 s on),
        ended if it runs here (a stopped process would hold its memory), and the others with
        it. And the controller: without it no answer comes back, though every rank beats."""
        from ..liveness import ended

        launched = getattr(self.cluster, "controller", None)
        controller = getattr(getattr(launched, "process", None), "pid", None)
        if controller is not None and ended(controller):
            self._fail(None, f"ipyparallel's controller (process {controller}) ended (killed?), "
                             "so no rank's answer can come back")
        try:
            heard, _, silent = self.pulses.lost()
        except Exception:  # noqa: BLE001 - the store is the kernel's own: gone only as it ends
            return
        if silent:
            self.pulses.kill_silent(heard, [rank for rank in silent if self._here[rank]])
            self._fail(silent[0] if len(silent) == 1 else None, self.pulses.words(heard, [], silent),
                       named=True)

    def _dead_peer(self, why: str, grace: float = 3.0) -> int | None:
        """The rank started here whose process ended, when a rank's collective failed on its
        peer (``why``): that rank's error comes the moment the peer dies, often before its
        death is seen, so the death is waited for (``grace`` seconds) and named instead."""
        if not any(word in why.lower() for word in ("gloo", "nccl", "connection", "peer", "socket")):
            return None
        from ..liveness import ended

        deadline = time.monotonic() + grace
        while True:
            for rank, (pid, here) in enumerate(zip(getattr(self, "pids", []), getattr(self, "_here", []))):
                if here and ended(pid):
                    return rank
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)

    def call(self, method: str, *args, **kwargs):
        """``run.<method>(*args, **kwargs)`` on every rank (a collective: each takes part);
        rank 0's answer."""
        return self.each(_call, lambda rank: (method, args, kwargs))[0]

    def _fail(self, rank: int | None, why: str, named: bool = False, out_of_memory: bool = False):
        """End every rank and the cluster, then raise ``RankFailed`` (``named``: ``why``
        names the rank itself)."""
        self._end()
        back = (f"recover() starts them again from {self.checkpoint}" if self.checkpoint is not None
                else "no checkpoint was saved through save_checkpoint(), so recover() starts "
                     "from the beginning")
        who = f"Rank {rank} failed: " if rank is not None else "The ranks failed: "
        said = why[0].upper() + why[1:] if named else who + why
        apart = ".\n" if "\n" in said else ". "  # (after an account of several lines: a line of its own)
        raise RankFailed(f"{said}{apart}The other ranks were ended (they would have "
                         f"waited for it); the kernel goes on, and {back}.", rank, out_of_memory)

    def save_checkpoint(self, folder) -> Path:
        """A sharded checkpoint of every rank (as under torchrun); ``restart()`` comes back to it."""
        folder = Path(folder).resolve()
        self.call("save_checkpoint", str(folder))
        self.checkpoint, self._checkpoint_techniques = folder, self.techniques
        return folder

    def load_checkpoint(self, folder) -> None:
        """Every rank continues from ``save_checkpoint``'s folder (its own shard)."""
        folder = Path(folder).resolve()
        self.call("load_checkpoint", str(folder))
        self.step_number, self.techniques = self.each(_where)[0]
        self.checkpoint, self._checkpoint_techniques = folder, self.techniques

    def _changed_since_file(self) -> dict:
        """The run file's fields changed by ``set`` before the checkpoint, as overrides: the
        ranks start again from the file with the techniques the checkpoint was saved with."""
        saved = getattr(self, "_checkpoint_techniques", self._file_techniques)
        return {f"techniques.{name}": getattr(saved, name)
                for name in sorted(saved.changed(self._file_techniques))}

    def restart(self) -> None:
        """Start the ranks again, from the last checkpoint saved or loaded (else step 0)."""
        self._end()
        self._start()

    @property
    def rank_steps(self) -> list[int]:
        """The step each rank stands at (they agree: every command reaches every rank)."""
        return [where[0] for where in self.each(_where)]

    def close(self) -> None:
        """End every rank and the cluster (no process is left)."""
        try:
            if self._engines:
                self.each(_leave)
        finally:
            self._end()

    def _end(self) -> None:
        """End the engines and the controller (idempotent)."""
        if getattr(self, "cluster", None) is None:
            return
        self._engines, self.pulses = [], None
        try:
            if self.client is not None:
                if self.local < self.world:  # engines started on other machines: asked to end
                    asking = threading.Thread(target=_ask_to_end, args=(self.client,), daemon=True)
                    asking.start()
                    asking.join(timeout=10)  # (a hung engine does not answer: not waited for)
                self.client.close()
            self.cluster.stop_cluster_sync()
        finally:
            if getattr(self, "_parts_ended", None) is not None:
                self._parts_ended()  # (once: a finalizer runs at most once)
            self.client = self.cluster = None
            self._profile.cleanup()


def _children(pid: int | None) -> list:
    """The processes ``pid`` started (psutil's, which know their start time: a number reused
    later is not taken for them); none where it is gone or not known."""
    import psutil

    try:
        return psutil.Process(pid).children(recursive=True) if pid is not None else []
    except psutil.Error:
        return []


def _kill(processes: list) -> None:
    """End those of ``processes`` still running: a controller SIGKILLed (the OOM killer)
    leaves its heart monitor behind, adopted by init, holding its memory. (psutil's kill
    checks the start time: a number reused by another process is left alone.)"""
    import psutil

    for process in processes:
        with contextlib.suppress(psutil.Error):
            process.kill()


def _watch(address: str, world: int, hang: float):
    """A store of the kernel's own for the ranks' heartbeats, at ``address`` (where the ranks
    reach this machine), and the kernel's reading of it: held by the kernel, it answers
    whichever rank stops (rank 0's own store would stop with rank 0)."""
    from torch.distributed import TCPStore

    from ..liveness import Pulses

    store = TCPStore(address, 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    return Pulses(store, world, hang)


def _ask_to_end(client) -> None:
    with contextlib.suppress(Exception):
        client.shutdown(targets="all", block=True)


def _error(result) -> BaseException | None:
    """A finished call's exception (None: it answered), from the future's own state.

    ipyparallel marks an AsyncResult ready in a callback after its future is done: between
    the two, ``successful()`` raises and ``get(0)`` times out (a CI run met that moment)."""
    return futures.Future.exception(result, 0)


def _reason(result) -> str:
    """Why a rank's call failed, in a line: the engine's death, or its exception."""
    err = _error(result)
    if err is None:
        return "unknown"
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[-1] if text else ''}"[:400].rstrip(".")


def _explained(result) -> str | None:
    """nbtune's own account of a rank's out of memory (``oom.explain``: the rank, the phase,
    what held memory and what to change), whole: written for the user, it names the rank."""
    err = _error(result)
    if err is None or getattr(err, "ename", None) != "OutOfMemory":
        return None
    return str(getattr(err, "evalue", "")).strip().rstrip(".") or None


def _out_of_memory(result) -> bool:
    """Whether a rank's call failed by running out of memory (torch's error, or nbtune's
    explained one), as ipyparallel names the exception it raised."""
    err = _error(result)
    return err is not None and getattr(err, "ename", type(err).__name__) in ("OutOfMemory", "OutOfMemoryError")


# ---- on each engine (ipyparallel pickles these by name: they run as nbtune code) ----------

def _host() -> tuple[str, int]:
    """This engine's machine (host name) and the process that started it."""
    return socket.gethostname(), os.getppid()


def _join(rank: int, world: int, port: int, path: str, overrides: dict, parent: int,
          controller: int | None, resume: str | None, build: bool, place: dict) -> dict:
    """Become rank ``rank``: the process group, then the run, as ``nbtune train`` builds it
    (from ``resume``'s checkpoint where given); returns what the kernel keeps of it. ``place``:
    its machine, its rank and their number there, the address of rank 0's machine, and
    whether the kernel started it (then it watches the kernel)."""
    from .. import runfile
    from . import factory
    from ..distributed import Parallel
    from ..liveness import end_with_parent

    os.environ.update(MASTER_ADDR=place["master"], MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(place["local_rank"]),
                      LOCAL_WORLD_SIZE=str(place["local_world"]), GROUP_RANK=str(place["machine"]))
    if place["watch"]:  # the kernel gone: this rank and the controller end
        end_with_parent(f"rank {rank}", parent, lambda: _end(controller), what="the kernel that started it")
    import torch
    from torch.distributed import TCPStore

    from ..liveness import Heartbeat

    ENGINE_STATE["beat"] = Heartbeat(  # (the kernel reads it: _listen)
        rank, world, _whereabouts, 0.0, say=lambda text: None, resume="", watch=False,
        store=TCPStore(place["master"], place["beats"], is_master=False, timeout=timedelta(seconds=30)))

    if not torch.cuda.is_available():  # the cores shared out, as torchrun does (OMP_NUM_THREADS)
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // place["local_world"]))
    config = runfile.load(path, overrides)
    parallel = Parallel.from_env(config.to_sharding())
    parallel.from_kernel = True  # (an out-of-memory error's advice is for the notebook)
    if not build:
        ENGINE_STATE.update(rank=rank, parallel=parallel)
        return {"step": 0, "techniques": config.to_techniques(), "pid": os.getpid()}
    run = factory.from_config(config, parallel=parallel)
    if resume is not None:
        run.load_checkpoint(resume)
    ENGINE_STATE.update(rank=rank, parallel=parallel, run=run)
    step, techniques = _where()
    return {"step": step, "techniques": techniques, "pid": os.getpid(), "config": run.model.config,
            "tokenizer": run.tokenizer, "source": run.source, "data_files": dict(run.data_files),
            "demo_name": run.demo_name, "settings": run.settings,
            "trainable": sum(p.numel() for p in run.model.parameters() if p.requires_grad),
            "match": run.match if isinstance(run.match, str) else "exact"}


def _whereabouts() -> str:
    """What this rank's heartbeat says it is doing."""
    run = ENGINE_STATE.get("run")
    return run.trainer.where() if run is not None else "while loading the model or between commands"


def _where() -> tuple:
    run = ENGINE_STATE["run"]
    return len(run.trainer.history), run.trainer.techniques


def _call(method: str, args: tuple, kwargs: dict):
    """``run.<method>(*args, **kwargs)`` on this rank's run; the answer as a plain value."""
    answer = getattr(ENGINE_STATE["run"], method)(*args, **kwargs)
    return str(answer) if answer is not None and not isinstance(answer, (int, float)) else answer


def rank_propose(new) -> str | None:
    """The first half of ``set`` on this rank: None when it could build ``new`` (Techniques),
    else why not."""
    trainer = ENGINE_STATE["run"].trainer
    try:
        ENGINE_STATE["proposal"] = trainer.prepare(new)
    except Exception as refused:  # noqa: BLE001 - told to the kernel, which tells every rank
        return str(refused)
    return None


def rank_settle(commit: bool) -> list[str]:
    """The second half: swap the prepared change in (``commit``) or drop it; what it noted."""
    trainer = ENGINE_STATE["run"].trainer
    prepared = ENGINE_STATE.pop("proposal", None)
    if prepared is None:
        return []
    if not commit:
        trainer.abort(prepared)
        return []
    trainer.commit(prepared)
    return trainer.take_notes()


def rank_steps(track: bool, track_rest: bool, most: int, flag: str) -> list[tuple]:
    """Up to ``most`` steps of this rank's trainer (``track``: measure the first's memory,
    ``track_rest``: the others'), each step's report and what it noted. They end early at
    the first step boundary where any rank sees the file ``flag`` (the kernel's Stop): one
    all-reduce of a number per boundary, so that every rank ends at the same step."""
    import torch

    trainer, parallel = ENGINE_STATE["run"].trainer, ENGINE_STATE["parallel"]
    taken: list[tuple] = []
    while len(taken) < most:
        if taken and parallel.sum_(torch.tensor([float(os.path.exists(flag))])).item():
            break
        report = trainer.step(track_rest if taken else track, True)
        taken.append((report, trainer.take_notes()))
    return taken


def _end(controller: int | None) -> None:
    """End the controller (the kernel that started it is gone)."""
    import signal

    if controller is not None:
        try:
            os.kill(controller, signal.SIGTERM)
        except OSError:
            pass


def _leave() -> None:
    parallel, beat = ENGINE_STATE.pop("parallel", None), ENGINE_STATE.pop("beat", None)
    ENGINE_STATE.clear()
    if beat is not None:
        beat.close()
    if parallel is not None:
        parallel.close()
