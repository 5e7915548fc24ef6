"""Score every (layer, scheme, observer): the model's own loss on the held-out text's scoring part
(``lab.allocate.held_out``; the frontier is measured on the other part) with that layer alone
quantized, its weight by the observer and, when the scheme has them, its inputs too (by the
observer the run's ranking rule picks, or at run time for a dynamic input).

Each quantizing scheme is an ``analyse`` run over the chosen layers' weights (every observer once
per layer and scheme) and one over their inputs; each score is one ``EffectRunner`` run from the
layer's block (the float hidden states at every block boundary are cached), and observers whose
quantized layer is the same (same qparams) share a run (``lab.effect.sensitivity.quant_digest``);
a layer's observers run together, their hidden states stacked (``EffectRunner.run_stacked``).
The score is the damage in the metric that ranks (``lab.results.damage``, the
sensitivity heatmap's rule): KL of next-token distributions for a decoder, 1 − embedding cosine for
an encoder; lower is better for every metric.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

import pandas as pd

from lab.allocate.held_out import HeldOut
from lab.allocate.schemes import Scheme
from lab.analyse.analysis import Analysis
from lab.analyse.run_config import RunConfig
from lab.effect.evaluate import ChoiceSet, Evaluator, check_applies, from_analysis
from lab.effect.sensitivity import quant_digest
from lab.results import choose, damage, usable_observers
from lab.vocab import DEFAULT_METRIC

ProgressFn = Callable[[int, int, str], None]
STACKED = 8
"""Observers of one layer run together at most (their hidden states stacked along the batch)."""
Analyse = Callable[[Scheme, RunConfig, Sequence[str]], Analysis]
"""How a run is analysed (the CLI's and the app's ``analyse`` with their progress and cache)."""


@dataclass
class Scores:
    """One row per (layer, scheme, observer) in ``frame``: ``score`` (the damage in ``metric``),
    every model-level metric, the input's observer (None without one) and the block its run
    started at, all on the held-out text's scoring part (the damage against the float model there).
    ``analyses``: each quantizing scheme's analyses (its weights, then its inputs), whose qparams
    the allocation's exports and end-to-end runs take."""

    frame: pd.DataFrame
    metric: str
    analyses: dict[str, list[Analysis]]
    runs: int
    unique_runs: int
    seconds: float

    def best(self) -> pd.DataFrame:
        """Per (layer, scheme): the observer that damages the model least, and its score."""
        ordered = self.frame.sort_values("score", kind="stable")
        return ordered.groupby(["layer", "scheme"], sort=False).head(1).reset_index(drop=True)


def _input_choice(inputs: Analysis | None, layer: str) -> str | None:
    """The observer a layer's input is quantized with (the run's ranking rule), None without one."""
    if inputs is None:
        return None
    chosen = choose(inputs, DEFAULT_METRIC).get((layer, "input"))
    if chosen is None:
        raise ValueError(f"{layer} input: no observer gave qparams, so its scheme cannot be scored")
    return chosen


def part_configs(base: RunConfig, scheme: Scheme) -> list[RunConfig]:
    """The runs a scheme takes: its weights with the base's observers (or every applicable one),
    and its inputs when it has them, with their applicable observers, or min-max alone for a
    dynamic input, whose static qparams only give NVFP4 its global scale."""
    configs = [replace(base, specs={"weight": scheme.weight})]
    if scheme.input is not None:
        observers = ("minmax",) if scheme.input.dynamic else None
        configs.append(replace(base, specs={"input": scheme.input}, observers=observers, knobs={}))
    return configs


def score(
    held_out: HeldOut,
    layers: Mapping[str, Sequence[str]],
    schemes: Sequence[Scheme],
    base: RunConfig,
    run_analysis: Analyse,
    *,
    metric: str | None = None,
    progress: ProgressFn | None = None,
) -> Scores:
    """Analyse each quantizing scheme's layers (``layers[scheme.name]``: those the checkpoint can
    store under it) with ``run_analysis(scheme, config, layers)`` for each of ``part_configs(base,
    scheme)`` (the calibration settings are the base's), then score every observer that gave
    qparams on each layer, on ``held_out.scoring`` only: the measuring part is kept for the
    frontier. A scheme that gives no qparams on any of its layers is a ``ValueError`` naming it."""
    evaluator = held_out.scoring
    metric = metric or evaluator.default_metric
    if metric not in evaluator.metric_names:
        raise ValueError(
            f"{metric!r} is not a metric of a {evaluator.kind}; choose from {', '.join(evaluator.metric_names)}"
        )
    start_time = time.perf_counter()
    quantizing = [scheme for scheme in schemes if not scheme.dense]
    analyses: dict[str, list[Analysis]] = {}
    for index, scheme in enumerate(quantizing):
        if progress is not None:
            progress(index, len(quantizing), f"analysing {scheme.name}")
        mine = layers[scheme.name]
        analyses[scheme.name] = [run_analysis(scheme, config, mine) for config in part_configs(base, scheme)]
    jobs = []
    for scheme in quantizing:
        weights, *inputs = analyses[scheme.name]
        analysed = set(weights.keys())
        found = [
            (scheme, layer, observer, _input_choice(inputs[0] if inputs else None, layer))
            for layer in layers[scheme.name]
            if (layer, "weight") in analysed
            for observer in usable_observers(weights.entry(layer, "weight"))
        ]
        if not found:
            raise ValueError(f"scheme {scheme.name} applies to no chosen layer: {_why_not(weights)}")
        jobs += found
    floats = evaluator.float_metrics()
    planned: dict[tuple, dict] = {}  # a distinct quantized layer: its tensors, run once
    keyed, checked = [], set()
    for scheme, layer, observer, input_observer in jobs:
        one = quantized(analyses[scheme.name], layer, observer, input_observer, f"{layer} {scheme.name} {observer}")
        if layer not in checked:
            check_applies(one, evaluator.model)
            checked.add(layer)
        digest = quant_digest(analyses[scheme.name][0].entry(layer, "weight"), one.tensors[(layer, "weight")])
        key = (scheme.name, layer, input_observer, digest)
        planned.setdefault(key, one.tensors)
        keyed.append(key)
    done = _run_all(evaluator, planned, progress)
    rows = []
    for (scheme, layer, observer, input_observer), key in zip(jobs, keyed, strict=True):
        values = done[key]
        rows.append(
            {
                "layer": layer,
                "scheme": scheme.name,
                "observer": observer,
                "input_observer": input_observer,
                "score": damage(metric, values[metric], floats[metric]),
                **values,
            }
        )
    frame = pd.DataFrame(rows)
    return Scores(frame, metric, analyses, len(jobs), len(done), time.perf_counter() - start_time)


def _run_all(evaluator: Evaluator, planned: dict[tuple, dict], progress: ProgressFn | None) -> dict[tuple, dict]:
    """Every distinct quantized layer's model-level metrics: a (scheme, layer)'s observers run
    together, ``STACKED`` at a time (``EffectRunner.run_stacked``)."""
    by_layer: dict[tuple, list[tuple]] = {}
    for key in planned:
        by_layer.setdefault(key[:2], []).append(key)
    done: dict[tuple, dict] = {}
    for keys in by_layer.values():
        for first in range(0, len(keys), STACKED):
            chunk = keys[first : first + STACKED]
            if progress is not None:
                progress(len(done), len(planned), f"{chunk[0][1]} · {chunk[0][0]} · {len(chunk)} observer(s)")
            metrics, start = evaluator.stacked_metrics([planned[key] for key in chunk])
            done |= {key: found | {"first_block": start} for key, found in zip(chunk, metrics, strict=True)}
    if progress is not None:
        progress(len(planned), len(planned), "scored")
    return done


def quantized(parts: Sequence[Analysis], layer: str, observer: str, input_observer: str | None, name: str) -> ChoiceSet:
    """A layer under a scheme (its analyses: weights, then inputs): its weight by ``observer``,
    its input by ``input_observer`` (at run time for a dynamic input)."""
    weights, *inputs = parts
    chosen = from_analysis(weights, {(layer, "weight"): observer}, name)
    if input_observer is None:
        return chosen
    given = from_analysis(inputs[0], {(layer, "input"): input_observer}, name)
    return ChoiceSet(name, chosen.tensors | given.tensors, chosen.observers | given.observers)


def _why_not(analysis: Analysis) -> str:
    errors = {r.error for e in analysis.entries if e.tensor == "weight" for r in e.results if r.error}
    return "; ".join(sorted(errors)[:2]) or "no observer gave qparams"
