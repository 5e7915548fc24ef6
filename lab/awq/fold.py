"""AWQ's scales folded into a model's weights: what a checkpoint holds after AWQ.

A mapping's scales multiply its balance layers' input columns (and an MoE router's) and divide its
smooth layer's outputs (a norm's weight; a linear's last rows and its bias), in float64 and cast
back, as llm-compressor writes them. Mappings fold in the order they were searched, so a layer two
mappings touch (``v_proj``: columns by the first, rows by the second) ends as llm-compressor
leaves it. ``folded`` gives only the tensors that change, read from the model's stored weights.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from lab.awq.mappings import Mapping
from lab.awq.search import MappingResult, Variant
from sample_models import Model


def fold_mapping(tensor: Callable[[str], torch.Tensor | None], mapping: Mapping, scales: torch.Tensor) -> None:
    """Fold one mapping's ``scales`` in place into the tensors ``tensor(key)`` gives (None: the
    model has no such tensor, a smooth layer without a bias)."""
    with torch.no_grad():
        for name in mapping.balance + mapping.scaled:
            weight = tensor(f"{name}.weight")
            weight.copy_((weight.double() * scales.view(1, -1)).to(weight.dtype))
        weight = tensor(f"{mapping.smooth}.weight")
        if weight.dim() == 1:
            weight.copy_((weight.double() / scales).to(weight.dtype))
        else:
            rows = weight[-scales.numel() :]
            rows.copy_((rows.double() / scales.view(-1, 1)).to(rows.dtype))
        bias = tensor(f"{mapping.smooth}.bias")
        if bias is not None:
            bias.copy_((bias.double() / scales).to(bias.dtype))


def folded(model: Model, results: Sequence[MappingResult], variant: Variant, observer: str) -> dict[str, torch.Tensor]:
    """``{stored key: tensor}`` of every weight and bias the chosen ``variant`` and ``observer``
    change, smoothed (``rtn`` changes nothing). A mapping that has no scales for them (the observer
    gave no qparams there) is refused in one line."""
    changed: dict[str, torch.Tensor] = {}
    if variant == Variant.RTN:
        return changed
    stored = set(model.stored_keys())

    def tensor(key: str) -> torch.Tensor | None:
        if key not in stored:
            return None
        if key not in changed:
            changed[key] = model.stored(key).clone()
        return changed[key]

    for result in results:
        scales = result.scales.get((variant, observer))
        if scales is None:
            raise ValueError(f"{result.mapping.name}: {observer} has no {variant} scales to fold")
        fold_mapping(tensor, result.mapping, scales)
    return changed
