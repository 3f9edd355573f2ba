"""The front door and the documentation site: README short and pointing into the site, the
site built strictly (no broken link, no missing reference), every guide, notebook and public
name on it, and the architecture page's toggle table true to the code for every toggle."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import nbtune as nt
from nbtune.techniques import Techniques

ROOT = Path(__file__).parents[1]
PACKAGE = ROOT / "nbtune"
DOCS = ROOT / "docs"


def build_site(into: Path) -> Path:
    """``mkdocs build --strict`` of the repository's site into ``into`` (a warning fails it)."""
    if shutil.which("mkdocs", path=str(Path(sys.executable).parent)) is None:
        pytest.fail("mkdocs is not installed: pip install -e '.[test]' (the docs extra comes with it)")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(into)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert done.returncode == 0, done.stdout + done.stderr
    return into


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    return build_site(tmp_path_factory.mktemp("site"))


def test_readme_is_a_front_door_of_at_most_250_lines_whose_links_lead_somewhere():
    readme = (ROOT / "README.md").read_text()
    assert readme.count("\n") <= 250
    commands = readme.split("```bash", 1)[1].split("```", 1)[0]
    assert 'pip install -c .ci/constraints-cpu.txt -e ".[test]"' in commands and "nbtune demo" in commands
    assert "python -m pytest" in commands
    targets = re.findall(r"\]\(((?:docs|benchmarks|notebooks)/[^)#\s]+)", readme)
    assert len(targets) >= 10 and [t for t in targets if not (ROOT / t).exists()] == []
    # every guide of the site is a click away
    guides = {p.name for p in (DOCS / "guides").glob("*.md")}
    linked = {Path(t).name for t in targets if t.startswith("docs/guides/")}
    assert guides - linked <= {"models-and-data.md"}, guides - linked


@pytest.mark.slow  # (14 s building the site: the whole suite runs it, and .ci/run builds it too)
def test_the_site_builds_strictly_with_every_guide_notebook_and_public_name(site):
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_multi_constructor("", lambda loader, suffix, node: None)
    nav = yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=Loader)["nav"]

    def pages(entry):
        if isinstance(entry, str):
            yield entry
        elif isinstance(entry, dict):
            for value in entry.values():
                yield from pages(value)
        else:
            for item in entry:
                yield from pages(item)

    listed = set(pages(nav))
    on_disk = {str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md") if "results" not in p.parts}
    assert on_disk <= listed, on_disk - listed  # no page the navigation leaves out
    notebooks = {f"notebooks/{p.name}" for p in (ROOT / "notebooks").glob("*.ipynb")}
    assert notebooks <= listed and len(notebooks) == 8
    for page in listed:
        stem = page.rsplit(".", 1)[0]
        folder = stem.removesuffix("index") if stem.endswith("index") else stem + "/"
        assert (site / folder / "index.html").exists(), page
    # a notebook page carries its committed chart (an image in its outputs)
    assert "data:image/png;base64" in (site / "notebooks/02_memory/index.html").read_text()
    # the API reference: every public name, and Session's commands with their parameters
    reference = "".join(p.read_text() for p in (site / "reference").rglob("index.html"))
    for name in [*nt.__all__, *RETURNED]:
        assert re.search(rf'id="nbtune\.[\w.]+\.{name}"', reference), name
    session = (site / "reference/session/index.html").read_text()
    assert 'id="nbtune.session.Session.start"' in session and "on_oom" in session
    # the measured results the pages cite are served beside them
    assert (site / "results/cpu-demo/demo_memory.png").exists()
    # every Markdown table rendered as a table (a blank line inside one leaves text "| ... |")
    broken = [str(p.relative_to(site)) for p in site.rglob("index.html")
              if "results" not in p.parts and re.search(r"<p>\s*\|", p.read_text())]
    assert broken == [], broken


# ---- the architecture page's toggle table ------------------------------------------------------

# Names that hold a Techniques, or carry a toggle by its name: a run's StepOptions (options),
# the command line's arguments (args), a layer's or an adapter's flag (layer, module, first).
HOLDERS = {"t", "techniques", "new", "start", "previous", "planned", "Techniques", "options", "args",
           "layer", "module", "first"}
# Toggles whose names torch and the files use for other things: attribute reads only.
GENERIC = {"dtype", "compile", "optimizer", "method", "lr", "seed", "batch_size", "seq_len"}


def toggle_readers() -> dict[str, set[str]]:
    """For every toggle, the package's files that read it by name (the page's rule)."""
    found = {f.name: set() for f in dataclasses.fields(Techniques)}
    strays = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = str(path.relative_to(PACKAGE))
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in found:
                base = node.value
                name = base.attr if isinstance(base, ast.Attribute) else getattr(base, "id", None)
                # self: a toggle's own reads (Techniques, StepOptions), and a layer's or an
                # adapter's flag of a toggle's name, which only toggles have
                if name in HOLDERS or (name == "self" and (rel in ("techniques.py", "step.py")
                                                           or node.attr not in GENERIC)):
                    found[node.attr].add(rel)
                elif node.attr not in GENERIC and name != "self":
                    strays.append(f"{rel}:{node.lineno} {ast.unparse(node)}")
            elif isinstance(node, ast.Constant) and node.value in found and node.value not in GENERIC:
                found[node.value].add(rel)
            elif isinstance(node, ast.keyword) and node.arg in found and node.arg not in GENERIC:
                found[node.arg].add(rel)
    # a toggle read through a name the rule does not know would be missed: name it in HOLDERS
    assert strays == [], strays
    return found


def test_the_architecture_pages_toggle_table_is_what_the_code_reads_for_every_toggle():
    page = (DOCS / "architecture.md").read_text()
    rows = dict(re.findall(r"^\| `(\w+)` \| (.*) \|$", page, flags=re.M))
    table = {name: set(re.findall(r"`([\w/]+\.py)`", files)) for name, files in rows.items()}
    expected = toggle_readers()
    assert set(table) == set(expected)  # every toggle, none that is gone
    wrong = {name: (sorted(table[name] - files), sorted(files - table[name]))
             for name, files in expected.items() if table[name] != files}
    assert wrong == {}, "\n".join(
        f"| `{n}` | {', '.join(f'`{f}`' for f in sorted(expected[n]))} |" for n in wrong)


def test_the_toggle_rule_sees_a_read_it_should_and_refuses_an_unknown_holder(tmp_path, monkeypatch):
    """The rule bites: a new read through a known name is found, one through a name it does
    not know is refused rather than missed."""
    (tmp_path / "a.py").write_text("def f(t):\n    return t.max_grad_norm\n")
    (tmp_path / "b.py").write_text("x = {'warmup_steps': 1}\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", tmp_path)
    found = toggle_readers()
    assert found["max_grad_norm"] == {"a.py"} and found["warmup_steps"] == {"b.py"}
    (tmp_path / "c.py").write_text("def g(cfg):\n    return cfg.tile_tokens\n")
    with pytest.raises(AssertionError, match="cfg.tile_tokens"):
        toggle_readers()


# ---- every public name documents its parameters ------------------------------------------------

def _sections(doc: str | None):
    """A docstring's Google-style sections as griffe (the site's reader) parses them."""
    import logging

    from griffe import Docstring

    logging.getLogger("griffe").setLevel(logging.ERROR)  # no parent: types come from signatures
    return Docstring(doc or "").parse("google") if doc else None


def _named(sections, *kinds: str) -> list[str]:
    return [item.name.lstrip("*") for section in sections if section.kind.value in kinds
            for item in section.value]


def _undocumented(where: str, func, skip_self: bool) -> list[str]:
    import inspect

    doc = inspect.getdoc(func)
    if not doc:
        return [f"{where}: no docstring"]
    sections = _sections(doc)
    signature = inspect.signature(func)
    wanted = [name for name in signature.parameters if not (skip_self and name in ("self", "cls"))]
    problems = []
    if sorted(_named(sections, "parameters")) != sorted(wanted):
        problems.append(f"{where}: parameters {wanted}, documented {_named(sections, 'parameters')}")
    returns = signature.return_annotation
    if returns not in (inspect.Signature.empty, None, "None") and not any(
            s.kind.value in ("returns", "yields") for s in sections):
        problems.append(f"{where}: returns {returns} without a Returns section")
    return problems


# What the public names return, which the reference shows beside them (docs/reference/returned.md).
RETURNED = {"FitBadge": "nbtune.predict.badge", "FitRow": "nbtune.predict.search",
            "LadderRow": "nbtune.run.ladder", "Reply": "nbtune.generate", "Usage": "nbtune.memory.usage",
            "Subscription": "nbtune.run.runner", "Event": "nbtune.run.runner", "StepDone": "nbtune.run.runner",
            "TechniquesChanged": "nbtune.run.runner", "PendingChanged": "nbtune.run.runner",
            "Message": "nbtune.run.runner", "Refused": "nbtune.run.runner", "RunStarted": "nbtune.run.runner",
            "RunFinished": "nbtune.run.runner"}


def _public_objects():
    import importlib

    for name in nt.__all__:
        yield name, getattr(nt, name)
    for name, module in RETURNED.items():
        yield name, getattr(importlib.import_module(module), name)


def public_name_problems() -> list[str]:
    """What the reference would lack: for every name in ``nbtune.__all__`` and what they
    return (``RETURNED``), and each public method and property of their classes, a docstring,
    each parameter in its Args (a class's fields in Args or Attributes), and a Returns section
    where it returns something."""
    import inspect

    problems = []
    for name, obj in _public_objects():
        if inspect.isclass(obj):
            doc = inspect.getdoc(obj) if obj.__doc__ else None
            if not doc:
                problems.append(f"{name}: no docstring")
                continue
            documented = _named(_sections(doc), "parameters", "attributes")
            own_init = "__init__" in vars(obj)
            if dataclasses.is_dataclass(obj):
                wanted = [f.name for f in dataclasses.fields(obj) if f.init]
            elif own_init:
                wanted = [p.name for p in inspect.signature(obj).parameters.values()
                          if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
            else:
                wanted = []
            if wanted:
                missing = [p for p in wanted if p not in documented]
                if missing:
                    problems.append(f"{name}: fields or arguments {missing} undocumented")
            for member, value in vars(obj).items():
                if member.startswith("_"):
                    continue
                if isinstance(value, property):
                    if not value.__doc__:
                        problems.append(f"{name}.{member}: property without a docstring")
                elif isinstance(value, (classmethod, staticmethod)) or inspect.isfunction(value):
                    func = getattr(obj, member)
                    problems += _undocumented(f"{name}.{member}", func, skip_self=True)
        elif callable(obj):
            problems += _undocumented(name, obj, skip_self=False)
        else:  # a table: its assignment carries a docstring (what the reference shows)
            source = next(p for p in PACKAGE.rglob("*.py")  # where it is assigned, not re-exported
                          if re.search(rf"^{name}(: .*)? = ", p.read_text(), re.M))
            body = ast.parse(source.read_text()).body
            documented = any(isinstance(node, (ast.Assign, ast.AnnAssign))
                             and name in [getattr(t, "id", None) for t in getattr(node, "targets", [getattr(node, "target", None)])]
                             and isinstance(after, ast.Expr) and isinstance(getattr(after, "value", None), ast.Constant)
                             for node, after in zip(body, body[1:]))
            if not documented:
                problems.append(f"{name}: no docstring under its assignment")
    return problems


def test_every_public_name_documents_its_parameters_returns_and_fields():
    problems = public_name_problems()
    assert problems == [], "\n".join(problems)


def test_the_docstring_check_bites_on_a_missing_argument_and_a_missing_returns():
    def documented(a: int, b: int = 0) -> int:
        """Sum.

        Args:
            a: One.
            b: Two.

        Returns:
            The sum.
        """
        return a + b

    def lacking(a: int, b: int = 0) -> int:
        """Sum.

        Args:
            a: One.
        """
        return a + b

    assert _undocumented("documented", documented, skip_self=False) == []
    said = _undocumented("lacking", lacking, skip_self=False)
    assert len(said) == 2 and "['a', 'b']" in said[0] and "Returns" in said[1]


def test_each_toggles_tooltip_is_its_whole_line_in_the_techniques_docstring():
    """HELP is read from Techniques' Attributes section: every field, each entry whole
    (wrapped lines joined with one space, nothing of the next entry)."""
    from nbtune.techniques import HELP

    assert list(HELP) == [f.name for f in dataclasses.fields(Techniques)]
    assert HELP["tile_tokens"].startswith("Sequence tiling: run each layer's norm + MLP")
    assert HELP["tile_tokens"].endswith("for long contexts (0 = off).")
    assert HELP["eval_every"].endswith("is measured and estimated too.")  # the last entry, whole
    assert all("\n" not in text and "  " not in text and text.strip() == text for text in HELP.values())
    # Python 3.13 dedents docstrings when it compiles them; -OO drops them
    from nbtune.techniques import _attributes

    assert _attributes(inspect.cleandoc(Techniques.__doc__)) == HELP and _attributes(None) == {}


def family_table() -> str:
    """The family predictions' table as the README and the families page quote it, made from
    the committed results file (``benchmarks/family_predictions.py``)."""
    import json

    result = json.loads((ROOT / "benchmarks/results/families/predictions.json").read_text())
    lines = ["| preset | parameters | QLoRA step on the card | host | longest context on an RTX 3090 |",
             "|---|---|---|---|---|"]
    for m in result["models"]:
        lines.append(f"| `{m['model']}` | {m['parameters'] / 1e9:.2f} B | {m['predicted_gib']:.2f} GiB | "
                     f"{m['host_gib']:.2f} GiB | {m['longest_context_rtx3090']:,} tokens ({m['longest_limit']}) |")
    return "\n".join(lines)


def test_the_family_predictions_quoted_are_the_committed_results():
    """Rerun the benchmark when the estimator changes, and the quotes follow its file; the
    parameter counts are the presets' own."""
    import json

    from nbtune.models.presets import preset_config

    table = family_table()
    for page in ("README.md", "docs/guides/families-and-objectives.md"):
        assert table in (ROOT / page).read_text(), f"{page} quotes other figures than the results file"
    result = json.loads((ROOT / "benchmarks/results/families/predictions.json").read_text())
    for m in result["models"]:
        assert m["parameters"] == preset_config(m["model"]).num_parameters
    moe, row = result["moe"], {m["model"]: m for m in result["models"]}["qwen3-30b-a3b"]
    readme, page = ((ROOT / p).read_text() for p in ("README.md", "docs/guides/families-and-objectives.md"))
    quoted = {readme: [f"{row['predicted_gib']:.2f} GiB sits beside the {moe['unsloth_30b_a3b_gb']} GB",
                       f"{moe['qwen3_30b_a3b_experts_adapted_gib']:.2f} GiB",
                       f"({moe['qwen3_235b_a22b_ranks']['per_card_gib']:.2f} GiB each)"],
              page: [f"predicted {row['predicted_gib']:.2f} GiB",
                     f"experts adapted too: {moe['qwen3_30b_a3b_experts_adapted_gib']:.2f} GiB",
                     f"{moe['qwen3_235b_a22b_ranks']['per_card_gib']:.2f} GiB on each",
                     f"{result['moe_speed_cpu']['ratio']:.2f}x of the tokens"]}
    for text, figures in quoted.items():
        for figure in figures:
            assert figure in " ".join(text.split()), figure
    assert moe["qwen3_235b_a22b_ranks"]["cards"] == 2  # the pages say two
