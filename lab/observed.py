"""The tensors ``lab.pipeline.analyse`` observes, derived from what it read and captured: the
views through a transform (``observers.transforms``), the per-column importance that activation
order and some weight observers take, which captured tensors are the same, and a split
calibration's whole shape. Each merges across
ranks that split the calibration batches (``lab.distributed``), so every rank derives the same."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

import observers as ob
from lab.distributed import Ranks
from lab.vocab import KV_TENSORS
from observers.shared import Op

if TYPE_CHECKING:
    from lab.pipeline import RunConfig


def smooths(config: RunConfig) -> bool:
    """SmoothQuant finds its scales from the inputs and the weight: both are read for every layer."""
    return config.transform is not None and config.transform.kind == ob.TransformKind.SMOOTHQUANT


def transformed(
    config: RunConfig,
    layers: Sequence[str],
    weights: dict[str, torch.Tensor],
    activations: dict[tuple[str, str], torch.Tensor],
    ranks: Ranks,
) -> tuple[dict[str, torch.Tensor], dict[tuple[str, str], torch.Tensor], list[str]]:
    """Weights, inputs and key/value states as the rotated or smoothed model sees them
    (``observers.transforms``); a layer's output is the float output, which no transform changes."""
    transform, notes = config.transform, []
    across = ranks.reduce if ranks.world_size > 1 else None
    weights, activations = dict(weights), dict(activations)
    for layer in layers:
        inputs = activations.get((layer, "input"))
        weight, inputs = ob.transform_layer(transform, weights.get(layer), inputs, across)
        if weight is not None and layer in weights:
            weights[layer] = weight
        if inputs is not None:
            activations[(layer, "input")] = inputs
    for key in [key for key in activations if key[1] in KV_TENSORS]:
        if transform.kind == ob.TransformKind.HADAMARD:
            activations[key] = ob.transform_states(transform, activations[key])
        else:
            notes.append(f"{key[0]}: SmoothQuant does not apply to key/value states; they are shown as captured")
    return weights, activations, sorted(set(notes))


def identical_activations(
    activations: dict[tuple[str, str], torch.Tensor], ranks: Ranks
) -> dict[tuple[str, str], tuple[str, str]]:
    """``{key: earlier key}`` for each captured tensor that holds exactly the values of an
    earlier one of the same kind (the query, key and value projections of an attention block
    read one hidden state): ``analyse`` keys results by the earlier one, so identical tensors
    are observed once. A fingerprint (shape, sum, ends) picks candidates; ``torch.equal`` decides.
    Not when ranks split the batches: each rank sees only its part, and the ranks would have to
    agree before running collectives on a different set of tensors."""
    if ranks.world_size > 1:
        return {}
    seen: dict[tuple, list[tuple[str, str]]] = {}
    same: dict[tuple[str, str], tuple[str, str]] = {}
    for key, data in activations.items():
        if data.numel() == 0:
            continue
        flat = data.reshape(-1)
        fingerprint = (key[1], tuple(data.shape), data.dtype, float(flat.sum()), float(flat[0]), float(flat[-1]))
        candidates = seen.setdefault(fingerprint, [])
        match = next((other for other in candidates if torch.equal(activations[other], data)), None)
        if match is None:
            candidates.append(key)
        else:
            same[key] = match
    return same


def g_idx_for(config: RunConfig, spec: ob.QuantSpec, importance: torch.Tensor | None) -> torch.Tensor | None:
    if not config.actorder or spec.strategy != "group" or spec.format.is_block or importance is None:
        return None
    return ob.activation_order_g_idx(importance, spec.group_size)


INPUT_STATISTICS = {
    "importance": ob.column_importance,
    "hessian": ob.local_hessian,
}
"""Observer knobs filled from a layer's captured inputs when the person left them empty: the mean
squared input per column (``imatrix_mse``, activation order) and the per-block input Hessian
(``local_hessian``); each takes ``across`` to merge over ranks that split the batches."""


def input_statistics(
    layers: Sequence[str], activations: dict[tuple[str, str], torch.Tensor], config: RunConfig, ranks: Ranks
) -> dict[str, dict[str, torch.Tensor]]:
    """``{layer: {knob: tensor}}`` of the ``INPUT_STATISTICS`` this run's weight observers (or
    activation order) take, from each layer's captured inputs; merged over the ranks when they
    split the batches, on every rank (each is a collective). A statistic a layer's shape does not
    allow (a Hessian block that does not divide its inputs) is left out: the observer says so."""
    if "weight" not in config.specs:
        return {}
    names = [name for name in config.observers_for("weight") if name in ob.available()]
    taken = {knob for name in names for knob in ob.knobs(name)}
    wanted = [knob for knob in INPUT_STATISTICS if knob in taken or (knob == "importance" and config.actorder)]
    across = ranks.reduce if ranks.world_size > 1 else None
    found: dict[str, dict[str, torch.Tensor]] = {}
    for layer in layers if wanted else ():
        inputs = activations.get((layer, "input"))
        tokens = 0 if inputs is None else inputs.shape[0]
        if across is not None and inputs is not None:
            tokens = int(across(torch.tensor([tokens], device=inputs.device), Op.SUM))
        if not tokens:
            continue
        found[layer] = {}
        for knob in wanted:
            try:
                found[layer][knob] = INPUT_STATISTICS[knob](inputs, across=across)
            except ValueError:  # the same on every rank: it depends on the shape only
                continue
    return found


def total_shape(tensor: str, data: torch.Tensor, ranks: Ranks) -> tuple[int, ...]:
    """The shape of a captured tensor with every rank's tokens (dim 2 of key/value states)."""
    axis = 2 if tensor in KV_TENSORS else 0
    shape = list(data.shape)
    shape[axis] = int(ranks.reduce(torch.tensor([shape[axis]], device=data.device), Op.SUM))
    return tuple(shape)
