"""What ``lab.analyse.pipeline.analyse`` derives beside the observers: a weight as a transform shows it
(``observers.transforms``; activations get their view in ``lab.calibrate.activations``), and the statistics
of a layer's inputs that activation order and some weight observers take (``INPUT_STATISTICS``,
summed over every calibration token by ``lab.calibrate.stream``)."""

from __future__ import annotations

import torch

import observers as ob
from lab.analyse.run_config import RunConfig


def smooths(config: RunConfig) -> bool:
    """SmoothQuant finds its scales from the inputs and the weight: both are read for every layer."""
    return config.transform is not None and config.transform.kind == ob.TransformKind.SMOOTHQUANT


def weight_view(config: RunConfig, weight: torch.Tensor, smoothing: torch.Tensor | None) -> torch.Tensor:
    """A layer's weight as the transformed model holds it: rotated (Hadamard), or scaled by the
    layer's SmoothQuant ``smoothing`` scales (found from its inputs, ``lab.calibrate.activations``)."""
    transform = config.transform
    if transform is None:
        return weight
    if transform.kind == ob.TransformKind.HADAMARD:
        return ob.transform_layer(transform, weight, None)[0]
    if smoothing is None:
        raise ValueError(
            "SmoothQuant migrates a layer's input columns into its weight, and this layer's inputs are not its "
            "weight's columns (an embedding's are token ids): leave it out of the layers"
        )
    return weight.float() * smoothing


def g_idx_for(config: RunConfig, spec: ob.QuantSpec, importance: torch.Tensor | None) -> torch.Tensor | None:
    if not config.actorder or spec.strategy != "group" or spec.format.is_block or importance is None:
        return None
    return ob.activation_order_g_idx(importance, spec.group_size)


INPUT_STATISTICS = {
    "importance": ob.column_importance,
    "hessian": ob.local_hessian,
    "gptq_hessian": ob.hessian_of_rows,
}
"""Observer knobs filled from a layer's inputs when the person left them empty: the mean squared
input per column (``imatrix_mse``, activation order) and the per-block input Hessian
(``local_hessian``); and GPTQ's whole input Hessian ``2/n Σ xxᵀ`` (``lab.gptq``), no observer's
knob. Each is a mean over tokens, so ``lab.calibrate.stream.MeanStatistic`` sums it batch by
batch and merges it across ranks."""


def wanted_statistics(config: RunConfig) -> list[str]:
    """The ``INPUT_STATISTICS`` this run's weight observers (or activation order, or GPTQ) take."""
    if "weight" not in config.specs:
        return []
    names = [name for name in config.observers_for("weight") if name in ob.available()]
    taken = {knob for name in names for knob in ob.knobs(name)}
    asked = {"importance": config.actorder, "gptq_hessian": config.gptq is not None}
    return [knob for knob in INPUT_STATISTICS if knob in taken or asked.get(knob, False)]
