"""Export and import of chosen qparams: the Observer Lab JSON file and a compressed-tensors export.

Observer Lab JSON (``format = "observer-lab-qparams"``, ``version = 1``) records, per analysed
layer and tensor kind, the chosen observer with its knobs, the full ``QuantSpec``, the qparams
(bit-exact: ``QParams.to_dict``) and the metrics of the chosen and runner-up observers, plus the
model source with a sha256 per weight file. The file is validated against
``lab/schema/observer_lab.schema.json`` on load, so a broken file is rejected with one error
that lists every problem, and nothing is applied partially.

The compressed-tensors export writes what a model's ``config.json`` needs
(``quantization_config``) and the qparam tensors under compressed-tensors' names, so a model can be
compressed or served with the observer the lab chose. Settings that format cannot express are
listed in ``notes`` instead of being approximated.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import IO, Any

import torch

import observers as ob
from lab.pipeline import KV_TENSORS, TENSOR_KINDS, Analysis, TensorAnalysis
from observers.suite import SuiteResult

FORMAT_NAME = "observer-lab-qparams"
FORMAT_VERSION = 1
SCHEMA_PATH = Path(__file__).resolve().parent / "schema" / "observer_lab.schema.json"
NONFINITE = {math.inf: "inf", -math.inf: "-inf"}
CT_CONFIG_FILE = "quantization_config.json"
CT_TENSORS_FILE = "qparams.safetensors"
CT_NOTES_FILE = "observer_lab_notes.txt"

Choices = dict[tuple[str, str], str]


# ---------------------------------------------------------------- model source


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    """Hex sha256 of a file, read in chunks so a multi-GB shard never sits in memory."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def _weight_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    try:
        from sample_models.stores import checkpoint_files

        return list(checkpoint_files(path))
    except (ImportError, ValueError):
        return sorted([*path.glob("*.safetensors"), *path.glob("*.bin")])


def describe_source(model: Any) -> dict[str, Any]:
    """``{"kind", "name", "path", "id", "files": [{"name", "sha256"}]}`` of an opened model.

    ``sample_models`` models expose ``name`` and ``source`` (a path, or a phrase for the synthetic
    built-ins) but no file list, so the weight files under an existing path are found here and
    hashed. ``kind`` is ``builtin`` (MiniLM and the synthetic decoders, whose weights come from a
    fixed seed and have no files), ``hub``, ``directory`` or ``file``.
    """
    from sample_models import BUILTIN_NAMES

    name = str(getattr(model, "name", "") or "")
    source = str(getattr(model, "source", "") or name)
    path = Path(source)
    builtin = name in BUILTIN_NAMES
    if not path.exists():
        kind = "builtin" if builtin else "hub"
        return {"kind": kind, "name": name or source, "path": None, "id": name or source, "files": []}
    files = _weight_files(path)
    root = path if path.is_dir() else path.parent
    if builtin:
        kind = "builtin"
    elif "/" in name and name != source:
        kind = "hub"
    else:
        kind = "directory" if path.is_dir() else "file"
    return {
        "kind": kind,
        "name": name or path.name,
        "path": str(path.resolve()),
        "id": name if kind in ("builtin", "hub") else None,
        "files": [{"name": str(f.relative_to(root)), "sha256": sha256_file(f)} for f in files],
    }


# ---------------------------------------------------------------- JSON helpers


def _finite_or_string(value: Any) -> Any:
    """JSON has no inf/NaN: non-finite floats become the strings "inf", "-inf", "nan"."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else NONFINITE[value]
    return value


def _float_from_json(value: Any) -> Any:
    if isinstance(value, str) and value in ("inf", "-inf", "nan"):
        return float(value)
    return value


def _json_safe(value: Any) -> Any:
    """Knob values and metrics as JSON values (tuples become lists, non-finite floats strings)."""
    if isinstance(value, Mapping):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if isinstance(value, torch.Tensor):
        return _json_safe(value.tolist())
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return _finite_or_string(value)
    return str(value)


def _metrics_to_json(metrics: Mapping[str, float | None]) -> dict[str, Any]:
    return {k: _finite_or_string(None if v is None else float(v)) for k, v in metrics.items()}


def _metrics_from_json(metrics: Mapping[str, Any]) -> dict[str, float | None]:
    return {k: _float_from_json(v) for k, v in metrics.items()}


# ---------------------------------------------------------------- choices


def _ranked(entry: TensorAnalysis, metric: str) -> list[SuiteResult]:
    """Results that have a value for ``metric``, best first (ties keep suite order)."""
    sign = 1.0 if ob.HIGHER_IS_BETTER[metric] else -1.0
    usable = [r for r in entry.results if r.error is None and r.metrics.get(metric) is not None]
    return sorted(usable, key=lambda r: -sign * r.metrics[metric])


def uncalibrated(analysis: Analysis) -> list[TensorAnalysis]:
    """Activation entries that saw no calibration tokens (e.g. MoE experts the router never
    picked): any qparams for them would be made up, which is how NaN or garbage scales reach
    checkpoints."""
    return [e for e in analysis.entries if e.tensor != "weight" and e.data.numel() == 0]


def _refuse_uncalibrated(analysis: Analysis, allow_uncalibrated: bool) -> list[dict[str, Any]]:
    """Raise unless ``allow_uncalibrated``; else the records that mark those tensors uncalibrated."""
    missing = uncalibrated(analysis)
    if missing and not allow_uncalibrated:
        listed = "\n  - ".join(f"{e.layer} {e.tensor}" for e in missing)
        raise ValueError(
            "refusing to export activation qparams: these tensors saw no calibration tokens:\n  - "
            f"{listed}\nCalibrate with more or other text, or pass allow_uncalibrated=True "
            "(CLI: --allow-uncalibrated) to record them as uncalibrated with no qparams."
        )
    return [{"layer": e.layer, "tensor": e.tensor, "num_observed_tokens": 0} for e in missing]


def _check_choices(analysis: Analysis, choices: Mapping[tuple[str, str], str]) -> list[tuple[TensorAnalysis, str]]:
    """The (entry, observer) pairs to export in analysis order; one error listing every bad choice."""
    problems = []
    known = {(e.layer, e.tensor): e for e in analysis.entries}
    for key, observer in choices.items():
        entry = known.get(tuple(key))
        if entry is None:
            problems.append(f"{key[0]} {key[1]}: not in the analysis")
            continue
        result = next((r for r in entry.results if r.name == observer), None)
        if result is None:
            problems.append(f"{key[0]} {key[1]}: observer {observer!r} was not run")
        elif result.qparams is None:
            problems.append(f"{key[0]} {key[1]}: observer {observer!r} failed: {result.error}")
    if problems:
        raise ValueError("cannot export these choices:\n  - " + "\n  - ".join(problems))
    if not choices:
        raise ValueError("nothing to export: no (layer, tensor) has a chosen observer")
    return [(e, choices[(e.layer, e.tensor)]) for e in analysis.entries if (e.layer, e.tensor) in choices]


def _observer_record(result: SuiteResult) -> dict[str, Any]:
    return {
        "observer": result.name,
        "knobs": _json_safe(result.knobs),
        "metrics": _metrics_to_json(result.metrics),
        "seconds": float(result.seconds),
    }


def _entry_record(entry: TensorAnalysis, observer: str, metric: str) -> dict[str, Any]:
    chosen = entry.result(observer)
    others = [r for r in _ranked(entry, metric) if r.name != observer]
    return {
        "layer": entry.layer,
        "tensor": entry.tensor,
        "tensor_shape": list(entry.data.shape),
        "spec": entry.spec.to_dict(),
        "chosen": _observer_record(chosen),
        "runner_up": _observer_record(others[0]) if others else None,
        "qparams": chosen.qparams.to_dict(),
    }


def build_document(
    analysis: Analysis,
    choices: Mapping[tuple[str, str], str],
    metric: str = "sqnr_db",
    source: dict | None = None,
    allow_uncalibrated: bool = False,
) -> dict[str, Any]:
    """The Observer Lab JSON document (a dict) for ``choices`` over ``analysis``.

    Activation tensors that saw no calibration tokens make this raise, unless
    ``allow_uncalibrated`` records them in ``uncalibrated`` (without qparams).
    """
    if metric not in ob.HIGHER_IS_BETTER:
        raise ValueError(f"unknown metric {metric!r}; choose from {', '.join(ob.HIGHER_IS_BETTER)}")
    missing = _refuse_uncalibrated(analysis, allow_uncalibrated)
    selected = _check_choices(analysis, choices)
    return {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "created": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "library": {"name": "observers", "version": ob.__version__},
        "source": _json_safe(source if source is not None else analysis.source),
        "metric": metric,
        "config": _json_safe(analysis.config.to_dict()),
        "entries": [_entry_record(entry, observer, metric) for entry, observer in selected],
        "uncalibrated": missing,
    }


def _write_text(text: str, path_or_file: str | Path | IO[str]) -> None:
    if isinstance(path_or_file, (str, Path)):
        Path(path_or_file).write_text(text, encoding="utf-8")
    else:
        path_or_file.write(text)


def export_json(
    analysis: Analysis,
    choices: Mapping[tuple[str, str], str],
    path_or_file: str | Path | IO[str],
    metric: str = "sqnr_db",
    source: dict | None = None,
    allow_uncalibrated: bool = False,
) -> dict[str, Any]:
    """Write the Observer Lab JSON of ``choices`` (``{(layer, tensor): observer}``, e.g. from
    ``lab.pipeline.choose``) to a path or text file; returns the written document.

    ``source`` overrides ``analysis.source`` (pass ``describe_source(model)`` for file hashes).
    The document is validated against the schema before anything is written.
    """
    document = build_document(analysis, choices, metric, source, allow_uncalibrated)
    problems = schema_problems(document)
    if problems:
        raise ValueError("internal error, the exported document breaks the schema:\n  - " + "\n  - ".join(problems))
    _write_text(dumps_json(document), path_or_file)
    return document


# ---------------------------------------------------------------- import


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

    @property
    def choices(self) -> Choices:
        """``{(layer, tensor): observer}``, the form ``lab.pipeline.choose`` returns."""
        return {(e.layer, e.tensor): e.observer for e in self.entries}

    @property
    def qparams(self) -> dict[tuple[str, str], ob.QParams]:
        return {(e.layer, e.tensor): e.qparams for e in self.entries}


def _read_text(path_or_file: str | Path | IO) -> str:
    if isinstance(path_or_file, (str, Path)):
        try:
            return Path(path_or_file).read_text(encoding="utf-8")
        except OSError as err:
            raise ValueError(f"cannot read {path_or_file}: {err.strerror or err}") from None
    text = path_or_file.read()
    return text.decode("utf-8") if isinstance(text, bytes) else text


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
        metrics=_metrics_from_json(raw["chosen"]["metrics"]),
        runner_up=raw["runner_up"],
    )


def parse_document(document: Any) -> LabFile:
    """A ``LabFile`` from a parsed JSON document; one ``ValueError`` lists every problem."""
    if isinstance(document, dict) and document.get("version") not in (None, FORMAT_VERSION):
        version = document.get("version")
        problems = [f"version: this library reads version {FORMAT_VERSION}, the file has version {version!r}"]
        problems += [p for p in schema_problems(document) if not p.startswith("version:")]
        raise ValueError("invalid Observer Lab file:\n  - " + "\n  - ".join(problems))
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
    )


def load_json(path_or_file: str | Path | IO) -> LabFile:
    """Read and validate an Observer Lab file (path, text or binary file object)."""
    text = _read_text(path_or_file)
    try:
        document = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"not a JSON file: {err}") from None
    return parse_document(document)


def _layer_shapes(model: Any, entries: Sequence[LabEntry]) -> dict[str, tuple[int, ...]]:
    """``{layer name: weight shape (out, in, ...)}`` from ``model.layers()``, plus ``{attention
    block: (kv_heads, head_dim)}`` when the file has key/value entries and the model can run."""
    shapes = {info.name: tuple(info.shape) for info in model.layers()}
    if any(e.tensor in KV_TENSORS for e in entries):
        try:
            blocks = model.attention_blocks()
        except (AttributeError, ValueError):
            blocks = []
        shapes |= {block: tuple(model.kv_shape(block)) for block in blocks}
    return shapes


def expected_qparam_shape(
    spec: ob.QuantSpec, tensor: str, weight_shape: tuple[int, ...], g_idx: torch.Tensor | None = None
) -> tuple[int, ...] | None:
    """The qparam shape ``spec`` gives on this layer's weight, input or output, or on an
    attention block's keys or values (``tensor`` ``k``/``v``, ``weight_shape`` then
    ``(kv_heads, head_dim)``); None when it depends on the calibration data (per-token).
    Computed on a meta tensor, so no memory is used."""
    if spec.strategy == "token":
        return None
    if tensor in KV_TENSORS:
        heads, head_dim = weight_shape
        shape, kind = (1, heads, 1, head_dim), "attention"
    elif tensor == "weight":
        shape, kind = weight_shape, "weight"
    else:
        width = weight_shape[1] if tensor == "input" else weight_shape[0]
        shape, kind = (1, width), "activation"
    probe = torch.empty(shape, device="meta")
    return tuple(ob.flatten(probe, spec, kind, g_idx=g_idx).qparam_shape)


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


def apply_choices(lab_file: LabFile, model: Any) -> dict[str, dict[tuple[str, str], Any]]:
    """Check a loaded file against ``model`` and restore its choices.

    Returns ``{"choices": {(layer, tensor): observer}, "qparams": {...: QParams},
    "specs": {...: QuantSpec}, "knobs": {...: dict}}``. A layer the model lacks, a weight shape
    or qparam shape that does not fit the layer: one ``ValueError`` listing every problem, and
    nothing is returned.
    """
    shapes = _layer_shapes(model, lab_file.entries)
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


# ---------------------------------------------------------------- compressed-tensors

# Element formats with a compressed-tensors equivalent: (type, num_bits). uint formats map onto
# CT's signed ints by shifting the zero point by 2^(bits-1), which is exact (same scale, same grid).
_CT_ELEMENTS: dict[str, tuple[str, int]] = {
    "int2": ("int", 2),
    "int3": ("int", 3),
    "int4": ("int", 4),
    "int8": ("int", 8),
    "uint4": ("int", 4),
    "uint8": ("int", 8),
    "fp8_e4m3": ("float", 8),
    "fp6_e2m3": ("float", 6),
    "fp4_e2m1": ("float", 4),
}
# Block formats: (num_bits, group_size, scale_dtype, strategy) as compressed-tensors' MX/NVFP4 presets.
_CT_BLOCKS: dict[str, tuple[int, int, str, str]] = {
    "mxfp4": (4, 32, "torch.uint8", "group"),
    "mxfp6_e2m3": (6, 32, "torch.uint8", "group"),
    "mxfp8_e4m3": (8, 32, "torch.uint8", "group"),
    "nvfp4": (4, 16, "torch.float8_e4m3fn", "tensor_group"),
}
# Our observers that llm-compressor has under another name.
CT_OBSERVER_NAMES = {
    "minmax": "static_minmax",
    "memoryless_minmax": "memoryless_minmax",
    "moving_average_minmax": "minmax",
    "mse_grid": "memoryless_mse",
    "mse_grid_moving_average": "mse",
    "imatrix_mse": "imatrix_mse",
}
_CT_ARG_NAMES = {"weight": "weights", "input": "input_activations", "output": "output_activations"}
_ACTIVATION_STRATEGIES = ("tensor", "group", "token")


def ct_args(spec: ob.QuantSpec, tensor: str) -> tuple[dict[str, Any] | None, list[str]]:
    """compressed-tensors ``QuantizationArgs`` fields for ``spec`` on a ``tensor`` kind, or
    ``(None, reasons)`` when that format cannot express it."""
    reasons = []
    fmt = spec.format
    block = _CT_BLOCKS.get(spec.dtype)
    element = _CT_ELEMENTS.get(spec.dtype)
    if block is None and element is None:
        if fmt.kind == "cast":
            reasons.append(f"dtype {spec.dtype} is a plain cast (a placeholder), not a compressed-tensors scheme")
        else:
            reasons.append(f"compressed-tensors has no {spec.dtype} element type")
    if spec.reduce_range:
        reasons.append("reduce_range has no compressed-tensors equivalent")
    if spec.has_custom_range:
        reasons.append("a custom quant_min/quant_max has no compressed-tensors equivalent")
    if fmt.kind == "int" and spec.symmetric and spec.scale_rule != "half_range":
        reasons.append(f"scale_rule {spec.scale_rule!r} differs from compressed-tensors' (max - min) / 2 divisor")
    kv = tensor in KV_TENSORS
    if spec.strategy == "channel" and not kv and (tensor != "weight" or spec.channel_axis("weight") != 0):
        reasons.append("compressed-tensors has channel scales for weight output channels (ch_axis 0) only")
    if tensor not in ("weight", *KV_TENSORS) and spec.strategy not in _ACTIVATION_STRATEGIES:
        reasons.append(f"compressed-tensors has no {spec.strategy} strategy for activations")
    if block is not None and spec.group_size != block[1]:
        reasons.append(f"{spec.dtype} with group size {spec.group_size} (compressed-tensors uses {block[1]})")
    if reasons:
        return None, reasons
    args: dict[str, Any] = {"symmetric": spec.symmetric, "dynamic": spec.dynamic}
    if block is not None:
        bits, group, scale_dtype, strategy = block
        args |= {"num_bits": bits, "type": "float", "strategy": strategy, "group_size": group}
        args["scale_dtype"] = scale_dtype
        args["zp_dtype"] = scale_dtype
        if spec.dynamic and strategy == "tensor_group":
            args["dynamic"] = "local"
        return args, reasons
    kind, bits = element
    strategy = "attn_head" if kv and spec.strategy == "channel" else spec.strategy
    args |= {"num_bits": bits, "type": kind, "strategy": strategy}
    if spec.strategy == "group":
        args["group_size"] = spec.group_size
    if spec.strategy == "block":
        args["block_structure"] = list(spec.block_size)
    if spec.strategy == "token" and not spec.dynamic:
        args["dynamic"] = True
        reasons.append("per-token scales are dynamic in compressed-tensors: written as dynamic, no scales saved")
    return args, reasons


def _ct_observer(name: str, knobs: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    defaults = ob.knobs(name) if name in ob.available() else {}
    changed = {k: v for k, v in knobs.items() if k != "ignore_nonfinite" and defaults.get(k) != v}
    return CT_OBSERVER_NAMES.get(name, name), _json_safe(changed)


@dataclass
class _CtLayer:
    layer: str
    args: dict[str, dict[str, Any] | None]
    observers: dict[str, str]
    knobs: dict[str, dict[str, Any]]
    entries: dict[str, TensorAnalysis]


def _ct_layers(selected: list[tuple[TensorAnalysis, str]], notes: list[str]) -> list[_CtLayer]:
    layers: dict[str, _CtLayer] = {}
    for entry, observer in selected:
        if entry.tensor in KV_TENSORS:
            continue
        item = layers.setdefault(entry.layer, _CtLayer(entry.layer, {}, {}, {}, {}))
        args, reasons = ct_args(entry.spec, entry.tensor)
        if args is not None and entry.g_idx is not None:
            args, reasons = None, ["activation-ordered groups (g_idx) were removed from compressed-tensors 0.20"]
        notes.extend(
            f"{entry.layer} {entry.tensor}: {reason}" + ("; not exported" if args is None else "") for reason in reasons
        )
        if args is None:
            continue
        result = entry.result(observer)
        item.args[entry.tensor] = args
        item.observers[entry.tensor] = observer
        item.knobs[entry.tensor] = result.knobs
        item.entries[entry.tensor] = entry
    return [item for item in layers.values() if item.args]


def _group_key(item: _CtLayer) -> str:
    return json.dumps({kind: item.args.get(kind) for kind in TENSOR_KINDS}, sort_keys=True)


def _scheme(members: list[_CtLayer], targets: list[str], notes: list[str]) -> dict[str, Any]:
    scheme: dict[str, Any] = {"targets": targets}
    for tensor in TENSOR_KINDS:
        args = members[0].args.get(tensor)
        if args is None:
            scheme[_CT_ARG_NAMES[tensor]] = None
            continue
        chosen = [(f"{m.layer} {tensor}", m.observers[tensor], m.knobs[tensor]) for m in members]
        scheme[_CT_ARG_NAMES[tensor]] = _record_observer(
            args, chosen, tensor, "its config group", "compressed-tensors has one observer per group", notes
        )
    return scheme


def _record_observer(
    args: dict[str, Any],
    chosen: list[tuple[str, str, Mapping[str, Any]]],
    scope: str,
    recorded_in: str,
    why: str,
    notes: list[str],
) -> dict[str, Any]:
    """``args`` with the one observer compressed-tensors records for all of ``chosen``
    (``(where, observer, knobs)`` of each tensor): the most common choice, first on ties. Fully
    dynamic args record none. Notes name an observer llm-compressor lacks, and every tensor whose
    own choice differs (its saved qparams are still those of its choice)."""
    observer = Counter(name for _, name, _ in chosen).most_common(1)[0][0]
    if args["dynamic"] is not True:  # static, or NVFP4 "local" with a calibrated global scale
        knobs = next(knobs for _, name, knobs in chosen if name == observer)
        ct_name, kwargs = _ct_observer(observer, knobs)
        args = {**args, "observer": ct_name, "observer_kwargs": kwargs}
    if observer not in CT_OBSERVER_NAMES:
        notes.append(f"{scope} observer {observer!r} has no llm-compressor equivalent; recorded by its lab name")
    notes.extend(
        f"{where}: chose {name!r} but {recorded_in} records {observer!r} ({why}; the saved qparams are those "
        "of the choice)"
        for where, name, _ in chosen
        if name != observer
    )
    return args


def _ct_zero_point(qp: ob.QParams, spec: ob.QuantSpec, num_bits: int) -> torch.Tensor:
    """Zero points as compressed-tensors' signed int8; uint formats shift by ``2^(bits-1)``."""
    zero_point = qp.zero_point.to(torch.int32)
    if not spec.format.signed:
        zero_point = zero_point - 2 ** (num_bits - 1)
    return zero_point.to(torch.int8)


def _ct_tensors(item: _CtLayer, args_by_kind: dict[str, dict[str, Any]]) -> dict[str, torch.Tensor]:
    """The qparam tensors of one layer, named and typed as compressed-tensors stores them."""
    tensors: dict[str, torch.Tensor] = {}
    for tensor, entry in item.entries.items():
        args = args_by_kind[tensor]
        qp = entry.result(item.observers[tensor]).qparams.to("cpu")
        base = f"{item.layer}.{tensor}"
        if qp.global_scale is not None:
            tensors[f"{base}_global_scale"] = qp.global_scale.float().reshape(1).contiguous()
        if args["dynamic"] is not False:
            continue
        if args.get("scale_dtype") == "torch.uint8":
            codes = qp.extras.get("scale_exponent")
            if codes is None:
                raise ValueError(f"{item.layer} {tensor}: {entry.spec.dtype} qparams lack extras['scale_exponent']")
            scale = codes.to(torch.uint8)
        elif args.get("scale_dtype") == "torch.float8_e4m3fn":
            scale = qp.scale.float().to(torch.float8_e4m3fn)
        else:
            scale = qp.scale.float()
        tensors[f"{base}_scale"] = scale.contiguous()
        if not args["symmetric"]:
            tensors[f"{base}_zero_point"] = _ct_zero_point(qp, entry.spec, args["num_bits"]).contiguous()
    return tensors


def _kv_cache_scheme(
    selected: list[tuple[TensorAnalysis, str]], notes: list[str], attention_blocks: Sequence[str] | None
) -> tuple[dict[str, Any] | None, dict[str, torch.Tensor]]:
    """compressed-tensors' ``kv_cache_scheme`` (one ``QuantizationArgs`` for every attention
    block's keys and values) and the ``<block>.k_scale`` / ``<block>.v_scale`` tensors, shaped as
    compressed-tensors registers them: ``(1,)`` per tensor, ``(kv_heads, 1, 1)`` per head."""
    kv = [(entry, observer) for entry, observer in selected if entry.tensor in KV_TENSORS]
    if not kv:
        return None, {}
    analysed = {entry.layer for entry, _ in kv}
    missing = [block for block in attention_blocks or [] if block not in analysed]
    if missing:
        notes.append(
            "kv_cache_scheme applies to every attention block, but these were not analysed and have no "
            f"k_scale/v_scale: {', '.join(missing)}"
        )
    args, reasons = ct_args(kv[0][0].spec, "k")
    notes.extend(f"key/value states: {reason}" + ("; not exported" if args is None else "") for reason in reasons)
    if args is None:
        return None, {}
    chosen = [(f"{entry.layer} {entry.tensor}", name, entry.result(name).knobs) for entry, name in kv]
    args = _record_observer(
        args, chosen, "kv", "kv_cache_scheme", "compressed-tensors has one KV-cache observer", notes
    )
    tensors: dict[str, torch.Tensor] = {}
    if args["dynamic"] is not False:
        return args, tensors
    for entry, chosen in kv:
        qp = entry.result(chosen).qparams.to("cpu")
        shape = (-1, 1, 1) if args["strategy"] == "attn_head" else (1,)
        base = f"{entry.layer}.{entry.tensor}"
        tensors[f"{base}_scale"] = qp.scale.float().reshape(shape).contiguous()
        if not args["symmetric"]:
            tensors[f"{base}_zero_point"] = _ct_zero_point(qp, entry.spec, args["num_bits"]).reshape(shape).contiguous()
    return args, tensors


def build_compressed_tensors(
    analysis: Analysis,
    choices: Mapping[tuple[str, str], str],
    layer_types: Mapping[str, str] | None = None,
    allow_uncalibrated: bool = False,
    attention_blocks: Sequence[str] | None = None,
) -> dict[str, Any]:
    """``{"quantization_config", "tensors", "notes"}`` for ``choices`` without writing files.

    Chosen key/value states (tensors ``k``/``v`` of attention blocks) become the config's
    ``kv_cache_scheme`` and ``<block>.k_scale`` / ``<block>.v_scale`` tensors; given the model's
    ``attention_blocks``, the notes list those left without scales.

    Activation tensors that saw no calibration tokens make this raise unless
    ``allow_uncalibrated``; they are then left out and listed in the notes.

    Layers with identical compressed-tensors args share one config group. Its targets are the
    layer names, or ``["Linear"]`` when ``layer_types`` (``{name: module type}`` of the whole
    model) shows that one group holds every analysed layer and all of them are Linear; the
    model's other Linear layers then go to ``ignore``.
    """
    notes = [
        f"{m['layer']} {m['tensor']}: saw no calibration tokens; uncalibrated, no qparams written"
        for m in _refuse_uncalibrated(analysis, allow_uncalibrated)
    ]
    selected = _check_choices(analysis, choices)
    items = _ct_layers(selected, notes)
    kv_cache_scheme, kv_tensors = _kv_cache_scheme(selected, notes, attention_blocks)
    if not items and kv_cache_scheme is None:
        raise ValueError("no chosen setting has a compressed-tensors equivalent:\n  - " + "\n  - ".join(notes))
    groups: dict[str, list[_CtLayer]] = {}
    for item in items:
        groups.setdefault(_group_key(item), []).append(item)
    ignore: list[str] = []
    config_groups: dict[str, Any] = {}
    analysed = {item.layer for item in items}
    one_linear_group = (
        layer_types is not None and len(groups) == 1 and all(layer_types.get(n) == "Linear" for n in analysed)
    )
    tensors: dict[str, torch.Tensor] = dict(kv_tensors)
    for index, members in enumerate(groups.values()):
        if one_linear_group:
            targets = ["Linear"]
            ignore = [n for n, t in layer_types.items() if t == "Linear" and n not in analysed]
        else:
            targets = [m.layer for m in members]
        scheme = _scheme(members, targets, notes)
        config_groups[f"group_{index}"] = scheme
        args_by_kind = {k: scheme[_CT_ARG_NAMES[k]] for k in TENSOR_KINDS if scheme[_CT_ARG_NAMES[k]] is not None}
        for m in members:
            tensors.update(_ct_tensors(m, args_by_kind))
    notes.append(
        "format 'dense', status 'frozen': weights are not packed; the qparams are stored beside the dense "
        "weights (compress with compressed-tensors' ModelCompressor to get a packed checkpoint)"
    )
    config = {
        "quant_method": "compressed-tensors",
        "format": "dense",
        "quantization_status": "frozen",
        "config_groups": config_groups,
        "ignore": ignore,
        "kv_cache_scheme": kv_cache_scheme,
    }
    return {"quantization_config": config, "tensors": tensors, "notes": list(dict.fromkeys(notes))}


def export_compressed_tensors(
    analysis: Analysis,
    choices: Mapping[tuple[str, str], str],
    out_dir: str | Path,
    layer_types: Mapping[str, str] | None = None,
    allow_uncalibrated: bool = False,
    attention_blocks: Sequence[str] | None = None,
) -> dict[str, Any]:
    """Write ``out_dir/quantization_config.json`` (``{"quantization_config": ...}``, ready to
    merge into a model's config.json), ``out_dir/qparams.safetensors`` (``<module>.weight_scale``,
    ``.weight_zero_point`` for asymmetric schemes only, ``.weight_global_scale``, ``.input_scale``,
    ..., ``<attention block>.k_scale`` / ``.v_scale``) and ``out_dir/observer_lab_notes.txt``
    (what could not be expressed).

    Returns ``{"quantization_config", "notes", "tensors": {name: {"dtype", "shape"}}, "files"}``.
    """
    from safetensors.torch import save_file

    built = build_compressed_tensors(analysis, choices, layer_types, allow_uncalibrated, attention_blocks)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = {"config": out / CT_CONFIG_FILE, "tensors": out / CT_TENSORS_FILE, "notes": out / CT_NOTES_FILE}
    files["config"].write_text(
        json.dumps({"quantization_config": built["quantization_config"]}, indent=2, allow_nan=False), encoding="utf-8"
    )
    metadata = {"format": "pt", "producer": f"observer-lab {ob.__version__}"}
    save_file(built["tensors"], str(files["tensors"]), metadata=metadata)
    files["notes"].write_text("".join(f"{note}\n" for note in built["notes"]), encoding="utf-8")
    return {
        "quantization_config": built["quantization_config"],
        "notes": built["notes"],
        "tensors": {
            name: {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}
            for name, t in built["tensors"].items()
        },
        "files": {key: str(path) for key, path in files.items()},
    }


def dumps_json(document: dict[str, Any]) -> str:
    """A document as the text ``export_json`` writes: strict JSON (no NaN/inf literals), compact
    separators, since most of a file is long arrays of numbers."""
    return json.dumps(document, allow_nan=False, separators=(",", ":"))


__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "LabEntry",
    "LabFile",
    "apply_choices",
    "uncalibrated",
    "build_compressed_tensors",
    "build_document",
    "ct_args",
    "describe_source",
    "dumps_json",
    "expected_qparam_shape",
    "export_compressed_tensors",
    "export_json",
    "load_json",
    "parse_document",
    "schema",
    "schema_problems",
    "sha256_file",
]
