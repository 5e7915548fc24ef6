"""A compressed checkpoint: the chosen qparams applied to the model's weights and packed by
compressed-tensors' own compressors, so that transformers (and vLLM) load the choice and run it.

``write(lab_file, model, out_dir)`` takes an Observer Lab file (``lab.export.lab_json``: the run's
choices, or a file saved by the app) and the model it was made for, and writes a Hugging Face model
directory:

- the model's weights, read one tensor at a time and written in files of at most ``FILE_BYTES``: a
  chosen layer's weight is replaced by the compressor's packed form of the lab's fake-quantized
  weight, with its scales (``lab.export.packing``); fused MoE experts are written one projection
  per expert, each packed, under the names transformers saves them by (``lab.export.experts``); the
  chosen input, output and key/value scales are added; everything else is copied as stored (an AWQ
  run's scales folded in, ``lab.awq.deploy``);
- ``config.json`` with a ``quantization_config`` (status ``compressed``; one config group per
  (scheme, observer, knobs), targeting the exact layer names, the model's other ``Linear`` layers in
  ``ignore``), the tokenizer and generation files, and ``observer_lab_checkpoint.txt`` (what was
  chosen, from which analysis, and what stayed dense and why).

The compressor quantizes the fake-quantized weight again with the same scales, which gives back the
lab's own codes (each value is a code times its scale), so a dequantized load equals the lab's
fake-quantized weight bit for bit. A setting compressed-tensors cannot express leaves its layer
dense and unquantized, with a note: never wrong numbers. The directory is written beside its
destination and renamed into place, so a refused or interrupted write leaves nothing half-done.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lab.analyse.model_facts import ModelFacts, describe_source, same_weights
from lab.export.chosen import Chosen, of_lab_file
from lab.export.compressed_tensors import CtLayer, ct_layers, kv_cache_scheme
from lab.export.experts import (
    by_fused_tensor,
    dense_stored_experts_note,
    expert_target,
    packed_experts,
    renamed_experts,
    saved_layers,
    target_experts,
)
from lab.export.lab_apply import apply_choices
from lab.export.lab_json import LabFile
from lab.export.model_dir import NOTES_FILE, files_section, move_into_place, name_weight_files
from lab.export.packing import compress_layer
from lab.export.recipe import config_groups_of
from lab.gptq.deploy import GPTQDeploy
from lab.gptq.hessians import HessianOf
from lab.provenance import provenance_lines
from lab.results import unusable_scales
from lab.runtime.scales import load_problems
from lab.scheme.stored import dense_reason, packed_format
from lab.vocab import KV_TENSORS
from sample_models.sequential import return_freed_memory

FILE_BYTES = 256 << 20
"""Largest weight file the checkpoint gets (a bigger tensor gets one of its own): what a write
holds in memory at once, twice (safetensors copies a file's tensors into bytes to write them)."""
# Files a model directory carries beside its weights that a loader or a server reads.
_SIDE_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.txt",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)
Progress = Callable[[int, int, str], None]
Read = Callable[[str], torch.Tensor]
"""A stored tensor by its key, as the checkpoint writes it."""
Pending = dict[str, tuple[CtLayer, dict[str, Any]]]


UNREACHED_BY_GPTQ = (
    "no calibration token reached it, so its run has no GPTQ for it: packed round-to-nearest with its chosen qparams "
    "(as llm-compressor leaves a module its GPTQ never saw)"
)


class CheckpointError(ValueError):
    """A checkpoint that cannot be written as asked; nothing was written."""


@dataclass(frozen=True)
class Written:
    """What ``write`` wrote: the directory, the config groups' formats and layers, the notes."""

    path: Path
    quantization_config: dict[str, Any]
    packed_layers: list[str]
    notes: list[str]


def check_fits(lab_file: LabFile, model: Any) -> ModelFacts:
    """The file's choices must be for this model's weights and fit its layers; a transformed
    analysis's qparams belong to another model. One ``CheckpointError`` naming the problem."""
    here = describe_source(model)
    if not same_weights(lab_file.source, here):
        raise CheckpointError(
            f"the choices were made for the model {lab_file.source.get('name')!r}, not for {here.get('name')!r} "
            "(other weights by fingerprint)"
        )
    if lab_file.config.get("transform"):
        raise CheckpointError(
            "the choices were made on transformed tensors (a rotation or smoothing): their qparams belong to the "
            "transformed model, not to this one"
        )
    facts = ModelFacts.of(model, with_kv=any(e.tensor in KV_TENSORS for e in lab_file.entries))
    try:
        apply_choices(lab_file, facts)
    except ValueError as err:
        raise CheckpointError(str(err)) from None
    bad = [f"{e.layer} {e.tensor}: {why}" for e in lab_file.entries for why in unusable_scales(e.qparams)]
    if bad:
        raise CheckpointError(f"scales that are NaN, infinite, zero or negative: {'; '.join(bad)}")
    return facts


def _plan(chosen: list[Chosen], facts: ModelFacts, notes: list[str]) -> list[CtLayer]:
    """The chosen layers compressed-tensors can express; the rest, and layers that are not
    ``Linear`` (the type its compressors take), stay dense with a note."""
    linear = []
    for entry in chosen:
        why = dense_reason(entry.spec, entry.tensor, facts.layer_types.get(entry.layer))
        if why is None:
            linear.append(entry)
        else:
            notes.append(f"{entry.layer} {entry.tensor}: {why}")
    dense_before = len(notes)
    layers = ct_layers(linear, notes)
    notes[dense_before:] = [
        note.replace("; not exported", "; stays dense and unquantized") for note in notes[dense_before:]
    ]
    return layers


def check_served(layers: list[CtLayer], facts: ModelFacts, experts: Iterable[str] = ()) -> None:
    """The packed layers must load as the lab computed them in a server that fuses layers (vLLM,
    SGLang: ``lab.runtime``): every fused group packed whole, in one scheme, sharing the scales the
    server keeps one of; ``experts`` (saved expert layers) run as one kernel per experts module.
    One ``CheckpointError`` line per group that would not; nothing is written."""
    packed = {
        layer.layer: {
            tensor: (entry.spec, entry.qparams) for tensor, entry in layer.entries.items() if tensor in layer.args
        }
        for layer in layers
    }
    linear = [name for name, kind in facts.layer_types.items() if kind == "Linear"]
    problems = load_problems(packed, list(dict.fromkeys([*linear, *experts])))
    if problems:
        raise CheckpointError(
            "a server that fuses layers (vLLM, SGLang) would load this checkpoint wrong:\n  - "
            + "\n  - ".join(problems)
        )


def quantization_config(
    lab_file: LabFile, facts: ModelFacts, saved_experts: dict[str, str] | None = None
) -> tuple[dict[str, Any], list[CtLayer], dict[str, torch.Tensor], list[str]]:
    """The ``quantization_config`` the checkpoint's ``config.json`` gets, the layers it packs, the
    key/value scale tensors and the notes (what stays dense and why). Groups are the recipe's
    (``lab.export.recipe``): one per scheme, observer and knobs, exact layer names; each group's
    ``format`` is the compressor compressed-tensors itself picks for a Linear layer with that scheme.
    Experts are packed under the names transformers saves them by (``saved_experts``,
    ``Model.saved_expert_names``; ``lab.export.experts``): fused experts' projections renamed, a
    checkpoint that stores them so (listed under those names) as it is; either targeted as experts."""
    notes: list[str] = []
    saved_experts = saved_experts or {}
    chosen = of_lab_file(lab_file.entries)
    renamed = renamed_experts(saved_experts, facts.layer_types)
    layers = saved_layers(_plan(chosen, facts, notes), renamed, notes)
    shapes = facts.layer_shapes | {saved: facts.layer_shapes[view] for view, saved in renamed.items()}
    config_groups, _ = config_groups_of(layers, shapes, notes)
    layers = [layer for layer in layers if layer.args]
    check_served(layers, facts, saved_experts.values())
    unloadable = dense_stored_experts_note(saved_experts, facts.layer_types, {layer.layer for layer in layers})
    notes += [] if unloadable is None else [unloadable]
    try:
        target_experts(config_groups, set(saved_experts.values()))
    except ValueError as err:
        raise CheckpointError(str(err)) from None
    formats = set()
    for scheme in config_groups.values():
        scheme["format"] = packed_format(scheme)
        formats.add(scheme["format"])
    kv_scheme, kv_tensors = kv_cache_scheme(chosen, notes, facts.attention_blocks)
    if not config_groups and kv_scheme is None:
        raise CheckpointError("nothing chosen has a compressed-tensors form:\n  - " + "\n  - ".join(notes))
    packed = {layer.layer for layer in layers}
    quantized = sorted(f for f in formats if f != "dense")
    config = {
        "quant_method": "compressed-tensors",
        "format": quantized[0] if len(quantized) == 1 else ("dense" if not quantized else "mixed-precision"),
        "quantization_status": "compressed",
        "config_groups": config_groups,
        "ignore": [name for name, kind in facts.layer_types.items() if kind == "Linear" and name not in packed],
        "kv_cache_scheme": kv_scheme,
    }
    return config, layers, kv_tensors, list(dict.fromkeys(notes))


def _converted(
    read: Read, key: str, pending: Pending, gptq: GPTQDeploy | None, awq: Any, experts: dict[str, Any]
) -> dict[str, torch.Tensor]:
    """One stored tensor as the checkpoint holds it: a chosen layer's weight packed with its
    scales, fused experts (``experts``: ``by_fused_tensor``) as their projections packed, anything
    else as ``read`` gives it (as stored, or with AWQ's scales folded in)."""
    name, _, local = key.rpartition(".")
    tensor = read(key)
    if key in experts:

        def compress(layer: CtLayer, scheme: dict[str, Any], weight: torch.Tensor) -> dict[str, torch.Tensor]:
            scales = None if awq is None else awq.input_scales(layer.entries["weight"].layer)
            return compress_layer(layer, scheme, weight, gptq, scales)

        return packed_experts(key, tensor, experts[key], pending, compress)
    if local == "weight" and name in pending:
        layer, scheme = pending.pop(name)
        scales = None if awq is None else awq.input_scales(name)
        return {f"{name}.{k}": v for k, v in compress_layer(layer, scheme, tensor, gptq, scales).items()}
    return {key: tensor.contiguous()}


def _bytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _files(
    model: Any,
    read: Read,
    pending: Pending,
    first: dict[str, torch.Tensor],
    progress: Progress | None,
    gptq: GPTQDeploy | None,
    awq: Any,
    experts: dict[str, Any],
) -> Iterator[dict[str, torch.Tensor]]:
    """The checkpoint's tensors, ``first`` then every stored one, in files of at most
    ``FILE_BYTES`` (a bigger tensor alone): what is held at once is one file being written."""
    keys = model.stored_keys()
    current, size = dict(first), _bytes(first)
    for done, key in enumerate(keys, start=1):
        converted = _converted(read, key, pending, gptq, awq, experts)
        added = _bytes(converted)
        if current and size + added > FILE_BYTES:
            yield current
            current, size = {}, 0
        current |= converted
        size += added
        if progress is not None:
            progress(done, len(keys), key)
    if current:
        yield current


def _side_files(model: Any, into: Path) -> dict[str, Any]:
    """Copy the tokenizer and generation files; returns the model's config as a dict."""
    source = Path(str(model.source))
    if source.is_dir():
        for name in _SIDE_FILES:
            if (source / name).is_file():
                shutil.copy2(source / name, into / name)
        config_file = source / "config.json"
        if config_file.is_file():
            return json.loads(config_file.read_text(encoding="utf-8"))
    elif model.supports_activations:
        model.tokenizer().save_pretrained(str(into))
    if model.config is None:
        raise CheckpointError(f"{model.name} has no transformers config, so no loadable checkpoint can be written")
    return model.config.to_dict()


def _notes_text(lab_file: LabFile, config: dict[str, Any], notes: Iterable[str], files: list[str]) -> str:
    lines = [
        "Observer Lab checkpoint",
        f"choices from an analysis of {lab_file.source.get('name')!r}, made {lab_file.created} "
        f"(observers {lab_file.library_version}, ranked by {lab_file.metric})",
        *provenance_lines(lab_file.provenance),
        "",
        "chosen:",
        *(f"  {e.layer} {e.tensor}: {e.observer} on {e.spec.dtype} {e.spec.strategy}" for e in lab_file.entries),
        "",
        f"quantization_config format: {config['format']}",
        *(f"  {name}: {g['format']}, {len(g['targets'])} layer(s)" for name, g in config["config_groups"].items()),
    ]
    notes = list(notes)
    if notes:
        lines += ["", "notes:", *(f"  {note}" for note in notes)]
    lines += files_section(files)
    return "\n".join(lines) + "\n"


def _noting(hessians: HessianOf, rounded: list[str]) -> HessianOf:
    """``hessians``, noting in ``rounded`` each layer it answers with the empty Hessian of a layer no
    token reached (``lab.gptq.hessians.unreached``: GPTQ packs it round-to-nearest) as the weights
    are packed, so each Hessian is read once."""

    def hessian(layer: str) -> torch.Tensor | None:
        kept = hessians(layer)
        if kept is not None and not kept.numel():
            rounded.append(layer)
        return kept

    return hessian


def _prepare(out_dir: Path, overwrite: bool) -> None:
    if out_dir.exists() and not out_dir.is_dir():
        raise CheckpointError(f"{out_dir} exists and is not a directory")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not overwrite:
        raise CheckpointError(f"{out_dir} is not empty; pass --overwrite to replace it")
    out_dir.parent.mkdir(parents=True, exist_ok=True)


def write(
    lab_file: LabFile,
    model: Any,
    out_dir: str | Path,
    *,
    overwrite: bool = False,
    progress: Progress | None = None,
    facts: ModelFacts | None = None,
    hessians: HessianOf | None = None,
    awq: Any = None,
) -> Written:
    """Write the compressed checkpoint of ``lab_file``'s choices on ``model`` into ``out_dir``.

    Refused (``CheckpointError``, nothing written): a non-empty ``out_dir`` without ``overwrite``,
    choices made for other weights, qparams that do not fit the model, a non-positive or
    non-finite scale. ``progress(done, total, key)`` is called after each stored tensor.
    ``facts`` is ``check_fits``'s answer for this file and model when the caller already has it
    (it hashes every weight file). A run made with GPTQ packs each chosen weight's GPTQ codes, made
    again from ``hessians`` (``lab.gptq.hessians``; a layer no token reached round-to-nearest, with a
    note). An AWQ deployment (``awq``, ``lab.awq.deploy``'s, read
    by its ``fold``, ``input_scales`` and ``lines``; ``lab_file`` with its choices in it) folds its
    scales into each stored tensor as it is read; with GPTQ, a balance layer's GPTQ runs on its
    folded weight and smoothed inputs' Hessian."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    _prepare(out, overwrite)
    facts = check_fits(lab_file, model) if facts is None else facts
    rounded: list[str] = []
    try:
        gptq = GPTQDeploy.of_config(lab_file.config, None if hessians is None else _noting(hessians, rounded))
    except ValueError as err:
        raise CheckpointError(str(err)) from None
    saved_experts = model.saved_expert_names()
    config, layers, kv_tensors, notes = quantization_config(lab_file, facts, saved_experts)
    read = model.stored if awq is None else lambda key: awq.fold(key, model.stored(key))
    notes = notes if awq is None else [*awq.lines(), *notes]
    layer_of = {expert_target(name): name for name in saved_experts.values()}
    scheme_of = {layer_of.get(t, t): scheme for scheme in config["config_groups"].values() for t in scheme["targets"]}
    pending = {layer.layer: (layer, scheme_of[layer.layer]) for layer in layers}
    experts = by_fused_tensor(renamed_experts(saved_experts, facts.layer_types), pending)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        model_config = _side_files(model, staging)
        # Scales without a weight of their own in the files (key/value states, the activations of
        # a layer whose weight was not chosen) open the first file.
        first = dict(kv_tensors)
        for key in [k for k, (layer, _) in pending.items() if "weight" not in layer.args]:
            layer, scheme = pending.pop(key)
            first |= {f"{key}.{k}": v for k, v in compress_layer(layer, scheme, None).items()}
        parts: list[tuple[Path, list[str]]] = []
        for tensors in _files(model, read, pending, first, progress, gptq, awq, experts):
            part = staging / f"part-{len(parts)}.safetensors"
            save_file(tensors, str(part), metadata={"format": "pt"})
            parts.append((part, list(tensors)))
            del tensors
            return_freed_memory()
        if pending:
            raise CheckpointError(f"layers without a stored weight: {', '.join(pending)}")
        notes += [f"{name} weight: {UNREACHED_BY_GPTQ}" for name in rounded]
        name_weight_files(staging, parts)
        model_config["quantization_config"] = config
        (staging / "config.json").write_text(json.dumps(model_config, indent=2, sort_keys=True), encoding="utf-8")
        files = sorted(entry.name for entry in staging.iterdir())
        (staging / NOTES_FILE).write_text(_notes_text(lab_file, config, notes, files), encoding="utf-8")
        move_into_place(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return Written(out, config, [layer.layer for layer in layers], notes)
