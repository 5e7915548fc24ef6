"""Error metrics of a quantized tensor (section 7 of the reference doc).

``compare_tensors`` is the part that needs only two tensors (also used for layer outputs);
``error_metrics`` adds what needs the qparams: the share of clipped elements and the RMS error in
units of the quantization step; ``quantization_metrics`` gives the same for ``x`` and its qparams
without materializing ``x̂`` where the native kernel reads the layout (``observers.metrics_kernel``).
Eager sums are fp32, native ones fp64 over fp32 lanes; both go through the same final code, so
edge cases give the same defined values, never NaN: a zero error has SQNR ``inf``, a zero
reference (with an error) ``-inf``, two zero tensors have cosine 1.
"""

from __future__ import annotations

import math

import torch

from observers import metrics_kernel
from observers.granularity import Flat, flatten
from observers.qparams import QParams
from observers.quantize import fake_quantize
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
    largest = err.abs().max() if ref.numel() else torch.zeros((), device=ref.device)
    return _comparison_metrics(sums, largest, ref.numel(), across)


def _comparison_metrics(
    sums: torch.Tensor, largest: torch.Tensor, count: int, across: Reduce | None
) -> dict[str, float]:
    """``compare_tensors``' metrics from one rank's ``[Σ err², Σ x², Σ x̂², Σ x·x̂]``, ``max |err|``
    (0-d fp32) and element count: one place for the reduction over ranks and the edge-case rules,
    whether the sums come from eager torch or from the native kernel (``quantization_metrics``)."""
    if across is not None:
        count = int(across(torch.tensor([count], dtype=torch.float64, device=sums.device), Op.SUM))
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


def _clip_bounds(spec: QuantSpec) -> tuple[float, float]:
    """The shifted codes ``x / s + zp`` beyond which an integer element counts as clipped: half a
    step past ``[qmin, qmax]`` plus ``_EDGE_STEPS`` (see ``_clip_and_step_sums``)."""
    qmin, qmax = spec.int_range
    return qmin - 0.5 - _EDGE_STEPS, qmax + 0.5 + _EDGE_STEPS


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
    g_idx = qp.extras.get("g_idx")
    flat = flatten(x, spec, qp.kind, g_idx=g_idx)
    flat_hat = flatten(x_hat, spec, qp.kind, g_idx=g_idx)
    scale = flat.broadcast(qp.effective_scale)
    clipped = _clipped(flat, scale, qp, spec)
    step_error = ((flat_hat.data.float() - flat.data.float()) / scale).square()
    if flat.valid is not None:
        step_error = step_error * flat.valid
    return torch.stack([clipped.sum().double(), step_error.sum().double()])


def _clipped(flat: Flat, scale: torch.Tensor, qp: QParams, spec: QuantSpec) -> torch.Tensor:
    """Which elements of ``flat`` (``granularity.flatten``'s view of a tensor, ``scale`` broadcast to
    it) lie beyond the representable range, by ``_clip_and_step_sums``' rule; padding is not."""
    scaled = flat.data.float() / scale
    if spec.format.kind == "int":
        low, high = _clip_bounds(spec)
        shifted = scaled.add_(flat.broadcast(qp.zero_point))
        clipped = (shifted > high) | (shifted < low)
    else:
        clipped = scaled.abs() > spec.format.max_value * (1 + 1e-6)
    return clipped if flat.valid is None else clipped & flat.valid


def clip_ratio(x: torch.Tensor, qp: QParams, spec: QuantSpec) -> float:
    """``error_metrics``' ``clip_ratio`` of ``x`` alone: the share of its elements beyond ``qp``'s
    representable range, which does not depend on ``x̂`` (GPTQ's share of its updated weights: one
    mask, none of the other metrics' passes over a layer-sized tensor). A one-line ValueError for a
    plain cast (no scale) or an empty ``x``."""
    if spec.format.kind == "cast" or x.numel() == 0:
        raise ValueError(f"clip_ratio needs a non-empty tensor of a scaled format, got {x.numel()} of {spec.dtype!r}")
    flat = flatten(x, spec, qp.kind, g_idx=qp.extras.get("g_idx"))
    return int(_clipped(flat, flat.broadcast(qp.effective_scale), qp, spec).sum()) / x.numel()


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
    return {**metrics, **_step_metrics(sums, x, spec, across)}


def _step_metrics(
    sums: torch.Tensor, x: torch.Tensor, spec: QuantSpec, across: Reduce | None
) -> dict[str, float | None]:
    """``clip_ratio`` and ``rmse_over_scale`` from one rank's ``[clipped count, Σ (err / s)²]``
    of ``x``, added over the ranks (the one place for that rule, eager or native sums)."""
    count = torch.tensor(float(x.numel()), dtype=torch.float64)
    sums = torch.cat([sums.to(count.device), count.reshape(1)])
    if across is not None:
        sums = across(sums.to(x.device), Op.SUM)
    clipped, step_sq, count = (float(value) for value in sums)
    return {
        "clip_ratio": clipped / count,
        "rmse_over_scale": None if spec.format.kind == "cast" else math.sqrt(step_sq / count),
    }


def quantization_metrics(
    x: torch.Tensor, qp: QParams, spec: QuantSpec, across: Reduce | None = None
) -> dict[str, float | None]:
    """``error_metrics(x, fake_quantize(x, qp, spec), qp, spec, across)``, without writing x̂
    where it can.

    Integer formats on contiguous fp32 CPU layouts go through the native one-read kernel
    (``observers.metrics_kernel``: the same x̂, the same counts and maximum, sums a few ulps
    apart); everything else, or an empty part of a tensor split between ranks, fake-quantizes
    eagerly. Both paths make the same reductions over ranks, so ranks may take different paths.
    """
    native = metrics_kernel.quant_error_sums(x, qp, spec, _clip_bounds(spec))
    if native is None:
        x_hat = fake_quantize(x, qp, spec) if x.numel() else x
        return error_metrics(x, x_hat, qp, spec, across)
    comparison = _comparison_metrics(native.comparison, native.largest, x.numel(), across)
    return {**comparison, **_step_metrics(native.clip_and_step, x, spec, across)}
