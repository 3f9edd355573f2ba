"""The technique ladder (compare), snapshots, and what sampled memory tracking reports."""

import pytest
import torch

import nbtune as nt
from nbtune.memory.sampling import MemorySampler
from nbtune.overhead import OverheadBudget

from helpers import small_session


@pytest.mark.slow
def test_compare_runs_each_row_on_a_trial_and_leaves_the_session_alone():
    session = small_session()
    session.step()
    weights = {n: p.detach().clone() for n, p in session.model.named_parameters()}
    techniques, steps = session.techniques, len(session.history)
    ladder = session.compare([{}, {"activation_checkpointing": True}, {"dtype": "bf16"},
                              {"method": "lora"}], steps=3, progress=False)
    assert len(ladder) == 4
    assert [r.label for r in ladder] == ["baseline", "+activation_checkpointing", "dtype=bf16",
                                         "method=lora"]
    assert ladder[3].techniques.activation_checkpointing and ladder[3].techniques.dtype == "bf16"
    peaks = [r.peak for r in ladder]
    assert peaks[0] > peaks[1] > peaks[2] > peaks[3] > 0  # each of these buys memory here
    assert ladder[0].change is None
    assert ladder[1].categories["activations"] < ladder[0].categories["activations"] / 2
    assert ladder[3].categories["gradients"] < ladder[2].categories["gradients"] / 10  # LoRA
    assert ladder[1].change == pytest.approx(100 * (peaks[1] - peaks[0]) / peaks[0])
    for row in ladder:
        assert row.estimated_peak == pytest.approx(row.peak, rel=0.02)
        assert sum(row.at_peak.values()) == row.peak
        assert all(row.categories[k] >= v for k, v in row.at_peak.items())  # high points
        assert row.tokens_per_second > 0 and row.loss > 0
    # The session itself did not move.
    assert session.techniques == techniques and len(session.history) == steps
    assert all(torch.equal(p, weights[n]) for n, p in session.model.named_parameters())
    text = repr(ladder)
    assert text.splitlines()[0].split() == ["configuration", "peak", "change", "tokens/s",
                                            "estimated", "peak"]
    assert f"{ladder[1].change:+.1f}%" in text.splitlines()[3]  # header, rule, baseline, row 1
    html = ladder._repr_html_()
    assert "<table>" in html and "data:image/png;base64," in html
    assert ladder.as_dicts()[1]["change_pct"] == ladder[1].change
    pair = ladder[1:3]  # a slice is a ladder of those rows, shown the same way
    assert isinstance(pair, type(ladder)) and [r.label for r in pair] == [r.label for r in ladder.rows[1:3]]
    assert pair._repr_html_().count("<tr>") == 3 and pair.steps == ladder.steps
    import dataclasses  # with estimate=False no row has an estimate: no empty column
    unestimated = type(ladder)([dataclasses.replace(r, estimated_peak=None) for r in ladder],
                               ladder.device, ladder.steps)
    assert repr(unestimated).splitlines()[0].split() == ["configuration", "peak", "change", "tokens/s"]
    assert "estimated" not in unestimated._repr_html_()


def test_a_bad_row_is_refused_before_anything_runs():
    session = small_session()
    with pytest.raises(ValueError, match="row 1 .*optimizer='adam'"):
        session.compare([{}, {"optimizer": "adam"}], progress=False)
    with pytest.raises(ValueError, match="row 'optimizer=paged_adamw8bit'.*CUDA"):
        session.compare([{}, {"optimizer": "paged_adamw8bit"}], progress=False)
    with pytest.raises(TypeError, match="row 0 is a str"):
        session.compare(["bf16"], progress=False)
    with pytest.raises(ValueError, match="steps must be a positive int"):
        session.compare([{}], steps=0, progress=False)
    assert session.history == [] and session.step().loss > 0


def test_snapshot_on_cpu_says_it_needs_cuda_and_changes_nothing(tmp_path):
    session = small_session()
    with pytest.raises(RuntimeError, match="CUDA caching allocator.*runs on cpu"):
        session.snapshot(tmp_path / "snap.pickle")
    assert not (tmp_path / "snap.pickle").exists() and session.history == []


def test_each_step_reports_phases_and_parameter_kinds():
    session = small_session(method="qlora", dtype="bf16")
    mem = session.step().memory
    assert set(mem.phases) == {"forward", "backward", "optimizer"}
    assert mem.peak == max(p["peak"] for p in mem.phases.values())
    assert mem.peak_phase in ("forward", "backward")
    assert all(p["largest"] in mem.categories for p in mem.phases.values())
    assert mem.parameters == mem.trainable + mem.frozen + mem.quantized
    assert mem.trainable > 0 and mem.frozen > 0 and mem.quantized > 0  # adapters, norms, NF4
    assert mem.measured and mem.reserved == 0 and mem.outside == 0  # CPU: no allocator cache
    assert mem.cached == 0
    assert nt.MemoryBreakdown(peak=10, reserved=15).cached == 5


def test_sampled_tracking_measures_after_a_change_and_carries_between():
    session = small_session()
    assert session.memory_tracking == "sampled"
    first = session.run(30, progress=False, live=False)
    assert first[0].memory.measured  # nothing measured yet under these techniques
    # and the step after it: the first made the optimizer's state, which every later step holds
    assert first[1].memory.measured and first[1].memory.peak > first[0].memory.peak
    carried = [r for r in first if not r.memory.measured]
    assert carried  # tracking costs ~1.6x a step here: most steps are not tracked
    for report in carried:  # they show the last measurement
        last = max((r for r in first if r.memory.measured and r.step < report.step),
                   key=lambda r: r.step)
        assert report.memory.peak == last.memory.peak
    assert session.overhead.overhead < 0.5
    session.set(activation_checkpointing=True)
    after = session.run(2, progress=False, live=False)
    assert after[0].memory.measured and after[0].memory.peak < first[1].memory.peak  # steady vs steady
    assert session.step().memory.measured  # a step on its own is always measured
    session.memory_tracking = "every_step"
    assert all(r.memory.measured for r in session.run(3, progress=False, live=False))
    session.memory_tracking = "off"
    assert not any(r.memory.measured for r in session.run(2, progress=False, live=False))
    with pytest.raises(ValueError, match="'sometimes' is not one of sampled"):
        session.memory_tracking = "sometimes"


def test_the_budget_allows_tracking_only_within_its_share():
    budget = OverheadBudget(share=0.05)
    sampler = MemorySampler(budget)
    assert sampler.should_track("cpu", sampled=True)  # stale: nothing measured yet
    sampler.record(1.6, tracked=True, device_type="cpu")  # unknown plain time: all charged
    assert budget.spent == pytest.approx(1.6)
    # the second step after a change is measured too: the first one made the optimizer's state
    assert sampler.should_track("cpu", sampled=True)
    sampler.record(1.6, tracked=True, device_type="cpu")
    assert budget.spent == pytest.approx(3.2)
    assert not sampler.should_track("cpu", sampled=True)
    for _ in range(10):
        sampler.record(1.0, tracked=False, device_type="cpu")
    assert not sampler.should_track("cpu", sampled=True)  # 3.2 s spent of 13.2: 24 %
    for _ in range(100):
        sampler.record(1.0, tracked=False, device_type="cpu")
    assert sampler.should_track("cpu", sampled=True)  # 3.2 + ~0.6 of ~114: under 5 %
    assert sampler.should_track("cuda", sampled=True)  # allocator counters: always
    assert sampler.should_track("cpu", sampled=False)  # an explicit step()
    assert budget.overhead == pytest.approx(3.2 / 113.2)


def _spinner():
    """Another process keeping one core busy."""
    import subprocess
    import sys

    spinner = subprocess.Popen([sys.executable, "-c", "print('spinning', flush=True)\nwhile True: pass"],
                               stdout=subprocess.PIPE, text=True)
    spinner.stdout.readline()  # started (an interpreter's start on a loaded machine is slow)
    return spinner


@pytest.mark.alone  # another worker's tests would be contention
def test_contention_counts_other_processes_not_this_one():
    import time

    from nbtune.hardware import Contention

    # against a process the test starts, not an absolute level: a shared machine's other
    # processes are in both measures (what they add is the baseline)
    with Contention() as own:  # this process's own work, a core for a second, is not contention
        started = time.monotonic()
        while time.monotonic() - started < 1.0:
            sum(i * i for i in range(10_000))
    spinner = _spinner()
    try:
        time.sleep(0.3)  # it has started
        with Contention() as other:
            time.sleep(1.0)
            so_far = other.so_far()
    finally:
        spinner.kill()
        spinner.wait()
    assert own.others is not None and other.others - own.others >= 0.5, (own.others, other.others)
    assert abs(so_far - other.others) < 0.3  # the running figure a status line shows


def test_a_row_timed_while_the_machine_is_busy_says_so_instead_of_a_speed():
    session = small_session()
    # two spinners: however the scheduler shares the cores with this process's own threads
    # during the short row, the others keep at least half a core busy
    spinners = [_spinner(), _spinner()]
    try:
        ladder = session.compare([{}], steps=3, estimate=False, progress=False)
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()
    row = ladder[0]
    assert row.speed_suspect and row.busy >= 0.5
    assert "(busy*)" in repr(ladder) and "not the technique's" in repr(ladder)
    assert "not the technique" in ladder._repr_html_()
    assert ladder.as_dicts()[0]["busy_cores"] == row.busy


LADDER_RUN = "demo: tiny\ntechniques: {batch_size: 4, seq_len: 96, lr: 1e-3}\nrun: {steps: 1}\n"
OOM_ROWS = [("as the file", {}), ("batch 8", {"techniques.batch_size": 8}),
            ("+ checkpointing", {"techniques.activation_checkpointing": True})]


def _oom_at_batch_8(path, rows, steps, overrides, predicted):
    """``ladder._measure_on_rank`` as sent to each engine, but rank 1 runs out of memory in
    the optimizer phase of a row with batch 8 and no checkpointing (a card's limit, planted
    on CPU)."""
    import torch

    import nbtune.step
    from nbtune.run import ladder
    from nbtune.run.processes import ENGINE_STATE

    row = {**overrides, **rows[0][1]}
    if ENGINE_STATE["rank"] == 1 and row.get("techniques.batch_size") == 8 \
            and not row.get("techniques.activation_checkpointing"):
        def out_of_memory(self):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (planted)")
        nbtune.step._Phases.before_optimizer = out_of_memory
    return ladder.measure_rows(path, rows, steps, ENGINE_STATE["parallel"], None, overrides, predicted)


_oom_at_batch_8.__module__ = "__main__"  # (ipyparallel sends its code; the engine cannot import tests)


def _rows_after_an_oom(rows, capsys):
    assert [r["label"] for r in rows] == [label for label, _ in OOM_ROWS]
    assert rows[0]["peak"] > 0 and "error" not in rows[0]
    assert rows[2]["peak"] > 0  # it ran, carrying the row before it on, as a row that ran would
    assert rows[2]["changes"] == {"techniques.batch_size": 8, "techniques.activation_checkpointing": True}
    table = capsys.readouterr().out
    assert f"batch 8{' ' * 22}{rows[1]['error']}" in table


@pytest.mark.slow  # (about 10 s here; the fast tier has this module's others)
def test_a_row_out_of_memory_in_one_process_is_a_row_and_the_ladder_goes_on(tmp_path, monkeypatch, capsys):
    import nbtune.step
    from nbtune.run import factory
    from nbtune.run.ladder import ladder

    path = tmp_path / "run.yaml"
    path.write_text(LADDER_RUN)
    batch, real_build, real_optimizer = [0], factory.from_config, nbtune.step._Phases.before_optimizer

    def build(config, *args, **kwargs):  # (the row being built: batch 8 without checkpointing fails)
        batch[0] = config.techniques.batch_size * (not config.techniques.activation_checkpointing)
        return real_build(config, *args, **kwargs)

    def before_optimizer(self):
        if batch[0] == 8:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (planted)")
        real_optimizer(self)
    monkeypatch.setattr(factory, "from_config", build)
    monkeypatch.setattr(nbtune.step._Phases, "before_optimizer", before_optimizer)
    rows = ladder(str(path), rows=OOM_ROWS, steps=1)
    assert rows[1]["error"] == "out of memory" and "peak" not in rows[1]
    _rows_after_an_oom(rows, capsys)


@pytest.mark.slow
def test_a_row_out_of_memory_on_a_rank_is_a_row_naming_it_and_the_rows_go_on(tmp_path, monkeypatch, capsys):
    """From the notebook (ranks of the ladder's own): rank 1 out of memory in the batch-8 row
    leaves rank 0 waiting in a collective. The row says so and names the rank, as one process
    says it; its ranks are ended and the next row runs on fresh ones; nothing is left."""
    import psutil

    from nbtune.run import ladder as module
    from nbtune.run.ladder import ladder

    path = tmp_path / "run.yaml"
    path.write_text(LADDER_RUN)
    monkeypatch.setattr(module, "_measure_on_rank", _oom_at_batch_8)
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    rows = ladder(str(path), rows=OOM_ROWS, steps=1, processes=2)
    assert rows[1]["error"] == "out of memory on rank 1" and "peak" not in rows[1]
    assert len(rows[0]["per_rank"]) == len(rows[2]["per_rank"]) == 2
    _rows_after_an_oom(rows, capsys)
    left = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
    _, still = psutil.wait_procs(left, timeout=20)
    assert not still, [p.cmdline() for p in still]
