"""Native pick of the ``local_hessian`` sweep (``csrc/block_hessian.c``).

Why: the eager sweep (``modelopt_search.candidate_errors`` with a Hessian, then ``argmin``) fake-quantizes
the whole weight once per candidate, 126 E4M3 block scales, and runs a batched matmul over the block
columns: a dozen passes through weight-sized buffers per candidate and a ``(126, rows, blocks)`` error
table. The kernel keeps sixteen rows of one block column and its ``16x16`` Hessian in L1 through every
candidate and writes only each block's pick.

How: ``hessian_picks`` takes the weight as ``(rows, blocks, 16)``, the ``(blocks, 16, 16)`` Hessian and one
step per candidate, and returns per row and block the least ``dwᵀ H_b dw`` and the first candidate reaching
it (NaN read as +inf), ``dw = x - grid(x/s)·s`` with the codes and dequantized values of ``fake_quantize``
bit for bit (the float grid rounding of ``csrc/float_grid.h`` after the correctly rounded ``x/s``). The form
is summed with fused multiply-adds in a fixed order, another than the eager matmul's, so values differ from
eager's by a few ulps of their terms, which can flip only a block whose two best candidates tie that
closely; candidates giving the same dequantized block give the same form (each runs the same operations),
so exact ties keep the first, as ``argmin`` does. It returns None whenever the eager path must run: CUDA,
non-fp32 or non-contiguous tensors, shapes it does not take, a format that is not a float grid, the
kernel not in use (``observers.kernels.status("block_hessian")``) or inside ``kernels.disabled()``.
"""

from __future__ import annotations

import ctypes

import torch

from observers import kernels
from observers.float_grid_kernel import covers
from observers.formats import ElementFormat
from observers.mse_kernel import WORK_PER_THREAD

NAME = "block_hessian"
BLOCK = 16
"""Values per block: NVFP4's, the only block size ``local_hessian`` takes."""
_MAX_OFFSET = 2**31
"""The kernel gathers a tile's rows with int32 offsets: ``16·in`` must stay below this."""
_ARGUMENTS = [
    ctypes.c_void_p,  # x (rows, blocks, 16)
    ctypes.c_int64,  # rows
    ctypes.c_int64,  # blocks
    ctypes.c_void_p,  # hessian (blocks, 16, 16)
    ctypes.c_void_p,  # step (count,)
    ctypes.c_int64,  # count (candidates)
    ctypes.c_int,  # exp_bits
    ctypes.c_int,  # man_bits
    ctypes.c_double,  # max_value
    ctypes.c_int,  # threads
    ctypes.c_void_p,  # best value (rows, blocks)
    ctypes.c_void_p,  # best index (rows, blocks) int64
]


def _laid_out(t: torch.Tensor) -> bool:
    """A non-empty contiguous fp32 CPU tensor: what the kernel reads."""
    return t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous() and t.numel() > 0


def takes(data: torch.Tensor, hessian: torch.Tensor, steps: torch.Tensor, fmt: ElementFormat) -> bool:
    """Whether ``hessian_picks`` runs the kernel on these tensors and this format."""
    if not all(_laid_out(t) for t in (data, hessian, steps)) or not covers(fmt):
        return False
    shaped = data.ndim == 3 and data.shape[2] == BLOCK and steps.ndim == 1
    shaped = shaped and tuple(hessian.shape) == (data.shape[1], BLOCK, BLOCK)
    return shaped and BLOCK * data.shape[1] * BLOCK < _MAX_OFFSET and kernels.in_use(NAME) is not None


def hessian_picks(
    data: torch.Tensor, hessian: torch.Tensor, steps: torch.Tensor, fmt: ElementFormat, isa: str | None = None
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Per row and block the least ``dwᵀ H_b dw`` over the candidate steps and the first candidate reaching
    it, ``((rows, blocks), (rows, blocks) int64)``, or None when the eager path must run (``takes``).

    ``data`` is ``(rows, blocks, 16)``, ``hessian`` ``(blocks, 16, 16)``, ``steps`` ``(C,)``: candidate
    ``c``'s element step for every block. ``isa`` picks a kernel variant (tests compare them).
    """
    if not takes(data, hessian, steps, fmt):
        return None
    rows, blocks, _ = data.shape
    count = steps.numel()
    best_value = torch.empty(rows, blocks, dtype=torch.float32)
    best_index = torch.empty(rows, blocks, dtype=torch.int64)
    tiles = -(-rows // BLOCK) * blocks
    threads = max(1, min(torch.get_num_threads(), tiles, data.numel() * count // WORK_PER_THREAD))
    kernels.function(NAME, isa, _ARGUMENTS)(
        data.data_ptr(),
        rows,
        blocks,
        hessian.data_ptr(),
        steps.data_ptr(),
        count,
        fmt.exp_bits,
        fmt.man_bits,
        fmt.max_value,
        threads,
        best_value.data_ptr(),
        best_index.data_ptr(),
    )
    return best_value, best_index
