"""lab.results.plots: figures checked on their data (traces, line positions, heatmap values, colors)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import observers as ob
from lab import results
from lab.analyse.analysis import TensorAnalysis
from lab.analyse.pipeline import analyse
from lab.analyse.result_cache import ResultCache
from lab.analyse.run_config import RunConfig
from lab.results import plots

MINMAX_FAMILY = ["minmax", "memoryless_minmax", "moving_average_minmax"]


def _weight(rows: int = 48, cols: int = 64, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g)
    w[3, 5] = 9.0  # one outlier, so clipping observers clip something
    return w


def _results(x: torch.Tensor, spec: ob.QuantSpec, kind: str = "weight") -> list:
    return ob.run_suite(x, spec, names=MINMAX_FAMILY, kind=kind)


def _lines(fig: go.Figure) -> dict[str, list[float]]:
    """x of the vertical lines per observer (shapes grouped by ``legendgroup``)."""
    positions: dict[str, list[float]] = {}
    for shape in fig.layout.shapes:
        assert shape.x0 == shape.x1, "observer lines are vertical"
        positions.setdefault(shape.legendgroup, []).append(shape.x0)
    return positions


def test_observer_color_is_registry_position_and_stable():
    names = list(ob.available())
    assert [plots.observer_color(n) for n in names] == [
        plots.PALETTE[i % len(plots.PALETTE)] for i in range(len(names))
    ]
    assert plots.observer_color("minmax") == plots.observer_color("minmax")
    assert plots.observer_color("not_registered") == plots.observer_color("not_registered")
    assert plots.observer_color("b", order=["a", "b"]) == plots.PALETTE[1]


def _clip_points(r, spec: ob.QuantSpec) -> list[float]:
    lo, hi = ob.representable_range(r.qparams, spec)
    return [float(lo.min()), float(hi.max())]


def test_range_histogram_lines_are_where_each_observer_clips():
    w = _weight()
    spec = ob.QuantSpec(dtype="int8", symmetric=False)
    results = _results(w, spec)
    fig = plots.range_histogram(w, results, spec, log_count=False)
    bars = [t for t in fig.data if isinstance(t, go.Bar)]
    assert len(bars) == 1 and bars[0].y.sum() == w.numel()
    lines = _lines(fig)
    assert set(lines) == set(MINMAX_FAMILY)
    for r in results:
        assert lines[r.name] == pytest.approx(_clip_points(r, spec))
    legend = [s.legendgroup for s in fig.layout.shapes if s.showlegend]
    assert sorted(legend) == sorted(MINMAX_FAMILY), "one legend entry per observer"
    assert fig.layout.yaxis.type == "linear"
    assert fig.layout.xaxis.title.text == "value"


def test_range_histogram_absolute_and_log_options():
    w = _weight()
    spec = ob.QuantSpec(dtype="int8", symmetric=False)
    results = _results(w, spec)
    fig = plots.range_histogram(w, results, spec, absolute=True, log_count=True)
    r = results[0]
    lo, hi = _clip_points(r, spec)
    assert _lines(fig)[r.name] == pytest.approx([abs(lo), hi])
    assert fig.layout.yaxis.type == "log"
    assert min(fig.data[0].x) >= 0


def test_range_histogram_group_granularity_draws_the_envelope():
    w = _weight()
    spec = ob.QuantSpec(dtype="int4", strategy="group", group_size=16)
    results = _results(w, spec)
    lines = _lines(plots.range_histogram(w, results, spec))
    scale = results[0].qparams.scale
    assert lines["minmax"] == pytest.approx([float((-8 * scale).min()), float((7 * scale).max())])


def test_range_histogram_labels_clipping_observers_with_range_and_share():
    w = _weight()
    clipped = ob.QParams(
        scale=torch.tensor([0.02]),
        zero_point=torch.tensor([0], dtype=torch.int32),
        min_val=torch.tensor([-2.5]),
        max_val=torch.tensor([2.5]),
    )
    from observers.suite import SuiteResult

    share = float(((w < -2.5) | (w > 2.5)).float().mean())
    result = SuiteResult("clipper", clipped, {"clip_ratio": share}, 0.0)
    fig = plots.range_histogram(w, [result, *_results(w, ob.QuantSpec())[:1]], ob.QuantSpec())
    labels = [s.name for s in fig.layout.shapes if s.showlegend]
    assert labels[0] == f"clipper [-2.56, 2.54] · {100 * share:.3g}% clipped"  # int8: -128·s and 127·s
    assert "clipped" not in labels[1]


def test_tail_zoom_bins_only_the_tail():
    w = _weight(200, 200)
    fig = plots.range_histogram(w, _results(w, ob.QuantSpec()), ob.QuantSpec(), tail="right", log_count=False)
    lo, hi = plots.tail_bounds(w, "right")
    assert tuple(fig.layout.xaxis.range) == pytest.approx((lo, hi))
    assert fig.data[0].y.sum() == pytest.approx(int(((w >= lo) & (w <= hi)).sum()), abs=1)
    with pytest.raises(ValueError, match="tail"):
        plots.tail_bounds(w, "middle")


def test_qparam_heatmaps_show_the_scales_on_one_color_range():
    w = _weight()
    spec = ob.QuantSpec(dtype="int4", strategy="group", group_size=16)
    results = _results(w, spec)
    results[1].qparams.scale = results[1].qparams.scale * 3  # make the two grids differ
    fig = plots.qparam_heatmaps(results)
    heatmaps = [t for t in fig.data if isinstance(t, go.Heatmap)]
    assert len(heatmaps) == len(results)
    for trace, r in zip(heatmaps, results, strict=True):
        np.testing.assert_array_equal(np.asarray(trace.z), r.qparams.scale.numpy())
        assert trace.coloraxis == "coloraxis"
    all_scales = torch.cat([r.qparams.scale.flatten() for r in results])
    assert fig.layout.coloraxis.cmin == pytest.approx(float(all_scales.min()))
    assert fig.layout.coloraxis.cmax == pytest.approx(float(all_scales.max()))


def test_qparam_heatmaps_zero_points_and_exponents():
    w = _weight()
    results = _results(w, ob.QuantSpec(dtype="uint8", symmetric=False, strategy="channel"))
    zp = plots.qparam_heatmaps(results, "zero_point")
    np.testing.assert_array_equal(np.asarray(zp.data[0].z), results[0].qparams.zero_point.numpy().reshape(-1, 1))
    exp = plots.qparam_heatmaps(results, "exponent")
    np.testing.assert_allclose(np.asarray(exp.data[0].z), np.log2(results[0].qparams.scale.numpy()), rtol=1e-6)
    with pytest.raises(ValueError, match="unknown qparam field"):
        plots.qparam_heatmaps(results, "nope")


def test_exponent_grid_prefers_stored_exponents():
    qp = ob.QParams(
        scale=torch.tensor([[0.5, 4.0]]),
        zero_point=torch.zeros(1, 2),
        min_val=torch.zeros(1, 2),
        max_val=torch.ones(1, 2),
        extras={"scale_exponent": torch.tensor([[126, 129]], dtype=torch.uint8)},
    )
    np.testing.assert_array_equal(plots.exponent_grid(qp), [[126, 129]])
    del qp.extras["scale_exponent"]
    np.testing.assert_array_equal(plots.exponent_grid(qp), [[-1.0, 2.0]])


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 700), cols=st.integers(1, 40), max_rows=st.integers(1, 300))
def test_downsample_keeps_the_max_and_bounds_the_size(rows, cols, max_rows):
    grid = np.random.default_rng(rows * 1000 + cols).random((rows, cols))
    small, row_factor, _ = plots.downsample(grid, max_rows)
    assert small.shape[0] <= max_rows and small.shape[1] == cols
    assert small.max() == grid.max()
    assert row_factor == max(1, -(-rows // max_rows))
    np.testing.assert_array_equal(small[0], grid[:row_factor].max(axis=0))


def test_big_heatmaps_are_downsampled_and_say_so():
    w = torch.randn(1000, 32)
    fig = plots.qparam_heatmaps(_results(w, ob.QuantSpec(strategy="channel")), max_rows=256)
    assert np.asarray(fig.data[0].z).shape == (250, 1)
    assert "downsampled" in fig.layout.title.text


def test_scale_ratio_is_log2_of_the_two_scales():
    w = _weight()
    a, b = _results(w, ob.QuantSpec(strategy="channel"))[:2]
    b.qparams.scale = b.qparams.scale * 2
    fig = plots.scale_ratio_heatmap(a, b)
    np.testing.assert_allclose(np.asarray(fig.data[0].z), -np.ones((w.shape[0], 1)), atol=1e-6)
    assert fig.data[0].zmid == 0


def test_channel_ranges_sorted_by_absmax_with_channel_index():
    w = _weight()
    frame = plots.channel_ranges(w, 0)
    assert frame["channel"].iloc[0] == 3  # the outlier row comes first
    assert frame["absmax"].is_monotonic_decreasing
    np.testing.assert_allclose(frame.sort_values("channel")["max"], w.amax(1).numpy())
    fig = plots.channel_range_figure(w)
    assert [t.name for t in fig.data] == ["min", "max"]
    assert list(fig.data[1].customdata) == list(frame["channel"])


def test_token_channel_figure_per_token_and_per_channel_absmax():
    acts = torch.randn(30, 16)
    acts[:, 7] *= 50
    fig = plots.token_channel_figure(acts)
    np.testing.assert_allclose(fig.data[0].y, acts.abs().amax(1).numpy())
    assert fig.data[1].customdata[0] == 7
    assert fig.data[1].y[0] == pytest.approx(float(acts[:, 7].abs().max()))


def _analysis(model_entries: list[TensorAnalysis]):
    from lab.analyse.analysis import Analysis
    from lab.analyse.model_facts import ModelFacts

    config = RunConfig(specs={"weight": ob.QuantSpec()}, observers=tuple(MINMAX_FAMILY))
    return Analysis(ModelFacts({"name": "t"}), config, model_entries)


def _entry(layer: str, w: torch.Tensor, spec: ob.QuantSpec) -> TensorAnalysis:
    return TensorAnalysis(layer, "weight", spec, w, _results(w, spec))


def test_metric_heatmap_and_bars_carry_the_frame_values():
    spec = ob.QuantSpec(dtype="int4")
    analysis = _analysis([_entry("a", _weight(seed=1), spec), _entry("b", _weight(seed=2), spec)])
    frame = analysis.frame()
    heat = plots.metric_heatmap(frame, "sqnr_db")
    assert list(heat.data[0].x) == MINMAX_FAMILY
    assert list(heat.data[0].y) == ["a · weight", "b · weight"]
    expected = frame.pivot_table(index="layer", columns="observer", values="sqnr_db")[MINMAX_FAMILY].to_numpy()
    np.testing.assert_allclose(np.asarray(heat.data[0].z, dtype=float), expected)
    assert plots.metric_heatmap(frame, "mse").data[0].colorscale != heat.data[0].colorscale
    bars = plots.metric_bars(frame, "sqnr_db")
    assert [t.name for t in bars.data] == MINMAX_FAMILY
    np.testing.assert_allclose(bars.data[0].x, frame[frame["observer"] == "minmax"]["sqnr_db"])
    assert list(bars.data[0].y) == ["a · weight", "b · weight"]
    failed = pd.concat([frame, frame.iloc[:1].assign(observer="broken", sqnr_db=np.nan)], ignore_index=True)
    assert "broken" not in [t.name for t in plots.metric_bars(failed).data], "no empty bars for errors"
    assert "broken" not in list(plots.metric_heatmap(failed).data[0].x)
    assert [t.marker.color for t in bars.data] == [plots.observer_color(n) for n in MINMAX_FAMILY]


def _one_row(metric: str, values: list[float]) -> pd.DataFrame:
    n = len(values)
    return pd.DataFrame({"layer": ["a"] * n, "tensor": ["weight"] * n, "observer": MINMAX_FAMILY[:n], metric: values})


def _color_of_cell(heat, column: int) -> str:
    """The colorscale's color at the cell's place between the smallest and largest ``z``."""
    z = np.asarray(heat.z, dtype=float)[0]
    place = (z[column] - z.min()) / (z.max() - z.min())
    return next(color for position, color in heat.colorscale if position == place)


@pytest.mark.parametrize(("metric", "best"), [("mse", "minmax"), ("sqnr_db", "moving_average_minmax")])
def test_metric_heatmap_paints_the_best_cell_bright_by_the_one_direction_rule(metric, best, monkeypatch):
    frame = _one_row(metric, [1.0, 2.0, 3.0])  # mse: lowest is best; sqnr_db: highest is best
    assert frame["observer"][results.best_mask(frame, metric)].tolist() == [best]
    heat = plots.metric_heatmap(frame, metric).data[0]
    bright = heat.colorscale[-1][1] if results.higher_is_better(metric) else heat.colorscale[0][1]
    assert _color_of_cell(heat, MINMAX_FAMILY.index(best)) == bright == "#fde725"
    # the figure asks lab.results, not a table of its own: flipping the rule flips the colors
    flipped = results.higher_is_better
    monkeypatch.setattr(results, "higher_is_better", lambda m: not flipped(m))
    heat = plots.metric_heatmap(frame, metric).data[0]
    assert _color_of_cell(heat, MINMAX_FAMILY.index(best)) != "#fde725"


def test_an_unknown_metric_is_an_error_naming_the_known_ones_not_higher_is_better():
    with pytest.raises(ValueError, match=r"unknown metric 'nonsense'.*mse.*sqnr_db.*model:kl"):
        results.higher_is_better("nonsense")
    with pytest.raises(ValueError, match=r"unknown metric 'nonsense'.*sqnr_db"):
        plots.metric_heatmap(_one_row("nonsense", [1.0, 2.0]), "nonsense")
    metrics = ("mse", "sqnr_db", "model:kl", "model:cosine")
    assert [results.higher_is_better(m) for m in metrics] == [False, True, False, True]


def test_error_histogram_counts_every_element_per_observer():
    spec = ob.QuantSpec(dtype="int4")
    entry = _entry("a", _weight(), spec)
    fig = plots.error_histogram(entry)
    assert [t.name for t in fig.data] == MINMAX_FAMILY
    for trace in fig.data:
        assert trace.y.sum() == entry.data.numel()
        assert trace.line.color == plots.observer_color(trace.name)
    err = plots.quantization_error(entry, entry.results[0])
    x_hat = ob.fake_quantize(entry.data, entry.results[0].qparams, spec)
    torch.testing.assert_close(err, entry.data - x_hat)


def test_layer_output_bars_one_panel_per_mode():
    rows = pd.DataFrame(
        {
            "layer": ["l0"] * 4,
            "observer": ["minmax", "mse_x", "minmax", "mse_x"],
            "quantized": ["weight only", "weight only", "both", "both"],
            "sqnr_db": [30.0, 31.0, 20.0, 22.0],
        }
    )
    fig = plots.layer_output_bars(rows)
    assert [a.text for a in fig.layout.annotations] == ["weight only", "both"]
    assert [list(t.y) for t in fig.data] == [[30.0], [31.0], [20.0], [22.0]]


class _FakeModel:
    name = "fake"
    source = "fake"
    dtype = torch.float32

    def __init__(self) -> None:
        self.w = {"l0": _weight(seed=3), "l1": _weight(seed=4)}

    def layers(self):
        from sample_models import LayerInfo

        return [LayerInfo(n, "Linear", tuple(w.shape), w.numel()) for n, w in self.w.items()]

    def weight(self, name: str) -> torch.Tensor:
        return self.w[name]


def test_plots_take_pipeline_analysis_directly():
    analysis = analyse(_FakeModel(), ["l0", "l1"], _analysis([]).config, cache=ResultCache())
    entry = analysis.entry("l1", "weight")
    fig = plots.range_histogram(entry.data, entry.results, entry.spec)
    assert set(_lines(fig)) == set(MINMAX_FAMILY)
    assert plots.qparam_heatmaps(entry.results).data


def test_scale_bars_one_bar_per_observer_with_its_scale():
    w = _weight()
    results = _results(w, ob.QuantSpec())
    fig = plots.scale_bars(results)
    assert list(fig.data[0].x) == MINMAX_FAMILY
    assert list(fig.data[0].y) == pytest.approx([float(r.qparams.scale) for r in results])
    assert list(fig.data[0].marker.color) == [plots.observer_color(n) for n in MINMAX_FAMILY]
