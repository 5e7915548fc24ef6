"""Native effective weights of AWQ's candidates, ``Q(W·s)/s`` (``csrc/smoothed_quant.c``).

Why: an AWQ search judges each candidate with the weight it would deploy, the smoothed weight
``W·s`` fake-quantized and divided back by ``s``, in llm-compressor's arithmetic (both the product
and the quotient in float64, then cast). Eager torch makes about ten passes over weight-sized
buffers per candidate for it, two of them in float64; at a 7B block's width that is 0.8 s a
gate/up candidate, more than a tenth of a search. The kernel reads the weight once and writes each
candidate's effective weight once, every element computed with the eager operations in the eager
order: the outputs are bit-identical.

``smoothed_fake_quantize`` returns None whenever the eager path must run: not an integer format,
CUDA or non-fp32 weights, scales that are not float64, qparams that are not one fp32 step and zero
point per row and group of ``group_size`` columns (a multiple of 16 dividing the columns), the
kernel not in use (``observers.kernels.status("smoothed_quant")``) or inside ``kernels.disabled()``.
"""

from __future__ import annotations

import ctypes

import torch

from observers import kernels
from observers.qparams import QParams
from observers.spec import QuantSpec

NAME = "smoothed_quant"
LANES = 16
"""A group's columns come in whole vectors of this many (the AVX-512 width; twice the AVX2 one)."""

_ARGUMENTS = [
    ctypes.c_void_p,  # w (rows, columns) fp32
    ctypes.c_int64,  # rows
    ctypes.c_int64,  # columns
    ctypes.c_int64,  # n candidates
    ctypes.c_void_p,  # scales (n, columns) fp64
    ctypes.c_void_p,  # step (n, rows, groups) fp32
    ctypes.c_void_p,  # zero point (n, rows, groups) fp32
    ctypes.c_int64,  # group
    ctypes.c_float,  # qmin
    ctypes.c_float,  # qmax
    ctypes.c_int,  # threads
    ctypes.c_void_p,  # out (n, rows, columns) fp32
]


def group_of(spec: QuantSpec, columns: int) -> int | None:
    """The columns one step covers under ``spec`` (a group, or a whole row), or None when the
    kernel does not take the spec: not an integer grid, or groups it cannot read in vectors."""
    if spec.format.kind != "int" or spec.strategy not in ("group", "channel"):
        return None
    if spec.strategy == "channel" and spec.ch_axis not in (None, 0):
        return None
    group = spec.group_size if spec.strategy == "group" else columns
    return group if group % LANES == 0 and columns % group == 0 else None


def smoothed_fake_quantize(
    weight: torch.Tensor, scales: torch.Tensor, qparams: QParams, spec: QuantSpec, isa: str | None = None
) -> torch.Tensor | None:
    """``n`` candidates' ``Q(W·s)/s`` ``(n, rows, columns)`` fp32 from the ``(rows, columns)``
    ``weight``, their float64 ``scales`` ``(n, columns)`` and ``qparams`` stacked along the rows
    (``n·rows`` rows of steps and zero points), or None when the eager path must run (see the
    module docstring). ``isa`` picks a kernel variant (tests compare them)."""
    if kernels.in_use(NAME) is None or weight.ndim != 2 or scales.ndim != 2:
        return None
    rows, columns = weight.shape
    n = scales.shape[0]
    group = group_of(spec, columns)
    step, zero = qparams.effective_scale, qparams.zero_point
    readable = (
        group is not None
        and weight.dtype == torch.float32
        and scales.dtype == torch.float64
        and scales.shape[1] == columns
        and step.dtype == torch.float32
        and all(t.device.type == "cpu" for t in (weight, scales, step, zero))
        and step.numel() == n * rows * (columns // group)
        and zero.numel() == step.numel()
    )
    if not readable or weight.numel() == 0:
        return None
    entry = kernels.function(NAME, isa, _ARGUMENTS)
    w, s = weight.contiguous(), scales.contiguous()
    d, z = step.contiguous(), zero.to(torch.float32).contiguous()
    qmin, qmax = spec.int_range
    out = torch.empty(n, rows, columns, dtype=torch.float32)
    entry(
        w.data_ptr(),
        rows,
        columns,
        n,
        s.data_ptr(),
        d.data_ptr(),
        z.data_ptr(),
        group,
        float(qmin),
        float(qmax),
        kernels.threads_for(out.numel()),
        out.data_ptr(),
    )
    return out
