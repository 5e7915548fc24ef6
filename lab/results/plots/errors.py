"""How much error each observer leaves: metric bars and heatmap, the error histogram, layer-output
error bars."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import torch
from plotly.subplots import make_subplots

import observers as ob
from lab import results
from lab.results.plots.ranges import _quantile_sample, value_histogram
from lab.results.plots.style import (
    BAR_PX,
    METRIC_LABELS,
    _ok,
    legend_on_right,
    legend_on_top,
    observer_color,
    tensor_label,
)
from observers.suite import SuiteResult


def quantization_error(entry, result: SuiteResult) -> torch.Tensor:
    """``x - x_hat`` of one observer on one analysed tensor (a ``lab.analyse.analysis.TensorAnalysis``)."""
    x = entry.data.to(torch.float32)
    return x - ob.fake_quantize(x, result.qparams, entry.spec).to(torch.float32)


ERROR_QUANTILE = 0.999


ERROR_PAD = 1.5


def error_bound(errors: Sequence[torch.Tensor]) -> float:
    """Half-width of the error histogram: ``ERROR_PAD`` times the largest ``ERROR_QUANTILE``
    quantile of ``|error|`` over observers, capped at the largest ``|error|``.

    Binning up to the plain max lets one clipped outlier stretch the bins until every other error
    falls in the middle one. The pad keeps an error made of rounding only (uniform up to half a
    step, its 99.9 % quantile just under its max) entirely on the plot."""
    magnitudes = [e.detach().float().abs().flatten() for e in errors]
    top = max(float(m.max()) for m in magnitudes)
    typical = max(float(torch.quantile(_quantile_sample(m), ERROR_QUANTILE)) for m in magnitudes)
    return min(top, ERROR_PAD * typical) or top or 1e-12


def error_histogram(entry, order: Sequence[str] | None = None, bins: int = 120) -> go.Figure:
    """Histogram of the error ``x - x_hat`` per observer, on common bins, as overlaid step lines.

    The bins span ``±error_bound`` (a robust range, not the largest error); each observer's
    count of errors beyond it is in its legend entry, and the subtitle gives the bound's rule and
    the largest error, so the outliers are reported rather than drawn as one stretched axis."""
    errors = {r.name: quantization_error(entry, r) for r in _ok(entry.results)}
    if not errors:
        raise ValueError(f"no observer produced qparams for {entry.layer} {entry.tensor}")
    bound = error_bound(list(errors.values()))
    fig = go.Figure()
    for name, err in errors.items():
        edges, counts = value_histogram(err, bins, -bound, bound)
        beyond = int((err.abs() > bound).sum())
        fig.add_trace(
            go.Scatter(
                x=(edges[:-1] + edges[1:]) / 2,
                y=counts,
                name=f"{name} · {beyond} beyond ±{bound:.3g}" if beyond else name,
                legendgroup=name,
                mode="lines",
                line={"color": observer_color(name, order), "shape": "hvh"},
            )
        )
    largest = max(float(e.abs().max()) for e in errors.values())
    rule = f"bins over ±{bound:.3g}: {ERROR_PAD:g} × the {100 * ERROR_QUANTILE:g}th percentile of |x − x̂|"
    subtitle = rule + (f"; largest |x − x̂| {largest:.3g}, counts beyond in the legend" if largest > bound else "")
    fig.update_layout(
        title=f"quantization error x − x̂: {entry.layer} · {entry.tensor}<br><sup>{subtitle}</sup>",
        xaxis={"title": "x − x̂", "range": [-bound, bound]},
        yaxis_title="count (log)",
        yaxis_type="log",
    )
    return legend_on_top(fig)


def metric_bars(frame: pd.DataFrame, metric: str = "sqnr_db", order: Sequence[str] | None = None) -> go.Figure:
    """Grouped horizontal bars: ``metric`` per observer (color), one row of bars per layer and
    tensor, named on the y axis with room for long names (``automargin``).

    The height grows with the number of bars (``BAR_PX`` each) and the legend sits right of the
    plot: a fixed height with the legend on top left about 100 px for all the bars."""
    fig = go.Figure()
    frame = frame.assign(label=[tensor_label(a, b) for a, b in zip(frame["layer"], frame["tensor"], strict=True)])
    frame = frame[pd.to_numeric(frame[metric], errors="coerce").notna()]
    for name, rows in frame.groupby("observer", sort=False):
        fig.add_trace(
            go.Bar(
                x=rows[metric], y=rows["label"], orientation="h", name=name, marker_color=observer_color(name, order)
            )
        )
    bars = frame["label"].nunique() * frame["observer"].nunique()
    fig.update_layout(
        barmode="group",
        title=f"{METRIC_LABELS.get(metric, metric)} per observer",
        xaxis_title=METRIC_LABELS.get(metric, metric),
        yaxis={"title": "layer · tensor", "automargin": True, "autorange": "reversed"},
        margin={"t": 60, "b": 60},
        height=max(320, 120 + BAR_PX * bars),
    )
    return legend_on_right(fig)


def metric_heatmap(frame: pd.DataFrame, metric: str = "sqnr_db") -> go.Figure:
    """Layers (rows) x observers (columns) colored by ``metric``, values written in the cells,
    so a whole model can be scanned at a glance. Better is always the same (bright) color, the
    direction being ``lab.results.higher_is_better``'s (an unknown metric is a ``ValueError``).
    28 px per row plus room for the rotated observer names, every row labelled, and margins that
    grow to the longest layer and observer names (``automargin``), so no name is cut and no axis
    title overlaps them."""
    frame = frame.assign(label=[tensor_label(a, b) for a, b in zip(frame["layer"], frame["tensor"], strict=True)])
    table = frame.pivot_table(index="label", columns="observer", values=metric, sort=False, aggfunc="first")
    table = table.dropna(axis="columns", how="all")
    better_high = results.higher_is_better(metric)
    z = table.to_numpy(dtype=float)
    fig = go.Figure(
        go.Heatmap(
            z=z,
            x=list(table.columns),
            y=list(table.index),
            colorscale="Viridis" if better_high else "Viridis_r",
            text=np.vectorize(lambda v: "" if np.isnan(v) else f"{v:.3g}")(z),
            texttemplate="%{text}",
            colorbar={"title": {"text": METRIC_LABELS.get(metric, metric)}},
            hovertemplate="%{y}<br>%{x}<br>%{z:.4g}<extra></extra>",
        )
    )
    fig.update_layout(
        title=f"{METRIC_LABELS.get(metric, metric)}: layers × observers",
        xaxis={"title": "observer", "automargin": True},
        yaxis={"title": "layer · tensor", "automargin": True, "autorange": "reversed", "dtick": 1},
        height=max(320, 200 + 28 * len(table.index)),
    )
    return fig


def layer_output_bars(rows: pd.DataFrame, metric: str = "sqnr_db", order: Sequence[str] | None = None) -> go.Figure:
    """Layer-output ``metric`` per observer, one panel per quantization mode (weight only,
    activation only, both), layers on the x axis."""
    modes = list(dict.fromkeys(rows["quantized"]))
    fig = make_subplots(rows=1, cols=len(modes), subplot_titles=modes, shared_yaxes=True)
    for col, mode in enumerate(modes, start=1):
        part = rows[rows["quantized"] == mode]
        for name, sub in part.groupby("observer", sort=False):
            fig.add_trace(
                go.Bar(
                    x=sub["layer"],
                    y=sub[metric],
                    name=name,
                    legendgroup=name,
                    showlegend=col == 1,
                    marker_color=observer_color(name, order),
                ),
                row=1,
                col=col,
            )
    fig.update_yaxes(title_text=f"layer output {METRIC_LABELS.get(metric, metric)}", row=1, col=1)
    fig.update_layout(barmode="group", title="layer-output error on the captured inputs")
    return legend_on_top(fig)
