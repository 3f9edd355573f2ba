"""The control panel: ipywidgets bound both ways to ``session.techniques``, plus the chart.

Widget -> session: a changed control asks the session's runner (``runner.set``); if the value
is refused the control snaps back and the reason is shown. Session -> widget: the panel
subscribes to the runner's events, so ``session.set(...)`` from code moves the controls too.
What the session says shows in the panel's status line: a widget callback never prints
(printed output from a callback lands in JupyterLab's log console, where nobody looks).
``close()`` unsubscribes and ends the fit check's worker.

Run trains in the background (``runner.start``): the kernel stays free, so Stop and the
controls keep working; a change made while it runs shows as pending until the training
thread applies it at the next step boundary. Chart and status are ipywidgets updated from
that thread (no display handles), which JupyterLab, Notebook 7, VS Code and Colab render.
"""

from __future__ import annotations

import html
import math
import threading
import time

import ipywidgets as w

from ..run.runner import (Message, PendingChanged, Refused, RunFinished, RunStarted, StepDone,
                      TechniquesChanged)
from ..data import TextRow
from ..techniques import (CHOICE_HELP, DTYPES, GRPO_LOSSES, HELP, LORA_TARGETS, METHODS, NO_EFFECT,
                          KV_CACHES, OBJECTIVES, OPTIMIZERS, REFERENCES)
from ..plan import SHARDED_FIELDS, SHARDED_REASON, projections
from ..units import format_bytes
from ..charts import draw_memory, figure_png
from ..predict import APPLY_IN_CODE, CARDS, HOST_RAM, Predictor
from .fitcheck import FitCheck, in_background
from .live import PacedRedraw
from .alive import PANEL_CLASS, display_watched, heartbeat
from .runview import STATUS_HELP, busy_of as _busy, wrapped as _wrapped
from .status import objective_words, run_status, step_count
from matplotlib.figure import Figure


LABEL_PX = 200  # room for the longest control label ("held-out loss every N steps")
# What the panel's figures mean, as their hover text.
PRICE_HELP = ("What the rented card costs per hour, in dollars: the status line then shows the "
              "cost so far and to finish (0: not shown)")
BADGE_HELP = ("Estimated for the next step with the toggles as they are (fake tensors: nothing is "
              "allocated). To spare: what the card offers (less the CUDA context and a margin for "
              "the allocator: 'usable') minus the step's peak, the most held at one moment. Host: "
              "what the run keeps in host memory (offloaded activations, optimizer state on the "
              "CPU, a checkpoint being written) of what the host offers")
PROMPT_HELP = ("A reply from the model as trained so far (greedy, as session.generate gives it), "
               "written here as it is made; during a run it is made between two steps, which the "
               "run waits for and which changes nothing in its training")
TEXT_HELP = ("The rows are raw text (continued pretraining: every token trained, a long text cut "
             "into seq_len pieces; packing fills each row): the model continues what you type as "
             "it is, with no chat template")
PROMPT_TOKENS = 64  # a reply's most new tokens in the panel
CONTEXT_HELP = ("The longest sequence (tokens per row) predicted to fit this card and its host "
                "with the other toggles as they are; Use it sets seq_len to it")


def _controls(session) -> dict[str, w.ValueWidget]:
    """One control per toggle, keyed by the Techniques field it edits."""
    layers = len(session.model.model.layers)
    limit = session.model.config.max_position_embeddings
    style = {"description_width": f"{LABEL_PX}px"}
    def wide():  # one Layout per control: hiding one (LoRA's under "full") must not hide others
        return w.Layout(width=f"{LABEL_PX + 270}px")

    def slider(cls, description, **kw):
        return cls(description=description, style=style, layout=wide(), **kw)

    def toggle(description):
        # A ToggleButton, not a Checkbox: a checkbox's hover text is its label, never the
        # tooltip, so a disabled one could not say why. Its look follows its value (_look).
        return w.ToggleButton(description=description,
                              layout=w.Layout(width="262px", margin=f"2px 0 2px {LABEL_PX + 8}px"))

    return {
        # model
        "method": w.Dropdown(options=METHODS, description="method", style=style, layout=wide(),
                             description_allow_html=True),
        "dtype": w.Dropdown(options=DTYPES, description="dtype", style=style, layout=wide(),
                            description_allow_html=True),
        "lora_rank": slider(w.IntSlider, "LoRA rank", min=1, max=64),
        "lora_alpha": slider(w.FloatSlider, "LoRA alpha", min=1.0, max=128.0, step=1.0),
        "lora_dropout": slider(w.FloatSlider, "LoRA dropout", min=0.0, max=0.5, step=0.05),
        "lora_targets": w.SelectMultiple(options=[p for p in LORA_TARGETS if p in projections(session.model)],
                                         description="LoRA targets",
                                         style=style, layout=w.Layout(width="440px", height="130px"),
                                         description_allow_html=True),
        # memory
        "activation_checkpointing": slider(w.IntSlider, "checkpoint every N layers", min=0, max=layers),
        "activation_offloading": toggle("offload activations to CPU"),
        "chunked_loss": slider(w.IntSlider, "loss in N chunks", min=0, max=16),
        "tile_tokens": slider(w.IntSlider, "tiles of N tokens", min=0, max=limit, step=16),
        "optimizer": w.Dropdown(options=OPTIMIZERS, description="optimizer", style=style, layout=wide(),
                                description_allow_html=True),
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
        "eval_every": slider(w.IntSlider, "held-out loss every N steps", min=0, max=200),
        # objective
        "objective": w.Dropdown(options=OBJECTIVES, description="objective", style=style, layout=wide(),
                                description_allow_html=True),
        "beta": slider(w.FloatLogSlider, "beta", base=10, min=-2, max=1, step=0.1, readout_format=".2g"),
        "gamma": slider(w.FloatSlider, "gamma (SimPO margin)", min=0.0, max=5.0, step=0.1),
        "reference": w.Dropdown(options=REFERENCES, description="reference", style=style, layout=wide(),
                                description_allow_html=True),
        "split_pairs": toggle("chosen, rejected apart"),
        "generations": slider(w.IntSlider, "completions per prompt", min=2, max=16),
        "max_completion": slider(w.IntSlider, "max completion tokens", min=8, max=limit, step=8),
        "rollout_temperature": slider(w.FloatSlider, "sampling temperature", min=0.1, max=2.0, step=0.05),
        "rollout_top_p": slider(w.FloatSlider, "top-p", min=0.05, max=1.0, step=0.05),
        "kl": slider(w.FloatSlider, "KL weight", min=0.0, max=0.5, step=0.01),
        "grpo_loss": w.Dropdown(options=GRPO_LOSSES, description="token averaging", style=style,
                                layout=wide(), description_allow_html=True),
        "scale_rewards": toggle("advantages over the group's std"),
        "generation_batch": slider(w.IntSlider, "written at once (0: a group)", min=0, max=16),
        "kv_cache": w.Dropdown(options=KV_CACHES, description="KV cache", style=style, layout=wide(),
                               description_allow_html=True),
    }


GRPO_FIELDS = ("generations", "max_completion", "rollout_temperature", "rollout_top_p", "kl", "grpo_loss",
               "scale_rewards", "generation_batch", "kv_cache")
# Controls grouped by concern, one tab each.
TABS = {"Method & adapter": ("method", "lora_rank", "lora_alpha", "lora_dropout", "lora_targets"),
        "Precision": ("dtype", "compile"),
        "Activations": ("activation_checkpointing", "activation_offloading", "chunked_loss",
                        "tile_tokens"),
        "Optimizer": ("optimizer", "optimizer_in_backward", "cpu_offload_optimizer", "lr",
                      "warmup_steps", "weight_decay", "max_grad_norm"),
        "Batch": ("batch_size", "seq_len", "packing", "grad_accum"),
        "Evaluation": ("eval_every",),
        "Objective": ("objective", "beta", "gamma", "reference", "split_pairs", *GRPO_FIELDS)}
LORA_FIELDS = ("lora_rank", "lora_alpha", "lora_dropout", "lora_targets")  # hidden under "full"
# hidden where unused (gamma: SimPO's alone; GRPO's under grpo alone)
PREFERENCE_FIELDS = ("beta", "gamma", "reference", "split_pairs", *GRPO_FIELDS)
# The value a control is moved to when a rule would stop it (checked to disable it ahead).
PROBES = {"optimizer_in_backward": True, "cpu_offload_optimizer": True, "compile": True,
          "activation_offloading": True, "packing": True, "grad_accum": 2, "max_grad_norm": 1.0}


def _widget_value(name: str, value, control):
    # activation_checkpointing is True/False/N in Techniques and 0..N on the slider; the
    # targets list offers only the projections this model has (the default names them all).
    if name == "lora_targets":
        return tuple(v for v in value if v in control.options)
    return int(value) if name == "activation_checkpointing" else value


def _snapped(control, current, new) -> bool:
    """Whether ``new`` is only the browser's slider putting ``current`` on its grid, not a
    move: a log slider of step 0.1 shows lr=3e-4 at 10**-3.5 and sends 3.16e-4 back the
    moment it is drawn (and seq_len=200 on a step of 16 comes back as 192 or 208), which
    would change the user's setting unasked. A grid point within half a step of ``current``
    (either one, half-way) is such a redraw; a hand that moves to that very point looks the
    same, and is taken for one too."""
    if not isinstance(control, (w.IntSlider, w.FloatSlider, w.FloatLogSlider)) or new == current:
        return False
    if isinstance(control, w.FloatLogSlider):
        if not (current > 0 and new > 0):
            return False
        current, new = math.log(current, control.base), math.log(new, control.base)
    at, to = (current - control.min) / control.step, (new - control.min) / control.step
    return math.isclose(to, round(to), abs_tol=1e-6) and abs(to - at) <= 0.5 + 1e-6


def _blocked_reason(techniques, name: str, device: str, sharded: bool = False) -> str | None:
    """Why control ``name`` is disabled: on ranks, it is fixed while the model is sharded
    (``plan.SHARDED_FIELDS``); moving it to its probe value would be refused, or it would
    change nothing on this device (``NO_EFFECT``); None if it is free to move."""
    if sharded and name in SHARDED_FIELDS:
        return f"{name} is fixed on ranks: {SHARDED_REASON}."
    pointless = [rule.reason for rule in NO_EFFECT
                 if name in rule.fields and rule.device != device and rule.broken(techniques)]
    if pointless:
        return " ".join(pointless)
    probe = PROBES.get(name)
    if probe is None or getattr(techniques, name) == probe:
        return None  # nothing to probe, or already on (it must stay possible to turn it off)
    try:
        broken = techniques.replace(**{name: probe}).conflicts(device)
    except ValueError as err:
        return str(err)
    return " ".join(rule.reason for rule in broken) or None


def _has_inputs(rows) -> bool:
    """Whether the task's instruction rows carry an input (the first hundred tell)."""
    return any(getattr(row, "instruction", None) and row.instruction[1] for row in list(rows[:100]))


class Panel(w.VBox):
    """Controls, Step / Run / Stop buttons, a status line and the live memory chart."""

    def __init__(self, session) -> None:
        self.session = session
        self.runner = session.runner
        self._local = threading.local()  # which thread is moving controls to match the session
        self.controls = _controls(session)
        self._labels = {name: control.description for name, control in self.controls.items()}
        for name, control in self.controls.items():
            control.value = _widget_value(name, getattr(session.techniques, name), control)
            control.observe(self._on_control, names="value")
        self._make_run_controls()
        self._make_fit_controls()
        self._make_prompt_controls()
        self._fit_changes: dict | None = None
        sharding = session.parallel.sharding if session.parallel is not None else None
        self._fitcheck = FitCheck(Predictor.of(session.model.config, "cuda"), self._show_badge,
                                  sharding=sharding)  # several cards: as the run shards
        self.last_fit_seconds: float | None = None  # request -> badge, for the benchmark
        self.status = w.HTML()  # replies to clicks: applied, pending, refused and why
        self._lines: list[str] = []  # what the status line shows
        self.progress = w.HTML()  # the run: step, loss, speed, time and cost
        self.chart = w.Image(format="png")
        self._figure = Figure(figsize=(9, 4))
        self._pacer = PacedRedraw(session.overhead)
        # the current choice of each dropdown, in a sentence, under it
        self.choice_help = {name: w.HTML(layout=w.Layout(width=f"{LABEL_PX + 270}px",
                                                          margin=f"0 0 6px {LABEL_PX + 8}px"))
                            for name in CHOICE_HELP}
        self.summary = w.HTML()  # the techniques in words
        tabs = w.Tab([w.VBox([widget for name in names
                              for widget in (self.controls[name], self.choice_help.get(name)) if widget])
                      for names in TABS.values()])
        for i, title in enumerate(TABS):
            tabs.set_title(i, title)
        super().__init__([
            w.HTML("<b>nbtune</b>: change a toggle, run a few steps, watch where memory goes. "
                   "Hover over a control to see what it does and costs."),
            self.summary, tabs, w.HBox([self.budget, self.badge]),
            w.HBox([self.fit_button, self.fit_apply, self.context_button, self.context_apply,
                    self.context]),
            w.HBox([self.step_button, self.steps, self.run_button, self.stop_button, self.price]),
            self.status, self.progress, self.chart,
            w.HBox([self.prompt, self.prompt_input, self.prompt_button]), self.reply,
            heartbeat()])  # ticks while the kernel lives: the page marks a dead one (``alive``)
        self.add_class(PANEL_CLASS)  # the page's watcher finds it by this (``alive``)
        self._search = None  # the fit search's thread, while it runs
        self._context_search = None  # the longest-context search's thread
        self.last_context = None  # its last answer (a LongestContext)
        self._context_asked = (None, None)  # the techniques and budget it answered for
        self._applied = session.techniques  # what "applied" compares the next change with
        self._sync_from(session.techniques)
        self._check_fit()
        self._subscription = self.runner.subscribe(self._on_event)
        self._run_seen = session.current_run
        if session.current_run is not None:
            self._running(True)
        self._redraw(force=True)

    def _make_run_controls(self) -> None:
        """Step, the number of steps, Run, Stop and the price per hour."""
        session = self.session
        self.steps = w.BoundedIntText(value=20, min=1, max=100_000, description="steps",
                                      layout=w.Layout(width="160px"),
                                      tooltip="How many optimizer steps Run trains")
        self.step_button = w.Button(description="Step", icon="forward",
                                    tooltip="Run one optimizer step")
        self.run_button = w.Button(description="Run", icon="play", button_style="primary",
                                   tooltip="Train the number of steps on the left in the "
                                           "background: the notebook stays usable")
        self.stop_button = w.Button(description="Stop", icon="stop", button_style="danger",
                                    tooltip="Stop after the step under way",
                                    layout=w.Layout(display="none"))
        self.price = w.BoundedFloatText(
            value=session.price_per_hour or 0.0, min=0.0, max=1000.0, step=0.01,
            # JupyterLab shows no hover text on a number box: put it on the label too
            description=f"<span title='{html.escape(PRICE_HELP, quote=True)}'>$ / hour</span>",
            description_allow_html=True, style={"description_width": "60px"},
            layout=w.Layout(width="190px"), tooltip=PRICE_HELP)
        self.step_button.on_click(lambda _: self._guarded(self._step))
        self.run_button.on_click(lambda _: self._guarded(self.runner.start, self.steps.value))
        self.stop_button.on_click(lambda _: self._guarded(self._stop))
        self.price.observe(self._on_price, names="value")

    def _make_prompt_controls(self) -> None:
        """A prompt to try on the model as it is now; the reply streams in below it."""
        rows = self.session.train_examples
        self._raw = bool(rows) and isinstance(rows[0], TextRow)  # continued pretraining: text goes on
        self.prompt = w.Text(placeholder=("Start a text for the model to continue" if self._raw else
                                          "Try a prompt on the model as trained so far"),
                             layout=w.Layout(width="480px"), tooltip=TEXT_HELP if self._raw else PROMPT_HELP)
        # the task's input beside its instruction, where its rows have one (the demo's do)
        self.prompt_input = w.Text(placeholder="input", layout=w.Layout(
            width="160px", display="" if _has_inputs(self.session.train_examples) else "none"),
            tooltip="The input of the task's rows (the text the instruction is about)")
        self.prompt_button = w.Button(description="Try it", icon="comment",
                                      layout=w.Layout(width="100px"), tooltip=PROMPT_HELP)
        self.reply = w.HTML()  # the reply, as it is made
        self._prompting = None  # the thread waiting for it
        self.prompt_button.on_click(lambda _: self._guarded(self._try_prompt))

    def _try_prompt(self) -> None:
        prompt = self.prompt.value.strip()
        if not prompt:
            self._say("Type a prompt in the box first.", error=True)
            return
        self.prompt_button.disabled = True
        running = self.session.current_run is not None
        pieces: list[str] = []
        given = self.prompt_input.value.strip() if self.prompt_input.layout.display != "none" else ""
        head = f"<b>{html.escape(prompt)}</b>" + (f" ({html.escape(given)})" if given else "") + "<br>"

        def show(piece: str) -> None:
            pieces.append(piece)
            self.reply.value = _wrapped(head + html.escape("".join(pieces)) + " …", title=PROMPT_HELP)

        def reply() -> tuple:
            return len(self.session.history), self.session.generate(
                prompt, input=given, stream=show, max_new_tokens=PROMPT_TOKENS, raw=self._raw)

        def wait() -> None:
            try:
                step, text = self.runner.between_steps(reply).result()
            except Exception as err:  # noqa: BLE001 - shown in the panel
                self.reply.value = _wrapped(f"⚠ {html.escape(f'{type(err).__name__}: {err}')}",
                                            "#b00")
            else:
                self.reply.value = _wrapped(
                    head + html.escape(text) + f"<br><span style='color:#777'>(the model after "
                    f"step {step}{', between two steps of the run' if running else ''})</span>",
                    title=PROMPT_HELP)
            finally:
                self.prompt_button.disabled = False

        self.reply.value = _wrapped(head + "<span style='color:#777'>" + (
            "waiting for the step under way to end…" if running else "…") + "</span>")
        self._prompting = in_background(wait, "nbtune-try-prompt")

    def _make_fit_controls(self) -> None:
        """The machine to check against, the badge, and the fit and longest-context searches."""
        session = self.session
        budget_help = ("The card and host to check the current toggles against: the estimate of "
                       "the next step's peak on the card, and of what the run holds in host memory "
                       "(offloaded activations, paged or offloaded optimizer state, a checkpoint "
                       "being saved), recomputed as you move a control")
        self.budget = w.Dropdown(options=_budgets(session), tooltip=budget_help,
                                 # JupyterLab shows no hover text on a dropdown: put it on the label
                                 description=f"<span title='{html.escape(budget_help, quote=True)}'>"
                                             "will it fit on</span>", description_allow_html=True,
                                 style={"description_width": "100px"}, layout=w.Layout(width="330px"))
        self.badge = w.HTML()
        self.fit_button = w.Button(description="Find the fastest fit", icon="search",
                                   layout=w.Layout(width="200px"),
                                   tooltip="Search toggle combinations with the estimator for the "
                                           "fastest one predicted to fit this card")
        self.fit_apply = w.Button(description="Apply", icon="check", button_style="success",
                                  layout=w.Layout(display="none"),
                                  tooltip="Apply the combination found")
        self.context_button = w.Button(description="Longest context", icon="arrows-h",
                                       layout=w.Layout(width="160px"),
                                       tooltip="Search seq_len with the estimator for the longest "
                                               "sequence predicted to fit this card (and its host) "
                                               "with the techniques as they are")
        self.context = w.HTML()  # the longest context found, beside the fit buttons
        self.context_apply = w.Button(description="Use it", icon="check", button_style="success",
                                      layout=w.Layout(display="none", width="90px"),
                                      tooltip="Set seq_len to the longest context found")
        self.context_button.on_click(lambda _: self._guarded(self._find_context))
        self.context_apply.on_click(lambda _: self._guarded(self._use_context))
        self.fit_button.on_click(lambda _: self._guarded(self._find_fit))
        self.fit_apply.on_click(lambda _: self._guarded(self._apply_fit))
        self.budget.observe(lambda _: (self._check_fit(), self._context_stale()), names="value")

    def _ipython_display_(self, **kwargs) -> None:
        """The panel, and beside it the page's watcher that disables a panel whose kernel is
        gone (``alive.WATCH_JS``)."""
        display_watched(self, **kwargs)

    def close(self) -> None:
        """Detach from the session (no more events) and end the fit check's worker."""
        self._subscription.close()
        self._fitcheck.close()
        for thread in (self._search, self._context_search, self._prompting):
            if thread is not None:
                thread.join()
        super().close()

    # widget -> session
    def _on_control(self, change) -> None:
        if getattr(self._local, "syncing", False):
            return  # this thread is moving the control to match the session
        name = next(n for n, c in self.controls.items() if c is change["owner"])
        if _snapped(change["owner"], getattr(self.runner.planned, name), change["new"]):
            return  # the browser put the session's value on the slider's grid: nobody moved it
        try:
            self.runner.set({name: change["new"]})
        except Exception as err:  # noqa: BLE001 - every reply is shown here, never lost
            self._sync_from(self.runner.planned)  # snap back: nothing was applied
            self._say(f"⚠ {name}: {err}", error=True)

    def _on_price(self, change) -> None:
        self.session.price_per_hour = change["new"] or None
        self._show_progress()

    def _guarded(self, action, *args) -> None:
        try:
            action(*args)
        except Exception as err:  # noqa: BLE001 - shown in the panel, the session stays usable
            self._say(f"⚠ {type(err).__name__}: {err}", error=True)

    def _step(self) -> None:
        self.step_button.disabled = True
        try:
            self.runner.step()
        finally:
            self.step_button.disabled = False
            self._redraw(force=True)

    def _stop(self) -> None:
        if self.session.stop(wait=False) is not None:
            self.stop_button.disabled = True
            self._say("stopping after the step under way…")

    # session -> widget (events of a background run arrive from its thread)
    def _on_event(self, event) -> None:
        if isinstance(event, (TechniquesChanged, Refused, PendingChanged)):
            self._check_fit()
            self._context_stale()
        if isinstance(event, (TechniquesChanged, Refused)):
            self._sync_from(self.runner.planned)
            if isinstance(event, TechniquesChanged):  # a pending event follows, if anything is left
                new = event.techniques
                changed = sorted(new.changed(self._applied))
                self._applied = new
                self._say("applied: " + _labels([{k: getattr(new, k) for k in changed}])
                          if changed else "applied")
        elif isinstance(event, PendingChanged) and event.pending:
            self._sync_from(event.planned)
            self._say(f"pending until the next step: {_labels(list(event.pending))}")
        elif isinstance(event, Message):
            self._say(event.text, error="not applied" in event.text or "stopped at step" in event.text,
                      more=True)
        elif isinstance(event, RunStarted):
            self._run_seen = event.run
            self._running(True)
        elif isinstance(event, StepDone):
            self._redraw()
            self._show_progress()
        elif isinstance(event, RunFinished):
            self._redraw(force=True)  # throttling may have skipped the last step's drawing
            self._running(False, final=self._last_run())
            run = self._last_run()
            if run is None or event.run is not run:
                return  # a synchronous run: its numbers are in the progress line already
            self._run_seen = None
            if run.stopped:
                self._say(f"stopped at {step_count(len(run.reports), run.steps, run.before)}; the "
                          "session keeps every step up to it (Run goes on from there).")

    # will it fit?
    def _check_fit(self) -> None:
        self.badge.value = "<span style='color:#777'>estimating…</span>"
        self._fitcheck.request(self.runner.planned, self.budget.value)

    def _show_badge(self, techniques, budget, badge, seconds, error) -> None:
        if techniques != self.runner.planned or budget != self.budget.value:
            # an answer to an older question; where the newest is answered already (a question
            # asked again while its answer was on the way), show that one now, not "estimating…"
            if self._fitcheck.cached(self.runner.planned, self.budget.value):
                self._fitcheck.request(self.runner.planned, self.budget.value)
            return
        self.last_fit_seconds = seconds
        if badge is None:
            self.badge.value = f"<span style='color:#b00'>⚠ no estimate: {error}</span>"
            return
        color, mark = ("#1a7f37", "✔") if badge.fits else ("#b00", "✘")
        self.badge.value = (f"<span title='{html.escape(BADGE_HELP, quote=True)}'>"
                            f"<b style='color:{color}'>{mark} {badge.text}</b> "
                            f"<span style='color:#777'>(estimated next step)</span></span>")

    def _find_fit(self) -> None:
        self.fit_button.disabled = True
        self._say(f"searching toggle combinations for {self.budget.label}…")

        def search() -> None:
            try:
                result = self.session.fit(self.budget.value)
            except Exception as err:  # noqa: BLE001 - shown in the panel
                self._say(f"⚠ {type(err).__name__}: {err}", error=True)
                return
            finally:
                self.fit_button.disabled = False
            # FSDP2's settings live in the run file: Apply alone would not give the answer
            whole = result.fits and result.changes and not result.sharding_changes
            self._fit_changes = result.changes if whole else None
            self.fit_apply.layout.display = "" if whole else "none"
            message = result.message.replace(APPLY_IN_CODE, "Apply uses it." if whole else APPLY_IN_CODE)
            self._say(message, error=not result.fits)

        self._search = in_background(search, "nbtune-fit")

    def _find_context(self) -> None:
        self.context_button.disabled = True
        self.context_apply.layout.display = "none"
        techniques, budget = self.runner.planned, self.budget.value
        self._context_asked, self.last_context = (techniques, budget), None
        self.context.value = "<span style='color:#777'>estimating…</span>"

        def progress(tokens: int) -> None:
            self.context.value = f"<span style='color:#777'>estimating {tokens:,} tokens…</span>"

        def search() -> None:
            try:
                result = self.session.longest_context(budget, progress=progress)
            except Exception as err:  # noqa: BLE001 - shown in the panel
                self.context.value = f"<span style='color:#b00'>⚠ {html.escape(str(err))}</span>"
                return
            finally:
                self.context_button.disabled = False
            self.last_context = result
            self._show_context()

        self._context_search = in_background(search, "nbtune-longest-context")

    def _context_is_stale(self) -> bool:
        """The answer shown was for other settings than the planned ones (seq_len aside: it
        is what the search varies) or another card."""
        techniques, budget = self._context_asked
        return (techniques is None or budget != self.budget.value
                or bool(self.runner.planned.changed(techniques) - {"seq_len"}))

    def _show_context(self) -> None:
        """The longest context found, with Use it; greyed, without it, once stale."""
        result = self.last_context
        if result is None:
            return
        stale = self._context_is_stale()
        usable = bool(result.tokens) and not stale and result.tokens != self.runner.planned.seq_len
        self.context_apply.layout.display = "" if usable else "none"
        estimates = f"{result.estimates} estimate{'s' if result.estimates != 1 else ''}"
        what = (f"<s>{html.escape(result.text)}</s> <span style='color:#777'>(for the settings "
                f"before your last change: search again)</span>" if stale else
                f"<b>{html.escape(result.text)}</b> <span style='color:#777'>({estimates})</span>")
        self.context.value = f"<span title='{html.escape(CONTEXT_HELP, quote=True)}'>{what}</span>"

    def _context_stale(self) -> None:
        if self.last_context is not None and self._context_search is not None \
                and not self._context_search.is_alive():
            self._show_context()

    def _use_context(self) -> None:
        if self.last_context is not None and not self._context_is_stale():
            self.runner.set({"seq_len": self.last_context.tokens})
        self.context_apply.layout.display = "none"

    def _apply_fit(self) -> None:
        if self._fit_changes:
            self.runner.set(self._fit_changes)
        self.fit_apply.layout.display = "none"
        self._fit_changes = None

    def _running(self, running: bool, final=None) -> None:
        self.step_button.disabled = self.run_button.disabled = running
        self.stop_button.disabled = False
        self.stop_button.layout.display = "" if running else "none"
        if final is not None:
            self._show_progress(final=True)

    def _show_progress(self, final: bool = False) -> None:
        run = self.session.current_run or (self._last_run() if final else None)
        if run is None:
            return
        end = run.finished or time.monotonic()
        line = run_status(run.reports, run.steps, end - run.started, self.session.price_per_hour,
                          finished=run.finished is not None, before=run.before,
                          busy=_busy(self.session, run))
        if run.finished is not None:
            line = ("stopped · " if run.stopped else "failed · " if run.error else "done · ") + line
        self.progress.value = _wrapped(html.escape(line), title=STATUS_HELP)

    def _last_run(self):
        return getattr(self, "_run_seen", None)  # the run that just ended

    def _sync_from(self, techniques) -> None:
        """Show ``techniques``: values, the summary line, each dropdown's choice in words,
        toggles that look on or off, LoRA fields only for LoRA methods, and each control a
        rule would refuse (or that would change nothing here) disabled with the reason."""
        self._local.syncing = True
        try:
            for name, control in self.controls.items():
                value = getattr(techniques, name)
                control.value = _widget_value(name, value, control)
                reason = _blocked_reason(techniques, name, self.session.device.type,
                                         sharded=self.session.parallel is not None)
                control.disabled = reason is not None
                help_text = HELP[name]
                if name in CHOICE_HELP:
                    chosen = CHOICE_HELP[name][value]
                    help_text = f"{help_text} Now: {value}: {chosen}"
                    self.choice_help[name].value = _wrapped(html.escape(f"{value}: {chosen}"),
                                                            "#555", "90%")
                control.tooltip = f"Not available: {reason}" if reason else help_text
                if getattr(control, "description_allow_html", False):
                    # JupyterLab shows no hover text on a dropdown or list: put it on the label
                    control.description = (f"<span title='{html.escape(control.tooltip, quote=True)}'>"
                                           f"{self._labels[name]}</span>")
                if isinstance(control, w.ToggleButton):
                    _look(control, value, disabled=reason is not None)
                if name in LORA_FIELDS:
                    control.layout.display = "none" if techniques.method == "full" else None
                if name in PREFERENCE_FIELDS:
                    # the reference shows under sft too: it is chosen before switching to dpo
                    # or ipo (after sft steps "precomputed" or a "copy" is the model they start from)
                    used = {"gamma": techniques.objective == "simpo",
                            "reference": techniques.objective in ("sft", "dpo", "ipo")
                            and self.session.data.pairs,
                            "beta": techniques.paired, "split_pairs": techniques.paired,
                            }.get(name, techniques.objective == "grpo")
                    control.layout.display = None if used else "none"
                    if name in self.choice_help:  # its line of help goes with it
                        self.choice_help[name].layout.display = control.layout.display
            self.summary.value = _wrapped(f"<b>now:</b> {html.escape(techniques.summary())}", size="105%")
        finally:
            self._local.syncing = False

    def _redraw(self, force: bool = False) -> None:
        if not self._pacer.due(force):
            return
        started = time.perf_counter()
        history = self.session.history
        self.chart.value = figure_png(draw_memory(self._figure, history, self.session.ranks_memory))
        self._pacer.drew(started)
        if history and self.session.current_run is None:  # a step on its own: its numbers
            last = history[-1]
            watched = objective_words(last)
            self.progress.value = (f"step {last.step}: loss {last.loss:.3f}{', ' * bool(watched)}{watched}, peak "
                                   f"{format_bytes(last.memory.peak)}, "
                                   f"{last.tokens_per_second:,.0f} tokens/s")

    def _say(self, text: str, error: bool = False, more: bool = False) -> None:
        """Show a reply in the status line; ``more``: below the reply before (what the
        session said about it: a reset optimizer, a skipped row), the last three kept."""
        line = f"<div style='color:{'#b00' if error else '#333'}'>{html.escape(text)}</div>"
        self._lines = (self._lines[-2:] if more else []) + [line]
        self.status.value = _wrapped("".join(self._lines))


def _look(toggle: w.ToggleButton, on: bool, disabled: bool = False) -> None:
    """On and off look different: a check and a filled style only when on; a toggle that
    cannot move here is struck through, so it does not read as merely off."""
    toggle.icon = "check" if on else ""
    toggle.button_style = "info" if on else ""
    toggle.style.text_decoration = "line-through" if disabled else "none"
    toggle.style.font_style = "italic" if disabled else "normal"


def _budgets(session) -> list[tuple[str, object]]:
    """The budget choices: the attached GPU and this host (when there is a GPU), then the
    usual cards with the host memory they usually come with."""
    import torch

    from .. import host

    out = []
    if session.device.type == "cuda":
        total, ram = torch.cuda.get_device_properties(session.device).total_memory, host.total()
        out.append((f"this GPU ({format_bytes(total)}) + this host ({format_bytes(ram or 0)})",
                    (total, ram)))
    out += [(f"{name} + {HOST_RAM[name] // 2**30} GiB RAM", name) for name in CARDS]
    # several 24 GB cards under FSDP2 (one process each, sharing the host): the peak per card;
    # a session on N ranks asks about N of them first
    world = session.parallel.world if session.parallel is not None else 1
    several = [(f"{n}x {name} + {32 * n} GiB RAM (FSDP2)", f"{n}x {name} + {32 * n}GiB")
               for n in dict.fromkeys((max(world, 2), 2)) for name in ("RTX 3090", "RTX 4090")]
    return several + out if world > 1 else out + several


def _labels(changes: list[dict]) -> str:
    from ..techniques import label_of

    return "; ".join(label_of(c) for c in changes)
