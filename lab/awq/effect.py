"""The model-level effect of each AWQ variant: for every weight observer and variant, every balance
layer of the run's mappings quantized as that variant deploys it (the other layers float), the
model's outputs on held-out text against the float model's (``lab.effect.evaluate``: KL, top-1
agreement, perplexity for a decoder).

The deployed model is the folded one (``lab.awq.fold``) with each balance layer's folded weight
``F`` quantized; it runs here in the model as loaded, each balance layer's weight replaced by
``diag(s_out)·Q(F)·diag(1/s_in)``, which on the unsmoothed inputs computes what ``Q(F)`` computes on
the smoothed ones. ``Q(F)`` is computed on ``F`` itself, not on the search's ``W·s``: a layer that
is also a smooth layer (``up_proj``, ``v_proj``) has its rows divided by the next mapping's
scales, and a group's extreme that sat on a rounding tie may round the other way once divided (a
test checks the outputs against the folded, quantized model). All variants of all observers run
stacked along the batch, a few at a time (``EffectRunner.run_stacked``).
"""

from __future__ import annotations

from collections.abc import Sequence

import pandas as pd
import torch

import observers as ob
from lab.awq import candidates
from lab.awq.fold import folded
from lab.awq.run import AWQRun
from lab.awq.search import Variant
from lab.effect.evaluate import Evaluator
from sample_models import Model
from sample_models.effect import TensorQuant

STACKED_VARIANTS = 8
"""Quantizations run in one stacked pass over the held-out batches."""


def variant_weights(model: Model, run: AWQRun, variant: Variant, observer: str) -> dict[str, torch.Tensor] | None:
    """Every balance layer's weight as the deployed model computes it, in the model's own
    coordinates: the folded weight ``F`` (columns times its mapping's scales, rows divided by the
    scales of the mapping it smooths) quantized as the variant deploys it (the observer run on
    ``F``; the clip search's ranges scaled with the rows), then ``diag(s_out)·Q(F)·diag(1/s_in)``.
    None when the observer has no row there on some mapping, or takes a statistic (a per-block
    Hessian) the run does not keep."""
    if any((variant, observer) not in result.qparams for result in run.results):
        return None
    changed = folded(model, run.results, variant, observer)
    smooths = {r.mapping.smooth: r.scales[(variant, observer)] for r in run.results if (variant, observer) in r.scales}
    found: dict[str, torch.Tensor] = {}
    for result in run.results:
        s_in = result.scales.get((variant, observer))
        for name in result.mapping.balance:
            key = f"{name}.weight"
            weight = changed[key] if key in changed else model.weight(name)
            s_out = smooths.get(name)
            quantized = _quantized(weight, name, observer, run, result, variant, s_out)
            if quantized is None:
                return None
            wide = quantized.double()
            if s_out is not None:
                wide[-s_out.numel() :] *= s_out.view(-1, 1)
            found[name] = (wide if s_in is None else wide / s_in.view(1, -1)).to(weight.dtype)
    return found


def _quantized(weight, name: str, observer: str, run: AWQRun, result, variant: Variant, s_out) -> torch.Tensor | None:
    """``Q(F)`` as the variant deploys it: the clip search's qparams with their rows scaled as the
    weight's were, else the observer on ``F`` with its knobs (the input importance of ``x/s_in``)."""
    spec = run.spec
    if variant == Variant.CLIP_SEARCH:
        qp = result.qparams[(variant, observer)][name]
        if s_out is not None:
            rows = torch.ones(weight.shape[0], 1, dtype=torch.float64, device=weight.device)
            rows[-s_out.numel() :, 0] = 1.0 / s_out.to(rows.device)
            qp = ob.qparams.range_rule((qp.min_val * rows).float(), (qp.max_val * rows).float(), spec)
        return ob.fake_quantize(weight, qp, spec)
    knobs = dict(run.observers.get(observer, {}))
    taken = ob.knobs(observer)
    if "hessian" in taken and knobs.get("hessian") is None:
        return None
    if "importance" in taken and knobs.get("importance") is None:
        s_in = result.scales.get((variant, observer))
        knobs["importance"] = result.importance if s_in is None else (result.importance / s_in.square()).float()
    try:
        found = candidates.observe(observer, weight, spec, knobs)
    except ValueError:
        return None
    return ob.fake_quantize(weight, found, spec)


def model_effect(
    model: Model, run: AWQRun, evaluator: Evaluator, variants: Sequence[Variant] = tuple(Variant)
) -> pd.DataFrame:
    """One row per (observer, variant) with the evaluator's metrics; a pair without a row on some
    mapping is left out."""
    asked: list[tuple[str, Variant, dict]] = []
    for observer in run.observers:
        for variant in variants:
            weights = variant_weights(model, run, variant, observer)
            if weights is None:
                continue
            quantization = {(name, "weight"): TensorQuant(run.spec, None, weight) for name, weight in weights.items()}
            asked.append((observer, variant, quantization))
    rows = []
    for start in range(0, len(asked), STACKED_VARIANTS):
        part = asked[start : start + STACKED_VARIANTS]
        results = evaluator.runner.run_stacked([q for _, _, q in part])
        for (observer, variant, _), result in zip(part, results, strict=True):
            rows.append({"observer": observer, "variant": str(variant), **evaluator.metrics(result)})
    return pd.DataFrame(rows, columns=["observer", "variant", *evaluator.metric_names])
