"""Whole-model sweeps: every layer streamed through ``lab.pipeline.analyse``, written as it goes,
resumable, and split between torchrun ranks (``lab.distributed``).

An ``Analysis`` keeps every tensor it observed, so one over all layers of a large model would hold
the whole model and its activations at once. A sweep analyses a few layers at a time (a *chunk*:
one calibration pass captures the chunk's activations), turns the chunk into the records
``lab_json.build_document`` writes (the very records of a single run), appends them to
``<out>.partial.jsonl`` (flushed and fsynced per chunk, so Ctrl-C or a crash loses only the chunk
under way) and drops the tensors. At the end the records are assembled into the Observer Lab
file, equal to what one ``analyse`` over the same layers writes (apart from creation time and
timings), written atomically, and the partial file is removed.

The partial file, JSON Lines:

- line 1: ``{"format": "observer-lab-sweep", "version": 1, "settings": sha256, "units": N,
  "world_size": W}``; ``settings`` hashes everything that changes the results (model source with
  file hashes, layers, attention blocks, run config, metric, uncalibrated policy, world size);
- once: ``{"header": {...}}``, the final document's top-level fields (entries left empty);
- one line per unit (a layer, or an attention block for ``k``/``v``): ``{"unit", "index",
  "rank", "entries", "uncalibrated", "warnings", "error"}``, its Observer Lab entries and
  uncalibrated records, analyse's warnings about it, and its first observer error (or null).

A line is complete or dropped (a torn last line from a kill mid-write is cut off on resume), so a
unit is either done or redone. ``resume`` skips the units already there and refuses a partial
file of other settings; without ``resume`` an existing partial file is refused rather than
overwritten, since it may hold hours of work.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

from lab import lab_json
from lab.distributed import SINGLE, Ranks, owner
from lab.json_values import json_safe
from lab.model_facts import describe_source
from lab.pipeline import Analysis, ProgressFn, RunConfig, analyse
from lab.results import check_metric, choose, export_selection, first_error, uncalibrated
from lab.vocab import DEFAULT_METRIC, KV, TensorKind

PARTIAL_FORMAT = "observer-lab-sweep"
PARTIAL_VERSION = 1
PARTIAL_SUFFIX = ".partial.jsonl"
LAYERS_PER_CHUNK = 8
"""Layers per chunk when activations are captured: each chunk costs one calibration pass and holds
its layers' activations until written. Weight-only sweeps go one layer at a time (no pass to save)."""

Unit = tuple[int, str, bool]
"""``(index, name, is_attention_block)``: layers first in model order, then attention blocks."""


def partial_path(out: str | Path) -> Path:
    """Where a sweep writing ``out`` keeps its finished units until the end."""
    return Path(f"{out}{PARTIAL_SUFFIX}")


@dataclass(frozen=True)
class Plan:
    """What one sweep analyses: ``layers`` (and ``attention`` blocks when ``config`` has a ``kv``
    spec) of ``model``, chosen by ``metric``; ``chunk`` layers at a time (None: the default)."""

    model: Any
    layers: tuple[str, ...]
    config: RunConfig
    attention: tuple[str, ...] = ()
    metric: str = DEFAULT_METRIC
    allow_uncalibrated: bool = False
    chunk: int | None = None

    def __post_init__(self) -> None:
        check_metric(self.metric)
        if self.chunk is not None and self.chunk < 1:
            raise ValueError(f"--chunk must be at least 1, got {self.chunk}")
        if not (self.layers or self.attention):
            raise ValueError("choose at least one layer or attention block")

    def units(self) -> list[Unit]:
        named = [(name, False) for name in self.layers] + [(name, True) for name in self.attention]
        return [(index, name, block) for index, (name, block) in enumerate(named)]

    @property
    def chunk_size(self) -> int:
        if self.chunk is not None:
            return self.chunk
        captures = self.config.actorder or any(kind != TensorKind.WEIGHT for kind in self.config.specs)
        return LAYERS_PER_CHUNK if captures else 1

    def settings_hash(self, world_size: int) -> str:
        """Changes exactly when a unit's records could change (the chunk size does not count)."""
        payload = {
            "source": describe_source(self.model),
            "layers": self.layers,
            "attention": self.attention,
            "config": self.config.to_dict(),
            "metric": self.metric,
            "allow_uncalibrated": self.allow_uncalibrated,
            "world_size": world_size,
        }
        return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()


@dataclass(frozen=True)
class Outcome:
    """What rank 0 gets back: the written document, analyse's warnings over every unit (those of
    a resumed run's earlier units included) and how many units a resume found done."""

    document: dict[str, Any]
    warnings: list[str]
    resumed: int


# ---------------------------------------------------------------- one chunk


def _config_for(config: RunConfig, attention: bool) -> RunConfig:
    """``analyse`` takes a ``kv`` spec only with attention blocks and layer specs only with layers."""
    return replace(config, specs={kind: spec for kind, spec in config.specs.items() if (kind == KV) == attention})


def _records(analysis: Analysis, metric: str, allow: bool) -> tuple[list[dict], list[dict], dict | None]:
    """The chunk's Observer Lab entries and uncalibrated records, and the document they came in
    (None when no tensor of the chunk has a choice, e.g. every observer failed on it)."""
    missing = uncalibrated(analysis)
    skipped = {(e.layer, e.tensor) for e in missing}
    choices = {key: name for key, name in choose(analysis, metric).items() if key not in skipped}
    if choices:
        document = lab_json.build_document(analysis, choices, metric, allow)
        return document["entries"], document["uncalibrated"], document
    if missing and not allow:
        export_selection(analysis, choices)  # raises the export's own "saw no calibration tokens" error
    return [], [lab_json.uncalibrated_record(e) for e in missing], None


def _analyse_chunk(plan: Plan, units: list[Unit], rank: int, progress: ProgressFn | None) -> dict[str, Any]:
    """One chunk analysed and reduced to its unit lines (the tensors are dropped on return), plus
    the document header the final file takes its top-level fields from."""
    names = [name for _, name, _ in units]
    block = units[0][2]
    config = _config_for(plan.config, block)
    if block:
        analysis = analyse(plan.model, [], config, progress=progress, attention=names)
    else:
        analysis = analyse(plan.model, names, config, progress=progress)
    entries, missing, document = _records(analysis, plan.metric, plan.allow_uncalibrated)
    lines = [
        {
            "unit": name,
            "index": index,
            "rank": rank,
            "entries": [e for e in entries if e["layer"] == name],
            "uncalibrated": [u for u in missing if u["layer"] == name],
            "warnings": [w for w in analysis.warnings if w.startswith(f"{name}: ")],
            "error": first_error(analysis, name),
        }
        for index, name, _ in units
    ]
    header = None if document is None else {**document, "entries": [], "uncalibrated": []}
    return {"units": lines, "header": header, "error": None}


def _chunks(units: list[Unit], size: int) -> list[list[Unit]]:
    """Consecutive runs of at most ``size`` units, never mixing layers and attention blocks."""
    chunks: list[list[Unit]] = []
    for unit in units:
        if chunks and len(chunks[-1]) < size and chunks[-1][0][2] == unit[2]:
            chunks[-1].append(unit)
        else:
            chunks.append([unit])
    return chunks


# ---------------------------------------------------------------- the partial file (rank 0)


def _append(path: Path, records: list[dict[str, Any]]) -> None:
    """Append whole lines and make them durable before going on (Ctrl-C loses nothing written)."""
    with open(path, "ab") as handle:
        handle.write(b"".join(lab_json.dumps(r).encode("utf-8") + b"\n" for r in records))
        handle.flush()
        os.fsync(handle.fileno())


def _complete_lines(path: Path) -> tuple[list[dict[str, Any]], int]:
    """The complete lines of a partial file and the bytes they span; a torn last line (killed
    mid-write) and anything after it does not count."""
    lines: list[dict[str, Any]] = []
    size = 0
    for raw in path.read_bytes().splitlines(keepends=True):
        try:
            if not raw.endswith(b"\n"):
                break
            lines.append(json.loads(raw))
        except ValueError:
            break
        size += len(raw)
    return lines, size


def _open_partial(path: Path, first: dict[str, Any], resume: bool) -> list[dict[str, Any]]:
    """The lines a resumed sweep starts from (the torn tail cut off), or a fresh file with ``first``."""
    if path.exists() and not resume:
        raise ValueError(f"{path} holds an unfinished sweep: add --resume to go on with it, or delete it to start over")
    lines, size = _complete_lines(path) if path.exists() else ([], 0)
    if not lines:
        path.write_bytes(b"")
        _append(path, [first])
        return [first]
    if lines[0].get("format") != PARTIAL_FORMAT:
        raise ValueError(f"{path} is not the partial file of an Observer Lab sweep")
    if lines[0].get("settings") != first["settings"]:
        raise ValueError(
            f"{path} was written by a sweep with other settings (model, layers, formats, observers, knobs, "
            "calibration, metric or number of ranks): run with those settings, or delete it to start over"
        )
    os.truncate(path, size)
    return lines


@dataclass
class _Writer:
    """Rank 0's side of the partial file: appends each round's unit lines (the header once)."""

    path: Path
    has_header: bool

    def write_round(self, payloads: list[dict[str, Any]]) -> None:
        """Write what every rank finished, then raise the first rank's error, if any: the units
        that did finish are kept for a resume."""
        records: list[dict[str, Any]] = []
        header = next((p["header"] for p in payloads if p["header"] is not None), None)
        if header is not None and not self.has_header:
            records.append({"header": header})
            self.has_header = True
        records += [line for p in payloads for line in p["units"]]
        if records:
            _append(self.path, records)
        errors = [p["error"] for p in payloads if p["error"]]
        if errors:
            raise ValueError(errors[0])


def _assemble(lines: list[dict[str, Any]], world_size: int, config: RunConfig) -> tuple[dict[str, Any], list[str]]:
    """The final document from a complete partial file's lines (units in model order), and the
    units' warnings; ``rank`` per entry and ``world_size`` on top only for several ranks."""
    units = sorted((line for line in lines if "unit" in line), key=lambda unit: unit["index"])
    entries = [{**e, "rank": u["rank"]} if world_size > 1 else e for u in units for e in u["entries"]]
    if not entries:
        first = next((u["error"] for u in units if u["error"]), "nothing was analysed")
        raise ValueError(f"no observer produced qparams for these settings: {first}")
    header = next(line["header"] for line in lines if "header" in line)
    document = {**header, "config": json_safe(config.to_dict()), "entries": entries}
    document["uncalibrated"] = [record for u in units for record in u["uncalibrated"]]
    if world_size > 1:
        document["world_size"] = world_size
    # every entry was validated in its chunk's document; one stands for all, so a whole model's
    # qparams are not validated twice
    problems = lab_json.schema_problems({**document, "entries": entries[:1]})
    if problems:
        raise ValueError("internal error, the assembled sweep breaks the schema: " + "; ".join(problems))
    return document, [w for u in units for w in u["warnings"]]


def _write_final(path: Path, document: dict[str, Any]) -> None:
    """Write the file whole or not at all (a crash here leaves the partial file to resume from)."""
    staging = Path(f"{path}.tmp")
    with open(staging, "w", encoding="utf-8") as handle:
        handle.write(lab_json.dumps(document))
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(staging, path)


# ---------------------------------------------------------------- the sweep


STOPS_EVERY_RANK = (ValueError, OSError, RuntimeError)
"""What one rank's chunk or file work may raise that must stop the other ranks too (bad input, a
full disk, CUDA out of memory) rather than leave them waiting in a collective."""


def _on_main(ranks: Ranks, work: Callable[[], Any]) -> Any:
    """``work()`` on rank 0 alone; its error is raised on every rank as a ``ValueError`` (so no
    rank waits for a rank that gave up), its result stays on rank 0 (None elsewhere)."""
    if ranks.group is None:
        return work()
    result, error = None, None
    if ranks.is_main:
        try:
            result = work()
        except STOPS_EVERY_RANK as err:
            error = str(err)
    error = ranks.broadcast(error)
    if error is not None:
        raise ValueError(error)
    return result


def _guarded(ranks: Ranks, work: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """A chunk's payload; with several ranks an error becomes the payload's, so this rank still
    joins the gather and rank 0 can stop every rank."""
    if ranks.group is None:
        return work()
    try:
        return work()
    except STOPS_EVERY_RANK as err:
        return {"units": [], "header": None, "error": f"rank {ranks.rank}: {err}"}


def _scaled(progress: ProgressFn | None, start: int, size: int, total: int) -> ProgressFn | None:
    """``analyse``'s steps within a round shown as a share of the round's ``size`` units (never
    the whole round: it counts as done once written)."""
    if progress is None:
        return None
    return lambda step, steps, label: progress(start + min(size - 1, size * step // max(steps, 1)), total, label)


def _start(plan: Plan, pending: Path, resume: bool, ranks: Ranks) -> tuple[set[int], _Writer | None]:
    """The units a resume finds done (on every rank) and rank 0's writer."""

    def open_it() -> list[dict[str, Any]]:
        first = {"format": PARTIAL_FORMAT, "version": PARTIAL_VERSION, "settings": plan.settings_hash(ranks.world_size)}
        return _open_partial(pending, {**first, "units": len(plan.units()), "world_size": ranks.world_size}, resume)

    lines = _on_main(ranks, open_it)
    done = ranks.broadcast(None if lines is None else [line["index"] for line in lines if "unit" in line])
    writer = _Writer(pending, any("header" in line for line in lines)) if ranks.is_main else None
    return set(done), writer


def run_sweep(
    plan: Plan,
    out: str | Path,
    *,
    resume: bool = False,
    progress: ProgressFn | None = None,
    ranks: Ranks = SINGLE,
) -> Outcome | None:
    """Analyse every unit of ``plan`` chunk by chunk and write the Observer Lab file ``out``
    (rank 0 only; the other ranks return None). ``progress(done, total, label)`` counts units
    (layers and attention blocks). Unit ``i`` goes to rank ``i % world_size``; each round every
    rank analyses one chunk of its own and rank 0 gathers and appends them."""
    out, pending = Path(out), partial_path(out)
    units = plan.units()
    done, writer = _start(plan, pending, resume, ranks)
    todo = [unit for unit in units if unit[0] not in done]
    world = range(ranks.world_size)
    plans = [_chunks([u for u in todo if owner(u[0], ranks.world_size) == r], plan.chunk_size) for r in world]
    count = len(done)
    if progress is not None:
        progress(count, len(units), "resuming" if done else "starting")
    for round_no in range(max(map(len, plans))):
        chunks = [mine[round_no] if round_no < len(mine) else [] for mine in plans]
        size = sum(map(len, chunks))
        inner = _scaled(progress, count, size, len(units))
        mine = chunks[ranks.rank]
        payload = {"units": [], "header": None, "error": None}
        if mine:
            payload = _guarded(ranks, partial(_analyse_chunk, plan, mine, ranks.rank, inner))
        gathered = ranks.gather(payload)
        _on_main(ranks, partial(writer.write_round, gathered) if writer else lambda: None)
        count += size
        if progress is not None:
            progress(count, len(units), f"{count} of {len(units)} written")

    def finish() -> Outcome:
        document, warnings = _assemble(_complete_lines(pending)[0], ranks.world_size, plan.config)
        _write_final(out, document)
        pending.unlink()
        return Outcome(document, warnings, len(done))

    return _on_main(ranks, finish)
