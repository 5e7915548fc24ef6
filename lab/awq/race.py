"""A search's candidates raced through their parent's calls: the first least loss of a group with
as little of the replay as it takes (issue 41's speed).

A candidate's loss is a sum over the calibration calls of squared differences, each call's part
non-negative, so its sum after some calls is a lower bound of its loss (float addition of
non-negative parts never decreases a sum, nor does dividing by the element count reorder two
sums). Once one candidate of a group has its whole loss, a rival whose partial loss already
exceeds it, or equals it later in the grid, cannot be the group's first least: its replay stops
there. The first candidate run to the end is the one a short scout of every call's first few
calls ranks first (or one the search names, ``keep``), so the others are measured against a loss
near the least from the start. The winner and its loss are those of running every candidate
through every call: the same per-call sums, added in the same order, compared by the same rule
(``first least``: the smallest finite loss, the earliest in the grid among equal ones).

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

from lab.awq.parent import ParentCalls

SCOUT_SHARE = 8
"""A group with no whole loss yet scouts every candidate through ``1/SCOUT_SHARE`` of the calls."""


@dataclass
class Entrant:
    """One candidate of a group: its place in the grid (ties go to the earlier), its digest and
    effective weights; ``keep``: its whole loss is wanted whatever it is (never stopped)."""

    position: int
    key: str
    weights: dict[str, torch.Tensor]
    keep: bool = False


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
class Race:
    """A mapping's candidates raced on its parent (``ParentCalls``): whole losses (``known``) and
    the lower bounds of stopped candidates (``bounds``) by digest, across every group of the
    mapping's search."""

    parent: ParentCalls
    balance: dict[str, nn.Linear]
    reference: list[torch.Tensor]
    width: int
    moment: torch.Tensor
    known: dict[str, float] = field(default_factory=dict)
    bounds: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.elements = max(self.parent.elements(self.reference), 1)
        self.calls = len(self.parent.calls)

    def run(self, entrants: Sequence[Entrant], heat: Heat) -> None:
        """Every entrant's whole loss into ``known`` where it may lead ``heat`` (or is kept), the
        rest stopped as soon as their partial loss says they cannot; ``heat`` leads after."""
        self._lead(entrants, heat)
        waiting, seen = [], set()
        for entrant in sorted(entrants, key=lambda e: (not e.keep, e.position)):
            if entrant.key in self.known or entrant.key in seen:
                continue
            bound = self.bounds.get(entrant.key, 0.0)
            if entrant.keep or not heat.out_of_reach(bound, entrant.position):
                waiting.append(entrant)
                seen.add(entrant.key)
        if self.parent.linear(self.balance, self.moment):
            self._whole(waiting, heat)
        else:
            step = self.parent.step(self.width)
            for start in range(0, len(waiting), step):
                self._heat(waiting[start : start + step], heat)
        self._lead(entrants, heat)

    def _lead(self, entrants: Sequence[Entrant], heat: Heat) -> None:
        """``heat``'s leader among the entrants with a whole loss (a digest twice in a group, at
        two grid points, leads at the earlier)."""
        for entrant in entrants:
            if entrant.key in self.known and heat.beaten_by(self.known[entrant.key], entrant.position):
                heat.leader = (self.known[entrant.key], entrant.position)

    def _whole(self, entrants: list[Entrant], heat: Heat) -> None:
        """A linear parent's losses need no replay (``ParentCalls.losses``' form): all at once."""
        if not entrants:
            return
        losses = self.parent.losses(
            self.balance, [e.weights for e in entrants], self.reference, self.width, self.moment
        )
        for entrant, loss in zip(entrants, losses.tolist(), strict=True):
            self._finished(entrant, loss, heat)

    def _heat(self, entrants: list[Entrant], heat: Heat) -> None:
        """``entrants`` (one stacked replay's worth) from the first call: kept ones first run to
        the end (the first of them leads at once), else after a scout the best-placed one; then
        the rest together, each stopped once out of reach."""
        for entrant in entrants:
            self.bounds.pop(entrant.key, None)
        sums = {e.key: 0.0 for e in entrants}
        running, done = list(entrants), 0
        while running:
            if heat.leader is None:
                first = next((e for e in running if e.keep), None)
                if first is None:
                    done = self._advance(running, sums, done, min(self.calls, done + self._scout()), heat)
                    running = [e for e in running if e.key not in self.known]
                    if not running:
                        return
                    first = min(running, key=lambda e: (_finite_or_inf(sums[e.key]), e.position))
                self._advance([first], sums, done, self.calls, heat)
                running.remove(first)
                continue
            done = self._advance(running, sums, done, self.calls, heat, stop=True)
            running = [e for e in running if e.key not in self.known and e.key not in self.bounds]

    def _scout(self) -> int:
        return max(1, self.calls // SCOUT_SHARE)

    def _advance(
        self, entrants: list[Entrant], sums: dict, done: int, until: int, heat: Heat, stop: bool = False
    ) -> int:
        """``entrants`` (each ``done`` calls into its sum) through calls ``done..until`` stacked
        together; with ``stop``, until one of them is out of reach (it is stopped, its bound
        remembered, and the calls done so far returned for the rest to go on from). A candidate
        through the last call has its whole loss."""
        with closing(self.parent.replay(self.balance, [e.weights for e in entrants], self.reference, done)) as calls:
            for call_sums in calls:
                for entrant, value in zip(entrants, call_sums.tolist(), strict=True):
                    sums[entrant.key] += value
                done += 1
                if done == self.calls:
                    for entrant in entrants:
                        self._finished(entrant, sums[entrant.key] / self.elements, heat)
                    return done
                if done == until:
                    return done
                if stop:
                    out = [
                        e for e in entrants if not e.keep and heat.out_of_reach(sums[e.key] / self.elements, e.position)
                    ]
                    if out:
                        self.bounds.update({e.key: sums[e.key] / self.elements for e in out})
                        return done
        return done

    def _finished(self, entrant: Entrant, loss: float, heat: Heat) -> None:
        self.known[entrant.key] = loss
        self.bounds.pop(entrant.key, None)
        if heat.beaten_by(loss, entrant.position):
            heat.leader = (loss, entrant.position)


def _finite_or_inf(value: float) -> float:
    return value if math.isfinite(value) else math.inf
