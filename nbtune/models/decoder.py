"""One config-driven decoder for the Llama / Qwen2 / Qwen3 / Mistral / Gemma 3 / Phi-3 / Qwen3-MoE
families.

Module names mirror the Hugging Face checkpoints (``model.layers.0.self_attn.q_proj``...),
so a safetensors file loads with no key mapping and LoRA adapters export under PEFT's
names. Family differences are config fields, never subclasses.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from .config import ModelConfig


class RMSNorm(nn.Module):
    """RMSNorm as Llama's reference has it (normalise in fp32, cast back, then scale), or
    with ``plus_one`` as Gemma's (scale by 1 + weight in fp32, then cast; the weight starts at 0)."""

    def __init__(self, dim: int, eps: float, plus_one: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if plus_one else torch.ones(dim))
        self.eps, self.plus_one = eps, plus_one

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.plus_one:
            return (x32 * (1.0 + self.weight.float())).to(x.dtype)
        return self.weight * x32.to(x.dtype)


def rope_frequencies(config: ModelConfig, device=None, long: bool = False) -> torch.Tensor:
    """Inverse rotary frequencies [rotary_dim / 2], with the checkpoint's rope scaling applied
    (LongRoPE: its short factors, or with ``long`` its long ones)."""
    dim = config.rotary_dim
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "longrope":  # each frequency divided by its own factor
        factors = torch.tensor(scaling["long_factor" if long else "short_factor"],
                               dtype=torch.float32, device=device)
        return 1.0 / (factors * config.rope_theta ** (
            torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim))
    # (one expression: with the exponents held in a name, the estimator's carry of a tiled
    # step from 3 and 4 tiles no longer matched tracing every tile, tests/predict/test_carry.py)
    inv_freq = 1.0 / (config.rope_theta ** (
        torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim))
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        # Llama 3.1+: slow down low frequencies by `factor`, keep high ones, blend between.
        factor, old_len = scaling["factor"], scaling["original_max_position_embeddings"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, blended, scaled)
    return inv_freq


def rope_attention_factor(config: ModelConfig) -> float:
    """What LongRoPE multiplies cos and sin by: sqrt(1 + ln(s) / ln(original context)) for a
    context stretched s times, or the config's own ``attention_factor``; 1 otherwise."""
    scaling = config.rope_scaling or {}
    if scaling.get("rope_type") != "longrope":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or config.max_position_embeddings / original
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


def rope_divisors(config: ModelConfig) -> torch.Tensor:
    """What the rope scaling divides each unscaled frequency by (llama.cpp's ``rope_freqs``)."""
    return rope_frequencies(dataclasses.replace(config, rope_scaling=None)) / rope_frequencies(config)


def local_rope(config: ModelConfig) -> ModelConfig:
    """The config whose RoPE the sliding layers use (Gemma 3: their own base, no scaling)."""
    if config.rope_local_theta is None:
        return config
    return dataclasses.replace(config, rope_theta=config.rope_local_theta, rope_scaling=None)


def rope_tables(config: ModelConfig, positions: torch.Tensor, dtype: torch.dtype):
    """cos/sin tables for ``positions`` [T] or [B, T] -> [T, D] or [B, 1, T, D] (rotate-half)."""
    inv_freq = rope_frequencies(config, positions.device)
    scale = rope_attention_factor(config)
    if (config.rope_scaling or {}).get("rope_type") == "longrope":
        # the long factors once any position is past the original context (as transformers:
        # chosen on the device, no sync)
        beyond = positions.max() + 1 > config.rope_scaling["original_max_position_embeddings"]
        inv_freq = torch.where(beyond, rope_frequencies(config, positions.device, long=True), inv_freq)
    angles = positions.float()[..., None] * inv_freq  # [..., T, D/2]
    angles = torch.cat([angles, angles], dim=-1)  # [..., T, D]
    if angles.dim() == 3:
        angles = angles[:, None]  # broadcast over heads
    if scale != 1.0:
        return (angles.cos() * scale).to(dtype), (angles.sin() * scale).to(dtype)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [B, H, T, D]; cos/sin: [T, R] or [B, 1, T, R], R < D rotating the first R only (Phi-4-mini)
    if cos.shape[-1] < x.shape[-1]:
        rot = cos.shape[-1]
        return torch.cat([apply_rope(x[..., :rot], cos, sin), x[..., rot:]], dim=-1)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def attention_mask(q_index: torch.Tensor, k_index: torch.Tensor,
                   document_ids: torch.Tensor | None = None,
                   window: int | None = None, pads: torch.Tensor | None = None) -> torch.Tensor:
    """Boolean mask [B|1, 1, Tq, Tk], True where a query may attend to a key.

    Causal by token index; with ``document_ids`` [B, T], only within the same document
    (packing); with a ``window``, only the last ``window`` tokens (Mistral); with ``pads``
    [B], each row's first ``pads`` tokens are padding (left-padded prompts generated
    together): no query sees them, and each sees only itself (a row of -inf would be NaN).
    """
    q, k = q_index[:, None], k_index[None, :]
    mask = k <= q  # [Tq, Tk]
    if window is not None:
        mask = mask & (q - k < window)
    if pads is not None:
        own = k[None] >= pads[:, None, None]  # [B, 1, Tk]: the row's own tokens
        return ((mask[None] & own) | (q == k)[None])[:, None]
    if document_ids is None:
        return mask[None, None]
    same = document_ids[:, :, None] == document_ids[:, None, :]  # [B, T, T]
    return (mask & same)[:, None]


def additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``mask`` as the 0 / -inf bias SDPA adds to the scores, in the attention's dtype: what
    SDPA itself would make of a boolean mask in every layer's call (and keep for backward,
    layer after layer), made once a forward and shared."""
    return torch.where(mask, torch.zeros((), dtype=dtype, device=mask.device),
                       torch.full((), float("-inf"), dtype=dtype, device=mask.device))


class KVCache:
    """Keys and values of the tokens seen so far, per layer, for incremental generation.

    A layer given a window (``windows``: a sliding layer's, else None) keeps only the keys a
    later query can reach, the last ``window - 1``: its cache stops growing there, as
    transformers' sliding-window cache does. ``length``: the tokens seen."""

    def __init__(self, num_layers: int, windows: list[int | None] | None = None) -> None:
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self.windows = list(windows) if windows is not None else [None] * num_layers
        self.length = 0

    def kept(self, window: int | None) -> int:
        """How many of the tokens seen a layer with ``window`` still holds."""
        return self.length if window is None or window not in self.windows \
            else min(self.length, window - 1)

    def expand(self, rows: int) -> None:
        """Share one sequence's keys and values with ``rows`` sequences that continue it (views:
        each layer's copy is made as the next token extends it)."""
        self.keys = [k if k is None else k.expand(rows, *k.shape[1:]) for k in self.keys]
        self.values = [v if v is None else v.expand(rows, *v.shape[1:]) for v in self.values]

    def extend(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """Append this step's keys/values [B, Hkv, T, D]; return those this step attends to."""
        if self.keys[layer] is not None:
            k = torch.cat([self.keys[layer], k], dim=-2)
            v = torch.cat([self.values[layer], v], dim=-2)
        window = self.windows[layer]
        if window is None:
            self.keys[layer], self.values[layer] = k, v
        else:  # a copy: a view would keep the whole concatenation alive
            keep = max(0, window - 1)
            self.keys[layer] = k[..., k.shape[-2] - min(keep, k.shape[-2]):, :].clone()
            self.values[layer] = v[..., v.shape[-2] - min(keep, v.shape[-2]):, :].clone()
        return k, v


class Int8KVCache(KVCache):
    """A KV cache in 8 bits: each cached key and value vector (one head of one token) kept as
    int8 codes and a float32 scale (its largest magnitude / 127), read back to the compute
    dtype a layer at a time as that layer attends. About half a bf16 cache (a quarter of
    fp32's) for a rounding of at most half a step, 1/254 of each vector's largest entry."""

    def __init__(self, num_layers: int, windows: list[int | None] | None = None) -> None:
        super().__init__(num_layers, windows)
        self.key_scales: list[torch.Tensor | None] = [None] * num_layers
        self.value_scales: list[torch.Tensor | None] = [None] * num_layers

    def expand(self, rows: int) -> None:
        super().expand(rows)
        self.key_scales = [s if s is None else s.expand(rows, *s.shape[1:]) for s in self.key_scales]
        self.value_scales = [s if s is None else s.expand(rows, *s.shape[1:]) for s in self.value_scales]

    def extend(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        dtype, window = k.dtype, self.windows[layer]
        out = []
        for codes, scales, new in ((self.keys, self.key_scales, k), (self.values, self.value_scales, v)):
            scale = new.detach().abs().amax(-1, keepdim=True).float() / 127
            scale = torch.where(scale > 0, scale, torch.ones_like(scale))
            code = (new.float() / scale).round_().clamp_(-127, 127).to(torch.int8)
            if codes[layer] is not None:
                code, scale = torch.cat([codes[layer], code], dim=-2), torch.cat([scales[layer], scale], dim=-2)
            keep = code.shape[-2] if window is None else min(max(0, window - 1), code.shape[-2])
            codes[layer] = code if window is None else code[..., code.shape[-2] - keep:, :].clone()
            scales[layer] = scale if window is None else scale[..., scale.shape[-2] - keep:, :].clone()
            out.append((code.float() * scale).to(dtype))  # (the rounding alone: float32 products)
        return out[0], out[1]


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        d, hd = config.hidden_size, config.head_dim
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, hd
        bias = config.attention_bias
        self.widths = [config.num_heads * hd, config.num_kv_heads * hd, config.num_kv_heads * hd]
        if config.fused_projections:  # Phi-3: one weight, split after the matmul
            self.qkv_proj = nn.Linear(d, sum(self.widths), bias=bias)
        else:
            self.q_proj = nn.Linear(d, self.widths[0], bias=bias)
            self.k_proj = nn.Linear(d, self.widths[1], bias=bias)
            self.v_proj = nn.Linear(d, self.widths[2], bias=bias)
        self.fused = config.fused_projections
        self.o_proj = nn.Linear(config.num_heads * hd, d, bias=False)
        if config.qk_norm:
            self.q_norm = RMSNorm(hd, config.rms_norm_eps, config.norm_plus_one)
            self.k_norm = RMSNorm(hd, config.rms_norm_eps, config.norm_plus_one)
        else:
            self.q_norm = self.k_norm = None
        # Gemma 3 scales scores by query_pre_attn_scalar ** -0.5; None: SDPA's 1 / sqrt(head_dim)
        self.scale = (config.query_pre_attn_scalar ** -0.5
                      if config.query_pre_attn_scalar is not None else None)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None, cache: KVCache | None = None) -> torch.Tensor:
        B, T, _ = x.shape
        # [B, T, H*D] -> [B, H, T, D]
        if self.fused:
            q, k, v = self.qkv_proj(x).split(self.widths, dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.view(B, T, self.num_heads, self.head_dim)
        k = k.view(B, T, self.num_kv_heads, self.head_dim)
        v = v.view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q.transpose(1, 2), cos, sin)
        k = apply_rope(k.transpose(1, 2), cos, sin)
        if cache is not None:
            k, v = cache.extend(self.layer_idx, k, v)
        # Causal unless a mask says otherwise or one cached token's query attends to all the
        # keys. Without a cache the answer is a plain bool: under torch.compile with a dynamic
        # length ``T > 1`` is a symbolic bool, which SDPA refuses, so each new length broke the
        # graph and recompiled the frames after the break, one step at a time (seen on an H200).
        causal = mask is None and (cache is None or T > 1)
        if mask is not None and mask.is_floating_point() and mask.dtype != q.dtype:
            mask = mask.to(q.dtype)  # a bias made in the hidden states' dtype, not the queries'
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal, scale=self.scale,
            enable_gqa=self.num_kv_heads != self.num_heads)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))


class SiluMul(torch.autograd.Function):
    """``silu(gate) * up`` that keeps only ``gate`` and ``up`` for backward.

    Autograd would also keep ``silu(gate)``, one [tokens, intermediate] tensor per layer that
    backward can recompute for the price of an elementwise op (seed 002: an unfused GLU keeps
    a tensor it does not need). The backward calls the kernels autograd calls, so gradients
    are bit for bit those of ``F.silu(gate) * up``. On the peers' fp32 rung (2 CPU cores) the
    recompute cost 0.2-1.0 % of the step, roughly (``benchmarks/results/peers/epyc-avx512/
    profiles/ab_guard_silumul.txt``), and the tensors it does not keep are 96 MiB of a 2.4 GiB peak.
    """

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        gate, up = ctx.saved_tensors
        grad_gate = grad_up = None
        if ctx.needs_input_grad[1]:
            grad_up = grad * F.silu(gate)
        if ctx.needs_input_grad[0]:
            grad_gate = torch.ops.aten.silu_backward(grad * up, gate)
        return grad_gate, grad_up


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, width: int | None = None) -> None:
        super().__init__()
        d, f = config.hidden_size, width or config.intermediate_size
        if config.fused_projections:  # Phi-3: gate then up in one weight
            self.gate_up_proj = nn.Linear(d, 2 * f, bias=False)
        else:
            self.gate_proj = nn.Linear(d, f, bias=False)
            self.up_proj = nn.Linear(d, f, bias=False)
        self.down_proj = nn.Linear(f, d, bias=False)
        self.fused = config.fused_projections
        self.gelu = config.hidden_act == "gelu_pytorch_tanh"  # Gemma's gate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1) if self.fused else (self.gate_proj(x), self.up_proj(x))
        if self.gelu:
            return self.down_proj(F.gelu(gate, approximate="tanh") * up)
        return self.down_proj(SiluMul.apply(gate, up))


class SparseMoE(nn.Module):
    """Qwen3-MoE's feed-forward: the router (``gate``) scores the experts for each token, the
    top ``num_experts_per_tok`` run it, and their outputs are summed weighted by the router's
    probabilities (renormalised over the chosen with ``norm_topk_prob``).

    The tokens are sorted by expert once and each expert runs on its run of them (a loop over
    experts, not tokens); the sum adds each token's contributions in expert order, as
    transformers does. How many tokens each expert gets is known only from the data: on fake
    tensors the estimator sets ``routing`` ("balanced": an equal share each; "worst": every
    token to the same experts). ``stats`` keeps what the load-balancing loss needs of each
    forward (``CausalLM.router_loss``)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.experts = nn.ModuleList(MLP(config, config.moe_intermediate_size)
                                     for _ in range(config.num_experts))
        self.top_k, self.renormalise = config.num_experts_per_tok, config.norm_topk_prob
        self.routing: str | None = None
        self.stats: list[tuple[torch.Tensor, torch.Tensor, int]] = []
        # set by CausalLM.hidden_states while its forward runs: a checkpointed layer's
        # recompute in backward must not keep its graph here until the next step
        self.recording = False

    # Eager under compile: how many tokens each expert gets is read back from the device, and
    # a graph traced for one split of the tokens would be traced again for every other one.
    @torch.compiler.disable
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        logits = self.gate(flat)  # [N, E]
        probs = F.softmax(logits, dim=-1, dtype=torch.float)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)  # [N, k]
        if self.renormalise:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(logits.dtype)
        assigned = chosen.reshape(-1)  # [N * k], token-major
        if self.recording:
            counts = torch.zeros(len(self.experts), device=x.device).index_add_(
                0, assigned, torch.ones_like(assigned, dtype=torch.float))
            self.stats.append((counts, probs.sum(dim=0), flat.shape[0]))
        order = assigned.argsort(stable=True)  # by expert; within one, by token
        tokens = order // self.top_k
        parts = flat[tokens].split(self._counts(assigned, flat.shape[0]))
        out = torch.cat([expert(part) for expert, part in zip(self.experts, parts)])
        out = out * weights.reshape(-1)[order, None]
        return torch.zeros_like(flat).index_add_(0, tokens, out).reshape(x.shape)

    def _counts(self, assigned: torch.Tensor, tokens: int) -> list[int]:
        """Tokens each expert runs: counted (a sync with the device), or as ``routing`` assumes."""
        experts = len(self.experts)
        if self.routing is None:
            return torch.bincount(assigned, minlength=experts).tolist()
        if self.routing == "worst":  # every token to the same top-k experts
            return [tokens if e < self.top_k else 0 for e in range(experts)]
        total = tokens * self.top_k
        return [total // experts + (e < total % experts) for e in range(experts)]


def tiled(fn, x: torch.Tensor, tile: int) -> torch.Tensor:
    """``fn(x)`` for a position-wise ``fn``, ``tile`` tokens (dim -2) at a time.

    With gradients on, each tile runs under non-reentrant checkpointing: forward keeps only
    the tile's input (a view of ``x``) and backward recomputes the tile's intermediates when
    it reaches them, so none of ``fn``'s ``[tokens, ...]`` temporaries (the MLP's
    ``[tokens, intermediate]``) ever exists for the whole sequence. ``tile`` 0: in one go.
    """
    if not tile or x.shape[-2] <= tile:
        return fn(x)
    parts = x.split(tile, dim=-2)
    if torch.is_grad_enabled():
        return torch.cat([checkpoint(fn, part, use_reentrant=False) for part in parts], dim=-2)
    return torch.cat([fn(part) for part in parts], dim=-2)


class DecoderLayer(nn.Module):
    """Attention then MLP, each with a residual. Llama's norms: one before each. Gemma 3's
    (``sandwich_norms``): one before and one after each, ``post_attention_layernorm`` being
    the one after attention there. ``ffn_norm`` is the norm the feed-forward starts with."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        norm = lambda: RMSNorm(config.hidden_size, config.rms_norm_eps, config.norm_plus_one)  # noqa: E731
        self.input_layernorm = norm()
        self.self_attn = Attention(config, layer_idx)
        self.post_attention_layernorm = norm()
        if config.sandwich_norms:
            self.pre_feedforward_layernorm = norm()
            self.post_feedforward_layernorm = norm()
        self.sandwich = config.sandwich_norms
        types = config.layer_types
        # attends within the sliding window (Gemma 3 as layer_types says, Mistral every layer)
        self.sliding = bool(config.sliding_window) and (types is None or types[layer_idx] == "sliding_attention")
        self.mlp = SparseMoE(config) if config.sparse(layer_idx) else MLP(config)
        # Set by nbtune.activations: recompute this layer in backward instead of saving.
        self.checkpointed = False
        # Set by nbtune.activations: run the norm + MLP this many tokens at a time (0: whole).
        self.tile_tokens = 0

    @property
    def ffn_norm(self) -> RMSNorm:
        """The norm the feed-forward starts with (where a tiled pass begins)."""
        return self.pre_feedforward_layernorm if self.sandwich else self.post_attention_layernorm

    def forward(self, x, cos, sin, mask=None, cache: KVCache | None = None) -> torch.Tensor:
        if self.checkpointed and torch.is_grad_enabled():
            return checkpoint(self._forward, x, cos, sin, mask, cache, use_reentrant=False)
        return self._forward(x, cos, sin, mask, cache)

    def _forward(self, x, cos, sin, mask, cache):
        attended = self.self_attn(self.input_layernorm(x), cos, sin, mask, cache)
        x = x + (self.post_attention_layernorm(attended) if self.sandwich else attended)
        return x + tiled(self._feed_forward, x, self.tile_tokens)

    def _feed_forward(self, x):
        if self.sandwich:
            return self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        return self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    """Embeddings, layers and final norm (HF's ``model.`` prefix)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.norm_plus_one)


class CausalLM(nn.Module):
    """Decoder-only language model: ``forward(input_ids [B, T]) -> logits [B, T, V]``."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = Backbone(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02) -> None:
        """Random init as in the reference (normal(0, std) weights, unit norms, zero biases)."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                module.weight.normal_(0.0, std)
                if getattr(module, "bias", None) is not None:
                    module.bias.zero_()
            elif isinstance(module, RMSNorm):
                module.weight.fill_(0.0 if module.plus_one else 1.0)

    def hidden_states(self, input_ids: torch.Tensor, *, positions: torch.Tensor | None = None,
                      document_ids: torch.Tensor | None = None,
                      cache: KVCache | None = None, normed: bool = True,
                      pads: torch.Tensor | None = None) -> torch.Tensor:
        """Final-norm hidden states [B, T, D]; the loss projects them to the vocabulary.

        ``positions`` [B, T] and ``document_ids`` [B, T] describe packed sequences (each
        document restarts its positions and sees only itself); ``cache`` holds the keys
        and values of earlier tokens during generation; ``pads`` [B] counts the padding
        before each row's first token (prompts of several lengths generated together: each
        row positioned and attending as if it were alone). ``normed=False`` leaves the final
        norm to the caller (a chunked loss applies it chunk by chunk, with the head).
        """
        blocks = self.sparse_blocks
        for block in blocks:  # this forward's routing, for the balancing loss
            block.stats.clear()
            block.recording = True
        try:
            return self._hidden_states(input_ids, positions, document_ids, cache, normed, pads)
        finally:
            for block in blocks:
                block.recording = False

    def _hidden_states(self, input_ids, positions, document_ids, cache, normed, pads) -> torch.Tensor:
        T = input_ids.shape[1]
        past = cache.length if cache is not None else 0
        index = torch.arange(past, past + T, device=input_ids.device)
        if pads is not None:
            if positions is not None or document_ids is not None:
                raise ValueError("Left padding (pads) takes no positions or document_ids: it sets both.")
            positions = (index[None] - pads[:, None]).clamp(min=0)  # [B, T]
        if positions is None:
            positions = index
        if document_ids is not None and past:
            raise ValueError("Packed sequences (document_ids) cannot extend a KV cache.")
        keys = torch.arange(past + T, device=input_ids.device)
        window = self.config.sliding_window
        # None: plain causal attention, the fast path; one mask for the full layers and one for
        # the sliding ones, each made once per forward and shared by the layers of its kind
        # (whose cached keys may start later: a windowed cache keeps only what they reach)
        h = self.model.embed_tokens(input_ids)
        # SDPA turns a boolean mask into a 0 / -inf bias in each layer's call and keeps that
        # for backward: where layers keep their activations one bias shared is cheaper (Gemma-
        # 3-1B at 8,192 tokens: 2.6 GiB less); checkpointed layers keep only their inputs,
        # of which the boolean is half the bias's size
        shared = torch.is_grad_enabled() and not all(layer.checkpointed for layer in self.model.layers)
        kind = (lambda m: additive(m, h.dtype)) if shared else (lambda m: m)  # noqa: E731
        full = (kind(attention_mask(index, keys, document_ids, pads=pads))
                if document_ids is not None or pads is not None or (past and T > 1) else None)
        first = past - cache.kept(window) if cache is not None else 0
        local = (kind(attention_mask(index, keys[first:], document_ids, window, pads))
                 if window and past + T > window else full)
        if self.config.embed_scale:  # Gemma: sqrt(hidden) rounded to the weights' dtype first
            h = h * torch.tensor(self.config.hidden_size ** 0.5, dtype=h.dtype)
        tables = {False: rope_tables(self.config, positions, h.dtype)}
        tables[True] = (rope_tables(local_rope(self.config), positions, h.dtype)
                        if self.config.rope_local_theta is not None else tables[False])
        for layer in self.model.layers:
            h = layer(h, *tables[layer.sliding], local if layer.sliding else full, cache)
        if cache is not None:
            cache.length += T
        return self.model.norm(h) if normed else h

    def new_cache(self, int8: bool = False) -> KVCache:
        """An empty KV cache whose sliding layers keep only their window (``int8``: in 8 bits,
        ``Int8KVCache``)."""
        return (Int8KVCache if int8 else KVCache)(
            len(self.model.layers), [self.config.sliding_window if layer.sliding else None
                                     for layer in self.model.layers])

    def forward(self, input_ids: torch.Tensor, **kwargs) -> torch.Tensor:
        return self.lm_head(self.hidden_states(input_ids, **kwargs))

    @property
    def sparse_blocks(self) -> list[SparseMoE]:
        """The mixture-of-experts feed-forwards (none in a dense model)."""
        return [layer.mlp for layer in self.model.layers if isinstance(layer.mlp, SparseMoE)]

    def router_loss(self) -> torch.Tensor | None:
        """The last forward's load-balancing loss (Switch Transformer's, as transformers sums it
        over every sparse layer): experts x sum over experts of (its top-k choices per token)
        x (its mean router probability); top_k when balanced. None for a dense model. Padding
        positions count too (transformers' Trainer leaves them out)."""
        stats = [s for block in self.sparse_blocks for s in block.stats]
        if not stats:
            return None
        rows = sum(n for _, _, n in stats)
        chosen = torch.stack([c for c, _, _ in stats]).sum(dim=0) / rows
        probability = torch.stack([p for _, p, _ in stats]).sum(dim=0) / rows
        return (chosen * probability).sum() * self.config.num_experts
