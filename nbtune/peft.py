"""LoRA and QLoRA by swapping layers on a built model: frozen base Linear + low-rank update.

Module names follow PEFT (``q_proj.base_layer``, ``q_proj.lora_A``, ``q_proj.lora_B``)
so adapters can be exported for ``peft.PeftModel`` without renaming.

QLoRA is the same ``LoRALinear`` whose base weight is a torchao ``NF4Tensor`` (4-bit
NormalFloat codes in blocks of 64, each block's absmax scale itself quantized to int8 in
blocks of 256, as torchao and torchtune do): about 0.26x the bytes of bf16. The forward
dequantizes it to the input's dtype as torchao's ``linear_nf4`` does, saving only the NF4
weight for backward, through ``dequantize``: torchao's values bit for bit, 6x faster.
"""

from __future__ import annotations

import contextlib
import math
import re
import sys

import torch
from torch import nn
# torch internal: fake tensors (the estimator's) are told apart to skip real NF4 quantizing.
from torch._subclasses.fake_tensor import is_fake

NF4_BLOCK = 64  # weights per absmax scale (torchao's and torchtune's default)
NF4_SCALER_BLOCK = 256  # scales per fp scale of the double quantization (ditto)
SHARDS = 8  # FSDP2 splits an NF4 weight into this many ranks' parts, or any divisor of it
_NF4_MODULE = "torchao.quantization.quantize_.workflows.nf4.nf4_tensor"


def _nf4():
    """torchao's NF4 module, imported on first use: it adds ~1.5 s to ``import nbtune``."""
    from .quiet import import_quietly

    return import_quietly(_NF4_MODULE)


def is_nf4(tensor) -> bool:
    """Whether ``tensor`` is a torchao NF4Tensor (without importing torchao, which makes them)."""
    module = sys.modules.get(_NF4_MODULE)
    return module is not None and isinstance(tensor, module.NF4Tensor)


def to_nf4(weight: torch.Tensor, name: str = "weight"):
    """NF4 copy of a weight, in its dtype and on its device.

    The scale blocks are 256 long where that leaves a multiple of 8 of them (every layer of
    the real models: Llama-3.1-8B's k_proj has 256), so that FSDP2 can split the weight over
    up to 8 ranks, each holding whole blocks (``scaler_block``); smaller layers (the tiny
    demo's) get shorter ones.
    """
    if weight.dim() != 2 or weight.numel() % NF4_BLOCK:
        raise ValueError(f"{name} {tuple(weight.shape)} cannot be stored as NF4: it needs a 2-D "
                         f"weight whose size is a multiple of {NF4_BLOCK}.")
    scaler_block = _scaler_block(weight.numel() // NF4_BLOCK)
    if is_fake(weight):
        return _nf4_layout(weight, scaler_block)
    return _nf4().to_nf4(weight.detach().contiguous(), NF4_BLOCK, scaler_block)


def nf4_block_absmax(rows: torch.Tensor) -> torch.Tensor:
    """Each block of 64 weights' largest magnitude, as torchao takes it (the first level of
    NF4's scales): what ranks holding parts of one weight gather to share its mean."""
    return _nf4().get_block_absmax(rows.reshape(-1), NF4_BLOCK)


@torch.no_grad()
def nf4_of_rows(rows: torch.Tensor, whole: tuple[int, int], absmax: torch.Tensor):
    """The NF4 of some whole rows of a weight of shape ``whole``, byte for byte the rows' part
    of ``to_nf4`` of the whole weight, given the whole weight's ``nf4_block_absmax``.

    torchao's double quantization subtracts the mean of every block's scale from each before
    quantizing them to int8 by blocks of ``scaler_block``; the mean is the only value that
    depends on rows outside these, so it is taken from ``absmax`` with torchao's own ``mean``
    (the same tensor, the same kernel: the same bits). The rest is torchao's arithmetic on
    these rows alone, which holds wherever their blocks and scale blocks start on a boundary
    (``distributed.check_sharding`` sees to it)."""
    nf4 = _nf4()
    numel = whole[0] * whole[1]
    scaler_block = _scaler_block(numel // NF4_BLOCK)
    mean = absmax.mean()
    scalers = nf4_block_absmax(rows) - mean  # torchao's double_quantize_scalers from here on
    count = scalers.numel() // scaler_block
    blocks = scalers.view(count, scaler_block)
    scale_max = nf4.get_block_absmax(scalers, scaler_block).unsqueeze(-1).expand(count, scaler_block)
    factor = 256 / (2 * scale_max)
    quantized_scalers = (blocks * factor).round().clamp(-128, 127).flatten().to(torch.int8)
    factor = factor[:, 0].view(count).contiguous()
    table = _nf4_levels(rows.dtype, rows.device)
    codes = nf4.NF4Tensor.convert_to_norm_float_weight(rows.contiguous(), rows.numel() // NF4_BLOCK,
                                                        NF4_BLOCK, table)
    meta = nf4.SubclassTensorArgs(rows.size(), rows.stride(), 0, rows.dtype, rows.device, False)
    return nf4.NF4Tensor(meta, NF4_BLOCK, numel // NF4_BLOCK, scaler_block, quantized_scalers,
                         factor, mean, codes, table)


def _nf4_levels(dtype: torch.dtype, device) -> torch.Tensor:
    """torchao's 16 NF4 levels (defined inside its quantizer only), from two small blocks."""
    probe = torch.arange(2 * NF4_BLOCK, dtype=dtype, device=device)
    return _nf4().to_nf4(probe, NF4_BLOCK, 2).nf4


def _scaler_block(blocks: int) -> int:
    """The longest scale block (a divisor of 256 and of ``blocks``) that leaves a multiple of
    ``SHARDS`` scale blocks; else the longest that divides ``blocks``."""
    for size in (NF4_SCALER_BLOCK >> k for k in range(NF4_SCALER_BLOCK.bit_length())):
        if blocks % size == 0 and (blocks // size) % SHARDS == 0:
            return size
    return math.gcd(blocks, NF4_SCALER_BLOCK)


def nf4_parts(size: int) -> tuple[int, int, int]:
    """Sizes of an NF4 weight of ``size`` values' parts that FSDP2 splits over ranks: its
    4-bit codes (bytes), its int8 block scales and their float factors."""
    blocks = size // NF4_BLOCK
    return size // 2, blocks, blocks // _scaler_block(blocks)


def _nf4_layout(weight: torch.Tensor, scaler_block: int):
    """The estimator's NF4 weight: torchao's NF4Tensor made of empty parts of the shapes and
    dtypes ``to_nf4`` gives (the tests compare them), without quantizing a fake weight, which
    costs as much as the rest of an estimate. Made under the estimator's FakeTensorMode."""
    nf4 = _nf4()
    n = weight.numel()
    blocks = n // NF4_BLOCK
    meta = nf4.SubclassTensorArgs(weight.size(), weight.stride(), weight.storage_offset(),
                                  weight.dtype, weight.device, False)

    def empty(size, dtype):
        return torch.empty(size, dtype=dtype, device=weight.device)

    scalers = blocks // scaler_block
    # As torchao makes it: one scale per scaler block cut from a [scalers, scaler_block] tensor,
    # which keeps that whole tensor's storage when there is a single scaler block.
    factor = empty((scalers, scaler_block), weight.dtype)[:, 0].view(scalers).contiguous()
    return nf4.NF4Tensor(meta, NF4_BLOCK, blocks, scaler_block,
                         quantized_scalers=empty(blocks, torch.int8), quantization_factor=factor,
                         scaler_mean=empty((), weight.dtype), quantized_data=empty(n // 2, torch.uint8),
                         nf4=empty(16, weight.dtype))


def dequantize(tensor: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A dense copy of an NF4 tensor (in its dtype, or ``dtype``); any other tensor as it is.

    Bit for bit torchao's ``get_original_weight``, which spends most of its time on two int64
    copies of the codes and two gathers: 3.2 ms for a 2048 x 768 bf16 weight on 2 CPU cores,
    against 0.5 ms here, where one gather looks up the four values two bytes of codes stand
    for. With checkpointing a QLoRA step dequantizes each weight three times.
    """
    if not is_nf4(tensor):
        return tensor
    if not tensor.is_contiguous() and tensor.t().is_contiguous():  # a transposed view
        return dequantize(tensor.t(), dtype).t()
    ints = {2: torch.int32, 4: torch.int64}.get(tensor.dtype.itemsize)  # one int: a byte's 2 values
    if ints is None or not tensor.is_contiguous() or sys.byteorder != "little":
        dense = tensor.get_original_weight()  # torchao's own: fp64, other layouts and hosts
    else:
        dense = _nf4_dense(tensor, ints)
    return dense if dtype in (None, dense.dtype) else dense.to(dtype)


def _nf4_dense(weight, ints: torch.dtype) -> torch.Tensor:
    """torchao's dequantization as a table lookup: each code byte (two 4-bit codes, the first
    in the high nibble) indexes the two NF4 values it stands for, as one ``ints`` value; in 2-byte
    dtypes, from 64 Ki code bytes on (the table's own 512 KiB is then at most its output's
    half), a little-endian uint16 indexes four. Then each block of 64 is scaled, in the
    weight's dtype, as torchao does."""
    codes, nf4 = weight.quantized_data, weight.nf4
    large = ints == torch.int32 and codes.numel() >= 1 << 16 and codes.numel() % 2 == 0
    if not torch.compiler.is_compiling() and is_fake(codes):  # (compile traces values)
        return _nf4_dense_fake(weight, ints, large)
    pairs = torch.stack([nf4.repeat_interleave(16), nf4.repeat(16)], -1).view(ints).view(256)
    if large:
        table = torch.stack([pairs.expand(256, 256), pairs.view(256, 1).expand(256, 256)], -1)
        table = table.view(torch.int64).view(-1)
        index = codes.view(torch.int16).int().bitwise_and_(0xFFFF)
    else:
        table, index = pairs, codes.int()
    scales = weight.dequantize_scalers(weight.quantized_scalers, weight.quantization_factor,
                                       weight.scaler_block_size)
    values = table.index_select(0, index).view(weight.dtype).view(scales.numel(), -1)
    return values.mul_(scales.unsqueeze(-1)).view(weight.shape)


def _nf4_dense_fake(weight, ints: torch.dtype, large: bool) -> torch.Tensor:
    """``_nf4_dense`` on the estimator's fake tensors: the tensors it makes, in its order and
    held as long, without their values (traced op by op they were most of a QLoRA estimate):
    pairs, table, the codes as ints, a scale per block of 64, then the values (index_select's
    [index] of the table's dtype: the weight's bytes)."""
    codes = weight.quantized_data

    def empty(size, dtype):
        return torch.empty(size, dtype=dtype, device=codes.device)

    pairs = empty(256, ints)
    table = empty(1 << 16, torch.int64) if large else pairs
    index = empty(codes.numel() // 2 if large else codes.numel(), torch.int32)
    scales = empty(weight.numel() // weight.block_size, weight.dtype)
    values = empty(weight.shape, weight.dtype)
    del pairs, table, index, scales  # (freed at return in the real lookup too)
    return values


def quantize_weight_(linear: nn.Linear, name: str = "weight") -> bool:
    """Store ``linear``'s frozen weight as NF4; False (and nothing touched) when it already is."""
    if is_nf4(linear.weight):
        return False
    linear.weight = nn.Parameter(to_nf4(linear.weight, name), requires_grad=False)
    return True


def dequantize_model_(model: nn.Module) -> int:
    """Make every NF4 weight dense again (in its dtype); returns how many."""
    count = 0
    for module in model.modules():
        for key, param in list(module._parameters.items()):
            if is_nf4(param):
                module._parameters[key] = nn.Parameter(dequantize(param), requires_grad=False)
                count += 1
    return count


def cast_model(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """``model.to(dtype)`` that keeps NF4 weights 4-bit.

    ``nn.Module.to(dtype)`` dequantizes an NF4 weight (even to its own dtype) and hides the
    dense copy under the NF4 wrapper: +2 bytes per weight in bf16, measured. Here the
    4-bit codes and int8 scales stay as they are; only the few float scales are cast.
    """
    held = [(module, key, param) for module in model.modules()
            for key, param in module._parameters.items() if is_nf4(param)]
    for module, key, _ in held:
        module._parameters[key] = None  # nn.Module._apply skips empty slots
    try:
        model.to(dtype)
    finally:
        for module, key, param in held:
            if param.dtype != dtype:
                floats = {part: getattr(param, part).to(dtype)
                          for part in ("quantization_factor", "scaler_mean", "nf4")}
                args = _nf4().construct_nf4_args(param, {"dtype": dtype, **floats})
                cast = _nf4().NF4Tensor(*args)
                param = nn.Parameter(cast, requires_grad=False)
            module._parameters[key] = param
    return model


class _LinearNF4(torch.autograd.Function):
    """torchao's ``linear_nf4`` over the faster ``dequantize``: the weight is made dense in the
    input's dtype for the matmul and kept 4-bit for backward, which makes it dense again."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight) -> torch.Tensor:
        ctx.save_for_backward(weight)
        return nn.functional.linear(x, dequantize(weight, x.dtype))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        weight, = ctx.saved_tensors
        return grad @ dequantize(weight, grad.dtype), None


class NF4Linear(nn.Linear):
    """A frozen Linear whose NF4 weight no adapter wraps (a mixture of experts' experts under
    QLoRA): its product goes through ``_LinearNF4`` as an adapted base's does, not torchao's
    ``F.linear`` path, whose ``get_original_weight`` is 6x slower and holds two int64 copies
    of the codes. A dense weight (made dense again) takes nn.Linear's own path."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not is_nf4(self.weight):
            return super().forward(x)
        out = _LinearNF4.apply(x, self.weight)
        return out if self.bias is None else out + self.bias


def new_adapters(in_features: int, out_features: int, rank: int, device, dtype) -> tuple[nn.Linear, nn.Linear]:
    """A LoRA pair as PEFT starts it: A kaiming-uniform, B zeros. The draws (nn.Linear's own
    initialisation of each, then A's) are the same wherever a pair is made, so ranks that
    make every pair whole and keep their rows start from one process's adapters."""
    lora_A = nn.Linear(in_features, rank, bias=False, device=device, dtype=dtype)
    lora_B = nn.Linear(rank, out_features, bias=False, device=device, dtype=dtype)
    nn.init.kaiming_uniform_(lora_A.weight, a=math.sqrt(5))  # as PEFT does
    nn.init.zeros_(lora_B.weight)
    return lora_A, lora_B


class LoRALinear(nn.Module):
    """``base(x) + (alpha / rank) * B(A(dropout(x)))`` with ``base`` frozen and B zero at start.

    The base weight may be NF4 (QLoRA): the adapters are then made in the dtype the NF4
    weight stands for, and the base product goes through ``_LinearNF4``.
    """

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float) -> None:
        super().__init__()
        self.base_layer = base
        self.rank, self.alpha = rank, alpha
        self.lora_A, self.lora_B = new_adapters(base.in_features, base.out_features, rank,
                                                base.weight.device, base.weight.dtype)
        self.lora_dropout = nn.Dropout(dropout) if dropout else nn.Identity()
        base.requires_grad_(False)

    off = False  # the adapter's update skipped (``adapters_off``): the base alone

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.off:
            return self._base(x)
        return self._base(x) + self.lora_B(self.lora_A(self.lora_dropout(x))) * self.scaling

    def _base(self, x: torch.Tensor) -> torch.Tensor:
        base = self.base_layer
        if not is_nf4(base.weight):
            return base(x)
        out = _LinearNF4.apply(x, base.weight)
        return out if base.bias is None else out + base.bias

    @torch.no_grad()
    def delta_weight(self) -> torch.Tensor:
        """The low-rank update ``scaling * B @ A`` [out, in], in fp32."""
        return (self.lora_B.weight.float() @ self.lora_A.weight.float()) * self.scaling

    @torch.no_grad()
    def merged(self) -> nn.Linear:
        """The base Linear with the low-rank update folded into its weight (dense, even if NF4)."""
        base = self.base_layer
        weight = (dequantize(base.weight).float() + self.delta_weight()).to(base.weight.dtype)
        # A new weight, not written into the old one (NF4 could not hold the update anyway):
        # a caller undoing a failed change keeps the old tensor and puts it back.
        base.weight = nn.Parameter(weight, requires_grad=False)
        return base


_EXPERT = re.compile(r"\.experts\.\d+\.(gate_proj|up_proj|down_proj)$")


def target_of(name: str) -> str:
    """The ``lora_targets`` name of the Linear module ``name``: "experts" for a projection of
    a mixture-of-experts layer's experts (not the adapters' own modules inside one), else its
    own last name part ("q_proj", "down_proj", "lora_A")."""
    return "experts" if _EXPERT.search(name) else name.rpartition(".")[2]


def lora_modules(model: nn.Module):
    """Every LoRA module of ``model``, as (name, module)."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, LoRALinear)]


def has_lora(model: nn.Module) -> bool:
    return bool(lora_modules(model))


def _swap(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, new)


def apply_lora(model: nn.Module, targets: tuple[str, ...], rank: int, alpha: float,
               dropout: float, quantize_base: bool = False) -> int:
    """Freeze every weight and wrap each Linear named in ``targets``; returns how many.

    ``quantize_base`` (QLoRA) stores each wrapped base weight as NF4; one that already is
    (``load_model(..., quantize=...)``) is kept as it is, never quantized twice.
    """
    model.requires_grad_(False)
    chosen = [(name, m) for name, m in model.named_modules()
              if isinstance(m, nn.Linear) and target_of(name) in targets]
    if not chosen:
        raise ValueError(f"No Linear layer is named one of {targets}; nothing to adapt.")
    if quantize_base:  # a mixture of experts' experts are NF4 under QLoRA, adapted or not
        for name, m in model.named_modules():
            if isinstance(m, nn.Linear) and target_of(name) == "experts":
                quantize_weight_(m, f"{name}.weight")
                if type(m) is nn.Linear:  # same parameters, the NF4 product (as FSDP2 swaps classes)
                    m.__class__ = NF4Linear
    for name, linear in chosen:
        if quantize_base:
            quantize_weight_(linear, f"{name}.weight")
        _swap(model, name, LoRALinear(linear, rank, alpha, dropout))
    return len(chosen)


def replace_adapters(model: nn.Module, targets: tuple[str, ...], rank: int, alpha: float,
                     dropout: float, quantize_base: bool = False) -> int:
    """Fresh zero-initialised adapters (another rank, other targets) over the same base layers.

    The old adapters are dropped, not folded in: folding into an NF4 base would mean
    dequantizing and quantizing it again, each time adding rounding error. Base weights
    are kept as the very same tensors; only newly targeted layers are quantized.
    """
    for name, module in lora_modules(model):
        _swap(model, name, module.base_layer)
    return apply_lora(model, targets, rank, alpha, dropout, quantize_base)


def adapters_untrained(model: nn.Module) -> bool:
    """Whether every adapter's B is still zero, as made: folding them in would add nothing
    (fake or meta weights, an estimate's, and sharded ones are taken as trained)."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    found = lora_modules(model)
    return bool(found) and all(
        not is_fake(w) and w.device.type != "meta" and not is_traceable_wrapper_subclass(w)
        and not bool(w.any()) for w in (m.lora_B.weight for _, m in found))


def drop_lora(model: nn.Module) -> None:
    """Every adapted layer's base put back, its adapters dropped."""
    for name, module in lora_modules(model):
        _swap(model, name, module.base_layer)


@contextlib.contextmanager
def adapters_off(model: nn.Module):
    """The base model alone while inside (each adapter's update skipped): a preference
    objective's reference under LoRA / QLoRA, with no second copy of the model."""
    layers = [m for m in model.modules() if isinstance(m, LoRALinear)]
    for layer in layers:
        layer.off = True
    try:
        yield
    finally:
        for layer in layers:
            layer.off = False


def merge_lora(model: nn.Module) -> int:
    """Fold every adapter into its base weight and put the plain Linear back; returns how many.

    Every NF4 weight comes out dense in its dtype, adapted or not, so the merged model is
    a plain model again (it can be trained in full or saved).
    """
    found = lora_modules(model)
    for name, module in found:
        _swap(model, name, module.merged())
    dequantize_model_(model)
    return len(found)


def set_lora_options(model: nn.Module, alpha: float, dropout: float) -> None:
    """Change scaling and dropout of the adapters in place (no retraining, no new weights)."""
    for _, module in lora_modules(model):
        module.alpha = alpha
        module.lora_dropout = nn.Dropout(dropout) if dropout else nn.Identity()


def peft_key(model: nn.Module, name: str, part: str) -> str:
    """PEFT's file name of LoRA module ``name``'s ``part`` (``base_model.model.<module>.lora_A.weight``);
    a multimodal checkpoint's language model is ``model.language_model.`` in transformers."""
    if getattr(getattr(model, "config", None), "multimodal", False) and name.startswith("model."):
        name = "model.language_model." + name.removeprefix("model.")
    return f"base_model.model.{name}.{part}.weight"


def adapter_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """The adapters' parameters under PEFT's file names (``peft_key``): what a saved adapter
    holds, and where a loaded one goes."""
    return {peft_key(model, name, part): getattr(module, part).weight
            for name, module in lora_modules(model) for part in ("lora_A", "lora_B")}


def adapter_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Adapter weights under PEFT's file names, detached (to save)."""
    return {name: p.detach().contiguous() for name, p in adapter_parameters(model).items()}


def adapter_config(model: nn.Module, base_model: str | None) -> dict:
    """PEFT's adapter_config.json for the adapters on ``model`` (all share one rank and alpha;
    a mixture of experts' as PEFT's ``target_parameters``: ``peft_experts``)."""
    from .peft_experts import expert_groups, peft_config_entries

    found = lora_modules(model)
    if not found:
        raise ValueError("The model has no LoRA adapters to describe.")
    first = found[0][1]
    dropout = first.lora_dropout.p if isinstance(first.lora_dropout, nn.Dropout) else 0.0
    # a multimodal base: its vision tower's q/k/v are not these adapters' places
    multimodal = getattr(getattr(model, "config", None), "multimodal", False)
    groups = expert_groups(found)
    experts = peft_config_entries(next(iter(groups.values())), first.alpha) if groups else {}
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
        "r": first.rank, "lora_alpha": first.alpha, "lora_dropout": dropout,
        "target_modules": _target_modules(model, [name for name, _ in found]),
        "bias": "none", "fan_in_fan_out": False, "inference_mode": True,
        "init_lora_weights": True, "use_rslora": False, "use_dora": False,
        "modules_to_save": None, "layers_to_transform": None, "layers_pattern": None,
        "rank_pattern": {}, "alpha_pattern": {},
        **({"exclude_modules": r".*(vision_tower|multi_modal_projector).*"} if multimodal else {}),
        **experts,
    }


def _target_modules(model: nn.Module, names: list[str]) -> list[str]:
    """PEFT's ``target_modules`` for the adapted modules ``names``: their last name parts (a
    mixture of experts' experts go as ``target_parameters`` instead).

    A mixture-of-experts model's dense MLPs (``mlp_only_layers``) cannot be named: transformers
    5 converts gate_proj, up_proj and down_proj targets of that family into its fused experts'
    (it refuses gate_proj without up_proj, and would load the others onto the experts)."""
    moe = any(name.endswith(".experts") for name, _ in model.named_modules())
    targets = {target_of(name) for name in names} - {"experts"}
    dense = sorted(targets & {"gate_proj", "up_proj", "down_proj"})
    if moe and dense:
        raise ValueError(
            f"An adapter on a mixture-of-experts model's dense {', '.join(dense)} cannot be saved "
            "for PEFT: transformers 5 reads those names as the model's fused experts and would "
            "load it onto other weights. Save with merge=True, or train with lora_targets="
            "('q_proj', 'k_proj', 'v_proj', 'o_proj', 'experts').")
    return sorted(targets)


class DenseWeights:
    """A model's weights under plain (HF) names, dense (NF4 dequantized) and with every adapter
    folded in, each made only when asked for: an export writes them one part at a time, so it
    holds one part beside the model, not a second model (16 GB for Llama-3.1-8B in bf16).
    ``described``: each weight's name, shape and dtype (meta tensors, nothing made);
    ``modules``: the module each is made from. Tensors are looked up when made: across ranks
    (``shards.Gathered``) that is while FSDP2 holds them gathered."""

    def __init__(self, model: nn.Module):
        lora = dict(lora_modules(model))
        self._sources: dict[str, tuple[nn.Module, str, nn.Module | None]] = {}
        self.modules: dict[str, str] = {}
        self.described: dict[str, torch.Tensor] = {}
        for key, value in model.state_dict(keep_vars=True).items():
            module_name, _, leaf = key.rpartition(".")
            parent, _, child = module_name.rpartition(".")
            adapter, owner = None, module_name
            if parent in lora:
                if child != "base_layer":
                    continue  # lora_A / lora_B: folded into the weight when it is made
                adapter = lora[parent] if leaf == "weight" else None
                key, owner = f"{parent}.{leaf}", parent
            self._sources[key] = (model.get_submodule(module_name), leaf, adapter)
            self.modules[key] = owner
            self.described[key] = torch.empty(value.shape, dtype=value.dtype, device="meta")

    def drop(self, key: str) -> None:
        """Leave ``key`` out (a tied head, which files leave out)."""
        for held in (self._sources, self.modules, self.described):
            held.pop(key, None)

    @torch.no_grad()
    def make(self, key: str) -> torch.Tensor:
        """The weight ``key`` made now, on the model's device (a new tensor only where it is
        merged or dequantized)."""
        module, leaf, adapter = self._sources[key]
        value = getattr(module, leaf)
        if adapter is not None:
            return (dequantize(value).float() + adapter.delta_weight()).to(value.dtype)
        return dequantize(value).detach().contiguous()


class AdapterWeights:
    """The LoRA adapters under PEFT's file names (what a saved adapter holds), each looked up
    when asked for; ``described`` and ``modules`` as ``DenseWeights`` has them. A mixture of
    experts' adapters are made in PEFT's fused form (``peft_experts``) from every expert's."""

    def __init__(self, model: nn.Module):
        from .peft_experts import expert_groups, fused, fused_shape, peft_names

        found = lora_modules(model)
        groups = expert_groups(found)
        grouped = {id(m) for group in groups.values() for m in group.values()}
        self._make = {}
        self.modules, self.described = {}, {}
        for name, module in found:
            if id(module) in grouped:
                continue
            for part in ("lora_A", "lora_B"):
                key, weight = peft_key(model, name, part), getattr(module, part).weight
                # looked up when made: across ranks the gathered weight, not this shard
                self._make[key] = lambda module=module, part=part: getattr(module, part).weight.detach()
                self.modules[key] = name
                self.described[key] = torch.empty(weight.shape, dtype=weight.dtype, device="meta")
        for parent, group in groups.items():
            dtype = next(iter(group.values())).lora_A.weight.dtype
            for (proj, part), key in peft_names(parent, lambda n, p: peft_key(model, n, p)).items():
                self._make[key] = lambda group=group, proj=proj, part=part: fused(group, proj, part)
                self.modules[key] = parent
                self.described[key] = torch.empty(fused_shape(group, proj, part), dtype=dtype, device="meta")

    def make(self, key: str) -> torch.Tensor:
        return self._make[key]().contiguous()


def merged_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The weights with every adapter folded in (NF4 ones dequantized), under plain (HF) names,
    all at once (a save makes them one part at a time: ``DenseWeights``); ``model`` is untouched."""
    weights = DenseWeights(model)
    return {key: weights.make(key) for key in weights.described}
