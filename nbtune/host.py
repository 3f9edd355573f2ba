"""The host's memory: how much a new allocation may take now, container limits included.

A rented GPU usually runs in a container whose memory limit is below what the machine has,
and the kernel's own count (``MemAvailable``) does not know that limit: both are read here.
Budgets that hold host copies (the undo copy, ``fit``'s host check) ask this module.
"""

from __future__ import annotations

from pathlib import Path

# Kept free beside any budget: the notebook server, the kernel's own Python objects and the
# page cache the loader streams weights through. A share of the total, at least 1 GiB.
MARGIN_SHARE, MARGIN_MIN = 0.10, 1 << 30


def _meminfo(root: Path) -> dict[str, int]:
    out = {}
    try:
        for line in (root / "proc/meminfo").read_text().splitlines():
            name, _, rest = line.partition(":")
            parts = rest.split()
            if parts and parts[0].isdigit():
                out[name] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    except OSError:
        pass
    return out


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max": no limit


def _cgroup(root: Path) -> tuple[int | None, int | None]:
    """(limit, usage) of this process's memory cgroup (v2, else v1); None where unlimited or
    unreadable."""
    v2 = root / "sys/fs/cgroup"
    limit = _read_int(v2 / "memory.max")
    if limit is not None:
        return limit, _read_int(v2 / "memory.current")
    v1 = v2 / "memory"
    limit = _read_int(v1 / "memory.limit_in_bytes")
    if limit is not None and limit < 1 << 60:  # v1 writes a huge number for "no limit"
        return limit, _read_int(v1 / "memory.usage_in_bytes")
    return None, None


def total(root: Path = Path("/")) -> int | None:
    """Bytes of memory this process may use in all: the machine's, or its container's limit."""
    info = _meminfo(root)
    limit, _ = _cgroup(root)
    sizes = [v for v in (info.get("MemTotal"), limit) if v]
    if not sizes:
        try:
            import psutil
        except ImportError:
            return None
        return int(psutil.virtual_memory().total)
    return min(sizes)


def available(root: Path = Path("/")) -> int | None:
    """Bytes a new allocation may take now without swapping or the OOM killer: the kernel's
    ``MemAvailable``, capped by what the container's limit leaves; None where unknown."""
    info = _meminfo(root)
    limit, usage = _cgroup(root)
    sizes = []
    if "MemAvailable" in info:
        sizes.append(info["MemAvailable"])
    if limit is not None and usage is not None:
        sizes.append(max(0, limit - usage))
    if not sizes:
        try:
            import psutil
        except ImportError:
            return None
        return int(psutil.virtual_memory().available)
    return min(sizes)


def margin(whole: int | None) -> int:
    """What budgets leave free of a host of ``whole`` bytes."""
    return max(MARGIN_MIN, int(MARGIN_SHARE * (whole or 0)))


def room(held: int = 0, reserve: int = 0, root: Path = Path("/")) -> int | None:
    """Bytes a host copy may hold: what is available now plus ``held`` (the copy's own
    buffers, already allocated), less ``reserve`` (what the step will take on the host by
    itself: offloaded activations, paged optimizer state) and the margin. None where the
    host's memory cannot be read."""
    free = available(root)
    if free is None:
        return None
    return free + held - reserve - margin(total(root))
