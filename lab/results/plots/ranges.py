"""Where values lie and where each observer clips: the range histogram, per-channel, per-token
and per-head ranges."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import torch
from plotly.subplots import make_subplots

import observers as ob
from lab.analyse.kept_values import ValueHistogram
from lab.results.plots.style import DATA_COLOR, _numpy, _ok, legend_on_top, observer_color
from lab.results.ranges import envelope
from observers.suite import SuiteResult

Values = torch.Tensor | ValueHistogram
"""What a value histogram draws: the values, or their histogram (a run reopened from the history)."""


def extent(x: Values) -> tuple[float, float]:
    """The smallest and largest value."""
    if isinstance(x, ValueHistogram):
        return x.lo, x.hi
    flat = x.detach().to(torch.float32).flatten()
    return float(flat.min()), float(flat.max())


def value_histogram(
    x: Values, bins: int = 200, lo: float | None = None, hi: float | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """``(bin_edges, counts)`` of the values of ``x`` over ``[lo, hi]`` (default: data range)."""
    if lo is None or hi is None:
        low, high = extent(x)
        lo, hi = low if lo is None else lo, high if hi is None else hi
    if hi <= lo:
        hi = lo + max(abs(lo), 1.0) * 1e-6
    if isinstance(x, ValueHistogram):
        return x.counts_over(bins, lo, hi)
    counts = torch.histc(x.detach().to(torch.float32).flatten(), bins=bins, min=lo, max=hi)
    return np.linspace(lo, hi, bins + 1), _numpy(counts)


def _quantile_sample(flat: torch.Tensor, limit: int = 2_000_000) -> torch.Tensor:
    """An evenly strided subset of at most ``limit`` values: ``torch.quantile`` refuses inputs of
    more than 16M elements, and a strided sample's quantiles are close enough for plot bounds."""
    return flat if flat.numel() <= limit else flat[:: math.ceil(flat.numel() / limit)]


def tail_bounds(x: Values, tail: str, share: float = 0.001) -> tuple[float, float]:
    """The x-range of the outer ``share`` of values on one side: ``tail`` is ``left`` or ``right``."""
    if tail not in ("left", "right"):
        raise ValueError(f"tail must be 'left' or 'right', got {tail!r}")
    lo, hi = extent(x)
    at = share if tail == "left" else 1.0 - share
    if isinstance(x, ValueHistogram):
        cut = x.quantile(at)
    else:
        cut = float(torch.quantile(_quantile_sample(x.detach().to(torch.float32).flatten()), at))
    return (cut, hi) if tail == "right" else (lo, cut)


def range_label(result: SuiteResult, lo: float, hi: float) -> str:
    """``name [lo, hi]``, plus ``· x% clipped`` when the observer clips values."""
    clip = result.metrics.get("clip_ratio") or 0.0
    label = f"{result.name} [{lo:.4g}, {hi:.4g}]"
    return f"{label} · {100 * clip:.3g}% clipped" if clip > 0 else label


def _line_x(lo: float, hi: float, absolute: bool) -> tuple[float, float]:
    return (abs(lo), abs(hi)) if absolute else (lo, hi)


VIEW_REACH = 4.0
"""Range lines further from zero than this many times the data's largest magnitude are left out
of the histogram's x range: a plain fp16 cast clips at ±65504, and binning up to there would put
every value in one bin. They stay in the legend, with their values."""


def view_bounds(data_lo: float, data_hi: float, lines: Sequence[float]) -> tuple[float, float]:
    """``(lo, hi)`` of the histogram: the data's range widened to every line within
    ``VIEW_REACH`` times the data's largest magnitude."""
    at = np.asarray(lines, dtype=np.float64)
    near = at[np.abs(at) <= VIEW_REACH * max(abs(data_lo), abs(data_hi))]
    return float(near.min(initial=data_lo)), float(near.max(initial=data_hi))


def range_histogram(
    data: Values,
    results: Sequence[SuiteResult],
    spec: ob.QuantSpec,
    *,
    bins: int = 200,
    log_count: bool = True,
    absolute: bool = False,
    tail: str | None = None,
    title: str = "",
    order: Sequence[str] | None = None,
    specs: Mapping[str, ob.QuantSpec] | None = None,
) -> go.Figure:
    """Histogram of the tensor's values with, per observer, two vertical lines where its format
    clips (``envelope`` under ``spec``: the representable range, not the chosen min/max) as layout
    shapes, one legend entry per observer, named by ``range_label``: the range, and for observers
    that clip (``clip_ratio`` > 0) the share of values clipped.

    ``absolute`` histograms ``|x|`` and draws the lines at ``|lo|`` and ``|hi|``; ``tail``
    (``left``/``right``) re-bins only the outer 0.1 % of values, so the tail's shape and the
    lines inside it become visible. The full view spans the data and the lines near it
    (``view_bounds``). ``specs``: the spec a result was computed under, by name, where it is not
    ``spec`` (a tool's conventions, e.g. torch.ao's halved activation range, move its clip lines).
    ``data``: the values, or their histogram (``TensorAnalysis.values``), re-binned as they would be.
    """
    if isinstance(data, ValueHistogram):
        x = data.absolute() if absolute else data
    else:
        x = data.detach().to(torch.float32)
        x = x.abs() if absolute else x
    ok = _ok(results)
    specs = specs or {}
    ends = {r.name: _line_x(*envelope(r, specs.get(r.name, spec)), absolute) for r in ok}
    if tail is None:
        lo, hi = view_bounds(*extent(x), [at for pair in ends.values() for at in pair])
    else:
        lo, hi = tail_bounds(x, tail)
    edges, counts = value_histogram(x, bins, lo, hi)
    centers = (edges[:-1] + edges[1:]) / 2
    fig = go.Figure(
        go.Bar(
            x=centers,
            y=counts,
            width=float(edges[1] - edges[0]),
            marker_color=DATA_COLOR,
            marker_line_width=0,
            opacity=0.6,
            name="values",
            hovertemplate="value %{x:.4g}<br>count %{y}<extra></extra>",
        )
    )
    for r in ok:
        color = observer_color(r.name, order)
        r_lo, r_hi = ends[r.name]
        for i, at in enumerate((r_lo, r_hi)):
            fig.add_shape(
                type="line",
                x0=at,
                x1=at,
                y0=0,
                y1=1,
                yref="paper",
                line={"color": color, "width": 2},
                name=range_label(r, r_lo, r_hi),
                legendgroup=r.name,
                showlegend=i == 0,
            )
    fig.update_layout(
        title=title,
        xaxis_title="|value|" if absolute else "value",
        yaxis_title="count (log)" if log_count else "count",
        yaxis_type="log" if log_count else "linear",
        bargap=0,
        height=520,
    )
    legend_on_top(fig, "observer: clips outside [lo, hi]", entries=len(ok) + 1)
    if log_count:
        fig.update_yaxes(dtick=1)
    pad = 0.0 if tail is not None else 0.02 * ((hi - lo) or max(abs(lo), 1.0))
    fig.update_xaxes(range=[lo - pad, hi + pad])
    return fig


def channel_ranges(x: torch.Tensor, channel_axis: int) -> pd.DataFrame:
    """Per-channel min and max (channels along ``channel_axis``), sorted by ``max |value|``
    descending, with the original channel index: outlier channels come first."""
    moved = x.detach().to(torch.float32).movedim(channel_axis, 0).flatten(1)
    frame = pd.DataFrame(
        {"channel": np.arange(moved.shape[0]), "min": _numpy(moved.amin(1)), "max": _numpy(moved.amax(1))}
    )
    frame["absmax"] = frame[["min", "max"]].abs().max(axis=1)
    return frame.sort_values("absmax", ascending=False, kind="stable").reset_index(drop=True)


def channel_range_figure(x: torch.Tensor, channel_axis: int = 0, title: str = "") -> go.Figure:
    """AIMET-style per-channel range plot: each channel's [min, max] as a band, channels sorted by
    ``max |value|`` so a few outlier channels stand out from the bulk on the left."""
    frame = channel_ranges(x, channel_axis)
    rank = np.arange(len(frame))
    hover = "channel %{customdata}<br>%{y:.4g}<extra>%{fullData.name}</extra>"
    fig = go.Figure(
        [
            go.Scatter(x=rank, y=frame["min"], name="min", mode="lines", line={"color": "#1f77b4"}),
            go.Scatter(x=rank, y=frame["max"], name="max", mode="lines", line={"color": "#d62728"}, fill="tonexty"),
        ]
    )
    fig.update_traces(customdata=frame["channel"], hovertemplate=hover)
    fig.update_layout(
        title=title,
        xaxis_title="channel rank (sorted by max |value|, outliers left)",
        yaxis_title="value",
    )
    return fig


def token_channel_figure(acts: torch.Tensor, title: str = "", channels: torch.Tensor | None = None) -> go.Figure:
    """For activations ``(tokens, hidden)``: abs-max per token (in token order) next to abs-max
    per channel (sorted), showing whether outliers live in tokens or in channels. ``channels``:
    the tokens the per-channel abs-max is taken over, where not ``acts`` (``TensorAnalysis.extremes``
    of a reopened run, whose ``acts`` are a subset)."""
    a = acts.detach().to(torch.float32).abs().flatten(0, -2)
    per_token = _numpy(a.amax(1))
    over = a if channels is None else channels.detach().to(torch.float32).abs().flatten(0, -2)
    per_channel = _numpy(over.amax(0))
    order = np.argsort(-per_channel, kind="stable")
    fig = make_subplots(rows=1, cols=2, subplot_titles=("abs-max per token", "abs-max per channel (sorted)"))
    fig.add_trace(
        go.Scatter(x=np.arange(len(per_token)), y=per_token, mode="lines", name="per token", line={"color": "#1f77b4"}),
        row=1,
        col=1,
    )
    fig.add_trace(
        go.Scatter(
            x=np.arange(len(order)),
            y=per_channel[order],
            customdata=order,
            mode="lines",
            name="per channel",
            line={"color": "#d62728"},
            hovertemplate="channel %{customdata}<br>abs-max %{y:.4g}<extra></extra>",
        ),
        row=1,
        col=2,
    )
    fig.update_xaxes(title_text="token index", row=1, col=1)
    fig.update_xaxes(title_text="channel rank", row=1, col=2)
    fig.update_yaxes(title_text="abs-max", type="log", row=1, col=1)
    fig.update_yaxes(title_text="abs-max", type="log", row=1, col=2)
    fig.update_layout(title=title, showlegend=False)
    return fig


def per_token_view(states: torch.Tensor) -> torch.Tensor:
    """Attention states ``(batch, heads, seq, head_dim)`` as ``(batch * seq, heads * head_dim)``:
    one row per cached token, in the layout the k/v projection wrote it."""
    if states.ndim != 4:
        raise ValueError(f"attention states must be (batch, heads, seq, head_dim), got shape {tuple(states.shape)}")
    batch, heads, seq, dim = states.shape
    return states.permute(0, 2, 1, 3).reshape(batch * seq, heads * dim)


def head_range_figure(states: torch.Tensor, title: str = "min/max per head") -> go.Figure:
    """Per-head ``[min, max]`` of attention states ``(batch, heads, seq, head_dim)`` as floating
    bars, heads sorted by ``max |value|``: one scale per head (compressed-tensors ``attn_head``)
    pays off when these bars differ."""
    if states.ndim != 4:
        raise ValueError(f"attention states must be (batch, heads, seq, head_dim), got shape {tuple(states.shape)}")
    frame = channel_ranges(states, 1)
    fig = go.Figure(
        go.Bar(
            x=[f"head {h}" for h in frame["channel"]],
            y=frame["max"] - frame["min"],
            base=frame["min"],
            marker_color="#d62728",
            opacity=0.6,
            customdata=np.stack([frame["min"], frame["max"]], axis=1),
            hovertemplate="%{x}<br>min %{customdata[0]:.4g}<br>max %{customdata[1]:.4g}<extra></extra>",
        )
    )
    fig.update_layout(title=title, xaxis_title="head (sorted by max |value|)", yaxis_title="value")
    return fig
