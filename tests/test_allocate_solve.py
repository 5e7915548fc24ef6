"""The allocation's solver (issue 34, ``lab.allocate.solve``): the least total score within a budget,
one option per group, against brute force over every allocation of small random cases."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lab.allocate.solve import Option, least_cost, solve

option = st.builds(
    Option,
    label=st.text(min_size=1, max_size=3),
    cost=st.integers(0, 1000),
    score=st.floats(0, 10, allow_nan=False, allow_infinity=False),
)
groups = st.lists(st.lists(option, min_size=1, max_size=4), min_size=1, max_size=4)


def _brute(cases, budget):
    fits = [c for c in itertools.product(*cases) if sum(o.cost for o in c) <= budget]
    return min(sum(o.score for o in c) for c in fits) if fits else None


@settings(max_examples=150, deadline=None)
@given(groups, st.integers(0, 4000))
def test_the_solver_finds_the_least_score_brute_force_finds(cases, budget):
    best = _brute(cases, budget)
    if best is None:
        with pytest.raises(ValueError, match=f"cheapest allocation, {least_cost(cases):,} bytes"):
            solve(cases, budget)
        return
    found = solve(cases, budget)
    assert found.cost <= budget and found.cost == sum(o.cost for o in found.chosen)
    assert [any(o is p for p in group) for o, group in zip(found.chosen, cases, strict=True)] == [True] * len(cases)
    assert found.score == pytest.approx(best, abs=1e-9)


def test_a_budget_above_every_best_takes_the_best_per_group():
    cases = [[Option("fp8", 8, 0.1), Option("nvfp4", 4, 0.5)], [Option("none", 16, 0.0), Option("w4", 4, 1.0)]]
    found = solve(cases, 10_000)
    assert found.unconstrained and [o.label for o in found.chosen] == ["fp8", "none"]
    tight = solve(cases, 12)
    assert not tight.unconstrained and tight.cost <= 12
    assert [o.label for o in tight.chosen] == ["fp8", "w4"] and tight.score == pytest.approx(1.1)


def test_bad_input_is_one_line():
    with pytest.raises(ValueError, match="at least one option"):
        solve([[]], 10)
    with pytest.raises(ValueError, match="score finite"):
        solve([[Option("x", 1, float("nan"))]], 10)
    with pytest.raises(ValueError, match="below the cheapest allocation, 5 bytes"):
        solve([[Option("a", 5, 1.0), Option("b", 9, 0.0)]], 4)


def test_costs_of_real_checkpoints_fit_to_the_byte():
    """Billions of bytes, a budget one byte short of the best: the answer fits in exact bytes."""
    cases = [[Option("a", 4_000_000_001, 1.0), Option("b", 4_000_000_000, 2.0)] for _ in range(3)]
    found = solve(cases, 12_000_000_002)
    assert found.cost == 12_000_000_002 and found.score == pytest.approx(4.0)
    assert solve(cases, 12_000_000_001).score == pytest.approx(5.0)
