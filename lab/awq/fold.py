"""AWQ's scales folded into a model's weights: what a checkpoint holds after AWQ.

A mapping's scales multiply its balance layers' input columns (and an MoE router's) and divide its
smooth layer's outputs (a norm's weight; a linear's last rows and its bias), in float64 and cast
back, as llm-compressor writes them. Mappings fold in the order they were searched, so a layer two
mappings touch (``v_proj``: columns by the first, rows by the second) ends as llm-compressor
leaves it. ``fold_key`` folds one stored tensor at a time, as a checkpoint reads them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from lab.awq.mappings import Mapping


def fold_mapping(tensor: Callable[[str], torch.Tensor | None], mapping: Mapping, scales: torch.Tensor) -> None:
    """Fold one mapping's ``scales`` in place into the tensors ``tensor(key)`` gives (None: a tensor
    left as it is here, a smooth layer without a bias, or a key another call folds). Each product
    is taken in float64 with the tensor promoted inside it (no float64 copy of a 7B-wide layer
    beside the product's), then cast back."""
    wide = scales.double()
    with torch.no_grad():
        for name in mapping.balance + mapping.scaled:
            weight = tensor(f"{name}.weight")
            if weight is not None:
                weight.copy_((weight * wide.view(1, -1)).to(weight.dtype))
        weight = tensor(f"{mapping.smooth}.weight")
        if weight is not None and weight.dim() == 1:
            weight.copy_((weight / wide).to(weight.dtype))
        elif weight is not None:
            rows = weight[-wide.numel() :]
            rows.copy_((rows / wide.view(-1, 1)).to(rows.dtype))
        bias = tensor(f"{mapping.smooth}.bias")
        if bias is not None:
            bias.copy_((bias / wide).to(bias.dtype))


def folded_keys(mapping: Mapping) -> list[str]:
    """The stored keys folding ``mapping`` changes (by the names the lab lists layers under): the
    balance and scaled layers' weights, the smooth layer's weight and bias (a key the model may lack)."""
    weights = [f"{name}.weight" for name in mapping.balance + mapping.scaled]
    return [*weights, f"{mapping.smooth}.weight", f"{mapping.smooth}.bias"]


def fused_views(key: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """A stored tensor under the names the lab lists its layers by: a fused experts module's 3-D
    ``gate_up_proj`` ``(experts, 2·intermediate, hidden)`` as each expert's ``gate_proj.weight`` and
    ``up_proj.weight`` views, its ``down_proj`` as each expert's ``down_proj.weight`` (and their
    biases likewise); any other tensor as itself. Views: folding them folds the tensor."""
    prefix, _, leaf = key.rpartition(".")
    fused = {"gate_up_proj": 3, "down_proj": 3, "gate_up_proj_bias": 2, "down_proj_bias": 2}
    if fused.get(leaf) != tensor.dim():
        return {key: tensor}
    local = "bias" if leaf.endswith("_bias") else "weight"
    if leaf.startswith("down_proj"):
        return {f"{prefix}.{e}.down_proj.{local}": tensor[e] for e in range(tensor.shape[0])}
    half = tensor.shape[1] // 2
    views = {}
    for e in range(tensor.shape[0]):
        views[f"{prefix}.{e}.gate_proj.{local}"] = tensor[e, :half]
        views[f"{prefix}.{e}.up_proj.{local}"] = tensor[e, half:]
    return views


def fold_key(key: str, tensor: torch.Tensor, folds: Sequence[tuple[Mapping, torch.Tensor]]) -> torch.Tensor:
    """The stored tensor ``key`` after every ``(mapping, scales)`` of ``folds`` that touches it (or
    one of its experts, ``fused_views``), in their order (a copy; ``tensor`` itself when none does):
    what a checkpoint writes in its place, one tensor at a time."""
    names = fused_views(key, tensor)
    touching = [(mapping, scales) for mapping, scales in folds if set(folded_keys(mapping)) & set(names)]
    if not touching:
        return tensor
    changed = tensor.clone()
    views = fused_views(key, changed)
    for mapping, scales in touching:
        fold_mapping(views.get, mapping, scales)
    return changed
