"""Native pick of AWQ's clip search (``csrc/group_clip.c``).

Why: the eager pick (``awq.clip_picks``) fake-quantizes every candidate weight once per clip ratio
and runs a batched matmul over the groups (``group_output_errors``): about ten passes through
weight-sized buffers and a permuted copy per ratio, 235 ms for 20 candidates of a 688x256 weight
and eleven ratios. The kernel keeps sixteen rows of one group column and that group's Hessian
block in L1 through every ratio and writes only each group's pick.

How: ``group_clip_picks`` takes the weights as ``(n, rows, groups, size)``, each weight's
``(groups, size, size)`` Hessian blocks, and per ratio every row's and group's step and zero point,
and returns per row and group the first ratio of least ``dwᵀ H dw``, kept as eager keeps it (the
first, then a ratio only when strictly less). The codes and ``dw`` are ``fake_quantize``'s bit for
bit; the form is summed in another order than eager's matmul, so values differ by a few ulps of
their terms, which can move a pick only between two ratios that tie that closely. It returns None
whenever the eager path must run: CUDA, non-fp32 or non-contiguous tensors, groups wider than
``MAX_SIZE``, the kernel not in use (``observers.kernels.status("group_clip")``) or inside
``kernels.disabled()``.
"""

from __future__ import annotations

import ctypes

import torch

from observers import kernels
from observers.mse_kernel import WORK_PER_THREAD

NAME = "group_clip"
MAX_SIZE = 256
"""The widest group the kernel takes (``MAX_SIZE`` in the C source: its per-lane buffers)."""
_MAX_OFFSET = 2**31
"""The kernel gathers a tile's sixteen rows with int32 offsets: ``16·in`` must stay below this."""
_ARGUMENTS = [
    ctypes.c_void_p,  # x (n, rows, groups, size)
    ctypes.c_int64,  # weights (n)
    ctypes.c_int64,  # rows per weight
    ctypes.c_int64,  # groups
    ctypes.c_int64,  # size
    ctypes.c_void_p,  # hessian (n, groups, size, size)
    ctypes.c_void_p,  # step (count, n·rows, groups)
    ctypes.c_void_p,  # zero point (count, n·rows, groups)
    ctypes.c_float,  # qmin
    ctypes.c_float,  # qmax
    ctypes.c_int64,  # count (ratios)
    ctypes.c_int,  # threads
    ctypes.c_void_p,  # best (n·rows, groups) int64
]


def _laid_out(t: torch.Tensor) -> bool:
    """A non-empty contiguous fp32 CPU tensor: what the kernel reads."""
    return t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous() and t.numel() > 0


def takes(data: torch.Tensor, hessian: torch.Tensor, step: torch.Tensor, zero: torch.Tensor) -> bool:
    """Whether ``group_clip_picks`` runs the kernel on these tensors."""
    if not all(_laid_out(t) for t in (data, hessian, step, zero)) or data.ndim != 4:
        return False
    n, rows, groups, size = data.shape
    shaped = tuple(hessian.shape) == (n, groups, size, size) and size <= MAX_SIZE
    shaped = shaped and step.ndim == 3 and tuple(step.shape[1:]) == (n * rows, groups) and step.shape == zero.shape
    return shaped and 16 * groups * size < _MAX_OFFSET and kernels.in_use(NAME) is not None


def group_clip_picks(
    data: torch.Tensor,
    hessian: torch.Tensor,
    step: torch.Tensor,
    zero: torch.Tensor,
    qmin: float,
    qmax: float,
    isa: str | None = None,
) -> torch.Tensor | None:
    """Per row and group the first ratio of least ``dwᵀ H dw``, ``(n·rows, groups)`` int64, or None
    when the eager path must run (``takes``).

    ``data`` is ``(n, rows, groups, size)``, ``hessian`` ``(n, groups, size, size)`` (weight ``i``'s
    rows read its own blocks), ``step`` and ``zero`` ``(ratios, n·rows, groups)``; ``qmin``/``qmax``
    the integer grid's codes. ``isa`` picks a kernel variant (tests compare them).
    """
    if not takes(data, hessian, step, zero):
        return None
    n, rows, groups, size = data.shape
    count = step.shape[0]
    best = torch.empty(n * rows, groups, dtype=torch.int64)
    units = n * -(-rows // 16) * groups
    threads = max(1, min(torch.get_num_threads(), units, data.numel() * count * size // WORK_PER_THREAD))
    kernels.function(NAME, isa, _ARGUMENTS)(
        data.data_ptr(),
        n,
        rows,
        groups,
        size,
        hessian.data_ptr(),
        step.data_ptr(),
        zero.data_ptr(),
        qmin,
        qmax,
        count,
        threads,
        best.data_ptr(),
    )
    return best
