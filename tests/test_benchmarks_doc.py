"""The current benchmark figures live in one text shown in two places: the site's Benchmarks page
(docs/benchmarks/index.md) and BENCHMARKS.md at the root, which is that page with its links made
relative to the root (so they resolve on GitHub and in a checkout). The copy cannot drift: it must
equal what ``copy_of`` makes of the page. Edit the page, then write the copy with

    .venv/bin/python tests/test_benchmarks_doc.py

Every command the page names to reproduce a figure must exist: each ``--only NAME`` selects at
least one of ``python -m bench``'s modules, each ``python -m bench.X`` is a module of bench/."""

from __future__ import annotations

import posixpath
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "benchmarks" / "index.md"
COPY = ROOT / "BENCHMARKS.md"
PAGE_DIR = "docs/benchmarks"
HEADER = (
    "<!-- A copy of docs/benchmarks/index.md (the site's Benchmarks page) with its links made relative"
    " to the repository root. Edit that page, then run: .venv/bin/python tests/test_benchmarks_doc.py"
    " (tests/test_benchmarks_doc.py fails while the two differ). -->\n"
)
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _from_root(target: str) -> str:
    """A link target of the page, relative to the repository root (URLs and anchors as they are)."""
    if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith(("#", "/")):
        return target
    path, hash_, anchor = target.partition("#")
    return posixpath.normpath(posixpath.join(PAGE_DIR, path)) + hash_ + anchor


def copy_of(page: str) -> str:
    """BENCHMARKS.md as it must be for ``page``: the header, then the page with root-relative links."""
    return HEADER + LINK.sub(lambda match: f"]({_from_root(match.group(1))})", page)


def test_benchmarks_md_is_the_site_page_with_links_from_the_root():
    expected = copy_of(PAGE.read_text(encoding="utf-8"))
    assert COPY.read_text(encoding="utf-8") == expected, (
        "BENCHMARKS.md differs from docs/benchmarks/index.md: edit the page, then run "
        ".venv/bin/python tests/test_benchmarks_doc.py"
    )


def test_links_are_rewritten_from_the_page_s_folder():
    assert _from_root("history.md") == "docs/benchmarks/history.md"
    assert _from_root("../guides/gptq.md#the-table") == "docs/guides/gptq.md#the-table"
    assert _from_root("../observers_today.md") == "docs/observers_today.md"
    assert _from_root("https://example.org/a.md") == "https://example.org/a.md"
    assert copy_of("[h](history.md) and [g](../guides/awq.md)\n").endswith(
        "[h](docs/benchmarks/history.md) and [g](docs/guides/awq.md)\n"
    )


def test_the_page_s_commands_name_benchmarks_that_exist():
    from bench.__main__ import MODULES

    text = PAGE.read_text(encoding="utf-8")
    selections = set(re.findall(r"--only\s+`?([A-Za-z0-9_]+)", " ".join(text.split()))) - {"NAME"}
    assert selections, "the page names no --only selection"
    for name in sorted(selections):
        assert any(name in module for module in MODULES), f"--only {name} selects no bench module"
    for module in set(re.findall(r"python -m bench\.([a-z_]+)", text)):
        assert (ROOT / "bench" / f"{module}.py").is_file(), f"python -m bench.{module}: no bench/{module}.py"


def test_the_page_keeps_a_section_per_area():
    headings = re.findall(r"^## (.+)$", PAGE.read_text(encoding="utf-8"), flags=re.MULTILINE)
    for area in ("Reproduce", "Machines", "Kernels and observers", "GPTQ", "AWQ", "Budgeted allocation"):
        assert area in headings, area


if __name__ == "__main__":
    COPY.write_text(copy_of(PAGE.read_text(encoding="utf-8")), encoding="utf-8")
    print(f"wrote {COPY.relative_to(ROOT)} from {PAGE.relative_to(ROOT)}")
