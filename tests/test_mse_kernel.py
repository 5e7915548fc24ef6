"""The native candidate-error kernel of mse_grid (observers/mse_kernel.py, csrc/group_mse_grid.c):
the eager sums to a few ulps for every norm, weight, int format and ragged group, on every
variant this CPU runs; the observers' scales with and without it; zero groups and zero steps;
and the eager fallback wherever the kernel cannot run."""

from __future__ import annotations

import shutil

import pytest
import torch

import observers as ob
import observers.lc_search as lc_search
import observers.mse_grid as mse_grid
from bench.common import llm_weight
from observers import kernels, mse_kernel
from observers.granularity import as_groups, flatten, reduce_min_max
from observers.mse_grid import _candidate_steps, _uniform_or, _unit_errors, mse_grid_search, shrink_factors

needs_kernel = pytest.mark.skipif(
    not kernels.available_isas(mse_kernel.NAME), reason=f"kernel not in use here: {kernels.status(mse_kernel.NAME)}"
)


def _cpu_has_avx2() -> bool:
    with open("/proc/cpuinfo") as cpuinfo:
        return " avx2" in cpuinfo.read()


def test_kernel_is_built_and_used_where_a_compiler_and_avx2_exist():
    line = kernels.status(mse_kernel.NAME)
    if any(shutil.which(name) for name in ("cc", "gcc", "clang")) and _cpu_has_avx2():
        assert line.startswith("native ("), line
        assert "avx2" in kernels.available_isas(mse_kernel.NAME)
    else:
        assert line.startswith("eager: "), line
        assert kernels.available_isas(mse_kernel.NAME) == []


def _search_inputs(spec: ob.QuantSpec, cols: int, seed: int = 0):
    """(N, Q, K) data of a weight with zero groups and outliers; its candidates' (C, Q) steps and bounds."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(48, cols, generator=g) * torch.rand(48, 1, generator=g)
    w[:, 3] *= 9  # outliers: clipped by the shrunk candidates
    w[5] = 0.0  # a row of all-zero groups: errors of exactly 0
    flat = flatten(w, spec, "weight")
    low, high = reduce_min_max(flat)
    data = flat.data.reshape(1, -1, flat.data.shape[-1]).contiguous()
    step, lows, highs = _candidate_steps(low, high, shrink_factors(0.2, 100), spec)
    return data, step, lows, highs


def _eager_sums(data, weight, step, low, high, spec, norm) -> torch.Tensor:
    """What the eager path sums for the same candidates, (C, Q)."""
    shape = (step.shape[0], 1, data.shape[1], 1)
    block_weight = None if weight is None else weight.unsqueeze(0)
    low, high = _uniform_or(low.reshape(shape)), _uniform_or(high.reshape(shape))
    return _unit_errors(data.unsqueeze(0), block_weight, step.reshape(shape), low, high, spec, norm)


SPECS = [
    ob.QuantSpec("int4", symmetric=True, strategy="group", group_size=128),
    ob.QuantSpec("int4", symmetric=False, strategy="group", group_size=32),
    ob.QuantSpec("int8", symmetric=True, strategy="group", group_size=100),  # ragged: 100 = 6·16 + 4
    ob.QuantSpec("int8", symmetric=False, strategy="group", group_size=100),
    ob.QuantSpec("uint8", symmetric=False, strategy="group", group_size=32),
]


@needs_kernel
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.dtype}-g{s.group_size}-{'sym' if s.symmetric else 'asym'}")
@pytest.mark.parametrize("norm", [1.0, 2.0, 2.4, 3.0])
def test_native_errors_equal_the_eager_sums(spec, norm):
    data, step, low, high = _search_inputs(spec, 800)
    weight = torch.rand(data.shape, generator=torch.Generator().manual_seed(1)) * 3
    for w in (None, weight):
        eager = _eager_sums(data, w, step, low, high, spec, norm)
        for isa in kernels.available_isas(mse_kernel.NAME):
            native = mse_kernel.candidate_errors(data, w, step, low, high, norm, isa=isa)
            assert native is not None and native.shape == eager.shape
            torch.testing.assert_close(native, eager, rtol=1e-5, atol=1e-30, msg=f"{isa}, weighted: {w is not None}")
            assert bool(torch.isfinite(native).all())


@needs_kernel
@pytest.mark.parametrize("norm", [0.5, 1.0, 2.0, 2.4, 3.0, 7.3, 500.0])
def test_the_power_is_a_few_ulps_from_exact_and_keeps_the_special_values(norm):
    """With both code bounds 0 an element's error is |x|: one group per value gives |x|^norm, as
    close to the exact power as the eager ``exp(norm·log x)`` (both round ``norm·log x`` to fp32)."""
    magnitudes = torch.exp(torch.empty(1 << 16).uniform_(-25, 5, generator=torch.Generator().manual_seed(14)))
    specials = torch.tensor([0.0, 1e-42, 1e-30, 0.25, 1.0, 3.0, float("inf"), float("nan")])
    x = torch.cat([specials, magnitudes, -magnitudes])
    exact = x.double().abs().pow(norm)
    normal = (exact > 1e-30) & (exact < 1e38)
    eager = mse_grid._power_(x.abs(), norm).double()
    eager_error = float(((eager - exact).abs() / exact)[normal].max())  # fp32 rounding of norm·log x
    for isa in kernels.available_isas(mse_kernel.NAME):
        got = mse_kernel.candidate_errors(x.reshape(1, -1, 1), None, torch.ones(1, x.numel()), 0.0, 0.0, norm, isa=isa)
        got = got.reshape(-1).double()
        # the kernel rounds norm·fraction(log2 x) once more: ~norm·2^-24, a few times eager's only for large norms
        bound = (2 if norm <= 8 else 5) * eager_error + 1e-6
        assert float(((got - exact).abs() / exact)[normal].max()) < bound, isa
        assert bool((got[exact <= 1e-30] < 1e-29).all()) and bool((got[exact >= 1e38] > 9e37).all()), isa
        assert got[0] == 0 and got[6] == float("inf") and got[7].isnan(), isa


@needs_kernel
def test_scalar_bounds_give_the_same_errors_as_per_group_bounds():
    spec = SPECS[0]
    data, step, low, high = _search_inputs(spec, 512)
    uniform_low, uniform_high = _uniform_or(low), _uniform_or(high)
    assert isinstance(uniform_low, float) and isinstance(uniform_high, float)
    for isa in kernels.available_isas(mse_kernel.NAME):
        per_group = mse_kernel.candidate_errors(data, None, step, low, high, 2.4, isa=isa)
        scalar = mse_kernel.candidate_errors(data, None, step, uniform_low, uniform_high, 2.4, isa=isa)
        mixed = mse_kernel.candidate_errors(data, None, step, uniform_low, high, 2.4, isa=isa)
        assert torch.equal(per_group, scalar) and torch.equal(per_group, mixed)


@needs_kernel
def test_a_candidate_error_does_not_depend_on_the_other_candidates_of_the_call():
    """What makes the search independent of the chunking: a candidate is summed in the same order
    whether it runs alone, in a group of four or of eight."""
    spec = SPECS[1]
    data, step, low, high = _search_inputs(spec, 800)
    for isa in kernels.available_isas(mse_kernel.NAME):
        every = mse_kernel.candidate_errors(data, None, step, low, high, 2.4, isa=isa)
        for part in (slice(0, 12), slice(12, 20), slice(3, 4), slice(5, 9)):
            alone = mse_kernel.candidate_errors(data, None, step[part], low[part], high[part], 2.4, isa=isa)
            assert torch.equal(alone, every[part]), (isa, part)


@needs_kernel
@pytest.mark.parametrize("norm", [2.0, 2.4])
def test_observations_and_long_rows_cut_into_pieces_give_the_eager_sums(monkeypatch, norm):
    """(N, Q, K) with N > 1 and rows longer than a piece (per-tensor and per-token activations)."""
    monkeypatch.setattr(mse_kernel, "PIECE", 48)
    spec = ob.QuantSpec("int8", symmetric=False, strategy="tensor")
    x = torch.randn(6, 1, 200, generator=torch.Generator().manual_seed(2)) + 0.3
    flat = flatten(x.reshape(6, 200), spec, "activation")
    low, high = reduce_min_max(flat)
    data = as_groups(flat.data)
    step, lows, highs = _candidate_steps(low, high, shrink_factors(0.2, 100), spec)
    weight = torch.rand(data.shape, generator=torch.Generator().manual_seed(3))
    for w in (None, weight):
        eager = _eager_sums(data, w, step, lows, highs, spec, norm)
        for isa in kernels.available_isas(mse_kernel.NAME):
            native = mse_kernel.candidate_errors(data, w, step, lows, highs, norm, isa=isa)
            torch.testing.assert_close(native, eager, rtol=1e-5, atol=1e-30)


@needs_kernel
@pytest.mark.parametrize(
    "spec", SPECS[:3], ids=lambda s: f"{s.dtype}-g{s.group_size}-{'sym' if s.symmetric else 'asym'}"
)
@pytest.mark.parametrize("norm", [1.0, 2.0, 2.4, 3.0])
def test_direct_errors_equal_lc_search_eager_sums(spec, norm):
    """``direct``: errors in the data's units, as ``lc_search`` (imatrix_mse) measures them."""
    w = torch.randn(48, 800, generator=torch.Generator().manual_seed(10)) * torch.linspace(0.01, 1, 800)
    flat = flatten(w, spec, "weight")
    data = flat.data.float()
    low, high = reduce_min_max(flat)
    factors = torch.tensor([1 - i / 20 for i in range(20)])
    weight = torch.rand(data.shape, generator=torch.Generator().manual_seed(11)) * 2
    with kernels.disabled():
        eager = lc_search._candidate_errors(data, weight, low, high, factors, spec, norm)
    qp = ob.calculate_qparams(
        low.unsqueeze(0) * factors.reshape(-1, 1, 1), high.unsqueeze(0) * factors.reshape(-1, 1, 1), spec
    )
    step, zero_point = qp.scale.reshape(20, -1), qp.zero_point.float().reshape(20, -1)
    qmin, qmax = spec.int_range
    rows = data.reshape(1, -1, data.shape[-1])
    for isa in kernels.available_isas(mse_kernel.NAME):
        native = mse_kernel.candidate_errors(
            rows, weight.reshape(rows.shape), step, qmin - zero_point, qmax - zero_point, norm, direct=True, isa=isa
        )
        torch.testing.assert_close(native.reshape(eager.shape), eager, rtol=1e-5, atol=1e-30, msg=isa)
        if isa == kernels.available_isas(mse_kernel.NAME)[0]:  # what lc_search runs
            assert torch.equal(
                lc_search._candidate_errors(data, weight, low, high, factors, spec, norm), native.reshape(eager.shape)
            )


def _scales(name: str, x: torch.Tensor, spec: ob.QuantSpec, batches: int = 1, **knobs) -> ob.QParams:
    observer = ob.create(name, spec, **knobs)
    for i in range(batches):
        observer.observe(x * (1 + 0.1 * i))
    return observer.qparams()


@needs_kernel
@pytest.mark.parametrize("symmetric", [True, False])
def test_observer_scales_with_and_without_the_kernel_agree_on_an_llm_weight(symmetric):
    w = llm_weight(1024, 4096, seed=4)
    spec = ob.QuantSpec("int4", symmetric=symmetric, strategy="group", group_size=128)
    for name, batches in (("mse_grid", 1), ("mse_grid_moving_average", 2)):
        native = _scales(name, w, spec, batches)
        with kernels.disabled():
            eager = _scales(name, w, spec, batches)
        same = float((native.scale == eager.scale).float().mean())
        assert same >= 0.999, f"{name}: {same:.5f} of the scales identical"
        torch.testing.assert_close(native.scale, eager.scale, rtol=0.05, atol=0)


@needs_kernel
def test_imatrix_scales_with_and_without_the_kernel_agree_on_an_llm_weight():
    w = llm_weight(1024, 4096, seed=12)
    importance = torch.rand(4096, generator=torch.Generator().manual_seed(13)) + 0.05
    spec = ob.QuantSpec("int4", symmetric=True, strategy="group", group_size=128)
    native = _scales("imatrix_mse", w, spec, importance=importance)
    with kernels.disabled():
        eager = _scales("imatrix_mse", w, spec, importance=importance)
    same = float((native.scale == eager.scale).float().mean())
    assert same >= 0.999, f"{same:.5f} of the scales identical"


SMALL_CASES = [
    ob.QuantSpec("int4", symmetric=True, strategy="group", group_size=32),
    ob.QuantSpec("int4", symmetric=True, strategy="group", group_size=24),  # ragged last group
    ob.QuantSpec("int8", symmetric=False, strategy="channel"),
    ob.QuantSpec("int8", symmetric=True, strategy="tensor"),
    ob.QuantSpec("mxint8"),
]


@needs_kernel
@pytest.mark.parametrize("spec", SMALL_CASES, ids=lambda s: f"{s.dtype}-{s.strategy}-{s.symmetric}")
@pytest.mark.parametrize("norm", [2.0, 2.4])
def test_small_cases_are_identical_with_and_without_the_kernel(spec, norm):
    w = torch.randn(12, 70, generator=torch.Generator().manual_seed(5)) * torch.linspace(0.1, 2, 12).unsqueeze(1)
    native = _scales("mse_grid", w, spec, norm=norm)
    with kernels.disabled():
        eager = _scales("mse_grid", w, spec, norm=norm)
    assert torch.equal(native.min_val, eager.min_val) and torch.equal(native.max_val, eager.max_val)


@needs_kernel
def test_the_native_search_does_not_depend_on_the_chunking(monkeypatch):
    w = llm_weight(256, 1024, seed=6)
    spec = ob.QuantSpec("int4", symmetric=False, strategy="group", group_size=128)
    flat = flatten(w, spec, "weight")
    results = []
    for chunk in (1, 3, 7, 20):
        monkeypatch.setattr(mse_grid, "_chunk_size", lambda *args, chunk=chunk: chunk)
        results.append(mse_grid_search(flat, spec, patience=3))
    for low, high in results[1:]:
        assert torch.equal(low, results[0][0]) and torch.equal(high, results[0][1])
    monkeypatch.undo()
    assert torch.equal(_scales("mse_grid", w, spec, max_working_bytes=1).scale, _scales("mse_grid", w, spec).scale)


@needs_kernel
@pytest.mark.parametrize("norm", [1.0, 2.0, 2.4])
def test_all_zero_groups_give_zero_errors_and_finite_scales(norm):
    w = torch.randn(32, 256, generator=torch.Generator().manual_seed(7))
    w[:8] = 0.0
    spec = ob.QuantSpec("int4", symmetric=False, strategy="group", group_size=64)
    flat = flatten(w, spec, "weight")
    lo, hi = reduce_min_max(flat)
    data = flat.data.reshape(1, -1, 64).contiguous()
    step, low, high = _candidate_steps(lo, hi, shrink_factors(0.2, 100), spec)
    for isa in kernels.available_isas(mse_kernel.NAME):
        errors = mse_kernel.candidate_errors(data, None, step, low, high, norm, isa=isa)
        assert bool(torch.isfinite(errors).all()) and bool((errors[:, :32] == 0).all())
    qp = _scales("mse_grid", w, spec, norm=norm)
    assert bool(torch.isfinite(qp.scale).all()) and bool((qp.scale > 0).all())
    assert not bool(torch.isnan(ob.fake_quantize(w, qp, spec)).any())


@needs_kernel
def test_a_zero_step_gives_nan_errors_like_eager_and_is_never_picked(monkeypatch):
    """0/0 makes the group's errors NaN on both paths; the search reads NaN as +inf, so that group
    keeps its unshrunk range and every other group its normal pick."""
    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(8))
    w[0] = 0.0
    spec = ob.QuantSpec("int4", symmetric=True, strategy="group", group_size=64)
    flat = flatten(w, spec, "weight")
    lo, hi = reduce_min_max(flat)
    data = flat.data.reshape(1, -1, 64).contiguous()
    step, low, high = _candidate_steps(lo, hi, shrink_factors(0.2, 100), spec)
    step[:, 0] = 0.0
    eager = _eager_sums(data, None, step, low, high, spec, 2.4)
    for isa in kernels.available_isas(mse_kernel.NAME):
        native = mse_kernel.candidate_errors(data, None, step, low, high, 2.4, isa=isa)
        assert bool(native[:, 0].isnan().all()) and bool(eager[:, 0].isnan().all())
        assert bool(torch.isfinite(native[:, 1:]).all())

    original = mse_grid._candidate_steps

    def zero_first_step(*args):
        steps, lows, highs = original(*args)
        steps[:, 0] = 0.0
        return steps, lows, highs

    monkeypatch.setattr(mse_grid, "_candidate_steps", zero_first_step)
    picks = [mse_grid_search(flat, spec)]
    with kernels.disabled():
        picks.append(mse_grid_search(flat, spec))
    for low_pick, high_pick in picks:
        assert bool(torch.isfinite(low_pick).all()) and bool(torch.isfinite(high_pick).all())
        assert float(low_pick[0, 0]) == float(lo[0, 0]) and float(high_pick[0, 0]) == float(hi[0, 0])
    assert torch.equal(picks[0][0], picks[1][0]) and torch.equal(picks[0][1], picks[1][1])


@pytest.mark.parametrize(
    "spec",
    [
        ob.QuantSpec("int4", symmetric=False, strategy="group", group_size=32),
        ob.QuantSpec("uint8", symmetric=False, strategy="channel"),
        ob.QuantSpec("fp8_e4m3", strategy="group", group_size=64),
        ob.QuantSpec("mxint8"),
        ob.QuantSpec("nvfp4"),
    ],
    ids=lambda s: s.dtype,
)
def test_candidate_steps_in_one_call_equal_one_call_per_candidate(spec):
    """The fp32 scale rule gets all candidate ranges at once; the result is the per-candidate one."""
    flat = flatten(llm_weight(64, 512, seed=15), spec, "weight")
    low, high = reduce_min_max(flat)
    factors = shrink_factors(0.2, 100)
    steps, lows, highs = _candidate_steps(low, high, factors, spec)
    qmin, qmax = spec.int_range if spec.format.kind == "int" else (0, 0)
    for row, p in enumerate(factors):
        qp = ob.calculate_qparams(low * p, high * p, spec)
        zero_point = qp.zero_point.expand_as(low).float().reshape(-1)
        assert torch.equal(steps[row], qp.effective_scale.expand_as(low).reshape(-1))
        assert torch.equal(lows[row], qmin - zero_point) and torch.equal(highs[row], qmax - zero_point)


@pytest.mark.parametrize(
    ("why", "data", "weight"),
    [
        ("float64", torch.randn(1, 8, 32, dtype=torch.float64), None),
        ("not contiguous", torch.randn(1, 32, 8).transpose(1, 2), None),
        ("weight of another shape", torch.randn(1, 8, 32), torch.ones(1, 8, 16)),
        ("float16 weight", torch.randn(1, 8, 32), torch.ones(1, 8, 32, dtype=torch.float16)),
        ("not (N, Q, K)", torch.randn(8, 32), None),
    ],
)
def test_inputs_the_kernel_leaves_to_eager(why, data, weight):
    groups = data.shape[-2]
    step = torch.ones(3, groups)
    assert not mse_kernel.usable(data, weight), why
    assert mse_kernel.candidate_errors(data, weight, step, -8.0, 7.0, 2.4) is None, why


@needs_kernel
def test_disabled_block_takes_the_eager_path():
    data, step, low, high = _search_inputs(SPECS[0], 256)
    assert mse_kernel.candidate_errors(data, None, step, low, high, 2.4) is not None
    with kernels.disabled():
        assert not mse_kernel.usable(data, None)
        assert mse_kernel.candidate_errors(data, None, step, low, high, 2.4) is None
    with pytest.raises(ValueError, match="does not run here"):
        mse_kernel.candidate_errors(data, None, step, low, high, 2.4, isa="neon")


@pytest.mark.parametrize(
    ("shape", "spec", "kind", "block"),
    [
        ((64, 300), ob.QuantSpec(dtype="int8", symmetric=False, strategy="tensor"), "activation", 1000),
        ((2, 5000), ob.QuantSpec(dtype="int4", symmetric=True, strategy="tensor"), "weight", 1000),
        ((6, 96), ob.QuantSpec(dtype="int4", symmetric=False, strategy="group", group_size=32), "weight", 50),
    ],
    ids=["split-observations", "split-elements", "asymmetric-groups"],
)
def test_the_eager_blocks_still_give_the_native_result(monkeypatch, shape, spec, kind, block):
    """The eager fallback's partial-sum paths (a group spread over several blocks), now that int
    formats take the kernel by default."""
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(9)) * 0.1 + 0.03
    observer = ob.create("mse_grid", spec, kind=kind)
    observer.observe(x)
    native = observer.qparams()
    monkeypatch.setattr(mse_grid, "_BLOCK_ELEMENTS", block)
    with kernels.disabled():
        observer = ob.create("mse_grid", spec, kind=kind)
        observer.observe(x)
        eager = observer.qparams()
    assert torch.equal(native.min_val, eager.min_val) and torch.equal(native.max_val, eager.max_val)


def test_without_the_kernel_the_search_runs_eager(monkeypatch):
    monkeypatch.setenv("OBSERVERS_NATIVE", "0")
    kernels.reset()
    try:
        assert kernels.status(mse_kernel.NAME) == "eager: native kernel disabled by OBSERVERS_NATIVE=0"
        assert kernels.available_isas(mse_kernel.NAME) == []
        data = torch.randn(1, 64, 32)
        assert not mse_kernel.usable(data, None)
        qp = _scales("mse_grid", torch.randn(16, 64), ob.QuantSpec("int4", strategy="group", group_size=32))
        assert bool(torch.isfinite(qp.scale).all())
    finally:
        monkeypatch.undo()
        kernels.reset()
