"""The index of a server's kept runs: an SQLite database (stdlib ``sqlite3``) in the output root, in
write-ahead-log mode, so that many sessions (and the CLI) record, list and delete runs at once
without losing one. One row per run: who asked, when, what it ran (model, layers, formats,
observers, calibration set, GPTQ or not), how long it took and where its run directory is.
"""

from __future__ import annotations

import datetime as _dt
import json
import sqlite3
from collections.abc import Iterator
from contextlib import closing, contextmanager
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

BUSY_MS = 30_000
"""How long a write waits for another's to finish before it fails (it never fails silently)."""

_COLUMNS = {
    "id": "TEXT PRIMARY KEY",
    "created": "REAL NOT NULL",
    "who": "TEXT NOT NULL",
    "origin": "TEXT NOT NULL",
    "model": "TEXT NOT NULL",
    "request": "TEXT NOT NULL",
    "layers": "TEXT NOT NULL",
    "formats": "TEXT NOT NULL",
    "observers": "TEXT NOT NULL",
    "calibration": "TEXT NOT NULL",
    "gptq": "INTEGER NOT NULL",
    "seconds": "REAL NOT NULL",
    "tensors": "INTEGER NOT NULL",
    "size": "INTEGER NOT NULL",
}


@dataclass(frozen=True)
class RunRecord:
    """One kept run as the index lists it. ``request`` is how to open its model again (the app's
    ``ModelRequest`` fields); ``layers`` the analysed layers; ``origin`` ``app`` or ``cli``;
    ``seconds`` how long the run took."""

    id: str
    created: float
    who: str
    origin: str
    model: str
    request: dict[str, Any]
    layers: list[str]
    formats: str
    observers: list[str]
    calibration: str
    gptq: bool
    seconds: float
    tensors: int
    size: int
    """Bytes its run directory takes on disk."""

    @property
    def when(self) -> str:
        """When it was kept, in UTC to the second (ISO 8601)."""
        return utc(self.created)

    def provenance(self) -> dict[str, str]:
        """The run as a file's ``provenance`` names it (``lab.provenance.made_by``)."""
        return {"id": self.id, "who": self.who, "when": self.when}


_JSON_FIELDS = ("request", "layers", "observers")


def utc(seconds: float) -> str:
    """A time (seconds since the epoch) in UTC to the second, ISO 8601: how the history says when."""
    return _dt.datetime.fromtimestamp(seconds, _dt.UTC).isoformat(timespec="seconds")


class RunIndex:
    """The SQLite index at ``path`` (made on first use). Every call opens its own connection, so one
    index serves every thread of a server and other processes alike."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        with self._connection() as db:
            db.execute("PRAGMA journal_mode=WAL")
            columns = ", ".join(f"{name} {kind}" for name, kind in _COLUMNS.items())
            db.execute(f"CREATE TABLE IF NOT EXISTS runs ({columns})")

    @contextmanager
    def _connection(self) -> Iterator[sqlite3.Connection]:
        with closing(sqlite3.connect(self.path, timeout=BUSY_MS / 1000, isolation_level=None)) as db:
            db.execute(f"PRAGMA busy_timeout={BUSY_MS}")
            yield db

    def add(self, record: RunRecord) -> None:
        row = asdict(record)
        row.update({name: json.dumps(row[name]) for name in _JSON_FIELDS})
        row["gptq"] = int(row["gptq"])
        names = ", ".join(row)
        with self._connection() as db:
            db.execute(f"INSERT INTO runs ({names}) VALUES ({', '.join('?' * len(row))})", tuple(row.values()))

    def runs(self) -> list[RunRecord]:
        """Every kept run, the newest first."""
        names = [field.name for field in fields(RunRecord)]
        with self._connection() as db:
            rows = db.execute(f"SELECT {', '.join(names)} FROM runs ORDER BY created DESC, id DESC").fetchall()
        return [_record(dict(zip(names, row, strict=True))) for row in rows]

    def get(self, run_id: str) -> RunRecord | None:
        return next((record for record in self.runs() if record.id == run_id), None)

    def remove(self, run_id: str) -> bool:
        """Forget one run; whether it was there."""
        with self._connection() as db:
            return db.execute("DELETE FROM runs WHERE id = ?", (run_id,)).rowcount > 0

    def beyond(self, keep: int) -> list[str]:
        """The runs past the newest ``keep``, the oldest last."""
        with self._connection() as db:
            rows = db.execute("SELECT id FROM runs ORDER BY created DESC, id DESC LIMIT -1 OFFSET ?", (keep,))
            return [row[0] for row in rows.fetchall()]


def _record(row: dict[str, Any]) -> RunRecord:
    row.update({name: json.loads(row[name]) for name in _JSON_FIELDS})
    row["gptq"] = bool(row["gptq"])
    return RunRecord(**row)
