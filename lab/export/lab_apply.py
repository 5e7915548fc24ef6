"""An Observer Lab file applied to a model or an analysis: its tensors checked against the model's
layers (weight shapes and the qparam shape each spec gives there, on meta tensors), its choices
restored, and what differs from the analysis it is imported into listed, never silently dropped.
Reading and validating the file itself is ``lab.export.lab_json``'s."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from lab.analyse.analysis import Analysis
from lab.analyse.model_facts import ModelFacts, same_weights
from lab.export.lab_json import LabEntry, LabFile, load
from lab.results import Choices, valid_choices
from lab.scheme.stored import expected_qparam_shape
from lab.vocab import KV_TENSORS


def _model_problems(entry: LabEntry, shapes: dict[str, tuple[int, ...]]) -> list[str]:
    where = f"{entry.layer} {entry.tensor}"
    if entry.layer not in shapes:
        what = "attention block" if entry.tensor in KV_TENSORS else "layer"
        return [f"{where}: the model has no {what} {entry.layer!r}"]
    weight_shape = shapes[entry.layer]
    if len(weight_shape) < 2:
        return [f"{where}: layer weight shape {list(weight_shape)} is not a matrix"]
    problems = []
    if entry.tensor == "weight" and tuple(entry.tensor_shape) != weight_shape:
        problems.append(f"{where}: file has weight shape {list(entry.tensor_shape)}, model has {list(weight_shape)}")
    try:
        expected = expected_qparam_shape(entry.spec, entry.tensor, weight_shape, entry.qparams.extras.get("g_idx"))
    except (ValueError, RuntimeError) as err:
        return [*problems, f"{where}: spec does not apply to this layer: {err}"]
    if expected is not None:
        for name in ("scale", "zero_point", "min_val", "max_val"):
            got = tuple(getattr(entry.qparams, name).shape)
            if got != expected:
                problems.append(f"{where}: {name} has shape {list(got)}, the layer needs {list(expected)}")
    return problems


def apply_choices(lab_file: LabFile, facts: ModelFacts) -> dict[str, dict[tuple[str, str], Any]]:
    """Check a loaded file against a model's facts (``ModelFacts.of(model)``, or an analysis's
    ``facts``) and restore its choices.

    Returns ``{"choices": {(layer, tensor): observer}, "qparams": {...: QParams},
    "specs": {...: QuantSpec}, "knobs": {...: dict}}``. A layer the model lacks, a weight shape
    or qparam shape that does not fit the layer: one ``ValueError`` listing every problem, and
    nothing is returned.
    """
    shapes = {**facts.layer_shapes, **facts.kv_shapes}
    problems = [p for entry in lab_file.entries for p in _model_problems(entry, shapes)]
    if problems:
        raise ValueError("the file does not fit this model:\n  - " + "\n  - ".join(problems))
    keys = [(e.layer, e.tensor) for e in lab_file.entries]
    return {
        "choices": dict(zip(keys, (e.observer for e in lab_file.entries), strict=True)),
        "qparams": dict(zip(keys, (e.qparams for e in lab_file.entries), strict=True)),
        "specs": dict(zip(keys, (e.spec for e in lab_file.entries), strict=True)),
        "knobs": dict(zip(keys, (e.knobs for e in lab_file.entries), strict=True)),
    }


def import_differences(lab_file: LabFile, analysis: Analysis) -> list[str]:
    """What differs between a file and the analysis its choices are applied to: other weights
    (file hashes or model name) and, per tensor, another spec. The choices still apply (the
    observer is chosen again on this analysis's data), but a person must be told."""
    notes = []
    if not same_weights(lab_file.source, analysis.source):
        notes.append(
            f"the file was made on {lab_file.source.get('name')!r}, this analysis on {analysis.source.get('name')!r} "
            "(different weights): its observer choices are applied, its qparams are not"
        )
    specs = {(e.layer, e.tensor): e.spec for e in analysis.entries}
    differing = [e for e in lab_file.entries if (e.layer, e.tensor) in specs and specs[(e.layer, e.tensor)] != e.spec]
    if differing:
        first = differing[0]
        notes.append(
            f"{len(differing)} tensor(s) were exported with another format than this run "
            f"(e.g. {first.layer} {first.tensor}: file {first.spec.dtype} {first.spec.strategy}, run "
            f"{specs[(first.layer, first.tensor)].dtype} {specs[(first.layer, first.tensor)].strategy}): "
            "the observer choices are applied to this run's format"
        )
    return notes


@dataclass(frozen=True)
class Restored:
    """What importing a file into an analysis gave: the choices that apply, and notes on the
    rest (entries this run did not analyse or whose observer gave no qparams here, other weights,
    other formats)."""

    choices: Choices
    notes: list[str]


def restore(data: bytes | str, analysis: Analysis, name: str = "the file") -> Restored:
    """Import an Observer Lab file's choices into ``analysis``: the file is validated, its entries
    for tensors this run analysed are checked against the analysis's model facts, and what it
    cannot restore is listed, not silently dropped."""
    lab_file = load(data, name)
    analysed = set(analysis.keys())
    fitting = replace(lab_file, entries=[e for e in lab_file.entries if (e.layer, e.tensor) in analysed])
    apply_choices(fitting, analysis.facts)
    notes = import_differences(lab_file, analysis)
    notes += [
        f"{e.layer} · {e.tensor}: not analysed in this run"
        for e in lab_file.entries
        if (e.layer, e.tensor) not in analysed
    ]
    choices, not_run = valid_choices(analysis, fitting.choices)
    return Restored(choices, notes + not_run)
