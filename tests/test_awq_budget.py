"""What an AWQ search holds at once (issue 54): the memory budget shared out between the raced
batch, a making step and a replay's activations, refused in one line when it holds no candidate;
the inputs' second moment kept as tokens while they are fewer than the columns; and a search under
a budget that makes and races one candidate at a time picking what an unbounded one picks."""

from __future__ import annotations

import pytest
import torch
from helpers import save_checkpoint
from helpers import tiny_llama as random_llama

import lab.awq.budget as awq_budget
import lab.awq.search as awq_search
import observers as ob
from lab.awq.budget import (
    ACTIVATION_BYTES,
    BATCH_BYTES,
    BATCH_SHARE,
    STACKED_ELEMENTS,
    SearchBudget,
    search_budget,
)
from lab.awq.moment import InputMoment
from lab.awq.run import run_awq
from lab.awq.search import SEARCH_OBSERVER
from sample_models import open_model

INT4_G16 = ob.QuantSpec(dtype="int4", strategy="group", group_size=16, symmetric=True)

# ------------------------------------------------------------------------------------------ budget


def test_an_unbounded_budget_holds_what_a_search_needs_to_be_fast_and_a_small_one_less() -> None:
    free = SearchBudget()
    assert free.batch(1 << 20) == BATCH_BYTES >> 20
    assert free.elements() == STACKED_ELEMENTS and free.activations() == ACTIVATION_BYTES
    small = SearchBudget(64 << 20)
    assert small.batch(1 << 20) == 16  # a quarter of 64 MiB, in 1 MiB candidates
    assert small.activations() == 8 << 20 and small.elements() < STACKED_ELEMENTS
    assert SearchBudget(1 << 40).batch(1 << 20) == free.batch(1 << 20)  # the caps hold however large
    assert small.batch(1 << 30) == 1  # never less than one candidate


def test_a_budget_that_holds_no_candidate_is_one_line_naming_the_mapping_and_the_flag() -> None:
    SearchBudget(BATCH_SHARE << 20).check("norm → up", 1 << 20)
    with pytest.raises(ValueError) as refused:
        SearchBudget((BATCH_SHARE << 20) - 1).check("model.layers.0.norm → gate, up", 1 << 20)
    assert "model.layers.0.norm → gate, up" in str(refused.value) and "--max-memory" in str(refused.value)
    assert "\n" not in str(refused.value)
    assert search_budget(100 << 20, 10 << 20, torch.device("cpu")).bytes == 80 << 20
    with pytest.raises(ValueError, match="does not hold a block and its smoothed copy"):
        search_budget(20 << 20, 10 << 20, torch.device("cpu"))


def test_a_walk_under_a_budget_too_small_for_one_candidate_stops_before_it_runs(tmp_path) -> None:
    directory = save_checkpoint(random_llama(layers=2), tmp_path / "llama")
    model = open_model(str(directory))
    sizes = {info.name: info for info in model.layers()}
    block = sum(info.params * 4 for name, info in sizes.items() if name.startswith("model.layers.0."))
    gate = sizes["model.layers.0.mlp.gate_proj"].params * 4
    max_memory = 2 * block + BATCH_SHARE * 2 * gate - 1  # the block, its copy, and no room for gate and up
    calls = []
    model.capture = lambda *args, **kwargs: calls.append(args)  # the walk must refuse before any pass
    with pytest.raises(ValueError, match="holds no candidate of model.layers.0.post_attention_layernorm"):
        run_awq(model, INT4_G16, {SEARCH_OBSERVER: {}}, samples=2, seq_len=32, max_memory=max_memory)
    assert calls == []


# ------------------------------------------------------------------------------------------ moment


def _batches(columns: int, sizes: list[int], seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(size, columns, generator=generator) * (1 + torch.arange(columns) % 5) for size in sizes]


def test_the_summed_form_is_the_per_batch_float64_sum_bit_for_bit() -> None:
    batches = _batches(24, [10, 7, 16], seed=1)  # 33 tokens outnumber 24 columns
    moment = InputMoment(24)
    for rows in batches:
        moment.add(rows)
    assert not moment.held_as_tokens
    total = None
    for rows in batches:
        wide = rows.double()
        total = wide.T @ wide if total is None else total + wide.T @ wide
    by_hand = total / 33
    assert torch.equal(moment.full(), by_hand)
    assert torch.equal(moment.diagonal(), by_hand.diagonal())
    assert torch.equal(moment.blocks(8), by_hand.reshape(3, 8, 3, 8).diagonal(dim1=0, dim2=2).permute(2, 0, 1))
    with pytest.raises(ValueError, match="takes no rows once it has been read"):
        moment.add(batches[0])


@pytest.mark.parametrize("seed", range(4))
def test_tokens_fewer_than_the_columns_are_kept_and_give_the_same_figures(seed: int) -> None:
    batches = _batches(64, [9, 12, 5], seed=seed)  # 26 tokens, 64 columns
    tokens = InputMoment(64)
    for rows in batches:
        tokens.add(rows)
    assert tokens.held_as_tokens
    x = torch.cat(batches).double()
    summed = InputMoment.of_matrix(x.T @ x / x.shape[0], x.shape[0])
    assert torch.allclose(tokens.full(), summed.full(), rtol=1e-12, atol=0)
    assert torch.allclose(tokens.diagonal(), summed.diagonal(), rtol=1e-12, atol=0)
    assert torch.allclose(tokens.blocks(16), summed.blocks(16), rtol=1e-12, atol=1e-12)
    generator = torch.Generator().manual_seed(100 + seed)
    weight = torch.randn(20, 64, generator=generator)
    approx = weight + 0.01 * torch.randn(20, 64, generator=generator)
    assert tokens.energy(weight) == pytest.approx(summed.energy(weight), rel=1e-5)
    error = tokens.layer_error(weight, approx, tokens.energy(weight))
    assert error == pytest.approx(summed.layer_error(weight, approx, summed.energy(weight)), rel=1e-4)
    assert error == pytest.approx(ob.layer_output_error(weight, approx, (x.T @ x / x.shape[0]).float()), rel=1e-4)
    assert tokens.layer_error(weight * 0, weight * 0, 0.0) == 0.0


def test_the_tokens_give_way_to_the_sum_once_they_outnumber_the_columns() -> None:
    batches = _batches(16, [6, 6, 6], seed=7)
    moment = InputMoment(16)
    moment.add(batches[0])
    moment.add(batches[1])
    assert moment.held_as_tokens
    moment.add(batches[2])
    assert not moment.held_as_tokens and moment.count == 18
    total = None
    for rows in batches:
        wide = rows.double()
        total = wide.T @ wide if total is None else total + wide.T @ wide
    assert torch.equal(moment.full(), total / 18)


# ------------------------------------------------------------------------------------------ search


def test_a_search_making_and_racing_one_candidate_at_a_time_picks_what_an_unbounded_one_picks(monkeypatch) -> None:
    model = open_model("tiny-llama")
    observers = {SEARCH_OBSERVER: {}, "mse_grid": {}, "imatrix_mse": {}}
    awq = ob.AWQSpec(n_grid=5)
    layers = ["model.layers.0.mlp.up_proj", "model.layers.0.mlp.down_proj"]
    settings = {"layers": layers, "samples": 4, "seq_len": 64}
    unbounded = run_awq(model, INT4_G16, observers, awq, **settings)
    candidate = 2 * 688 * 256 * 4  # gate and up, float32
    small = SearchBudget(BATCH_SHARE * candidate)
    assert small.batch(candidate) == 1
    monkeypatch.setattr(awq_budget, "search_budget", lambda *args: small)
    returned = []  # big candidates hand the memory a batch freed back after it: here every batch
    monkeypatch.setattr(awq_budget, "RETURNED_CANDIDATE_BYTES", 0)
    monkeypatch.setattr(awq_search, "return_freed_memory", lambda: returned.append(1))
    steps = []
    bounded = run_awq(model, INT4_G16, observers, awq, progress=steps.append, **settings)
    assert len(returned) >= 2 * (5 + 3 * 11) // 3  # a batch of one candidate, twins and stopped ones included
    assert len(bounded.results) == len(unbounded.results) == 2
    for mine, theirs in zip(bounded.results, unbounded.results, strict=True):
        assert torch.equal(mine.searched, theirs.searched)
        for a, b in zip(mine.rows, theirs.rows, strict=True):
            assert (a.observer, a.variant, a.ratio, a.duo, a.error) == (b.observer, b.variant, b.ratio, b.duo, b.error)
            assert a.mapping_loss == pytest.approx(b.mapping_loss, rel=1e-6)
            assert a.held_out_error == pytest.approx(b.held_out_error, rel=1e-6)
        for key, qparams in theirs.qparams.items():
            for layer, qp in qparams.items():
                assert torch.equal(mine.qparams[key][layer].scale, qp.scale)
    # a bar per mapping: each mapping's steps count its candidates up to their total
    for number in (1, 2):
        own = [s for s in steps if s.number == number]
        assert own[-1].done == own[-1].total == 5 + 3 * (1 + 2 * 5) and own[0].mappings == 2
        assert [s.done for s in own] == sorted(s.done for s in own) and len(own) > 3
