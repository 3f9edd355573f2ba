"""``nbtune train`` under torchrun with one fault planted in rank 1, for the catalogue of rank
faults in tests/cli/test_rank_faults.py:

    torchrun ... tests/fault_worker.py FAULT STEP train run.yaml --out OUT ...

FAULT: ``loading`` (rank 1 killed while it loads the model), ``forward``, ``backward``,
``optimizer`` (killed in that phase of step STEP), ``between`` (killed after step STEP is
recorded, before the next), ``write`` (killed while it writes its part of the checkpoint
after step STEP), ``disk-full`` (its part of that checkpoint fails: no space left). A killed
rank first stays in place for two heartbeats, so that its last words are that place: a real
fault strikes a phase that lasts a second or more (a step of an 8B model), not the
milliseconds a tiny one takes. Only rank 1 is touched, and only through nbtune's own
functions: the other rank runs nbtune unchanged."""

import errno
import os
import signal
import sys
import time

import nbtune.checkpoint
import nbtune.run.factory
import nbtune.step
from nbtune.cli.main import main


def _die() -> None:
    time.sleep(2.5)  # heard there (the heartbeat beats every second)
    os.kill(os.getpid(), signal.SIGKILL)


def plant(fault: str, step: int) -> None:
    steps = [0]  # this rank's steps begun (a resumed run starts past the checkpoint's)

    if fault == "loading":
        real_build = nbtune.run.factory.from_config

        def build(*args, **kwargs):
            _die()
            return real_build(*args, **kwargs)
        nbtune.run.factory.from_config = build
    elif fault in ("forward", "backward", "optimizer"):
        Phases = nbtune.step._Phases
        hook = {"forward": "before_forward", "backward": "after_forward", "optimizer": "before_optimizer"}[fault]
        real, real_enter = getattr(Phases, hook), Phases.__enter__

        def enter(self):
            steps[0] += 1
            return real_enter(self)

        def phase(self):
            real(self)
            if steps[0] == step:
                _die()
        Phases.__enter__ = enter
        setattr(Phases, hook, phase)
    elif fault in ("between", "write", "disk-full"):
        from nbtune.run import checkpoints

        real_after = checkpoints.StepCheckpoints.after_step
        real_save = nbtune.checkpoint.save_file

        def after_step(self, report):
            if fault == "between" and report.step == step:
                _die()
            steps[0] = report.step
            return real_after(self, report)

        def save_file(tensors, path, *args, **kwargs):
            if steps[0] == step and "optimizer" in os.path.basename(str(path)):
                if fault == "write":
                    _die()
                raise OSError(errno.ENOSPC, "No space left on device", str(path))
            return real_save(tensors, path, *args, **kwargs)
        checkpoints.StepCheckpoints.after_step = after_step
        nbtune.checkpoint.save_file = save_file
    else:
        raise SystemExit(f"fault_worker: unknown fault {fault!r}")


if __name__ == "__main__":
    fault, step = sys.argv[1], int(sys.argv[2])
    if os.environ.get("RANK") == "1":
        plant(fault, step)
    sys.exit(main(sys.argv[3:]))
