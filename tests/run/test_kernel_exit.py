"""A background run in a real Jupyter kernel, and the kernel stopped under it: by SIGTERM (a
machine stopped) and by a shutdown request (JupyterLab's "Shut Down Kernel"). The run's last
completed step is saved to the folder named in ``session.start(checkpoint=...)``, and the
checkpoint resumed gives bit for bit the losses of a run that was never stopped."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from helpers import small_session

jupyter_client = pytest.importorskip("jupyter_client")
pytestmark = pytest.mark.slow

TESTS = Path(__file__).resolve().parents[1]  # tests/, for helpers


def _kernel_training(folder: Path):
    """A kernel whose session trains in the background, armed to save to ``folder``; returns
    the kernel manager and client once it has completed a few steps."""
    km = jupyter_client.KernelManager(kernel_name="python3")
    km.start_kernel(env={**__import__("os").environ, "HF_HUB_OFFLINE": "1",
                         "PYTHONPATH": f"{TESTS.parent}:{TESTS}"})
    kc = km.client()
    kc.start_channels()
    kc.wait_for_ready(timeout=120)
    code = (f"from helpers import small_session\ns = small_session()\n"
            f"run = s.start(100_000, checkpoint={str(folder)!r})\n")
    reply = kc.execute_interactive(code, timeout=120)
    assert reply["content"]["status"] == "ok", reply["content"]
    steps = []
    deadline = time.monotonic() + 120
    while not steps or steps[-1] < 5:  # a few steps done
        assert time.monotonic() < deadline, "the run made no steps"
        kc.execute_interactive("print(len(s.history))", timeout=60,
                               output_hook=lambda m: steps.append(int(m["content"]["text"]))
                               if m["msg_type"] == "stream" else None)
        time.sleep(0.2)
    return km, kc


def _resumes_like_a_run_never_stopped(folder: Path) -> None:
    resumed = small_session()
    resumed.load_checkpoint(folder)
    done = len(resumed.history)
    assert done >= 5
    resumed.run(3, progress=False, live=False)
    twin = small_session()
    twin.run(done + 3, progress=False, live=False)
    assert [r.loss for r in resumed.history] == [r.loss for r in twin.history]


def test_sigterm_to_a_kernel_saves_the_background_run_and_exits_143(tmp_path):
    folder = tmp_path / "saved"
    km, kc = _kernel_training(folder)
    try:
        process = km.provisioner.process
        process.send_signal(signal.SIGTERM)
        code = process.wait(120)
    finally:
        kc.stop_channels()
        if km.is_alive():
            km.shutdown_kernel(now=True)
    assert code == 128 + signal.SIGTERM
    assert (folder / "trainer_state.json").is_file()
    _resumes_like_a_run_never_stopped(folder)


def test_shutting_the_kernel_down_saves_the_background_run(tmp_path):
    folder = tmp_path / "saved"
    km, kc = _kernel_training(folder)
    try:
        km.shutdown_kernel(now=False)  # a shutdown request, as JupyterLab sends
    finally:
        kc.stop_channels()
    assert not km.is_alive()
    assert (folder / "trainer_state.json").is_file()
    _resumes_like_a_run_never_stopped(folder)
