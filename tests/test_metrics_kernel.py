"""The native one-read error metrics of integer formats (observers/metrics_kernel.py): the eager
``error_metrics(x, fake_quantize(x, qp, spec))`` numbers on every layout it takes, for every
kernel variant and thread count, and the eager path itself wherever it does not take the layout."""

from __future__ import annotations

import functools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import observers as ob
from observers import kernels, metrics_kernel
from observers.metrics import METRIC_KEYS, _clip_bounds, error_metrics, quantization_metrics
from observers.quantize import fake_quantize

needs_kernel = pytest.mark.skipif(
    not kernels.status("quant_error").startswith("native"),
    reason=f"quant_error kernel not in use here ({kernels.status('quant_error')}): eager path only",
)
SUMMED = ("mse", "sqnr_db", "cosine", "rmse_over_scale")
"""Metrics made from sums, which the kernel adds in another order (a few ulps apart)."""
SELECTED = ("max_abs_error", "clip_ratio")
"""Metrics made from a maximum and a count: exactly the eager ones."""


def _qparams(x: torch.Tensor, spec: ob.QuantSpec, kind: str, observer: str = "memoryless_minmax") -> ob.QParams:
    created = ob.create(observer, spec, kind=kind)
    created.observe(x)
    return created.qparams()


def _eager(x: torch.Tensor, qp: ob.QParams, spec: ob.QuantSpec) -> dict:
    with kernels.disabled():
        return error_metrics(x, fake_quantize(x, qp, spec), qp, spec)


def _assert_same_metrics(native: dict, eager: dict) -> None:
    assert set(native) == set(eager) == set(METRIC_KEYS)
    for key in SUMMED:
        assert native[key] == pytest.approx(eager[key], rel=1e-5, abs=0.0), key
    for key in SELECTED:
        assert native[key] == eager[key], key


def _with_outliers() -> tuple[torch.Tensor, ob.QParams]:
    """An activation whose qparams come from its bulk, so its outliers clip."""
    g = torch.Generator().manual_seed(3)
    bulk = torch.randn(300, 384, generator=g)
    spec = ob.QuantSpec(dtype="int8", strategy="tensor")
    qp = _qparams(bulk, spec, "activation")
    x = bulk.clone()
    x[::7, ::11] = 40.0 * torch.randn(x[::7, ::11].shape, generator=g)
    return x, qp


def _cases() -> list[tuple[str, torch.Tensor, ob.QuantSpec, str, ob.QParams | None]]:
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(256, 1536, generator=g) * torch.logspace(-2, 1, 256, dtype=torch.float32).unsqueeze(1)
    activation = torch.randn(3, 100, 384, generator=g) + 0.3
    outliers, clipping_qparams = _with_outliers()
    int8_tensor = ob.QuantSpec(dtype="int8", strategy="tensor")
    return [
        ("int4 group 128 weight", weight, ob.QuantSpec(dtype="int4", strategy="group", group_size=128), "weight", None),
        ("int4 group 32 weight", weight, ob.QuantSpec(dtype="int4", strategy="group", group_size=32), "weight", None),
        ("int8 per-channel weight", weight, ob.QuantSpec(dtype="int8", strategy="channel"), "weight", None),
        ("int8 per-tensor weight", weight, int8_tensor, "weight", None),
        ("int8 per-tensor activation", activation, int8_tensor, "activation", None),
        (
            "uint8 asymmetric per-tensor activation",
            activation,
            ob.QuantSpec(dtype="uint8", strategy="tensor", symmetric=False),
            "activation",
            None,
        ),
        ("int8 per-token activation", activation, ob.QuantSpec(dtype="int8", strategy="token"), "activation", None),
        (
            "int4 asymmetric group 64 activation",
            activation,
            ob.QuantSpec(dtype="int4", strategy="group", group_size=64, symmetric=False),
            "activation",
            None,
        ),
        ("mxint8 weight", weight, ob.QuantSpec(dtype="mxint8"), "weight", None),
        ("activation with outliers that clip", outliers, int8_tensor, "activation", clipping_qparams),
        ("all-zero weight", torch.zeros(64, 256), int8_tensor, "weight", None),
    ]


CASES = _cases()


@pytest.fixture(params=[1, 2], ids=["1 thread", "2 threads"])
def threads(request, monkeypatch):
    """Run the kernel on this many threads, whatever the tensor's size."""
    monkeypatch.setattr(kernels, "threads_for", lambda elements: request.param)
    return request.param


def _variant(monkeypatch, isa: str) -> None:
    """Make ``quantization_metrics`` use kernel variant ``isa``."""
    monkeypatch.setattr(metrics_kernel, "quant_error_sums", functools.partial(metrics_kernel.quant_error_sums, isa=isa))


@needs_kernel
@pytest.mark.parametrize("isa", kernels.available_isas(metrics_kernel.NAME))
@pytest.mark.parametrize("name,x,spec,kind,qp", CASES, ids=[case[0] for case in CASES])
def test_native_metrics_equal_the_eager_ones(name, x, spec, kind, qp, isa, threads, monkeypatch):
    qp = qp or _qparams(x, spec, kind)
    assert metrics_kernel.quant_error_sums(x, qp, spec, _clip_bounds(spec)) is not None, "expected the native path"
    _variant(monkeypatch, isa)
    _assert_same_metrics(quantization_metrics(x, qp, spec), _eager(x, qp, spec))


@needs_kernel
def test_the_special_cases_keep_their_defined_values():
    outliers, qp = _with_outliers()
    assert quantization_metrics(outliers, qp, ob.QuantSpec(dtype="int8", strategy="tensor"))["clip_ratio"] > 0.005
    zeros = torch.zeros(64, 256)
    spec = ob.QuantSpec(dtype="int8", strategy="tensor")
    metrics = quantization_metrics(zeros, _qparams(zeros, spec, "weight"), spec)
    assert metrics["sqnr_db"] == math.inf and metrics["cosine"] == 1.0 and metrics["mse"] == 0.0


@needs_kernel
@pytest.mark.parametrize("isa", kernels.available_isas(metrics_kernel.NAME))
def test_elements_on_the_clip_edges_count_as_on_the_eager_path(isa, monkeypatch):
    """Shifted codes within a few ulps of ``qmax + 0.5 + 1e-3`` and ``qmin - 0.5 - 1e-3``: the
    bounds are compared in fp32 on both paths."""
    spec = ob.QuantSpec(dtype="uint8", strategy="tensor", symmetric=False)
    qp = ob.QParams(torch.tensor([0.1]), torch.tensor([3], dtype=torch.int32), torch.zeros(1), torch.ones(1))
    low, high = _clip_bounds(spec)
    steps = torch.arange(-64, 64, dtype=torch.float32) * 2e-5
    codes = torch.cat([(high - 3) + steps, (low - 3) + steps, torch.linspace(-10, 260, 128)])
    x = (codes * 0.1).reshape(3, 128)
    _variant(monkeypatch, isa)
    native = quantization_metrics(x, qp, spec)
    assert 0 < native["clip_ratio"] < 1
    _assert_same_metrics(native, _eager(x, qp, spec))


@needs_kernel
def test_a_nan_gives_nan_metrics_as_on_the_eager_path():
    x = torch.randn(64, 256)
    spec = ob.QuantSpec(dtype="int8", strategy="group", group_size=128)
    qp = _qparams(x, spec, "weight")
    x[5, 17] = math.nan
    native, eager = quantization_metrics(x, qp, spec), _eager(x, qp, spec)
    for key in ("mse", "max_abs_error", "rmse_over_scale"):
        assert math.isnan(native[key]) and math.isnan(eager[key]), key
    assert native["clip_ratio"] == eager["clip_ratio"]


@needs_kernel
@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, 40),
    columns=st.sampled_from([16, 17, 64, 100, 128, 1000, 3000]),
    dtype=st.sampled_from(["int4", "int8", "uint4", "uint8"]),
    symmetric=st.booleans(),
    strategy=st.sampled_from(["tensor", "channel", "token", "group"]),
    shrink=st.floats(0.3, 1.0),
    seed=st.integers(0, 2**31 - 1),
    threads=st.integers(1, 3),
)
def test_property_native_equals_eager(rows, columns, dtype, symmetric, strategy, shrink, seed, threads):
    """Any shape, integer format, granularity, clipping and thread count the kernel takes."""
    x = torch.randn(rows, columns, generator=torch.Generator().manual_seed(seed)) * 3.0
    group = next((g for g in (128, 64, 32, 16) if columns % g == 0), columns)
    spec = ob.QuantSpec(dtype=dtype, strategy=strategy, symmetric=symmetric, group_size=group)
    kind = "activation" if strategy == "token" else "weight"
    qp = _qparams(x * shrink, spec, kind)
    eager = _eager(x, qp, spec)
    for isa in kernels.available_isas(metrics_kernel.NAME):
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(kernels, "threads_for", lambda elements: threads)
            assert metrics_kernel.quant_error_sums(x, qp, spec, _clip_bounds(spec), isa) is not None
            _variant(patch, isa)
            _assert_same_metrics(quantization_metrics(x, qp, spec), eager)


@needs_kernel
@pytest.mark.parametrize("observer", ["minmax", "moving_average_minmax"])
@pytest.mark.parametrize("name,x,spec,kind,qp", CASES[:7], ids=[case[0] for case in CASES[:7]])
def test_run_one_gives_the_eager_results(observer, name, x, spec, kind, qp):
    batches = list(x.split(1)) if kind == "activation" else x
    native = ob.run_one(observer, batches, spec, kind)
    with kernels.disabled():
        eager = ob.run_one(observer, batches, spec, kind)
    assert native.error is None and eager.error is None
    assert torch.equal(native.qparams.scale, eager.qparams.scale)
    _assert_same_metrics(native.metrics, eager.metrics)


def _refused() -> list[tuple[str, torch.Tensor, ob.QuantSpec, str]]:
    g = torch.Generator().manual_seed(1)
    weight = torch.randn(64, 384, generator=g)
    activation = torch.randn(200, 384, generator=g)
    int8 = ob.QuantSpec(dtype="int8", strategy="tensor")
    return [
        ("ragged group 100", weight, ob.QuantSpec(dtype="int4", strategy="group", group_size=100), "weight"),
        ("mxfp4", weight, ob.QuantSpec(dtype="mxfp4"), "weight"),
        ("nvfp4", weight, ob.QuantSpec(dtype="nvfp4"), "weight"),
        ("fp16 cast", weight, ob.QuantSpec(dtype="fp16"), "weight"),
        ("per-feature activation", activation, ob.QuantSpec(dtype="int8", strategy="channel"), "activation"),
        ("bfloat16 data", activation.bfloat16(), int8, "activation"),
        ("groups of 8", weight, ob.QuantSpec(dtype="int4", strategy="group", group_size=8), "weight"),
    ]


@pytest.mark.parametrize("name,x,spec,kind", _refused(), ids=[case[0] for case in _refused()])
def test_layouts_the_kernel_does_not_take_give_exactly_the_eager_numbers(name, x, spec, kind):
    qp = _qparams(x, spec, kind, "placeholder" if spec.format.kind == "cast" else "memoryless_minmax")
    assert metrics_kernel.quant_error_sums(x, qp, spec, _clip_bounds(spec)) is None
    assert quantization_metrics(x, qp, spec) == _eager(x, qp, spec)


def test_inside_disabled_and_for_float64_qparams_the_eager_path_runs():
    x = torch.randn(64, 256)
    spec = ob.QuantSpec(dtype="int8", strategy="tensor")
    qp = _qparams(x, spec, "weight")
    with kernels.disabled():
        assert metrics_kernel.quant_error_sums(x, qp, spec, _clip_bounds(spec)) is None
    qp.scale = qp.scale.double()
    assert metrics_kernel.quant_error_sums(x, qp, spec, _clip_bounds(spec)) is None
    assert quantization_metrics(x, qp, spec) == _eager(x, qp, spec)


def test_qparams_that_do_not_fit_raise_the_eager_error():
    x = torch.randn(64, 256)
    spec = ob.QuantSpec(dtype="int4", strategy="group", group_size=128)
    qp = _qparams(torch.randn(32, 256), spec, "weight")
    with pytest.raises(ValueError, match="do not fit"):
        quantization_metrics(x, qp, spec)


@needs_kernel
def test_an_unknown_variant_is_refused():
    x = torch.randn(64, 256)
    spec = ob.QuantSpec(dtype="int8", strategy="tensor")
    with pytest.raises(ValueError, match="does not run here"):
        metrics_kernel.quant_error_sums(x, _qparams(x, spec, "weight"), spec, _clip_bounds(spec), isa="neon")
