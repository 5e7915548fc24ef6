"""The compressed-tensors export: the chosen qparams as a model's ``quantization_config`` and
tensors under compressed-tensors' names, so a model can be compressed or served with the observer
the lab chose.

``build(analysis, choices)`` gives a ``CompressedTensorsExport`` (config, tensors, notes) without
touching a disk; ``.to_zip()`` is the in-memory form the app offers for download, ``.write(dir)``
(or ``save_file``) the file form: ``quantization_config.json`` (``{"quantization_config": ...}``,
ready to merge into config.json), ``qparams.safetensors`` and ``observer_lab_notes.txt``. Settings
compressed-tensors cannot express are listed in the notes instead of being approximated. The
model's facts (layer types for the ``Linear`` target, attention blocks for the KV-cache notes)
come from the analysis.
"""

from __future__ import annotations

import io
import json
import zipfile
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import observers as ob
from lab.analyse.analysis import Analysis
from lab.export.chosen import Chosen, of_analysis
from lab.export.json_values import json_safe
from lab.provenance import provenance_lines
from lab.results import export_selection
from lab.scheme.stored import ct_args
from lab.vocab import GLOBAL_SCALE_CONVENTION, KV_TENSORS, LAYER_TENSORS

CONFIG_FILE = "quantization_config.json"
TENSORS_FILE = "qparams.safetensors"
NOTES_FILE = "observer_lab_notes.txt"


# Our observers that llm-compressor has under another name.
CT_OBSERVER_NAMES = {
    "minmax": "static_minmax",
    "memoryless_minmax": "memoryless_minmax",
    "moving_average_minmax": "minmax",
    "mse_grid": "memoryless_mse",
    "mse_grid_moving_average": "mse",
    "imatrix_mse": "imatrix_mse",
    "nvfp4_expanded_mse": "nvfp4_expanded_mse",
    "nvfp4_expanded_imatrix": "nvfp4_expanded_imatrix",
}
CT_ARG_NAMES = {"weight": "weights", "input": "input_activations", "output": "output_activations"}


def ct_observer(name: str, knobs: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    """compressed-tensors' name for observer ``name`` and the knobs a person changed; tensors the
    lab fills from the calibration (importance, Hessian) are data, not settings, and stay out."""
    specs = ob.knob_specs(name) if name in ob.available() else {}
    settable = {k: spec.default for k, spec in specs.items() if spec.editable and k != "ignore_nonfinite"}
    changed = {k: v for k, v in knobs.items() if k in settable and settable[k] != v}
    return CT_OBSERVER_NAMES.get(name, name), json_safe(changed)


@dataclass
class CtLayer:
    """One layer's exportable tensors: compressed-tensors args and the chosen tensor (observer,
    knobs, qparams), by tensor kind."""

    layer: str
    args: dict[str, dict[str, Any] | None]
    entries: dict[str, Chosen]


def ct_layers(chosen: list[Chosen], notes: list[str]) -> list[CtLayer]:
    """The chosen layers as compressed-tensors can express them, the rest in ``notes`` (shared by the exports)."""
    layers: dict[str, CtLayer] = {}
    for entry in chosen:
        if entry.tensor in KV_TENSORS:
            continue
        item = layers.setdefault(entry.layer, CtLayer(entry.layer, {}, {}))
        args, reasons = ct_args(entry.spec, entry.tensor)
        if args is not None and entry.g_idx is not None:
            args, reasons = None, ["activation-ordered groups (g_idx) were removed from compressed-tensors 0.20"]
        notes.extend(
            f"{entry.layer} {entry.tensor}: {reason}" + ("; not exported" if args is None else "") for reason in reasons
        )
        if args is None:
            continue
        item.args[entry.tensor] = args
        item.entries[entry.tensor] = entry
    return [item for item in layers.values() if item.args]


def _group_key(item: CtLayer) -> str:
    return json.dumps({kind: item.args.get(kind) for kind in LAYER_TENSORS}, sort_keys=True)


def _scheme(members: list[CtLayer], targets: list[str], notes: list[str]) -> dict[str, Any]:
    scheme: dict[str, Any] = {"targets": targets}
    for tensor in LAYER_TENSORS:
        args = members[0].args.get(tensor)
        if args is None:
            scheme[CT_ARG_NAMES[tensor]] = None
            continue
        chosen = [(f"{m.layer} {tensor}", m.entries[tensor].observer, m.entries[tensor].knobs) for m in members]
        scheme[CT_ARG_NAMES[tensor]] = _record_observer(
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
        ct_name, kwargs = ct_observer(observer, knobs)
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


def ct_zero_point(qp: ob.QParams, spec: ob.QuantSpec, num_bits: int) -> torch.Tensor:
    """Zero points as compressed-tensors' signed int8; uint formats shift by ``2^(bits-1)``."""
    zero_point = qp.zero_point.to(torch.int32)
    if not spec.format.signed:
        zero_point = zero_point - 2 ** (num_bits - 1)
    return zero_point.to(torch.int8)


def ct_tensors(item: CtLayer, args_by_kind: dict[str, dict[str, Any]]) -> dict[str, torch.Tensor]:
    """The qparam tensors of one layer, named and typed as compressed-tensors stores them."""
    tensors: dict[str, torch.Tensor] = {}
    for tensor, entry in item.entries.items():
        args = args_by_kind[tensor]
        qp = entry.qparams.to("cpu")
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
            tensors[f"{base}_zero_point"] = ct_zero_point(qp, entry.spec, args["num_bits"]).contiguous()
    return tensors


def kv_cache_scheme(
    chosen: list[Chosen], notes: list[str], attention_blocks: Sequence[str] | None
) -> tuple[dict[str, Any] | None, dict[str, torch.Tensor]]:
    """compressed-tensors' ``kv_cache_scheme`` (one ``QuantizationArgs`` for every attention
    block's keys and values) and the ``<block>.k_scale`` / ``<block>.v_scale`` tensors, shaped as
    compressed-tensors registers them: ``(1,)`` per tensor, ``(kv_heads, 1, 1)`` per head."""
    kv = [entry for entry in chosen if entry.tensor in KV_TENSORS]
    if not kv:
        return None, {}
    analysed = {entry.layer for entry in kv}
    missing = [block for block in attention_blocks or [] if block not in analysed]
    if missing:
        notes.append(
            "kv_cache_scheme applies to every attention block, but these were not analysed and have no "
            f"k_scale/v_scale: {', '.join(missing)}"
        )
    args, reasons = ct_args(kv[0].spec, "k")
    notes.extend(f"key/value states: {reason}" + ("; not exported" if args is None else "") for reason in reasons)
    if args is None:
        return None, {}
    records = [(f"{entry.layer} {entry.tensor}", entry.observer, entry.knobs) for entry in kv]
    args = _record_observer(
        args, records, "kv", "kv_cache_scheme", "compressed-tensors has one KV-cache observer", notes
    )
    tensors: dict[str, torch.Tensor] = {}
    if args["dynamic"] is not False:
        return args, tensors
    for entry in kv:
        qp = entry.qparams.to("cpu")
        shape = (-1, 1, 1) if args["strategy"] == "attn_head" else (1,)
        base = f"{entry.layer}.{entry.tensor}"
        tensors[f"{base}_scale"] = qp.scale.float().reshape(shape).contiguous()
        if not args["symmetric"]:
            tensors[f"{base}_zero_point"] = ct_zero_point(qp, entry.spec, args["num_bits"]).reshape(shape).contiguous()
    return args, tensors


@dataclass(frozen=True)
class CompressedTensorsExport:
    """A built export: ``quantization_config`` (the dict compressed-tensors' ``QuantizationConfig``
    parses), the qparam ``tensors`` by name, and ``notes`` on what could not be expressed."""

    quantization_config: dict[str, Any]
    tensors: dict[str, torch.Tensor]
    notes: list[str]

    def files(self) -> dict[str, bytes]:
        """``{file name: bytes}`` of the three files."""
        from safetensors.torch import save

        metadata = {"format": "pt", "producer": f"observer-lab {ob.__version__}"}
        config = json.dumps({"quantization_config": self.quantization_config}, indent=2, allow_nan=False)
        return {
            CONFIG_FILE: config.encode("utf-8"),
            # Layers that read one input (q, k, v) share one result, so their qparams can be one
            # tensor under two names: safetensors refuses shared storage, so each name gets a copy.
            TENSORS_FILE: save({name: tensor.clone() for name, tensor in self.tensors.items()}, metadata=metadata),
            NOTES_FILE: "".join(f"{note}\n" for note in self.notes).encode("utf-8"),
        }

    def to_zip(self) -> bytes:
        """The three files in one zip archive (the app's download)."""
        buffer = io.BytesIO()
        with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
            for name, data in self.files().items():
                archive.writestr(name, data)
        return buffer.getvalue()

    def write(self, out_dir: str | Path) -> dict[str, str]:
        """Write the three files into ``out_dir`` (created if needed); ``{file name: path}``."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        written = {}
        for name, data in self.files().items():
            (out / name).write_bytes(data)
            written[name] = str(out / name)
        return written

    def tensor_summary(self) -> dict[str, dict[str, Any]]:
        """``{name: {"dtype", "shape"}}`` of the saved tensors."""
        return {
            name: {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}
            for name, t in self.tensors.items()
        }


def build(
    analysis: Analysis,
    choices: Mapping[tuple[str, str], str],
    allow_uncalibrated: bool = False,
    provenance: Mapping[str, Any] | None = None,
) -> CompressedTensorsExport:
    """The compressed-tensors export of ``choices`` over ``analysis``.

    Chosen key/value states (tensors ``k``/``v`` of attention blocks) become the config's
    ``kv_cache_scheme`` and ``<block>.k_scale`` / ``<block>.v_scale`` tensors; the notes list the
    model's attention blocks left without scales.

    Activation tensors that saw no calibration tokens make this raise unless
    ``allow_uncalibrated``; they are then left out and listed in the notes, which begin with who
    asked for the export (``provenance``, ``lab.provenance``).

    Layers with identical compressed-tensors args share one config group. Its targets are the
    layer names, or ``["Linear"]`` when the model's layer types show that one group holds every
    analysed layer and all of them are Linear; the model's other Linear layers then go to
    ``ignore``.
    """
    selected, missing = export_selection(analysis, choices, allow_uncalibrated)
    notes = provenance_lines(provenance)
    notes += [f"{e.layer} {e.tensor}: saw no calibration tokens; uncalibrated, no qparams written" for e in missing]
    chosen = of_analysis(selected)
    items = ct_layers(chosen, notes)
    kv_scheme, kv_tensors = kv_cache_scheme(chosen, notes, analysis.facts.attention_blocks)
    if not items and kv_scheme is None:
        raise ValueError("no chosen setting has a compressed-tensors equivalent:\n  - " + "\n  - ".join(notes))
    groups: dict[str, list[CtLayer]] = {}
    for item in items:
        groups.setdefault(_group_key(item), []).append(item)
    layer_types = analysis.facts.layer_types
    ignore: list[str] = []
    config_groups: dict[str, Any] = {}
    analysed = {item.layer for item in items}
    one_linear_group = bool(layer_types) and len(groups) == 1 and all(layer_types.get(n) == "Linear" for n in analysed)
    tensors: dict[str, torch.Tensor] = dict(kv_tensors)
    for index, members in enumerate(groups.values()):
        if one_linear_group:
            targets = ["Linear"]
            ignore = [n for n, t in layer_types.items() if t == "Linear" and n not in analysed]
        else:
            targets = [m.layer for m in members]
        scheme = _scheme(members, targets, notes)
        config_groups[f"group_{index}"] = scheme
        args_by_kind = {k: scheme[CT_ARG_NAMES[k]] for k in LAYER_TENSORS if scheme[CT_ARG_NAMES[k]] is not None}
        for m in members:
            tensors.update(ct_tensors(m, args_by_kind))
    if any(name.endswith("_global_scale") for name in tensors):
        notes.append(f"*_global_scale tensors follow {GLOBAL_SCALE_CONVENTION}")
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
        "kv_cache_scheme": kv_scheme,
    }
    return CompressedTensorsExport(config, tensors, list(dict.fromkeys(notes)))


def save(analysis: Analysis, choices: Mapping[tuple[str, str], str], allow_uncalibrated: bool = False) -> bytes:
    """The export as zip bytes (config, tensors, notes)."""
    return build(analysis, choices, allow_uncalibrated).to_zip()


def save_file(
    analysis: Analysis,
    choices: Mapping[tuple[str, str], str],
    out_dir: str | Path,
    allow_uncalibrated: bool = False,
    provenance: Mapping[str, Any] | None = None,
) -> CompressedTensorsExport:
    """Write the export into ``out_dir``; returns what was written."""
    built = build(analysis, choices, allow_uncalibrated, provenance)
    built.write(out_dir)
    return built
