"""histogram, percentile, mse and entropy: torch.ao parity, ModelOpt semantics, properties."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.ao.quantization.observer import HistogramObserver as TaoHistogramObserver

import observers as ob
from observers.hist_search import l2_range_search
from observers.hist_state import update_histogram
from observers.mse_grid import fake_quant_batched

HIST_NAMES = ("histogram", "percentile", "mse", "entropy")


def _amax(qp) -> float:
    """The symmetric range's half-width (ends are clipped separately to the observed min/max)."""
    return max(-float(qp.min_val.min()), float(qp.max_val.max()))


def _data(kind: str, n: int = 50_000, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if kind == "gauss":
        return torch.randn(n, generator=gen)
    if kind == "heavy":
        return torch.randn(n, generator=gen) * torch.rand(n, generator=gen).pow(3) * 4
    return torch.relu(torch.randn(n, generator=gen)) + torch.randn(n, generator=gen).abs().pow(4) * 0.1


# --- histogram (L2) vs torch.ao -------------------------------------------------------------


@pytest.mark.parametrize("kind", ["gauss", "heavy", "relu"])
def test_l2_range_error_is_at_most_torch_ao(kind):
    x = _data(kind)
    tao = TaoHistogramObserver()
    tao(x)
    tao_min, tao_max = tao._non_linear_param_search()
    width = float(tao.max_val - tao.min_val) / tao.bins
    tao_start = round(float(tao_min - tao.min_val) / width)
    tao_end = round(float(tao_max - tao.min_val) / width) - 1
    hist = update_histogram(None, x.reshape(1, -1), 2048)
    assert float((hist.counts[0] - tao.histogram.double()).abs().sum()) <= 1e-3 * x.numel()
    start, end = l2_range_search(hist, 256)
    ours = tao._compute_quantization_error(int(start), int(end) - 1)
    theirs = tao._compute_quantization_error(tao_start, tao_end)
    assert ours <= theirs * (1 + 1e-6)


def test_histogram_observer_range_inside_observed_and_qparams_close_to_torch_ao():
    x = _data("gauss", seed=3)
    spec = ob.QuantSpec(dtype="uint8", symmetric=False)
    obs = ob.create("histogram", spec, kind="activation")
    obs.observe(x)
    qp = obs.qparams()
    assert float(x.min()) <= float(qp.min_val) and float(qp.max_val) <= float(x.max())
    tao = TaoHistogramObserver()
    tao(x)
    tao_scale, _ = tao.calculate_qparams()
    assert float(qp.scale) == pytest.approx(float(tao_scale), rel=0.1)


@pytest.mark.filterwarnings("ignore:imatrix_mse got no importance")
def test_histogram_rejects_float_formats_and_groups():
    with pytest.raises(ValueError, match="integer"):
        ob.create("histogram", ob.QuantSpec(dtype="fp8_e4m3"))
    for name in HIST_NAMES:
        with pytest.raises(ValueError, match="strategy"):
            ob.create(name, ob.QuantSpec(dtype="int8", strategy="group", group_size=32))
    results = ob.run_suite(torch.randn(4, 64), ob.QuantSpec(dtype="int4", strategy="group", group_size=32))
    by_name = {r.name: r for r in results}
    assert all(by_name[n].error for n in HIST_NAMES)


# --- running histogram ------------------------------------------------------------------------


@given(
    seed=st.integers(0, 10_000),
    scales=st.lists(st.floats(0.01, 100.0), min_size=1, max_size=5),
    shifts=st.lists(st.floats(-50.0, 50.0), min_size=5, max_size=5),
    bins=st.sampled_from([16, 64, 2048]),
)
@settings(max_examples=40, deadline=None)
def test_rebinning_keeps_counts_and_each_value_within_one_bin(seed, scales, shifts, bins):
    gen = torch.Generator().manual_seed(seed)
    batches = [torch.randn(1, 300, generator=gen) * s + shifts[i] for i, s in enumerate(scales)]
    hist = None
    for batch in batches:
        hist = update_histogram(hist, batch, bins)
    allx = torch.cat(batches, dim=1).double().flatten()
    assert float(hist.counts.sum()) == allx.numel()
    edges = hist.edges()[0]
    assert float(edges[0]) <= float(allx.min()) and float(allx.max()) <= float(edges[-1]) + 1e-6 * float(
        edges[-1].abs() + 1
    )
    ours = torch.cumsum(hist.counts[0], 0)
    below_prev = (allx.unsqueeze(0) < edges[:-1].unsqueeze(1) - 1e-9).sum(1).double()
    upto_next = torch.cat([(allx.unsqueeze(0) < edges[2:].unsqueeze(1) + 1e-9).sum(1).double(), ours[-1:]])
    # Each value is counted in its own bin or a neighbour: the cumulative counts stay in that band.
    assert bool((ours >= below_prev).all()) and bool((ours <= upto_next).all())


def test_all_zero_first_batch_then_data():
    hist = update_histogram(None, torch.zeros(1, 100), 2048)
    assert float(hist.width[0]) == 0.0
    hist = update_histogram(hist, torch.linspace(-1, 3, 400).reshape(1, -1), 2048)
    assert float(hist.counts.sum()) == 500
    zero_bin = int((0 - hist.lo[0]) / hist.width[0])
    assert float(hist.counts[0, zero_bin]) >= 100


@pytest.mark.parametrize("name", HIST_NAMES)
def test_zero_then_real_data_and_constants_give_finite_qparams(name):
    spec = ob.QuantSpec(dtype="int8", symmetric=name != "histogram")
    for batches in ([torch.zeros(64), torch.randn(64)], [torch.full((64,), 2.5)] * 2, [torch.zeros(64)]):
        obs = ob.create(name, spec, kind="activation")
        for b in batches:
            obs.observe(b)
        qp = obs.qparams()
        assert bool(torch.isfinite(qp.scale).all()) and bool((qp.scale > 0).all())
        x = torch.cat(batches)
        assert not bool(torch.isnan(ob.fake_quantize(x, qp, spec)).any())
        assert float(qp.min_val) >= float(x.min()) - 1e-6 and float(qp.max_val) <= float(x.max()) + 1e-6


# --- percentile ---------------------------------------------------------------------------------


@given(seed=st.integers(0, 10_000), n=st.integers(20, 3000), p=st.sampled_from([90.0, 99.0, 99.9, 99.99, 100.0]))
@settings(max_examples=40, deadline=None)
def test_percentile_within_one_bin_of_torch_quantile(seed, n, p):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=gen) * torch.rand(n, generator=gen).pow(2) * 3 + 0.3
    sym = ob.create("percentile", ob.QuantSpec(dtype="int8"), kind="activation", percentile=p)
    sym.observe(x)
    amax = _amax(sym.qparams())
    exact = float(torch.quantile(x.abs().double(), p / 100))
    assert abs(amax - exact) <= float(sym.hist.width[0]) * (1 + 1e-9) + 1e-7
    asym = ob.create("percentile", ob.QuantSpec(dtype="uint8", symmetric=False), kind="activation", percentile=p)
    asym.observe(x[: n // 2].reshape(-1, 1))
    asym.observe(x[n // 2 :].reshape(-1, 1))
    qp = asym.qparams()
    tail = (100 - p) / 200
    lo, hi = torch.quantile(x.double(), torch.tensor([tail, 1 - tail], dtype=torch.float64)).tolist()
    width = float(asym.hist.width[0]) * (1 + 1e-9) + 1e-7
    assert abs(float(qp.min_val) - lo) <= width and abs(float(qp.max_val) - hi) <= width


# --- mse (ModelOpt sweep) ----------------------------------------------------------------------


def _hist_error(obs, low, high):
    hist = obs.hist
    values = hist.centers().float()
    qp = ob.calculate_qparams(torch.tensor([low]), torch.tensor([high]), obs.spec)
    x_hat = fake_quant_batched(values, qp.effective_scale.reshape(1, 1), qp.zero_point.float().reshape(1, 1), obs.spec)
    return float(((x_hat - values).double().square() * hist.counts).sum())


@pytest.mark.parametrize(
    "spec",
    [ob.QuantSpec(dtype="int8"), ob.QuantSpec(dtype="int4"), ob.QuantSpec(dtype="uint8", symmetric=False)]
    + [ob.QuantSpec(dtype="fp8_e4m3"), ob.QuantSpec(dtype="fp4_e2m1")],
    ids=lambda s: f"{s.dtype}-{s.symmetric}",
)
@pytest.mark.parametrize("kind", ["gauss", "heavy"])
def test_mse_choice_beats_minmax_on_the_same_histogram(spec, kind):
    x = _data(kind, seed=5)
    obs = ob.create("mse", spec, kind="activation")
    obs.observe(x)
    qp = obs.qparams()
    hist = obs.hist
    full = (-float(hist.data_max[0]), float(hist.data_max[0])) if spec.symmetric else (float(x.min()), float(x.max()))
    assert _hist_error(obs, float(qp.min_val), float(qp.max_val)) <= _hist_error(obs, *full) * (1 + 1e-9)
    assert float(x.min()) <= float(qp.min_val) and float(qp.max_val) <= float(x.max())


def _modelopt_mse_amax(counts, edges, num_bits, start_bin=128):
    """ModelOpt ``_compute_amax_mse`` as a plain loop: narrow-range symmetric int quantizer."""
    centers = (edges[1:] + edges[:-1]) / 2
    best, best_amax = math.inf, None
    bound = 2 ** (num_bits - 1) - 1
    for i in range(start_bin, len(centers)):
        amax = centers[i]
        q = np.clip(np.round(centers / amax * bound), -bound, bound) * amax / bound
        err = float(((q - centers) ** 2 * counts).mean())
        if err < best:
            best, best_amax = err, amax
    return best_amax


@pytest.mark.parametrize("bits", [8, 4])
def test_mse_matches_modelopt_sweep_with_qmax_rule(bits):
    x = _data("heavy", seed=7)
    spec = ob.QuantSpec(dtype=f"int{bits}", scale_rule="qmax")
    obs = ob.create("mse", spec, kind="activation")
    obs.observe(x)
    hist = obs.hist
    ref = _modelopt_mse_amax(hist.counts[0].numpy(), hist.edges()[0].numpy(), bits)
    assert _amax(obs.qparams()) == pytest.approx(ref, rel=1e-5)


# --- entropy (ModelOpt KL) --------------------------------------------------------------------


def _modelopt_entropy_index(hist_counts, num_bits, unsigned=False, start_bin=128):
    """ModelOpt ``_compute_amax_entropy`` as a naive loop (first argmin, our documented tie rule)."""
    bins = np.array(hist_counts, dtype=np.float64)
    bins[0] = bins[1]
    nbins = 1 << (num_bits - 1 + int(unsigned))
    best, best_i = math.inf, None
    for i in range(start_bin, len(bins) + 1):
        space = np.linspace(0, i, num=nbins + 1)
        digitized = np.digitize(range(i), space) - 1
        digitized[bins[:i] == 0] = -1
        merged = np.zeros(nbins)
        members = np.zeros(nbins)
        for idx, d in enumerate(digitized):
            if d != -1:
                merged[d] += bins[idx]
                members[d] += 1
        q = np.array([merged[d] / members[d] if d != -1 else 0.0 for d in digitized])
        p = bins[:i].copy()
        p[-1] += bins[i:].sum()
        p, q = p / p.sum(), q / q.sum()
        with np.errstate(divide="ignore", invalid="ignore"):
            kl = float(np.sum(np.where(p > 0, p * np.log(p / q), 0.0)))
        if kl < best:
            best, best_i = kl, i
    return best_i


@pytest.mark.parametrize(
    ("dtype", "bits", "unsigned", "kind", "bins"),
    [("int8", 8, False, "heavy", 512), ("int4", 4, False, "gauss", 512), ("uint8", 8, True, "relu", 512)],
)
def test_entropy_amax_within_one_bin_of_modelopt_loop(dtype, bits, unsigned, kind, bins):
    x = _data(kind, n=20_000, seed=11)
    spec = ob.QuantSpec(dtype=dtype, symmetric=not unsigned)
    obs = ob.create("entropy", spec, kind="activation", bins=bins)
    obs.observe(x)
    hist = obs.hist
    ref_i = _modelopt_entropy_index(hist.counts[0].numpy(), bits, unsigned)
    ref_amax = float(hist.edges()[0, ref_i])
    amax = _amax(obs.qparams())
    assert abs(min(ref_amax, float(x.abs().max())) - amax) <= float(hist.width[0]) * 1.0001


def test_entropy_clips_a_heavy_tail():
    x = _data("heavy", seed=12)
    obs = ob.create("entropy", ob.QuantSpec(dtype="int8"), kind="activation")
    obs.observe(x)
    assert _amax(obs.qparams()) < 0.9 * float(x.abs().max())


# --- per-channel: vectorized == per-row loop ---------------------------------------------------


@pytest.mark.parametrize(
    ("name", "knobs", "spec"),
    [
        ("histogram", {"bins": 256}, ob.QuantSpec(dtype="int8", symmetric=False, strategy="channel")),
        ("percentile", {"percentile": 99.0}, ob.QuantSpec(dtype="int8", strategy="channel")),
        ("percentile", {"percentile": 99.0}, ob.QuantSpec(dtype="uint8", symmetric=False, strategy="channel")),
        ("mse", {}, ob.QuantSpec(dtype="int4", strategy="channel")),
        ("mse", {"bins": 512}, ob.QuantSpec(dtype="fp8_e4m3", strategy="channel")),
        ("entropy", {"bins": 512}, ob.QuantSpec(dtype="int8", strategy="channel")),
    ],
)
def test_per_channel_equals_per_row_loop(name, knobs, spec):
    gen = torch.Generator().manual_seed(13)
    w = torch.randn(6, 400, generator=gen) * torch.rand(6, 1, generator=gen) * 3
    w2 = torch.randn(6, 400, generator=gen) * 5
    obs = ob.create(name, spec, **knobs)
    obs.observe(w)
    obs.observe(w2)
    qp = obs.qparams()
    assert qp.scale.shape == (6, 1)
    tensor_spec = spec.replace(strategy="tensor")
    for row in range(6):
        one = ob.create(name, tensor_spec, **knobs)
        one.observe(w[row : row + 1])
        one.observe(w2[row : row + 1])
        ref = one.qparams()
        assert float(qp.min_val[row, 0]) == pytest.approx(float(ref.min_val[0]), rel=1e-5, abs=1e-6)
        assert float(qp.max_val[row, 0]) == pytest.approx(float(ref.max_val[0]), rel=1e-5, abs=1e-6)


def test_per_channel_histogram_coarse_to_fine_stays_close_to_all_pairs():
    gen = torch.Generator().manual_seed(14)
    w = torch.randn(16, 1000, generator=gen) * torch.rand(16, 1000, generator=gen).pow(2)
    spec = ob.QuantSpec(dtype="int8", symmetric=False, strategy="channel")
    obs = ob.create("histogram", spec)
    obs.observe(w)
    hist = obs.hist
    from observers.hist_search import _prefix_moments, exact_l2

    moments = _prefix_moments(hist.counts)
    start, end = l2_range_search(hist, 256)
    ours = exact_l2(hist.counts, moments, start.unsqueeze(1), end.unsqueeze(1), 256)
    full = exact_l2(
        hist.counts,
        moments,
        torch.zeros(16, 1, dtype=torch.float64),
        torch.full((16, 1), 2048.0, dtype=torch.float64),
        256,
    )
    assert bool((ours <= full * (1 + 1e-9)).all())


def test_attention_per_head_and_bad_knobs():
    x = torch.randn(2, 3, 5, 8)
    obs = ob.create("percentile", ob.QuantSpec(dtype="int8", strategy="channel"), kind="attention")
    obs.observe(x)
    assert obs.qparams().scale.shape == (3,)
    for name, knob in [("percentile", {"percentile": 0}), ("mse", {"start_bin": 5000}), ("entropy", {"stride": 0})]:
        with pytest.raises(ValueError):
            ob.create(name, ob.QuantSpec(dtype="int8"), **knob)
    with pytest.raises(ValueError, match="bins"):
        ob.create("histogram", ob.QuantSpec(dtype="int8"), bins=1)


# --- fast paths: chunked binning, non-finite detection from min/max, coarse-to-fine search -----


def test_chunked_binning_matches_exact_counts_across_chunk_boundaries():
    import observers.hist_state as hist_state

    gen = torch.Generator().manual_seed(21)
    rows = torch.randn(3, hist_state._BIN_CHUNK + 777, generator=gen) * torch.tensor([[1.0], [5.0], [0.1]])
    hist = update_histogram(None, rows, 64)
    assert torch.equal(hist.counts.sum(dim=1), torch.full((3,), float(rows.shape[1]), dtype=torch.float64))
    for r in range(3):
        exact = torch.histogram(rows[r].double(), bins=hist.edges()[r]).hist
        # fp32 bin positions may move a value that sits within rounding of an edge by one bin.
        assert float((hist.counts[r] - exact).abs().sum()) <= 4


@pytest.mark.parametrize("name", HIST_NAMES)
def test_nonfinite_batches_are_rejected_or_ignored_without_corrupting_the_histogram(name):
    spec = ob.QuantSpec(dtype="int8")
    x = torch.randn(4, 64)
    bad = x.clone()
    bad[1, 3] = float("nan")
    bad[2, 5] = float("inf")
    obs = ob.create(name, spec, kind="activation")
    obs.observe(x)
    with pytest.raises(ValueError, match="non-finite"):
        obs.observe(bad)
    assert float(obs.hist.counts.sum()) == x.numel()
    tolerant = ob.create(name, spec, kind="activation", ignore_nonfinite=True)
    tolerant.observe(bad)
    qp = tolerant.qparams()
    assert float(tolerant.hist.counts.sum()) == x.numel()
    assert bool(torch.isfinite(qp.scale).all()) and float(qp.max_val) <= float(x.abs().max()) + 1e-6


@pytest.mark.parametrize("kind", ["bimodal", "spike_at_zero", "one_outlier", "student_t"])
def test_coarse_to_fine_single_row_search_beats_torch_ao(kind):
    gen = torch.Generator().manual_seed(22)
    n = 100_000
    if kind == "bimodal":
        x = torch.cat([torch.randn(n, generator=gen) - 6, torch.randn(n, generator=gen) * 0.3 + 5])
    elif kind == "spike_at_zero":
        x = torch.cat([torch.zeros(3 * n), torch.randn(n, generator=gen)])
    elif kind == "one_outlier":
        x = torch.cat([torch.randn(n, generator=gen), torch.tensor([300.0])])
    else:
        x = torch.randn(n, generator=gen) / torch.rand(n, generator=gen).add(0.05)
    tao = TaoHistogramObserver()
    tao(x)
    tao_min, tao_max = tao._non_linear_param_search()
    width = float(tao.max_val - tao.min_val) / tao.bins
    tao_start = round(float(tao_min - tao.min_val) / width)
    tao_end = round(float(tao_max - tao.min_val) / width) - 1
    start, end = l2_range_search(update_histogram(None, x.reshape(1, -1), 2048), 256)
    ours = tao._compute_quantization_error(int(start), int(end) - 1)
    assert ours <= tao._compute_quantization_error(tao_start, tao_end) * (1 + 1e-6)
