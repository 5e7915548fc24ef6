"""The one form every deployment export reads: a chosen tensor with its spec, observer, knobs and
qparams. An analysis's choices (``of_analysis``) and a saved Observer Lab file (``of_lab_file``)
both become a list of ``Chosen``, so the compressed-tensors export, the llm-compressor recipe and
the compressed checkpoint give the same answer for the same choice, however it reached them."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

import observers as ob


@dataclass(frozen=True)
class Chosen:
    """One chosen tensor: ``tensor`` is a layer's ``weight``/``input``/``output`` or an attention
    block's ``k``/``v``."""

    layer: str
    tensor: str
    spec: ob.QuantSpec
    observer: str
    knobs: dict[str, Any] = field(default_factory=dict)
    qparams: ob.QParams | None = None
    g_idx: torch.Tensor | None = None
    """Activation order's group index, when the weight's columns were reordered."""


def of_analysis(selected: Sequence[tuple[Any, Any]]) -> list[Chosen]:
    """``lab.results.export_selection``'s ``(entry, served choice)`` pairs as ``Chosen``: the qparams a
    server runs (a fused group's shared scales)."""
    chosen = []
    for entry, served in selected:
        result = served.result
        knobs = dict(result.knobs)
        chosen.append(Chosen(entry.layer, entry.tensor, entry.spec, result.name, knobs, result.qparams, entry.g_idx))
    return chosen


def of_lab_file(entries: Iterable[Any]) -> list[Chosen]:
    """A loaded Observer Lab file's entries (``lab.export.lab_json.LabEntry``) as ``Chosen``."""
    return [
        Chosen(e.layer, e.tensor, e.spec, e.observer, dict(e.knobs), e.qparams, e.qparams.extras.get("g_idx"))
        for e in entries
    ]
