"""From scores to allocations, and each allocation measured end to end.

Per layer and scheme the option is the scheme with the observer that damages the model least
(a layer's cost does not depend on its observer, so the best observer under each scheme is all the
solver needs); layers a server fuses (``lab.runtime.fusion``) form one group whose option is a
scheme for all of them, with each member's own best observer. ``allocate`` solves one budget
(``lab.allocate.solve``); ``uniform`` puts every layer on one scheme; ``fixed`` takes a rule
(a scheme per layer). ``measure`` runs an allocation with all its choices applied together and
``frontier`` does it for every budget and every uniform scheme, so that the prediction (the sum
of the scores, which assumes the layers' damages add) is seen beside what the model does.

The scores come from the held-out text's scoring part, and a point is measured on the measuring
part (``measured``, out of sample) and on the scoring part too (``in_sample``): the prediction and
the in-sample figure share their text, so their gap is the layers' interaction; the measured
figure adds what another text does (``lab.allocate.held_out``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from lab.allocate.held_out import PARTS, HeldOut
from lab.allocate.schemes import NONE, Budget, Scheme
from lab.allocate.score import Scores, quantized
from lab.allocate.solve import Option, least_cost, solve
from lab.effect.evaluate import ChoiceSet, Evaluator
from lab.results import damage
from lab.scheme.cost import LayerSizes

PART_RATIO = 1.5
"""Measured over predicted (or predicted over measured) beyond this: the two part, and the page says so."""


@dataclass(frozen=True)
class LayerChoice:
    """One layer's scheme, its observers (None for ``none``), what it stores and its score."""

    layer: str
    scheme: str
    observer: str | None
    input_observer: str | None
    bytes: int
    score: float


Options = dict[str, dict[str, LayerChoice]]
"""Per layer, per scheme that gave qparams on it (and ``none``), its best ``LayerChoice``."""


@dataclass
class Point:
    """One allocation: what it chose per layer, its size (the chosen layers' bytes, as average bits
    per weight, and the whole checkpoint's bytes), its predicted score (the sum of its scores, on
    the scoring part) and, once measured, the model-level metrics with every choice applied
    together on the measuring part (``measured``, out of sample) and on the scoring part
    (``in_sample``), and their damage (``measured_score``, ``in_sample_score``)."""

    name: str
    kind: str
    choices: tuple[LayerChoice, ...]
    layer_bytes: int
    bits_per_weight: float
    checkpoint_bytes: int
    predicted: float
    budget: str | None = None
    unconstrained: bool = False
    measured: dict[str, float] = field(default_factory=dict)
    measured_score: float | None = None
    in_sample: dict[str, float] = field(default_factory=dict)
    in_sample_score: float | None = None

    def schemes(self) -> dict[str, str]:
        return {choice.layer: choice.scheme for choice in self.choices}

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "kind": self.kind,
            "budget": self.budget,
            "unconstrained": self.unconstrained,
            "layer_bytes": self.layer_bytes,
            "bits_per_weight": self.bits_per_weight,
            "checkpoint_bytes": self.checkpoint_bytes,
            "predicted": self.predicted,
            "measured": self.measured,
            "measured_score": self.measured_score,
            "in_sample": self.in_sample,
            "in_sample_score": self.in_sample_score,
            "layers": [choice.__dict__ for choice in self.choices],
        }


def layer_options(scores: Scores, sizes: LayerSizes, schemes: Sequence[Scheme]) -> Options:
    """Each layer's options: every scheme that gave qparams on it, with its best observer, and
    ``none`` when it is a candidate (score 0: the float layer)."""
    by_name = {scheme.name: scheme for scheme in schemes}
    options: Options = {layer: {} for layer in sizes.shapes}
    for row in scores.best().itertuples(index=False):
        scheme = by_name[row.scheme]
        cost = sizes.layer_bytes(row.layer, scheme.weight, scheme.input)
        input_observer = row.input_observer if isinstance(row.input_observer, str) else None  # NaN: none
        options[row.layer][row.scheme] = LayerChoice(
            row.layer, row.scheme, row.observer, input_observer, cost, float(row.score)
        )
    if NONE in by_name:
        for layer, found in options.items():
            found[NONE] = LayerChoice(layer, NONE, None, None, sizes.layer_bytes(layer, None), 0.0)
    bare = [layer for layer, found in options.items() if not found]
    if bare:
        raise ValueError(f"no candidate scheme applies to {', '.join(bare[:3])}: add 'none' to --schemes")
    return options


def _group_options(options: Options, groups: Sequence[tuple[str, list[str]]]) -> list[list[Option]]:
    """Per fused group, the schemes every member can take, with the members' summed cost and score."""
    found = []
    for name, members in groups:
        shared = [s for s in options[members[0]] if all(s in options[m] for m in members)]
        if not shared:
            raise ValueError(f"the fused layers of {name} share no candidate scheme: add 'none' to --schemes")
        found.append(
            [
                Option(
                    scheme,
                    sum(options[m][scheme].bytes for m in members),
                    sum(options[m][scheme].score for m in members),
                )
                for scheme in shared
            ]
        )
    return found


def _point(name: str, kind: str, choices: Sequence[LayerChoice], sizes: LayerSizes, **extra: Any) -> Point:
    total = sum(choice.bytes for choice in choices)
    predicted = sum(choice.score for choice in choices)
    checkpoint = sizes.checkpoint_bytes(total)
    return Point(name, kind, tuple(choices), total, sizes.bits_per_weight(total), checkpoint, predicted, **extra)


def _budget_words(sizes: LayerSizes, layer_bytes: int) -> str:
    bits = sizes.bits_per_weight(layer_bytes)
    return f"{bits:.4g} bits per weight (a {sizes.checkpoint_bytes(layer_bytes):,}-byte checkpoint)"


def scheme_layers(sizes: LayerSizes, schemes: Sequence[Scheme]) -> dict[str, list[str]]:
    """Each quantizing scheme's layers: those the checkpoint stores packed under it (a scheme it
    would leave dense, or cannot export, is no option there). A scheme with none is a
    ``ValueError`` saying why."""
    found = {}
    for scheme in (s for s in schemes if not s.dense):
        reasons = {layer: sizes.why_dense(layer, scheme.weight) for layer in sizes.shapes}
        found[scheme.name] = [layer for layer, why in reasons.items() if why is None]
        if not found[scheme.name]:
            layer, why = next(iter(reasons.items()))
            raise ValueError(f"scheme {scheme.name} applies to no chosen layer (e.g. {layer}: {why})")
    return found


def check_budgets(sizes: LayerSizes, schemes: Sequence[Scheme], budgets: Sequence[Budget]) -> None:
    """Before any scoring: a budget below every layer's cheapest scheme cannot be met, whatever
    the scores (``allocate`` checks again with the schemes each layer turned out to take)."""
    cheapest = 0
    for layer in sizes.shapes:
        costs = []
        for scheme in schemes:
            if scheme.dense or sizes.why_dense(layer, scheme.weight) is None:
                costs.append(sizes.layer_bytes(layer, scheme.weight, scheme.input))
        cheapest += min(costs, default=0)
    for budget in budgets:
        if budget.layer_bytes(sizes.weights, sizes.rest_bytes) < cheapest:
            raise ValueError(
                f"budget {budget.text} is below the cheapest allocation of these schemes: the least feasible is "
                f"{_budget_words(sizes, cheapest)}"
            )


def allocate(options: Options, groups: Sequence[tuple[str, list[str]]], sizes: LayerSizes, budget: Budget) -> Point:
    """The least predicted damage within ``budget``. Below the cheapest allocation: a
    ``ValueError`` naming the least feasible budget; above every group's best: those (``unconstrained``)."""
    grouped = _group_options(options, groups)
    limit = budget.layer_bytes(sizes.weights, sizes.rest_bytes)
    cheapest = least_cost(grouped)
    if limit < cheapest:
        raise ValueError(
            f"budget {budget.text} is below the cheapest allocation of these schemes: the least feasible is "
            f"{_budget_words(sizes, cheapest)}"
        )
    solved = solve(grouped, limit)
    choices = [
        options[member][option.label]
        for (_, members), option in zip(groups, solved.chosen, strict=True)
        for member in members
    ]
    order = {layer: index for index, layer in enumerate(sizes.shapes)}
    choices.sort(key=lambda choice: order[choice.layer])
    name = f"budget {budget.text}"
    return _point(name, "budget", choices, sizes, budget=budget.text, unconstrained=solved.unconstrained)


def uniform(options: Options, sizes: LayerSizes, scheme: str) -> Point | None:
    """Every layer on ``scheme`` with its best observer; None when the scheme misses a layer."""
    if not all(scheme in found for found in options.values()):
        return None
    return _point(f"all {scheme}", "uniform", [found[scheme] for found in options.values()], sizes)


def fixed(options: Options, sizes: LayerSizes, name: str, scheme_of: Callable[[str], str]) -> Point:
    """A rule's allocation (``scheme_of(layer)``), each layer with its best observer under it."""
    missing = [layer for layer, found in options.items() if scheme_of(layer) not in found]
    if missing:
        raise ValueError(f"{name}: the rule's scheme does not apply to {', '.join(missing[:3])}")
    return _point(name, "rule", [found[scheme_of(layer)] for layer, found in options.items()], sizes)


def choice_set(point: Point, scores: Scores) -> ChoiceSet:
    """The allocation as one set of quantized tensors, each layer's from its scheme's analyses."""
    tensors, observers = {}, {}
    for c in point.choices:
        if c.scheme != NONE:
            part = quantized(scores.analyses[c.scheme], c.layer, c.observer, c.input_observer, point.name)
            tensors |= part.tensors
            observers |= part.observers
    return ChoiceSet(point.name, tensors, observers)


def _damaged(evaluator: Evaluator, chosen: ChoiceSet, metric: str) -> tuple[dict[str, float], float]:
    """``chosen``'s end-to-end metrics on ``evaluator``'s text and their damage against the float
    model on the same text (a part's own float perplexity, not the other part's)."""
    metrics = dict(evaluator.evaluate(chosen).metrics)
    return metrics, damage(metric, metrics[metric], evaluator.float_metrics()[metric])


def measure(point: Point, held_out: HeldOut, scores: Scores) -> Point:
    """The point with its end-to-end metrics (every choice applied at once) and their damage, on
    the measuring part (``measured``) and on the scoring part its scores came from (``in_sample``)."""
    chosen = choice_set(point, scores)
    measured, measured_score = _damaged(held_out.measuring, chosen, scores.metric)
    in_sample, in_sample_score = _damaged(held_out.scoring, chosen, scores.metric)
    return replace(
        point, measured=measured, measured_score=measured_score, in_sample=in_sample, in_sample_score=in_sample_score
    )


@dataclass
class Frontier:
    """The budgets' allocations and the uniform schemes, measured; the rank correlation of
    predicted (scoring part) and measured (measuring part) damage over all of them; where the two
    part; ``held_out``: the split in one line (``HeldOut.summary``)."""

    metric: str
    allocations: list[Point]
    uniforms: list[Point]
    spearman: float | None
    notes: list[str]
    held_out: str

    @property
    def points(self) -> list[Point]:
        return self.allocations + self.uniforms

    def to_dict(self) -> dict[str, Any]:
        return {
            "metric": self.metric,
            "score": score_name(self.metric),
            "spearman": self.spearman,
            "parts": PARTS,
            "held_out": self.held_out,
            "notes": self.notes,
            "allocations": [p.to_dict() for p in self.allocations],
            "uniform": [p.to_dict() for p in self.uniforms],
        }


def score_name(metric: str) -> str:
    """How a score is called on a page: ``1 − cosine``, ``KL``."""
    return {"cosine": "1 − cosine", "kl": "KL", "spearman": "1 − spearman", "top1_agreement": "1 − top-1"}.get(
        metric, f"{metric} above float"
    )


def frontier(
    held_out: HeldOut,
    scores: Scores,
    options: Options,
    groups: Sequence[tuple[str, list[str]]],
    sizes: LayerSizes,
    budgets: Sequence[Budget],
    progress: Callable[[int, int, str], None] | None = None,
) -> Frontier:
    """Every budget's allocation and every uniform scheme, measured end to end on both parts of
    ``held_out``; Spearman and ``parting`` compare the prediction with the measuring part's figure."""
    notes = []
    planned = [allocate(options, groups, sizes, budget) for budget in budgets]
    for point in planned:
        if point.unconstrained:
            notes.append(
                f"{point.name} is above what every layer's best option takes ({point.bits_per_weight:.4g} bits per "
                "weight): each layer takes its best"
            )
    schemes = dict.fromkeys(scheme for found in options.values() for scheme in found)
    every = [p for p in (uniform(options, sizes, s) for s in schemes) if p is not None]
    measured = []
    for index, point in enumerate(planned + every):
        if progress is not None:
            progress(index, len(planned) + len(every), f"measuring {point.name}")
        measured.append(measure(point, held_out, scores))
    if progress is not None:
        progress(len(measured), len(measured), "measured")
    allocations, uniforms = measured[: len(planned)], measured[len(planned) :]
    correlation = rank_correlation(measured)
    notes += parting(measured, scores.metric)
    return Frontier(scores.metric, allocations, uniforms, correlation, notes, held_out.summary())


def rank_correlation(points: Sequence[Point]) -> float | None:
    """Spearman's rank correlation of predicted (scoring part) and measured (measuring part)
    damage (None under three points or when either side is constant)."""
    from scipy.stats import spearmanr

    pairs = [(p.predicted, p.measured_score) for p in points if p.measured_score is not None]
    if len(pairs) < 3:
        return None
    value = spearmanr([a for a, _ in pairs], [b for _, b in pairs]).statistic
    return None if value is None or math.isnan(value) else float(value)


def parting(points: Sequence[Point], metric: str) -> list[str]:
    """Where prediction (the scores, on the scoring part) and measurement (on the measuring part)
    part: a point measured beyond ``PART_RATIO`` times its prediction either way, with why (see
    ``_why``), and pairs of points the two put in opposite orders."""
    name = score_name(metric)
    notes = []
    for p in points:
        if p.measured_score is None or p.predicted <= 0 or p.measured_score <= 0:
            continue
        ratio = p.measured_score / p.predicted
        if ratio > PART_RATIO or ratio < 1 / PART_RATIO:
            in_sample = None if p.in_sample_score is None else p.in_sample_score / p.predicted
            notes.append(
                f"{p.name}: measured {name} {p.measured_score:.4g} on the measuring part against {p.predicted:.4g} "
                f"predicted from the scoring part ({ratio:.2f}×): {_why(ratio, in_sample)}"
            )
    ordered = sorted((p for p in points if p.measured_score is not None), key=lambda p: p.predicted)
    for a, b in zip(ordered, ordered[1:], strict=False):
        if b.predicted > a.predicted and b.measured_score < a.measured_score:
            notes.append(f"{a.name} and {b.name}: predicted in one order, measured on the measuring part in the other")
    return notes


def _why(ratio: float, in_sample: float | None) -> str:
    """Why a measurement parts from its prediction by ``ratio``, from the in-sample figure's ratio
    to the prediction (None: not measured there): when the scoring part parts the same way, the
    layers' damages do not add (they compound, or partly cancel); when it does not, the layers'
    damages add on the text they were scored on and the other text is what differs."""
    higher = ratio > 1
    words = "the layers' damages compound rather than add" if higher else "the layers' damages partly cancel"
    if in_sample is None:
        return words
    if in_sample > PART_RATIO if higher else in_sample < 1 / PART_RATIO:
        return f"{words} ({in_sample:.2f}× on the scoring part too)"
    return (
        f"on the scoring part it is {in_sample:.2f}× the prediction, so the measuring part's text is hurt "
        f"{'more' if higher else 'less'} than the text the layers were scored on"
    )


def scheme_counts(point: Point, sizes: LayerSizes) -> Mapping[str, float]:
    """Share of the chosen layers' weights each scheme takes in ``point``."""
    counts: dict[str, float] = {}
    for choice in point.choices:
        rows, columns = sizes.shapes[choice.layer]
        counts[choice.scheme] = counts.get(choice.scheme, 0.0) + rows * columns / sizes.weights
    return counts
