"""The quickstart notebook, executed as Jupyter would, reaches the outcomes it promises.

What only the executed outputs show (a widget, one live chart however many steps) is checked
here; the other notebooks check their outcomes in their own NBVAL_CHECK_OUTPUT cells.
"""

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"


def code_cells(nb):
    return [c for c in nb.cells if c.cell_type == "code"]


def images(cell):
    return [o for o in cell.outputs if "image/png" in o.get("data", {})]


@pytest.mark.slow
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
                    "checkpointing cut activations by half: True\n"
                    "memory charted on every step: True\n")


def test_committed_notebooks_are_what_build_writes_with_outputs_under_a_megabyte():
    # The tutorial text lives in notebooks/build.py; a notebook edited by hand (or not rebuilt
    # after an edit) would drift from it, and GitHub readers see the committed outputs.
    import importlib.util

    spec = importlib.util.spec_from_file_location("build", NOTEBOOKS / "build.py")
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    assert sorted(name for name, _, _ in build.COURSE) == sorted(p.name for p in NOTEBOOKS.glob("0*.ipynb"))
    for name, cells, check in build.COURSE:
        committed = nbformat.read(NOTEBOOKS / name, as_version=4)
        assert [c.source for c in committed.cells] == [src for _, src in cells], name
        assert "**Needs:**" in committed.cells[0].source, f"{name} does not say what it needs"
        ran = code_cells(committed)
        assert all(c.execution_count for c in ran), f"{name} is committed without its outputs"
        assert not [o for c in ran for o in c.outputs
                    if o.output_type == "error" or o.get("name") == "stderr"], name
        assert (NOTEBOOKS / name).stat().st_size < 2**20, name
        checks = [c for c in ran if c.source.startswith("# NBVAL_CHECK_OUTPUT")]
        assert len(checks) == 1 and "".join(o.get("text", "") for o in checks[0].outputs) == check, name
        for cell in ran:  # where widgets do not render, their text is their final state
            for output in cell.outputs:
                text = output.get("data", {}).get("text/plain", "")
                if "application/vnd.jupyter.widget-view+json" in output.get("data", {}):
                    assert " 0%|" not in text and "children=" not in text, (name, text)
