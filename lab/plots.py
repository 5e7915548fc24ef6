"""Plotly figures for the app: every figure is built from tensors, QParams and result frames by a
pure function here, so pages stay thin and each figure can be unit-tested on its data.

Figures set no template: the app draws them with ``st.plotly_chart(fig, theme="streamlit")`` so
they follow the light or dark theme. Trace colors are explicit and come from ``observer_color``,
so one observer has the same color on every page.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import torch
from plotly.colors import qualitative
from plotly.subplots import make_subplots

import observers as ob
from lab.dynamic import DYNAMIC_LABEL, effective_scales
from observers.suite import SuiteResult

PALETTE: tuple[str, ...] = (*qualitative.Plotly, *qualitative.Dark24)
MAX_HEATMAP_ROWS = 256
MAX_HEATMAP_COLS = 512
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


def envelope(result: SuiteResult) -> tuple[float, float]:
    """The tensor-wide ``(min, max)`` of an observer's chosen ranges: for channel, group, token
    or block granularity the smallest min and largest max over all its qparam groups."""
    qp = result.qparams
    return float(qp.min_val.min()), float(qp.max_val.max())


def value_histogram(
    x: torch.Tensor, bins: int = 200, lo: float | None = None, hi: float | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """``(bin_edges, counts)`` of the values of ``x`` over ``[lo, hi]`` (default: data range)."""
    flat = x.detach().to(torch.float32).flatten()
    lo = float(flat.min()) if lo is None else lo
    hi = float(flat.max()) if hi is None else hi
    if hi <= lo:
        hi = lo + max(abs(lo), 1.0) * 1e-6
    counts = torch.histc(flat, bins=bins, min=lo, max=hi)
    return np.linspace(lo, hi, bins + 1), _numpy(counts)


def tail_bounds(x: torch.Tensor, tail: str, share: float = 0.001) -> tuple[float, float]:
    """The x-range of the outer ``share`` of values on one side: ``tail`` is ``left`` or ``right``."""
    flat = x.detach().to(torch.float32).flatten()
    sample = flat if flat.numel() <= 2_000_000 else flat[:: math.ceil(flat.numel() / 2_000_000)]
    if tail == "right":
        return float(torch.quantile(sample, 1.0 - share)), float(flat.max())
    if tail == "left":
        return float(flat.min()), float(torch.quantile(sample, share))
    raise ValueError(f"tail must be 'left' or 'right', got {tail!r}")


def legend_on_top(fig: go.Figure, title: str = "observer") -> go.Figure:
    """A horizontal legend above the plot, so a dozen observers never squeeze the plot area."""
    fig.update_layout(
        legend={"orientation": "h", "yanchor": "bottom", "y": 1.02, "xanchor": "left", "x": 0, "title_text": title},
        title={"yref": "container", "y": 0.99, "yanchor": "top"},
        margin={"t": 170},
    )
    return fig


def range_label(result: SuiteResult, lo: float, hi: float) -> str:
    """``name [lo, hi]``, plus ``· x% clipped`` when the observer clips values."""
    clip = result.metrics.get("clip_ratio") or 0.0
    label = f"{result.name} [{lo:.4g}, {hi:.4g}]"
    return f"{label} · {100 * clip:.3g}% clipped" if clip > 0 else label


def _line_x(lo: float, hi: float, absolute: bool) -> tuple[float, float]:
    return (abs(lo), abs(hi)) if absolute else (lo, hi)


def range_histogram(
    data: torch.Tensor,
    results: Sequence[SuiteResult],
    *,
    bins: int = 200,
    log_count: bool = True,
    absolute: bool = False,
    tail: str | None = None,
    title: str = "",
    order: Sequence[str] | None = None,
) -> go.Figure:
    """Histogram of the tensor's values with each observer's chosen ``[min, max]`` as two vertical
    lines (layout shapes, one legend entry per observer, named by ``range_label``: the range, and
    for observers that clip (``clip_ratio`` > 0) the share of values clipped).

    ``absolute`` histograms ``|x|`` and draws the lines at ``|min|`` and ``|max|``; ``tail``
    (``left``/``right``) re-bins only the outer 0.1 % of values, so the tail's shape and the
    lines inside it become visible.
    """
    x = data.detach().to(torch.float32)
    x = x.abs() if absolute else x
    ok = _ok(results)
    if tail is None:
        edges_x = [float(x.min()), float(x.max())]
        for r in ok:
            edges_x.extend(_line_x(*envelope(r), absolute))
        lo, hi = min(edges_x), max(edges_x)
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
        r_lo, r_hi = _line_x(*envelope(r), absolute)
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
    legend_on_top(fig, "observer: chosen [min, max]")
    if log_count:
        fig.update_yaxes(dtick=1)
    if tail is not None:
        fig.update_xaxes(range=[lo, hi])
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


def token_channel_figure(acts: torch.Tensor, title: str = "") -> go.Figure:
    """For activations ``(tokens, hidden)``: abs-max per token (in token order) next to abs-max
    per channel (sorted), showing whether outliers live in tokens or in channels."""
    a = acts.detach().to(torch.float32).abs().flatten(0, -2)
    per_token = _numpy(a.amax(1))
    per_channel = _numpy(a.amax(0))
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
    says by how much.
    """
    if field not in QPARAM_FIELDS:
        raise ValueError(f"unknown qparam field {field!r}; choose from {', '.join(QPARAM_FIELDS)}")
    label, grid_of = QPARAM_FIELDS[field]
    ok = _ok(results)
    if not ok:
        raise ValueError("no observer produced qparams for this tensor")
    grids = [downsample(grid_of(r.qparams), max_rows) for r in ok]
    finite = np.concatenate([g[np.isfinite(g)] for g, _, _ in grids] or [np.zeros(1)])
    cmin, cmax = (float(finite.min()), float(finite.max())) if finite.size else (0.0, 1.0)
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
    fig.update_layout(
        title=title or f"{label} per group" + (f" (downsampled to ≤ {max_rows} rows)" if reduced else ""),
        coloraxis={"cmin": cmin, "cmax": cmax, "colorscale": "Viridis", "colorbar": {"title": {"text": label}}},
    )
    return fig


def scale_ratio_heatmap(a: SuiteResult, b: SuiteResult, max_rows: int = MAX_HEATMAP_ROWS) -> go.Figure:
    """``log2(scale_a / scale_b)`` per group on a diverging scale centered at 0 (equal scales):
    red where ``a`` chose a wider range than ``b``, blue where narrower."""
    if a.qparams is None or b.qparams is None:
        raise ValueError("both observers need qparams to compare scales")
    ratio = np.log2(as_grid(a.qparams.effective_scale) / as_grid(b.qparams.effective_scale))
    grid, row_factor, _ = downsample(np.abs(ratio), max_rows) if ratio.shape[0] > max_rows else (ratio, 1, 1)
    bound = float(np.nanmax(np.abs(grid[np.isfinite(grid)]))) if np.isfinite(grid).any() else 1.0
    fig = go.Figure(
        go.Heatmap(
            z=grid,
            zmid=0,
            zmin=-max(bound, 1e-6),
            zmax=max(bound, 1e-6),
            colorscale="RdBu_r",
            colorbar={"title": {"text": "log2 ratio"}},
            hovertemplate="row %{y}<br>group %{x}<br>log2 ratio %{z:.3f}<extra></extra>",
        )
    )
    note = f" (|ratio|, max of {row_factor} rows)" if row_factor > 1 else ""
    fig.update_layout(
        title=f"log2(scale {a.name} / scale {b.name}){note}",
        xaxis_title="group",
        yaxis_title="row",
        yaxis_autorange="reversed",
    )
    return fig


def scale_distribution(results: Sequence[SuiteResult], order: Sequence[str] | None = None) -> go.Figure:
    """Overlaid histograms of ``log2(scale)`` per observer."""
    fig = go.Figure()
    for r in _ok(results):
        values = np.log2(_numpy(r.qparams.effective_scale).ravel())
        fig.add_trace(
            go.Histogram(x=values, name=r.name, marker_color=observer_color(r.name, order), opacity=0.55, nbinsx=60)
        )
    fig.update_layout(
        barmode="overlay", xaxis_title="log2(scale)", yaxis_title="groups", title="distribution of scales"
    )
    return legend_on_top(fig)


def quantization_error(entry, result: SuiteResult) -> torch.Tensor:
    """``x - x_hat`` of one observer on one analysed tensor (a ``lab.pipeline.TensorAnalysis``)."""
    x = entry.data.to(torch.float32)
    return x - ob.fake_quantize(x, result.qparams, entry.spec).to(torch.float32)


def error_histogram(entry, order: Sequence[str] | None = None, bins: int = 120) -> go.Figure:
    """Histogram of the error ``x - x_hat`` per observer, on common bins, as overlaid step lines."""
    errors = {r.name: quantization_error(entry, r) for r in _ok(entry.results)}
    if not errors:
        raise ValueError(f"no observer produced qparams for {entry.layer} {entry.tensor}")
    bound = max(float(e.abs().max()) for e in errors.values()) or 1e-12
    fig = go.Figure()
    for name, err in errors.items():
        edges, counts = value_histogram(err, bins, -bound, bound)
        fig.add_trace(
            go.Scatter(
                x=(edges[:-1] + edges[1:]) / 2,
                y=counts,
                name=name,
                mode="lines",
                line={"color": observer_color(name, order), "shape": "hvh"},
            )
        )
    fig.update_layout(
        title=f"quantization error x − x̂: {entry.layer} · {entry.tensor}",
        xaxis_title="x − x̂",
        yaxis_title="count (log)",
        yaxis_type="log",
    )
    return legend_on_top(fig)


def tensor_label(layer: str, tensor: str) -> str:
    return f"{layer} · {tensor}"


def metric_bars(frame: pd.DataFrame, metric: str = "sqnr_db", order: Sequence[str] | None = None) -> go.Figure:
    """Grouped bars: ``metric`` per observer (color) per layer and tensor (x)."""
    fig = go.Figure()
    frame = frame.assign(label=[tensor_label(a, b) for a, b in zip(frame["layer"], frame["tensor"], strict=True)])
    frame = frame[pd.to_numeric(frame[metric], errors="coerce").notna()]
    for name, rows in frame.groupby("observer", sort=False):
        fig.add_trace(go.Bar(x=rows["label"], y=rows[metric], name=name, marker_color=observer_color(name, order)))
    fig.update_layout(
        barmode="group",
        title=f"{METRIC_LABELS.get(metric, metric)} per observer",
        xaxis_title="layer · tensor",
        yaxis_title=METRIC_LABELS.get(metric, metric),
    )
    return legend_on_top(fig)


METRIC_LABELS = {
    "mse": "MSE",
    "sqnr_db": "SQNR (dB)",
    "cosine": "cosine similarity",
    "max_abs_error": "max |error|",
    "clip_ratio": "share clipped",
    "rmse_over_scale": "RMSE / scale",
    "seconds": "time (s)",
}


def metric_heatmap(frame: pd.DataFrame, metric: str = "sqnr_db") -> go.Figure:
    """Layers (rows) x observers (columns) colored by ``metric``, values written in the cells,
    so a whole model can be scanned at a glance. Higher-is-better metrics use the reversed scale
    so that better is always the same color."""
    frame = frame.assign(label=[tensor_label(a, b) for a, b in zip(frame["layer"], frame["tensor"], strict=True)])
    table = frame.pivot_table(index="label", columns="observer", values=metric, sort=False, aggfunc="first")
    table = table.dropna(axis="columns", how="all")
    better_high = ob.HIGHER_IS_BETTER.get(metric, True)
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
        xaxis_title="observer",
        yaxis_title="layer · tensor",
        yaxis_autorange="reversed",
        height=max(320, 60 + 28 * len(table.index)),
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


def scale_bars(results: Sequence[SuiteResult], order: Sequence[str] | None = None) -> go.Figure:
    """One bar per observer: its single scale (per-tensor granularity, where a heatmap is one cell)."""
    ok = [r for r in _ok(results) if r.qparams.scale.numel() == 1]
    fig = go.Figure(
        go.Bar(
            x=[r.name for r in ok],
            y=[float(r.qparams.effective_scale.flatten()[0]) for r in ok],
            marker_color=[observer_color(r.name, order) for r in ok],
            hovertemplate="%{x}<br>scale %{y:.5g}<extra></extra>",
        )
    )
    fig.update_layout(title="scale per observer (one per tensor)", xaxis_title="observer", yaxis_title="scale")
    return fig


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

    ``entry`` is a ``lab.pipeline.TensorAnalysis``; the run-time scales are
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
