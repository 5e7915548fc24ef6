"""What a stage holds at a 7B width stays bounded, and the numbers stay what they were: histogram
searches on chunks of rows, GPTQ's clip ratio without the other metrics' passes, held-out Hessians
on disk until their rows are made, streamed fp64 sums added a slice at a time, large blocks mapped
for themselves inside a GPTQ sweep."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import lab.allocator
import observers as ob
from lab.calibrate import stream
from lab.gptq.hessians import SpilledHessians
from lab.gptq.layer import gptq_rows, gptq_weight
from observers import hist_search
from observers.metrics import clip_ratio, error_metrics

ROOT = Path(__file__).resolve().parents[1]

CHANNEL_SEARCHES = [
    ("histogram", {"bins": 256}, ob.QuantSpec(dtype="int8", symmetric=False, strategy="channel")),
    ("percentile", {"percentile": 99.0}, ob.QuantSpec(dtype="int8", strategy="channel")),
    ("mse", {"bins": 512}, ob.QuantSpec(dtype="int4", strategy="channel")),
    ("mse", {"bins": 512}, ob.QuantSpec(dtype="fp8_e4m3", strategy="channel")),
    ("entropy", {"bins": 512}, ob.QuantSpec(dtype="int8", strategy="channel")),
    ("layerwise_percentile", {}, ob.QuantSpec(dtype="int8", strategy="channel")),
    ("sqnr", {"bins": 512}, ob.QuantSpec(dtype="int4", symmetric=False, strategy="channel")),
]


def _weight(rows: int = 40, columns: int = 300, seed: int = 21) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, columns, generator=gen) * torch.rand(rows, 1, generator=gen).mul(3).add(0.1)


@pytest.mark.parametrize(("name", "knobs", "spec"), CHANNEL_SEARCHES)
def test_a_histogram_search_on_small_chunks_of_rows_gives_the_whole_search_s_qparams(name, knobs, spec, monkeypatch):
    w = _weight()
    whole = ob.create(name, spec, **knobs)
    whole.observe(w)
    expected = whole.qparams()
    calls = []
    search = hist_search.in_row_chunks

    def counted(hist, bytes_per_row, fn, cap=None):
        calls.append(len(hist_search.row_chunks(hist.counts.shape[0], bytes_per_row, cap)))
        return search(hist, bytes_per_row, fn, cap)

    monkeypatch.setattr(hist_search, "SEARCH_CHUNK_BYTES", 1)  # one row a chunk
    for module in ("observers.histogram", "observers.lwp_search", "observers.sqnr_search"):
        monkeypatch.setattr(f"{module}.in_row_chunks", counted, raising=False)
    chunked = ob.create(name, spec, **knobs)
    chunked.observe(w)
    found = chunked.qparams()
    assert calls and max(calls) == w.shape[0]  # the search really ran a row at a time
    for field in ("scale", "zero_point", "min_val", "max_val"):
        assert torch.equal(getattr(found, field), getattr(expected, field)), field


@given(
    rows=st.integers(0, 5000),
    bytes_per_row=st.integers(1, 1 << 24),
    cap=st.one_of(st.none(), st.integers(1, 1 << 30)),
)
@settings(max_examples=200, deadline=None)
def test_row_chunks_cover_every_row_once_within_the_budget(rows, bytes_per_row, cap):
    chunks = hist_search.row_chunks(rows, bytes_per_row, cap)
    covered = [row for part in chunks for row in range(max(rows, 1))[part]]
    assert covered == list(range(max(rows, 1)))
    budget = hist_search.chunk_budget(cap)
    assert budget <= hist_search.SEARCH_CHUNK_BYTES and (cap is None or budget <= cap)
    for part in chunks:
        size = len(range(max(rows, 1))[part])
        assert size == 1 or size * bytes_per_row <= budget


PEAK = """
import resource, sys, torch
import observers as ob
torch.set_num_threads(1)
gen = torch.Generator().manual_seed(0)
w = torch.randn(688, 256, generator=gen)
spec = ob.QuantSpec(dtype="int8", strategy="channel")
for name in sys.argv[1:]:
    obs = ob.create(name, spec)
    obs.observe(w)
    obs.qparams()
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(before)
"""


def test_per_channel_histogram_searches_of_a_wide_weight_stay_within_a_few_hundred_megabytes():
    """A 688-channel weight's entropy search held 4 GB in one piece (10 MB a row); on chunks of
    rows the whole suite of histogram searches stays within what the process holds anyway."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    base = subprocess.run([sys.executable, "-c", PEAK], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    names = ["entropy", "mse", "histogram", "percentile", "layerwise_percentile", "sqnr"]
    done = subprocess.run(
        [sys.executable, "-c", PEAK, *names], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert base.returncode == 0 and done.returncode == 0, base.stderr + done.stderr
    grown_kib = int(done.stdout.split()[-1]) - int(base.stdout.split()[-1])
    assert grown_kib < 400 * 1024, f"the searches raised the peak by {grown_kib / 1024:.0f} MiB"


@given(
    seed=st.integers(0, 2**16),
    dtype=st.sampled_from(["int4", "uint4", "int8", "fp8_e4m3", "fp4_e2m1"]),
    strategy=st.sampled_from(["tensor", "channel", "group"]),
    shrink=st.floats(0.3, 1.0),
)
@settings(max_examples=60, deadline=None)
def test_clip_ratio_alone_is_error_metrics_clip_ratio(seed, dtype, strategy, shrink):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(8, 64, generator=gen) * 2
    spec = ob.QuantSpec(dtype=dtype, symmetric=not dtype.startswith("uint"), strategy=strategy, group_size=16)
    observer = ob.create("minmax", spec)
    observer.observe(x * shrink)  # a narrower range than x's: some elements clip
    qp = observer.qparams()
    x_hat = ob.fake_quantize(x, qp, spec)
    assert clip_ratio(x, qp, spec) == error_metrics(x, x_hat, qp, spec)["clip_ratio"]


def test_clip_ratio_of_a_plain_cast_or_an_empty_tensor_is_a_one_line_error():
    spec = ob.QuantSpec(dtype="int8")
    observer = ob.create("minmax", spec)
    observer.observe(torch.ones(4))
    qp = observer.qparams()
    with pytest.raises(ValueError, match="non-empty tensor of a scaled format"):
        clip_ratio(torch.ones(2), qp, ob.QuantSpec(dtype="bf16"))
    with pytest.raises(ValueError, match="non-empty tensor of a scaled format"):
        clip_ratio(torch.ones(0), qp, spec)


def test_spilled_hessians_wait_on_disk_shared_by_the_layers_fed_one_input():
    h = torch.randn(6, 6, dtype=torch.float64)
    h = h @ h.T
    with SpilledHessians() as kept:
        assert kept.get("q") is None
        assert kept._folder is None  # nothing written: no folder made
        read_q = kept.put(["q", "k", "v"], h)
        kept.put(["o"], torch.eye(6))
        folder = Path(kept._folder.name)
        assert len(list(folder.iterdir())) == 2  # q, k and v share one file
        for layer in ("q", "k", "v"):
            assert torch.equal(kept.get(layer), h.float())
        assert torch.equal(read_q(), h.float())
        assert kept.put(["q2"], h) is read_q  # the same tensor put again: its file and reader
        assert len(list(folder.iterdir())) == 2 and torch.equal(kept.get("q2"), h.float())
        assert torch.equal(kept.get("o"), torch.eye(6))
        assert kept.get("down") is None
    assert not folder.exists()
    assert kept.get("q") is None


def test_a_spilled_hessians_folder_goes_with_the_last_reader():
    kept = SpilledHessians()
    read = kept.put(["o"], torch.eye(3))
    folder = Path(kept._folder.name)
    del kept
    gc.collect()
    assert folder.exists() and torch.equal(read(), torch.eye(3))  # the reader keeps it
    del read
    gc.collect()
    assert not folder.exists()


def test_gptq_rows_read_the_held_out_hessian_when_their_figures_are_made():
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(32, 64, generator=gen)
    x = torch.randn(256, 64, generator=gen)
    held_x = torch.randn(200, 64, generator=gen) * 1.5
    hessian, held_out = ob.hessian_of_rows(x), ob.hessian_of_rows(held_x)
    spec = ob.QuantSpec(dtype="int4", strategy="group", group_size=16)
    gptq = ob.GPTQSpec()
    results = ob.run_suite(weight, spec, ["minmax", "mse_grid"], kind="weight")
    reads = []
    rows = gptq_rows(results, weight, hessian, spec, gptq, {}, lambda: reads.append(1) or held_out)
    assert reads  # read for the rows, not held by the caller
    for result, row in zip(results, rows, strict=True):
        assert row.error is None
        rtn = ob.fake_quantize(weight, result.qparams, spec)
        assert row.rtn_held_out == pytest.approx(ob.layer_output_error(weight, rtn, held_out), rel=1e-6)
        assert row.rtn_error == pytest.approx(ob.layer_output_error(weight, rtn, hessian), rel=1e-6)
    without = gptq_rows(results, weight, hessian, spec, gptq, {}, lambda: None)
    assert all(row.gptq_held_out is None and row.rtn_held_out is None for row in without)
    assert [row.gptq_error for row in without] == [row.gptq_error for row in rows]


def test_a_streamed_mean_added_a_slice_at_a_time_is_the_one_add_s_mean_to_the_bit(monkeypatch):
    gen = torch.Generator().manual_seed(5)
    batches = [torch.randn(n, 48, generator=gen) for n in (7, 130, 1, 64)]
    expected = None
    for rows in batches:
        value = ob.hessian_of_rows(rows)
        expected = value.double() * rows.shape[0] if expected is None else expected.add_(value, alpha=rows.shape[0])
    expected = (expected / sum(b.shape[0] for b in batches)).float()
    monkeypatch.setattr(stream, "ADDED_BYTES", 3 * 48 * 8)  # three rows of the fp64 sum at a time
    mean = stream.MeanStatistic(ob.hessian_of_rows)
    for rows in batches:
        mean.add(rows)
    found = mean.value(None, torch.device("cpu"))
    assert torch.equal(found, expected)
    assert mean.total is None  # the fp64 sum is let go once the mean is made
    assert mean.value(None, torch.device("cpu")) is found  # the layers sharing it share the mean


class _RecordingLibc:
    def __init__(self) -> None:
        self.calls: list[tuple[int, int]] = []

    def mallopt(self, option: int, value: int) -> int:
        self.calls.append((option, value))
        return 1


def test_large_blocks_are_mapped_for_themselves_inside_and_kept_again_after(monkeypatch):
    monkeypatch.setattr(lab.allocator, "_kept_by", None)
    with lab.allocator.large_blocks_mapped():
        pass  # a process that kept glibc's defaults (the app) is left alone
    libc = _RecordingLibc()
    monkeypatch.setattr(lab.allocator, "_kept_by", libc)
    with pytest.raises(RuntimeError), lab.allocator.large_blocks_mapped():
        assert libc.calls == [(lab.allocator._M_MMAP_THRESHOLD, lab.allocator.LARGE_BYTES)]
        raise RuntimeError("a sweep that fails")
    assert libc.calls[-1] == (lab.allocator._M_MMAP_THRESHOLD, lab.allocator.KEPT_BYTES)
    libc.calls.clear()
    with lab.allocator.large_blocks_mapped():  # a layer's rows, a sweep of its own inside them
        with lab.allocator.large_blocks_mapped():
            pass
        assert libc.calls == [(lab.allocator._M_MMAP_THRESHOLD, lab.allocator.LARGE_BYTES)]  # still mapped
    assert libc.calls == [
        (lab.allocator._M_MMAP_THRESHOLD, lab.allocator.LARGE_BYTES),
        (lab.allocator._M_MMAP_THRESHOLD, lab.allocator.KEPT_BYTES),
    ]


def test_a_gptq_weight_made_again_maps_its_large_blocks_for_themselves(monkeypatch):
    # propagation and the checkpoint sweep a chosen observer again: its (in, in) matrices must not
    # strand heap blocks any more than the analysis's sweeps
    libc = _RecordingLibc()
    monkeypatch.setattr(lab.allocator, "_kept_by", libc)
    weight = torch.randn(16, 32, generator=torch.Generator().manual_seed(1))
    hessian = ob.hessian_of_rows(torch.randn(64, 32, generator=torch.Generator().manual_seed(2)))
    spec = ob.QuantSpec(dtype="int4", strategy="group", group_size=16)
    qparams = ob.run_one("minmax", weight, spec, "weight").qparams
    seen = []
    sweep = ob.gptq_quantize
    monkeypatch.setattr(ob, "gptq_quantize", lambda *a, **k: seen.append(list(libc.calls)) or sweep(*a, **k))
    done = gptq_weight(weight, hessian, spec, ob.GPTQSpec(), "minmax", qparams, {})
    assert seen == [[(lab.allocator._M_MMAP_THRESHOLD, lab.allocator.LARGE_BYTES)]]
    assert libc.calls[-1] == (lab.allocator._M_MMAP_THRESHOLD, lab.allocator.KEPT_BYTES)
    assert done.weight.shape == weight.shape


def test_observers_with_equal_qparams_are_swept_once_and_get_the_rows_each_would_alone(monkeypatch):
    gen = torch.Generator().manual_seed(8)
    weight = torch.randn(48, 64, generator=gen)
    x = torch.randn(300, 64, generator=gen)
    hessian, held_out = ob.hessian_of_rows(x), ob.hessian_of_rows(x[:100] * 2)
    spec = ob.QuantSpec(dtype="int4", strategy="group", group_size=16)
    names = ["minmax", "memoryless_minmax", "mse_grid", "moving_average_minmax", "mse_grid_moving_average"]
    results = ob.run_suite(weight, spec, names, kind="weight")
    swept = []
    fixed = ob.gptq_quantize_fixed
    monkeypatch.setattr(
        ob, "gptq_quantize_fixed", lambda w, h, s, fns, **k: swept.append(len(fns)) or fixed(w, h, s, fns, **k)
    )
    rows = gptq_rows(results, weight, hessian, spec, ob.GPTQSpec(), {}, lambda: held_out)
    assert sum(swept) == 2  # the min-max family once, the MSE grid with and without its average once
    for result, row in zip(results, rows, strict=True):
        alone = gptq_rows([result], weight, hessian, spec, ob.GPTQSpec(), {}, lambda: held_out)[0]
        # A stacked sweep's products have other shapes than one observer's: equal within rounding.
        for name, value in vars(alone).items():
            expected = pytest.approx(value, rel=1e-5, abs=1e-9) if isinstance(value, float) else value
            assert getattr(row, name) == expected, name
    swept.clear()
    gptq_rows(results, weight, hessian, spec, ob.GPTQSpec(actorder="group"), {}, lambda: held_out)
    assert sum(swept) == len(names)  # each observer runs again on the reordered columns: no twins


def test_same_grid_compares_every_tensor_that_sets_the_grid():
    spec = ob.QuantSpec(dtype="int4", strategy="group", group_size=16)
    w = torch.randn(8, 64, generator=torch.Generator().manual_seed(2))
    one, other = (ob.run_suite(w, spec, [name], kind="weight")[0].qparams for name in ("minmax", "memoryless_minmax"))
    assert one.same_grid(other) and other.same_grid(one)
    shifted = replace(other, max_val=other.max_val + 1e-3)
    assert not one.same_grid(shifted)
    assert not one.same_grid(replace(other, global_scale=torch.ones(1)))
