"""mse_grid's eager search off the CPU (issue 26): each chunk of candidates in one pass over the
whole data and its early stop replayed in tensor ops. Both modes run here on CPU (the mode is
forced through ``mse_grid._vectorized``) and must pick exactly what the CPU mode and a plain
sequential loop pick, early stops mid-chunk and tied groups included."""

from __future__ import annotations

import pytest
import torch

import observers as ob
import observers.lc_search as lc_search
import observers.mse_grid as mse_grid
from bench.common import llm_weight
from observers import kernels
from observers.granularity import flatten, group_rows, reduce_min_max
from observers.mse_grid import _blocks, _chunk_errors, mse_grid_search, shrink_factors

SPECS = [
    ob.QuantSpec("int4", symmetric=True, strategy="group", group_size=128),
    ob.QuantSpec("int8", symmetric=False, strategy="channel"),
    ob.QuantSpec("fp8_e4m3", symmetric=True, strategy="channel"),
    ob.QuantSpec("fp4_e2m1", symmetric=True, strategy="group", group_size=16),
    ob.QuantSpec("nvfp4"),
    ob.QuantSpec("mxfp4"),
]
SEARCH = dict(maxshrink=0.6, grid=50, patience=2)
"""30 candidates with a short patience: the searches below stop part-way, mostly inside a chunk."""


def spec_id(spec: ob.QuantSpec) -> str:
    return f"{spec.dtype}-{spec.strategy}"


def small_weight() -> torch.Tensor:
    """A random weight with an all-zero row, a constant row and a row of one repeated pair: groups
    whose candidates all tie."""
    w = torch.randn(8, 256, generator=torch.Generator().manual_seed(3)) * torch.rand(8, 1) * 0.1
    w[2] = 0.0
    w[5] = 0.25
    w[6, ::2], w[6, 1::2] = 0.5, -0.5
    return w


WEIGHTS = {"llm": lambda: llm_weight(64, 512), "small": small_weight}


def sequential_pick(table: torch.Tensor, factors: list[float], patience: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """llm-compressor's loop over a (C, Q) error table: for each factor in order every group keeps
    its first lowest error; stop after ``patience`` consecutive factors that improved no group.
    Returns each group's factor, its error and how many factors were evaluated."""
    best = torch.full(table.shape[1:], torch.finfo(torch.float32).max)
    factor = torch.ones(table.shape[1:])
    stale = 0
    for evaluated, (p, errors) in enumerate(zip(factors, table, strict=True), start=1):
        improved = errors < best
        if bool(improved.any()):
            best = torch.where(improved, errors, best)
            factor = torch.where(improved, torch.tensor(p), factor)
            stale = 0
        else:
            stale += 1
            if stale >= patience:
                return factor, best, evaluated
    return factor, best, len(factors)


def chunked_pick(replay, table: torch.Tensor, factors: list[float], patience: int, chunk: int):
    """``mse_grid_search``'s loop over a given error table, ``chunk`` candidates per replay call."""
    best = torch.full(table.shape[1:], torch.finfo(torch.float32).max)
    best_factor = torch.ones_like(best)
    stale = 0
    for first in range(0, len(factors), chunk):
        stale, stopped = replay(
            table[first : first + chunk], factors[first : first + chunk], best, best_factor, stale, patience
        )
        if stopped:
            break
    return best_factor, best


def error_table(seed: int, candidates: int = 24, groups: int = 40) -> torch.Tensor:
    """Small integer errors (many exact ties) with one all-zero group, one constant group, an
    infinite candidate (a NaN sum) and a slowly improving group that keeps the loop going."""
    gen = torch.Generator().manual_seed(seed)
    table = torch.randint(0, 4, (candidates, groups), generator=gen).float()
    table[:, 0] = 0.0
    table[:, 1] = 7.0
    table[3, 2] = torch.inf
    table[:, 3] = torch.linspace(10, 0, candidates).round()
    return table


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("patience", [1, 2, 3, 5])
@pytest.mark.parametrize("chunk", [1, 3, 7, 24])
def test_both_replays_equal_the_sequential_loop_on_error_tables(seed, patience, chunk):
    table = error_table(seed)
    factors = shrink_factors(0.96, 25)
    want_factor, want_best, _ = sequential_pick(table, factors, patience)
    for replay in (mse_grid._replay, mse_grid._replay_vectorized):
        factor, best = chunked_pick(replay, table, factors, patience, chunk)
        assert torch.equal(factor, want_factor), replay.__name__
        assert torch.equal(best, want_best), replay.__name__


def test_vectorized_replay_stops_mid_chunk_like_the_loop():
    table = torch.tensor([[3.0, 3.0], [2.0, 3.0], [2.0, 1.0], [2.0, 3.0], [2.0, 3.0], [0.0, 0.0]])
    factors = [1.0, 0.9, 0.8, 0.7, 0.6, 0.5]
    for replay in (mse_grid._replay, mse_grid._replay_vectorized):
        best = torch.full((2,), torch.finfo(torch.float32).max)
        best_factor = torch.ones(2)
        assert replay(table, factors, best, best_factor, 0, 2) == (2, True)  # 0.5 would improve: never read
        assert best_factor.tolist() == pytest.approx([0.9, 0.8]) and best.tolist() == [2.0, 1.0]


def test_the_mode_is_decided_by_the_device():
    assert not mse_grid._vectorized(torch.zeros(2))
    assert mse_grid._vectorized(torch.zeros(2, device="meta"))


def search(x: torch.Tensor, spec: ob.QuantSpec, monkeypatch, vectorized: bool, **knobs):
    """``mse_grid_search`` on the eager path in the given mode (kernels off)."""
    monkeypatch.setattr(mse_grid, "_vectorized", lambda data: vectorized)
    with kernels.disabled():
        return mse_grid_search(flatten(x, spec, "weight"), spec, **knobs)


def working_bytes_for(x: torch.Tensor, candidates: int) -> int:
    """A budget that ``_chunk_size`` turns into chunks of ``candidates``."""
    return x.numel() * 8 * candidates


@pytest.mark.parametrize("spec", SPECS, ids=spec_id)
@pytest.mark.parametrize("weight", list(WEIGHTS), ids=str)
@pytest.mark.parametrize("chunk", [4, 30])
def test_device_mode_picks_what_the_cpu_mode_and_the_sequential_loop_pick(monkeypatch, spec, weight, chunk):
    x = WEIGHTS[weight]()
    knobs = dict(SEARCH, max_working_bytes=working_bytes_for(x, chunk))
    cpu = search(x, spec, monkeypatch, False, **knobs)
    device = search(x, spec, monkeypatch, True, **knobs)
    assert torch.equal(device[0], cpu[0]) and torch.equal(device[1], cpu[1])

    flat = flatten(x, spec, "weight")
    low, high = reduce_min_max(flat)
    factors = shrink_factors(SEARCH["maxshrink"], SEARCH["grid"])
    data, weight_mask = group_rows(flat)
    with kernels.disabled():
        table = _chunk_errors(data, weight_mask, low, high, factors, spec, 2.4, 1 << 40, True).nan_to_num_(
            nan=torch.inf
        )
    factor, _, evaluated = sequential_pick(table, factors, SEARCH["patience"])
    factor = factor.reshape(low.shape)
    assert evaluated < len(factors)  # the early stop fired
    assert torch.equal(device[0], low * factor) and torch.equal(device[1], high * factor)


@pytest.mark.parametrize("spec", SPECS, ids=spec_id)
def test_the_early_stop_fires_inside_a_chunk(monkeypatch, spec):
    """The parity cases above do stop part-way through a chunk (not only at a chunk's end)."""
    stops = []
    replay_patience = lc_search._replay_patience

    def recording(errors, best, stale, patience):
        used, stale, stopped = replay_patience(errors, best, stale, patience)
        stops.append((used, errors.shape[0], stopped))
        return used, stale, stopped

    monkeypatch.setattr(lc_search, "_replay_patience", recording)
    x = small_weight()
    search(x, spec, monkeypatch, True, **SEARCH, max_working_bytes=working_bytes_for(x, 30))
    (used, count, stopped), *_ = stops
    assert stopped and used < count


def test_tied_groups_keep_the_first_candidate(monkeypatch):
    """All-zero and constant groups tie on every candidate (or on every candidate that keeps the
    value on the grid): the first of them wins, as in the loop."""
    spec = ob.QuantSpec("int4", symmetric=True, strategy="group", group_size=128)
    x = torch.zeros(4, 256)
    x[1] = 0.5
    x[2, :128] = torch.linspace(-1, 1, 128)
    for vectorized in (False, True):
        low, high = search(x, spec, monkeypatch, vectorized, **SEARCH)
        assert low[0].tolist() == [0.0, 0.0] and high[1].tolist() == [0.5, 0.5]


@pytest.mark.parametrize("spec", [SPECS[0], SPECS[4]], ids=spec_id)
def test_device_mode_reads_the_data_once_per_chunk_and_syncs_once_per_chunk(monkeypatch, spec):
    """Per chunk: one ``_unit_errors`` pass over the whole data, one ``_replay_patience`` call,
    and one host read in all of the chunk's work, the stop rule's (the CPU mode syncs once per
    candidate, and walks this weight in several cache-sized blocks)."""
    x = llm_weight(256, 1024)
    counts = {"chunks": 0, "passes": 0, "stop_rules": 0, "syncs": 0}
    counting = [False]

    def count(key, function):
        def wrapper(*args, **kwargs):
            counts[key] += 1
            return function(*args, **kwargs)

        return wrapper

    def sync_counter(method):
        def wrapper(self, *args):
            counts["syncs"] += counting[0]
            return method(self, *args)

        return wrapper

    def in_chunk_work(function):
        def wrapper(*args, **kwargs):
            counting[0] = True
            try:
                return function(*args, **kwargs)
            finally:
                counting[0] = False

        return wrapper

    for method in ("__bool__", "item", "__int__", "__float__", "tolist"):
        monkeypatch.setattr(torch.Tensor, method, sync_counter(getattr(torch.Tensor, method)))
    monkeypatch.setattr(mse_grid, "_unit_errors", count("passes", mse_grid._unit_errors))
    monkeypatch.setattr(lc_search, "_replay_patience", count("stop_rules", lc_search._replay_patience))
    monkeypatch.setattr(mse_grid, "_chunk_errors", in_chunk_work(count("chunks", mse_grid._chunk_errors)))
    monkeypatch.setattr(mse_grid, "_replay_vectorized", in_chunk_work(mse_grid._replay_vectorized))
    search(x, spec, monkeypatch, True, maxshrink=0.2, grid=100, patience=100, max_working_bytes=working_bytes_for(x, 3))
    assert counts == {"chunks": 7, "passes": 7, "stop_rules": 7, "syncs": 7}

    monkeypatch.setattr(mse_grid, "_replay", in_chunk_work(mse_grid._replay))
    counts.update(chunks=0, passes=0, stop_rules=0, syncs=0)
    search(
        x, spec, monkeypatch, False, maxshrink=0.2, grid=100, patience=100, max_working_bytes=working_bytes_for(x, 3)
    )
    assert counts["chunks"] == 7 and counts["passes"] > 7 and counts["stop_rules"] == 0 and counts["syncs"] >= 20


def test_device_mode_blocks_the_data_only_when_one_candidate_exceeds_the_budget():
    """The vectorized pass is bounded by ``max_working_bytes``: the whole data is one block
    whenever the chunk fits the budget, and only a budget below one candidate splits it."""
    data = torch.zeros(1, 512, 128)
    fits = mse_grid._block_elements(5, data.numel() * 8 * 5, True)
    assert len(list(_blocks(*data.shape, fits))) == 1
    too_small = mse_grid._block_elements(1, data.numel() * 8 // 4, True)
    assert len(list(_blocks(*data.shape, too_small))) == 4


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("spec", SPECS, ids=spec_id)
def test_cuda_search_picks_what_the_cpu_search_picks(spec):
    x = llm_weight(256, 1024)
    assert mse_grid._vectorized(x.cuda())
    with kernels.disabled():
        cpu = mse_grid_search(flatten(x, spec, "weight"), spec, **SEARCH)
        cuda = mse_grid_search(flatten(x.cuda(), spec, "weight"), spec, **SEARCH)
    same = (cuda[0].cpu() == cpu[0]) & (cuda[1].cpu() == cpu[1])
    assert same.float().mean() >= 0.999  # sums on another device may differ by ulps in near-ties
