"""The allocation's optimisation: one option (a scheme and observer, with its cost in checkpoint
bytes and its score, the model's loss with that layer alone quantized) per group of layers that
must share a scheme, the least total score within a budget of bytes. A multiple-choice knapsack.

Solved exactly as an integer program with scipy's ``milp`` (HiGHS, branch and bound to a zero
gap): one binary per option, one "exactly one" row per group, one budget row. A dynamic program
over the cost axis would need the costs on a grid; in bytes that grid has billions of points for
a real model, and rounding costs onto a coarse one can pick an allocation that does not fit or
miss the best one. Options no better and no cheaper than another of their group are dropped
first (they are never needed), so the program stays small; the answer's cost is checked in exact
integer bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Option:
    """One way to quantize a group: what it is called (``label``), what it stores (``cost``, bytes)
    and what it does to the model (``score``, lower is better)."""

    label: str
    cost: int
    score: float


@dataclass(frozen=True)
class Allocation:
    """The option chosen for each group (in the groups' order), their total cost and score, and
    ``unconstrained`` when the budget left every group its best option."""

    chosen: tuple[Option, ...]
    cost: int
    score: float
    unconstrained: bool = False


def least_cost(groups: Sequence[Sequence[Option]]) -> int:
    """The cheapest allocation's cost: every group's cheapest option."""
    return sum(min(option.cost for option in options) for options in _checked(groups))


def solve(groups: Sequence[Sequence[Option]], budget: int) -> Allocation:
    """The least total score with total cost at most ``budget`` bytes. A budget below the cheapest
    allocation is a ``ValueError`` naming the least feasible one; a budget above what the best
    option of every group costs returns those (``unconstrained``)."""
    groups = _checked(groups)
    cheapest = least_cost(groups)
    if budget < cheapest:
        raise ValueError(f"the budget of {budget:,} bytes is below the cheapest allocation, {cheapest:,} bytes")
    best = tuple(min(options, key=lambda o: (o.score, o.cost)) for options in groups)
    if sum(o.cost for o in best) <= budget:
        return Allocation(best, sum(o.cost for o in best), sum(o.score for o in best), unconstrained=True)
    kept = [_undominated(options) for options in groups]
    chosen = _milp(kept, budget)
    return Allocation(chosen, sum(o.cost for o in chosen), sum(o.score for o in chosen))


def _checked(groups: Sequence[Sequence[Option]]) -> list[list[Option]]:
    found = [list(options) for options in groups]
    if not found or any(not options for options in found):
        raise ValueError("every group needs at least one option, and there must be a group")
    for options in found:
        for option in options:
            if option.cost < 0 or not np.isfinite(option.score):
                raise ValueError(f"option {option.label!r}: a cost must be ≥ 0 and a score finite")
    return found


def _undominated(options: list[Option]) -> list[Option]:
    """The options no other option beats on both cost and score (the group's own frontier)."""
    kept: list[Option] = []
    for option in sorted(options, key=lambda o: (o.cost, o.score)):
        if not kept or option.score < kept[-1].score:
            kept.append(option)
    return kept


def _milp(groups: list[list[Option]], budget: int) -> tuple[Option, ...]:
    """The integer program; a solution over the budget by the solver's feasibility tolerance is
    solved again with the bound lowered by its excess, so the answer fits in exact bytes."""
    from scipy.optimize import Bounds, LinearConstraint, milp

    flat = [option for options in groups for option in options]
    owner = np.repeat(np.arange(len(groups)), [len(options) for options in groups])
    one_each = np.zeros((len(groups), len(flat)))
    one_each[owner, np.arange(len(flat))] = 1.0
    costs = np.array([[option.cost for option in flat]], dtype=float)
    bound = budget + 0.5  # costs are whole bytes: half a byte of room decides nothing
    for _ in range(RETRIES):
        result = milp(
            np.array([option.score for option in flat]),
            integrality=np.ones(len(flat)),
            bounds=Bounds(0, 1),
            constraints=[LinearConstraint(one_each, 1.0, 1.0), LinearConstraint(costs, -np.inf, bound)],
            options={"mip_rel_gap": 0.0},
        )
        if result.x is None:
            break
        picked = sorted(np.flatnonzero(np.round(result.x) == 1), key=lambda i: owner[i])
        chosen = tuple(flat[i] for i in picked)
        total = sum(option.cost for option in chosen)
        if len(chosen) == len(groups) and total <= budget:
            return chosen
        bound -= max(total - budget, 1)
    raise ValueError(f"the integer program found no allocation within {budget:,} bytes")


RETRIES = 8
