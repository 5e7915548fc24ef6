"""Values as JSON holds them: strict JSON has no inf/NaN, tuples or tensors, so knob values,
metrics and run settings go through ``json_safe`` (and metrics back through
``metrics_from_json``) wherever the lab writes a file: the Observer Lab JSON, the
compressed-tensors config, the sweep's partial records."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

NONFINITE = {math.inf: "inf", -math.inf: "-inf"}


def _finite_or_string(value: Any) -> Any:
    """JSON has no inf/NaN: non-finite floats become the strings "inf", "-inf", "nan"."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else NONFINITE[value]
    return value


def _float_from_json(value: Any) -> Any:
    if isinstance(value, str) and value in ("inf", "-inf", "nan"):
        return float(value)
    return value


def json_safe(value: Any) -> Any:
    """Knob values and metrics as JSON values (tuples become lists, non-finite floats strings)."""
    if isinstance(value, Mapping):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    if isinstance(value, torch.Tensor):
        return json_safe(value.tolist())
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return _finite_or_string(value)
    return str(value)


def metrics_to_json(metrics: Mapping[str, float | None]) -> dict[str, Any]:
    """Metric values for a file: floats, with non-finite ones as strings."""
    return {k: _finite_or_string(None if v is None else float(v)) for k, v in metrics.items()}


def metrics_from_json(metrics: Mapping[str, Any]) -> dict[str, float | None]:
    """Metric values read back: the strings "inf", "-inf", "nan" become floats again."""
    return {k: _float_from_json(v) for k, v in metrics.items()}
