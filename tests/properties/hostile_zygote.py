"""Runs hostile-file cases one at a time, each in a forked child with a memory cap and a
time limit (see test_hostile.py). Imports nbtune once, never runs torch itself, then forks
per case: a child starts in milliseconds and no OpenMP pool is shared across the fork.

Protocol: one case name per stdin line; one JSON line per case on stdout.
"""

import json
import os
import resource
import signal
import sys
import time
import traceback

import torch  # noqa: F401  (imported once here, before any fork)

import nbtune  # noqa: F401
import hostile_cases

MEMORY = 1 << 30  # what a case may add to the address space and the resident set
SECONDS = 10.0  # wall-clock kill; the test asserts the tighter CPU-time budget


def _vm_size() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


def _child(name: str, write_fd: int) -> None:
    resource.setrlimit(resource.RLIMIT_AS, (_vm_size() + MEMORY, resource.RLIM_INFINITY))
    torch.set_num_threads(1)
    started = time.process_time()
    try:
        result = hostile_cases.run(name)
    except MemoryError:
        result = {"outcome": "memory", "detail": traceback.format_exc(limit=-3)}
    result["cpu"] = time.process_time() - started
    with os.fdopen(write_fd, "w") as f:
        json.dump(result, f, default=str)
    os._exit(0)


def run_one(name: str) -> dict:
    read_fd, write_fd = os.pipe()
    baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    started = time.monotonic()
    pid = os.fork()
    if pid == 0:
        os.close(read_fd)
        _child(name, write_fd)
    os.close(write_fd)
    chunks = []
    killed = False
    os.set_blocking(read_fd, False)
    while True:
        try:
            chunk = os.read(read_fd, 1 << 16)
        except BlockingIOError:
            chunk = None
        if chunk:
            chunks.append(chunk)
        done, status, usage = os.wait4(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() - started > SECONDS:
            os.kill(pid, signal.SIGKILL)
            killed = True
        time.sleep(0.005)
    os.set_blocking(read_fd, True)
    while chunk := os.read(read_fd, 1 << 16):
        chunks.append(chunk)
    os.close(read_fd)
    text = b"".join(chunks).decode()
    result = json.loads(text) if text else {"outcome": "killed" if killed else "crashed",
                                            "status": status}
    result["seconds"] = time.monotonic() - started
    result["rss_growth"] = usage.ru_maxrss * 1024 - baseline
    return result


if __name__ == "__main__":
    for line in sys.stdin:
        print(json.dumps(run_one(line.strip()), default=str), flush=True)
