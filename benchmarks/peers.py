"""nbtune against transformers (+ PEFT, + bitsandbytes) and torchtune 0.6.1, rung by rung.

    python benchmarks/peers.py                    # CPU rungs on the 125M Llama shape, 2 rounds of 6 steps
    python benchmarks/peers.py --shape small --rounds 1 --steps 2   # a quick look
    python benchmarks/peers.py --device cuda      # the GPU half (published shapes; unmeasured)
    # writes benchmarks/results/peers/peers-<shape>-<device>.json and a table on stdout

The same random-weight Llama (one safetensors folder written with transformers) and the same
token batches go to every framework. In each round every framework of a rung runs in a fresh
process of its own: load, one step untimed (first allocations, optimizer state), one step
counted, each alone on the machine; then ``--steps`` timed steps, interleaved on a CPU: one
step of each framework in turn, the order rotating each cycle and reversed every other round;
every worker ends only after the last cycle. A machine that drifts (a 2-core VM's neighbours
moved whole runs by up to 17 %) slows every framework alike, and each step pairs with the
others' of its cycle: besides the tokens/s, nbtune's speed over each peer's step by step
(median and quartiles). On a GPU, where all frameworks would not fit on the card at once,
each runs its timed steps alone, one after another. Memory is counted one way for all: the
peak of live tensor bytes in the counted step, by ``live_bytes_mode`` below (each
framework's own tracking off). Also reported: peak RSS growth over the run, the page faults
of each timed step, the first step's loss (the work is the same: it agrees to rounding) and
the ratios nbtune / best peer. On a CPU every worker runs with glibc's mmap off (``--malloc``):
freed blocks are reused, as on a GPU, instead of faulting in afresh each step.

torchtune 0.6.1 imports ``torchao.quantization.int4_weight_only``, gone from torchao 0.16 on, so
it runs in its own venv (``--torchtune-python``, default ``.venv-torchtune/bin/python``), made on
first use with ``pip install torch==<this torch> torchtune==0.6.1 torchao==0.15.0`` (the newest
torchao it imports with, tried one by one).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
OUT = HERE / "results" / "peers"
INPUTS = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "nbtune" / "peers-inputs"

SHAPES = {  # Llama shapes; "125m" is the one DESIGN.md's CPU figures use
    "125m": dict(vocab=32000, hidden=768, mlp=2048, layers=12, heads=12, kv=4, batch=2, seq=512),
    "small": dict(vocab=32000, hidden=256, mlp=688, layers=4, heads=8, kv=4, batch=2, seq=256),
    "tiny": dict(vocab=512, hidden=64, mlp=172, layers=2, heads=4, kv=2, batch=2, seq=32),
    # the GPU half: torchtune's README shape (Llama 3.2 3B, 2 x 4096) and Llama 3.1 8B
    "3b": dict(vocab=128256, hidden=3072, mlp=8192, layers=28, heads=24, kv=8, batch=2, seq=4096,
               tied=True),
    "8b": dict(vocab=128256, hidden=4096, mlp=14336, layers=32, heads=32, kv=8, batch=2, seq=2048),
}

# torchtune's README ladder: each rung adds to the one before; LoRA and QLoRA stand alone.
LADDER = [
    ("full fp32", {}),
    ("+ bf16", {"dtype": "bf16"}),
    ("+ activation checkpointing", {"checkpointing": True}),
    ("+ chunked loss", {"chunked_loss": True}),
    ("+ optimizer in backward", {"optimizer_in_backward": True}),
    ("+ activation offloading", {"offloading": True}),
    ("+ 8-bit AdamW", {"adamw8bit": True}),
    ("LoRA", {"lora": True}),
    ("QLoRA", {"lora": True, "qlora": True}),
]
STANDALONE = {"LoRA", "QLoRA"}  # over the ladder's dtype and checkpointing only
FEATURES = {  # what each framework can do, by rung key (one name each, as the rungs use)
    "nbtune": {"dtype", "checkpointing", "chunked_loss", "optimizer_in_backward", "offloading",
               "adamw8bit", "lora", "qlora"},
    "transformers": {"dtype", "checkpointing", "adamw8bit", "lora", "qlora"},
    "torchtune": {"dtype", "checkpointing", "chunked_loss", "optimizer_in_backward", "offloading",
                  "adamw8bit", "lora", "qlora"},
}
FEATURES["nbtune-norollback"] = FEATURES["nbtune-tracked"] = FEATURES["nbtune"]
LORA = dict(rank=8, alpha=16.0)
TORCHAO_FOR_TORCHTUNE = "torchao==0.15.0"
LR = 1e-5


def rung_configs(device: str = "cpu", bf16_slow: float | None = None) -> list[tuple[str, dict, str | None]]:
    """(label, config, why skipped) per rung; a skipped rung's change is not carried on."""
    rows, current = [], {}
    for label, change in LADDER:
        if label in STANDALONE:
            keep = {k: current[k] for k in ("dtype", "checkpointing") if k in current}
            config = {**keep, **change}
        else:
            config = {**current, **change}
        why = skipped_on(device, change, bf16_slow)
        if why is None and label not in STANDALONE:
            current = config
        rows.append((label, config, why))
    return rows


def skipped_on(device: str, config: dict, bf16_slow: float | None) -> str | None:
    """Why a rung cannot say anything on this device, or None."""
    if device == "cpu" and config.get("offloading"):
        return "activation offloading moves activations to host memory: on a CPU they are there"
    if device == "cpu" and config.get("dtype") == "bf16" and bf16_slow and bf16_slow > 4:
        return f"bf16 matmuls run {bf16_slow:.0f}x slower than fp32 on this CPU (no native bf16)"
    return None


def bf16_slowdown() -> float:
    """How many times slower a bf16 matmul is than fp32 here (nbtune's own probe, ~0.1 s)."""
    from nbtune.hardware import bf16_slowdown as probe

    return probe()


# ---- shared inputs ---------------------------------------------------------------------------

def max_positions(shape: dict) -> int:
    """The context the model is built for: the row length on CPU shapes, 128k on GPU ones (one
    model folder serves every row length the longest-context search tries)."""
    return 131072 if shape["hidden"] >= 3072 else max(shape["seq"], 128)


def make_inputs(shape: dict, folder: Path, steps: int) -> None:
    """The random-weight model (transformers' init, seed 0) and the batches, via nbtune's own
    ``BatchStream`` so that the nbtune worker draws exactly these."""
    import torch
    import transformers
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    big = shape["hidden"] >= 3072  # the GPU shapes
    # One model folder per shape, whatever the batch: an 8B copy per row length would fill a disk.
    key = "-".join(str(shape[k]) for k in ("vocab", "hidden", "mlp", "layers", "heads", "kv"))
    key += f"-{max_positions(shape)}"
    model_dir = folder.parent / f"model-{key}{'-tied' if shape.get('tied') else ''}"
    link = folder / "model"  # a folder of an older run is kept; a link elsewhere is redone
    if link.is_symlink() and link.resolve() != model_dir.resolve():
        link.unlink()
    if not link.exists() and not link.is_symlink():
        link.symlink_to(model_dir.resolve(), target_is_directory=True)
    if not (model_dir / "model.safetensors").exists():
        config = transformers.LlamaConfig(
            vocab_size=shape["vocab"], hidden_size=shape["hidden"], intermediate_size=shape["mlp"],
            num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"],
            num_key_value_heads=shape["kv"], max_position_embeddings=max_positions(shape),
            rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=shape.get("tied", False))
        torch.manual_seed(0)
        with torch.device("meta" if big else "cpu"):
            model = transformers.LlamaForCausalLM(config)
        if big:  # the weights' values do not matter for memory and speed; bf16 on disk
            model = model.to_empty(device="cpu").to(torch.bfloat16)
            for p in model.parameters():
                torch.nn.init.normal_(p, std=0.02)
        model.save_pretrained(model_dir, safe_serialization=True)
    batches = []
    stream = nbtune_stream(shape, folder, rows=shape["batch"] * (steps + 2))
    for _ in range(steps + 2):
        batches.append(stream.next())
    save_file({f"{k}.{i}": b[k].contiguous() for i, b in enumerate(batches) for k in ("input_ids", "labels")},
              str(folder / "batches.safetensors"))


def nbtune_stream(shape: dict, folder: Path, rows: int):
    import torch

    from nbtune.data import IGNORE, BatchStream, Sample

    gen = torch.Generator().manual_seed(1)
    samples = []
    for _ in range(rows):
        ids = torch.randint(0, shape["vocab"], (shape["seq"],), generator=gen)
        labels = torch.cat([ids[1:], torch.tensor([IGNORE])])
        samples.append(Sample(input_ids=ids, labels=labels))
    return BatchStream(samples, shape["batch"], pad_id=0, seed=0)


def load_batches(folder: Path) -> list[dict]:
    from safetensors.torch import load_file

    flat = load_file(str(folder / "batches.safetensors"))
    n = len(flat) // 2
    return [{"input_ids": flat[f"input_ids.{i}"], "labels": flat[f"labels.{i}"]} for i in range(n)]


# ---- measuring one step the same way for everyone ------------------------------------------

def live_bytes_mode():
    """A dispatch mode that counts the live tensor bytes on the CPU and their peak.

    Written here, not taken from nbtune (whose own tracker is under test) or from torch's
    ``MemTracker`` (its module hooks refuse a module called twice in a step, as a chunked loss
    does, and hook every parameter, frozen ones included): each storage is counted once, when
    an op first returns it or when it is already held (``hold``), and dropped when freed.
    """
    import weakref

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
    from torch.utils._pytree import tree_map_only

    class LiveBytes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.sizes, self.now, self.peak = {}, 0, 0

        def see(self, t):
            if is_traceable_wrapper_subclass(t):  # NF4 and other wrappers: their inner tensors
                for name in t.__tensor_flatten__()[0]:
                    self.see(getattr(t, name))
                return
            if t.device.type != "cpu" or t.is_meta:
                return
            storage = t.untyped_storage()
            key = storage._cdata
            if key in self.sizes:
                return
            self.sizes[key] = storage.nbytes()
            self.now += self.sizes[key]
            self.peak = max(self.peak, self.now)
            weakref.finalize(storage, self.drop, key)

        def drop(self, key):
            self.now -= self.sizes.pop(key, 0)

        def hold(self, *roots):
            for root in roots:
                if isinstance(root, torch.nn.Module):
                    for p in root.parameters():
                        self.see(p)
                        if p.grad is not None:
                            self.see(p.grad)
                    for b in root.buffers():
                        self.see(b)
                elif isinstance(root, torch.optim.Optimizer):
                    for state in root.state.values():
                        tree_map_only(torch.Tensor, self.see, state)
                elif isinstance(root, (list, tuple)):
                    self.hold(*root)
                elif isinstance(root, dict):  # a batch
                    tree_map_only(torch.Tensor, self.see, root)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            tree_map_only(torch.Tensor, self.see, out)
            return out

    return LiveBytes()


SERVED = False  # --serve: the driver asks for each timed step in turn (one line on stdin each)


def measure(step, model, optimizer, batches: list[dict], steps: int, device: str,
            batch_made_in_step: bool = False) -> dict:
    """``step(batch) -> loss`` once untimed, once counted, then up to ``steps`` timed. The
    counted step's batch counts for everyone: held from the start when it is given to the
    step, made in it when the step draws its own (nbtune's trainer). Served:
    a line with the loss and peak first, then each timed step when the driver asks for it
    (a line on stdin), its seconds as a line; the driver interleaves the frameworks' steps."""
    import torch

    rss_before = _rss()
    first_loss = float(step(batches[0]))
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        step(batches[1])
        peak = torch.cuda.max_memory_allocated()
    else:
        counter = live_bytes_mode()
        counter.hold(model, optimizer, *([] if batch_made_in_step else [batches[1]]))
        with counter:
            step(batches[1])
        peak = counter.peak
    if SERVED:
        print(json.dumps({"first_loss": first_loss, "peak_bytes": peak}), flush=True)
    seconds, faults, tokens = [], [], 0
    for batch in batches[2:2 + steps]:
        if SERVED and not sys.stdin.readline():  # the driver is done asking
            break
        faulted = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        started = time.perf_counter()
        step(batch)
        if device == "cuda":
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - started)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faulted)
        tokens += batch["input_ids"].numel()
        if SERVED:
            print(json.dumps({"seconds": seconds[-1]}), flush=True)
    if SERVED:  # ending now would free gigabytes while another framework's last step is timed
        sys.stdin.read()
    return {"first_loss": first_loss, "peak_bytes": peak, "tokens_per_second": tokens / sum(seconds),
            "step_seconds": seconds, "page_faults": faults, "rss_growth_bytes": _max_rss() - rss_before,
            "malloc_env": {k: os.environ[k] for k in KEEP_FREED if k in os.environ}}  # as it ran


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _max_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# ---- the three workers -----------------------------------------------------------------------

def worker_nbtune(shape, config, folder, steps, device, rollback="auto", track=False):
    import torch

    import nbtune as nt
    from nbtune.models import load_model
    from nbtune.run.trainer import Trainer

    method = "qlora" if config.get("qlora") else "lora" if config.get("lora") else "full"
    t = nt.Techniques(
        method=method, dtype=config.get("dtype", "fp32"), batch_size=shape["batch"],
        seq_len=shape["seq"], lr=LR, activation_checkpointing=bool(config.get("checkpointing")),
        chunked_loss=8 if config.get("chunked_loss") else 0,
        tile_tokens=int(config.get("tile_tokens", 0)),  # long_context.py's sequence tiling
        optimizer_in_backward=bool(config.get("optimizer_in_backward")),
        activation_offloading=bool(config.get("offloading")),
        optimizer="adamw8bit" if config.get("adamw8bit") else "adamw",
        lora_rank=LORA["rank"], lora_alpha=LORA["alpha"])
    model = load_model(folder / "model", dtype=t.dtype, device=device,
                       quantize=t.lora_targets if method == "qlora" else ())  # NF4 as read
    class Batches:  # the trainer's data: the same random rows the other peers get
        pad_id = 0

        def stream(self, techniques):
            return nbtune_stream(shape, folder, shape["batch"] * (steps + 2)), []

        def problems(self, techniques):
            return []

        def eval_batches(self, techniques):
            return []

    trainer = Trainer(model, Batches(), t, torch.device(device))
    trainer.rollback = rollback  # "auto": the undo copy a user gets; on CPU it is counted
    expected = load_batches(folder)

    def step(batch):  # the trainer draws the same batch from its own stream
        return trainer.step(track=track).loss  # track: nbtune's own memory tracker on every step

    drawn = trainer.stream.copy().next()
    assert torch.equal(drawn["input_ids"], expected[0]["input_ids"]), "batches differ"
    return measure(step, trainer.model, trainer.optimizer, expected, steps, device, batch_made_in_step=True)


def worker_transformers(shape, config, folder, steps, device):
    import torch
    import transformers

    dtype = torch.bfloat16 if config.get("dtype") == "bf16" else torch.float32
    kwargs = {"dtype": dtype}
    if config.get("qlora"):
        kwargs["quantization_config"] = transformers.BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype)
    if config.get("qlora"):  # bitsandbytes places 4-bit weights itself (.to() is refused)
        kwargs["device_map"] = device
    model = transformers.LlamaForCausalLM.from_pretrained(folder / "model", **kwargs)
    if not config.get("qlora"):
        model = model.to(device)
    model.config.use_cache = False
    if config.get("checkpointing"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if config.get("lora"):
        import peft

        model = peft.get_peft_model(model, peft.LoraConfig(
            r=LORA["rank"], lora_alpha=LORA["alpha"], lora_dropout=0.0,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = _optimizer(params, config, device)
    model.train()

    def step(batch):
        ids = batch["input_ids"].to(device)
        loss = model(input_ids=ids, labels=ids).loss  # transformers shifts the labels itself
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return measure(step, model, optimizer, load_batches(folder), steps, device)


def worker_torchtune(shape, config, folder, steps, device):
    import torch
    from safetensors.torch import load_file
    from torchtune import training
    from torchtune.models.convert_weights import hf_to_tune
    from torchtune.models.llama3._component_builders import llama3, lora_llama3
    from torchtune.modules import TransformerSelfAttentionLayer
    from torchtune.modules.loss import CEWithChunkedOutputLoss
    from torchtune.modules.peft import get_adapter_params, set_trainable_params

    dtype = torch.bfloat16 if config.get("dtype") == "bf16" else torch.float32
    common = dict(vocab_size=shape["vocab"], num_layers=shape["layers"], num_heads=shape["heads"],
                  num_kv_heads=shape["kv"], embed_dim=shape["hidden"],
                  max_seq_len=max_positions(shape), intermediate_dim=shape["mlp"], norm_eps=1e-5,
                  rope_base=500000.0)
    build, lora_build = llama3, lora_llama3
    if shape.get("tied"):  # Llama 3.2's builders tie the head (their RoPE is scaled: the loss
        from torchtune.models.llama3_2._component_builders import llama3_2, lora_llama3_2

        build, lora_build = llama3_2, lora_llama3_2  # differs a little; memory and speed do not)
    with training.set_default_dtype(dtype), torch.device(device):
        if config.get("lora"):
            model = lora_build(lora_attn_modules=["q_proj", "k_proj", "v_proj", "output_proj"],
                                apply_lora_to_mlp=True, apply_lora_to_output=False,
                                lora_rank=LORA["rank"], lora_alpha=LORA["alpha"],
                                quantize_base=bool(config.get("qlora")), **common)
        else:
            model = build(**common)
    hf_state = {}
    for part in sorted((folder / "model").glob("*.safetensors")):  # large models come in shards
        hf_state.update(load_file(str(part)))
    state = hf_to_tune(hf_state, num_heads=shape["heads"], num_kv_heads=shape["kv"], dim=shape["hidden"])
    model.load_state_dict(state, strict=not config.get("lora"))
    if config.get("lora"):
        set_trainable_params(model, get_adapter_params(model))
    if config.get("checkpointing"):
        training.set_activation_checkpointing(model, auto_wrap_policy={TransformerSelfAttentionLayer})
    chunked = bool(config.get("chunked_loss"))
    loss_fn = CEWithChunkedOutputLoss() if chunked else torch.nn.CrossEntropyLoss(ignore_index=-100)
    if chunked:
        model.set_num_output_chunks(loss_fn.num_output_chunks)
    params = [p for p in model.parameters() if p.requires_grad]
    in_backward = bool(config.get("optimizer_in_backward"))
    if in_backward:
        optimizers = {p: _optimizer([p], config, device) for p in params}
        training.register_optim_in_bwd_hooks(model=model, optim_dict=optimizers)
        optimizer = None
    else:
        optimizer = _optimizer(params, config, device)
    model.train()

    def step(batch):
        ids, labels = batch["input_ids"].to(device), batch["labels"].to(device)
        logits = model(ids)
        if chunked:
            loss = loss_fn(logits, labels)
        else:
            loss = loss_fn(logits.float().flatten(0, 1), labels.flatten())
        del logits
        loss.backward()
        if optimizer is not None:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return measure(step, model, optimizer if optimizer is not None else list(optimizers.values()),
                   load_batches(folder), steps, device)


def _optimizer(params, config, device):
    import torch

    if config.get("adamw8bit"):
        import bitsandbytes

        return bitsandbytes.optim.AdamW8bit(params, lr=LR)
    return torch.optim.AdamW(params, lr=LR, fused=True)  # the fastest torch AdamW, CPU and CUDA


WORKERS = {"nbtune": worker_nbtune, "transformers": worker_transformers, "torchtune": worker_torchtune,
           # the step alone: without the host copy that makes a failed step undoable
           "nbtune-norollback": lambda *a: worker_nbtune(*a, rollback="none"),
           # memory_tracking="every_step": what measuring every step costs (its peak counts the
           # tracker's own bookkeeping too, so only its speed is compared)
           "nbtune-tracked": lambda *a: worker_nbtune(*a, track=True)}


# ---- the driver ------------------------------------------------------------------------------

def torchtune_python(path: str | None) -> str:
    """The torchtune venv's python, made on first use."""
    import torch

    python = Path(path) if path else ROOT / ".venv-torchtune" / "bin" / "python"
    if python.exists():
        return str(python)
    if path:
        sys.exit(f"--torchtune-python {path} does not exist.")
    venv = python.parent.parent
    print(f"making {venv} for torchtune 0.6.1 (once; a few minutes)", file=sys.stderr)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    base = torch.__version__.split("+")[0]
    pip = [str(python), "-m", "pip", "install", "-q"]
    subprocess.run(pip + [f"torch=={base}"], check=True)
    subprocess.run(pip + [f"torch=={base}", "torchtune==0.6.1", TORCHAO_FOR_TORCHTUNE, "bitsandbytes",
                          "safetensors"], check=True)
    return str(python)


def _command(python: str, framework: str, config: dict, args, folder: Path) -> list[str]:
    command = [python, __file__, "--worker", framework, "--config", json.dumps(config), "--shape", args.shape,
               "--steps", str(args.steps), "--device", args.device, "--folder", str(folder),
               "--batch", str(args.batch_used), "--seq", str(args.seq_used)]
    return command + (["--cap-gib", str(args.cap_gib)] if args.cap_gib else [])


ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
# glibc serves blocks over 32 MB (logits, the vocabulary's gradients) with a fresh mmap each
# time and unmaps them when freed: every CPU step faulted them in again (~185k pages, 0.3 s of
# kernel time in the 125M fp32 step, nbtune's and torchtune's alike). With mmap off, freed
# blocks are reused, as torch's caching allocator reuses them on a GPU. ``--malloc system``:
# glibc's defaults (and whatever MALLOC_* the caller's environment sets).
KEEP_FREED = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(2**40)}


def keeps_freed(args) -> bool:
    return args.device == "cpu" and args.malloc == "keep"


def worker_env(args) -> dict:
    return {**ENV, **(KEEP_FREED if keeps_freed(args) else {})}


def run_worker(python: str, framework: str, label: str, config: dict, args, folder: Path) -> dict:
    """One framework alone in a fresh process, its timed steps back to back."""
    done = subprocess.run(_command(python, framework, config, args, folder), capture_output=True,
                          text=True, env=worker_env(args), timeout=args.timeout)
    if done.returncode != 0:
        return {"error": (done.stderr.strip().splitlines() or ["(no output)"])[-1][:300]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_interleaved(pythons: dict, frameworks: list[str], config: dict, args, folder: Path) -> dict:
    """Every framework in a fresh process of its own, started one after another (each loads
    and counts its peak alone on the machine); then their timed steps interleaved, one step
    each in turn, the order rotating each cycle: a machine that drifts slows every framework's
    steps alike, and each step's time pairs with the others' of the same cycle."""
    import tempfile
    import threading

    workers, results = {}, {}

    def error(framework: str) -> dict:
        process, log = workers.pop(framework)
        process.kill()
        process.wait()
        log.seek(0)
        why = (log.read().strip().splitlines() or ["(no output)"])[-1][:300]
        log.close()
        return {"error": why}

    def ask(framework: str, text: str | None) -> dict | None:
        process = workers[framework][0]
        timer = threading.Timer(args.timeout, process.kill)
        timer.start()
        try:
            if text is not None:
                process.stdin.write(text)
                process.stdin.flush()
            else:
                process.stdin.close()
            if text is None:
                lines = process.stdout.read().splitlines()
            else:  # (up to its next JSON line: a library may print on stdout too)
                lines = [process.stdout.readline()]
                while lines[-1] and not lines[-1].startswith("{"):
                    lines.append(process.stdout.readline())
        except OSError:  # (a worker that died: a broken pipe)
            lines = []
        finally:
            timer.cancel()
        try:
            return json.loads([line for line in lines if line.startswith("{")][-1])
        except (IndexError, ValueError):
            return None

    try:
        for framework in frameworks:
            log = tempfile.TemporaryFile("w+")
            workers[framework] = (subprocess.Popen(
                _command(pythons[framework], framework, config, args, folder) + ["--serve"],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True,
                env=worker_env(args)), log)
            if ask(framework, "") is None:  # (writing nothing: its first line, the counted step)
                results[framework] = error(framework)
        for cycle in range(args.steps):
            for framework in frameworks[cycle % len(frameworks):] + frameworks[:cycle % len(frameworks)]:
                if framework in workers and ask(framework, "step\n") is None:
                    results[framework] = error(framework)
        for framework in list(workers):
            last = ask(framework, None)
            if workers[framework][0].wait() != 0 or last is None:
                results[framework] = error(framework)
            else:
                results[framework] = last
                workers.pop(framework)[1].close()
    finally:
        for process, log in workers.values():
            process.kill()
            log.close()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=list(SHAPES), default=None,
                        help="model shape (default: 125m on cpu, 3b on cuda)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--rounds", type=int, default=2, help="fresh processes per rung")
    parser.add_argument("--steps", type=int, default=6, help="timed steps per framework and round")
    parser.add_argument("--rungs", default=None, help="comma-separated rung labels (default: all)")
    parser.add_argument("--frameworks", default="nbtune,transformers,torchtune")
    parser.add_argument("--torchtune-python", default=None)
    parser.add_argument("--timeout", type=int, default=1800,
                        help="seconds a worker may take for one answer (a load and two steps, or a step)")
    parser.add_argument("--batch", type=int, default=None, help="rows per step (default: the shape's)")
    parser.add_argument("--seq", type=int, default=None, help="tokens per row (default: the shape's)")
    parser.add_argument("--cap-gib", type=float, default=None,
                        help="CUDA: cap each process at this many GiB (set_per_process_memory_fraction), "
                             "e.g. 24 for a 3090/4090 on a larger card")
    parser.add_argument("--longest-context", action="store_true",
                        help="CUDA: the longest row (batch 1) each framework trains with QLoRA under "
                             "--cap-gib, by bisection (Unsloth's published 8B figure: 78,475 tokens)")
    parser.add_argument("--malloc", choices=["keep", "system"], default="keep",
                        help="CPU: 'keep' runs every worker with glibc's mmap off, freed blocks "
                             "reused instead of faulted in again; 'system': glibc's defaults")
    parser.add_argument("--out", default=str(OUT))
    parser.add_argument("--inputs", default=str(INPUTS),
                        help="where the random-weight model and the batches are written (reused)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.shape = args.shape or ("125m" if args.device == "cpu" else "3b")
    shape = {**SHAPES[args.shape], **{k: v for k, v in (("batch", args.batch), ("seq", args.seq))
                                      if v is not None}}

    if args.worker:  # one (framework, rung) in this fresh process; its last line is JSON
        import torch

        global SERVED
        SERVED = args.serve

        torch.manual_seed(0)
        if args.device == "cuda" and args.cap_gib:
            total = torch.cuda.get_device_properties(0).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, args.cap_gib * 2**30 / total))
        result = WORKERS[args.worker](shape, json.loads(args.config), Path(args.folder), args.steps,
                                      args.device)
        print(json.dumps(result))
        return

    frameworks = args.frameworks.split(",")
    wanted = args.rungs.split(",") if args.rungs else [label for label, _ in LADDER]
    pythons = {f: sys.executable for f in frameworks}
    if "torchtune" in frameworks:
        pythons["torchtune"] = torchtune_python(args.torchtune_python)
    if args.longest_context:
        return longest_context(args, shape, frameworks, pythons)
    args.batch_used, args.seq_used = shape["batch"], shape["seq"]
    folder = Path(args.inputs) / f"{args.shape}-{shape['batch']}x{shape['seq']}"
    make_inputs(shape, folder, args.steps)
    slow = bf16_slowdown() if args.device == "cpu" else None
    rows = []
    planned = {label: (config, why) for label, config, why in rung_configs(args.device, slow)}
    for label in wanted:
        config, why = planned[label]
        row = {"rung": label, "config": config, "runs": {}}
        if why:
            row["skipped"] = why
            rows.append(row)
            print(f"{label}: skipped ({why})", flush=True)
            continue
        able = [f for f in frameworks if set(config) <= FEATURES[f]]
        row["not_available"] = sorted(set(frameworks) - set(able))
        for r in range(args.rounds):
            order = able if r % 2 == 0 else able[::-1]  # who follows whom, both ways
            results = (run_interleaved(pythons, order, config, args, folder) if args.device == "cpu"
                       else {f: run_worker(pythons[f], f, label, config, args, folder) for f in order})
            for framework, result in results.items():
                row["runs"].setdefault(framework, []).append(result)
                print(f"{label} round {r + 1} {framework}: {result}", flush=True)
        row["summary"] = summarize(row["runs"])
        rows.append(row)
    result = {
        "benchmark": "peers", "command": "python " + " ".join([Path(sys.argv[0]).as_posix()] + sys.argv[1:]),
        "shape": {args.shape: shape}, "device": args.device, "rounds": args.rounds,
        "timed_steps": args.steps, "bf16_slowdown": slow,
        "malloc": KEEP_FREED if keeps_freed(args) else "system", "rows": rows, "inputs": str(folder),
        "machine": machine(args.device), "versions": versions(pythons),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"peers-{args.shape}-{args.device}.json"
    path.write_text(json.dumps(result, indent=2))
    print(table(rows))
    print(f"wrote {path}")


def longest_context(args, shape: dict, frameworks: list[str], pythons: dict) -> None:
    """Bisect the longest row (batch 1) that trains a QLoRA step under the cap, per framework."""
    config = {"checkpointing": True, "lora": True, "qlora": True}
    found = {}
    for framework in frameworks:
        fits, fails = 0, None
        seq = 4096
        while fails is None or fails - fits > 1024:
            args.batch_used, args.seq_used = 1, seq
            folder = Path(args.inputs) / f"{args.shape}-1x{seq}"
            make_inputs({**shape, "batch": 1, "seq": seq}, folder, 1)
            result = run_worker(pythons[framework], framework, "QLoRA", config,
                                argparse.Namespace(**{**vars(args), "steps": 1}), folder)
            print(f"{framework} 1 x {seq}: {result}", flush=True)
            if "error" in result:
                fails = seq
            else:
                fits = seq
            seq = seq * 2 if fails is None else (fits + fails) // 2 // 256 * 256
            if seq <= fits:
                break
        found[framework] = fits
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"longest-context-{args.shape}-{args.device}.json"
    path.write_text(json.dumps({"benchmark": "longest_context", "shape": shape, "cap_gib": args.cap_gib,
                                "longest_tokens": found, "published": {"unsloth_8b_qlora_24gb": 78475},
                                "machine": machine(args.device), "versions": versions(pythons)}, indent=2))
    print(json.dumps(found), f"wrote {path}")


def summarize(runs: dict) -> dict:
    """Per framework: the median tokens/s, the peak (the same every round) and the loss; then
    nbtune's ratios against the best peer that ran."""
    out = {}
    for framework, results in runs.items():
        good = [r for r in results if "error" not in r]
        if not good:
            out[framework] = {"error": results[-1]["error"]}
            continue
        out[framework] = {
            "tokens_per_second": statistics.median(r["tokens_per_second"] for r in good),
            "peak_bytes": max(r["peak_bytes"] for r in good),
            "rss_growth_bytes": max(r["rss_growth_bytes"] for r in good),
            "first_loss": good[0]["first_loss"]}
    ours = out.get("nbtune", {})
    peers = {f: v for f, v in out.items() if not f.startswith("nbtune") and "error" not in v}
    if "error" not in ours and ours and peers:
        best_peak = min(v["peak_bytes"] for v in peers.values())
        best_speed = max(v["tokens_per_second"] for v in peers.values())
        out["ratios"] = {"peak_vs_best_peer": ours["peak_bytes"] / best_peak,
                         "speed_vs_best_peer": ours["tokens_per_second"] / best_speed,
                         "targets": {"peak": 0.9, "speed": 1.1}}
    paired = paired_ratios(runs)
    if paired:
        out.setdefault("ratios", {})["per_step_vs"] = paired
    tracked = out.get("nbtune-tracked", {})
    if ours and "error" not in ours and tracked and "error" not in tracked:
        # a step's time with memory tracked over without (target: under 1.5x)
        out.setdefault("ratios", {})["every_step_tracking_cost"] = (
            ours["tokens_per_second"] / tracked["tokens_per_second"])
    return out


def paired_ratios(runs: dict) -> dict:
    """nbtune's speed over each peer's, step by step: a peer's step time over nbtune's step
    of the same cycle (the same batch, interleaved); per peer the median and the quartiles."""
    ours = runs.get("nbtune", [])
    out = {}
    for framework, results in runs.items():
        if framework.startswith("nbtune"):
            continue
        pairs = [theirs / mine for a, b in zip(ours, results) if "error" not in a and "error" not in b
                 for mine, theirs in zip(a["step_seconds"], b["step_seconds"])]
        if len(pairs) >= 4:
            q1, median, q3 = statistics.quantiles(pairs, n=4)
            out[framework] = {"median": median, "q1": q1, "q3": q3, "steps": len(pairs)}
        elif pairs:
            out[framework] = {"median": statistics.median(pairs), "steps": len(pairs)}
    return out


def table(rows: list[dict]) -> str:
    mib = 2 ** 20
    lines = [f"{'rung':<28}{'framework':<14}{'peak MiB':>10}{'tokens/s':>10}{'loss':>9}"
             f"{'peak ratio':>12}{'speed ratio':>12}"]
    for row in rows:
        if "skipped" in row:
            lines.append(f"{row['rung']:<28}skipped: {row['skipped']}")
            continue
        ratios = row["summary"].get("ratios", {})
        for i, (framework, v) in enumerate((f, v) for f, v in row["summary"].items() if f != "ratios"):
            head = row["rung"] if i == 0 else ""
            if "error" in v:
                lines.append(f"{head:<28}{framework:<14}error: {v['error'][:60]}")
                continue
            extra = (f"{ratios['peak_vs_best_peer']:>12.2f}{ratios['speed_vs_best_peer']:>12.2f}"
                     if framework == "nbtune" and "peak_vs_best_peer" in ratios else "")
            if framework == "nbtune" and ratios.get("per_step_vs"):
                extra += "   per step vs " + ", ".join(
                    f"{peer} {v['median']:.2f}" + (f" [{v['q1']:.2f}-{v['q3']:.2f}]" if "q1" in v else "")
                    for peer, v in ratios["per_step_vs"].items())
            if framework == "nbtune-tracked" and "every_step_tracking_cost" in ratios:
                extra = f"{'':>12}{'':>12}   tracking every step: {ratios['every_step_tracking_cost']:.2f}x"
            lines.append(f"{head:<28}{framework:<14}{v['peak_bytes'] / mib:>10,.0f}"
                         f"{v['tokens_per_second']:>10,.1f}{v['first_loss']:>9.4f}{extra}")
        for missing in row.get("not_available", []):
            lines.append(f"{'':<28}{missing:<14}n/a (no such feature)")
    return "\n".join(lines)


def machine(device: str) -> dict:
    import torch

    info = {"platform": platform.platform(), "processor": platform.processor(),
            "cpu_count": os.cpu_count(), "threads": torch.get_num_threads(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability()}
    if device == "cuda":
        info.update(gpu=torch.cuda.get_device_name(), driver=torch.version.cuda)
    return info


def versions(pythons: dict) -> dict:
    out = {}
    for framework, python in pythons.items():
        names = {"nbtune": "nbtune torch torchao bitsandbytes",
                 "transformers": "transformers peft torch bitsandbytes",
                 "torchtune": "torchtune torchao torch bitsandbytes"}[framework.split("-")[0]].split()
        code = ("import importlib.metadata as m, json; print(json.dumps({n: m.version(n) for n in "
                f"{names!r}}}))")
        done = subprocess.run([python, "-c", code], capture_output=True, text=True)
        out[framework] = json.loads(done.stdout) if done.returncode == 0 else done.stderr[-200:]
    return out


if __name__ == "__main__":
    main()
