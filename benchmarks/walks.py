"""The walks a maintainer takes through the code (issue 54): which of nbtune's files a
command passes through, in order, as a profiler sees the calls and returns.

``sys.setprofile`` records every Python call into and return out of nbtune's own files (other
packages and C code are skipped: the walk stays where the last nbtune frame is). The walk is
the sequence of files the innermost nbtune frame is in; staying in one file is one stop.
Reported per walk:

* **files**: distinct files the walk stops in;
* **calls**: distinct calls from one file into another (a pair of files counts once, however
  often a loop repeats it);
* **up**: of those, calls into a file of a higher layer than the caller's
  (``tests/test_layers.py``'s ``LAYERS``: back up to a front end, a run's control, a
  subscriber);
* **returns**: of those, calls into a file the walk had left before (not by a call) when the
  call was first made: the reader goes back to a file already read.

Walks: ``nbtune train`` of the tiny demo for one step (in this process, through ``cli.main``),
a panel click mid-run (``session.set`` during a background run, and its application at the
next step boundary), ``nt.estimate`` of Llama-3.1-8B on two ranks (fake tensors), a
session's ``from_config`` with a run file (the run built) and one ``step``, and the same on two
processes the notebook drives (the kernel's side: the ranks' own calls are in their processes).

    python benchmarks/walks.py            # about two minutes on 2 cores
"""

from __future__ import annotations

import json
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import nbtune as nt  # noqa: E402
from test_layers import _layer  # noqa: E402

PACKAGE = Path(nt.__file__).parent


def _module(filename: str) -> str | None:
    path = Path(filename)
    try:
        parts = path.resolve().relative_to(PACKAGE).with_suffix("").parts
    except ValueError:
        return None
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


class Walk:
    """The files a command's nbtune frames are in, moment by moment (one thread's)."""

    def __init__(self) -> None:
        self.moves: list[tuple[str, str, str]] = []  # (from, to, "call" | "return")
        self._stack: list[str | None] = []
        self._thread = threading.get_ident()

    def _where(self) -> str | None:
        return next((m for m in reversed(self._stack) if m is not None), None)

    def __call__(self, frame, event, arg) -> None:
        if threading.get_ident() != self._thread or event not in ("call", "return"):
            return
        before = self._where()
        if event == "call":
            self._stack.append(_module(frame.f_code.co_filename))
        elif self._stack:
            self._stack.pop()
        after = self._where()
        if before is not None and after is not None and before != after:
            self.moves.append((before, after, event))

    def __enter__(self) -> "Walk":
        sys.setprofile(self)
        return self

    def __exit__(self, *exc) -> None:
        sys.setprofile(None)

    def summary(self) -> dict:
        seen, left, calls, up, returns = set(), set(), set(), 0, 0
        for source, target, event in self.moves:
            seen |= {source, target}
            if event == "call" and (source, target) not in calls:
                calls.add((source, target))
                up += _layer(target) > _layer(source)
                returns += target in left
            if event == "return":
                left.add(source)  # read to its end for now: entering it again goes back
        return {"files": len(seen), "calls": len(calls), "up": up, "returns": returns}


def walk(command) -> dict:
    with Walk() as w:
        command()
    return w.summary()


def main() -> None:
    import nbtune.cli.main as cli

    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        session = nt.Session.demo(device="cpu")
        session.echo = False
        path = session.save_config(tmp / "run.yaml", steps=1)
        results["nbtune train (1 step)"] = walk(lambda: cli.main(
            ["train", str(path), "--out", str(tmp / "out")]))

        run = session.start(3)
        while len(run.reports) < 1:
            time.sleep(0.01)
        results["panel click mid-run: set"] = walk(lambda: session.set(lr=3e-4))
        run.wait()
        session.set(lr=1e-3)
        results["estimate(llama-3.1-8b, ranks=2)"] = walk(
            lambda: nt.estimate("llama-3.1-8b", nt.Techniques(method="qlora", dtype="bf16"), ranks=2))

        def built_and_stepped() -> None:
            s = nt.Session.from_config(path)
            s.echo = False
            s.step()
        results["Session.from_config(run file).step()"] = walk(built_and_stepped)

        def on_two_processes() -> None:
            s = nt.Session.from_config(path, processes=2)
            try:
                s.echo = False
                s.step()
            finally:
                s.close()
        results["Session.from_config(run file, processes=2).step()"] = walk(on_two_processes)
    for name, numbers in results.items():
        print(f"{name:42s} " + "  ".join(f"{k} {v:4d}" for k, v in numbers.items()))
    out = ROOT / "benchmarks" / "results" / "walks.json"
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"written to {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
