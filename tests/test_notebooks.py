"""The quickstart notebook, executed as Jupyter would, reaches the outcomes it promises."""

from pathlib import Path

import nbformat
from nbclient import NotebookClient

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"


def code_cells(nb):
    return [c for c in nb.cells if c.cell_type == "code"]


def images(cell):
    return [o for o in cell.outputs if "image/png" in o.get("data", {})]


def test_quickstart_outcomes(tmp_path):
    nb = nbformat.read(NOTEBOOKS / "01_quickstart.ipynb", as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    cells = code_cells(nb)
    by_source = {c.source.splitlines()[-1]: c for c in cells}

    panel = next(c for c in cells if "session.panel()" in c.source)
    assert any("application/vnd.jupyter.widget-view+json" in o.get("data", {}) for o in panel.outputs)

    run = by_source["reports = session.run(200)"]
    # nbclient applies display updates: the live chart is one output, however many steps
    assert len(images(run)) == 1

    toggle = next(c for c in cells if "activation_checkpointing=True" in c.source)
    assert len(images(toggle)) == 1  # the chart right after the toggle

    check = cells[-1]
    text = "".join(o.get("text", "") for o in check.outputs)
    assert text == ("loss fell by half: True\naccuracy rose: True\n"
                    "checkpointing cut activations by half: True\n")


def test_memory_notebook_outcomes(tmp_path):
    nb = nbformat.read(NOTEBOOKS / "02_memory.ipynb", as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    cells = code_cells(nb)
    ladder = next(c for c in cells if "session.compare(" in c.source)
    html = "".join(o.get("data", {}).get("text/html", "") for o in ladder.outputs)
    assert "<table>" in html and html.count("<tr>") == 6  # header and five rows
    assert "data:image/png;base64," in html  # the bar chart under the table
    steps = next(c for c in cells if 'session.chart("steps")' in c.source)
    assert len(images(steps)) == 1
    snapshot = next(c for c in cells if "session.snapshot(" in c.source)
    assert "CUDA caching allocator" in "".join(o.get("text", "") for o in snapshot.outputs)
    text = "".join(o.get("text", "") for o in cells[-1].outputs)
    assert text == ("8B QLoRA fits in 24 GB: True\nestimate within 2% of the measured step: True\n"
                    "ladder rows: 5\ncheckpointing lowered the peak: True\n"
                    "out of memory explained, nothing changed: True\nadapted and trained on: True\n")
    oom = next(c for c in cells if "nt.SimulatedCard" in c.source and "except" in c.source)
    explained = "".join(o.get("text", "") for o in oom.outputs)
    assert "Out of memory in the forward phase" in explained and "activation_checkpointing=True" in explained
    adapt = next(c for c in cells if 'on_oom="adapt"' in c.source)
    assert "nbtune: out of memory in the" in "".join(o.get("text", "") for o in adapt.outputs)
