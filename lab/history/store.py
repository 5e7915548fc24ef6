"""A server's run history in its output root: each run's directory (``run_file``) and the SQLite
index of them all (``index``), kept across restarts and shared by every session and the CLI.

``History(root, size, max_bytes)`` records a run (who asked, when, what it ran), lists them, opens
one as it was (no recomputing: the run directory holds every observer's results and what the pages
draw of the values; the weights are read again from the model's files), deletes a person's own,
and prunes the oldest past ``size`` runs (``--history-size``) or ``max_bytes`` of runs on disk
(``--history-bytes``), saying how many went (``pruned_note``). A run larger than the whole
``max_bytes`` is refused in one line, never kept at the cost of every other. A run the CLI saved
(``run --out``, with its run directory beside the file) joins it with ``add``.
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
from lab.settings import parse_bytes

HISTORY_DIR = "runs"
"""Where a server keeps its runs, under its output root."""
INDEX_FILE = "index.sqlite"
DEFAULT_HISTORY_SIZE = 200
"""Runs a server keeps in its history (``--history-size``); older ones are pruned, oldest first."""
DEFAULT_HISTORY_BYTES = "20GB"
"""Bytes of runs a server keeps on disk (``--history-bytes``; older ones are pruned, oldest first).
A run takes its qparams (a weight's per group and observer are most of it), about 1 MB an
activation and GPTQ's Hessians: 6 MB for MiniLM's demo, GBs for every layer of a 7B model with group
scales or GPTQ. 20 GB keeps the default 200 runs of the small models and a few large ones."""
MIN_HISTORY_BYTES = 10**6
"""The least ``--history-bytes``: below a MB no run fits, and a bare ``20`` (bytes) was meant as GB."""
LAB_FILE = "observer_lab.json"
"""Each kept run's Observer Lab JSON (the best observer per tensor), beside its run files."""


class HistoryError(ValueError):
    """A history request that cannot be met (an unknown run, another person's run to delete, a bound
    it cannot keep a run in, a run larger than the whole bound)."""


def parse_history_bytes(text: str) -> int:
    """``--history-bytes`` as written (``20GB``, ``500 MB``, ``8GiB``) in bytes: one line naming the
    problem for anything else."""
    try:
        found = parse_bytes(text)
    except ValueError as err:
        raise HistoryError(f"--history-bytes: {err}") from None
    return _checked_bytes(found)


def _checked_bytes(count: int) -> int:
    """``count`` when it is a bound a run can fit in (``MIN_HISTORY_BYTES`` or more)."""
    if count < MIN_HISTORY_BYTES:
        raise HistoryError(
            f"--history-bytes must be at least {_bytes_text(MIN_HISTORY_BYTES)}, got {count:,} bytes "
            "(write a unit: 20GB)"
        )
    return count


def _bytes_text(count: int) -> str:
    """``20 GB``, ``257 MB``: a size in decimal units, as the flags are written."""
    units = (("TB", 1e12), ("GB", 1e9))
    unit, scale = next(((unit, scale) for unit, scale in units if count >= scale), ("MB", 1e6))
    return f"{count / scale:.3g} {unit}"


def new_id(now: float) -> str:
    """A run's id: when it was kept (``now``, UTC) to the second, and 6 random hex digits (a link names it)."""
    stamp = _dt.datetime.fromtimestamp(now, _dt.UTC).strftime("%Y%m%d-%H%M%S")
    return f"{stamp}-{secrets.token_hex(3)}"


@dataclass
class History:
    """The runs kept under ``root`` (a server's ``<output root>/runs``): at most ``size``
    (``--history-size``) taking at most ``max_bytes`` on disk (``--history-bytes``: their run
    directories, the index aside), the oldest pruned first; ``pruned`` counts the runs this history
    removed since it was opened."""

    root: Path
    size: int
    max_bytes: int = field(default_factory=lambda: parse_history_bytes(DEFAULT_HISTORY_BYTES))
    pruned: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        if self.size < 1:
            raise HistoryError(f"--history-size must be at least 1, got {self.size}")
        _checked_bytes(self.max_bytes)
        self.index = RunIndex(self.root / INDEX_FILE)

    @property
    def bounds(self) -> str:
        """What the history keeps, in words: ``the newest 200 runs within 20 GB``."""
        return f"the newest {self.size} runs within {_bytes_text(self.max_bytes)}"

    def pruned_note(self) -> str | None:
        """How many runs this history removed since it was opened, and to keep what (the Runs page
        and ``history add`` say it); None when none."""
        return f"{self.pruned} older run(s) were removed to keep {self.bounds}" if self.pruned else None

    def record(self, run: KeptRun, who: str, origin: str = "app") -> RunRecord:
        """Keep ``run`` as asked for by ``who`` now, with its Observer Lab JSON (a ``HistoryError``
        when it alone takes more than ``max_bytes``)."""
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
        size = sum(path.stat().st_size for path in (self.root / run_id).iterdir())
        if size > self.max_bytes:
            shutil.rmtree(self.root / run_id, ignore_errors=True)
            raise HistoryError(
                f"this run takes {_bytes_text(size)} on disk, more than the whole history keeps "
                f"(--history-bytes {_bytes_text(self.max_bytes)}): it is not kept"
            )
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
            size=size,
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
        """Remove the runs past the newest ``size``, then the oldest while the rest take more than
        ``max_bytes`` (the newest stays: it fits alone); their ids."""
        gone = self.index.beyond(self.size)
        kept = [record for record in self.index.runs() if record.id not in gone]
        total = sum(record.size for record in kept)
        while total > self.max_bytes and len(kept) > 1:
            oldest = kept.pop()
            gone.append(oldest.id)
            total -= oldest.size
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
