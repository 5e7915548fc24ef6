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
from observers.shared import Op, Reduce
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


def compare_tensors(reference: torch.Tensor, approx: torch.Tensor, across: Reduce | None = None) -> dict[str, float]:
    """``mse``, ``sqnr_db`` (20·log10(‖x‖/‖x−x̂‖)), ``cosine`` and ``max_abs_error``.

    ``across``: the tensors are one rank's part of tensors split between processes
    (``observers.shared``); the metrics are those of the whole, from sums added over the ranks
    (a part may be empty)."""
    if reference.shape != approx.shape:
        raise ValueError(f"cannot compare tensors of shapes {tuple(reference.shape)} and {tuple(approx.shape)}")
    if reference.numel() == 0 and across is None:
        raise ValueError("cannot compute error metrics of an empty tensor")
    ref = reference.detach().float().flatten()
    app = approx.detach().float().flatten()
    err = app - ref
    sums = torch.stack([err.square().sum(), ref.square().sum(), app.square().sum(), torch.dot(ref, ref + err)])
    count, largest = ref.numel(), err.abs().max() if ref.numel() else torch.zeros((), device=ref.device)
    if across is not None:
        count = int(across(torch.tensor([count], dtype=torch.float64, device=ref.device), Op.SUM))
        if count == 0:
            raise ValueError("cannot compute error metrics of an empty tensor (no rank has any element)")
        sums, largest = across(sums.double(), Op.SUM), across(largest.reshape(1), Op.MAX)
    err_sq, ref_sq, approx_sq, dot = (float(value) for value in sums)
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
        cosine = dot / math.sqrt(ref_sq * approx_sq)
    return {
        "mse": err_sq / count,
        "sqnr_db": sqnr,
        "cosine": cosine,
        "max_abs_error": float(largest),
    }


_EDGE_STEPS = 1e-3


def _clip_and_step_sums(x: torch.Tensor, x_hat: torch.Tensor, qp: QParams, spec: QuantSpec) -> torch.Tensor:
    """How many elements lie beyond the representable range, and the sum of squared error / step.

    An integer element counts as clipped when it lies more than half a step beyond
    ``[(qmin - zp)·s, (qmax - zp)·s]`` (saturation, not rounding, set its error); a float element
    when ``|x| > max_value·s``. Both allow ``_EDGE_STEPS`` of fp32 rounding: with the
    ``half_range`` rule the range's own end sits exactly half a step beyond ``qmax·s``, and
    ``x / s`` there may land a hair past it.
    """
    if x.numel() == 0:
        return torch.zeros(2, dtype=torch.float64, device=x.device)
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
    if flat.valid is not None:
        clipped = clipped & flat.valid
        step_error = step_error * flat.valid
    return torch.stack([clipped.sum().double(), step_error.sum().double()])


def error_metrics(
    x: torch.Tensor, x_hat: torch.Tensor, qp: QParams, spec: QuantSpec, across: Reduce | None = None
) -> dict[str, float | None]:
    """All of ``METRIC_KEYS`` for ``x`` and its fake-quantized ``x_hat``.

    For plain casts (fp16/bf16) there is no step: ``rmse_over_scale`` is None and ``clip_ratio``
    counts values beyond the cast type's largest finite value. ``across``: ``x`` is one rank's
    part of a tensor split between processes, as in ``compare_tensors``.
    """
    metrics: dict[str, float | None] = dict(compare_tensors(x, x_hat, across))
    if spec.format.kind == "cast":
        limit = torch.finfo(x_hat.dtype if x_hat.dtype.is_floating_point else torch.float32).max
        limit = min(limit, spec.format.max_value or limit)
        sums = torch.stack([(x.float().abs() > limit).sum().double(), torch.zeros((), dtype=torch.float64)])
    else:
        sums = _clip_and_step_sums(x, x_hat, qp, spec)
    count = torch.tensor(float(x.numel()), dtype=torch.float64)
    sums = torch.cat([sums.to(count.device), count.reshape(1)])
    if across is not None:
        sums = across(sums.to(x.device), Op.SUM)
    clipped, step_sq, count = (float(value) for value in sums)
    metrics["clip_ratio"] = clipped / count
    metrics["rmse_over_scale"] = None if spec.format.kind == "cast" else math.sqrt(step_sq / count)
    return metrics
