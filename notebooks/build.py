"""Write the tutorial notebooks from the cell lists below (outputs stripped).

Kept as code so the tutorial text is reviewed like code; run it after editing:
    python notebooks/build.py
"""

from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

NOTEBOOKS = Path(__file__).resolve().parent

QUICKSTART = [
    ("md", """# nbtune quickstart: train a model and watch its memory

This notebook finetunes nbtune's embedded default, a 0.8M-parameter Llama-shaped model,
on a small instruction dataset that ships with nbtune. It runs on a laptop CPU in about a
minute, and the same cells run on a GPU with a real model (`nt.Session.from_pretrained`).

You will: load the model, ask it a question, open the control panel, train, see where the
memory went, flip a memory technique, and ask again."""),
    ("md", "A `Session` holds the model, the data, every training toggle (`session.techniques`) "
           "and the history of steps. `Session.demo()` builds the embedded default the first "
           "time (in your cache folder) and loads it like any Hugging Face checkpoint."),
    ("code", """import nbtune as nt

session = nt.Session.demo()
session"""),
    ("md", "Before training the model knows nothing: its answers are noise, and its accuracy on "
           "held-out questions (inputs it will never train on) is zero."),
    ("code", """accuracy_before = session.evaluate()
print(f"held-out accuracy before training: {accuracy_before:.0%}")
session.generate("Which vowel is in the word?", input="bcud")"""),
    ("md", """The panel binds every control to `session.techniques` both ways: move a slider
and the session changes; call `session.set(...)` and the slider moves. **Step** and **Run**
train from the panel, and its chart redraws after the steps. Hover over a control to see
what it trades."""),
    ("code", """# NBVAL_IGNORE_OUTPUT
session.panel()"""),
    ("md", """Training from code works the same way. `run(n)` shows a progress bar, and in a
notebook the memory chart below it is updated in place after the steps: left, where the
latest step's memory went; right, the peak of every step and the loss falling."""),
    ("code", """# NBVAL_IGNORE_OUTPUT
reports = session.run(200)"""),
    ("md", """Each step returns a `StepReport`. Its `memory` is a breakdown in bytes: each
category at its high point during the step, and `peak`, the most held at one moment
(less than the sum, because gradients are created while activations are freed)."""),
    ("code", """last = session.history[-1]
for name, nbytes in last.memory.categories.items():
    print(f"{name:>16}: {nbytes / 2**20:6.2f} MiB")
print(f"{'peak':>16}: {last.memory.peak / 2**20:6.2f} MiB   (loss {last.loss:.3f})")"""),
    ("md", """Activations dominate here: the model is tiny but every token of every sequence
keeps its intermediate results for the backward pass. **Activation checkpointing** keeps
only each layer's input and recomputes the rest during backward: less memory, a little
more compute, exactly the same maths. Flip it and run a few steps:"""),
    ("code", """activations_before = session.history[-1].memory.activations
session.set(activation_checkpointing=True)
session.run(10, progress=False, live=False)
activations_after = session.history[-1].memory.activations
print(f"activations: {activations_before / 2**20:.1f} MiB -> {activations_after / 2**20:.1f} MiB")
session.chart()"""),
    ("md", "After training, ask again. The model has learned to answer the easier tasks "
           "(is a number even or odd, which vowel hides in a word) on inputs it never saw."),
    ("code", """accuracy_after = session.evaluate()
print(f"held-out accuracy after training: {accuracy_after:.0%}")
session.generate("Which vowel is in the word?", input="bcud")"""),
    ("md", "Finally the outcomes this notebook promises, checked (the tests run this notebook "
           "and compare this cell's output):"),
    ("code", """# NBVAL_CHECK_OUTPUT
losses = [r.loss for r in session.history]
print("loss fell by half:", sum(losses[-10:]) / 10 < losses[0] / 2)
print("accuracy rose:", accuracy_after > accuracy_before)
print("checkpointing cut activations by half:", activations_after <= activations_before / 2)"""),
]

QUICKSTART_CHECK = ("loss fell by half: True\naccuracy rose: True\n"
                    "checkpointing cut activations by half: True\n")

MEMORY = [
    ("md", """# Where the memory goes: before, across configurations, in detail

Three tools answer the questions a finetuning run starts with:

* **`nt.estimate`** predicts a step's memory *before* anything is loaded: it runs the real
  training step on fake tensors (shapes, no storage), so an 8B model costs seconds and no memory.
* **`session.compare`** runs a ladder of configurations, a few steps each, and tabulates
  peak memory, the change from the row before, speed and the estimate.
* **`session.snapshot`** (CUDA) records every allocation of a step for pytorch.org/memory_viz."""),
    ("md", "Does Llama-3.1-8B fit on a 24 GB card with QLoRA at sequence length 2048, batch 2? "
           "The presets describe popular models offline; a Hub repo id or a `config.json` works too."),
    ("code", """import nbtune as nt

qlora_8b = nt.Techniques(method="qlora", dtype="bf16", activation_checkpointing=True,
                         chunked_loss=8, batch_size=2, seq_len=2048)
guess = nt.estimate("llama-3.1-8b", qlora_8b, device="cuda")
for name, nbytes in guess.categories.items():
    print(f"{name:>16}: {nbytes / 2**30:5.2f} GiB")
print(f"{'peak':>16}: {guess.peak / 2**30:5.2f} GiB, in the {guess.peak_phase} pass")"""),
    ("md", "The estimate counts what tensors hold. On a real card add the CUDA context and the "
           "allocator's cache (typically a few hundred MiB to a GiB or two), so leave headroom. "
           "Full finetuning of the same model is another story:"),
    ("code", """full_8b = qlora_8b.replace(method="full", optimizer="adamw8bit")
print(f"full finetune, 8-bit AdamW: {nt.estimate('llama-3.1-8b', full_8b, device='cuda').peak / 2**30:.1f} GiB")"""),
    ("md", "On the embedded default the estimate can be checked against a measured step. "
           "`session.estimate()` predicts the session's next step for full-length rows; "
           "given the batch's actual shape it should match the measurement."),
    ("code", """session = nt.Session.demo()
session.step()  # the first step creates the optimizer state
report = session.step()
predicted = session.estimate(batch_size=report.shape[0], seq_len=report.shape[1])
print(f"measured {report.memory.peak / 2**20:.1f} MiB, estimated {predicted.peak / 2**20:.1f} MiB")"""),
    ("md", """The ladder: each row's changes apply on top of the row before, as in torchtune's
"optimization flags" table. The rows run on a throw-away copy of the model, so the session
is not trained by it. The bars split each peak into what held memory at that moment; the
black tick is the estimate."""),
    ("code", """# NBVAL_IGNORE_OUTPUT
ladder = session.compare([{}, {"activation_checkpointing": True}, {"dtype": "bf16"},
                          {"method": "lora"}, {"method": "qlora"}])
ladder"""),
    ("md", "Every step's breakdown over a run: the bars are each category's high point in the "
           "step, the line the most held at one moment. On CPU the tracker measures the first "
           "step after a change and then as many as fit 2 % of the training time (marked "
           "dots); other steps repeat the last measurement."),
    ("code", """# NBVAL_IGNORE_OUTPUT
session.run(30, progress=False, live=False)
session.chart("steps")"""),
    ("md", "On a GPU, `session.snapshot(\"step.pickle\")` records the allocator's history over "
           "the next step; drag the file onto https://pytorch.org/memory_viz. Here it says why not:"),
    ("code", """try:
    session.snapshot("step.pickle")
except RuntimeError as err:
    print(str(err)[:90], "...")"""),
    ("md", """## Out of memory, without a restart

On a GPU a step that asks for more than the card holds raises an out-of-memory error. nbtune
rolls that step back (weights, optimizer state, data position and random state are exactly
as before it, and its activations are freed), then says in which phase memory ran out, what
held it, and which toggles the estimator predicts would fit. On this CPU really running out
would get the kernel killed by the operating system, so `nt.SimulatedCard` pretends the card
holds only 40 MiB of activations: an unchecked step of the demo saves about 77 MiB."""),
    ("code", """import torch

session = nt.Session.demo()
session.step()
before = [p.detach().clone() for p in session.model.parameters()]
try:
    with nt.SimulatedCard(40 * 2**20):
        session.step()
except nt.OutOfMemory as err:
    oom = err
    print(err)"""),
    ("md", "Nothing was half-applied, so the same session goes on. `run(n, on_oom=\"adapt\")` "
           "applies the first suggestion, says so, and retries the step:"),
    ("code", """unchanged = all(torch.equal(a, p) for a, p in zip(before, session.model.parameters()))
print("weights unchanged:", unchanged, "| steps so far:", len(session.history))
with nt.SimulatedCard(40 * 2**20):
    adapted = session.run(5, on_oom="adapt", progress=False, live=False)
print("now:", {k: getattr(session.techniques, k) for k in oom.suggestions[0].changes})"""),
    ("md", "The outcomes this notebook promises, checked:"),
    ("code", """# NBVAL_CHECK_OUTPUT
print("8B QLoRA fits in 24 GB:", guess.peak < 24 * 2**30)
print("estimate within 2% of the measured step:", abs(predicted.peak - report.memory.peak) <= 0.02 * report.memory.peak)
print("ladder rows:", len(ladder))
print("checkpointing lowered the peak:", ladder[1].peak < ladder[0].peak)
print("out of memory explained, nothing changed:", oom.phase is not None and unchanged)
print("adapted and trained on:", len(adapted) == 5 and len(session.history) == 6)"""),
]

MEMORY_CHECK = ("8B QLoRA fits in 24 GB: True\nestimate within 2% of the measured step: True\n"
                "ladder rows: 5\ncheckpointing lowered the peak: True\n"
                "out of memory explained, nothing changed: True\nadapted and trained on: True\n")


def build(cells, check_output: str) -> nbformat.NotebookNode:
    nb = new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    for kind, source in cells:
        if kind == "md":
            nb.cells.append(new_markdown_cell(source))
            continue
        cell = new_code_cell(source)
        if source.startswith("# NBVAL_CHECK_OUTPUT"):
            # nbval --nbval-lax compares this cell's output with the one stored here.
            cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text=check_output)]
            cell.execution_count = 1
        nb.cells.append(cell)
    return nb


if __name__ == "__main__":
    NOTEBOOKS.mkdir(exist_ok=True)
    for name, cells, check in [("01_quickstart.ipynb", QUICKSTART, QUICKSTART_CHECK),
                               ("02_memory.ipynb", MEMORY, MEMORY_CHECK)]:
        nbformat.write(build(cells, check), NOTEBOOKS / name)
        print(f"wrote {NOTEBOOKS / name}")
