"""``QuantSpec``: the one validated, serializable description of how a tensor is quantized.

Modelled on compressed-tensors' ``QuantizationArgs``: every other module reads the spec instead
of taking loose arguments, and a spec written with ``to_dict`` reads back with ``from_dict``. The
allowed words of ``strategy``, ``scale_rule`` and ``scale_rounding`` (and of observer kinds) are
the enums of ``observers.vocab``; either a member or its string may be passed, and the spec keeps
the plain string, so specs compare and serialize the same either way.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from enum import StrEnum
from typing import Any

import torch

from observers.formats import ElementFormat, get_format
from observers.vocab import STRATEGIES_BY_KIND, ObserverKind, ScaleRounding, ScaleRule, Strategy

FLOAT32_EPS = float(torch.finfo(torch.float32).eps)


def _choice(field_name: str, value: Any, allowed: type[StrEnum]) -> str:
    """``value`` (a member of ``allowed`` or its string) as a plain str, so a spec built with
    ``Strategy.GROUP`` equals, prints and serializes like one built with ``"group"``."""
    values = [member.value for member in allowed]
    if value not in values:
        raise ValueError(f"QuantSpec.{field_name}={value!r} is not valid; allowed: {', '.join(values)}")
    return allowed(value).value


def _positive_int(field_name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"QuantSpec.{field_name} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class QuantSpec:
    """How one tensor is quantized.

    - ``dtype``: element format name (see ``observers.formats.FORMATS``).
    - ``symmetric``: zero point fixed at the middle of the range (0 for signed ints).
    - ``strategy``: a ``Strategy``, ``tensor`` | ``channel`` | ``group`` | ``token`` | ``block``
      (see ``observers.granularity`` for the qparam shape of each).
    - ``group_size``: columns per group for ``group`` (a ragged last group is allowed).
    - ``block_size``: ``(rows, cols)`` for ``block``.
    - ``ch_axis``: axis of ``channel``; ``None`` means 0 (output channel) for weights, -1 (hidden
      feature) for activations, 1 (head) for attention states.
    - ``reduce_range``: drop one bit of the integer range, as torch.ao does for some backends.
    - ``quant_min``/``quant_max``: custom integer range (both or neither).
    - ``scale_rule``: a ``ScaleRule``, the symmetric divisor: ``half_range`` ((qmax - qmin) / 2,
      torch.ao and compressed-tensors) or ``qmax`` (ModelOpt's narrow rule).
    - ``scale_rounding``: a ``ScaleRounding``, the shared-exponent rounding of MX formats (``floor``
      OCP, ``even`` Quark, ``ceil`` ModelOpt; see ``observers.blocks``); ignored by the other formats
      (BFP16 always applies its overflow bump, NVFP4 rounds block scales to E4M3).
    - ``eps``: smallest scale (torch.ao clamps to float32 eps), so no scale is ever 0.
    - ``dynamic``: the range is computed at run time per token/group; static qparams are then
      only a summary of the calibration data.
    """

    dtype: str = "int8"
    symmetric: bool = True
    strategy: str = "tensor"
    group_size: int | None = None
    block_size: tuple[int, int] | None = None
    ch_axis: int | None = None
    reduce_range: bool = False
    quant_min: int | None = None
    quant_max: int | None = None
    scale_rule: str = "half_range"
    scale_rounding: str = "floor"
    eps: float = FLOAT32_EPS
    dynamic: bool = False

    def __post_init__(self) -> None:
        fmt = get_format(self.dtype)
        object.__setattr__(self, "strategy", _choice("strategy", self.strategy, Strategy))
        object.__setattr__(self, "scale_rule", _choice("scale_rule", self.scale_rule, ScaleRule))
        object.__setattr__(self, "scale_rounding", _choice("scale_rounding", self.scale_rounding, ScaleRounding))
        for name in ("symmetric", "reduce_range", "dynamic"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"QuantSpec.{name} must be a bool, got {getattr(self, name)!r}")
        if not (isinstance(self.eps, (int, float)) and 0 < self.eps < 1):
            raise ValueError(f"QuantSpec.eps must be a float in (0, 1), got {self.eps!r}")
        if fmt.is_block and self.strategy != "group":
            object.__setattr__(self, "strategy", "group")
        if fmt.is_block and self.group_size is None:
            object.__setattr__(self, "group_size", fmt.block_size)
        if self.strategy == "group":
            if self.group_size is None:
                raise ValueError("QuantSpec.group_size is required when strategy='group'")
            _positive_int("group_size", self.group_size)
        if self.strategy == "block":
            if self.block_size is None:
                raise ValueError("QuantSpec.block_size (rows, cols) is required when strategy='block'")
            if isinstance(self.block_size, list):
                object.__setattr__(self, "block_size", tuple(self.block_size))
            if not (isinstance(self.block_size, tuple) and len(self.block_size) == 2):
                raise ValueError(f"QuantSpec.block_size must be (rows, cols), got {self.block_size!r}")
            for size in self.block_size:
                _positive_int("block_size", size)
        if self.ch_axis is not None and (isinstance(self.ch_axis, bool) or not isinstance(self.ch_axis, int)):
            raise ValueError(f"QuantSpec.ch_axis must be an int or None, got {self.ch_axis!r}")
        self._validate_range(fmt)
        if fmt.kind == "float" and not self.symmetric:
            raise ValueError(
                f"QuantSpec.symmetric=False is not defined for float format {self.dtype!r} "
                "(compressed-tensors defines no asymmetric float scheme); use symmetric=True"
            )
        if self.reduce_range and self.symmetric and fmt.kind == "int" and not fmt.signed:
            raise ValueError(
                f"QuantSpec.reduce_range=True with symmetric {self.dtype!r} is undefined (its zero point 2^(bits-1) "
                "would fall outside the reduced range; torch.ao rejects it too); use symmetric=False or a signed dtype"
            )
        if fmt.scale_kind in ("e8m0", "e4m3", "pow2") and not self.symmetric:
            raise ValueError(f"block format {self.dtype!r} is symmetric only; use symmetric=True")
        if fmt.is_block and self.reduce_range:
            raise ValueError(f"QuantSpec.reduce_range does not apply to block format {self.dtype!r}")

    def _validate_range(self, fmt: ElementFormat) -> None:
        custom = (self.quant_min, self.quant_max)
        if custom == (None, None):
            return
        if None in custom:
            raise ValueError("QuantSpec.quant_min and quant_max must be given together")
        if fmt.kind != "int" or fmt.is_block:
            raise ValueError(f"QuantSpec.quant_min/quant_max apply to plain integer formats only, not {self.dtype!r}")
        full_min, full_max = fmt.int_range()
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in custom):
            raise ValueError(f"QuantSpec.quant_min/quant_max must be integers, got {custom!r}")
        if not full_min <= self.quant_min < self.quant_max <= full_max:
            raise ValueError(
                f"QuantSpec.quant_min/quant_max={custom} must satisfy "
                f"{full_min} <= quant_min < quant_max <= {full_max} for {self.dtype}"
            )

    @property
    def format(self) -> ElementFormat:
        """The element format row of ``dtype``."""
        return get_format(self.dtype)

    @property
    def has_custom_range(self) -> bool:
        return self.quant_min is not None

    @property
    def int_range(self) -> tuple[int, int]:
        """``(qmin, qmax)`` after ``reduce_range`` and custom-range overrides (integer formats)."""
        if self.has_custom_range:
            return self.quant_min, self.quant_max
        return self.format.int_range(self.reduce_range)

    def channel_axis(self, kind: str) -> int:
        """The effective ``ch_axis`` for ``kind`` (see the class docstring)."""
        if self.ch_axis is not None:
            return self.ch_axis
        return {"weight": 0, "activation": -1, "attention": 1}[kind]

    def check_kind(self, kind: str) -> None:
        """Raise a clear ``ValueError`` when ``strategy`` does not apply to ``kind``."""
        kind = _choice_kind(kind)
        allowed = STRATEGIES_BY_KIND[kind]
        if self.strategy not in allowed:
            raise ValueError(
                f"strategy {self.strategy!r} is not valid for kind={kind!r}; allowed: {', '.join(allowed)}"
            )

    def replace(self, **changes: Any) -> QuantSpec:
        """A copy with some fields changed (validated again)."""
        return QuantSpec.from_dict({**self.to_dict(), **changes})

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe dict; ``from_dict(to_dict())`` gives an equal spec."""
        data = asdict(self)
        if data["block_size"] is not None:
            data["block_size"] = list(data["block_size"])
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> QuantSpec:
        """Build from ``to_dict`` output; unknown keys are an error, not silently dropped."""
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(
                f"unknown QuantSpec field(s): {', '.join(sorted(unknown))}; known: {', '.join(sorted(known))}"
            )
        data = dict(data)
        if isinstance(data.get("block_size"), list):
            data["block_size"] = tuple(data["block_size"])
        return cls(**data)


_KIND_VALUES = {member.value: member.value for member in ObserverKind}
"""Every kind's plain str, looked up on each observe (iterating the enum costs microseconds)."""


def _choice_kind(kind: str) -> str:
    """``kind`` as a plain str (``ObserverKind`` members included), or a ``ValueError``."""
    value = _KIND_VALUES.get(kind) if isinstance(kind, str) else None
    if value is None:
        raise ValueError(f"kind={kind!r} is not valid; allowed: {', '.join(_KIND_VALUES)}")
    return value
