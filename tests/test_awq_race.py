"""The race of AWQ candidates through their parent's calls (``lab.awq.race``): the first least loss
of a group, and the kept candidates' whole losses, are those of running every candidate through
every call, while out-of-reach rivals stop early."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from lab.awq.moment import InputMoment
from lab.awq.parent import ParentCalls
from lab.awq.race import Entrant, Heat, Race


class _Table:
    """A parent whose per-call sums are a table (candidate id → one non-negative sum per call):
    what ``Race`` reads of ``ParentCalls``, with the candidate-calls it was asked for counted."""

    def __init__(self, table: dict[int, list[float]], elements: int, step: int) -> None:
        self.table, self._elements, self._step = table, elements, step
        self.calls = [None] * len(next(iter(table.values())))
        self.work = 0

    def judged(self, balance, moment) -> _Table:
        return self

    def step(self, width: int, activations: int = 0) -> int:
        return self._step

    def elements(self, reference) -> int:
        return self._elements

    def replay(self, balance, weights, reference, order=None):
        ids = [int(i) for i in weights["id"]]
        for index in range(len(self.calls)) if order is None else order:
            self.work += len(ids)
            yield torch.tensor([self.table[i][index] for i in ids], dtype=torch.float64)


def _whole(sums: list[float], elements: int) -> float:
    total = 0.0
    for value in sums:
        total += value
    return total / elements


def _first_least(losses: list[float]) -> int | None:
    finite = [(loss, i) for i, loss in enumerate(losses) if math.isfinite(loss)]
    return min(finite)[1] if finite else None


def _race(table: _Table) -> Race:
    return Race(table, {}, [], 1, torch.eye(1))


def _entrants(ids: list[int], heat: Heat, keep: set[int] = frozenset()) -> list[Entrant]:
    return [Entrant(i, f"c{c}", {"id": torch.tensor(c)}, heat, i in keep) for i, c in enumerate(ids)]


_sum = st.one_of(
    st.sampled_from([0.0, 1.0, 2.0, 0.5]),  # ties across candidates and calls
    st.floats(0, 10, allow_nan=False),
    st.just(math.inf),
    st.just(math.nan),
)


@settings(max_examples=200, deadline=None)
@given(
    data=st.data(),
    count=st.integers(1, 9),
    calls=st.integers(1, 12),
    step=st.integers(1, 6),
    elements=st.integers(1, 7),
)
def test_the_race_finds_every_candidate_run_to_the_ends_first_least(data, count, calls, step, elements) -> None:
    table = {c: data.draw(st.lists(_sum, min_size=calls, max_size=calls)) for c in range(count)}
    # a group may name one candidate twice (two grid points with one digest) and keep some
    ids = data.draw(st.lists(st.integers(0, count - 1), min_size=1, max_size=count + 2))
    keep = set(data.draw(st.lists(st.integers(0, len(ids) - 1), max_size=2)))
    parent = _Table(table, elements, step)
    race, heat = _race(parent), Heat()
    race.run(_entrants(ids, heat, keep))
    losses = [_whole(table[c], elements) for c in ids]
    expected = _first_least(losses)
    if expected is None:
        assert heat.leader is None
    else:
        assert heat.leader is not None and heat.leader[1] == expected
        assert heat.leader[0] == losses[expected]  # the same sums added in the same order
    for position in keep:
        found = race.known[f"c{ids[position]}"]
        assert found == losses[position] or (math.isnan(found) and math.isnan(losses[position]))
    assert parent.work <= (len(set(ids)) + 1) * calls * 2  # never more than a scout and a run each


@settings(max_examples=200, deadline=None)
@given(data=st.data(), count=st.integers(1, 8), calls=st.integers(1, 10), step=st.integers(1, 9))
def test_groups_raced_together_each_find_their_own_first_least(data, count, calls, step) -> None:
    # several groups in one stacked replay, sharing candidates (one digest in two groups) and
    # keeping some: each group's leader is its own first least, every kept loss whole
    table = {c: data.draw(st.lists(_sum, min_size=calls, max_size=calls)) for c in range(count)}
    groups = data.draw(st.lists(st.lists(st.integers(0, count - 1), min_size=1, max_size=6), min_size=1, max_size=4))
    parent = _Table(table, 2, step)
    race, entrants, heats = _race(parent), [], []
    for ids in groups:
        heat = Heat()
        keep = set(data.draw(st.lists(st.integers(0, len(ids) - 1), max_size=1)))
        heats.append((heat, ids, keep))
        entrants += _entrants(ids, heat, keep)
    race.run(entrants)
    for heat, ids, keep in heats:
        losses = [_whole(table[c], 2) for c in ids]
        expected = _first_least(losses)
        assert heat.leader == (None if expected is None else (losses[expected], expected))
        for position in keep:
            found = race.known[f"c{ids[position]}"]
            assert found == losses[position] or (math.isnan(found) and math.isnan(losses[position]))


@settings(max_examples=100, deadline=None)
@given(data=st.data(), calls=st.integers(2, 10))
def test_a_later_group_skips_or_reruns_what_an_earlier_one_stopped(data, calls) -> None:
    # candidates stopped in one group keep their bound; a later group with a better candidate skips
    # them, one where they may lead runs them again: both find the first least of whole losses
    table = {c: data.draw(st.lists(st.floats(0, 10), min_size=calls, max_size=calls)) for c in range(6)}
    race = _race(_Table(table, 3, 4))
    for ids in ([0, 1, 2, 3], [4, 1, 2], [2, 3, 5], [1, 0]):
        heat = Heat()
        race.run(_entrants(ids, heat))
        losses = [_whole(table[c], 3) for c in ids]
        assert heat.leader == (losses[_first_least(losses)], _first_least(losses))


def test_rivals_far_behind_stop_early_and_a_tie_goes_to_the_earlier_place() -> None:
    table = {c: [1.0] * 32 for c in range(10)}
    table[3] = table[7] = [0.1] * 32  # the least, twice: the earlier place leads
    parent = _Table(table, 4, 64)
    race, heat = _race(parent), Heat()
    race.run(_entrants(list(range(10)), heat))
    assert heat.leader == (_whole(table[3], 4), 3)
    # a scout of 4 calls for all ten, the leader run on alone, every rival stopped a call later;
    # the tie of 7 runs to the end (it may still lead until its last call)
    assert parent.work == 10 * 4 + 28 + 28 + 8 * 1
    assert race.bounds.keys() == {f"c{c}" for c in range(10) if c not in (3, 7)}


def test_a_kept_candidate_leads_from_the_first_call_without_a_scout() -> None:
    table = {c: [1.0 + c] * 16 for c in range(5)}  # candidate c adds 1 + c per call
    parent = _Table(table, 1, 64)
    race, heat = _race(parent), Heat()
    race.run(_entrants([0, 1, 2, 3, 4], heat, keep={0}))
    assert heat.leader == (16.0, 0) and race.known == {"c0": 16.0}
    # the kept one runs first, alone; then the rivals together, each stopped at the first call
    # where it cannot lead: 4 and 3 (a tie, later) after 4 calls, 2 after 6, 1 (a tie) after 8
    assert parent.work == 16 + 4 * 4 + 2 * 2 + 2
    assert race.bounds == {"c4": 20.0, "c3": 16.0, "c2": 18.0, "c1": 16.0}
    # a later group, in the other order: 0 leads at the last place; the bounds of 4 and 2 keep them
    # out, while 3 and 1 (bounds equal to the lead, at earlier places) run again, from the first call
    again = Heat()
    race.run(_entrants([4, 3, 2, 1, 0], again))
    assert again.leader == (16.0, 4)
    assert parent.work == 38 + 2 * 5 + 4 and race.bounds == {"c4": 20.0, "c3": 20.0, "c2": 18.0, "c1": 18.0}


def test_the_calls_run_heaviest_first_once_a_first_candidate_has_run_them_all() -> None:
    # the kept candidate's loss sits in its last four calls; a rival's too. Run in the given order
    # each rival would need ten or eleven calls to reach the leader's 4.0, run heaviest first it
    # needs two (three for 1)
    table = {c: [0.1 * c] * 8 + [1.0 + 0.5 * c] * 4 for c in range(6)}
    parent = _Table(table, 1, 64)
    race, heat = _race(parent), Heat()
    race.run(_entrants(list(range(6)), heat, keep={0}))
    assert heat.leader == (4.0, 0) and race.order == [8, 9, 10, 11, 0, 1, 2, 3, 4, 5, 6, 7]
    assert parent.work == 12 + 3 + 4 * 2
    # a bound is the parts run so far added in call order: the loss of the calls not run left out
    assert race.bounds == {"c1": 4.5, **{f"c{c}": 2 * (1.0 + 0.5 * c) for c in range(2, 6)}}
    # a later group runs the heaviest calls first from its first call, and still finds the whole
    # losses in call order: 5's parts are [0.5] * 8 + [3.5] * 4, added one by one
    again, before = Heat(), parent.work
    race.run(_entrants([5], again, keep={0}))
    assert again.leader == (_whole(table[5], 1), 0) and parent.work == before + 12


def test_the_race_on_a_parent_module_picks_what_every_loss_picks() -> None:
    torch.manual_seed(6)
    mlp = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    calls = [((torch.randn(1, int(n), 16),), {}) for n in (5, 9, 3, 7, 8, 4, 6, 2)]
    parent = ParentCalls(mlp, calls, [torch.ones(1, args[0].shape[1], dtype=torch.bool) for args, _ in calls])
    reference = parent.outputs()
    weights = [mlp[0].weight.detach() + spread * torch.randn(32, 16) for spread in (0.3, 0.05, 0.2, 0.01, 0.1, 0.4)]
    losses = parent.losses({"0": mlp[0]}, [{"0": w} for w in weights], reference, 32, torch.eye(16).double())
    with torch.no_grad():
        by_hand = [
            sum(
                float(F.mse_loss(mlp[2](mlp[1](F.linear(a[0], w, mlp[0].bias))), r, reduction="sum"))
                for (a, _), r in zip(calls, reference, strict=True)
            )
            / sum(r.numel() for r in reference)
            for w in weights
        ]
    assert torch.allclose(losses, torch.tensor(by_hand, dtype=torch.float64), rtol=1e-5)
    race, heat = Race(parent, {"0": mlp[0]}, reference, 32, torch.eye(16).double()), Heat()
    race.run([Entrant(i, f"w{i}", {"0": w}, heat) for i, w in enumerate(weights)])
    # The pick is exact; the loss is the same per-call sums added in the same order, but the race's
    # batched products are narrower than ``losses``' (fewer candidates stacked), and a BLAS may block
    # a product of another width otherwise: the loss agrees to float32 rounding, not to the bit.
    assert heat.leader[1] == 3 == int(losses.argmin())
    assert math.isclose(heat.leader[0], float(losses[3]), rel_tol=1e-5)
    assert len(race.bounds) >= 3  # the far ones stopped before the last call


class _Poisoned(nn.Module):
    """A parent whose output is never finite (a NaN somewhere upstream, say)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x) * math.nan


def test_a_search_whose_every_candidate_has_no_finite_loss_is_one_error() -> None:
    import observers as ob
    from lab.awq.inputs import MappingInputs
    from lab.awq.mappings import Mapping
    from lab.awq.search import search

    torch.manual_seed(8)
    module = _Poisoned()
    x = torch.randn(1, 12, 16)
    parent = ParentCalls(module, [((x,), {})], [torch.ones(1, 12, dtype=torch.bool)])
    moment = InputMoment.of(x[0])
    inputs = MappingInputs(parent, {"proj": module.proj}, x[0].abs().mean(0), moment, 8)
    spec = ob.QuantSpec(dtype="int4", strategy="group", group_size=16, symmetric=True)
    with pytest.raises(ValueError, match="no candidate gave a finite loss"):
        search(Mapping("norm", ("proj",), "parent", 0), inputs, spec, ob.AWQSpec(n_grid=3), {"mse_grid": {}})


def test_the_live_runners_stay_in_front_of_one_stack() -> None:
    from lab.awq.race import _Runner, _Stack

    heat = Heat()
    runners = [_Runner([Entrant(i, f"c{i}", {"w": torch.full((2, 3), float(i))}, heat)], 1) for i in range(5)]
    stack = _Stack(runners)
    buffer = stack.weights["w"]
    a, b, c, d, e = runners
    live, weights = stack.front([b, d, e])
    # the two slots left in front (a's and c's) are taken by d and e, b stays: two weights copied
    assert live == [d, b, e]
    assert weights["w"].data_ptr() == buffer.data_ptr() and weights["w"].shape == (3, 2, 3)
    assert torch.equal(weights["w"], torch.stack([r.weights["w"] for r in live]))
    live, weights = stack.front([e, b])
    assert live == [e, b] and torch.equal(weights["w"][:, 0, 0], torch.tensor([4.0, 1.0]))
    alone = _Stack([a])  # one runner's weights are read where they are, never copied
    assert alone.weights["w"].data_ptr() == a.weights["w"].data_ptr() and alone.weights["w"].shape == (1, 2, 3)
