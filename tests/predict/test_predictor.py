"""The Predictor: one cache per model shape and device that the badge, fit, the longest-context
search and the out-of-memory advice share, safe on several threads at once."""

import threading
from collections import Counter

import pytest

import nbtune as nt
import nbtune.predict.predictor as predictor_module
from nbtune.models import ModelConfig
from nbtune.predict import (Predictor, clear_cache, required, search_space,
                            single_moves)
from nbtune.predict.predictor import memory_twin
from nbtune.ui.fitcheck import FitCheck

# Two small layers and a long context: every estimate well under a second.
SHAPE = dict(vocab_size=259, hidden_size=128, intermediate_size=384, num_layers=2, num_heads=4,
             num_kv_heads=2, head_dim=32, max_position_embeddings=1 << 14)
START = nt.Techniques(batch_size=2, seq_len=512)


def _questions(config):
    """The badge, a fit search and a longest-context search: each one's answer, comparable."""
    def badge():
        shown = []
        check = FitCheck(Predictor.of(config, "cuda"), lambda *a: shown.append(a), delay=0.0)
        check.request(START, "24GiB")
        assert check.wait(300)
        check.close()
        _, _, answer, _, error = shown[-1]
        assert error is None
        return (answer.need, answer.text)

    def fit():
        budget = required(nt.estimate(config, START, device="cuda")) * 6 // 10
        result = nt.fit(config, budget, START, reserve=0, margin=0)
        return (result.techniques, result.peak, [(r.label, r.peak, r.fits) for r in result.tried])

    def longest():
        result = nt.longest_context(config, 700 * 2**20, {"batch_size": 1, "chunked_loss": 4},
                                    device="cuda")
        return (result.tokens, result.limit, result.tried)

    return {"badge": badge, "fit": fit, "longest": longest}


@pytest.mark.slow
def test_three_questions_at_once_answer_as_each_asked_alone(monkeypatch):
    config = ModelConfig(**SHAPE)
    alone = {}
    for name, ask in _questions(config).items():
        clear_cache()
        alone[name] = ask()
    clear_cache()
    asked = Counter()
    real = predictor_module.estimate

    def counting(config, t, **kwargs):
        asked[(t, kwargs["batch_size"], kwargs["seq_len"])] += 1
        return real(config, t, **kwargs)

    monkeypatch.setattr(predictor_module, "estimate", counting)
    together, errors = {}, []

    def run(name, ask):
        try:
            together[name] = ask()
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append(f"{name}: {type(err).__name__}: {err}")

    threads = [threading.Thread(target=run, args=item) for item in _questions(config).items()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(600)
    assert not errors, errors
    assert together == alone
    # each question reached the estimator once, however many threads asked it
    assert asked and max(asked.values()) == 1, asked.most_common(3)
    assert Predictor.of(config, "cuda").estimates == len(asked)


def test_one_predictor_per_shape_and_device():
    clear_cache()
    a, b = ModelConfig(**SHAPE), ModelConfig(**SHAPE)
    assert Predictor.of(a, "cuda") is Predictor.of(b, "cuda:0")
    assert Predictor.of(a, "cpu") is not Predictor.of(a, "cuda")
    assert Predictor.of(a.replace(num_layers=3), "cuda") is not Predictor.of(a, "cuda")
    mine = Predictor(a, "cpu")
    assert Predictor.of(mine, "cpu") is mine
    with pytest.raises(ValueError, match="estimates for 'cpu'"):
        Predictor.of(mine, "cuda")


def test_a_repeated_question_is_answered_from_the_cache_and_an_error_is_raised_again():
    calls = []

    def estimator(config, t, **kwargs):
        calls.append(t)
        if t.batch_size == 3:
            raise ValueError("no   such\n shape")
        return nt.MemoryBreakdown(peak=t.batch_size, measured=False)

    p = Predictor(ModelConfig(**SHAPE), "cpu", estimator=estimator)
    assert p.estimate(START).peak == 2 and p.cached(START)
    # what does not change memory shares the entry: grad_accum past 2, lr, seed
    assert p.estimate(START.replace(grad_accum=2)).peak == 2
    assert p.estimate(START.replace(grad_accum=5, lr=1e-2, seed=7)).peak == 2
    assert len(calls) == 2 and calls[1].grad_accum == 2
    for _ in range(2):
        with pytest.raises(ValueError, match="no such shape"):
            p.estimate(START.replace(batch_size=3))
    assert len(calls) == 3 and p.estimates == 3
    p.clear()
    assert not p.cached(START)


@pytest.mark.slow
def test_the_memory_twin_predicts_what_its_original_does():
    """The cache's premise, checked on the real estimator: grad_accum past 2, lr, warm-up and
    the seed leave every number of the estimate as it was (where the peak sits too)."""
    config = ModelConfig(**SHAPE)
    for t in (START.replace(grad_accum=4, lr=3e-3, seed=5, warmup_steps=2),
              START.replace(grad_accum=3, activation_checkpointing=True, chunked_loss=4,
                            method="lora", eval_every=2)):
        mine, twin = nt.estimate(config, t), nt.estimate(config, memory_twin(t))
        assert mine == twin and mine.at_peak == twin.at_peak and mine.host == twin.host


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("start", [
    nt.Techniques(batch_size=4),
    nt.Techniques(batch_size=6, grad_accum=2, dtype="bf16", optimizer="adamw8bit"),
    nt.Techniques(method="lora", activation_checkpointing=4, chunked_loss=8),
    nt.Techniques(optimizer_in_backward=True, method="qlora", dtype="bf16"),
])
def test_the_out_of_memory_advice_moves_within_fits_search_space(device, start):
    """Every move the OOM advice offers is a combination fit would try, with the same verdict
    on the maths, and changes one axis only."""
    if start.conflicts(device):
        pytest.skip("not runnable there")
    space = {c.techniques: c for c in search_space(start, device)}
    moves = single_moves(start, device)
    assert moves
    for changes, exact in moves:
        new = start.replace(**changes)
        assert new in space, changes
        assert space[new].exact == exact
        assert set(changes) <= {"batch_size", "grad_accum"} or len(changes) == 1
    axes = [next(iter(c)) for c, _ in moves]
    assert len(axes) == len(set(axes))  # one move per axis


def test_the_advice_offers_the_moves_it_always_did():
    """The first step along each axis, as the OOM messages and notebook 06 teach them."""
    moves = dict((tuple(sorted(c.items())), exact) for c, exact in
                 single_moves(nt.Techniques(batch_size=4), "cuda"))
    assert moves == {
        (("chunked_loss", 8),): True, (("activation_checkpointing", True),): True,
        (("batch_size", 2), ("grad_accum", 2)): True, (("optimizer_in_backward", True),): True,
        (("activation_offloading", True),): True, (("optimizer", "adamw8bit"),): False,
        (("dtype", "bf16"),): False, (("method", "lora"),): False}
    on_cpu = [c for c, _ in single_moves(nt.Techniques(method="lora", batch_size=1), "cpu")]
    assert {"activation_offloading": True} not in on_cpu and {"method": "qlora"} in on_cpu


@pytest.mark.slow  # (about 10 s here; the fast tier has this module's others)
def test_an_exact_change_is_advised_before_a_maths_changing_one_and_adapt_applies_it(monkeypatch, capsys):
    """Out of memory with both kinds predicted to fit: the exact change (checkpointing, smaller
    micro-batches) comes first whatever order the moves are tried in (here reversed, the
    maths-changing ones first), and run(on_oom="adapt") applies that one and goes on."""
    import torch

    import nbtune.oom
    import nbtune.predict.advice as advice
    from helpers import small_session

    moves = advice.single_moves
    monkeypatch.setattr(advice, "single_moves", lambda t, device: list(reversed(list(moves(t, device)))))
    monkeypatch.setattr(nbtune.oom, "budget", lambda device: 1 << 40)  # every change fits
    session = small_session(method="full")
    before = session.techniques
    _, found = advice.suggest(session.model.config, before, torch.device("cpu"), (4, 96), 1 << 40)
    assert [s.exact for s in found] == sorted((s.exact for s in found), reverse=True)
    assert found[0].exact and not found[-1].exact and all(s.fits for s in found)
    fired = []

    def out_of_memory(module, args):
        if not fired:
            fired.append(1)
            raise torch.OutOfMemoryError("injected")

    handle = session.model.model.layers[0].register_forward_pre_hook(out_of_memory)
    reports = session.run(2, on_oom="adapt", progress=False, live=False)
    handle.remove()
    assert fired and len(reports) == 2
    changed = session.techniques.changed(before)
    assert changed and {k: getattr(session.techniques, k) for k in changed} == found[0].changes
    assert (session.techniques.optimizer, session.techniques.dtype, session.techniques.method) == \
        (before.optimizer, before.dtype, before.method)
    assert f"set {found[0].label}" in capsys.readouterr().out
