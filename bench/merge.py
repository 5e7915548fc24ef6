"""``python -m bench.merge RUN.json [RUN.json ...] [--markdown FILE]``: one table from several runs.

On a shared machine a run's medians swing with other people's load, so the published table runs
the benchmark more than once (``python -m bench --json RUN.json``) and keeps, per row, the run
whose ours median was lowest (its floor and agreement come from that same run, so the ``x floor``
and per-element figures stay consistent) and the lowest reference median. A last column lists
ours in every run, to show the noise.
"""

from __future__ import annotations

import argparse
import json
import sys

from bench.__main__ import HEADER, format_rows, markdown, ms_cell, plain

MERGED_HEADER = [*HEADER, "ours ms, each run"]


def merge(runs: list[list[dict]]) -> list[dict]:
    """Rows keyed by (case, reference) in the first run's order: the row of the run with the
    lowest ours median, the lowest reference median over the runs, and ``runs_s`` (every ours).
    A row missing from some run keeps the runs it has."""
    order: list[tuple[str, str]] = []
    keyed: dict[tuple[str, str], list[dict]] = {}
    for rows in runs:
        for row in rows:
            key = (row["case"], row.get("reference", ""))
            if key not in keyed:
                order.append(key)
                keyed[key] = []
            keyed[key].append(row)
    merged = []
    for key in order:
        rows = keyed[key]
        best = min(rows, key=lambda r: r["ours_s"])
        references = [r["reference_s"] for r in rows if r.get("reference_s")]
        merged.append(
            {**best, "reference_s": min(references) if references else None, "runs_s": [r["ours_s"] for r in rows]}
        )
    return merged


def merged_cells(rows: list[dict]) -> list[list[str]]:
    """Table cells with the extra per-run column."""
    return [
        [*cells, " / ".join(ms_cell(s) for s in row["runs_s"])]
        for cells, row in zip(format_rows(rows), rows, strict=True)
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.merge", description=__doc__.split("\n\n")[1])
    parser.add_argument("runs", nargs="+", help="JSON files written by python -m bench --json")
    parser.add_argument("--markdown", default=None, help="also write the merged table as markdown to this file")
    args = parser.parse_args(argv)
    loaded = []
    for path in args.runs:
        with open(path) as f:
            loaded.append(json.load(f))
    rows = merge([run["rows"] for run in loaded])
    cells = merged_cells(rows)
    header = "\n".join(f"run {i + 1}: {run['run']}" for i, run in enumerate(loaded)) + f"\n{loaded[-1]['references']}"
    print(f"{header}\n{plain(rows, MERGED_HEADER, cells)}")
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(header.replace("\n", "  \n") + f"\n\n{markdown(rows, MERGED_HEADER, cells)}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
