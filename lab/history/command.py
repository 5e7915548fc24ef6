"""``python -m observers history``: work done at the shell in a server's run history.

``history add FILE --output-root DIR`` keeps the run ``run --out FILE`` saved (its run directory
beside the file, ``FILE`` minus ``.json`` plus ``.run``) in the history of the server whose output
root is ``DIR``, so the team's Runs page lists and opens it; ``history list`` prints what the
history keeps.
"""

from __future__ import annotations

import argparse
import getpass
from pathlib import Path
from typing import IO, Any

from lab import provenance
from lab.analyse.analysis import Analysis
from lab.history import run_file
from lab.history.store import DEFAULT_HISTORY_BYTES, DEFAULT_HISTORY_SIZE, HISTORY_DIR, History, parse_history_bytes


def who() -> str:
    """Who asks at the command line: ``cli (<login name>)``."""
    try:
        return f"cli ({getpass.getuser()})"
    except (KeyError, OSError):  # no name for this user id (a container)
        return "cli"


def made_by(earlier: dict[str, Any] | None = None) -> dict[str, Any]:
    """The ``provenance`` of a file the command line writes now: who asks and when, and the kept
    run that ``earlier`` (the provenance of the file it started from) named."""
    return provenance.made_by(who(), (earlier or {}).get("run"))


def save_beside(analysis: Analysis, lab_path: str, model: str, device: str) -> Path:
    """Keep the run ``run --out lab_path`` made beside the file (``x.json`` → ``x.run``), as a
    server's history keeps one (``run_file``: a bounded number of bytes a tensor, never the
    calibration sample), so that ``history add`` takes it to a server's history; ``model`` and
    ``device`` open it again."""
    directory = run_file.directory_for(lab_path)
    run_file.save(run_file.KeptRun(analysis, request={"source": model, "device": device, "dtype": "fp32"}), directory)
    return directory


def add_parser(commands: Any) -> None:
    """The ``history`` command's flags."""
    history = commands.add_parser("history", help="a server's run history: add a run saved with --out, or list")
    actions = history.add_subparsers(dest="action", required=True, parser_class=type(history))
    add = actions.add_parser("add", help="keep the run `run --out FILE` saved in the history")
    add.add_argument("file", help="the Observer Lab JSON that `run --out` wrote (its run directory lies beside it)")
    listing = actions.add_parser("list", help="the runs the history keeps, newest first")
    for parser in (add, listing):
        parser.add_argument("--output-root", required=True, help="the server's --output-root (its history is in runs/)")
        parser.add_argument(
            "--history-size", type=int, default=DEFAULT_HISTORY_SIZE, help="the server's --history-size"
        )
        parser.add_argument("--history-bytes", default=DEFAULT_HISTORY_BYTES, help="the server's --history-bytes")


def run(args: argparse.Namespace, out: IO[str]) -> None:
    """``history add`` or ``history list``."""
    history = History(Path(args.output_root) / HISTORY_DIR, args.history_size, parse_history_bytes(args.history_bytes))
    if args.action == "add":
        record = history.add(Path(args.file), who())
        out.write(f"kept run {record.id} ({record.model}, {len(record.layers)} layer(s)) in {history.root}\n")
        note = history.pruned_note()
        if note:
            out.write(f"{note}\n")
        return
    for record in history.runs():
        out.write(f"{record.id}\t{record.when}\t{record.who}\t{record.model}\t{record.formats}\n")
