"""Whether the other processes of a job are still there, by side channels that do not go
through the collectives (which a hung rank blocks): a rank ends with the process that
started it (``end_with_parent``), and every rank beats in the job's store and names a rank
that falls silent (``Heartbeat``)."""

from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import sys
import threading
import time
from datetime import timedelta
from typing import Callable


PR_SET_PDEATHSIG = 1  # prctl(2): the signal this process gets when its parent dies


def end_with_parent(who: str, parent: int | None = None, before: Callable[[], None] | None = None,
                    what: str = "its parent") -> None:
    """End this process once ``parent`` (default: its parent now, as torchrun's agent is a
    rank's) is gone, however it died (SIGKILL, the OOM killer, a scheduler), saying so on
    stderr: no rank is left waiting in a collective, holding its memory (on a GPU, the card).
    A thread watches the parent's pid; on Linux the parent's death also sends SIGCONT, so a
    rank stopped meanwhile (SIGSTOP) wakes and its watch ends it. ``before()``: run first
    (an engine ends its controller)."""
    parent = os.getppid() if parent is None else parent
    if sys.platform.startswith("linux") and parent == os.getppid():
        try:  # (the kernel's own signal: it also reaches a process that is stopped)
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGCONT))
        except (OSError, AttributeError):
            pass

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        try:
            sys.stderr.write(f"\nnbtune: {who}: {what} (process {parent}) is gone (killed?): ending "
                             "this process, as nothing is left to run it.\n")
            sys.stderr.flush()
        except (OSError, ValueError):  # the parent held the other end of stderr
            pass
        if before is not None:
            before()
        os._exit(1)
    threading.Thread(target=watch, daemon=True, name="nbtune-parent-watch").start()


BEAT_SECONDS = 1.0  # how often a rank says it is there
HOST = socket.gethostname()  # (a silent rank on this machine is ended from here)
_PREFIX = "nbtune/beat/"
_TOLD = "nbtune/told"  # how many ranks tried to say a rank was lost (the first one does)


def ended(pid: int) -> bool:
    """Whether process ``pid`` on this machine has ended: gone, or a zombie not yet reaped
    (a rank SIGKILLed stays one until torchrun's agent or the kernel reaps it)."""
    import psutil  # (ipyparallel's dependency, so nbtune's)

    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _pulse(store, rank: int) -> list | None:
    """``rank``'s last pulse in ``store``: [count or "done", where, host, pid, machine]; None
    before its first."""
    key = f"{_PREFIX}{rank}"
    return json.loads(store.get(key)) if store.check([key]) else None


def last_heard(store, rank: int) -> str | None:
    """Where ``rank`` was when it last beat in ``store`` ("during the backward phase of step
    3"), None if it never beat or finished."""
    pulse = _pulse(store, rank)
    return None if pulse is None or pulse[0] == "done" else pulse[1]


class Pulses:
    """The ranks' pulses in a job's store as one watcher sees them (a rank, ``me``, or the
    notebook's kernel): which ranks on this machine ended (their process gone without
    finishing) and which stopped answering (a count that has not moved for ``hang`` seconds
    by the watcher's clock: machines' clocks need not agree)."""

    def __init__(self, store, world: int, hang: float, me: int | None = None) -> None:
        self.store, self.world, self.hang, self.me = store, world, hang, me
        self._seen: dict[int, tuple] = {}  # rank -> (its count, when it last moved)

    def read(self) -> dict[int, list]:
        """Every other rank's last pulse: [count or "done", where, host, pid, machine]."""
        return {rank: _pulse(self.store, rank) or [0, "while starting", "", 0, "0"]
                for rank in range(self.world) if rank != self.me}

    def lost(self) -> tuple[dict[int, list], list[int], list[int]]:
        """(every pulse, the ranks that ended, the ranks silent for ``hang``)."""
        heard, now = self.read(), time.monotonic()
        for rank, pulse in heard.items():
            if rank not in self._seen or self._seen[rank][0] != pulse[0]:
                self._seen[rank] = (pulse[0], now)
        gone = [rank for rank, pulse in heard.items()
                if pulse[0] != "done" and pulse[2] == HOST and pulse[3] and ended(pulse[3])]
        silent = [rank for rank, pulse in heard.items() if pulse[0] != "done" and rank not in gone
                  and now - self._seen[rank][1] > self.hang]
        return heard, gone, silent

    def words(self, heard: dict[int, list], gone: list[int], silent: list[int]) -> str:
        """The ranks ``gone`` and ``silent`` named (with their machine, where the job has
        several) and where each was last heard, in a line."""
        machines = len({_machine()} | {str(pulse[4]) for pulse in heard.values() if len(pulse) > 4}) > 1
        name = lambda r: f"rank {r}" + (f" (machine {heard[r][4]}, {heard[r][2]})"  # noqa: E731
                                        if machines and len(heard[r]) > 4 else "")
        return "; ".join(
            f"{name(r)} ended (its process is gone: killed or crashed; last heard {heard[r][1]})"
            if r in gone else
            f"{name(r)} stopped answering (no heartbeat for {self.hang:.0f} s; last heard {heard[r][1]})"
            for r in sorted(set(gone) | set(silent)))

    def kill_silent(self, heard: dict[int, list], silent: list[int]) -> None:
        """SIGKILL the silent ranks on this machine: a stopped process would otherwise wait
        for a SIGKILL, holding its memory (on a GPU, the card) meanwhile."""
        for rank in silent:
            if heard[rank][2] == HOST and heard[rank][3] not in (0, os.getpid()):
                try:
                    os.kill(heard[rank][3], signal.SIGKILL)
                except OSError:
                    pass


def _machine() -> str:
    """This machine's number in the job (torchrun's GROUP_RANK; the engines set it too)."""
    return os.environ.get("GROUP_RANK", "0")


def beat(store, rank: int, where: str, count: int) -> None:
    """One pulse of ``rank`` in ``store``."""
    store.set(f"{_PREFIX}{rank}", json.dumps([count, where, HOST, os.getpid(), _machine()]))


class Heartbeat:
    """This rank's pulse in the job's store (torchrun's, at ``MASTER_ADDR:MASTER_PORT``), from a
    thread of its own: a count and ``where()`` (its phase and step) every ``BEAT_SECONDS``.
    Under torchrun (``watch``) it also reads the other ranks' (``Pulses``): the first rank to
    see one ended or silent names it and where it was last heard, a beat before at most
    ("rank 1 stopped answering ...; last heard during the backward phase of step 41"); a
    silent rank on this machine is killed, every rank still beating ends, and torchrun ends
    the rest. ``close()`` names a rank that ended meanwhile (this rank may be ending because
    of it), then marks this rank done (a rank that finished is not waited for). From the
    notebook (not ``watch``), the kernel reads the pulses instead (``run.processes``)."""

    def __init__(self, rank: int, world: int, where: Callable[[], str], hang_seconds: float,
                 say: Callable[[str], None], resume: str, store=None, watch: bool = True) -> None:
        self.rank, self.where, self.hang, self.watch = rank, where, hang_seconds, watch
        self.say, self.resume = say, resume
        if store is None:
            import torch.distributed as dist

            store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                                  timeout=timedelta(seconds=max(10.0, hang_seconds)))
        self.store, self._stop = store, threading.Event()
        self.pulses = Pulses(store, world, hang_seconds, me=rank)
        self._thread = threading.Thread(target=self._run, daemon=True, name="nbtune-heartbeat")
        self._thread.start()

    def close(self) -> None:
        """Stop beating; name a rank that ended meanwhile; marked done, so that no rank names
        this one as hung."""
        self._stop.set()
        self._thread.join()
        try:
            if self.watch:
                heard, gone, _ = self.pulses.lost()
                if gone:
                    self._tell(heard, gone, [])
            self.store.set(f"{_PREFIX}{self.rank}", json.dumps(["done", ""]))
        except Exception:  # noqa: BLE001 - the store's host already gone: nothing waits on us
            pass

    def _run(self) -> None:
        count = 0
        try:
            while not self._stop.is_set():
                count += 1
                beat(self.store, self.rank, self.where(), count)
                if self.watch:
                    heard, gone, silent = self.pulses.lost()
                    if gone or silent:
                        if self._tell(heard, gone, silent):
                            self.pulses.kill_silent(heard, silent)
                        os._exit(1)
                self._stop.wait(BEAT_SECONDS)
        except Exception:  # noqa: BLE001 - the store is gone (the agent ended): end_with_parent's
            return

    def _tell(self, heard: dict[int, list], gone: list[int], silent: list[int]) -> bool:
        """Name the ranks ``gone`` and ``silent`` in one line, unless another rank already
        did (the first to see it says it: once); whether this rank did."""
        if self.store.add(_TOLD, 1) != 1:
            return False
        self.say(f"{self.pulses.words(heard, gone, silent)}: the job ends here on every rank. {self.resume}")
        return True
