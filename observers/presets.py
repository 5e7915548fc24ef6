"""Preset schemes, as compressed-tensors names them (section 9 of the reference doc).

A preset maps each tensor kind a layer quantizes (``weight``, ``input``) to a ``QuantSpec``;
``None`` means that kind stays in high precision. Dynamic input schemes are marked
``dynamic=True``: their static qparams only summarize the calibration data.
"""

from __future__ import annotations

from typing import Any

from observers.spec import QuantSpec

_PRESETS: dict[str, dict[str, dict[str, Any] | None]] = {
    "W4A16": {"weight": {"dtype": "int4", "strategy": "group", "group_size": 128}, "input": None},
    "W8A8": {
        "weight": {"dtype": "int8", "strategy": "channel"},
        "input": {"dtype": "int8", "strategy": "token", "dynamic": True},
    },
    "FP8": {
        "weight": {"dtype": "fp8_e4m3", "strategy": "tensor"},
        "input": {"dtype": "fp8_e4m3", "strategy": "tensor"},
    },
    "FP8_DYNAMIC": {
        "weight": {"dtype": "fp8_e4m3", "strategy": "channel"},
        "input": {"dtype": "fp8_e4m3", "strategy": "token", "dynamic": True},
    },
    "FP8_BLOCK": {
        "weight": {"dtype": "fp8_e4m3", "strategy": "block", "block_size": (128, 128)},
        "input": {"dtype": "fp8_e4m3", "strategy": "group", "group_size": 128, "dynamic": True},
    },
    "NVFP4": {"weight": {"dtype": "nvfp4"}, "input": {"dtype": "nvfp4", "dynamic": True}},
    "NVFP4A16": {"weight": {"dtype": "nvfp4"}, "input": None},
    "MXFP4": {"weight": {"dtype": "mxfp4"}, "input": {"dtype": "mxfp4", "dynamic": True}},
    "MXFP8": {"weight": {"dtype": "mxfp8_e4m3"}, "input": {"dtype": "mxfp8_e4m3", "dynamic": True}},
}

PRESET_NAMES = tuple(_PRESETS)


def preset(name: str) -> dict[str, QuantSpec | None]:
    """``{"weight": QuantSpec, "input": QuantSpec | None}`` for preset ``name``."""
    if name not in _PRESETS:
        raise ValueError(f"unknown preset {name!r}; available: {', '.join(_PRESETS)}")
    return {kind: None if fields is None else QuantSpec(**fields) for kind, fields in _PRESETS[name].items()}
