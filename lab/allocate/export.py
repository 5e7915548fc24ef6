"""An allocation as a choice like any other: the Observer Lab JSON (each layer's scheme and observer,
each entry with its own spec and qparams), from which ``lab.export.checkpoint`` writes the packed
compressed-tensors checkpoint in its ``mixed-precision`` form and ``lab.export.recipe`` the
llm-compressor recipe (one config group per scheme × observer, exact layer names).

The document is each scheme's own (``lab_json.build_document`` over that scheme's analyses and the
layers the allocation gave it) with their entries put together in the model's layer order; its
``config`` says what was allocated (schemes, budget, each layer's scheme, the metrics measured on
the held-out text's measuring part and, in sample, on its scoring part, the frontier), since no
one run's settings describe a mixed choice. Layers left at ``none`` are not in it: they stay dense.
"""

from __future__ import annotations

import datetime as _dt
from collections.abc import Mapping
from typing import Any

import observers as ob
from lab.allocate.frontier import Frontier, Point
from lab.allocate.schemes import NONE, Scheme
from lab.allocate.score import Scores
from lab.export import lab_json
from lab.export.json_values import json_safe

ALLOCATION_KEY = "allocation"
"""Where a lab JSON's ``config`` holds what was allocated."""


def document(
    point: Point,
    scores: Scores,
    schemes: list[Scheme],
    frontier: Frontier | None = None,
    settings: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The Observer Lab JSON document of ``point``, validated against the schema."""
    parts: list[dict[str, Any]] = []
    for scheme in schemes:
        members = [c for c in point.choices if c.scheme == scheme.name]
        if scheme.dense or not members:
            continue
        weights, *inputs = scores.analyses[scheme.name]
        parts.append(lab_json.build_document(weights, {(c.layer, "weight"): c.observer for c in members}))
        with_input = {(c.layer, "input"): c.input_observer for c in members if c.input_observer is not None}
        if with_input:
            parts.append(lab_json.build_document(inputs[0], with_input))
    order = {choice.layer: index for index, choice in enumerate(point.choices)}
    entries = sorted((e for part in parts for e in part["entries"]), key=lambda e: (order[e["layer"]], e["tensor"]))
    first = next(iter(scores.analyses.values()))[0]
    described = {
        "schemes": {s.name: {k: spec.to_dict() for k, spec in s.specs().items()} for s in schemes},
        "budget": point.budget,
        "metric": scores.metric,
        "bits_per_weight": point.bits_per_weight,
        "checkpoint_bytes": point.checkpoint_bytes,
        "predicted": point.predicted,
        "measured": point.measured,
        "in_sample": point.in_sample,
        "layers": {
            c.layer: {"scheme": c.scheme, "observer": c.observer, "input_observer": c.input_observer}
            for c in point.choices
        },
        **({} if frontier is None else {"frontier": frontier.to_dict()}),
        **({} if settings is None else {"run": dict(settings)}),
    }
    found = {
        "format": lab_json.FORMAT_NAME,
        "version": lab_json.FORMAT_VERSION,
        "created": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "library": {"name": "observers", "version": ob.__version__},
        "source": json_safe(first.source),
        "metric": parts[0]["metric"] if parts else lab_json.DEFAULT_METRIC,
        "config": json_safe({ALLOCATION_KEY: described}),
        **({} if first.calibration is None else {"calibration": json_safe(first.calibration)}),
        "entries": entries,
        "uncalibrated": [],
    }
    if any("global_scale_convention" in part for part in parts):
        found["global_scale_convention"] = parts[0]["global_scale_convention"]
    problems = lab_json.schema_problems(found)
    if problems:
        raise ValueError("internal error, the allocation's document breaks the schema:\n  - " + "\n  - ".join(problems))
    return found


def layer_schemes(lab_file: Any) -> dict[str, str]:
    """A loaded allocation file's ``{layer: scheme}`` (``none`` included); empty for a run's file."""
    described = lab_file.config.get(ALLOCATION_KEY) or {}
    return {layer: found["scheme"] for layer, found in described.get("layers", {}).items()}


def quantized_layers(point: Point) -> list[str]:
    """The layers ``point`` quantizes (the rest stay dense)."""
    return [c.layer for c in point.choices if c.scheme != NONE]
