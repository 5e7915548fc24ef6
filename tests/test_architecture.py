"""The layout rules of docs/architecture.md, checked: floors import downward only, lab/'s modules
import one another without a circle, streamlit only in the app layer, lab/ modules stay small, and
the app and the CLI share one settings path (same settings, same JSON)."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from lab import ui
from lab.cli import main
from lab.export import lab_json

ROOT = Path(__file__).resolve().parents[1]
STREAMLIT_ALLOWED = {
    "app.py",
    "app_server.py",
    "lab/ui/__init__.py",
    "lab/ui/serving.py",
    "lab/ui/access.py",
    "lab/ui/history.py",
}
FLOORS = ["observers", "sample_models", "lab"]
MAX_LAB_LINES = 430


def _imports(path: Path, full: bool = False) -> set[str]:
    """The top-level packages ``path`` imports (the whole dotted names with ``full``)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names |= {alias.name if full else alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module if full else node.module.split(".")[0])
    return names


def _sources() -> list[Path]:
    folders = [*FLOORS, "pages", "bench"]
    return [ROOT / "app.py", *(p for folder in folders for p in sorted((ROOT / folder).rglob("*.py")))]


def test_only_the_app_layer_imports_streamlit():
    """The bench may speak Streamlit's wire format (``streamlit.proto``: ``bench_serve``'s sessions
    are websocket clients of a served app), never import the UI."""
    offenders = [
        str(p.relative_to(ROOT))
        for p in _sources()
        if "streamlit" in _imports(p) and str(p.relative_to(ROOT)) not in STREAMLIT_ALLOWED and p.parent.name != "pages"
        and not (p.parent.name == "bench" and all(n.startswith("streamlit.proto") for n in _ui_imports(p)))
    ]
    assert offenders == []


def _ui_imports(path: Path) -> set[str]:
    return {name for name in _imports(path, full=True) if name.split(".")[0] == "streamlit"}


@pytest.mark.parametrize("floor", FLOORS)
def test_nothing_imports_upward(floor):
    above = set(FLOORS[FLOORS.index(floor) + 1 :]) | {"pages", "bench"}
    # observers/__main__.py is the ``python -m observers`` entry point, not part of the library: it
    # only hands over to lab.cli, and importing observers never runs it.
    files = [p for p in (ROOT / floor).rglob("*.py") if p.name != "__main__.py"]
    offenders = {str(p.relative_to(ROOT)): _imports(p) & above for p in files}
    assert {k: v for k, v in offenders.items() if v} == {}


def _module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_graph(package: Path) -> dict[str, set[str]]:
    """Each module of ``package`` → the modules of ``package`` it imports, wherever the statement
    stands: module level, inside a function or under ``TYPE_CHECKING``. An import moved into a
    function to dodge a circle is still a circle: the modules still need each other.
    ``from pkg import name`` points at ``pkg.name`` when that is a module, else at ``pkg``."""
    root = package.parent
    modules = {_module_name(p, root): p for p in package.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package_parts = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                found |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = _from_module(node, package_parts)
                found |= {f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names}
        graph[name] = (found & modules.keys()) - {name}
    return graph


def _from_module(node: ast.ImportFrom, package_parts: list[str]) -> str:
    """The module a ``from`` statement names; a relative one (``from . import x``) resolved
    against the package of the module it stands in."""
    if not node.level:
        return node.module or ""
    anchor = package_parts[: len(package_parts) + 1 - node.level]
    return ".".join([*anchor, *([node.module] if node.module else [])])


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The circle each back edge of a depth-first walk closes, as the path around it (first module
    repeated at the end): none found means the graph has none."""
    circles: list[list[str]] = []
    path: list[str] = []
    done: set[str] = set()

    def visit(node: str) -> None:
        path.append(node)
        for target in sorted(graph[node]):
            if target in path:
                circles.append([*path[path.index(target) :], target])
            elif target not in done:
                visit(target)
        path.pop()
        done.add(node)

    for node in sorted(graph):
        if node not in done:
            visit(node)
    return circles


def test_the_import_graph_sees_imports_inside_functions(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "a.py").write_text("def f():\n    from pkg.b import g\n")
    (tmp_path / "pkg" / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import a\n")
    assert _circles(_import_graph(tmp_path / "pkg")) == [["pkg.a", "pkg.b", "pkg.a"]]


def test_lab_imports_form_no_circle():
    circles = [" → ".join(circle) for circle in _circles(_import_graph(ROOT / "lab"))]
    assert not circles, "import circles in lab/ (docs/architecture.md, Floors):\n" + "\n".join(circles)


def test_lab_modules_stay_small():
    sizes = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in (ROOT / "lab").rglob("*.py")}
    assert {name: n for name, n in sizes.items() if n > MAX_LAB_LINES} == {}


def _comparable(document: dict) -> dict:
    """A document without what differs between any two runs (creation time, timings, who asked)."""
    document = {k: v for k, v in document.items() if k not in ("created", "provenance")}
    for entry in document["entries"]:
        for record in (entry["chosen"], entry["runner_up"]):
            if record is not None:
                record.pop("seconds")
    return document


def test_cli_and_app_write_the_same_json_for_the_same_settings(tmp_path):
    layers = ["encoder.layer.0.attention.self.query", "encoder.layer.0.attention.self.key"]
    observers = ["minmax", "moving_average_minmax", "imatrix_mse"]
    out = tmp_path / "cli.json"
    argv = ["run", "minilm", "--layers", ",".join(layers), "--format", "int4", "--strategy", "group"]
    argv += ["--group-size", "32", "--asymmetric", "--kinds", "weight,input", "--observers", ",".join(observers)]
    argv += ["--knob", "moving_average_minmax.averaging_constant=0.5", "--actorder", "--samples", "4"]
    argv += ["--seq-len", "32", "--quiet", "--out", str(out)]
    assert main(argv) == 0

    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=300).run()
    at.switch_page("pages/model.py").run()
    at.multiselect(key="w:layers").set_value(layers)
    at.number_input(key="w:samples").set_value(4)
    at.number_input(key="w:seq_len").set_value(32).run()
    at.switch_page("pages/run.py").run()
    at.selectbox(key="w:weight_dtype").set_value("int4").run()
    at.radio(key="w:weight_symmetric").set_value(False)
    at.selectbox(key="w:weight_strategy").set_value("group").run()
    at.number_input(key="w:weight_group_size").set_value(32)
    at.checkbox(key="w:actorder").check()
    at.selectbox(key="w:act_dtype").set_value("int4").run()
    at.radio(key="w:act_symmetric").set_value(False)
    at.selectbox(key="w:act_strategy").set_value("group").run()
    at.number_input(key="w:act_group_size").set_value(32)
    at.multiselect(key="w:observers").set_value(observers).run()
    at.number_input(key="w:knob:moving_average_minmax:averaging_constant").set_value(0.5).run()
    next(b for b in at.button if b.label == "Run").click().run()
    assert not at.exception and not at.error, [e.value for e in at.error]
    ws = at.session_state[ui.WORKSPACE]
    app_document = json.loads(lab_json.save(ws.analysis, ws.choices()[0]))
    cli_document = json.loads(out.read_text())
    assert _comparable(app_document) == _comparable(cli_document)
