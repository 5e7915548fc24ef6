"""The native binning kernel of the running histograms (observers/hist_kernel.py): the same
counts as the eager path bit for bit, every variant and thread split, the same qparams for
every histogram observer, and a clear refusal of inputs it cannot read. Last, the shortcuts of
the L2 search made with it (observers/hist_search.py) against their plain forms."""

import ctypes
import ctypes.util
import mmap
import shutil
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import observers as ob
from observers import hist_kernel, kernels
from observers import hist_search as hs
from observers.hist_state import _bin_transform, _eager_counts, update_histogram

needs_kernel = pytest.mark.skipif(
    not kernels.available_isas(hist_kernel.NAME),
    reason=f"row-histogram kernel not in use here: {kernels.status(hist_kernel.NAME)}",
)


def _cpu_has(*flags: str) -> bool:
    with open("/proc/cpuinfo") as cpuinfo:
        words = set(cpuinfo.read().split())
    return all(flag in words for flag in flags)


def test_kernel_is_built_where_a_compiler_avx2_and_fma_exist():
    line = kernels.status(hist_kernel.NAME)
    if any(shutil.which(name) for name in ("cc", "gcc", "clang")) and _cpu_has("avx2", "fma"):
        assert line.startswith("native ("), line
        assert "avx2" in kernels.available_isas(hist_kernel.NAME)
    else:
        assert line.startswith("eager: "), line
        assert kernels.available_isas(hist_kernel.NAME) == []


def _transform(lo: list[float], width: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    return _bin_transform(torch.tensor(lo, dtype=torch.float64), torch.tensor(width, dtype=torch.float64))


@pytest.fixture
def every_call_splits(monkeypatch):
    """Give even small inputs one thread per torch thread, so the thread splits are exercised."""
    monkeypatch.setattr(kernels, "ELEMENTS_PER_THREAD", 1)


def _assert_every_variant_matches(values, scale, shift, bins: int, absolute: bool) -> None:
    eager = _eager_counts(values, scale, shift, bins, absolute)
    assert int(eager.sum()) == values.numel()
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for isa in kernels.available_isas(hist_kernel.NAME):
                native = hist_kernel.row_histogram(values, scale, shift, bins, absolute, isa)
                assert native.dtype == torch.int64 and native.shape == eager.shape
                assert torch.equal(native, eager), f"{isa}, {threads} threads, absolute={absolute}"
    finally:
        torch.set_num_threads(before)


@needs_kernel
@pytest.mark.parametrize("absolute", [False, True])
@pytest.mark.parametrize(
    "rows,n",
    [(1, 1), (1, 15), (1, 17), (1, 33), (1, 100_003), (3, 70_001), (64, 999), (300, 37)],
    ids=lambda v: str(v),
)
def test_counts_equal_eager_for_one_and_many_rows(rows, n, absolute, every_call_splits):
    g = torch.Generator().manual_seed(rows * 1000 + n)
    values = torch.randn(rows, n, generator=g) * torch.logspace(-2, 2, rows).unsqueeze(1)
    values[:, ::7] = 0.0  # a spike of equal values: the interleaved copies' case
    lo = [(-0.5 if absolute else -2.0) * float(s) for s in torch.logspace(-2, 2, rows)]
    width = [3.7 * float(s) / 2048 for s in torch.logspace(-2, 2, rows)]
    scale, shift = _transform(lo, width)
    _assert_every_variant_matches(values, scale, shift, 2048, absolute)


@needs_kernel
@pytest.mark.parametrize("absolute", [False, True])
def test_values_on_bin_edges_and_beyond_both_ends(absolute, every_call_splits):
    bins = 64
    lo, width = 0.25 if absolute else -1.0, 2.0 / bins  # every edge is an exact fp32 value
    edges = lo + width * torch.arange(-3, bins + 4, dtype=torch.float32)
    values = torch.cat([edges, -edges, torch.tensor([-0.0, 0.0, 1e30, -1e30, 3.4e38, -3.4e38, 1e-40])])
    values = values.repeat(1, 5)[:, :-3].contiguous()  # 742 values: not a multiple of 16 or 8
    scale, shift = _transform([lo], [width])
    _assert_every_variant_matches(values, scale, shift, bins, absolute)
    counts = hist_kernel.row_histogram(values, scale, shift, bins, absolute)
    assert int(counts[0, 0]) > 0 and int(counts[0, -1]) > 0


@needs_kernel
@pytest.mark.parametrize("bins", [1, 2, 3, 1008, 2048, 4200])
def test_odd_bin_counts_and_a_flat_row(bins, every_call_splits):
    g = torch.Generator().manual_seed(bins)
    values = torch.randn(2, 50_001, generator=g)
    scale, shift = _transform([-3.0, 0.5], [6.0 / bins, 0.0])  # the second row is flat: all in bin 0
    _assert_every_variant_matches(values, scale, shift, bins, False)
    assert int(hist_kernel.row_histogram(values, scale, shift, bins)[1, 0]) == 50_001


@needs_kernel
@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, 9),
    n=st.integers(1, 3000),
    bins=st.integers(1, 3000),
    magnitude=st.floats(1e-6, 1e6),
    offset=st.floats(-2.0, 2.0),
    absolute=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_property_counts_equal_eager_where_fma_rounding_decides(rows, n, bins, magnitude, offset, absolute, seed):
    g = torch.Generator().manual_seed(seed)
    values = torch.randn(rows, n, generator=g) * magnitude
    lo = [(offset - 2.0) * magnitude] * rows
    width = [float(w) * magnitude / bins for w in torch.rand(rows, generator=g).add(0.1) * 4]
    scale, shift = _transform(lo, width)
    _assert_every_variant_matches(values, scale, shift, bins, absolute)


def _growing_batches(shape: tuple[int, ...], count: int = 4) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(sum(shape))
    batches = []
    for i in range(count):
        x = torch.randn(*shape, generator=g) * 1.7**i
        x[..., :2] *= 20  # outlier channels
        x[..., 5] = 0.0
        batches.append(x)
    return batches


def _qparams(name: str, spec: ob.QuantSpec, batches: list[torch.Tensor]) -> ob.QParams:
    obs = ob.create(name, spec, kind="activation", bins=512)
    for x in batches:
        obs.observe(x)
    return obs.qparams()


@needs_kernel
@pytest.mark.parametrize("name", ["histogram", "percentile", "mse", "entropy"])
@pytest.mark.parametrize("strategy", ["tensor", "channel"])
@pytest.mark.parametrize("symmetric", [True, False])
def test_observer_qparams_are_identical_with_and_without_the_kernel(name, strategy, symmetric):
    spec = ob.QuantSpec(dtype="int8", symmetric=symmetric, strategy=strategy)
    batches = _growing_batches((600, 96) if strategy == "tensor" else (300, 24))
    assert hist_kernel.native_counts(torch.randn(2, 8), torch.ones(2), torch.zeros(2), 4) is not None
    native = _qparams(name, spec, batches)
    with kernels.disabled():
        assert hist_kernel.native_counts(torch.randn(2, 8), torch.ones(2), torch.zeros(2), 4) is None
        eager = _qparams(name, spec, batches)
    for field in ("scale", "zero_point", "min_val", "max_val"):
        assert torch.equal(getattr(native, field), getattr(eager, field)), field


@needs_kernel
def test_absolute_histogram_counts_match_the_eager_path_after_growth():
    batches = _growing_batches((1, 40_000), count=5)
    native = eager = None
    for x in batches:
        native = update_histogram(native, x, 2048, absolute=True)
        with kernels.disabled():
            eager = update_histogram(eager, x, 2048, absolute=True)
    assert torch.equal(native.counts, eager.counts) and torch.equal(native.width, eager.width)
    assert float(native.counts.sum()) == 5 * 40_000


@needs_kernel
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mprotect through ctypes: Linux only here")
@pytest.mark.parametrize("rows,n", [(1, 1000), (2, 500), (1, 7)])
def test_values_that_end_where_memory_becomes_unreadable(rows, n, every_call_splits):
    """The values end exactly at a page that may not be read. The tail's masked loads stop at the
    last value, and the prefetch 4 KiB ahead of the counting names that page (with 4 KiB pages,
    every prefetch of a row this short does) without faulting: the eager path's counts, no crash."""
    page = mmap.PAGESIZE
    region = mmap.mmap(-1, 2 * page)
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    start = ctypes.addressof(ctypes.c_char.from_buffer(region))
    assert libc.mprotect(ctypes.c_void_p(start + page), ctypes.c_size_t(page), 0) == 0, ctypes.get_errno()  # PROT_NONE
    try:
        count = rows * n
        values = torch.frombuffer(region, dtype=torch.float32, count=count, offset=page - 4 * count).view(rows, n)
        values.copy_(torch.randn(rows, n, generator=torch.Generator().manual_seed(n)))
        scale, shift = _transform([-3.0] * rows, [6.0 / 2048] * rows)
        _assert_every_variant_matches(values, scale, shift, 2048, False)
    finally:
        libc.mprotect(ctypes.c_void_p(start + page), ctypes.c_size_t(page), 3)  # PROT_READ | PROT_WRITE


@pytest.mark.parametrize(
    "why,values,vector",
    [
        ("float64", torch.randn(2, 64, dtype=torch.float64), torch.ones(2)),
        ("not contiguous", torch.randn(64, 2).t(), torch.ones(2)),
        ("one dimension", torch.randn(64), torch.ones(64)),
        ("scale of another length", torch.randn(2, 64), torch.ones(3)),
        ("float64 scale", torch.randn(2, 64), torch.ones(2, dtype=torch.float64)),
    ],
)
def test_inputs_the_kernel_leaves_to_eager(why, values, vector):
    assert hist_kernel.native_counts(values, vector, vector, 16) is None, why


def test_row_histogram_rejects_what_it_cannot_read():
    values, vector = torch.randn(2, 64), torch.ones(2)
    if not kernels.available_isas(hist_kernel.NAME):
        with pytest.raises(RuntimeError, match="not in use"):
            hist_kernel.row_histogram(values, vector, vector, 16)
        return
    with pytest.raises(ValueError, match="contiguous float32 CPU"):
        hist_kernel.row_histogram(values.t(), torch.ones(64), torch.ones(64), 16)
    with pytest.raises(ValueError, match="contiguous float32 CPU"):
        hist_kernel.row_histogram(values.double(), vector, vector, 16)
    with pytest.raises(ValueError, match="scale/shift"):
        hist_kernel.row_histogram(values, torch.ones(3), vector, 16)
    with pytest.raises(ValueError, match="bins"):
        hist_kernel.row_histogram(values, vector, vector, 0)
    with pytest.raises(ValueError, match="does not run here|available"):
        hist_kernel.row_histogram(values, vector, vector, 16, isa="neon")


# --- the L2 search's shortcuts (observers/hist_search.py), sped up alongside the kernel --------


def _search_histograms() -> list:
    g = torch.Generator().manual_seed(9)
    spike = torch.cat([torch.zeros(1, 30_000), torch.randn(1, 10_000, generator=g)], dim=1)
    heavy = torch.randn(1, 40_000, generator=g) / torch.rand(1, 40_000, generator=g).add(0.05)
    channels = torch.randn(6, 3_000, generator=g) * torch.rand(6, 3_000, generator=g).pow(2)
    return [update_histogram(None, x, bins) for x, bins in ((spike, 2048), (heavy, 512), (channels, 2048))]


def _cell_by_cell_l2(counts, moments, start, end, levels: int) -> torch.Tensor:
    """The error summed cell by cell from cumulative moments at every bound (the textbook form)."""
    p0, p1, p2 = moments
    rows, bins = counts.shape
    step = (end - start) / levels
    j = torch.arange(levels + 1, dtype=torch.float64)
    bounds = start.unsqueeze(-1) + j * step.unsqueeze(-1)
    bounds[..., 0], bounds[..., -1] = 0.0, float(bins)
    centres = start.unsqueeze(-1) + (j[:-1] + 0.5) * step.unsqueeze(-1)
    k = bounds.floor().clamp(max=bins - 1)
    at = lambda table: torch.gather(table, 1, k.long().view(rows, -1)).view(bounds.shape)  # noqa: E731
    c = at(counts)
    g0 = at(p0) + c * (bounds - k)
    g1 = at(p1) + c * (bounds**2 - k**2) / 2
    g2 = at(p2) + c * (bounds**3 - k**3) / 3
    d0, d1, d2 = g0.diff(dim=-1), g1.diff(dim=-1), g2.diff(dim=-1)
    return (d2 - 2 * centres * d1 + centres**2 * d0).sum(dim=-1)


@pytest.mark.parametrize("levels", [2, 16, 256])
def test_exact_l2_by_parts_equals_the_cell_by_cell_sum(levels):
    g = torch.Generator().manual_seed(levels)
    for hist in _search_histograms():
        rows, bins = hist.counts.shape
        moments = hs._prefix_moments(hist.counts)
        start = torch.randint(0, bins // 2, (rows, 40), generator=g).double()
        end = start + torch.randint(1, bins // 2, (rows, 40), generator=g).double()
        ours = hs.exact_l2(hist.counts, moments, start, end, levels)
        assert torch.allclose(ours, _cell_by_cell_l2(hist.counts, moments, start, end, levels), rtol=1e-9)


def _refine_rescoring_every_window(counts, moments, start, end, error, levels: int, radius: int):
    """The descent without its shortcuts: every round scores the whole window."""
    bins = counts.shape[1]
    for _ in range(8):
        cand_start, cand_end = hs._window_pairs(start, end, radius, 1)
        valid = (cand_start >= 0) & (cand_end <= bins) & (cand_end > cand_start)
        scored = hs.exact_l2(counts, moments, cand_start.clamp(0, bins - 1), cand_end.clamp(1, bins), levels)
        value, pick = torch.where(valid, scored, torch.inf).min(dim=1, keepdim=True)
        better = value.squeeze(1) < error
        if not bool(better.any()):
            break
        start = torch.where(better, cand_start.gather(1, pick).squeeze(1), start)
        end = torch.where(better, cand_end.gather(1, pick).squeeze(1), end)
        error = torch.where(better, value.squeeze(1), error)
    return start, end


@pytest.mark.parametrize("offset", [(9, 0), (0, -9), (-9, 9), (5, -10), (13, 13), (-2, 1), (-300, 250)])
def test_refine_scoring_only_new_candidates_picks_what_rescoring_every_window_picks(offset):
    for hist in _search_histograms():
        counts = hist.counts
        rows, bins = counts.shape
        moments = hs._prefix_moments(counts)
        best_start, best_end = hs.l2_range_search(hist, 256)
        start = (best_start + offset[0]).clamp(0, bins // 2)
        end = (best_end + offset[1]).clamp(bins // 2 + 1, bins)
        error = hs.exact_l2(counts, moments, start.unsqueeze(1), end.unsqueeze(1), 256).squeeze(1)
        radius = hs._polish_radius(rows, 256)
        assert radius == 8  # <= 40 rows: the widest window
        ours = hs._refine_exact(counts, moments, start, end, error, 256, radius)
        reference = _refine_rescoring_every_window(counts, moments, start, end, error, 256, radius)
        assert torch.equal(ours[0], reference[0]) and torch.equal(ours[1], reference[1])


def test_screen_grid_blocks_give_the_same_best_pairs_at_any_block_size():
    for hist in _search_histograms():
        rows, bins = hist.counts.shape
        terms = hs._edge_terms(hs._prefix_moments(hist.counts))
        step = hs._first_step(rows, bins)
        edges, score, end = hs._screen_grid(terms, step, 256)
        for chunk in (1, 1 << 12, 1 << 20):
            other = hs._screen_grid(terms, step, 256, chunk)
            assert torch.equal(other[0], edges) and torch.equal(other[1], score) and torch.equal(other[2], end)
