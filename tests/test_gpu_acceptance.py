"""The GPU acceptance command stays runnable where CI runs: without CUDA it checks what a CPU
can (the estimate against measured peaks, on the tiny model) and skips every CUDA check,
saying so, in the same JSON a GPU run writes."""

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import gpu_acceptance  # noqa: E402


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU: run the command itself")
def test_runs_on_a_cpu_and_says_what_it_skipped(tmp_path, capsys):
    out = tmp_path / "gpu.json"
    assert gpu_acceptance.main(["--out", str(out)]) == 0
    record = json.loads(out.read_text())
    checks = {c["name"]: c for c in record["checks"]}
    assert set(checks) == {name for name, _, _ in gpu_acceptance.CHECKS}
    assert checks["estimate"]["status"] == "pass"
    assert checks["estimate"]["numbers"]["worst"] <= gpu_acceptance.ESTIMATE_TOLERANCE
    skipped = [c for c in record["checks"] if c["status"] == "skip"]
    assert len(skipped) == len(checks) - 1
    assert all(c["detail"] == "needs a CUDA GPU" for c in skipped)
    assert record["machine"]["torch"] == torch.__version__ and "card" not in record["machine"]
    printed = capsys.readouterr().out
    assert "dry run, CUDA checks skipped" in printed and f"wrote {out}" in printed
