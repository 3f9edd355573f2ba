"""A rehearsal of the 24 GB user's Llama-3.1-8B run, on fake tensors (no weights, a few MiB).

The user builds a QLoRA and a full-finetuning configuration, flips the toggles the panel
offers, takes a step, saves a checkpoint and the merged weights, and exports GGUF. Here the
8B model is made of fake tensors on the "meta" device, standing in for the card, through
nbtune's own code (``transform_model``, the optimizer, ``update`` with the undo copy,
``save_checkpoint``, ``save_session``), and torch's own ``MemTracker`` counts every
host (CPU) tensor the code makes on the way. Each part must stay within what
``nt.estimate(...).host`` predicts for it, and no toggle may copy anything to the host.

What cannot run on fake tensors, and why (each is checked at small scale instead):

* the step's offloaded activations: they go to pinned host memory on CUDA only; on the
  stand-in device they stay where they are (``test_host`` counts them at the hooks);
* loading: it reads real files (``test_loading_reads_one_tensor_at_a_time`` below, on the
  tiny model's folder);
* the GGUF export's conversion: it reads values into numpy (``test_host`` counts what the
  writer holds on the tiny model); here the null sink takes the merged tensors only;
* safetensors' own writing: a null sink stands in for ``save_file`` and does what the
  library does with a device tensor (moves each tensor of the file to the host, holds them
  until the file is written);
* fused AdamW refuses the stand-in device: a stand-in makes the state fused AdamW makes on
  CUDA (two moments like the weight, the step count on the weight's device);
* CUDA streams and pinning (the undo copy's overlap): ``benchmarks/gpu_acceptance.py``.
"""

import contextlib
import types

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker

import nbtune as nt
import nbtune.checkpoint
import nbtune.models.hf
import nbtune.optim
from nbtune.predict.estimator import _StateStandIn, _make_state
from nbtune.models.decoder import CausalLM
from nbtune.models.filling import DTYPES
from nbtune.models.presets import preset_config
from nbtune.optim import OptimizerInBackward, trainable_parameters
from nbtune.peft import cast_model
from nbtune.plan import transform_model
from nbtune.step import StepContext, StepOptions, _Untracked, update
from nbtune.run.trainer import Trainer
from nbtune.undo import UndoCopy, copy_bytes, undo_units

pytestmark = pytest.mark.slow  # about a minute: two 8B configurations, every layer

CPU = torch.device("cpu")
GiB = 2**30
START = {
    "qlora": nt.Techniques(method="qlora", dtype="bf16", batch_size=2, seq_len=2048,
                           activation_checkpointing=True, chunked_loss=8),
    "full": nt.Techniques(dtype="bf16", batch_size=2, seq_len=2048, activation_checkpointing=True,
                          chunked_loss=8, optimizer="paged_adamw8bit", optimizer_in_backward=True),
}
# What the panel lets the user move, in the order a user might: each applied to the model
# in place, as a session's set() does.
TOGGLES = {
    "qlora": [dict(activation_checkpointing=2), dict(chunked_loss=0), dict(lora_rank=16),
              dict(lora_dropout=0.05), dict(activation_checkpointing=True, chunked_loss=8),
              dict(lora_rank=8, lora_dropout=0.0)],
    "full": [dict(activation_checkpointing=4), dict(chunked_loss=0),
             dict(activation_checkpointing=True, chunked_loss=8)],
}


class _FusedAdamWState(_StateStandIn):
    """The state fused AdamW keeps on CUDA, made on the stand-in device (fused AdamW refuses
    it): two moments like each weight, the step count as a tensor on the weight's device."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None and not self.state[p]:
                    self.state[p] = {"step": torch.zeros((), dtype=torch.float32, device=p.device),
                                     "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}


def _optimizer(model, t: nt.Techniques):
    params = trainable_parameters(model)
    if t.optimizer == "adamw":
        def make(ps):
            return _FusedAdamWState(ps, "adamw", paged=False)
    else:  # bitsandbytes' (paged) 8-bit state, as the estimator makes it
        def make(ps):
            return _StateStandIn(ps, t.optimizer, paged=t.optimizer.startswith("paged"))
    return OptimizerInBackward(params, make) if t.optimizer_in_backward else make(params)


class _NoModules(contextlib.nullcontext):
    """MemTracker without its module hooks (they register gradient hooks on every weight,
    which frozen NF4 weights refuse): only the totals per device are wanted here."""

    is_bw, parents = False, {"Global"}

    def register_user_hooks(self, *hooks) -> None:
        pass

    def clear_user_hooks(self) -> None:
        pass


@contextlib.contextmanager
def host_bytes():
    """Counts host tensors made inside (torch's MemTracker, on CPU tensors): ``.peak``."""
    seen = types.SimpleNamespace(peak=0)
    tracker = MemTracker()
    tracker._mod_tracker = _NoModules()
    with tracker:
        yield seen
    seen.peak = tracker.get_tracker_snapshot("peak").get(CPU, {}).get("Total", 0)


@pytest.fixture(scope="module")
def rehearsal():
    """Both configurations built once: the fake model, its optimizer with steady state, and
    the prediction."""
    config = preset_config("llama-3.1-8b")
    out = {}
    for name, t in START.items():
        with torch.device("meta"):
            model = CausalLM(config)
        cast_model(model, DTYPES[t.dtype])
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        with mode:
            model.to_empty(device="meta")
            model.tie_weights()
            with host_bytes() as built:
                transform_model(model, t, previous=None, cast=False)
            optimizer = _optimizer(model, t)
            _make_state(optimizer)
        predicted = nt.estimate(config, t, device="cuda").host
        out[name] = types.SimpleNamespace(model=model, optimizer=optimizer, mode=mode, t=t,
                                          host=predicted, built=built.peak)
    return out


@pytest.mark.parametrize("name", list(START))
def test_building_and_every_toggle_put_nothing_on_the_host(rehearsal, name):
    run = rehearsal[name]
    assert run.built == 0
    t = run.t
    with run.mode:
        for change in TOGGLES[name]:
            new = t.replace(**change)
            with host_bytes() as moved:
                transform_model(run.model, new, previous=t)
            assert moved.peak == 0, f"{change} put {moved.peak} bytes on the host"
            t = new
        # the rank changes made new adapters: a new optimizer, as the session's set() builds
        run.optimizer = _optimizer(run.model, t)
        _make_state(run.optimizer)
    assert t == run.t  # back where the other checks start


@pytest.mark.parametrize("name", list(START))
def test_a_step_holds_at_most_the_predicted_undo_copy_on_the_host(rehearsal, name):
    run = rehearsal[name]
    units = undo_units(run.model, run.optimizer)
    copy = copy_bytes(units)
    # "auto" keeps the copy for QLoRA (small) and, host permitting, for the optimizer in
    # backward; its bytes are what the prediction says, to the byte
    assert run.host.undo == copy
    ids = torch.zeros(run.t.batch_size, run.t.seq_len, dtype=torch.long, device="meta")
    with run.mode:
        undo = UndoCopy(torch.device("meta"))
        undo.begin(units)
        with host_bytes() as held:
            update(run.model, run.optimizer, [{"input_ids": ids, "labels": ids}],
                   ids.numel(), _Untracked(), StepOptions(chunked_loss=run.t.chunked_loss),
                   StepContext(undo=undo))
        assert undo.updated == len(units)  # every weight's update was copied first
        undo.done()
    scalars = 64  # the step's loss read back to the host: a few four-byte tensors
    assert copy <= held.peak <= run.host.undo + scalars
    if name == "full":  # 30 GiB: more than a 32 GB host has free beside the rest
        assert run.host.undo > 25 * GiB and run.host.without_undo < 22 * GiB
        badge = nt.fit_badge(nt.estimate(preset_config("llama-3.1-8b"), run.t, device="cuda"),
                             "RTX 3090 + 32GiB RAM")
        assert "no undo copy" in badge.text or not badge.fits_host


def _trainer_view(run):
    """What ``save_checkpoint`` reads of a session, over the fake model."""
    trainer = types.SimpleNamespace(
        techniques=run.t, model=run.model, optimizer=run.optimizer, history=[],
        base_changed=False, base_fingerprint="rehearsal", _copy=None,  # (no reference copy)
        stream=types.SimpleNamespace(state_dict=lambda: {"position": 0}, reference_logps=None),
        note_checkpoint=lambda folder: None)
    trainer.state_dict = lambda: Trainer.state_dict(trainer)
    return types.SimpleNamespace(trainer=trainer, source=None, model=run.model,
                                 tokenizer=None, base_changed=False, techniques=run.t)


@pytest.fixture
def null_sink(monkeypatch):
    """``save_file`` that writes nothing and does what safetensors does with device tensors:
    moves each of a file's tensors to the host and holds them until the file is written."""
    files = []

    def save_file(tensors, path, metadata=None):
        held = {k: v.to(CPU) for k, v in tensors.items()}
        files.append((str(path).rpartition("/")[2], sum(v.numel() * v.element_size()
                                                        for v in held.values())))
        del held

    monkeypatch.setattr(nbtune.checkpoint, "save_file", save_file)
    monkeypatch.setattr(nbtune.models.hf, "save_file", save_file)
    return files


@pytest.mark.parametrize("name", list(START))
def test_checkpoint_and_merged_saves_stay_within_the_prediction(rehearsal, name, null_sink,
                                                                tmp_path):
    run = rehearsal[name]
    view = _trainer_view(run)
    with run.mode:
        with host_bytes() as saving:
            nbtune.checkpoint.save_checkpoint(view.trainer, tmp_path / "checkpoint")
        parts = [size for file, size in null_sink if not file.startswith("rng")]
        assert saving.peak <= run.host.checkpoint and max(parts) <= run.host.checkpoint
        if name == "full":  # 15 GiB of weights, 15 GiB of state: written in parts of ~1 GiB
            assert len(parts) > 20 and run.host.checkpoint < 1.1 * GiB
        null_sink.clear()
        view.tokenizer = types.SimpleNamespace(save=lambda folder: None)
        with host_bytes() as merging:
            nbtune.checkpoint.save_session(view, tmp_path / "merged", merge=name != "full")
        # written a part of about a GiB at a time (16 GB of weights in bf16), merged as it goes
        sizes = [size for _, size in null_sink]
        assert merging.peak <= run.host.merged < 1.1 * GiB and max(sizes) <= run.host.merged
        assert len(sizes) >= 15 and sum(sizes) == 2 * preset_config("llama-3.1-8b").num_parameters


def test_a_gguf_export_holds_one_tensor_within_the_prediction(rehearsal, tmp_path, monkeypatch):
    """The f16 GGUF export of the 8B model, through the real writer (its header, each tensor's
    info, each tensor's data in turn): host tensors (MemTracker) and numpy arrays (tracemalloc,
    which numpy reports its buffers to) together stay within ``host.gguf``, about 1 GiB (the
    embedding in f16) instead of the 16 GB the writer used to hold. Fake tensors have no
    values, so the float32 chunk's numpy view is a view of zeros, the vocabulary is a
    stand-in (metadata, not weights) and the data goes to a null sink that checks each size."""
    import tracemalloc

    import gguf
    import numpy as np

    import nbtune.models.gguf as writing

    run = rehearsal["qlora"]  # (the full run's export is the same weights, unmerged)
    config = preset_config("llama-3.1-8b")
    # chunks of 256 MiB, not 16: a sixteenth of the fake-tensor dispatches (20 s -> 5 s here);
    # the prediction follows the chunk
    monkeypatch.setattr(writing, "CONVERT_CHUNK_BYTES", 256 << 20)
    predicted = nt.estimate(config, run.t, device="cuda").host.gguf
    # the chunk's values as a view (as ``.numpy()`` is of the host chunk MemTracker counts),
    # in f16: numpy's float32 -> f16 cast of 8 billion zeros would take 20 s here
    monkeypatch.setattr(writing, "_numpy", lambda chunk: np.broadcast_to(np.float16(0), chunk.shape))
    monkeypatch.setattr(writing, "_vocab", lambda tokenizer, size: (["t"], [1], [], "llama-bpe"))
    written = []

    def null_sink(self, data, *args, **kwargs):
        info = self.tensors[0].pop(next(iter(self.tensors[0])))
        assert info.nbytes == data.nbytes
        written.append(data.nbytes)

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensor_data", null_sink)
    tokenizer = types.SimpleNamespace(bos_id=1, eos_id=2, pad_id=None, chat_template=None,
                                      config={}, stop_ids=[2],
                                      backend=types.SimpleNamespace(id_to_token=lambda i: "t"))
    view = types.SimpleNamespace(model=run.model, tokenizer=tokenizer, source=None)
    tracemalloc.start()
    try:
        with run.mode, host_bytes() as torch_side:
            nbtune.checkpoint.save_gguf(view, tmp_path / "gguf", "f16")
        numpy_side = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    # embedding, norm, head, 9 per layer, and Llama 3.1's RoPE factors (64 in float32)
    assert len(written) == 3 + 9 * config.num_layers + 1
    norms = config.hidden_size * (2 * config.num_layers + 1)  # kept in float32
    assert sum(written) == 2 * (config.num_parameters - norms) + 4 * norms + 4 * 64
    assert run.host.gguf < 1.1 * GiB  # at the usual 16 MiB chunks
    assert torch_side.peak + numpy_side <= predicted == run.host.gguf + 2 * (240 << 20)


def test_loading_reads_one_tensor_at_a_time(tmp_path):
    """The loader's host memory is one tensor (plus its cast buffer), whatever the model's
    size: checked on the tiny model's folder, each tensor sent to the stand-in device."""
    from nbtune.models import demo_model_dir
    from nbtune.models.config import ModelConfig
    from nbtune.models.filling import CHECK_BYTES
    from nbtune.models.hf import CAST_CHUNK_BYTES, empty_model, folder_weights

    folder = demo_model_dir()
    config = ModelConfig.from_file(folder / "config.json")
    _, _, expected = empty_model(config, ())
    largest = max(v.numel() for v in expected.values()) * 2  # bf16
    with host_bytes() as reading:  # each weight goes to the stand-in device as it is read
        moved = dict(folder_weights(folder, config, expected, torch.bfloat16, "meta"))
    assert moved.keys() == expected.keys()
    assert reading.peak <= largest + CAST_CHUNK_BYTES + CHECK_BYTES  # the NaN check: scalars only
    predicted = nt.estimate(config, nt.Techniques(dtype="bf16", batch_size=1, seq_len=32),
                            device="cuda").host
    assert predicted.loading == largest + CAST_CHUNK_BYTES + CHECK_BYTES
