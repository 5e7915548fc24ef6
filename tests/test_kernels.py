"""The native one-read min-max kernel (observers/kernels.py): same numbers as eager torch on
every layout it takes, NaN/Inf flagged per group, a clear eager fallback when it cannot run."""

import math
import shutil

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import observers as ob
from observers import kernels
from observers.granularity import flatten, reduce_min_max


@pytest.fixture
def fresh_kernel(monkeypatch):
    """Let a test change the environment the kernel is loaded from; reload it afterwards."""
    kernels.reset()
    yield monkeypatch
    monkeypatch.undo()
    kernels.reset()


def _eager(data: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    dims = (0, data.ndim - 1)
    return data.amin(dim=dims), data.amax(dim=dims)


def _cpu_has_avx2() -> bool:
    with open("/proc/cpuinfo") as cpuinfo:
        return " avx2" in cpuinfo.read()


def test_kernel_is_built_and_used_where_a_compiler_and_avx2_exist():
    line = kernels.status()
    if any(shutil.which(name) for name in ("cc", "gcc", "clang")) and _cpu_has_avx2():
        assert line.startswith("native ("), line
        assert "avx2" in kernels.available_isas()
    else:
        assert line.startswith("eager: "), line
        assert kernels.available_isas() == []


needs_kernel = pytest.mark.skipif(
    not kernels.available_isas(), reason="kernel not in use here (see the test above for why): eager path only"
)


@needs_kernel
@pytest.mark.parametrize("run", [16, 17, 31, 32, 100, 128, 130, 1000])
def test_every_variant_equals_amin_amax(run):
    g = torch.Generator().manual_seed(run)
    runs = torch.randn(257, run, generator=g) * torch.logspace(-3, 3, 257).unsqueeze(1)
    runs[3] = -5.0
    runs[4] = 0.0
    runs[5, : run // 2] = -0.0
    for isa in kernels.available_isas():
        low, high = kernels.run_min_max(runs, isa)
        assert torch.equal(low, runs.amin(1)), isa
        assert torch.equal(high, runs.amax(1)), isa


@needs_kernel
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("position", [0, 15, 16, 127])
@pytest.mark.parametrize("run", [128, 130])  # sixteen runs at a time (multiples of 32) and one by one
@pytest.mark.parametrize("row", [7, 66])  # inside a block of sixteen runs, and in the rows after the last block
def test_a_nonfinite_value_makes_its_group_nan_and_leaves_others_exact(bad, position, run, row):
    runs = torch.randn(69, run, generator=torch.Generator().manual_seed(1))
    runs[row, position] = bad
    for isa in kernels.available_isas():
        low, high = kernels.run_min_max(runs, isa)
        assert math.isnan(low[row]) and math.isnan(high[row]), isa
        keep = torch.arange(69) != row
        assert torch.equal(low[keep], runs[keep].amin(1)) and torch.equal(high[keep], runs[keep].amax(1))


@needs_kernel
@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 300),
    run=st.one_of(st.integers(16, 300), st.sampled_from([32, 64, 128, 256])),
    magnitude=st.floats(1e-30, 1e30),
    seed=st.integers(0, 2**31 - 1),
    threads=st.integers(1, 4),
)
def test_property_kernel_equals_eager_for_any_shape_scale_and_thread_count(rows, run, magnitude, seed, threads):
    runs = torch.randn(rows, run, generator=torch.Generator().manual_seed(seed)) * magnitude
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for isa in kernels.available_isas():
            low, high = kernels.run_min_max(runs, isa)
            assert torch.equal(low, runs.amin(1)) and torch.equal(high, runs.amax(1))
    finally:
        torch.set_num_threads(before)


def _layouts():
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(512, 1000, generator=g)
    activation = torch.randn(3, 200, 384, generator=g)
    return [
        ("weight group 128, ragged", weight, ob.QuantSpec(dtype="int4", strategy="group", group_size=128), "weight"),
        ("weight group 32", weight, ob.QuantSpec(dtype="int4", strategy="group", group_size=32), "weight"),
        ("weight tensor", weight, ob.QuantSpec(dtype="int8", strategy="tensor"), "weight"),
        ("weight per output channel", weight, ob.QuantSpec(dtype="int8", strategy="channel"), "weight"),
        ("activation tensor", activation, ob.QuantSpec(dtype="int8", strategy="tensor"), "activation"),
        ("activation token", activation, ob.QuantSpec(dtype="int8", strategy="token"), "activation"),
        ("activation group 64", activation, ob.QuantSpec(dtype="int4", strategy="group", group_size=64), "activation"),
        ("mxfp4 blocks of 32, ragged", weight, ob.QuantSpec(dtype="mxfp4"), "weight"),
    ]


@needs_kernel
@pytest.mark.parametrize("name,x,spec,kind", _layouts(), ids=[layout[0] for layout in _layouts()])
def test_layouts_the_kernel_takes_give_the_eager_result(name, x, spec, kind):
    flat = flatten(x, spec, kind)
    native = kernels.group_min_max(flat.data)
    assert native is not None, f"{name}: expected the native path"
    low, high = _eager(flat.data)
    assert torch.equal(native[0], low) and torch.equal(native[1], high)
    assert torch.equal(reduce_min_max(flat)[0], low.reshape(flat.qparam_shape))


def test_a_per_tensor_run_too_long_for_one_thread_is_cut_into_sub_runs():
    assert kernels._sub_run(128) == 128
    assert kernels._sub_run(4096 * 4096) == kernels.MAX_RUN
    size = kernels._sub_run(1000 * 1024)
    assert size is not None and 1024 <= size <= kernels.MAX_RUN and (1000 * 1024) % size == 0
    assert kernels._sub_run(2 * 1_000_003) is None  # no divisor in range: eager


@pytest.mark.parametrize(
    "why,data",
    [
        ("too small", torch.randn(1, 10, 128)),
        ("float16", torch.randn(1, 1024, 128).half()),
        ("run of one (per-feature view)", torch.randn(2048, 64, 1)),
        ("not contiguous (per input channel)", torch.randn(512, 512).t().reshape(1, 1, 512, 512)[..., ::2]),
    ],
)
def test_layouts_the_kernel_leaves_to_eager(why, data):
    assert kernels.group_min_max(data) is None, why


def test_run_min_max_rejects_what_it_cannot_read():
    if not kernels.available_isas():
        with pytest.raises(RuntimeError, match="not in use"):
            kernels.run_min_max(torch.randn(4, 16))
        return
    with pytest.raises(ValueError, match="contiguous float32 CPU"):
        kernels.run_min_max(torch.randn(16, 4).t())
    with pytest.raises(ValueError, match="contiguous float32 CPU"):
        kernels.run_min_max(torch.randn(4, 16, dtype=torch.float64))
    with pytest.raises(ValueError, match="at least one element"):
        kernels.run_min_max(torch.randn(0, 16))
    with pytest.raises(ValueError, match="does not run here|available"):
        kernels.run_min_max(torch.randn(4, 16), isa="neon")


def _minmax_qparams(x: torch.Tensor, spec: ob.QuantSpec, **knobs) -> ob.QParams:
    observer = ob.create("memoryless_minmax", spec, kind="weight", **knobs)
    observer.observe(x)
    return observer.qparams()


def test_observer_qparams_are_identical_with_and_without_the_kernel(fresh_kernel):
    w = torch.randn(1024, 4096, generator=torch.Generator().manual_seed(3)) * 0.02
    spec = ob.QuantSpec(dtype="int4", symmetric=True, strategy="group", group_size=128)
    native = _minmax_qparams(w, spec)
    fresh_kernel.setenv("OBSERVERS_NATIVE", "0")
    kernels.reset()
    assert kernels.status() == "eager: native kernel disabled by OBSERVERS_NATIVE=0"
    assert kernels.group_min_max(flatten(w, spec, "weight").data) is None
    eager = _minmax_qparams(w, spec)
    assert torch.equal(native.scale, eager.scale) and torch.equal(native.min_val, eager.min_val)


@needs_kernel
def test_observers_native_avx2_runs_the_avx2_variants_and_a_bad_value_is_named(fresh_kernel):
    fresh_kernel.setenv("OBSERVERS_NATIVE", "avx2")
    kernels.reset()
    assert kernels.available_isas() == ["avx2"]
    assert kernels.in_use("group_min_max")[1] == "avx2"
    assert kernels.status().startswith("native (avx2")
    data = torch.randn(1, 256, 8, 128)
    low, high = kernels.group_min_max(data)
    want_low, want_high = _eager(data)
    assert torch.equal(low, want_low) and torch.equal(high, want_high)
    fresh_kernel.setenv("OBSERVERS_NATIVE", "fast")
    kernels.reset()
    with pytest.raises(ValueError, match="OBSERVERS_NATIVE must be one of 0 .*avx2.*got 'fast'"):
        kernels.status()


@needs_kernel
def test_disabled_block_takes_the_eager_path_and_restores_the_kernel_after():
    data = torch.randn(1, 256, 8, 128)
    with kernels.disabled():
        assert kernels.group_min_max(data) is None
        with kernels.disabled():
            pass
        assert kernels.group_min_max(data) is None
    assert kernels.group_min_max(data) is not None


@needs_kernel
def test_nonfinite_weight_on_the_native_path_is_reported_or_ignored_like_on_the_eager_path(fresh_kernel):
    w = torch.randn(512, 1024, generator=torch.Generator().manual_seed(4))
    w[10, 5] = math.nan
    w[300, 700] = math.inf
    spec = ob.QuantSpec(dtype="int4", strategy="group", group_size=128)
    assert kernels.group_min_max(flatten(w, spec, "weight").data) is not None
    with pytest.raises(ValueError, match="has 2 non-finite value"):
        _minmax_qparams(w, spec)
    native = _minmax_qparams(w, spec, ignore_nonfinite=True)
    assert bool(torch.isfinite(native.scale).all()) and bool((native.scale > 0).all())
    fresh_kernel.setenv("OBSERVERS_NATIVE", "0")
    kernels.reset()
    eager = _minmax_qparams(w, spec, ignore_nonfinite=True)
    assert torch.equal(native.scale, eager.scale) and torch.equal(native.max_val, eager.max_val)


def test_without_a_compiler_everything_runs_eager(fresh_kernel):
    fresh_kernel.setenv("CC", "no-such-compiler-xyz")
    kernels.reset()
    assert kernels.status().startswith("eager: no C compiler found")
    assert kernels.available_isas() == []
    w = torch.randn(256, 1024)
    assert kernels.group_min_max(w.reshape(1, 256, 8, 128)) is None
    qp = _minmax_qparams(w, ob.QuantSpec(dtype="int8", strategy="channel"))
    assert torch.equal(qp.min_val.flatten(), w.amin(1)) and torch.equal(qp.max_val.flatten(), w.amax(1))


def test_a_failing_build_falls_back_with_the_reason(fresh_kernel, tmp_path):
    fresh_kernel.setenv("CC", shutil.which("false") or "false")
    fresh_kernel.setenv("OBSERVERS_CACHE_DIR", str(tmp_path))
    kernels.reset()
    line = kernels.status()
    assert line.startswith("eager: native kernel unavailable") and "failed" in line, line
    assert list(tmp_path.iterdir()) == []  # no half-written library left behind


@needs_kernel
def test_the_library_is_built_once_into_the_cache_folder(fresh_kernel, tmp_path):
    fresh_kernel.setenv("OBSERVERS_CACHE_DIR", str(tmp_path))
    kernels.reset()
    assert kernels.status().startswith("native")
    built = list(tmp_path.glob("group_min_max-*.so"))
    assert len(built) == 1
    stamp = built[0].stat().st_mtime_ns
    kernels.reset()
    assert kernels.status().startswith("native")
    assert [p.stat().st_mtime_ns for p in tmp_path.glob("group_min_max-*.so")] == [stamp]


def test_the_temp_folder_fallback_must_be_private(fresh_kernel, tmp_path):
    fresh_kernel.delenv("OBSERVERS_CACHE_DIR", raising=False)
    fresh_kernel.setenv("HOME", "/proc/no-home-here")
    fresh_kernel.setenv("USER", "tester")
    fresh_kernel.setattr("tempfile.tempdir", str(tmp_path))
    private = tmp_path / "observer-lab-tester"
    assert kernels._cache_dir() == private
    assert private.stat().st_mode & 0o777 == 0o700
    private.chmod(0o777)  # as if someone else had prepared it for us: never load from there
    with pytest.raises(OSError, match="no writable cache folder"):
        kernels._cache_dir()
    if kernels._compiler() is not None:
        kernels.reset()
        assert kernels.status().startswith("eager: native kernel unavailable (no writable cache folder")


def test_small_calls_stay_on_one_thread_and_large_ones_split():
    before = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        assert kernels.threads_for(kernels.ELEMENTS_PER_THREAD - 1) == 1
        assert kernels.threads_for(3 * kernels.ELEMENTS_PER_THREAD) == 3
        assert kernels.threads_for(100 * kernels.ELEMENTS_PER_THREAD) == 4
    finally:
        torch.set_num_threads(before)


@needs_kernel
@pytest.mark.parametrize("run", [128, 130])
def test_a_call_split_over_several_threads_equals_eager(run):
    """Big enough for 4 threads (rows not a multiple of 16, so the last rows go one by one)."""
    runs = torch.randn(4 * kernels.ELEMENTS_PER_THREAD // run + 7, run, generator=torch.Generator().manual_seed(3))
    runs[-3, 5] = math.nan
    before = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        for isa in kernels.available_isas():
            low, high = kernels.run_min_max(runs, isa)
            assert math.isnan(low[-3]) and math.isnan(high[-3])
            low[-3] = high[-3] = 0.0
            runs[-3] = 0.0
            assert torch.equal(low, runs.amin(1)) and torch.equal(high, runs.amax(1)), isa
            runs[-3, 5] = math.nan
    finally:
        torch.set_num_threads(before)
