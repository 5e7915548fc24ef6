"""What an observer is run with on an AWQ candidate: the input statistics it takes, filled for the
smoothed inputs ``x/s`` (per-column importance, per-block Hessians), whether candidates stacked as
rows each get the qparams they get alone (``rowwise``, ``stackable``), and which observers agree on a
weight observed once (``once``), so twins search once. Pure functions of an observer's name, knobs
and a spec: the candidates (``lab.awq.candidates``) and the deployment (``lab.awq.deploy``) read
them alike."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

import observers as ob

INPUT_STATISTICS = ("importance", "hessian")
"""Observer knobs filled from the smoothed inputs, which differ per candidate."""

PER_WEIGHT_STATISTICS = ("importance",)


def scaled_blocks(blocks: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
    """Diagonal blocks ``(groups, size, size)`` of the inputs' second moment as the smoothed inputs
    ``x/s`` have them."""
    if scales is None:
        return blocks
    inverse = (1.0 / scales).reshape(blocks.shape[0], -1)
    return blocks * inverse.unsqueeze(2) * inverse.unsqueeze(1)


def statistic_knobs(
    observer: str, knobs: dict[str, Any], diagonal: torch.Tensor, blocks: Callable[[int], torch.Tensor], scales
) -> dict[str, Any]:
    """The observer's knobs with the input statistics it takes filled for the smoothed inputs
    ``x/s``, unless the person gave them: the mean square per column (``importance``, from the
    inputs' ``diagonal``) and the per-block second moment (``hessian``, from ``blocks(size)``, the
    inputs' diagonal blocks of that size). ``scales`` ``(n, in)`` (``n`` stacked candidates) give
    one importance row per candidate."""
    taken = ob.knobs(observer)
    filled = dict(knobs)
    inverse = None if scales is None else 1.0 / scales
    if "importance" in taken and filled.get("importance") is None:
        filled["importance"] = (diagonal if inverse is None else diagonal * inverse**2).float()
    if "hessian" in taken and filled.get("hessian") is None:
        size = hessian_block(observer, filled)
        filled["hessian"] = scaled_blocks(blocks(size), scales).float()
    return filled


def hessian_block(observer: str, knobs: dict[str, Any]) -> int:
    """The block size of the per-block Hessian ``observer`` takes with ``knobs``."""
    return int(knobs.get("block_size", ob.knobs(observer).get("block_size", 16)))


def observe(
    observer: str, weight: torch.Tensor, spec: ob.QuantSpec, knobs: dict[str, Any], apart: int = 1
) -> ob.QParams:
    """``observer``'s qparams of ``weight`` alone (``apart``: of the weights stacked in its rows,
    each as if alone): a search needs no error metrics of every candidate (``ob.run_one``
    measures them), and an observer that cannot run raises its ``ValueError``."""
    found = ob.create(observer, spec, "weight", **knobs)
    found.observe(weight, apart=apart)
    return found.qparams()


def rowwise(spec: ob.QuantSpec) -> bool:
    """Whether qparams are per row or per group of a row (group or channel scales without a global
    scale): candidates stacked as rows are then quantized, and clip-searched, each as alone."""
    return spec.strategy in ("group", "channel") and spec.format.scale_kind != "e4m3"


def stackable(observer: str, spec: ob.QuantSpec) -> bool:
    """Whether candidates stacked as rows get each the qparams it gets alone (``observe(apart=…)``:
    a shrink grid's early stop kept per candidate): ``rowwise`` qparams, and no knob filled from
    the inputs (those differ per candidate) but those taken one row per stacked weight."""
    taken = ob.knobs(observer)
    return rowwise(spec) and not any(k in taken for k in INPUT_STATISTICS if k not in PER_WEIGHT_STATISTICS)


def once(observer: str, knobs: dict[str, Any]) -> tuple[str, dict[str, Any], str]:
    """The observer and knobs that give ``observer``'s qparams of a weight observed once
    (``ob.once_form``: the min-max family are one, ``mse_grid_moving_average`` is ``mse_grid``),
    and a tag naming them with their knobs, so that twins are remembered as one. Knobs holding
    tensors keep the observer as it is, tagged by its own name."""
    if any(isinstance(value, torch.Tensor) for value in knobs.values()):
        return observer, knobs, observer
    once, given = ob.once_form(observer, knobs)
    return once, given, f"{once}{sorted(given.items())!r}"
