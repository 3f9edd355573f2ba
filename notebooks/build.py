"""Write notebooks/01_quickstart.ipynb from the cell list below (outputs stripped).

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

CHECK_OUTPUT = ("loss fell by half: True\naccuracy rose: True\n"
                "checkpointing cut activations by half: True\n")


def build(cells) -> nbformat.NotebookNode:
    nb = new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    for kind, source in cells:
        if kind == "md":
            nb.cells.append(new_markdown_cell(source))
            continue
        cell = new_code_cell(source)
        if source.startswith("# NBVAL_CHECK_OUTPUT"):
            # nbval --nbval-lax compares this cell's output with the one stored here.
            cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text=CHECK_OUTPUT)]
            cell.execution_count = 1
        nb.cells.append(cell)
    return nb


if __name__ == "__main__":
    NOTEBOOKS.mkdir(exist_ok=True)
    path = NOTEBOOKS / "01_quickstart.ipynb"
    nbformat.write(build(QUICKSTART), path)
    print(f"wrote {path}")
