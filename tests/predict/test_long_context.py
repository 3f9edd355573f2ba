"""Long contexts: sequence tiling keeps the maths and flattens the memory slope, and
``longest_context`` finds the longest sequence the estimator says fits (CPU, fp32)."""

import contextlib

import pytest
import torch
import torch.nn.functional as F

import nbtune as nt
from nbtune.activations import set_tiling
from nbtune.data import IGNORE
from nbtune.loss import cross_entropy_sum, loss_pieces
from nbtune.predict.longest import GRAIN, attention_kernel, longest_context
from nbtune.models import ModelConfig
from nbtune.models.presets import preset_config

from helpers import small_session
from test_estimate import DEMO_SHAPE, measured
from test_techniques import assert_equal_runs


def reference_loss(model, batch):
    """Mean token loss from the model's plain forward and torch's cross-entropy: no tiles,
    no pieces, no nbtune loss code."""
    logits = model(batch["input_ids"]).float()
    return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=IGNORE)


def tiled_loss(model, batch, tile):
    """The step's own path with ``tile``: hidden states before the final norm, then the
    norm, head and loss in pieces of at most ``tile`` tokens."""
    set_tiling(model, tile)
    hidden = model.hidden_states(batch["input_ids"], normed=False)
    trained = (batch["labels"] != IGNORE).sum()
    return cross_entropy_sum(model.lm_head, hidden, batch["labels"], tile_tokens=tile,
                             norm=model.model.norm) / trained


def loss_and_grads(model, batch, tile):
    model.zero_grad(set_to_none=True)
    loss = reference_loss(model, batch) if tile is None else tiled_loss(model, batch, tile)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


def assert_same_loss_and_grads(model, batch, tile):
    loss, grads = loss_and_grads(model, batch, None)
    tiled, tiled_grads = loss_and_grads(model, batch, tile)
    torch.testing.assert_close(tiled, loss, atol=1e-6, rtol=0)
    assert grads.keys() == tiled_grads.keys() and grads
    for name in grads:
        torch.testing.assert_close(tiled_grads[name], grads[name], atol=1e-5, rtol=0, msg=name)


@pytest.mark.parametrize("method", ["full", "lora"])
@pytest.mark.parametrize("tile", [17, 32])
def test_tiled_mlp_and_loss_equal_the_plain_model(method, tile):
    session = small_session(method=method, lora_rank=4)
    model = session.model
    if method == "lora":  # zero-initialised B would hide the adapters' share of the maths
        for name, p in model.named_parameters():
            if p.requires_grad and "lora" in name:
                torch.nn.init.normal_(p, std=0.02)
    batch = session.trainer.stream.next()
    assert batch["input_ids"].shape[1] > 2 * tile  # several tiles, the last one short
    assert_same_loss_and_grads(model, batch, tile)


@pytest.mark.slow
def test_tiling_reaches_the_mlp_and_the_head():
    session = small_session(tile_tokens=32)
    model = session.model
    seen = {"mlp": [], "head": []}
    # pre-hooks: a recompute stops as soon as the last tensor backward needs is made again
    model.model.layers[0].mlp.register_forward_pre_hook(
        lambda m, args: seen["mlp"].append(args[0].shape[1]))
    model.lm_head.register_forward_pre_hook(lambda m, args: seen["head"].append(args[0].shape[1]))
    report = session.step()
    tokens = report.shape[1]
    assert tokens > 64
    # forward, then backward's recompute: every call sees one tile, never the whole sequence
    assert seen["mlp"] and max(seen["mlp"]) <= 32 and sum(seen["mlp"]) == 2 * tokens
    assert seen["head"] and max(seen["head"]) <= 32 and sum(seen["head"]) == 2 * tokens
    assert loss_pieces(tokens, 0, 32) == -(-tokens // 32)
    assert loss_pieces(tokens, 8, 32) == max(8, -(-tokens // 32))
    session.set(tile_tokens=0)
    seen["mlp"].clear()
    session.step()
    session.set(tile_tokens=32)
    assert seen["mlp"] and seen["mlp"][0] > 32  # turned off, the MLP takes the whole sequence


@pytest.mark.parametrize("changes", [
    dict(tile_tokens=32),
    dict(tile_tokens=40, activation_checkpointing=True, chunked_loss=3),
    dict(tile_tokens=24, activation_checkpointing=True, activation_offloading=True),
])
@pytest.mark.slow
def test_five_sgd_steps_with_tiling_give_the_same_weights(changes):
    assert_equal_runs(small_session(optimizer="sgd", lr=0.05, **changes),
                      small_session(optimizer="sgd", lr=0.05))


@pytest.mark.slow
def test_tiling_with_lora_over_five_steps():
    assert_equal_runs(small_session(method="lora", optimizer="sgd", lr=0.05, tile_tokens=32,
                                    activation_checkpointing=True),
                      small_session(method="lora", optimizer="sgd", lr=0.05))


@pytest.mark.slow
def test_tiled_smollm2_with_lora_equals_untiled():
    from nbtune.plan import transform_model

    try:
        path = nt.smollm2_path()
    except FileNotFoundError as err:
        pytest.skip(str(err))
    model = nt.load_model(path)
    t = nt.Techniques(method="lora", lora_rank=4, seq_len=192, batch_size=1)
    transform_model(model, t, previous=None)
    torch.manual_seed(0)
    for name, p in model.named_parameters():
        if p.requires_grad and "lora_B" in name:
            torch.nn.init.normal_(p, std=0.01)
    ids = torch.randint(0, model.config.vocab_size, (1, 192))
    assert_same_loss_and_grads(model, {"input_ids": ids, "labels": ids.clone()}, 64)


WIDE = dict(DEMO_SHAPE, intermediate_size=1024)  # the MLP's [tokens, intermediate] dominates


@pytest.mark.slow
def test_tiling_flattens_the_slope_and_the_estimate_follows_it():
    """Measured live bytes at three lengths, checkpointing every layer, with and without
    tiles: the estimate equals each peak to 2%, and tiling takes off at least the
    gate and up activations of the layer being recomputed, per token."""
    config = ModelConfig(**WIDE)
    slopes = {}
    for tile in (0, 64):
        peaks = []
        for tokens in (128, 256, 512):
            t = nt.Techniques(batch_size=1, seq_len=tokens, activation_checkpointing=True,
                              tile_tokens=tile)
            real = measured(config, t, 1, tokens)
            guess = nt.estimate(config, t)
            assert abs(guess.peak - real.peak) <= 0.02 * real.peak, (tile, tokens)
            peaks.append(real.peak)
        slopes[tile] = (peaks[2] - peaks[1]) / 256
        assert peaks[1] - peaks[0] > 0 and peaks[2] > peaks[1]
    gate_and_up = 2 * config.intermediate_size * 4  # fp32 bytes per token of one layer
    assert slopes[0] - slopes[64] >= gate_and_up, slopes


@pytest.mark.slow
def test_every_tiling_setting_lowers_the_estimate_of_a_long_8b_step():
    t = dict(method="qlora", dtype="bf16", activation_checkpointing=True, batch_size=1,
             seq_len=16384, chunked_loss=16, lora_rank=32)
    plain = nt.estimate("llama-3.1-8b", t, device="cuda")
    tiled = nt.estimate("llama-3.1-8b", {**t, "tile_tokens": 4096}, device="cuda")
    both = nt.estimate("llama-3.1-8b", {**t, "tile_tokens": 4096, "activation_offloading": True},
                       device="cuda")
    # one layer's [tokens, intermediate] (gate, up: bf16) is what backward no longer holds whole
    config = preset_config("llama-3.1-8b")
    assert plain.peak - tiled.peak >= 2 * 16384 * config.intermediate_size * 2 * 0.5
    # offloading moves every checkpointed layer input ([tokens, hidden] bf16) to the host;
    # in backward the layer being recomputed and the one being fetched are back on the card
    inputs = config.num_layers * 16384 * config.hidden_size * 2
    assert tiled.peak - both.peak >= 0.85 * inputs
    assert both.host.offloaded >= inputs and tiled.host.offloaded == 0


# ---- longest_context --------------------------------------------------------------------

SHORT = dict(DEMO_SHAPE, num_layers=2, max_position_embeddings=1 << 20)


@pytest.mark.slow
def test_longest_context_is_the_longest_grain_that_fits():
    """Against an independent answer: the line through two estimates (computed here) says
    where the card's room is reached; longest_context lands within a few grains of it, its
    answer fits and one grain more does not (estimated here), in a few estimates, of which
    one long one where memory is straight."""
    from nbtune.predict import required

    config = ModelConfig(**SHORT)
    t = dict(batch_size=1, activation_checkpointing=True, chunked_loss=4, tile_tokens=2048,
             method="lora")
    at = {n: required(nt.estimate(config, {**t, "seq_len": n}, device="cpu")) for n in (2048, 4096)}
    slope = (at[4096] - at[2048]) / 2048
    budget = at[4096] + int(slope * 2000)  # room for about 6k tokens on this line
    result = longest_context(config, budget, t, device="cpu")
    on_the_line = 4096 + 2000
    assert abs(result.tokens - on_the_line) <= 4 * GRAIN, (result.tokens, on_the_line)
    assert result.tokens % GRAIN == 0 and result.limit == "card"
    assert required(result.memory) <= budget
    over = nt.estimate(config, {**t, "seq_len": result.tokens + GRAIN}, device="cpu")
    assert required(over) > budget
    assert result.estimates <= 6, result.tried
    if result.tried[2][3]:  # the line's guess fitted: it was the answer, confirmed at once
        assert result.estimates == 3 and result.tried[2][0] == result.tokens
    assert "longest context that fits" in result.text and "card" in result.text


@pytest.mark.parametrize("bend", [0.0, 0.05, 2.0])
@pytest.mark.parametrize("budget_gib", [3, 7.5, 20])
def test_longest_context_on_a_bending_memory_curve_is_exact_to_the_grain(monkeypatch, bend,
                                                                          budget_gib):
    """Against a brute force over every grain: where memory is a known curve (straight, or
    bending upwards as a mask would make it), the answer is the longest grain that fits,
    found in at most MAX_ESTIMATES estimates."""
    import nbtune.predict.longest as longest
    from nbtune.predict import Predictor, usable

    def device_bytes(tokens):
        return int(2e9 + 4e5 * tokens + bend * tokens * tokens)

    class Estimate:
        host = None

        def __init__(self, tokens):
            self.tokens = tokens

    monkeypatch.setattr(longest, "required", lambda memory: device_bytes(memory.tokens))
    config = Predictor(ModelConfig(**dict(SHORT, max_position_embeddings=1 << 17)), "cpu",
                       estimator=lambda config, t, seq_len, **_: Estimate(seq_len))
    budget = int(budget_gib * 2**30)
    room = usable(budget, "cpu")
    fitting = [n for n in range(GRAIN, (1 << 17) + 1, GRAIN) if device_bytes(n) <= room]
    result = longest_context(config, budget, {"batch_size": 1}, device="cpu")
    assert result.tokens == (fitting[-1] if fitting else 0), result.tried
    assert result.estimates <= longest.MAX_ESTIMATES


def test_longest_context_stops_at_the_models_context_and_at_nothing():
    config = ModelConfig(**dict(DEMO_SHAPE, max_position_embeddings=1024))
    whole = longest_context(config, "24GiB", {"batch_size": 1}, device="cpu")
    assert whole.tokens == 1024 and whole.limit == "model" and "whole context" in whole.text
    assert whole.estimates == 1
    none = longest_context(config, 1 << 20, {"batch_size": 1}, device="cpu")
    assert none.tokens == 0 and "none" in none.text


def test_longest_context_on_cuda_counts_the_host():
    """Offloaded layer inputs go to the host: a small host caps the context before the card."""
    from nbtune.predict import host_usable

    config = ModelConfig(**dict(SHORT, hidden_size=512, num_heads=8, num_kv_heads=4, head_dim=64))
    t = dict(dtype="bf16", activation_checkpointing=True, batch_size=1, tile_tokens=4096,
             chunked_loss=4, activation_offloading=True)
    host = {n: nt.estimate(config, {**t, "seq_len": n}, device="cuda").host.without_undo
            for n in (2048, 4096)}
    slope = (host[4096] - host[2048]) / 2048
    assert slope >= 2 * 512 * 2  # at least the two layers' offloaded inputs (bf16) per token
    room = host[4096] + int(slope * 4000)  # about 8k tokens on this line
    budget = room
    while host_usable(budget) < room:  # and the margin nbtune keeps free on top
        budget += room - host_usable(budget)
    result = longest_context(config, ("80GiB", budget), t)
    assert result.limit == "host" and abs(result.tokens - 8096) <= 4 * GRAIN, result.tried
    assert result.memory.host.without_undo <= result.host_usable
    assert "host is the limit" in result.text


def test_attention_kernel_names_the_mask_that_makes_memory_quadratic():
    llama = preset_config("llama-3.1-8b")
    assert attention_kernel(llama, nt.Techniques(seq_len=131072)) == ("flash", None)
    kernel, note = attention_kernel(llama, nt.Techniques(packing=True, seq_len=8192))
    assert kernel == "efficient" and "square" in note and "packing" in note
    assert attention_kernel(llama, nt.Techniques(packing=True), "cpu")[0] == "flash"
    mistral = ModelConfig(**dict(DEMO_SHAPE, sliding_window=4096))
    assert attention_kernel(mistral, nt.Techniques(seq_len=4096))[1] is None
    assert "sliding window" in attention_kernel(mistral, nt.Techniques(seq_len=8192))[1]


def test_cpu_sdpa_picks_the_flash_kernel_the_estimate_assumes():
    """The real session's attention call on CPU (no mask, causal) runs the flash kernel, as
    ``attention_kernel`` says; with a mask it is still flash on CPU."""
    from torch.nn.attention import SDPBackend

    q = torch.randn(1, 4, 64, 16)
    assert SDPBackend(torch._fused_sdp_choice(q, q, q, None, 0.0, True)) == SDPBackend.FLASH_ATTENTION
    mask = torch.ones(1, 1, 64, 64, dtype=torch.bool).tril()
    assert SDPBackend(torch._fused_sdp_choice(q, q, q, mask, 0.0, False)) == SDPBackend.FLASH_ATTENTION


def test_tile_tokens_is_validated_with_the_fix():
    with pytest.raises(ValueError, match="tile_tokens must be an int >= 0"):
        nt.Techniques(tile_tokens=-1)
    assert "tiles of 512 tokens" in nt.Techniques(tile_tokens=512).summary()


def test_offloaded_layer_inputs_are_prefetched_a_layer_ahead_in_backward():
    """The prefetch schedule, run on CPU through the estimator's path (``to="meta"``: the
    parked tensor comes back as an empty one, as fake CUDA tensors do): with checkpointing,
    what is parked is each layer's input, and every one but the last layer's is already on
    its way back before backward unpacks it, started by the unpack of the layer after it."""
    from nbtune.activations import OffloadActivations

    session = small_session(activation_checkpointing=True)
    model = session.model
    batch = session.trainer.stream.next()
    hooks = OffloadActivations(model, to="meta")
    with hooks:
        hidden = model.hidden_states(batch["input_ids"], normed=False)
    cross_entropy_sum(model.lm_head, hidden, batch["labels"], 2, norm=model.model.norm).backward()
    log = hooks.log
    unpacked = [i for kind, i in log if kind == "unpack"]
    fetched = [i for kind, i in log if kind == "fetch"]
    layers = len(model.model.layers)
    inside = [layer for layer, _ in hooks.runs if layer is not None]
    assert inside == list(range(layers))  # each layer's input, in order (and what is before)
    starts = [start for _, start in hooks.runs]
    run_of = {i: sum(start <= i for start in starts) - 1 for i in set(unpacked)}
    for i in set(unpacked):
        fetch, unpack = log.index(("fetch", i)), log.index(("unpack", i))
        if run_of[i] == len(hooks.runs) - 1:  # the last layer's: backward needs it first
            continue
        assert fetch < unpack, (i, log)  # on its way before it is needed...
        trigger = max(j for j in range(fetch) if log[j][0] == "unpack")
        assert run_of[log[trigger][1]] == run_of[i] + 1, (i, log)  # ...by the layer after it
    assert sorted(set(fetched)) == sorted(set(unpacked))  # each brought back once, none lost


def test_a_tensor_every_layer_saves_is_parked_once_and_gradients_stay_exact():
    """The rope tables go into every checkpointed layer: parked once on the host, not once a
    layer (the 8B at 128k: 64 MiB instead of 2 GiB), each layer still given them back in backward,
    and the gradients equal to a run without offloading."""
    from nbtune.activations import OffloadActivations

    session = small_session(activation_checkpointing=True)
    model = session.model
    batch = session.trainer.stream.next()

    def grads(offload: bool):
        model.zero_grad(set_to_none=True)
        hooks = OffloadActivations(model, min_bytes=0) if offload else None
        packed = []
        if hooks is not None:
            pack = hooks.pack_hook
            hooks.pack_hook = lambda t: packed.append(pack(t)) or packed[-1]
        with hooks or contextlib.nullcontext():
            hidden = model.hidden_states(batch["input_ids"], normed=False)
        cross_entropy_sum(model.lm_head, hidden, batch["labels"], 2, norm=model.model.norm).backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}, packed

    plain, _ = grads(False)
    offloaded, packed = grads(True)
    assert offloaded.keys() == plain.keys()
    for name in plain:
        assert torch.equal(offloaded[name], plain[name]), name
    layers = len(model.model.layers)
    parked = [p for p in packed if not isinstance(p, torch.Tensor)]
    seq = batch["input_ids"].shape[1]
    tables = [p for p in parked if tuple(p.host.shape) == (seq, model.config.head_dim)]  # cos, sin
    assert len(tables) == 2 * layers  # every layer saved both...
    assert len({id(p.host) for p in tables}) == 2  # ...and they were copied once each
    inputs = [p for p in parked if p.host.dim() == 3 and p.host.shape[-1] == model.config.hidden_size]
    assert len({id(p.host) for p in inputs}) == len(inputs) >= layers  # layer inputs: one each
