"""Host memory of ipyparallel's controller as nbtune starts it (``--usethreads``: its schedulers
are threads) against its default (each scheduler a process of its own): the controller's
resident memory plus its children's, one engine attached, on an idle cluster.

    python benchmarks/controller_memory.py
"""

from __future__ import annotations

import tempfile

import ipyparallel as ipp
import psutil


def measured(args: list[str]) -> tuple[int, int]:
    """(processes, resident MiB) of a controller started with ``args`` and its children."""
    with tempfile.TemporaryDirectory() as folder:
        cluster = ipp.Cluster(n=1, profile_dir=folder, log_level=40, controller_args=args)
        client = cluster.start_and_connect_sync(activate=False)
        try:
            client.wait_for_engines(1, timeout=120)
            controller = psutil.Process(cluster.controller.process.pid)
            processes = [controller, *controller.children(recursive=True)]
            return len(processes), sum(p.memory_info().rss for p in processes) >> 20
        finally:
            client.close()
            cluster.stop_cluster_sync()


if __name__ == "__main__":
    for args in (["--nodb"], ["--nodb", "--usethreads"]):
        count, mib = measured(args)
        print(f"controller {' '.join(args):22s} {count} processes, {mib} MiB resident")
