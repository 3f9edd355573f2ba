"""fit: budgets, the speed cost model, and the search for the fastest toggles predicted to fit.

The search is checked two ways: with the real estimator on a tiny model over a small space
(the answer is the cheapest that fits, by an exhaustive check over the same candidates),
and with a stand-in estimator (a monotone formula, instant) over whole search spaces.
"""

from dataclasses import replace

import pytest
import torch

import nbtune as nt
from nbtune.memory import MemoryBreakdown
from nbtune.models import ModelConfig
from nbtune.models.decoder import CausalLM

import nbtune.predict.predictor as predictor_module
from nbtune.predict import (Predictor, clear_cache, cost_terms, fit_badge, host_usable,
                            keeps_maths, parse_budget, parse_machine, relative_cost, required,
                            search_space, usable)
from nbtune.predict.costs import checkpointed_fraction
from nbtune.predict.tables import (ALLOCATOR_MARGIN, CARDS, COSTS, CUDA_CONTEXT, HOST_RAM, GiB,
                                   MiB)

# Two small layers: a real estimate of it takes about a second on a busy CPU.
TINY = ModelConfig(vocab_size=259, hidden_size=64, intermediate_size=128, num_layers=2,
                   num_heads=2, num_kv_heads=1, head_dim=32)
START = nt.Techniques(batch_size=4, seq_len=64)
T = nt.Techniques


# ---- budgets ---------------------------------------------------------------------------

@pytest.mark.parametrize("value,expected", [
    (24 * 2**30, 24 * 2**30),
    ("24GiB", 24 * 2**30),
    ("24 GiB", 24 * 2**30),
    ("16gib", 16 * 2**30),
    ("24 GB", 24 * 10**9),
    ("24G", 24 * 2**30),
    ("512MiB", 512 * 2**20),
    ("512 MB", 512 * 10**6),
    ("1.5GiB", 3 * 2**29),
    ("4096", 4096),
    ("RTX 4090", 24564 * MiB),
    ("rtx3090", 24 * GiB),
    ("a100-80gb", 80 * GiB),
    ("A100 40GB", 40536 * MiB),
    ("t4", 15 * GiB),
    ("L4", 23034 * MiB),
])
def test_parse_budget_forms(value, expected):
    assert parse_budget(value) == expected


@pytest.mark.parametrize("value", ["24 parsecs", "", "GiB", "-1GiB", "0GiB", "RTX 9090", "24 GiB x",
                                   0, -5, True, None, float("nan"), [24]])
def test_parse_budget_errors_name_the_input_and_the_accepted_forms(value):
    with pytest.raises(ValueError) as err:
        parse_budget(value)
    message = str(err.value)
    assert repr(value) in message
    assert "'24GiB'" in message and "'512MiB'" in message and "RTX 4090" in message


def test_cards_and_what_is_usable_of_them():
    assert set(CARDS) == {"RTX 3090", "RTX 4090", "A100 40GB", "A100 80GB", "T4", "L4"}
    for name in ("RTX 3090", "RTX 4090", "L4"):
        assert 22 * GiB < CARDS[name] <= 24 * GiB
    assert 256 * MiB <= CUDA_CONTEXT <= 512 * MiB  # the context's ~0.3-0.5 GiB
    card = parse_budget("RTX 4090")
    assert usable(card, "cuda") == int((card - CUDA_CONTEXT) * (1 - ALLOCATOR_MARGIN))
    assert usable(card, "cuda", reserve=0, margin=0) == card  # a measured budget
    assert usable(card, "cpu") == card


# ---- the cost model ----------------------------------------------------------------------

def test_cost_model_orderings():
    plain = relative_cost(T())
    assert plain == 1.0
    # checkpointing: more layers recomputed, more time; every-N exact with the layer count
    assert relative_cost(T(activation_checkpointing=True)) > relative_cost(T(activation_checkpointing=2)) \
        > relative_cost(T(activation_checkpointing=4)) > plain
    assert relative_cost(T(activation_checkpointing=2), num_layers=3) == pytest.approx(
        1 + COSTS["checkpointing"][0] * 2 / 3)
    # offloading pays off with checkpointing: it moves only layer inputs then
    with_ckpt = relative_cost(T(activation_checkpointing=True, activation_offloading=True)) \
        - relative_cost(T(activation_checkpointing=True))
    alone = relative_cost(T(activation_offloading=True)) - plain
    assert 0 < with_ckpt < alone
    # CPU optimizer offload moves every weight in a full finetune, only adapters in LoRA
    assert relative_cost(T(cpu_offload_optimizer=True)) - plain > \
        relative_cost(T(method="lora", cpu_offload_optimizer=True)) - relative_cost(T(method="lora")) > 0
    # small ones
    for changes in (dict(chunked_loss=8), dict(optimizer="adamw8bit"), dict(optimizer="paged_adamw8bit")):
        assert plain < relative_cost(T(**changes)) < plain + 0.1, changes
    assert relative_cost(T(optimizer_in_backward=True)) == pytest.approx(plain)
    assert relative_cost(T(compile=True)) < plain
    # the same effective batch in more, smaller micro-batches costs more
    assert relative_cost(T(batch_size=8)) < relative_cost(T(batch_size=4, grad_accum=2)) \
        < relative_cost(T(batch_size=1, grad_accum=8))
    # maths-changing choices against a baseline: LoRA skips base gradients, QLoRA dequantizes,
    # bf16 is faster on CUDA and not modelled on CPU
    full = T()
    assert relative_cost(T(method="lora"), baseline=full) < 1.0 \
        < relative_cost(T(method="qlora"), baseline=full)
    assert relative_cost(T(method="qlora"), baseline=T(method="lora")) > 1.0
    assert relative_cost(T(dtype="bf16"), baseline=full) < 1.0
    assert relative_cost(T(dtype="bf16"), "cpu", baseline=full) == 1.0
    assert relative_cost(T(method="qlora", dtype="bf16")) == 1.0  # own method and dtype by default
    # FSDP2 over several cards: CPU offload is dear, resharding and sharded embeddings cheap,
    # bf16 mixed precision computes as bf16 does (on an fp32 model)
    from nbtune.distributed import Sharding

    fsdp = relative_cost(T(), sharding=Sharding())
    assert fsdp == pytest.approx(1 + COSTS["fsdp_reshard"][0])
    assert relative_cost(T(), sharding=Sharding(reshard_after_forward=False)) == plain < fsdp
    assert fsdp < relative_cost(T(), sharding=Sharding(shard_embeddings=True)) < fsdp + 0.05 \
        < relative_cost(T(), sharding=Sharding(cpu_offload=True))
    assert relative_cost(T(), sharding=Sharding(mixed_precision="bf16")) == pytest.approx(
        relative_cost(T(dtype="bf16"), baseline=full, sharding=Sharding()))
    assert set(cost_terms(T(activation_checkpointing=True, chunked_loss=8, compile=True))) == {
        "checkpointing", "chunked_loss", "compile"}
    for value, why in COSTS.values():  # every constant says where it comes from
        assert ("measured" in why or "rough" in why), why


# ---- the search space ----------------------------------------------------------------------

def test_search_space_keeps_the_maths_first_and_obeys_the_rules():
    start = T(batch_size=8, seq_len=128)
    for device in ("cpu", "cuda"):
        space = search_space(start, device, num_layers=4)
        assert space[0].techniques == start  # plain start: nothing is cheaper
        steps = [c.steps for c in space]
        assert steps == sorted(steps) and steps[0] == 0 and max(steps) > 0
        for c in space:
            t = c.techniques
            assert not t.conflicts(device)
            assert t.batch_size * t.grad_accum == 8 and t.seq_len == 128
            assert (c.steps == 0) == c.exact == keeps_maths(start, t)
            assert c.changes == {k: getattr(t, k) for k in t.changed(start)}
            if device == "cpu":
                assert not (t.activation_offloading or t.cpu_offload_optimizer or t.compile)
        exact_costs = [c.cost for c in space if c.exact]
        assert exact_costs == sorted(exact_costs)
        assert len({c.techniques for c in space}) == len(space)
    # both directions: a start split into micro-batches is best merged when memory allows
    split = search_space(T(batch_size=4, grad_accum=2, seq_len=128), "cpu", num_layers=4)
    assert split[0].changes == {"batch_size": 8, "grad_accum": 1} and split[0].exact
    assert keeps_maths(T(optimizer="adamw8bit"), T(optimizer="paged_adamw8bit"))
    assert not keeps_maths(T(), T(batch_size=3, grad_accum=3))
    with pytest.raises(ValueError, match="choose from"):
        search_space(START, "cpu", toggles=("lr",))


# ---- fit with the real estimator (tiny model) ---------------------------------------------

SMALL_SPACE = ("activation_checkpointing", "chunked_loss")


@pytest.fixture(scope="module")
def tiny_peaks():
    """The real estimator's need for every candidate of a small space (via fit's cache)."""
    clear_cache()
    space = search_space(START, "cpu", num_layers=TINY.num_layers, toggles=SMALL_SPACE)
    return {c.techniques: required(Predictor.of(TINY, "cpu").estimate(c.techniques)) for c in space}


def test_fit_between_plain_and_checkpointed_is_the_cheapest_that_fits(tiny_peaks):
    plain = tiny_peaks[START]
    checkpointed = tiny_peaks[START.replace(activation_checkpointing=True)]
    budget = (plain + checkpointed) // 2
    assert checkpointed < budget < plain
    result = nt.fit(TINY, budget, START, device="cpu", toggles=SMALL_SPACE)
    assert result.fits and result.exact and result.peak <= budget == result.budget == result.usable
    assert result.estimates == 0  # all in the cache already
    # the estimator says it fits...
    assert tiny_peaks[result.techniques] == result.peak <= budget
    # ...and nothing cheaper does: exhaustive over the same candidate list
    space = search_space(START, "cpu", num_layers=TINY.num_layers, toggles=SMALL_SPACE)
    fitting = [c for c in space if tiny_peaks[c.techniques] <= budget]
    assert fitting[0].techniques == result.techniques
    assert result.cost == min(c.cost for c in fitting)
    assert result.changes == fitting[0].changes and result.changes
    for row in result.tried:
        assert row.fits == (row.peak <= budget) and row.exact
    assert {r.label for r in result.tried if r.fits} >= {fitting[0].label}
    assert "Fastest predicted to fit" in result.message and "Same maths" in result.message
    text, page = repr(result), result._repr_html_()
    assert "-> " + fitting[0].label in text and "predicted peak" in text
    assert "<table>" in page and "font-weight:bold" in page
    # what the search cost is a detail: after the table, not in the answer
    searched = f"{result.estimates} estimate{'s' if result.estimates != 1 else ''} run"
    assert searched not in result.message and result.search.startswith(searched)
    assert text.endswith(f"\n\n({result.search}.)")
    assert f"<details><summary>The search</summary>{result.search}." in page


def test_fit_with_an_impossible_budget_says_so(tiny_peaks):
    result = nt.fit(TINY, 1000, START, device="cpu", toggles=SMALL_SPACE)
    assert not result.fits and result.techniques is None and result.peak is None
    assert result.changes == {} and result.exact is None
    assert "Nothing tried fits in 1000 B" in result.message
    assert "seq_len" in result.message and "smallest predicted peak" in result.message
    # the most-saving combination did not fit, so nothing weaker was estimated
    assert len(result.tried) <= 3
    assert "Nothing tried fits" in repr(result)


def test_fit_with_a_huge_budget_returns_the_start_unchanged(tiny_peaks):
    result = nt.fit(TINY, "1TiB", START, device="cpu")
    assert result.fits and result.techniques == START and result.changes == {}
    assert result.exact and result.cost == 1.0 and len(result.tried) == 1
    assert result.message.startswith("The start fits")


def test_fit_accepts_a_model_and_refuses_a_start_the_device_cannot_run(tiny_peaks):
    with torch.device("meta"):
        model = CausalLM(TINY)
    result = nt.fit(model, "1TiB", START, device="cpu")
    assert result.fits and result.techniques == START and result.estimates == 0
    with pytest.raises(ValueError, match="cannot run on cpu"):
        nt.fit(TINY, "1TiB", T(compile=True), device="cpu")
    with pytest.raises(ValueError, match="'cpu' or 'cuda'"):
        nt.fit(TINY, "1TiB", START, device="mps")
    with pytest.raises(ValueError, match="max_tries"):
        nt.fit(TINY, "1TiB", START, device="cpu", max_tries=0)


def test_estimates_are_cached_across_calls(monkeypatch):
    clear_cache()
    calls = []
    real = predictor_module.estimate

    def counting(*args, **kwargs):
        calls.append(args[1])
        return real(*args, **kwargs)

    monkeypatch.setattr(predictor_module, "estimate", counting)
    split = START.replace(batch_size=2, grad_accum=3)
    first = nt.fit(TINY, "1TiB", split, device="cpu")  # merged into one micro-batch: faster
    assert first.changes == {"batch_size": 6, "grad_accum": 1}
    assert len(calls) == first.estimates == 1
    again = nt.fit(TINY, "1TiB", split, device="cpu")
    assert len(calls) == 1 and again.estimates == 0 and again.tried == first.tried
    # memory does not depend on grad_accum past 2, nor on lr or the seed: one entry
    kept = nt.fit(TINY, "1TiB", split, device="cpu", toggles=())
    assert kept.techniques == split and len(calls) == 2 and calls[1].grad_accum == 2
    nt.fit(TINY, "1TiB", split.replace(grad_accum=5, lr=1e-3, seed=3), device="cpu", toggles=())
    assert len(calls) == 2


# ---- the search logic over whole spaces (stand-in estimator) -------------------------------

def _stand_in_parts(t: nt.Techniques) -> dict:
    """A step's memory by category, falling along every toggle as the real estimator's does
    (and as ``fit`` bounds it: checkpointing removes part of each checkpointed layer's share
    of the activations, the optimizer toggles part of the gradients and the state)."""
    weights = {"full": 100, "lora": 40, "qlora": 15}[t.method] * (1 if t.dtype == "bf16" else 2)
    grads = 0 if t.method != "full" else weights * (0.1 if t.optimizer_in_backward else 1)
    state = {"adamw": 2, "adamw8bit": 0.5, "ao_adamw4bit": 0.25}[t.optimizer] * (
        weights if t.method == "full" else 2)
    state *= 0.05 if t.cpu_offload_optimizer else 1
    layers = 8
    kept = 1 - 0.9 * checkpointed_fraction(t, layers)
    acts = 6 * t.batch_size * kept * (0.3 if t.activation_offloading else 1)
    logits = 10 * t.batch_size / (4 if t.chunked_loss > 1 else 1)
    return {"parameters": int(1000 * weights), "gradients": int(1000 * grads),
            "optimizer_state": int(1000 * state), "activations": int(1000 * (acts + logits))}


def _stand_in_need(t: nt.Techniques) -> int:
    return sum(_stand_in_parts(t).values())


def _stand_in_memory(t: nt.Techniques, device: str, **more) -> MemoryBreakdown:
    """The stand-in's breakdown: every category held at the peak."""
    parts = _stand_in_parts(t)
    return MemoryBreakdown(peak=sum(parts.values()), device=device, measured=False,
                           at_peak=parts, **parts, **more)


@pytest.fixture
def stand_in(monkeypatch):
    clear_cache()
    calls = []

    def fake(model, t, device="cpu", **kwargs):
        calls.append(t)
        return _stand_in_memory(t, device)

    monkeypatch.setattr(predictor_module, "estimate", fake)
    yield calls
    clear_cache()


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("start", [T(batch_size=8, seq_len=256),
                                   T(method="lora", batch_size=4, grad_accum=2, seq_len=256,
                                     activation_checkpointing=True, chunked_loss=8)],
                         ids=["full", "lora"])
def test_fit_is_the_cheapest_that_fits_over_a_whole_space(stand_in, device, start):
    config = TINY.replace(num_layers=8)
    space = search_space(start, device, num_layers=8)
    needs = sorted({_stand_in_need(c.techniques) for c in space})
    for budget in needs[len(needs) // 12:: max(1, len(needs) // 6)] + [needs[0] - 1, needs[-1]]:
        clear_cache()
        stand_in.clear()
        result = nt.fit(config, budget, start, device=device, reserve=0, margin=0,
                            max_tries=len(space))
        fitting = [c for c in space if _stand_in_need(c.techniques) <= budget]
        if not fitting:
            assert not result.fits and "Nothing tried fits" in result.message
            assert result.estimates <= 6  # the most-saving ones did not fit: stop
            continue
        best = fitting[0]  # fewest maths steps, then cheapest: the search's own order
        assert result.techniques == best.techniques, (budget, result.changes, best.changes)
        assert result.exact == best.exact and result.cost == best.cost
        if any(c.exact for c in fitting):  # the maths is changed only when nothing else fits
            assert result.exact
        assert result.estimates == len(stand_in) < len(space) / 4


def test_combinations_the_estimator_cannot_run_are_reported_and_avoided(monkeypatch):
    """As with LoRA + checkpointing + offloading + chunked loss, which raises a CheckpointError
    in the estimator (and in a real step): that combination and those including it are
    left out; the answer is the cheapest runnable one that fits."""
    clear_cache()
    calls = []

    def fake(model, t, device="cpu", **kwargs):
        calls.append(t)
        if t.activation_offloading and t.chunked_loss > 1:
            raise RuntimeError("torch.utils.checkpoint: Recomputed values differ")
        return _stand_in_memory(t, device)

    monkeypatch.setattr(predictor_module, "estimate", fake)
    start = T(method="lora", batch_size=4, seq_len=256)
    space = search_space(start, "cuda", num_layers=8)
    runnable = [c for c in space
                if not (c.techniques.activation_offloading and c.techniques.chunked_loss > 1)]
    needs = sorted({_stand_in_need(c.techniques) for c in runnable})
    budget = needs[len(needs) // 4]
    result = nt.fit(TINY.replace(num_layers=8), budget, start, reserve=0, margin=0, max_tries=200)
    assert result.techniques == next(c for c in runnable if _stand_in_need(c.techniques) <= budget).techniques
    errors = [r for r in result.tried if r.error]
    assert errors and all("RuntimeError: torch.utils.checkpoint" in r.error for r in errors)
    assert "could not be estimated" in result.message
    # what failures share is suspect: at most two failures per method and dtype tried
    groups = {(r.changes.get("method", "lora"), r.changes.get("dtype", "fp32")) for r in errors}
    assert len(errors) <= 2 * len(groups)
    assert result.estimates < len(space) / 4
    clear_cache()


def test_the_search_stops_at_max_tries_with_the_best_found(stand_in):
    start = T(batch_size=8, seq_len=256)
    space = search_space(start, "cpu", num_layers=8)
    budget = sorted(_stand_in_need(c.techniques) for c in space)[len(space) // 3]
    result = nt.fit(TINY.replace(num_layers=8), budget, start, device="cpu", margin=0,
                        max_tries=3)
    assert result.estimates == len(stand_in) <= 3
    assert "max_tries" in result.message
    if result.fits:
        assert result.peak <= budget


# ---- the badge -------------------------------------------------------------------------------

def test_fit_badge():
    estimated = MemoryBreakdown(parameters=4 * GiB, activations=10 * GiB, peak=15 * GiB,
                                outside=GiB, device="cuda", measured=False,
                                at_peak={"parameters": 4 * GiB, "activations": 10 * GiB})
    badge = fit_badge(estimated, "RTX 4090")
    assert badge.fits and badge.need == 16 * GiB and badge.largest == "activations"
    assert badge.usable == usable(parse_budget("RTX 4090"), "cuda")
    assert badge.headroom == badge.usable - 16 * GiB > 0
    assert badge.text.startswith("fits:") and "activations" in str(badge)
    over = fit_badge(estimated, "16GiB")
    assert not over.fits and over.headroom < 0 and over.text.startswith("does not fit:")
    # a measured CUDA step already shows the allocator's cache and the context (outside)
    measured = MemoryBreakdown(peak=10 * GiB, reserved=11 * GiB, outside=GiB // 2, device="cuda:0",
                               at_peak={"gradients": 6 * GiB, "parameters": 4 * GiB})
    badge = fit_badge(measured, "12GiB")
    assert badge.need == 11 * GiB + GiB // 2 and badge.usable == 12 * GiB and badge.fits
    assert badge.largest == "gradients"
    plain = fit_badge(3 * GiB, "4GiB", device="cpu")
    assert plain.fits and plain.usable == 4 * GiB and plain.largest is None
    with pytest.raises(TypeError):
        fit_badge("3GiB", "4GiB")


# ---- a real preset -------------------------------------------------------------------------

@pytest.mark.slow  # one estimate of an 8B model: 30-60 s on two busy cores
def test_fit_reads_a_preset_name():
    clear_cache()
    t = T(method="qlora", dtype="bf16", activation_checkpointing=True, chunked_loss=8,
          batch_size=2, seq_len=2048)
    result = nt.fit("llama-3.2-1b", "RTX 4090", t, toggles=())  # the start only: one estimate
    assert result.fits and result.techniques == t and result.estimates == 1
    assert GiB < result.peak < result.usable
    clear_cache()


# ---- the host: cards come with host memory, fit and the badge check both -------------------

@pytest.mark.parametrize("value,expected", [
    ("RTX 3090", (24 * GiB, HOST_RAM["RTX 3090"])),
    ("rtx 4090 + 64 GB RAM", (24564 * MiB, 64 * 10**9)),
    ("RTX 3090 + 48GiB", (24 * GiB, 48 * GiB)),
    ("24GiB + 32GiB RAM", (24 * GiB, 32 * GiB)),
    ("24GiB", (24 * GiB, None)),
    (24 * GiB, (24 * GiB, None)),
    (("T4", "16GiB"), (15 * GiB, 16 * GiB)),
])
def test_parse_machine_forms(value, expected):
    assert parse_machine(value) == expected


def test_every_card_has_its_usual_host_memory():
    assert set(HOST_RAM) == set(CARDS)
    assert all(8 * GiB <= ram <= 256 * GiB for ram in HOST_RAM.values())


def _host_of(t: nt.Techniques):
    """Host memory that rises with the toggles that move memory to the host."""
    from nbtune.memory.breakdown import HostMemory

    return HostMemory(runtime=GiB, offloaded=(6 * GiB if t.activation_offloading else 0),
                      cpu_optimizer=(20 * GiB if t.cpu_offload_optimizer else 0),
                      undo=(8 * GiB if t.optimizer_in_backward else 0), checkpoint=2 * GiB)


@pytest.fixture
def stand_in_with_host(monkeypatch):
    clear_cache()

    def fake(model, t, device="cpu", **kwargs):
        return _stand_in_memory(t, device, host=_host_of(t))

    monkeypatch.setattr(predictor_module, "estimate", fake)
    yield
    clear_cache()


def test_fit_refuses_what_the_host_cannot_hold(stand_in_with_host):
    start = T(batch_size=8, seq_len=256)
    space = search_space(start, "cuda", num_layers=8)
    needs = sorted({_stand_in_need(c.techniques) for c in space})
    budget = needs[len(needs) // 3]
    config = TINY.replace(num_layers=8)
    for host in (4 * GiB, 9 * GiB, 64 * GiB):
        clear_cache()
        result = nt.fit(config, budget, start, reserve=0, margin=0, max_tries=len(space),
                            host=host)
        room = host_usable(host)
        both = [c for c in space if _stand_in_need(c.techniques) <= budget
                and _host_of(c.techniques).without_undo <= room]
        assert result.host_budget == host and result.host_usable == room
        if not both:
            assert not result.fits
            assert "fit on the card but not on the host" in result.message
            continue
        assert result.techniques == both[0].techniques, (host, result.changes, both[0].changes)
        assert result.tried[-1].host == _host_of(result.techniques).without_undo
    # no host given and a bare size: the host is not checked
    clear_cache()
    free = nt.fit(config, budget, start, reserve=0, margin=0, max_tries=len(space))
    assert free.host_budget is None and all(r.host is None for r in free.tried)


def test_fit_says_when_the_undo_copy_is_dropped_for_the_host(stand_in_with_host):
    start = T(batch_size=1, seq_len=256, optimizer_in_backward=True)
    result = nt.fit(TINY.replace(num_layers=8), 10**12, start, reserve=0, margin=0,
                        host=12 * GiB, toggles=())
    assert result.fits  # 1 + 2 GiB without the copy; 11 GiB with it: over the 10.8 usable
    assert "with no undo copy (it would need 8.0 GiB more" in result.message


def test_fit_badge_checks_the_host_and_says_which_binds():
    from nbtune.memory.breakdown import HostMemory

    estimated = MemoryBreakdown(parameters=4 * GiB, activations=10 * GiB, peak=15 * GiB,
                                device="cuda", measured=False,
                                at_peak={"parameters": 4 * GiB, "activations": 10 * GiB},
                                host=HostMemory(runtime=3 * GiB, paged=12 * GiB, undo=20 * GiB,
                                                checkpoint=10 * GiB))
    badge = fit_badge(estimated, "RTX 4090")  # its usual host: 32 GiB, 28.8 usable
    assert badge.host_budget == 32 * GiB and badge.host_need == 25 * GiB
    assert badge.fits_card and badge.fits and badge.binds == "host"
    assert "host 25.0 GiB of 28.8 GiB usable, no undo copy (20.0 GiB would not fit)" in badge.text
    assert badge.text.endswith("the host is the limit; most held by activations")
    temporaries = fit_badge(replace(estimated, at_peak={"parameters": 4 * GiB, "other": 10 * GiB}),
                            "RTX 4090")
    assert temporaries.text.endswith("most held by other (the step's temporaries: attention and MLP "
                                     "scratch, the loss's logits, the optimizer step's; on CUDA "
                                     "also cuBLAS workspaces)")
    small = fit_badge(estimated, "RTX 4090 + 16GiB RAM")
    assert small.fits_card and not small.fits and not small.fits_host
    assert small.text.startswith("does not fit on the host: host 10.6 GiB over its 14.4 GiB usable")
    roomy = fit_badge(estimated, ("A100 80GB", "512GiB"))  # both far from full: no limit named
    assert roomy.fits and "limit" not in roomy.text
    big = fit_badge(estimated, ("RTX 4090", "256GiB"))
    assert big.fits and big.binds == "card" and "no undo copy" not in big.text
    bare = fit_badge(estimated, "24GiB")  # a size alone: the host is not known
    assert bare.host_need is None and "host" not in bare.text


def test_fit_turns_down_what_moves_too_much_to_the_host(monkeypatch):
    """Offloading is the only way onto the card here, and it parks 40 GiB on the host: a 32 GiB
    host refuses it (nothing fits), a 64 GiB one takes it."""
    from nbtune.memory.breakdown import HostMemory

    def fake(model, t, device="cpu", **kwargs):
        moved = t.activation_offloading
        return MemoryBreakdown(peak=(10 if moved else 30) * GiB, device=device, measured=False,
                               at_peak={"parameters": 1},
                               host=HostMemory(runtime=GiB, offloaded=40 * GiB if moved else 0))

    monkeypatch.setattr(predictor_module, "estimate", fake)
    start, config = T(batch_size=2, seq_len=256), TINY.replace(num_layers=8)
    for host, fits in ((32 * GiB, False), (64 * GiB, True)):
        clear_cache()
        result = nt.fit(config, 20 * GiB, start, reserve=0, margin=0, host=host, max_tries=200)
        assert result.fits is fits
        if fits:
            assert result.techniques.activation_offloading
            assert result.tried[-1].host == 41 * GiB
        else:
            assert "fit on the card but not on the host" in result.message
    clear_cache()


# ---- what fit rules out by a failed estimate's breakdown (``reach``) ------------------------

def _candidate(start: nt.Techniques, t: nt.Techniques, layers: int):
    return next(c for c in search_space(start, "cuda", num_layers=layers) if c.techniques == t)


@pytest.mark.slow
@pytest.mark.parametrize("method,every", [("full", False), ("lora", 4)])
def test_reach_bounds_what_checkpointing_and_the_optimizer_toggles_save_on_real_estimates(method, every):
    """At a failed combination's peak, one that also checkpoints more layers or moves the
    optimizer's memory holds at least its peak less ``reach``: checked against the real
    estimator's answers for both (eight layers, on CUDA)."""
    from nbtune.predict.search import reach

    config = TINY.replace(num_layers=8)
    start = T(method=method, batch_size=2, seq_len=64, chunked_loss=8)
    predictor = Predictor.of(config, "cuda")
    checked = 0
    for failed_t in (start.replace(activation_checkpointing=every),):
        failed = _candidate(start, failed_t, 8)
        memory = predictor.estimate(failed_t)
        for change in ({"activation_checkpointing": 2}, {"activation_checkpointing": True},
                       {"optimizer_in_backward": True}, {"cpu_offload_optimizer": True},
                       {"activation_checkpointing": True, "optimizer_in_backward": True}):
            c = _candidate(start, failed_t.replace(**change), 8)
            saves = reach(failed, memory, c, 8)
            assert saves is not None and saves >= 0
            assert predictor.estimate(c.techniques).peak >= memory.peak - saves, (failed_t, change)
            checked += 1
        # what it cannot bound: another axis, or other maths
        for change in ({"batch_size": 1, "grad_accum": 2}, {"activation_offloading": True},
                       {"optimizer": "adamw8bit"}):
            assert reach(failed, memory, _candidate(start, failed_t.replace(**change), 8), 8) is None
    assert checked == 5


def test_reach_is_one_share_of_the_activations_per_layer_and_the_optimizers_memory():
    from nbtune.predict.search import reach

    start = T(method="lora", batch_size=2, seq_len=128)
    failed = _candidate(start, start, 8)
    memory = MemoryBreakdown(peak=100, activations=70, gradients=9, optimizer_state=30,
                             at_peak={"gradients": 5, "optimizer_state": 30, "activations": 60})
    every_2 = _candidate(start, start.replace(activation_checkpointing=2), 8)
    assert reach(failed, memory, every_2, 8) == -(-4 * 70 // 7)  # 4 layers, 7 hold theirs whole
    both = _candidate(start, start.replace(activation_checkpointing=2, optimizer_in_backward=True), 8)
    assert reach(failed, memory, both, 8) == -(-4 * 70 // 7) + 5 + 30  # what is held at the peak
    fewer = _candidate(start, start.replace(activation_checkpointing=4), 8)
    assert reach(_candidate(start, start.replace(activation_checkpointing=4), 8), memory, every_2, 8) \
        == -(-2 * 70 // 5)  # 2 more; 8 - 2 - 1 hold theirs whole
    assert reach(every_2, memory, fewer, 8) == 0  # saves less: nothing more to save


def test_fit_rules_out_by_reach_and_finds_the_same_answer(stand_in, monkeypatch):
    """Over the LoRA space, the bound saves estimates and changes no answer."""
    import nbtune.predict.search as search_module

    start = T(method="lora", batch_size=4, seq_len=256)
    config, space = TINY.replace(num_layers=8), search_space(start, "cuda", num_layers=8)
    needs = sorted({_stand_in_need(c.techniques) for c in space})

    def answers():
        out = []
        for budget in needs[::max(1, len(needs) // 12)]:
            clear_cache()
            result = nt.fit(config, budget, start, reserve=0, margin=0, max_tries=len(space))
            out.append((result.techniques, result.estimates))
        return out

    bounded = answers()
    monkeypatch.setattr(search_module, "reach", lambda *args: None)
    unbounded = answers()
    assert [t for t, _ in bounded] == [t for t, _ in unbounded]
    assert sum(n for _, n in bounded) < sum(n for _, n in unbounded)


@pytest.mark.slow  # (5 s or more here; the fast tier has this module's others)
def test_fit_with_the_default_reserve_and_margin_does_not_call_a_start_fitting_that_only_the_whole_card_holds():
    """A CUDA card keeps its context and an allocator margin apart (``usable``): a start whose
    predicted need lies between the usable part and the whole card does not fit, and the
    combination chosen fits the usable part (most tests pass reserve=0, margin=0, where the
    two bounds coincide)."""
    start = nt.Techniques(method="lora", dtype="bf16", batch_size=4, seq_len=1024)
    need = required(Predictor.of("llama-3.2-1b", "cuda").estimate(start))
    card = need + CUDA_CONTEXT // 2  # the start fits the whole card, not its usable part
    room = usable(card, "cuda")
    assert room < need < card
    result = nt.fit("llama-3.2-1b", card, start, device="cuda")
    assert result.usable == room and result.tried[0].changes == {} and result.tried[0].fits is False
    assert result.techniques is not None and result.changes and result.peak <= room
    assert nt.fit("llama-3.2-1b", card, start, device="cuda", reserve=0, margin=0).changes == {}


def test_fsdps_settings_bound_all_but_the_activations_held_at_a_failed_peak():
    """``reach``: CPU offload, resharding and sharded embeddings can free the weights (the
    gathered ones are "other"), gradients and state held at a failed combination's peak,
    never its activations; a candidate differing only so is ruled out when even that is not
    enough, and not when it might be."""
    from nbtune.memory.breakdown import MemoryBreakdown
    from nbtune.predict.search import reach
    from nbtune.predict.space import search_space

    t = T(batch_size=2, activation_checkpointing=True)
    space = search_space(t, "cuda", ranks=2, num_layers=4, toggles=("sharding",))
    start = next(c for c in space if not c.sharding_changes)
    offload = next(c for c in space if c.sharding_changes == {"cpu_offload": True})
    held = {"parameters": 10, "gradients": 5, "optimizer_state": 20, "activations": 30, "other": 35}
    memory = MemoryBreakdown(peak=100, activations=30, at_peak=held)
    assert reach(start, memory, offload, 4) == 70  # everything but the activations
    assert reach(offload, memory, start, 4) == 0  # offloading less saves nothing
    mixed = next(c for c in space if c.sharding_changes == {"mixed_precision": "bf16"}) \
        if any(c.sharding_changes.get("mixed_precision") for c in space) else None
    assert mixed is None or reach(start, memory, mixed, 4) is None  # a maths change: no bound
