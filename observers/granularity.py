"""One way to flatten a tensor for every granularity.

``flatten(x, spec, kind)`` returns a view of ``x`` shaped ``(num_observations, *qparam_shape,
group)``: every quantization group is a run along the last dim, and the statistics of a group
are a reduction over dims ``(0, -1)``. No observer loops over groups, channels or blocks.

qparam shapes (the contract every module relies on):

=========== ============================ ================================ ====================
strategy    weight ``(out, in)``          activation ``(tokens, hidden)``  attention ``(b,h,s,d)``
=========== ============================ ================================ ====================
tensor      ``(1,)``                      ``(1,)``                         ``(1,)``
channel     ``(out, 1)`` (ch_axis 0) or   ``(hidden,)`` (ch_axis -1)       ``(heads,)``
            ``(1, in)`` (ch_axis 1)
group g     ``(out, ceil(in/g))``         ``(ceil(hidden/g),)``            n/a
token       n/a                           ``(tokens, 1)``                  n/a
block       ``(ceil(out/bh), ceil(in/bw))`` n/a                            n/a
=========== ============================ ================================ ====================

Conv weights ``(out, in, kh, kw)`` are viewed as ``(out, in*kh*kw)``; activations with more
than two dims have their leading dims flattened into tokens. A ragged last group or block is
padded by repeating an element of the same group, so min/max need no mask; sums use ``valid``.
With ``g_idx`` (activation ordering, group strategy only) column ``c`` belongs to group
``g_idx[c]``; groups may then differ in size and be in any column order.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from observers import kernels
from observers.spec import QuantSpec


@dataclass
class Flat:
    """A tensor viewed as ``(num_observations, *qparam_shape, group)``.

    ``valid`` is ``None`` when there is no padding, else a bool tensor broadcastable to ``data``
    marking the real elements. ``restore`` maps a tensor shaped like ``data`` back to the shape
    of the original tensor (dropping padding).
    """

    data: torch.Tensor
    valid: torch.Tensor | None
    qparam_shape: tuple[int, ...]
    restore: Callable[[torch.Tensor], torch.Tensor]
    num_tokens: int = 0

    def broadcast(self, qparam: torch.Tensor) -> torch.Tensor:
        """Reshape a qparam tensor so it broadcasts against ``data``."""
        return qparam.reshape(1, *self.qparam_shape, 1)


def as_2d(x: torch.Tensor, kind: str) -> torch.Tensor:
    """The 2-D view of a weight ``(out, in*...)`` or activation ``(tokens, hidden)``."""
    if kind == "weight":
        return x.reshape(1, -1) if x.ndim == 1 else x.reshape(x.shape[0], -1)
    return x.reshape(-1, x.shape[-1])


def _pad_columns(x2: torch.Tensor, total: int) -> torch.Tensor:
    missing = total - x2.shape[1]
    if missing == 0:
        return x2
    return torch.cat([x2, x2[:, -1:].expand(x2.shape[0], missing)], dim=1)


def _pad_rows(x2: torch.Tensor, total: int) -> torch.Tensor:
    missing = total - x2.shape[0]
    if missing == 0:
        return x2
    return torch.cat([x2, x2[-1:].expand(missing, x2.shape[1])], dim=0)


def _column_mask(columns: int, groups: int, group: int, device: torch.device) -> torch.Tensor | None:
    if groups * group == columns:
        return None
    return (torch.arange(groups * group, device=device) < columns).reshape(groups, group)


def _group_view(x2: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor | None, Callable]:
    """``(rows, cols)`` -> ``(rows, G, group_size)`` padded, with its mask and inverse."""
    rows, cols = x2.shape
    groups = -(-cols // group_size)
    data = _pad_columns(x2, groups * group_size).reshape(rows, groups, group_size)
    valid = _column_mask(cols, groups, group_size, x2.device)

    def restore(values: torch.Tensor) -> torch.Tensor:
        return values.reshape(rows, groups * group_size)[:, :cols]

    return data, valid, restore


def _indexed_group_view(x2: torch.Tensor, g_idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, Callable]:
    """Groups given by ``g_idx[c]`` (activation order): gather each group's columns, padded.

    Columns are sorted by group (stable), each group's columns are placed in one padded row of an
    index table ``(G, max_group)``; padding repeats the group's first column.
    """
    rows, cols = x2.shape
    g_idx = g_idx.to(device=x2.device, dtype=torch.long)
    groups = int(g_idx.max()) + 1
    counts = torch.bincount(g_idx, minlength=groups)
    if bool((counts == 0).any()):
        empty = torch.nonzero(counts == 0).flatten().tolist()
        raise ValueError(
            f"g_idx leaves group(s) {empty[:10]} empty; every group index in 0..{groups - 1} needs a column"
        )
    width = int(counts.max())
    order = torch.argsort(g_idx, stable=True)
    starts = torch.cumsum(counts, 0) - counts
    position = torch.arange(cols, device=x2.device) - starts[g_idx[order]]
    index = order[starts].unsqueeze(1).expand(groups, width).clone()
    index[g_idx[order], position] = order
    valid = None
    if int(counts.min()) != width:
        valid = torch.arange(width, device=x2.device).unsqueeze(0) < counts.unsqueeze(1)
    data = x2[:, index]

    def restore(values: torch.Tensor) -> torch.Tensor:
        out = values.new_empty(rows, cols)
        out[:, order] = values.reshape(rows, groups, width)[:, g_idx[order], position]
        return out

    return data, valid, restore


def _check_g_idx(g_idx: torch.Tensor, columns: int) -> bool:
    """Validate ``g_idx``; False when it asks for positional groups (None or containing -1)."""
    if g_idx is None:
        return False
    if not isinstance(g_idx, torch.Tensor) or g_idx.ndim != 1 or g_idx.dtype.is_floating_point:
        raise ValueError("g_idx must be a 1-D integer tensor mapping each column to its group")
    if g_idx.numel() != columns:
        raise ValueError(f"g_idx has {g_idx.numel()} entries but the tensor has {columns} columns")
    if bool((g_idx == -1).any()):
        return False
    if bool((g_idx < 0).any()):
        raise ValueError("g_idx entries must be >= 0 (or -1 for positional groups)")
    return True


def flatten(x: torch.Tensor, spec: QuantSpec, kind: str, g_idx: torch.Tensor | None = None) -> Flat:
    """View ``x`` as ``(num_observations, *qparam_shape, group)`` for ``spec.strategy``.

    The returned ``data`` shares memory with ``x`` whenever no padding or reordering is needed.
    """
    spec.check_kind(kind)
    if g_idx is not None and spec.strategy != "group":
        raise ValueError(f"g_idx applies to strategy='group' only, not {spec.strategy!r}")
    shape = x.shape
    if kind == "attention":
        flat = _flatten_attention(x, spec)
    else:
        x2 = as_2d(x, kind)
        flat = _flatten_2d(x2, spec, kind, g_idx)
        inner = flat.restore
        flat.restore = lambda values: inner(values).reshape(shape)
    flat.num_tokens = _count_tokens(x, kind)
    return flat


def _flatten_attention(x: torch.Tensor, spec: QuantSpec) -> Flat:
    if x.ndim != 4:
        raise ValueError(f"attention states must be (batch, heads, seq, head_dim), got shape {tuple(x.shape)}")
    batch, heads, seq, dim = x.shape
    if spec.strategy == "tensor":
        return Flat(x.reshape(1, 1, -1), None, (1,), lambda v: v.reshape(batch, heads, seq, dim))
    if spec.channel_axis("attention") not in (1, -3):
        raise ValueError("attention states support ch_axis=1 (per head) only")
    return Flat(x.reshape(batch, heads, seq * dim), None, (heads,), lambda v: v.reshape(batch, heads, seq, dim))


def _flatten_2d(x2: torch.Tensor, spec: QuantSpec, kind: str, g_idx: torch.Tensor | None) -> Flat:
    rows, cols = x2.shape
    strategy = spec.strategy
    if strategy == "tensor":
        if kind == "weight":
            return Flat(x2.reshape(1, 1, -1), None, (1,), lambda v: v.reshape(rows, cols))
        return Flat(x2.reshape(rows, 1, cols), None, (1,), lambda v: v.reshape(rows, cols))
    if strategy == "token":
        return Flat(x2.reshape(1, rows, 1, cols), None, (rows, 1), lambda v: v.reshape(rows, cols))
    if strategy == "channel":
        return _flatten_channel(x2, spec, kind)
    if strategy == "group":
        if _check_g_idx(g_idx, cols):
            data, valid, restore = _indexed_group_view(x2, g_idx)
        else:
            data, valid, restore = _group_view(x2, spec.group_size)
        groups = data.shape[1]
        if kind == "weight":
            valid = None if valid is None else valid.unsqueeze(0).unsqueeze(0)
            return Flat(data.unsqueeze(0), valid, (rows, groups), lambda v: restore(v.squeeze(0)))
        valid = None if valid is None else valid.unsqueeze(0)
        return Flat(data, valid, (groups,), restore)
    return _flatten_block(x2, spec)


def _flatten_channel(x2: torch.Tensor, spec: QuantSpec, kind: str) -> Flat:
    rows, cols = x2.shape
    axis = spec.channel_axis(kind)
    if kind == "activation":
        if axis not in (-1, 1):
            raise ValueError("activation channel granularity takes ch_axis=-1 (per hidden feature)")
        return Flat(x2.reshape(rows, cols, 1), None, (cols,), lambda v: v.reshape(rows, cols))
    if axis == 0 or axis == -2:
        return Flat(x2.reshape(1, rows, 1, cols), None, (rows, 1), lambda v: v.reshape(rows, cols))
    if axis in (1, -1):
        return Flat(x2.t().reshape(1, 1, cols, rows), None, (1, cols), lambda v: v.reshape(cols, rows).t())
    raise ValueError(f"weight channel granularity takes ch_axis 0 (output) or 1 (input), got {axis}")


def _flatten_block(x2: torch.Tensor, spec: QuantSpec) -> Flat:
    rows, cols = x2.shape
    block_rows, block_cols = spec.block_size
    row_blocks, col_blocks = -(-rows // block_rows), -(-cols // block_cols)
    padded = _pad_rows(_pad_columns(x2, col_blocks * block_cols), row_blocks * block_rows)

    def to_blocks(t: torch.Tensor) -> torch.Tensor:
        return (
            t.reshape(row_blocks, block_rows, col_blocks, block_cols)
            .permute(0, 2, 1, 3)
            .reshape(1, row_blocks, col_blocks, block_rows * block_cols)
        )

    valid = None
    if (row_blocks * block_rows, col_blocks * block_cols) != (rows, cols):
        mask = torch.zeros(padded.shape, dtype=torch.bool, device=x2.device)
        mask[:rows, :cols] = True
        valid = to_blocks(mask)

    def restore(values: torch.Tensor) -> torch.Tensor:
        full = (
            values.reshape(row_blocks, col_blocks, block_rows, block_cols)
            .permute(0, 2, 1, 3)
            .reshape(row_blocks * block_rows, col_blocks * block_cols)
        )
        return full[:rows, :cols]

    return Flat(to_blocks(padded), valid, (row_blocks, col_blocks), restore)


def min_max(data: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(min, max)`` of ``data`` over dims ``(0, -1)``, in fp32.

    fp32 CPU data in a contiguous layout goes through the native one-read kernel
    (``observers.kernels``); everything else, or when the kernel is not in use, is ``amin`` and
    ``amax`` as two eager passes (each about one read of the tensor on CPU, whereas
    ``torch.aminmax`` over a short last dim is several times slower). Both give the same values;
    a group holding NaN/Inf gives a non-finite min or max either way.
    """
    native = kernels.group_min_max(data)
    if native is not None:
        return native
    dims = (0, data.ndim - 1)
    return data.amin(dim=dims).float(), data.amax(dim=dims).float()


def reduce_min_max(flat: Flat) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-qparam-group ``(min, max)`` in fp32, shaped ``qparam_shape`` (see ``min_max``)."""
    low, high = min_max(flat.data)
    return low.reshape(flat.qparam_shape), high.reshape(flat.qparam_shape)


def as_groups(values: torch.Tensor, shape: torch.Size | None = None) -> torch.Tensor:
    """``values`` ``(N, *qparam_shape, K)`` (broadcast to ``shape`` when given: an element weight or
    mask) as contiguous fp32 ``(N, Q, K)``, every qparam group on one axis: the native kernels'
    layout (N may be 0; no copy when already so)."""
    values = values.float() if shape is None else values.float().expand(shape)
    return values.reshape(values.shape[0], math.prod(values.shape[1:-1]), values.shape[-1]).contiguous()


def group_rows(flat: Flat) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``flat``'s data and its padding mask (None without padding) in ``as_groups``' layout."""
    return as_groups(flat.data), None if flat.valid is None else as_groups(flat.valid, flat.data.shape)


def _count_tokens(x: torch.Tensor, kind: str) -> int:
    if kind == "weight":
        return x.shape[0] if x.ndim > 1 else 1
    if kind == "attention":
        return x.shape[0] * x.shape[2]
    return as_2d(x, kind).shape[0]


def all_finite(t: torch.Tensor) -> bool:
    """True when ``t`` has no NaN/Inf. One sum (NaN/Inf propagate into it) instead of
    ``torch.isfinite``, which is several times slower on CPU; the exact check runs only when the
    sum is not finite (a real NaN/Inf, or a sum of huge finite values that overflowed)."""
    if math.isfinite(float(t.sum())):  # a Python float: torch.isfinite on a 0-d tensor costs ~4 µs a call
        return True
    return bool(torch.isfinite(t).all())
