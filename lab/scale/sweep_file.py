"""The partial file of a sweep (``lab.scale.sweep``): finished units appended as they come, durable,
resumable; only rank 0 touches it.

The partial file, JSON Lines:

- line 1: ``{"format": "observer-lab-sweep", "version": 1, "settings": sha256, "units": N,
  "world_size": W}``; ``settings`` hashes everything that changes the results (model source with
  file hashes, layers, attention blocks, run config, metric, uncalibrated policy, world size and
  what the ranks split);
- once: ``{"header": {...}}``, the final document's top-level fields (entries left empty);
- one line per unit (a layer, or an attention block for ``k``/``v``): ``{"unit", "index",
  "rank", "entries", "uncalibrated", "warnings", "error"}``, its Observer Lab entries and
  uncalibrated records, analyse's warnings about it, and its first observer error (or null);
  ``rank`` is the rank that analysed it, or "all" when the ranks split the calibration batches
  (each entry then names its own: "all", or the rank that observed a weight).

A line is complete or dropped (a torn last line from a kill mid-write is cut off on resume), so a
unit is either done or redone. ``resume`` skips the units already there and refuses a partial
file of other settings; without ``resume`` an existing partial file is refused rather than
overwritten, since it may hold hours of work.

The file is read one line at a time (``read``), keeping the units' small fields and where each
line starts, never their entries: a big model's partial file is its whole Observer Lab file, and
the final file is written from it one unit's entries at a time (``write_final``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lab.export import lab_json
from lab.vocab import TensorKind

PARTIAL_FORMAT = "observer-lab-sweep"
PARTIAL_VERSION = 1
PARTIAL_SUFFIX = ".partial.jsonl"


def partial_path(out: str | Path) -> Path:
    """Where a sweep writing ``out`` keeps its finished units until the end."""
    return Path(f"{out}{PARTIAL_SUFFIX}")


def append(path: Path, records: list[dict[str, Any]]) -> None:
    """Append whole lines and make them durable before going on (Ctrl-C loses nothing written)."""
    with open(path, "ab") as handle:
        handle.write(b"".join(lab_json.dumps(r).encode("utf-8") + b"\n" for r in records))
        handle.flush()
        os.fsync(handle.fileno())


def _complete_lines(path: Path) -> Iterator[tuple[int, int, dict[str, Any]]]:
    """``(start, end, line)`` of each complete line, parsed one at a time; a torn last line (killed
    mid-write) and anything after it does not count."""
    with open(path, "rb") as handle:
        start = 0
        for raw in handle:
            try:
                if not raw.endswith(b"\n"):
                    return
                line = json.loads(raw)
            except ValueError:
                return
            yield start, start + len(raw), line
            start += len(raw)


@dataclass
class Contents:
    """A partial file's complete lines as a resume and the final file need them: the first line,
    the header lines, each unit's line with the number of its entries in place of them and
    ``offset``, where the line starts (the entries are read again one unit at a time), and the
    bytes the complete lines span."""

    first: dict[str, Any] | None = None
    headers: list[dict[str, Any]] = field(default_factory=list)
    units: list[dict[str, Any]] = field(default_factory=list)
    size: int = 0


def read(path: Path) -> Contents:
    """A partial file's ``Contents``, read one line at a time; units sorted by index (ranks that
    split the layers append them out of model order)."""
    contents = Contents()
    for start, end, line in _complete_lines(path):
        contents.size = end
        if contents.first is None:
            contents.first = line
        elif "header" in line:
            contents.headers.append(line["header"])
        elif "unit" in line:
            contents.units.append({**line, "entries": len(line["entries"]), "offset": start})
    contents.units.sort(key=lambda unit: unit["index"])
    return contents


def unit_entries(path: Path, units: list[dict[str, Any]]) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    """``(unit, entry)`` for each entry of ``units`` (``Contents.units``), in their order, one
    unit's line read and parsed at a time."""
    with open(path, "rb") as handle:
        for unit in units:
            handle.seek(unit["offset"])
            for entry in json.loads(handle.readline())["entries"]:
                yield unit, entry


def open_partial(path: Path, settings: str, units: int, world_size: int, resume: bool) -> Contents:
    """The contents a resumed sweep of these ``settings`` (a hash) starts from (the torn tail cut
    off), or a fresh file whose first line records them."""
    first = {"format": PARTIAL_FORMAT, "version": PARTIAL_VERSION, "settings": settings}
    first |= {"units": units, "world_size": world_size}
    if path.exists() and not resume:
        raise ValueError(f"{path} holds an unfinished sweep: add --resume to go on with it, or delete it to start over")
    contents = read(path) if path.exists() else Contents()
    if contents.first is None:
        path.write_bytes(b"")
        append(path, [first])
        return Contents(first=first)
    if contents.first.get("format") != PARTIAL_FORMAT:
        raise ValueError(f"{path} is not the partial file of an Observer Lab sweep")
    if contents.first.get("settings") != first["settings"]:
        raise ValueError(
            f"{path} was written by a sweep with other settings (model, layers, formats, observers, knobs, "
            "calibration, metric or number of ranks): run with those settings, or delete it to start over"
        )
    os.truncate(path, contents.size)
    return contents


@dataclass
class Writer:
    """Rank 0's side of the partial file: appends each round's unit lines (the header once)."""

    path: Path
    has_header: bool
    has_calibration: bool = False
    """Whether a written header records the calibration set (weight-only units' headers do not)."""

    def write_round(self, payloads: list[dict[str, Any]]) -> None:
        """Write what every rank finished, then raise the first rank's error, if any: the units
        that did finish are kept for a resume."""
        records: list[dict[str, Any]] = []
        header = next((p["header"] for p in payloads if p["header"] is not None), None)
        calibrated = next((p["header"] for p in payloads if p["header"] and "calibration" in p["header"]), None)
        if header is not None and not self.has_header:
            records.append({"header": header})
            self.has_header = True
            self.has_calibration = "calibration" in header
        elif calibrated is not None and not self.has_calibration:  # the first units had no activations
            records.append({"header": calibrated})
            self.has_calibration = True
        records += _merge_units([line for p in payloads for line in p["units"]])
        if records:
            append(self.path, records)
        errors = [p["error"] for p in payloads if p["error"]]
        if errors:
            raise ValueError(errors[0])


def _merge_units(lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One line per unit from the lines every rank sent for it (ranks that split the batches send
    a line per unit each): entries in tensor order, the first error, the rest as rank 0 sent it."""
    merged: dict[int, dict[str, Any]] = {}
    for line in lines:
        first = merged.setdefault(line["index"], {**line, "entries": []})
        first["entries"] += line["entries"]
        first["error"] = first["error"] or line["error"]
    order = {kind: i for i, kind in enumerate(TensorKind)}
    for line in merged.values():
        line["entries"].sort(key=lambda entry: order[entry["tensor"]])
    return list(merged.values())


def write_final(path: Path, document: dict[str, Any], entries: Iterable[dict[str, Any]]) -> None:
    """Write the Observer Lab file ``document`` with ``entries`` in place of its (empty) ``entries``
    list, whole or not at all (a crash here leaves the partial file to resume from).

    Written piece by piece, one entry at a time, so memory does not grow with the model: the bytes
    are exactly ``lab_json.dumps`` of the whole document (compact JSON is ``{``, then each
    ``"key":value`` joined by ``,``, then ``}``, and a list likewise with ``[``, ``]``)."""
    staging = Path(f"{path}.tmp")
    with open(staging, "w", encoding="utf-8") as handle:
        handle.write("{")
        for number, (key, value) in enumerate(document.items()):
            handle.write(("," if number else "") + lab_json.dumps(key) + ":")
            if key != "entries":
                handle.write(lab_json.dumps(value))
                continue
            handle.write("[")
            for count, entry in enumerate(entries):
                handle.write(("," if count else "") + lab_json.dumps(entry))
            handle.write("]")
        handle.write("}")
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(staging, path)
