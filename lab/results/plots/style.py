"""Shared look of every figure: one colour per observer, legends, labels, metric names."""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence

import numpy as np
import plotly.graph_objects as go
import torch
from plotly.colors import qualitative

import observers as ob
from lab.vocab import PER_LAYER_PREFIX
from observers.suite import SuiteResult

PALETTE: tuple[str, ...] = (*qualitative.Plotly, *qualitative.Dark24)


DATA_COLOR = "#7f7f7f"


def observer_color(name: str, order: Sequence[str] | None = None) -> str:
    """A fixed color per observer: its position in the registry (or ``order``) in ``PALETTE``.

    Names outside the registry get a color from a stable hash of the name, placed after the
    registry's colors, so they never borrow a registered observer's color while it fits.
    """
    names = list(ob.available() if order is None else order)
    index = names.index(name) if name in names else len(names) + zlib.crc32(name.encode()) % len(PALETTE)
    return PALETTE[index % len(PALETTE)]


def _numpy(t: torch.Tensor) -> np.ndarray:
    return t.detach().to(torch.float32).cpu().numpy()


def _ok(results: Sequence[SuiteResult]) -> list[SuiteResult]:
    return [r for r in results if r.error is None and r.qparams is not None]


def legend_on_right(fig: go.Figure, title: str = "observer") -> go.Figure:
    """A vertical legend right of the plot, for figures whose height is sized to their rows: a
    legend on top would take that height from the plot area."""
    fig.update_layout(
        legend={"orientation": "v", "yanchor": "top", "y": 1, "xanchor": "left", "x": 1.02, "title_text": title}
    )
    return fig


LEGEND_ROW_PX = 26
"""Height of one row of a horizontal legend."""
LEGEND_PER_ROW = 3
"""Legend entries per row to plan for: range labels (``name [lo, hi] · x% clipped``) are long."""


def legend_on_top(fig: go.Figure, title: str = "observer", entries: int | None = None) -> go.Figure:
    """A horizontal legend above the plot, so a dozen observers never squeeze the plot area. With
    ``entries`` (how many legend items) the top margin grows with the rows they take, so a long
    legend never runs into the title."""
    rows = 4 if entries is None else max(1, math.ceil(entries / LEGEND_PER_ROW))
    fig.update_layout(
        legend={"orientation": "h", "yanchor": "bottom", "y": 1.02, "xanchor": "left", "x": 0, "title_text": title},
        title={"yref": "container", "y": 0.99, "yanchor": "top"},
        margin={"t": max(120, 66 + LEGEND_ROW_PX * rows)},
    )
    return fig


def tensor_label(layer: str, tensor: str) -> str:
    return f"{layer} · {tensor}"


BAR_PX = 16
"""Height of one bar's slot in ``metric_bars``: a 12 px bar plus its share of the gap between tensors."""


METRIC_LABELS = {
    "mse": "MSE",
    "sqnr_db": "SQNR (dB)",
    "cosine": "cosine similarity",
    "max_abs_error": "max |error|",
    "clip_ratio": "share clipped",
    "rmse_over_scale": "RMSE / scale",
    "seconds": "time (s)",
    "gptq:gptq_error": "GPTQ layer-output error",
    "gptq:gptq_held_out": "GPTQ held-out error",
    "gptq:gptq_clipped": "share clipped after GPTQ",
}
METRIC_LABELS |= {
    PER_LAYER_PREFIX + metric: f"{label}, per layer (own scales)"
    for metric, label in list(METRIC_LABELS.items())
    if metric in ob.HIGHER_IS_BETTER
}
"""The local metrics as served (a fused group's shared scales) are named plainly; with each layer's
own scales they say so (``per-layer:<metric>``)."""
