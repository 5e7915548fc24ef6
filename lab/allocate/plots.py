"""Figures of an allocation (the app's Allocate page and the report draw the same ones): the
frontier, bits per weight against the damage, the budgets' allocations predicted (the scores, on
the held-out text's scoring part), measured in sample (on that part) and measured out of sample
(on the measuring part), with every uniform scheme as a point; and the layers × schemes view of
one allocation, each cell the best observer's score under that scheme, the chosen cell marked.

Damage is drawn on a log scale, as the sensitivity heatmap draws it: the layers' scores span
orders of magnitude.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from lab.allocate.frontier import Frontier, Options, Point, score_name
from lab.results.plots.effect import DAMAGE_FLOOR
from lab.results.plots.style import legend_on_top


def frontier_figure(frontier: Frontier) -> go.Figure:
    """Bits per weight against damage: allocations measured on the measuring part (line), in
    sample on the scoring part (dotted) and predicted (dashed), the uniform schemes measured
    (points) and predicted (hollow); every point's in-sample figure is in ``points_frame``."""
    name = score_name(frontier.metric)
    figure = go.Figure()
    allocations = sorted(frontier.allocations, key=lambda p: p.bits_per_weight)
    for label, values, style in (
        ("allocation, measured", [p.measured_score for p in allocations], {"dash": "solid"}),
        ("allocation, in sample", [p.in_sample_score for p in allocations], {"dash": "dot"}),
        ("allocation, predicted", [p.predicted for p in allocations], {"dash": "dash"}),
    ):
        figure.add_trace(
            go.Scatter(
                x=[p.bits_per_weight for p in allocations],
                y=[_floor(v) for v in values],
                text=[p.name for p in allocations],
                mode="lines+markers",
                line={"color": "#1f77b4", **style},
                name=label,
                hovertemplate="%{text}<br>%{x:.3f} bits/weight<br>" + name + " %{y:.4g}<extra></extra>",
            )
        )
    uniforms = [p for p in frontier.uniforms if p.predicted > 0 or (p.measured_score or 0) > 0]
    for label, values, symbol in (
        ("uniform scheme, measured", [p.measured_score for p in uniforms], "diamond"),
        ("uniform scheme, predicted", [p.predicted for p in uniforms], "diamond-open"),
    ):
        figure.add_trace(
            go.Scatter(
                x=[p.bits_per_weight for p in uniforms],
                y=[_floor(v) for v in values],
                text=[p.name for p in uniforms],
                mode="markers+text" if "measured" in label else "markers",
                textposition="top center",
                marker={"symbol": symbol, "size": 11, "color": "#d62728"},
                cliponaxis=False,  # the uniforms' names above them
                name=label,
                hovertemplate="%{text}<br>%{x:.3f} bits/weight<br>" + name + " %{y:.4g}<extra></extra>",
            )
        )
    figure.update_layout(
        xaxis_title="bits per weight (the chosen layers, as the checkpoint stores them)",
        yaxis_title=f"{name} (log)",
        yaxis_type="log",
        height=420,
        margin={"t": 40, "l": 10, "r": 10, "b": 10},
    )
    return legend_on_top(figure, title="", entries=5)


def _floor(value: float | None) -> float | None:
    if value is None or math.isnan(value):
        return None
    return max(value, DAMAGE_FLOOR)


def allocation_frame(point: Point, options: Options) -> pd.DataFrame:
    """Layers × schemes: the best observer's score under each scheme (NaN where it does not
    apply), in the layers' order."""
    schemes = list(dict.fromkeys(s for found in options.values() for s in found))
    rows = {layer: {s: (found[s].score if s in found else np.nan) for s in schemes} for layer, found in options.items()}
    return pd.DataFrame.from_dict(rows, orient="index")[schemes].loc[[c.layer for c in point.choices]]


def allocation_figure(point: Point, options: Options, metric: str) -> go.Figure:
    """The layers × schemes view of ``point``: color is log10 of each option's score, the chosen
    cell is written ``● observer``, the others their best observer."""
    frame = allocation_frame(point, options)
    chosen = point.schemes()
    text = [
        [
            ("● " if chosen[layer] == scheme else "") + (options[layer][scheme].observer or "dense")
            if scheme in options[layer]
            else ""
            for scheme in frame.columns
        ]
        for layer in frame.index
    ]
    z = np.log10(np.clip(frame.to_numpy(dtype=float), DAMAGE_FLOOR, None))
    figure = go.Figure(
        go.Heatmap(
            z=z,
            x=list(frame.columns),
            y=list(frame.index),
            text=text,
            texttemplate="%{text}",
            colorscale="Reds",
            colorbar={"title": f"log10 {score_name(metric)}"},
            hovertemplate="%{y} under %{x}<br>%{text}<br>log10 score %{z:.2f}<extra></extra>",
        )
    )
    figure.update_layout(
        height=max(320, 22 * len(frame) + 120),
        yaxis={"autorange": "reversed"},
        margin={"t": 30, "l": 10, "r": 10, "b": 10},
        title=f"{point.name}: {point.bits_per_weight:.3f} bits per weight",
    )
    return figure


def points_frame(frontier: Frontier) -> pd.DataFrame:
    """One row per measured point: size, predicted damage (scoring part), the damage measured in
    sample (scoring part) and out of sample (measuring part), measured over predicted, and the
    measuring part's metrics."""
    name = score_name(frontier.metric)
    rows = []
    for p in frontier.points:
        ratio = p.measured_score / p.predicted if p.predicted and p.measured_score is not None else None
        rows.append(
            {
                "allocation": p.name,
                "bits per weight": p.bits_per_weight,
                "checkpoint bytes": p.checkpoint_bytes,
                f"predicted {name}": p.predicted,
                f"in-sample {name}": p.in_sample_score,
                f"measured {name}": p.measured_score,
                "measured / predicted": ratio,
                **{m: v for m, v in p.measured.items()},
            }
        )
    return pd.DataFrame(rows)
