"""The control panel: ipywidgets bound both ways to ``session.techniques``, plus the chart.

Widget -> session: a changed control calls ``session.set``; if the value is refused the
control snaps back and the reason is shown. Session -> widget: the panel subscribes to
the session, so ``session.set(...)`` from code moves the controls too.
"""

from __future__ import annotations

import time

import ipywidgets as w

from ..techniques import DTYPES, HELP, LORA_TARGETS, METHODS, OPTIMIZERS
from .charts import draw_memory, figure_png, format_bytes
from .live import PacedRedraw
from matplotlib.figure import Figure


def _controls(session) -> dict[str, w.ValueWidget]:
    """One control per toggle, keyed by the Techniques field it edits."""
    layers = len(session.model.model.layers)
    limit = session.model.config.max_position_embeddings
    style = {"description_width": "170px"}
    wide = w.Layout(width="440px")

    def slider(cls, description, **kw):
        return cls(description=description, style=style, layout=wide, **kw)

    def toggle(description):
        # A ToggleButton, not a Checkbox: a checkbox's hover text is its label, never the
        # tooltip, so a disabled one could not say why.
        return w.ToggleButton(description=description, icon="check",
                              layout=w.Layout(width="262px", margin="2px 0 2px 178px"))

    return {
        # model
        "method": w.Dropdown(options=METHODS, description="method", style=style, layout=wide),
        "dtype": w.Dropdown(options=DTYPES, description="dtype", style=style, layout=wide),
        "lora_rank": slider(w.IntSlider, "LoRA rank", min=1, max=64),
        "lora_alpha": slider(w.FloatSlider, "LoRA alpha", min=1.0, max=128.0, step=1.0),
        "lora_dropout": slider(w.FloatSlider, "LoRA dropout", min=0.0, max=0.5, step=0.05),
        "lora_targets": w.SelectMultiple(options=LORA_TARGETS, description="LoRA targets",
                                         style=style, layout=w.Layout(width="440px", height="130px")),
        # memory
        "activation_checkpointing": slider(w.IntSlider, "checkpoint every N layers", min=0, max=layers),
        "activation_offloading": toggle("offload activations to CPU"),
        "chunked_loss": slider(w.IntSlider, "loss in N chunks", min=0, max=16),
        "optimizer": w.Dropdown(options=OPTIMIZERS, description="optimizer", style=style, layout=wide),
        "optimizer_in_backward": toggle("optimizer step in backward"),
        "cpu_offload_optimizer": toggle("optimizer state on CPU"),
        "compile": toggle("torch.compile"),
        # batch
        "batch_size": slider(w.IntSlider, "batch size", min=1, max=64),
        "seq_len": slider(w.IntSlider, "sequence length", min=16, max=limit, step=16),
        "packing": toggle("pack examples into sequences"),
        "grad_accum": slider(w.IntSlider, "gradient accumulation", min=1, max=16),
        # optimizer
        "lr": slider(w.FloatLogSlider, "learning rate", base=10, min=-6, max=-1, step=0.1,
                     readout_format=".1e"),
        "warmup_steps": slider(w.IntSlider, "warm-up steps", min=0, max=500),
        "weight_decay": slider(w.FloatSlider, "weight decay", min=0.0, max=0.3, step=0.01),
        "max_grad_norm": slider(w.FloatSlider, "max gradient norm", min=0.0, max=5.0, step=0.1),
    }


TABS = {"Model": ("method", "dtype", "lora_rank", "lora_alpha", "lora_dropout", "lora_targets"),
        "Memory": ("activation_checkpointing", "activation_offloading", "chunked_loss", "optimizer",
                   "optimizer_in_backward", "cpu_offload_optimizer", "compile"),
        "Batch": ("batch_size", "seq_len", "packing", "grad_accum"),
        "Optimizer": ("lr", "warmup_steps", "weight_decay", "max_grad_norm")}
# The value a control is moved to when a rule would stop it (checked to disable it ahead).
PROBES = {"optimizer_in_backward": True, "cpu_offload_optimizer": True, "compile": True,
          "activation_offloading": True, "packing": True, "grad_accum": 2, "max_grad_norm": 1.0}


def _widget_value(name: str, value):
    # activation_checkpointing is True/False/N in Techniques and 0..N on the slider.
    return int(value) if name == "activation_checkpointing" else value


def _blocked_reason(techniques, name: str, device: str) -> str | None:
    """Why moving control ``name`` to its probe value would be refused, or None."""
    probe = PROBES.get(name)
    if probe is None or getattr(techniques, name) == probe:
        return None  # nothing to probe, or already on (it must stay possible to turn it off)
    try:
        broken = techniques.replace(**{name: probe}).conflicts(device)
    except ValueError as err:
        return str(err)
    return " ".join(rule.reason for rule in broken) or None


class Panel(w.VBox):
    """Controls, Step / Run buttons, a status line and the live memory chart of a session."""

    def __init__(self, session) -> None:
        self.session = session
        self.controls = _controls(session)
        for name, control in self.controls.items():
            control.value = _widget_value(name, getattr(session.techniques, name))
            control.observe(self._on_control, names="value")
        self.steps = w.BoundedIntText(value=20, min=1, max=100_000, description="steps",
                                      layout=w.Layout(width="160px"))
        self.step_button = w.Button(description="Step", icon="forward",
                                    tooltip="Run one optimizer step")
        self.run_button = w.Button(description="Run", icon="play", button_style="primary",
                                   tooltip="Run the number of steps on the left")
        self.step_button.on_click(lambda _: self._train(1))
        self.run_button.on_click(lambda _: self._train(self.steps.value))
        self.status = w.HTML()
        self.chart = w.Image(format="png")
        self._figure = Figure(figsize=(9, 4))
        self._pacer = PacedRedraw(session.overhead)
        self._syncing = False
        tabs = w.Tab([w.VBox([self.controls[name] for name in names]) for names in TABS.values()])
        for i, title in enumerate(TABS):
            tabs.set_title(i, title)
        super().__init__([
            w.HTML("<b>nbtune</b>: change a toggle, run a few steps, watch where memory goes."),
            tabs, w.HBox([self.step_button, self.steps, self.run_button]),
            self.status, self.chart])
        self._sync_from(session.techniques)
        session.subscribe(self._on_session)
        self._redraw(force=True)

    # widget -> session
    def _on_control(self, change) -> None:
        if self._syncing:
            return
        name = next(n for n, c in self.controls.items() if c is change["owner"])
        try:
            self.session.set(**{name: change["new"]})
        except (ValueError, TypeError) as err:
            self._sync_from(self.session.techniques)  # snap back: nothing was applied
            self._say(f"⚠ {err}", error=True)

    # session -> widget
    def _on_session(self, event: str, payload) -> None:
        if event == "techniques":
            self._sync_from(payload)
        elif event == "step":
            self._redraw()
        elif event == "run":
            self._redraw(force=True)  # throttling may have skipped the last step's drawing

    def _sync_from(self, techniques) -> None:
        """Show ``techniques``; disable each control a rule would refuse, saying why."""
        self._syncing = True
        try:
            for name, control in self.controls.items():
                control.value = _widget_value(name, getattr(techniques, name))
                reason = _blocked_reason(techniques, name, self.session.device.type)
                control.disabled = reason is not None
                control.tooltip = reason or HELP[name]
        finally:
            self._syncing = False

    def _train(self, steps: int) -> None:
        for button in (self.step_button, self.run_button):
            button.disabled = True
        try:
            self.session.run(steps, progress=False, live=False)
        except Exception as err:  # show it in the panel; the session stays usable
            self._say(f"⚠ {type(err).__name__}: {err}", error=True)
        finally:
            for button in (self.step_button, self.run_button):
                button.disabled = False
            self._redraw(force=True)

    def _redraw(self, force: bool = False) -> None:
        if not self._pacer.due(force):
            return
        started = time.perf_counter()
        history = self.session.history
        self.chart.value = figure_png(draw_memory(self._figure, history))
        self._pacer.drew(started)
        if history:
            last = history[-1]
            self._say(f"step {last.step}: loss {last.loss:.3f}, peak {format_bytes(last.memory.peak)}, "
                      f"{last.tokens_per_second:,.0f} tokens/s")

    def _say(self, text: str, error: bool = False) -> None:
        color = "#b00" if error else "#333"
        self.status.value = f"<span style='color:{color}'>{text}</span>"
