"""A whole run on disk, so that a kept run opens as if it had just run, without recomputing.

A run directory holds ``run.json`` (how to open the model again, and per analysis of the run: the
model's facts, the run's config, and per analysed tensor its spec and every observer's result:
metrics, knobs, errors, as served and each layer's own, the GPTQ rows and each tool's default) and
``tensors.safetensors`` (every tensor those name: qparams, what the pages draw of an activation,
activation order's group index, SmoothQuant's scales, the tensors a weight observer took as knobs),
and ``hessian-N.safetensors``, one per distinct GPTQ Hessian. Nothing is pickled: a run directory
is read as data.

Its bytes do not grow with the calibration data: of an activation's sample (up to ``SAMPLE_BYTES``
of tokens, what its metrics were computed on) a run keeps what the pages draw
(``lab.analyse.kept_values``: the histogram of every value, each channel's extremes, a seeded
subset of at most ``KEPT_VALUES`` values of tokens), and no weight: ``load(directory, weight_of)``
reads one with ``weight_of(layer)`` when a page asks, through the run's transform (a Hadamard
rotation from its seed, SmoothQuant's kept scales). A GPTQ Hessian (``in²`` floats a layer, once
per distinct input) is kept whole: it is what makes a GPTQ weight again (the Ranges page, the
checkpoint), short of calibrating again; the history's byte bound counts it. Each is a file of its
own, written one at a time and read when asked for, so neither saving nor opening a run holds
more than one (a 7B model's are 28 GB).

Version 3; a version 2 directory (its Hessians among the tensors) and a version 1 directory (whole
samples, transformed weights kept too) read as they did.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch

import observers as ob
from lab.analyse.analysis import Analysis, Served, TensorAnalysis, ToolResult
from lab.analyse.kept_values import KeptValues, ValueHistogram, kept_rows, summarise
from lab.analyse.model_facts import ModelFacts
from lab.analyse.run_config import RunConfig
from lab.analyse.tools import ToolProfile
from lab.calibrate.observed import weight_view
from lab.export.json_values import json_safe, metrics_from_json, metrics_to_json
from lab.gptq import hessians
from lab.gptq.layer import GPTQRow
from observers.suite import SuiteResult

FORMAT = "observer-lab-run"
VERSION = 3
READS = (1, 2, VERSION)
"""The versions ``load`` reads: 1 kept whole samples and transformed weights, 1 and 2 their
Hessians among the tensors; each is read as it is."""
HESSIAN_FILE = re.compile(r"hessian-\d+\.safetensors")
"""How a version 3 run names a Hessian's file (anything else a document names is refused)."""
DOCUMENT, TENSORS = "run.json", "tensors.safetensors"
SUFFIX = ".run"
_QPARAM_FIELDS = ("scale", "zero_point", "min_val", "max_val", "global_scale")
_PARTS = ("analysis", "transformed", "unpropagated")

WeightOf = Callable[[str], torch.Tensor]
"""Reads a layer's weight from the model the run was made on (when a page asks for it)."""


class RunFileError(ValueError):
    """A run directory that cannot be read (missing, another format or version, broken)."""


@dataclass(frozen=True)
class KeptRun:
    """A run as kept: its ``analysis``, the same run through the settings' transform
    (``transformed``) and, with propagation, calibrated on the float model (``unpropagated``);
    ``request`` is how to open its model again (the app's ``ModelRequest`` fields)."""

    analysis: Analysis
    transformed: Analysis | None = None
    unpropagated: Analysis | None = None
    request: dict[str, Any] = field(default_factory=dict)


def directory_for(lab_path: str | os.PathLike) -> Path:
    """Where the CLI keeps the run it saved as ``lab_path``: ``x.json`` → ``x.run``."""
    path = Path(lab_path)
    return path.with_name(path.stem + SUFFIX)


class _Tensors:
    """The tensors of one run file, each under a key the document names: a tensor whose contents
    were put before (a knob every observer of a layer took, the one input q, k and v read) is
    stored once, and each in memory of its own (safetensors stores no shared memory): a view is
    copied, a tensor owning its memory (a Hessian) is not. ``kept`` memoizes what is kept of an
    activation's sample, by the sample (q, k and v read one)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.found: dict[str, torch.Tensor] = {}
        self.keys: dict[tuple, str] = {}
        self.kept: dict[int, tuple[torch.Tensor, KeptValues]] = {}
        self.hessians: dict[int, tuple[object, str]] = {}

    def hessian(self, entry: TensorAnalysis) -> str | None:
        """``entry``'s Hessian written into a file of its own in ``folder`` (read from where it
        waits, one at a time; a source already written, q's for k and v, is named again)."""
        source = entry.hessian_source
        if source is None:
            return None
        found = self.hessians.get(id(source))
        if found is None or found[0] is not source:
            name = f"hessian-{len(self.hessians)}.safetensors"
            hessians.write_file(self.folder / name, entry.hessian)
            found = self.hessians[id(source)] = (source, name)
        return found[1]

    def put(self, key: str, tensor: torch.Tensor | None) -> str | None:
        if tensor is None:
            return None
        stored = tensor.detach().cpu().contiguous()
        raw = stored.reshape(-1).view(torch.uint8).numpy()
        content = (str(stored.dtype), tuple(stored.shape), hashlib.sha256(raw).hexdigest())
        if content not in self.keys:
            whole = stored.storage_offset() == 0 and stored.untyped_storage().nbytes() == stored.nbytes
            self.found[key], self.keys[content] = stored if whole else stored.clone(), key
        return self.keys[content]


def save(run: KeptRun, directory: Path, beside: Mapping[str, bytes] | None = None) -> None:
    """Write ``run`` as a run directory at ``directory``, with the files ``beside`` (name: bytes; the
    run's lab JSON). Staged beside it and moved into place, so a crash leaves no half-written run;
    a directory already there is replaced only when it is a run this lab wrote."""
    from safetensors.torch import save_file

    from lab.export.model_dir import move_into_place

    if directory.exists() and not is_run(directory):
        raise RunFileError(f"{directory} exists and is not a run this lab wrote: it is left alone")
    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", dir=directory.parent))
    try:
        tensors = _Tensors(staging)
        analyses = {
            part: None if analysis is None else _analysis(analysis, part[0], tensors)
            for part, analysis in zip(_PARTS, (run.analysis, run.transformed, run.unpropagated), strict=True)
        }
        document = {"format": FORMAT, "version": VERSION, "request": json_safe(run.request), **analyses}
        (staging / DOCUMENT).write_text(json.dumps(document, allow_nan=False), encoding="utf-8")
        save_file(tensors.found, str(staging / TENSORS))
        for name, data in (beside or {}).items():
            (staging / name).write_bytes(data)
        move_into_place(staging, directory)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def is_run(directory: Path) -> bool:
    """Whether ``directory`` holds a run this lab wrote (its document says so)."""
    try:
        return json.loads((directory / DOCUMENT).read_text(encoding="utf-8")).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def _analysis(analysis: Analysis, key: str, tensors: _Tensors) -> dict[str, Any]:
    return {
        "facts": json_safe(asdict(analysis.facts)),
        "config": json_safe(analysis.config.to_dict()),
        "seconds": analysis.seconds,
        "warnings": list(analysis.warnings),
        "calibration": json_safe(analysis.calibration),
        "entries": [_entry(entry, f"{key}{i}", tensors) for i, entry in enumerate(analysis.entries)],
    }


def _entry(entry: TensorAnalysis, key: str, tensors: _Tensors) -> dict[str, Any]:
    record = {
        "layer": entry.layer,
        "tensor": entry.tensor,
        "spec": entry.spec.to_dict(),
        "total_shape": None if entry.total_shape is None else list(entry.total_shape),
        "rank": entry.rank,
        "metrics_tokens": entry.metrics_tokens,
        "g_idx": tensors.put(f"{key}.g_idx", entry.g_idx),
        "hessian": tensors.hessian(entry),
        "smoothing": tensors.put(f"{key}.smoothing", entry.smoothing),
        "results": [_result(r, f"{key}.r{j}", tensors) for j, r in enumerate(entry.results)],
        "per_layer": [_result(r, f"{key}.own{j}", tensors) for j, r in enumerate(entry.per_layer)],
        "served": None if entry.served is None else asdict(entry.served),
        "gptq": [json_safe(asdict(row)) for row in entry.gptq],
        "tools": [_tool(run, f"{key}.t{j}", tensors) for j, run in enumerate(entry.tool_results)],
    }
    return record | _values(entry, key, tensors)


def _values(entry: TensorAnalysis, key: str, tensors: _Tensors) -> dict[str, Any]:
    """What is kept of an activation's sample (``sample``: its kept rows, ``values``: its histogram
    and extremes; none of a weight, read from the model again)."""
    if callable(entry.source):
        return {"sample": None, "values": None}
    data = entry.data
    if data.numel() == 0:  # no token: nothing to draw
        return {"sample": tensors.put(f"{key}.sample", data), "values": None}
    if id(data) not in tensors.kept:
        tensors.kept[id(data)] = (kept_rows(data), entry.kept_values or summarise(data))
    rows, kept = tensors.kept[id(data)]
    histogram = kept.histogram
    values = {"lo": histogram.lo, "hi": histogram.hi, "histogram": tensors.put(f"{key}.histogram", histogram.counts)}
    values["extremes"] = tensors.put(f"{key}.extremes", kept.extremes)
    return {"sample": tensors.put(f"{key}.sample", rows), "values": values}


def _result(result: SuiteResult, key: str, tensors: _Tensors) -> dict[str, Any]:
    knobs = {
        name: {"tensor": tensors.put(f"{key}.knob.{name}", value)}
        if isinstance(value, torch.Tensor)
        else json_safe(value)
        for name, value in result.knobs.items()
    }
    record: dict[str, Any] = {
        "name": result.name,
        "metrics": metrics_to_json(result.metrics),
        "seconds": result.seconds,
        "knobs": knobs,
        "tokens": result.num_observed_tokens,
        "error": result.error,
        "qparams": None,
    }
    qp = result.qparams
    if qp is not None:
        fields = {name: tensors.put(f"{key}.{name}", getattr(qp, name)) for name in _QPARAM_FIELDS}
        extras = {name: tensors.put(f"{key}.extra.{name}", value) for name, value in qp.extras.items()}
        record["qparams"] = {**fields, "extras": extras, "kind": qp.kind}
    return record


def _tool(run: ToolResult, key: str, tensors: _Tensors) -> dict[str, Any]:
    profile = run.profile
    found = None
    if profile is not None:
        found = {"observer": profile.observer, "knobs": json_safe(profile.knobs), "spec": profile.spec.to_dict()}
        found["notes"] = list(profile.notes)
    return {"tool": run.tool, "profile": found, "result": _result(run.result, key, tensors)}


def load(directory: Path, weight_of: WeightOf) -> KeptRun:
    """The run a run directory holds; a weight not kept is read by ``weight_of`` when asked for.
    One ``RunFileError`` when the directory is not a run this lab wrote in a version it reads."""
    from safetensors.torch import load_file

    try:
        document = json.loads((directory / DOCUMENT).read_text(encoding="utf-8"))
        tensors = load_file(str(directory / TENSORS))
    except (OSError, ValueError) as err:
        raise RunFileError(f"{directory} is not a readable run: {err}") from None
    if not isinstance(document, dict) or document.get("format") != FORMAT or document.get("version") not in READS:
        raise RunFileError(f"{directory} is not an Observer Lab run of version {' or '.join(map(str, READS))}")
    hessian_of = partial(_hessian_reader, directory) if document.get("version") == VERSION else partial(_get, tensors)
    try:
        found = [
            None if document[part] is None else _read(document[part], tensors, weight_of, hessian_of) for part in _PARTS
        ]
        request = dict(document["request"])
    except (KeyError, TypeError, ValueError) as err:
        raise RunFileError(f"{directory} holds a broken run: {type(err).__name__}: {err}") from None
    if found[0] is None:
        raise RunFileError(f"{directory} holds no analysis")
    return KeptRun(*found, request=request)


def read_request(directory: Path) -> dict[str, Any]:
    """How to open the model of the run at ``directory`` again (without reading its tensors)."""
    try:
        return dict(json.loads((directory / DOCUMENT).read_text(encoding="utf-8"))["request"])
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise RunFileError(f"{directory} is not a readable run: {err}") from None


def _hessian_reader(directory: Path, name: str | None) -> Callable[[], torch.Tensor] | None:
    """What reads a version 3 run's Hessian file ``name`` (None: the entry has none) when asked."""
    if name is None:
        return None
    if not isinstance(name, str) or not HESSIAN_FILE.fullmatch(name):
        raise ValueError(f"{name!r} is not a Hessian file a run names")
    return partial(_read_hessian, directory / name)


def _read_hessian(path: Path) -> torch.Tensor:
    try:
        return hessians.read_file(path)
    except (OSError, ValueError) as err:
        raise RunFileError(f"{path} holds no Hessian ({err}): the run was changed since it was opened") from None


def _read(
    document: dict[str, Any],
    tensors: dict[str, torch.Tensor],
    weight_of: WeightOf,
    hessian_of: Callable[[str | None], torch.Tensor | Callable[[], torch.Tensor] | None],
) -> Analysis:
    facts = document["facts"]
    shapes = {name: tuple(shape) for name, shape in facts["layer_shapes"].items()}
    blocks = facts.get("attention_blocks")
    kv = {name: tuple(shape) for name, shape in facts.get("kv_shapes", {}).items()}
    model_facts = ModelFacts(facts["source"], facts["layer_types"], shapes, tuple(blocks) if blocks else None, kv)
    config = RunConfig.from_dict(document["config"])
    entries = [_read_entry(record, tensors, weight_of, config, hessian_of) for record in document["entries"]]
    warnings, calibration = list(document["warnings"]), document["calibration"]
    return Analysis(model_facts, config, entries, document["seconds"], warnings, calibration)


def _read_entry(
    record: dict[str, Any],
    tensors: dict[str, torch.Tensor],
    weight_of: WeightOf,
    config: RunConfig,
    hessian_of: Callable[[str | None], torch.Tensor | Callable[[], torch.Tensor] | None],
) -> TensorAnalysis:
    sample, smoothing = record["sample"], _get(tensors, record.get("smoothing"))
    source = tensors[sample] if sample is not None else partial(_weight, weight_of, record["layer"], config, smoothing)
    shape = record["total_shape"]
    entry = TensorAnalysis(
        layer=record["layer"],
        tensor=record["tensor"],
        spec=ob.QuantSpec.from_dict(record["spec"]),
        source=source,
        results=[_read_result(r, tensors) for r in record["results"]],
        g_idx=_get(tensors, record["g_idx"]),
        total_shape=None if shape is None else tuple(shape),
        rank=record["rank"],
    )
    entry.tool_results = [_read_tool(t, tensors) for t in record["tools"]]
    entry.gptq = [GPTQRow(**{**row, "notes": tuple(row["notes"])}) for row in record["gptq"]]
    entry.hessian_source = hessian_of(record["hessian"])
    entry.metrics_tokens = record["metrics_tokens"]
    entry.served = (
        None
        if record["served"] is None
        else Served(**{**record["served"], "members": tuple(record["served"]["members"])})
    )
    entry.per_layer = [_read_result(r, tensors) for r in record["per_layer"]]
    entry.smoothing = smoothing
    values = record.get("values")
    if values is not None:
        histogram = ValueHistogram(values["lo"], values["hi"], tensors[values["histogram"]])
        entry.kept_values = KeptValues(histogram, tensors[values["extremes"]])
    return entry


def _weight(weight_of: WeightOf, layer: str, config: RunConfig, smoothing: torch.Tensor | None) -> torch.Tensor:
    """A kept run's weight, read from its model as the run's transform shows it."""
    return weight_view(config, weight_of(layer), smoothing)


def _read_result(record: dict[str, Any], tensors: dict[str, torch.Tensor]) -> SuiteResult:
    knobs = {
        name: tensors[value["tensor"]] if isinstance(value, dict) and set(value) == {"tensor"} else value
        for name, value in record["knobs"].items()
    }
    qp = None
    found = record["qparams"]
    if found is not None:
        fields = {name: _get(tensors, found[name]) for name in _QPARAM_FIELDS}
        extras = {name: tensors[key] for name, key in found["extras"].items()}
        qp = ob.QParams(**fields, extras=extras, kind=found["kind"])
    metrics = metrics_from_json(record["metrics"])
    return SuiteResult(record["name"], qp, metrics, record["seconds"], knobs, record["tokens"], record["error"])


def _read_tool(record: dict[str, Any], tensors: dict[str, torch.Tensor]) -> ToolResult:
    found = record["profile"]
    profile = None
    if found is not None:
        spec = ob.QuantSpec.from_dict(found["spec"])
        profile = ToolProfile(record["tool"], found["observer"], dict(found["knobs"]), spec, tuple(found["notes"]))
    return ToolResult(record["tool"], profile, _read_result(record["result"], tensors))


def _get(tensors: dict[str, torch.Tensor], key: str | None) -> torch.Tensor | None:
    return None if key is None else tensors[key]
