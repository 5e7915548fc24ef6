"""Element formats: integer ranges and float grids, one row per ``QuantSpec.dtype``.

A format says what one quantized element can hold (an integer range or a small float grid) and
how the scale that multiplies it is stored. Observers and ``fake_quantize`` read these rows; a new
format is a new row here (plus, for a new kind of scale, its rule in ``qparams``), not a branch
in every observer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ElementFormat:
    """One quantized element type.

    ``kind`` is ``"int"`` (uniform integer grid ``[qmin, qmax]``), ``"float"`` (a minifloat with
    ``exp_bits``/``man_bits``, subnormals, saturating at ``max_value``) or ``"cast"`` (a plain
    cast to fp16/bf16, no scale). ``scale_kind`` says how the per-group scale is represented:
    ``"float"`` (a free fp32 scale), ``"e8m0"`` (power of two, MX), ``"e4m3"`` (FP8 block scale
    plus an fp32 global scale, NVFP4), ``"pow2"`` (shared exponent, BFP) or ``"none"``.
    """

    name: str
    kind: str
    bits: int
    signed: bool = True
    exp_bits: int = 0
    man_bits: int = 0
    max_value: float = 0.0
    scale_kind: str = "float"
    block_size: int | None = None
    family: str = "integer"
    description: str = ""

    @property
    def is_block(self) -> bool:
        """True when the scale is shared by a fixed-size block along the last dim (MX, NVFP4, BFP)."""
        return self.block_size is not None

    @property
    def min_exponent(self) -> int:
        """Smallest normal exponent of a float element (``1 - bias``)."""
        return 2 - 2 ** (self.exp_bits - 1)

    def int_range(self, reduce_range: bool = False) -> tuple[int, int]:
        """``(qmin, qmax)`` of an integer element; ``reduce_range`` drops one bit like torch.ao."""
        bits = self.bits - 1 if reduce_range else self.bits
        if self.signed:
            return -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
        return 0, 2**bits - 1


def _int(bits: int, signed: bool = True) -> ElementFormat:
    name = f"{'int' if signed else 'uint'}{bits}"
    return ElementFormat(
        name, "int", bits, signed, description=f"{bits}-bit {'signed' if signed else 'unsigned'} integer"
    )


def _float(name: str, exp_bits: int, man_bits: int, max_value: float) -> ElementFormat:
    return ElementFormat(
        name,
        "float",
        1 + exp_bits + man_bits,
        True,
        exp_bits,
        man_bits,
        max_value,
        family="float",
        description=f"FP{1 + exp_bits + man_bits} E{exp_bits}M{man_bits}, max {max_value:g}",
    )


FORMATS: dict[str, ElementFormat] = {
    f.name: f
    for f in (
        _int(2),
        _int(3),
        _int(4),
        _int(8),
        _int(4, signed=False),
        _int(8, signed=False),
        _float("fp8_e4m3", 4, 3, 448.0),
        _float("fp8_e5m2", 5, 2, 57344.0),
        _float("fp6_e3m2", 3, 2, 28.0),
        _float("fp6_e2m3", 2, 3, 7.5),
        _float("fp4_e2m1", 2, 1, 6.0),
    )
}


def get_format(dtype: str) -> ElementFormat:
    """The row for ``dtype``; a clear ``ValueError`` listing the known names otherwise."""
    try:
        return FORMATS[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; allowed: {', '.join(FORMATS)}") from None


def round_to_float_grid(x: torch.Tensor, exp_bits: int, man_bits: int, max_value: float) -> torch.Tensor:
    """Round ``x`` (already divided by its scale) to the nearest value of a minifloat grid.

    Round half to even between neighbours, subnormals included, saturating at ``±max_value``
    (no inf/NaN codes, as the OCP "fn" formats and FP6/FP4 have none). Works in the input dtype,
    which should be fp32. The step inside a binade ``[2^e, 2^(e+1))`` is ``2^(e - man_bits)``;
    below the smallest normal exponent the step stays at the subnormal step.
    """
    min_exponent = 2 - 2 ** (exp_bits - 1)
    magnitude = x.abs()
    _, exponent = torch.frexp(magnitude)
    exponent = (exponent - 1).clamp_(min=min_exponent)
    step = torch.ldexp(torch.ones_like(magnitude), exponent - man_bits)
    rounded = torch.round(magnitude / step).mul_(step).clamp_(max=max_value)
    return torch.copysign(rounded, x)
