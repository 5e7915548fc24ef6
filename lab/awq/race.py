"""A search's candidates raced through their parent's calls: the first least loss of a group with
as little of the replay as it takes (issue 41's speed).

A candidate's loss is a sum over the calibration calls of squared differences (a linear parent's,
over blocks of its output rows: ``LinearCalls``), each call's part non-negative, added in call
order. Its parts so far, added in call order with the calls not yet run adding nothing, are a lower
bound of its loss: rounding is monotonic, so leaving out a non-negative part never makes a float sum
larger, nor does dividing by the element count reorder two sums. Once one candidate of a group has
its whole loss, a rival whose partial loss already exceeds it, or equals it later in the grid,
cannot be the group's first least: its replay stops there. The first candidate run to the end is
the one a short scout of every call's first few calls ranks first (or one the search names,
``keep``), so the others are measured against a loss near the least from the start; its parts then
set the order the rest of the calls run in, the heaviest first, so a rival out of reach shows it in
fewer calls. The winner and its loss are those of running every candidate through every call: the
same per-call sums (up to the few ulps by which a batched product's width moves them, as the width
of any stacked replay does), added in the same order, compared by the same rule (``first least``:
the smallest finite loss, the earliest in the grid among equal ones).

A stopped candidate's partial loss is remembered by its digest: a later group (another observer's
pass over the same grid point) that already has a lower loss skips it outright, and one that
needs it runs it again from the first call.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from contextlib import closing
from dataclasses import dataclass, field

import torch
from torch import nn

from lab.awq.budget import ACTIVATION_BYTES
from lab.awq.moment import InputMoment
from lab.awq.parent import ParentCalls, stacked

SCOUT_SHARE = 8
"""A group with no whole loss yet scouts every candidate through ``1/SCOUT_SHARE`` of the calls."""


@dataclass
class Heat:
    """One group's race so far: the leader's ``(loss, position)`` (None: no whole finite loss yet),
    carried over the chunks of candidates a big model makes one at a time."""

    leader: tuple[float, int] | None = None

    def beaten_by(self, loss: float, position: int) -> bool:
        """Whether a whole ``loss`` at ``position`` leads: finite, and less (or equal, earlier)."""
        if not math.isfinite(loss):
            return False
        return self.leader is None or (loss, position) < self.leader

    def out_of_reach(self, bound: float, position: int) -> bool:
        """Whether a candidate whose loss is at least ``bound`` cannot lead."""
        if not math.isfinite(bound):
            return True
        return self.leader is not None and (bound, position) > self.leader


@dataclass
class Entrant:
    """One candidate in one group (``heat``): its place in the grid (ties go to the earlier), its
    digest and effective weights; ``keep``: its whole loss is wanted whatever it is."""

    position: int
    key: str
    weights: dict[str, torch.Tensor]
    heat: Heat
    keep: bool = False


class _Runner:
    """One distinct candidate (by digest) in the replay, for every group it is in: stopped only
    where it can lead none of them and none keeps it. ``parts``: its sum of each call run so far
    (0 for the others)."""

    def __init__(self, entries: list[Entrant], calls: int) -> None:
        self.entries, self.key, self.weights = entries, entries[0].key, entries[0].weights
        self.parts = [0.0] * calls

    @property
    def sum(self) -> float:
        """Its parts added in call order: its whole loss once every call has run, a lower bound
        before (a call not run adds an exact zero)."""
        total = 0.0
        for part in self.parts:
            total += part
        return total

    def may_lead(self, bound: float) -> bool:
        return any(e.keep or not e.heat.out_of_reach(bound, e.position) for e in self.entries)


class _Stack:
    """Runners' weights stacked once for the replay (``parent.stacked``), the live ones kept in
    front: a runner that stops or finishes leaves a slot that a live runner from behind the front
    takes (its weights copied once), so every replay of the live runners reads a prefix of the one
    stack instead of stacking their weights again (a few hundred megabytes per replay on an MLP
    with every observer's candidates)."""

    def __init__(self, runners: list[_Runner]) -> None:
        self.order = list(runners)
        self.weights = stacked([r.weights for r in runners])

    def front(self, live: list[_Runner]) -> tuple[list[_Runner], dict[str, torch.Tensor]]:
        """``live`` (runners of the stack; the others are gone for good) in their stacked order and
        their weights, a view of the stack's front."""
        wanted, count = {id(r) for r in live}, len(live)
        holes = [i for i in range(count) if id(self.order[i]) not in wanted]
        movers = [i for i in range(count, len(self.order)) if id(self.order[i]) in wanted]
        if holes:
            to, source = torch.tensor(holes), torch.tensor(movers)
            for weights in self.weights.values():
                weights[to] = weights[source]
            for hole, mover in zip(holes, movers, strict=True):
                self.order[hole] = self.order[mover]
        del self.order[count:]
        return list(self.order), {name: weights[:count] for name, weights in self.weights.items()}


@dataclass
class Race:
    """A mapping's candidates raced on its parent (``ParentCalls``): whole losses (``known``) and
    the lower bounds of stopped candidates (``bounds``) by digest, across every group of the
    mapping's search. The groups raced together share one stacked replay."""

    parent: ParentCalls
    balance: dict[str, nn.Linear]
    reference: list[torch.Tensor]
    width: int
    moment: InputMoment
    activations: int = ACTIVATION_BYTES
    """Bytes of the parent's widest activation one stacked replay holds (``lab.awq.budget``)."""
    known: dict[str, float] = field(default_factory=dict)
    bounds: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.judged = self.parent.judged(self.balance, self.moment)
        self.elements = max(self.judged.elements(self.reference), 1)
        self.calls = len(self.judged.calls)
        self.order = list(range(self.calls))
        """The calls in the order a replay runs them: as given until a first candidate has run
        them all, then its heaviest parts first (``_learn_order``)."""
        self._heaviest: list[int] | None = None

    def run(self, entrants: Sequence[Entrant]) -> None:
        """Every entrant's whole loss into ``known`` where it may lead its heat (or is kept), the
        rest stopped as soon as their partial loss says they cannot; each heat leads after."""
        self._lead(entrants)
        by_key: dict[str, list[Entrant]] = {}
        for entrant in sorted(entrants, key=lambda e: (not e.keep, e.position)):
            if entrant.key not in self.known:
                by_key.setdefault(entrant.key, []).append(entrant)
        waiting = [_Runner(entries, self.calls) for entries in by_key.values()]
        waiting = [r for r in waiting if r.may_lead(self.bounds.get(r.key, 0.0))]
        step = self.judged.step(self.width, self.activations)
        for start in range(0, len(waiting), step):
            self._heat(waiting[start : start + step])
        self._lead(entrants)

    def _lead(self, entrants: Sequence[Entrant]) -> None:
        """Each heat's leader among its entrants with a whole loss (a digest twice in a group, at
        two grid points, leads at the earlier)."""
        for entrant in entrants:
            loss = self.known.get(entrant.key)
            if loss is not None and entrant.heat.beaten_by(loss, entrant.position):
                entrant.heat.leader = (loss, entrant.position)

    def _heat(self, runners: list[_Runner]) -> None:
        """``runners`` (one stacked replay's worth) from the first call. A heat without a leader
        gets one first: its kept candidate, else after a scout of every runner its best-placed
        one, run to the end with the other heats' firsts; then the rest together, each stopped
        at the first call where it is out of reach."""
        for runner in runners:
            self.bounds.pop(runner.key, None)
            runner.parts = [0.0] * self.calls
        if self._heaviest is not None:
            self.order = list(self._heaviest)
        running, done, stack = list(runners), 0, _Stack(runners)
        while running:
            open_heats = {id(e.heat): e.heat for r in running for e in r.entries if e.heat.leader is None}
            if open_heats:
                if any(not self._kept(running, heat) for heat in open_heats.values()):
                    done = self._advance(stack, running, done, min(self.calls, done + self._scout()))
                    running = [r for r in running if r.key not in self.known]
                firsts = {id(f): f for heat in open_heats.values() if (f := self._first(running, heat)) is not None}
                if not firsts:
                    continue
                self._advance(_Stack(list(firsts.values())), list(firsts.values()), done, self.calls)
                self._learn_order(list(firsts.values()), done)
                running = [r for r in running if id(r) not in firsts]
                continue
            done = self._advance(stack, running, done, self.calls, stop=True)
            running = [r for r in running if r.key not in self.known and r.key not in self.bounds]

    def _learn_order(self, finished: list[_Runner], done: int) -> None:
        """Once, from the first candidates run through every call: the calls ordered by their
        summed parts, heaviest first (ties in call order). The ``done`` calls the running
        candidates have already run keep their places; later heats run the whole order."""
        if self._heaviest is not None:
            return
        weight = [sum(r.parts[c] for r in finished if math.isfinite(r.parts[c])) for c in range(self.calls)]
        heaviest = sorted(range(self.calls), key=lambda c: -weight[c])
        run = set(self.order[:done])
        self.order[done:] = [c for c in heaviest if c not in run]
        self._heaviest = heaviest

    def _scout(self) -> int:
        return max(1, self.calls // SCOUT_SHARE)

    @staticmethod
    def _kept(running: list[_Runner], heat: Heat) -> _Runner | None:
        return next((r for r in running if any(e.heat is heat and e.keep for e in r.entries)), None)

    def _first(self, running: list[_Runner], heat: Heat) -> _Runner | None:
        """The runner to run to the end for ``heat``: its kept one, else the least partial loss
        (the earliest place among equal ones)."""
        kept = self._kept(running, heat)
        if kept is not None:
            return kept
        placed = [
            (_finite_or_inf(r.sum), e.position, i) for i, r in enumerate(running) for e in r.entries if e.heat is heat
        ]
        return running[min(placed)[2]] if placed else None

    def _advance(self, stack: _Stack, runners: list[_Runner], done: int, until: int, stop: bool = False) -> int:
        """``runners`` (each through the first ``done`` calls of ``order``; their weights in
        ``stack``) through its calls ``done..until`` stacked together; with ``stop``, until one of
        them is out of reach (those are stopped, their bounds remembered, and the calls done so far
        returned for the rest to go on from). A runner through the last call has its whole loss."""
        runners, weights = stack.front(runners)
        order = self.order[done:]
        with closing(self.judged.replay(self.balance, weights, self.reference, order)) as calls:
            for index, call_sums in zip(order, calls, strict=True):
                for runner, value in zip(runners, call_sums.tolist(), strict=True):
                    runner.parts[index] = value
                done += 1
                if done == self.calls:
                    for runner in runners:
                        self._finished(runner, runner.sum / self.elements)
                    return done
                if done == until:
                    return done
                if stop:
                    out = [r for r in runners if not r.may_lead(r.sum / self.elements)]
                    if out:
                        self.bounds.update({r.key: r.sum / self.elements for r in out})
                        return done
        return done

    def _finished(self, runner: _Runner, loss: float) -> None:
        self.known[runner.key] = loss
        self.bounds.pop(runner.key, None)
        self._lead(runner.entries)


def _finite_or_inf(value: float) -> float:
    return value if math.isfinite(value) else math.inf
