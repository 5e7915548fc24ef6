"""What each observer chose per group: scale / zero-point / exponent heatmaps (bars for per-tensor
qparams), the ratio of two observers' scales and the distribution of scales."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np
import plotly.graph_objects as go
import torch
from plotly.subplots import make_subplots

import observers as ob
from lab.results.plots.style import _numpy, _ok, legend_on_top, observer_color
from observers.suite import SuiteResult

MAX_HEATMAP_ROWS = 256


MAX_HEATMAP_COLS = 512


def as_grid(t: torch.Tensor) -> np.ndarray:
    """A qparam tensor as a 2-D array (rows x groups): 0-d/1-d become one row."""
    arr = _numpy(t)
    if arr.ndim <= 1:
        return arr.reshape(1, -1)
    return arr.reshape(arr.shape[0], -1)


def downsample(grid: np.ndarray, max_rows: int = MAX_HEATMAP_ROWS, max_cols: int = MAX_HEATMAP_COLS):
    """``(grid, row_factor, col_factor)``: blocks of rows/columns reduced to their max so that at
    most ``max_rows`` x ``max_cols`` cells reach the browser (outliers survive the reduction)."""
    row_factor = max(1, math.ceil(grid.shape[0] / max_rows))
    col_factor = max(1, math.ceil(grid.shape[1] / max_cols))
    if row_factor == col_factor == 1:
        return grid, 1, 1
    rows = math.ceil(grid.shape[0] / row_factor) * row_factor
    cols = math.ceil(grid.shape[1] / col_factor) * col_factor
    padded = np.full((rows, cols), -np.inf, dtype=np.float64)
    padded[: grid.shape[0], : grid.shape[1]] = grid
    blocks = padded.reshape(rows // row_factor, row_factor, cols // col_factor, col_factor)
    return blocks.max(axis=(1, 3)), row_factor, col_factor


def exponent_grid(qp: ob.QParams) -> np.ndarray:
    """MX shared exponents: ``extras["scale_exponent"]`` when the observer stored them, else
    ``log2`` of the effective scale (the same number for power-of-two scales)."""
    if "scale_exponent" in qp.extras:
        return as_grid(qp.extras["scale_exponent"])
    return np.log2(as_grid(qp.effective_scale))


QPARAM_FIELDS = {
    "scale": ("scale", lambda qp: as_grid(qp.scale)),
    "log2_scale": ("log2(scale)", lambda qp: np.log2(as_grid(qp.effective_scale))),
    "zero_point": ("zero point", lambda qp: as_grid(qp.zero_point)),
    "exponent": ("scale exponent", exponent_grid),
}


def _qparam_field(field: str) -> tuple[str, Callable[[ob.QParams], np.ndarray]]:
    """``(label, grid_of)`` of ``QPARAM_FIELDS[field]``, with the allowed names in the error."""
    if field not in QPARAM_FIELDS:
        raise ValueError(f"unknown qparam field {field!r}; choose from {', '.join(QPARAM_FIELDS)}")
    return QPARAM_FIELDS[field]


def scale_figure_kind(results: Sequence[SuiteResult]) -> str:
    """``"bars"`` when every observer has a single scale (per-tensor granularity, where a heatmap
    is one cell per observer and a distribution one value), else ``"heatmap"``.

    ``qparam_heatmaps`` applies it itself; pages call it to caption the figure and to skip the
    distribution of scales when there is none."""
    return "bars" if all(r.qparams.scale.numel() == 1 for r in _ok(results)) else "heatmap"


def color_range(values: np.ndarray) -> tuple[float, float]:
    """``(cmin, cmax)`` of the finite ``values``; for all-equal values a band of ±5 % around them
    (±1 around 0), since plotly's own range for a flat grid is a ±1e-6 colour bar that makes
    "all equal" look like an empty plot."""
    finite = values[np.isfinite(values)]
    if not finite.size:
        return 0.0, 1.0
    lo, hi = float(finite.min()), float(finite.max())
    pad = 0.0 if hi > lo else abs(lo) * 0.05 or 1.0
    return lo - pad, hi + pad


def all_equal_note(values: np.ndarray, what: str) -> str:
    """``all N <what> equal X`` when every finite value is the same, else ``""``: a flat heatmap
    says so in its title instead of leaving the reader to guess from one colour."""
    finite = values[np.isfinite(values)]
    if finite.size and finite.min() == finite.max():
        return f"all {finite.size} {what} equal {finite[0]:.4g}"
    return ""


def qparam_heatmaps(
    results: Sequence[SuiteResult],
    field: str = "scale",
    *,
    max_rows: int = MAX_HEATMAP_ROWS,
    title: str = "",
    order: Sequence[str] | None = None,
) -> go.Figure:
    """One heatmap (rows x groups) per observer, side by side on one shared color scale.

    ``field`` is ``scale``, ``log2_scale``, ``zero_point`` or ``exponent`` (``QPARAM_FIELDS``).
    Grids larger than ``max_rows`` rows are reduced by the max over blocks of rows; the title
    says by how much. Per-tensor qparams (``scale_figure_kind`` is ``bars``) give ``scale_bars``
    instead of one-cell heatmaps; all-equal values get a visible colour range (``color_range``)
    and say so in the title (``all_equal_note``).
    """
    label, grid_of = _qparam_field(field)
    ok = _ok(results)
    if not ok:
        raise ValueError("no observer produced qparams for this tensor")
    if scale_figure_kind(ok) == "bars":
        return scale_bars(ok, order, field=field)
    raw = [grid_of(r.qparams) for r in ok]
    grids = [downsample(g, max_rows) for g in raw]
    values = np.concatenate([g.ravel() for g in raw])
    cmin, cmax = color_range(values)
    fig = make_subplots(rows=1, cols=len(ok), subplot_titles=[r.name for r in ok], shared_yaxes=True)
    for i, (r, (grid, _, col_factor)) in enumerate(zip(ok, grids, strict=True), start=1):
        fig.add_trace(
            go.Heatmap(
                z=grid,
                coloraxis="coloraxis",
                name=r.name,
                hovertemplate=f"row %{{y}}<br>group %{{x}}<br>{label} %{{z:.4g}}<extra>{r.name}</extra>",
            ),
            row=1,
            col=i,
        )
        fig.update_xaxes(title_text="group" if col_factor == 1 else f"group (max of {col_factor})", row=1, col=i)
    row_factors = {f for _, f, _ in grids}
    reduced = max(row_factors) > 1
    fig.update_yaxes(title_text=f"row (max of {max(row_factors)})" if reduced else "row", row=1, col=1)
    fig.update_yaxes(autorange="reversed")
    note = all_equal_note(values, f"{label}s")
    title = title or f"{label} per group" + (f" (downsampled to ≤ {max_rows} rows)" if reduced else "")
    fig.update_layout(
        title=f"{title} · {note}" if note else title,
        coloraxis={"cmin": cmin, "cmax": cmax, "colorscale": "Viridis", "colorbar": {"title": {"text": label}}},
    )
    return fig


def scale_ratio_heatmap(a: SuiteResult, b: SuiteResult, max_rows: int = MAX_HEATMAP_ROWS) -> go.Figure:
    """``log2(scale_a / scale_b)`` per group on a diverging scale centered at 0 (equal scales):
    red where ``a`` chose a wider range than ``b``, blue where narrower. Identical scales get a
    ±1 (factor 2) colour range and say so in the title, not a ±1e-6 bar over a blank grid."""
    if a.qparams is None or b.qparams is None:
        raise ValueError("both observers need qparams to compare scales")
    ratio = np.log2(as_grid(a.qparams.effective_scale) / as_grid(b.qparams.effective_scale))
    grid, row_factor, _ = downsample(np.abs(ratio), max_rows) if ratio.shape[0] > max_rows else (ratio, 1, 1)
    finite = np.abs(grid[np.isfinite(grid)])
    bound = float(finite.max()) if finite.size else 0.0
    fig = go.Figure(
        go.Heatmap(
            z=grid,
            zmid=0,
            zmin=-(bound or 1.0),
            zmax=bound or 1.0,
            colorscale="RdBu_r",
            colorbar={"title": {"text": "log2 ratio"}},
            hovertemplate="row %{y}<br>group %{x}<br>log2 ratio %{z:.3f}<extra></extra>",
        )
    )
    note = f" (|ratio|, max of {row_factor} rows)" if row_factor > 1 else ""
    equal = all_equal_note(ratio, "log2 ratios")
    fig.update_layout(
        title=f"log2(scale {a.name} / scale {b.name}){note}" + (f" · {equal}" if equal else ""),
        xaxis_title="group",
        yaxis_title="row",
        yaxis_autorange="reversed",
    )
    return fig


MIN_DISTRIBUTION_VALUES = 8
"""Below this many scales per observer a histogram is a few one-count bars posing as a
distribution: ``scale_distribution`` then draws one marker per scale instead."""


def scale_distribution(results: Sequence[SuiteResult], order: Sequence[str] | None = None) -> go.Figure:
    """``log2(scale)`` per observer: overlaid histograms, or, when no observer has
    ``MIN_DISTRIBUTION_VALUES`` scales (per-tensor, a handful of channels), a strip: one row per
    observer with a marker per scale."""
    values = {r.name: np.log2(_numpy(r.qparams.effective_scale).ravel()) for r in _ok(results)}
    if max((v.size for v in values.values()), default=0) >= MIN_DISTRIBUTION_VALUES:
        fig = go.Figure(
            [
                go.Histogram(x=v, name=name, marker_color=observer_color(name, order), opacity=0.55, nbinsx=60)
                for name, v in values.items()
            ]
        )
        fig.update_layout(
            barmode="overlay", xaxis_title="log2(scale)", yaxis_title="groups", title="distribution of scales"
        )
        return legend_on_top(fig)
    fig = go.Figure(
        [
            go.Scatter(
                x=v,
                y=[name] * v.size,
                customdata=np.exp2(v),
                mode="markers",
                name=name,
                marker={"color": observer_color(name, order), "size": 12},
                hovertemplate="%{y}<br>scale %{customdata:.5g}<br>log2 %{x:.4g}<extra></extra>",
            )
            for name, v in values.items()
        ]
    )
    fig.update_layout(
        title=f"scales per observer (fewer than {MIN_DISTRIBUTION_VALUES} each: no distribution to show)",
        xaxis_title="log2(scale)",
        yaxis={"title": "observer", "automargin": True, "autorange": "reversed"},
        showlegend=False,
        height=max(260, 140 + 40 * len(values)),
    )
    return fig


def scale_bars(results: Sequence[SuiteResult], order: Sequence[str] | None = None, field: str = "scale") -> go.Figure:
    """One bar per observer: its single ``field`` value (``QPARAM_FIELDS``), for per-tensor
    granularity, where a heatmap would be one cell per observer."""
    label, grid_of = _qparam_field(field)
    ok = [r for r in _ok(results) if r.qparams.scale.numel() == 1]
    fig = go.Figure(
        go.Bar(
            x=[r.name for r in ok],
            y=[float(grid_of(r.qparams)[0, 0]) for r in ok],
            marker_color=[observer_color(r.name, order) for r in ok],
            hovertemplate=f"%{{x}}<br>{label} %{{y:.5g}}<extra></extra>",
        )
    )
    fig.update_layout(
        title=f"{label} per observer (one per tensor)",
        xaxis={"title": "observer", "automargin": True},
        yaxis_title=label,
    )
    return fig
