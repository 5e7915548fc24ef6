"""Honest plots, checked on the plotly figure objects (data and layout, no screenshots): range lines
where the format clips (``ob.representable_range``), readable bars and error bins, per-tensor scales
as bars, visible colour ranges for equal values, and margins that fit long layer names."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import pytest
import torch

import observers as ob
from lab.analyse.analysis import Analysis, TensorAnalysis
from lab.analyse.model_facts import ModelFacts
from lab.analyse.run_config import RunConfig
from lab.gptq.layer import GPTQRow
from lab.gptq.table import gptq_frame
from lab.results import plots
from lab.results.ranges import envelope
from lab.results.report import report_figures
from observers.suite import SuiteResult

MINMAX = ["minmax", "memoryless_minmax", "moving_average_minmax"]


def _weight(rows: int = 48, cols: int = 64, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))


def _qparams(scale: list[float], zero_point: list[int] | None = None, **extra) -> ob.QParams:
    s = torch.tensor(scale)
    zp = torch.zeros_like(s, dtype=torch.int32) if zero_point is None else torch.tensor(zero_point, dtype=torch.int32)
    return ob.QParams(s, zp, -s, s, **extra)


def _lines(fig: go.Figure) -> dict[str, list[float]]:
    positions: dict[str, list[float]] = {}
    for shape in fig.layout.shapes:
        positions.setdefault(shape.legendgroup, []).append(shape.x0)
    return positions


# ob.representable_range, hand-computed


def test_int8_symmetric_half_range_clips_at_minus_128_and_127_steps():
    spec = ob.QuantSpec(dtype="int8")
    qp = ob.calculate_qparams(torch.tensor([-1.0]), torch.tensor([2.0]), spec)
    s = 2 / 127.5  # half_range: amax / ((127 - -128) / 2)
    lo, hi = ob.representable_range(qp, spec)
    assert float(lo) == pytest.approx(-128 * s) and float(hi) == pytest.approx(127 * s)
    assert lo.shape == hi.shape == qp.scale.shape


def test_uint8_asymmetric_range_is_shifted_by_the_zero_point():
    spec = ob.QuantSpec(dtype="uint8", symmetric=False)
    qp = ob.calculate_qparams(torch.tensor([-1.0]), torch.tensor([3.0]), spec)
    s = 4 / 255
    assert int(qp.zero_point) == 64  # 0 - round(-1 / s) = round(63.75)
    lo, hi = ob.representable_range(qp, spec)
    assert float(lo) == pytest.approx(-64 * s) and float(hi) == pytest.approx((255 - 64) * s)


def test_per_channel_int4_range_has_the_qparam_shape():
    spec = ob.QuantSpec(dtype="int4", strategy="channel")
    lo, hi = ob.representable_range(_qparams([[0.5], [2.0]]), spec)
    torch.testing.assert_close(lo, torch.tensor([[-4.0], [-16.0]]))
    torch.testing.assert_close(hi, torch.tensor([[3.5], [14.0]]))


def test_fp8_e4m3_covers_448_scales():
    lo, hi = ob.representable_range(_qparams([0.5]), ob.QuantSpec(dtype="fp8_e4m3"))
    assert (float(lo), float(hi)) == (-224.0, 224.0)


def test_mx_blocks_cover_max_value_times_their_power_of_two():
    x = torch.zeros(1, 96)
    x[0, 0], x[0, 33], x[0, 70] = 5.0, -0.7, 20.0  # block exponents floor(log2 amax) - emax: 0, -3, 2
    fp4 = ob.QuantSpec(dtype="mxfp4")
    lo, hi = ob.representable_range(ob.run_one("minmax", x, fp4).qparams, fp4)
    torch.testing.assert_close(hi, torch.tensor([[6.0, 0.75, 24.0]]))
    torch.testing.assert_close(lo, -hi)
    int8 = ob.QuantSpec(dtype="mxint8")  # emax 0: exponents 2, -1, 4; codes ±127 of step 2^(e - 6)
    _, hi = ob.representable_range(ob.run_one("minmax", x, int8).qparams, int8)
    torch.testing.assert_close(hi, torch.tensor([[127 / 16, 127 / 128, 127 / 4]]))


def test_nvfp4_divides_by_the_global_scale():
    qp = _qparams([[3.0, 0.5]], global_scale=torch.tensor([2.0]))
    lo, hi = ob.representable_range(qp, ob.QuantSpec(dtype="nvfp4"))
    torch.testing.assert_close(hi, torch.tensor([[9.0, 1.5]]))
    torch.testing.assert_close(lo, -hi)


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_plain_casts_clip_at_their_largest_finite_value(dtype):
    limit = torch.finfo(torch.float16 if dtype == "fp16" else torch.bfloat16).max
    lo, hi = ob.representable_range(_qparams([1.0]), ob.QuantSpec(dtype=dtype))
    assert (float(lo), float(hi)) == (-limit, limit)


# range lines and the range table's envelope


def test_envelope_is_the_widest_clip_point_over_groups():
    spec = ob.QuantSpec(dtype="int8", strategy="channel")
    result = SuiteResult("x", _qparams([[0.01], [0.03]]), {}, 0.0)
    assert envelope(result, spec) == pytest.approx((-128 * 0.03, 127 * 0.03))


def test_range_lines_of_a_symmetric_format_are_its_clip_points_not_its_chosen_range():
    w = _weight()
    spec = ob.QuantSpec(dtype="int8")
    results = ob.run_suite(w, spec, names=["minmax", "mse_grid"])
    fig = plots.range_histogram(w, results, spec)
    for r in results:
        s = float(r.qparams.scale)
        assert _lines(fig)[r.name] == pytest.approx([-128 * s, 127 * s])
        assert _lines(fig)[r.name][0] != pytest.approx(float(r.qparams.min_val))
        label = next(shape.name for shape in fig.layout.shapes if shape.legendgroup == r.name and shape.showlegend)
        assert f"[{-128 * s:.4g}, {127 * s:.4g}]" in label


def test_minilm_query_mse_grid_line_is_at_the_clip_point():
    """The issue's case: mse_grid chose max 0.5597 on MiniLM's first query weight, but int8
    symmetric clips at 127·s = 0.662."""
    safetensors = pytest.importorskip("safetensors")
    from sample_models.builtin import minilm_dir

    with safetensors.safe_open(str(minilm_dir() / "model.safetensors"), "pt") as f:
        w = f.get_tensor("encoder.layer.0.attention.self.query.weight").float()
    spec = ob.QuantSpec(dtype="int8")
    result = ob.run_one("mse_grid", w, spec)
    lo, hi = _lines(plots.range_histogram(w, [result], spec))["mse_grid"]
    assert hi == pytest.approx(127 * float(result.qparams.scale)) and hi == pytest.approx(0.662, abs=5e-4)
    assert float(result.qparams.max_val) == pytest.approx(0.5597, abs=5e-4)
    assert lo == pytest.approx(-128 * float(result.qparams.scale))


def test_a_cast_range_far_beyond_the_data_stays_off_view():
    w = _weight()
    spec = ob.QuantSpec(dtype="fp16")
    fig = plots.range_histogram(w, [ob.run_one("placeholder", w, spec)], spec, log_count=False)
    assert _lines(fig)["placeholder"] == [-65504.0, 65504.0]
    lo, hi = fig.layout.xaxis.range
    assert lo >= 1.1 * float(w.min()) and hi <= 1.1 * float(w.max())
    assert np.count_nonzero(fig.data[0].y) >= 100


# SQNR bars


def test_metric_bars_grow_with_the_bars_and_keep_the_legend_off_the_plot():
    rows = [
        {"layer": f"model.layers.{i}.mlp.down_proj", "tensor": "weight", "observer": name, "sqnr_db": 30.0 + i}
        for i in range(20)
        for name in MINMAX
    ]
    fig = plots.metric_bars(pd.DataFrame(rows))
    layout = fig.layout
    plot_px = layout.height - layout.margin.t - layout.margin.b
    assert plot_px / (20 * len(MINMAX)) >= 12, "every bar gets at least 12 px"
    assert layout.legend.x >= 1, "the legend sits right of the plot, not over it"
    assert layout.yaxis.automargin is True


# error histogram


def _entry(w: torch.Tensor, spec: ob.QuantSpec, results: list[SuiteResult], layer: str = "l") -> TensorAnalysis:
    return TensorAnalysis(layer, "weight", spec, w, results)


def test_error_histogram_bins_a_typical_error_despite_one_huge_outlier():
    w = _weight(64, 64)
    w[3, 5] = 1000.0
    spec = ob.QuantSpec(dtype="int8")
    clippers = [SuiteResult(f"clip{a}", _qparams([a / 127]), {}, 0.0) for a in (4.0, 4.5)]
    entry = _entry(w, spec, clippers)
    fig = plots.error_histogram(entry)
    for trace in fig.data:
        assert np.count_nonzero(trace.y) >= 40, f"{trace.name}: {np.count_nonzero(trace.y)} non-empty bins"
    bound = fig.layout.xaxis.range[1]
    assert bound < 1.0, "the outlier's error (about 996) does not set the bins"
    for trace, r in zip(fig.data, clippers, strict=True):
        beyond = int((plots.quantization_error(entry, r).abs() > bound).sum())
        assert beyond >= 1 and trace.y.sum() + beyond == w.numel()
        assert trace.name == f"{r.name} · {beyond} beyond ±{bound:.3g}"


# per-tensor scales


def test_per_tensor_scales_are_bars_not_one_cell_heatmaps():
    w = _weight()
    per_tensor = ob.run_suite(w, ob.QuantSpec(), names=MINMAX)
    per_channel = ob.run_suite(w, ob.QuantSpec(strategy="channel"), names=MINMAX)
    fig = plots.qparam_heatmaps(per_tensor)
    assert [type(t) for t in fig.data] == [go.Bar]
    assert list(fig.data[0].x) == MINMAX
    assert list(fig.data[0].y) == pytest.approx([float(r.qparams.scale) for r in per_tensor])
    assert plots.scale_figure_kind(per_tensor) == "bars"
    assert plots.scale_figure_kind(per_channel) == "heatmap"


def test_scale_distribution_of_a_few_scales_is_one_marker_per_scale():
    w = _weight(4, 64)
    for spec, count in ((ob.QuantSpec(), 1), (ob.QuantSpec(strategy="channel"), 4)):
        fig = plots.scale_distribution(ob.run_suite(w, spec, names=MINMAX))
        assert all(isinstance(t, go.Scatter) and t.mode == "markers" for t in fig.data)
        assert [len(t.x) for t in fig.data] == [count] * len(MINMAX)
        assert [t.y[0] for t in fig.data] == MINMAX
    many = plots.scale_distribution(ob.run_suite(_weight(), ob.QuantSpec(strategy="channel"), names=MINMAX))
    assert all(isinstance(t, go.Histogram) for t in many.data)


# equal values


def test_equal_scales_get_a_visible_colour_range_and_say_so():
    row = torch.linspace(-1.0, 2.0, 64)
    w = torch.stack([row[torch.randperm(64, generator=torch.Generator().manual_seed(i))] for i in range(48)])
    results = ob.run_suite(w, ob.QuantSpec(strategy="channel"), names=MINMAX)
    value = float(results[0].qparams.scale[0])
    fig = plots.qparam_heatmaps(results)
    cmin, cmax = fig.layout.coloraxis.cmin, fig.layout.coloraxis.cmax
    assert cmin < value < cmax and cmax - cmin >= 0.05 * value
    assert f"all {48 * len(MINMAX)} scales equal {value:.4g}" in fig.layout.title.text
    zero_points = plots.qparam_heatmaps(results, "zero_point").layout.coloraxis
    assert (zero_points.cmin, zero_points.cmax) == (-1.0, 1.0)


def test_equal_scale_ratio_is_a_visible_colour_range_and_says_so():
    w = _weight()
    a, b = ob.run_suite(w, ob.QuantSpec(strategy="channel"), names=MINMAX[:2])
    fig = plots.scale_ratio_heatmap(a, b)
    assert (fig.data[0].zmin, fig.data[0].zmax) == (-1.0, 1.0)
    assert "all 48 log2 ratios equal 0" in fig.layout.title.text


# HTML report


def test_report_heatmap_and_bars_make_room_for_long_layer_names():
    spec = ob.QuantSpec(dtype="int4")
    long = "model.language_model.layers.{}.self_attn.q_proj_with_a_very_long_name"
    entries = [
        _entry(w, spec, ob.run_suite(w, spec, names=MINMAX), long.format(i))
        for i, w in enumerate(_weight(16, 32, seed) for seed in range(12))
    ]
    config = RunConfig(specs={"weight": spec}, observers=tuple(MINMAX))
    figures = report_figures(Analysis(ModelFacts({"name": "t"}), config, entries), "sqnr_db")
    heatmap, bars = figures[:2]
    for fig in (heatmap, bars):
        assert fig.layout.yaxis.automargin is True, "the left margin grows to the longest layer name"
        assert fig.layout.height >= 24 * len(entries) + 60
    assert heatmap.layout.xaxis.automargin is True
    assert len(figures) == 2 + len(entries)
    assert math.isclose(max(_lines(figures[2])["minmax"]), envelope(entries[0].results[0], spec)[1])


def test_a_result_computed_under_another_spec_draws_its_own_clip_lines():
    """``--as torch.ao``: its activations use reduce_range (-64..63); drawn under the run's int8 spec
    its lines would sit twice as far out as where it clips."""
    from lab.results.ranges import range_table

    x = torch.linspace(-4.0, 4.0, 1001).reshape(-1, 1)
    run_spec, halved = ob.QuantSpec(dtype="int8"), ob.QuantSpec(dtype="int8", reduce_range=True)
    result = ob.run_one("minmax", x, halved, "activation")
    fig = plots.range_histogram(x, [result], run_spec, specs={result.name: halved})
    lines = sorted(shape.x0 for shape in fig.layout.shapes)
    step = 4.0 / 63.5  # amax over half of the 127 steps of -64..63
    assert lines == pytest.approx([-64 * step, 63 * step], rel=1e-5)
    wrong = sorted(shape.x0 for shape in plots.range_histogram(x, [result], run_spec).layout.shapes)
    assert wrong == pytest.approx([-128 * step, 127 * step], rel=1e-5)  # what the run's spec alone would draw
    table = range_table([result], run_spec, {result.name: halved})
    assert table["clips above"].iloc[0] == pytest.approx(lines[1])


def test_a_long_legend_pushes_the_plot_down_instead_of_into_the_title():
    x = torch.randn(500, 8)
    spec = ob.QuantSpec(dtype="int8")
    few = [ob.run_one("minmax", x, spec, "activation")]
    many = [ob.run_one(name, x, spec, "activation") for name in ("minmax", "mse_grid", "percentile", "mse")] * 4
    for i, result in enumerate(many):
        result.name = f"{result.name}#{i}"
    top = {n: plots.range_histogram(x, r, spec).layout.margin.t for n, r in (("few", few), ("many", many))}
    assert top["many"] > top["few"] >= 120


# GPTQ beside round-to-nearest (issue 33)


def _gptq_analysis(rows_by_layer: dict[str, list]) -> Analysis:
    spec = ob.QuantSpec(dtype="int4")
    config = RunConfig(specs={"weight": spec}, observers=("minmax", "mse_grid", "percentile"), gptq=ob.GPTQSpec())
    entries = []
    for layer, rows in rows_by_layer.items():
        entry = TensorAnalysis(layer, "weight", spec, _weight(8, 16), [])
        entry.gptq = [GPTQRow(*row) if isinstance(row, tuple) else row for row in rows]
        entries.append(entry)
    return Analysis(ModelFacts({"name": "t"}), config, entries)


GPTQ_TURNS = [  # observer, rtn_error, gptq_error, rtn_clipped, gptq_clipped
    ("minmax", 0.30, 0.040, 0.0, 0.001),
    ("mse_grid", 0.10, 0.060, 0.02, 0.09),
    ("percentile", 0.20, 0.050, 0.01, 0.03),
]


def test_gptq_bars_carry_the_frames_errors_and_ranks_best_by_rtn_first():
    failed = GPTQRow("lwp", error="no qparams")
    frame = gptq_frame(_gptq_analysis({"l0": [*GPTQ_TURNS, failed]}))
    fig = plots.gptq_bars(frame)
    assert [t.name for t in fig.data] == ["round-to-nearest", "GPTQ"]
    assert fig.layout.barmode == "group"
    ordered = frame.dropna(subset=["rtn_error"]).sort_values("rtn_error")
    for trace, side in zip(fig.data, ("rtn", "gptq"), strict=True):
        assert list(trace.x) == list(ordered["observer"]) == ["mse_grid", "percentile", "minmax"]
        assert list(trace.y) == list(ordered[f"{side}_error"])
        assert list(trace.text) == [f"#{r}" for r in ordered[f"{side}_rank"]]
        assert [c[0] for c in trace.customdata] == list(ordered[f"{side}_clipped"])
    assert list(fig.data[1].text) == ["#3", "#2", "#1"]  # the turnover, read off the bars
    assert "lwp" not in fig.data[0].x  # no figures to draw
    assert [t.yaxis for t in fig.data] == ["y", "y2"] and fig.layout.yaxis2.overlaying == "y"
    assert fig.layout.yaxis.type == fig.layout.yaxis2.type == "linear"


def test_gptq_bars_go_log_when_errors_span_orders_of_magnitude_and_take_one_layer():
    wide = [("minmax", 1e-1, 1e-4, 0.0, 0.0), ("mse_grid", 2e-1, 5e-2, 0.0, 0.0)]
    frame = gptq_frame(_gptq_analysis({"l0": wide, "l1": wide}))
    fig = plots.gptq_bars(frame[frame["layer"] == "l0"])
    assert (fig.layout.yaxis.type, fig.layout.yaxis2.type) == ("linear", "log")  # each side its own axis
    with pytest.raises(ValueError, match="one layer"):
        plots.gptq_bars(frame)


def test_gptq_turnover_says_when_the_best_by_rtn_is_not_the_best_under_gptq():
    kept = [("minmax", 0.1, 0.01, 0.0, 0.0), ("mse_grid", 0.2, 0.02, 0.0, 0.0)]
    frame = gptq_frame(_gptq_analysis({"turns": GPTQ_TURNS, "keeps": kept}))
    turns = plots.gptq_turnover(frame[frame["layer"] == "turns"])
    assert "turns over" in turns
    assert "best by round-to-nearest error, mse_grid, is #3 under GPTQ" in turns
    assert "best under GPTQ is minmax, #3 by round-to-nearest" in turns
    keeps = plots.gptq_turnover(frame[frame["layer"] == "keeps"])
    assert "minmax" in keeps and "also the best under GPTQ" in keeps and "turns over" not in keeps
    assert plots.turned_over(frame) == ["turns"]
    assert "not the best under GPTQ in 1: turns" in plots.gptq_turnover_summary(frame)


def test_gptq_turnover_names_observers_tied_for_best_together():
    tied = [("minmax", 0.1, 0.03, 0.0, 0.0), ("memoryless_minmax", 0.1, 0.03, 0.0, 0.0), ("mse_grid", 0.2, 0.02, 0, 0)]
    kept = [("minmax", 0.1, 0.03, 0.0, 0.0), ("memoryless_minmax", 0.1, 0.02, 0.0, 0.0), ("mse_grid", 0.2, 0.04, 0, 0)]
    frame = gptq_frame(_gptq_analysis({"tied": tied, "kept": kept}))
    text = plots.gptq_turnover(frame[frame["layer"] == "tied"])
    assert "best by round-to-nearest error, memoryless_minmax (tied with minmax), is #2 under GPTQ" in text
    assert "the best under GPTQ is mse_grid, #3 by round-to-nearest" in text
    text = plots.gptq_turnover(frame[frame["layer"] == "kept"])
    assert text.startswith("kept: memoryless_minmax, the best by round-to-nearest error, is also the best under GPTQ")
    assert plots.turned_over(frame) == ["tied"]
