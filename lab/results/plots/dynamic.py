"""Run-time (dynamic) scales over the calibration tokens against each observer's static scales."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

import observers as ob
from lab.results.dynamic import DYNAMIC_LABEL, effective_scales
from lab.results.plots.style import DATA_COLOR, _ok, legend_on_top, observer_color
from observers.suite import SuiteResult

_DYNAMIC_UNITS = {"token": "token", "tensor": "call (the calibration set as one call)"}


def _log10_range(values: Sequence[np.ndarray], pad: float = 0.05) -> tuple[float, float]:
    """``(lo, hi)`` in decades around every positive value of ``values``, padded so that a single
    value still spans a visible interval."""
    logs = np.log10(np.concatenate([v.ravel() for v in values]))
    return float(logs.min()) - pad, float(logs.max()) + pad


def _scale_line(at: float, top: float, color: str, name: str, group: str, dash: str = "solid") -> go.Scatter:
    """A vertical line at scale ``at`` from 0 to ``top``, as a trace (it shares the log x axis)."""
    return go.Scatter(
        x=[at, at],
        y=[0.0, top],
        mode="lines",
        line={"color": color, "width": 2, "dash": dash},
        name=name,
        legendgroup=group,
        hovertemplate=f"{name}<extra></extra>",
    )


def dynamic_scale_figure(entry, results: Sequence[SuiteResult], order: Sequence[str] | None = None) -> go.Figure:
    """The run-time scales of a dynamic activation over all its calibration tokens, as a histogram
    on log-spaced bins (a filled step line; scales span decades), with each observer's static
    scale: a vertical line where it is one value, else (per group or per token) a box of its
    values (quartiles, whiskers at min and max) in a panel below, next to the run-time box.
    Per-tensor dynamic scales are one value for the calibration set (one call): a dashed line,
    drawn over the observers' lines.

    ``entry`` is a ``lab.analyse.analysis.TensorAnalysis``; the run-time scales are
    ``ob.dynamic_qparams(entry.data, entry.spec)``, step sizes (NVFP4: ``scale / global_scale``).
    """
    runtime = effective_scales(ob.dynamic_qparams(entry.data, entry.spec))
    statics = {r.name: effective_scales(r.qparams) for r in _ok(results)}
    spread = {name: values for name, values in statics.items() if values.size > 1}
    fig = make_subplots(
        rows=2 if spread else 1,
        cols=1,
        shared_xaxes=True,
        row_heights=[0.7, 0.3] if spread else None,
        vertical_spacing=0.05,
    )
    if runtime.size > 1:
        lo, hi = _log10_range([runtime])
        counts = np.histogram(np.log10(runtime), bins=60, range=(lo, hi))[0]
        fig.add_trace(
            go.Scatter(
                x=10.0 ** np.linspace(lo, hi, 61),
                y=np.append(counts, counts[-1]),
                mode="lines",
                line={"shape": "hv", "color": DATA_COLOR},
                fill="tozeroy",
                name=f"{DYNAMIC_LABEL}: {runtime.size} scales",
                legendgroup=DYNAMIC_LABEL,
                hovertemplate="scale ≥ %{x:.4g}<br>count %{y}<extra></extra>",
            ),
            row=1,
            col=1,
        )
        top = float(counts.max()) * 1.05
        fig.update_yaxes(title_text="run-time scales", row=1, col=1)
    else:
        top = 1.0
        fig.update_yaxes(visible=False, row=1, col=1)
    single = {name: float(values[0]) for name, values in statics.items() if values.size == 1}
    for name, at in single.items():
        label = f"{name}: static {at:.4g}"
        fig.add_trace(_scale_line(at, top, observer_color(name, order), label, name), row=1, col=1)
    if runtime.size == 1:
        name = f"{DYNAMIC_LABEL}: {runtime[0]:.4g}"
        fig.add_trace(_scale_line(float(runtime[0]), top, DATA_COLOR, name, DYNAMIC_LABEL, "dash"), row=1, col=1)
    boxes = {DYNAMIC_LABEL: runtime, **spread} if spread else {}
    for name, values in boxes.items():
        q0, q1, q2, q3, q4 = np.percentile(values, (0, 25, 50, 75, 100))
        is_runtime = name == DYNAMIC_LABEL
        fig.add_trace(
            go.Box(
                y=[name],
                q1=[q1],
                median=[q2],
                q3=[q3],
                lowerfence=[q0],
                upperfence=[q4],
                orientation="h",
                marker_color=DATA_COLOR if is_runtime else observer_color(name, order),
                name=name if is_runtime else f"{name}: {values.size} static scales",
                legendgroup=name,
                showlegend=not is_runtime,
            ),
            row=2,
            col=1,
        )
    if spread:
        fig.update_yaxes(title_text="quartiles, min–max", autorange="reversed", row=2, col=1)
    fig.update_xaxes(type="log", range=list(_log10_range([runtime, *statics.values()])))
    fig.update_xaxes(title_text="scale (step size, log)", row=2 if spread else 1, col=1)
    unit = _DYNAMIC_UNITS.get(entry.spec.strategy, "token × group")
    fig.update_layout(
        title=f"run-time scales, one per {unit}: {entry.layer} · {entry.tensor}",
        height=620 if spread else 480,
    )
    return legend_on_top(fig, "scales")
