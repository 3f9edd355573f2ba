"""The estimate of a deep model, extrapolated from two shallow fake steps, against the same
estimate run on every layer (``extrapolate=False``): equal to the byte, breakdown, the
composition of the peak moment, each phase's peak and the held-out evaluation included."""

import pytest

import nbtune as nt
import nbtune.predict.estimator as est
from nbtune.models import ModelConfig
from nbtune.models.presets import preset_config

from helpers import returns_of

SMALL = dict(vocab_size=300, hidden_size=64, intermediate_size=160, num_layers=8, num_heads=4,
             num_kv_heads=2, head_dim=16)
FAMILIES = {
    "llama": ModelConfig(**SMALL),
    "llama-tied": ModelConfig(**SMALL, tie_word_embeddings=True),
    "qwen2": ModelConfig(**SMALL, model_type="qwen2", attention_bias=True, tie_word_embeddings=True),
    "qwen3": ModelConfig(**SMALL, model_type="qwen3", qk_norm=True),
    "mistral": ModelConfig(**SMALL, model_type="mistral", sliding_window=16),
    # two sliding layers and a global one, repeated: the layers differ, the pattern repeats
    "gemma3": ModelConfig(**{**SMALL, "num_layers": 24}, model_type="gemma3_text",
                          layer_types=("sliding_attention", "sliding_attention", "full_attention") * 8,
                          sliding_window=16, rope_local_theta=10000.0, norm_plus_one=True,
                          embed_scale=True, sandwich_norms=True, qk_norm=True,
                          query_pre_attn_scalar=16, hidden_act="gelu_pytorch_tanh",
                          tie_word_embeddings=True),
}

# The combinations test_estimate, test_fit and test_eval use, and every memory toggle. Each
# runs on one family in turn (all families meet most toggles) on the device it is for.
COMBOS = [
    dict(),
    dict(activation_checkpointing=True),
    dict(activation_checkpointing=2),
    dict(dtype="bf16", chunked_loss=4),
    dict(method="lora", dtype="bf16"),
    dict(method="lora", activation_checkpointing=True, max_grad_norm=1.0),
    dict(method="qlora", dtype="bf16", activation_checkpointing=True),
    dict(method="qlora", dtype="bf16", lora_targets=("q_proj", "v_proj"), lora_dropout=0.1),
    dict(optimizer_in_backward=True),
    dict(dtype="bf16", optimizer="adamw8bit", optimizer_in_backward=True),
    dict(grad_accum=2, max_grad_norm=1.0),
    dict(method="lora", grad_accum=3),
    dict(packing=True, optimizer="sgd"),
    dict(optimizer="adamw8bit"),
    dict(dtype="bf16", optimizer="ao_adamw8bit"),
    dict(optimizer="ao_adamw4bit", activation_checkpointing=True),
    dict(eval_every=5, chunked_loss=4),
    dict(activation_offloading=True, activation_checkpointing=True, device="cuda"),
    dict(activation_offloading=True, method="lora", device="cuda"),
    # without checkpointing, backward brings back the layer before's parked tensors: the
    # second unit (after the first, which parks fewer) and the one before the last differ
    dict(activation_offloading=True, method="qlora", dtype="bf16", tile_tokens=8, device="cuda"),
    dict(activation_offloading=True, method="lora", tile_tokens=8, device="cuda"),
    dict(optimizer="paged_adamw8bit", device="cuda"),
    dict(cpu_offload_optimizer=True, device="cuda"),
]


def _label(changes: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in changes.items()) or "baseline"


def assert_same(a: nt.MemoryBreakdown, b: nt.MemoryBreakdown) -> None:
    assert a == b  # every byte count, the device and the evaluation's peak
    assert a.at_peak == b.at_peak and a.phases == b.phases  # (not in ==: compare=False)


@pytest.fixture
def calls(monkeypatch):
    """How many estimates were extrapolated (two shallow runs) rather than run whole."""
    return returns_of(monkeypatch, est, "_extrapolated")


@pytest.mark.slow
@pytest.mark.parametrize("number", range(len(COMBOS)), ids=[_label(c) for c in COMBOS])
def test_extrapolated_equals_every_layer_run(calls, number):
    changes = dict(COMBOS[number])
    device = changes.pop("device", "cpu")
    name = list(FAMILIES)[number % len(FAMILIES)]
    t = nt.Techniques(batch_size=2, seq_len=32, **changes)
    shallow = est.estimate(FAMILIES[name], t, device=device)
    assert len(calls) == 1 and calls[0] is not None, "the estimate was not extrapolated"
    whole = est.estimate(FAMILIES[name], t, device=device, extrapolate=False)
    assert len(calls) == 1
    assert_same(shallow, whole)
    assert shallow.peak > shallow.parameters > 0


# A preset of each family (llama untied and tied, qwen2, mistral, gemma 3's 26 layers not a
# pattern of five sliding layers and a global one, phi's fused projections; qwen3 has no preset).
@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama-3.1-8b", "llama-3.2-1b", "qwen2.5-0.5b", "mistral-7b",
                                  "gemma-3-12b", "phi-4-mini"])
def test_extrapolated_equals_every_layer_run_on_a_preset_of_each_family(calls, name):
    # Short rows: the layers' structure, not their length, is what the extrapolation relies on.
    config = preset_config(name)
    t = nt.Techniques(method="qlora" if config.num_parameters > 3e9 else "full", dtype="bf16",
                      activation_checkpointing=True, chunked_loss=4, batch_size=1, seq_len=64)
    shallow = est.estimate(config, t, device="cuda")
    assert calls and calls[0] is not None
    assert_same(shallow, est.estimate(config, t, device="cuda", extrapolate=False))


@pytest.mark.slow
def test_the_first_layer_is_kept_apart_because_it_differs(calls):
    # With a frozen embedding (LoRA), the first layer computes no gradient for its input: its
    # backward holds less than the layers after it, so the most held in backward can sit in
    # the second layer. Extrapolating from the first and the last layer only would miss it.
    config = FAMILIES["llama"]
    t = nt.Techniques(method="qlora", dtype="bf16", activation_checkpointing=True, batch_size=2,
                      seq_len=32)
    steps = {depth: est._fake_step(config.replace(num_layers=depth), t, "cpu", (2, 32), True)
             for depth in (4,)}
    totals = [steps[4].segments[("backward", 0, "layer", i)].peak["Total"] for i in range(4)]
    step = totals[2] - totals[3]  # each layer after the first: one layer's share more
    assert totals[1] - totals[2] == step and step != 0
    assert totals[0] - totals[1] != step  # the first layer is not on that line
    assert_same(est.estimate(config, t), est.estimate(config, t, extrapolate=False))


@pytest.mark.parametrize("layers,every,expected", [
    (8, False, 1), (8, 2, 2), (8, 3, None), (3, False, None), (6, 2, None), (12, 3, 3), (32, 4, 4)])
def test_layer_period_falls_back_where_the_layers_do_not_repeat(layers, every, expected):
    config = FAMILIES["llama"].replace(num_layers=layers)
    assert est.layer_period(config, nt.Techniques(activation_checkpointing=every)) == expected


@pytest.mark.parametrize("layers,every,expected", [(24, False, 3), (24, 2, 6), (26, False, None), (48, 4, 12)])
def test_layer_period_covers_the_pattern_of_sliding_and_global_layers(layers, every, expected):
    config = FAMILIES["gemma3"].with_layers(layers)
    assert config.layer_pattern == 3 and config.layer_types[:3] == config.layer_types[3:6]
    assert est.layer_period(config, nt.Techniques(activation_checkpointing=every)) == expected


def test_a_depth_that_is_not_whole_units_runs_every_layer(calls):
    t = nt.Techniques(activation_checkpointing=3, batch_size=2, seq_len=32)  # 8 layers: 3+3+2
    guess = est.estimate(FAMILIES["llama"], t)
    assert calls == []  # not extrapolated
    assert guess.peak > 0


def test_the_estimators_nf4_weight_has_the_parts_torchao_makes():
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from nbtune.memory.accounting import storage_bytes
    from nbtune.peft import to_nf4

    # One scaler block (torchao then keeps a larger storage for its factor) and several.
    for shape, dtype in [((128, 512), torch.bfloat16), ((64, 128), torch.float32),
                         ((256, 256), torch.bfloat16)]:
        weight = torch.randn(shape, dtype=dtype)
        real = to_nf4(weight)
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            fake = to_nf4(mode.from_tensor(weight))
        parts, _ = real.__tensor_flatten__()
        assert fake.__tensor_flatten__()[0] == parts
        for part in parts:
            assert getattr(fake, part).shape == getattr(real, part).shape, part
            assert getattr(fake, part).dtype == getattr(real, part).dtype, part
        assert storage_bytes([fake]) == storage_bytes([real])
        assert (fake.shape, fake.dtype, fake.block_size, fake.n_blocks, fake.scaler_block_size) == \
            (real.shape, real.dtype, real.block_size, real.n_blocks, real.scaler_block_size)


@pytest.mark.slow
@pytest.mark.parametrize("changes", [dict(), dict(method="qlora", dtype="bf16", activation_checkpointing=True),
                                     dict(activation_checkpointing=2, grad_accum=2),
                                     dict(activation_offloading=True, method="lora", tile_tokens=8)],
                         ids=["full", "qlora-checkpointed", "every-2nd-accumulated", "offloaded"])
def test_every_extrapolated_segment_is_the_deep_runs_own(changes):
    """Not only the peak: each segment carried along the line (the units kept apart at the
    front and at the back, and the embedding's, the head's and the optimizer's) equals,
    byte for byte, that segment of a run of every layer."""
    t = nt.Techniques(batch_size=2, seq_len=32, **changes)
    device = "cuda" if t.activation_offloading else "cpu"
    config = FAMILIES["llama"].replace(num_layers=14)
    period = est.layer_period(config, t)
    shallow, deeper, front, back = est.shallow_units(t)
    run = {depth: est._fake_step(config.replace(num_layers=depth), t, device, (2, 32), True)
           for depth in (shallow * period, deeper * period, 14)}
    carried = est._extrapolated(run[shallow * period], run[deeper * period], shallow * period,
                                deeper * period, 14, period, (front, back))
    whole = run[14].segments
    units = 14 // period
    for (phase, micro, part, position, where), segment in carried.segments.items():
        if position is not None:
            end, k = where
            index = period * (k if end == "front" else units - 1 - k) + position
        own = whole[(phase, micro, part, None if position is None else index)]
        assert segment.peak == own.peak and segment.highs == own.highs, (phase, part, where)
    assert {k[4] for k in carried.segments if k[3] is not None} == {
        *(("front", k) for k in range(front)), *(("back", k) for k in range(back))}
    assert carried.state == run[14].state and carried.weights == run[14].weights
