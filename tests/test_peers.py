"""benchmarks/peers.py on tiny shapes: the same work in every framework, counted one way."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

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
    batch = {"input_ids": torch.zeros(2, 50, dtype=torch.long)}  # a batch given to the step: 800
    counter.hold(held, batch)
    with counter:
        a = torch.ones(1000)  # 4,000 bytes
        b = a.view(10, 100)  # a view: no new storage
        del a, b
        c = torch.zeros(500)  # 2,000 bytes, after 4,000 were freed
    assert counter.peak == 8800
    assert counter.now == 6800 and c.numel() == 500


def test_each_peer_step_pairs_with_nbtunes_step_of_its_cycle_in_every_round():
    runs = {"nbtune": [{"step_seconds": [1.0, 2.0]}, {"step_seconds": [4.0, 1.0]}],
            "torchtune": [{"step_seconds": [2.0, 2.0]}, {"step_seconds": [2.0, 3.0]}],
            "transformers": [{"error": "out of memory"}, {"step_seconds": [8.0, 1.0]}]}
    paired = peers().paired_ratios(runs)
    assert paired["torchtune"] == {"median": 1.5, "q1": 0.625, "q3": 2.75, "steps": 4}  # 2, 1, 0.5, 3
    assert paired["transformers"] == {"median": 1.5, "steps": 2}  # the failed round pairs nothing


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
         "--steps", "2", "--frameworks", "nbtune,transformers", "--rungs",
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
        # each framework's timed steps, interleaved: nbtune's speed over the peer's, step by step
        mine, peer = (rows[label]["runs"][f][0]["step_seconds"] for f in ("nbtune", "transformers"))
        assert len(mine) == len(peer) == 2 and ratios["per_step_vs"]["transformers"]["steps"] == 2
        assert ratios["per_step_vs"]["transformers"]["median"] == pytest.approx(
            (peer[0] / mine[0] + peer[1] / mine[1]) / 2)
    # full finetuning holds at least weights + gradients + two AdamW states: 16 bytes a weight
    weights = sum(t.numel() for t in load_file(str(Path(result["inputs"]) / "model" / "model.safetensors")).values())
    assert rows["full fp32"]["summary"]["transformers"]["peak_bytes"] >= 16 * weights
    assert rows["full fp32"]["summary"]["nbtune"]["peak_bytes"] >= 16 * weights
    assert rows["+ chunked loss"]["not_available"] == ["transformers"]
    assert result["malloc"] == peers().KEEP_FREED  # every worker's glibc reuses freed blocks,
    for run in rows["LoRA"]["runs"].values():  # as each worker saw it
        assert run[0]["malloc_env"] == result["malloc"] and len(run[0]["page_faults"]) == 2


def test_workers_reuse_freed_memory_on_a_cpu_only_unless_asked_not_to():
    module = peers()
    assert module.worker_env(SimpleNamespace(device="cpu", malloc="keep"))["MALLOC_MMAP_MAX_"] == "0"
    for device, malloc in (("cpu", "system"), ("cuda", "keep")):
        env = module.worker_env(SimpleNamespace(device=device, malloc=malloc))
        assert env.get("MALLOC_MMAP_MAX_") == os.environ.get("MALLOC_MMAP_MAX_")
        assert env["HF_HUB_OFFLINE"] == "1"


def test_long_context_gives_the_workers_every_option_they_read(tmp_path):
    spec = importlib.util.spec_from_file_location("long_context", ROOT / "benchmarks" / "long_context.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    options = module.worker_options(SimpleNamespace(steps=2, timeout=60), 4096)
    command = module.peers._command(sys.executable, "nbtune", {}, options, tmp_path)
    assert command[command.index("--seq") + 1] == "4096" and "--cap-gib" not in command
    # its results so far were taken with glibc's defaults: it keeps them
    assert module.peers.worker_env(options).get("MALLOC_MMAP_MAX_") == os.environ.get("MALLOC_MMAP_MAX_")
