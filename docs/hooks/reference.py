"""The Reference pages' generated parts, rendered from the code when the site is built, so they cannot
drift from it: a page holds a marker ``<!-- generated: NAME -->`` on a line of its own, and this MkDocs
hook (``hooks:`` in mkdocs.yml) replaces it with ``GENERATORS[NAME]()``:

- ``cli``: every ``python -m observers`` command's usage and options, from the parser ``main`` parses
  with (``lab.cli.command_parser``), help texts, defaults and choices as argparse holds them;
- ``serve-options``: the served app's own flags, from the parser ``scripts/app.sh`` reads
  (``lab.serve.config``);
- ``schema``: the Observer Lab JSON file's fields, from ``lab/export/schema/observer_lab.schema.json``;
- ``element-formats``: ``observers.formats.formats_table()`` (what ``python -m observers list`` prints);
- ``checkpoint-formats``: what the checkpoint packs each element format into, or why it leaves it
  dense, from the rules it writes by (``lab.scheme.stored``).

An unknown marker name fails the build. The code is imported only when a page asks for it (the lab
imports torch), and the functions here are plain: ``tests/test_docs.py`` calls them directly.
"""

from __future__ import annotations

import argparse
import html
import json
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
SCHEMA_FILE = ROOT / "lab" / "export" / "schema" / "observer_lab.schema.json"
MARKER = re.compile(r"^<!-- generated: ([a-z-]+) -->$", re.MULTILINE)
HELP_WIDTH = 88  # the usage lines' width, whatever terminal builds the site
_MARKDOWN_SPECIALS = re.compile(r"([\\`*_\[\]|])")


def _importable() -> None:
    """The repository root on ``sys.path``: ``mkdocs`` runs from the .venv's script, not ``python -m``."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))


def text(value: Any) -> str:
    """``value`` as literal Markdown text inside a table cell: HTML escaped (``<metric>`` is not a tag),
    Markdown's emphasis, code and link characters and the table's ``|`` backslash-escaped, one line."""
    flat = " ".join(str(value).split())
    return _MARKDOWN_SPECIALS.sub(r"\\\1", html.escape(flat, quote=False))


def code(value: Any) -> str:
    """``value`` as an inline code span (a backtick inside it widens the fence; a ``|`` inside one does
    not split a table's cell)."""
    flat = " ".join(str(value).split())
    fence = "``" if "`" in flat else "`"
    return f"{fence}{flat}{fence}" if fence == "`" else f"{fence} {flat} {fence}"


# ---------------------------------------------------------------------------------------------- CLI


def _sub_commands(parser: argparse.ArgumentParser) -> list[tuple[str, str, argparse.ArgumentParser]]:
    """(name, one-line help, parser) of each sub-command ``parser`` has, in the order it lists them."""
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help or "" for choice in action._choices_actions}
            found += [(name, helps.get(name, ""), sub) for name, sub in action.choices.items()]
    return found


def _usage(parser: argparse.ArgumentParser) -> str:
    """``parser``'s usage as ``--help`` prints it, at a fixed width."""
    formatter = argparse.HelpFormatter(parser.prog, width=HELP_WIDTH, max_help_position=32)
    formatter.add_usage(parser.usage, parser._actions, parser._mutually_exclusive_groups)
    return formatter.format_help().strip()


def _default(action: argparse.Action) -> str:
    """The default worth showing: none for flags and for what argparse fills with None or ``[]``."""
    if action.default in (None, argparse.SUPPRESS, [], False) or action.nargs == 0:
        return ""
    return code(action.default)


def _options_table(parser: argparse.ArgumentParser) -> list[str]:
    """One row per argument: how it is typed, its default, its help (``%(default)s`` expanded)."""
    formatter = argparse.HelpFormatter(parser.prog)
    rows = ["| argument | default | what it does |", "|---|---|---|"]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction | argparse._HelpAction) or action.help == argparse.SUPPRESS:
            continue
        if action.option_strings:  # the metavar as the usage line shows it: FILE, {fixed,refit}, ...
            metavar = "" if action.nargs == 0 else " " + formatter._format_args(action, action.dest.upper())
            typed = ", ".join(code(option + metavar) for option in action.option_strings)
        else:
            typed = code(formatter._format_args(action, action.dest))
        what = text(formatter._expand_help(action)) if action.help else ""
        if action.choices is not None and not isinstance(action.choices, dict):
            what += (" " if what else "") + "One of " + ", ".join(code(choice) for choice in action.choices) + "."
        if action.required and action.option_strings:
            what = "**Required.** " + what
        if isinstance(action, argparse._AppendAction):
            what += " Repeatable."
        rows.append(f"| {typed} | {_default(action)} | {what.strip()} |")
    return rows


def cli_reference(parser: argparse.ArgumentParser, level: int = 3) -> str:
    """Every (sub-)command of ``parser``: a section (headings from ``level`` down) with its help, its
    usage and its arguments' table."""
    lines: list[str] = []

    def section(path: str, summary: str, sub: argparse.ArgumentParser, level: int) -> None:
        lines.extend([f"{'#' * level} `{path}`", ""])
        if summary or sub.description:
            lines.extend([text(summary or sub.description), ""])
        lines.extend(["```text", _usage(sub), "```", ""])
        table = _options_table(sub)
        if len(table) > 2:
            lines.extend([*table, ""])
        for name, help_text, child in _sub_commands(sub):
            section(f"{path} {name}", help_text, child, min(level + 1, 5))

    lines.extend([text(parser.description or ""), "", "```text", _usage(parser), "```", ""])
    for name, help_text, sub in _sub_commands(parser):
        section(f"{parser.prog} {name}", help_text, sub, level)
    return "\n".join(lines)


def _cli() -> str:
    _importable()
    from lab.cli import command_parser

    return cli_reference(command_parser())


def _serve_options() -> str:
    """The app's own flags (``scripts/app.sh`` passes Streamlit's ``--server.*`` flags on to it)."""
    _importable()
    from lab.serve import config

    parser = config._parser()
    return "\n".join(["```text", _usage(parser), "```", "", *_options_table(parser)])


# ------------------------------------------------------------------------------------------- schema


def _type_of(node: dict[str, Any]) -> str:
    """A schema node's type in words: its ``type``, ``const``, ``enum``, ``$ref`` (a link to the
    definition's section), an array's items, a ``oneOf``/``anyOf``'s alternatives."""
    if "$ref" in node:
        name = node["$ref"].rsplit("/", 1)[-1]
        return f"[{name}](#def-{name})"
    if "const" in node:
        return "= " + code(json.dumps(node["const"]))
    if "enum" in node:
        return "one of " + ", ".join(code(json.dumps(value)) for value in node["enum"])
    for either in ("oneOf", "anyOf"):
        if either in node and "type" not in node:
            return " or ".join(_type_of(option) for option in node[either])
    kinds = node.get("type", "any")
    kind = " or ".join(kinds) if isinstance(kinds, list) else kinds
    if kind == "array" and isinstance(node.get("items"), dict):
        return f"array of {_type_of(node['items'])}"
    if kind == "object" and isinstance(node.get("additionalProperties"), dict):
        return f"object of {_type_of(node['additionalProperties'])}"
    return kind


def _fields(node: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, dict[str, Any], bool]]:
    """(dotted path, node, required) of every property under ``node``, nested objects and arrays of
    objects included (``entries[].chosen``); ``$ref``s are left as links, not expanded."""
    required = set(node.get("required", ()))
    for name, child in node.get("properties", {}).items():
        path = f"{prefix}{name}"
        yield path, child, name in required
        if "$ref" in child:
            continue
        if "properties" in child:
            yield from _fields(child, path + ".")
        items = child.get("items")
        if isinstance(items, dict) and "properties" in items:
            yield from _fields(items, path + "[].")


def _fields_table(node: dict[str, Any]) -> list[str]:
    rows = ["| field | type | required | meaning |", "|---|---|---|---|"]
    for path, child, required in _fields(node):
        meaning = text(child.get("description", ""))
        rows.append(f"| {code(path)} | {_type_of(child)} | {'yes' if required else ''} | {meaning} |")
    return rows


def schema_reference(schema: dict[str, Any]) -> str:
    """The schema's top level and each of its ``$defs`` as tables of fields, then the schema itself."""
    lines = [f"**{text(schema.get('title', ''))}** ({code(schema.get('$schema', ''))})", ""]
    lines += [text(schema.get("description", "")), "", "## Top level", "", *_fields_table(schema), ""]
    for name, node in schema.get("$defs", {}).items():
        lines += [f"## `{name}` {{ #def-{name} }}", ""]
        if node.get("description"):
            lines += [text(node["description"]), ""]
        if "properties" in node:
            lines += [*_fields_table(node), ""]
        else:
            lines += [f"Type: {_type_of(node)}", ""]
    document = json.dumps(schema, indent=2)
    lines += ["## The schema file", "", f"`{SCHEMA_FILE.relative_to(ROOT)}`, as it is:", ""]
    lines += ['??? note "observer_lab.schema.json"', "", "    ```json"]
    lines += ["    " + line for line in document.splitlines()]
    lines += ["    ```", ""]
    return "\n".join(lines)


def _schema() -> str:
    return schema_reference(json.loads(SCHEMA_FILE.read_text(encoding="utf-8")))


# ------------------------------------------------------------------------------------------ formats


def _element_formats() -> str:
    _importable()
    from observers.formats import formats_table

    rows = ["| dtype | family | element | block | scale | largest element |", "|---|---|---|---|---|---|"]
    for row in formats_table():
        block = row["block_size"] or ""
        rows.append(
            f"| {code(row['name'])} | {text(row['family'])} | {text(row['element'])} | {block} "
            f"| {text(row['scale'])} | {row['max_value']:g} |"
        )
    return "\n".join(rows)


def _weight_specs(fmt: Any) -> list[tuple[str, Any]]:
    """The weight schemes a format is shown with: its block for a block format, one scale for a plain
    cast, else per output channel and in groups of 128."""
    import observers as ob

    if fmt.is_block:
        return [(f"block {fmt.block_size}", ob.QuantSpec(dtype=fmt.name, strategy="group", group_size=fmt.block_size))]
    if fmt.kind == "cast":
        return [("cast", ob.QuantSpec(dtype=fmt.name))]
    return [
        ("channel", ob.QuantSpec(dtype=fmt.name, strategy="channel")),
        ("group 128", ob.QuantSpec(dtype=fmt.name, strategy="group", group_size=128)),
    ]


def _stored(spec: Any, tensor: str = "weight", layer_type: str = "Linear", inputs: Any = None) -> str:
    """What the checkpoint writes a ``Linear``'s weight in ``spec`` as (with ``inputs``' static input
    scales): compressed-tensors' format, or why it stays dense."""
    from lab.scheme.stored import ct_args, dense_reason, packed_format

    reason = dense_reason(spec, tensor, layer_type)
    if reason:
        return text(reason)
    weights, reasons = ct_args(spec, tensor)
    if weights is None:
        return "stays dense: " + text("; ".join(reasons))
    scheme: dict[str, Any] = {"targets": ["Linear"], "weights": weights}
    if inputs is not None:
        input_args, input_reasons = ct_args(inputs, "input")
        if input_args is None:
            return "inputs stay unquantized: " + text("; ".join(input_reasons))
        scheme["input_activations"] = input_args
    return code(packed_format(scheme))


def _expert(spec: Any) -> str:
    from lab.scheme.stored import ct_args, expert_dense_reason

    reason = expert_dense_reason(spec, "weight")
    if reason:
        return text(reason)
    return "packed, one projection per expert" if ct_args(spec, "weight")[0] is not None else "stays dense"


def _checkpoint_formats() -> str:
    """One row per element format and weight scheme: a ``Linear`` weight's packed form, the same with
    static per-tensor inputs in the same dtype, and a fused MoE expert's, as ``checkpoint.write`` decides."""
    _importable()
    import observers as ob

    rows = [
        "| dtype | weight scheme | `Linear` weight | with static inputs (same dtype, per tensor) | fused MoE expert |",
        "|---|---|---|---|---|",
    ]
    for fmt in ob.FORMATS.values():
        for scheme, spec in _weight_specs(fmt):
            static = None if fmt.is_block or fmt.kind == "cast" else ob.QuantSpec(dtype=fmt.name)
            with_inputs = _stored(spec, inputs=static) if static is not None else ""
            rows.append(f"| {code(fmt.name)} | {scheme} | {_stored(spec)} | {with_inputs} | {_expert(spec)} |")
    asymmetric = ob.QuantSpec(dtype="uint4", symmetric=False, strategy="group", group_size=128)
    rows.append(f"| {code('uint4')}, asymmetric | group 128 | {_stored(asymmetric)} | | {_expert(asymmetric)} |")
    int4 = ob.QuantSpec(dtype="int4", strategy="group", group_size=128)
    rows.append(f"| {code('int4')} on an `Embedding` | group 128 | {_stored(int4, layer_type='Embedding')} | | |")
    return "\n".join(rows)


GENERATORS: dict[str, Callable[[], str]] = {
    "cli": _cli,
    "serve-options": _serve_options,
    "schema": _schema,
    "element-formats": _element_formats,
    "checkpoint-formats": _checkpoint_formats,
}


def render(markdown: str) -> str:
    """``markdown`` with every generated marker replaced (a name without a generator raises)."""

    def generated(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in GENERATORS:
            raise KeyError(f"<!-- generated: {name} -->: no such generator (known: {', '.join(GENERATORS)})")
        return GENERATORS[name]()

    return MARKER.sub(generated, markdown)


def on_page_markdown(markdown: str, **_: Any) -> str:
    """MkDocs' hook: each page's Markdown before it is converted."""
    return render(markdown)
