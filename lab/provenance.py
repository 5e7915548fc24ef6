"""Who asked for a file and when, and the kept run it came from (issue 40): what the Observer Lab
JSON stores as ``provenance`` and every other export says in words (the checkpoint's notes, the
compressed-tensors notes, the recipe's comments, the HTML report)."""

from __future__ import annotations

import datetime as _dt
from collections.abc import Mapping
from typing import Any


def made_by(who: str, run: Mapping[str, str] | None = None) -> dict[str, Any]:
    """A file's ``provenance``: ``who`` asks for it now, from the kept ``run`` (``id``, ``who``,
    ``when``; None: a run not kept)."""
    when = _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")
    return {"asked_by": who, "asked_at": when, "run": None if run is None else dict(run)}


def provenance_lines(provenance: Mapping[str, Any] | None) -> list[str]:
    """``provenance`` in words, a line for who asked and one for the run it came from (none for None)."""
    if not provenance:
        return []
    run = provenance.get("run")
    lines = [f"asked for by {provenance['asked_by']} at {provenance['asked_at']}"]
    return lines + ([f"from run {run['id']}, asked for by {run['who']} at {run['when']}"] if run else [])
