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
along the batch, a few at a time (``EffectRunner.run_stacked``). A deployment holds its qparams,
not its weights: each balance layer's weight is made when its block runs and let go after it
(``TensorQuant.made``), so a stacked pass holds a block's deployed weights, not a model's (26 GB
for a 7B model's).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from functools import partial

import pandas as pd
import torch

from lab.allocator import large_blocks_mapped
from lab.awq import candidates, deploy, observed
from lab.awq.candidates import Candidate
from lab.awq.run import AWQRun
from lab.awq.search import Variant
from lab.effect.evaluate import Evaluator
from sample_models import Model
from sample_models.effect import TensorQuant
from sample_models.sequential import return_freed_memory

STACKED_VARIANTS = 8
"""The most quantizations run in one stacked pass over the held-out batches."""

STACKED_BYTES = 1 << 30
"""The most bytes of deployed weights those quantizations hold together: each holds its balance
layers of the block being run (0.8 GB for a 7B-wide block), so a wide model runs fewer at a time."""


def variant_deployment(model: Model, run: AWQRun, variant: Variant, observer: str) -> deploy.AWQDeploy | None:
    """The deployment of ``observer`` on every mapping under ``variant`` (``deploy.of_run``: its
    qparams on the folded weights, no weight held). None when the observer has no row there on some
    mapping, or gives no qparams on a folded weight."""
    if any((variant, observer) not in result.qparams for result in run.results):
        return None
    try:
        return deploy.of_run(model, run, variant, {r.mapping.name: observer for r in run.results})
    except ValueError:
        return None


def variant_weights(model: Model, run: AWQRun, variant: Variant, observer: str) -> dict[str, torch.Tensor] | None:
    """Every balance layer's weight as ``variant_deployment``'s model computes it, in the model's
    own coordinates (``AWQDeploy.model_weights``), all at once: what a comparison reads, where the
    effect makes one block's at a time. None where there is no deployment."""
    deployed = variant_deployment(model, run, variant, observer)
    return None if deployed is None else deployed.model_weights(model)


@large_blocks_mapped()
def model_effect(
    model: Model, run: AWQRun, evaluator: Evaluator, variants: Sequence[Variant] = tuple(Variant)
) -> pd.DataFrame:
    """One row per (observer, variant) with the evaluator's metrics; a pair without a row on some
    mapping is left out. Balance layers the effect runner cannot quantize are one ``ValueError``
    (a fused MoE's experts run inside their fused module, ``EffectRunner``). The pairs' weights are
    made as they are run, ``STACKED_VARIANTS`` distinct ones held at a time, fewer where they would
    hold more than ``STACKED_BYTES`` (one at least). Its large blocks (a layer's folded, quantized
    and divided weights, some in float64) are mapped for themselves and handed back when freed
    (``lab.allocator.large_blocks_mapped``): in the CLI's heap, which keeps freed blocks, they left
    8 GB resident for 1.5 GB live at a 7B-wide block."""
    keys: list[tuple[str, Variant, str]] = []
    waiting: dict[str, dict] = {}
    metrics: dict[str, dict[str, float]] = {}

    def measure() -> None:
        found, _ = evaluator.stacked_metrics(list(waiting.values()))
        metrics.update(zip(waiting, found, strict=True))
        waiting.clear()
        return_freed_memory()  # a 7B-wide block's deployment is 0.8 GB: the next is made in the memory this one held

    made: dict[tuple, str] = {}
    for observer in run.observers:
        for variant in variants:
            deployment = _deployment(run, variant, observer)
            if deployment in made:
                keys.append((observer, variant, made[deployment]))
                continue
            deployed = variant_deployment(model, run, variant, observer)
            if deployed is None:
                continue
            quantization = _made_when_run(model, run, deployed)
            if not keys:
                _check(evaluator, quantization)
            key = made[deployment] = _digest(quantization)
            keys.append((observer, variant, key))
            if key not in metrics and key not in waiting:
                waiting[key] = quantization
            if len(waiting) >= _stacked(model, deployed, evaluator):
                measure()
    if waiting:
        measure()
    rows = [{"observer": observer, "variant": str(variant), **metrics[key]} for observer, variant, key in keys]
    return pd.DataFrame(rows, columns=["observer", "variant", *evaluator.metric_names])


def _made_when_run(model: Model, run: AWQRun, deployed: deploy.AWQDeploy) -> dict[tuple[str, str], TensorQuant]:
    """Each balance layer's deployed weight as a quantization of the runner, made when its layer
    runs (``AWQDeploy.model_weight``)."""
    stored = deploy.StoredByLayer(model)
    return {
        (name, "weight"): TensorQuant(run.spec, None, made=partial(deployed.model_weight, stored, name))
        for name in deployed.balance_layers()
    }


def _stacked(model: Model, deployed: deploy.AWQDeploy, evaluator: Evaluator) -> int:
    """How many deployments like this one a stacked pass holds: ``STACKED_VARIANTS``, fewer where
    the deployed weights of one block would pass ``STACKED_BYTES`` (a block's are made as it runs)."""
    size = torch.empty((), dtype=model.dtype).element_size()
    blocks: dict[int | None, int] = {}
    for name, shape in deployed.shapes.items():
        block = evaluator.runner.block_of(name)
        blocks[block] = blocks.get(block, 0) + math.prod(shape) * size
    held = max(blocks.values(), default=0)
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
    """The weights a quantization replaces (each made in turn and let go, ``_made_when_run``), in a
    few bytes: equal digests run the same model."""
    found = hashlib.sha1()
    for (name, _), quant in sorted(quantization.items()):
        found.update(name.encode())
        weight = quant.weight if quant.weight is not None else quant.made()
        found.update(weight.detach().float().cpu().contiguous().numpy().tobytes())
    return found.hexdigest()
