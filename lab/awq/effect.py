"""The model-level effect of each AWQ variant: for every weight observer and variant, every balance
layer of the run's mappings quantized as that variant deploys it (the other layers float), the
model's outputs on held-out text against the float model's (``lab.effect.evaluate``: KL, top-1
agreement, perplexity for a decoder).

The deployed model is the folded one with each balance layer's folded weight ``F`` quantized
(``lab.awq.deploy``, the same deployment a checkpoint writes, with one observer on every mapping);
it runs here in the model as loaded, each balance layer's weight replaced by
``diag(s_out)·Q(F)·diag(1/s_in)``, which on the unsmoothed inputs computes what ``Q(F)`` computes on
the smoothed ones (a test checks the outputs against the folded, quantized model). Pairs that deploy
the same weights (observers that agree, a variant that keeps llm-compressor's pick) run once, and
twin observers with the same picks (``_deployment``) are folded once; the distinct ones run stacked
along the batch, a few at a time (``EffectRunner.run_stacked``), made as they are run so that only
those few are held.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import pandas as pd
import torch

from lab.awq import candidates, deploy, observed
from lab.awq.candidates import Candidate
from lab.awq.run import AWQRun
from lab.awq.search import Variant
from lab.effect.evaluate import Evaluator
from sample_models import Model
from sample_models.effect import TensorQuant

STACKED_VARIANTS = 8
"""The most quantizations run in one stacked pass over the held-out batches."""

STACKED_BYTES = 1 << 30
"""The most bytes of deployed weights those quantizations hold together: each holds every balance
layer of the run (0.8 GB for one 7B-wide block), so a wide model runs fewer at a time."""


def variant_weights(model: Model, run: AWQRun, variant: Variant, observer: str) -> dict[str, torch.Tensor] | None:
    """Every balance layer's weight as the deployed model computes it with ``observer`` on every
    mapping under ``variant``, in the model's own coordinates (``AWQDeploy.model_weights``). None
    when the observer has no row there on some mapping, or gives no qparams on a folded weight."""
    if any((variant, observer) not in result.qparams for result in run.results):
        return None
    try:
        return deploy.weights_of_run(model, run, variant, {r.mapping.name: observer for r in run.results})
    except ValueError:
        return None


def model_effect(
    model: Model, run: AWQRun, evaluator: Evaluator, variants: Sequence[Variant] = tuple(Variant)
) -> pd.DataFrame:
    """One row per (observer, variant) with the evaluator's metrics; a pair without a row on some
    mapping is left out. Balance layers the effect runner cannot quantize are one ``ValueError``
    (a fused MoE's experts run inside their fused module, ``EffectRunner``). The pairs' weights are
    made as they are run, ``STACKED_VARIANTS`` distinct ones held at a time, fewer where they would
    hold more than ``STACKED_BYTES`` (one at least)."""
    keys: list[tuple[str, Variant, str]] = []
    waiting: dict[str, dict] = {}
    metrics: dict[str, dict[str, float]] = {}

    def measure() -> None:
        found, _ = evaluator.stacked_metrics(list(waiting.values()))
        metrics.update(zip(waiting, found, strict=True))
        waiting.clear()

    made: dict[tuple, str] = {}
    for observer in run.observers:
        for variant in variants:
            deployment = _deployment(run, variant, observer)
            if deployment in made:
                keys.append((observer, variant, made[deployment]))
                continue
            weights = variant_weights(model, run, variant, observer)
            if weights is None:
                continue
            quantization = {(name, "weight"): TensorQuant(run.spec, None, weight) for name, weight in weights.items()}
            if not keys:
                _check(evaluator, quantization)
            key = made[deployment] = _digest(quantization)
            keys.append((observer, variant, key))
            if key not in metrics and key not in waiting:
                waiting[key] = quantization
            if len(waiting) >= _stacked(quantization):
                measure()
    if waiting:
        measure()
    rows = [{"observer": observer, "variant": str(variant), **metrics[key]} for observer, variant, key in keys]
    return pd.DataFrame(rows, columns=["observer", "variant", *evaluator.metric_names])


def _stacked(quantization: dict[tuple[str, str], TensorQuant]) -> int:
    """How many quantizations like this one a stacked pass holds: ``STACKED_VARIANTS``, fewer where
    their weights would pass ``STACKED_BYTES``."""
    held = sum(q.weight.numel() * q.weight.element_size() for q in quantization.values())
    return max(1, min(STACKED_VARIANTS, STACKED_BYTES // max(held, 1)))


def _deployment(run: AWQRun, variant: Variant, observer: str) -> tuple:
    """What decides the weights a pair deploys: the variant, the observer as it observes a weight
    once (twins are one, ``observed.once``) and each mapping's pick (its scales and qparams).
    Two pairs that agree on it deploy the same weights, so only the first is folded."""
    tag = observed.once(observer, run.observers.get(observer, {}))[2]
    picks = tuple(
        candidates.digest(Candidate(r.scales.get((variant, observer)), r.qparams.get((variant, observer), {}), {}))
        for r in run.results
    )
    return variant, tag, picks


def _check(evaluator: Evaluator, quantization: dict) -> None:
    """Refuse, in one line, balance layers the model-level runner cannot quantize."""
    try:
        evaluator.runner.check(quantization)
    except ValueError as err:
        problems = [line.strip(" -") for line in str(err).splitlines()[1:]]
        more = f" and {len(problems) - 1} more" if len(problems) > 1 else ""
        raise ValueError(f"the model-level runner cannot quantize every balance layer: {problems[0]}{more}") from None


def _digest(quantization: dict[tuple[str, str], TensorQuant]) -> str:
    """The weights a quantization replaces (each given as a weight, ``variant_weights``), in a few
    bytes: equal digests run the same model."""
    found = hashlib.sha1()
    for (name, _), quant in sorted(quantization.items()):
        found.update(name.encode())
        found.update(quant.weight.detach().float().cpu().contiguous().numpy().tobytes())
    return found.hexdigest()
