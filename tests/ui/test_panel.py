"""The panel's controls are bound both ways to session.techniques; buttons train."""

import pytest

from nbtune.techniques import HELP

from helpers import small_session

REQUIRED = ("method", "dtype", "activation_checkpointing", "batch_size", "lr")


@pytest.fixture
def session_and_panel():
    session = small_session()
    panel = session.panel()
    yield session, panel
    # an estimate still running in the fit check's thread when the interpreter exits aborts it
    # ("terminate called without an active exception", exit code 134)
    assert panel._fitcheck.wait(120)


def test_required_controls_exist_with_tooltips(session_and_panel):
    _, panel = session_and_panel
    for name in REQUIRED:
        assert name in panel.controls
    for name, control in panel.controls.items():
        assert control.tooltip.startswith(HELP[name]) or control.disabled
        assert control.tooltip.strip()


def test_widget_changes_reach_the_session(session_and_panel):
    session, panel = session_and_panel
    panel.controls["lr"].value = 5e-4
    panel.controls["batch_size"].value = 3
    panel.controls["activation_checkpointing"].value = 2
    panel.controls["method"].value = "lora"
    t = session.techniques
    assert (t.lr, t.batch_size, t.activation_checkpointing, t.method) == (5e-4, 3, 2, "lora")
    assert any("lora_A" in n for n, _ in session.model.named_parameters())
    assert "applied: method=lora" in panel.status.value  # the reply names the change
    panel.controls["packing"].value = True
    assert "applied: +packing" in panel.status.value


def test_a_slider_drawn_on_its_grid_changes_nothing_a_move_does(session_and_panel):
    """The browser's slider puts a value between its steps on the nearest step and sends that
    back as soon as it is drawn (seen in JupyterLab: lr=3e-4 became 10**-3.5): the session
    keeps its value; a move of one step, or any other value, is applied."""
    session, panel = session_and_panel
    session.set(lr=3e-4, lora_dropout=0.07, max_grad_norm=0.93)
    panel.controls["lr"].value = 10 ** -3.5  # as the browser sends it back
    panel.controls["lora_dropout"].value = 0.05
    panel.controls["max_grad_norm"].value = 0.9
    t = session.techniques
    assert (t.lr, t.lora_dropout, t.max_grad_norm) == (3e-4, 0.07, 0.93)
    panel.controls["lr"].value = 10 ** -3.6  # one step down: a move
    panel.controls["max_grad_norm"].value = 1.0
    assert session.techniques.lr == 10 ** -3.6 and session.techniques.max_grad_norm == 1.0
    panel.controls["lr"].value = 2e-4  # set from code, between steps: taken as it is
    assert session.techniques.lr == 2e-4
    session.set(seq_len=104)  # half-way between 96 and 112 on a step of 16: either is a redraw
    for redrawn in (96, 112):
        panel.controls["seq_len"].value = redrawn
        assert session.techniques.seq_len == 104
    panel.controls["seq_len"].value = 128
    assert session.techniques.seq_len == 128
    panel.controls["batch_size"].value = session.techniques.batch_size + 1  # a step of 1: a move
    assert session.techniques.batch_size == 5


def test_session_changes_reach_the_widgets(session_and_panel):
    session, panel = session_and_panel
    session.set(batch_size=5, dtype="bf16", activation_checkpointing=True)
    assert panel.controls["batch_size"].value == 5
    assert panel.controls["dtype"].value == "bf16"
    assert panel.controls["activation_checkpointing"].value == 1


def test_refused_value_snaps_back_and_says_why(session_and_panel):
    session, panel = session_and_panel
    panel.controls["seq_len"].value = 16  # every demo prompt is longer: nothing to train on
    assert session.techniques.seq_len == 96
    assert panel.controls["seq_len"].value == 96
    assert "Raise seq_len" in panel.status.value


@pytest.mark.slow
def test_buttons_train_and_draw(session_and_panel):
    session, panel = session_and_panel
    panel.step_button.click()
    assert len(session.history) == 1
    panel.steps.value = 3
    panel.run_button.click()  # trains in the background: the click returns at once
    run = session.current_run or panel._last_run()
    assert run is not None
    run.wait()
    assert len(session.history) == 4
    assert panel.chart.value[:4] == b"\x89PNG"
    # the session's step, the chart's count, with this run's share (one step came before)
    assert "done · step 4 (3 of this run&#x27;s 3)" in panel.progress.value
    assert not panel.run_button.disabled and panel.stop_button.layout.display == "none"
    assert "loss" in panel.progress.value


def test_every_toggle_has_a_control(session_and_panel):
    import dataclasses

    import nbtune as nt

    session, panel = session_and_panel
    fields = {f.name for f in dataclasses.fields(nt.Techniques)} - {"seed"}
    assert fields <= set(panel.controls)


def test_a_control_a_rule_would_refuse_is_disabled_with_the_reason(session_and_panel):
    session, panel = session_and_panel
    on_cpu = panel.controls["cpu_offload_optimizer"]
    assert on_cpu.disabled and "CUDA" in on_cpu.tooltip
    assert panel.controls["compile"].disabled
    in_backward = panel.controls["optimizer_in_backward"]
    assert not in_backward.disabled and in_backward.tooltip == HELP["optimizer_in_backward"]
    assert "Not available" in on_cpu.tooltip
    panel.controls["grad_accum"].value = 2
    assert in_backward.disabled and "grad_accum=1" in in_backward.tooltip
    panel.controls["grad_accum"].value = 1
    assert not in_backward.disabled
    in_backward.value = True
    assert session.techniques.optimizer_in_backward
    assert panel.controls["grad_accum"].disabled  # now accumulation would break the rule


def test_panel_is_current_after_a_run_from_code(session_and_panel):
    session, panel = session_and_panel
    session.run(3, progress=False, live=False)  # steps come faster than the redraw interval
    assert "step 3: loss" in panel.progress.value


def test_run_in_the_background_stop_and_pending_changes_shown(session_and_panel):
    import time

    session, panel = session_and_panel
    panel.steps.value = 10_000
    panel.run_button.click()
    run = session.current_run
    assert run is not None and run.running
    assert panel.run_button.disabled and panel.step_button.disabled
    assert panel.stop_button.layout.display == ""
    panel.controls["lr"].value = 2e-4  # queued: the control keeps its new value
    assert panel.controls["lr"].value == 2e-4
    assert "pending" in panel.status.value or "applied" in panel.status.value
    panel.step_button.click()  # disabled in the browser; clicked anyway it is refused in the panel
    assert "BusyError" in panel.status.value
    while run.running and session.techniques.lr != 2e-4:
        time.sleep(0.01)
    assert session.techniques.lr == 2e-4
    panel.stop_button.click()
    run.wait()
    assert run.stopped and "stopped" in panel.progress.value
    assert not panel.run_button.disabled and panel.stop_button.layout.display == "none"
    # a stopped run has nothing left: no time left in its line; the reply names both counts
    assert " left" not in panel.progress.value
    done, total = len(run.reports), len(session.history)
    assert total == run.before + done and run.reports[-1].step == total
    said = (f"stopped at step {total} of 10000" if not run.before
            else f"stopped at step {total} ({done} of this run's 10000)")
    assert said in panel.status.value  # the reply and the progress line: the same count
    assert "stopped · " + said.removeprefix("stopped at ") in panel.progress.value


def test_run_status_line_counts_time_left_and_cost():
    from nbtune.step import StepReport
    from nbtune.ui.status import format_duration, run_status

    reports = [StepReport(step=i, loss=2.0 - i / 10, tokens=1000, trained_tokens=500, seconds=0.5,
                          lr=1e-3, memory=None) for i in range(1, 5)]
    line = run_status(reports, 10, elapsed=2.4, price_per_hour=3.6)
    # 4 of 10 in 2.4 s -> 0.6 s a step, 3.6 s left; 4000 tokens in 2 s of steps; $3.6/h = $0.001/s
    assert line.startswith("step 4 of 10 · loss 1.600 · 2,000 tokens/s")
    assert "2 s elapsed, 4 s left" in line
    assert "$0.00 so far, $0.01 to finish at $3.6/h" in line
    stopped = run_status(reports, 10, elapsed=2.4, price_per_hour=3.6, finished=True)
    assert " left" not in stopped and "to finish" not in stopped and "$0.00 so far" in stopped
    assert run_status([], 5, 0.0) == "step 0 of 5 · 0 s elapsed"
    # one count everywhere: the session's step (the chart's), this run's share beside it
    later = [StepReport(step=20 + i, loss=1.0, tokens=1000, trained_tokens=500, seconds=0.5, lr=1e-3,
                        memory=None) for i in range(1, 5)]
    assert run_status(later, 300, 2.4, before=20).startswith("step 24 (4 of this run's 300) · loss")
    # a machine kept busy by other processes is said once the run is long enough to tell
    assert "machine busy: other processes used 1.5 of" in run_status(later, 300, 6.0, busy=1.5)
    assert "busy" not in run_status(later, 300, 6.0, busy=0.1) + run_status(later, 300, 2.0, busy=1.5)
    assert format_duration(3725) == "1 h 02 min" and format_duration(65) == "1 min 05 s"


def test_a_background_run_shows_as_a_progress_bar_with_stop():
    import time

    from nbtune.ui.runview import RunView

    session = small_session()
    run = session.start(10_000)
    view = RunView(session, run)
    while len(run.reports) < 2:
        time.sleep(0.01)
    view.stop_button.click()
    run.wait()
    assert run.stopped and view.bar.value == len(run.reports) and view.bar.bar_style == "warning"
    assert view.line.value.count("stopped") == 1 and f"step {len(run.reports)} of 10000" in view.line.value
    done = session.start(2)
    view = RunView(session, done)
    done.wait()
    assert view.bar.value == 2 and view.bar.bar_style == "success" and "done" in view.line.value


def test_the_summary_line_says_the_techniques_in_words():
    import nbtune as nt

    t = nt.Techniques(method="qlora", lora_rank=16, dtype="bf16", activation_checkpointing=True,
                      optimizer="adamw8bit", batch_size=2, seq_len=2048)
    assert t.summary() == "QLoRA r16 · bf16 · checkpointing every layer · AdamW 8-bit · 2 × 2048 tokens"
    t = nt.Techniques(activation_checkpointing=2, chunked_loss=8, optimizer_in_backward=True,
                      packing=True, batch_size=4, seq_len=128)
    assert t.summary() == ("full finetuning · fp32 · checkpointing every 2 layers · loss in 8 chunks · "
                           "AdamW in backward · 4 × 128 tokens packed")
    assert nt.Techniques(grad_accum=4, batch_size=1, seq_len=64).summary().endswith("1 × 64 tokens × 4 accumulated")


def test_every_field_and_every_choice_has_its_sentence():
    import dataclasses

    import nbtune as nt
    from nbtune.techniques import CHOICE_HELP, DTYPES, METHODS, OPTIMIZERS

    for field in dataclasses.fields(nt.Techniques):
        assert HELP[field.name].strip().endswith("."), field.name
    for name, choices in (("method", METHODS), ("dtype", DTYPES), ("optimizer", OPTIMIZERS)):
        assert set(CHOICE_HELP[name]) == set(choices)
        assert all(text.strip().endswith(".") for text in CHOICE_HELP[name].values())


def test_the_panel_shows_its_state_at_a_glance(session_and_panel):
    session, panel = session_and_panel
    packing = panel.controls["packing"]
    assert not packing.value and packing.icon == "" and packing.button_style == ""
    packing.value = True
    assert session.techniques.packing and packing.icon == "check" and packing.button_style == "info"
    assert "4 × 96 tokens packed" in panel.summary.value
    # LoRA's own controls only for LoRA methods
    assert all(panel.controls[n].layout.display == "none" for n in ("lora_rank", "lora_targets"))
    panel.controls["method"].value = "lora"
    assert all(panel.controls[n].layout.display != "none" for n in ("lora_rank", "lora_targets"))
    assert "LoRA r8" in panel.summary.value
    assert "lora: Freezes the model" in panel.choice_help["method"].value
    assert "Now: lora: Freezes the model" in panel.controls["method"].tooltip
    # changes nothing on this device: disabled, with the reason
    offload = panel.controls["activation_offloading"]
    assert offload.disabled and "already" in offload.tooltip and "CUDA" in offload.tooltip
    # ... and looks it: struck through, unlike a toggle that is merely off
    assert offload.style.text_decoration == "line-through"
    assert packing.style.text_decoration == "none"
    # the controls outside the tabs explain themselves too (the dropdown's on its label)
    assert panel.steps.tooltip and "title=" in panel.budget.description


def test_the_chart_redraws_within_its_budget_and_at_least_every_so_often(monkeypatch):
    from nbtune.overhead import OverheadBudget
    from nbtune.ui import live

    now = [100.0]
    monkeypatch.setattr(live.time, "perf_counter", lambda: now[0])
    budget = OverheadBudget(share=0.02)
    pacer = live.PacedRedraw(budget)
    assert pacer.due()  # the first drawing always
    now[0] += 0.1
    pacer.drew(100.0)  # it cost 0.1 s, with no training time yet: the budget is spent
    budget.work(2.0)
    assert not pacer.due() and pacer.due(force=True)
    now[0] += 9.0
    assert not pacer.due()
    now[0] += 1.5  # over 10 s since the last drawing: drawn anyway
    assert pacer.due()
    budget.work(1000.0)  # plenty of training time: the budget allows it at once
    now[0] += 0.01
    pacer.drew(now[0] - 0.1)
    assert pacer.due()


def test_hiding_lora_fields_hides_nothing_else(session_and_panel):
    """Under full finetuning and sft: LoRA's fields and the preference objectives' hidden."""
    _, panel = session_and_panel
    hidden = {name for name, control in panel.controls.items() if control.layout.display == "none"}
    from nbtune.ui.panel import GRPO_FIELDS

    assert hidden == {"lora_rank", "lora_alpha", "lora_dropout", "lora_targets", "beta", "gamma", "reference",
                      "split_pairs", *GRPO_FIELDS}


def test_a_preference_objective_shows_its_own_settings_and_a_pair_batch_trains():
    """On pairs: choosing simpo in the dropdown shows beta and gamma (dpo: beta alone), and a
    step from the panel reports the pairs' rewards."""
    from helpers import small_session

    session = small_session(objective="sft")
    panel = session.panel()
    try:
        # under sft on pairs the reference is chosen before a switch to dpo (after sft steps
        # "precomputed" or a "copy" is the model dpo starts from); hidden, its help line goes too
        assert panel.controls["reference"].layout.display != "none"
        panel.controls["objective"].value = "simpo"
        assert panel.choice_help["reference"].layout.display == "none"
        assert session.techniques.objective == "simpo"
        shown = {n for n in ("beta", "gamma", "reference", "split_pairs")
                 if panel.controls[n].layout.display != "none"}
        assert shown == {"beta", "gamma", "split_pairs"}
        panel.controls["split_pairs"].value = True  # the toggle reaches the session's techniques
        assert session.techniques.split_pairs
        panel.step_button.click()
        last = session.history[-1]
        assert last.preference is not None
        panel._redraw(force=True)
        assert f"margin {last.preference.margin:.3f}" in panel.progress.value
    finally:
        assert panel._fitcheck.wait(120)


def test_grpo_in_the_panel_shows_its_settings_and_a_step_reports_its_rewards():
    """Choosing grpo shows its settings (and hides the pairs' beta, gamma and reference); a
    step from the panel reports the rewards, on the status line and the chart's reward line."""
    from helpers import small_session
    from nbtune.ui.panel import GRPO_FIELDS

    session = small_session(objective="simpo", max_completion=16)  # (room for the prompts)
    session.rewards = small_session(objective="grpo").rewards
    panel = session.panel()
    try:
        assert all(panel.controls[n].layout.display == "none" for n in GRPO_FIELDS)
        panel.controls["objective"].value = "grpo"
        assert session.techniques.objective == "grpo"
        assert all(panel.controls[n].layout.display != "none" for n in GRPO_FIELDS)
        assert all(panel.controls[n].layout.display == "none" for n in ("beta", "gamma", "reference"))
        panel.controls["generations"].value = 3
        assert session.techniques.generations == 3
        panel.step_button.click()
        last = session.history[-1]
        assert last.rollouts is not None and last.shape[0] == 3 * session.techniques.batch_size
        panel._redraw(force=True)
        assert f"reward {last.rollouts.reward:.3f}" in panel.progress.value
    finally:
        assert panel._fitcheck.wait(120)


def test_the_longest_context_button_answers_beside_the_fit_buttons(session_and_panel):
    """The button searches in the background and shows the answer (the same as
    ``session.longest_context``, computed here) with the seq_len to use."""
    session, panel = session_and_panel
    panel.budget.value = panel.budget.options[0][1] if isinstance(panel.budget.options[0], tuple) \
        else panel.budget.options[0]
    panel.context_button.click()
    panel._context_search.join(300)
    result = panel.last_context
    assert result is not None and result.tokens > 0
    assert result.tokens == session.longest_context(panel.budget.value).tokens
    assert "longest context that fits" in panel.context.value
    assert "estimating" not in panel.context.value
    assert not panel.context_button.disabled
    # Use it sets seq_len to the answer (and goes: the answer is in use)
    assert panel.context_apply.layout.display == "" and result.tokens != session.techniques.seq_len
    panel.context_apply.click()
    assert session.techniques.seq_len == result.tokens
    assert panel.context_apply.layout.display == "none" and "<s>" not in panel.context.value
    # another toggle makes the answer stale: struck through, no Use it
    session.set(activation_checkpointing=not session.techniques.activation_checkpointing)
    assert "<s>" in panel.context.value and "search again" in panel.context.value
    assert panel.context_apply.layout.display == "none"
    panel.context_apply.click()  # a click that was on its way changes nothing
    assert session.techniques.seq_len == result.tokens


def test_every_figure_the_panel_shows_says_what_it_means_on_hover(session_and_panel):
    from nbtune.ui.panel import BADGE_HELP, PRICE_HELP
    from nbtune.ui.runview import STATUS_HELP

    session, panel = session_and_panel
    assert panel._fitcheck.wait(120)
    assert "title=" in panel.badge.value and "To spare" in BADGE_HELP
    assert "title=" in panel.price.description and "$ / hour" in panel.price.description
    assert "dollars" in PRICE_HELP
    panel.steps.value = 2
    panel.run_button.click()
    session.wait(120)
    panel._show_progress(final=True)
    assert "title=" in panel.progress.value and "tokens/s" in STATUS_HELP


def test_a_dropped_answer_leaves_no_estimating_behind(session_and_panel):
    """An answer to an older question is dropped; where the newest question is answered
    already, its answer shows at once (not "estimating…" until the next change)."""
    session, panel = session_and_panel
    assert panel._fitcheck.wait(120)
    shown = panel.badge.value
    panel.badge.value = "<span style='color:#777'>estimating…</span>"  # asked again meanwhile
    older = session.techniques.replace(batch_size=session.techniques.batch_size + 1)
    panel._show_badge(older, panel.budget.value, None, 0.0, "old")
    assert panel.badge.value == shown


def test_a_prompt_tried_in_the_panel_streams_its_reply_there_during_a_run(session_and_panel, capsys):
    """The reply is made between two steps of the run and shown in the panel as it comes:
    several updates of the reply line, nothing printed (which would land in the Log console)."""
    session, panel = session_and_panel
    session.run(40, progress=False, live=False)  # the demo answers in several tokens by then
    updates = []
    panel.reply.observe(lambda change: updates.append(change["new"]), names="value")
    run = session.start(200)
    panel.prompt.value = "Is 7 even or odd?"
    panel.prompt_button.click()
    assert panel.prompt_button.disabled
    panel._prompting.join(120)
    session.stop()
    expected = "(the model after step"
    assert expected in panel.reply.value and "between two steps of the run" in panel.reply.value
    streamed = [u for u in updates if u.endswith(" …</div>")]
    assert len(streamed) > 1 and not panel.prompt_button.disabled
    assert run.error is None and capsys.readouterr().out == ""
    panel.prompt.value = "  "
    panel.prompt_button.click()
    assert "Type a prompt" in panel.status.value
    # the task's rows have an input: the box beside the prompt takes one, and the reply is the
    # model's to the instruction with that input, as generate makes it
    from nbtune.ui.panel import PROMPT_TOKENS

    assert panel.prompt_input.layout.display == ""
    panel.prompt.value, panel.prompt_input.value = "Which vowel is in the word?", "bcud"
    panel.prompt_button.click()
    panel._prompting.join(120)
    expected = session.generate("Which vowel is in the word?", input="bcud", max_new_tokens=PROMPT_TOKENS)
    assert f"Which vowel is in the word?</b> (bcud)<br>{expected}<br>" in panel.reply.value


@pytest.mark.slow
def test_two_cards_in_the_machine_list_badge_one_ranks_step(session_and_panel):
    """The machine list offers two 24 GB cards under FSDP2; choosing them shows the need of
    one rank's step (``estimate(..., ranks=2)``), not the whole step's."""
    import nbtune as nt
    from nbtune.predict.budgets import required
    from nbtune.units import format_bytes

    session, panel = session_and_panel
    two = [value for label, value in panel.budget.options if label.startswith("2x RTX 3090")]
    assert two == ["2x RTX 3090 + 64GiB"]
    shown, show = [], panel._fitcheck._show
    panel._fitcheck._show = lambda *args: (shown.append(args), show(*args))
    panel.budget.value = two[0]
    assert panel._fitcheck.wait(120)
    per_rank = required(nt.estimate(session.model.config, session.planned, device="cuda", ranks=2))
    whole = required(nt.estimate(session.model.config, session.planned, device="cuda"))
    badge = shown[-1][2]
    assert shown[-1][1] == two[0] and badge.need == per_rank < whole
    assert f"{format_bytes(badge.usable - per_rank)} to spare" in panel.badge.value


def test_a_background_run_started_in_a_cell_shows_its_bar_whatever_it_is_assigned_to(monkeypatch):
    """``run = session.start(n)`` (the README's form) shows the bar and Stop in that cell's
    output; ``run`` as the cell's last expression does not show a second one, and shown in
    a later cell it shows again."""
    import IPython
    import IPython.display

    import nbtune.ui.live
    from nbtune.ui.runview import RunView

    shown, shell = [], type("Shell", (), {"execution_count": 7})()
    monkeypatch.setattr(nbtune.ui.live, "in_notebook", lambda: True)
    monkeypatch.setattr(IPython, "get_ipython", lambda: shell)
    monkeypatch.setattr(IPython.display, "display", lambda *objs, **kw: shown.extend(objs))
    session = small_session()
    run = session.start(3)
    assert len(shown) == 1 and isinstance(shown[0], RunView) and shown[0].run is run
    run._ipython_display_()  # ``run`` at the end of the same cell: already shown
    assert len(shown) == 1
    run.wait()
    shell.execution_count = 8
    run._ipython_display_()  # in a later cell: shown again, finished
    assert len(shown) == 2 and shown[1].bar.value == 3 and "done" in shown[1].line.value
    for view in shown:
        view.close()


def test_a_session_without_rows_says_so_before_a_bar_is_drawn(capsys):
    import nbtune as nt
    from nbtune.data import DataError
    from nbtune.demos import demo_named

    session = nt.Session.from_pretrained(demo_named("tiny").model())  # to chat: no data
    for command in (lambda: session.run(1), lambda: session.start(1)):
        with pytest.raises(DataError, match="no training rows"):
            command()
    assert "training" not in capsys.readouterr().err  # no progress bar was drawn
    assert session.current_run is None and not session.history
