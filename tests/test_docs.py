"""Docs that cannot rot (issue 55): the site builds strictly (and a broken link or a missing API object
would stop it), the generated Reference pages follow the code, every fenced ``python`` block of the
docs and the README runs, and every ``python -m observers`` command they show parses with the real
parser and runs (exit 0), on the sample models.

A block opts out only with a visible reason on the line right above it::

    <!-- not-run: needs a GPU -->

Blocks of one page, Python and commands alike, run in order in one temporary working directory (the
Python ones in one namespace), as a reader would run them: a command reads the file an earlier block
wrote. Asking for one block alone runs the page's earlier blocks first.
"""

from __future__ import annotations

import importlib.util
import io
import os
import re
import shlex
import subprocess
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
HOOK_FILE = ROOT / "docs" / "hooks" / "reference.py"
FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>```+|~~~+)[ \t]*(?P<lang>[\w+-]*)")
NOT_RUN = re.compile(r"^<!--\s*not-run\b:?(?P<reason>.*?)-->$")
SHELLS = {"bash", "sh", "shell", "console"}
CLI = ("python", "-m", "observers")
VENV = ".venv/bin/"
"""A command may name the set-up's interpreter (``.venv/bin/python -m observers``), as the README's do."""


@dataclass(frozen=True)
class Block:
    """One fenced code block: where it starts (the fence's line, 1-based), its language and source."""

    page: str
    line: int
    lang: str
    source: str
    not_run: str | None  # the opt-out marker's reason ("" when the marker gives none), None if no marker

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def _pages() -> list[Path]:
    docs = sorted(p for p in (ROOT / "docs").rglob("*.md") if "hooks" not in p.relative_to(ROOT / "docs").parts)
    return [ROOT / "README.md", *docs]


def blocks_of(page: str, text: str) -> list[Block]:
    """The fenced blocks of a Markdown ``text`` (indented fences too: an admonition's, a list item's),
    each with the ``not-run`` marker on the last non-blank line above its fence, if any."""
    found: list[Block] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        opened = FENCE.match(lines[i])
        if not opened:
            i += 1
            continue
        indent, fence, lang = opened["indent"], opened["fence"], opened["lang"].lower()
        end = i + 1
        while end < len(lines) and not lines[end].strip().startswith(fence[0] * len(fence)):
            end += 1
        above = next((line.strip() for line in reversed(lines[:i]) if line.strip()), "")
        marker = NOT_RUN.match(above)
        inside = (line[len(indent) :] if line.startswith(indent) else line for line in lines[i + 1 : end])
        body = textwrap.dedent("\n".join(inside))
        found.append(Block(page, i + 1, lang, body, marker["reason"].strip() if marker else None))
        i = end + 1
    return found


def _all_blocks() -> list[Block]:
    return [b for p in _pages() for b in blocks_of(str(p.relative_to(ROOT)), p.read_text(encoding="utf-8"))]


BLOCKS = _all_blocks()
PYTHON_BLOCKS = [b for b in BLOCKS if b.lang in ("python", "py")]


def cli_commands(source: str) -> list[list[str]]:
    """The ``python -m observers ...`` commands of a shell block as argv lists (after ``observers``):
    continuation lines joined, prompts (``$ ``) and comments dropped, other commands ignored. A
    command the shell could not split (an unclosed quote) is kept as ``["<unclosed quote>", line]``,
    which no parser takes, so its test fails instead of the collection."""
    commands = []
    for line in source.replace("\\\n", " ").splitlines():
        line = line.strip().removeprefix("$ ").removeprefix(VENV)
        if not line.startswith(" ".join(CLI)):
            continue
        try:
            words = shlex.split(line, comments=True)
        except ValueError:
            words = [*CLI, "<unclosed quote>", line]
        if tuple(words[:3]) == CLI:
            commands.append(words[3:])
    return commands


CLI_BLOCKS = [b for b in BLOCKS if b.lang in SHELLS and cli_commands(b.source)]


# ------------------------------------------------------------------------------------- the site


def _build(config: Path, site: Path) -> subprocess.CompletedProcess[str]:
    """``mkdocs build --strict`` of ``config`` with the interpreter running the tests (the .venv's)."""
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(site)]
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The whole site, built once for the tests that read it."""
    out = tmp_path_factory.mktemp("site")
    built = _build(ROOT / "mkdocs.yml", out)
    assert built.returncode == 0, built.stdout + built.stderr
    return out


def _config_over(docs: Path, tmp_path: Path) -> Path:
    """mkdocs.yml as it is (theme, hooks, plugins, validation, extensions) over another docs folder,
    with no nav: the same strictness on a page written for a test."""
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))
    config.pop("nav")
    config["docs_dir"] = str(docs)
    config["hooks"] = [str(ROOT / hook) for hook in config["hooks"]]
    for plugin in config["plugins"]:
        if isinstance(plugin, dict) and "mkdocstrings" in plugin:
            plugin["mkdocstrings"]["handlers"]["python"]["paths"] = [str(ROOT)]
    path = tmp_path / "mkdocs.yml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    return path


@pytest.mark.slow
def test_the_site_builds_strictly_with_its_generated_pages(site: Path):
    cli = (site / "reference" / "cli" / "index.html").read_text(encoding="utf-8")
    for command in ("list", "layers", "run", "export", "allocate", "history add"):
        assert f"python -m observers {command}" in cli
    assert "--choose-by" in cli and "--data-root" in cli
    assert "observer-lab-qparams" in (site / "reference" / "schema" / "index.html").read_text(encoding="utf-8")
    assert "nvfp4-pack-quantized" in (site / "reference" / "checkpoint-formats" / "index.html").read_text("utf-8")


@pytest.mark.slow
def test_the_api_page_documents_every_export(site: Path):
    import observers

    page = (site / "reference" / "api" / "index.html").read_text(encoding="utf-8")
    anchors = set(re.findall(r'id="(observers\.[\w.]+)"', page))
    missing = [name for name in observers.__all__ if not any(a.rsplit(".", 1)[-1] == name for a in anchors)]
    assert missing == []


@pytest.mark.slow
@pytest.mark.parametrize(
    ("page", "complaint"),
    [
        ("See [the guide](guides/no-such-page.md).\n", "no-such-page.md"),
        ("See [the CLI](#no-such-anchor).\n", "no-such-anchor"),
        ("::: observers.no_such_object\n", "no_such_object"),
        ("<!-- generated: no-such-generator -->\n", "no-such-generator"),
    ],
    ids=["broken link", "broken anchor", "missing API object", "unknown generated part"],
)
def test_the_strict_build_refuses(tmp_path: Path, page: str, complaint: str):
    built = _build_page(tmp_path, page)
    assert built.returncode != 0
    assert complaint in built.stdout + built.stderr


@pytest.mark.slow
def test_the_same_build_takes_a_sound_page(tmp_path: Path):
    """The control: the refusals above are the pages', not the test configuration's."""
    built = _build_page(tmp_path, "See [the heading](#a-page).\n\n::: observers.QuantSpec\n")
    assert built.returncode == 0, built.stdout + built.stderr


def _build_page(tmp_path: Path, page: str) -> subprocess.CompletedProcess[str]:
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "index.md").write_text("# A page\n\n" + page, encoding="utf-8")
    return _build(_config_over(docs, tmp_path), tmp_path / "site")


# ------------------------------------------------------------------------- the generated pages


@pytest.fixture(scope="module")
def hook() -> ModuleType:
    spec = importlib.util.spec_from_file_location("docs_reference_hook", HOOK_FILE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _action(parser: Any, command: str, option: str) -> Any:
    sub = next(a for a in parser._actions if a.dest == "command").choices[command]
    return next(a for a in sub._actions if option in a.option_strings)


def test_the_cli_reference_is_the_parser(hook: ModuleType, monkeypatch: pytest.MonkeyPatch):
    """Change an option's help in the parser and the page says the new help, not the old one."""
    import lab.cli

    parser = lab.cli.command_parser()
    before = hook.render("<!-- generated: cli -->")
    old = _action(parser, "run", "--out").help
    assert hook.text(old) in before
    _action(parser, "run", "--out").help = "where the choices go (changed by a test)"
    monkeypatch.setattr(lab.cli, "command_parser", lambda: parser)
    after = hook.render("<!-- generated: cli -->")
    assert "where the choices go (changed by a test)" in after and hook.text(old) not in after
    for action in parser._actions:
        if action.dest == "command":
            assert all(f"`python -m observers {name}`" in after for name in action.choices)


def test_the_serve_options_are_the_launchers(hook: ModuleType):
    from lab.serve import config

    page = hook.render("<!-- generated: serve-options -->")
    assert all(f"`{o}" in page for a in config._parser()._actions for o in a.option_strings if o != "-h")


def test_the_schema_page_lists_every_field(hook: ModuleType):
    from lab.export import lab_json

    schema = lab_json.schema()
    page = hook.render("<!-- generated: schema -->")
    assert all(f"`{name}`" in page for name in schema["properties"])
    assert all(f"{{ #def-{name} }}" in page for name in schema["$defs"])


def test_the_formats_pages_list_every_format(hook: ModuleType):
    import observers as ob

    formats = hook.render("<!-- generated: element-formats -->")
    checkpoint = hook.render("<!-- generated: checkpoint-formats -->")
    assert all(f"`{name}`" in formats and f"`{name}`" in checkpoint for name in ob.FORMATS)


def test_an_unknown_generated_part_is_an_error(hook: ModuleType):
    with pytest.raises(KeyError, match="no-such-part"):
        hook.render("<!-- generated: no-such-part -->")


# ---------------------------------------------------------------------------------- the examples


def test_blocks_are_found_with_their_opt_out_reasons():
    page = "Text.\n\n<!-- not-run: needs a GPU -->\n```python\nx = 1\n```\n\n  ```py\n  y = 2\n  ```\n"
    first, second = blocks_of("p.md", page)
    assert (first.line, first.lang, first.source, first.not_run) == (4, "python", "x = 1", "needs a GPU")
    assert (second.line, second.source, second.not_run) == (8, "y = 2", None)
    assert blocks_of("p.md", "<!-- not-run -->\n```python\nx\n```\n")[0].not_run == ""


def test_cli_commands_are_read_as_the_shell_reads_them():
    block = "$ python -m observers run minilm \\\n    --layers 'a b' --out x.json  # the choices\nls x.json\n"
    assert cli_commands(block) == [["run", "minilm", "--layers", "a b", "--out", "x.json"]]
    unclosed = "python -m observers layers 'minilm"
    assert cli_commands(unclosed + "\n") == [["<unclosed quote>", unclosed]]


@dataclass
class _Page:
    """A page's shared state while its blocks run: one namespace, one working directory."""

    cwd: Path
    namespace: dict[str, Any] = field(default_factory=lambda: {"__name__": "__docs__"})
    ran: set[int] = field(default_factory=set)


_PAGES: dict[str, _Page] = {}
RUNNABLE = sorted(PYTHON_BLOCKS + CLI_BLOCKS, key=lambda b: (b.page, b.line))
"""Every block that runs, a page's in the order a reader meets them."""


def _page_state(page: str, factory: pytest.TempPathFactory) -> _Page:
    if page not in _PAGES:
        _PAGES[page] = _Page(factory.mktemp(re.sub(r"\W+", "_", page)))
    return _PAGES[page]


def _run(block: Block, state: _Page) -> None:
    """One block: Python executed in the page's namespace, or each of its commands through the CLI's
    ``main`` (exit 0 required)."""
    if block in PYTHON_BLOCKS:
        exec(compile(block.source, block.id, "exec"), state.namespace)  # noqa: S102 (the docs' own examples)
        return
    from lab import cli

    for argv in cli_commands(block.source):
        out, err = io.StringIO(), io.StringIO()
        code = cli.main(argv, out, err)
        assert code == 0, f"{block.id}: python -m observers {shlex.join(argv)} exited {code}: {err.getvalue()}"


def _run_in_order(block: Block, factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Run ``block`` after the earlier blocks of its page (each once, opted-out ones skipped), in the
    page's working directory, offline."""
    state = _page_state(block.page, factory)
    monkeypatch.chdir(state.cwd)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.syspath_prepend(str(ROOT))
    for earlier in RUNNABLE:
        if earlier.page == block.page and earlier.line <= block.line and earlier.line not in state.ran:
            state.ran.add(earlier.line)
            if earlier.not_run is None:
                _run(earlier, state)


def _opted_out(block: Block) -> None:
    if block.not_run is not None:
        assert block.not_run, f"{block.id}: <!-- not-run: ... --> needs a reason"
        pytest.skip(f"not run: {block.not_run}")


@pytest.mark.parametrize("block", PYTHON_BLOCKS, ids=[b.id for b in PYTHON_BLOCKS])
def test_python_block_runs(block: Block, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch):
    _opted_out(block)
    _run_in_order(block, tmp_path_factory, monkeypatch)


@pytest.mark.parametrize("block", CLI_BLOCKS, ids=[b.id for b in CLI_BLOCKS])
def test_cli_block_parses_and_runs(
    block: Block, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
):
    """Every command a page shows parses with the real parser, then runs after the page's earlier blocks."""
    from lab import cli

    for argv in cli_commands(block.source):
        try:
            cli.command_parser().parse_args(argv)
        except (ValueError, SystemExit) as exc:
            pytest.fail(f"{block.id}: python -m observers {shlex.join(argv)}: {exc}")
    _opted_out(block)  # a block that cannot run here (a path on the reader's machine) still parses
    _run_in_order(block, tmp_path_factory, monkeypatch)
