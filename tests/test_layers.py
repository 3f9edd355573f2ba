"""The shape of the package: layers that import downwards only, no class's private members
touched from outside it, a front end of bounded size, and the runner's event seams."""

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import nbtune as nt
from nbtune.run.runner import Message, StepDone, TechniquesChanged

from helpers import small_session

PACKAGE = Path(nt.__file__).parent

# Each module's layer, lowest first; a module may import its own layer or lower ones only.
# Unlisted modules under a listed package take the package's layer.
LAYERS = [
    # 0. basics: words, sizes, the model and its files, data, memory accounting, techniques
    ["units", "files", "template", "techniques", "host", "hardware", "overhead", "atomic", "hub", "scoring",
     "generate", "models", "data", "memory.accounting", "memory.breakdown", "memory.tracker",
     "memory.sampling", "memory.snapshot", "memory.usage", "memory", "peft", "peft_experts", "adapters", "optim", "activations", "plan",
     "step", "loss", "objectives", "undo", "datasets", "quiet", "interrupts", "trackers", "benchmark"],
    # 1. the model across ranks, and the state's forms on disk and across ranks (a frozen copy of it too)
    ["distributed", "liveness", "shards", "state", "checkpoint", "sharded_checkpoint", "objectives.reference"],
    # 2. prediction (one package), and the out-of-memory explanation built on it
    ["predict", "oom"],
    # 3. the training state
    ["run.trainer"],
    # 4. run control and what drives it (and the charts a ladder draws)
    ["run", "runfile", "demos", "charts"],
    # 5. front ends
    ["session", "ui", "cli", "__main__", ""],
]


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _imports(name: str, path: Path, modules: dict) -> set[str]:
    """nbtune modules ``name`` imports, at the top or inside functions."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".") if package else []
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            elif node.module and node.module.startswith("nbtune"):
                target = node.module.removeprefix("nbtune").lstrip(".")
            else:
                continue
            subs = [f"{target}.{a.name}".lstrip(".") for a in node.names
                    if f"{target}.{a.name}".lstrip(".") in modules]
            found.update(subs or ([target] if target in modules else []))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("nbtune"):
                    found.add(alias.name.removeprefix("nbtune").lstrip("."))
    found.discard(name)
    return found


def _layer(name: str) -> int:
    best, level = -1, None
    for i, layer in enumerate(LAYERS):
        for entry in layer:
            if (name == entry or (entry and name.startswith(entry + "."))) and len(entry) > best:
                best, level = len(entry), i
    assert level is not None, f"nbtune.{name} has no layer in LAYERS: place it"
    return level


def test_imports_go_down_the_layers_and_never_in_a_circle():
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    upward = [f"{a} (layer {_layer(a)}) imports {b} (layer {_layer(b)})"
              for a, targets in graph.items() for b in targets
              if a and b and _layer(b) > _layer(a)]
    assert not upward, upward
    # a circle: depth-first search for a module reached again while still on the path
    state, circles = {}, []

    def visit(node, path):
        state[node] = "open"
        for nxt in graph.get(node, ()):
            if state.get(nxt) == "open":
                circles.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = "done"

    for name in graph:
        if name and name not in state:
            visit(name, [name])
    assert not [c for c in circles if "" not in c], circles


def _folder(name: str) -> str:
    return name.split(".")[0]


def test_no_circle_between_folders():
    """Folded to their top level (``predict.search`` -> ``predict``), modules still import in
    one direction: no folder imports a module that imports the folder back."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        if name:
            graph.setdefault(_folder(name), set()).update(
                _folder(b) for b in _imports(name, path, modules) if b and _folder(b) != _folder(name))
    seen, circles = {}, []

    def visit(node, path):
        seen[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if seen.get(nxt) == "open":
                circles.append(path[path.index(nxt):] + [nxt])
            elif nxt not in seen:
                visit(nxt, path + [nxt])
        seen[node] = "done"

    for name in sorted(graph):
        if name not in seen:
            visit(name, [name])
    assert not circles, circles


def test_the_cli_builds_its_run_with_the_factory_not_the_notebook_front_end():
    """``nbtune train`` and ``nbtune demo`` build through ``run.factory`` (as ``Session`` does) and
    never import the notebook's front end."""
    modules = _modules()
    for name in ("cli.train", "cli.main"):
        found = _imports(name, modules[name], modules)
        assert "run.factory" in found and "session" not in found, (name, sorted(found))
    assert "run.factory" in _imports("session", modules["session"], modules)


def test_memory_only_measures_and_prediction_lives_in_one_package():
    modules = _modules()
    for name, path in modules.items():
        if name.startswith("memory"):
            assert not any(_folder(b) in ("predict", "step", "run", "checkpoint", "undo")
                           for b in _imports(name, path, modules)), name
    assert not [name for name in modules if name in ("fitting", "longest", "memory.estimate")]


def test_the_layer_check_sees_an_upward_import(tmp_path):
    """The check itself: a trainer that imported the session would be caught."""
    assert _layer("run.trainer") < _layer("session")
    fake = tmp_path / "trainer.py"
    fake.write_text("from ..session import Session\n")
    assert "session" in _imports("run.trainer", fake, _modules())


def _private_names_by_class(tree) -> dict[str, set[str]]:
    """class name -> private attributes it defines (self._x assigned, methods named _x)."""
    out = {}
    for cls in [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]:
        names = {item.name for item in cls.body
                 if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef))
                 and item.name.startswith("_") and not item.name.startswith("__")}
        for node in ast.walk(cls):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id == "self" and isinstance(node.ctx, ast.Store)
                    and node.attr.startswith("_") and not node.attr.startswith("__")):
                names.add(node.attr)
        out[cls.name] = names
    return out


def _outside_access(trees: dict) -> list[str]:
    owned: dict[str, set[str]] = {}  # private name -> classes that define it
    for tree in trees.values():
        for cls, names in _private_names_by_class(tree).items():
            for name in names:
                owned.setdefault(name, set()).add(cls)
    found = []
    for path, tree in trees.items():
        def walk(node, classes):
            if isinstance(node, ast.ClassDef):
                classes = classes + [node.name]
            if (isinstance(node, ast.Attribute) and node.attr in owned
                    and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
                    and not owned[node.attr] & set(classes)):
                found.append(f"{path}:{node.lineno}: {ast.unparse(node)} "
                             f"(private to {', '.join(sorted(owned[node.attr]))})")
            for child in ast.iter_child_nodes(node):
                walk(child, classes)
        walk(tree, [])
    return found


def test_no_class_has_its_private_members_touched_from_outside():
    trees = {str(p.relative_to(PACKAGE.parent)): ast.parse(p.read_text())
             for p in PACKAGE.rglob("*.py")}
    assert _outside_access(trees) == []


def test_the_private_member_check_catches_a_reach_in():
    code = textwrap.dedent("""
        class Session:
            def __init__(self):
                self._lock = None
        class BackgroundRun:
            def run(self, session):
                return session._lock
    """)
    assert len(_outside_access({"x.py": ast.parse(code)})) == 1


def _docstring_lines(tree: ast.AST) -> set[int]:
    """The lines docstrings take: the size bounds count code, and the API reference's
    parameter sections are documentation (tests/test_docs.py asks for them)."""
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                lines.update(range(first.lineno, first.end_lineno + 1))
    return lines


def _code_lines(node: ast.AST, docs: set[int]) -> int:
    return len(set(range(node.lineno, node.end_lineno + 1)) - docs)


def test_the_session_class_is_a_front_end_of_under_500_lines():
    tree = ast.parse((PACKAGE / "session.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Session")
    assert _code_lines(cls, _docstring_lines(tree)) < 500


def test_no_file_over_700_lines_and_no_function_over_80():
    """Issue 33's bound on size, docstrings aside: a file of the package reads in one
    sitting, a function on one screen and a half."""
    long_files, long_functions = [], []
    for path in PACKAGE.rglob("*.py"):
        text = path.read_text()
        tree = ast.parse(text)
        docs = _docstring_lines(tree)
        if text.count("\n") - len(docs) > 700:
            long_files.append(str(path.relative_to(PACKAGE)))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if _code_lines(node, docs) > 80:
                    long_functions.append(f"{path.relative_to(PACKAGE)}:{node.name}")
    assert long_files == [] and long_functions == []


def test_the_size_bounds_count_code_not_docstrings():
    tree = ast.parse('def f():\n    """Doc\n\n    more.\n    """\n    return 1\n')
    assert _code_lines(tree.body[0], _docstring_lines(tree)) == 2


# ---- the runner's events ---------------------------------------------------------------------

def test_a_subscriber_hears_each_event_once_in_order_and_nothing_after_closing():
    session = small_session()
    heard = []
    subscription = session.subscribe(heard.append)
    session.set(lr=5e-4)
    session.step()
    session.step()
    assert [type(e) for e in heard] == [TechniquesChanged, StepDone, StepDone]
    assert heard[0].techniques.lr == 5e-4
    assert [e.report.step for e in heard[1:]] == [1, 2]
    subscription.close()
    session.step()
    session.set(lr=1e-3)
    assert len(heard) == 3


def test_messages_print_in_the_command_that_said_them_and_only_there(capsys):
    session = small_session()
    session.step()  # optimizer state exists: a method change resets it, and says so
    heard = []
    session.subscribe(lambda e: heard.append(e.text) if isinstance(e, Message) else None)
    session.set(optimizer="sgd")
    printed = capsys.readouterr().out
    assert "nbtune: optimizer state reset" in printed and printed.count("nbtune:") == 1
    assert heard and heard[0].startswith("optimizer state reset")
    session.runner.set({"optimizer": "adamw"})  # what a widget callback calls (SGD kept no state)
    session.runner.step()  # AdamW state again: the next change resets it
    capsys.readouterr()
    session.runner.set({"optimizer": "sgd"})  # says so, and never prints
    assert capsys.readouterr().out == "" and len(heard) == 2


def test_a_panel_callback_prints_nothing_and_shows_the_message(capsys):
    session = small_session()
    session.step()
    panel = session.panel()
    try:
        capsys.readouterr()
        panel.controls["optimizer"].value = "sgd"  # as a click does: the widget's observer runs
        assert session.techniques.optimizer == "sgd"
        assert capsys.readouterr().out == ""
        assert "optimizer state reset" in panel.status.value and "applied" in panel.status.value
    finally:
        panel.close()
    session.set(lr=2e-3)  # a closed panel no longer follows the session
    assert panel.controls["lr"].value != 2e-3


def test_closing_a_panel_ends_its_fit_check_worker():
    session = small_session()
    panel = session.panel()
    assert panel._fitcheck.wait(120)
    panel.close()
    worker = panel._fitcheck._worker
    assert worker is None or not worker.is_alive()
    assert panel._fitcheck._closed


@pytest.mark.slow
def test_a_script_that_made_a_panel_exits_cleanly(tmp_path):
    """Exit while the fit check estimates (a thread inside torch): the exit hook joins it,
    so the interpreter does not abort ("terminate called without an active exception")."""
    script = tmp_path / "panel_exit.py"
    script.write_text(textwrap.dedent("""
        import nbtune as nt
        session = nt.Session.demo("tiny", device="cpu")
        panel = session.panel()
        panel.budget.value = panel.budget.options[-1][1]  # another budget: a fresh estimate
        panel.controls["seq_len"].value = 64  # and another: the worker is busy as we leave
        print("leaving")
    """))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=600, env={**__import__("os").environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert "leaving" in done.stdout and "terminate called" not in done.stderr
