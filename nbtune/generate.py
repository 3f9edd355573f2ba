"""Text generation with a KV cache: greedy, or sampled with temperature and top-p."""

from __future__ import annotations

import torch

from .models.decoder import CausalLM, KVCache


def next_token(logits: torch.Tensor, temperature: float = 0.0, top_p: float = 1.0,
               generator: torch.Generator | None = None) -> int:
    """Pick one token from ``logits`` [V]: argmax at temperature 0, else nucleus sampling."""
    if temperature <= 0:
        return int(logits.argmax())
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        # keep the smallest set of tokens whose probability reaches top_p
        outside = sorted_probs.cumsum(-1) - sorted_probs >= top_p
        sorted_probs[outside] = 0.0
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=generator))


@torch.no_grad()
def generate_ids(model: CausalLM, prompt_ids: list[int], *, max_new_tokens: int,
                 stop_ids: frozenset[int] | set[int], temperature: float = 0.0, top_p: float = 1.0,
                 generator: torch.Generator | None = None) -> list[int]:
    """New token ids after ``prompt_ids``, up to a stop token (not returned) or the budget.

    The prompt is read once; each new token then costs one single-token forward over the
    cached keys and values of everything before it.
    """
    if not prompt_ids:
        raise ValueError("generate needs at least one prompt token.")
    device = next(model.parameters()).device
    limit = model.config.max_position_embeddings
    cache = KVCache(len(model.model.layers))
    logits = model(torch.tensor([prompt_ids], device=device), cache=cache)[0, -1]
    out: list[int] = []
    while len(out) < max_new_tokens:
        token = next_token(logits, temperature, top_p, generator)
        if token in stop_ids:
            break
        out.append(token)
        if cache.length >= limit:
            break
        logits = model(torch.tensor([[token]], device=device), cache=cache)[0, -1]
    return out
