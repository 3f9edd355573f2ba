"""nbval runs every notebook here but the quickstart: tests/test_notebooks.py executes that one
and checks its check cell's text as nbval would, plus what only its outputs show (the panel
widget, one live chart however many steps); running it twice would cost a minute of CI."""


def pytest_ignore_collect(collection_path, config):
    return True if collection_path.name == "01_quickstart.ipynb" else None


def pytest_collection_modifyitems(config, items):
    """Every notebook cell is slow: the fast tier (``-m "not slow"``) leaves the notebooks out."""
    import pytest

    for item in items:
        if str(item.fspath).endswith(".ipynb"):
            item.add_marker(pytest.mark.slow)
