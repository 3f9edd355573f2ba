"""The README's line that opens the notebooks, run as it is written (as root where the tests
run as root, the default user of rented containers): JupyterLab serves the quickstart on the
machine's own address only."""

import os
import re
import shlex
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]


def readme_launch_line() -> list[str]:
    """The README's JupyterLab command, after its venv's activation."""
    block = re.search(r"## The notebooks\s+```bash\n(.*?)\n```", (ROOT / "README.md").read_text(), re.S)
    assert block, "README.md has no command under 'The notebooks'"
    line = block.group(1).strip()
    assert line.startswith(". .venv/bin/activate && jupyter lab "), line
    return shlex.split(line.split("&&", 1)[1])


def test_the_readme_launch_line_opens_the_quickstart_as_root_on_127_0_0_1_only(tmp_path):
    args = readme_launch_line()
    assert args[:2] == ["jupyter", "lab"] and "--allow-root" in args and "--no-browser" in args
    assert args[args.index("--ip") + 1] == "127.0.0.1"
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = dict(os.environ, JUPYTER_CONFIG_DIR=str(tmp_path / "config"),
               JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime"), JUPYTER_TOKEN="nbtune-launch-test")
    # the line as written; only the port is this test's (8888 may be taken)
    server = subprocess.Popen([sys.executable, "-m", "jupyterlab", *args[2:], f"--port={port}"],
                              cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True)
    try:
        deadline, page = time.monotonic() + 90, None
        while page is None:
            try:
                page = urllib.request.urlopen(f"http://127.0.0.1:{port}/lab/tree/notebooks/"
                                              "01_quickstart.ipynb?token=nbtune-launch-test", timeout=2)
            except OSError:
                if server.poll() is not None:
                    pytest.fail("JupyterLab ended at once: " + server.stdout.read()[-2000:])
                assert time.monotonic() < deadline, "JupyterLab did not answer within 90 s"
                time.sleep(0.5)
        assert page.status == 200 and b"JupyterLab" in page.read()
        # on the machine's own address only: nothing answers on another of its addresses
        try:
            outward = socket.gethostbyname(socket.gethostname())
        except OSError:  # (a sandbox without a name for itself: nothing else to try)
            outward = "127.0.0.1"
        if not outward.startswith("127."):
            with pytest.raises(OSError):
                socket.create_connection((outward, port), timeout=2).close()
    finally:
        server.terminate()
        try:
            output, _ = server.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
            output, _ = server.communicate()
    assert "Running as root is not recommended" not in output  # (refused as root without the flag)
