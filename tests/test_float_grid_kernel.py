"""The native candidate-error kernel of the float element searches (observers/float_grid_kernel.py,
csrc/group_float_grid.c): the eager codes exactly (one element per group, norm 1), the eager sums
to a few ulps for every float grid, norm, weight and step layout on every variant this CPU runs,
its pick equal to argmin over its sums, NVFP4's batched candidate steps bit for bit; and every
observer it serves giving the eager scales, with the eager fallback wherever it cannot run."""

from __future__ import annotations

import shutil

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import observers as ob
from bench.common import llm_weight
from observers import float_grid_kernel, kernels
from observers.formats import FORMATS, round_to_float_grid_
from observers.granularity import flatten, reduce_min_max
from observers.lc_search import free_scale_spec
from observers.mse_grid import _candidate_steps, _float_candidate_rule, shrink_factors
from observers.qparams import calculate_qparams

needs_kernel = pytest.mark.skipif(
    not kernels.available_isas(float_grid_kernel.NAME),
    reason=f"kernel not in use here: {kernels.status(float_grid_kernel.NAME)}",
)
GRIDS = ["fp4_e2m1", "fp6_e2m3", "fp6_e3m2", "fp8_e4m3", "fp8_e5m2"]


def _cpu_has_avx2() -> bool:
    with open("/proc/cpuinfo") as cpuinfo:
        return " avx2" in cpuinfo.read()


def test_kernel_is_built_and_used_where_a_compiler_and_avx2_exist():
    line = kernels.status(float_grid_kernel.NAME)
    if any(shutil.which(name) for name in ("cc", "gcc", "clang")) and _cpu_has_avx2():
        assert line.startswith("native ("), line
    else:
        assert line.startswith("eager: "), line


def _eager(data, weight, step, fmt, norm, direct) -> torch.Tensor:
    """The eager sums for the same candidates, (C, Q): fake_quantize's division and grid rounding."""
    s = step.reshape(step.shape[0], 1, -1, 1) if step.ndim == 2 else step.reshape(-1, 1, 1, 1)
    scaled = data.unsqueeze(0) / s
    codes = round_to_float_grid_(scaled.clone(), fmt.exp_bits, fmt.man_bits, fmt.max_value)
    err = (codes * s - data) if direct else (codes - scaled)
    err = err.abs().pow(norm)
    if weight is not None:
        err = err * weight
    return err.sum(dim=(1, 3))


def _special_values(fmt) -> torch.Tensor:
    """Zeros of both signs, fp32 subnormals, every grid point and every midpoint between neighbours
    (ties to even), the largest value and beyond it (saturation), both signs."""
    grid = torch.arange(0, 2 ** (fmt.exp_bits + fmt.man_bits), dtype=torch.float32)
    grid = round_to_float_grid_(grid * 2.0 ** (1 - 2 ** (fmt.exp_bits - 1) - fmt.man_bits), *_bits(fmt)).unique()
    grid = grid[grid <= fmt.max_value]
    midpoints = (grid[1:] + grid[:-1]) / 2
    extra = torch.tensor([0.0, 1e-40, 1e-45, 3e-39, fmt.max_value * 1.01, fmt.max_value * 7, 1e30])
    values = torch.cat([grid, midpoints, midpoints.nextafter(torch.tensor(0.0)), extra])
    return torch.cat([values, -values, torch.tensor([-0.0])])


def _bits(fmt):
    return fmt.exp_bits, fmt.man_bits, fmt.max_value


@needs_kernel
@pytest.mark.parametrize("name", GRIDS)
def test_codes_are_the_eager_codes_on_every_special_value(name):
    """One element per group and norm 1: each sum is |grid(x/s) - x/s| of one element, so equal
    sums mean equal codes; steps 1 (the values themselves) and 0.75 (an inexact division)."""
    fmt = FORMATS[name]
    values = _special_values(fmt)
    data = values.reshape(1, -1, 1).contiguous()
    step = torch.tensor([1.0, 0.75, 3.0]).reshape(3, 1).expand(3, values.numel())
    for isa in kernels.available_isas(float_grid_kernel.NAME):
        for direct in (False, True):
            got = float_grid_kernel.candidate_errors(data, None, step, fmt, 1.0, direct, isa=isa)
            assert torch.equal(got, _eager(data, None, step, fmt, 1.0, direct)), (isa, direct)


@needs_kernel
@pytest.mark.parametrize("name", GRIDS)
@pytest.mark.parametrize("norm", [1.0, 2.0, 2.4, 3.0])
@pytest.mark.parametrize("direct", [False, True])
@pytest.mark.parametrize("shape", [(2, 37, 70), (1, 64, 16), (3, 32, 32), (1, 48, 7)])
def test_sums_match_eager_to_a_few_ulps(name, norm, direct, shape):
    """Long rows, and short ones in whole sixteens of groups (the AVX-512 lane-per-row path), with
    per-group steps and with one step per candidate."""
    fmt = FORMATS[name]
    g = torch.Generator().manual_seed(3)
    data = torch.randn(*shape, generator=g) * torch.rand(1, shape[1], 1, generator=g) * 4
    data[0, 0] = 0.0
    weight = torch.rand(*shape, generator=g)
    for step in (torch.rand(9, shape[1], generator=g) * 0.3 + 1e-3, torch.rand(9, generator=g) + 0.01):
        for isa in kernels.available_isas(float_grid_kernel.NAME):
            for w in (None, weight):
                got = float_grid_kernel.candidate_errors(data, w, step, fmt, norm, direct, isa=isa)
                want = _eager(data, w, step, fmt, norm, direct)
                torch.testing.assert_close(got, want, rtol=2e-6, atol=0)


@needs_kernel
@pytest.mark.parametrize("shape", [(1, 16, 16), (1, 3, 70)])
def test_quotients_that_would_overflow_take_the_divide(shape):
    """1e15 / 2^-120 overflows fp32: the divide gives inf, which the grid clamps to its largest value, as
    eager does; the divide-free quotient v·(1/s) corrected by an fma would give NaN there. Both the
    lane-per-row path (sixteen 16-value groups) and the row path."""
    fmt = FORMATS["fp4_e2m1"]
    data = torch.randn(*shape, generator=torch.Generator().manual_seed(6))
    data[0, 0, 3] = 1e15
    step = torch.tensor([2.0**-120, 0.5])
    want = _eager(data, None, step, fmt, 1.0, True)
    assert torch.isfinite(want).all()
    for isa in kernels.available_isas(float_grid_kernel.NAME):
        got = float_grid_kernel.candidate_errors(data, None, step, fmt, 1.0, True, isa=isa)
        torch.testing.assert_close(got, want, rtol=2e-6, atol=0)
        least, index = float_grid_kernel.candidate_picks(data, None, step, fmt, 1.0, True, isa=isa)
        torch.testing.assert_close(least, want.min(dim=0).values, rtol=2e-6, atol=0)


@needs_kernel
def test_one_step_per_candidate_equals_the_expanded_table_and_long_rows_are_pieced(monkeypatch):
    fmt = FORMATS["fp4_e2m1"]
    data = torch.randn(1, 5, 300)
    step = torch.rand(7) + 0.01
    one = float_grid_kernel.candidate_errors(data, None, step, fmt, 2.0, True)
    table = float_grid_kernel.candidate_errors(data, None, step.reshape(7, 1).repeat(1, 5), fmt, 2.0, True)
    assert torch.equal(one, table)
    monkeypatch.setattr(float_grid_kernel, "PIECE", 64)
    pieced = float_grid_kernel.candidate_errors(data, None, step, fmt, 2.0, True)
    torch.testing.assert_close(pieced, one, rtol=2e-6, atol=0)


@needs_kernel
@pytest.mark.parametrize("direct", [False, True])
@pytest.mark.parametrize("groups", [300, 320])
def test_pick_is_argmin_of_the_sums_times_factor(direct, groups):
    fmt = FORMATS["fp8_e4m3"]
    g = torch.Generator().manual_seed(1)
    data = torch.randn(1, groups, 16, generator=g)
    weight = torch.rand(1, groups, 16, generator=g)
    step = torch.rand(50, groups, generator=g) * 0.3 + 1e-3
    step[10] = step[3]  # exact ties: the first is kept
    factor = step.pow(2.4)
    for isa in kernels.available_isas(float_grid_kernel.NAME):
        for f in (None, factor):
            for w in (None, weight):
                sums = float_grid_kernel.candidate_errors(data, w, step, fmt, 2.4, direct, isa=isa)
                sums = sums if f is None else sums * f
                least, index = float_grid_kernel.candidate_picks(data, w, step, fmt, 2.4, direct, f, isa=isa)
                assert torch.equal(index, sums.argmin(dim=0)) and torch.equal(least, sums.amin(dim=0))
        shared = step[:, 0].contiguous()
        sums = float_grid_kernel.candidate_errors(data, None, shared, fmt, 2.0, True, isa=isa)
        _, index = float_grid_kernel.candidate_picks(data, None, shared, fmt, 2.0, True, isa=isa)
        assert torch.equal(index, sums.argmin(dim=0))


def _hard_rows(run: int, seed: int, norm: float) -> torch.Tensor:
    """(1, 192, run) rows a bound-pruned pick must get right, twelve kinds of sixteen: Gaussian rows, rows
    on the FP4 grid of one step (some candidate's error is zero), rows at 1e-30, 1e-18 and 1e30 of the
    usual size and rows whose largest errors' ``norm`` power overflows fp32 for some candidates only
    (powers that underflow or overflow before the weight), fp32 subnormals, all zeros, all one value
    (every candidate ties), a NaN or an infinity in a row, heavy-tailed rows."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(16, run, generator=g)
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    on_grid = grid[torch.randint(0, 8, (16, run), generator=g)] * torch.sign(base) * 0.037
    nan, inf = base.clone(), base.clone()
    nan[3, 5], inf[7, 2] = float("nan"), float("inf")
    kinds = [base, on_grid, base * 1e-30, base * 1e30, base * 1e-40, torch.zeros(16, run), base * 1e-18]
    kinds.append(base / base.abs().amax() * 10 * 2.0 ** (128 / norm))
    kinds += [torch.full((16, run), 0.75), nan, inf, torch.distributions.StudentT(2.0).sample((16, run))]
    return torch.cat(kinds).reshape(1, -1, run).contiguous()


def _want_pick(sums: torch.Tensor, factor: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    values = sums if factor is None else sums * factor
    values = torch.where(values.isnan(), float("inf"), values)  # the pick reads NaN as +inf
    return values.amin(dim=0), values.argmin(dim=0)


@needs_kernel
@pytest.mark.parametrize("norm", [1.3, 2.4, 2.9])
@pytest.mark.parametrize("direct", [False, True])
@pytest.mark.parametrize("run", [16, 32])
def test_pick_with_a_fractional_norm_is_the_full_pick_on_hard_rows(norm, direct, run):
    """A fractional norm's pick skips the candidates its bounds rule out (rows in blocks of sixteen on
    AVX-512, eight on AVX2) and must still give the very least value and first index of the full
    sums: zero-error and all-tied candidates, tiny, huge, subnormal and non-finite rows, zero, light
    and heavy weights (1e-9 with powers that overflow before the weight, 1e25 with powers that
    underflow), negative and tiny weights (which turn the bounds off), zero and NaN factors."""
    fmt = FORMATS["fp4_e2m1"]
    data = _hard_rows(run, seed=int(norm * 10) + run, norm=norm)
    groups = data.shape[1]
    g = torch.Generator().manual_seed(2)
    weights = [None, torch.rand(data.shape, generator=g) * (torch.rand(data.shape, generator=g) > 0.3)]
    negative = torch.rand(data.shape, generator=g)
    negative[0, 4, 1] = -0.5
    weights += [negative, torch.rand(data.shape, generator=g) * 1e-35]
    weights += [torch.rand(data.shape, generator=g) * 1e-9, torch.rand(data.shape, generator=g) * 1e25]
    amax = data.abs().amax(dim=-1).reshape(-1).nan_to_num(nan=1.0, posinf=1.0)
    factors = torch.tensor([1.8 * p for p in shrink_factors(0.55, 200)])
    rule = float_grid_kernel.StepRule("free", amax, factors, fmt.max_value, torch.finfo(torch.float32).eps)
    table = torch.maximum(amax * factors.reshape(-1, 1) / fmt.max_value, torch.tensor(1e-38))
    table[5] = table[9]  # two candidates with the same steps: exact ties
    factor = table.pow(norm)
    factor[:, 20:24] = 0.0
    factor[3, 30] = float("nan")
    for isa in kernels.available_isas(float_grid_kernel.NAME):
        for w in weights:
            sums = float_grid_kernel.candidate_errors(data, w, rule, fmt, norm, direct, isa=isa)
            got = float_grid_kernel.candidate_picks(data, w, rule, fmt, norm, direct, isa=isa)
            want = _want_pick(sums, None)
            assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0]), (isa, w is None)
            sums = float_grid_kernel.candidate_errors(data, w, table, fmt, norm, direct, isa=isa)
            for f in (None, factor):
                got = float_grid_kernel.candidate_picks(data, w, table, fmt, norm, direct, f, isa=isa)
                want = _want_pick(sums, f)
                assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0]), (isa, w is None, f is None)
    assert groups % 16 == 0


@needs_kernel
@pytest.mark.parametrize("norm", [1.5, 2.4])
def test_pick_with_a_fractional_norm_where_every_value_overflows_is_the_first_candidate(norm):
    """Steps times finite factors near 2^127 whose products overflow for every candidate: the full
    pick reads them all +inf and keeps candidate 0, and so must the bounded pick, although candidate
    0's bounds (finite) lie far above the others' (its step clamps the data)."""
    fmt = FORMATS["fp4_e2m1"]
    g = torch.Generator().manual_seed(9)
    step = 2.0 ** (126.5 / norm)
    table = step * torch.linspace(1.0, 1.05, 48).reshape(-1, 1).expand(48, 32).contiguous()
    table[0] = step * 0.55
    data = (torch.randn(1, 32, 16, generator=g) * 3 * step).contiguous()
    weight = torch.rand(data.shape, generator=g) * 1e3
    factor = table.pow(norm)
    assert bool(factor.isfinite().all())
    for isa in kernels.available_isas(float_grid_kernel.NAME):
        sums = float_grid_kernel.candidate_errors(data, weight, table, fmt, norm, False, isa=isa)
        assert bool((sums * factor).isinf().all())
        least, index = float_grid_kernel.candidate_picks(data, weight, table, fmt, norm, False, factor, isa=isa)
        assert bool(least.isinf().all()) and not bool(index.any())


@needs_kernel
@settings(max_examples=60, deadline=None)
@given(
    name=st.sampled_from(GRIDS),
    seed=st.integers(0, 2**31 - 1),
    norm=st.floats(1.05, 2.95).filter(lambda n: abs(n - 2.0) > 1e-3),
    direct=st.booleans(),
    exponent=st.integers(-90, 90),
    snapped=st.floats(0.0, 1.0),
    weight_exponent=st.one_of(st.none(), st.integers(-20, 30)),
)
def test_pick_with_a_fractional_norm_is_the_full_pick(name, seed, norm, direct, exponent, snapped, weight_exponent):
    """Property: for every float grid, on any scale, with any share of the values on a candidate's
    grid, unweighted or with weights of any size (some zero), the pick equals argmin over the full
    sums (times the steps' power, as mse_grid picks), on every variant."""
    fmt = FORMATS[name]
    g = torch.Generator().manual_seed(seed)
    data = torch.randn(1, 32, 16, generator=g) * 2.0**exponent
    amax = data.abs().amax(dim=-1).reshape(-1)
    table = (amax * torch.linspace(1.8, 0.8, 50).reshape(-1, 1)) / fmt.max_value
    grid = round_to_float_grid_(data / table[7].reshape(1, -1, 1), *_bits(fmt)) * table[7].reshape(1, -1, 1)
    data = torch.where(torch.rand(data.shape, generator=g) < snapped, grid, data).contiguous()
    weight = None
    if weight_exponent is not None:
        weight = (
            torch.rand(data.shape, generator=g) * (torch.rand(data.shape, generator=g) > 0.2) * 10.0**weight_exponent
        )
    for isa in kernels.available_isas(float_grid_kernel.NAME):
        sums = float_grid_kernel.candidate_errors(data, weight, table, fmt, norm, direct, isa=isa)
        for f in (None, table.pow(norm)):
            got = float_grid_kernel.candidate_picks(data, weight, table, fmt, norm, direct, f, isa=isa)
            want = _want_pick(sums, f)
            assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])


@pytest.mark.parametrize("dtype", ["nvfp4", "mxfp4", "mxfp8_e4m3", "mxint8", "bfp16", "int4", "fp8_e4m3"])
def test_batched_candidate_steps_equal_one_rule_call_per_candidate(dtype):
    """Every candidate's steps and code bounds in one pass (NVFP4's global scale per candidate written
    out, the other rules over a leading candidate axis) are those of one ``calculate_qparams`` call
    per candidate range, bit for bit."""
    spec = (
        ob.QuantSpec(dtype, strategy="group", group_size=32) if dtype in ("int4", "fp8_e4m3") else ob.QuantSpec(dtype)
    )
    w = llm_weight(64, 256)
    w[3] = 0.0
    flat = flatten(w, spec, "weight")
    low, high = reduce_min_max(flat)
    factors = [1.8 * p for p in shrink_factors(0.55, 200)]
    steps, lows, highs = _candidate_steps(low, high, factors, spec)
    qmin, qmax = spec.int_range if spec.format.kind == "int" else (0, 0)
    for c, p in enumerate(factors):
        qp = calculate_qparams(low * p, high * p, spec)
        assert torch.equal(steps[c], qp.effective_scale.expand_as(low).reshape(-1))
        zero_point = qp.zero_point.expand_as(low).reshape(-1).float()
        assert torch.equal(lows[c], qmin - zero_point) and torch.equal(highs[c], qmax - zero_point)


@needs_kernel
@pytest.mark.parametrize("groups_of", [16, 20])
def test_step_rules_give_the_step_tables_results(groups_of):
    """The steps the kernel computes (NVFP4's E4M3 block scales per candidate, the free fp32 rule)
    give the very sums and picks of the torch-built ``(C, Q)`` tables, on every variant (256 and 320
    groups: the lane-per-row paths of AVX-512 and AVX2)."""
    spec = ob.QuantSpec("nvfp4")
    w = llm_weight(groups_of, 256, seed=5)
    w[1] = 0.0
    flat = flatten(w, spec, "weight")
    low, high = reduce_min_max(flat)
    data = flat.data.reshape(1, -1, 16).contiguous()
    factors = [1.8 * p for p in shrink_factors(0.55, 200)]
    table = _candidate_steps(low, high, factors, spec)[0]
    rule = _float_candidate_rule(low, high, factors, spec, 2.4)
    free = free_scale_spec(spec)
    free_table = calculate_qparams(
        low.unsqueeze(0) * torch.tensor(factors).reshape(-1, 1, 1),
        high.unsqueeze(0) * torch.tensor(factors).reshape(-1, 1, 1),
        free,
    ).effective_scale.reshape(len(factors), -1)
    amax = torch.maximum(torch.neg(low), high).reshape(-1)
    free_rule = float_grid_kernel.StepRule("free", amax, torch.tensor(factors), free.format.max_value, free.eps)
    for isa in kernels.available_isas(float_grid_kernel.NAME):
        for steps, by_rule, direct in ((table, rule, False), (free_table, free_rule, True)):
            want = float_grid_kernel.candidate_errors(data, None, steps, spec.format, 2.4, direct, isa=isa)
            assert torch.equal(
                float_grid_kernel.candidate_errors(data, None, by_rule, spec.format, 2.4, direct, isa=isa), want
            )
            factor = None if direct else steps.pow(2.4)
            picked = float_grid_kernel.candidate_picks(data, None, steps, spec.format, 2.4, direct, factor, isa=isa)
            by = float_grid_kernel.candidate_picks(data, None, by_rule, spec.format, 2.4, direct, isa=isa)
            assert torch.equal(picked[0], by[0]) and torch.equal(picked[1], by[1])


def _both(name: str, w: torch.Tensor, spec: ob.QuantSpec, kind: str = "weight", **knobs):
    """The observer's qparams with the kernels and inside ``kernels.disabled()`` (eager)."""

    def run():
        observer = ob.create(name, spec, kind=kind, **knobs)
        observer.observe(w)
        return observer.qparams()

    native = run()
    with kernels.disabled():
        eager = run()
    return native, eager


OBSERVER_CASES = [
    ("mse_grid", ob.QuantSpec("nvfp4"), {}),
    ("mse_grid", ob.QuantSpec("fp8_e4m3", strategy="channel"), {}),
    ("mse_grid", ob.QuantSpec("fp8_e5m2", strategy="channel"), {}),
    ("mse_grid", ob.QuantSpec("fp4_e2m1", strategy="group", group_size=32), {"patience": 1}),
    ("mse_grid", ob.QuantSpec("fp6_e3m2", strategy="group", group_size=64), {"norm": 2.0}),
    ("mse_grid", ob.QuantSpec("fp6_e2m3", strategy="tensor"), {}),
    ("mse_grid", ob.QuantSpec("mxfp4"), {}),
    ("nvfp4_expanded_mse", ob.QuantSpec("nvfp4"), {}),
    ("nvfp4_expanded_mse", ob.QuantSpec("nvfp4"), {"patience": 3}),
    ("nvfp4_expanded_mse", ob.QuantSpec("fp8_e4m3", strategy="channel"), {}),
    ("nvfp4_fp8_sweep", ob.QuantSpec("nvfp4"), {}),
    ("modelopt_mse", ob.QuantSpec("nvfp4"), {}),
    ("modelopt_mse", ob.QuantSpec("fp8_e4m3", strategy="channel"), {}),
]


def _group_errors(w: torch.Tensor, qp: ob.QParams, spec: ob.QuantSpec, norm: float) -> torch.Tensor:
    """Each group's ``Σ|fake_quant(w) - w|^norm`` in float64, in the qparam shape."""
    diff = flatten((ob.fake_quantize(w, qp, spec).double() - w.double()).abs().pow(norm), spec, "weight")
    return diff.data.sum(dim=(0, -1))


def assert_same_or_near_tie(w, native, eager, spec, norm):
    """Identical scales, except groups whose two picks' exact errors tie to 1e-6 relative (fp32 sums
    in another order can flip those either way; at most 0.1 % of the groups)."""
    differ = native.scale != eager.scale
    assert int(differ.sum()) <= max(1, differ.numel() // 1000)
    if bool(differ.any()):
        mine, theirs = _group_errors(w, native, spec, norm), _group_errors(w, eager, spec, norm)
        torch.testing.assert_close(mine[differ], theirs[differ], rtol=1e-6, atol=0)


@needs_kernel
@pytest.mark.parametrize(("name", "spec", "knobs"), OBSERVER_CASES, ids=lambda v: getattr(v, "dtype", None) or str(v))
def test_observers_give_the_eager_qparams(name, spec, knobs):
    w = llm_weight(96, 512, seed=2)
    w[7] = 0.0  # all-zero groups
    native, eager = _both(name, w, spec, **knobs)
    norm = knobs.get("norm", 2.0 if name in ("modelopt_mse", "nvfp4_fp8_sweep") else 2.4)
    assert_same_or_near_tie(w, native, eager, spec, norm)
    assert torch.equal(native.zero_point, eager.zero_point)
    assert (native.global_scale is None) == (eager.global_scale is None)
    if native.global_scale is not None:
        assert torch.equal(native.global_scale, eager.global_scale)


@needs_kernel
def test_ragged_groups_weigh_padding_zero():
    w = llm_weight(32, 80, seed=4)
    for name in ("mse_grid", "nvfp4_expanded_mse", "modelopt_mse"):
        native, eager = _both(name, w, ob.QuantSpec("fp4_e2m1", strategy="group", group_size=32))
        assert torch.equal(native.scale, eager.scale), name


@needs_kernel
def test_searches_use_the_kernel_and_disabled_bypasses_it(monkeypatch):
    calls = []
    real = float_grid_kernel._call
    monkeypatch.setattr(float_grid_kernel, "_call", lambda *a, **k: calls.append(1) or real(*a, **k))
    w = llm_weight(32, 256)
    for name in ("mse_grid", "nvfp4_expanded_mse", "nvfp4_fp8_sweep", "modelopt_mse"):
        calls.clear()
        with kernels.disabled():
            ob.create(name, ob.QuantSpec("nvfp4")).observe(w)
            assert not calls, name
        observer = ob.create(name, ob.QuantSpec("nvfp4"))
        observer.observe(w)
        observer.qparams()
        assert calls, name


def test_bad_inputs_fall_back_to_eager():
    fmt = FORMATS["fp8_e4m3"]
    data = torch.randn(1, 4, 32)
    step = torch.ones(3, 4)
    assert float_grid_kernel.candidate_errors(data.double(), None, step, fmt, 2.0) is None
    assert float_grid_kernel.candidate_errors(data.transpose(1, 2), None, step, fmt, 2.0) is None
    assert float_grid_kernel.candidate_errors(data, torch.ones(1, 4, 31), step, fmt, 2.0) is None
    assert float_grid_kernel.candidate_errors(data, None, step, FORMATS["int4"], 2.0) is None
    assert float_grid_kernel.candidate_picks(torch.randn(2, 4, 32), None, step, fmt, 2.0) is None
    assert not float_grid_kernel.covers(FORMATS["fp16"]) and not float_grid_kernel.covers(FORMATS["mxint8"])
    with kernels.disabled():
        assert float_grid_kernel.candidate_errors(data, None, step, fmt, 2.0) is None
        assert float_grid_kernel.candidate_picks(data, None, step, fmt, 2.0) is None


@needs_kernel
def test_token_observations_take_the_table_path_with_the_eager_answer():
    """Several observations per group (per-channel activations): no per-unit pick, the (C, Q) sums."""
    x = torch.randn(64, 48) * torch.rand(1, 48) * 3
    spec = ob.QuantSpec("fp8_e4m3", strategy="channel")
    for name in ("mse_grid", "nvfp4_expanded_mse"):
        native, eager = _both(name, x, spec, kind="activation")
        assert torch.equal(native.scale, eager.scale), name


IMATRIX_CASES = [
    ("nvfp4_expanded_imatrix", ob.QuantSpec("nvfp4")),
    ("imatrix_mse", ob.QuantSpec("nvfp4")),
    ("imatrix_mse", ob.QuantSpec("fp8_e4m3", strategy="channel")),
    ("imatrix_mse", ob.QuantSpec("mxfp4")),
    ("imatrix_mse", ob.QuantSpec("fp4_e2m1", strategy="group", group_size=48)),  # ragged: 512 = 10·48 + 32
]


def _weighted_search_errors(w, observer, importance) -> torch.Tensor:
    """The search's own objective for the observer's chosen ranges, per group, in float64: free-scale
    fake quantization (``free_scale_spec``), ``Σ imp·|fq(w) - w|^norm`` with ``imp`` the importance
    over its mean, as llm-compressor's imatrix observers weigh it."""
    spec = free_scale_spec(observer.spec)
    qp = calculate_qparams(observer.min_val, observer.max_val, spec)
    error = (ob.fake_quantize(w, qp, spec).double() - w.double()).abs().pow(observer.norm)
    error = error * (importance / importance.mean()).double()
    return flatten(error, spec, "weight").data.sum(dim=(0, -1))


@needs_kernel
@pytest.mark.parametrize(("name", "spec"), IMATRIX_CASES, ids=lambda v: getattr(v, "dtype", None) or str(v))
def test_importance_weighted_searches_give_the_eager_ranges(name, spec, monkeypatch):
    """imatrix_mse and nvfp4_expanded_imatrix on float grids take the kernel (llm-compressor's loop
    with the importance as each element's weight) and keep the eager ranges, but for groups whose
    two picks' objectives tie to 1e-6 (the weighted fp32 sums run in another order)."""
    w = llm_weight(96, 512, seed=3)
    importance = torch.rand(512, generator=torch.Generator().manual_seed(5)) * 4
    importance[:7] = 0.0
    calls = []
    real = float_grid_kernel._call
    monkeypatch.setattr(float_grid_kernel, "_call", lambda *a, **k: calls.append(1) or real(*a, **k))

    def run():
        observer = ob.create(name, spec, importance=importance)
        observer.observe(w)
        return observer

    native = run()
    assert calls, "the kernel did not run"
    with kernels.disabled():
        eager = run()
    differ = (native.max_val != eager.max_val) | (native.min_val != eager.min_val)
    assert int(differ.sum()) <= max(1, differ.numel() // 1000)
    if bool(differ.any()):
        mine, theirs = _weighted_search_errors(w, native, importance), _weighted_search_errors(w, eager, importance)
        torch.testing.assert_close(mine[differ], theirs[differ], rtol=1e-6, atol=0)
