"""Whole-model sweeps: every layer through ``lab.analyse.pipeline.analyse``, written as it goes,
resumable, and split between torchrun ranks (``lab.scale.distributed``).

A sweep that captures activations runs one calibration pass over all its layers: the observers
keep only their state, and ``analyse`` hands on each block's layers as soon as the block has seen
every batch (``on_done``; a block at a time in a sequential capture). Those are turned into the
records ``lab_json.build_document`` writes (the very records of a single run), appended to
``<out>.partial.jsonl`` (flushed and fsynced, so Ctrl-C or a crash loses only the block under way)
and dropped. ``--chunk N`` splits the layers into passes of ``N`` instead; weight-only sweeps go
one layer at a time. At the end the records are assembled into the Observer Lab file, equal to
what one ``analyse`` over the same layers writes (apart from creation time and timings), written
atomically and streamed from the partial file one unit at a time (a big model's document is
gigabytes once parsed, so it is never held whole), and the partial file is removed.

The partial file and its format: ``lab.scale.sweep_file``.

Under torchrun (``lab.scale.distributed``) the ranks split the calibration batches when the sweep
captures (each rank streams its share of every batch round; the activation observers merge their
statistics across ranks, ``observers.shared``, and the weights are split by layer), or else the
layers (each rank analyses its own chunks alone).
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from functools import cached_property, partial
from pathlib import Path
from typing import Any

from lab.analyse.analysis import Analysis
from lab.analyse.pipeline import ProgressFn, analyse
from lab.analyse.run_config import RunConfig
from lab.export import lab_json
from lab.export.json_values import json_safe
from lab.gptq import hessians
from lab.results import choose, export_selection, first_error, uncalibrated
from lab.scale import sweep_file
from lab.scale.distributed import SINGLE, Ranks, RankSplit, owner
from lab.scale.plan import Plan, Unit, chunked
from lab.scale.sweep_file import partial_path
from lab.vocab import KV

ALL_RANKS = "all"
"""The ``rank`` of an entry that every rank computed together (split calibration batches)."""


@dataclass(frozen=True)
class Outcome:
    """What rank 0 gets back: the written file, analyse's warnings over every unit (those of a
    resumed run's earlier units included) and how many units a resume found done."""

    path: Path
    warnings: list[str]
    resumed: int

    @cached_property
    def document(self) -> dict[str, Any]:
        """The written document, read back on first use: the sweep itself never holds it whole."""
        return json.loads(self.path.read_text(encoding="utf-8"))


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


Payload = dict[str, Any]
"""What a rank sends rank 0 for some finished units: their lines, the document header, an error."""


def _analyse_chunk(
    plan: Plan,
    units: list[Unit],
    ranks: Ranks,
    progress: ProgressFn | None,
    write: Callable[[Payload], None],
    kept: Path | None = None,
) -> None:
    """One chunk analysed in one calibration pass, each group of finished units (a block's layers
    in a sequential pass) reduced to its unit lines and handed to ``write`` at once: the tensors
    are dropped as soon as they are written. Ranks that split the batches hand over the same
    groups in the same order. A GPTQ run's Hessians go into ``kept`` as their layers finish
    (``lab.gptq.hessians``: what deploys the sweep's GPTQ choices)."""
    names = [name for _, name, _ in units]
    block = units[0][2]
    config = _config_for(plan.config, block)
    by_name = {name: (index, name, attention) for index, name, attention in units}

    def hand_on(part: Analysis) -> None:
        finished = [by_name[name] for name in dict.fromkeys(e.layer for e in part.entries) if name in by_name]
        if kept is not None:
            hessians.save(kept, part.entries)
        write(_payload(plan, part, finished, ranks))

    scope = {"attention": names} if block else {}
    scope |= {"on_done": hand_on, "choices": partial(choose, metric=plan.metric)}  # propagate what it exports
    analyse(plan.model, [] if block else names, config, progress=progress, ranks=ranks, **scope)


def _payload(plan: Plan, analysis: Analysis, units: list[Unit], ranks: Ranks) -> Payload:
    """Finished units reduced to their lines, plus the document header the final file takes its
    top-level fields from.

    Ranks that split the batches (``ranks.group`` set) analyse the same chunk together: each
    line then carries its entries' ranks, rank 0 sends the entries every rank computed together
    (``rank`` "all") and each rank its own weights; ``_merge_units`` joins them."""
    entries, missing, document = _records(analysis, plan.metric, plan.allow_uncalibrated)
    shared = ranks.group is not None
    if shared:
        by_key = {(e.layer, e.tensor): ALL_RANKS if e.rank is None else e.rank for e in analysis.entries}
        entries = [{**e, "rank": by_key[(e["layer"], e["tensor"])]} for e in entries]
        entries = [e for e in entries if e["rank"] == ranks.rank or (e["rank"] == ALL_RANKS and ranks.is_main)]
        missing = missing if ranks.is_main else []
    lines = [
        {
            "unit": name,
            "index": index,
            "rank": ALL_RANKS if shared else ranks.rank,
            "entries": [e for e in entries if e["layer"] == name],
            "uncalibrated": [u for u in missing if u["layer"] == name],
            "warnings": [w for w in analysis.warnings if w.startswith(f"{name}: ")] if ranks.is_main else [],
            "error": first_error(analysis, name),
        }
        for index, name, _ in units
    ]
    header = None if document is None else {**document, "entries": [], "uncalibrated": []}
    return {"units": lines, "header": header, "error": None}


def _assemble(pending: Path, world_size: int, config: RunConfig) -> tuple[dict, Iterator[dict], list[str]]:
    """The final document of a complete partial file: its top-level fields (``entries`` empty, in
    their place), its entries as they are read back, a unit at a time in model order, and the
    units' warnings; ``rank`` per entry and ``world_size`` on top only for several ranks."""
    contents = sweep_file.read(pending)
    units = contents.units
    read = sweep_file.unit_entries(pending, units)
    entries = ({"rank": unit["rank"], **e} if world_size > 1 else e for unit, e in read)
    first = next(entries, None)
    if first is None:
        error = next((u["error"] for u in units if u["error"]), "nothing was analysed")
        raise ValueError(f"no observer produced qparams for these settings: {error}")
    headers = contents.headers
    header = headers[0] | next(({"calibration": h["calibration"]} for h in headers if "calibration" in h), {})
    # the version this lab writes, also over a header that a resumed sweep's older lab wrote
    document = {**header, "version": lab_json.FORMAT_VERSION, "config": json_safe(config.to_dict()), "entries": []}
    document["uncalibrated"] = [record for u in units for record in u["uncalibrated"]]
    if world_size > 1:
        document["world_size"] = world_size
    # every entry was validated in its chunk's document; one stands for all, so a whole model's
    # qparams are not validated twice
    problems = lab_json.schema_problems({**document, "entries": [first]})
    if problems:
        raise ValueError("internal error, the assembled sweep breaks the schema: " + "; ".join(problems))
    return document, itertools.chain([first], entries), [w for u in units for w in u["warnings"]]


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


def _guarded(ranks: Ranks, work: Callable[[], None]) -> Payload | None:
    """Run a chunk; with several ranks its error becomes a payload (None when it went well), so
    this rank still joins the gather and rank 0 can stop every rank."""
    if ranks.group is None:
        work()
        return None
    try:
        work()
    except STOPS_EVERY_RANK as err:
        return {"units": [], "header": None, "error": f"rank {ranks.rank}: {err}"}
    return None


def _joined(payloads: list[Payload], error: Payload | None) -> Payload:
    """One payload of a round's finished groups (and its error)."""
    header = next((p["header"] for p in payloads if p["header"] is not None), None)
    units = [line for p in payloads for line in p["units"]]
    return {"units": units, "header": header, "error": None if error is None else error["error"]}


def _scaled(progress: ProgressFn | None, start: int, size: int, total: int) -> ProgressFn | None:
    """``analyse``'s steps within a round shown as a share of the round's ``size`` units (never
    the whole round: it counts as done once written)."""
    if progress is None:
        return None
    return lambda step, steps, label: progress(start + min(size - 1, size * step // max(steps, 1)), total, label)


def _start(plan: Plan, pending: Path, resume: bool, ranks: Ranks) -> tuple[set[int], sweep_file.Writer | None]:
    """The units a resume finds done (on every rank) and rank 0's writer."""

    def open_it() -> sweep_file.Contents:
        settings = plan.settings_hash(ranks.world_size)
        return sweep_file.open_partial(pending, settings, len(plan.units()), ranks.world_size, resume)

    contents = _on_main(ranks, open_it)
    done = ranks.broadcast(None if contents is None else [unit["index"] for unit in contents.units])
    headers = contents.headers if ranks.is_main else []
    writer = (
        sweep_file.Writer(pending, bool(headers), any("calibration" in h for h in headers)) if ranks.is_main else None
    )
    return set(done), writer


def run_sweep(
    plan: Plan,
    out: str | Path,
    *,
    resume: bool = False,
    progress: ProgressFn | None = None,
    ranks: Ranks = SINGLE,
    provenance: dict[str, Any] | None = None,
) -> Outcome | None:
    """Analyse every unit of ``plan`` chunk by chunk and write the Observer Lab file ``out``
    (rank 0 only; the other ranks return None), said to be asked for as ``provenance`` says
    (``lab.provenance.made_by``). ``progress(done, total, label)`` counts units
    (layers and attention blocks). Fused group ``i`` (``Plan.group``) goes to rank ``i % world_size``;
    each round every rank analyses one chunk of its own and rank 0 gathers and appends them."""
    out, pending = Path(out), partial_path(out)
    kept = hessians.directory_for(out) if plan.config.gptq is not None else None
    units = plan.units()
    done, writer = _start(plan, pending, resume, ranks)
    todo = [unit for unit in units if unit[0] not in done]
    split, size = plan.split_for(ranks.world_size), plan.chunk_size(ranks.world_size)
    if split == RankSplit.BATCHES:  # every rank takes part in every chunk
        plans = [chunked(todo, size, plan.group)] * ranks.world_size
        together = ranks
    else:
        world = range(ranks.world_size)
        mine = [[u for u in todo if owner(plan.group(u), ranks.world_size) == r] for r in world]
        plans = [chunked(units, size, plan.group) for units in mine]
        together = replace(ranks, group=None, world_size=1)  # analyse alone; ranks.rank still names it
    written = set(done)
    if progress is not None:
        progress(len(written), len(units), "resuming" if done else "starting")

    def write(payload: Payload, collected: list[Payload] | None = None) -> None:
        """Rank 0 appends what every rank finished (a collective: every rank calls it in step)."""
        if collected is not None:  # ranks that split the layers write once per round
            collected.append(payload)
            return
        gathered = ranks.gather(payload)
        _on_main(ranks, partial(writer.write_round, gathered) if writer else lambda: None)
        written.update(line["index"] for each in gathered or () for line in each["units"])  # rank 0's count
        if progress is not None:
            progress(len(written), len(units), f"{len(written)} of {len(units)} written")

    for round_no in range(max(map(len, plans))):
        chunks = [mine[round_no] if round_no < len(mine) else [] for mine in plans]
        count = len(chunks[0]) if split == RankSplit.BATCHES else sum(map(len, chunks))
        inner = _scaled(progress, len(written), count, len(units))
        mine = chunks[ranks.rank]
        alone = split == RankSplit.LAYERS and ranks.world_size > 1  # each rank's own pass, written per round
        collected: list[Payload] | None = [] if alone else None
        error = None
        if mine:
            error = _guarded(
                ranks,
                partial(_analyse_chunk, plan, mine, together, inner, partial(write, collected=collected), kept),
            )
        if collected is not None:
            write(_joined(collected, error))
        elif error is not None:
            write(error)

    def finish() -> Outcome:
        document, entries, warnings = _assemble(pending, ranks.world_size, plan.config)
        sweep_file.write_final(out, document | ({"provenance": provenance} if provenance else {}), entries)
        pending.unlink()
        return Outcome(out, warnings, len(done))

    return _on_main(ranks, finish)
