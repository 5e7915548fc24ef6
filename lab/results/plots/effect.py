"""Figures of model-level effect: the sensitivity heatmap (tensors x observers), the SQNR of the
hidden states after each block for every evaluated choice set (where error enters the model), the
model-level metric per choice set, and the local metric against the model-level one.

Damage is drawn on a log scale: a sensitive layer's KL can be a thousand times a robust one's, and
a linear color scale would show one bright cell and a uniform rest.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from lab import results
from lab.results import damage, is_similarity  # noqa: F401  (the page and the tests read them here too)
from lab.results.plots.style import METRIC_LABELS, legend_on_top, observer_color, tensor_label
from lab.vocab import model_metric

MODEL_METRIC_LABELS = {
    "kl": "KL(float ‖ quantized)",
    "top1_agreement": "top-1 agreement",
    "perplexity": "perplexity",
    "cosine": "embedding cosine",
    "spearman": "similarity ranking (Spearman)",
}
DAMAGE_FLOOR = 1e-12
SET_COLORS = ("#7f7f7f", "#d62728", "#1f77b4", "#2ca02c", "#9467bd", "#ff7f0e")


def cell_text(metric: str, value: float) -> str:
    """What a sensitivity cell writes, to 3 significant digits: ``1 − value`` for a similarity (cosines
    0.9996 and 0.99999 both read "1" at three digits; their damage reads "0.0004" and "1e-05"), else
    the value itself."""
    if math.isnan(value):
        return ""
    return f"{1.0 - value:.3g}" if is_similarity(metric) else f"{value:.3g}"


def _hover_text(metric: str, value: float) -> str:
    """The full value (shortest exact form) and, for a similarity, ``1 − value`` too."""
    if math.isnan(value):
        return f"{metric}: no value"
    text = f"{metric} = {float(value)!r}"
    return text + f"<br>1 − {metric} = {1.0 - value:.6g}" if is_similarity(metric) else text


def _heatmap_titles(metric: str) -> tuple[str, str]:
    """(what the color is, what the cell text is) for the sensitivity heatmap's colorbar."""
    if is_similarity(metric):
        return f"log10(1 − {metric})", f"1 − {metric}"
    if metric == "perplexity":
        return "log10 relative rise of perplexity", metric
    return f"log10 {metric}", metric


def sensitivity_heatmap(frame: pd.DataFrame, metric: str, float_value: float | None = None) -> go.Figure:
    """Tensors (rows, in table order) x observers (columns): color is log10 of the damage of
    ``metric`` when only that tensor is quantized with that observer (brighter: hurts more). The
    cell text (``cell_text``) is what tells cells apart: ``1 − value`` for a similarity (a cosine
    above 0.9995 reads "1" at three digits), else the value; the hover has the full value, the
    colorbar's title says what color and text are."""
    labels = [tensor_label(a, b) for a, b in zip(frame["layer"], frame["tensor"], strict=True)]
    table = frame.assign(label=labels).pivot_table(
        index="label", columns="observer", values=metric, sort=False, aggfunc="first"
    )
    values = table.to_numpy(dtype=float)
    harm = np.vectorize(lambda v: np.nan if np.isnan(v) else damage(metric, v, float_value))(values)
    z = np.log10(np.maximum(harm, DAMAGE_FLOOR))
    color_title, text_title = _heatmap_titles(metric)
    fig = go.Figure(
        go.Heatmap(
            z=z,
            x=list(table.columns),
            y=list(table.index),
            colorscale="Inferno",
            customdata=values,
            text=[[cell_text(metric, v) for v in row] for row in values],
            texttemplate="%{text}",
            hovertext=[[_hover_text(metric, v) for v in row] for row in values],
            colorbar={"title": {"text": f"color: {color_title}<br>text: {text_title}"}},
            hovertemplate="%{y}<br>%{x}<br>%{hovertext}<extra></extra>",
        )
    )
    fig.update_layout(
        title=f"{MODEL_METRIC_LABELS.get(metric, metric)} when only this tensor is quantized",
        xaxis={"title": "observer", "automargin": True},
        yaxis={"title": "layer · tensor", "automargin": True, "autorange": "reversed", "dtick": 1},
        height=max(320, 200 + 28 * len(table.index)),
    )
    return fig


def block_sqnr_figure(names: Sequence[str], curves: Sequence[Sequence[float]]) -> go.Figure:
    """One line per choice set: SQNR (dB) of the hidden states after each block against the float
    model's. Blocks before the first quantized one (infinite SQNR) are left out of the line."""
    fig = go.Figure()
    for i, (name, curve) in enumerate(zip(names, curves, strict=True)):
        y = [v if math.isfinite(v) else None for v in curve]
        if all(v is None for v in y):
            continue
        fig.add_trace(
            go.Scatter(
                x=list(range(len(curve))),
                y=y,
                mode="lines+markers",
                name=name,
                line={"color": SET_COLORS[i % len(SET_COLORS)]},
                hovertemplate=f"{name}<br>block %{{x}}<br>%{{y:.2f}} dB<extra></extra>",
            )
        )
    fig.update_layout(
        title="Hidden-state SQNR after each block (where the error enters)",
        xaxis={"title": "block", "dtick": 1},
        yaxis={"title": METRIC_LABELS["sqnr_db"]},
        height=420,
    )
    return legend_on_top(fig, "choice set")


def choice_set_bars(
    names: Sequence[str], values: Sequence[float], metric: str, reference: str | None = "float"
) -> go.Figure:
    """The model-level ``metric`` of each choice set, one bar each, the best quantized one outlined
    (``reference``, the float model, is the yardstick, not a choice; "best" by
    ``lab.results.higher_is_better``). The value axis spans the values, not zero to them: sets that
    differ in the third decimal of a cosine must look different."""
    finite = [(v, i) for i, v in enumerate(values) if v is not None and math.isfinite(v)]
    candidates = [(v, i) for v, i in finite if names[i] != reference] or finite
    best = None
    if candidates:
        best = (max if results.higher_is_better(model_metric(metric)) else min)(candidates)[1]
    fig = go.Figure(
        go.Bar(
            x=list(names),
            y=list(values),
            marker={
                "color": [SET_COLORS[i % len(SET_COLORS)] for i in range(len(names))],
                "line": {"width": [3 if i == best else 0 for i in range(len(names))], "color": "black"},
            },
            text=[f"{v:.4g}" for v in values],
            textposition="outside",
        )
    )
    fig.update_layout(
        title=f"{MODEL_METRIC_LABELS.get(metric, metric)} per choice set",
        yaxis={"title": metric},
        height=380,
    )
    if len(finite) > 1:
        low, high = min(v for v, _ in finite), max(v for v, _ in finite)
        pad = (high - low) or abs(high) or 1.0
        fig.update_yaxes(range=[low - 0.3 * pad, high + 0.15 * pad])
    return fig


def local_vs_model(
    frame: pd.DataFrame,
    local_column: str,
    metric: str,
    float_value: float | None = None,
    order: Sequence[str] | None = None,
) -> go.Figure:
    """Every (tensor, observer) of a sensitivity table: its local metric against the model-level
    damage (log scale), one color per observer: whether a better local value means a better model."""
    fig = go.Figure()
    for name, part in frame.groupby("observer", sort=False):
        harm = [max(damage(metric, v, float_value), DAMAGE_FLOOR) for v in part[metric]]
        labels = [tensor_label(a, b) for a, b in zip(part["layer"], part["tensor"], strict=True)]
        fig.add_trace(
            go.Scatter(
                x=list(part[local_column]),
                y=harm,
                mode="markers",
                name=str(name),
                text=labels,
                marker={"color": observer_color(str(name), order)},
                hovertemplate="%{text}<br>local %{x:.4g}<br>damage %{y:.3g}<extra>" + str(name) + "</extra>",
            )
        )
    fig.update_layout(
        title=f"Local {local_column.removeprefix('local_')} against model-level damage ({metric})",
        xaxis={"title": local_column.removeprefix("local_")},
        yaxis={"title": f"damage ({metric})", "type": "log"},
        height=440,
    )
    return legend_on_top(fig)
