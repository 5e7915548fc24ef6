"""Dynamic (run-time) quantization: observers.dynamic against naive per-token loops, its error and
error paths; lab.results.dynamic's summary table and lab.results.plots' dynamic scale figure checked on their data."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import observers as ob
from lab.analyse.analysis import TensorAnalysis
from lab.results import dynamic, plots

FP32_EPS = float(torch.finfo(torch.float32).eps)
INT_DTYPES = ["int2", "int3", "int4", "int8", "uint4", "uint8"]


def _acts(*shape: int, seed: int = 0) -> torch.Tensor:
    """Activations with a few large tokens and one outlier channel, so scales differ per token."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g)
    x = x * torch.exp(torch.randn(*shape[:-1], 1, generator=g))
    x[..., 3] *= 20.0
    return x


def _entry(x: torch.Tensor, spec: ob.QuantSpec, names: list[str], tensor: str = "input") -> TensorAnalysis:
    return TensorAnalysis("layer", tensor, spec, x, ob.run_suite(x, spec, names=names, kind="activation"))


# ---------------------------------------------------------------- observers.dynamic vs naive loops


def test_int8_token_equals_a_per_token_loop():
    spec = ob.QuantSpec(dtype="int8", strategy="token", dynamic=True)
    x = _acts(3, 7, 40)
    qp = ob.dynamic_qparams(x, spec)
    rows = x.reshape(-1, 40)
    assert qp.scale.shape == (21, 1) and qp.kind == "weight"
    for t in range(rows.shape[0]):
        amax = rows[t].abs().max()
        expected = torch.clamp(amax / 127.5, min=FP32_EPS)
        assert float(qp.scale[t, 0]) == pytest.approx(float(expected), rel=1e-6)
        assert int(qp.zero_point[t, 0]) == 0
        assert float(qp.min_val[t, 0]) == float(rows[t].min()) and float(qp.max_val[t, 0]) == float(rows[t].max())


def test_int4_asymmetric_group_with_ragged_last_group_equals_a_loop():
    spec = ob.QuantSpec(dtype="int4", symmetric=False, strategy="group", group_size=32, dynamic=True)
    x = _acts(11, 70) + 0.7
    qp = ob.dynamic_qparams(x, spec)
    assert qp.scale.shape == (11, 3) and qp.zero_point.shape == (11, 3)
    for t in range(11):
        for g, start in enumerate(range(0, 70, 32)):
            part = x[t, start : start + 32]
            assert part.numel() == (6 if g == 2 else 32)
            lo, hi = part.min().clamp(max=0.0), part.max().clamp(min=0.0)
            scale = ((hi - lo) / 15.0).clamp(min=FP32_EPS)
            zero_point = int((-8 - torch.round(lo / scale)).clamp(-8, 7))
            assert float(qp.scale[t, g]) == pytest.approx(float(scale), rel=1e-6)
            assert int(qp.zero_point[t, g]) == zero_point


def test_mxfp4_equals_a_per_token_block_loop():
    spec = ob.QuantSpec(dtype="mxfp4", dynamic=True)
    x = _acts(5, 80)
    x[2, 32:64] = 0.0  # an all-zero block takes the smallest exponent
    qp = ob.dynamic_qparams(x, spec)
    assert qp.scale.shape == (5, 3)
    emax = spec.format.emax
    for t in range(5):
        for g, start in enumerate(range(0, 80, 32)):
            amax = float(x[t, start : start + 32].abs().max())
            exponent = -127 if amax == 0 else math.frexp(amax)[1] - 1 - emax
            exponent = max(-127, min(exponent, 127 - emax))
            assert float(qp.scale[t, g]) == 2.0**exponent
            assert int(qp.extras["scale_exponent"][t, g]) == exponent + 127


def test_nvfp4_block_scales_per_token_and_one_global_scale_per_call():
    spec = ob.QuantSpec(dtype="nvfp4", dynamic=True)
    x = _acts(4, 48)
    qp = ob.dynamic_qparams(x, spec)
    assert qp.scale.shape == (4, 3) and qp.global_scale.shape == (1,)
    global_scale = 448.0 * 6.0 / float(x.abs().max())
    assert float(qp.global_scale) == pytest.approx(global_scale, rel=1e-6)
    for t in range(4):
        for g in range(3):
            raw = torch.tensor(float(x[t, 16 * g : 16 * g + 16].abs().max()) / 6.0 * float(qp.global_scale))
            assert float(qp.scale[t, g]) == float(raw.clamp(2.0**-9, 448.0).to(torch.float8_e4m3fn).float())


def test_token_and_tensor_equal_the_static_min_max_of_the_same_call():
    x = _acts(2, 9, 24)
    for strategy in ("token", "tensor"):
        spec = ob.QuantSpec(dtype="int8", symmetric=False, strategy=strategy, dynamic=True)
        observer = ob.create("memoryless_minmax", spec, kind="activation")
        observer.observe(x)
        static = observer.qparams()
        qp = ob.dynamic_qparams(x, spec)
        assert torch.equal(qp.scale, static.scale) and torch.equal(qp.zero_point, static.zero_point)


@pytest.mark.parametrize(
    ("spec", "shape"),
    [
        (ob.QuantSpec(dtype="int8", strategy="token"), (12, 1)),
        (ob.QuantSpec(dtype="int8", strategy="tensor"), (1,)),
        (ob.QuantSpec(dtype="int4", strategy="group", group_size=7), (12, 10)),
        (ob.QuantSpec(dtype="mxfp8_e4m3"), (12, 3)),
        (ob.QuantSpec(dtype="nvfp4"), (12, 5)),
        (ob.QuantSpec(dtype="bfp16"), (12, 9)),
        (ob.QuantSpec(dtype="fp8_e4m3", strategy="token"), (12, 1)),
    ],
)
def test_shapes_and_fake_quantize_keeps_shape_and_dtype(spec, shape):
    x = _acts(3, 4, 66).to(torch.bfloat16)
    qp = ob.dynamic_qparams(x, spec)
    assert tuple(qp.scale.shape) == shape and qp.scale.dtype == torch.float32
    assert torch.isfinite(qp.scale).all() and (qp.scale > 0).all()
    x_hat = ob.dynamic_fake_quantize(x, spec)
    assert x_hat.shape == x.shape and x_hat.dtype == x.dtype
    assert torch.equal(x_hat.reshape(-1, 66), ob.fake_quantize(x.reshape(-1, 66), qp, ob.dynamic_view_spec(spec)))


@st.composite
def int_cases(draw):
    tokens, hidden = draw(st.integers(1, 9)), draw(st.integers(1, 50))
    strategy = draw(st.sampled_from(["token", "group", "tensor"]))
    spec = ob.QuantSpec(
        draw(st.sampled_from(INT_DTYPES)),
        symmetric=draw(st.booleans()),
        strategy=strategy,
        group_size=draw(st.integers(1, 20)) if strategy == "group" else None,
        dynamic=True,
    )
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    magnitude = draw(st.sampled_from([1e-4, 1.0, 300.0]))
    offset = draw(st.sampled_from([0.0, 0.8, -2.0]))
    return (torch.randn(tokens, hidden, generator=g) + offset) * magnitude, spec


def _step_per_element(qp: ob.QParams, spec: ob.QuantSpec, hidden: int) -> torch.Tensor:
    """The run-time step of every element of a ``(tokens, hidden)`` activation, by plain indexing."""
    scale = qp.scale
    if spec.strategy == "group":
        columns = torch.arange(hidden) // spec.group_size
        return scale[:, columns]
    return scale.reshape(-1, 1)


@given(int_cases())
@settings(max_examples=60, deadline=None)
def test_dynamic_integer_error_is_within_half_a_step(case):
    x, spec = case
    qp = ob.dynamic_qparams(x, spec)
    x_hat = ob.dynamic_fake_quantize(x, spec)
    step = _step_per_element(qp, spec, x.shape[1])
    assert ((x - x_hat).abs() <= 0.5 * step * (1 + 1e-5) + 4 * FP32_EPS * x.abs()).all()
    assert ob.dynamic_error_metrics(x, spec)[1]["rmse_over_scale"] <= 0.5 * (1 + 1e-4)


def test_dynamic_error_beats_one_static_range_on_token_outliers():
    x = _acts(64, 96)
    spec = ob.QuantSpec(dtype="int8", strategy="tensor")
    static = ob.run_one("minmax", x, spec, kind="activation").metrics["sqnr_db"]
    token_spec = ob.QuantSpec(dtype="int8", strategy="token", dynamic=True)
    assert ob.dynamic_error_metrics(x, token_spec)[1]["sqnr_db"] > static + 3.0


@pytest.mark.parametrize(
    ("x", "spec", "message"),
    [
        (torch.ones(4, 8), ob.QuantSpec(strategy="channel"), "no run-time"),
        (torch.ones(4, 8), ob.QuantSpec(strategy="block", block_size=(2, 2)), "no run-time"),
        (torch.ones(4, 8), ob.QuantSpec(dtype="bf16"), "plain cast"),
        (torch.zeros(0, 8), ob.QuantSpec(strategy="token"), "saw no tokens"),
        (torch.zeros(2, 0, 8), ob.QuantSpec(), "saw no tokens"),
        (torch.zeros(4, 0), ob.QuantSpec(), "empty hidden"),
        (torch.tensor(1.0), ob.QuantSpec(), "0-d"),
        (torch.ones(4, 8, dtype=torch.int32), ob.QuantSpec(), "floating-point"),
        ([[1.0, 2.0]], ob.QuantSpec(), "torch.Tensor"),
    ],
)
def test_bad_input_raises_a_clear_value_error(x, spec, message):
    for fn in (ob.dynamic_qparams, ob.dynamic_fake_quantize, ob.dynamic_error_metrics):
        with pytest.raises(ValueError, match=message):
            fn(x, spec)


def test_non_finite_values_are_counted_not_turned_into_nan_scales():
    x = _acts(6, 16)
    x[1, 2], x[4, 0], x[5, 5] = float("nan"), float("inf"), -float("inf")
    with pytest.raises(ValueError, match="3 non-finite value"):
        ob.dynamic_qparams(x, ob.QuantSpec(strategy="token"))
    with pytest.raises(ValueError, match="3 non-finite value"):
        ob.dynamic_fake_quantize(x, ob.QuantSpec(dtype="mxfp4"))


def test_bad_spec_type_is_a_value_error():
    with pytest.raises(ValueError, match="QuantSpec"):
        ob.dynamic_qparams(torch.ones(2, 4), {"dtype": "int8"})


def test_view_spec_maps_token_to_output_channels_only():
    token = ob.QuantSpec(strategy="token", dynamic=True)
    assert ob.dynamic_view_spec(token) == token.replace(strategy="channel", ch_axis=0)
    group = ob.QuantSpec(dtype="int4", strategy="group", group_size=16)
    assert ob.dynamic_view_spec(group) is group


# ---------------------------------------------------------------- lab.results.dynamic


def test_dynamic_applies_only_to_dynamic_activations_that_saw_tokens():
    spec = ob.QuantSpec(strategy="token", dynamic=True)
    x = _acts(8, 16)
    assert dynamic.dynamic_applies(TensorAnalysis("l", "input", spec, x, []))
    assert dynamic.dynamic_applies(TensorAnalysis("l", "output", spec, x, []))
    assert not dynamic.dynamic_applies(TensorAnalysis("l", "weight", spec, x, []))
    assert not dynamic.dynamic_applies(TensorAnalysis("l", "input", spec.replace(dynamic=False), x, []))
    assert not dynamic.dynamic_applies(TensorAnalysis("l", "input", spec, torch.zeros(0, 16), []))


def test_summary_rows_percentiles_and_sqnr_for_group_scales():
    spec = ob.QuantSpec(dtype="int4", strategy="group", group_size=16, dynamic=True)
    x = _acts(40, 64)
    entry = _entry(x, spec, ["memoryless_minmax", "mse_grid", "histogram"])
    frame = dynamic.dynamic_summary(entry)
    assert list(frame["scales from"]) == [dynamic.DYNAMIC_LABEL, "memoryless_minmax", "mse_grid"]  # histogram: error
    runtime = ob.dynamic_qparams(x, spec).scale
    first = frame.iloc[0]
    assert first["scales"] == 40 * 4
    for p in (1, 50, 99):
        assert first[f"scale p{p}"] == pytest.approx(float(np.percentile(runtime.numpy(), p)), rel=1e-6)
    assert first["max/min"] == pytest.approx(float(runtime.max() / runtime.min()), rel=1e-6)
    assert first["p50 / run-time p50"] == 1.0 and pd.isna(first["run-time scales above it %"])
    expected_sqnr = ob.compare_tensors(x, ob.dynamic_fake_quantize(x, spec))["sqnr_db"]
    assert first["SQNR dB"] == pytest.approx(expected_sqnr)
    for _, row in frame.iloc[1:].iterrows():
        result = entry.result(row["scales from"])
        static = result.qparams.scale
        above = sum(float(runtime[t, g]) > float(static[g]) for t in range(40) for g in range(4))
        assert row["scales"] == 4
        assert row["run-time scales above it %"] == pytest.approx(100 * above / 160)
        assert row["SQNR dB"] == result.metrics["sqnr_db"]
        ratio = np.median(static.double().numpy()) / np.median(runtime.double().numpy())
        assert row["p50 / run-time p50"] == pytest.approx(ratio, rel=1e-9)
    minmax = frame.set_index("scales from").loc["memoryless_minmax"]
    assert minmax["run-time scales above it %"] == 0.0, "the calibration max covers every token's max"
    assert minmax["p50 / run-time p50"] > 1.0
    assert first["SQNR dB"] > minmax["SQNR dB"]


def test_summary_uses_effective_scales_for_nvfp4_and_tokens_line_up():
    x = _acts(10, 32)
    nvfp4 = _entry(x, ob.QuantSpec(dtype="nvfp4", dynamic=True), ["minmax"])
    frame = dynamic.dynamic_summary(nvfp4)
    runtime = ob.dynamic_qparams(x, nvfp4.spec).effective_scale
    assert frame.iloc[0]["scale p50"] == pytest.approx(float(np.percentile(runtime.numpy(), 50)), rel=1e-6)
    token = _entry(x, ob.QuantSpec(strategy="token", dynamic=True), ["memoryless_minmax"])
    row = dynamic.dynamic_summary(token).iloc[1]
    assert row["run-time scales above it %"] == 0.0 and row["p50 / run-time p50"] == 1.0
    assert row["scales"] == 10


def test_static_on_runtime_grid_broadcasts_or_says_none():
    runtime = torch.ones(6, 4)
    assert dynamic.static_on_runtime_grid(torch.ones(4), runtime).shape == (1, 4)
    assert dynamic.static_on_runtime_grid(torch.ones(1), runtime).shape == (1, 1)
    assert dynamic.static_on_runtime_grid(torch.ones(6, 1), torch.ones(6, 1)).shape == (6, 1)
    assert dynamic.static_on_runtime_grid(torch.ones(5, 1), torch.ones(6, 1)) is None


# ---------------------------------------------------------------- lab.results.plots.dynamic_scale_figure


def _hist(fig: go.Figure) -> go.Scatter:
    """The run-time trace of the top panel (histogram, or a line for one per-tensor scale)."""
    return next(t for t in fig.data if t.legendgroup == dynamic.DYNAMIC_LABEL and isinstance(t, go.Scatter))


def test_figure_per_tensor_scales_are_vertical_lines():
    spec = ob.QuantSpec(dtype="int8", strategy="tensor", dynamic=True)
    x = _acts(30, 64)
    names = ["minmax", "percentile", "mse"]
    entry = _entry(x, spec, names)
    fig = plots.dynamic_scale_figure(entry, entry.results)
    assert len(fig.data) == 1 + len(names)
    runtime = float(ob.dynamic_qparams(x, spec).scale)
    run_line = _hist(fig)
    assert list(run_line.x) == pytest.approx([runtime] * 2), "per tensor: one run-time scale, a dashed line"
    assert run_line.line.dash == "dash" and run_line.mode == "lines"
    for r in entry.results:
        line = next(t for t in fig.data if t.legendgroup == r.name)
        assert list(line.x) == pytest.approx([float(r.qparams.scale)] * 2)
        assert line.line.color == plots.observer_color(r.name)
    assert fig.layout.xaxis.type == "log"
    low, high = fig.layout.xaxis.range
    scales = [runtime] + [float(r.qparams.scale) for r in entry.results]
    assert 10**low < min(scales) and max(scales) < 10**high


def test_figure_group_scales_histogram_and_boxes():
    spec = ob.QuantSpec(dtype="int4", strategy="group", group_size=16, dynamic=True)
    x = _acts(50, 64)
    entry = _entry(x, spec, ["memoryless_minmax", "mse_grid", "histogram"])
    order = ["mse_grid", "memoryless_minmax"]
    fig = plots.dynamic_scale_figure(entry, entry.results, order=order)
    boxes = [t for t in fig.data if isinstance(t, go.Box)]
    assert len(fig.data) == 1 + 1 + 2 and len(boxes) == 3
    runtime = ob.dynamic_qparams(x, spec).scale.numpy().ravel()
    hist = _hist(fig)
    assert sum(hist.y[:-1]) == runtime.size == 50 * 4
    assert hist.x[0] <= runtime.min() and runtime.max() <= hist.x[-1]
    counts = np.histogram(runtime, bins=np.asarray(hist.x))[0]
    assert list(counts) == list(hist.y[:-1]), "step heights are the counts between consecutive edges"
    for box in boxes:
        name = box.y[0]
        values = runtime if name == dynamic.DYNAMIC_LABEL else entry.result(name).qparams.scale.numpy()
        assert box.lowerfence[0] == pytest.approx(values.min()) and box.upperfence[0] == pytest.approx(values.max())
        assert box.median[0] == pytest.approx(np.median(values))
        if name != dynamic.DYNAMIC_LABEL:
            assert box.marker.color == plots.observer_color(name, order)
    assert fig.layout.xaxis.type == "log" and fig.layout.xaxis2.type == "log"


def test_figure_without_observers_shows_the_run_time_scales_only():
    entry = _entry(_acts(8, 32), ob.QuantSpec(dtype="mxfp4", dynamic=True), ["minmax"])
    fig = plots.dynamic_scale_figure(entry, [])
    assert len(fig.data) == 1 and sum(_hist(fig).y[:-1]) == 8
