"""Native candidate errors of the shrink-grid searches for int formats (``csrc/group_mse_grid.c``).

Why: the eager searches run about eight torch passes per candidate (divide, round, clamp,
subtract, abs, log, multiply, exp) before the sum, each a round trip through a buffer; the
kernel reads each piece of the data once per call and evaluates every candidate of the call
while the piece is in L1, with its own vectorized log2/exp2, so the search is bound by
arithmetic instead (4096x4096 int4 g128, 20 candidates: ~75 ms on 2 AVX-512 cores).

How: ``candidate_errors`` takes ``(N, Q, K)`` data and returns per candidate and group
``Σ weight·|clamp(rint(x/s), low, high) - x/s|^norm`` (in steps, what ``mse_grid._unit_errors``
sums) or, with ``direct``, ``Σ weight·|clamp(rint(x/s), low, high)·s - x|^norm`` (what
``lc_search`` sums). The codes are the eager codes (the same true division, round half to even);
``|e|^norm`` is exact where the eager path's is (norm 1 and 2; 3 too with ``direct``, as
``torch.pow``), else a few ulps from the exact power as eager's; the fp32 sums run in another order.
So errors differ from the eager ones by a few ulps, which can flip only a group whose two best
candidates tie to ~1e-6. It returns None whenever the eager path must run: CUDA, non-fp32 or
non-contiguous tensors, the kernel not in use (``observers.kernels.status("group_mse_grid")``)
or inside ``kernels.disabled()``. Float formats never come here (the callers check).
"""

from __future__ import annotations

import ctypes

import torch

from observers import kernels

NAME = "group_mse_grid"
PIECE = 4096
"""Longest run of one row a kernel work unit takes (16 KiB: stays in L1 through all candidates);
longer rows (per-tensor and per-token views) are cut into pieces so every thread gets work,
and the pieces' sums are added here."""
WORK_PER_THREAD = 1 << 18
"""Element-candidate errors (about 0.2 ms of work) below which another thread costs more to wake
and join than it saves: small searches run on one thread."""
_ARGUMENTS = [
    ctypes.c_void_p,  # x
    ctypes.c_void_p,  # weight or NULL
    ctypes.c_int64,  # rows
    ctypes.c_int64,  # run
    ctypes.c_int64,  # piece
    ctypes.c_int64,  # groups
    ctypes.c_int64,  # count (candidates)
    ctypes.c_void_p,  # step (C, Q)
    ctypes.c_void_p,  # low
    ctypes.c_void_p,  # high
    ctypes.c_int64,  # bound stride per candidate
    ctypes.c_int64,  # bound stride per group
    ctypes.c_double,  # norm
    ctypes.c_int,  # direct
    ctypes.c_int,  # threads
    ctypes.c_void_p,  # out
]


def chunk_size(count: int, patience: int) -> int:
    """Candidates per kernel call (between early-stop checks) of a search over ``count``.

    The kernel needs no buffers, so the trade-off is one more read of the data per call against
    candidates evaluated past the early stop: ``2·(patience + 1)`` keeps both small (a search
    never stops before ``patience + 1`` candidates); ``patience`` 0 never stops: one call.
    """
    return count if patience == 0 else min(count, 2 * (patience + 1))


def readable(data: torch.Tensor, weight: torch.Tensor | None) -> bool:
    """Whether a candidate-error kernel can read this data and weight: non-empty ``(N, Q, K)``
    contiguous fp32 CPU tensors of one shape (this kernel's and ``float_grid_kernel``'s rule)."""
    tensors = [data] if weight is None else [data, weight]
    laid_out = all(
        t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous() and t.shape == data.shape
        for t in tensors
    )
    return laid_out and data.ndim == 3 and data.numel() > 0


def usable(data: torch.Tensor, weight: torch.Tensor | None) -> bool:
    """Whether ``candidate_errors`` runs the kernel on this ``(N, Q, K)`` data and weight."""
    return readable(data, weight) and kernels.in_use(NAME) is not None


def _bounds(
    low: torch.Tensor | float, high: torch.Tensor | float, count: int, groups: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(C, Q)`` fp32 views of the code bounds sharing one stride pattern (the kernel takes one
    pair of strides): a scalar bound is a stride-0 view, so symmetric formats pass one value."""
    views = [
        torch.tensor(bound, dtype=torch.float32).expand(count, groups)
        if isinstance(bound, float)
        else bound.reshape(count, groups).float()
        for bound in (low, high)
    ]
    if views[0].stride() != views[1].stride():
        views = [view.contiguous() for view in views]
    return views[0], views[1]


def candidate_errors(
    data: torch.Tensor,
    weight: torch.Tensor | None,
    step: torch.Tensor,
    low: torch.Tensor | float,
    high: torch.Tensor | float,
    norm: float,
    direct: bool = False,
    isa: str | None = None,
) -> torch.Tensor | None:
    """``Σ weight·|clamp(rint(x/s), low, high) - x/s|^norm`` per candidate and group, ``(C, Q)``, or None.

    ``data`` and ``weight`` (or None) are ``(N, Q, K)``; ``step``, ``low`` and ``high`` hold ``C·Q``
    values, candidate major (``(C, Q)`` or ``(C, 1, Q, 1)``); a bound may be one float. The bounds are
    integer codes measured from the zero point (``qmin - zp``, ``qmax - zp``). Errors are in steps
    (the caller multiplies by ``s^norm``), or with ``direct`` in the data's units,
    ``|clamp(rint(x/s), low, high)·s - x|``. None when the eager path must run (``usable``).
    ``isa`` picks a kernel variant (tests compare them).
    """
    if not usable(data, weight):
        return None
    function = kernels.function(NAME, isa, _ARGUMENTS)
    observations, groups, run = data.shape
    count = step.numel() // groups
    step = step.reshape(count, groups).float().contiguous()
    low, high = _bounds(low, high, count, groups)
    piece = min(run, PIECE)
    pieces = -(-run // piece)
    rows = observations * groups
    out = torch.empty(count, rows * pieces, dtype=torch.float32)
    threads = max(1, min(torch.get_num_threads(), rows * pieces, data.numel() * count // WORK_PER_THREAD))
    function(
        data.data_ptr(),
        None if weight is None else weight.data_ptr(),
        rows,
        run,
        piece,
        groups,
        count,
        step.data_ptr(),
        low.data_ptr(),
        high.data_ptr(),
        low.stride(0),
        low.stride(1),
        norm,
        int(direct),
        threads,
        out.data_ptr(),
    )
    if observations == 1 and pieces == 1:
        return out
    return out.view(count, observations, groups, pieces).sum(dim=(1, 3))
