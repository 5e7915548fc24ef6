"""Error metrics of a quantized tensor (section 7 of the reference doc).

``compare_tensors`` is the part that needs only two tensors (also used for layer outputs);
``error_metrics`` adds what needs the qparams: the share of clipped elements and the RMS error in
units of the quantization step. Sums are fp32; edge cases give defined values, never NaN:
a zero error has SQNR ``inf``, two zero tensors have cosine 1.
"""

from __future__ import annotations

import math

import torch

from observers.granularity import flatten
from observers.qparams import QParams
from observers.spec import QuantSpec

METRIC_KEYS = ("mse", "sqnr_db", "cosine", "max_abs_error", "clip_ratio", "rmse_over_scale")
HIGHER_IS_BETTER = {
    "mse": False,
    "sqnr_db": True,
    "cosine": True,
    "max_abs_error": False,
    "clip_ratio": False,
    "rmse_over_scale": False,
}


def compare_tensors(reference: torch.Tensor, approx: torch.Tensor) -> dict[str, float]:
    """``mse``, ``sqnr_db`` (20·log10(‖x‖/‖x−x̂‖)), ``cosine`` and ``max_abs_error``."""
    if reference.shape != approx.shape:
        raise ValueError(f"cannot compare tensors of shapes {tuple(reference.shape)} and {tuple(approx.shape)}")
    if reference.numel() == 0:
        raise ValueError("cannot compute error metrics of an empty tensor")
    ref = reference.detach().float().flatten()
    err = approx.detach().float().flatten() - ref
    err_sq = float(err.square().sum())
    ref_sq = float(ref.square().sum())
    approx_sq = float(approx.detach().float().square().sum())
    if err_sq == 0.0:
        sqnr = math.inf
    elif ref_sq == 0.0:
        sqnr = -math.inf
    else:
        sqnr = 10.0 * math.log10(ref_sq / err_sq)
    if ref_sq == 0.0 and approx_sq == 0.0:
        cosine = 1.0
    elif ref_sq == 0.0 or approx_sq == 0.0:
        cosine = 0.0
    else:
        cosine = float(torch.dot(ref, ref + err)) / math.sqrt(ref_sq * approx_sq)
    return {
        "mse": err_sq / ref.numel(),
        "sqnr_db": sqnr,
        "cosine": cosine,
        "max_abs_error": float(err.abs().max()),
    }


_EDGE_STEPS = 1e-3


def _clip_and_step_error(x: torch.Tensor, x_hat: torch.Tensor, qp: QParams, spec: QuantSpec) -> tuple[float, float]:
    """Share of elements beyond the representable range, and RMS error / step.

    An integer element counts as clipped when it lies more than half a step beyond
    ``[(qmin - zp)·s, (qmax - zp)·s]`` (saturation, not rounding, set its error); a float element
    when ``|x| > max_value·s``. Both allow ``_EDGE_STEPS`` of fp32 rounding: with the
    ``half_range`` rule the range's own end sits exactly half a step beyond ``qmax·s``, and
    ``x / s`` there may land a hair past it.
    """
    fmt = spec.format
    g_idx = qp.extras.get("g_idx")
    flat = flatten(x, spec, qp.kind, g_idx=g_idx)
    flat_hat = flatten(x_hat, spec, qp.kind, g_idx=g_idx)
    scale = flat.broadcast(qp.effective_scale)
    scaled = flat.data.float() / scale
    if fmt.kind == "int":
        qmin, qmax = spec.int_range
        shifted = scaled + flat.broadcast(qp.zero_point)
        clipped = (shifted > qmax + 0.5 + _EDGE_STEPS) | (shifted < qmin - 0.5 - _EDGE_STEPS)
    else:
        clipped = scaled.abs() > fmt.max_value * (1 + 1e-6)
    step_error = ((flat_hat.data.float() - flat.data.float()) / scale).square()
    count = x.numel()
    if flat.valid is not None:
        clipped = clipped & flat.valid
        step_error = step_error * flat.valid
    return float(clipped.sum()) / count, math.sqrt(float(step_error.sum()) / count)


def error_metrics(x: torch.Tensor, x_hat: torch.Tensor, qp: QParams, spec: QuantSpec) -> dict[str, float | None]:
    """All of ``METRIC_KEYS`` for ``x`` and its fake-quantized ``x_hat``.

    For plain casts (fp16/bf16) there is no step: ``rmse_over_scale`` is None and ``clip_ratio``
    counts values beyond the cast type's largest finite value.
    """
    metrics: dict[str, float | None] = dict(compare_tensors(x, x_hat))
    if spec.format.kind == "cast":
        limit = torch.finfo(x_hat.dtype if x_hat.dtype.is_floating_point else torch.float32).max
        limit = min(limit, spec.format.max_value or limit)
        metrics.update(clip_ratio=float((x.float().abs() > limit).sum()) / x.numel(), rmse_over_scale=None)
        return metrics
    clip_ratio, rmse_over_scale = _clip_and_step_error(x, x_hat, qp, spec)
    metrics.update(clip_ratio=clip_ratio, rmse_over_scale=rmse_over_scale)
    return metrics
