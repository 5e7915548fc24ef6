"""Dynamic quantization: the qparams a runtime computes on the fly for each activation it sees.

A ``QuantSpec(dynamic=True)`` activation is not quantized with calibrated qparams: at run time
every token (``token``), every token's group of ``group_size`` hidden values (``group`` and the
block formats MX/NVFP4/BFP16, whose scale covers 32/16/8 consecutive values) or each call as a
whole (``tensor``) gets the min-max range of the values in it. Static qparams of such a tensor
only summarize calibration, so this module computes the run-time ones for comparison.

The activation ``x`` is viewed as ``(tokens, hidden)`` (leading dims flattened into tokens) and
treated like a weight ``(out, in)``: per-token ranges are per-output-channel ranges, per-token
groups are weight groups. The library's one ``flatten`` and ``calculate_qparams`` then give the
run-time qparams unchanged; ``dynamic_view_spec`` is the spec of that view, which the returned
``QParams`` (``kind="weight"``) belong to. Shapes: token ``(tokens, 1)``, group
``(tokens, ceil(hidden / g))``, tensor ``(1,)``. NVFP4's fp32 global scale is that of the call
(``x`` as a whole), as a fully dynamic runtime computes it.
"""

from __future__ import annotations

import torch

from observers.granularity import all_finite, as_2d, flatten, reduce_min_max
from observers.metrics import quantization_metrics
from observers.qparams import QParams, calculate_qparams
from observers.quantize import fake_quantize
from observers.spec import QuantSpec

DYNAMIC_STRATEGIES = ("token", "group", "tensor")


def dynamic_view_spec(spec: QuantSpec) -> QuantSpec:
    """The weight-style spec on the ``(tokens, hidden)`` view whose qparams are the run-time ones:
    ``token`` becomes per-output-channel (``channel``, ``ch_axis=0``); ``group`` and ``tensor``
    keep their strategy. ``channel`` (one fixed range per hidden feature) and ``block`` are not
    run-time schemes and raise ``ValueError``, as do plain casts (fp16/bf16 have no scale)."""
    if not isinstance(spec, QuantSpec):
        raise ValueError(f"spec must be a QuantSpec, got {type(spec).__name__}")
    if spec.format.kind == "cast":
        raise ValueError(f"{spec.dtype} is a plain cast with no scale; dynamic ranges do not apply to it")
    if spec.strategy not in DYNAMIC_STRATEGIES:
        raise ValueError(
            f"strategy {spec.strategy!r} has no run-time (dynamic) form: a per-feature or 2-D block range "
            f"is fixed across tokens; dynamic quantization takes strategy {', '.join(DYNAMIC_STRATEGIES)}"
        )
    if spec.strategy == "token":
        return spec.replace(strategy="channel", ch_axis=0)
    return spec


def _tokens_view(x: torch.Tensor) -> torch.Tensor:
    """``x`` as ``(tokens, hidden)``, after the checks that make every later step well defined."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"dynamic quantization needs a torch.Tensor, got {type(x).__name__}")
    if x.ndim == 0:
        raise ValueError("dynamic quantization needs an activation (tokens, hidden), got a 0-d tensor")
    if not x.dtype.is_floating_point:
        raise ValueError(f"dynamic quantization needs a floating-point tensor, got {x.dtype}")
    if x.shape[-1] == 0:
        raise ValueError(f"the activation of shape {tuple(x.shape)} has an empty hidden (last) dim")
    x2 = as_2d(x, "activation")
    if x2.shape[0] == 0:
        raise ValueError(
            f"the activation of shape {tuple(x.shape)} saw no tokens; dynamic qparams need at least one token"
        )
    if not all_finite(x2):
        bad = int((~torch.isfinite(x2)).sum())
        raise ValueError(
            f"the activation has {bad} non-finite value(s) (NaN/Inf) out of {x2.numel()}; "
            "a run-time range over them would be NaN/Inf"
        )
    return x2


def _dynamic(x: torch.Tensor, spec: QuantSpec) -> tuple[torch.Tensor, QuantSpec, QParams]:
    view_spec = dynamic_view_spec(spec)
    x2 = _tokens_view(x)
    with torch.no_grad():
        qp = calculate_qparams(*reduce_min_max(flatten(x2, view_spec, "weight")), view_spec)
    qp.kind = "weight"
    return x2, view_spec, qp


def dynamic_qparams(x: torch.Tensor, spec: QuantSpec) -> QParams:
    """The qparams a runtime computing ranges on the fly uses for activation ``x``.

    One min-max range per token (``token``: shape ``(tokens, 1)``), per token and group
    (``group`` and block formats: ``(tokens, ceil(hidden / g))``) or per call (``tensor``:
    ``(1,)``), on ``x``'s device. They belong to ``x.reshape(-1, hidden)`` quantized with
    ``dynamic_view_spec(spec)`` (``kind="weight"``). ``ValueError`` for a ``channel``/``block``
    strategy, a cast dtype, an empty ``x`` or non-finite values.
    """
    return _dynamic(x, spec)[2]


def dynamic_fake_quantize(x: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """``x`` quantized and dequantized with its own run-time qparams: same shape and dtype as ``x``,
    the error true dynamic quantization leaves (to compare with a static observer's)."""
    x2, view_spec, qp = _dynamic(x, spec)
    with torch.no_grad():
        return fake_quantize(x2, qp, view_spec).reshape(x.shape)


def dynamic_error_metrics(x: torch.Tensor, spec: QuantSpec) -> tuple[QParams, dict[str, float | None]]:
    """The run-time qparams of ``x`` and ``error_metrics`` of quantizing ``x`` with them (every key
    of ``METRIC_KEYS``), in one pass of the range computation."""
    x2, view_spec, qp = _dynamic(x, spec)
    with torch.no_grad():
        return qp, quantization_metrics(x2, qp, view_spec)
