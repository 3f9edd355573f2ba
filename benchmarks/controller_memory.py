"""Host memory of ipyparallel's controller as nbtune starts it (``--usethreads``: its schedulers
are threads) against its default (each scheduler a process of its own): the proportional set
size (PSS) of the controller and its children, one engine attached, on an idle cluster. PSS
counts a page shared by several processes once in all (the schedulers are forks of the
controller: their resident sizes would count its pages again in each).

    python benchmarks/controller_memory.py
"""

from __future__ import annotations

import tempfile

import ipyparallel as ipp
import psutil


def measured(args: list[str]) -> tuple[int, int, int]:
    """(processes, PSS MiB, resident MiB summed) of a controller started with ``args`` and its children."""
    with tempfile.TemporaryDirectory() as folder:
        cluster = ipp.Cluster(n=1, profile_dir=folder, log_level=40, controller_args=args)
        try:
            client = cluster.start_and_connect_sync(activate=False)
            client.wait_for_engines(1, timeout=120)
            controller = psutil.Process(cluster.controller.process.pid)
            processes = [controller, *controller.children(recursive=True)]
            infos = [p.memory_full_info() for p in processes]
            client.close()
            return len(processes), sum(i.pss for i in infos) >> 20, sum(i.rss for i in infos) >> 20
        finally:
            cluster.stop_cluster_sync()


if __name__ == "__main__":
    for args in (["--nodb"], ["--nodb", "--usethreads"]):
        count, pss, rss = measured(args)
        print(f"controller {' '.join(args):22s} {count} processes, {pss} MiB (PSS; {rss} MiB resident summed)")
