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

from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any

import torch
from torch import nn

import observers as ob
from lab.awq import candidates, then_gptq
from lab.awq.candidates import Candidate
from lab.awq.mappings import Mapping
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
    moment: torch.Tensor
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


CANDIDATE_BYTES = 512 << 20
"""Bytes of effective weights made and raced at once: candidates stream through the judge, and
only each ask's winner and kept candidate stay."""


class _Judge:
    """A mapping's candidates judged on its parent's output, made a few grid points at a time and
    raced through the parent's calls (``race``: a candidate's replay stops once its partial loss
    shows it cannot be its group's first least): the float output computed once, each candidate's
    llm-compressor loss (the mean squared difference), the float output's energy per element (the
    relative errors' reference). A candidate whose qparams another already had at the same grid
    point (the min-max family agree on every weight) is not judged again: its loss, or the bound
    that stopped it, is looked up by the qparams' digest."""

    def __init__(self, inputs: MappingInputs, weights: dict[str, torch.Tensor], spec: ob.QuantSpec) -> None:
        self.inputs, self.weights, self.spec = inputs, weights, spec
        self.reference = inputs.parent.outputs()
        self.energy = inputs.parent.energy(self.reference)
        self.race = Race(inputs.parent, inputs.balance, self.reference, inputs.width, inputs.moment)
        self._memo: dict[str, Any] = {}
        size = sum(w.numel() * w.element_size() for w in weights.values())
        self.step = max(1, CANDIDATE_BYTES // max(size, 1))

    def first_least(self, scales: torch.Tensor, asks: list[_Ask]) -> list[_Outcome]:
        """Each ask's first least candidate and kept one (``_Outcome``), every ask raced together
        (``Race``: one stacked replay of all their candidates, a few asks' worth of weights made
        at a time); an ask whose observer cannot run has its error instead."""
        outcomes, heats = [_Outcome() for _ in asks], [Heat() for _ in asks]
        batch: list[tuple[int, list, list[Candidate], list[Entrant]]] = []
        for a, ask in enumerate(asks):
            for start in range(0, len(ask.indices), self.step):
                part = ask.indices[start : start + self.step]
                rows = None if part == [None] else scales[part]
                try:
                    made = candidates.make(
                        self.weights, rows, ask.observer, self.spec, ask.knobs, self.inputs.moment, ask.clip, self._memo
                    )
                except ValueError as err:
                    outcomes[a].error = str(err)
                    break
                entrants = [
                    Entrant(start + i, candidates.digest(c), c.effective, heats[a], ask.keep == start + i)
                    for i, c in enumerate(made)
                ]
                batch.append((a, part, made, entrants))
                if sum(len(made) for _, _, made, _ in batch) >= self.step:
                    self._settle(batch, heats, outcomes)
                    batch = []
        self._settle(batch, heats, outcomes)
        return outcomes

    def _settle(self, batch: list, heats: list[Heat], outcomes: list[_Outcome]) -> None:
        """Race a batch's candidates and keep, per ask, its leader and kept candidate if here."""
        live = [item for item in batch if outcomes[item[0]].error is None]
        self.race.run([e for _, _, _, entrants in live for e in entrants])
        for a, part, made, entrants in live:
            leader = heats[a].leader
            for i, entrant in enumerate(entrants):
                if leader is not None and leader[1] == entrant.position:
                    outcomes[a].winner = (part[i], made[i], leader[0])
                if entrant.keep:
                    outcomes[a].kept = (part[i], made[i], self.race.known[entrant.key])


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


@torch.no_grad()
def search(
    mapping: Mapping,
    inputs: MappingInputs,
    spec: ob.QuantSpec,
    awq: ob.AWQSpec,
    observers: dict[str, dict[str, Any]],
    gptq: ob.GPTQSpec | None = None,
    held_out: MappingInputs | None = None,
) -> MappingResult:
    """The mapping's rows for every observer (``{name: knobs}``) under every variant; with ``gptq``,
    each row's error once GPTQ follows AWQ too; with ``held_out`` (the same mapping's inputs on
    held-out text), every figure on those tokens as well (``measure_held_out``)."""
    weights = {name: layer.weight.detach() for name, layer in inputs.balance.items()}
    grid = awq.grid()
    w_mean = ob.awq.weight_means(list(weights.values()), spec) if any(duo for _, duo in grid) else None
    scales = ob.awq.candidate_scales(inputs.x_mean, w_mean, grid)
    judge = _Judge(inputs, weights, spec)
    everywhere = list(range(len(grid)))
    (searched,) = judge.first_least(scales, [_Ask(everywhere, SEARCH_OBSERVER, {})])
    if searched.error is not None:
        raise ValueError(searched.error)
    if searched.winner is None:
        raise ValueError("no candidate gave a finite loss: the parent module's outputs are not finite")
    best = searched.winner[0]

    blocks = {
        size: candidates.diagonal_blocks(inputs.moment, size).clone()
        for size in {candidates.hessian_block(o, k) for o, k in observers.items() if "hessian" in ob.knobs(o)}
    }
    digests = {name: candidates.tensor_digest(weight) for name, weight in weights.items()}
    result = MappingResult(mapping, [], {}, {}, scales[best], inputs.moment.diagonal().clone(), blocks, digests)
    picked: dict[tuple, tuple[Candidate, dict]] = {}
    figures = _LayerFigures(weights, inputs.moment, spec)
    asks = []
    for observer, knobs in observers.items():
        asks += [
            _Ask([None], observer, knobs, keep=0),
            _Ask(everywhere, observer, knobs, keep=best),
            _Ask(everywhere, observer, knobs, awq.clip_ratios()),
        ]
    outcomes = judge.first_least(scales, asks)
    for number, (observer, knobs) in enumerate(observers.items()):
        rtn, inside, clipped = outcomes[3 * number : 3 * number + 3]
        kept = {
            Variant.RTN: rtn.kept,
            Variant.LLM_COMPRESSOR: inside.kept,
            Variant.OBSERVER_IN_SEARCH: inside.winner,
            Variant.CLIP_SEARCH: clipped.winner,
        }
        failed = {
            Variant.RTN: rtn.error,
            Variant.LLM_COMPRESSOR: inside.error,
            Variant.OBSERVER_IN_SEARCH: inside.error,
            Variant.CLIP_SEARCH: clipped.error,
        }
        for variant in Variant:
            if kept[variant] is None:
                why = failed[variant] or "no candidate gave a finite loss"
                result.rows.append(VariantRow(observer, variant, error=why))
                continue
            index, candidate, loss = kept[variant]
            ratio, duo = (None, None) if index is None else grid[index]
            row = _row(observer, variant, candidate, loss, judge.energy, figures, ratio, duo)
            result.rows.append(row)
            if candidate.scales is not None:
                result.scales[(variant, observer)] = candidate.scales
            result.qparams[(variant, observer)] = candidate.qparams
            picked[(variant, observer)] = (candidate, knobs)
    made = {} if gptq is None else then_gptq.gptq_candidates(weights, picked, inputs.moment, spec, gptq)
    if made:
        error = _errors(inputs, made, judge.reference, judge.energy)
        result = replace(result, rows=[replace(r, gptq_error=error.get((r.variant, r.observer))) for r in result.rows])
    if held_out is None:
        return result
    return measure_held_out(result, held_out, spec, {key: c for key, (c, _) in picked.items()}, made)


def _errors(inputs: MappingInputs, made: dict[tuple, Candidate], reference, energy: float) -> dict[tuple, float]:
    """Each candidate's (by key) relative error of the parent's output on ``inputs``' tokens."""
    losses = inputs.parent.losses(
        inputs.balance, [c.effective for c in made.values()], reference, inputs.width, inputs.moment
    )
    return {key: float(loss) / energy if energy > 0 else 0.0 for key, loss in zip(made, losses, strict=True)}


class _LayerFigures:
    """Each balance layer's own figures of a candidate on the inputs behind ``moment``: its output
    error ``‖WX − ŴX‖² / ‖WX‖²`` and the share of its smoothed weight clipped. The layers' output
    energies are computed once, and a candidate another row already picked (observers that agree,
    a variant keeping another's pick) is looked up by its digest."""

    def __init__(self, weights: dict[str, torch.Tensor], moment: torch.Tensor, spec: ob.QuantSpec) -> None:
        self.weights, self.spec = weights, spec
        self.hessian = moment.float()
        self.energy = {name: ob.output_energy(w, self.hessian) for name, w in weights.items()}
        self._errors: dict[str, dict[str, float]] = {}
        self._clipped: dict[str, dict[str, float]] = {}

    def errors(self, candidate: Candidate) -> dict[str, float]:
        key = candidates.digest(candidate)
        if key not in self._errors:
            self._errors[key] = {
                name: ob.layer_output_error(w, candidate.effective[name], self.hessian, self.energy[name])
                for name, w in self.weights.items()
            }
        return self._errors[key]

    def clipped(self, candidate: Candidate) -> dict[str, float]:
        key = candidates.digest(candidate)
        if key not in self._clipped:
            self._clipped[key] = candidate.clipped(self.weights, self.spec)
        return self._clipped[key]


def _row(observer, variant, candidate: Candidate, loss, energy, figures: _LayerFigures, ratio, duo) -> VariantRow:
    return VariantRow(
        observer,
        variant,
        mapping_error=loss / energy if energy > 0 else 0.0,
        mapping_loss=loss,
        layer_errors=figures.errors(candidate),
        clipped=figures.clipped(candidate),
        ratio=ratio,
        duo=duo,
    )


@torch.no_grad()
def measure_held_out(
    result: MappingResult,
    inputs: MappingInputs,
    spec: ob.QuantSpec,
    picked: dict[tuple, Candidate],
    gptq: dict[tuple, Candidate] | None = None,
) -> MappingResult:
    """``result`` with each row's pick (``picked``, by ``(variant, observer)``: the candidates the
    search kept, whose weights do not depend on the tokens) measured on held-out inputs
    (``inputs``: the same mapping's statistics and parent calls on held-out text): the mapping's
    and each layer's error there, and with ``gptq`` (AWQ then GPTQ's candidates by ``(variant,
    observer)``) their mapping error."""
    weights = {name: layer.weight.detach() for name, layer in inputs.balance.items()}
    reference = inputs.parent.outputs()
    energy = inputs.parent.energy(reference)
    distinct = {candidates.digest(c): c for c in picked.values()}
    losses = inputs.parent.losses(
        inputs.balance, [c.effective for c in distinct.values()], reference, inputs.width, inputs.moment
    )
    loss_of = dict(zip(distinct, (float(v) for v in losses), strict=True))
    after_gptq = _errors(inputs, gptq, reference, energy) if gptq else {}
    figures = _LayerFigures(weights, inputs.moment, spec)
    rows = []
    for row in result.rows:
        key = (row.variant, row.observer)
        candidate = picked.get(key)
        if candidate is None:
            rows.append(row)
            continue
        loss = loss_of[candidates.digest(candidate)]
        held = loss / energy if energy > 0 else 0.0
        layers = figures.errors(candidate)
        found = replace(row, held_out_error=held, held_out_layer_errors=layers, gptq_held_out_error=after_gptq.get(key))
        rows.append(found)
    return replace(result, rows=rows)
