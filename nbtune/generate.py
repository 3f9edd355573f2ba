"""Text generation with a KV cache: greedy, or sampled with temperature and top-p."""

from __future__ import annotations

import numbers
from typing import Callable

import torch

from .models.decoder import CausalLM


class Reply(str):
    """The generated text: a plain ``str`` to code, shown as text in a notebook.

    A notebook shows a bare string as its repr, quotes and ``\\n`` escapes included; this
    one is shown as it reads, line breaks and all (``repr()`` is unchanged for code).
    """

    def _repr_pretty_(self, printer, cycle) -> None:
        printer.text(str(self) if self else "(empty reply)")


def next_token(logits: torch.Tensor, temperature: float = 0.0, top_p: float = 1.0,
               generator: torch.Generator | None = None) -> int:
    """Pick one token from ``logits`` [V]: argmax at temperature 0, else nucleus sampling."""
    return int(sample_tokens(logits[None], temperature, top_p, generator)[0])


def sample_tokens(logits: torch.Tensor, temperature: float = 0.0, top_p: float = 1.0,
                  generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per row of ``logits`` [N, V]: argmax at temperature 0, else
    sampled from the softmax at ``temperature`` within the smallest set of tokens whose
    probability reaches ``top_p``, drawn by ``generator`` where it lives (GRPO's CPU ones:
    the logits are copied to the host; a seeded chat's on a GPU, or none: where they are)."""
    logits = logits.detach().float().to(generator.device if generator is not None else logits.device)
    if temperature <= 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # keep the smallest set of tokens whose probability reaches top_p
        outside = sorted_probs.cumsum(-1) - sorted_probs >= top_p
        sorted_probs[outside] = 0.0
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def sample_rows(logits: torch.Tensor, temperature: float, top_p: float,
                generators: list) -> torch.Tensor:
    """``sample_tokens`` for each row of ``logits`` [N, V] with its own generator, so that a
    row's draw does not depend on which rows are sampled beside it. With CPU generators (GRPO's)
    the rows go to the host in one copy, not one a row: a token's sampling waits on the card once."""
    if all(g is None or g.device.type == "cpu" for g in generators):
        logits = logits.detach().float().cpu()
    return torch.cat([sample_tokens(logits[i:i + 1], temperature, top_p, g) for i, g in enumerate(generators)])


def _is_number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def check_generation_args(prompt_tokens: int, limit: int, *, max_new_tokens, temperature,
                          top_p) -> None:
    """Refuse settings generation cannot honour, before any compute, saying what to pass."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, numbers.Integral) \
            or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens={max_new_tokens!r}: it must be a whole number of tokens, "
                         "0 or more (e.g. max_new_tokens=48).")
    if not _is_number(temperature) or not temperature >= 0:  # `not >=` also catches NaN
        raise ValueError(f"temperature={temperature!r}: it must be a number, 0 or more. Use 0 for "
                         "greedy decoding, or about 0.7-1.0 to sample.")
    if not _is_number(top_p) or not 0 < top_p <= 1:
        raise ValueError(f"top_p={top_p!r}: it must be a number in (0, 1], the share of "
                         "probability mass sampled from. Use 1.0 to keep every token, or e.g. "
                         "0.9 for nucleus sampling.")
    if prompt_tokens == 0:
        raise ValueError("The prompt is empty (0 tokens): generation needs at least one prompt "
                         "token. Give some text to continue.")
    if prompt_tokens > limit:
        raise ValueError(f"The prompt is {prompt_tokens} tokens long but the model reads at most "
                         f"{limit} (max_position_embeddings). Shorten the prompt (or its input) "
                         f"by at least {prompt_tokens - limit} tokens.")


@torch.no_grad()
def generate_ids(model: CausalLM, prompt_ids: list[int], *, max_new_tokens: int,
                 stop_ids: frozenset[int] | set[int], temperature: float = 0.0, top_p: float = 1.0,
                 generator: torch.Generator | None = None,
                 on_token: Callable[[list[int]], None] | None = None) -> list[int]:
    """New token ids after ``prompt_ids``, up to a stop token (not returned) or the budget.

    The prompt is read once; each new token then costs one single-token forward over the
    cached keys and values of everything before it. Bad settings raise ``ValueError`` before
    any of that (see ``check_generation_args``); ``max_new_tokens=0`` returns ``[]``.
    ``on_token`` is called with the ids so far after each new one (streaming).
    """
    limit = model.config.max_position_embeddings
    check_generation_args(len(prompt_ids), limit, max_new_tokens=max_new_tokens,
                          temperature=temperature, top_p=top_p)
    if max_new_tokens == 0:
        return []
    device = next(model.parameters()).device
    cache = model.new_cache()
    logits = model(torch.tensor([prompt_ids], device=device), cache=cache)[0, -1]
    out: list[int] = []
    while len(out) < max_new_tokens:
        token = next_token(logits, temperature, top_p, generator)
        if token in stop_ids:
            break
        out.append(token)
        if on_token is not None:
            on_token(out)
        if cache.length >= limit:
            break
        logits = model(torch.tensor([[token]], device=device), cache=cache)[0, -1]
    return out


@torch.no_grad()
def greedy_replies(model: CausalLM, prompts: list[list[int]], budgets: list[int], *,
                   stop_ids: frozenset[int] | set[int], int8: bool = False) -> list[list[int]]:
    """Greedy new ids after each of ``prompts``, all in one batch: what ``generate_ids``
    gives each alone (``budgets[i]`` tokens at most), up to the last bits of the sums (a
    batch's matrix products add in another order). One token costs one forward of the batch
    where it cost one forward per prompt: a token reads every weight, so on a card (and on a
    CPU) a batch of short prompts takes about as long as one.

    The prompts are left-padded to the longest; ``pads`` keeps each row to its own tokens
    at its own positions. A row that has ended (a stop token, its budget) rides along
    until every row has. ``int8``: the cache in 8 bits (``Int8KVCache``), as GRPO's writing
    keeps it where ``kv_cache="int8"``."""
    if len(prompts) != len(budgets):
        raise ValueError(f"greedy_replies: {len(prompts)} prompts but {len(budgets)} budgets.")
    if not prompts:
        return []
    limit = model.config.max_position_embeddings
    for ids, budget in zip(prompts, budgets):
        check_generation_args(len(ids), limit, max_new_tokens=budget, temperature=0.0, top_p=1.0)
    longest, scaling = max(map(len, prompts)), model.config.rope_scaling or {}
    if scaling.get("rope_type") == "longrope" and \
            longest + max(budgets) - 1 > scaling["original_max_position_embeddings"]:
        # (its factors switch by the furthest position fed in the batch, the longest prompt's
        # as long as any row writes: past the original context they would switch every
        # row's) one at a time, as alone
        return [generate_ids(model, ids, max_new_tokens=budget, stop_ids=stop_ids)
                for ids, budget in zip(prompts, budgets)]
    out: list[list[int]] = [[] for _ in prompts]
    going = [budget > 0 for budget in budgets]
    if not any(going):
        return out
    device = next(model.parameters()).device
    pads = torch.tensor([longest - len(ids) for ids in prompts], device=device)
    ids = torch.tensor([[0] * (longest - len(ids)) + ids for ids in prompts], device=device)
    cache = model.new_cache(int8=int8)
    hidden = model.hidden_states(ids, cache=cache, pads=pads)
    logits = model.lm_head(hidden[:, -1])  # the last position's alone
    del hidden
    while True:
        tokens = sample_tokens(logits, 0.0).tolist()
        for row, token in enumerate(tokens):
            if going[row]:
                if token in stop_ids:
                    going[row] = False
                else:  # (its last token kept where its context is full, as alone)
                    out[row].append(token)
                    going[row] = (len(out[row]) < budgets[row]
                                  and len(prompts[row]) + len(out[row]) - 1 < limit)
        if not any(going):
            return out
        logits = model.lm_head(model.hidden_states(torch.tensor([[t] for t in tokens], device=device),
                                                   cache=cache, pads=pads)[:, -1])


class TextStream:
    """Turns the growing list of new ids into the text each one adds, for ``stream``: the
    whole is decoded each time and only what follows the text already given is passed on
    (a token may end inside a multi-byte character, which decodes once it is whole)."""

    def __init__(self, decode: Callable[[list[int]], str], write: Callable[[str], object]) -> None:
        self.decode, self.write, self.given = decode, write, ""

    def __call__(self, ids: list[int], last: bool = False) -> None:
        text = self.decode(ids)
        whole = last or not text.endswith("\ufffd")  # else wait for the character's other bytes
        if text.startswith(self.given) and len(text) > len(self.given) and whole:
            self.write(text[len(self.given):])
            self.given = text
