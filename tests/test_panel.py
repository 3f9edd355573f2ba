"""The panel's controls are bound both ways to session.techniques; buttons train."""

import pytest

from nbtune.techniques import HELP

from helpers import small_session

REQUIRED = ("method", "dtype", "activation_checkpointing", "batch_size", "lr")


@pytest.fixture
def session_and_panel():
    session = small_session()
    return session, session.panel()


def test_required_controls_exist_with_tooltips(session_and_panel):
    _, panel = session_and_panel
    for name in REQUIRED:
        assert name in panel.controls
    for name, control in panel.controls.items():
        assert control.tooltip == HELP[name] or control.disabled


def test_widget_changes_reach_the_session(session_and_panel):
    session, panel = session_and_panel
    panel.controls["lr"].value = 5e-4
    panel.controls["batch_size"].value = 3
    panel.controls["activation_checkpointing"].value = 2
    panel.controls["method"].value = "lora"
    t = session.techniques
    assert (t.lr, t.batch_size, t.activation_checkpointing, t.method) == (5e-4, 3, 2, "lora")
    assert any("lora_A" in n for n, _ in session.model.named_parameters())


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


def test_buttons_train_and_draw(session_and_panel):
    session, panel = session_and_panel
    panel.step_button.click()
    assert len(session.history) == 1
    panel.steps.value = 3
    panel.run_button.click()
    assert len(session.history) == 4
    assert panel.chart.value[:4] == b"\x89PNG"
    assert "step 4: loss" in panel.status.value


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
    assert "step 3: loss" in panel.status.value
