"""Quantize, dequantize and fake-quantize with given qparams, for every element format.

Pure functions over tensors, like torchao's quant primitives: the tensor is flattened once
(``observers.granularity``), the scale broadcasts against it, and the result is restored to the
input's shape and dtype. Integer formats round half to even and clamp to ``[qmin, qmax]``;
float formats round to the nearest grid value with saturation (``formats.round_to_float_grid_``,
in place on the freshly divided buffer).
Arithmetic is fp32 whatever the input dtype.
"""

from __future__ import annotations

import torch

from observers.formats import round_to_float_grid_
from observers.granularity import Flat, flatten
from observers.qparams import QParams
from observers.spec import QuantSpec


def _flat_for(x: torch.Tensor, qp: QParams, spec: QuantSpec, g_idx: torch.Tensor | None) -> Flat:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"expected a torch.Tensor, got {type(x).__name__}")
    if g_idx is None:
        g_idx = qp.extras.get("g_idx")
    flat = flatten(x, spec, qp.kind, g_idx=g_idx)
    if tuple(qp.scale.shape) != flat.qparam_shape:
        raise ValueError(
            f"qparams of shape {tuple(qp.scale.shape)} do not fit a {qp.kind} of shape {tuple(x.shape)} "
            f"with strategy {spec.strategy!r} (expected {flat.qparam_shape})"
        )
    return flat


def element_codes(data: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """Round ``data / scale`` onto the format's element grid (ints: shifted by the zero point).

    The primitive under ``quantize``/``fake_quantize``, on tensors already laid out by
    ``flatten`` with ``scale``/``zero_point`` broadcastable against ``data``; search observers
    (``mse_grid``, ``mx_exponent_search``) call it directly on their candidate scales."""
    fmt = spec.format
    scaled = data.float() / scale
    if fmt.kind == "int":
        qmin, qmax = spec.int_range
        return scaled.round_().add_(zero_point).clamp_(qmin, qmax)
    return round_to_float_grid_(scaled, fmt.exp_bits, fmt.man_bits, fmt.max_value)


def quantize(x: torch.Tensor, qp: QParams, spec: QuantSpec, g_idx: torch.Tensor | None = None) -> torch.Tensor:
    """Element codes, same shape as ``x``: int32 for integer formats, fp32 grid values for floats."""
    if spec.format.kind == "cast":
        raise ValueError(f"{spec.dtype} is a plain cast and has no element codes; use fake_quantize")
    flat = _flat_for(x, qp, spec, g_idx)
    codes = element_codes(flat.data, flat.broadcast(qp.effective_scale), flat.broadcast(qp.zero_point), spec)
    codes = flat.restore(codes)
    return codes.to(torch.int32) if spec.format.kind == "int" else codes


def dequantize(codes: torch.Tensor, qp: QParams, spec: QuantSpec, g_idx: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 values of ``codes`` (as returned by ``quantize``)."""
    flat = _flat_for(codes, qp, spec, g_idx)
    values = flat.data.float()
    if spec.format.kind == "int":
        values = values - flat.broadcast(qp.zero_point)
    return flat.restore(values * flat.broadcast(qp.effective_scale))


def fake_quantize(x: torch.Tensor, qp: QParams, spec: QuantSpec, g_idx: torch.Tensor | None = None) -> torch.Tensor:
    """Quantize then dequantize: same shape and dtype as ``x``, values on the quantized grid."""
    fmt = spec.format
    if fmt.kind == "cast":
        return x.to(_CAST_DTYPES[spec.dtype]).to(x.dtype)
    flat = _flat_for(x, qp, spec, g_idx)
    scale = flat.broadcast(qp.effective_scale)
    zero_point = flat.broadcast(qp.zero_point)
    codes = element_codes(flat.data, scale, zero_point, spec)
    values = codes.sub_(zero_point).mul_(scale) if fmt.kind == "int" else codes.mul_(scale)
    return flat.restore(values).to(x.dtype)


_CAST_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
