"""One layer's weight observers under GPTQ: for each observer's qparams, the layer-output error and
the clipped share of round-to-nearest and of GPTQ (``observers.gptq_quantize``) on the calibration
inputs behind the layer's Hessian.

The error is the relative ``‖WX − ŴX‖²`` GPTQ minimises, from the Hessian alone
(``observers.layer_output_error``); the clipped share is the lab's ``clip_ratio`` rule, of the
original weight for round-to-nearest and of the error-updated weights for GPTQ (what fixed scales
cut off). With ``fixed`` scales an observer's qparams on the whole weight go in as they are; with
``refit`` the observer runs again on each group as the sweep reaches it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

import observers as ob
from observers.suite import SuiteResult


@dataclass(frozen=True)
class GPTQRow:
    """One observer on one layer under GPTQ (``error`` says why there is nothing else)."""

    observer: str
    rtn_error: float | None = None
    gptq_error: float | None = None
    rtn_clipped: float | None = None
    gptq_clipped: float | None = None
    fallback: bool = False
    notes: tuple[str, ...] = ()
    error: str | None = None


def gptq_rows(
    results: list[SuiteResult],
    weight: torch.Tensor,
    hessian: torch.Tensor | None,
    spec: ob.QuantSpec,
    gptq: ob.GPTQSpec,
    knobs: dict[str, dict[str, Any]],
) -> list[GPTQRow]:
    """A row per weight observer that gave qparams (``results``, the observers' results on
    ``weight``), GPTQ with ``gptq``'s knobs and scale semantics; ``hessian`` is None when no
    calibration token reached the layer. ``knobs`` are the run's knobs per observer (a refit runs
    the observer with them)."""
    rows, layer = [], _Layer(weight, hessian) if hessian is not None else None
    for result in results:
        if result.qparams is None:
            rows.append(GPTQRow(result.name, error=result.error or "no qparams"))
        elif layer is None:
            rows.append(GPTQRow(result.name, error="no calibration token reached this layer: no Hessian"))
        else:
            rows.append(_row(result, layer, spec, gptq, knobs.get(result.name, {})))
    return rows


class _Layer:
    """What every observer's GPTQ on one layer shares: the weight and Hessian, ``‖WX‖²`` (the
    errors' reference) and the inverse factors per order (``gptq_quantize``'s ``factors``)."""

    def __init__(self, weight: torch.Tensor, hessian: torch.Tensor) -> None:
        self.weight, self.hessian = weight, hessian
        self.energy = ob.gptq.output_energy(weight, hessian)
        self.factors: dict = {}

    def error(self, approx: torch.Tensor) -> float:
        return ob.layer_output_error(self.weight, approx, self.hessian, self.energy)


def _row(result: SuiteResult, layer: _Layer, spec: ob.QuantSpec, gptq: ob.GPTQSpec, knobs) -> GPTQRow:
    weight = layer.weight

    def observe(tensor: torch.Tensor) -> ob.QParams:
        if gptq.scales == "fixed" and tensor.shape == weight.shape and torch.equal(tensor, weight):
            return result.qparams  # the observer's qparams on the original weight, as computed
        found = ob.run_one(result.name, tensor, spec, "weight", **knobs)
        if found.qparams is None:
            raise ValueError(f"{result.name} gave no qparams on a group: {found.error}")
        return found.qparams

    try:
        done = ob.gptq_quantize(weight, layer.hessian, spec, observe, factors=layer.factors, **gptq.kwargs())
    except ValueError as err:
        return GPTQRow(result.name, error=str(err))
    return GPTQRow(
        result.name,
        rtn_error=layer.error(ob.fake_quantize(weight.float(), result.qparams, spec)),
        gptq_error=layer.error(done.weight),
        rtn_clipped=result.metrics.get("clip_ratio"),
        gptq_clipped=done.clip_ratio,
        fallback=done.fallback,
        notes=done.notes,
    )
