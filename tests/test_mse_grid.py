"""mse_grid, its moving-average twin and imatrix_mse: parity with a naive sequential LC loop."""

from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import observers as ob
from observers.actorder import column_importance
from observers.granularity import flatten, reduce_min_max
from observers.mse_grid import mse_grid_search


def naive_lc_search(x, spec, kind="weight", maxshrink=0.2, grid=100, patience=5, norm=2.4, expand=1.0, col_weight=None):
    """llm-compressor's memoryless_mse loop, one candidate at a time, through the public API."""
    flat = flatten(x, spec, kind)
    low, high = reduce_min_max(flat)
    base_min, base_max = low * expand, high * expand
    best = torch.full_like(base_min, torch.finfo(torch.float32).max)
    best_min, best_max = base_min.clone(), base_max.clone()
    stale = 0
    for i in range(int(maxshrink * grid)):
        p = 1 - i / grid
        cand_min, cand_max = base_min * p, base_max * p
        qp = ob.calculate_qparams(cand_min, cand_max, spec)
        qp.kind = kind
        diff = (ob.fake_quantize(x, qp, spec).float() - x.float()).abs().pow(norm)
        if col_weight is not None:
            diff = diff * col_weight
        err_flat = flatten(diff, spec, kind)
        err = err_flat.data
        if err_flat.valid is not None:
            err = err * err_flat.valid
        err = err.sum(dim=(0, err.ndim - 1))
        improved = err < best
        if bool(improved.any()):
            best[improved] = err[improved]
            best_min[improved] = cand_min[improved]
            best_max[improved] = cand_max[improved]
            stale = 0
        else:
            stale += 1
            if stale >= patience:
                break
    return best_min, best_max


SPECS = [
    ob.QuantSpec(dtype="int4", symmetric=True, strategy="group", group_size=32),
    ob.QuantSpec(dtype="int4", symmetric=True, strategy="group", group_size=24),  # ragged last group
    ob.QuantSpec(dtype="int8", symmetric=False, strategy="channel"),
    ob.QuantSpec(dtype="int8", symmetric=True, strategy="tensor"),
    ob.QuantSpec(dtype="fp8_e4m3", symmetric=True, strategy="block", block_size=(4, 16)),
    ob.QuantSpec(dtype="fp4_e2m1", symmetric=True, strategy="group", group_size=16),
    ob.QuantSpec(dtype="mxfp4"),
    ob.QuantSpec(dtype="mxint8"),
    ob.QuantSpec(dtype="nvfp4"),
    ob.QuantSpec(dtype="bfp16"),
]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.dtype}-{s.strategy}-{s.symmetric}")
@pytest.mark.parametrize("working", [1, 1 << 30], ids=["one-candidate-chunks", "one-chunk"])
def test_chunked_search_equals_naive_sequential_loop(spec, working):
    torch.manual_seed(0)
    w = torch.randn(12, 70) * torch.rand(12, 1) + torch.randn(12, 70).pow(3) * 0.1
    obs = ob.create("mse_grid", spec, max_working_bytes=working)
    obs.observe(w)
    qp = obs.qparams()
    ref_min, ref_max = naive_lc_search(w, spec)
    assert torch.equal(qp.min_val, ref_min)
    assert torch.equal(qp.max_val, ref_max)


@given(
    seed=st.integers(0, 10_000),
    patience=st.integers(1, 6),
    grid=st.sampled_from([20, 50, 100]),
    maxshrink=st.sampled_from([0.2, 0.5, 0.9]),
    working=st.sampled_from([1, 3 * 4 * 200 * 3, 1 << 30]),
)
@settings(max_examples=25, deadline=None)
def test_patience_rule_replayed_over_chunks_matches_sequential(seed, patience, grid, maxshrink, working):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(4, 50, generator=gen) * torch.rand(4, 1, generator=gen)
    spec = ob.QuantSpec(dtype="int4", symmetric=True, strategy="group", group_size=10)
    kn = dict(maxshrink=maxshrink, grid=grid, patience=patience)
    flat = flatten(w, spec, "weight")
    low, high = mse_grid_search(flat, spec, max_working_bytes=working, **kn)
    ref_min, ref_max = naive_lc_search(w, spec, **kn)
    assert torch.equal(low, ref_min) and torch.equal(high, ref_max)


def test_each_group_error_is_at_most_minmax_error():
    torch.manual_seed(1)
    w = torch.randn(16, 128)
    w[:, 5] *= 8
    spec = ob.QuantSpec(dtype="int4", strategy="group", group_size=32)
    errs = {}
    for name in ("mse_grid", "minmax"):
        obs = ob.create(name, spec)
        obs.observe(w)
        qp = obs.qparams()
        diff = (ob.fake_quantize(w, qp, spec) - w).abs().pow(2.4)
        errs[name] = flatten(diff, spec, "weight").data.sum(dim=(0, -1))
    assert bool((errs["mse_grid"] <= errs["minmax"]).all())
    assert bool((errs["mse_grid"] < errs["minmax"]).any())


def test_early_stop_limits_candidates_when_nothing_improves():
    # Values already on the int8 grid of the full range: p = 1 is exact, every shrink is worse.
    spec = ob.QuantSpec(dtype="int8", symmetric=True)
    w = (torch.arange(-127, 128, dtype=torch.float32) / 127.5).reshape(1, -1)
    obs = ob.create("mse_grid", spec, patience=2)
    obs.observe(w)
    qp = obs.qparams()
    assert float(qp.max_val) == pytest.approx(float(w.abs().max()))


def test_moving_average_variant_averages_per_batch_searches():
    torch.manual_seed(2)
    spec = ob.QuantSpec(dtype="int8", symmetric=True, strategy="tensor")
    a, b = torch.randn(64, 32), 3 * torch.randn(64, 32)
    obs = ob.create("mse_grid_moving_average", spec, kind="activation", averaging_constant=0.25)
    obs.observe(a)
    obs.observe(b)
    lo_a, hi_a = naive_lc_search(a, spec, kind="activation")
    lo_b, hi_b = naive_lc_search(b, spec, kind="activation")
    qp = obs.qparams()
    assert torch.allclose(qp.max_val, hi_a + 0.25 * (hi_b - hi_a))
    assert torch.allclose(qp.min_val, lo_a + 0.25 * (lo_b - lo_a))
    memoryless = ob.create("mse_grid", spec, kind="activation")
    memoryless.observe(a)
    memoryless.observe(b)
    assert torch.equal(memoryless.qparams().max_val, hi_b)


MSE_GRID_DEFAULTS = {"maxshrink": 0.2, "grid": 100, "norm": 2.4}
"""imatrix_mse with mse_grid's knobs (its own defaults are llm-compressor 0.14's 0.95/20/3)."""


def test_imatrix_weights_errors_by_column_importance():
    torch.manual_seed(3)
    spec = ob.QuantSpec(dtype="int4", strategy="group", group_size=16)
    w = torch.randn(8, 64)
    inputs = torch.randn(100, 64) * torch.linspace(0.1, 5, 64)
    importance = column_importance(inputs)
    assert torch.allclose(importance, inputs.square().mean(0))
    obs = ob.create("imatrix_mse", spec, importance=importance, **MSE_GRID_DEFAULTS)
    obs.observe(w)
    # llm-compressor's imatrix loop tries int(maxshrink·grid) + 1 candidates with the importance
    # normalized by its mean (tests/test_observers_today.py has its 0.14 defaults)
    weight = (importance / importance.mean()).reshape(1, -1)
    ref_min, ref_max = naive_lc_search(w, spec, maxshrink=0.21, col_weight=weight)
    assert torch.equal(obs.qparams().max_val, ref_max)
    plain = ob.create("mse_grid", spec)
    plain.observe(w)
    assert not torch.equal(obs.qparams().max_val, plain.qparams().max_val)
    uniform = ob.create("imatrix_mse", spec, importance=torch.ones(64), **MSE_GRID_DEFAULTS)
    uniform.observe(w)
    assert torch.equal(uniform.qparams().max_val, plain.qparams().max_val)


def test_imatrix_without_importance_warns_and_falls_back():
    torch.manual_seed(4)
    spec = ob.QuantSpec(dtype="int4", strategy="group", group_size=16)
    w = torch.randn(8, 64)
    obs = ob.create("imatrix_mse", spec, **MSE_GRID_DEFAULTS)
    with pytest.warns(UserWarning, match="no importance"):
        obs.observe(w)
    plain = ob.create("mse_grid", spec)
    plain.observe(w)
    assert torch.equal(obs.qparams().scale, plain.qparams().scale)


def test_imatrix_bad_importance_and_kind_are_clear_errors():
    spec = ob.QuantSpec(dtype="int4", strategy="group", group_size=16)
    obs = ob.create("imatrix_mse", spec, importance=torch.ones(10))
    with pytest.raises(ValueError, match="input columns"):
        obs.observe(torch.randn(4, 64))
    with pytest.raises(ValueError, match=r"a float tensor of shape \(in,\), or \(n, in\)"):
        ob.create("imatrix_mse", spec, importance=[1.0, 2.0])
    with pytest.raises(ValueError, match="weight"):
        ob.create("imatrix_mse", ob.QuantSpec(dtype="int8"), kind="activation")


@pytest.mark.parametrize(
    "knob", [{"maxshrink": 0}, {"grid": -1}, {"patience": 0}, {"norm": 0}, {"expand": 0.5}, {"max_working_bytes": 0}]
)
def test_bad_knobs_raise_value_error(knob):
    with pytest.raises(ValueError):
        ob.create("mse_grid", ob.QuantSpec(dtype="int8"), **knob)


@pytest.mark.parametrize("name", ["mse_grid", "mse_grid_moving_average", "imatrix_mse"])
def test_constant_and_zero_tensors_give_finite_scales(name):
    spec = ob.QuantSpec(dtype="int4", strategy="group", group_size=8)
    knobs = {"importance": torch.ones(16)} if name == "imatrix_mse" else {}
    for w in (torch.zeros(4, 16), torch.full((4, 16), 0.7)):
        obs = ob.create(name, spec, **knobs)
        obs.observe(w)
        obs.observe(w)
        qp = obs.qparams()
        assert bool(torch.isfinite(qp.scale).all()) and bool((qp.scale > 0).all())
        assert not bool(torch.isnan(ob.fake_quantize(w, qp, spec)).any())


def test_expand_starts_above_the_observed_range():
    torch.manual_seed(5)
    spec = ob.QuantSpec(dtype="fp4_e2m1", strategy="group", group_size=16)
    w = torch.randn(4, 64)
    ref_min, ref_max = naive_lc_search(w, spec, expand=1.8, grid=200, maxshrink=1 - 0.8 / 1.8, patience=1000)
    obs = ob.create("mse_grid", spec, expand=1.8, grid=200, maxshrink=1 - 0.8 / 1.8, patience=1000)
    obs.observe(w)
    assert torch.equal(obs.qparams().max_val, ref_max)


def test_token_strategy_searches_each_token():
    torch.manual_seed(6)
    spec = ob.QuantSpec(dtype="int8", strategy="token")
    x = torch.randn(5, 40)
    obs = ob.create("mse_grid", spec, kind="activation")
    obs.observe(x)
    ref_min, ref_max = naive_lc_search(x, spec, kind="activation")
    assert torch.equal(obs.qparams().max_val, ref_max)


def test_suite_runs_grid_observers_and_warns_for_missing_importance():
    torch.manual_seed(7)
    spec = ob.QuantSpec(dtype="int4", strategy="group", group_size=32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        results = ob.run_suite(torch.randn(8, 64), spec, names=["mse_grid", "imatrix_mse", "minmax"])
    assert all(r.error is None for r in results)
    by_name = {r.name: r.metrics["mse"] for r in results}
    assert by_name["mse_grid"] <= by_name["minmax"] * 1.05


@pytest.mark.parametrize(
    ("shape", "spec", "kind", "block"),
    [
        ((64, 300), ob.QuantSpec(dtype="int8", symmetric=False, strategy="tensor"), "activation", 1000),
        ((2, 5000), ob.QuantSpec(dtype="int4", symmetric=True, strategy="tensor"), "weight", 1000),
        ((6, 96), ob.QuantSpec(dtype="int4", symmetric=False, strategy="group", group_size=32), "weight", 50),
    ],
    ids=["split-observations", "split-elements", "asymmetric-groups"],
)
def test_blocked_search_equals_naive_loop_when_groups_are_split(monkeypatch, shape, spec, kind, block):
    # Tiny blocks force the partial-sum paths (a group spread over several blocks).
    import observers.mse_grid as mse_grid

    monkeypatch.setattr(mse_grid, "_BLOCK_ELEMENTS", block)
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(*shape, generator=gen) * 0.1 + 0.03
    obs = ob.create("mse_grid", spec, kind=kind)
    obs.observe(x)
    ref_min, ref_max = naive_lc_search(x, spec, kind=kind)
    qp = obs.qparams()
    assert torch.equal(qp.min_val, ref_min) and torch.equal(qp.max_val, ref_max)


def test_unit_error_power_matches_torch_pow_to_a_few_ulps():
    from observers.mse_grid import _power_

    values = torch.rand(10_000, generator=torch.Generator().manual_seed(9)) * 0.5
    values[:3] = torch.tensor([0.0, 0.5, 1e-30])
    for norm in (1.0, 2.0, 2.4, 3.7):
        got = _power_(values.clone(), norm)
        want = values.double().pow(norm)
        assert torch.allclose(got.double(), want, rtol=4e-6, atol=1e-38)
