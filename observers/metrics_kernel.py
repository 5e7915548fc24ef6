"""Native error sums of an integer fake-quantization (``csrc/quant_error.c``).

Why: after every observer the suite fake-quantizes the tensor and measures the error; eager torch
does that in about twenty elementwise passes (``fake_quantize``, then ``compare_tensors`` and
``_clip_and_step_sums`` of ``observers.metrics``), about a fifth of an app Run over a model's
Linear layers. The kernel reads each element once, computes its ``x̂`` in registers with the
operations and order of ``element_codes`` + ``fake_quantize`` (so ``x̂`` is bit-identical) and
adds it into every sum the metrics need, without writing ``x̂``.

Same numbers: the clipped count and ``max |err|`` are exact; the sums add the eager terms in
another order (fp32 per vector lane over at most 1024 values, then fp64), so they differ from
torch's fp32 sums by a few ulps. ``quant_error_sums`` returns None whenever the eager path must
run: a format that is not an integer format, CUDA or non-fp32 data, qparams that are not fp32
scales with integer or fp32 zero points, a layout with padding (ragged groups or blocks) or
groups shorter than ``kernels.MIN_RUN`` (per-feature activations), qparams that do not fit the
tensor (the eager path raises the error), the kernel not in use
(``observers.kernels.status("quant_error")``) or inside ``kernels.disabled()``.
"""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass

import torch

from observers import kernels
from observers.granularity import flatten
from observers.qparams import QParams
from observers.spec import QuantSpec

NAME = "quant_error"


@dataclass(frozen=True)
class ErrorSums:
    """One tensor's quantization error as the sums ``observers.metrics`` turns into metrics."""

    comparison: torch.Tensor
    """fp64 ``[Σ err², Σ x², Σ x̂², Σ x·x̂]`` (``err = x̂ - x``), what ``compare_tensors`` sums."""
    largest: torch.Tensor
    """fp32 0-d ``max |err|`` (NaN when an error is NaN)."""
    clip_and_step: torch.Tensor
    """fp64 ``[clipped count, Σ (err / s)²]``, what ``_clip_and_step_sums`` sums."""


_ARGUMENTS = [
    ctypes.c_void_p,  # x
    ctypes.c_int64,  # rows
    ctypes.c_int64,  # run
    ctypes.c_int64,  # groups
    ctypes.c_void_p,  # scale (groups,)
    ctypes.c_void_p,  # zero point (groups,), fp32
    ctypes.c_float,  # qmin
    ctypes.c_float,  # qmax
    ctypes.c_float,  # clip low
    ctypes.c_float,  # clip high
    ctypes.c_int,  # threads
    ctypes.c_void_p,  # out (7,) fp64
]

_ZERO_POINT_DTYPES = (torch.int32, torch.int64, torch.int16, torch.int8, torch.uint8, torch.float32)
"""Zero points that become fp32 exactly as the eager ``add_`` makes them (a float64 zero point or
scale would make the eager arithmetic float64)."""


def _readable_qparams(qp: QParams) -> bool:
    """fp32 CPU scales and zero points of the dtypes above."""
    scale, zero_point = qp.effective_scale, qp.zero_point
    return (
        scale.dtype == torch.float32
        and scale.device.type == "cpu"
        and zero_point.device.type == "cpu"
        and zero_point.dtype in _ZERO_POINT_DTYPES
    )


def _runs(x: torch.Tensor, qp: QParams, spec: QuantSpec) -> torch.Tensor | None:
    """``x`` as the contiguous ``(N, Q, K)`` layout of ``flatten`` (Q = one group per scale),
    or None when the kernel does not read it (see the module docstring)."""
    if spec.format.kind != "int" or not isinstance(x, torch.Tensor) or x.numel() == 0:
        return None
    if x.device.type != "cpu" or x.dtype != torch.float32 or not _readable_qparams(qp):
        return None
    flat = flatten(x.detach(), spec, qp.kind, g_idx=qp.extras.get("g_idx"))
    data = flat.data
    if tuple(qp.scale.shape) != flat.qparam_shape or flat.valid is not None or not data.is_contiguous():
        return None
    if data.shape[-1] < kernels.MIN_RUN:
        return None
    groups = math.prod(flat.qparam_shape)
    return data.view(-1, groups, data.shape[-1])


def quant_error_sums(
    x: torch.Tensor, qp: QParams, spec: QuantSpec, clip_bounds: tuple[float, float], isa: str | None = None
) -> ErrorSums | None:
    """The error sums of ``fake_quantize(x, qp, spec)`` against ``x``, read natively, or None.

    ``clip_bounds``: ``(low, high)`` of the shifted code ``x / s + zp`` beyond which an element
    counts as clipped (compared in fp32, as torch compares an fp32 tensor with a Python float).
    ``isa`` picks a kernel variant (tests compare them); by default the best this CPU runs.
    None when the eager path must run (see the module docstring).
    """
    runs = None if kernels.in_use(NAME) is None else _runs(x, qp, spec)
    if runs is None:
        return None
    entry = kernels.function(NAME, isa, _ARGUMENTS)
    observations, groups, run = runs.shape
    scale = qp.effective_scale.reshape(groups).contiguous()
    zero_point = qp.zero_point.reshape(groups).to(torch.float32).contiguous()
    qmin, qmax = spec.int_range
    out = torch.empty(7, dtype=torch.float64)
    entry(
        runs.data_ptr(),
        observations * groups,
        run,
        groups,
        scale.data_ptr(),
        zero_point.data_ptr(),
        qmin,
        qmax,
        *clip_bounds,
        kernels.threads_for(runs.numel()),
        out.data_ptr(),
    )
    return ErrorSums(out[:4], out[6].float(), out[4:6])
