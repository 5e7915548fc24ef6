"""One mapping's search, four ways per weight observer (issue 41):

- ``rtn``: the observer on the weights as they are, no smoothing;
- ``llm-compressor``: llm-compressor 0.14's ``AWQModifier``: the grid of scales judged with
  ``memoryless_minmax`` standing in for every observer, then each observer on the weights smoothed
  with the scales that won;
- ``observer-in-search``: each candidate judged with the observer's own qparams, so each observer
  gets the scales that suit it;
- ``clip-search``: as ``observer-in-search``, each candidate's qparams first shrunk per group to
  the share of the observer's range (ModelOpt ``awq_clip``'s ratios) whose part of the layer's
  output on the smoothed inputs is nearest: the scale and the clip searched jointly.

Every candidate of every way is judged in one stacked replay of the parent (``parent``), raced
(``race``: a candidate stops once its loss so far shows it cannot be picked); the candidates of one
weight are deduplicated first (observers with the same qparams judge alike).
Besides the mapping's error, each balance layer's own output error (from the second moment of its
inputs) and its clipped share say where the error comes from.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any

import torch

import observers as ob
from lab.allocator import large_blocks_mapped
from lab.awq import candidates, observed
from lab.awq.budget import SearchBudget
from lab.awq.candidates import Candidate
from lab.awq.figures import PickFigures, Side
from lab.awq.inputs import MappingInputs
from lab.awq.mappings import Mapping
from lab.awq.race import Entrant, Heat, Race
from sample_models.sequential import return_freed_memory

SEARCH_OBSERVER = "memoryless_minmax"
"""What llm-compressor 0.14 swaps in for the configured observer during the scale search."""


class Variant(StrEnum):
    """The four ways a weight observer meets AWQ, in the order the issue names them."""

    RTN = "rtn"
    LLM_COMPRESSOR = "llm-compressor"
    OBSERVER_IN_SEARCH = "observer-in-search"
    CLIP_SEARCH = "clip-search"


DEPLOYED_VARIANT = Variant.LLM_COMPRESSOR
"""What a checkpoint of an AWQ run deploys unless told otherwise: what llm-compressor's recipe makes."""


@dataclass(frozen=True)
class VariantRow:
    """One observer under one variant on one mapping (``error`` says why there is nothing else).

    ``mapping_error``: ``Σ (out − float)² / Σ float²`` of the parent's output on the calibration
    tokens; ``mapping_loss``: llm-compressor's figure (the mean squared difference);
    ``layer_errors``/``clipped``: per balance layer, ``‖WX − ŴX‖² / ‖WX‖²`` and the share of the
    (smoothed) weight outside the range its qparams represent; ``ratio``/``duo``: the candidate
    that won (None for ``rtn``)."""

    observer: str
    variant: Variant
    mapping_error: float | None = None
    mapping_loss: float | None = None
    layer_errors: dict[str, float] = field(default_factory=dict)
    clipped: dict[str, float] = field(default_factory=dict)
    ratio: float | None = None
    duo: bool | None = None
    error: str | None = None
    held_out_error: float | None = None
    """``mapping_error`` on held-out tokens (``measure_held_out``): what the pick carries over."""
    gptq_error: float | None = None
    """``mapping_error`` once GPTQ quantizes the smoothed balance layers with these qparams (AWQ then
    GPTQ, ``then_gptq``; GPTQ alone under ``rtn``); None without GPTQ or where GPTQ refused."""
    held_out_layer_errors: dict[str, float] = field(default_factory=dict)
    gptq_held_out_error: float | None = None
    """``gptq_error`` on held-out tokens: the same GPTQ weights (from the calibration Hessian)."""


@dataclass
class MappingResult:
    """A mapping's rows and, per (variant, observer), the scales it smooths with (float64 ``(in,)``;
    none for ``rtn``) and each balance layer's qparams on the smoothed weight."""

    mapping: Mapping
    rows: list[VariantRow]
    scales: dict[tuple[Variant, str], torch.Tensor]
    qparams: dict[tuple[Variant, str], dict[str, ob.QParams]]
    searched: torch.Tensor
    """The scales llm-compressor's search picks (memoryless min-max), whatever the observers."""
    importance: torch.Tensor
    """The mean squared input per column of the balance layers (float64; what an observer taking
    input importance is given for the folded weights, divided by the scales squared)."""
    blocks: dict[int, torch.Tensor] = field(default_factory=dict)
    """The inputs' second-moment diagonal blocks (float64) of each size an observer of the run
    takes as a per-block Hessian: what it is given for the folded weights."""
    weights: dict[str, str] = field(default_factory=dict)
    """Each balance layer's weight as searched, in a few bytes (``candidates.tensor_digest``): a
    deployment that folds the same stored weight with the same scales quantizes the weight these
    qparams were found on, and reads them instead of observing it again."""

    def row(self, variant: Variant, observer: str) -> VariantRow:
        return next(r for r in self.rows if r.variant == variant and r.observer == observer)


class _Judge:
    """A mapping's candidates judged on its parent's output, made a slice of the grid at a time and
    raced through the parent's calls (``race``: a candidate's replay stops once its partial loss
    shows it cannot be its group's first least): the float output computed once, each candidate's
    llm-compressor loss (the mean squared difference), the float output's energy per element (the
    relative errors' reference). A candidate whose qparams another already had at the same grid
    point (the min-max family agree on every weight) is not judged again: its loss, or the bound
    that stopped it, is looked up by the qparams' digest.

    What it holds at once is ``budget``'s: the candidates of one raced batch (``budget.batch``) and
    the smoothed weights of one slice of the grid, made once for every group of the slice and let
    go after it; a group's first least and kept candidate are held ``light`` (scales and qparams),
    their weights made again when a figure needs them (``rebuilt``). ``progress(done)`` hears the
    candidates judged so far."""

    def __init__(
        self,
        inputs: MappingInputs,
        weights: dict[str, torch.Tensor],
        spec: ob.QuantSpec,
        budget: SearchBudget,
        progress: Callable[[int], None] | None = None,
    ) -> None:
        self.inputs, self.weights, self.spec, self.progress = inputs, weights, spec, progress
        self.side = Side(inputs, spec, budget.activations())
        self.race = Race(
            inputs.parent, inputs.balance, self.side.reference, inputs.width, inputs.moment, budget.activations()
        )
        self.budget = budget
        self._memo: dict[str, Any] = {}
        candidate = sum(w.numel() * w.element_size() for w in weights.values())
        self.step, self.returns_freed = budget.batch(candidate), budget.returns_freed(candidate)
        self.done = 0

    def first_least(self, scales: torch.Tensor, asks: list[_Ask], first: int | None = None) -> list[_Outcome]:
        """Each ask's first least candidate and kept one (``_Outcome``), every ask raced together
        (``Race``: one stacked replay of all their candidates, a batch of candidates at a time),
        the grid made a slice at a time (``_slices``: ``first``, a grid point likely to lead, in
        the first); an ask whose observer cannot run has its error instead."""
        outcomes, heats = [_Outcome() for _ in asks], [Heat() for _ in asks]
        batch: list[tuple[int, list, list[Candidate], list[Entrant]]] = []
        for part in _slices(asks, len(scales), self.step, first):
            for a, ask in enumerate(asks):
                wanted = [index for index in part if index in ask.indices]
                if wanted and outcomes[a].error is None:
                    batch += self._made(a, ask, wanted, scales, heats[a], outcomes[a])
                if sum(len(item[2]) for item in batch) >= self.step:
                    self._settle(batch, heats, outcomes)
            candidates.forget_slice(self._memo)
        self._settle(batch, heats, outcomes)
        return outcomes

    def _made(self, a: int, ask: _Ask, wanted: list, scales: torch.Tensor, heat: Heat, outcome: _Outcome) -> list:
        """Ask ``a``'s candidates at the grid points ``wanted`` as a batch item (none when its
        observer cannot run: ``outcome`` then says why)."""
        rows = None if wanted == [None] else scales[wanted]
        try:
            made = candidates.make(
                self.weights,
                rows,
                ask.observer,
                self.spec,
                ask.knobs,
                self.inputs.moment,
                ask.clip,
                self._memo,
                self.budget.elements(),
            )
        except ValueError as err:
            outcome.error = str(err)
            return []
        positions = [ask.indices.index(index) for index in wanted]
        entrants = [
            Entrant(position, candidates.digest(c), c.effective, heat, ask.keep == position)
            for position, c in zip(positions, made, strict=True)
        ]
        return [(a, wanted, made, entrants)]

    def _settle(self, batch: list, heats: list[Heat], outcomes: list[_Outcome]) -> None:
        """Race a batch's candidates and keep, per ask, its leader and kept candidate if here
        (``light``); the batch is emptied, its weights let go (and, for big candidates, handed
        back to the system)."""
        live = [item for item in batch if outcomes[item[0]].error is None]
        self.race.run([e for item in live for e in item[3]])
        for item in live:
            self._keep(item, heats[item[0]], outcomes[item[0]])
        self.done += sum(len(item[2]) for item in batch)
        if self.progress is not None and batch:
            self.progress(self.done)
        live.clear()
        batch.clear()
        if self.returns_freed:
            return_freed_memory()

    def _keep(self, item: tuple, heat: Heat, outcome: _Outcome) -> None:
        """A batch item's leader and kept candidate, if among its candidates, as ``light`` ones."""
        _, part, made, entrants = item
        for i, entrant in enumerate(entrants):
            if heat.leader is not None and heat.leader[1] == entrant.position:
                outcome.winner = (part[i], candidates.light(made[i]), heat.leader[0])
            if entrant.keep:
                outcome.kept = (part[i], candidates.light(made[i]), self.race.known[entrant.key])

    def with_weights(self, picked: list[Candidate]) -> Iterator[list[Candidate]]:
        """``picked`` (``light``) with their effective weights made again, a batch at a time."""
        for start in range(0, len(picked), self.step):
            part = picked[start : start + self.step]
            yield candidates.rebuilt(self.weights, part, self.spec, self._memo, self.budget.elements())


def _slices(asks: list[_Ask], count: int, step: int, first: int | None) -> Iterator[list]:
    """The grid points a search makes together, in turn: the unsmoothed weights (``[None]``) when
    an ask wants them, then the ``count`` grid points a slice at a time, as many as leave each ask
    a share of a raced batch of ``step`` candidates, ``first`` at the head of the first slice (the
    race then finds a near-least loss early; its picks do not depend on the order)."""
    if any(None in ask.indices for ask in asks):
        yield [None]
    gridded = sum(1 for ask in asks if None not in ask.indices)
    if not gridded:
        return
    order = list(range(count)) if first is None else [first, *(i for i in range(count) if i != first)]
    size = max(1, step // gridded)
    for start in range(0, count, size):
        yield order[start : start + size]


@dataclass(frozen=True)
class _Ask:
    """One group of a mapping's search: an observer's candidates at grid ``indices`` (``[None]``:
    the weights unsmoothed), clip-searched with ``clip``'s ratios when given; ``keep``: the
    position in ``indices`` whose loss is wanted whatever it is."""

    indices: list
    observer: str
    knobs: dict[str, Any]
    clip: list[float] | None = None
    keep: int | None = None


@dataclass
class _Outcome:
    """An ask's first least ``(grid index, candidate, loss)`` (None: no finite loss), its kept
    candidate the same way, or why its observer could not run."""

    winner: tuple | None = None
    kept: tuple | None = None
    error: str | None = None


Progress = Callable[[int, int], None]
"""``progress(done, total)``: a search's candidates judged so far, of all it will judge."""


@torch.no_grad()
def search(
    mapping: Mapping,
    inputs: MappingInputs,
    spec: ob.QuantSpec,
    awq: ob.AWQSpec,
    observers: dict[str, dict[str, Any]],
    gptq: ob.GPTQSpec | None = None,
    held_out: MappingInputs | None = None,
    budget: SearchBudget | None = None,
    progress: Progress | None = None,
) -> MappingResult:
    """The mapping's rows for every observer (``{name: knobs}``) under every variant; with ``gptq``,
    each row's error once GPTQ follows AWQ too; with ``held_out`` (the same mapping's inputs on
    held-out text), every figure on those tokens as well (``_HeldOut``). What it holds at once is
    within ``budget`` (default: the caps of ``lab.awq.budget``); ``progress`` hears the candidates
    judged."""
    weights = {name: layer.weight.detach() for name, layer in inputs.balance.items()}
    budget = SearchBudget() if budget is None else budget
    budget.check(mapping.name, sum(w.numel() * w.element_size() for w in weights.values()))
    grid = awq.grid()
    w_mean = ob.awq.weight_means(list(weights.values()), spec) if any(duo for _, duo in grid) else None
    scales = ob.awq.candidate_scales(inputs.x_mean, w_mean, grid)
    total = len(grid) + len(observers) * (1 + 2 * len(grid))
    judge = _Judge(inputs, weights, spec, budget, None if progress is None else lambda done: progress(done, total))
    everywhere = list(range(len(grid)))
    (searched,) = judge.first_least(scales, [_Ask(everywhere, SEARCH_OBSERVER, {})])
    if searched.error is not None:
        raise ValueError(searched.error)
    if searched.winner is None:
        raise ValueError("no candidate gave a finite loss: the parent module's outputs are not finite")
    best = searched.winner[0]

    blocks = {
        size: inputs.moment.blocks(size).clone()
        for size in {observed.hessian_block(o, k) for o, k in observers.items() if "hessian" in ob.knobs(o)}
    }
    digests = {name: candidates.tensor_digest(weight) for name, weight in weights.items()}
    result = MappingResult(mapping, [], {}, {}, scales[best], inputs.moment.diagonal(), blocks, digests)
    asks = []
    for observer, knobs in observers.items():
        asks += [
            _Ask([None], observer, knobs, keep=0),
            _Ask(everywhere, observer, knobs, keep=best),
            _Ask(everywhere, observer, knobs, awq.clip_ratios()),
        ]
    outcomes = judge.first_least(scales, asks, first=best)
    kept: dict[tuple[Variant, str], tuple] = {}
    failed: dict[tuple[Variant, str], str] = {}
    for number, observer in enumerate(observers):
        rtn, inside, clipped = outcomes[3 * number : 3 * number + 3]
        picks = {
            Variant.RTN: (rtn.kept, rtn.error),
            Variant.LLM_COMPRESSOR: (inside.kept, inside.error),
            Variant.OBSERVER_IN_SEARCH: (inside.winner, inside.error),
            Variant.CLIP_SEARCH: (clipped.winner, clipped.error),
        }
        for variant, (pick, error) in picks.items():
            if pick is None:
                failed[(variant, observer)] = error or "no candidate gave a finite loss"
            else:
                kept[(variant, observer)] = pick
    # the picks' figures make a few large tensors of several sizes (a pick's smoothed weights for its
    # clipped share): mapped for themselves, so that a heap that keeps freed blocks does not strand them
    with large_blocks_mapped():
        checked = None if held_out is None else Side(held_out, spec, judge.budget.activations())
        figures = PickFigures(judge.side, checked, judge.with_weights, judge.step)
        figures.measure([candidate for _, candidate, _ in kept.values()])
        if gptq is not None:
            with_knobs = {key: (candidate, observers[key[1]]) for key, (_, candidate, _) in kept.items()}
            figures.measure_gptq(with_knobs, weights, spec, gptq)
        for observer in observers:
            for variant in Variant:
                key = (variant, observer)
                if key in failed:
                    result.rows.append(VariantRow(observer, variant, error=failed[key]))
                    continue
                index, candidate, loss = kept[key]
                ratio, duo = (None, None) if index is None else grid[index]
                result.rows.append(_row(key, candidate, loss, ratio, duo, figures))
                if candidate.scales is not None:
                    result.scales[key] = candidate.scales
                result.qparams[key] = candidate.qparams
    if progress is not None and judge.done < total:
        progress(total, total)
    return result


def _row(key: tuple[Variant, str], candidate: Candidate, loss: float, ratio, duo, figures: PickFigures) -> VariantRow:
    """A kept pick's row: its loss from the race, its figures from ``figures``."""
    variant, observer = key
    calibration, held_out = figures.calibration, figures.held_out
    row = VariantRow(
        observer,
        variant,
        mapping_error=calibration.relative(loss),
        mapping_loss=loss,
        layer_errors=calibration.layers.errors(candidate),
        clipped=calibration.layers.clipped(candidate),
        ratio=ratio,
        duo=duo,
        gptq_error=figures.gptq.get(key),
    )
    if held_out is None:
        return row
    return replace(
        row,
        held_out_error=held_out.error(candidate),
        held_out_layer_errors=held_out.layers.errors(candidate),
        gptq_held_out_error=figures.gptq_held_out.get(key),
    )
