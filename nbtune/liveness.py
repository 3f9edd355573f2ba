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


class Heartbeat:
    """This rank's pulse in the job's store (torchrun's, at ``MASTER_ADDR:MASTER_PORT``), from a
    thread of its own: a count and ``where()`` (its phase and step) every ``BEAT_SECONDS``; and
    the other ranks' pulses read. A rank whose count has not moved for ``hang_seconds`` (by
    this rank's clock: machines' clocks need not agree) stopped answering. The lowest rank
    still beating names it and where it was last heard, a beat before at most ("rank 1
    stopped answering ...; last heard during the backward phase of step 41"); a silent rank
    on this machine is killed, every rank still beating ends, and torchrun ends the rest.
    ``close()`` marks this rank done (a rank that finished is not waited for)."""

    def __init__(self, rank: int, world: int, where: Callable[[], str], hang_seconds: float,
                 say: Callable[[str], None], resume: str, store=None) -> None:
        self.rank, self.world, self.where, self.hang = rank, world, where, hang_seconds
        self.say, self.resume = say, resume
        if store is None:
            import torch.distributed as dist

            store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                                  timeout=timedelta(seconds=max(10.0, hang_seconds)))
        self.store, self._stop = store, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="nbtune-heartbeat")
        self._thread.start()

    def close(self) -> None:
        """Stop beating, marked done, so that no rank names this one as hung."""
        self._stop.set()
        self._thread.join()
        try:
            self.store.set(f"{_PREFIX}{self.rank}", json.dumps(["done", ""]))
        except Exception:  # noqa: BLE001 - the store's host already gone: nothing waits on us
            pass

    def _run(self) -> None:
        count, seen = 0, {}  # rank -> (its count, its where, when it last moved by our clock)
        try:
            while not self._stop.is_set():
                count += 1
                self.store.set(f"{_PREFIX}{self.rank}", json.dumps([count, self.where(), HOST, os.getpid()]))
                silent = self._silent(seen)
                if silent is not None:
                    self._end(*silent, seen)
                self._stop.wait(BEAT_SECONDS)
        except Exception:  # noqa: BLE001 - the store is gone (the agent ended): end_with_parent's
            return

    def _silent(self, seen: dict) -> tuple[int, str] | None:
        """The first rank silent for ``hang_seconds``, with its last words; else None."""
        now = time.monotonic()
        for rank in range(self.world):
            if rank == self.rank:
                continue
            key = f"{_PREFIX}{rank}"
            pulse = json.loads(self.store.get(key)) if self.store.check([key]) else [0, "while starting", "", 0]
            if pulse[0] == "done":
                seen[rank] = (pulse[0], "", now, None)
                continue
            if rank not in seen or seen[rank][0] != pulse[0]:
                seen[rank] = (pulse[0], pulse[1], now, pulse[3] if pulse[2] == HOST else None)
            elif now - seen[rank][2] > self.hang:
                return rank, seen[rank][1]
        return None

    def _end(self, rank: int, where: str, seen: dict) -> None:
        beating = [r for r in range(self.world) if r == self.rank or r not in seen or
                   seen[r][0] != "done" and time.monotonic() - seen[r][2] <= self.hang]
        if self.rank == min(beating):
            self.say(f"rank {rank} stopped answering (no heartbeat for {self.hang:.0f} s; last heard "
                     f"{where}): the job ends here on every rank. {self.resume}")
            for other, (count, _, _, pid) in seen.items():  # (a stopped rank here would wait for
                if other not in beating and count != "done" and pid not in (None, 0, os.getpid()):
                    try:  # torchrun's SIGKILL, holding its memory meanwhile)
                        os.kill(pid, signal.SIGKILL)
                    except OSError:
                        pass
        os._exit(1)
