"""Generation with the KV cache equals generation by full recomputation."""

import pytest
import torch

import nbtune as nt
from nbtune import generate
from nbtune.generate import generate_ids, greedy_replies, next_token
from nbtune.models import demo_model_dir

from helpers import returns_of, slow_after
from test_families import build


def greedy_without_cache(model, prompt, steps):
    ids = list(prompt)
    for _ in range(steps):
        ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt):]


@pytest.mark.parametrize("family", ["llama", "qwen3", "mistral"])
def test_cached_greedy_equals_recomputation(tmp_path, family):
    build(tmp_path, family, tie=False)
    model = nt.load_model(tmp_path).eval()
    prompt = torch.randint(0, 101, (20,)).tolist()
    steps = 12  # prompt + steps crosses Mistral's 24-token window
    got = generate_ids(model, prompt, max_new_tokens=steps, stop_ids=frozenset())
    assert got == greedy_without_cache(model, prompt, steps)


# Prompts of 3, 9 and 30 tokens, 10 new tokens: read and written past the 24-token windows of
# Mistral and Gemma 3's sliding layer (whose cache holds padding, then drops it). Phi-3 (an
# original context of 32) within it, then past it where the longest prompt has the smallest
# budget (its factors switch by the batch's furthest position: one prompt at a time, as the
# cached writer alone).
LONGER, SHORTER = ((3, 9, 30), (10, 7, 10)), ((3, 9, 20), (10, 7, 10))


@pytest.mark.parametrize("family,shape", slow_after(2, [
    ("mistral", LONGER), ("phi3", ((3, 9, 20), (14, 11, 4))), ("llama", LONGER), ("gemma3", LONGER),
    ("phi3", SHORTER), ("qwen3_moe", LONGER)]),
    ids=["mistral", "phi3-past-its-original-context", "llama", "gemma3", "phi3", "qwen3_moe"])
def test_prompts_written_together_get_each_the_reply_it_gets_alone(tmp_path, monkeypatch, family, shape):
    """Held-out evaluation writes several prompts in one batch, left-padded: each row must
    see only its own tokens at its own positions. Against full forwards of each prompt
    alone, no cache, no padding: an independent writer; a stop token ends its row only."""
    build(tmp_path, family, tie=False)
    model = nt.load_model(tmp_path).eval()
    draw = torch.Generator().manual_seed(5)
    lengths, budgets = shape
    prompts = [torch.randint(0, 101, (n,), generator=draw).tolist() for n in lengths]
    past = max(lengths) + max(budgets) - 1 > (model.config.rope_scaling or {}).get(
        "original_max_position_embeddings", 1 << 30)
    alone = [generate_ids(model, p, max_new_tokens=b, stop_ids=frozenset()) if past  # (keys of
             else greedy_without_cache(model, p, b) for p, b in zip(prompts, budgets)]  # both factors)
    assert len({tuple(a) for a in alone}) == 3  # (three different replies)
    one_at_a_time = returns_of(monkeypatch, generate, "generate_ids")
    assert greedy_replies(model, prompts, list(budgets), stop_ids=frozenset()) == alone
    assert len(one_at_a_time) == (3 if past else 0)  # (this tiny Phi-3's replies are the same either way)
    stop = alone[0][3]  # ends row 0 at its fourth token; the others where they meet it, if they do
    ended = [a[:a.index(stop)] if stop in a else a for a in alone]
    assert greedy_replies(model, prompts, list(budgets), stop_ids={stop}) == ended


def test_cached_logits_equal_full_forward(tmp_path):
    from nbtune.models.decoder import KVCache

    build(tmp_path, "mistral", tie=False)
    model = nt.load_model(tmp_path).eval()
    ids = torch.randint(0, 101, (1, 40))
    with torch.no_grad():
        full = model(ids)
        cache = KVCache(len(model.model.layers))
        first = model(ids[:, :30], cache=cache)
        rest = model(ids[:, 30:], cache=cache)  # several new tokens at once, past the window
    torch.testing.assert_close(torch.cat([first, rest], dim=1), full, atol=1e-5, rtol=0)


def test_stops_at_a_stop_token_and_respects_the_budget():
    model = nt.load_model(demo_model_dir()).eval()
    free = generate_ids(model, [1, 2, 3], max_new_tokens=6, stop_ids=frozenset())
    assert len(free) == 6
    stopped = generate_ids(model, [1, 2, 3], max_new_tokens=6, stop_ids=frozenset({free[2]}))
    assert stopped == free[: free.index(free[2])]


def test_sampling_is_seeded_and_top_p_keeps_the_nucleus():
    logits = torch.tensor([5.0, 4.0, 1.0, -2.0])
    draws = {next_token(logits, 1.0, top_p=0.5, generator=torch.Generator().manual_seed(s))
             for s in range(50)}
    assert draws == {0}  # token 0 alone holds more than half the mass
    draws = {next_token(logits, 1.0, top_p=0.99, generator=torch.Generator().manual_seed(s))
             for s in range(200)}
    assert {0, 1} <= draws and 3 not in draws
    a = [next_token(logits, 2.0, generator=torch.Generator().manual_seed(7)) for _ in range(3)]
    b = [next_token(logits, 2.0, generator=torch.Generator().manual_seed(7)) for _ in range(3)]
    assert a == b
    assert next_token(logits, 0.0) == 0


@pytest.mark.parametrize("temperature", [0.7, 2.0])
def test_sampling_at_a_temperature_draws_from_softmax_of_logits_over_it(monkeypatch, temperature):
    """The probabilities handed to the sampler, against softmax(logits / T) computed here in
    numpy (float64); a sampler that ignored T, or multiplied by it, would differ by far more."""
    import numpy as np

    logits = torch.tensor([2.0, 1.0, 0.5, -1.0, -3.0])
    handed = []
    real = torch.multinomial
    monkeypatch.setattr(torch, "multinomial", lambda probs, *a, **k: handed.append(probs.clone()) or real(probs, *a, **k))
    next_token(logits, temperature, generator=torch.Generator().manual_seed(0))
    scaled = logits.double().numpy() / temperature
    expected = np.exp(scaled - scaled.max()) / np.exp(scaled - scaled.max()).sum()
    assert np.allclose(handed[0].double().numpy(), expected, rtol=1e-6, atol=1e-7)
    flat = np.exp(logits.double().numpy()) / np.exp(logits.double().numpy()).sum()
    assert np.abs(expected - flat).max() > 0.05  # T changes the distribution measurably


def test_a_reply_is_a_str_that_a_notebook_shows_as_it_reads():
    from IPython.lib.pretty import pretty

    from nbtune.generate import Reply

    reply = Reply('{"name": "Chile",\n "capital": "Santiago"}')
    assert isinstance(reply, str) and reply == '{"name": "Chile",\n "capital": "Santiago"}'
    assert repr(reply) == repr(str(reply))  # code sees a plain string
    assert pretty(reply) == '{"name": "Chile",\n "capital": "Santiago"}'  # no quotes, no \\n
    assert pretty(Reply("")) == "(empty reply)"
    session = nt.Session.demo(device="cpu")
    assert type(session.generate("Which vowel is in the word?", input="bcud", max_new_tokens=4)) is Reply
