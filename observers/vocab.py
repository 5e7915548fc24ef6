"""The observer library's words, each set once as a ``StrEnum``.

Every member is its string (``Strategy.GROUP == "group"``, ``json.dumps`` writes ``"group"``), so
code may pass either; ``QuantSpec`` stores the plain strings, so specs compare and serialize as
before. The app builds its choices from these enums instead of repeating the lists.
"""

from __future__ import annotations

from enum import StrEnum


class Strategy(StrEnum):
    """Granularity of the qparams (see ``observers.granularity`` for the shape of each)."""

    TENSOR = "tensor"
    CHANNEL = "channel"
    GROUP = "group"
    TOKEN = "token"
    BLOCK = "block"


class ObserverKind(StrEnum):
    """What an observer sees: a weight, activations, or attention key/value states."""

    WEIGHT = "weight"
    ACTIVATION = "activation"
    ATTENTION = "attention"


class ScaleRule(StrEnum):
    """Symmetric divisor: ``(qmax - qmin) / 2`` (torch.ao, compressed-tensors) or ``qmax`` (ModelOpt)."""

    HALF_RANGE = "half_range"
    QMAX = "qmax"


class ScaleRounding(StrEnum):
    """Shared-exponent rounding of MX formats: ``floor`` (OCP), ``even`` (Quark), ``ceil`` (ModelOpt),
    ``compressed-tensors`` (rounds amax at FP4's one mantissa bit whatever the element format)."""

    FLOOR = "floor"
    EVEN = "even"
    CEIL = "ceil"
    COMPRESSED_TENSORS = "compressed-tensors"


STRATEGIES_BY_KIND: dict[ObserverKind, tuple[Strategy, ...]] = {
    ObserverKind.WEIGHT: (Strategy.TENSOR, Strategy.CHANNEL, Strategy.GROUP, Strategy.BLOCK),
    ObserverKind.ACTIVATION: (Strategy.TENSOR, Strategy.CHANNEL, Strategy.GROUP, Strategy.TOKEN),
    ObserverKind.ATTENTION: (Strategy.TENSOR, Strategy.CHANNEL),
}
"""The strategies that apply to each kind: blocks are 2-D weight tiles, tokens exist only in
activations, and attention states are quantized per tensor or per head."""
