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

Every candidate of every way is judged in one stacked replay of the parent (``parent``); the
candidates of one weight are deduplicated first (observers with the same qparams judge alike).
Besides the mapping's error, each balance layer's own output error (from the second moment of its
inputs) and its clipped share say where the error comes from.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import torch
from torch import nn

import observers as ob
from lab.awq.mappings import Mapping
from lab.awq.parent import ParentCalls

SEARCH_OBSERVER = "memoryless_minmax"
"""What llm-compressor 0.14 swaps in for the configured observer during the scale search."""


class Variant(StrEnum):
    """The four ways a weight observer meets AWQ, in the order the issue names them."""

    RTN = "rtn"
    LLM_COMPRESSOR = "llm-compressor"
    OBSERVER_IN_SEARCH = "observer-in-search"
    CLIP_SEARCH = "clip-search"


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


@dataclass
class MappingResult:
    """A mapping's rows and, per (variant, observer), the scales it smooths with (float64 ``(in,)``;
    none for ``rtn``) and each balance layer's qparams on the smoothed weight."""

    mapping: Mapping
    rows: list[VariantRow]
    scales: dict[tuple[Variant, str], torch.Tensor]
    qparams: dict[tuple[Variant, str], dict[str, ob.QParams]]

    def row(self, variant: Variant, observer: str) -> VariantRow:
        return next(r for r in self.rows if r.variant == variant and r.observer == observer)


@dataclass
class _Candidate:
    """One way to quantize the balance layers: scales (None: unsmoothed), each layer's qparams on
    its smoothed weight and the effective weight ``Q(W·s)/s`` the parent runs with."""

    scales: torch.Tensor | None
    qparams: dict[str, ob.QParams]
    effective: dict[str, torch.Tensor]
    clipped: dict[str, float]


def _smoothed(weight: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
    """``W·s`` in the weight's dtype, as llm-compressor writes it (float64 product, then cast)."""
    return weight if scales is None else (weight.double() * scales.view(1, -1)).to(weight.dtype)


def _effective(quantized: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
    """``Q(W·s)/s`` in the weight's dtype, as llm-compressor runs the parent with it."""
    return quantized if scales is None else (quantized.double() / scales.view(1, -1)).to(quantized.dtype)


def _statistic_knobs(observer: str, knobs: dict[str, Any], moment: torch.Tensor, scales, spec) -> dict[str, Any]:
    """The observer's knobs with the input statistics it takes filled for the smoothed inputs
    ``x/s``: the mean square per column (``importance``) and the per-block second moment
    (``hessian``)."""
    taken = ob.knobs(observer)
    filled = dict(knobs)
    inverse = 1.0 if scales is None else 1.0 / scales
    if "importance" in taken and filled.get("importance") is None:
        filled["importance"] = (moment.diagonal() * inverse**2).float()
    if "hessian" in taken and filled.get("hessian") is None:
        size = int(filled.get("block_size", ob.knobs(observer).get("block_size", 16)))
        blocks = _diagonal_blocks(moment, size)
        if scales is not None:
            s = (1.0 / scales).reshape(-1, size)
            blocks = blocks * s.unsqueeze(2) * s.unsqueeze(1)
        filled["hessian"] = blocks.float()
    return filled


def _diagonal_blocks(moment: torch.Tensor, size: int) -> torch.Tensor:
    """The ``(in/size, size, size)`` diagonal blocks of an ``(in, in)`` second moment."""
    groups = moment.shape[0] // size
    return moment.reshape(groups, size, groups, size).diagonal(dim1=0, dim2=2).permute(2, 0, 1)


def _observe(observer: str, weight: torch.Tensor, spec: ob.QuantSpec, knobs: dict[str, Any]) -> ob.QParams:
    found = ob.run_one(observer, weight, spec, "weight", **knobs)
    if found.qparams is None:
        raise ValueError(found.error or f"{observer} gave no qparams")
    return found.qparams


def _candidate(
    weights: dict[str, torch.Tensor], scales, observer: str, spec, knobs, moment, clip: list[float] | None
) -> _Candidate:
    """Every balance layer smoothed by ``scales``, observed, optionally clip-searched, quantized."""
    observer_knobs = _statistic_knobs(observer, knobs, moment, scales, spec)
    qparams, effective, clipped = {}, {}, {}
    block_moment = None
    if clip is not None:
        size = spec.group_size if spec.strategy == "group" else next(iter(weights.values())).shape[1]
        block_moment = _diagonal_blocks(moment, size)
        if scales is not None:
            s = (1.0 / scales).reshape(-1, size)
            block_moment = block_moment * s.unsqueeze(2) * s.unsqueeze(1)
    for name, weight in weights.items():
        smoothed = _smoothed(weight, scales)
        qp = _observe(observer, smoothed, spec, observer_knobs)
        if clip is not None:
            qp = _clip_search(smoothed, qp, spec, clip, block_moment)
        quantized = ob.fake_quantize(smoothed, qp, spec)
        qparams[name] = qp
        effective[name] = _effective(quantized, scales)
        clipped[name] = float(ob.quantization_metrics(smoothed, qp, spec).get("clip_ratio", 0.0))
    return _Candidate(scales, qparams, effective, clipped)


def _clip_search(weight: torch.Tensor, qp: ob.QParams, spec, ratios: list[float], block_moment) -> ob.QParams:
    """Per group, the share of ``qp``'s range (among ``ratios``) whose part of the layer's output
    error on the smoothed inputs is least (the first least, in the ratios' order)."""
    candidates = ob.awq.shrunk(qp, spec, ratios)
    differences = torch.stack([weight.float() - ob.fake_quantize(weight, c, spec).float() for c in candidates])
    errors = ob.awq.group_output_errors(differences, block_moment.to(differences.device))
    best = torch.argmin(errors, dim=0)
    chosen = torch.tensor(ratios, dtype=torch.float32, device=weight.device)[best].reshape(qp.min_val.shape)
    return ob.qparams.range_rule(qp.min_val * chosen, qp.max_val * chosen, spec)


class _Plan:
    """The distinct candidates of a mapping, each judged once: ``key`` (variant, observer, grid
    index) → its candidate's position. Observers whose qparams agree on a weight (the min-max
    family on any weight) share a candidate."""

    def __init__(self) -> None:
        self.candidates: list[_Candidate] = []
        self.at: dict[tuple, int] = {}
        self._slots: dict[tuple, list[int]] = {}

    def add(self, key: tuple, slot: tuple, candidate: _Candidate) -> None:
        for position in self._slots.get(slot, []):
            same = self.candidates[position].effective
            if all(torch.equal(same[name], weight) for name, weight in candidate.effective.items()):
                self.at[key] = position
                return
        self._slots.setdefault(slot, []).append(len(self.candidates))
        self.at[key] = len(self.candidates)
        self.candidates.append(candidate)


def search(
    mapping: Mapping,
    inputs: MappingInputs,
    spec: ob.QuantSpec,
    awq: ob.AWQSpec,
    observers: dict[str, dict[str, Any]],
) -> MappingResult:
    """The mapping's rows for every observer (``{name: knobs}``) under every variant."""
    weights = {name: layer.weight.detach() for name, layer in inputs.balance.items()}
    grid = awq.grid()
    w_mean = ob.awq.weight_means(list(weights.values()), spec) if any(duo for _, duo in grid) else None
    scales = ob.awq.candidate_scales(inputs.x_mean, w_mean, grid)
    reference = inputs.parent.outputs()
    errors: dict[tuple[Variant, str], str] = {}

    def make(scale_index: int | None, observer: str, knobs: dict, clip: list[float] | None) -> _Candidate:
        chosen = None if scale_index is None else scales[scale_index]
        return _candidate(weights, chosen, observer, spec, knobs, inputs.moment, clip)

    plan = _Plan()
    for index in range(len(grid)):
        plan.add(("search", SEARCH_OBSERVER, index), (index, False), make(index, SEARCH_OBSERVER, {}, None))
    ways = ((Variant.RTN, None), (Variant.OBSERVER_IN_SEARCH, None), (Variant.CLIP_SEARCH, awq.clip_ratios()))
    for observer, knobs in observers.items():
        for variant, clip in ways:
            indices = [None] if variant == Variant.RTN else range(len(grid))
            try:
                found = [(index, make(index, observer, knobs, clip)) for index in indices]
            except ValueError as err:
                errors[(variant, observer)] = str(err)
                continue
            for index, candidate in found:
                plan.add((variant, observer, index), (index, clip is not None), candidate)
    losses, energy = inputs.parent.losses(
        inputs.balance, [c.effective for c in plan.candidates], reference, inputs.width
    )

    best = ob.awq.first_minimum(
        torch.stack([losses[plan.at[("search", SEARCH_OBSERVER, i)]] for i in range(len(grid))])
    )
    second = _Plan()
    for observer, knobs in observers.items():
        try:
            second.add((Variant.LLM_COMPRESSOR, observer, best), (best,), make(best, observer, knobs, None))
        except ValueError as err:
            errors[(Variant.LLM_COMPRESSOR, observer)] = str(err)
    second_losses, _ = inputs.parent.losses(
        inputs.balance, [c.effective for c in second.candidates], reference, inputs.width
    )

    result = MappingResult(mapping, [], {}, {})
    for observer in observers:
        for variant in Variant:
            key = (variant, observer)
            if key in errors:
                result.rows.append(VariantRow(observer, variant, error=errors[key]))
                continue
            if variant == Variant.LLM_COMPRESSOR:
                position = second.at[(variant, observer, best)]
                candidate, loss, index = second.candidates[position], float(second_losses[position]), best
            else:
                indices = [None] if variant == Variant.RTN else list(range(len(grid)))
                positions = [plan.at[(variant, observer, i)] for i in indices]
                pick = ob.awq.first_minimum(torch.stack([losses[p] for p in positions]))
                index, position = indices[pick], positions[pick]
                candidate, loss = plan.candidates[position], float(losses[position])
            result.rows.append(_row(observer, variant, candidate, loss, energy, weights, inputs.moment, grid, index))
            if candidate.scales is not None:
                result.scales[key] = candidate.scales
            result.qparams[key] = candidate.qparams
    return result


def _row(observer, variant, candidate: _Candidate, loss, energy, weights, moment, grid, index) -> VariantRow:
    hessian = moment.float()
    layer_errors = {
        name: ob.layer_output_error(weights[name].float(), candidate.effective[name].float(), hessian)
        for name in weights
    }
    ratio, duo = (None, None) if index is None else grid[index]
    return VariantRow(
        observer,
        variant,
        mapping_error=loss / energy if energy > 0 else 0.0,
        mapping_loss=loss,
        layer_errors=layer_errors,
        clipped=dict(candidate.clipped),
        ratio=ratio,
        duo=duo,
    )
