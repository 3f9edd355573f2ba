"""The quickstart notebook, executed as Jupyter would, reaches the outcomes it promises.

What only the executed outputs show (a widget, one live chart however many steps) is checked
here; the other notebooks check their outcomes in their own NBVAL_CHECK_OUTPUT cells.
"""

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
