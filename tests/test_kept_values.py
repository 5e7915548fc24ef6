"""What a kept run holds of an activation in place of its sample (``lab.analyse.kept_values``): the
histogram of every value re-bins, folds and zooms as the values themselves do, each channel's
extremes draw the per-channel figures of every token, and the kept tokens are a bounded, seeded
subset of whole tokens. The figures of a reopened entry are the figures of the computed one."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

import observers as ob
from lab.analyse.analysis import TensorAnalysis
from lab.analyse.kept_values import (
    HISTOGRAM_BINS,
    KEPT_VALUES,
    KeptValues,
    ValueHistogram,
    extremes_of,
    kept_rows,
    summarise,
)
from lab.results import plots


def _activations(tokens: int = 3000, features: int = 384, seed: int = 0) -> torch.Tensor:
    """Activations with outlier channels and one outlier token, as a model's inputs have."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, features, generator=g)
    x[:, 7] *= 40.0
    x[11, 100] = -300.0
    return x


def test_the_histogram_counts_every_value_and_rebins_as_the_values_bin():
    x = _activations()
    histogram = ValueHistogram.of(x)
    assert len(histogram.counts) == HISTOGRAM_BINS and float(histogram.counts.sum()) == x.numel()
    assert (histogram.lo, histogram.hi) == (float(x.min()), float(x.max()))
    edges, counts = histogram.counts_over(HISTOGRAM_BINS, histogram.lo, histogram.hi)
    assert np.array_equal(counts, torch.histc(x, HISTOGRAM_BINS, histogram.lo, histogram.hi).double().numpy())
    lo, hi = histogram.lo - 50.0, histogram.hi + 50.0  # a plot's range reaches to lines beyond the data
    edges, counts = histogram.counts_over(200, lo, hi)
    exact = torch.histc(x, 200, lo, hi).double().numpy()
    assert counts.sum() == pytest.approx(x.numel()) and np.abs(counts - exact).max() <= 0.01 * x.numel()
    assert np.array_equal(edges, np.linspace(lo, hi, 201))


def test_the_histogram_folds_to_absolute_values_and_finds_quantiles():
    x = _activations()
    histogram = ValueHistogram.of(x)
    folded = histogram.absolute()
    assert (folded.lo, folded.hi) == (0.0, 300.0) and float(folded.counts.sum()) == pytest.approx(x.numel())
    _, counts = folded.counts_over(100, 0.0, 300.0)
    exact = torch.histc(x.abs(), 100, 0.0, 300.0).double().numpy()
    assert np.abs(counts - exact).max() <= 0.01 * x.numel()
    step = (histogram.hi - histogram.lo) / HISTOGRAM_BINS
    for q in (0.001, 0.5, 0.999):
        assert histogram.quantile(q) == pytest.approx(float(torch.quantile(x.flatten(), q)), abs=step)
    for one_side in (x.abs() + 1.0, -(x.abs() + 1.0)):
        folded = ValueHistogram.of(one_side).absolute()
        assert (folded.lo, folded.hi) == pytest.approx((float(one_side.abs().min()), float(one_side.abs().max())))
        assert float(folded.counts.sum()) == pytest.approx(x.numel())
        _, counts = folded.counts_over(50, folded.lo, folded.hi)
        assert np.abs(counts - torch.histc(one_side.abs(), 50, folded.lo, folded.hi).double().numpy()).max() <= 2


def test_the_histogram_leaves_out_values_that_are_not_finite():
    x = _activations(200, 128)
    x[0, 0], x[1, 1], x[2, 2] = float("nan"), float("inf"), -float("inf")
    histogram = ValueHistogram.of(x)
    finite = x[x.isfinite()]
    assert (histogram.lo, histogram.hi) == (float(finite.min()), float(finite.max()))
    assert float(histogram.counts.sum()) == finite.numel()


def test_extremes_draw_every_channels_range_of_every_token():
    x = _activations()
    extremes = extremes_of(x)
    assert extremes.shape == (2, x.shape[1])
    assert torch.equal(extremes[0], x.amin(0)) and torch.equal(extremes[1], x.amax(0))
    assert plots.channel_ranges(extremes, -1).equals(plots.channel_ranges(x, -1))
    states = torch.randn(1, 4, 50, 8)
    states[0, 2, 9, 3] = 70.0
    both = extremes_of(states)
    assert both.shape == (2, 4, 1, 8)
    assert plots.channel_ranges(both, 1).equals(plots.channel_ranges(states, 1))  # per head
    view = plots.per_token_view
    assert torch.equal(view(both).abs().amax(0), view(states).abs().amax(0))  # per channel


def test_kept_rows_are_a_seeded_bounded_subset_of_whole_tokens_in_order():
    x = _activations(5000, 1536)
    rows = kept_rows(x)
    assert rows.shape == (KEPT_VALUES // 1536, 1536) and rows.numel() <= KEPT_VALUES
    assert torch.equal(rows, kept_rows(x.clone()))  # seeded: the same tokens every time
    found = [int(torch.nonzero((x == row).all(1)).item()) for row in rows]
    assert found == sorted(found) and len(set(found)) == len(found)  # whole tokens, in their order
    small = x[:100]
    assert kept_rows(small) is small  # within the bound: the tokens themselves
    wide = torch.randn(3, KEPT_VALUES + 1)
    assert kept_rows(wide).shape == (1, KEPT_VALUES + 1)  # at least one token
    states = torch.randn(1, 8, 2000, 64)
    kept = kept_rows(states)
    assert kept.shape == (1, 8, KEPT_VALUES // 512, 64)  # sequence positions, every head of each


def _entries(x: torch.Tensor) -> tuple[TensorAnalysis, TensorAnalysis]:
    """An input as computed (its sample) and as a kept run reopens it (its kept rows and values)."""
    spec = ob.QuantSpec("int8")
    results = ob.run_suite(x, spec, names=["minmax", "percentile"], kind="activation")
    computed = TensorAnalysis("layer", "input", spec, x, results, total_shape=(x.shape[0] * 4, x.shape[1]))
    computed.metrics_tokens = x.shape[0]
    reopened = replace(computed, source=kept_rows(x), kept_values=summarise(x))
    return computed, reopened


@pytest.mark.parametrize("absolute", [False, True])
@pytest.mark.parametrize("tail", [None, "left", "right"])
def test_a_reopened_entry_draws_the_range_histogram_of_the_whole_sample(absolute, tail):
    computed, reopened = _entries(_activations())
    drawn = [
        plots.range_histogram(entry.values, entry.results, entry.spec, absolute=absolute, tail=tail, log_count=False)
        for entry in (computed, reopened)
    ]
    ends = [tuple(figure.layout.xaxis.range) for figure in drawn]
    width = (computed.data.max() - computed.data.min()).item() / HISTOGRAM_BINS
    assert ends[1] == pytest.approx(ends[0], abs=width)
    assert [s.x0 for s in drawn[1].layout.shapes] == [s.x0 for s in drawn[0].layout.shapes]
    total = drawn[0].data[0].y.sum()
    assert drawn[1].data[0].y.sum() == pytest.approx(total, rel=0.02, abs=2)
    if tail is None:
        assert total == computed.data.numel()
        assert np.abs(drawn[1].data[0].y - drawn[0].data[0].y).max() <= 0.01 * total


def test_a_reopened_entry_draws_per_channel_figures_of_every_token_and_says_what_it_holds():
    computed, reopened = _entries(_activations())
    assert isinstance(reopened.kept_values, KeptValues) and reopened.data.shape[0] < computed.data.shape[0]
    assert torch.equal(reopened.extremes, computed.extremes)
    mine = plots.token_channel_figure(reopened.data, channels=reopened.extremes)
    theirs = plots.token_channel_figure(computed.data, channels=computed.extremes)
    assert np.array_equal(mine.data[1].y, theirs.data[1].y)  # per channel: every token's
    assert len(mine.data[0].y) == reopened.data.shape[0]  # per token: the kept ones
    assert plots.token_channel_figure(computed.data).data[1].y.tolist() == theirs.data[1].y.tolist()
    assert computed.kept_note is None and computed.values is computed.data
    assert reopened.kept_note == f"{reopened.data.shape[0]:,} of the 3,000 tokens the metrics saw"
    assert reopened.shape == computed.shape and reopened.num_tokens == computed.num_tokens == 12000
    plots.error_histogram(reopened)  # the figures re-derived from values draw on the kept tokens
    plots.dynamic_scale_figure(replace(reopened, spec=ob.QuantSpec("int8", strategy="token", dynamic=True)), [])
