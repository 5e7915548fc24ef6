"""The Observer Lab JSON file: chosen qparams written bit-exact, read back and checked.

A file (``format = "observer-lab-qparams"``, ``version = 2``; version 1 is still read, see
``FORMAT_VERSION``) records, per analysed layer and tensor kind, the chosen observer with its knobs,
the full ``QuantSpec``, the qparams (bit-exact: ``QParams.to_dict``) and the metrics of the chosen
and runner-up observers, plus the model's source with a sha256 per weight file. It is validated against
``lab/export/schema/observer_lab.schema.json`` on write and on read, so a broken file is rejected with
one error that lists every problem, and nothing is applied partially.

Paired in-memory and file forms, as safetensors has them: ``save`` -> bytes / ``save_file``,
``load`` (bytes or text) / ``load_file``. A file is applied to a model or an analysis by
``lab.export.lab_apply``.
"""

from __future__ import annotations

import datetime as _dt
import json
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import observers as ob
from lab.analyse.analysis import Analysis, TensorAnalysis, ToolResult
from lab.analyse.served import ServedChoice
from lab.export.json_values import json_safe, metrics_from_json, metrics_to_json
from lab.results import Choices, check_metric, export_selection, rank
from lab.vocab import DEFAULT_METRIC, GLOBAL_SCALE_CONVENTION
from observers.suite import SuiteResult

FORMAT_NAME = "observer-lab-qparams"
FORMAT_VERSION = 2
"""The version this lab writes. Version 1 wrote every tensor's values (``data``, beside ``bytes_b64``);
version 2 writes a tensor of more than ``observers.qparams.DATA_LIMIT`` (4,096) elements as its bytes
only. Nothing else differs, and a tensor reads from its bytes or else its values: both read alike."""
READ_VERSIONS = (1, FORMAT_VERSION)
"""Another version (a newer lab's, whose fields may mean other things) is refused whole."""
SCHEMA_PATH = Path(__file__).resolve().parent / "schema" / "observer_lab.schema.json"


# ---------------------------------------------------------------- writing


def _observer_record(result: SuiteResult) -> dict[str, Any]:
    return {
        "observer": result.name,
        "knobs": json_safe(result.knobs),
        "metrics": metrics_to_json(result.metrics),
        "seconds": float(result.seconds),
    }


def _tool_record(run: ToolResult) -> dict[str, Any]:
    """What one tool would produce by default on the entry's tensor (its profile and result)."""
    record: dict[str, Any] = {"tool": run.tool, "error": run.result.error}
    if run.profile is not None:
        record |= {"observer": run.profile.observer, "spec": run.profile.spec.to_dict()}
        record |= {"notes": list(run.profile.notes), "knobs": json_safe(run.result.knobs)}
    if run.result.qparams is not None:
        record |= {"metrics": metrics_to_json(run.result.metrics), "qparams": run.result.qparams.to_dict()}
    return record


def _fused_record(entry: TensorAnalysis, served: ServedChoice) -> dict[str, Any]:
    """How a server runs a tensor fused with others: the fused unit, its members, the scale they
    share, the member whose range set it, and the chosen observer's metrics with the layer's own
    scales (what fusion costs this layer)."""
    return {
        "fused": {
            "unit": entry.served.unit,
            "members": list(entry.served.members),
            "shares": entry.served.collapse,
            "set_by": served.set_by,
            "per_layer_metrics": metrics_to_json(served.own.metrics),
        }
    }


def _entry_record(entry: TensorAnalysis, served: ServedChoice, metric: str) -> dict[str, Any]:
    chosen = served.result
    others = [r for r in rank(entry, metric) if r.name != chosen.name]
    tools = {"tools": [_tool_record(run) for run in entry.tool_results]} if entry.tool_results else {}
    fused = _fused_record(entry, served) if entry.served is not None else {}
    return (
        {
            "layer": entry.layer,
            "tensor": entry.tensor,
            "tensor_shape": list(entry.shape),
            "spec": entry.spec.to_dict(),
            "chosen": _observer_record(chosen),
            "runner_up": _observer_record(others[0]) if others else None,
            "qparams": chosen.qparams.to_dict(),
        }
        | tools
        | fused
        | ({} if entry.metrics_tokens is None else {"metrics_tokens": entry.metrics_tokens})
    )


def uncalibrated_record(entry: TensorAnalysis) -> dict[str, Any]:
    """How a file records a tensor that saw no calibration tokens: named, with no qparams."""
    return {"layer": entry.layer, "tensor": entry.tensor, "num_observed_tokens": 0}


def build_document(
    analysis: Analysis,
    choices: Mapping[tuple[str, str], str],
    metric: str = DEFAULT_METRIC,
    allow_uncalibrated: bool = False,
    provenance: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The Observer Lab JSON document (a dict) for ``choices`` (``{(layer, tensor): observer}``,
    e.g. from ``lab.results.choose``) over ``analysis``, validated against the schema.

    Activation tensors that saw no calibration tokens make this raise, unless
    ``allow_uncalibrated`` records them in ``uncalibrated`` (without qparams). ``provenance``: who
    asked for the file and when, and the kept run it came from (``lab.provenance``).
    """
    check_metric(metric)
    selected, missing = export_selection(analysis, choices, allow_uncalibrated)
    document = {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "created": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "library": {"name": "observers", "version": ob.__version__},
        "source": json_safe(analysis.source),
        "metric": metric,
        "config": json_safe(analysis.config.to_dict()),
        **({} if analysis.calibration is None else {"calibration": json_safe(analysis.calibration)}),
        "entries": [_entry_record(entry, served, metric) for entry, served in selected],
        "uncalibrated": [uncalibrated_record(e) for e in missing],
    } | ({} if provenance is None else {"provenance": dict(provenance)})
    if any(served.result.qparams.global_scale is not None for _, served in selected):
        document["global_scale_convention"] = GLOBAL_SCALE_CONVENTION
    problems = schema_problems(document)
    if problems:
        raise ValueError("internal error, the exported document breaks the schema:\n  - " + "\n  - ".join(problems))
    return document


def dumps(document: dict[str, Any]) -> str:
    """A document as text: strict JSON (no NaN/inf literals), compact separators, since most of a
    file is long arrays of numbers."""
    return json.dumps(document, allow_nan=False, separators=(",", ":"))


def save(
    analysis: Analysis,
    choices: Mapping[tuple[str, str], str],
    metric: str = DEFAULT_METRIC,
    allow_uncalibrated: bool = False,
    provenance: Mapping[str, Any] | None = None,
) -> bytes:
    """The Observer Lab JSON of ``choices`` as UTF-8 bytes (what the app offers for download)."""
    return dumps(build_document(analysis, choices, metric, allow_uncalibrated, provenance)).encode("utf-8")


def save_file(
    analysis: Analysis,
    choices: Mapping[tuple[str, str], str],
    path: str | Path,
    metric: str = DEFAULT_METRIC,
    allow_uncalibrated: bool = False,
    provenance: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Write the Observer Lab JSON of ``choices`` to ``path``; returns the written document.
    Nothing is written when the choices cannot be exported."""
    document = build_document(analysis, choices, metric, allow_uncalibrated, provenance)
    Path(path).write_text(dumps(document), encoding="utf-8")
    return document


# ---------------------------------------------------------------- reading


@cache
def schema() -> dict[str, Any]:
    """The JSON Schema of the Observer Lab file."""
    return json.loads(SCHEMA_PATH.read_text(encoding="utf-8"))


def _where(path: Iterable[Any]) -> str:
    return "/".join(str(p) for p in path) or "(top level)"


def schema_problems(document: Any) -> list[str]:
    """Every schema violation of ``document``, one line each, sorted by where it occurs."""
    import jsonschema

    validator = jsonschema.Draft202012Validator(schema())
    errors = sorted(validator.iter_errors(document), key=lambda e: [str(p) for p in e.absolute_path])
    return [f"{_where(e.absolute_path)}: {e.message}" for e in errors]


@dataclass(frozen=True)
class LabEntry:
    """One (layer, tensor) of a loaded file: the restored spec, choice and qparams."""

    layer: str
    tensor: str
    tensor_shape: tuple[int, ...]
    spec: ob.QuantSpec
    observer: str
    knobs: dict[str, Any]
    qparams: ob.QParams
    metrics: dict[str, float | None]
    runner_up: dict[str, Any] | None
    fused: dict[str, Any] | None = None
    """How a fusing server runs it with others (the file's ``fused`` record), None when alone."""


@dataclass(frozen=True)
class LabFile:
    """A validated Observer Lab file."""

    version: int
    created: str
    library_version: str
    source: dict[str, Any]
    metric: str
    entries: list[LabEntry]
    config: dict[str, Any] = field(default_factory=dict)
    provenance: dict[str, Any] | None = None
    """Who asked for the file and when, and the kept run it came from (``lab.provenance``)."""

    @property
    def choices(self) -> Choices:
        """``{(layer, tensor): observer}``, the form ``lab.results.choose`` returns."""
        return {(e.layer, e.tensor): e.observer for e in self.entries}

    @property
    def qparams(self) -> dict[tuple[str, str], ob.QParams]:
        return {(e.layer, e.tensor): e.qparams for e in self.entries}


def _decode(data: bytes | str, where: str) -> str:
    if isinstance(data, str):
        return data
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"{where} is not a UTF-8 text file (is it a binary file?)") from None


def _restore_entry(index: int, raw: dict[str, Any], problems: list[str]) -> LabEntry | None:
    where = f"entries/{index} ({raw['layer']} {raw['tensor']})"
    found = len(problems)
    try:
        spec = ob.QuantSpec.from_dict(raw["spec"])
    except (ValueError, TypeError) as err:
        problems.append(f"{where}: bad spec: {err}")
    try:
        qparams = ob.QParams.from_dict(raw["qparams"])
    except (ValueError, TypeError, RuntimeError) as err:
        problems.append(f"{where}: bad qparams: {err}")
    observer = raw["chosen"]["observer"]
    if observer not in ob.available():
        problems.append(f"{where}: observer {observer!r} is not in this library (known: {', '.join(ob.available())})")
    if len(problems) > found:
        return None
    return LabEntry(
        layer=raw["layer"],
        tensor=raw["tensor"],
        tensor_shape=tuple(raw["tensor_shape"]),
        spec=spec,
        observer=observer,
        knobs=dict(raw["chosen"]["knobs"]),
        qparams=qparams,
        metrics=metrics_from_json(raw["chosen"]["metrics"]),
        runner_up=raw["runner_up"],
        fused=raw.get("fused"),
    )


def parse_document(document: Any) -> LabFile:
    """A ``LabFile`` from a parsed JSON document; one ``ValueError`` lists every problem, except for
    a version this lab does not read: one line, since the rest of such a file cannot be judged."""
    ours = isinstance(document, dict) and document.get("format") == FORMAT_NAME and "version" in document
    if ours and document["version"] not in READ_VERSIONS:
        readable = " and ".join(map(str, READ_VERSIONS))
        raise ValueError(
            f"the Observer Lab file has version {document['version']!r}; this lab reads versions {readable} "
            "(if a newer lab wrote it, update observers to read it)"
        )
    problems = schema_problems(document)
    if problems:
        raise ValueError("invalid Observer Lab file:\n  - " + "\n  - ".join(problems))
    seen: Counter = Counter((raw["layer"], raw["tensor"]) for raw in document["entries"])
    problems = [f"entries: {layer} {tensor} appears {n} times" for (layer, tensor), n in seen.items() if n > 1]
    entries = [_restore_entry(i, raw, problems) for i, raw in enumerate(document["entries"])]
    if problems:
        raise ValueError("invalid Observer Lab file:\n  - " + "\n  - ".join(problems))
    return LabFile(
        version=document["version"],
        created=document["created"],
        library_version=document["library"]["version"],
        source=document["source"],
        metric=document["metric"],
        entries=entries,
        config=document.get("config") or {},
        provenance=document.get("provenance"),
    )


def as_lab_file(
    analysis: Analysis,
    choices: Mapping[tuple[str, str], str],
    metric: str = DEFAULT_METRIC,
    allow_uncalibrated: bool = False,
    provenance: Mapping[str, Any] | None = None,
) -> LabFile:
    """The file ``save`` would write, read back: what the deployment exports take, so a choice made
    in the app reaches them exactly as a saved file does."""
    document = build_document(analysis, choices, metric, allow_uncalibrated, provenance)
    return parse_document(json.loads(dumps(document)))


def load(data: bytes | str, name: str = "the file") -> LabFile:
    """Read and validate an Observer Lab file given as bytes or text (``name`` names it in errors)."""
    text = _decode(data, name)
    try:
        document = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"{name} is not JSON: {err}") from None
    return parse_document(document)


def load_file(path: str | Path) -> LabFile:
    """Read and validate the Observer Lab file at ``path``."""
    try:
        data = Path(path).read_bytes()
    except OSError as err:
        raise ValueError(f"cannot read {path}: {err.strerror or err}") from None
    return load(data, str(path))
