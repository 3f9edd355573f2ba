"""Every optimizer toggle, proven on the embedded default: in-backward stepping, low-bit state.

Runs are five steps from the same seed (batch 4 x 96 tokens, lr 1e-3, fp32). Optimizers are
built with ``build_optimizer`` and put on the session directly, so the paged ones (which the
session refuses on CPU) can be run too. torchao compiles its step on first use (5-13 s cold
on CPU), so each run is made once per module and shared.
"""

import math
import subprocess
import sys
import warnings
import weakref
from dataclasses import dataclass

import pytest
import torch

from nbtune.memory.accounting import optimizer_state_bytes
from nbtune.optim import build_optimizer, release_optimizer, trainable_parameters

from helpers import param_bytes, small_session

STEPS = 5

# Distance of each low-bit optimizer from exact AdamW over the same STEPS steps, measured on
# this machine's setup (torch 2.13 CPU, bitsandbytes 0.50.2, torchao 0.18): the largest
# |loss - AdamW loss| over the steps, and |dw - dw_AdamW| / |dw_AdamW| for the final change of
# the weights. Measured: adamw8bit 1.7e-4 / 0.018, ao_adamw8bit 1.0e-4 / 0.018, ao_adamw4bit
# 0.011 / 0.28; SGD, as a check that the bounds can fail, is 0.88 / 0.99. Bounds are 2-10x.
# State ratio bounds: 8-bit state at most 0.3x of fp32 AdamW's, 4-bit at most 0.2x. Measured
# 0.255 (bitsandbytes), 0.294 (torchao 8-bit: the 259x128 tied embedding has 33152 values, not
# a multiple of torchao's 256-value block, so it stays fp32, and each quantized tensor carries
# its own 1 KiB lookup table), 0.135 (torchao 4-bit, 128-value blocks: the embedding is
# quantized). Only the nine 128-value norms stay fp32 in every one of them.
LOW_BIT = {  # name: (loss distance, relative update distance, state ratio)
    "adamw8bit": (1e-3, 0.05, 0.3),
    "ao_adamw8bit": (1e-3, 0.05, 0.3),
    "ao_adamw4bit": (0.05, 0.6, 0.2),
}


@dataclass
class Run:
    losses: list
    reports: list
    start: torch.Tensor  # all weights, flattened
    end: torch.Tensor
    session: object


def _weights(model) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()]).clone()


def _run(optimizer: str, **changes) -> Run:
    session = small_session()
    start = _weights(session.model)
    techniques = session.techniques.replace(optimizer=optimizer, **changes)
    session.trainer.optimizer = build_optimizer(session.model, techniques)
    reports = [session.step() for _ in range(STEPS)]
    return Run([r.loss for r in reports], reports, start, _weights(session.model), session)


@pytest.fixture(scope="module")
def runs():
    """``runs(name, **changes)``: the STEPS-step run of that optimizer, made once per module."""
    made = {}

    def get(name, **changes):
        key = (name, tuple(sorted(changes.items())))
        if key not in made:
            made[key] = _run(name, **changes)
        return made[key]

    return get


def _largest_gradient_bytes(model) -> int:
    return max(p.numel() * p.element_size() for p in trainable_parameters(model))


# ---- optimizer in backward ------------------------------------------------------------------

@pytest.mark.parametrize("name", ["adamw", "sgd"])
def test_in_backward_follows_the_plain_step_exactly(runs, name):
    plain = runs(name)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        in_backward = runs(name, optimizer_in_backward=True)
    # The CPU memory tracker takes gradients that the step in backward already dropped.
    assert not [w for w in caught if "mem_tracker" in w.filename]
    assert plain.losses[-1] < plain.losses[0] - 0.5  # it trained
    assert in_backward.losses == pytest.approx(plain.losses, abs=1e-5)
    assert torch.allclose(in_backward.end, plain.end, rtol=0, atol=1e-5)
    # The state lives in the per-parameter optimizers and the breakdown sees all of it.
    states = [r.memory.optimizer_state for r in (plain.reports[-1], in_backward.reports[-1])]
    assert states[0] == states[1]


def test_in_backward_keeps_at_most_one_gradient_alive():
    def alive_counts(in_backward: bool):
        session = small_session()
        params = trainable_parameters(session.model)
        counts = []
        # Registered before the optimizer's own hooks, so it runs just before each step.
        for p in params:
            p.register_post_accumulate_grad_hook(
                lambda _: counts.append(sum(q.grad is not None for q in params)))
        session.trainer.optimizer = build_optimizer(
            session.model, session.techniques.replace(optimizer_in_backward=in_backward))
        report = session.step()
        return counts, report.memory.gradients, len(params), session.model

    counts, gradients, n, model = alive_counts(in_backward=True)
    assert len(counts) == n and max(counts) == 1  # each parameter stepped once, alone
    assert gradients <= _largest_gradient_bytes(model)
    counts, gradients, n, model = alive_counts(in_backward=False)
    assert max(counts) == n  # the same count without it: every gradient at once
    assert gradients == param_bytes(trainable_parameters(model))


def test_release_removes_the_hooks_and_frees_the_state():
    session = small_session(optimizer_in_backward=True)
    session.step()
    model, optimizer = session.model, session.optimizer
    params = trainable_parameters(model)
    tokens = torch.randint(0, 256, (2, 16))

    def backward():
        before = _weights(model)
        model(tokens).float().mean().backward()
        return before

    before = backward()  # hooked: every parameter stepped, every gradient dropped
    assert not torch.equal(before, _weights(model))
    assert all(p.grad is None for p in params)

    state = weakref.ref(next(iter(optimizer.state.values()))["exp_avg"])
    release_optimizer(optimizer)
    assert state() is None and not optimizer.state
    before = backward()  # released: nothing steps, gradients stay
    assert torch.equal(before, _weights(model))
    assert all(p.grad is not None for p in params)


# ---- low-bit optimizers -------------------------------------------------------------------------

def _expected_state_bytes(name: str, params) -> int:
    """State bytes worked out from each library's layout, parameter by parameter.

    bitsandbytes: from 4096 values, uint8 codes plus an fp32 absmax per 256-value block (the
    last block may be partial), and two 256-entry fp32 lookup tables shared by all parameters;
    smaller ones keep fp32 state. torchao: from 4096 values and a whole number of blocks
    (256 values for 8-bit, 128 for 4-bit), codes (a byte, or half a byte) plus an fp32 scale
    per block plus the tensor's own fp32 lookup table (256 or 16 entries); otherwise fp32;
    and an fp32 step per parameter.
    """
    total = 2 * 256 * 4 if name == "adamw8bit" else 0
    for n in (p.numel() for p in params):
        if name == "adamw8bit":
            total += 2 * (n + 4 * math.ceil(n / 256)) if n >= 4096 else 2 * 4 * n
        else:
            block, entries, bits = (256, 256, 8) if name == "ao_adamw8bit" else (128, 16, 4)
            quantized = n >= 4096 and n % block == 0
            total += 4 + 2 * (n * bits // 8 + 4 * n // block + 4 * entries if quantized else 4 * n)
    return total


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LOW_BIT))
def test_low_bit_optimizer_trains_close_to_adamw_in_a_fraction_of_its_state(runs, name):
    loss_distance, update_distance, state_ratio = LOW_BIT[name]
    exact, low = runs("adamw"), runs(name)
    assert low.losses[-1] < low.losses[0] - 1.0
    assert max(abs(a - b) for a, b in zip(low.losses, exact.losses)) <= loss_distance
    moved, exact_moved = low.end - low.start, exact.end - exact.start
    assert (moved - exact_moved).norm() / exact_moved.norm() <= update_distance

    state = low.reports[-1].memory.optimizer_state  # as the step's breakdown reports it
    assert state == _expected_state_bytes(name, trainable_parameters(low.session.model))
    assert state <= state_ratio * exact.reports[-1].memory.optimizer_state


@pytest.mark.slow
def test_low_bit_optimizer_in_backward_matches_its_plain_step(runs):
    plain = runs("ao_adamw4bit")
    in_backward = runs("ao_adamw4bit", optimizer_in_backward=True)
    assert in_backward.losses == plain.losses
    assert torch.equal(in_backward.end, plain.end)
    assert in_backward.reports[-1].memory.gradients <= _largest_gradient_bytes(plain.session.model)


@pytest.mark.slow
def test_paged_optimizers_fall_back_to_unpaged_state_on_cpu(runs):
    # bitsandbytes pages state through CUDA unified memory; on CPU it warns and keeps
    # ordinary tensors. The session refuses paged optimizers on CPU (techniques.RULES); built
    # directly they are exactly their unpaged selves.
    with pytest.warns(UserWarning, match="Paged optimizers are not supported on CPU"):
        paged8 = runs("paged_adamw8bit")
    with pytest.warns(UserWarning, match="Paged optimizers are not supported on CPU"):
        paged32 = runs("paged_adamw")
    plain8, exact = runs("adamw8bit"), runs("adamw")
    assert paged8.losses == plain8.losses and torch.equal(paged8.end, plain8.end)
    assert paged8.reports[-1].memory.optimizer_state == plain8.reports[-1].memory.optimizer_state
    assert paged32.losses == pytest.approx(exact.losses, abs=1e-5)
    # fp32 state like AdamW's, with bitsandbytes' step kept as a Python int instead of a tensor.
    params = trainable_parameters(paged32.session.model)
    assert paged32.reports[-1].memory.optimizer_state == 2 * param_bytes(params)


# ---- checkpoints, CPU offload, imports ---------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("name, in_backward", [("adamw", True), ("ao_adamw4bit", True),
                                               ("adamw8bit", False)])
def test_checkpoint_continues_the_run_exactly(tmp_path, name, in_backward):
    first = small_session(optimizer=name, optimizer_in_backward=in_backward)
    for _ in range(2):
        first.step()
    first.save_checkpoint(tmp_path / "checkpoint")  # optimizer.state_dict() as safetensors + JSON
    expected = [first.step() for _ in range(2)]

    second = small_session(optimizer=name, optimizer_in_backward=in_backward)
    second.load_checkpoint(tmp_path / "checkpoint")
    resumed = [second.step() for _ in range(2)]
    assert [r.loss for r in resumed] == [r.loss for r in expected]
    assert torch.equal(_weights(second.model), _weights(first.model))
    # Still quantized after loading: the same state bytes, not an fp32 copy.
    assert resumed[-1].memory.optimizer_state == expected[-1].memory.optimizer_state


@pytest.mark.slow
def test_in_backward_state_dict_numbers_parameters_as_one_optimizer_would():
    session = small_session(optimizer_in_backward=True)
    session.step()
    saved = session.optimizer.state_dict()
    n = len(trainable_parameters(session.model))
    assert [g["params"] for g in saved["param_groups"]] == [[i] for i in range(n)]
    assert sorted(saved["state"]) == list(range(n))
    with pytest.raises(ValueError, match="one per parameter"):
        session.optimizer.load_state_dict({**saved, "param_groups": saved["param_groups"][:-1]})


def test_cpu_offload_is_refused_on_cpu_with_the_reason():
    session = small_session()
    with pytest.raises(ValueError, match="CUDA device"):
        build_optimizer(session.model, session.techniques.replace(cpu_offload_optimizer=True))


@pytest.mark.slow
def test_importing_nbtune_loads_neither_bitsandbytes_nor_torchao():
    code = ("import sys, nbtune; "
            "print(sorted(m for m in ('bitsandbytes', 'torchao') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.slow
def test_nf4_and_torchao_optimizers_load_without_printing_but_user_warnings_still_show():
    # torchao's import-time logs showed as red stderr in notebooks; only they are silenced.
    code = ("import logging, nbtune as nt\n"
            "s = nt.Session.demo(method='qlora', optimizer='ao_adamw8bit', batch_size=2)\n"
            "s.step()\n"
            "logging.getLogger('torchao').warning('the user asked for this one')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stderr.strip() == "the user asked for this one"


def test_state_bytes_count_where_the_state_lives():
    # A CUDA breakdown counts state on its GPU: CPU-offloaded state is not there, while
    # bitsandbytes' paged state (a CPU view of CUDA unified memory) is.
    param = torch.nn.Parameter(torch.zeros(4))
    optimizer = torch.optim.SGD([param], lr=0.1)
    host, paged = torch.zeros(8), torch.zeros(16)
    paged.is_paged, paged.page_deviceid = True, 0
    optimizer.state[param] = {"host": host, "paged": paged, "shared": host[:4]}
    assert optimizer_state_bytes(optimizer) == 96
    assert optimizer_state_bytes(optimizer, torch.device("cpu")) == 32
    assert optimizer_state_bytes(optimizer, torch.device("cuda", 0)) == 64


@pytest.mark.slow
def test_adamw_steps_without_a_second_copy_of_the_weights():
    """torch's foreach AdamW holds list-wide temporaries at the step (about one more copy of
    every weight); the fused kernel nbtune uses holds none. At the optimizer phase's peak only
    the weights, their gradients, the two moments and one tensor's worth of scratch are live."""
    from helpers import small_session

    session = small_session(method="full")
    session.memory_tracking = "every_step"
    session.run(2, progress=False, live=False)
    memory = session.history[-1].memory
    largest = max(p.numel() * p.element_size() for p in session.model.parameters())
    floor = memory.parameters + memory.gradients + memory.optimizer_state
    assert floor <= memory.phases["optimizer"]["peak"] <= floor + largest
