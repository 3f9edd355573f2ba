"""benchmarks/peers.py on tiny shapes: the same work in every framework, counted one way."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]


def peers():
    spec = importlib.util.spec_from_file_location("peers", ROOT / "benchmarks" / "peers.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_live_bytes_counts_what_is_held_and_made_and_forgets_what_is_freed():
    counter = peers().live_bytes_mode()
    held = torch.nn.Linear(100, 10, bias=False)  # 4,000 bytes
    counter.hold(held)
    with counter:
        a = torch.ones(1000)  # 4,000 bytes
        b = a.view(10, 100)  # a view: no new storage
        del a, b
        c = torch.zeros(500)  # 2,000 bytes, after 4,000 were freed
    assert counter.peak == 8000
    assert counter.now == 6000 and c.numel() == 500


def test_a_skipped_rung_is_not_carried_into_the_next():
    rows = {label: (config, why) for label, config, why in peers().rung_configs("cpu", bf16_slow=250.0)}
    assert "bf16" in rows["+ bf16"][1] and "offloading" in rows["+ activation offloading"][1]
    config, why = rows["+ 8-bit AdamW"]
    assert why is None and "dtype" not in config and "offloading" not in config
    assert config["checkpointing"] and config["chunked_loss"] and config["adamw8bit"]
    assert rows["LoRA"][0] == {"checkpointing": True, "lora": True}


@pytest.mark.slow
def test_nbtune_and_transformers_do_the_same_work_on_a_tiny_shape(tmp_path):
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "peers.py"), "--shape", "tiny", "--rounds", "1",
         "--steps", "1", "--frameworks", "nbtune,transformers", "--rungs",
         "full fp32,+ chunked loss,LoRA", "--out", str(tmp_path), "--inputs", str(tmp_path / "inputs")],
        capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads((tmp_path / "peers-tiny-cpu.json").read_text())
    rows = {r["rung"]: r for r in result["rows"]}
    for label in ("full fp32", "LoRA"):
        ours, theirs = rows[label]["summary"]["nbtune"], rows[label]["summary"]["transformers"]
        assert abs(ours["first_loss"] - theirs["first_loss"]) < 1e-4  # same weights, same batches
        assert ours["peak_bytes"] > 0 and theirs["peak_bytes"] > 0
        ratios = rows[label]["summary"]["ratios"]
        assert ratios["peak_vs_best_peer"] == ours["peak_bytes"] / theirs["peak_bytes"]
    # full finetuning holds at least weights + gradients + two AdamW states: 16 bytes a weight
    weights = sum(t.numel() for t in load_file(str(Path(result["inputs"]) / "model" / "model.safetensors")).values())
    assert rows["full fp32"]["summary"]["transformers"]["peak_bytes"] >= 16 * weights
    assert rows["full fp32"]["summary"]["nbtune"]["peak_bytes"] >= 16 * weights
    assert rows["+ chunked loss"]["not_available"] == ["transformers"]
