"""Observers on a batch split between ranks (``observers.shared``): ranks as threads of this
process (``helpers.ThreadRanks``), each observing its part with a reduction that meets the others
at a barrier, against one observer on the whole batch."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from helpers import ThreadRanks

import observers as ob
from observers.minmax import MinMaxObserver
from observers.shared import EXACT_HISTOGRAM, EXACT_MIN_MAX, Op, local_reduce
from sample_models.calibration import Batch, rounds, share_of

MERGING_PAGE = Path(__file__).resolve().parents[1] / "docs" / "reference" / "merging.md"
SPECS = {
    "int8 asymmetric per tensor": ob.QuantSpec(dtype="int8", symmetric=False),
    "int8 per channel": ob.QuantSpec(dtype="int8", strategy="channel"),
    "int4 groups of 16": ob.QuantSpec(dtype="int4", strategy="group", group_size=16),
    "nvfp4": ob.QuantSpec(dtype="nvfp4"),
    "fp16 cast": ob.QuantSpec(dtype="fp16"),
}
SHARING = [name for name in ob.available() if ob.observer_class(name).shares_statistics]


def _knobs(name: str) -> dict:
    """Fewer histogram bins than the default 2048: the merge is the same, the test faster."""
    return {"bins": 256} if "bins" in ob.knobs(name) else {}


def _activations(seed: int = 0, tokens: int = 240) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, 64, generator=generator) * torch.linspace(0.1, 3.0, 64)
    x[7, 5] = 30.0  # an outlier in the first part only: the merged range must still hold it
    return x


def _parts(x: torch.Tensor) -> list[torch.Tensor]:
    """Three unequal parts, the last one empty (a rank that got no tokens)."""
    return [x[:100], x[100:], x[x.shape[0] :]]


def _split_run(name: str, x: torch.Tensor, spec: ob.QuantSpec, kind: str = "activation") -> list:
    parts = _parts(x)
    knobs = _knobs(name)
    return ThreadRanks(len(parts)).run(
        lambda rank, reduce: ob.run_one(name, parts[rank], spec, kind, across=reduce, **knobs)
    )


@pytest.mark.parametrize("label", list(SPECS))
def test_every_sharing_observer_merges_to_the_result_on_the_whole_batch(label):
    spec, x = SPECS[label], _activations()
    for name in SHARING:
        whole = ob.run_one(name, x, spec, "activation", **_knobs(name))
        ranks = _split_run(name, x, spec)
        if whole.error is not None:
            assert all(r.error is not None for r in ranks), name
            continue
        rule = ob.observer_class(name).merge_rule
        for result in ranks:
            assert result.error is None, (name, result.error)
            assert result.num_observed_tokens == whole.num_observed_tokens == x.shape[0]
            if rule in (EXACT_MIN_MAX, EXACT_HISTOGRAM):
                assert torch.equal(result.qparams.scale, whole.qparams.scale), name
                assert torch.equal(result.qparams.zero_point, whole.qparams.zero_point), name
            else:  # exact up to the rounding of summed errors: the same pick but for near-ties
                same = (result.qparams.scale == whole.qparams.scale).float().mean()
                assert same >= 0.99, (name, float(same))
            for key, value in whole.metrics.items():
                if value is None or abs(value) == float("inf"):
                    assert result.metrics[key] == value
                else:
                    assert result.metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-9), (name, key)


def test_per_token_qparams_are_joined_in_rank_order():
    spec, x = ob.QuantSpec(dtype="int8", strategy="token"), _activations()
    for name in ("minmax", "mse_grid"):
        whole = ob.run_one(name, x, spec, "activation")
        for result in _split_run(name, x, spec):
            assert result.qparams.scale.shape == whole.qparams.scale.shape == (x.shape[0], 1)
            assert torch.equal(result.qparams.scale, whole.qparams.scale)
            assert result.metrics["sqnr_db"] == pytest.approx(whole.metrics["sqnr_db"], rel=1e-6)


def test_key_value_states_split_along_their_tokens():
    states = torch.randn(1, 4, 90, 16)
    parts = [states[:, :, :50], states[:, :, 50:]]
    spec = ob.QuantSpec(dtype="fp8_e4m3", strategy="channel")
    whole = ob.run_one("percentile", states, spec, "attention")
    for result in ThreadRanks(2).run(
        lambda r, reduce: ob.run_one("percentile", parts[r], spec, "attention", across=reduce)
    ):
        assert torch.equal(result.qparams.scale, whole.qparams.scale)
        assert result.num_observed_tokens == 90


class _RangePerRank(MinMaxObserver):
    """A min-max observer that does not share its statistics: it gets the fallback merge."""

    name = "range_per_rank_test"
    shares_statistics = False


def test_an_observer_without_a_merge_rule_gets_the_token_weighted_mean_of_the_ranks_ranges():
    spec = ob.QuantSpec(dtype="int8", symmetric=False)
    parts = [torch.tensor([[-1.0], [3.0]]), torch.tensor([[-4.0], [0.0], [1.0], [2.0]]), torch.zeros(0, 1)]

    def work(rank, reduce):
        observer = _RangePerRank(spec, kind="activation")
        observer.observe(parts[rank], across=reduce)
        return observer.qparams()

    expected_min, expected_max = (2 * -1.0 + 4 * -4.0) / 6, (2 * 3.0 + 4 * 2.0) / 6  # by hand
    for qp in ThreadRanks(3).run(work):
        assert float(qp.min_val) == pytest.approx(expected_min) and float(qp.max_val) == pytest.approx(expected_max)


def test_a_refused_part_stops_every_rank_with_an_error_instead_of_a_hang():
    x = _activations()
    x[150, 3] = float("nan")  # in rank 1's part only
    results = _split_run("histogram", x, SPECS["int8 per channel"])
    assert "non-finite" in results[1].error
    assert all("another rank" in results[r].error for r in (0, 2))
    assert all(r.qparams is None for r in results)


def test_no_tokens_on_any_rank_is_an_error_on_every_rank():
    empty = torch.zeros(0, 8)
    results = ThreadRanks(2).run(
        lambda r, reduce: ob.run_one("minmax", empty, ob.QuantSpec(dtype="int8"), "activation", across=reduce)
    )
    assert all(r.error is not None and "no tokens on any rank" in r.error for r in results)


def test_importance_and_metrics_merge_from_sums():
    x = _activations()
    parts = _parts(x)
    importances = ThreadRanks(3).run(lambda r, reduce: ob.column_importance(parts[r], across=reduce))
    for importance in importances:
        assert torch.allclose(importance, ob.column_importance(x), rtol=1e-6)
    noisy = x + 0.01 * torch.randn_like(x)
    noisy_parts = _parts(noisy)
    whole = ob.compare_tensors(x, noisy)
    merged = ThreadRanks(3).run(lambda r, reduce: ob.compare_tensors(parts[r], noisy_parts[r], across=reduce))
    for metrics in merged:
        assert metrics["max_abs_error"] == whole["max_abs_error"]
        assert metrics["sqnr_db"] == pytest.approx(whole["sqnr_db"], rel=1e-6)
        assert metrics["cosine"] == pytest.approx(whole["cosine"], rel=1e-6)


def test_local_reduce_defines_each_operation():
    parts = [torch.tensor([1.0, 5.0]), torch.tensor([3.0, 2.0])]
    assert local_reduce(parts, Op.MIN).tolist() == [1.0, 2.0]
    assert local_reduce(parts, Op.MAX).tolist() == [3.0, 5.0]
    assert local_reduce(parts, Op.SUM).tolist() == [4.0, 7.0]
    assert local_reduce([torch.zeros(1, 2), torch.ones(2, 2)], Op.CAT).shape == (3, 2)


def test_ranks_take_whole_batches_in_turn():
    """Round ``r`` of two ranks holds batches 2r and 2r+1: what one process with twice the batch
    size sees in its batch ``r``; the rank with fewer batches is padded to the same rounds."""
    batches = [Batch(torch.full((1, 2), i), torch.ones(1, 2), torch.ones(1, 2, dtype=torch.bool)) for i in range(5)]
    shares = [share_of(batches, part, 2) for part in range(2)]
    assert [[int(b.input_ids[0, 0]) for b in share] for share in shares] == [[0, 2, 4], [1, 3]]
    assert rounds(5, 2) == 3 and rounds(4, 2) == 2 and rounds(5, 1) == 5
    with pytest.raises(ValueError, match="fewer than the 8 ranks"):
        share_of(batches, 0, 8)


def test_the_docs_name_each_observer_s_merge_rule():
    """The merge table of docs/reference/merging.md is the one users read; each row must say what
    the code does."""
    text = MERGING_PAGE.read_text(encoding="utf-8")
    rows = dict(re.findall(r"^\| `([a-z0-9_]+)` \| ([^|]+) \|$", text, flags=re.MULTILINE))
    for name in ob.available():
        assert rows.get(name, "").strip() == ob.merge_rule(name), name
