"""Per-rank prediction: the real FSDP2 sharding on fake tensors over a fake process group,
against each rank's measured step on real gloo ranks."""

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

import nbtune as nt
from nbtune.distributed import Sharding
from nbtune.models import CausalLM, ModelConfig

ROOT = Path(__file__).resolve().parents[2]
TINY = dict(vocab_size=259, hidden_size=128, intermediate_size=384, num_layers=4, num_heads=4,
            num_kv_heads=2, head_dim=32)
CASES = [
    {"name": "full", "techniques": {}},
    {"name": "full, checkpointed", "techniques": {"activation_checkpointing": True}},
    {"name": "full, gathered after forward", "techniques": {},
     "sharding": {"reshard_after_forward": False}},
    {"name": "lora, chunked loss", "techniques": {"method": "lora", "lora_rank": 4, "chunked_loss": 4}},
    {"name": "qlora", "techniques": {"method": "qlora", "lora_rank": 4}},
    {"name": "qlora, checkpointed", "techniques": {"method": "qlora", "lora_rank": 4,
                                                    "activation_checkpointing": True}},
]


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [2, 4])
def test_each_ranks_estimate_is_within_2_percent_of_its_measured_step(tmp_path, ranks):
    # 4 ranks on 2 cores are slow: there the cases whose splits differ most from 2 ranks'
    # (full, LoRA with the chunked loss, QLoRA's NF4 shards); 2 ranks run all six
    chosen = CASES if ranks == 2 else [CASES[i] for i in (0, 3, 4)]
    cases = tmp_path / "cases.json"
    cases.write_text(json.dumps({"config": TINY, "batch_size": 4, "seq_len": 96, "cases": chosen}))
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc_per_node", str(ranks), str(ROOT / "benchmarks" / "rank_peaks.py"),
                           str(cases), str(tmp_path / "out.json")],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads((tmp_path / "out.json").read_text())["rows"]
    assert [row["name"] for row in rows] == [case["name"] for case in chosen]
    for row in rows:
        assert len(row["ranks"]) == ranks
        guess = row["estimate"]
        for measured in row["ranks"]:
            assert abs(guess["peak"] - measured["peak"]) <= 0.02 * measured["peak"], (row["name"], guess, measured)
            assert guess["parameters"] == measured["parameters"], row["name"]


@pytest.mark.slow  # (about 10 s here; the fast tier has this module's others)
def test_a_rank_holds_its_share_of_the_weights_gradients_and_state():
    config = ModelConfig(**TINY)
    t = nt.Techniques(batch_size=4, seq_len=96)
    one = nt.estimate(config, t)
    weights = 4 * config.num_parameters  # fp32
    assert one.parameters == weights
    for ranks in (2, 4):
        each = nt.estimate(config, t, ranks=ranks)
        # dim 0 of every weight split: each rank keeps ceil(rows / ranks) of them (259 rows of
        # the vocabulary: 130 on each of 2 ranks)
        with torch.device("meta"):
            model = CausalLM(config)
        assert each.parameters == sum(4 * -(-p.shape[0] // ranks) * p[0].numel()
                                      for p in model.parameters())
        assert each.gradients == each.parameters and each.optimizer_state >= 2 * each.parameters
        assert each.peak < one.peak
    # QLoRA: FSDP2 splits each NF4 weight's codes and both levels of scales (torchao's
    # extension); its 16-value lookup table and mean scale are kept whole on every rank
    from nbtune.peft import to_nf4

    qlora = t.replace(method="qlora", lora_rank=4)
    whole = nt.estimate(config, qlora).quantized
    parts = [to_nf4(module.weight.detach()) for module in CausalLM(config).modules()
             if isinstance(module, torch.nn.Linear) and module.weight.shape[1] in (128, 384)
             and module.weight.shape[0] != 259]
    assert len(parts) == 28 and whole == sum(sum(getattr(w, name).nbytes for name in (
        "quantized_data", "quantized_scalers", "quantization_factor", "nf4", "scaler_mean")) for w in parts)
    split = sum(sum(getattr(w, name).nbytes for name in ("quantized_data", "quantized_scalers",
                                                         "quantization_factor")) for w in parts)
    for ranks in (2, 4):
        assert nt.estimate(config, qlora, ranks=ranks).quantized == split // ranks + whole - split
    assert not dist.is_initialized()  # the fake process group is gone


@pytest.mark.slow
def test_layers_are_carried_to_the_byte_under_fsdp():
    """The last layer is the first to run backward under FSDP2: the shallow runs keep it apart
    from the front ones (3 and 4 layers), so a deep model's step is carried exactly."""
    config = ModelConfig(**{**TINY, "num_layers": 7})
    for changes in ({"activation_checkpointing": True}, {"method": "qlora", "lora_rank": 4}):
        t = nt.Techniques(batch_size=4, seq_len=96, **changes)
        carried = nt.estimate(config, t, ranks=2)
        traced = nt.estimate(config, t, ranks=2, extrapolate=False)
        assert carried.peak == traced.peak and carried.at_peak == traced.at_peak


def test_cpu_offload_moves_the_sharded_state_to_every_ranks_host():
    config = ModelConfig(**TINY)
    t = nt.Techniques(batch_size=4, seq_len=96)
    kept = nt.estimate(config, t, device="cuda", ranks=2)
    moved = nt.estimate(config, t, device="cuda", ranks=2, sharding={"cpu_offload": True})
    assert moved.parameters == moved.optimizer_state == moved.gradients == 0
    assert moved.host.sharded >= kept.parameters + kept.gradients + kept.optimizer_state
    assert moved.peak <= kept.peak - kept.parameters - kept.optimizer_state
    # every rank is a process on this host: its runtime counts once per rank
    assert kept.host.runtime == 2 * nt.estimate(config, t, device="cuda").host.runtime


def test_per_rank_estimates_refuse_what_cannot_run():
    config = ModelConfig(**TINY)
    t = nt.Techniques(batch_size=4, seq_len=96)
    with pytest.raises(ValueError, match="ranks=0"):
        nt.estimate(config, t, ranks=0)
    with pytest.raises(ValueError, match="batch_size=4 does not split over 3 ranks"):
        nt.estimate(config, t, ranks=3)
    with pytest.raises(ValueError, match="no setting 'reshard'"):
        nt.estimate(config, t, ranks=2, sharding={"reshard": False})
    with pytest.raises(ValueError, match="cpu_offload: false"):
        nt.estimate(config, t, ranks=2, sharding=Sharding(cpu_offload=True))  # on a CPU
    with pytest.raises(ValueError, match="need ranks=2 or more"):
        nt.estimate(config, t, sharding={"cpu_offload": True})
    with pytest.raises(ValueError, match="cannot split .* over 3 ranks"):
        nt.estimate(config, t.replace(method="qlora", batch_size=3), ranks=3)
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        with pytest.raises(RuntimeError, match="already belongs to a job"):
            nt.estimate(config, t, ranks=2)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # (notebook 07 asks fit the same question on the user's path)
def test_fit_on_several_cards_and_how_many_cards_a_run_needs():
    from nbtune.predict.budgets import parse_cards, required
    from nbtune.units import format_bytes

    assert parse_cards("2x RTX 3090 + 64 GB RAM") == (2, "RTX 3090 + 64 GB RAM")
    assert parse_cards("4 \u00d7 24GiB") == (4, "24GiB") and parse_cards("RTX 3090") == (1, "RTX 3090")
    config = ModelConfig(**TINY)
    t = nt.Techniques(batch_size=4, seq_len=96)
    one = required(nt.estimate(config, t, device="cuda"))
    two = required(nt.estimate(config, t, device="cuda", ranks=2))
    assert two < one
    budget = (one + two) // 2  # the start fits on two such cards, not on one
    only = dict(toggles=(), reserve=0, margin=0.0)  # the start alone: nothing else to try
    alone = nt.fit(config, budget, t, **only)
    assert not alone.fits and alone.needs_cards == 2
    assert f"It needs 2 cards of {format_bytes(budget)}" in alone.message
    pair = nt.fit(config, f"2x {budget}B", t, **only)
    assert pair.fits and pair.cards == 2 and pair.peak == two
    assert "on each of 2 cards" in pair.message
    with pytest.raises(ValueError, match="batch_size=3 is the global batch"):
        nt.fit(config, f"2x {budget}B", t.replace(batch_size=3))
    # the longest context over two cards reads the per-rank predictor too
    longest = nt.longest_context(config, "2x 700MiB", t)
    assert longest.tokens >= nt.longest_context(config, "700MiB", t).tokens > 0
    assert longest.memory == nt.estimate(config, t.replace(seq_len=longest.tokens), device="cuda", ranks=2)


def test_the_panels_badge_for_two_cards_is_one_ranks_step_against_one_card():
    from nbtune.predict import Predictor
    from nbtune.predict.budgets import required
    from nbtune.ui.fitcheck import FitCheck

    config = ModelConfig(**TINY)
    t = nt.Techniques(batch_size=4, seq_len=96)
    shown = []
    check = FitCheck(Predictor.of(config, "cuda"), lambda *args: shown.append(args), delay=0.0)
    try:
        for budget in ("2x RTX 3090 + 64GiB", "RTX 3090"):
            check.request(t, budget)
            assert check.wait()
    finally:
        check.close()
    (_, _, two, _, error), (_, _, one, _, _) = shown
    assert error is None and two.budget == one.budget == 24576 * 2**20
    assert two.need == required(nt.estimate(config, t, device="cuda", ranks=2)) < one.need
    assert two.host_budget == 64 * 2**30


@pytest.mark.slow
def test_a_ranks_out_of_memory_names_it_with_its_own_predictions():
    """Inside a job a rank cannot start the estimator's fake process group: it asks a fresh
    Python process, which gives what this process gives outside a job. Under torchrun the
    advice is the run file and ``--resume``; on ranks a notebook drives (``from_kernel``) the
    kernel goes on, so it is ``session.set`` after ``recover()``, of the first change sharded
    ranks accept (asked of a sharded trainer itself)."""
    import torch

    from nbtune.distributed import Parallel
    from nbtune.oom import explain
    from nbtune.predict.advice import suggest

    config = ModelConfig(**TINY)
    t = nt.Techniques(batch_size=4, seq_len=96)
    cpu = torch.device("cpu")
    now, expected = suggest(config, t, cpu, (2, 96), None, 2, Sharding())
    assert expected and now.peak == nt.estimate(config, t, ranks=2).peak
    torchrun, notebook = Parallel(1, 2, 1, Sharding()), Parallel(1, 2, 1, Sharding())
    notebook.from_kernel = True

    def explained(parallel):
        return explain(torch.OutOfMemoryError("CUDA out of memory."), "backward", 3,
                       {"parameters": 1, "gradients": 2, "optimizer_state": 3}, config, t, cpu,
                       (2, 96), parallel)

    said = str(explained(notebook))  # (the advice asked here: no process group is up)
    damaged = str(explain(torch.OutOfMemoryError("CUDA out of memory."), "optimizer", 3,
                          {"parameters": 1}, config, t, cpu, (2, 96), notebook,
                          damaged="The update had begun writing weights."))
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        err = explained(torchrun)
    finally:
        dist.destroy_process_group()
    text = str(err)
    assert text.startswith("Rank 1 of 2 ran out of memory in the backward phase of step 3")
    assert "Predicted peak per rank now" in text and "--resume" in text
    assert [(s.changes, s.peak) for s in err.suggestions] == [(s.changes, s.peak) for s in expected]
    first = ", ".join(f"techniques.{k}: {v}" for k, v in expected[0].changes.items())
    assert f"Put one in the run file ({first})" in text
    settable = [s for s in expected if _sharded_ranks_accept(s.changes)]
    assert settable and said.startswith("Rank 1 of 2 ran out of memory in the backward phase of step 3.\n")
    assert "--resume" not in said and "run file" not in said and "Predicted peak per rank now" in said
    advice = (f"After session.recover() has started the ranks again, apply one with "
              f"session.set({settable[0].label}).")
    assert advice in said
    # an update that had begun writing (no undo copy) names the rank and advises the same
    assert damaged.startswith("Rank 1 of 2: Out of memory in the optimizer phase of step 3. The update")
    assert advice in damaged and "--resume" not in damaged


def _sharded_ranks_accept(changes: dict) -> bool:
    """Whether a trainer sharded over 2 ranks accepts ``changes`` (its own two-phase set)."""
    trainer = nt.Session.demo("tiny", batch_size=4, seq_len=96).trainer
    trainer.parallel = SimpleNamespace(world=2)  # (only its size is read by prepare)
    try:
        trainer.abort(trainer.prepare(trainer.techniques.replace(**changes)))
        return True
    except ValueError as refused:
        assert "cannot change while the model is sharded" in str(refused)  # (not another refusal)
        return False


def test_a_change_the_sharding_fixes_is_sent_to_the_run_file_and_the_first_settable_to_set():
    """On a notebook's ranks the advice names the first change the ranks accept for
    ``session.set``, and sends a better one the sharding fixes (``method``) to the run file."""
    from nbtune.oom import _advice_on_ranks
    from nbtune.predict.advice import Suggestion

    fixed, kept = Suggestion({"method": "lora"}, 1, False, None), Suggestion({"chunked_loss": 8}, 2, True, None)
    assert not _sharded_ranks_accept(fixed.changes) and _sharded_ranks_accept(kept.changes)
    said = _advice_on_ranks([fixed, kept])
    assert "session.set(chunked_loss=8)" in said and "method='lora' is fixed" in said
    assert "run file (techniques.method: lora)" in said
    assert _advice_on_ranks([kept, fixed]) == ("After session.recover() has started the ranks again, apply "
                                        "one with session.set(chunked_loss=8).")


def test_a_sessions_estimate_per_rank_is_the_estimators():
    session = nt.Session.demo("tiny")
    t = session.techniques
    assert session.estimate(ranks=2) == nt.estimate(session.model.config, t, ranks=2)
    assert session.estimate(ranks=2, device="cuda", sharding={"cpu_offload": True}).parameters == 0


def test_host_memory_is_predicted_per_machine_and_hsdp_shards_within_a_group():
    """4 ranks on 2 machines: each machine's host holds its 2 ranks (their runtimes, their
    offloaded shards, their loading), not all 4; rank 0's machine also writes the saves, as
    one machine would. HSDP (replicate: 2) shards over a group of 2: a rank holds what a rank
    of 2-rank FSDP holds."""
    config = ModelConfig(**TINY)
    t = nt.Techniques(batch_size=4, seq_len=96)
    sharding = {"cpu_offload": True}
    one = nt.estimate(config, t, device="cuda", ranks=4, sharding=sharding)
    two = nt.estimate(config, t, device="cuda", ranks=4, sharding=sharding, machines=2)
    assert two.host.sharded * 2 == one.host.sharded > 0
    assert two.host.runtime * 2 == one.host.runtime and two.host.loading * 2 == one.host.loading
    assert (two.host.merged, two.host.gguf) == (one.host.merged, one.host.gguf)
    assert two.peak == one.peak  # the device side does not care where the ranks are
    with pytest.raises(ValueError, match="machines=3"):
        nt.estimate(config, t, ranks=4, machines=3)
    hsdp = nt.estimate(config, t, ranks=4, sharding={"replicate": 2})
    assert hsdp.parameters == nt.estimate(config, t, ranks=2).parameters
    assert hsdp.parameters == 2 * nt.estimate(config, t, ranks=4).parameters
    with pytest.raises(ValueError, match="replicate=3 does not split 4 ranks"):
        nt.estimate(config, t, ranks=4, sharding={"replicate": 3})


def test_fit_on_two_cards_searches_fsdps_settings_and_says_which_it_chose():
    """A model whose untied embedding and head dominate: only sharding them as units of their
    own fits the budget; ``fit`` finds that setting among FSDP2's and names it."""
    from nbtune.predict.budgets import required
    from nbtune.predict.space import AXES, search_space

    config = ModelConfig(**{**TINY, "vocab_size": 16384, "num_layers": 2, "tie_word_embeddings": False})
    t = nt.Techniques(batch_size=2, seq_len=32)
    apart = required(nt.estimate(config, t, ranks=2, sharding={"shard_embeddings": True}))
    budget = f"2x {apart}B"
    assert not nt.fit(config, budget, t, device="cpu", toggles=()).fits  # FSDP2's defaults do not
    found = nt.fit(config, budget, t, device="cpu", toggles=("sharding",))
    assert found.fits and found.exact and found.changes == {}
    assert found.sharding_changes == {"shard_embeddings": True} and found.sharding.shard_embeddings
    assert found.peak == apart and "shard_embeddings: true" in found.message
    assert "distributed: {" in found.message and "session.set" not in found.message  # nothing to set
    tried = {tuple(sorted(r["sharding_changes"])) for r in found.as_dicts()}
    assert ("reshard_after_forward",) in tried or ("reshard_after_forward", "shard_embeddings") in tried
    # a tied model's embedding is the head: the search does not offer to shard it apart
    for tied, offers in ((True, False), (False, True)):
        space = search_space(t, "cpu", ranks=2, tied=tied, toggles=("sharding",))
        assert any("shard_embeddings" in c.sharding_changes for c in space) is offers
    on_cuda = search_space(t, "cuda", ranks=2, toggles=("sharding",))  # CPU offload: CUDA only
    assert {tuple(sorted(c.sharding_changes)) for c in on_cuda} > {
        tuple(sorted(c.sharding_changes)) for c in search_space(t, "cpu", ranks=2, toggles=("sharding",))}
    assert len(on_cuda) == 16 and all(c.sharding is None for c in search_space(t, "cuda"))
    with pytest.raises(ValueError, match="sharding settings need ranks=2"):
        nt.fit(config, "24GiB", t, device="cpu", sharding={"shard_embeddings": True})
    assert "sharding" not in AXES  # (a name of its own: ``toggles`` takes it beside the axes)


@pytest.mark.slow  # (6 s: two fits)
def test_each_host_term_over_two_ranks_is_every_ranks_share_and_fit_counts_them_all():
    """Both ranks of a machine park their shares on the one host. Each term held while
    training over 2 ranks is twice one process's at the per-rank batch: the offloaded
    activations (at least every checkpointed layer's input, B/2 x T x hidden in bf16), the
    runtime, and on a CPU the step itself; and a two-card ``fit`` with a host budget
    refuses activation offloading when the host holds one rank's share only."""
    from nbtune.predict.budgets import required

    config = ModelConfig(**TINY)
    t = nt.Techniques(batch_size=4, seq_len=96, dtype="bf16", activation_checkpointing=True,
                      activation_offloading=True)
    two = nt.estimate(config, t, device="cuda", ranks=2)
    one = nt.estimate(config, t.replace(batch_size=2), device="cuda")
    per_rank = one.host.offloaded
    assert per_rank > config.num_layers * 2 * 96 * config.hidden_size * 2  # (each layer's input, and more)
    assert two.host.offloaded == 2 * per_rank
    assert two.host.runtime == 2 * one.host.runtime
    on_cpu = nt.estimate(config, t.replace(dtype="fp32", activation_offloading=False), ranks=2)
    alone = nt.estimate(config, t.replace(dtype="fp32", activation_offloading=False, batch_size=2))
    assert on_cpu.host.step == 2 * on_cpu.highest and on_cpu.highest < alone.highest  # (sharded state)
    # fit: offloading is what fits the card; the host holds both ranks' shares, or one's only
    start = t.replace(activation_offloading=False)
    assert required(nt.estimate(config, start, device="cuda", ranks=2)) > required(two)
    budget, both = f"2x {required(two)}B", two.host.without_undo
    only = dict(toggles=("activation_offloading",), reserve=0, margin=0.0)
    fits = nt.fit(config, budget, start, device="cuda", host=_host_with_usable(both), **only)
    assert fits.fits and fits.changes == {"activation_offloading": True}
    short = nt.fit(config, budget, start, device="cuda", host=_host_with_usable(both - per_rank), **only)
    assert not short.fits and "host memory" in short.message


def _host_with_usable(need: int) -> int:
    """A host whose usable part (less the margin ``nbtune.host`` keeps) is ``need``, or a
    few bytes more."""
    from nbtune.predict.budgets import host_usable

    host = need
    while host_usable(host) < need:
        host += need - host_usable(host)
    return host
