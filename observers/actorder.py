"""Activation ordering (GPTQ "actorder"): group a weight's input columns by importance.

``activation_order_g_idx`` sorts the input columns by the mean squared input activation they
see (most important first) and cuts that order into groups of ``group_size``; the result is a
``g_idx`` (column -> group) for ``observe(w, g_idx=...)`` and ``fake_quantize(..., g_idx=...)``.
Columns with similar importance then share a scale, which is what llm-compressor's group
observer supports through ``g_idx``.
"""

from __future__ import annotations

import torch

from observers.shared import Op, Reduce


def column_importance(inputs: torch.Tensor, across: Reduce | None = None) -> torch.Tensor:
    """Mean squared activation per input column of ``inputs`` (``(..., in)``), in fp32.

    ``across``: ``inputs`` is one rank's part of inputs split between processes
    (``observers.shared``; it may be empty): the mean over every rank's rows, from sums added in
    fp64 (equal to the unsplit mean up to float rounding)."""
    if not isinstance(inputs, torch.Tensor) or inputs.ndim == 0 or (inputs.numel() == 0 and across is None):
        raise ValueError("column_importance needs a non-empty tensor shaped (..., in_features)")
    flat = inputs.reshape(-1, inputs.shape[-1]).float()
    if across is None:
        return flat.square().mean(dim=0)
    sums = across(flat.square().sum(dim=0).double(), Op.SUM)
    rows = across(torch.tensor([flat.shape[0]], dtype=torch.float64, device=flat.device), Op.SUM)
    if float(rows) == 0:
        raise ValueError("column_importance needs inputs: no rank has any row")
    return (sums / rows).float()


def activation_order_g_idx(importance: torch.Tensor, group_size: int) -> torch.Tensor:
    """``g_idx[c]``: the group of column ``c`` when columns are ranked by ``importance``.

    ``importance`` is a 1-D tensor (e.g. ``column_importance(inputs)``); ties keep column order.
    """
    if not isinstance(importance, torch.Tensor) or importance.ndim != 1 or importance.numel() == 0:
        raise ValueError("importance must be a non-empty 1-D tensor with one value per input column")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size <= 0:
        raise ValueError(f"group_size must be a positive integer, got {group_size!r}")
    order = torch.argsort(importance.float(), descending=True, stable=True)
    g_idx = torch.empty_like(order)
    g_idx[order] = torch.arange(order.numel(), device=order.device) // group_size
    return g_idx
