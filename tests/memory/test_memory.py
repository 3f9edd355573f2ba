"""The per-step breakdown against figures computed from the model's shapes and dtypes."""

import pytest

from nbtune.optim import trainable_parameters

from helpers import param_bytes, small_session

ADAM_STEP_BYTES = 4  # torch.optim.AdamW keeps `step` as one fp32 scalar per parameter


@pytest.mark.parametrize("method", ["full", "lora"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_parameter_gradient_and_optimizer_bytes(method, dtype):
    session = small_session(method=method, dtype=dtype)
    model = session.model
    everything = list({id(p): p for p in model.parameters()}.values())
    trainable = trainable_parameters(model)
    element = 4 if dtype == "fp32" else 2
    assert all(p.element_size() == element for p in everything)
    if method == "lora":
        assert 0 < len(trainable) < len(everything)
        assert all("lora_" in n for n, p in model.named_parameters() if p.requires_grad)

    for _ in range(2):  # optimizer state exists from the first step's update on
        report = session.step()
    mem = report.memory
    assert mem.parameters == param_bytes(everything)
    assert mem.gradients == param_bytes(trainable)
    assert mem.optimizer_state == 2 * param_bytes(trainable) + ADAM_STEP_BYTES * len(trainable)
    assert mem.activations > 0 and mem.other > 0


def test_peak_is_one_moment_and_at_most_the_sum_of_categories():
    session = small_session()
    mem = session.step().memory
    assert sum(mem.at_peak.values()) == mem.peak
    assert mem.parameters <= mem.peak <= sum(mem.categories.values())
    assert mem.largest_at_peak in mem.categories


def test_lora_needs_less_gradient_and_optimizer_memory_than_full():
    full = small_session(method="full").step().memory
    lora = small_session(method="lora", lora_rank=4).step().memory
    assert lora.gradients < full.gradients / 5
    assert lora.optimizer_state < full.optimizer_state / 5


def test_checkpointing_shrinks_activations_by_at_least_half():
    plain = small_session().step().memory
    checkpointed = small_session(activation_checkpointing=True).step().memory
    assert checkpointed.activations <= plain.activations / 2


def test_bigger_batches_need_more_activation_memory():
    small = small_session(batch_size=2).step().memory
    large = small_session(batch_size=8).step().memory
    assert large.activations > 2 * small.activations
