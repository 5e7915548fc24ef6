"""Fused experts in a compressed checkpoint: each expert's projection packed as a 2-D weight of its
own, under the name transformers saves it by.

transformers 5 holds a mixture of experts' projections as fused 3-D parameters (``experts.
gate_up_proj``, ``experts.down_proj``) and converts a checkpoint's per-expert tensors into them when
it loads. compressed-tensors packs 2-D weights, and transformers' compressed-tensors loader
(``CompressedTensorsDequantize``) dequantizes packed per-expert tensors before that conversion merges
them; vLLM reads the same per-expert layout. So a fused tensor whose projections were chosen is
written as ``save_pretrained`` writes it (``sample_models.layers.saved_expert_names``: Mixtral's
``block_sparse_moe.experts.<e>.w1``/``w3``/``w2``), each projection packed with its own qparams.

transformers decompresses every expert of a checkpoint with one config group's scheme (the group
whose ``re:`` targets name experts), so the experts' groups target them by ``re:`` and share one
weight scheme; a scheme its expert loader cannot read leaves the experts dense, with a note.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Collection
from dataclasses import replace
from typing import Any

import torch

from lab.export.compressed_tensors import CtLayer
from sample_models.layers import expert_of, expert_weight

Pending = dict[str, tuple[CtLayer, dict[str, Any]]]
Compress = Callable[[CtLayer, dict[str, Any], torch.Tensor], dict[str, torch.Tensor]]


UNPLACED = "transformers does not save these experts one projection per expert in a layout the lab can place"


def renamed_experts(saved_experts: dict[str, str], listed: Collection[str]) -> dict[str, str]:
    """The expert projections the model lists fused (``{view: saved name}``), which the checkpoint
    writes under their saved names; a model that stores them one per expert lists the saved names
    themselves, and writes them as stored."""
    return {view: saved for view, saved in saved_experts.items() if view in listed}


def saved_layers(layers: list[CtLayer], saved_names: dict[str, str], notes: list[str]) -> list[CtLayer]:
    """``layers`` with every expert projection renamed to the layer it is saved as; a projection
    without a saved name (``UNPLACED``) stays dense, with a note."""
    placed = []
    for layer in layers:
        if expert_of(layer.layer) is None:
            placed.append(layer)
        elif layer.layer in saved_names:
            placed.append(replace(layer, layer=saved_names[layer.layer]))
        else:
            notes.append(f"{layer.layer}: stays dense ({UNPLACED})")
    return placed


def expert_target(saved: str) -> str:
    """The config-group target of a saved expert layer: its exact name as an ``re:`` pattern."""
    return f"re:^{re.escape(saved)}$"


def target_experts(config_groups: dict[str, dict[str, Any]], saved_experts: set[str]) -> None:
    """Target the saved expert layers by exact ``re:`` patterns (how transformers finds the experts'
    group), and check that every expert shares one weight scheme. ValueError naming the schemes if not."""
    schemes = set()
    for group in config_groups.values():
        experts = [name for name in group["targets"] if name in saved_experts]
        if experts:
            schemes.add(json.dumps(group["weights"], sort_keys=True))
            group["targets"] = [expert_target(t) if t in saved_experts else t for t in group["targets"]]
    if len(schemes) > 1:
        raise ValueError(
            "the experts were chosen in different weight schemes; transformers loads every expert of a checkpoint "
            f"with one: {'; '.join(sorted(schemes))}"
        )


def dense_stored_experts_note(
    saved_experts: dict[str, str], listed: Collection[str], packed: Collection[str]
) -> str | None:
    """A note when the model stores its experts one projection per expert (listed under their saved
    names) and some stay dense in the checkpoint: transformers 5.23's compressed-tensors loader
    dequantizes every expert it merges and merges nothing from a dense one, so it cannot load such
    a checkpoint (vLLM reads it). None when there is nothing to say."""
    dense = [name for name in saved_experts.values() if name in listed and name not in packed]
    if not dense or not packed:
        return None
    return (
        f"{len(dense)} expert projection(s) stored one per expert stay dense ({dense[0]}, …): transformers 5.23 "
        "cannot load this checkpoint (its compressed-tensors loader merges only packed experts); vLLM reads it. "
        "Choose every expert to load it in transformers"
    )


def by_fused_tensor(saved_names: dict[str, str], pending: Pending) -> dict[str, list[tuple[str, int, str]]]:
    """``{fused stored key: [(saved layer, expert, projection)]}`` of the pending expert layers."""
    found: dict[str, list[tuple[str, int, str]]] = {}
    for view, saved in saved_names.items():
        if saved in pending:
            module, fused, expert, projection = expert_of(view)  # type: ignore[misc]
            found.setdefault(f"{module}.{fused}", []).append((saved, expert, projection))
    return found


def packed_experts(
    key: str, tensor: torch.Tensor, placed: list[tuple[str, int, str]], pending: Pending, compress: Compress
) -> dict[str, torch.Tensor]:
    """A fused tensor (``key``, as the checkpoint writes it: AWQ's scales folded) as its experts'
    packed projections, each under its saved name. Every projection of the tensor must be pending:
    the fused-group rule (``lab.runtime``) packs an experts module whole or not at all."""
    fused = key.rpartition(".")[2]
    expected = tensor.shape[0] * (2 if fused == "gate_up_proj" else 1)
    if len(placed) != expected:
        raise ValueError(f"{key}: {len(placed)} of its {expected} expert projections chosen; pack all or none")
    out: dict[str, torch.Tensor] = {}
    for saved, expert, projection in placed:
        layer, scheme = pending.pop(saved)
        weight = expert_weight({fused: tensor}, expert, projection)
        out |= {f"{saved}.{name}": value for name, value in compress(layer, scheme, weight).items()}
    return out
