"""A server's run history in its output root: each run's directory (``run_file``) and the SQLite
index of them all (``index``), kept across restarts and shared by every session and the CLI.

``History(root, size)`` records a run (who asked, when, what it ran), lists them, opens one as it
was (no recomputing: the run directory holds every observer's results and the kept samples; the
weights are read again from the model's files), deletes a person's own, and prunes the oldest past
``size`` (``--history-size``), saying how many went. A run the CLI saved (``run --out``, with its
run directory beside the file) joins it with ``add``.
"""

from __future__ import annotations

import datetime as _dt
import secrets
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lab.analyse.analysis import Analysis
from lab.history import run_file
from lab.history.index import RunIndex, RunRecord, utc
from lab.history.run_file import KeptRun
from lab.results import spec_text
from lab.results.calibration import calibration_text

HISTORY_DIR = "runs"
"""Where a server keeps its runs, under its output root."""
INDEX_FILE = "index.sqlite"
DEFAULT_HISTORY_SIZE = 200
"""Runs a server keeps in its history (``--history-size``); older ones are pruned, oldest first."""
LAB_FILE = "observer_lab.json"
"""Each kept run's Observer Lab JSON (the best observer per tensor), beside its run files."""


class HistoryError(ValueError):
    """A history request that cannot be met (an unknown run, another person's run to delete)."""


def new_id(now: float) -> str:
    """A run's id: when it was kept (``now``, UTC) to the second, and 6 random hex digits (a link names it)."""
    stamp = _dt.datetime.fromtimestamp(now, _dt.UTC).strftime("%Y%m%d-%H%M%S")
    return f"{stamp}-{secrets.token_hex(3)}"


@dataclass
class History:
    """The runs kept under ``root`` (a server's ``<output root>/runs``): at most ``size``
    (``--history-size``), the oldest pruned first; ``pruned`` counts the runs this history removed
    since it was opened."""

    root: Path
    size: int
    pruned: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        if self.size < 1:
            raise HistoryError(f"--history-size must be at least 1, got {self.size}")
        self.index = RunIndex(self.root / INDEX_FILE)

    def record(self, run: KeptRun, who: str, origin: str = "app") -> RunRecord:
        """Keep ``run`` as asked for by ``who`` now, with its Observer Lab JSON."""
        now = time.time()
        run_id = new_id(now)
        lab_file = _lab_json(run.analysis, {"id": run_id, "who": who, "when": utc(now)})
        run_file.save(run, self.root / run_id, {} if lab_file is None else {LAB_FILE: lab_file})
        return self._index(run_id, run.analysis, run.request, who, origin, now)

    def add(self, lab_path: Path, who: str) -> RunRecord:
        """Keep the run the CLI saved as ``lab_path`` (its run directory beside it, ``run_file.
        directory_for``), as the command line's: read back whole before it is indexed."""
        source = run_file.directory_for(lab_path)
        if not run_file.is_run(source):
            raise HistoryError(
                f"{lab_path} has no run beside it ({source.name}): `python -m observers run` keeps one with --out "
                "on a --layers list (a sweep keeps no whole analysis)"
            )
        kept = run_file.load(source, _no_weights)
        now = time.time()
        run_id = new_id(now)
        staging = Path(tempfile.mkdtemp(prefix=f".{run_id}.", dir=self.root))
        try:
            shutil.copytree(source, staging, dirs_exist_ok=True)
            shutil.copyfile(lab_path, staging / LAB_FILE)
            staging.rename(self.root / run_id)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        return self._index(run_id, kept.analysis, kept.request, who, "cli", now)

    def _index(
        self, run_id: str, analysis: Analysis, request: dict[str, Any], who: str, origin: str, now: float
    ) -> RunRecord:
        record = RunRecord(
            id=run_id,
            created=now,
            who=who,
            origin=origin,
            model=analysis.facts.name,
            request=dict(request),
            layers=list(dict.fromkeys(entry.layer for entry in analysis.entries)),
            formats="; ".join(f"{kind}: {spec_text(spec)}" for kind, spec in analysis.config.specs.items()),
            observers=list(analysis.config.observer_names),
            calibration=calibration_text(analysis.calibration) or "none (weights only)",
            gptq=analysis.config.gptq is not None,
            seconds=float(analysis.seconds),
            tensors=len(analysis.entries),
            size=sum(path.stat().st_size for path in (self.root / run_id).iterdir()),
        )
        self.index.add(record)
        self.prune()
        return record

    def runs(self) -> list[RunRecord]:
        """Every kept run, the newest first."""
        return self.index.runs()

    def get(self, run_id: str) -> RunRecord:
        found = self.index.get(run_id)
        if found is None:
            raise HistoryError(f"no kept run {run_id!r} on this server (deleted, pruned, or never kept here)")
        return found

    def open(self, run_id: str, weight_of: run_file.WeightOf) -> KeptRun:
        """The kept run ``run_id`` as it was; ``weight_of`` reads a weight from its model."""
        self.get(run_id)
        return run_file.load(self.root / run_id, weight_of)

    def lab_file(self, run_id: str) -> bytes | None:
        """The kept run's Observer Lab JSON (None when no observer gave qparams to export)."""
        path = self.root / self.get(run_id).id / LAB_FILE
        return path.read_bytes() if path.is_file() else None

    def delete(self, run_id: str, who: str) -> None:
        """Remove a run ``who`` asked for; another person's is refused in one line."""
        record = self.get(run_id)
        if record.who != who:
            raise HistoryError(f"run {run_id} was asked for by {record.who}: only they may delete it")
        self._remove(run_id)

    def prune(self) -> list[str]:
        """Remove the runs past the newest ``size``, the oldest first; their ids."""
        gone = self.index.beyond(self.size)
        for run_id in gone:
            self._remove(run_id)
        self.pruned += len(gone)
        return gone

    def _remove(self, run_id: str) -> None:
        self.index.remove(run_id)
        shutil.rmtree(self.root / run_id, ignore_errors=True)


def _lab_json(analysis: Analysis, run: dict[str, str]) -> bytes | None:
    """The Observer Lab JSON of the best observer per tensor, said to come from ``run`` (its id,
    who asked, when) and asked for by the same person (None when no tensor has qparams)."""
    from lab.export import lab_json
    from lab.provenance import made_by
    from lab.results import choose

    choices = choose(analysis)
    if not choices:
        return None
    return lab_json.save(analysis, choices, allow_uncalibrated=True, provenance=made_by(run["who"], run))


def _no_weights(layer: str) -> Any:
    raise HistoryError(f"the weight of {layer} is read from its model only when a kept run is opened")
