"""QLoRA: LoRA adapters over frozen NF4 base weights (torchao), tested at the module level.

Memory from the step's breakdown, training against the exact LoRA run, merging, PEFT
export, new adapters over the same base, and loading with NF4 applied tensor by tensor.
"""

import contextlib
import json

import peft
import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

import nbtune as nt
import nbtune.peft as nt_peft
from nbtune.run.trainer import check_weights, full_weights, write_weights
from nbtune.memory.accounting import storage_bytes
from nbtune.models import demo_model_dir
from nbtune.peft import (LoRALinear, adapter_config, adapter_state_dict, apply_lora, cast_model,
                         dequantize, is_nf4, merge_lora, merged_state_dict, replace_adapters)
from nbtune.step import StepOptions, train_step
from nbtune.techniques import LORA_TARGETS

from helpers import small_session

STEPS = 10
LR = 1e-3  # 1e-2 makes the exact LoRA run itself spike (to 6.5 at step 6): no fair reference
# max |QLoRA loss - LoRA loss| over the first 10 steps, rank 8, all seven projections, same
# batches and adapter init (adapter seeds 0-3): bf16 0.016-0.031 (0.023 for the seed used
# here), fp32 0.012-0.028. The bound is 2x the largest; the loss falls by ~1.15 meanwhile.
LOSS_DISTANCE = 0.06
# Max |logit difference| between our QLoRA model and its exported adapter in PEFT on the
# original dense base: this is NF4's own error (the same adapter on the dequantized base
# matches to 0.0). Measured 0.18-0.21 with logits up to ~1.2, for adapter scales 0.01-0.05.
NF4_LOGIT_TOLERANCE = 0.3
IDS = torch.randint(0, 250, (2, 37), generator=torch.Generator().manual_seed(5))


def lora_model(dtype: str = "fp32", quantize_base: bool = True, rank: int = 8, seed: int = 0):
    model = nt.load_model(demo_model_dir(), dtype=dtype)
    torch.manual_seed(seed)  # the adapters' init: equal for the LoRA and QLoRA runs
    apply_lora(model, LORA_TARGETS, rank, 16.0, 0.0, quantize_base=quantize_base)
    return model


def nf4_weights(model) -> dict:
    return {name: p for name, p in model.named_parameters() if is_nf4(p)}


def logits(model) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(IDS)


def randomize_adapters(model, std: float = 0.05) -> None:
    """Non-zero lora_B, so the adapters change the output (fresh ones add zero)."""
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, LoRALinear):
                weight = module.lora_B.weight
                weight.copy_(torch.randn(weight.shape, generator=generator) * std)


@pytest.fixture(scope="module")
def bf16_runs():
    """Ten steps of LoRA and of QLoRA in bf16 on the same batches: (losses, last report, model)."""
    session = small_session()
    batches = [session.trainer.stream.next() for _ in range(STEPS)]
    runs = {}
    for method, quantize_base in (("lora", False), ("qlora", True)):
        model = lora_model("bf16", quantize_base)
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
        reports = [train_step(model, optimizer, [batch], StepOptions(),
                              pad_id=session.tokenizer.pad_id, step=step)
                   for step, batch in enumerate(batches, 1)]
        runs[method] = ([r.loss for r in reports], reports[-1], model)
    return runs


@pytest.mark.slow
def test_qlora_loss_falls_and_stays_near_the_exact_lora_run(bf16_runs):
    lora, _, _ = bf16_runs["lora"]
    qlora, _, model = bf16_runs["qlora"]
    assert len(nf4_weights(model)) == 7 * model.config.num_layers
    assert qlora[-1] < qlora[0] - 0.5  # measured 5.78 -> 4.62
    distance = max(abs(a - b) for a, b in zip(lora, qlora))
    assert 0 < distance <= LOSS_DISTANCE  # 0 would mean the base was not quantized at all


def test_nf4_base_takes_at_most_0_3x_its_bf16_bytes_in_the_breakdown(bf16_runs):
    _, lora_report, lora = bf16_runs["lora"]
    _, qlora_report, qlora = bf16_runs["qlora"]
    quantized = nf4_weights(qlora)
    bf16_bytes = sum(p.numel() * 2 for p in quantized.values())
    # Both models hold the same adapters, norms and embeddings; they differ only in the
    # base weights, dense bf16 in one and NF4 in the other.
    dense_elsewhere = lora_report.memory.parameters - bf16_bytes
    nf4_bytes = qlora_report.memory.parameters - dense_elsewhere
    assert nf4_bytes <= 0.3 * bf16_bytes  # measured 0.262 (codes 0.25, int8 scales 0.008)
    assert nf4_bytes >= 0.25 * bf16_bytes  # the 4-bit codes alone: anything less is miscounted
    assert qlora_report.memory.parameters == storage_bytes(qlora.parameters())
    assert storage_bytes(quantized.values()) == nf4_bytes
    assert dense_elsewhere == storage_bytes(p for n, p in lora.named_parameters()
                                            if not n.endswith("base_layer.weight"))


def test_merged_state_dict_is_the_dequantized_base_plus_the_update():
    model = lora_model()
    randomize_adapters(model)
    before = logits(model)
    state = merged_state_dict(model)
    assert set(state) == set(nt.load_model(demo_model_dir()).state_dict())
    assert not any(is_nf4(v) for v in state.values())
    for name, module in model.named_modules():
        if isinstance(module, LoRALinear):
            base = module.base_layer.weight
            update = module.lora_B.weight @ module.lora_A.weight * module.scaling
            torch.testing.assert_close(state[f"{name}.weight"],
                                       base.get_original_weight() + update, rtol=0, atol=1e-6)
            assert (update.abs().max() > 1e-3)  # the update is really there
    assert merge_lora(model) == 7 * model.config.num_layers
    assert not nf4_weights(model) and all(p.dtype == torch.float32 for p in model.parameters())
    torch.testing.assert_close(logits(model), before, rtol=0, atol=1e-5)
    for key, value in model.state_dict().items():
        assert torch.equal(value, state[key]), key


def test_qlora_adapter_loads_in_peft_on_the_dense_base(tmp_path):
    model = lora_model()
    randomize_adapters(model)
    ours = logits(model)
    save_file(adapter_state_dict(model), str(tmp_path / "adapter_model.safetensors"))
    (tmp_path / "adapter_config.json").write_text(json.dumps(adapter_config(model, "demo")))
    base = transformers.AutoModelForCausalLM.from_pretrained(demo_model_dir())
    adapted = peft.PeftModel.from_pretrained(base, tmp_path).eval()
    with torch.no_grad():
        theirs = adapted(IDS).logits
        with adapted.disable_adapter():
            plain = adapted(IDS).logits
    assert (theirs - ours).abs().max() <= NF4_LOGIT_TOLERANCE
    assert (theirs - plain).abs().max() > 2 * NF4_LOGIT_TOLERANCE  # measured 1.06: adapters matter
    # On the dequantized NF4 base, PEFT computes exactly what we do: the mapping is exact.
    params = dict(adapted.named_parameters())
    with torch.no_grad():
        for name, p in nf4_weights(model).items():
            params[f"base_model.model.{name}"].copy_(dequantize(p))
        torch.testing.assert_close(adapted(IDS).logits, ours, rtol=0, atol=1e-5)


def test_replace_adapters_keeps_the_nf4_base(monkeypatch):
    model = lora_model()
    randomize_adapters(model)
    before = nf4_weights(model)
    parts = {n: p.quantized_data.data_ptr() for n, p in before.items()}

    def no_requantizing(*args, **kwargs):
        raise AssertionError("the base was quantized again")

    monkeypatch.setattr(nt_peft, "to_nf4", no_requantizing)
    assert replace_adapters(model, LORA_TARGETS, 4, 8.0, 0.0, quantize_base=True) == len(before)
    after = nf4_weights(model)
    assert after.keys() == before.keys() and all(after[n] is before[n] for n in before)
    assert all(p.quantized_data.data_ptr() == parts[n] for n, p in after.items())
    adapters = [m for m in model.modules() if isinstance(m, LoRALinear)]
    assert all(m.rank == 4 and m.lora_A.weight.shape[0] == 4 for m in adapters)
    assert all(not m.lora_B.weight.any() for m in adapters)  # fresh: zero, the output is the base's
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    # Fewer targets: the untargeted layers keep their NF4 weight and still run.
    replace_adapters(model, ("q_proj",), 4, 8.0, 0.0, quantize_base=True)
    assert all(nf4_weights(model)[n.replace(".base_layer", "")] is p
               for n, p in before.items() if "q_proj" not in n)
    assert torch.isfinite(logits(model)).all()


def test_load_model_quantizes_as_it_reads(monkeypatch):
    lean = nt.load_model(demo_model_dir(), dtype="bf16", quantize=LORA_TARGETS)
    plain = nt.load_model(demo_model_dir(), dtype="bf16")
    quantized = nf4_weights(lean)
    assert len(quantized) == 7 * lean.config.num_layers
    assert all(not p.requires_grad for p in quantized.values())
    dense = [p for n, p in lean.named_parameters() if "proj" not in n]  # norms, embeddings
    assert dense and not any(map(is_nf4, dense))
    for name, module in plain.named_modules():
        if name.rpartition(".")[2] in LORA_TARGETS:
            nt_peft.quantize_weight_(module)
    for name, p in quantized.items():
        q = plain.get_parameter(name)
        for part in ("quantized_data", "quantized_scalers", "quantization_factor", "scaler_mean"):
            assert torch.equal(getattr(p, part), getattr(q, part)), (name, part)
    assert torch.equal(logits(lean), logits(plain))
    # The loaded NF4 weights are the QLoRA base as they are: no second quantization.
    monkeypatch.setattr(nt_peft, "to_nf4", lambda *a, **k: pytest.fail("quantized twice"))
    apply_lora(lean, LORA_TARGETS, 8, 16.0, 0.0, quantize_base=True)
    assert all(lean.get_parameter(n.replace("proj.", "proj.base_layer.")) is p
               for n, p in quantized.items())
    with pytest.raises(ValueError, match="names no Linear"):
        nt.load_model(demo_model_dir(), quantize=("lm_head",))


def test_cast_model_keeps_nf4_codes_and_adds_no_dense_copy():
    model = lora_model("fp32")
    codes = {n: p.quantized_data.data_ptr() for n, p in nf4_weights(model).items()}
    cast_model(model, torch.bfloat16)
    cast_weights = nf4_weights(model)
    assert all(p.dtype == torch.bfloat16 and p.quantized_data.data_ptr() == codes[n]
               for n, p in cast_weights.items())
    assert all(p.dtype == torch.bfloat16 for n, p in model.named_parameters() if n not in codes)
    assert not any(map(holds_dense_data, cast_weights.values()))
    assert logits(model).dtype == torch.bfloat16
    # Why cast_model exists: nn.Module.to(dtype) dequantizes into a hidden dense copy.
    model.to(torch.bfloat16)
    assert all(map(holds_dense_data, nf4_weights(model).values()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_dequantize_and_the_nf4_linear_give_torchaos_values_bit_for_bit(dtype):
    # nbtune looks a code byte up in one table, and in 2-byte dtypes from 64 Ki code bytes on
    # (512 x 256 here) two; torchao decodes each nibble on its own: the same values, the same
    # products with the block scales. fp64 is left to torchao.
    generator = torch.Generator().manual_seed(3)
    for shape, scaler_block in (((512, 256), 256), ((96, 64), 96), ((4, 320), 20), ((1, 64), 1)):
        weight = torch.randn(shape, generator=generator).to(dtype) * 3
        weight[0, :64] = 0  # a block of zeros: its scale is 0
        nf4 = nt_peft._nf4().to_nf4(weight, 64, scaler_block)
        expected = nf4.get_original_weight()
        assert torch.equal(dequantize(nf4), expected) and dequantize(nf4).dtype == dtype
        assert torch.equal(dequantize(nf4, torch.float32), expected.float())
        x = torch.randn(5, shape[1], generator=generator).to(dtype).requires_grad_()
        x_ref = x.detach().clone().requires_grad_()
        out, out_ref = nt_peft._LinearNF4.apply(x, nf4), nt_peft._nf4().linear_nf4(x_ref, nf4)
        grad = torch.randn(out.shape, generator=generator).to(dtype)
        out.backward(grad)
        out_ref.backward(grad)
        assert torch.equal(out, out_ref) and torch.equal(x.grad, x_ref.grad)
        assert torch.equal(dequantize(nf4.t()), expected.t())  # a transposed view, as torchao's


def test_an_unadapted_nf4_linear_gives_torchaos_values_and_plain_linears_when_dense():
    """A mixture of experts' NF4 experts that no adapter wraps (``NF4Linear``): the product
    and the input's gradient are torchao's ``linear_nf4``'s bit for bit, the bias added; made
    dense again, it is nn.Linear."""
    generator = torch.Generator().manual_seed(5)
    linear = torch.nn.Linear(256, 128, dtype=torch.bfloat16)
    nt_peft.quantize_weight_(linear)
    linear.__class__ = nt_peft.NF4Linear
    x = torch.randn(4, 256, generator=generator).bfloat16().requires_grad_()
    x_ref = x.detach().clone().requires_grad_()
    out = linear(x)
    expected = nt_peft._nf4().linear_nf4(x_ref, linear.weight) + linear.bias
    grad = torch.randn(out.shape, generator=generator).bfloat16()
    out.backward(grad)
    expected.backward(grad)
    assert torch.equal(out, expected) and torch.equal(x.grad, x_ref.grad)
    nt_peft.dequantize_model_(linear)
    assert torch.equal(linear(x), torch.nn.functional.linear(x, linear.weight, linear.bias))


@pytest.mark.parametrize("shape, dtype", [((768, 2048), torch.bfloat16), ((96, 64), torch.bfloat16),
                                          ((128, 256), torch.float32), ((512, 256), torch.float16)])
def test_the_estimators_nf4_product_holds_what_the_real_one_holds(shape, dtype):
    """On fake tensors ``dequantize`` makes the tensors the real lookup makes (in order, no
    values): a step through an NF4 layer tracked on real tensors and on fake ones holds the
    same bytes at its peak (the dequantized weight's: table, codes as ints, the values)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from nbtune.memory.tracker import CpuStepMemory

    peaks = []
    for mode in (contextlib.nullcontext(), FakeTensorMode(allow_non_fake_inputs=True)):
        with mode:
            frozen = torch.nn.Linear(shape[1], shape[0], bias=False, dtype=dtype)
            nt_peft.quantize_weight_(frozen)
            frozen.__class__ = nt_peft.NF4Linear
            head = torch.nn.Linear(shape[0], 3, dtype=dtype)
            model = torch.nn.Sequential(frozen, head)
            x = torch.ones(5, shape[1], dtype=dtype, requires_grad=True)
            memory = CpuStepMemory(model, torch.optim.SGD(head.parameters(), lr=0.1), x)
            with memory:
                model(x).sum().backward()
            peaks.append(memory.result().peak)
    weight = shape[0] * shape[1] * dtype.itemsize
    assert peaks[0] == peaks[1] and peaks[0] > 1.5 * weight  # the dense copy and the codes as ints


def test_a_compiled_qlora_layer_equals_the_eager_one():
    """``compile`` compiles each layer: the NF4 lookup must trace (torch.compile's own graph
    capture and autograd, without generated kernels), with equal outputs and gradients."""
    generator = torch.Generator().manual_seed(4)
    torch.manual_seed(4)
    layer = LoRALinear(torch.nn.Linear(256, 512, bias=False, dtype=torch.bfloat16), 8, 16.0, 0.0)
    nt_peft.quantize_weight_(layer.base_layer)
    with torch.no_grad():
        layer.lora_B.weight.normal_(0, 0.05, generator=generator)
    x = torch.randn(3, 256, generator=generator).bfloat16()  # bf16: the two-byte lookup
    results = []
    for run in (layer, torch.compile(layer, backend="aot_eager", fullgraph=True)):
        x_in = x.clone().requires_grad_()
        layer.zero_grad()
        out = run(x_in)
        out.square().sum().backward()
        results.append((out.detach(), x_in.grad, layer.lora_A.weight.grad.clone()))
    for eager, compiled in zip(*results):
        assert torch.equal(eager, compiled)


def holds_dense_data(weight) -> bool:
    """Whether an NF4 wrapper also carries dense data of its own (it should only hold parts)."""
    try:
        return weight.untyped_storage().data_ptr() != 0
    except RuntimeError:  # "invalid python storage": a pure wrapper, as it should be
        return False


def test_training_checkpoint_restores_nf4_weights_bit_for_bit(tmp_path):
    model = lora_model()
    save_file({k: v.contiguous() for k, v in full_weights(model).items()},
              str(tmp_path / "weights.safetensors"))
    other = nt.load_model(demo_model_dir())
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.01)  # another base: its NF4 codes differ
    apply_lora(other, LORA_TARGETS, 8, 16.0, 0.0, quantize_base=True)
    weights = load_file(str(tmp_path / "weights.safetensors"))
    check_weights(other, weights, full=True)  # every name and shape fits: nothing missing
    write_weights(other, weights, full=True)
    for name, p in nf4_weights(model).items():
        q = other.get_parameter(name)
        assert torch.equal(p.quantized_data, q.quantized_data) and torch.equal(p.nf4, q.nf4), name
    assert torch.equal(logits(model), logits(other))


@pytest.mark.slow
def test_session_qlora_trains_keeps_its_base_on_rank_change_and_merges_back():
    from helpers import small_session
    from nbtune.peft import is_nf4

    session = small_session(method="qlora", dtype="bf16", lr=1e-3)
    bases = {n: p for n, p in session.model.named_parameters() if is_nf4(p)}
    assert len(bases) == 7 * 4  # every projection of the 4 layers
    losses = [session.step().loss for _ in range(6)]
    assert losses[-1] < losses[0]
    session.set(lora_rank=4)
    after = {n: p for n, p in session.model.named_parameters() if is_nf4(p)}
    assert all(after[n] is bases[n] for n in bases)  # not quantized again
    session.step()
    session.set(method="full")
    assert not any(is_nf4(p) for p in session.model.parameters())
    assert session.step().loss > 0
