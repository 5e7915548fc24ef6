"""Element formats: integer ranges and float grids, one row per ``QuantSpec.dtype``.

A format says what one quantized element can hold (an integer range or a small float grid) and
how the scale that multiplies it is stored. Observers and ``fake_quantize`` read these rows; a new
format is a new row here (plus, for a new kind of scale, its rule in ``qparams``), not a branch
in every observer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import torch


@dataclass(frozen=True)
class ElementFormat:
    """One quantized element type.

    ``kind`` is ``"int"`` (uniform integer grid ``[qmin, qmax]``), ``"float"`` (a minifloat with
    ``exp_bits``/``man_bits``, subnormals, saturating at ``max_value``) or ``"cast"`` (a plain
    cast to fp16/bf16, no scale). ``scale_kind`` says how the per-group scale is represented:
    ``"float"`` (a free fp32 scale), ``"e8m0"`` (power of two, MX), ``"e4m3"`` (FP8 block scale
    plus an fp32 global scale, NVFP4), ``"pow2"`` (shared exponent, BFP) or ``"none"``.
    ``family`` groups dtypes for display: integer, float, MX, NVFP4, BFP or cast (fp16/bf16).

    Integer elements of block formats (MXINT8, BFP16) are fixed-point numbers: a code ``c`` means
    ``c * 2^-man_bits`` of the block's power-of-two scale, so ``man_bits`` counts fraction bits and
    ``max_value`` is the largest element value (127/64). ``narrow_range`` makes the integer range
    symmetric (``qmin = -qmax``, e.g. ±127).
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
    narrow_range: bool = False

    @property
    def is_block(self) -> bool:
        """True when the scale is shared by a fixed-size block along the last dim (MX, NVFP4, BFP)."""
        return self.block_size is not None

    @property
    def emax(self) -> int:
        """Exponent of the largest element value, ``floor(log2(max_value))`` (E2M1: 2, E4M3: 8, MXINT8: 0).

        MX's shared exponent is ``floor(log2(amax)) - emax`` under the OCP rule.
        """
        return math.frexp(self.max_value)[1] - 1

    @property
    def element(self) -> str:
        """Short name of the element type: ``INT4``, ``E2M1``, ``INT8 (x2^-6)``, ``FP16``."""
        if self.kind == "cast":
            return self.name.upper()
        if self.kind == "float":
            return f"E{self.exp_bits}M{self.man_bits}"
        prefix = "INT" if self.signed else "UINT"
        return f"{prefix}{self.bits}" + (f" (x2^-{self.man_bits})" if self.man_bits else "")

    def int_range(self, reduce_range: bool = False) -> tuple[int, int]:
        """``(qmin, qmax)`` of an integer element; ``reduce_range`` drops one bit like torch.ao."""
        bits = self.bits - 1 if reduce_range else self.bits
        if self.signed:
            qmax = 2 ** (bits - 1) - 1
            return (-qmax if self.narrow_range else -qmax - 1), qmax
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


def _mx(name: str, exp_bits: int, man_bits: int, max_value: float) -> ElementFormat:
    return replace(
        _float(name, exp_bits, man_bits, max_value),
        scale_kind="e8m0",
        block_size=32,
        family="MX",
        description=f"OCP MX: E{exp_bits}M{man_bits} elements, blocks of 32 sharing an E8M0 power-of-two scale",
    )


def _block_int8(name: str, scale_kind: str, block_size: int, family: str, description: str) -> ElementFormat:
    return ElementFormat(
        name,
        "int",
        8,
        True,
        man_bits=6,
        max_value=127 / 64,
        scale_kind=scale_kind,
        block_size=block_size,
        family=family,
        description=description,
        narrow_range=True,
    )


def _cast(name: str, exp_bits: int, man_bits: int, dtype: torch.dtype) -> ElementFormat:
    return ElementFormat(
        name,
        "cast",
        16,
        True,
        exp_bits,
        man_bits,
        float(torch.finfo(dtype).max),
        scale_kind="none",
        family="cast",
        description=f"plain cast to {name} (no scale, no range)",
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
        _mx("mxfp8_e4m3", 4, 3, 448.0),
        _mx("mxfp8_e5m2", 5, 2, 57344.0),
        _mx("mxfp6_e3m2", 3, 2, 28.0),
        _mx("mxfp6_e2m3", 2, 3, 7.5),
        _mx("mxfp4", 2, 1, 6.0),
        _block_int8(
            "mxint8", "e8m0", 32, "MX", "OCP MX: int8 codes (step scale/64, range ±127), blocks of 32, E8M0 scale"
        ),
        ElementFormat(
            "nvfp4",
            "float",
            4,
            True,
            2,
            1,
            6.0,
            scale_kind="e4m3",
            block_size=16,
            family="NVFP4",
            description="NVIDIA FP4: E2M1 elements, blocks of 16, FP8 E4M3 block scales and an fp32 global scale",
        ),
        _block_int8(
            "bfp16",
            "pow2",
            8,
            "BFP",
            "block floating point: 8-bit mantissas, blocks of 8 sharing an exponent (Quark BFP16)",
        ),
        replace(
            _block_int8(
                "bfp16_quark",
                "pow2",
                8,
                "BFP",
                "BFP16 as Quark computes it: codes -128..127, exponent bumped only when the positive max overflows",
            ),
            narrow_range=False,
        ),
        _cast("fp16", 5, 10, torch.float16),
        _cast("bf16", 8, 7, torch.bfloat16),
    )
}

FAMILIES = ("integer", "float", "MX", "NVFP4", "BFP", "cast")
"""Display groups of ``FORMATS`` in order; ``cast`` is fp16/bf16."""

_SCALE_TYPES = {
    "float": "fp32",
    "e8m0": "E8M0 (power of two)",
    "e4m3": "FP8 E4M3 + fp32 global",
    "pow2": "shared 8-bit exponent",
    "none": "none",
}


def get_format(dtype: str) -> ElementFormat:
    """The row for ``dtype``; a clear ``ValueError`` listing the known names otherwise."""
    try:
        return FORMATS[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; allowed: {', '.join(FORMATS)}") from None


def formats_table() -> list[dict[str, Any]]:
    """One row per dtype (what ``python -m observers list`` prints): name, family, element, block
    size, scale type, max value.

    ``max_value`` is the largest element magnitude in units of the scale (integers: ``qmax``).
    """
    rows = []
    for fmt in FORMATS.values():
        max_value = fmt.int_range()[1] if fmt.kind == "int" and not fmt.is_block else fmt.max_value
        rows.append(
            {
                "name": fmt.name,
                "family": fmt.family,
                "element": fmt.element,
                "block_size": fmt.block_size,
                "scale": _SCALE_TYPES[fmt.scale_kind],
                "max_value": max_value,
            }
        )
    return rows


_EXPONENT_FIELD = 0x7F800000
_CPU_CHUNK = 1 << 18


def round_to_float_grid(x: torch.Tensor, exp_bits: int, man_bits: int, max_value: float) -> torch.Tensor:
    """Round ``x`` (already divided by its scale) to the nearest value of a minifloat grid.

    Round half to even between neighbours, subnormals included, saturating at ``±max_value``
    (no inf/NaN codes, as the OCP "fn" formats and FP6/FP4 have none); the sign of zero is kept.
    Returns a new tensor of the input dtype; the arithmetic is fp32. The step inside a binade
    ``[2^e, 2^(e+1))`` is ``2^(e - man_bits)``; below the smallest normal exponent the step stays
    at the subnormal step.
    """
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device).copy_(x.detach())
    return round_to_float_grid_(out, exp_bits, man_bits, max_value).to(x.dtype)


def round_to_float_grid_(x: torch.Tensor, exp_bits: int, man_bits: int, max_value: float) -> torch.Tensor:
    """In-place ``round_to_float_grid`` of an fp32 tensor (``quantize`` uses it on its own buffer).

    Why not ``frexp``: this is the hot loop of every float and MX fake-quant. The step's reciprocal
    ``2^(man_bits - e)`` is built from the exponent field of the fp32 bits (one masked copy), then
    ``x * r`` is rounded half to even by ``torch.round`` and divided back; multiplying and dividing by
    a power of two is exact. On CPU the work runs over cache-sized chunks with one reused scratch
    buffer, so the data is read from memory about once instead of once per operation.
    """
    if x.dtype != torch.float32:
        raise ValueError(f"round_to_float_grid_ needs an fp32 tensor, got {x.dtype}")
    min_field = (2 - 2 ** (exp_bits - 1) + 127) << 23
    exponent_bias = torch.tensor(127 << 23, dtype=torch.int32, device=x.device)
    parts = [x]
    if x.device.type == "cpu" and x.is_contiguous() and x.numel() > _CPU_CHUNK:
        parts = x.view(-1).split(_CPU_CHUNK)
    scratch = torch.empty(parts[0].shape, dtype=torch.int32, device=x.device)
    for part in parts:
        part.clamp_(-max_value, max_value)
        reciprocal = scratch.view(-1)[: part.numel()].view(part.shape)
        torch.bitwise_and(part.view(torch.int32), _EXPONENT_FIELD, out=reciprocal)
        # bits of 2^(man_bits - e): ((127 + man_bits) - (field - 127)) << 23, kept inside int32
        torch.sub(exponent_bias, reciprocal.clamp_(min=min_field), out=reciprocal).add_((127 + man_bits) << 23)
        reciprocal_f = reciprocal.view(torch.float32)
        part.mul_(reciprocal_f).round_().div_(reciprocal_f)
    return x
