"""FSDP2 under torchrun, proven on CPU with two gloo ranks against one process on the same run file."""

import contextlib
import json
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

import nbtune.cli.main as cli
from nbtune import runfile
from nbtune.techniques import Techniques
from nbtune.distributed import Parallel, Sharding, check_sharding, shard_model
from nbtune.models import demo_model_dir, load_model

from helpers import tiny_llama, torchrun

RUN = "demo: tiny\ntechniques: {{{techniques}}}\nrun: {{steps: {steps}, checkpoint_every: 2, save: [{save}]}}\n"
FULL = "batch_size: 4, seq_len: 96, lr: 1e-3"
LORA = ("method: lora, batch_size: 4, seq_len: 96, lr: 1e-3, lora_rank: 4, grad_accum: 2, "
        "max_grad_norm: 1.0")
QLORA = "method: qlora, batch_size: 4, seq_len: 96, lr: 1e-3, lora_rank: 4"


def run_file(tmp_path, techniques, steps=4, save="hf"):
    path = tmp_path / "run.yaml"
    path.write_text(RUN.format(techniques=techniques, steps=steps, save=save))
    return path


def metrics(out, name="metrics.jsonl"):
    return [json.loads(line) for line in (out / name).read_text().splitlines()]


def weights(out, folder="final"):
    folder = out / folder
    name = "adapter_model.safetensors" if (folder / "adapter_model.safetensors").exists() else "model.safetensors"
    return load_file(str(folder / name))


def close(a, b, tol=1e-5):
    assert a.keys() == b.keys()
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    assert worst <= tol, worst


@pytest.mark.slow
@pytest.mark.parametrize("techniques, ranks", [(FULL, 2), (LORA, 2), (QLORA, 2), (QLORA, 4)],
                         ids=["full", "lora", "qlora", "qlora-4-ranks"])
def test_ranks_equal_one_process_and_hold_their_share_of_the_state_each(tmp_path, techniques, ranks):
    """QLoRA: the NF4 base sharded through torchao's FSDP2 extension (5 steps); its adapter
    and its merged save (the base dequantized plus the update) equal one process's."""
    adapters = techniques != FULL
    steps = 5 if techniques == QLORA else 3
    gguf = techniques == QLORA and ranks == 2
    saves = "hf, merged, gguf" if gguf else "hf, merged" if adapters else "hf"
    path = run_file(tmp_path, techniques, steps=steps, save=saves)
    assert cli.main(["train", str(path), "--out", str(tmp_path / "one")]) == 0
    done = torchrun(path, tmp_path / "two", ranks=ranks)
    one, two = metrics(tmp_path / "one"), metrics(tmp_path / "two")
    other = metrics(tmp_path / "two", f"metrics.rank{ranks - 1}.jsonl")
    assert [m["step"] for m in two] == list(range(1, steps + 1)) and {m["rank"] for m in other} == {ranks - 1}
    for a, b, c in zip(one, two, other):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 and b["loss"] == c["loss"]  # the global loss
        assert a["tokens"] == b["tokens"]  # every rank reports the global batch's tokens
    close(weights(tmp_path / "one"), weights(tmp_path / "two"))
    if adapters:
        close(weights(tmp_path / "one", "merged"), weights(tmp_path / "two", "merged"))
    if gguf:  # f16 tensors: a weight 1e-7 apart may round to the neighbouring f16 value
        from gguf import GGUFReader

        one_file, two_file = (GGUFReader(str(tmp_path / run / "gguf" / "model.gguf")) for run in ("one", "two"))
        assert [t.name for t in one_file.tensors] == [t.name for t in two_file.tensors]
        for a, b in zip(one_file.tensors, two_file.tensors):
            if a.data.dtype == np.float16:
                assert np.abs(a.data.view(np.int16).astype(int) - b.data.view(np.int16).astype(int)).max() <= 1
            else:
                np.testing.assert_allclose(a.data, b.data, rtol=0, atol=1e-5)
    # the tracker's per-rank bytes: each rank holds its share of the weights (LoRA: the frozen
    # base too; QLoRA: its NF4 codes and scales), gradients and optimizer state
    single = one[0]["memory"]
    for rank in (two[0], other[0]):
        for key in ("parameters", "gradients", "optimizer_state"):
            assert abs(rank["memory"][key] / single[key] - 1 / ranks) < 0.02, (key, rank["memory"], single)
    assert "memory per rank" in done.stdout and f"   {ranks - 1} " in done.stdout
    assert "unwaited" not in done.stderr  # the gathered save waits for every collective it starts


@pytest.mark.slow
@pytest.mark.parametrize("techniques", [FULL, QLORA], ids=["full", "qlora"])
def test_sharded_checkpoint_then_resume_equals_an_uninterrupted_run(tmp_path, techniques):
    path = run_file(tmp_path, techniques, steps=4)
    torchrun(path, tmp_path / "whole")
    torchrun(path, tmp_path / "cut", "--steps", "2")
    first = json.loads((tmp_path / "cut" / "checkpoints" / "step-00000002" / "trainer_state.json").read_text())
    assert first["sharded"] and first["world"] == 2
    folder = tmp_path / "cut" / "checkpoints" / "step-00000002"  # each rank its own files, no pickle
    assert {p.name for p in folder.iterdir()} == {"trainer_state.json", "rank0.json", "rank1.json"} | {
        f"{kind}.rank{rank}.safetensors" for kind in ("model", "optimizer", "rng") for rank in (0, 1)}
    done = torchrun(path, tmp_path / "cut", "--resume")
    assert "resumed from" in done.stdout
    assert [m["loss"] for m in metrics(tmp_path / "cut")] == [m["loss"] for m in metrics(tmp_path / "whole")]
    close(weights(tmp_path / "whole"), weights(tmp_path / "cut"), tol=0.0)


@pytest.mark.slow
def test_the_optimizer_steps_each_sharded_gradient_in_backward(tmp_path):
    """FSDP2 calls a sharded weight's post-accumulate-grad hook after its reduce-scatter:
    stepping there gives the weights of the ordinary step, with no gradients held at the peak."""
    torchrun(run_file(tmp_path, FULL + ", optimizer_in_backward: true", steps=5), tmp_path / "in")
    torchrun(run_file(tmp_path, FULL, steps=5), tmp_path / "after")
    inside, after = metrics(tmp_path / "in"), metrics(tmp_path / "after")
    assert [m["loss"] for m in inside] == [m["loss"] for m in after]
    close(weights(tmp_path / "in"), weights(tmp_path / "after"), tol=0.0)
    assert inside[-1]["memory"]["gradients"] == 0 < after[-1]["memory"]["gradients"]


DRIVER = """\
import os, sys, time
import nbtune.optim as optim
import nbtune.cli.main as cli

real, calls = optim._step_in_backward, [0]

def poisoned(owner, index, param):  # rank 1's shard of the third weight written: NaN
    calls[0] += 1
    if calls[0] == 3 and os.environ["RANK"] == "1":
        param.grad.to_local().view(-1)[0] = float("nan")
    return real(owner, index, param)

optim._step_in_backward = poisoned
code = cli.main(["train", *sys.argv[1:]])
time.sleep(5)  # torchrun ends every rank once one exits: a slower rank that stopped must be heard
sys.exit(code)
"""


@pytest.mark.slow
def test_a_nan_in_one_ranks_shard_stops_every_rank_with_one_message(tmp_path):
    """With the optimizer in backward under FSDP2 each rank checks its own shard of a gradient:
    a NaN on rank 1's shard alone must stop both ranks at the same weight (they sum their
    verdicts; a rank that went on alone would hang its collectives), each saying which tensor
    in one message (no traceback) and how to go on."""
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc_per_node", "2", str(driver),
                           str(run_file(tmp_path, FULL + ", optimizer_in_backward: true", steps=3)),
                           "--out", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    said = [line for line in done.stderr.splitlines() if line.startswith("nbtune train: Step 1")]
    assert len(said) == 2, done.stderr[-3000:]  # each rank, the same words
    assert said[0] == said[1] and "the gradient of model.layers.3.self_attn.k_proj.weight is not finite" in said[0]
    assert "Across processes no copy is kept" in said[0]
    assert f"--resume --out {tmp_path / 'out'}" in done.stderr
    assert "[rank0]: Traceback" not in done.stderr and "[rank1]: Traceback" not in done.stderr


@pytest.fixture
def one_rank_group():
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    yield
    dist.destroy_process_group()


def test_each_sharding_setting_reaches_fsdp(one_rank_group, tmp_path):
    from torch.distributed.fsdp import FSDPModule

    def sharded(sharding, folder=None):
        model = load_model(folder or demo_model_dir(), dtype="fp32", device="cpu")
        shard_model(model, sharding)
        hidden = model.hidden_states(torch.randint(0, 90, (1, 8)))
        return model, hidden, model.model.layers[0].mlp.up_proj.weight

    _, _, weight = sharded(Sharding())
    assert type(weight).__name__ == "DTensor"  # resharded after forward
    _, _, weight = sharded(Sharding(reshard_after_forward=False))
    assert type(weight).__name__ != "DTensor" and weight.dtype == torch.float32
    _, hidden, weight = sharded(Sharding(reshard_after_forward=False, mixed_precision="bf16"))
    assert weight.dtype == torch.bfloat16 and hidden.dtype == torch.bfloat16
    tiny_llama(tmp_path / "untied", tie=False, safe_serialization=True)
    model, _, _ = sharded(Sharding(shard_embeddings=True), tmp_path / "untied")
    assert isinstance(model.model.embed_tokens, FSDPModule) and isinstance(model.lm_head, FSDPModule)
    model, _, _ = sharded(Sharding(), tmp_path / "untied")
    assert not isinstance(model.model.embed_tokens, FSDPModule)


def test_sharding_refusals_name_the_setting_and_the_fix():
    model = load_model(demo_model_dir(), dtype="fp32", device="cpu")  # tied embeddings
    full = Techniques()
    assert any("shard_embeddings: false" in p for p in check_sharding(Sharding(shard_embeddings=True),
                                                                      model, full, "cpu"))
    assert any("cpu_offload: false" in p for p in check_sharding(Sharding(cpu_offload=True), model,
                                                                 full, "cpu"))
    assert not check_sharding(Sharding(cpu_offload=True), model, full, "cuda")
    qlora = Techniques(method="qlora", lora_rank=4)
    for world in (2, 4, 8):  # the demo's layers split over up to 8 ranks (whole NF4 blocks each)
        assert not check_sharding(Sharding(), model, qlora, "cpu", world)
    # 3 ranks: 384-row projections split, but the 128-row q_proj's codes and scales do not
    (problem,) = check_sharding(Sharding(), model, qlora, "cpu", 3)
    assert "cannot split model.layers.0.self_attn.q_proj (128, 128)" in problem and "over 3 ranks" in problem
    assert "use 2, 4 or 8 processes" in problem
    assert not check_sharding(Sharding(), model, Techniques(method="lora", lora_rank=4), "cpu", 3)
    parallel = Parallel(rank=1, world=2, local_rank=1, sharding=Sharding())
    batch = {"input_ids": torch.arange(8).reshape(4, 2), "labels": torch.arange(8).reshape(4, 2)}
    assert parallel.rows(batch)["input_ids"].tolist() == [[4, 5], [6, 7]]
    with pytest.raises(ValueError, match="batch_size=3 does not split over 2 ranks"):
        parallel.rows({k: v[:3] for k, v in batch.items()})


def test_the_run_file_checks_its_distributed_section(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("demo: tiny\ndistributed:\n  mixed_precision: fp16\n  reshard: false\n")
    with pytest.raises(runfile.RunFileError) as err:
        runfile.load(path)
    assert "line 3, distributed.mixed_precision" in str(err.value)
    assert "line 4, distributed.reshard: unknown field" in str(err.value)
    path.write_text("demo: tiny\ndistributed: {reshard_after_forward: false, mixed_precision: bf16}\n")
    assert runfile.load(path).to_sharding() == Sharding(reshard_after_forward=False, mixed_precision="bf16")


@pytest.mark.slow
def test_the_fsdp_ladder_measures_each_row_per_rank_and_says_why_a_row_is_refused(tmp_path):
    path = run_file(tmp_path, FULL)
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc_per_node", "2", "-m", "nbtune", "ladder", str(path),
                           "--out", str(tmp_path / "ladder")],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {r["label"]: r for r in json.loads((tmp_path / "ladder" / "ladder.json").read_text())["rows"]}
    assert list(rows) == ["FSDP2", "+ activation checkpointing", "+ CPU offload",
                          "+ sharded embeddings", "+ chunked loss"]
    assert len(rows["FSDP2"]["per_rank"]) == 2
    assert rows["+ activation checkpointing"]["peak"] < rows["FSDP2"]["peak"]
    assert "CUDA" in rows["+ CPU offload"]["refused"]  # CPU: the weights are already in CPU memory
    assert "tie_word_embeddings" in rows["+ sharded embeddings"]["refused"]
    assert rows["+ chunked loss"]["changes"] == {"techniques.activation_checkpointing": True,
                                                 "techniques.chunked_loss": 8}
    assert "refused:" in done.stdout and "peak per rank" in done.stdout and "predicted" in done.stdout
    # each row predicted per rank (full-length rows: the demo's shorter ones measure about that or less)
    for label in ("FSDP2", "+ activation checkpointing", "+ chunked loss"):
        assert 0.98 * rows[label]["peak"] <= rows[label]["predicted_peak"] <= 1.25 * rows[label]["peak"], rows[label]
    assert rows["+ CPU offload"].get("predicted_peak") is None


@pytest.mark.slow
def test_the_ladder_in_one_process_names_what_needs_torchrun(tmp_path, capsys):
    from nbtune.run.ladder import ladder

    rows = ladder(str(run_file(tmp_path, FULL)), steps=1)
    assert rows[0]["label"] == "one process (no FSDP2)"
    assert "torchrun" in rows[2]["refused"] and "torchrun" in rows[3]["refused"]
    assert rows[1]["peak"] < rows[0]["peak"]  # checkpointing reaches the maths


def test_a_ranks_peak_counts_the_weights_fsdp_gathers(one_rank_group):
    """FSDP2 grows its gather buffers with ``UntypedStorage.resize_``, which dispatch does not
    see. The untied root holds the full embedding through the step; as its own unit the
    embedding is freed after its forward: the forward peaks must differ by at least its bytes."""
    from nbtune.memory.tracker import CpuStepMemory
    from nbtune.models import CausalLM, ModelConfig
    from nbtune.step import StepOptions, update

    config = ModelConfig(vocab_size=4096, hidden_size=64, intermediate_size=128, num_layers=2,
                         num_heads=4, num_kv_heads=2, head_dim=16, model_type="llama",
                         rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=64,
                         tie_word_embeddings=False)
    batch = {"input_ids": torch.randint(0, 4096, (2, 16)), "labels": torch.randint(0, 4096, (2, 16))}

    def forward_peak(sharding):
        torch.manual_seed(0)
        model = CausalLM(config)
        model.reset_parameters()
        shard_model(model, sharding)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        peaks = []
        for _ in range(2):  # the second step starts with the gather buffers already made
            memory = CpuStepMemory(model, optimizer, *batch.values())
            with memory:
                update(model, optimizer, [batch], batch["labels"].numel(), memory, StepOptions())
            peaks.append(memory.result().phases["forward"]["peak"])
        return peaks[-1]

    embedding = config.vocab_size * config.hidden_size * 4
    assert forward_peak(Sharding()) - forward_peak(Sharding(shard_embeddings=True)) >= embedding


# ---- past one machine ------------------------------------------------------------------------

def two_machines(run, out, *, kill: bool = False):
    """``nbtune train`` as two torchrun "machines" of one rank each on this host: two
    invocations with --nnodes 2 meeting at a c10d rendezvous on 127.0.0.1 (one hosts the
    store). ``kill``: SIGKILL the second machine's rank once two steps are written."""
    import os
    import signal
    import socket
    import time

    import psutil

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    nodes = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
                               "--nproc_per_node", "1", "--rdzv-backend", "c10d",
                               "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"test-{port}",
                               "--rdzv-conf", f"is_host={int(node == 0)}", "-m", "nbtune", "train",
                               str(run), "--out", str(out)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for node in (0, 1)]
    if kill:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and (
                not (out / "metrics.jsonl").exists() or len((out / "metrics.jsonl").read_text().splitlines()) < 2):
            time.sleep(0.5)
        workers = [child for child in psutil.Process(nodes[1].pid).children(recursive=True)
                   if "nbtune" in " ".join(child.cmdline())]
        assert workers, "the second machine's rank had not started"
        os.kill(workers[0].pid, signal.SIGKILL)
    return [node.communicate(timeout=300) + (node.returncode,) for node in nodes]


@pytest.mark.slow
def test_two_machines_by_rendezvous_and_hsdp_equal_one_process(tmp_path):
    """Two torchrun "machines" meeting at a c10d rendezvous, and HSDP over 2 x 2 gloo ranks
    (replicate: 2, each pair sharding the model): losses over 5 steps and the saved adapters
    equal one process's, each HSDP rank holding half the weights (its pair's share)."""
    path = run_file(tmp_path, LORA, steps=5)
    assert cli.main(["train", str(path), "--out", str(tmp_path / "one")]) == 0
    ran = two_machines(path, tmp_path / "machines")
    assert [code for *_, code in ran] == [0, 0], [err[-2000:] for _, err, _ in ran]
    hsdp = tmp_path / "hsdp.yaml"
    hsdp.write_text(path.read_text() + "distributed: {replicate: 2}\n")
    torchrun(hsdp, tmp_path / "hsdp", ranks=4)
    one = metrics(tmp_path / "one")
    for out in ("machines", "hsdp"):
        other = metrics(tmp_path / out)
        assert [m["step"] for m in other] == [1, 2, 3, 4, 5]
        for a, b in zip(one, other):
            assert abs(a["loss"] - b["loss"]) <= 1e-5 and a["tokens"] == b["tokens"], out
        close(weights(tmp_path / "one"), weights(tmp_path / out))
    last = metrics(tmp_path / "hsdp", "metrics.rank3.jsonl")[-1]["memory"]
    assert abs(last["parameters"] / one[-1]["memory"]["parameters"] - 0.5) < 0.02


@pytest.mark.slow
def test_a_machine_that_drops_out_is_named_and_the_job_ends(tmp_path):
    """The second "machine"'s rank killed mid-run: the first names it (rank 1, machine 1) in
    one message with the way on, and ends; nothing waits for ever."""
    path = run_file(tmp_path, LORA, steps=100000)
    (first, second) = two_machines(path, tmp_path / "out", kill=True)
    out, err, code = first
    assert code != 0 and second[2] != 0
    # (both "machines" are this one: the heartbeat sees rank 1's process gone; across machines
    # it is silent, or the roll call names it: Parallel.lost)
    said = [line for line in err.splitlines() if line.startswith("nbtune train: ") and "rank 1 (machine 1, " in line]
    assert len(said) == 1 and "--resume" in said[0], err[-3000:]
    assert "[rank0]: Traceback" not in err


def _resumes_as_its_twin(path, out, tmp_path):
    """``--resume`` from the newest complete checkpoint, two steps on, equals a run never
    stopped (the same file and step count): every loss and the saved adapters, bit for bit."""
    from nbtune.run.checkpoints import checkpoints

    steps = str(int(checkpoints(out)[-1].name.split("-")[1]) + 2)
    torchrun(path, out, "--resume", "--steps", steps)
    torchrun(path, tmp_path / "twin", "--steps", steps)
    assert [m["loss"] for m in metrics(out)] == [m["loss"] for m in metrics(tmp_path / "twin")]
    close(weights(out), weights(tmp_path / "twin"), tol=0.0)


@contextlib.contextmanager
def _a_job_with_a_checkpoint(path, out):
    """``nbtune train`` on 2 gloo ranks under torchrun, yielded as (the agent, its two ranks,
    a dict that gets the agent's stderr) once a checkpoint is complete; whatever of the job
    is still there after the block is killed (never left to the next test)."""
    import time

    import psutil

    from nbtune.run.checkpoints import checkpoints

    agent = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                              "--nproc_per_node", "2", "-m", "nbtune", "train", str(path), "--out", str(out)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    said: dict = {}
    try:
        deadline = time.monotonic() + 240
        while not checkpoints(out):  # (a complete one)
            assert agent.poll() is None and time.monotonic() < deadline, agent.communicate()
            time.sleep(0.2)
        ranks = [child for child in psutil.Process(agent.pid).children(recursive=True)
                 if "nbtune" in " ".join(child.cmdline())]
        assert len(ranks) == 2
        yield agent, ranks, said
    finally:
        for process in psutil.Process().children(recursive=True):
            try:
                if process.pid != agent.pid and "nbtune" in " ".join(process.cmdline()):
                    process.kill()
            except psutil.Error:  # (gone, or a zombie)
                pass
        said["err"] = agent.communicate(timeout=60)[1]  # (the ranks wrote to the agent's stderr too)


@pytest.mark.slow
def test_no_rank_outlives_a_killed_torchrun_agent_and_each_says_why(tmp_path):
    """torchrun's agent SIGKILLed (the OOM killer, a scheduler) while rank 1 is stopped
    (SIGSTOP: a hung rank) and rank 0 waits for it in a collective: both end within seconds,
    each saying why, and --resume from the checkpoint written before equals a run never stopped."""
    import os
    import signal
    import time

    import psutil

    path = run_file(tmp_path, LORA, steps=100000)
    out = tmp_path / "out"
    with _a_job_with_a_checkpoint(path, out) as (agent, ranks, said):
        ranks[1].send_signal(signal.SIGSTOP)
        time.sleep(1.0)  # rank 0 now waits in the step's collective
        os.kill(agent.pid, signal.SIGKILL)
        gone, alive = psutil.wait_procs(ranks, timeout=20)
    assert not alive, [p.pid for p in alive]
    for rank in (0, 1):
        assert f"nbtune train, rank {rank}: torchrun's agent (process {agent.pid}) is gone" in said["err"], \
            said["err"][-2000:]
    _resumes_as_its_twin(path, out, tmp_path)  # the newest complete checkpoint, left whole


@pytest.mark.slow
def test_a_stopped_rank_is_named_with_its_phase_within_hang_seconds_and_nothing_is_left(tmp_path):
    """Rank 1 stopped (SIGSTOP: it neither dies nor answers) mid-run under torchrun: within
    run.hang_seconds rank 0 names it and the phase it was in, the job ends, no rank is left,
    and --resume from the last checkpoint equals a run never stopped."""
    import signal
    import time

    import psutil

    path = run_file(tmp_path, LORA, steps=100000)
    path.write_text(path.read_text().replace("run: {", "run: {hang_seconds: 4, "))
    out = tmp_path / "out"
    with _a_job_with_a_checkpoint(path, out) as (agent, ranks, said):
        ranks[1].send_signal(signal.SIGSTOP)
        stopped = time.monotonic()
        agent.wait(timeout=120)
        took = time.monotonic() - stopped
        _, alive = psutil.wait_procs(ranks, timeout=5)  # (before the block's end kills what is left)
    err = said["err"]
    said = [line for line in err.splitlines() if "rank 1 stopped answering" in line]
    assert len(said) == 1, err[-3000:]
    assert ("last heard during the " in said[0] and " phase of step " in said[0]) or "between steps" in said[0] \
        or "while saving the checkpoint of step " in said[0]
    assert "no heartbeat for 4 s" in said[0] and "--resume" in said[0]
    assert agent.returncode != 0 and took < 20, took  # (a stopped rank here is killed, not left to torchrun)
    assert not alive, [p.pid for p in alive]
    _resumes_as_its_twin(path, out, tmp_path)

