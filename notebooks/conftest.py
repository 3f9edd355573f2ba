"""nbval runs every notebook here but the quickstart: tests/test_notebooks.py executes that one
and checks its check cell's text as nbval would, plus what only its outputs show (the panel
widget, one live chart however many steps); running it twice would cost a minute of CI.
Notebook 07 is the same where the browser test runs it (``_run_in_the_browser``)."""

BROWSER_07 = "tests/ui/test_browser.py::test_notebook_07_runs_in_jupyterlab_and_its_panel_stops_two_processes"


def pytest_ignore_collect(collection_path, config):
    return True if collection_path.name == "01_quickstart.ipynb" else None


def pytest_collection_modifyitems(config, items):
    """Every notebook cell is slow: the fast tier (``-m "not slow"``) leaves the notebooks out."""
    import pytest

    for item in items:
        if str(item.fspath).endswith(".ipynb"):
            item.add_marker(pytest.mark.slow)
    _run_in_the_browser(config, items)


def _run_in_the_browser(config, items):
    """Leave notebook 07's cells to the browser test where it runs in this session: it runs
    every cell in JupyterLab and checks the check cell's text as nbval would (2 min 20 s of
    CI twice otherwise). Where that test is not collected (no playwright) or its own skipif
    holds (no Chromium), nbval runs the notebook."""
    browser = [item for item in items if item.nodeid == BROWSER_07]
    if not browser or any(mark.args and mark.args[0] for mark in browser[0].iter_markers("skipif")):
        return
    left = [item for item in items if item.fspath.basename == "07_scale_out.ipynb"]
    if left:
        config.hook.pytest_deselected(items=left)
        items[:] = [item for item in items if item.fspath.basename != "07_scale_out.ipynb"]
