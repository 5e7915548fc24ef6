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
from torch import nn

import observers as ob
from lab.awq import candidates, then_gptq
from lab.awq.budget import SearchBudget
from lab.awq.candidates import Candidate
from lab.awq.mappings import Mapping
from lab.awq.moment import InputMoment
from lab.awq.parent import ParentCalls
from lab.awq.race import Entrant, Heat, Race

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
class MappingInputs:
    """What a mapping's search reads: the parent's calls, the quantized balance layers, the mean
    absolute input per channel ``x_mean`` (llm-compressor's statistic) and the mean ``x xᵀ`` of
    the balance layers' input (``moment``, float64, ``(in, in)``)."""

    parent: ParentCalls
    balance: dict[str, nn.Linear]
    x_mean: torch.Tensor
    moment: InputMoment
    width: int


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
        self.reference = inputs.parent.outputs()
        self.energy = inputs.parent.energy(self.reference)
        self.race = Race(
            inputs.parent, inputs.balance, self.reference, inputs.width, inputs.moment, budget.activations()
        )
        self.budget = budget
        self._memo: dict[str, Any] = {}
        self.step = budget.batch(sum(w.numel() * w.element_size() for w in weights.values()))
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
                if not wanted or outcomes[a].error is not None:
                    continue
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
                    outcomes[a].error = str(err)
                    continue
                positions = [ask.indices.index(index) for index in wanted]
                entrants = [
                    Entrant(position, candidates.digest(c), c.effective, heats[a], ask.keep == position)
                    for position, c in zip(positions, made, strict=True)
                ]
                batch.append((a, wanted, made, entrants))
                if sum(len(made) for _, _, made, _ in batch) >= self.step:
                    self._settle(batch, heats, outcomes)
                    batch = []
            candidates.forget_smoothed(self._memo)
        self._settle(batch, heats, outcomes)
        return outcomes

    def _settle(self, batch: list, heats: list[Heat], outcomes: list[_Outcome]) -> None:
        """Race a batch's candidates and keep, per ask, its leader and kept candidate if here
        (``light``: their weights go with the batch)."""
        live = [item for item in batch if outcomes[item[0]].error is None]
        self.race.run([e for _, _, _, entrants in live for e in entrants])
        for a, part, made, entrants in live:
            leader = heats[a].leader
            for i, entrant in enumerate(entrants):
                if leader is not None and leader[1] == entrant.position:
                    outcomes[a].winner = (part[i], candidates.light(made[i]), leader[0])
                if entrant.keep:
                    outcomes[a].kept = (part[i], candidates.light(made[i]), self.race.known[entrant.key])
        self.done += sum(len(made) for _, _, made, _ in batch)
        if self.progress is not None and batch:
            self.progress(self.done)

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
        for size in {candidates.hessian_block(o, k) for o, k in observers.items() if "hessian" in ob.knobs(o)}
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
    measured = _Measured(judge, weights, spec, held_out)
    measured.measure([candidate for _, candidate, _ in kept.values()])
    if gptq is not None:
        measured.measure_gptq({key: (candidate, observers[key[1]]) for key, (_, candidate, _) in kept.items()}, gptq)
    for observer in observers:
        for variant in Variant:
            key = (variant, observer)
            if key in failed:
                result.rows.append(VariantRow(observer, variant, error=failed[key]))
                continue
            index, candidate, loss = kept[key]
            ratio, duo = (None, None) if index is None else grid[index]
            result.rows.append(measured.row(key, candidate, loss, ratio, duo))
            if candidate.scales is not None:
                result.scales[key] = candidate.scales
            result.qparams[key] = candidate.qparams
    if progress is not None and judge.done < total:
        progress(total, total)
    return result


def _errors(
    inputs: MappingInputs, made: dict[tuple, Candidate], reference, energy: float, activations: int
) -> dict[tuple, float]:
    """Each candidate's (by key) relative error of the parent's output on ``inputs``' tokens
    (``activations``: the bytes a stacked call's widest activation holds)."""
    effective = [c.effective for c in made.values()]
    losses = inputs.parent.losses(inputs.balance, effective, reference, inputs.width, inputs.moment, activations)
    return {key: float(loss) / energy if energy > 0 else 0.0 for key, loss in zip(made, losses, strict=True)}


class _LayerFigures:
    """Each balance layer's own figures of a candidate on the inputs behind ``moment``: its output
    error ``‖WX − ŴX‖² / ‖WX‖²`` and the share of its smoothed weight clipped. The layers' output
    energies are computed once, and a candidate another row already picked (observers that agree,
    a variant keeping another's pick) is looked up by its digest."""

    def __init__(self, weights: dict[str, torch.Tensor], moment: InputMoment, spec: ob.QuantSpec) -> None:
        self.weights, self.spec, self.moment = weights, spec, moment
        self.energy = {name: moment.energy(w) for name, w in weights.items()}
        self._errors: dict[str, dict[str, float]] = {}
        self._clipped: dict[str, dict[str, float]] = {}

    def errors(self, candidate: Candidate) -> dict[str, float]:
        """The candidate's layer errors (its effective weights are needed the first time only)."""
        key = candidates.digest(candidate)
        if key not in self._errors:
            self._errors[key] = {
                name: self.moment.layer_error(w, candidate.effective[name], self.energy[name])
                for name, w in self.weights.items()
            }
        return self._errors[key]

    def clipped(self, candidate: Candidate) -> dict[str, float]:
        key = candidates.digest(candidate)
        if key not in self._clipped:
            self._clipped[key] = candidate.clipped(self.weights, self.spec)
        return self._clipped[key]


class _HeldOut:
    """A search's picks on held-out inputs (the same mapping's statistics and parent calls on
    held-out text; the picks' weights do not depend on the tokens): the parent's float output and
    its energy once, each pick's loss by digest, each layer's figures."""

    def __init__(self, inputs: MappingInputs, spec: ob.QuantSpec, activations: int) -> None:
        self.inputs, self.activations = inputs, activations
        self.reference = inputs.parent.outputs()
        self.energy = inputs.parent.energy(self.reference)
        weights = {name: layer.weight.detach() for name, layer in inputs.balance.items()}
        self.figures = _LayerFigures(weights, inputs.moment, spec)
        self.losses: dict[str, float] = {}

    def measure(self, made: list[Candidate]) -> None:
        """The losses and layer figures of ``made`` (with their effective weights)."""
        parent = self.inputs.parent
        effective = [c.effective for c in made]
        inputs = self.inputs
        losses = parent.losses(inputs.balance, effective, self.reference, inputs.width, inputs.moment, self.activations)
        self.losses.update({c.key: float(loss) for c, loss in zip(made, losses, strict=True)})
        for candidate in made:
            self.figures.errors(candidate)

    def error(self, candidate: Candidate) -> float:
        loss = self.losses[candidates.digest(candidate)]
        return loss / self.energy if self.energy > 0 else 0.0


class _Measured:
    """The figures of a search's picks (``light`` candidates), their weights made again a batch at
    a time (``_Judge.with_weights``) and let go after: each layer's error and clipped share on the
    calibration inputs, with ``held_out`` the mapping's and each layer's error there, and AWQ then
    GPTQ's errors (``measure_gptq``)."""

    def __init__(
        self, judge: _Judge, weights: dict[str, torch.Tensor], spec: ob.QuantSpec, held_out: MappingInputs | None
    ) -> None:
        self.judge = judge
        self.figures = _LayerFigures(weights, judge.inputs.moment, spec)
        self.held_out = None if held_out is None else _HeldOut(held_out, spec, judge.budget.activations())
        self.gptq: dict[tuple, float] = {}
        self.gptq_held_out: dict[tuple, float] = {}
        self.weights, self.spec = weights, spec

    def measure(self, picked: list[Candidate]) -> None:
        distinct = list({candidates.digest(c): c for c in picked}.values())
        for made in self.judge.with_weights(distinct):
            for candidate in made:
                self.figures.errors(candidate)
            if self.held_out is not None:
                self.held_out.measure(made)

    def measure_gptq(self, kept: dict[tuple, tuple[Candidate, dict]], gptq: ob.GPTQSpec) -> None:
        """AWQ then GPTQ (``then_gptq``) of every kept pick, a batch at a time (the picks sharing
        scales, and so GPTQ's factors, together): the parent's error on the calibration and
        held-out inputs."""
        keys = sorted(kept, key=lambda key: candidates.scales_key(kept[key][0].scales))
        judge = self.judge
        for start in range(0, len(keys), judge.step):
            chunk = {key: kept[key] for key in keys[start : start + judge.step]}
            made = then_gptq.gptq_candidates(self.weights, chunk, judge.inputs.moment, self.spec, gptq)
            if not made:
                continue
            activations = judge.budget.activations()
            self.gptq.update(_errors(judge.inputs, made, judge.reference, judge.energy, activations))
            if self.held_out is not None:
                checked = self.held_out
                found = _errors(checked.inputs, made, checked.reference, checked.energy, activations)
                self.gptq_held_out.update(found)

    def row(self, key: tuple[Variant, str], candidate: Candidate, loss: float, ratio, duo) -> VariantRow:
        variant, observer = key
        energy = self.judge.energy
        row = VariantRow(
            observer,
            variant,
            mapping_error=loss / energy if energy > 0 else 0.0,
            mapping_loss=loss,
            layer_errors=self.figures.errors(candidate),
            clipped=self.figures.clipped(candidate),
            ratio=ratio,
            duo=duo,
            gptq_error=self.gptq.get(key),
        )
        if self.held_out is None:
            return row
        return replace(
            row,
            held_out_error=self.held_out.error(candidate),
            held_out_layer_errors=self.held_out.figures.errors(candidate),
            gptq_held_out_error=self.gptq_held_out.get(key),
        )
